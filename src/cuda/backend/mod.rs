//! [`CudaBackend`]: the [`Backend`] ops on one GPU, bf16 activations and weights, f32
//! accumulation, f32 parameter gradients and batch-norm statistics, NHWC.
//!
//! Every op validates lengths like the CPU backend, then queues its kernels on the device's one
//! compute stream; only `download` and the loss (which returns host statistics) wait for the
//! GPU. Scratch buffers (BN partial sums, the staged u8 batch, labels, per-row losses) live in a
//! workspace that grows to the largest batch seen and is then reused: no allocation per step.
//!
//! One file per op family, as in the CPU backend (`src/backend/cpu/`): `conv.rs`, `bn.rs`,
//! `bn_sync.rs` (synchronised batch norm), `bn_fused.rs` (batch norm fused into the
//! convolutions), `pool.rs`, `dense.rs` (the classifier head), `loss.rs`, `input.rs` and
//! `profile.rs` (`--breakdown`'s per-launch timing); this file holds the backend, its
//! memory and the [`Backend`] implementation that hands each op to its family. Every kernel
//! goes through `CudaBackend::launch` with its typed launcher (`src/cuda/launchers.rs`).

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::conv::{ConvVersion, GpuLimits};
use super::device::GpuDevice;
use super::error::CudaError;
use super::launch::{self, Kernel};
use super::tensor::{from_bf16_bits, to_bf16_bits, CudaTensor, DType, Storage};
use crate::backend::{
    Backend, BackendError, BnBackward, BnForward, BnGradEpilogue, BnShape, BnSyncBackward,
    ConvShape, LinearShape, LossStats, PoolShape, SumsMut, Targets, TensorRole,
};
use crate::model::InputBatch;

mod bn;
mod bn_fused;
mod bn_sync;
mod conv;
mod dense;
mod input;
mod loss;
mod pool;
mod profile;

pub use bn_fused::{bn_fusion_from_env, parse_bn_fusion, BN_FUSION_ENV};
pub use bn_sync::CudaSums;
use conv::Conv2Scratch;
pub(crate) use conv::ConvArgs;
pub(crate) use input::{aug_ints, InputMix};
pub use loss::DeviceTotalsAt;
pub use profile::KernelTime;
use profile::Profiler;

/// Threads per block of the element-wise kernels.
const THREADS: u32 = 256;

/// Scratch buffers reused across steps (grown, never shrunk).
#[derive(Debug, Default)]
struct Workspace {
    f32a: Option<CudaSlice<f32>>,
    f32b: Option<CudaSlice<f32>>,
    pixels: Option<CudaSlice<u8>>,
    ints: Option<CudaSlice<i32>>,
    ints2: Option<CudaSlice<i32>>,
    norm: Option<CudaSlice<f32>>,
    /// `norm` holds the ImageNet scale/shift (a pageable upload synchronises the stream, so
    /// the constants go up once, not every step).
    norm_ready: bool,
    /// Synchronised batch norm's global reductions dgamma and dbeta (f32 [C] each).
    sync_a: Option<CudaSlice<f32>>,
    sync_b: Option<CudaSlice<f32>>,
}

/// The CUDA backend on one device.
#[derive(Debug, Clone)]
pub struct CudaBackend {
    dev: Arc<GpuDevice>,
    sms: u32,
    /// Which convolution kernels run (`BIRDTRAIN_CONV`, see [`conv`]).
    conv: ConvVersion,
    /// What the v2 tile choice models.
    limits: GpuLimits,
    /// Whether networks run batch norm fused into the convolutions (`BIRDTRAIN_BN_FUSION`, on
    /// unless `0`, [`bn_fused`]); it takes the v2 kernels.
    bn_fusion: bool,
    /// v2 scratch: the 8-channel stem input and weight, the phase-ordered dgrad weight.
    conv2: Arc<Mutex<Conv2Scratch>>,
    work: Arc<Mutex<Workspace>>,
    profiler: Arc<Mutex<Profiler>>,
}

fn dev_err(op: &'static str) -> impl Fn(CudaError) -> BackendError {
    move |e| BackendError::Device {
        op,
        source: Box::new(e),
    }
}

fn drv_err(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> BackendError {
    move |e| BackendError::Device {
        op,
        source: Box::new(CudaError::Driver {
            context: op.to_string(),
            source: e,
        }),
    }
}

fn check_len(op: &'static str, what: &str, got: usize, want: usize) -> Result<(), BackendError> {
    if got < want {
        return Err(BackendError::Shape {
            op,
            detail: format!("{what} has {got} elements, needs at least {want}"),
        });
    }
    Ok(())
}

fn to_i32(op: &'static str, what: &str, v: usize) -> Result<i32, BackendError> {
    i32::try_from(v).map_err(|_| BackendError::Shape {
        op,
        detail: format!("{what} = {v} exceeds the kernels' 32-bit index range"),
    })
}

/// Ensures `slot` holds at least `len` elements (allocating only when it must grow).
fn ensure<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
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

fn oom_or_device(op: &'static str, bytes: usize, e: cudarc::driver::DriverError) -> BackendError {
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

fn elementwise_cfg(total: usize) -> LaunchConfig {
    let blocks = total.div_ceil(THREADS as usize).clamp(1, 65_535) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaBackend {
    /// The backend on device `ordinal`; kernels compile (or load from the disk cache) now.
    pub fn new(ordinal: usize) -> Result<CudaBackend, CudaError> {
        let dev = GpuDevice::open(ordinal)?;
        dev.warm_up()?;
        let sms = dev
            .context()
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(CudaError::driver("reading the SM count"))? as u32;
        let smem_per_sm = dev
            .context()
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
            )
            .map_err(CudaError::driver("reading the shared memory per SM"))? as usize;
        Ok(CudaBackend {
            dev,
            sms,
            conv: ConvVersion::from_env()?,
            bn_fusion: bn_fusion_from_env()?,
            limits: GpuLimits {
                sms: sms as usize,
                smem_per_sm,
            },
            conv2: Arc::default(),
            work: Arc::default(),
            profiler: Arc::default(),
        })
    }

    /// Which convolution kernels this backend launches.
    pub fn conv_version(&self) -> ConvVersion {
        self.conv
    }

    /// Switches the convolution kernels (tests compare v1 and v2 on one device).
    pub fn set_conv_version(&mut self, version: ConvVersion) {
        self.conv = version;
    }

    /// The device.
    pub fn device(&self) -> &Arc<GpuDevice> {
        &self.dev
    }

    /// Waits for every queued op.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.dev.synchronize()
    }

    fn work(&self) -> std::sync::MutexGuard<'_, Workspace> {
        self.work.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `kernel` (one of launcher `K`'s) on the compute stream with `args`, timed when
    /// profiling is on.
    fn launch<K: Kernel>(
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

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Sums = CudaSums;

    fn alloc_sums(&self, len: usize) -> Result<CudaSums, BackendError> {
        bn_sync::alloc_sums(self, len)
    }

    fn sums_mut<'a>(&self, sums: &'a mut CudaSums) -> SumsMut<'a> {
        SumsMut::Device(sums)
    }

    fn bn_sync_moments(
        &self,
        shape: BnShape,
        mean: &CudaTensor,
        var: &CudaTensor,
        moments: &mut CudaSums,
    ) -> Result<(), BackendError> {
        bn_sync::moments(self, shape, mean, var, moments)
    }

    fn bn_sync_statistics(
        &self,
        channels: usize,
        moments: &mut CudaSums,
        mean: &mut CudaTensor,
        var: &mut CudaTensor,
        running_mean: &mut CudaTensor,
        running_var: &mut CudaTensor,
        momentum: f32,
    ) -> Result<(), BackendError> {
        bn_sync::statistics(
            self,
            channels,
            moments,
            mean,
            var,
            running_mean,
            running_var,
            momentum,
        )
    }

    fn bn_sync_grad_sums(
        &self,
        shape: BnShape,
        moments: &mut CudaSums,
        dgamma: &CudaTensor,
        dbeta: &CudaTensor,
        grads: &mut CudaSums,
    ) -> Result<(), BackendError> {
        bn_sync::grad_sums(self, shape, moments, dgamma, dbeta, grads)
    }

    fn bn_sync_backward(
        &self,
        grads: &mut CudaSums,
        a: BnSyncBackward<'_, CudaTensor>,
    ) -> Result<(), BackendError> {
        bn_sync::backward(self, grads, a)
    }

    fn name(&self) -> String {
        format!(
            "cuda:{} {} ({})",
            self.dev.context().ordinal(),
            self.dev.name(),
            self.dev.arch()
        )
    }

    fn alloc(&self, len: usize, role: TensorRole) -> Result<CudaTensor, BackendError> {
        let dtype = DType::for_role(role);
        let storage = if len == 0 {
            Storage::Empty
        } else {
            let stream = self.dev.stream();
            let bytes = len * dtype.size();
            self.dev.note_allocation(bytes);
            match dtype {
                DType::Bf16 => Storage::Bf16(
                    stream
                        .alloc_zeros::<u16>(len)
                        .map_err(|e| oom_or_device("alloc", bytes, e))?,
                ),
                DType::F32 => Storage::F32(
                    stream
                        .alloc_zeros::<f32>(len)
                        .map_err(|e| oom_or_device("alloc", bytes, e))?,
                ),
            }
        };
        Ok(CudaTensor {
            len,
            dtype,
            storage,
            view_of: None,
        })
    }

    fn alloc_views(
        &self,
        total: usize,
        ranges: &[std::ops::Range<usize>],
        role: TensorRole,
    ) -> Result<Option<(u64, Vec<CudaTensor>)>, BackendError> {
        let op = "alloc_views";
        if DType::for_role(role) != DType::F32 {
            return Err(BackendError::Shape {
                op,
                detail: format!("views are f32 ({role:?} is stored as bf16)"),
            });
        }
        if let Some(bad) = ranges.iter().find(|r| r.start > r.end || r.end > total) {
            return Err(BackendError::Shape {
                op,
                detail: format!("range {bad:?} is outside the {total}-element buffer"),
            });
        }
        let stream = self.dev.stream().clone();
        let arena = Arc::new(
            stream
                .alloc_zeros::<f32>(total.max(1))
                .map_err(|e| oom_or_device(op, 4 * total, e))?,
        );
        self.dev.note_allocation(4 * total.max(1));
        let base = {
            let (p, _record) = cudarc::driver::DevicePtr::device_ptr(&*arena, &stream);
            p
        };
        let views = ranges
            .iter()
            // SAFETY: every range lies inside the arena (checked above); the views and the
            // arena are used on this backend's one stream (or ordered by events).
            .map(|r| unsafe { CudaTensor::f32_view(&arena, &stream, r.start, r.len()) })
            .collect();
        Ok(Some((base, views)))
    }

    fn len(&self, t: &CudaTensor) -> usize {
        t.len
    }

    fn upload(&self, src: &[f32], dst: &mut CudaTensor) -> Result<(), BackendError> {
        if src.len() != dst.len {
            return Err(BackendError::Shape {
                op: "upload",
                detail: format!("{} values into a tensor of {}", src.len(), dst.len),
            });
        }
        let stream = self.dev.stream().clone();
        match &mut dst.storage {
            Storage::Empty => Ok(()),
            Storage::Bf16(d) => stream
                .memcpy_htod(&to_bf16_bits(src), d)
                .map_err(drv_err("upload")),
            Storage::F32(d) => stream.memcpy_htod(src, d).map_err(drv_err("upload")),
        }
    }

    fn download(&self, src: &CudaTensor) -> Result<Vec<f32>, BackendError> {
        let stream = self.dev.stream();
        let out = match &src.storage {
            Storage::Empty => Vec::new(),
            Storage::Bf16(s) => from_bf16_bits(&stream.clone_dtoh(s).map_err(drv_err("download"))?),
            Storage::F32(s) => stream.clone_dtoh(s).map_err(drv_err("download"))?,
        };
        stream.synchronize().map_err(drv_err("download"))?;
        Ok(out)
    }

    fn input(&self, batch: &InputBatch<'_>, out: &mut CudaTensor) -> Result<(), BackendError> {
        input::input(self, batch, out)
    }

    fn conv_forward(
        &self,
        s: &ConvShape,
        x: &CudaTensor,
        w: &CudaTensor,
        y: &mut CudaTensor,
    ) -> Result<(), BackendError> {
        conv::forward(self, s, x, w, y)
    }

    fn conv_backward_data(
        &self,
        s: &ConvShape,
        dy: &CudaTensor,
        w: &CudaTensor,
        dx: &mut CudaTensor,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        conv::backward_data(self, s, dy, w, dx, accumulate)
    }

    fn conv_backward_weight(
        &self,
        s: &ConvShape,
        x: &CudaTensor,
        dy: &CudaTensor,
        dw: &mut CudaTensor,
    ) -> Result<(), BackendError> {
        conv::backward_weight(self, s, x, dy, dw)
    }

    fn bn_fusion(&self) -> bool {
        // The epilogues are v2 kernels; with v1 the fused ops would only compose the passes.
        self.bn_fusion && self.conv == ConvVersion::V2
    }

    fn conv_forward_moments(
        &self,
        s: &ConvShape,
        x: &CudaTensor,
        w: &CudaTensor,
        y: &mut CudaTensor,
        moments: &mut CudaTensor,
    ) -> Result<(), BackendError> {
        bn_fused::conv_forward_moments(self, s, x, w, y, moments)
    }

    fn conv_backward_data_bn(
        &self,
        s: &ConvShape,
        dy: &CudaTensor,
        w: &CudaTensor,
        dx: &mut CudaTensor,
        accumulate: bool,
        bn: BnGradEpilogue<'_, CudaTensor>,
    ) -> Result<(), BackendError> {
        bn_fused::conv_backward_data_bn(self, s, dy, w, dx, accumulate, bn)
    }

    fn bn_forward(&self, a: BnForward<'_, CudaTensor>) -> Result<(), BackendError> {
        bn::forward(self, a)
    }

    fn bn_backward(&self, a: BnBackward<'_, CudaTensor>) -> Result<(), BackendError> {
        bn::backward(self, a)
    }

    fn maxpool_forward(
        &self,
        s: &PoolShape,
        x: &CudaTensor,
        y: &mut CudaTensor,
    ) -> Result<(), BackendError> {
        pool::max_forward(self, s, x, y)
    }

    fn maxpool_backward(
        &self,
        s: &PoolShape,
        x: &CudaTensor,
        dy: &CudaTensor,
        dx: &mut CudaTensor,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        pool::max_backward(self, s, x, dy, dx, accumulate)
    }

    fn gap_forward(
        &self,
        n: usize,
        hw: usize,
        c: usize,
        x: &CudaTensor,
        y: &mut CudaTensor,
    ) -> Result<(), BackendError> {
        pool::gap_forward(self, n, hw, c, x, y)
    }

    fn gap_backward(
        &self,
        n: usize,
        hw: usize,
        c: usize,
        dy: &CudaTensor,
        dx: &mut CudaTensor,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        pool::gap_backward(self, n, hw, c, dy, dx, accumulate)
    }

    fn linear_forward(
        &self,
        s: &LinearShape,
        x: &CudaTensor,
        w: &CudaTensor,
        b: &CudaTensor,
        y: &mut CudaTensor,
    ) -> Result<(), BackendError> {
        dense::linear_forward(self, s, x, w, b, y)
    }

    fn linear_backward(
        &self,
        s: &LinearShape,
        x: &CudaTensor,
        w: &CudaTensor,
        dy: &CudaTensor,
        dx: &mut CudaTensor,
        dw: &mut CudaTensor,
        db: &mut CudaTensor,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        dense::linear_backward(self, s, x, w, dy, dx, dw, db, accumulate)
    }

    fn softmax_cross_entropy(
        &self,
        n: usize,
        classes: usize,
        logits: &CudaTensor,
        targets: &Targets<'_>,
        dlogits: Option<&mut CudaTensor>,
        probs: Option<&mut Vec<f32>>,
    ) -> Result<LossStats, BackendError> {
        loss::softmax_cross_entropy(self, n, classes, logits, targets, dlogits, probs, None)
    }
}
