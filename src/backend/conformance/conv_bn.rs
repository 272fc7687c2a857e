//! The convolution that applies the batch norm before it ([`Backend::conv_forward_bn`],
//! [`Backend::conv_backward_weight_bn`], and [`Backend::conv_backward_data_bn`] with no
//! stored output) against the same backend's separate ops over the batch norm's output as it
//! stores it: forward (with and without the moments), weight gradient and the finished data
//! gradient to the bit, since applying the batch norm on load must change nothing but where
//! the output lives; and against the CPU reference within a tolerance, and repeatable.
//!
//! The batch norm's inputs are exact ([`super::applied::Inputs`]: γ negative, zero and
//! positive, a β that leaves a channel all negative), so a transformed zero in the padding, a
//! mask read from the wrong values or a lost ReLU each changes bits.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::applied::{grid, same_bits_twice, Inputs};
use super::{conv, CheckReport, Pair, Tolerance};
use crate::backend::{AppliedBn, Backend, BackendError, BnGradEpilogue, ConvShape, TensorRole};

/// One check's tensors on the tested backend.
struct Uploaded<T> {
    z: T,
    w: T,
    dy: T,
    mean: T,
    invstd: T,
    gamma: T,
    beta: T,
    residual: T,
}

impl<B: Backend> Pair<'_, B> {
    /// Zero-filled (NaN-filled where the op overwrites) outputs of `len` values.
    fn blank(&self, len: usize, role: TensorRole) -> Result<B::Tensor, BackendError> {
        self.up(&vec![f32::NAN; len], role)
    }

    /// The applied convolution at shape `s`, with and without ReLU.
    fn conv_bn(&mut self, s: ConvShape, rng: &mut ChaCha8Rng) -> Result<(), BackendError> {
        let c = s.c_in;
        let inputs = Inputs::new(s.n * s.h * s.w, 0, c, rng);
        let w = grid(rng, s.w_len(), -0.5, 0.5, 1.0 / 64.0);
        let dy = grid(rng, s.y_len(), -1.0, 1.0, 1.0 / 128.0);
        let residual = grid(rng, s.x_len(), -1.0, 1.0, 1.0 / 128.0);
        let (act, stat, weight) = (
            TensorRole::Activation,
            TensorRole::Statistic,
            TensorRole::Weight,
        );
        let t = Uploaded {
            z: self.up(&inputs.z, act)?,
            w: self.up(&w, weight)?,
            dy: self.up(&dy, act)?,
            mean: self.up(&inputs.mean, stat)?,
            invstd: self.up(&inputs.invstd, stat)?,
            gamma: self.up(&inputs.gamma, weight)?,
            beta: self.up(&inputs.beta, weight)?,
            residual: self.up(&residual, act)?,
        };
        for relu in [true, false] {
            let tag = format!(
                "k{} s{} p{} {}x{}x{}x{}→{} relu={relu}",
                s.kernel, s.stride, s.padding, s.n, s.h, s.w, c, s.c_out
            );
            // The batch norm's output as the backend stores it, and the separate ops over it.
            let x = self.stored(&inputs.bn_output(c, relu))?;
            let tx = self.up(&x, act)?;
            let bn = AppliedBn {
                gamma: &t.gamma,
                beta: &t.beta,
                saved_mean: &t.mean,
                saved_invstd: &t.invstd,
                relu,
            };
            let mut want = vec![0.0; s.y_len()];
            self.reference.conv_forward(&s, &x, &w, &mut want)?;
            let mut sep = self.blank(s.y_len(), act)?;
            self.test.conv_forward(&s, &tx, &t.w, &mut sep)?;
            let sep = self.test.download(&sep)?;
            let mut got = self.blank(s.y_len(), act)?;
            self.test
                .conv_forward_bn(&s, &t.z, &bn, &t.w, &mut got, None)?;
            self.check_bits(format!("conv_forward_bn y {tag}"), &got, &sep)?;
            self.check(format!("conv_forward_bn y vs reference {tag}"), &got, &want)?;

            let mut sep_m = self.blank(3 * s.c_out, stat)?;
            let mut sep_y = self.blank(s.y_len(), act)?;
            self.test
                .conv_forward_moments(&s, &tx, &t.w, &mut sep_y, &mut sep_m)?;
            let (sep_y, sep_m) = (self.test.download(&sep_y)?, self.test.download(&sep_m)?);
            let mut got_m = self.blank(3 * s.c_out, stat)?;
            let mut got_y = self.blank(s.y_len(), act)?;
            self.test
                .conv_forward_bn(&s, &t.z, &bn, &t.w, &mut got_y, Some(&mut got_m))?;
            self.check_bits(format!("conv_forward_bn+moments y {tag}"), &got_y, &sep_y)?;
            self.check_bits(format!("conv_forward_bn moments {tag}"), &got_m, &sep_m)?;

            let mut want_dw = vec![0.0; s.w_len()];
            self.reference
                .conv_backward_weight(&s, &x, &dy, &mut want_dw)?;
            let mut sep_dw = self.blank(s.w_len(), TensorRole::WeightGrad)?;
            self.test
                .conv_backward_weight(&s, &tx, &t.dy, &mut sep_dw)?;
            let sep_dw = self.test.download(&sep_dw)?;
            let mut got_dw = self.blank(s.w_len(), TensorRole::WeightGrad)?;
            self.test
                .conv_backward_weight_bn(&s, &t.z, &bn, &t.dy, &mut got_dw)?;
            self.check_bits(
                format!("conv_backward_weight_bn dw {tag}"),
                &got_dw,
                &sep_dw,
            )?;
            self.check(
                format!("conv_backward_weight_bn dw vs reference {tag}"),
                &got_dw,
                &want_dw,
            )?;

            // The finished data gradient: the mask recomputed from z against the stored
            // output's, plain and accumulating onto a residual's gradient.
            for accumulate in [false, true] {
                let mut outs = Vec::new();
                for stored in [true, false] {
                    let mut dx = self.up(&residual, act)?;
                    let mut dg = self.blank(c, TensorRole::WeightGrad)?;
                    let mut db = self.blank(c, TensorRole::WeightGrad)?;
                    self.test.conv_backward_data_bn(
                        &s,
                        &t.dy,
                        &t.w,
                        &mut dx,
                        accumulate,
                        BnGradEpilogue {
                            x: &t.z,
                            y: stored.then_some(&tx),
                            y_recomputable: false,
                            relu,
                            gamma: &t.gamma,
                            beta: &t.beta,
                            saved_mean: &t.mean,
                            saved_invstd: &t.invstd,
                            residual_grad: accumulate.then_some(&t.residual),
                            dgamma: &mut dg,
                            dbeta: &mut db,
                        },
                    )?;
                    outs.push((dx, dg, db));
                }
                let (dx, dg, db) = &outs[0];
                let want = [
                    self.test.download(dx)?,
                    self.test.download(dg)?,
                    self.test.download(db)?,
                ];
                let (dx, dg, db) = &outs[1];
                let acc = if accumulate { " accumulating" } else { "" };
                self.check_bits(format!("conv_backward_data_bn dx{acc} {tag}"), dx, &want[0])?;
                self.check_bits(
                    format!("conv_backward_data_bn dgamma{acc} {tag}"),
                    dg,
                    &want[1],
                )?;
                self.check_bits(
                    format!("conv_backward_data_bn dbeta{acc} {tag}"),
                    db,
                    &want[2],
                )?;
            }
        }
        Ok(())
    }
}

/// The shapes [`check_conv_bn`] runs: the convolutions that read an inner batch norm's
/// output in ResNets (3×3 pad 1 at strides 1 and 2, 1×1 at stride 1), at odd sizes, with
/// channel counts in whole 8-channel groups (a GPU's 16-byte loads) and not, one of 16 (the
/// CIFAR ResNets, a GPU's small-channel gathers), and a map larger than one tile.
pub fn conv_bn_shapes() -> Vec<ConvShape> {
    vec![
        conv(2, 7, 6, 8, 16, 3, 1, 1),
        conv(3, 9, 9, 16, 24, 3, 2, 1),
        conv(2, 10, 10, 64, 32, 1, 1, 0),
        conv(2, 5, 5, 5, 8, 3, 1, 1),
        conv(2, 9, 8, 32, 64, 1, 2, 0),
        conv(4, 17, 15, 72, 64, 3, 1, 1),
    ]
}

/// Checks `backend`'s applied convolution ([`Backend::conv_forward_bn`],
/// [`Backend::conv_backward_weight_bn`], [`Backend::conv_backward_data_bn`] with no stored
/// output) at each of `shapes` ([`conv_bn_shapes`]): to the bit against its own separate ops
/// over the batch norm's stored output, and the forward and weight gradient within `tol`
/// (scaled by the largest magnitude) of the CPU reference's.
pub fn check_conv_bn<B: Backend>(
    backend: &B,
    shapes: &[ConvShape],
    tol: Tolerance,
) -> Result<Vec<CheckReport>, BackendError> {
    let mut pair = Pair::new(backend, tol, true)?;
    let mut rng = ChaCha8Rng::seed_from_u64(0xc0b4);
    for &s in shapes {
        pair.conv_bn(s, &mut rng)?;
    }
    Ok(pair.reports)
}

/// Runs `backend`'s applied convolution twice on the same inputs at each of `shapes` and
/// demands the same bits (y, its moments, dw).
pub fn check_conv_bn_repeatable<B: Backend>(
    backend: &B,
    shapes: &[ConvShape],
) -> Result<(), BackendError> {
    let mut rng = ChaCha8Rng::seed_from_u64(0xc0b5);
    let up = |data: &[f32], role| -> Result<B::Tensor, BackendError> {
        let mut t = backend.alloc(data.len(), role)?;
        backend.upload(data, &mut t)?;
        Ok(t)
    };
    for &s in shapes {
        let c = s.c_in;
        let inputs = Inputs::new(s.n * s.h * s.w, 0, c, &mut rng);
        let (act, stat, weight) = (
            TensorRole::Activation,
            TensorRole::Statistic,
            TensorRole::Weight,
        );
        let (z, w) = (
            up(&inputs.z, act)?,
            up(&grid(&mut rng, s.w_len(), -0.5, 0.5, 1.0 / 64.0), weight)?,
        );
        let dy = up(&grid(&mut rng, s.y_len(), -1.0, 1.0, 1.0 / 128.0), act)?;
        let (mean, invstd) = (up(&inputs.mean, stat)?, up(&inputs.invstd, stat)?);
        let (gamma, beta) = (up(&inputs.gamma, weight)?, up(&inputs.beta, weight)?);
        let bn = AppliedBn {
            gamma: &gamma,
            beta: &beta,
            saved_mean: &mean,
            saved_invstd: &invstd,
            relu: true,
        };
        let mut runs: Vec<Vec<Vec<f32>>> = Vec::new();
        for _ in 0..2 {
            let mut y = backend.alloc(s.y_len(), act)?;
            let mut m = backend.alloc(3 * s.c_out, stat)?;
            backend.conv_forward_bn(&s, &z, &bn, &w, &mut y, Some(&mut m))?;
            let mut dw = backend.alloc(s.w_len(), TensorRole::WeightGrad)?;
            backend.conv_backward_weight_bn(&s, &z, &bn, &dy, &mut dw)?;
            runs.push(vec![
                backend.download(&y)?,
                backend.download(&m)?,
                backend.download(&dw)?,
            ]);
        }
        let shape = format!("{}x{}x{}x{c}", s.n, s.h, s.w);
        same_bits_twice(&format!("conv_bn {shape}"), &["y", "moments", "dw"], &runs)?;
    }
    Ok(())
}
