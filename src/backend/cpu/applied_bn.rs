//! A batch norm applied by its reader ([`AppliedBn`]) on the CPU: the reference of the GPU
//! kernels that apply it as they load their input. The batch norm's output is computed into a
//! scratch buffer by the batch-norm forward's own pass (the backend's [`Kernels`]) and the
//! plain ops run over it, so every result has the bits of the separate passes. The max pool's
//! form is in [`super::pool_bn`]; the convolution's ([`Backend::conv_forward_bn`],
//! [`Backend::conv_backward_weight_bn`], and the mask of [`Backend::conv_backward_data_bn`]
//! with no stored output) is here. On the CPU it saves nothing (the scratch is as large as the
//! output it replaces); it exists so that a network's fused sequence can be checked here.
//!
//! [`Backend::conv_forward_bn`]: crate::backend::Backend::conv_forward_bn
//! [`Backend::conv_backward_weight_bn`]: crate::backend::Backend::conv_backward_weight_bn
//! [`Backend::conv_backward_data_bn`]: crate::backend::Backend::conv_backward_data_bn

use super::bn::Normalise;
use super::{bn, bn_ref, CpuBackend, Kernels};
use crate::backend::error::check_len;
use crate::backend::{AppliedBn, Backend, BackendError, ConvShape};

/// Checks the batch norm's four per-channel vectors against its `c` channels.
pub(super) fn check_params(
    op: &'static str,
    c: usize,
    bn: &AppliedBn<'_, Vec<f32>>,
) -> Result<(), BackendError> {
    for (name, len) in [
        ("gamma", bn.gamma.len()),
        ("beta", bn.beta.len()),
        ("saved_mean", bn.saved_mean.len()),
        ("saved_invstd", bn.saved_invstd.len()),
    ] {
        check_len(op, name, len, c)?;
    }
    Ok(())
}

impl CpuBackend {
    /// The batch norm's output over `z` (`rows × c`): what its forward would have stored.
    pub(super) fn bn_output(
        &self,
        rows: usize,
        c: usize,
        z: &[f32],
        bn: &AppliedBn<'_, Vec<f32>>,
    ) -> Vec<f32> {
        let norm = Normalise {
            rows,
            c,
            x: z,
            residual: None,
            gamma: bn.gamma,
            beta: bn.beta,
            mean: bn.saved_mean,
            invstd: bn.saved_invstd,
            relu: bn.relu,
        };
        let mut y = vec![0.0; rows * c];
        self.pool.install(|| match self.kernels {
            Kernels::Fast => bn::normalise(self.level, &norm, &mut y),
            Kernels::Reference => bn_ref::normalise(&norm, &mut y),
        });
        y
    }

    /// The convolution's input, `bn(z)`, after checking `z` and the batch norm against `s`.
    fn conv_input(
        &self,
        op: &'static str,
        s: &ConvShape,
        z: &[f32],
        bn: &AppliedBn<'_, Vec<f32>>,
    ) -> Result<Vec<f32>, BackendError> {
        check_len(op, "z", z.len(), s.x_len())?;
        check_params(op, s.c_in, bn)?;
        let _t = self.profiler.time(|| "bn_apply".into(), 0.0, 0.0);
        Ok(self.bn_output(s.n * s.h * s.w, s.c_in, z, bn))
    }

    /// See [`Backend::conv_forward_bn`].
    pub(super) fn conv_bn_forward(
        &self,
        s: &ConvShape,
        z: &[f32],
        bn: &AppliedBn<'_, Vec<f32>>,
        w: &Vec<f32>,
        y: &mut Vec<f32>,
        moments: Option<&mut Vec<f32>>,
    ) -> Result<(), BackendError> {
        let x = self.conv_input("conv_forward_bn", s, z, bn)?;
        match moments {
            Some(m) => self.conv_forward_moments(s, &x, w, y, m),
            None => self.conv_forward(s, &x, w, y),
        }
    }

    /// See [`Backend::conv_backward_weight_bn`].
    pub(super) fn conv_bn_backward_weight(
        &self,
        s: &ConvShape,
        z: &[f32],
        bn: &AppliedBn<'_, Vec<f32>>,
        dy: &Vec<f32>,
        dw: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let x = self.conv_input("conv_backward_weight_bn", s, z, bn)?;
        self.conv_backward_weight(s, &x, dy, dw)
    }
}
