//! Conformance checks: run every op (and whole training steps) on a backend under test and on
//! the CPU reference with identical random inputs, and compare with llm.c's rule
//! `|got − ref| ≤ atol + rtol·|ref|`. The CUDA backend's tests call these with its own
//! tolerance (bf16 storage needs a looser one than f32); the CPU backend's tests call them with
//! another thread count, which must agree to f32 rounding.
//!
//! Backward ops are fed the *reference* forward results (uploaded), so each op is checked in
//! isolation and a ReLU mask can never differ between the two sides.

use std::fmt;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::cpu::CpuBackend;
use super::{
    Backend, BackendError, BnBackward, BnForward, BnGradEpilogue, BnMode, BnShape, ConvShape,
    LinearShape, PoolShape, Targets, TensorRole,
};
use crate::model::{
    Arch, Augment, Graph, InputBatch, Mix, ModelError, ModelState, Network, NetworkConfig, PixelBox,
};

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
        let allowed = tol.atol * scale + tol.rtol * w.abs();
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

impl<B: Backend> Pair<'_, B> {
    fn up(&self, data: &[f32], role: TensorRole) -> Result<B::Tensor, BackendError> {
        let mut t = self.test.alloc(data.len(), role)?;
        self.test.upload(data, &mut t)?;
        Ok(t)
    }

    fn check(&mut self, name: String, got: &B::Tensor, want: &[f32]) -> Result<(), BackendError> {
        let got = self.test.download(got)?;
        let scale = if self.scaled {
            want.iter()
                .fold(0.0f32, |a, v| a.max(v.abs()))
                .max(f32::MIN_POSITIVE)
        } else {
            1.0
        };
        let r = compare_scaled(&name, &got[..want.len()], want, self.tol, scale)?;
        self.reports.push(r);
        Ok(())
    }

    fn conv(&mut self, s: ConvShape, rng: &mut ChaCha8Rng) -> Result<(), BackendError> {
        let tag = format!(
            "k{} s{} p{} {}x{}x{}x{}→{}",
            s.kernel, s.stride, s.padding, s.n, s.h, s.w, s.c_in, s.c_out
        );
        let x = random(rng, s.x_len(), -1.0, 1.0);
        let w = random(rng, s.w_len(), -0.5, 0.5);
        let dy = random(rng, s.y_len(), -1.0, 1.0);
        let dx0 = random(rng, s.x_len(), -1.0, 1.0);
        let r = &self.reference;
        let mut y = vec![0.0; s.y_len()];
        r.conv_forward(&s, &x, &w, &mut y)?;
        let mut dx = vec![0.0; s.x_len()];
        r.conv_backward_data(&s, &dy, &w, &mut dx, false)?;
        let mut dx_acc = dx0.clone();
        r.conv_backward_data(&s, &dy, &w, &mut dx_acc, true)?;
        let mut dw = vec![0.0; s.w_len()];
        r.conv_backward_weight(&s, &x, &dy, &mut dw)?;

        let (tx, tw, tdy) = (
            self.up(&x, TensorRole::Activation)?,
            self.up(&w, TensorRole::Weight)?,
            self.up(&dy, TensorRole::Activation)?,
        );
        let mut ty = self.test.alloc(s.y_len(), TensorRole::Activation)?;
        self.test.conv_forward(&s, &tx, &tw, &mut ty)?;
        self.check(format!("conv_forward {tag}"), &ty, &y)?;
        let mut tdx = self.test.alloc(s.x_len(), TensorRole::Activation)?;
        self.test
            .conv_backward_data(&s, &tdy, &tw, &mut tdx, false)?;
        self.check(format!("conv_backward_data {tag}"), &tdx, &dx)?;
        let mut tdx = self.up(&dx0, TensorRole::Activation)?;
        self.test
            .conv_backward_data(&s, &tdy, &tw, &mut tdx, true)?;
        self.check(format!("conv_backward_data+acc {tag}"), &tdx, &dx_acc)?;
        let mut tdw = self.test.alloc(s.w_len(), TensorRole::WeightGrad)?;
        self.test.conv_backward_weight(&s, &tx, &tdy, &mut tdw)?;
        self.check(format!("conv_backward_weight {tag}"), &tdw, &dw)
    }

    fn bn(
        &mut self,
        rows: usize,
        c: usize,
        residual: bool,
        relu: bool,
        mode: BnMode,
        rng: &mut ChaCha8Rng,
    ) -> Result<(), BackendError> {
        let tag = format!("{mode:?} {rows}x{c} res={residual} relu={relu}");
        let shape = BnShape { rows, channels: c };
        let x = random(rng, rows * c, -2.0, 2.5);
        let gamma = random(rng, c, 0.5, 1.5);
        let beta = random(rng, c, -0.5, 0.5);
        let res = random(rng, rows * c, -1.0, 1.0);
        let rm0 = random(rng, c, -0.5, 0.5);
        let rv0 = random(rng, c, 0.5, 1.5);
        let dy = random(rng, rows * c, -1.0, 1.0);
        let dres0 = random(rng, rows * c, -1.0, 1.0);
        let (mut y, mut m, mut is) = (vec![0.0; rows * c], vec![0.0; c], vec![0.0; c]);
        let (mut rm, mut rv) = (rm0.clone(), rv0.clone());
        self.reference.bn_forward(BnForward {
            shape,
            x: &x,
            gamma: &gamma,
            beta: &beta,
            residual: residual.then_some(&res),
            relu,
            y: &mut y,
            saved_mean: &mut m,
            saved_invstd: &mut is,
            running_mean: &mut rm,
            running_var: &mut rv,
            mode,
            momentum: 0.1,
            eps: 1e-5,
            moments: None,
        })?;
        let (mut dx, mut dg, mut db) = (vec![0.0; rows * c], vec![0.0; c], vec![0.0; c]);
        let mut dres = dres0.clone();
        self.reference.bn_backward(BnBackward {
            shape,
            x: &x,
            y: &y,
            gamma: &gamma,
            saved_mean: &m,
            saved_invstd: &is,
            batch_stats: mode == BnMode::Train,
            relu,
            dy: &dy,
            dx: &mut dx,
            dresidual: residual.then_some((&mut dres, true)),
            dgamma: &mut dg,
            dbeta: &mut db,
            prepared: false,
        })?;

        let act = TensorRole::Activation;
        let stat = TensorRole::Statistic;
        let (tx, tg, tb, tres) = (
            self.up(&x, act)?,
            self.up(&gamma, TensorRole::Weight)?,
            self.up(&beta, TensorRole::Weight)?,
            self.up(&res, act)?,
        );
        let mut ty = self.test.alloc(rows * c, act)?;
        let (mut tm, mut tis) = (self.test.alloc(c, stat)?, self.test.alloc(c, stat)?);
        let (mut trm, mut trv) = (self.up(&rm0, stat)?, self.up(&rv0, stat)?);
        self.test.bn_forward(BnForward {
            shape,
            x: &tx,
            gamma: &tg,
            beta: &tb,
            residual: residual.then_some(&tres),
            relu,
            y: &mut ty,
            saved_mean: &mut tm,
            saved_invstd: &mut tis,
            running_mean: &mut trm,
            running_var: &mut trv,
            mode,
            momentum: 0.1,
            eps: 1e-5,
            moments: None,
        })?;
        self.check(format!("bn_forward y {tag}"), &ty, &y)?;
        self.check(format!("bn_forward running_mean {tag}"), &trm, &rm)?;
        self.check(format!("bn_forward running_var {tag}"), &trv, &rv)?;
        // Backward from the reference forward's outputs.
        let (ty, tm, tis, tdy) = (
            self.up(&y, act)?,
            self.up(&m, stat)?,
            self.up(&is, stat)?,
            self.up(&dy, act)?,
        );
        let mut tdx = self.test.alloc(rows * c, act)?;
        let mut tdres = self.up(&dres0, act)?;
        let (mut tdg, mut tdb) = (
            self.test.alloc(c, TensorRole::WeightGrad)?,
            self.test.alloc(c, TensorRole::WeightGrad)?,
        );
        self.test.bn_backward(BnBackward {
            shape,
            x: &tx,
            y: &ty,
            gamma: &tg,
            saved_mean: &tm,
            saved_invstd: &tis,
            batch_stats: mode == BnMode::Train,
            relu,
            dy: &tdy,
            dx: &mut tdx,
            dresidual: residual.then_some((&mut tdres, true)),
            dgamma: &mut tdg,
            dbeta: &mut tdb,
            prepared: false,
        })?;
        self.check(format!("bn_backward dx {tag}"), &tdx, &dx)?;
        self.check(format!("bn_backward dgamma {tag}"), &tdg, &dg)?;
        self.check(format!("bn_backward dbeta {tag}"), &tdb, &db)?;
        if residual {
            self.check(format!("bn_backward dresidual+acc {tag}"), &tdres, &dres)?;
        }
        Ok(())
    }

    /// The fused batch-norm ops at shape `s`: `conv_forward_moments` (y and its moments
    /// against f64 moments of the reference's y), `conv_backward_data_bn` with and without
    /// accumulation, residual gradient and mask (g and its sums against f64 ones), then
    /// `bn_forward` from moments and the `prepared` `bn_backward` against the reference's
    /// separate ops on the same data (γ of both signs).
    fn bn_fusion(&mut self, s: ConvShape, rng: &mut ChaCha8Rng) -> Result<(), BackendError> {
        let tag = format!(
            "k{} s{} p{} {}x{}x{}x{}→{}",
            s.kernel, s.stride, s.padding, s.n, s.h, s.w, s.c_in, s.c_out
        );
        let (act, stat) = (TensorRole::Activation, TensorRole::Statistic);
        let x = random_bf16(rng, s.x_len(), -1.0, 1.0);
        let w = random_bf16(rng, s.w_len(), -0.5, 0.5);
        // Forward: y and the moments of y.
        let r = &self.reference;
        let mut y = vec![0.0; s.y_len()];
        r.conv_forward(&s, &x, &w, &mut y)?;
        let (rows, k) = (s.n * s.out_h() * s.out_w(), s.c_out);
        let moments = host_moments(&y, rows, k);
        let (tx, tw) = (self.up(&x, act)?, self.up(&w, TensorRole::Weight)?);
        let mut ty = self.test.alloc(s.y_len(), act)?;
        let mut tm = self.up(&vec![f32::NAN; 3 * k], stat)?;
        self.test
            .conv_forward_moments(&s, &tx, &tw, &mut ty, &mut tm)?;
        self.check(format!("conv_forward_moments y {tag}"), &ty, &y)?;
        self.check(
            format!("conv_forward_moments mean {tag}"),
            &tm,
            &moments[..k],
        )?;
        let got = self.test.download(&tm)?;
        let m2_scale = moments[k..2 * k].iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let m2 = compare_scaled(
            &format!("conv_forward_moments M2 {tag}"),
            &got[k..2 * k],
            &moments[k..2 * k],
            self.tol,
            m2_scale.max(f32::MIN_POSITIVE),
        )?;
        self.reports.push(m2);
        let n = compare(
            &format!("conv_forward_moments count {tag}"),
            &got[2 * k..3 * k],
            &moments[2 * k..],
            Tolerance {
                atol: 0.0,
                rtol: 0.0,
            },
        )?;
        self.reports.push(n);

        // Backward: the data gradient finished for the batch norm that produced x.
        let (rows_in, c) = (s.n * s.h * s.w, s.c_in);
        let dy = random_bf16(rng, s.y_len(), -1.0, 1.0);
        let dx0 = random_bf16(rng, s.x_len(), -1.0, 1.0);
        let res = random_bf16(rng, s.x_len(), -1.0, 1.0);
        let bn_y = random_bf16(rng, s.x_len(), -1.0, 1.0);
        let bn_x: Vec<f32> = random_bf16(rng, s.x_len(), -1.0, 1.0)
            .iter()
            .enumerate()
            .map(|(i, v)| v + 0.25 * (i % c) as f32)
            .collect();
        let mean: Vec<f32> = (0..c).map(|ch| 0.25 * ch as f32).collect();
        let invstd = random_bf16(rng, c, 0.5, 1.5);
        let (tdy, tbx, tby) = (
            self.up(&dy, act)?,
            self.up(&bn_x, act)?,
            self.up(&bn_y, act)?,
        );
        let (tmean, tinv, tres) = (
            self.up(&mean, stat)?,
            self.up(&invstd, stat)?,
            self.up(&res, act)?,
        );
        for (accumulate, residual, relu) in [
            (false, true, true),
            (true, false, true),
            (false, false, false),
        ] {
            let mut g = if accumulate {
                dx0.clone()
            } else {
                vec![0.0; s.x_len()]
            };
            self.reference
                .conv_backward_data(&s, &dy, &w, &mut g, accumulate)?;
            let (mut sb, mut sg) = (vec![0.0f64; c], vec![0.0f64; c]);
            for (i, v) in g.iter_mut().enumerate() {
                if residual {
                    *v += res[i];
                }
                if relu && bn_y[i] <= 0.0 {
                    *v = 0.0;
                }
                let ch = i % c;
                sb[ch] += f64::from(*v);
                sg[ch] += f64::from(*v) * f64::from(bn_x[i] - mean[ch]) * f64::from(invstd[ch]);
            }
            let sb: Vec<f32> = sb.iter().map(|&v| v as f32).collect();
            let sg: Vec<f32> = sg.iter().map(|&v| v as f32).collect();
            let mut tdx = self.up(if accumulate { &dx0 } else { &res }, act)?;
            let (mut tdg, mut tdb) = (
                self.test.alloc(c, TensorRole::WeightGrad)?,
                self.test.alloc(c, TensorRole::WeightGrad)?,
            );
            self.test.conv_backward_data_bn(
                &s,
                &tdy,
                &tw,
                &mut tdx,
                accumulate,
                BnGradEpilogue {
                    x: &tbx,
                    y: &tby,
                    relu,
                    saved_mean: &tmean,
                    saved_invstd: &tinv,
                    residual_grad: residual.then_some(&tres),
                    dgamma: &mut tdg,
                    dbeta: &mut tdb,
                },
            )?;
            let v = format!("acc={accumulate} res={residual} relu={relu} {tag}");
            self.check(
                format!("conv_backward_data_bn g {v}"),
                &tdx,
                &g[..rows_in * c],
            )?;
            self.check(format!("conv_backward_data_bn dbeta {v}"), &tdb, &sb)?;
            self.check(format!("conv_backward_data_bn dgamma {v}"), &tdg, &sg)?;
        }

        // The batch norm of y from the moments, and its prepared backward.
        let shape = BnShape { rows, channels: k };
        let mut gamma = random_bf16(rng, k, 0.5, 1.5);
        for v in gamma.iter_mut().step_by(3) {
            *v = -*v;
        }
        let beta = random_bf16(rng, k, -0.5, 0.5);
        let (rm0, rv0) = (
            random_bf16(rng, k, -0.5, 0.5),
            random_bf16(rng, k, 0.5, 1.5),
        );
        let mut out = vec![0.0; s.y_len()];
        let (mut sm, mut si) = (vec![0.0; k], vec![0.0; k]);
        let (mut rm, mut rv) = (rm0.clone(), rv0.clone());
        self.reference.bn_forward(BnForward {
            shape,
            x: &y,
            gamma: &gamma,
            beta: &beta,
            residual: None,
            relu: true,
            y: &mut out,
            saved_mean: &mut sm,
            saved_invstd: &mut si,
            running_mean: &mut rm,
            running_var: &mut rv,
            mode: BnMode::Train,
            momentum: 0.1,
            eps: 1e-5,
            moments: None,
        })?;
        let (ty_ref, tg, tb) = (
            self.up(&y, act)?,
            self.up(&gamma, TensorRole::Weight)?,
            self.up(&beta, TensorRole::Weight)?,
        );
        let tmom = self.up(&moments, stat)?;
        let mut tout = self.test.alloc(s.y_len(), act)?;
        let (mut tsm, mut tsi) = (self.test.alloc(k, stat)?, self.test.alloc(k, stat)?);
        let (mut trm, mut trv) = (self.up(&rm0, stat)?, self.up(&rv0, stat)?);
        self.test.bn_forward(BnForward {
            shape,
            x: &ty_ref,
            gamma: &tg,
            beta: &tb,
            residual: None,
            relu: true,
            y: &mut tout,
            saved_mean: &mut tsm,
            saved_invstd: &mut tsi,
            running_mean: &mut trm,
            running_var: &mut trv,
            mode: BnMode::Train,
            momentum: 0.1,
            eps: 1e-5,
            moments: Some(&tmom),
        })?;
        self.check(format!("bn_forward from moments y {tag}"), &tout, &out)?;
        self.check(
            format!("bn_forward from moments running_var {tag}"),
            &trv,
            &rv,
        )?;
        self.check(
            format!("bn_forward from moments saved_invstd {tag}"),
            &tsi,
            &si,
        )?;
        let dz = random_bf16(rng, s.y_len(), -1.0, 1.0);
        let (mut dx, mut dg, mut db) = (vec![0.0; s.y_len()], vec![0.0; k], vec![0.0; k]);
        let mut dres = vec![0.0; s.y_len()];
        self.reference.bn_backward(BnBackward {
            shape,
            x: &y,
            y: &out,
            gamma: &gamma,
            saved_mean: &sm,
            saved_invstd: &si,
            batch_stats: true,
            relu: true,
            dy: &dz,
            dx: &mut dx,
            dresidual: Some((&mut dres, false)),
            dgamma: &mut dg,
            dbeta: &mut db,
            prepared: false,
        })?;
        // Prepared: the masked gradient (the residual's gradient, as written) and its sums.
        let (tout_ref, tsm_ref, tsi_ref, tg_in) = (
            self.up(&out, act)?,
            self.up(&sm, stat)?,
            self.up(&si, stat)?,
            self.up(&dres, act)?,
        );
        let mut tdx = self.test.alloc(s.y_len(), act)?;
        let mut tdres = self.test.alloc(s.y_len(), act)?;
        let (mut tdg, mut tdb) = (
            self.up(&dg, TensorRole::WeightGrad)?,
            self.up(&db, TensorRole::WeightGrad)?,
        );
        self.test.bn_backward(BnBackward {
            shape,
            x: &ty_ref,
            y: &tout_ref,
            gamma: &tg,
            saved_mean: &tsm_ref,
            saved_invstd: &tsi_ref,
            batch_stats: true,
            relu: true,
            dy: &tg_in,
            dx: &mut tdx,
            dresidual: Some((&mut tdres, false)),
            dgamma: &mut tdg,
            dbeta: &mut tdb,
            prepared: true,
        })?;
        self.check(format!("bn_backward prepared dx {tag}"), &tdx, &dx)?;
        self.check(format!("bn_backward prepared dres {tag}"), &tdres, &dres)?;
        self.check(format!("bn_backward prepared dgamma kept {tag}"), &tdg, &dg)
    }

    fn pool(&mut self, s: PoolShape, rng: &mut ChaCha8Rng) -> Result<(), BackendError> {
        let tag = format!(
            "k{} s{} p{} {}x{}x{}x{}",
            s.kernel, s.stride, s.padding, s.n, s.h, s.w, s.c
        );
        let xlen = s.n * s.h * s.w * s.c;
        let ylen = s.n * s.out_h() * s.out_w() * s.c;
        let x = random(rng, xlen, -1.0, 1.0);
        let dy = random(rng, ylen, -1.0, 1.0);
        let mut y = vec![0.0; ylen];
        self.reference.maxpool_forward(&s, &x, &mut y)?;
        let mut dx = vec![0.0; xlen];
        self.reference
            .maxpool_backward(&s, &x, &dy, &mut dx, false)?;
        let (tx, tdy) = (
            self.up(&x, TensorRole::Activation)?,
            self.up(&dy, TensorRole::Activation)?,
        );
        let mut ty = self.test.alloc(ylen, TensorRole::Activation)?;
        self.test.maxpool_forward(&s, &tx, &mut ty)?;
        self.check(format!("maxpool_forward {tag}"), &ty, &y)?;
        let mut tdx = self.test.alloc(xlen, TensorRole::Activation)?;
        self.test.maxpool_backward(&s, &tx, &tdy, &mut tdx, false)?;
        self.check(format!("maxpool_backward {tag}"), &tdx, &dx)
    }

    fn gap_linear_loss(&mut self, rng: &mut ChaCha8Rng) -> Result<(), BackendError> {
        let (n, hw, c, classes) = (5, 9, 24, 13);
        let x = random(rng, n * hw * c, -1.0, 2.0);
        let dy = random(rng, n * c, -1.0, 1.0);
        let mut y = vec![0.0; n * c];
        self.reference.gap_forward(n, hw, c, &x, &mut y)?;
        let mut dx = vec![0.0; n * hw * c];
        self.reference.gap_backward(n, hw, c, &dy, &mut dx, false)?;
        let (tx, tdy) = (
            self.up(&x, TensorRole::Activation)?,
            self.up(&dy, TensorRole::Activation)?,
        );
        let mut ty = self.test.alloc(n * c, TensorRole::Activation)?;
        self.test.gap_forward(n, hw, c, &tx, &mut ty)?;
        self.check(format!("gap_forward {n}x{hw}x{c}"), &ty, &y)?;
        let mut tdx = self.test.alloc(n * hw * c, TensorRole::Activation)?;
        self.test.gap_backward(n, hw, c, &tdy, &mut tdx, false)?;
        self.check(format!("gap_backward {n}x{hw}x{c}"), &tdx, &dx)?;

        let s = LinearShape {
            n,
            inputs: c,
            outputs: classes,
        };
        let w = random(rng, classes * c, -0.3, 0.3);
        let b = random(rng, classes, -0.1, 0.1);
        let dz = random(rng, n * classes, -1.0, 1.0);
        let mut z = vec![0.0; n * classes];
        self.reference.linear_forward(&s, &y, &w, &b, &mut z)?;
        let (mut lx, mut lw, mut lb) =
            (vec![0.0; n * c], vec![0.0; classes * c], vec![0.0; classes]);
        self.reference
            .linear_backward(&s, &y, &w, &dz, &mut lx, &mut lw, &mut lb, false)?;
        let (ty, tw, tb, tdz) = (
            self.up(&y, TensorRole::Activation)?,
            self.up(&w, TensorRole::Weight)?,
            self.up(&b, TensorRole::Weight)?,
            self.up(&dz, TensorRole::Activation)?,
        );
        let mut tz = self.test.alloc(n * classes, TensorRole::Activation)?;
        self.test.linear_forward(&s, &ty, &tw, &tb, &mut tz)?;
        self.check(format!("linear_forward {n}x{c}→{classes}"), &tz, &z)?;
        let mut tlx = self.test.alloc(n * c, TensorRole::Activation)?;
        let mut tlw = self.test.alloc(classes * c, TensorRole::WeightGrad)?;
        let mut tlb = self.test.alloc(classes, TensorRole::WeightGrad)?;
        self.test
            .linear_backward(&s, &ty, &tw, &tdz, &mut tlx, &mut tlw, &mut tlb, false)?;
        self.check(format!("linear_backward dx {n}x{c}→{classes}"), &tlx, &lx)?;
        self.check(format!("linear_backward dw {n}x{c}→{classes}"), &tlw, &lw)?;
        self.check(format!("linear_backward db {n}x{c}→{classes}"), &tlb, &lb)?;

        let logits: Vec<f32> = random(rng, n * classes, -4.0, 4.0);
        let labels: Vec<u32> = (0..n as u32).map(|i| (i * 5) % classes as u32).collect();
        // Plain targets, then a mixed batch (mixup's target: 0.3 of each row's own label,
        // 0.7 of its partner's).
        for own_weight in [1.0, 0.3] {
            let targets = Targets {
                own_weight,
                ..Targets::labels(&labels, 0.1)
            };
            let mut d = vec![0.0; n * classes];
            let mut p = Vec::new();
            let stats = self.reference.softmax_cross_entropy(
                n,
                classes,
                &logits,
                &targets,
                Some(&mut d),
                Some(&mut p),
            )?;
            let tl = self.up(&logits, TensorRole::Activation)?;
            let mut td = self.test.alloc(n * classes, TensorRole::Activation)?;
            let mut tp = Vec::new();
            let tstats = self.test.softmax_cross_entropy(
                n,
                classes,
                &tl,
                &targets,
                Some(&mut td),
                Some(&mut tp),
            )?;
            self.check(
                format!("softmax_cross_entropy dlogits {n}x{classes} own weight {own_weight}"),
                &td,
                &d,
            )?;
            self.reports.push(compare(
                &format!("softmax_cross_entropy probs {n}x{classes}"),
                &tp,
                &p,
                self.tol,
            )?);
            let loss = compare(
                &format!("softmax_cross_entropy loss own weight {own_weight}"),
                &[tstats.loss_sum as f32],
                &[stats.loss_sum as f32],
                self.tol,
            )?;
            self.reports.push(loss);
            if (tstats.correct_top1, tstats.correct_top5)
                != (stats.correct_top1, stats.correct_top5)
            {
                return Err(BackendError::Mismatch {
                    check: "softmax_cross_entropy counts".into(),
                    detail: format!("{tstats:?} vs reference {stats:?}"),
                });
            }
        }

        // A row with a NaN or infinite logit never counts as correct, on either backend: a
        // diverged network must not score. Rows: NaN at the label, NaN elsewhere, +inf, and
        // one finite row whose label is on top (the only correct one).
        let k = classes.max(2);
        let mut z = vec![0.0f32; 4 * k];
        z[0] = f32::NAN;
        z[k + 1] = f32::NAN;
        z[2 * k + 1] = f32::INFINITY;
        z[3 * k] = 3.0;
        let labels = [0u32; 4];
        let reference = self.reference.softmax_cross_entropy(
            4,
            k,
            &z,
            &Targets::labels(&labels, 0.0),
            None,
            None,
        )?;
        let tz = self.up(&z, TensorRole::Activation)?;
        let tested = self.test.softmax_cross_entropy(
            4,
            k,
            &tz,
            &Targets::labels(&labels, 0.0),
            None,
            None,
        )?;
        for (who, got) in [("reference", reference), ("tested backend", tested)] {
            if (got.correct_top1, got.correct_top5) != (1, 1) {
                return Err(BackendError::Mismatch {
                    check: "softmax_cross_entropy counts with non-finite logits".into(),
                    detail: format!("{who}: {got:?}, expected 1 correct of 4 (rows with NaN or inf never count)"),
                });
            }
        }
        Ok(())
    }

    fn input(&mut self, rng: &mut ChaCha8Rng) -> Result<(), BackendError> {
        let (n, s) = (4usize, 17u32);
        let px: Vec<u8> = (0..n * (s * s * 3) as usize)
            .map(|_| rng.random())
            .collect();
        let labels = vec![0u32; n];
        let m = Augment::max_shift(s);
        // Odd images erased (random erasing), one box on the bottom-right corner.
        let aug: Vec<Augment> = (0..n as u32)
            .map(|i| Augment {
                dy: rng.random_range(-m..=m),
                dx: rng.random_range(-m..=m),
                flip: rng.random(),
                erase: (i % 2 == 1).then(|| PixelBox {
                    y0: 2 + 3 * i,
                    y1: s - 2 * (i / 2),
                    x0: 1 + i,
                    x1: s - 2 * (i / 2),
                }),
            })
            .collect();
        let mixes = [
            None,
            Some(Mix::Blend { lambda: 0.35 }),
            Some(Mix::Paste(PixelBox {
                y0: 2,
                y1: 11,
                x0: 5,
                x1: 17,
            })),
        ];
        for (augment, mix) in [None, Some(aug.as_slice())]
            .into_iter()
            .flat_map(|a| mixes.map(|m| (a, m)))
        {
            let batch = InputBatch {
                pixels: &px,
                labels: &labels,
                len: n,
                image_size: s,
                augment,
                mix,
            };
            let len = n * (s * s * 3) as usize;
            let mut want = vec![0.0; len];
            self.reference.input(&batch, &mut want)?;
            let mut got = self.test.alloc(len, TensorRole::Activation)?;
            self.test.input(&batch, &mut got)?;
            self.check(
                format!(
                    "input {n}x{s}x{s} augment={} mix={mix:?}",
                    augment.is_some()
                ),
                &got,
                &want,
            )?;
        }
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

/// Checks every op of `backend` against the CPU reference at several shapes, odd sizes
/// included. Returns one report per comparison, or the first mismatch as
/// [`BackendError::Mismatch`].
pub fn check_ops<B: Backend>(
    backend: &B,
    tol: Tolerance,
) -> Result<Vec<CheckReport>, BackendError> {
    let mut pair = Pair {
        reference: CpuBackend::reference(2)?,
        test: backend,
        tol,
        scaled: false,
        reports: Vec::new(),
    };
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed);
    for s in [
        conv(2, 7, 6, 3, 8, 3, 1, 1),
        conv(2, 9, 7, 5, 4, 3, 2, 1),
        conv(3, 5, 5, 16, 8, 1, 1, 0),
        conv(2, 7, 6, 8, 16, 1, 2, 0),
        conv(2, 15, 13, 3, 16, 7, 2, 3),
        conv(1, 8, 8, 64, 64, 3, 1, 1),
        conv(2, 5, 4, 2, 3, 2, 1, 0),
    ] {
        pair.conv(s, &mut rng)?;
    }
    for (rows, c, residual, relu, mode) in [
        (50, 3, false, false, BnMode::Train),
        (64, 16, false, true, BnMode::Train),
        (300, 8, true, true, BnMode::Train),
        (700, 64, true, true, BnMode::Train),
        (530, 19, false, false, BnMode::Train),
        (40, 5, true, true, BnMode::Frozen),
        (40, 5, false, true, BnMode::Eval),
    ] {
        pair.bn(rows, c, residual, relu, mode, &mut rng)?;
    }
    for (kernel, stride, padding, h, w) in [(3, 2, 1, 9, 8), (2, 2, 0, 6, 6), (3, 2, 1, 4, 4)] {
        let s = PoolShape {
            n: 2,
            h,
            w,
            c: 5,
            kernel,
            stride,
            padding,
        };
        pair.pool(s, &mut rng)?;
    }
    pair.gap_linear_loss(&mut rng)?;
    pair.input(&mut rng)?;
    Ok(pair.reports)
}

/// Per channel of `y` (`rows × c`): mean, M2 = Σ(y − mean)² and the row count, in f64, as
/// f32 (the layout of [`BnForward::moments`]).
fn host_moments(y: &[f32], rows: usize, c: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; 3 * c];
    for ch in 0..c {
        let vals = || (0..rows).map(|r| f64::from(y[r * c + ch]));
        let mean = vals().sum::<f64>() / rows as f64;
        out[ch] = mean as f32;
        out[c + ch] = vals().map(|v| (v - mean) * (v - mean)).sum::<f64>() as f32;
        out[2 * c + ch] = rows as f32;
    }
    out
}

/// The shapes [`check_bn_fusion`] runs: 3×3 pad 1 with a row tail and with a tile boundary
/// inside the rows, stride 2 (four dgrad phases), 1×1 stride 1 and stride 2 (phases without
/// taps), the 3-channel 7×7 stem, odd channel counts (no 16-byte kernels), and enough rows
/// that the per-tile records are merged in two launches on a GPU (288 tiles of 128 rows).
pub fn bn_fusion_shapes() -> Vec<ConvShape> {
    vec![
        conv(2, 7, 6, 8, 16, 3, 1, 1),
        conv(2, 12, 12, 32, 64, 3, 1, 1),
        conv(3, 9, 9, 16, 24, 3, 2, 1),
        conv(2, 10, 10, 64, 32, 1, 1, 0),
        conv(2, 9, 8, 32, 64, 1, 2, 0),
        conv(2, 19, 17, 3, 64, 7, 2, 3),
        conv(2, 5, 5, 5, 8, 3, 1, 1),
        conv(9, 64, 64, 8, 16, 3, 1, 1),
    ]
}

/// Checks the fused batch-norm ops of `backend` ([`Backend::conv_forward_moments`],
/// [`Backend::conv_backward_data_bn`], [`BnForward::moments`], [`BnBackward::prepared`])
/// against the CPU reference's separate ops and f64 reductions, at each of `shapes`
/// ([`bn_fusion_shapes`]), on inputs a bf16 backend stores exactly. Tolerances scale with
/// each tensor's largest reference magnitude: `|got − ref| ≤ atol·max|ref| + rtol·|ref|`.
pub fn check_bn_fusion<B: Backend>(
    backend: &B,
    shapes: &[ConvShape],
    tol: Tolerance,
) -> Result<Vec<CheckReport>, BackendError> {
    let mut pair = Pair {
        reference: CpuBackend::reference(2)?,
        test: backend,
        tol,
        scaled: true,
        reports: Vec::new(),
    };
    let mut rng = ChaCha8Rng::seed_from_u64(0xb4);
    for &s in shapes {
        pair.bn_fusion(s, &mut rng)?;
    }
    Ok(pair.reports)
}

/// Runs the fused batch-norm ops of `backend` twice on the same inputs at each of `shapes`
/// and demands the same bits (moments, g, dγ, dβ): no atomics, no order-dependent sums.
pub fn check_bn_fusion_repeatable<B: Backend>(
    backend: &B,
    shapes: &[ConvShape],
) -> Result<(), BackendError> {
    let mut rng = ChaCha8Rng::seed_from_u64(0x2b17);
    let (act, stat) = (TensorRole::Activation, TensorRole::Statistic);
    let up = |data: &[f32], role| -> Result<B::Tensor, BackendError> {
        let mut t = backend.alloc(data.len(), role)?;
        backend.upload(data, &mut t)?;
        Ok(t)
    };
    for &s in shapes {
        let tag = format!(
            "k{} s{} p{} {}x{}x{}x{}→{}",
            s.kernel, s.stride, s.padding, s.n, s.h, s.w, s.c_in, s.c_out
        );
        let c = s.c_in;
        let (x, w) = (
            up(&random(&mut rng, s.x_len(), -1.0, 1.0), act)?,
            up(&random(&mut rng, s.w_len(), -0.5, 0.5), TensorRole::Weight)?,
        );
        let (dy, res) = (
            up(&random(&mut rng, s.y_len(), -1.0, 1.0), act)?,
            up(&random(&mut rng, s.x_len(), -1.0, 1.0), act)?,
        );
        let (bx, by) = (
            up(&random(&mut rng, s.x_len(), -2.0, 2.0), act)?,
            up(&random(&mut rng, s.x_len(), -1.0, 1.0), act)?,
        );
        let (mean, invstd) = (
            up(&random(&mut rng, c, -0.5, 0.5), stat)?,
            up(&random(&mut rng, c, 0.5, 1.5), stat)?,
        );
        let mut runs: Vec<Vec<Vec<f32>>> = Vec::new();
        for _ in 0..2 {
            let mut y = backend.alloc(s.y_len(), act)?;
            let mut m = backend.alloc(3 * s.c_out, stat)?;
            backend.conv_forward_moments(&s, &x, &w, &mut y, &mut m)?;
            let mut dx = backend.alloc(s.x_len(), act)?;
            let (mut dg, mut db) = (
                backend.alloc(c, TensorRole::WeightGrad)?,
                backend.alloc(c, TensorRole::WeightGrad)?,
            );
            backend.conv_backward_data_bn(
                &s,
                &dy,
                &w,
                &mut dx,
                false,
                BnGradEpilogue {
                    x: &bx,
                    y: &by,
                    relu: true,
                    saved_mean: &mean,
                    saved_invstd: &invstd,
                    residual_grad: Some(&res),
                    dgamma: &mut dg,
                    dbeta: &mut db,
                },
            )?;
            runs.push(vec![
                backend.download(&y)?,
                backend.download(&m)?,
                backend.download(&dx)?,
                backend.download(&dg)?,
                backend.download(&db)?,
            ]);
        }
        for (name, (a, b)) in ["y", "moments", "g", "dgamma", "dbeta"]
            .iter()
            .zip(runs[0].iter().zip(&runs[1]))
        {
            if let Some(i) = a
                .iter()
                .zip(b)
                .position(|(p, q)| p.to_bits() != q.to_bits())
            {
                return Err(BackendError::Mismatch {
                    check: format!("fused {name} twice {tag}"),
                    detail: format!("element {i}: {} then {}", a[i], b[i]),
                });
            }
        }
    }
    Ok(())
}

/// Checks the convolutions of `backend` (forward, data gradient overwritten and accumulated,
/// weight gradient) against the reference's im2col + GEMM at odd shapes: 3×3 and 7×7,
/// stride 2 and 3, padding up to and beyond the kernel, 1- and 2-pixel maps, 3, 5, 16, 64
/// and 512 channels, and enough pixels that weight gradients are summed in parts. The
/// absolute tolerance is scaled by each tensor's largest reference magnitude (sums of up to
/// 4 608 products): `|got − ref| ≤ atol·max|ref| + rtol·|ref|`.
pub fn check_convs<B: Backend>(
    backend: &B,
    tol: Tolerance,
) -> Result<Vec<CheckReport>, BackendError> {
    let mut pair = Pair {
        reference: CpuBackend::reference(2)?,
        test: backend,
        tol,
        scaled: true,
        reports: Vec::new(),
    };
    let mut rng = ChaCha8Rng::seed_from_u64(0xc0de);
    for s in [
        // ResNet stems: 7×7 stride 2 on 3 channels, and the CIFAR 3×3 one.
        conv(2, 19, 17, 3, 64, 7, 2, 3),
        conv(2, 9, 9, 3, 16, 3, 1, 1),
        // 3×3 at 16 and 64 channels, stride 1 and 2 (odd and even sizes).
        conv(2, 8, 8, 16, 16, 3, 1, 1),
        conv(2, 7, 7, 16, 32, 3, 2, 1),
        conv(2, 8, 8, 64, 64, 3, 1, 1),
        conv(1, 6, 7, 64, 128, 3, 2, 1),
        // 1- and 2-pixel maps at 512 channels: 8 (or 5) of 9 taps are padding.
        conv(3, 1, 1, 512, 512, 3, 1, 1),
        conv(2, 2, 2, 512, 512, 3, 1, 1),
        conv(2, 3, 3, 256, 512, 3, 2, 1),
        conv(3, 1, 1, 64, 64, 3, 1, 1),
        // 1×1 stride 2 (downsample shortcut), and 1×1 with padding (border pixels see none).
        conv(2, 5, 4, 64, 128, 1, 2, 0),
        conv(1, 2, 2, 4, 8, 1, 1, 1),
        // Odd channel counts (partial vector blocks), kernel 2, stride 3, padding ≥ kernel.
        conv(2, 5, 5, 5, 3, 3, 1, 1),
        conv(1, 6, 5, 3, 5, 2, 1, 0),
        conv(2, 8, 8, 2, 2, 3, 3, 2),
        conv(1, 2, 3, 8, 8, 3, 1, 3),
        // Enough pixels for the weight gradient to be summed in parts.
        conv(4, 32, 33, 16, 16, 3, 1, 1),
    ] {
        pair.conv(s, &mut rng)?;
    }
    Ok(pair.reports)
}

/// One whole training step (loss, every parameter gradient, BN running statistics) and one
/// eval step (probabilities) of `arch` on `backend` against the CPU reference, on a random
/// augmented batch of `batch` images of side `image_size`. Gradients use a per-tensor scale:
/// `|got − ref| ≤ atol·max|ref| + rtol·|ref|`.
pub fn check_network<B: Backend>(
    backend: B,
    arch: Arch,
    image_size: u32,
    batch: usize,
    tol: Tolerance,
) -> Result<Vec<CheckReport>, ModelError> {
    let classes = 10;
    let graph = Graph::new(arch, classes);
    let state = ModelState::init(&graph, 1);
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let s = image_size as usize;
    let px: Vec<u8> = (0..batch * s * s * 3).map(|_| rng.random()).collect();
    let labels: Vec<u32> = (0..batch as u32).map(|i| i % classes as u32).collect();
    let m = Augment::max_shift(image_size);
    let aug: Vec<Augment> = (0..batch)
        .map(|_| Augment {
            dy: rng.random_range(-m..=m),
            dx: rng.random_range(-m..=m),
            flip: rng.random(),
            erase: None,
        })
        .collect();
    let input = InputBatch {
        pixels: &px,
        labels: &labels,
        len: batch,
        image_size,
        augment: Some(&aug),
        mix: None,
    };
    let config = NetworkConfig {
        label_smoothing: 0.1,
        ..NetworkConfig::default()
    };
    let mut reference = Network::new(CpuBackend::reference(2)?, &graph, batch, image_size)?;
    let mut test = Network::new(backend, &graph, batch, image_size)?;
    let mut reports = Vec::new();
    reference.load_state(&state)?;
    reference.set_config(config);
    test.load_state(&state)?;
    test.set_config(config);
    let want = reference.train_step(&input)?;
    let got = test.train_step(&input)?;
    reports.push(compare(
        &format!("{arch} train loss"),
        &[got.mean_loss() as f32],
        &[want.mean_loss() as f32],
        tol,
    )?);
    let (wg, gg) = (reference.grads_f32()?, test.grads_f32()?);
    let (offsets, _) = graph.param_offsets();
    for (i, spec) in graph.params().iter().enumerate() {
        let r = offsets[i]..offsets[i] + spec.numel();
        let scale = wg[r.clone()].iter().fold(0.0f32, |a, v| a.max(v.abs()));
        reports.push(compare_scaled(
            &format!("{arch} grad {}", spec.name),
            &gg[r.clone()],
            &wg[r],
            tol,
            scale.max(f32::MIN_POSITIVE),
        )?);
    }
    let (ws, gs) = (reference.state()?, test.state()?);
    for ((spec, w), g) in graph.buffers().iter().zip(&ws.buffers).zip(&gs.buffers) {
        reports.push(compare(&format!("{arch} buffer {}", spec.name), g, w, tol)?);
    }
    let plain = InputBatch {
        augment: None,
        ..input
    };
    let (_, wp) = reference.eval_step(&plain)?;
    let (_, gp) = test.eval_step(&plain)?;
    reports.push(compare(
        &format!("{arch} eval probabilities"),
        &gp,
        &wp,
        tol,
    )?);
    Ok(reports)
}
