//! The reductions over the ranks of one process on one GPU (kernels/collective.cu): what the
//! rehearsal's collective ([`crate::dist::device_group`]) launches once every rank has joined a
//! round. Each reads element i of every rank's buffer and writes the result into every rank's
//! buffer, in rank order, with the arithmetic the file's header states.

use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig};

use super::device::GpuDevice;
use super::error::CudaError;
use super::kernel_types::{RankBuffersF32, RankBuffersF64};
use super::launch::{launch, Kernel};
use super::launchers::{RankAverageF32, RankSumF64};

pub use super::kernel_types::MAX_RANKS;

/// Threads per block (the file's launch configuration).
const THREADS: u32 = 256;

/// One rank's part of an average: the device address of its values and its scale.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankSlice {
    /// Device address of the rank's first value.
    pub ptr: u64,
    /// The rank's scale (its share of the step's images × ranks; 1 for an even split).
    pub scale: f32,
}

/// The two kernels, loaded (compiled on a cold cache) once per device.
#[derive(Debug)]
pub struct RankReducer {
    average: CudaFunction,
    sum: CudaFunction,
}

fn launch_config(len: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (len.div_ceil(THREADS as usize).clamp(1, 1024) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn check_ranks(ranks: usize) -> Result<i32, CudaError> {
    if ranks == 0 || ranks > MAX_RANKS {
        return Err(CudaError::Unsupported {
            what: format!("a reduction over {ranks} ranks (1 to {MAX_RANKS})"),
        });
    }
    Ok(ranks as i32)
}

fn check_len(len: usize) -> Result<i64, CudaError> {
    i64::try_from(len).map_err(|_| CudaError::Unsupported {
        what: format!("a reduction of {len} values"),
    })
}

impl RankReducer {
    /// Loads `rank_average_f32` and `rank_sum_f64` on `dev` (through the kernel cache).
    pub fn new(dev: &GpuDevice) -> Result<RankReducer, CudaError> {
        Ok(RankReducer {
            average: dev.function(RankAverageF32::FILE, RankAverageF32::NAMES[0])?,
            sum: dev.function(RankSumF64::FILE, RankSumF64::NAMES[0])?,
        })
    }

    /// Enqueues on `stream` the average of `len` f32 values over `ranks` (rank order): every
    /// rank's values become `(Σ scale_r · v_r) / ranks`.
    ///
    /// # Safety
    /// Every `ptr` must address `len` live f32 values in the context of `stream`, which no
    /// other work reads or writes until the launch has completed (the caller orders it with
    /// events).
    pub unsafe fn average_f32(
        &self,
        stream: &CudaStream,
        ranks: &[RankSlice],
        len: usize,
    ) -> Result<(), CudaError> {
        let count = check_ranks(ranks.len())?;
        let n = check_len(len)?;
        if len == 0 {
            return Ok(());
        }
        let mut args = RankBuffersF32 {
            ptr: [0; MAX_RANKS],
            scale: [0.0; MAX_RANKS],
        };
        for (r, slice) in ranks.iter().enumerate() {
            args.ptr[r] = slice.ptr;
            args.scale[r] = slice.scale;
        }
        let args = RankAverageF32 {
            b: args,
            ranks: count,
            n,
        };
        // SAFETY: `average` is rank_average_f32 (loaded in new); the caller guarantees the
        // buffers.
        unsafe { launch(stream, &self.average, launch_config(len), args) }
            .map_err(CudaError::driver("rank_average_f32"))?;
        Ok(())
    }

    /// Enqueues on `stream` the sum of `len` f64 values over the ranks at `ptrs` (rank order),
    /// written into every rank's values.
    ///
    /// # Safety
    /// As [`RankReducer::average_f32`], for f64 values.
    pub unsafe fn sum_f64(
        &self,
        stream: &CudaStream,
        ptrs: &[u64],
        len: usize,
    ) -> Result<(), CudaError> {
        let count = check_ranks(ptrs.len())?;
        let n = check_len(len)?;
        if len == 0 {
            return Ok(());
        }
        let mut args = RankBuffersF64 {
            ptr: [0; MAX_RANKS],
        };
        args.ptr[..ptrs.len()].copy_from_slice(ptrs);
        let args = RankSumF64 {
            b: args,
            ranks: count,
            n,
        };
        // SAFETY: `sum` is rank_sum_f64 (loaded in new); the caller guarantees the buffers.
        unsafe { launch(stream, &self.sum, launch_config(len), args) }
            .map_err(CudaError::driver("rank_sum_f64"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_argument_structs_have_the_kernels_c_layout() {
        // 8 pointers then 8 floats: 96 bytes, 8-byte aligned, as the kernel's struct.
        assert_eq!(std::mem::size_of::<RankBuffersF32>(), 96);
        assert_eq!(std::mem::align_of::<RankBuffersF32>(), 8);
        assert_eq!(std::mem::size_of::<RankBuffersF64>(), 64);
        let src = include_str!("../../kernels/collective.cu");
        assert!(src.contains(&format!("#define BT_MAX_RANKS {MAX_RANKS}")));
    }

    #[test]
    fn rank_counts_outside_one_to_eight_are_refused_before_any_launch() {
        assert!(check_ranks(0).is_err());
        assert!(check_ranks(MAX_RANKS + 1).is_err());
        assert_eq!(check_ranks(3).unwrap(), 3);
        let grid = launch_config(3001).grid_dim.0;
        assert_eq!(grid, 12);
        assert_eq!(launch_config(10_000_000).grid_dim.0, 1024);
        assert_eq!(launch_config(0).grid_dim.0, 1);
    }
}
