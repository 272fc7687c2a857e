//! Conformance checks: run every op (and whole training steps) on a backend under test and on
//! the CPU reference with identical random inputs, and compare with llm.c's rule
//! `|got − ref| ≤ atol + rtol·|ref|`. The CUDA backend's tests call these with its own
//! tolerance (bf16 storage needs a looser one than f32); the CPU backend's tests call them with
//! another thread count, which must agree to f32 rounding.
//!
//! Backward ops are fed the *reference* forward results (uploaded), so each op is checked in
//! isolation and a ReLU mask can never differ between the two sides.
//!
//! By family: the plain ops (`ops`: convolutions, batch norm, pooling, the head and loss, the
//! input stage), batch norm fused into the convolutions (`bn_fusion`), and whole networks
//! (`network`); this file holds the comparison rule and the pair of backends they share.

mod applied;
mod bn_fusion;
mod conv_bn;
mod network;
mod ops;
mod pool_bn;

use std::fmt;

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::cpu::CpuBackend;
use super::{Backend, BackendError, ConvShape, TensorRole};

pub use bn_fusion::{bn_fusion_shapes, check_bn_fusion, check_bn_fusion_repeatable};
pub use conv_bn::{check_conv_bn, check_conv_bn_repeatable, conv_bn_shapes};
pub use network::check_network;
pub use ops::{check_convs, check_ops};
pub use pool_bn::{check_pool_bn, check_pool_bn_repeatable, pool_bn_shapes};

/// Allowed difference: `atol + rtol·|ref|` per element.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    /// Absolute part.
    pub atol: f32,
    /// Relative part.
    pub rtol: f32,
}

impl Tolerance {
    /// For an f32 backend (summation order may differ).
    pub const F32: Tolerance = Tolerance {
        atol: 1e-4,
        rtol: 1e-4,
    };
}

/// The outcome of one comparison.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckReport {
    /// What was compared, e.g. `conv_forward k3 s2 p1 2x9x7x5→4`.
    pub name: String,
    /// Elements compared.
    pub elements: usize,
    /// Largest |got − ref|.
    pub max_abs_err: f32,
    /// Largest error / allowed error (≤ 1 passes).
    pub worst_ratio: f32,
}

impl fmt::Display for CheckReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<48} {:>9} elems  max err {:.3e}  err/tol {:.3}",
            self.name, self.elements, self.max_abs_err, self.worst_ratio
        )
    }
}

/// Compares `got` with the reference `want` element-wise.
pub fn compare(
    name: &str,
    got: &[f32],
    want: &[f32],
    tol: Tolerance,
) -> Result<CheckReport, BackendError> {
    compare_scaled(name, got, want, tol, 1.0)
}

/// Like [`compare`], with the absolute part multiplied by `scale` (e.g. a tensor's largest
/// reference magnitude, for gradients whose size varies by orders between layers).
fn compare_scaled(
    name: &str,
    got: &[f32],
    want: &[f32],
    tol: Tolerance,
    scale: f32,
) -> Result<CheckReport, BackendError> {
    compare_with_allowance(name, got, want, tol, scale, &[])
}

/// [`compare_scaled`] with `allowance[i]` more for element `i` (none where it is shorter):
/// what an error the reference can bound, such as the rounding of a stored operand, adds.
fn compare_with_allowance(
    name: &str,
    got: &[f32],
    want: &[f32],
    tol: Tolerance,
    scale: f32,
    allowance: &[f32],
) -> Result<CheckReport, BackendError> {
    if got.len() != want.len() {
        return Err(BackendError::Mismatch {
            check: name.to_string(),
            detail: format!("{} values vs {} in the reference", got.len(), want.len()),
        });
    }
    let mut report = CheckReport {
        name: name.to_string(),
        elements: got.len(),
        max_abs_err: 0.0,
        worst_ratio: 0.0,
    };
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        let allowed =
            tol.atol * scale + tol.rtol * w.abs() + allowance.get(i).copied().unwrap_or(0.0);
        let ratio = if allowed > 0.0 {
            err / allowed
        } else if err == 0.0 {
            0.0
        } else {
            f32::INFINITY
        };
        if ratio.is_nan() || ratio > 1.0 {
            return Err(BackendError::Mismatch {
                check: name.to_string(),
                detail: format!("element {i}: got {g}, reference {w} (allowed ±{allowed:.3e})"),
            });
        }
        report.max_abs_err = report.max_abs_err.max(err);
        report.worst_ratio = report.worst_ratio.max(ratio);
    }
    Ok(report)
}

fn random(rng: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// [`random`] rounded to bf16: values a bf16 backend stores exactly, so its checks measure
/// what it computes, not the rounding of its inputs.
fn random_bf16(rng: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n)
        .map(|_| half::bf16::from_f32(rng.random_range(lo..hi)).to_f32())
        .collect()
}

/// Both backends with the data each side needs.
struct Pair<'a, B: Backend> {
    reference: CpuBackend,
    test: &'a B,
    tol: Tolerance,
    /// Scale the absolute tolerance by the tensor's largest reference magnitude (long sums).
    scaled: bool,
    reports: Vec<CheckReport>,
}

impl<'a, B: Backend> Pair<'a, B> {
    /// `test` against a fresh CPU reference, its tolerance `scaled` or not by each tensor's
    /// largest reference magnitude.
    fn new(test: &'a B, tol: Tolerance, scaled: bool) -> Result<Self, BackendError> {
        Ok(Pair {
            reference: CpuBackend::reference(2)?,
            test,
            tol,
            scaled,
            reports: Vec::new(),
        })
    }

    fn up(&self, data: &[f32], role: TensorRole) -> Result<B::Tensor, BackendError> {
        let mut t = self.test.alloc(data.len(), role)?;
        self.test.upload(data, &mut t)?;
        Ok(t)
    }

    fn check(&mut self, name: String, got: &B::Tensor, want: &[f32]) -> Result<(), BackendError> {
        self.check_with_allowance(name, got, want, &[])
    }

    /// [`Pair::check`] with a per-element `allowance` added to the tolerance.
    fn check_with_allowance(
        &mut self,
        name: String,
        got: &B::Tensor,
        want: &[f32],
        allowance: &[f32],
    ) -> Result<(), BackendError> {
        let got = self.test.download(got)?;
        let scale = if self.scaled {
            want.iter()
                .fold(0.0f32, |a, v| a.max(v.abs()))
                .max(f32::MIN_POSITIVE)
        } else {
            1.0
        };
        let r =
            compare_with_allowance(&name, &got[..want.len()], want, self.tol, scale, allowance)?;
        self.reports.push(r);
        Ok(())
    }
}

/// A convolution shape from its numbers in `ConvShape`'s field order.
#[allow(clippy::too_many_arguments)]
fn conv(
    n: usize,
    h: usize,
    w: usize,
    c_in: usize,
    c_out: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
) -> ConvShape {
    ConvShape {
        n,
        h,
        w,
        c_in,
        c_out,
        kernel,
        stride,
        padding,
    }
}
