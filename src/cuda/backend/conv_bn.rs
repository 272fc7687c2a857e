//! A batch norm applied by the convolution that reads its output ([`Backend::conv_forward_bn`],
//! [`Backend::conv_backward_weight_bn`], and [`Backend::conv_backward_data_bn`]'s mask with no
//! stored output) on [`CudaBackend`], where no kernel applies it as it loads its input: the
//! batch norm's output is written by `bn_apply` into a scratch tensor, and the plain ops run
//! over it (the same bits as the separate passes). The scratch tensors are kept, one per
//! size, so a step allocates nothing after its first (and a CUDA graph replays the same
//! addresses); a network holds at most a few distinct sizes (resnet50: one per stage and
//! stride), not one output per layer.

use std::collections::HashMap;

use crate::cuda::error::CudaError;

use super::base::{check_len, to_i32, CudaBackend};
use super::bn::apply_launch;
use crate::backend::{AppliedBn, Backend, BackendError, ConvShape, TensorRole};
use crate::cuda::launchers::BnApply;
use crate::cuda::tensor::CudaTensor;

/// The environment variable that lets convolutions apply the batch norm before them
/// ([`Backend::conv_applies_bn`]): `1` on (with batch norm fused), `0` or unset off. Off by
/// default until a GPU run has passed its tests and measured it faster.
pub const BN_PROLOGUE_ENV: &str = "BIRDTRAIN_BN_PROLOGUE";

/// Parses the value of `BIRDTRAIN_BN_PROLOGUE` (unset or empty: off).
pub fn parse_bn_prologue(value: Option<&str>) -> Result<bool, CudaError> {
    match value.map(str::trim) {
        None | Some("") | Some("0") => Ok(false),
        Some("1") => Ok(true),
        Some(other) => Err(CudaError::Unsupported {
            what: format!(
                "{BN_PROLOGUE_ENV}={other:?}: expected 0 (each batch norm writes its output) or \
                 1 (the convolution that reads it applies it); unset means 0"
            ),
        }),
    }
}

/// The scratch outputs of applied batch norms, by element count.
pub(super) type AppliedScratch = HashMap<usize, CudaTensor>;

impl CudaBackend {
    /// Lets convolutions apply the batch norm before them (`true`) or not, for networks built
    /// afterwards (tests compare both on one device; `BIRDTRAIN_BN_PROLOGUE` sets it at start).
    pub fn set_conv_applies_bn(&mut self, on: bool) {
        self.bn_prologue = on;
    }

    /// Runs `f` with `bn(z)` (`rows × c`) in a kept scratch tensor: `bn_apply`'s output, what
    /// the batch norm's forward would have stored.
    pub(super) fn with_applied<R>(
        &self,
        op: &'static str,
        rows: usize,
        c: usize,
        z: &CudaTensor,
        bn: &AppliedBn<'_, CudaTensor>,
        f: impl FnOnce(&CudaTensor) -> Result<R, BackendError>,
    ) -> Result<R, BackendError> {
        let len = rows * c;
        check_len(op, "z", z.len, len)?;
        for (name, t) in [
            ("gamma", bn.gamma),
            ("beta", bn.beta),
            ("saved_mean", bn.saved_mean),
            ("saved_invstd", bn.saved_invstd),
        ] {
            check_len(op, name, t.len, c)?;
        }
        // Taken out while in use (the lock is not held across `f`, which launches kernels).
        let kept = self.applied_scratch().remove(&len);
        let mut y = match kept {
            Some(t) => t,
            None => self.alloc(len, TensorRole::Activation)?,
        };
        let r = apply(self, op, rows, c, z, bn, &mut y).and_then(|()| f(&y));
        self.applied_scratch().insert(len, y);
        r
    }

    fn applied_scratch(&self) -> std::sync::MutexGuard<'_, AppliedScratch> {
        self.applied.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// `y ← bn(z)` by `bn_apply` (no residual).
fn apply(
    be: &CudaBackend,
    op: &'static str,
    rows: usize,
    c: usize,
    z: &CudaTensor,
    bn: &AppliedBn<'_, CudaTensor>,
    y: &mut CudaTensor,
) -> Result<(), BackendError> {
    let (apply, cfg) = apply_launch(be, op, "bn_apply", "bn_apply_vec", rows, c)?;
    let args = BnApply {
        x: z.bf16(op, "z")?.into(),
        mean: bn.saved_mean.f32(op, "saved_mean")?.into(),
        invstd: bn.saved_invstd.f32(op, "saved_invstd")?.into(),
        gamma: bn.gamma.bf16(op, "gamma")?.into(),
        beta: bn.beta.bf16(op, "beta")?.into(),
        residual: None,
        y: y.bf16_mut(op, "y")?.into(),
        total: (rows * c) as i64,
        channels: to_i32(op, "channels", c)?,
        relu: i32::from(bn.relu),
    };
    be.launch(op, apply, cfg, args)?;
    be.note_work(4 * rows * c, 0.0);
    Ok(())
}

/// See [`Backend::conv_forward_bn`].
pub(super) fn forward(
    be: &CudaBackend,
    s: &ConvShape,
    z: &CudaTensor,
    bn: &AppliedBn<'_, CudaTensor>,
    w: &CudaTensor,
    y: &mut CudaTensor,
    moments: Option<&mut CudaTensor>,
) -> Result<(), BackendError> {
    let rows = s.n * s.h * s.w;
    be.with_applied("conv_forward_bn", rows, s.c_in, z, bn, |x| match moments {
        Some(m) => be.conv_forward_moments(s, x, w, y, m),
        None => be.conv_forward(s, x, w, y),
    })
}

/// See [`Backend::conv_backward_weight_bn`].
pub(super) fn backward_weight(
    be: &CudaBackend,
    s: &ConvShape,
    z: &CudaTensor,
    bn: &AppliedBn<'_, CudaTensor>,
    dy: &CudaTensor,
    dw: &mut CudaTensor,
) -> Result<(), BackendError> {
    let rows = s.n * s.h * s.w;
    be.with_applied("conv_backward_weight_bn", rows, s.c_in, z, bn, |x| {
        be.conv_backward_weight(s, x, dy, dw)
    })
}

#[cfg(test)]
mod tests {
    use super::parse_bn_prologue;

    #[test]
    fn the_prologue_setting_is_off_unless_one_and_names_a_bad_value() {
        assert!(!parse_bn_prologue(None).unwrap());
        assert!(!parse_bn_prologue(Some("")).unwrap());
        assert!(!parse_bn_prologue(Some("0")).unwrap());
        assert!(parse_bn_prologue(Some(" 1 ")).unwrap());
        let e = parse_bn_prologue(Some("yes")).unwrap_err().to_string();
        assert!(
            e.contains("BIRDTRAIN_BN_PROLOGUE=\"yes\"") && e.contains("expected 0"),
            "{e}"
        );
    }
}
