//! The CPU backend: f32 everywhere, NHWC activations, OHWI convolution weights,
//! multithreaded on its own rayon pool, vectorised for the processor it runs on.
//!
//! - Convolutions: 3×3, 7×7 and strided ones by direct kernels (`direct.rs`: register-tiled,
//!   padded taps skipped, no im2col); 1×1 stride-1 ones are one GEMM (the `gemm` crate).
//! - Batch norm: vectorised, branch-free passes (`bn.rs`).
//! - Vector width: chosen at run time ([`SimdLevel`]: AVX-512, AVX2 + FMA, or portable), one
//!   generic implementation of each kernel instantiated per level.
//! - [`CpuBackend::reference`] runs the plain versions instead (im2col + GEMM convolutions,
//!   f64 batch-norm reductions): the reference the fast kernels and the GPU kernels are
//!   checked against (`backend::conformance`).
//!
//! Deterministic: the same inputs give the same bits run to run, and for any thread count
//! (fixed work partitions; reductions in fixed blocks combined in a fixed order).
//! [`CpuOptimizer`] updates the parameters in place; [`CpuBackend::set_profiling`] times
//! every op (`bench step --breakdown`).

mod applied_bn;
mod bn;
mod bn_fused;
mod bn_ref;
mod conv;
mod dense;
mod direct;
mod gemm;
mod input;
mod optim;
mod pool;
mod pool_bn;
mod profile;
mod simd;
mod threads;

use std::sync::{Arc, Mutex, MutexGuard};

pub use optim::{CpuOptimizer, UpdateRule};
pub use profile::OpTime;
pub use simd::{SimdLevel, SIMD_ENV};
pub(crate) use threads::start_pool;

use super::error::{check_len, missing_mask};
use super::{
    bn_sync, AppliedBn, Backend, BackendError, BnBackward, BnForward, BnGradEpilogue, BnMode,
    BnSyncBackward, ConvShape, LinearShape, LossStats, PoolShape, Targets, TensorRole,
};
use crate::model::InputBatch;

/// Which implementations a [`CpuBackend`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernels {
    /// Direct convolutions and vectorised batch norm at the backend's [`SimdLevel`].
    Fast,
    /// im2col + GEMM convolutions and f64 batch-norm reductions: the reference.
    Reference,
}

/// Buffers reused across calls (steady-state steps allocate nothing).
#[derive(Debug, Default)]
struct Scratch {
    /// im2col columns.
    cols: Vec<f32>,
    /// Packed forward weights.
    packed: Vec<f32>,
    /// Weight-gradient partial sums.
    partials: Vec<f32>,
}

/// The CPU backend. Cheap to clone (clones share the thread pool and the convolution plans,
/// not the scratch buffers).
pub struct CpuBackend {
    pool: Arc<rayon::ThreadPool>,
    threads: usize,
    level: SimdLevel,
    kernels: Kernels,
    scratch: Arc<Mutex<Scratch>>,
    plans: Arc<direct::PlanCache>,
    profiler: Arc<profile::Profiler>,
    /// Whether networks run batch norm fused into the convolutions ([`Backend::bn_fusion`]).
    bn_fusion: bool,
    /// Whether their convolutions also apply the batch norm they read
    /// ([`Backend::conv_applies_bn`]).
    conv_applies_bn: bool,
    /// Whether the fused data gradients recompute the ReLU's mask of a batch norm whose output
    /// is ReLU(BN(x)) alone instead of reading that output.
    recompute_masks: bool,
}

impl Clone for CpuBackend {
    fn clone(&self) -> Self {
        CpuBackend {
            pool: Arc::clone(&self.pool),
            threads: self.threads,
            level: self.level,
            kernels: self.kernels,
            scratch: Arc::default(),
            plans: Arc::clone(&self.plans),
            profiler: Arc::clone(&self.profiler),
            bn_fusion: self.bn_fusion,
            conv_applies_bn: self.conv_applies_bn,
            recompute_masks: self.recompute_masks,
        }
    }
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("threads", &self.threads)
            .field("level", &self.level)
            .field("kernels", &self.kernels)
            .field("bn_fusion", &self.bn_fusion)
            .field("conv_applies_bn", &self.conv_applies_bn)
            .finish()
    }
}

impl CpuBackend {
    /// A backend running on `threads` threads (0: one per available core), with the fast
    /// kernels at the widest vector width the processor has (or `BIRDTRAIN_CPU_SIMD`'s; an
    /// invalid or unsupported value is an error naming it).
    pub fn new(threads: usize) -> Result<CpuBackend, BackendError> {
        CpuBackend::with_options(threads, SimdLevel::detect()?, Kernels::Fast)
    }

    /// The reference backend: im2col + GEMM convolutions, f64 batch-norm reductions,
    /// portable loops. What the fast kernels and the GPU kernels are checked against.
    pub fn reference(threads: usize) -> Result<CpuBackend, BackendError> {
        CpuBackend::with_options(threads, SimdLevel::Portable, Kernels::Reference)
    }

    /// A backend with the given vector width and kernels (an unsupported level is an error).
    pub fn with_options(
        threads: usize,
        level: SimdLevel,
        kernels: Kernels,
    ) -> Result<CpuBackend, BackendError> {
        if !level.supported() {
            return Err(BackendError::InvalidInput {
                op: "CpuBackend::new",
                detail: format!(
                    "this processor lacks {level} (hint: use {} or lower)",
                    SimdLevel::best()
                ),
            });
        }
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        let pool = start_pool(threads, "cpu-backend")?;
        Ok(CpuBackend {
            pool: Arc::new(pool),
            threads,
            level,
            kernels,
            scratch: Arc::default(),
            plans: Arc::default(),
            profiler: Arc::default(),
            bn_fusion: false,
            conv_applies_bn: false,
            recompute_masks: false,
        })
    }

    /// Makes networks built on this backend run batch norm fused into the convolutions
    /// (`true`) or not (`false`, the default): the CUDA backend's fused sequence with the
    /// reductions computed after each convolution (`bn_fused.rs`), so the sequence can be
    /// checked against the unfused one without a GPU. It saves nothing on the CPU.
    pub fn set_bn_fusion(&mut self, on: bool) {
        self.bn_fusion = on;
    }

    /// With batch norm fused, makes the convolutions also apply the batch norm whose output
    /// they alone read, as they read its input (`true`), so that output is never stored, or
    /// not (`false`, the default): the CUDA backend's `BIRDTRAIN_BN_PROLOGUE` sequence,
    /// computed here through a scratch output (`applied_bn.rs`), to be checked without a GPU.
    pub fn set_conv_applies_bn(&mut self, on: bool) {
        self.conv_applies_bn = on;
    }

    /// With batch norm fused, makes the data gradients recompute the ReLU's mask of a batch
    /// norm whose output is ReLU(BN(x)) alone from its input (`true`,
    /// [`BnGradEpilogue::y_recomputable`]) instead of reading the stored output (`false`, the
    /// default): the CUDA backend's `BIRDTRAIN_BN_MASK=recomputed`, to be checked without a
    /// GPU (a mask recomputed where a residual entered the output would be wrong).
    pub fn set_recompute_masks(&mut self, on: bool) {
        self.recompute_masks = on;
    }

    fn scratch(&self) -> MutexGuard<'_, Scratch> {
        // A poisoned lock only means an earlier op panicked mid-write; the buffers are scratch.
        self.scratch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Threads in the pool.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The vector width the kernels run at.
    pub fn simd_level(&self) -> SimdLevel {
        self.level
    }

    /// Which kernels run.
    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    /// Starts (`true`) or stops timing every op; clones share the timings.
    pub fn set_profiling(&self, on: bool) {
        self.profiler.set(on);
    }

    /// The per-op timings recorded so far (first-seen order), clearing them.
    pub fn take_profile(&self) -> Vec<OpTime> {
        self.profiler.take()
    }

    /// Whether `s` runs on the direct kernels (everything but 1×1 stride-1 convolutions,
    /// which are one GEMM) with this backend's kernels.
    fn direct(&self, s: &ConvShape) -> bool {
        self.kernels == Kernels::Fast && !conv::is_pointwise(s)
    }
}

/// The kernel-kind label under which [`CpuBackend::set_profiling`] times a convolution pass
/// (`conv_fwd 3x3/2`): `op`, the kernel size, and the stride when it is not 1.
pub fn conv_kind(op: &str, s: &ConvShape) -> String {
    if s.stride == 1 {
        format!("{op} {k}x{k}", k = s.kernel)
    } else {
        format!("{op} {k}x{k}/{st}", k = s.kernel, st = s.stride)
    }
}

impl Backend for CpuBackend {
    type Tensor = Vec<f32>;
    type Sums = Vec<f64>;

    fn alloc_sums(&self, len: usize) -> Result<Vec<f64>, BackendError> {
        Ok(vec![0.0; len])
    }

    fn sums_mut<'a>(&self, sums: &'a mut Vec<f64>) -> crate::backend::SumsMut<'a> {
        crate::backend::SumsMut::Host(sums)
    }

    fn name(&self) -> String {
        match self.kernels {
            Kernels::Fast => format!("cpu ({} threads, {})", self.threads, self.level),
            Kernels::Reference => format!("cpu reference ({} threads)", self.threads),
        }
    }

    fn alloc(&self, len: usize, _role: TensorRole) -> Result<Vec<f32>, BackendError> {
        let mut v = Vec::new();
        crate::oom::fallible(|| v.try_reserve_exact(len)).map_err(|_| {
            BackendError::OutOfMemory {
                bytes: len * 4,
                what: "a CPU tensor".into(),
                hint: "use a smaller --batch-size or --image-size".into(),
            }
        })?;
        v.resize(len, 0.0);
        Ok(v)
    }

    /// Host tensors are separate vectors: no views (the trainer copies gradients out).
    fn alloc_views(
        &self,
        _total: usize,
        _ranges: &[std::ops::Range<usize>],
        _role: TensorRole,
    ) -> Result<Option<super::GradientViews<Vec<f32>>>, BackendError> {
        Ok(None)
    }

    /// The CPU reads y for the mask: nothing to keep.
    fn keep_relu_signs(&self, _y: &mut Vec<f32>) -> Result<(), BackendError> {
        Ok(())
    }
    fn len(&self, t: &Vec<f32>) -> usize {
        t.len()
    }

    fn upload(&self, src: &[f32], dst: &mut Vec<f32>) -> Result<(), BackendError> {
        if src.len() != dst.len() {
            return Err(BackendError::Shape {
                op: "upload",
                detail: format!("{} values into a tensor of {}", src.len(), dst.len()),
            });
        }
        dst.copy_from_slice(src);
        Ok(())
    }

    fn download(&self, src: &Vec<f32>) -> Result<Vec<f32>, BackendError> {
        Ok(src.clone())
    }

    fn input(&self, batch: &InputBatch<'_>, out: &mut Vec<f32>) -> Result<(), BackendError> {
        let s = batch.image_size as usize;
        check_len("input", "pixels", batch.pixels.len(), batch.len * s * s * 3)?;
        check_len("input", "output", out.len(), batch.len * s * s * 3)?;
        if let Some(a) = batch.augment {
            check_len("input", "augment", a.len(), batch.len)?;
        }
        let _t = self.profiler.time(
            || "input".into(),
            0.0,
            (batch.pixels.len() + 4 * out.len().min(batch.pixels.len())) as f64,
        );
        self.pool.install(|| input::normalise(batch, out));
        Ok(())
    }

    fn conv_forward(
        &self,
        s: &ConvShape,
        x: &Vec<f32>,
        w: &Vec<f32>,
        y: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        check_conv("conv_forward", s)?;
        check_len("conv_forward", "x", x.len(), s.x_len())?;
        check_len("conv_forward", "w", w.len(), s.w_len())?;
        check_len("conv_forward", "y", y.len(), s.y_len())?;
        let bytes = 4.0 * (s.x_len() + s.w_len() + s.y_len()) as f64;
        let _t = self
            .profiler
            .time(|| conv_kind("conv_fwd", s), s.flops(), bytes);
        let mut guard = self.scratch();
        let scratch = &mut *guard;
        if self.direct(s) {
            let plans = &self.plans;
            self.pool.install(|| {
                direct::forward(
                    self.level,
                    self.threads,
                    plans,
                    s,
                    x,
                    w,
                    y,
                    &mut scratch.packed,
                )
            });
        } else {
            self.pool
                .install(|| conv::forward(s, x, w, y, self.threads, &mut scratch.cols));
        }
        Ok(())
    }

    fn conv_backward_data(
        &self,
        s: &ConvShape,
        dy: &Vec<f32>,
        w: &Vec<f32>,
        dx: &mut Vec<f32>,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        check_conv("conv_backward_data", s)?;
        check_len("conv_backward_data", "dy", dy.len(), s.y_len())?;
        check_len("conv_backward_data", "w", w.len(), s.w_len())?;
        check_len("conv_backward_data", "dx", dx.len(), s.x_len())?;
        let bytes = 4.0 * (s.x_len() * (1 + accumulate as usize) + s.w_len() + s.y_len()) as f64;
        let _t = self
            .profiler
            .time(|| conv_kind("conv_dgrad", s), s.flops(), bytes);
        let mut guard = self.scratch();
        let scratch = &mut *guard;
        if self.direct(s) {
            let plans = &self.plans;
            self.pool.install(|| {
                direct::backward_data(
                    self.level,
                    self.threads,
                    plans,
                    s,
                    dy,
                    w,
                    dx,
                    accumulate,
                    &mut scratch.packed,
                )
            });
        } else {
            self.pool.install(|| {
                conv::backward_data(s, dy, w, dx, accumulate, self.threads, &mut scratch.cols)
            });
        }
        Ok(())
    }

    fn conv_backward_weight(
        &self,
        s: &ConvShape,
        x: &Vec<f32>,
        dy: &Vec<f32>,
        dw: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        check_conv("conv_backward_weight", s)?;
        check_len("conv_backward_weight", "x", x.len(), s.x_len())?;
        check_len("conv_backward_weight", "dy", dy.len(), s.y_len())?;
        check_len("conv_backward_weight", "dw", dw.len(), s.w_len())?;
        let bytes = 4.0 * (s.x_len() + s.w_len() + s.y_len()) as f64;
        let _t = self
            .profiler
            .time(|| conv_kind("conv_wgrad", s), s.flops(), bytes);
        let mut guard = self.scratch();
        let scratch = &mut *guard;
        if self.direct(s) {
            let plans = &self.plans;
            let partials = &mut scratch.partials;
            self.pool.install(|| {
                direct::backward_weight(self.level, self.threads, plans, s, x, dy, dw, partials)
            });
        } else {
            self.pool
                .install(|| conv::backward_weight(s, x, dy, dw, self.threads, &mut scratch.cols));
        }
        Ok(())
    }

    fn bn_fusion(&self) -> bool {
        self.bn_fusion
    }

    fn conv_applies_bn(&self) -> bool {
        self.bn_fusion && self.conv_applies_bn
    }

    fn conv_forward_moments(
        &self,
        s: &ConvShape,
        x: &Vec<f32>,
        w: &Vec<f32>,
        y: &mut Vec<f32>,
        moments: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        check_len(
            "conv_forward_moments",
            "moments",
            moments.len(),
            3 * s.c_out,
        )?;
        self.conv_forward(s, x, w, y)?;
        let rows = s.n * s.out_h() * s.out_w();
        let _t = self
            .profiler
            .time(|| "bn_moments".into(), 0.0, 4.0 * (rows * s.c_out) as f64);
        self.pool
            .install(|| bn_fused::moments(y, rows, s.c_out, moments));
        Ok(())
    }

    fn conv_backward_data_bn(
        &self,
        s: &ConvShape,
        dy: &Vec<f32>,
        w: &Vec<f32>,
        dx: &mut Vec<f32>,
        accumulate: bool,
        bn: BnGradEpilogue<'_, Vec<f32>>,
    ) -> Result<(), BackendError> {
        let op = "conv_backward_data_bn";
        let (rows, c) = (s.n * s.h * s.w, s.c_in);
        check_len(op, "x", bn.x.len(), rows * c)?;
        if let Some(y) = bn.y {
            check_len(op, "y", y.len(), rows * c)?;
        }
        if let Some(r) = bn.residual_grad {
            check_len(op, "residual_grad", r.len(), rows * c)?;
        }
        for (name, len) in [
            ("saved_mean", bn.saved_mean.len()),
            ("saved_invstd", bn.saved_invstd.len()),
            ("gamma", bn.gamma.len()),
            ("beta", bn.beta.len()),
            ("dgamma", bn.dgamma.len()),
            ("dbeta", bn.dbeta.len()),
        ] {
            check_len(op, name, len, c)?;
        }
        self.conv_backward_data(s, dy, w, dx, accumulate)?;
        let stored = if self.recompute_masks && bn.y_recomputable {
            None
        } else {
            bn.y
        };
        // Never stored (the convolution applied the batch norm), or not read: the mask's source
        // recomputed.
        let recomputed = match (stored, bn.relu) {
            (None, true) => {
                let _t = self.profiler.time(|| "bn_apply".into(), 0.0, 0.0);
                Some(self.bn_output(rows, c, bn.x, &bn.applied()))
            }
            _ => None,
        };
        // Without a ReLU the mask is not read.
        let y = stored.or(recomputed.as_ref()).unwrap_or(bn.x);
        let streams = 4 + usize::from(bn.residual_grad.is_some());
        let _t = self.profiler.time(
            || "bn_grad_finish".into(),
            0.0,
            4.0 * (rows * c * streams) as f64,
        );
        self.pool.install(|| {
            bn_fused::finish_grad(
                rows,
                c,
                dx,
                bn.residual_grad.map(|r| &r[..]),
                y,
                bn.relu,
                bn.x,
                bn.saved_mean,
                bn.saved_invstd,
                bn.dgamma,
                bn.dbeta,
            )
        });
        Ok(())
    }

    fn bn_forward(&self, a: BnForward<'_, Vec<f32>>) -> Result<(), BackendError> {
        let (r, c) = (a.shape.rows, a.shape.channels);
        let op = "bn_forward";
        if let Some(m) = a.moments {
            check_len(op, "moments", m.len(), 3 * c)?;
        }
        check_len(op, "x", a.x.len(), r * c)?;
        if let Some(y) = &a.y {
            check_len(op, "y", y.len(), r * c)?;
        } else if a.residual.is_some() {
            return Err(BackendError::InvalidInput {
                op,
                detail: "a residual without an output to add it to".into(),
            });
        }
        if let Some(res) = a.residual {
            check_len(op, "residual", res.len(), r * c)?;
        }
        for (name, len) in [
            ("gamma", a.gamma.len()),
            ("beta", a.beta.len()),
            ("saved_mean", a.saved_mean.len()),
            ("saved_invstd", a.saved_invstd.len()),
            ("running_mean", a.running_mean.len()),
            ("running_var", a.running_var.len()),
        ] {
            check_len(op, name, len, c)?;
        }
        if r == 0 {
            return Err(BackendError::Shape {
                op,
                detail: "zero rows".into(),
            });
        }
        // x read, y written, the residual read; in training without moments x is read once
        // more for the batch statistics (with them, the convolution reduced it already).
        // Without y, only the statistics.
        let reduces = a.mode == BnMode::Train && a.moments.is_none();
        let applies = 2 * usize::from(a.y.is_some());
        let bytes =
            4.0 * (r * c * (applies + a.residual.is_some() as usize + reduces as usize)) as f64;
        let _t = self.profiler.time(|| "bn_fwd".into(), 0.0, bytes);
        match self.kernels {
            Kernels::Fast => self.pool.install(|| bn::forward(self.level, a)),
            Kernels::Reference => self.pool.install(|| bn_ref::forward(a)),
        }
        Ok(())
    }

    fn bn_backward(&self, a: BnBackward<'_, Vec<f32>>) -> Result<(), BackendError> {
        let (r, c) = (a.shape.rows, a.shape.channels);
        let op = "bn_backward";
        for (name, len) in [
            ("x", a.x.len()),
            ("y", a.y.map_or(r * c, |y| y.len())),
            ("dy", a.dy.len()),
            ("dx", a.dx.len()),
        ] {
            check_len(op, name, len, r * c)?;
        }
        if a.y.is_none() && a.relu && !a.prepared {
            return Err(missing_mask(op));
        }
        if let Some((d, _)) = &a.dresidual {
            check_len(op, "dresidual", d.len(), r * c)?;
        }
        for (name, len) in [
            ("gamma", a.gamma.len()),
            ("saved_mean", a.saved_mean.len()),
            ("saved_invstd", a.saved_invstd.len()),
            ("dgamma", a.dgamma.len()),
            ("dbeta", a.dbeta.len()),
        ] {
            check_len(op, name, len, c)?;
        }
        let streams = 4 + a.dresidual.as_ref().map_or(0, |(_, acc)| 1 + *acc as usize);
        let bytes = 4.0 * (r * c * streams) as f64;
        let _t = self.profiler.time(|| "bn_bwd".into(), 0.0, bytes);
        match self.kernels {
            Kernels::Fast => self.pool.install(|| bn::backward(self.level, a)),
            Kernels::Reference => self.pool.install(|| bn_ref::backward(a)),
        }
        Ok(())
    }

    fn bn_sync_backward(
        &self,
        grads: &mut Vec<f64>,
        a: BnSyncBackward<'_, Vec<f32>>,
    ) -> Result<(), BackendError> {
        let (r, c) = (a.shape.rows, a.shape.channels);
        let op = "bn_sync_backward";
        for (name, len) in [
            ("x", a.x.len()),
            ("y", a.y.map_or(r * c, |y| y.len())),
            ("dy", a.dy.len()),
            ("dx", a.dx.len()),
        ] {
            check_len(op, name, len, r * c)?;
        }
        if a.y.is_none() && a.relu {
            return Err(missing_mask(op));
        }
        for (name, len) in [
            ("gamma", a.gamma.len()),
            ("saved_mean", a.saved_mean.len()),
            ("saved_invstd", a.saved_invstd.len()),
        ] {
            check_len(op, name, len, c)?;
        }
        let (dgamma, dbeta) = bn_sync::global_reductions(c, grads)?;
        let bytes = 4.0 * (r * c * 4) as f64;
        let _t = self.profiler.time(|| "bn_sync_bwd".into(), 0.0, bytes);
        // The batch-statistics backward's own second pass, on the global reductions.
        let pass = bn::InputGradient {
            rows: r,
            channels: c,
            x: a.x,
            // No output (no ReLU): the mask is not read; dy stands in.
            y: a.y.unwrap_or(a.dy),
            dy: a.dy,
            mean: a.saved_mean,
            invstd: a.saved_invstd,
            gamma: a.gamma,
            relu: a.relu,
            dgamma: &dgamma,
            dbeta: &dbeta,
        };
        self.pool
            .install(|| bn::input_gradient(self.level, pass, a.dx.as_mut_slice()));
        Ok(())
    }

    fn maxpool_forward(
        &self,
        s: &PoolShape,
        x: &Vec<f32>,
        y: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        check_pool("maxpool_forward", s)?;
        check_len("maxpool_forward", "x", x.len(), s.n * s.h * s.w * s.c)?;
        check_len(
            "maxpool_forward",
            "y",
            y.len(),
            s.n * s.out_h() * s.out_w() * s.c,
        )?;
        let _t = self.profiler.time(|| "maxpool_fwd".into(), 0.0, 0.0);
        self.pool.install(|| pool::max_forward(self.level, s, x, y));
        Ok(())
    }

    fn maxpool_backward(
        &self,
        s: &PoolShape,
        x: &Vec<f32>,
        dy: &Vec<f32>,
        dx: &mut Vec<f32>,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        check_pool("maxpool_backward", s)?;
        check_len("maxpool_backward", "x", x.len(), s.n * s.h * s.w * s.c)?;
        check_len("maxpool_backward", "dx", dx.len(), s.n * s.h * s.w * s.c)?;
        check_len(
            "maxpool_backward",
            "dy",
            dy.len(),
            s.n * s.out_h() * s.out_w() * s.c,
        )?;
        let _t = self.profiler.time(|| "maxpool_bwd".into(), 0.0, 0.0);
        self.pool
            .install(|| pool::max_backward(self.level, s, x, dy, dx, accumulate));
        Ok(())
    }

    fn conv_forward_bn(
        &self,
        s: &ConvShape,
        z: &Vec<f32>,
        bn: &AppliedBn<'_, Vec<f32>>,
        w: &Vec<f32>,
        y: &mut Vec<f32>,
        moments: Option<&mut Vec<f32>>,
    ) -> Result<(), BackendError> {
        self.conv_bn_forward(s, z, bn, w, y, moments)
    }

    fn conv_backward_weight_bn(
        &self,
        s: &ConvShape,
        z: &Vec<f32>,
        bn: &AppliedBn<'_, Vec<f32>>,
        dy: &Vec<f32>,
        dw: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.conv_bn_backward_weight(s, z, bn, dy, dw)
    }

    fn maxpool_bn_forward(
        &self,
        s: &PoolShape,
        z: &Vec<f32>,
        bn: &AppliedBn<'_, Vec<f32>>,
        y: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.pool_bn_forward(s, z, bn, y)
    }

    fn maxpool_bn_backward(
        &self,
        s: &PoolShape,
        z: &Vec<f32>,
        bn: &AppliedBn<'_, Vec<f32>>,
        dy: &Vec<f32>,
        g: &mut Vec<f32>,
        dgamma: &mut Vec<f32>,
        dbeta: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.pool_bn_backward(
            s,
            z,
            bn,
            dy,
            g,
            (dgamma.as_mut_slice(), dbeta.as_mut_slice()),
        )
    }

    fn gap_forward(
        &self,
        n: usize,
        hw: usize,
        c: usize,
        x: &Vec<f32>,
        y: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        check_len("gap_forward", "x", x.len(), n * hw * c)?;
        check_len("gap_forward", "y", y.len(), n * c)?;
        if hw == 0 {
            return Err(BackendError::Shape {
                op: "gap_forward",
                detail: "empty spatial extent".into(),
            });
        }
        let _t = self.profiler.time(|| "avgpool_fwd".into(), 0.0, 0.0);
        self.pool.install(|| pool::gap_forward(n, hw, c, x, y));
        Ok(())
    }

    fn gap_backward(
        &self,
        n: usize,
        hw: usize,
        c: usize,
        dy: &Vec<f32>,
        dx: &mut Vec<f32>,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        check_len("gap_backward", "dy", dy.len(), n * c)?;
        check_len("gap_backward", "dx", dx.len(), n * hw * c)?;
        if hw == 0 {
            return Err(BackendError::Shape {
                op: "gap_backward",
                detail: "empty spatial extent".into(),
            });
        }
        let _t = self.profiler.time(|| "avgpool_bwd".into(), 0.0, 0.0);
        self.pool
            .install(|| pool::gap_backward(n, hw, c, dy, dx, accumulate));
        Ok(())
    }

    fn linear_forward(
        &self,
        s: &LinearShape,
        x: &Vec<f32>,
        w: &Vec<f32>,
        b: &Vec<f32>,
        y: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        check_len("linear_forward", "x", x.len(), s.n * s.inputs)?;
        check_len("linear_forward", "w", w.len(), s.outputs * s.inputs)?;
        check_len("linear_forward", "b", b.len(), s.outputs)?;
        check_len("linear_forward", "y", y.len(), s.n * s.outputs)?;
        let flops = 2.0 * (s.n * s.inputs * s.outputs) as f64;
        let _t = self.profiler.time(|| "linear_fwd".into(), flops, 0.0);
        self.pool
            .install(|| dense::linear_forward(s, x, w, b, y, self.threads));
        Ok(())
    }

    fn linear_backward(
        &self,
        s: &LinearShape,
        x: &Vec<f32>,
        w: &Vec<f32>,
        dy: &Vec<f32>,
        dx: &mut Vec<f32>,
        dw: &mut Vec<f32>,
        db: &mut Vec<f32>,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        check_len("linear_backward", "x", x.len(), s.n * s.inputs)?;
        check_len("linear_backward", "dx", dx.len(), s.n * s.inputs)?;
        check_len("linear_backward", "w", w.len(), s.outputs * s.inputs)?;
        check_len("linear_backward", "dw", dw.len(), s.outputs * s.inputs)?;
        check_len("linear_backward", "db", db.len(), s.outputs)?;
        check_len("linear_backward", "dy", dy.len(), s.n * s.outputs)?;
        let flops = 4.0 * (s.n * s.inputs * s.outputs) as f64;
        let _t = self.profiler.time(|| "linear_bwd".into(), flops, 0.0);
        self.pool
            .install(|| dense::linear_backward(s, x, w, dy, dx, dw, db, accumulate, self.threads));
        Ok(())
    }

    fn softmax_cross_entropy(
        &self,
        n: usize,
        classes: usize,
        logits: &Vec<f32>,
        targets: &Targets<'_>,
        dlogits: Option<&mut Vec<f32>>,
        probs: Option<&mut Vec<f32>>,
    ) -> Result<LossStats, BackendError> {
        let op = "softmax_cross_entropy";
        check_len(op, "logits", logits.len(), n * classes)?;
        check_len(op, "labels", targets.labels.len(), n)?;
        if let Some(d) = &dlogits {
            check_len(op, "dlogits", d.len(), n * classes)?;
        }
        let _t = self.profiler.time(|| "softmax_ce".into(), 0.0, 0.0);
        dense::softmax_cross_entropy(n, classes, logits, targets, dlogits, probs)
    }
}

fn check_conv(op: &'static str, s: &ConvShape) -> Result<(), BackendError> {
    if s.kernel == 0
        || s.stride == 0
        || s.h + 2 * s.padding < s.kernel
        || s.w + 2 * s.padding < s.kernel
    {
        return Err(BackendError::Shape {
            op,
            detail: format!("{s:?}: kernel larger than the padded input, or zero kernel/stride"),
        });
    }
    Ok(())
}

pub(super) fn check_pool(op: &'static str, s: &PoolShape) -> Result<(), BackendError> {
    if s.kernel == 0
        || s.stride == 0
        || s.h + 2 * s.padding < s.kernel
        || s.w + 2 * s.padding < s.kernel
        || s.padding >= s.kernel
    {
        return Err(BackendError::Shape {
            op,
            detail: format!("{s:?}: window larger than the padded input, or padding ≥ kernel"),
        });
    }
    Ok(())
}
