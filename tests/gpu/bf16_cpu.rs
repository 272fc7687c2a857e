//! The CPU backend storing what the GPU stores in bf16 (activations, their gradients and the
//! weights as the forward reads them) rounded to bf16 after every op, the rest (weight
//! gradients, statistics) in f32. It computes in f32 like the CPU, so it differs from the GPU
//! only by summation order: the reference a GPU step is held to, while its distance from the
//! f32 CPU is the error bf16 storage alone brings (large in the first layers of a small batch,
//! where batch norm divides by the spread of a few values).

use birdtrain::backend::cpu::CpuBackend;
use birdtrain::backend::{
    AppliedBn, Backend, BackendError, BnBackward, BnForward, BnGradEpilogue, ConvShape,
    GradientViews, LinearShape, LossStats, PoolShape, Targets, TensorRole,
};
use birdtrain::model::InputBatch;

/// A tensor and whether the GPU would store it in bf16.
pub(crate) struct Stored {
    v: Vec<f32>,
    bf16: bool,
}

/// See the module docs.
pub(crate) struct Bf16Cpu(pub(crate) CpuBackend);

/// The output of a batch norm its reader applies (a fused max pool or convolution), `rows ×
/// c` values of `z`: the GPU kernels' formula, `[ReLU]((z − mean)·invstd·γ + β)` rounded to
/// bf16.
fn applied_output(z: &[f32], rows: usize, c: usize, bn: &AppliedBn<'_, Stored>) -> Vec<f32> {
    (0..rows * c)
        .map(|i| {
            let ch = i % c;
            let v = (z[i] - bn.saved_mean.v[ch]) * bn.saved_invstd.v[ch] * bn.gamma.v[ch]
                + bn.beta.v[ch];
            let v = if bn.relu { v.max(0.0) } else { v };
            half::bf16::from_f32(v).to_f32()
        })
        .collect()
}

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
    fn keep_relu_signs(&self, y: &mut Stored) -> Result<(), BackendError> {
        self.0.keep_relu_signs(&mut y.v)
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
    fn bn_fusion(&self) -> bool {
        self.0.bn_fusion()
    }
    fn conv_applies_bn(&self) -> bool {
        self.0.conv_applies_bn()
    }
    fn conv_forward_moments(
        &self,
        s: &ConvShape,
        x: &Stored,
        w: &Stored,
        y: &mut Stored,
        moments: &mut Stored,
    ) -> Result<(), BackendError> {
        // The moments of the stored (rounded) output, as the GPU's epilogue reads it.
        self.0.conv_forward(s, &x.v, &w.v, &mut y.v)?;
        fix(y);
        let rows = s.n * s.out_h() * s.out_w();
        let mut m = vec![0.0f32; 3 * s.c_out];
        let yv = &y.v[..rows * s.c_out];
        for ch in 0..s.c_out {
            let vals = yv.iter().skip(ch).step_by(s.c_out).map(|&v| f64::from(v));
            let mean = vals.clone().sum::<f64>() / rows as f64;
            let m2: f64 = vals.map(|v| (v - mean) * (v - mean)).sum();
            m[ch] = mean as f32;
            m[s.c_out + ch] = m2 as f32;
            m[2 * s.c_out + ch] = rows as f32;
        }
        moments.v[..3 * s.c_out].copy_from_slice(&m);
        Ok(())
    }
    fn conv_forward_bn(
        &self,
        s: &ConvShape,
        z: &Stored,
        bn: &AppliedBn<'_, Stored>,
        w: &Stored,
        y: &mut Stored,
        moments: Option<&mut Stored>,
    ) -> Result<(), BackendError> {
        let x = Stored {
            v: applied_output(&z.v, s.n * s.h * s.w, s.c_in, bn),
            bf16: true,
        };
        match moments {
            Some(m) => self.conv_forward_moments(s, &x, w, y, m),
            None => self.conv_forward(s, &x, w, y),
        }
    }
    fn conv_backward_weight_bn(
        &self,
        s: &ConvShape,
        z: &Stored,
        bn: &AppliedBn<'_, Stored>,
        dy: &Stored,
        dw: &mut Stored,
    ) -> Result<(), BackendError> {
        let x = Stored {
            v: applied_output(&z.v, s.n * s.h * s.w, s.c_in, bn),
            bf16: true,
        };
        self.conv_backward_weight(s, &x, dy, dw)
    }
    fn conv_backward_data_bn(
        &self,
        s: &ConvShape,
        dy: &Stored,
        w: &Stored,
        dx: &mut Stored,
        accumulate: bool,
        bn: BnGradEpilogue<'_, Stored>,
    ) -> Result<(), BackendError> {
        // Rounded as the GPU rounds: the product, each sum, then the mask.
        self.0
            .conv_backward_data(s, &dy.v, &w.v, &mut dx.v, accumulate)?;
        fix(dx);
        let (rows, c) = (s.n * s.h * s.w, s.c_in);
        let round = |v: f32| half::bf16::from_f32(v).to_f32();
        // No stored output (the convolution applied the batch norm): its sign recomputed.
        let recomputed;
        let mask = match bn.y {
            Some(y) => &y.v,
            None => {
                recomputed = applied_output(&bn.x.v, rows, c, &bn.applied());
                &recomputed
            }
        };
        let (mut sb, mut sg) = (vec![0.0f64; c], vec![0.0f64; c]);
        for (i, &m) in mask[..rows * c].iter().enumerate() {
            let ch = i % c;
            let mut g = dx.v[i];
            if let Some(r) = bn.residual_grad {
                g = round(g + r.v[i]);
            }
            if bn.relu && m <= 0.0 {
                g = 0.0;
            }
            dx.v[i] = g;
            sb[ch] += f64::from(g);
            sg[ch] += f64::from(g * (bn.x.v[i] - bn.saved_mean.v[ch]) * bn.saved_invstd.v[ch]);
        }
        for ch in 0..c {
            bn.dbeta.v[ch] = sb[ch] as f32;
            bn.dgamma.v[ch] = sg[ch] as f32;
        }
        Ok(())
    }
    fn bn_forward(&self, mut a: BnForward<'_, Stored>) -> Result<(), BackendError> {
        self.0.bn_forward(BnForward {
            shape: a.shape,
            x: &a.x.v,
            gamma: &a.gamma.v,
            beta: &a.beta.v,
            residual: a.residual.map(|r| &r.v),
            relu: a.relu,
            y: a.y.as_mut().map(|y| &mut y.v),
            saved_mean: &mut a.saved_mean.v,
            saved_invstd: &mut a.saved_invstd.v,
            running_mean: &mut a.running_mean.v,
            running_var: &mut a.running_var.v,
            mode: a.mode,
            momentum: a.momentum,
            eps: a.eps,
            moments: a.moments.map(|m| &m.v),
        })?;
        if let Some(y) = a.y {
            fix(y);
        }
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
            prepared,
        } = a;
        let (dres, acc) = match dresidual {
            Some((d, acc)) => (Some(d), acc),
            None => (None, false),
        };
        let mut dres = dres;
        self.0.bn_backward(BnBackward {
            shape,
            x: &x.v,
            y: y.map(|y| &y.v),
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
            prepared,
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
    fn maxpool_bn_forward(
        &self,
        s: &PoolShape,
        z: &Stored,
        bn: &AppliedBn<'_, Stored>,
        y: &mut Stored,
    ) -> Result<(), BackendError> {
        let t = applied_output(&z.v, s.n * s.h * s.w, s.c, bn);
        self.0.maxpool_forward(s, &t, &mut y.v)?;
        fix(y);
        Ok(())
    }
    fn maxpool_bn_backward(
        &self,
        s: &PoolShape,
        z: &Stored,
        bn: &AppliedBn<'_, Stored>,
        dy: &Stored,
        g: &mut Stored,
        dgamma: &mut Stored,
        dbeta: &mut Stored,
    ) -> Result<(), BackendError> {
        // The gradient of the stored output, rounded, then masked and reduced (f64).
        let (rows, c) = (s.n * s.h * s.w, s.c);
        let t = applied_output(&z.v, rows, c, bn);
        self.0.maxpool_backward(s, &t, &dy.v, &mut g.v, false)?;
        fix(g);
        let (mut sb, mut sg) = (vec![0.0f64; c], vec![0.0f64; c]);
        for (i, (gi, &ti)) in g.v[..rows * c].iter_mut().zip(&t).enumerate() {
            let ch = i % c;
            if bn.relu && ti <= 0.0 {
                *gi = 0.0;
            }
            let xhat = (z.v[i] - bn.saved_mean.v[ch]) * bn.saved_invstd.v[ch];
            sb[ch] += f64::from(*gi);
            sg[ch] += f64::from(*gi * xhat);
        }
        for ch in 0..c {
            dbeta.v[ch] = sb[ch] as f32;
            dgamma.v[ch] = sg[ch] as f32;
        }
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
