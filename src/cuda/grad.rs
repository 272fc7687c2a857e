//! Device-side work on a rank's flat gradient buffer: scaling a bucket by the rank's share of
//! the step's images before it is averaged (kernels/optim.cu `scale_f32`; a small kernel
//! instead of a cuBLAS dependency), and summing micro-batches' gradients for
//! `--grad-accum-steps` (`grad_accumulate`).

use cudarc::driver::LaunchConfig;

use super::device::GpuDevice;
use super::error::CudaError;
use super::launch::{launch_on_device, Out};
use super::launchers::{GradAccumulate, ScaleF32};

/// Threads per block of `scale_f32` and `grad_accumulate`.
const THREADS: u32 = 256;

/// Their launch: a grid-stride loop over `len` values, at most 1024 blocks.
fn grid_stride(len: usize) -> LaunchConfig {
    let blocks = len.div_ceil(THREADS as usize).clamp(1, 1024) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Multiplies `len` f32 values at device address `ptr` by `alpha`, on `dev`'s compute stream
/// (after the kernels already queued there, e.g. the ones that wrote the values).
pub fn scale_f32(dev: &GpuDevice, ptr: u64, len: usize, alpha: f32) -> Result<(), CudaError> {
    if len == 0 {
        return Ok(());
    }
    let n = i64::try_from(len).map_err(|_| CudaError::Unsupported {
        what: format!("scaling {len} values"),
    })?;
    // SAFETY: the caller's `ptr` addresses `len` live f32 values on this device, which the
    // grid-stride loop over `len` reads and writes.
    unsafe {
        let args = ScaleF32 {
            x: Out::addr(ptr),
            n,
            alpha,
        };
        launch_on_device(dev, "scale_f32", grid_stride(len), args)
    }
}

/// What [`accumulate`] does with a micro-batch's gradient `g` (`--grad-accum-steps`), with the
/// sum carried in an f32 buffer `acc` beside the flat gradient buffer (kernels/optim.cu
/// `grad_accumulate`, whose modes these are).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AccumulateMode {
    /// The step's first micro-batch: `acc = w·g`.
    Start = 0,
    /// A micro-batch between: `acc = acc + w·g`.
    Add = 1,
    /// The rank's last micro-batch with images: `g = acc + w·g`, the sum where the buckets
    /// read it.
    Finish = 2,
    /// The first micro-batch is also the last with images: `g = w·g`.
    Only = 3,
}

impl AccumulateMode {
    /// The mode of a micro-batch: the step's `first`, and whether it holds the rank's `last`
    /// images.
    pub fn of(first: bool, last: bool) -> AccumulateMode {
        match (first, last) {
            (true, false) => AccumulateMode::Start,
            (false, false) => AccumulateMode::Add,
            (false, true) => AccumulateMode::Finish,
            (true, true) => AccumulateMode::Only,
        }
    }
}

/// Adds `weight` × the `len` f32 gradient values at `grad` into the accumulator at `acc` (or,
/// by `mode`, finishes the sum into `grad`), on `dev`'s compute stream after the backward
/// kernels that wrote them; products and sums rounded apart, as the CPU ranks add.
pub fn accumulate(
    dev: &GpuDevice,
    acc: u64,
    grad: u64,
    len: usize,
    weight: f32,
    mode: AccumulateMode,
) -> Result<(), CudaError> {
    if len == 0 {
        return Ok(());
    }
    let n = i64::try_from(len).map_err(|_| CudaError::Unsupported {
        what: format!("accumulating {len} values"),
    })?;
    // SAFETY: the caller's `acc` and `grad` address `len` live f32 values each on this
    // device, in different allocations; the grid-stride loop over `len` touches those.
    unsafe {
        let args = GradAccumulate {
            acc: Out::addr(acc),
            g: Out::addr(grad),
            n,
            w: weight,
            mode: mode as i32,
        };
        launch_on_device(dev, "grad_accumulate", grid_stride(len), args)
    }
}
