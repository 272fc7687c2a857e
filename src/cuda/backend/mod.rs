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
//! convolutions), `conv3.rs` (the Hopper convolutions), `pool.rs`, `dense.rs` (the classifier head), `loss.rs`, `input.rs` and
//! `profile.rs` (`--breakdown`'s per-launch timing), with what they share in `base.rs` (the
//! backend's state, the checks, the one launch path every kernel takes with its typed
//! launcher from `src/cuda/launchers.rs`); this file opens the backend, holds its memory ops
//! and the [`Backend`] implementation that hands each op to its family.

use std::sync::Arc;

use super::bn_mask::MaskSource;
use super::conv::{ConvVersion, GpuLimits};
use super::conv3_schedule::TileSchedule;
use super::device::GpuDevice;
use super::error::CudaError;
use super::tensor::{from_bf16_bits, to_bf16_bits, CudaTensor, DType, Storage};
use crate::backend::{
    AppliedBn, Backend, BackendError, BnBackward, BnForward, BnGradEpilogue, BnShape,
    BnSyncBackward, ConvShape, LinearShape, LossStats, PoolShape, SumsMut, Targets, TensorRole,
};
use crate::model::InputBatch;

mod base;
mod bn;
mod bn_fused;
mod bn_sync;
mod conv;
mod conv3;
mod conv_bn;
mod dense;
mod input;
mod loss;
mod pool;
mod profile;
mod step_values;

pub use base::CudaBackend;
use base::{drv_err, oom_or_device};
pub use bn_fused::{bn_fusion_from_env, parse_bn_fusion, BN_FUSION_ENV};
pub use bn_sync::CudaSums;
pub use conv_bn::{parse_bn_prologue, BN_PROLOGUE_ENV};
pub use loss::DeviceTotalsAt;
pub use profile::KernelTime;
pub(crate) use step_values::StepInputs;

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
        let conv = ConvVersion::from_env(dev.arch())?;
        if conv == ConvVersion::V3 && !crate::cuda::conv3::runs_on(dev.arch()) {
            warn_v3_elsewhere(dev.arch());
        }
        Ok(CudaBackend {
            dev,
            sms,
            conv,
            conv3_tiles: TileSchedule::from_env()?,
            bn_mask: MaskSource::from_env()?,
            bn_fusion: bn_fusion_from_env()?,
            bn_prologue: conv_bn::parse_bn_prologue(
                std::env::var(conv_bn::BN_PROLOGUE_ENV).ok().as_deref(),
            )?,
            limits: GpuLimits {
                sms: sms as usize,
                smem_per_sm,
            },
            conv2: Arc::default(),
            work: Arc::default(),
            applied: Arc::default(),
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

    /// How the v3 GEMMs of 128-column tiles walk their tiles.
    pub fn conv3_tiles(&self) -> TileSchedule {
        self.conv3_tiles
    }

    /// Switches the v3 tile schedule (tests compare the schedules on one device, bit for bit).
    pub fn set_conv3_tiles(&mut self, schedule: TileSchedule) {
        self.conv3_tiles = schedule;
    }

    /// Where the fused data gradients take an inner batch norm's ReLU mask from.
    pub fn bn_mask(&self) -> MaskSource {
        self.bn_mask
    }

    /// Switches the mask's source (tests compare both on one device, bit for bit).
    pub fn set_bn_mask(&mut self, source: MaskSource) {
        self.bn_mask = source;
    }
}

/// Says once per process that `BIRDTRAIN_CONV=v3` asked for kernels this GPU cannot run, so
/// that a timing of "v3" on it is not mistaken for one (every layer then runs v2).
fn warn_v3_elsewhere(arch: crate::cuda::arch::GpuArch) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        tracing::warn!(
            "{}=v3 needs a Hopper GPU (compute capability 9.0); this one is {arch}: every convolution runs the v2 kernels (hint: unset {} on this GPU)",
            crate::cuda::conv::CONV_ENV,
            crate::cuda::conv::CONV_ENV
        );
    });
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
        Ok(CudaTensor::new(len, dtype, storage))
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

    /// With `BIRDTRAIN_BN_MASK=packed` and v3, a byte per 8 elements beside `y` for its packed
    /// signs (`bn_apply_signs_vec` writes them, the v3 data gradients read them).
    fn keep_relu_signs(&self, y: &mut CudaTensor) -> Result<(), BackendError> {
        // v3's data gradients alone read them (v2's read y).
        let reads = self.conv == ConvVersion::V3 && self.bn_mask.packs();
        if !reads || y.dtype != DType::Bf16 || y.len % 8 != 0 || y.len == 0 {
            return Ok(());
        }
        let bytes = y.len / 8;
        self.dev.note_allocation(bytes);
        let bits = self
            .dev
            .stream()
            .alloc_zeros::<u8>(bytes)
            .map_err(|e| oom_or_device("alloc", bytes, e))?;
        y.attach_signs(bits);
        Ok(())
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
        dst.stale_signs();
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
        // The epilogues are v2 (and v3) kernels; with v1 the fused ops would only compose the
        // passes.
        self.bn_fusion && self.conv != ConvVersion::V1
    }

    fn conv_applies_bn(&self) -> bool {
        self.bn_prologue && self.bn_fusion()
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

    fn conv_forward_bn(
        &self,
        s: &ConvShape,
        z: &CudaTensor,
        bn: &AppliedBn<'_, CudaTensor>,
        w: &CudaTensor,
        y: &mut CudaTensor,
        moments: Option<&mut CudaTensor>,
    ) -> Result<(), BackendError> {
        conv_bn::forward(self, s, z, bn, w, y, moments)
    }

    fn conv_backward_weight_bn(
        &self,
        s: &ConvShape,
        z: &CudaTensor,
        bn: &AppliedBn<'_, CudaTensor>,
        dy: &CudaTensor,
        dw: &mut CudaTensor,
    ) -> Result<(), BackendError> {
        conv_bn::backward_weight(self, s, z, bn, dy, dw)
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

    fn maxpool_bn_forward(
        &self,
        s: &PoolShape,
        z: &CudaTensor,
        bn: &AppliedBn<'_, CudaTensor>,
        y: &mut CudaTensor,
    ) -> Result<(), BackendError> {
        pool::max_bn_forward(self, s, z, bn, y)
    }

    fn maxpool_bn_backward(
        &self,
        s: &PoolShape,
        z: &CudaTensor,
        bn: &AppliedBn<'_, CudaTensor>,
        dy: &CudaTensor,
        g: &mut CudaTensor,
        dgamma: &mut CudaTensor,
        dbeta: &mut CudaTensor,
    ) -> Result<(), BackendError> {
        pool::max_bn_backward(self, s, z, bn, dy, g, (dgamma, dbeta))
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
