//! What the checks of a batch norm applied by its reader share ([`super::pool_bn`],
//! [`super::conv_bn`]): exact inputs and comparisons to the bit.
//!
//! The inputs make the batch norm exact: z on a grid of 2⁻⁷, the mean on 2⁻⁴, invstd a power
//! of two, γ and β on 2⁻² and 2⁻³, so `(z − mean)·invstd·γ + β` needs at most 16 significant
//! bits and every way of writing it (the CPU's `(z − mean)·(γ·invstd) + β`, its reference's
//! `z·scale + shift`, the GPU's) gives the same f32.

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::{CheckReport, Pair};
use crate::backend::{Backend, BackendError, TensorRole};

/// Exact inputs of one check (see the module docs): z, dy, and per channel mean, invstd, γ, β.
pub(super) struct Inputs {
    pub(super) z: Vec<f32>,
    pub(super) dy: Vec<f32>,
    pub(super) mean: Vec<f32>,
    pub(super) invstd: Vec<f32>,
    pub(super) gamma: Vec<f32>,
    pub(super) beta: Vec<f32>,
}

/// `n` values on the grid of `step` in `[lo, hi)`.
pub(super) fn grid(rng: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32, step: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.random_range(lo..hi) / step).round() * step)
        .collect()
}

impl Inputs {
    /// Inputs for `rows` pixels of z and `out_rows` of dy, `c` channels each.
    pub(super) fn new(rows: usize, out_rows: usize, c: usize, rng: &mut ChaCha8Rng) -> Inputs {
        let z = grid(rng, rows * c, -2.0, 2.0, 1.0 / 128.0);
        let dy = grid(rng, out_rows * c, -1.0, 1.0, 1.0 / 128.0);
        let mean = grid(rng, c, -0.5, 0.5, 1.0 / 16.0);
        let invstd = (0..c).map(|ch| [0.5, 1.0, 2.0, 4.0][ch % 4]).collect();
        // γ negative, zero and positive by channel; some β so low that a channel without a
        // ReLU has only negative values (a transformed zero for padding would win there).
        let gamma = (0..c)
            .map(|ch| [-1.5, 0.0, 1.25, -0.25, 0.5, 1.0][ch % 6])
            .collect();
        let beta = (0..c)
            .map(|ch| match ch % 5 {
                4 => -8.0,
                _ => (rng.random_range(-1.0f32..1.0) * 8.0).round() / 8.0,
            })
            .collect();
        Inputs {
            z,
            dy,
            mean,
            invstd,
            gamma,
            beta,
        }
    }

    /// The batch norm's output, exact in f32.
    pub(super) fn bn_output(&self, c: usize, relu: bool) -> Vec<f32> {
        let out = self.z.iter().enumerate().map(|(i, &z)| {
            let ch = i % c;
            (z - self.mean[ch]) * self.invstd[ch] * self.gamma[ch] + self.beta[ch]
        });
        out.map(|v| if relu { v.max(0.0) } else { v }).collect()
    }
}

impl<B: Backend> Pair<'_, B> {
    /// `data` as the tested backend stores an activation (a bf16 backend rounds it).
    pub(super) fn stored(&self, data: &[f32]) -> Result<Vec<f32>, BackendError> {
        let t = self.up(data, TensorRole::Activation)?;
        self.test.download(&t)
    }

    /// Requires the same bits as `want`.
    pub(super) fn check_bits(
        &mut self,
        name: String,
        got: &B::Tensor,
        want: &[f32],
    ) -> Result<(), BackendError> {
        let got = self.test.download(got)?;
        if let Some(i) = (0..want.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
            return Err(BackendError::Mismatch {
                check: name,
                detail: format!("element {i}: got {}, separate ops {}", got[i], want[i]),
            });
        }
        self.reports.push(CheckReport {
            name,
            elements: want.len(),
            max_abs_err: 0.0,
            worst_ratio: 0.0,
        });
        Ok(())
    }
}

/// Requires two runs' outputs (`runs[r][i]`, named `names[i]`) to have the same bits.
pub(super) fn same_bits_twice(
    check: &str,
    names: &[&str],
    runs: &[Vec<Vec<f32>>],
) -> Result<(), BackendError> {
    for (name, (a, b)) in names.iter().zip(runs[0].iter().zip(&runs[1])) {
        if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
            return Err(BackendError::Mismatch {
                check: format!("{check} {name} twice"),
                detail: format!("element {i}: {} then {}", a[i], b[i]),
            });
        }
    }
    Ok(())
}
