//! What every op family of the CUDA backend shares: [`CudaBackend`]'s state (the device, its
//! limits, the workspace and scratch that grow to the largest batch and are reused, the
//! profiler), the one launch path every kernel takes (`CudaBackend::launch`), and the checks
//! and conversions the ops make before they launch.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaEvent, CudaSlice, LaunchConfig};

use crate::backend::{AppliedBn, BackendError};
use crate::cuda::bn_mask::MaskSource;
use crate::cuda::conv::{ConvVersion, GpuLimits};
use crate::cuda::conv3_schedule::TileSchedule;
use crate::cuda::device::GpuDevice;
use crate::cuda::error::CudaError;
use crate::cuda::kernel_types::InputMix;
use crate::cuda::launch::{self, Kernel};
use crate::cuda::tensor::CudaTensor;

/// Threads per block of the element-wise kernels.
pub(super) const THREADS: u32 = 256;

/// Scratch buffers reused across steps (grown, never shrunk).
#[derive(Debug, Default)]
pub(super) struct Workspace {
    pub(super) f32a: Option<CudaSlice<f32>>,
    pub(super) f32b: Option<CudaSlice<f32>>,
    pub(super) pixels: Option<CudaSlice<u8>>,
    pub(super) ints: Option<CudaSlice<i32>>,
    pub(super) ints2: Option<CudaSlice<i32>>,
    pub(super) norm: Option<CudaSlice<f32>>,
    /// `norm` holds the ImageNet scale/shift (a pageable upload synchronises the stream, so
    /// the constants go up once, not every step).
    pub(super) norm_ready: bool,
    /// Synchronised batch norm's global reductions dgamma and dbeta (f32 [C] each).
    pub(super) sync_a: Option<CudaSlice<f32>>,
    pub(super) sync_b: Option<CudaSlice<f32>>,
    /// The step's values that kernels read from device memory (labels, mixing, stop wish).
    pub(super) step: StepValues,
}

/// The buffers of the step's values that kernels read from device memory (`step_values.rs`
/// fills them): fixed addresses once grown, so a captured CUDA graph reads each step's own.
#[derive(Debug, Default)]
pub(super) struct StepValues {
    pub(super) labels: Option<CudaSlice<i32>>,
    pub(super) own_weight: Option<CudaSlice<f32>>,
    pub(super) stop: Option<CudaSlice<i32>>,
    pub(super) mix: Option<CudaSlice<InputMix>>,
    /// The values of the coming step are on the device already: the ops upload nothing.
    pub(super) preloaded: bool,
}

/// The CUDA backend on one device.
#[derive(Debug, Clone)]
pub struct CudaBackend {
    pub(super) dev: Arc<GpuDevice>,
    pub(super) sms: u32,
    /// Which convolution kernels run (`BIRDTRAIN_CONV`, see [`crate::cuda::conv`]).
    pub(super) conv: ConvVersion,
    /// How the v3 GEMMs of 128-column tiles walk them (`BIRDTRAIN_CONV3_TILES`, see
    /// [`crate::cuda::conv3_schedule`]).
    pub(super) conv3_tiles: TileSchedule,
    /// Where the fused data gradients take a ReLU's mask from (`BIRDTRAIN_BN_MASK`, see
    /// [`crate::cuda::bn_mask`]).
    pub(super) bn_mask: MaskSource,
    /// What the v2 tile choice models.
    pub(super) limits: GpuLimits,
    /// Whether networks run batch norm fused into the convolutions (`BIRDTRAIN_BN_FUSION`, on
    /// unless `0`, [`super::bn_fused`]); it takes the v2 kernels.
    pub(super) bn_fusion: bool,
    /// Whether, with batch norm fused, convolutions apply the batch norm before them
    /// (`BIRDTRAIN_BN_PROLOGUE`, off unless `1`, `conv_bn.rs`).
    pub(super) bn_prologue: bool,
    /// v2 scratch: the stem's input and weight copies, the phase-ordered dgrad weight.
    pub(super) conv2: Arc<Mutex<Conv2Scratch>>,
    pub(super) work: Arc<Mutex<Workspace>>,
    /// The outputs of batch norms applied by their readers where no kernel applies them as it
    /// loads (`conv_bn.rs`), one per size.
    pub(super) applied: Arc<Mutex<AppliedScratch>>,
    pub(super) profiler: Arc<Mutex<Profiler>>,
}

pub(super) fn dev_err(op: &'static str) -> impl Fn(CudaError) -> BackendError {
    move |e| BackendError::Device {
        op,
        source: Box::new(e),
    }
}

pub(super) fn drv_err(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> BackendError {
    move |e| BackendError::Device {
        op,
        source: Box::new(CudaError::Driver {
            context: op.to_string(),
            source: e,
        }),
    }
}

pub(super) fn check_len(
    op: &'static str,
    what: &str,
    got: usize,
    want: usize,
) -> Result<(), BackendError> {
    if got < want {
        return Err(BackendError::Shape {
            op,
            detail: format!("{what} has {got} elements, needs at least {want}"),
        });
    }
    Ok(())
}

pub(super) fn to_i32(op: &'static str, what: &str, v: usize) -> Result<i32, BackendError> {
    i32::try_from(v).map_err(|_| BackendError::Shape {
        op,
        detail: format!("{what} = {v} exceeds the kernels' 32-bit index range"),
    })
}

/// Ensures `slot` holds at least `len` elements (allocating only when it must grow).
pub(super) fn ensure<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    dev: &GpuDevice,
    slot: &mut Option<CudaSlice<T>>,
    len: usize,
    op: &'static str,
) -> Result<(), BackendError> {
    if slot.as_ref().is_none_or(|s| s.len() < len) {
        *slot = None;
        *slot = Some(
            dev.stream()
                .alloc_zeros::<T>(len.max(1))
                .map_err(|e| oom_or_device(op, len * size_of::<T>(), e))?,
        );
        dev.note_allocation(len.max(1) * size_of::<T>());
    }
    Ok(())
}

pub(super) fn oom_or_device(
    op: &'static str,
    bytes: usize,
    e: cudarc::driver::DriverError,
) -> BackendError {
    if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        BackendError::OutOfMemory {
            bytes,
            what: format!("{op} on the GPU"),
            hint: "use a smaller --batch-size".into(),
        }
    } else {
        drv_err(op)(e)
    }
}

pub(super) fn elementwise_cfg(total: usize) -> LaunchConfig {
    let blocks = total.div_ceil(THREADS as usize).clamp(1, 65_535) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}
/// Scratch of the v2 convolutions (grown, never shrunk).
#[derive(Debug, Default)]
pub(super) struct Conv2Scratch {
    /// The stem's input and weight, padded to 8 channels or paired (`StemCopy`).
    pub(super) x_stem: Option<CudaSlice<u16>>,
    pub(super) w_stem: Option<CudaSlice<u16>>,
    pub(super) wt: Option<CudaSlice<u16>>,
    /// The split wgrad's partial sums, one weight-sized f32 plane per reduction slice.
    pub(super) planes: Option<CudaSlice<f32>>,
}

/// Per-launch timing (the `--breakdown` of `bench step`).
#[derive(Debug, Default)]
pub(super) struct Profiler {
    pub(super) enabled: bool,
    pub(super) events: Vec<ProfiledLaunch>,
}

/// One timed launch and the work it did (when the op declared it).
#[derive(Debug)]
pub(super) struct ProfiledLaunch {
    pub(super) name: &'static str,
    pub(super) start: CudaEvent,
    pub(super) end: CudaEvent,
    pub(super) bytes: f64,
    pub(super) flops: f64,
}

/// The scratch outputs of applied batch norms, by element count (`conv_bn.rs`).
pub(super) type AppliedScratch = HashMap<usize, CudaTensor>;

/// An applied batch norm's device tensors, as the v2 kernels that apply it take them.
pub(super) struct AppliedArgs<'a> {
    /// Its saved mean (f32, per channel).
    pub(super) mean: &'a CudaSlice<f32>,
    /// Its saved 1/sqrt(var + eps).
    pub(super) invstd: &'a CudaSlice<f32>,
    /// γ (bf16).
    pub(super) gamma: &'a CudaSlice<u16>,
    /// β (bf16).
    pub(super) beta: &'a CudaSlice<u16>,
    /// 1 with a ReLU after it.
    pub(super) relu: i32,
}

impl<'a> AppliedArgs<'a> {
    /// The tensors of `bn` over `c` channels (lengths checked).
    pub(super) fn of(
        op: &'static str,
        bn: &AppliedBn<'a, CudaTensor>,
        c: usize,
    ) -> Result<Self, BackendError> {
        for (name, t) in [
            ("gamma", bn.gamma),
            ("beta", bn.beta),
            ("saved_mean", bn.saved_mean),
            ("saved_invstd", bn.saved_invstd),
        ] {
            check_len(op, name, t.len, c)?;
        }
        Ok(Self {
            mean: bn.saved_mean.f32(op, "saved_mean")?,
            invstd: bn.saved_invstd.f32(op, "saved_invstd")?,
            gamma: bn.gamma.bf16(op, "gamma")?,
            beta: bn.beta.bf16(op, "beta")?,
            relu: i32::from(bn.relu),
        })
    }
}

impl CudaBackend {
    /// The device.
    pub fn device(&self) -> &Arc<GpuDevice> {
        &self.dev
    }

    /// Waits for every queued op.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.dev.synchronize()
    }

    pub(super) fn work(&self) -> std::sync::MutexGuard<'_, Workspace> {
        self.work.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `kernel` (one of launcher `K`'s) on the compute stream with `args`, timed when
    /// profiling is on.
    pub(super) fn launch<K: Kernel>(
        &self,
        op: &'static str,
        kernel: &'static str,
        cfg: LaunchConfig,
        args: K,
    ) -> Result<(), BackendError> {
        if !launch::declares::<K>(kernel) {
            return Err(dev_err(op)(CudaError::Unsupported {
                what: format!(
                    "{kernel} is not a kernel of the launcher {}",
                    std::any::type_name::<K>()
                ),
            }));
        }
        let f = self.dev.function(K::FILE, kernel).map_err(dev_err(op))?;
        let timing = self.profile_begin()?;
        // SAFETY: `f` is one of `K`'s kernels (checked above), whose parameters `K` mirrors
        // (the launchers' unit test checks them against kernels/*.cu); every op
        // length-checks its buffers before it launches.
        unsafe { launch::launch(self.dev.stream(), &f, cfg, args) }.map_err(drv_err(op))?;
        self.profile_end(kernel, timing)
    }
}
