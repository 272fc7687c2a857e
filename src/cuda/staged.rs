//! [`StagedBackend`]: the CUDA backend of a training rank, reading its input batch from a
//! staging-ring device slot and leaving the step's loss figures on the device.
//!
//! [`crate::model::Network::train_step`] hands the backend's `input` op a host batch. On a
//! GPU rank the batch is already on the device (the staging ring uploaded it on the copy
//! stream while the previous step computed), so this wrapper's `input` runs the transform
//! kernel (kernels/input.cu: crop, flip, normalise → bf16 NHWC) straight from the slot set by
//! [`StagedBackend::set_staged`]; with no slot set (validation) it falls back to the wrapped
//! backend's host upload. Likewise, after [`StagedBackend::defer_loss`] the next loss op
//! writes its sums to a device address instead of returning them (no host synchronisation in
//! a step). Every other op is the wrapped [`CudaBackend`]'s.

use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::backend::{CudaSums, DeviceTotalsAt, StepInputs};
use super::kernel_types::{aug_ints, InputMix};
use super::launch::{launch, In, Kernel};
use super::launchers::InputTransform;
use super::{CudaBackend, CudaError, CudaTensor, GpuDevice};
use crate::backend::{
    AppliedBn, Backend, BackendError, BnBackward, BnForward, BnGradEpilogue, BnShape,
    BnSyncBackward, ConvShape, LinearShape, LossStats, PoolShape, Targets, TensorRole,
};
use crate::model::{InputBatch, IMAGENET_MEAN, IMAGENET_STD};

/// Threads per block of the input kernel (a grid-stride loop, as the backend launches it).
const THREADS: u32 = 256;

/// Where the current batch lies on the device.
#[derive(Debug, Clone, Copy)]
struct StagedInput {
    /// Raw device address of the slot.
    ptr: u64,
    /// Bytes valid at `ptr`.
    bytes: usize,
}

#[derive(Debug, Default)]
struct InputWork {
    norm: Option<CudaSlice<f32>>,
    aug: Option<CudaSlice<i32>>,
}

/// A [`CudaBackend`] whose `input` reads the staged device slot.
#[derive(Debug)]
pub struct StagedBackend {
    inner: CudaBackend,
    staged: Mutex<Option<StagedInput>>,
    deferred_loss: Mutex<Option<DeviceTotalsAt>>,
    work: Mutex<InputWork>,
}

fn drv(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> BackendError {
    move |source| BackendError::Device {
        op,
        source: Box::new(CudaError::Driver {
            context: op.to_string(),
            source,
        }),
    }
}

impl StagedBackend {
    /// Wraps `inner`.
    pub fn new(inner: CudaBackend) -> Self {
        StagedBackend {
            inner,
            staged: Mutex::new(None),
            deferred_loss: Mutex::new(None),
            work: Mutex::new(InputWork::default()),
        }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &CudaBackend {
        &self.inner
    }

    /// The device.
    pub fn device(&self) -> &Arc<GpuDevice> {
        self.inner.device()
    }

    /// The next `input` reads `bytes` at device address `ptr` instead of the host batch.
    ///
    /// # Safety
    /// `ptr` must address at least `bytes` bytes of this device's memory that stay allocated and
    /// unmodified until the kernels enqueued by the next `input` call have run (the staging ring
    /// guarantees this: the slot's `consumed` event is recorded after them).
    pub unsafe fn set_staged(&self, ptr: u64, bytes: usize) {
        *lock(&self.staged) = Some(StagedInput { ptr, bytes });
    }

    /// Back to host input (validation, inference), and loss figures returned to the host.
    pub fn clear_staged(&self) {
        *lock(&self.staged) = None;
        *lock(&self.deferred_loss) = None;
    }

    /// The next loss op writes (or adds) the step's figures (five f64: loss sum, top-1 hits,
    /// top-5 hits, rows, `stop`) to the device (see [`DeviceTotalsAt`]) and returns zeros
    /// instead of waiting for the GPU.
    ///
    /// # Safety
    /// `totals.addr` must address five f64 of this device's memory that stay allocated until
    /// the kernels queued by the next loss op have run.
    pub unsafe fn defer_loss(&self, totals: DeviceTotalsAt) {
        *lock(&self.deferred_loss) = Some(totals);
    }

    /// Uploads what the coming step reads from device memory (its augmentation, mixing,
    /// labels, the loss's mixing weight and the stop wish) before it is captured or
    /// replayed; its ops then upload nothing until [`StagedBackend::end_preload`]. `batch`
    /// and `smoothing` are what the step's `input` and loss ops would be given.
    pub fn preload_step(
        &self,
        batch: &InputBatch<'_>,
        smoothing: f32,
        stop: bool,
    ) -> Result<(), BackendError> {
        let op = "preload step values";
        let (params, _) = aug_params(batch, op)?;
        let stream = self.inner.device().stream().clone();
        {
            let mut work = lock(&self.work);
            ensure_aug(&mut work, &stream, params.len(), batch.len, op)?;
            let aug = work.aug.as_mut().expect("allocated above");
            stream
                .memcpy_htod(&params, &mut aug.slice_mut(0..params.len()))
                .map_err(drv(op))?;
        }
        let targets = Targets::of_batch(batch, smoothing);
        self.inner.preload_step(&StepInputs {
            labels: targets.labels,
            own_weight: targets.own_weight,
            stop,
            mix: InputMix::of(batch.mix),
        })
    }

    /// Back to each op uploading its own values (after a captured or replayed step).
    pub fn end_preload(&self) {
        self.inner.end_preload();
    }

    fn input_from_slot(
        &self,
        slot: StagedInput,
        batch: &InputBatch<'_>,
        out: &mut CudaTensor,
    ) -> Result<(), BackendError> {
        let op = "input (staged)";
        let s = batch.image_size as usize;
        let n = batch.len;
        let bytes = n * s * s * 3;
        let shape = |detail: String| BackendError::Shape { op, detail };
        if slot.bytes < bytes {
            return Err(shape(format!(
                "the staged slot holds {} bytes, the batch needs {bytes}",
                slot.bytes
            )));
        }
        if out.len() < bytes {
            return Err(shape(format!(
                "output has {} elements, needs {bytes}",
                out.len()
            )));
        }
        let to_i32 = |what: &str, v: usize| {
            i32::try_from(v).map_err(|_| shape(format!("{what} = {v} exceeds 32-bit indexing")))
        };
        let (n_i, s_i) = (to_i32("n", n)?, to_i32("image size", s)?);
        let dev = self.inner.device();
        let stream = dev.stream().clone();
        // A captured or replayed step's augmentation and mixing were uploaded before it
        // (`preload_step`): nothing is uploaded inside a capture.
        let preloaded = self.inner.step_preloaded();
        let mix_at = self.inner.step_mix(op, InputMix::of(batch.mix))?;
        let mut work = lock(&self.work);
        if work.norm.is_none() {
            let norm: Vec<f32> = (0..3)
                .map(|c| 1.0 / (255.0 * IMAGENET_STD[c]))
                .chain((0..3).map(|c| -IMAGENET_MEAN[c] / IMAGENET_STD[c]))
                .collect();
            work.norm = Some(stream.clone_htod(&norm).map_err(drv(op))?);
        }
        let (params, use_aug) = aug_params(batch, op)?;
        ensure_aug(&mut work, &stream, params.len(), n, op)?;
        let InputWork { norm, aug } = &mut *work;
        let aug = aug.as_mut().expect("allocated above");
        if !preloaded {
            stream
                .memcpy_htod(&params, &mut aug.slice_mut(0..params.len()))
                .map_err(drv(op))?;
        }
        let norm = norm.as_ref().expect("allocated above");
        let (scale, shift) = (norm.slice(0..3), norm.slice(3..6));
        let dst = out.bf16_slice_mut().ok_or_else(|| {
            shape("the input tensor must be bf16 (TensorRole::Activation)".into())
        })?;
        let f = dev
            .function(InputTransform::FILE, "input_transform")
            .map_err(|e| BackendError::Device {
                op,
                source: Box::new(e),
            })?;
        let blocks = bytes.div_ceil(THREADS as usize).clamp(1, 65_535) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = InputTransform {
            // SAFETY: `slot.ptr` addresses `slot.bytes >= bytes` live bytes (set_staged's
            // contract).
            src: unsafe { In::addr(slot.ptr) },
            aug: (&*aug).into(),
            use_aug,
            scale: (&scale).into(),
            shift: (&shift).into(),
            // SAFETY: the step's mix buffer (one InputMix), alive with the backend.
            mix: unsafe { In::addr(mix_at) },
            dst: dst.into(),
            n: n_i,
            size: s_i,
        };
        // SAFETY: `f` is the launcher's kernel; `src` holds `bytes` pixels, `dst` at least
        // `bytes` elements, `aug` 7 ints per image when `use_aug` is 1.
        unsafe { launch(&stream, &f, cfg, args) }.map_err(drv(op))?;
        Ok(())
    }
}

/// The batch's augmentation as kernels/input.cu's `aug` ints, and `use_aug`.
fn aug_params(batch: &InputBatch<'_>, op: &'static str) -> Result<(Vec<i32>, i32), BackendError> {
    let n = batch.len;
    match batch.augment {
        Some(aug) if aug.len() >= n => Ok((aug[..n].iter().flat_map(aug_ints).collect(), 1)),
        Some(aug) => Err(BackendError::Shape {
            op,
            detail: format!("{} augmentations for {n} images", aug.len()),
        }),
        None => Ok((vec![0], 0)),
    }
}

/// Grows the augmentation buffer to `len` ints (at least 7 per image of `n`).
fn ensure_aug(
    work: &mut InputWork,
    stream: &Arc<cudarc::driver::CudaStream>,
    len: usize,
    n: usize,
    op: &'static str,
) -> Result<(), BackendError> {
    if work.aug.as_ref().is_none_or(|a| a.len() < len) {
        work.aug = None;
        work.aug = Some(
            stream
                .alloc_zeros::<i32>(len.max(7 * n).max(1))
                .map_err(drv(op))?,
        );
    }
    Ok(())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Backend for StagedBackend {
    type Tensor = CudaTensor;
    type Sums = CudaSums;

    fn alloc_sums(&self, len: usize) -> Result<CudaSums, BackendError> {
        self.inner.alloc_sums(len)
    }
    fn sums_mut<'a>(&self, sums: &'a mut CudaSums) -> crate::backend::SumsMut<'a> {
        self.inner.sums_mut(sums)
    }
    fn bn_sync_moments(
        &self,
        shape: BnShape,
        mean: &CudaTensor,
        var: &CudaTensor,
        moments: &mut CudaSums,
    ) -> Result<(), BackendError> {
        self.inner.bn_sync_moments(shape, mean, var, moments)
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
        self.inner.bn_sync_statistics(
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
        self.inner
            .bn_sync_grad_sums(shape, moments, dgamma, dbeta, grads)
    }
    fn bn_sync_backward(
        &self,
        grads: &mut CudaSums,
        a: BnSyncBackward<'_, CudaTensor>,
    ) -> Result<(), BackendError> {
        self.inner.bn_sync_backward(grads, a)
    }

    fn name(&self) -> String {
        format!("{} · staged input", self.inner.name())
    }
    fn alloc(&self, len: usize, role: TensorRole) -> Result<CudaTensor, BackendError> {
        self.inner.alloc(len, role)
    }
    fn alloc_views(
        &self,
        total: usize,
        ranges: &[std::ops::Range<usize>],
        role: TensorRole,
    ) -> Result<Option<crate::backend::GradientViews<CudaTensor>>, BackendError> {
        self.inner.alloc_views(total, ranges, role)
    }
    fn keep_relu_signs(&self, y: &mut CudaTensor) -> Result<(), BackendError> {
        self.inner.keep_relu_signs(y)
    }
    fn len(&self, t: &CudaTensor) -> usize {
        self.inner.len(t)
    }
    fn upload(&self, src: &[f32], dst: &mut CudaTensor) -> Result<(), BackendError> {
        self.inner.upload(src, dst)
    }
    fn download(&self, src: &CudaTensor) -> Result<Vec<f32>, BackendError> {
        self.inner.download(src)
    }
    fn input(&self, batch: &InputBatch<'_>, out: &mut CudaTensor) -> Result<(), BackendError> {
        // Taken, not copied: a slot serves exactly one step.
        let staged = lock(&self.staged).take();
        match staged {
            Some(slot) => self.input_from_slot(slot, batch, out),
            None => self.inner.input(batch, out),
        }
    }
    fn conv_forward(
        &self,
        s: &ConvShape,
        x: &CudaTensor,
        w: &CudaTensor,
        y: &mut CudaTensor,
    ) -> Result<(), BackendError> {
        self.inner.conv_forward(s, x, w, y)
    }
    fn conv_backward_data(
        &self,
        s: &ConvShape,
        dy: &CudaTensor,
        w: &CudaTensor,
        dx: &mut CudaTensor,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        self.inner.conv_backward_data(s, dy, w, dx, accumulate)
    }
    fn conv_backward_weight(
        &self,
        s: &ConvShape,
        x: &CudaTensor,
        dy: &CudaTensor,
        dw: &mut CudaTensor,
    ) -> Result<(), BackendError> {
        self.inner.conv_backward_weight(s, x, dy, dw)
    }
    fn bn_fusion(&self) -> bool {
        self.inner.bn_fusion()
    }
    fn conv_applies_bn(&self) -> bool {
        self.inner.conv_applies_bn()
    }
    fn conv_forward_moments(
        &self,
        s: &ConvShape,
        x: &CudaTensor,
        w: &CudaTensor,
        y: &mut CudaTensor,
        moments: &mut CudaTensor,
    ) -> Result<(), BackendError> {
        self.inner.conv_forward_moments(s, x, w, y, moments)
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
        self.inner.conv_forward_bn(s, z, bn, w, y, moments)
    }
    fn conv_backward_weight_bn(
        &self,
        s: &ConvShape,
        z: &CudaTensor,
        bn: &AppliedBn<'_, CudaTensor>,
        dy: &CudaTensor,
        dw: &mut CudaTensor,
    ) -> Result<(), BackendError> {
        self.inner.conv_backward_weight_bn(s, z, bn, dy, dw)
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
        self.inner
            .conv_backward_data_bn(s, dy, w, dx, accumulate, bn)
    }
    fn bn_forward(&self, a: BnForward<'_, CudaTensor>) -> Result<(), BackendError> {
        self.inner.bn_forward(a)
    }
    fn bn_backward(&self, a: BnBackward<'_, CudaTensor>) -> Result<(), BackendError> {
        self.inner.bn_backward(a)
    }
    fn maxpool_forward(
        &self,
        s: &PoolShape,
        x: &CudaTensor,
        y: &mut CudaTensor,
    ) -> Result<(), BackendError> {
        self.inner.maxpool_forward(s, x, y)
    }
    fn maxpool_backward(
        &self,
        s: &PoolShape,
        x: &CudaTensor,
        dy: &CudaTensor,
        dx: &mut CudaTensor,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        self.inner.maxpool_backward(s, x, dy, dx, accumulate)
    }
    fn maxpool_bn_forward(
        &self,
        s: &PoolShape,
        z: &CudaTensor,
        bn: &AppliedBn<'_, CudaTensor>,
        y: &mut CudaTensor,
    ) -> Result<(), BackendError> {
        self.inner.maxpool_bn_forward(s, z, bn, y)
    }
    #[allow(clippy::too_many_arguments)]
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
        self.inner
            .maxpool_bn_backward(s, z, bn, dy, g, dgamma, dbeta)
    }
    fn gap_forward(
        &self,
        n: usize,
        hw: usize,
        c: usize,
        x: &CudaTensor,
        y: &mut CudaTensor,
    ) -> Result<(), BackendError> {
        self.inner.gap_forward(n, hw, c, x, y)
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
        self.inner.gap_backward(n, hw, c, dy, dx, accumulate)
    }
    fn linear_forward(
        &self,
        s: &LinearShape,
        x: &CudaTensor,
        w: &CudaTensor,
        b: &CudaTensor,
        y: &mut CudaTensor,
    ) -> Result<(), BackendError> {
        self.inner.linear_forward(s, x, w, b, y)
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
        self.inner
            .linear_backward(s, x, w, dy, dx, dw, db, accumulate)
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
        // Taken, not copied: one step's figures per `defer_loss`.
        let deferred = lock(&self.deferred_loss).take();
        match (deferred, probs) {
            (Some(totals), None) => {
                // SAFETY: `defer_loss`'s contract.
                unsafe {
                    self.inner.softmax_cross_entropy_on_device(
                        n, classes, logits, targets, dlogits, totals,
                    )
                }?;
                Ok(LossStats::default())
            }
            (_, probs) => self
                .inner
                .softmax_cross_entropy(n, classes, logits, targets, dlogits, probs),
        }
    }
}
