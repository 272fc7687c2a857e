//! Device-side work on a rank's flat gradient buffer: scaling a bucket by the rank's share of
//! the step's images before it is averaged (kernels/optim.cu `scale_f32`; a small kernel
//! instead of a cuBLAS dependency).

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::device::GpuDevice;
use super::error::CudaError;

/// Threads per block of `scale_f32`.
const THREADS: u32 = 256;

/// Multiplies `len` f32 values at device address `ptr` by `alpha`, on `dev`'s compute stream
/// (after the kernels already queued there, e.g. the ones that wrote the values).
pub fn scale_f32(dev: &GpuDevice, ptr: u64, len: usize, alpha: f32) -> Result<(), CudaError> {
    if len == 0 {
        return Ok(());
    }
    let n = i64::try_from(len).map_err(|_| CudaError::Unsupported {
        what: format!("scaling {len} values"),
    })?;
    let f = dev.function("optim.cu", "scale_f32")?;
    let blocks = len.div_ceil(THREADS as usize).clamp(1, 1024) as u32;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = dev.stream().launch_builder(&f);
    b.arg(&ptr).arg(&n).arg(&alpha);
    // SAFETY: the arguments match scale_f32(float*, long, float) in kernels/optim.cu; the
    // caller's `ptr` addresses `len` live f32 values on this device.
    unsafe { b.launch(cfg) }.map_err(CudaError::driver("scale_f32"))?;
    Ok(())
}
