//! The CPU backend storing what the GPU stores in bf16 (activations, their gradients and the
//! weights as the forward reads them) rounded to bf16 after every op, the rest (weight
//! gradients, statistics) in f32. It computes in f32 like the CPU, so it differs from the GPU
//! only by summation order: the reference a GPU step is held to, while its distance from the
//! f32 CPU is the error bf16 storage alone brings (large in the first layers of a small batch,
//! where batch norm divides by the spread of a few values).

use birdtrain::backend::cpu::CpuBackend;
use birdtrain::backend::{
    Backend, BackendError, BnBackward, BnForward, ConvShape, GradientViews, LinearShape, LossStats,
    PoolShape, Targets, TensorRole,
};
use birdtrain::model::InputBatch;

/// A tensor and whether the GPU would store it in bf16.
pub(crate) struct Stored {
    v: Vec<f32>,
    bf16: bool,
}

/// See the module docs.
pub(crate) struct Bf16Cpu(pub(crate) CpuBackend);

/// Rounds `t` to bf16 (nearest, ties to even, as the GPU's conversions) when it is stored so.
fn fix(t: &mut Stored) {
    if t.bf16 {
        for x in &mut t.v {
            *x = half::bf16::from_f32(*x).to_f32();
        }
    }
}

impl Backend for Bf16Cpu {
    type Tensor = Stored;
    type Sums = Vec<f64>;

    fn alloc_sums(&self, len: usize) -> Result<Vec<f64>, BackendError> {
        self.0.alloc_sums(len)
    }
    fn sums_mut<'a>(&self, sums: &'a mut Vec<f64>) -> birdtrain::backend::SumsMut<'a> {
        self.0.sums_mut(sums)
    }

    fn name(&self) -> String {
        format!("{} · bf16 storage", self.0.name())
    }
    fn alloc(&self, len: usize, role: TensorRole) -> Result<Stored, BackendError> {
        Ok(Stored {
            v: self.0.alloc(len, role)?,
            bf16: matches!(role, TensorRole::Activation | TensorRole::Weight),
        })
    }
    fn alloc_views(
        &self,
        _total: usize,
        _ranges: &[std::ops::Range<usize>],
        _role: TensorRole,
    ) -> Result<Option<GradientViews<Stored>>, BackendError> {
        Ok(None)
    }
    fn len(&self, t: &Stored) -> usize {
        t.v.len()
    }
    fn upload(&self, src: &[f32], dst: &mut Stored) -> Result<(), BackendError> {
        self.0.upload(src, &mut dst.v)?;
        fix(dst);
        Ok(())
    }
    fn download(&self, src: &Stored) -> Result<Vec<f32>, BackendError> {
        self.0.download(&src.v)
    }
    fn input(&self, batch: &InputBatch<'_>, out: &mut Stored) -> Result<(), BackendError> {
        self.0.input(batch, &mut out.v)?;
        fix(out);
        Ok(())
    }
    fn conv_forward(
        &self,
        s: &ConvShape,
        x: &Stored,
        w: &Stored,
        y: &mut Stored,
    ) -> Result<(), BackendError> {
        self.0.conv_forward(s, &x.v, &w.v, &mut y.v)?;
        fix(y);
        Ok(())
    }
    fn conv_backward_data(
        &self,
        s: &ConvShape,
        dy: &Stored,
        w: &Stored,
        dx: &mut Stored,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        self.0
            .conv_backward_data(s, &dy.v, &w.v, &mut dx.v, accumulate)?;
        fix(dx);
        Ok(())
    }
    fn conv_backward_weight(
        &self,
        s: &ConvShape,
        x: &Stored,
        dy: &Stored,
        dw: &mut Stored,
    ) -> Result<(), BackendError> {
        self.0.conv_backward_weight(s, &x.v, &dy.v, &mut dw.v)?;
        fix(dw);
        Ok(())
    }
    fn bn_forward(&self, a: BnForward<'_, Stored>) -> Result<(), BackendError> {
        self.0.bn_forward(BnForward {
            shape: a.shape,
            x: &a.x.v,
            gamma: &a.gamma.v,
            beta: &a.beta.v,
            residual: a.residual.map(|r| &r.v),
            relu: a.relu,
            y: &mut a.y.v,
            saved_mean: &mut a.saved_mean.v,
            saved_invstd: &mut a.saved_invstd.v,
            running_mean: &mut a.running_mean.v,
            running_var: &mut a.running_var.v,
            mode: a.mode,
            momentum: a.momentum,
            eps: a.eps,
        })?;
        fix(a.y);
        Ok(())
    }
    fn bn_backward(&self, a: BnBackward<'_, Stored>) -> Result<(), BackendError> {
        let BnBackward {
            shape,
            x,
            y,
            gamma,
            saved_mean,
            saved_invstd,
            batch_stats,
            relu,
            dy,
            dx,
            dresidual,
            dgamma,
            dbeta,
        } = a;
        let (dres, acc) = match dresidual {
            Some((d, acc)) => (Some(d), acc),
            None => (None, false),
        };
        let mut dres = dres;
        self.0.bn_backward(BnBackward {
            shape,
            x: &x.v,
            y: &y.v,
            gamma: &gamma.v,
            saved_mean: &saved_mean.v,
            saved_invstd: &saved_invstd.v,
            batch_stats,
            relu,
            dy: &dy.v,
            dx: &mut dx.v,
            dresidual: dres.as_mut().map(|d| (&mut d.v, acc)),
            dgamma: &mut dgamma.v,
            dbeta: &mut dbeta.v,
        })?;
        fix(dx);
        if let Some(d) = dres {
            fix(d);
        }
        Ok(())
    }
    fn maxpool_forward(
        &self,
        s: &PoolShape,
        x: &Stored,
        y: &mut Stored,
    ) -> Result<(), BackendError> {
        self.0.maxpool_forward(s, &x.v, &mut y.v)?;
        fix(y);
        Ok(())
    }
    fn maxpool_backward(
        &self,
        s: &PoolShape,
        x: &Stored,
        dy: &Stored,
        dx: &mut Stored,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        self.0
            .maxpool_backward(s, &x.v, &dy.v, &mut dx.v, accumulate)?;
        fix(dx);
        Ok(())
    }
    fn gap_forward(
        &self,
        n: usize,
        hw: usize,
        c: usize,
        x: &Stored,
        y: &mut Stored,
    ) -> Result<(), BackendError> {
        self.0.gap_forward(n, hw, c, &x.v, &mut y.v)?;
        fix(y);
        Ok(())
    }
    fn gap_backward(
        &self,
        n: usize,
        hw: usize,
        c: usize,
        dy: &Stored,
        dx: &mut Stored,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        self.0
            .gap_backward(n, hw, c, &dy.v, &mut dx.v, accumulate)?;
        fix(dx);
        Ok(())
    }
    fn linear_forward(
        &self,
        s: &LinearShape,
        x: &Stored,
        w: &Stored,
        b: &Stored,
        y: &mut Stored,
    ) -> Result<(), BackendError> {
        self.0.linear_forward(s, &x.v, &w.v, &b.v, &mut y.v)?;
        fix(y);
        Ok(())
    }
    fn linear_backward(
        &self,
        s: &LinearShape,
        x: &Stored,
        w: &Stored,
        dy: &Stored,
        dx: &mut Stored,
        dw: &mut Stored,
        db: &mut Stored,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        self.0.linear_backward(
            s, &x.v, &w.v, &dy.v, &mut dx.v, &mut dw.v, &mut db.v, accumulate,
        )?;
        fix(dx);
        Ok(())
    }
    fn softmax_cross_entropy(
        &self,
        n: usize,
        classes: usize,
        logits: &Stored,
        targets: &Targets<'_>,
        dlogits: Option<&mut Stored>,
        probs: Option<&mut Vec<f32>>,
    ) -> Result<LossStats, BackendError> {
        match dlogits {
            Some(d) => {
                let stats = self.0.softmax_cross_entropy(
                    n,
                    classes,
                    &logits.v,
                    targets,
                    Some(&mut d.v),
                    probs,
                )?;
                fix(d);
                Ok(stats)
            }
            None => self
                .0
                .softmax_cross_entropy(n, classes, &logits.v, targets, None, probs),
        }
    }
}
