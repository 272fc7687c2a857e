//! The engine's allocator hook fed with pinned host memory.
//!
//! The pipeline assembles every micro-batch into a buffer its [`BatchAllocator`] hands out. On
//! the GPU path that buffer is page-locked ([`PinnedBuffer`], allocated portable so every
//! driver thread's context may copy from it), so the staging ring's host-to-device copy runs
//! asynchronously on the copy stream straight from the engine's buffer: no batch is copied
//! twice on the host.
//!
//! The adapter is generic ([`FnAllocator`] over any buffer type), so its logic (size checks,
//! error mapping, counting) is tested on CPU with `Vec<u8>`; [`pinned_allocator`] plugs in
//! the CUDA allocation.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cudarc::driver::{CudaContext, DriverError};
use pipeline::{BatchAllocator, HostBuffer, PipelineError};

use super::device::PinnedBuffer;

/// A [`PinnedBuffer`] as the engine's [`HostBuffer`].
#[derive(Debug)]
pub struct PinnedHostBuffer(pub PinnedBuffer);

impl HostBuffer for PinnedHostBuffer {
    fn as_slice(&self) -> &[u8] {
        self.0.as_slice()
    }
    fn as_mut_slice(&mut self) -> &mut [u8] {
        self.0.as_mut_slice()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// True when the engine assembled `buffer` in pinned memory (the copy is then asynchronous).
pub fn is_pinned(buffer: &dyn HostBuffer) -> bool {
    buffer.as_any().is::<PinnedHostBuffer>()
}

/// A [`BatchAllocator`] from an allocation function; counts what it allocated.
pub struct FnAllocator<F> {
    alloc: F,
    what: &'static str,
    buffers: AtomicUsize,
    bytes: AtomicUsize,
}

impl<F> FnAllocator<F> {
    /// Allocates with `alloc`; `what` names the memory in errors ("pinned host memory").
    pub fn new(what: &'static str, alloc: F) -> Self {
        FnAllocator {
            alloc,
            what,
            buffers: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
        }
    }

    /// Buffers and bytes handed out so far (the engine recycles buffers, so this stays small).
    pub fn allocated(&self) -> (usize, usize) {
        (
            self.buffers.load(Ordering::Relaxed),
            self.bytes.load(Ordering::Relaxed),
        )
    }
}

impl<F, B, E> BatchAllocator for FnAllocator<F>
where
    F: Fn(usize) -> Result<B, E> + Send + Sync,
    B: HostBuffer + 'static,
    E: std::error::Error + Send + Sync + 'static,
{
    fn allocate(&self, pixel_bytes: usize) -> Result<Box<dyn HostBuffer>, PipelineError> {
        let buffer = (self.alloc)(pixel_bytes).map_err(|e| PipelineError::Allocator {
            message: format!(
                "cannot allocate {pixel_bytes} bytes of {} for a batch (hint: a smaller --batch-size or --prefetch-depth)",
                self.what
            ),
            source: Some(Box::new(e)),
        })?;
        let got = buffer.as_slice().len();
        if got < pixel_bytes {
            // The pool checks this too; saying it here names the allocator at fault.
            return Err(PipelineError::Allocator {
                message: format!(
                    "{} allocator returned {got} bytes, a batch needs {pixel_bytes}",
                    self.what
                ),
                source: None,
            });
        }
        self.buffers.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(got, Ordering::Relaxed);
        Ok(Box::new(buffer))
    }
}

/// The engine's allocator for GPU training: portable pinned memory of `ctx`'s device.
pub fn pinned_allocator(
    ctx: Arc<CudaContext>,
) -> Arc<FnAllocator<impl Fn(usize) -> Result<PinnedHostBuffer, DriverError> + Send + Sync>> {
    Arc::new(FnAllocator::new("pinned host memory", move |bytes| {
        PinnedBuffer::new(&ctx, bytes).map(PinnedHostBuffer)
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("out of pinned memory")]
    struct NoMemory;

    #[test]
    fn hands_out_buffers_of_the_asked_size_and_counts_them() {
        let a = FnAllocator::new("test memory", |n| Ok::<_, NoMemory>(vec![7u8; n]));
        let b = a.allocate(48).unwrap();
        assert_eq!(b.as_slice().len(), 48);
        assert!(!is_pinned(b.as_ref()), "a Vec is not pinned memory");
        a.allocate(16).unwrap();
        assert_eq!(a.allocated(), (2, 64));
    }

    #[test]
    fn an_allocation_failure_is_an_allocator_error_with_a_hint_and_the_source() {
        let a = FnAllocator::new("pinned host memory", |_| Err::<Vec<u8>, _>(NoMemory));
        let Err(e) = a.allocate(1 << 20) else {
            panic!("must fail")
        };
        let text = e.to_string();
        assert!(
            text.contains("1048576 bytes of pinned host memory"),
            "{text}"
        );
        assert!(text.contains("--batch-size"), "{text}");
        assert!(std::error::Error::source(&e).is_some());
        assert_eq!(a.allocated(), (0, 0));
    }

    #[test]
    fn a_short_buffer_is_refused() {
        let a = FnAllocator::new("test memory", |n| Ok::<_, NoMemory>(vec![0u8; n / 2]));
        let Err(e) = a.allocate(10) else {
            panic!("must fail")
        };
        assert!(e.to_string().contains("returned 5 bytes"), "{e}");
    }

    #[test]
    fn the_engine_assembles_into_the_adapters_buffers() {
        let root = tempfile::tempdir().unwrap();
        let mut synth = pipeline::synth::SynthConfig::new(root.path().join("data"));
        synth.classes = 2;
        synth.train_per_class = 3;
        synth.valid_per_class = 1;
        synth.test_per_class = 0;
        synth.width = 16;
        synth.height = 16;
        pipeline::synth::write_dataset(&synth).unwrap();
        let alloc = Arc::new(FnAllocator::new("test memory", |n| {
            Ok::<_, NoMemory>(vec![0u8; n])
        }));
        let pipe = pipeline::PipelineBuilder::new(pipeline::DatasetSource::folder(
            root.path().join("data"),
        ))
        .image_size(16)
        .batch_size(2)
        .cache_dir(root.path().join("cache"))
        .allocator(alloc.clone())
        .build()
        .unwrap();
        let mut seen = 0;
        for batch in pipe.epoch(0, 0, 0).unwrap() {
            let batch = batch.unwrap();
            assert!(batch.buffer().as_any().is::<Vec<u8>>());
            seen += batch.len;
        }
        assert_eq!(seen, pipe.len());
        let (buffers, _) = alloc.allocated();
        assert!(buffers >= 1, "the engine used the hook");
    }
}
