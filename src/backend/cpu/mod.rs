//! The CPU reference backend: f32 everywhere, NHWC, multithreaded on its own rayon pool,
//! convolutions by im2col + the `gemm` crate. Deterministic: the same inputs and thread
//! count give the same bits (fixed work partitions, reductions combined in a fixed order).

mod bn;
mod conv;
mod dense;
mod gemm;
mod input;
mod pool;

use std::sync::{Arc, Mutex, MutexGuard};

use super::error::check_len;
use super::{
    Backend, BackendError, BnBackward, BnForward, ConvShape, LinearShape, LossStats, PoolShape,
    TensorRole,
};
use crate::model::InputBatch;

/// The CPU backend. Cheap to clone (clones share the thread pool, not the scratch buffer).
pub struct CpuBackend {
    pool: Arc<rayon::ThreadPool>,
    threads: usize,
    /// im2col column buffer, reused across calls (a clone gets its own).
    scratch: Arc<Mutex<Vec<f32>>>,
}

impl Clone for CpuBackend {
    fn clone(&self) -> Self {
        CpuBackend {
            pool: Arc::clone(&self.pool),
            threads: self.threads,
            scratch: Arc::default(),
        }
    }
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("threads", &self.threads)
            .finish()
    }
}

impl CpuBackend {
    /// A backend running on `threads` threads (0: one per available core).
    pub fn new(threads: usize) -> Result<CpuBackend, BackendError> {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("cpu-backend-{i}"))
            .build()
            .map_err(|e| BackendError::Device {
                op: "CpuBackend::new",
                source: Box::new(e),
            })?;
        Ok(CpuBackend {
            pool: Arc::new(pool),
            threads,
            scratch: Arc::default(),
        })
    }

    fn scratch(&self) -> MutexGuard<'_, Vec<f32>> {
        // A poisoned lock only means an earlier op panicked mid-write; the buffer is scratch.
        self.scratch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Threads in the pool.
    pub fn threads(&self) -> usize {
        self.threads
    }
}

impl Backend for CpuBackend {
    type Tensor = Vec<f32>;

    fn name(&self) -> String {
        format!("cpu ({} threads)", self.threads)
    }

    fn alloc(&self, len: usize, _role: TensorRole) -> Result<Vec<f32>, BackendError> {
        let mut v = Vec::new();
        v.try_reserve_exact(len)
            .map_err(|_| BackendError::OutOfMemory {
                bytes: len * 4,
                what: "a CPU tensor".into(),
                hint: "use a smaller --batch-size or --image-size".into(),
            })?;
        v.resize(len, 0.0);
        Ok(v)
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
        let mut guard = self.scratch();
        let scratch: &mut Vec<f32> = &mut guard;
        self.pool
            .install(|| conv::forward(s, x, w, y, self.threads, scratch));
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
        let mut guard = self.scratch();
        let scratch: &mut Vec<f32> = &mut guard;
        self.pool
            .install(|| conv::backward_data(s, dy, w, dx, accumulate, self.threads, scratch));
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
        let mut guard = self.scratch();
        let scratch: &mut Vec<f32> = &mut guard;
        self.pool
            .install(|| conv::backward_weight(s, x, dy, dw, self.threads, scratch));
        Ok(())
    }

    fn bn_forward(&self, a: BnForward<'_, Vec<f32>>) -> Result<(), BackendError> {
        let (r, c) = (a.shape.rows, a.shape.channels);
        let op = "bn_forward";
        check_len(op, "x", a.x.len(), r * c)?;
        check_len(op, "y", a.y.len(), r * c)?;
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
        self.pool.install(|| bn::forward(a));
        Ok(())
    }

    fn bn_backward(&self, a: BnBackward<'_, Vec<f32>>) -> Result<(), BackendError> {
        let (r, c) = (a.shape.rows, a.shape.channels);
        let op = "bn_backward";
        for (name, len) in [
            ("x", a.x.len()),
            ("y", a.y.len()),
            ("dy", a.dy.len()),
            ("dx", a.dx.len()),
        ] {
            check_len(op, name, len, r * c)?;
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
        self.pool.install(|| bn::backward(a));
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
        self.pool.install(|| pool::max_forward(s, x, y));
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
        self.pool
            .install(|| pool::max_backward(s, x, dy, dx, accumulate));
        Ok(())
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
        self.pool
            .install(|| dense::linear_backward(s, x, w, dy, dx, dw, db, accumulate, self.threads));
        Ok(())
    }

    fn softmax_cross_entropy(
        &self,
        n: usize,
        classes: usize,
        logits: &Vec<f32>,
        labels: &[u32],
        smoothing: f32,
        dlogits: Option<&mut Vec<f32>>,
        probs: Option<&mut Vec<f32>>,
    ) -> Result<LossStats, BackendError> {
        let op = "softmax_cross_entropy";
        check_len(op, "logits", logits.len(), n * classes)?;
        check_len(op, "labels", labels.len(), n)?;
        if let Some(d) = &dlogits {
            check_len(op, "dlogits", d.len(), n * classes)?;
        }
        dense::softmax_cross_entropy(n, classes, logits, labels, smoothing, dlogits, probs)
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

fn check_pool(op: &'static str, s: &PoolShape) -> Result<(), BackendError> {
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
