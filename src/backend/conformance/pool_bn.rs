//! The max pool that applies the batch norm before it ([`Backend::maxpool_bn_forward`],
//! [`Backend::maxpool_bn_backward`]) against the reference's separate ops: the batch norm's
//! output stored as the tested backend stores it, the plain pool ops over it, the ReLU's mask
//! read from it and f64 reductions; and repeatability to the bit.
//!
//! The inputs make the batch norm exact ([`super::applied::Inputs`]), so the pool's output and
//! gradient are compared to the bit, ties included (the rounding to bf16 makes many).

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::applied::{same_bits_twice, Inputs};
use super::{CheckReport, Pair, Tolerance};
use crate::backend::{AppliedBn, Backend, BackendError, PoolShape, TensorRole};

impl<B: Backend> Pair<'_, B> {
    /// The fused pool at shape `s`, with and without ReLU.
    fn pool_bn(&mut self, s: PoolShape, rng: &mut ChaCha8Rng) -> Result<(), BackendError> {
        let (c, rows) = (s.c, s.n * s.h * s.w);
        let inputs = Inputs::new(s.n * s.h * s.w, s.n * s.out_h() * s.out_w(), s.c, rng);
        let (act, stat, weight) = (
            TensorRole::Activation,
            TensorRole::Statistic,
            TensorRole::Weight,
        );
        let tz = self.up(&inputs.z, act)?;
        let tdy = self.up(&inputs.dy, act)?;
        let (tmean, tinvstd) = (self.up(&inputs.mean, stat)?, self.up(&inputs.invstd, stat)?);
        let (tgamma, tbeta) = (
            self.up(&inputs.gamma, weight)?,
            self.up(&inputs.beta, weight)?,
        );
        for relu in [true, false] {
            let tag = format!(
                "k{} s{} p{} {}x{}x{}x{} relu={relu}",
                s.kernel, s.stride, s.padding, s.n, s.h, s.w, c
            );
            // The separate ops: the output as stored, pooled; its gradient, stored, masked.
            let y = self.stored(&inputs.bn_output(c, relu))?;
            let r = &self.reference;
            let mut pooled = vec![0.0; s.n * s.out_h() * s.out_w() * c];
            r.maxpool_forward(&s, &y, &mut pooled)?;
            let mut g = vec![0.0; rows * c];
            r.maxpool_backward(&s, &y, &inputs.dy, &mut g, false)?;
            let mut g = self.stored(&g)?;
            let (mut sb, mut sg) = (vec![0.0f64; c], vec![0.0f64; c]);
            for (i, v) in g.iter_mut().enumerate() {
                let ch = i % c;
                if relu && y[i] <= 0.0 {
                    *v = 0.0;
                }
                let xhat = (inputs.z[i] - inputs.mean[ch]) * inputs.invstd[ch];
                sb[ch] += f64::from(*v);
                sg[ch] += f64::from(*v) * f64::from(xhat);
            }
            let dbeta: Vec<f32> = sb.iter().map(|&v| v as f32).collect();
            let dgamma: Vec<f32> = sg.iter().map(|&v| v as f32).collect();
            // The fused ops.
            let bn = AppliedBn {
                gamma: &tgamma,
                beta: &tbeta,
                saved_mean: &tmean,
                saved_invstd: &tinvstd,
                relu,
            };
            let mut ty = self.up(&vec![f32::NAN; pooled.len()], act)?;
            self.test.maxpool_bn_forward(&s, &tz, &bn, &mut ty)?;
            let mut tg = self.up(&vec![f32::NAN; rows * c], act)?;
            let mut tdg = self.up(&vec![f32::NAN; c], TensorRole::WeightGrad)?;
            let mut tdb = self.up(&vec![f32::NAN; c], TensorRole::WeightGrad)?;
            self.test
                .maxpool_bn_backward(&s, &tz, &bn, &tdy, &mut tg, &mut tdg, &mut tdb)?;
            self.check_bits(format!("maxpool_bn_forward y {tag}"), &ty, &pooled)?;
            self.check_bits(format!("maxpool_bn_backward g {tag}"), &tg, &g)?;
            self.check(format!("maxpool_bn_backward dbeta {tag}"), &tdb, &dbeta)?;
            self.check(format!("maxpool_bn_backward dgamma {tag}"), &tdg, &dgamma)?;
        }
        Ok(())
    }
}

/// The shapes [`check_pool_bn`] runs: ResNet's stem pool (3×3, stride 2, padding 1) at odd
/// and even sizes, with whole 8-channel groups (a GPU's 16-byte kernels) and without; no
/// padding (an uncovered tail); a window wider than twice the stride (a GPU's scalar
/// backward); and a map larger than one 7×7 output tile with two 64-channel chunks.
pub fn pool_bn_shapes() -> Vec<PoolShape> {
    let pool = |n, h, w, c, kernel, stride, padding| PoolShape {
        n,
        h,
        w,
        c,
        kernel,
        stride,
        padding,
    };
    vec![
        pool(2, 9, 7, 16, 3, 2, 1),
        pool(2, 10, 12, 8, 3, 2, 1),
        pool(1, 7, 7, 5, 3, 2, 1),
        pool(1, 8, 9, 24, 3, 2, 0),
        pool(1, 7, 6, 8, 3, 1, 1),
        pool(2, 33, 31, 72, 3, 2, 1),
    ]
}

/// Checks `backend`'s fused max pool ([`Backend::maxpool_bn_forward`],
/// [`Backend::maxpool_bn_backward`]) against the CPU reference's separate ops at each of
/// `shapes` ([`pool_bn_shapes`]): the pooled output and the finished gradient to the bit,
/// the two reductions within `tol` (scaled by their largest magnitude).
pub fn check_pool_bn<B: Backend>(
    backend: &B,
    shapes: &[PoolShape],
    tol: Tolerance,
) -> Result<Vec<CheckReport>, BackendError> {
    let mut pair = Pair::new(backend, tol, true)?;
    let mut rng = ChaCha8Rng::seed_from_u64(0x9001);
    for &s in shapes {
        pair.pool_bn(s, &mut rng)?;
    }
    Ok(pair.reports)
}

/// Runs `backend`'s fused max pool twice on the same inputs at each of `shapes` and demands
/// the same bits (y, g, dγ, dβ).
pub fn check_pool_bn_repeatable<B: Backend>(
    backend: &B,
    shapes: &[PoolShape],
) -> Result<(), BackendError> {
    let mut rng = ChaCha8Rng::seed_from_u64(0x9002);
    let up = |data: &[f32], role| -> Result<B::Tensor, BackendError> {
        let mut t = backend.alloc(data.len(), role)?;
        backend.upload(data, &mut t)?;
        Ok(t)
    };
    for &s in shapes {
        let c = s.c;
        let inputs = Inputs::new(s.n * s.h * s.w, s.n * s.out_h() * s.out_w(), s.c, &mut rng);
        let (tz, tdy) = (
            up(&inputs.z, TensorRole::Activation)?,
            up(&inputs.dy, TensorRole::Activation)?,
        );
        let (mean, invstd) = (
            up(&inputs.mean, TensorRole::Statistic)?,
            up(&inputs.invstd, TensorRole::Statistic)?,
        );
        let (gamma, beta) = (
            up(&inputs.gamma, TensorRole::Weight)?,
            up(&inputs.beta, TensorRole::Weight)?,
        );
        let bn = AppliedBn {
            gamma: &gamma,
            beta: &beta,
            saved_mean: &mean,
            saved_invstd: &invstd,
            relu: true,
        };
        let mut runs: Vec<Vec<Vec<f32>>> = Vec::new();
        for _ in 0..2 {
            let mut y = backend.alloc(s.n * s.out_h() * s.out_w() * c, TensorRole::Activation)?;
            backend.maxpool_bn_forward(&s, &tz, &bn, &mut y)?;
            let mut g = backend.alloc(s.n * s.h * s.w * c, TensorRole::Activation)?;
            let mut dg = backend.alloc(c, TensorRole::WeightGrad)?;
            let mut db = backend.alloc(c, TensorRole::WeightGrad)?;
            backend.maxpool_bn_backward(&s, &tz, &bn, &tdy, &mut g, &mut dg, &mut db)?;
            runs.push(vec![
                backend.download(&y)?,
                backend.download(&g)?,
                backend.download(&dg)?,
                backend.download(&db)?,
            ]);
        }
        let shape = format!("{}x{}x{}x{c}", s.n, s.h, s.w);
        same_bits_twice(
            &format!("maxpool_bn {shape}"),
            &["y", "g", "dgamma", "dbeta"],
            &runs,
        )?;
    }
    Ok(())
}
