//! Memory planning for the CUDA backend: the footprint of a network (fixed bytes + bytes per
//! image), `--batch-size auto`, and an out-of-memory error that names a batch size that fits.
//!
//! [`Network`] allocates every activation, activation gradient, parameter, gradient and
//! statistic once, for its maximum batch; the backend adds a workspace that grows to the
//! largest batch and is then reused. So the footprint is affine in the batch size, and two
//! probe networks (batch 1 and 2) measure it exactly on the device ([`measure`]); [`estimate`]
//! computes the same from the graph without a GPU.

use crate::model::{Graph, InputBatch, Network};

use super::backend::CudaBackend;
use super::error::CudaError;

/// Bytes a network needs: `fixed + per_image × batch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footprint {
    /// Parameters, gradients, statistics, per-layer constants, module images.
    pub fixed_bytes: u64,
    /// Activations, their gradients and the per-image workspace.
    pub per_image_bytes: u64,
}

/// Fraction of the free memory left unplanned (allocator granularity, cuBLAS/driver pools).
pub const HEADROOM: f64 = 0.08;

impl Footprint {
    /// Bytes for `batch` images.
    pub fn bytes(&self, batch: usize) -> u64 {
        self.fixed_bytes + self.per_image_bytes * batch as u64
    }

    /// The largest batch whose footprint fits `free_bytes` less [`HEADROOM`] (0 if none).
    pub fn largest_batch(&self, free_bytes: u64) -> usize {
        let usable = (free_bytes as f64 * (1.0 - HEADROOM)) as u64;
        if usable <= self.fixed_bytes || self.per_image_bytes == 0 {
            return 0;
        }
        ((usable - self.fixed_bytes) / self.per_image_bytes) as usize
    }

    /// `Ok` when `batch` fits `free_bytes`, else [`CudaError::OutOfMemory`] naming the largest
    /// batch that fits.
    pub fn check(&self, batch: usize, free_bytes: u64) -> Result<(), CudaError> {
        let fits = self.largest_batch(free_bytes);
        if batch <= fits {
            return Ok(());
        }
        Err(CudaError::OutOfMemory {
            batch_size: batch,
            needed_mib: self.bytes(batch) >> 20,
            free_mib: free_bytes >> 20,
            fits,
        })
    }
}

/// The footprint computed from the graph: bf16 activations and activation gradients (the
/// input image has no gradient), bf16 weights, f32 gradients and statistics, the staged u8
/// batch and BN partial sums (≤ 4 per SM × channels × 2, counted generously as 1 MiB).
pub fn estimate(graph: &Graph, image_size: u32) -> Footprint {
    let dims = graph.value_dims(image_size);
    let acts: usize = dims.iter().map(|d| d.per_image()).sum();
    let grads: usize = acts - dims.first().map_or(0, |d| d.per_image());
    let pixels = (image_size as usize).pow(2) * 3;
    let per_image = 2 * (acts + grads) + pixels + 4 * graph.num_classes();
    let params = graph.param_count();
    let buffers: usize = graph.buffers().iter().map(|b| b.numel()).sum();
    let fixed = params * (2 + 4) + buffers * 4 * 2 + (1 << 20);
    Footprint {
        fixed_bytes: fixed as u64,
        per_image_bytes: per_image as u64,
    }
}

/// Measures the footprint on device `backend` by building probe networks of batch 1 and 2 and
/// running one training step on each (so the workspace is sized too). Needs a GPU.
pub fn measure(
    backend: &CudaBackend,
    graph: &Graph,
    image_size: u32,
) -> Result<Footprint, anyhow::Error> {
    let dev = backend.device();
    let used = |b: &CudaBackend| -> Result<u64, CudaError> {
        b.synchronize()?;
        let (free, total) = dev.memory()?;
        Ok((total - free) as u64)
    };
    let base = used(backend)?;
    let probe = |batch: usize| -> Result<u64, anyhow::Error> {
        let mut net = Network::new(backend.clone(), graph, batch, image_size)?;
        let s = image_size as usize;
        let pixels = vec![0u8; batch * s * s * 3];
        let labels = vec![0u32; batch];
        net.train_step(&InputBatch {
            pixels: &pixels,
            labels: &labels,
            len: batch,
            image_size,
            augment: None,
        })?;
        Ok(used(backend)?.saturating_sub(base))
    };
    let one = probe(1)?;
    let two = probe(2)?;
    let per_image = two.saturating_sub(one).max(1);
    Ok(Footprint {
        fixed_bytes: one.saturating_sub(per_image),
        per_image_bytes: per_image,
    })
}

/// `--batch-size auto`: the largest per-GPU batch that fits the device's free memory, from
/// the measured footprint. Returns the batch and the footprint (for the printed figure).
pub fn auto_batch_size(
    backend: &CudaBackend,
    graph: &Graph,
    image_size: u32,
) -> Result<(usize, Footprint), anyhow::Error> {
    let footprint = measure(backend, graph, image_size)?;
    let (free, _) = backend.device().memory()?;
    let batch = footprint.largest_batch(free as u64);
    if batch == 0 {
        anyhow::bail!(
            "{} at {image_size}px does not fit this GPU even at batch size 1 ({} MiB fixed + {} MiB per image, {} MiB free): use a smaller --image-size or model",
            graph.arch(),
            footprint.fixed_bytes >> 20,
            footprint.per_image_bytes >> 20,
            free >> 20
        );
    }
    Ok((batch, footprint))
}

/// Checks, before anything is allocated, that `batch` images fit the device's free memory
/// according to [`estimate`]; the error names the largest batch size that fits.
pub fn check_batch_fits(
    backend: &CudaBackend,
    graph: &Graph,
    image_size: u32,
    batch: usize,
) -> Result<(), CudaError> {
    let (free, _) = backend.device().memory()?;
    estimate(graph, image_size).check(batch, free as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Arch;

    #[test]
    fn largest_batch_respects_headroom() {
        let fp = Footprint {
            fixed_bytes: 1000,
            per_image_bytes: 100,
        };
        // 10_000 free → 9_200 usable → (9_200 − 1_000) / 100 = 82.
        assert_eq!(fp.largest_batch(10_000), 82);
        assert_eq!(fp.largest_batch(500), 0);
        assert!(fp.check(82, 10_000).is_ok());
        let err = fp.check(200, 10_000).unwrap_err();
        assert!(matches!(
            err,
            CudaError::OutOfMemory {
                fits: 82,
                batch_size: 200,
                ..
            }
        ));
        let text = err.to_string();
        assert!(
            text.contains("--batch-size 82") && text.contains("batch size 200"),
            "{text}"
        );
    }

    #[test]
    fn estimate_grows_with_model_and_image() {
        let r18 = estimate(&Graph::new(Arch::ResNet18, 285), 224);
        let r50 = estimate(&Graph::new(Arch::ResNet50, 285), 224);
        let r50_small = estimate(&Graph::new(Arch::ResNet50, 285), 112);
        assert!(r50.per_image_bytes > r18.per_image_bytes);
        assert!(r50.fixed_bytes > r18.fixed_bytes);
        assert!(r50_small.per_image_bytes * 3 < r50.per_image_bytes);
        // ResNet-50 at 224px keeps on the order of 100 MiB of bf16 activations and gradients
        // per image in this design (every value and its gradient stay resident).
        let mib = r50.per_image_bytes as f64 / (1 << 20) as f64;
        assert!((20.0..400.0).contains(&mib), "{mib} MiB per image");
    }
}
