//! The max pool that applies the batch norm before it ([`Backend::maxpool_bn_forward`],
//! [`Backend::maxpool_bn_backward`]) on the CPU: the reference of the fused GPU kernels. The
//! batch norm's output is computed into a scratch buffer by the batch-norm forward's own pass
//! (the backend's [`Kernels`]), the plain pool ops run over it, and the backward ends in the
//! fused epilogue's mask and reductions ([`bn_fused::finish_grad`]). So the pool's output and
//! its gradient have the bits of the separate passes; only the batch norm's two reductions
//! come from another summation order. Used where a network fuses
//! ([`CpuBackend::set_bn_fusion`]); on the CPU it saves nothing.
//!
//! [`Backend::maxpool_bn_forward`]: crate::backend::Backend::maxpool_bn_forward
//! [`Backend::maxpool_bn_backward`]: crate::backend::Backend::maxpool_bn_backward

use super::bn::Normalise;
use super::{bn, bn_fused, bn_ref, check_pool, pool, CpuBackend, Kernels};
use crate::backend::error::check_len;
use crate::backend::{BackendError, PoolBn, PoolShape};

/// Checks the fused pool's tensors: `z` (and a gradient of its size) against the pool's input,
/// the batch norm's four per-channel vectors against its channels.
fn check(
    op: &'static str,
    s: &PoolShape,
    z: &[f32],
    bn: &PoolBn<'_, Vec<f32>>,
) -> Result<(), BackendError> {
    check_pool(op, s)?;
    check_len(op, "z", z.len(), s.n * s.h * s.w * s.c)?;
    for (name, len) in [
        ("gamma", bn.gamma.len()),
        ("beta", bn.beta.len()),
        ("saved_mean", bn.saved_mean.len()),
        ("saved_invstd", bn.saved_invstd.len()),
    ] {
        check_len(op, name, len, s.c)?;
    }
    Ok(())
}

impl CpuBackend {
    /// The batch norm's output over the pool's input: what its forward would have stored.
    fn bn_output(&self, s: &PoolShape, z: &[f32], bn: &PoolBn<'_, Vec<f32>>) -> Vec<f32> {
        let rows = s.n * s.h * s.w;
        let norm = Normalise {
            rows,
            c: s.c,
            x: z,
            residual: None,
            gamma: bn.gamma,
            beta: bn.beta,
            mean: bn.saved_mean,
            invstd: bn.saved_invstd,
            relu: bn.relu,
        };
        let mut y = vec![0.0; rows * s.c];
        self.pool.install(|| match self.kernels {
            Kernels::Fast => bn::normalise(self.level, &norm, &mut y),
            Kernels::Reference => bn_ref::normalise(&norm, &mut y),
        });
        y
    }

    /// See [`crate::backend::Backend::maxpool_bn_forward`].
    pub(super) fn pool_bn_forward(
        &self,
        s: &PoolShape,
        z: &[f32],
        bn: &PoolBn<'_, Vec<f32>>,
        y: &mut [f32],
    ) -> Result<(), BackendError> {
        let op = "maxpool_bn_forward";
        check(op, s, z, bn)?;
        check_len(op, "y", y.len(), s.n * s.out_h() * s.out_w() * s.c)?;
        let _t = self.profiler.time(|| "maxpool_bn_fwd".into(), 0.0, 0.0);
        let t = self.bn_output(s, z, bn);
        self.pool
            .install(|| pool::max_forward(self.level, s, &t, y));
        Ok(())
    }

    /// See [`crate::backend::Backend::maxpool_bn_backward`]; `sums` are (dγ, dβ).
    pub(super) fn pool_bn_backward(
        &self,
        s: &PoolShape,
        z: &[f32],
        bn: &PoolBn<'_, Vec<f32>>,
        dy: &[f32],
        g: &mut [f32],
        sums: (&mut [f32], &mut [f32]),
    ) -> Result<(), BackendError> {
        let op = "maxpool_bn_backward";
        check(op, s, z, bn)?;
        let (rows, c) = (s.n * s.h * s.w, s.c);
        check_len(op, "g", g.len(), rows * c)?;
        check_len(op, "dy", dy.len(), s.n * s.out_h() * s.out_w() * c)?;
        let (dgamma, dbeta) = sums;
        check_len(op, "dgamma", dgamma.len(), c)?;
        check_len(op, "dbeta", dbeta.len(), c)?;
        let _t = self.profiler.time(|| "maxpool_bn_bwd".into(), 0.0, 0.0);
        let t = self.bn_output(s, z, bn);
        self.pool.install(|| {
            pool::max_backward(self.level, s, &t, dy, g, false);
            bn_fused::finish_grad(
                rows,
                c,
                g,
                None,
                &t,
                bn.relu,
                z,
                bn.saved_mean,
                bn.saved_invstd,
                dgamma,
                dbeta,
            );
        });
        Ok(())
    }
}
