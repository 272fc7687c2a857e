//! Caller-allocated batch buffers and the pool that recycles them.
//!
//! The trainer hands the engine an allocator of pinned host memory; batches are assembled
//! straight into those buffers and, when the consumer drops a batch, the buffer (with its label
//! and id vectors) goes back to the pool, so a steady state allocates nothing.

use std::sync::Arc;

use crate::PipelineError;

/// A host memory buffer a batch is assembled into.
pub trait HostBuffer: Send {
    /// The bytes.
    fn as_slice(&self) -> &[u8];
    /// The bytes, writable.
    fn as_mut_slice(&mut self) -> &mut [u8];
    /// For downcasting to the allocator's concrete type (e.g. a pinned buffer).
    fn as_any(&self) -> &dyn std::any::Any;
}

/// Allocates batch buffers; called only when the pool has no free buffer.
pub trait BatchAllocator: Send + Sync {
    /// A buffer of at least `pixel_bytes` bytes.
    fn allocate(&self, pixel_bytes: usize) -> Result<Box<dyn HostBuffer>, PipelineError>;
}

impl HostBuffer for Vec<u8> {
    fn as_slice(&self) -> &[u8] {
        self
    }
    fn as_mut_slice(&mut self) -> &mut [u8] {
        self
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// The default allocator: ordinary heap memory (`Vec<u8>`).
#[derive(Debug, Default, Clone, Copy)]
pub struct VecAllocator;

impl BatchAllocator for VecAllocator {
    fn allocate(&self, pixel_bytes: usize) -> Result<Box<dyn HostBuffer>, PipelineError> {
        Ok(Box::new(zeroed_vec(pixel_bytes)?))
    }
}

/// `len` zero bytes from the allocator's zeroed path (calloc): a large block comes from fresh
/// pages the kernel zeroes on first touch, so no memset runs over a buffer the decode
/// threads are about to overwrite (that memset cost ~3 % of a first epoch). A refused
/// allocation is an error value, not an abort.
fn zeroed_vec(len: usize) -> Result<Vec<u8>, PipelineError> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let refused =
        |source: Option<Box<dyn std::error::Error + Send + Sync>>| PipelineError::Allocator {
            message: format!(
                "cannot allocate a batch buffer of {}",
                crate::limits::human_bytes(len as u64)
            ),
            source,
        };
    let layout = std::alloc::Layout::array::<u8>(len).map_err(|e| refused(Some(Box::new(e))))?;
    // SAFETY: the layout's size is not zero.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(refused(None));
    }
    // SAFETY: `ptr` came from the global allocator with the layout of `[u8; len]`, and all
    // `len` bytes are initialised (zero); the Vec takes ownership of the allocation.
    Ok(unsafe { Vec::from_raw_parts(ptr, len, len) })
}

/// A buffer with its per-batch vectors, as kept in the pool.
pub(crate) struct Slot {
    pub(crate) pixels: Box<dyn HostBuffer>,
    pub(crate) labels: Vec<u32>,
    pub(crate) ids: Vec<u64>,
}

/// Free buffers of one size, shared by every epoch iterator of a pipeline (clones share them).
#[derive(Clone)]
pub(crate) struct BufferPool {
    allocator: Arc<dyn BatchAllocator>,
    pixel_bytes: usize,
    free_tx: flume::Sender<Slot>,
    free_rx: flume::Receiver<Slot>,
}

impl BufferPool {
    pub(crate) fn new(allocator: Arc<dyn BatchAllocator>, pixel_bytes: usize) -> Self {
        let (free_tx, free_rx) = flume::unbounded();
        Self {
            allocator,
            pixel_bytes,
            free_tx,
            free_rx,
        }
    }

    /// A free slot, or a new one from the allocator.
    pub(crate) fn take(&self) -> Result<Slot, PipelineError> {
        if let Ok(slot) = self.free_rx.try_recv() {
            return Ok(slot);
        }
        let pixels = self.allocator.allocate(self.pixel_bytes)?;
        let got = pixels.as_slice().len();
        if got < self.pixel_bytes {
            return Err(PipelineError::Allocator {
                message: format!(
                    "returned a buffer of {got} bytes; a batch needs {}",
                    self.pixel_bytes
                ),
                source: None,
            });
        }
        Ok(Slot {
            pixels,
            labels: Vec::new(),
            ids: Vec::new(),
        })
    }

    /// A handle batches use to give their slot back.
    pub(crate) fn returner(&self) -> flume::Sender<Slot> {
        self.free_tx.clone()
    }

    /// Slots currently free (for statistics and tests).
    pub(crate) fn free(&self) -> usize {
        self.free_rx.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vec_allocator_hands_out_zeroed_buffers_of_the_asked_size() {
        for len in [0, 1, 4095, 4096, 3 << 20] {
            let mut buffer = VecAllocator.allocate(len).unwrap();
            assert_eq!(buffer.as_slice().len(), len);
            assert!(buffer.as_slice().iter().all(|&b| b == 0), "{len} bytes");
            // Writable to its last byte, and freed by the Vec that owns it.
            if let Some(last) = buffer.as_mut_slice().last_mut() {
                *last = 7;
            }
        }
    }

    #[test]
    fn an_allocation_too_large_is_an_error_value() {
        let err = VecAllocator
            .allocate(usize::MAX / 2)
            .err()
            .expect("refused");
        assert!(
            err.to_string().contains("cannot allocate a batch buffer"),
            "{err}"
        );
    }
}
