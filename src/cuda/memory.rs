//! Memory planning for the CUDA backend: the footprint of a network (fixed bytes + bytes per
//! image), the largest batch that fits ([`auto_batch_size`]), and an out-of-memory error that
//! names a batch size that fits.
//!
//! [`Network`] allocates every activation, the shared activation-gradient buffers, every
//! parameter, gradient and statistic once, for its maximum batch; the backend adds a
//! workspace that grows to the largest batch and is then reused. So the footprint is affine
//! in the batch size. [`estimate`] computes it from the network's own buffer plan
//! ([`crate::model::buffer_plan`], the one `Network::new` allocates from: activation
//! gradients share a few buffers), plus the optimizer's f32 master weights and state and the
//! staging slots; [`measure`] adds up the sizes of what the backend really allocates for
//! probe networks of batch 1 and 2 (the device counts every allocation), which, unlike
//! differencing the driver's free memory, is not disturbed by other processes, pool caching
//! or the driver's own reservations.

use crate::backend::ConvShape;
use crate::model::{buffer_plan, Graph, InputBatch, Network, Node};

use super::conv::StemCopy;

use super::backend::CudaBackend;
use super::error::CudaError;

/// Bytes a network needs: `fixed + per_image × batch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footprint {
    /// Parameters, gradients, statistics, optimizer state, per-layer constants.
    pub fixed_bytes: u64,
    /// Activations, their gradients, the staged batch and the per-image workspace.
    pub per_image_bytes: u64,
}

/// Fraction of the free memory left unplanned (allocator granularity, driver pools, modules).
pub const HEADROOM: f64 = 0.08;

/// Staging slots the estimate assumes (the default `--prefetch-depth`).
const STAGING_SLOTS: usize = 2;

impl Footprint {
    /// Bytes for `batch` images.
    pub fn bytes(&self, batch: usize) -> u64 {
        self.fixed_bytes + self.per_image_bytes * batch as u64
    }

    /// This footprint with `--grad-accum-steps` `k` (a batch is then one micro-batch): the
    /// f32 gradient accumulator beside the gradient buffer (4 bytes a parameter) in the fixed
    /// bytes, and per image of the micro-batch the k − 1 more images each staging slot holds
    /// (a slot holds the whole step).
    pub fn accumulating(self, graph: &Graph, image_size: u32, k: u32) -> Footprint {
        if k <= 1 {
            return self;
        }
        let params = buffer_plan(graph, image_size).params as u64;
        let pixels = 3 * u64::from(image_size).pow(2);
        Footprint {
            fixed_bytes: self.fixed_bytes + 4 * params,
            per_image_bytes: self.per_image_bytes
                + u64::from(k - 1) * STAGING_SLOTS as u64 * pixels,
        }
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

/// The convolutions reading the image (the stem) at one image each.
fn stem_shapes(graph: &Graph, image_size: u32) -> impl Iterator<Item = ConvShape> + '_ {
    let dims = graph.value_dims(image_size);
    graph.nodes().iter().filter_map(move |node| match node {
        Node::Conv { input: 0, .. } => graph.conv_shape(node, &dims, 1),
        _ => None,
    })
}

/// Values per image of the stem's input as the v2 convolutions copy it (padded to 8 channels
/// or paired, [`StemCopy`]; 0 when they read it as it is).
fn stem_input_copy_values(graph: &Graph, image_size: u32) -> usize {
    stem_shapes(graph, image_size)
        .map(|s| StemCopy::of(&s).input_len(&s))
        .max()
        .unwrap_or(0)
}

/// Values of the stem's weight as the v2 convolutions copy it (0 when none is made).
fn stem_weight_values(graph: &Graph, image_size: u32) -> usize {
    stem_shapes(graph, image_size)
        .map(|s| StemCopy::of(&s).weight_len(&s))
        .max()
        .unwrap_or(0)
}

/// Bytes per image of the fused batch norm's per-tile records (`BIRDTRAIN_BN_FUSION`,
/// src/cuda/backend/bn_fused.rs): two f32 planes per 128 rows of the largest convolution output or
/// input, a 1/16 of its bf16 bytes, plus the first merge level's groups (1/128 of that).
fn bn_partials_per_image(graph: &Graph, image_size: u32) -> usize {
    let largest = graph
        .value_dims(image_size)
        .iter()
        .skip(1)
        .map(|d| d.per_image())
        .max()
        .unwrap_or(0);
    let records = (2 * 4 * largest).div_ceil(128);
    records + records.div_ceil(128)
}

/// The device optimizer's state: f32 master weights and up to two moments (Adam's).
fn optimizer_bytes(params: usize) -> usize {
    3 * 4 * params
}

/// The split weight gradient's partial-sum planes (f32, one weight-sized plane per slice):
/// slices × tiles stays under 4 waves of 128×128 tiles, at most ~107 MiB for a ResNet layer
/// on an H100's 132 SMs (layer4's 3×3: 8 slices of 2.4 M values).
const SPLIT_WGRAD_PLANES: usize = 128 << 20;

/// The footprint from the network's buffer plan: bf16 activations and activation gradients,
/// bf16 weights and f32 gradients, f32 buffers and statistics; the optimizer's f32 master
/// weights and moments (Adam's two, the larger case); per image, the u8 pixels of the staging
/// slots and the loss rows; the v2 convolutions' scratch (the stem's input and weight copies,
/// paired or padded to 8 channels, in bf16, the largest weight rearranged for the strided
/// dgrad, the split weight gradient's planes); the fused batch norm's tile records; the
/// blocks' outputs' packed signs; 1 MiB of kernel scratch.
pub fn estimate(graph: &Graph, image_size: u32) -> Footprint {
    let plan = buffer_plan(graph, image_size);
    let pixels = (image_size as usize).pow(2) * 3;
    let stem_copy = 2 * stem_input_copy_values(graph, image_size);
    let per_image = 2 * (plan.activations_per_image + plan.activation_grads_per_image)
        + (1 + STAGING_SLOTS) * pixels
        + stem_copy
        + bn_partials_per_image(graph, image_size)
        + 4 * graph.num_classes()
        // the packed signs of BIRDTRAIN_BN_MASK=packed (counted whatever the setting: a bit an
        // element of the blocks' outputs, under 1 % of the rest)
        + plan.residual_relu_outputs_per_image.div_ceil(8);
    let optimizer = optimizer_bytes(plan.params);
    let largest_weight = graph
        .params()
        .iter()
        .map(|p| p.shape.iter().product::<usize>())
        .max()
        .unwrap_or(0);
    let conv2_weights = 2 * largest_weight + 2 * stem_weight_values(graph, image_size);
    let fixed = plan.params * (2 + 4)
        + optimizer
        + 4 * (plan.buffers + plan.statistics)
        + conv2_weights
        + SPLIT_WGRAD_PLANES
        + (1 << 20);
    Footprint {
        fixed_bytes: fixed as u64,
        per_image_bytes: per_image as u64,
    }
}

/// Measures the footprint on device `backend` by building probe networks and running one
/// training step on each, adding up what the backend allocated for each. A batch-2 probe runs
/// first: its step makes the kernels' one-time buffers (the rearranged dgrad weights, the
/// reduction slabs) and sizes the batch-dependent scratch, all counted into the fixed bytes;
/// the probes of batch 1 and 2 after it then differ by one image's tensors alone (measured
/// the other way round on an H100, the one-time buffers cancelled most of an image). The
/// scratch that grows with the batch (the stem's copy of the input, paired or padded) is
/// added per image, and the optimizer's state to the fixed bytes. Needs a GPU.
pub fn measure(
    backend: &CudaBackend,
    graph: &Graph,
    image_size: u32,
) -> Result<Footprint, CudaError> {
    let dev = backend.device();
    let probe = |batch: usize| -> Result<u64, CudaError> {
        let before = dev.allocated_bytes();
        let mut net =
            Network::new(backend.clone(), graph, batch, image_size).map_err(probe_error)?;
        let s = image_size as usize;
        let pixels = vec![0u8; batch * s * s * 3];
        let labels = vec![0u32; batch];
        net.train_step(&InputBatch {
            pixels: &pixels,
            labels: &labels,
            len: batch,
            image_size,
            augment: None,
            mix: None,
        })
        .map_err(probe_error)?;
        backend.synchronize()?;
        Ok(dev.allocated_bytes() - before)
    };
    let first = probe(2)?;
    let one = probe(1)?;
    let two = probe(2)?;
    let stem_scratch = 2 * stem_input_copy_values(graph, image_size) as u64;
    let per_image = two.saturating_sub(one).max(1) + stem_scratch;
    // The device optimizer's state (f32 master weights and up to two moments), which the
    // probes do not build, as the estimate counts it.
    let optimizer = optimizer_bytes(buffer_plan(graph, image_size).params) as u64;
    Ok(Footprint {
        fixed_bytes: first.saturating_sub(2 * per_image) + optimizer,
        per_image_bytes: per_image,
    })
}

fn probe_error(e: crate::model::ModelError) -> CudaError {
    CudaError::Unsupported {
        what: format!("a memory probe network: {e}"),
    }
}

/// The largest per-GPU batch that fits the device's free memory (`--batch-size auto`, through
/// [`crate::train::largest_gpu_batch`]), from the measured footprint. Returns the batch and
/// the footprint (for the printed figure).
pub fn auto_batch_size(
    backend: &CudaBackend,
    graph: &Graph,
    image_size: u32,
    accum_steps: u32,
) -> Result<(usize, Footprint), CudaError> {
    let footprint =
        measure(backend, graph, image_size)?.accumulating(graph, image_size, accum_steps);
    let (free, _) = backend.device().memory()?;
    // An H100's memory holds more stem activations than the kernels' 32-bit indices reach.
    let batch = footprint
        .largest_batch(free as u64)
        .min(index_limited_batch(graph, image_size));
    if batch == 0 {
        return Err(CudaError::Unsupported {
            what: format!(
                "{} at {image_size}px does not fit this GPU even at batch size 1 ({} MiB fixed + {} MiB per image, {} MiB free): use a smaller --image-size or model",
                graph.arch(),
                footprint.fixed_bytes >> 20,
                footprint.per_image_bytes >> 20,
                free >> 20
            ),
        });
    }
    Ok((batch, footprint))
}

/// The largest batch whose every tensor the kernels can index with 32 bits (`i32`): the
/// largest per-image value of the network (the stem's output, or the v2 convolutions' copy of
/// its input) times the batch stays under 2³¹.
pub fn index_limited_batch(graph: &Graph, image_size: u32) -> usize {
    let input_copy = stem_input_copy_values(graph, image_size);
    let largest = graph
        .value_dims(image_size)
        .iter()
        .map(|d| d.per_image())
        .max()
        .unwrap_or(0)
        .max(input_copy)
        .max(1);
    i32::MAX as usize / largest
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
    fn the_automatic_batch_stays_within_32_bit_indices() {
        // resnet18 at 128 px: the stem's output, 64 × 64 × 64 values per image, is the
        // largest: 2³¹ / 262 144 images.
        let graph = Graph::new(Arch::ResNet18, 285);
        assert_eq!(index_limited_batch(&graph, 128), 8191);
        let stem = 64 * 64 * 64;
        assert!(index_limited_batch(&graph, 128) * stem <= i32::MAX as usize);
    }

    #[test]
    fn the_stem_copies_follow_the_v2_layout() {
        // resnet's stride-2 stem reads pixel pairs: 112 pairs of 8 values a row at 224 px (half
        // the 8-channel copy), its weight 64 × 7 × 4 pairs of 8.
        let r50 = Graph::new(Arch::ResNet50, 285);
        assert_eq!(stem_input_copy_values(&r50, 224), 224 * 112 * 8);
        assert_eq!(stem_weight_values(&r50, 224), 64 * 7 * 4 * 8);
        // An odd size: 57 pairs a row, the last one's second pixel zero.
        assert_eq!(stem_input_copy_values(&r50, 113), 113 * 57 * 8);
        // The CIFAR resnets' stride-1 stem is padded to 8 channels.
        let r20 = Graph::new(Arch::ResNet20, 10);
        assert_eq!(stem_input_copy_values(&r20, 32), 32 * 32 * 8);
        assert_eq!(stem_weight_values(&r20, 32), 16 * 3 * 3 * 8);
    }

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
    fn the_estimate_counts_the_shared_gradient_buffers_not_one_per_value() {
        let graph = Graph::new(Arch::ResNet50, 285);
        let plan = buffer_plan(&graph, 224);
        // The reverse pass keeps a few gradient buffers live at a time: far fewer than the
        // activations (a gradient per value would equal them, less the input image).
        assert!(
            plan.activation_grads_per_image * 3 < plan.activations_per_image,
            "{plan:?}"
        );
        let est = estimate(&graph, 224);
        let pixels = 224 * 224 * 3;
        let per_value_grads = 2 * (2 * plan.activations_per_image - pixels);
        assert!((est.per_image_bytes as usize) < per_value_grads, "{est:?}");
        // Fixed: bf16 weights, f32 gradients and at most three f32 optimizer vectors.
        assert!(est.fixed_bytes as usize >= plan.params * (2 + 4 + 12));
    }

    #[test]
    fn accumulation_adds_the_accumulator_and_the_larger_staging_slots() {
        let graph = Graph::new(Arch::ResNet50, 285);
        let base = estimate(&graph, 224);
        assert_eq!(base.accumulating(&graph, 224, 1), base);
        let four = base.accumulating(&graph, 224, 4);
        let params = buffer_plan(&graph, 224).params as u64;
        assert_eq!(four.fixed_bytes, base.fixed_bytes + 4 * params);
        // Each of the 2 slots holds 3 more images of 224² × 3 bytes per micro-batch image.
        assert_eq!(
            four.per_image_bytes,
            base.per_image_bytes + 3 * 2 * 224 * 224 * 3
        );
        assert!(four.largest_batch(80 << 30) < base.largest_batch(80 << 30));
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
