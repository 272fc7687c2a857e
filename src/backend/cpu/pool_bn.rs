//! The max pool that applies the batch norm before it ([`Backend::maxpool_bn_forward`],
//! [`Backend::maxpool_bn_backward`]) on the CPU: the reference of the fused GPU kernels. The
//! batch norm's output is computed into a scratch buffer as [`super::applied_bn`] computes
//! it, the plain pool ops run over it, and the backward ends in the
//! fused epilogue's mask and reductions ([`bn_fused::finish_grad`]). So the pool's output and
//! its gradient have the bits of the separate passes; only the batch norm's two reductions
//! come from another summation order. Used where a network fuses
//! ([`CpuBackend::set_bn_fusion`]); on the CPU it saves nothing.
//!
//! [`Backend::maxpool_bn_forward`]: crate::backend::Backend::maxpool_bn_forward
//! [`Backend::maxpool_bn_backward`]: crate::backend::Backend::maxpool_bn_backward

use super::applied_bn::check_params;
use super::{bn_fused, check_pool, pool, CpuBackend};
use crate::backend::error::check_len;
use crate::backend::{AppliedBn, BackendError, PoolShape};

/// Checks the fused pool's tensors: `z` (and a gradient of its size) against the pool's input,
/// the batch norm's four per-channel vectors against its channels.
fn check(
    op: &'static str,
    s: &PoolShape,
    z: &[f32],
    bn: &AppliedBn<'_, Vec<f32>>,
) -> Result<(), BackendError> {
    check_pool(op, s)?;
    check_len(op, "z", z.len(), s.n * s.h * s.w * s.c)?;
    check_params(op, s.c, bn)
}

impl CpuBackend {
    /// See [`crate::backend::Backend::maxpool_bn_forward`].
    pub(super) fn pool_bn_forward(
        &self,
        s: &PoolShape,
        z: &[f32],
        bn: &AppliedBn<'_, Vec<f32>>,
        y: &mut [f32],
    ) -> Result<(), BackendError> {
        let op = "maxpool_bn_forward";
        check(op, s, z, bn)?;
        check_len(op, "y", y.len(), s.n * s.out_h() * s.out_w() * s.c)?;
        let _t = self.profiler.time(|| "maxpool_bn_fwd".into(), 0.0, 0.0);
        let t = self.bn_output(s.n * s.h * s.w, s.c, z, bn);
        self.pool
            .install(|| pool::max_forward(self.level, s, &t, y));
        Ok(())
    }

    /// See [`crate::backend::Backend::maxpool_bn_backward`]; `sums` are (dγ, dβ).
    pub(super) fn pool_bn_backward(
        &self,
        s: &PoolShape,
        z: &[f32],
        bn: &AppliedBn<'_, Vec<f32>>,
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
        let t = self.bn_output(s.n * s.h * s.w, s.c, z, bn);
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
