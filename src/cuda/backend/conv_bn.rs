//! A batch norm applied by the convolution that reads its output ([`Backend::conv_forward_bn`],
//! [`Backend::conv_backward_weight_bn`], and [`Backend::conv_backward_data_bn`]'s mask with no
//! stored output) on [`CudaBackend`]. Where v2 runs the layer (v2 selected, or v3 leaving it
//! to v2, and a shape v2 takes), its kernels apply the batch norm as they load their input
//! (kernels/conv2.cu, `AppliedBn`: `conv2_fwd[_stats]_apply_*`, `conv2_wgrad_apply_*`, and
//! the data gradient's epilogue recomputing the ReLU mask, as v3's does where v3 runs the data
//! gradient: `bn_fused.rs`). Elsewhere (v3, v1) the batch
//! norm's output is written by `bn_apply` into a scratch tensor, and the plain ops run over it
//! (the same bits as the separate passes). The scratch tensors are kept, one per size, so a
//! step allocates nothing after its first (and a CUDA graph replays the same addresses); a
//! network holds at most a few distinct sizes (resnet50: one per stage and stride), not one
//! output per layer.

use crate::cuda::error::CudaError;

use super::base::{check_len, to_i32, AppliedArgs, AppliedScratch, Conv2Scratch, CudaBackend};
use super::bn::apply_launch;
use super::bn_fused;
use super::conv::{conv2_wgrad, conv_args};
use crate::backend::{AppliedBn, Backend, BackendError, ConvShape, TensorRole};
use crate::cuda::conv::{Conv2Launch, Pass};
use crate::cuda::launchers::{BnApply, Conv2FwdApply};
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
        let params = AppliedArgs::of(op, bn, c)?;
        // Taken out while in use (the lock is not held across `f`, which launches kernels).
        let kept = self.applied_scratch().remove(&len);
        let mut y = match kept {
            Some(t) => t,
            None => self.alloc(len, TensorRole::Activation)?,
        };
        let r = apply(self, op, rows, c, z, &params, &mut y).and_then(|()| f(&y));
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
    bn: &AppliedArgs<'_>,
    y: &mut CudaTensor,
) -> Result<(), BackendError> {
    let (apply, cfg) = apply_launch(be, op, "bn_apply", "bn_apply_vec", rows, c)?;
    let args = BnApply {
        x: z.bf16(op, "z")?.into(),
        mean: bn.mean.into(),
        invstd: bn.invstd.into(),
        gamma: bn.gamma.into(),
        beta: bn.beta.into(),
        residual: None,
        y: y.bf16_mut(op, "y")?.into(),
        total: (rows * c) as i64,
        channels: to_i32(op, "channels", c)?,
        relu: bn.relu,
    };
    be.launch(op, apply, cfg, args)?;
    be.note_work(4 * rows * c, 0.0);
    Ok(())
}

/// Shared memory a block keeps beside its dynamic shared memory (static tables, the driver's
/// reserve), for the check that an APPLY kernel's parameters fit.
const STATIC_SMEM_MARGIN: usize = 4096;

/// The v2 launch of `pass` (forward, or wgrad) for `s` with its kernel that applies the batch
/// norm as it loads its input (`stats`: the forward's statistics epilogue) and that kernel's
/// shared memory, when v2 runs the layer (v3 selected and taking it, v1, or a shape v2 refuses:
/// `None`, the composition runs) and the parameters fit in shared memory.
pub(super) fn apply_plan(
    be: &CudaBackend,
    pass: Pass,
    s: &ConvShape,
    stats: bool,
) -> Option<Conv2Launch> {
    let v3 = match pass {
        Pass::Forward => be.conv3_takes_forward(s),
        Pass::Wgrad => be.conv3_takes_wgrad(s),
        Pass::Dgrad => return None,
    };
    if v3 {
        return None;
    }
    let l = be.conv2_plan(pass, s)?;
    let kernel = l.apply_kernel(stats)?;
    let smem_bytes = l.apply_smem_bytes();
    (smem_bytes as usize + STATIC_SMEM_MARGIN <= be.limits.smem_per_sm).then_some(Conv2Launch {
        kernel,
        smem_bytes,
        ..l
    })
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
    if let Some(l) = apply_plan(be, Pass::Forward, s, moments.is_some()) {
        let op = "conv_forward_bn";
        conv_args(op, s)?;
        check_len(op, "z", z.len, s.x_len())?;
        check_len(op, "w", w.len, s.w_len())?;
        check_len(op, "y", y.len, s.y_len())?;
        let applied = AppliedArgs::of(op, bn, s.c_in)?;
        return match moments {
            Some(m) => bn_fused::conv_forward_moments_applied(be, s, z, &applied, w, y, m, &l),
            None => forward_applied(be, s, z, &applied, w, y, &l),
        };
    }
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
    if let Some(l) = apply_plan(be, Pass::Wgrad, s, false) {
        let op = "conv_backward_weight_bn";
        conv_args(op, s)?;
        check_len(op, "z", z.len, s.x_len())?;
        check_len(op, "dy", dy.len, s.y_len())?;
        check_len(op, "dw", dw.len, s.w_len())?;
        let applied = AppliedArgs::of(op, bn, s.c_in)?;
        let cfg = be.conv2_prepare(op, &l)?;
        let (dy, z) = (dy.bf16(op, "dy")?, z.bf16(op, "z")?);
        let dw = dw.f32_mut(op, "dw")?;
        let mut scratch = be.conv2.lock().unwrap_or_else(|e| e.into_inner());
        let Conv2Scratch { planes, .. } = &mut *scratch;
        return conv2_wgrad(be, op, s, &l, cfg, (z, dy), dw, planes, Some(&applied));
    }
    let rows = s.n * s.h * s.w;
    be.with_applied("conv_backward_weight_bn", rows, s.c_in, z, bn, |x| {
        be.conv_backward_weight(s, x, dy, dw)
    })
}

/// [`Backend::conv_forward_bn`] without moments through `l`, a `conv2_fwd_apply_*` launch
/// (the tensors' lengths checked by the caller).
fn forward_applied(
    be: &CudaBackend,
    s: &ConvShape,
    z: &CudaTensor,
    applied: &AppliedArgs<'_>,
    w: &CudaTensor,
    y: &mut CudaTensor,
    l: &Conv2Launch,
) -> Result<(), BackendError> {
    let op = "conv_forward_bn";
    let cfg = be.conv2_prepare(op, l)?;
    let gemm = Conv2FwdApply {
        z: z.bf16(op, "z")?.into(),
        w: w.bf16(op, "w")?.into(),
        y: y.bf16_mut(op, "y")?.into(),
        args: l.args,
        mean: applied.mean.into(),
        invstd: applied.invstd.into(),
        gamma: applied.gamma.into(),
        beta: applied.beta.into(),
        relu: applied.relu,
    };
    be.launch(op, l.kernel, cfg, gemm)?;
    be.note_work(2 * (s.x_len() + s.w_len() + s.y_len()), s.flops());
    Ok(())
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
