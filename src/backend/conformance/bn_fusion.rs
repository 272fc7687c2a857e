//! Batch norm fused into the convolutions (moments from the forward, the gradient epilogue of
//! the data gradient, the `prepared` backward) against the reference's separate ops, and
//! repeatability of the fused ops to the bit.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::{compare, compare_scaled, conv, random, random_bf16, CheckReport, Pair, Tolerance};
use crate::backend::{
    Backend, BackendError, BnBackward, BnForward, BnGradEpilogue, BnMode, BnShape, ConvShape,
    TensorRole,
};

impl<B: Backend> Pair<'_, B> {
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
        // Offset per channel (so x̂ needs the mean), then rounded to bf16 again: a bf16
        // backend stores x so, and the reference must read the same values (unrounded, x up
        // to 8.75 differs by up to 2⁻⁵ from what the device holds, and dgamma's 288-row sums
        // drift by more than the tolerance; seen on an H100, 2026-11-27).
        let bn_x: Vec<f32> = random_bf16(rng, s.x_len(), -1.0, 1.0)
            .iter()
            .enumerate()
            .map(|(i, v)| half::bf16::from_f32(v + 0.25 * (i % c) as f32).to_f32())
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
        // Read only where the mask is recomputed (no stored output): not here.
        let (tgamma, tbeta) = (
            self.up(&random_bf16(rng, c, 0.5, 1.5), TensorRole::Weight)?,
            self.up(&random_bf16(rng, c, -0.5, 0.5), TensorRole::Weight)?,
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
            // What storing g in bf16 before the sums may move them: each term by up to two
            // half-ulps (the product's rounding and the accumulation's), b = 2⁻⁸·|term|, as
            // independent errors: 4·√Σb² (about 7 standard deviations). A bf16 backend that
            // reduces its stored g is that far from f32 sums: the 3-channel stem's dβ by 0.39
            // at a tolerance of 0.35, on an H100 and on the bf16 CPU model alike, 2026-11-27.
            // A wrong mask still fails the check of g itself, above the sums'.
            let (mut rb, mut rg) = (vec![0.0f64; c], vec![0.0f64; c]);
            for (i, v) in g.iter_mut().enumerate() {
                if residual {
                    *v += res[i];
                }
                if relu && bn_y[i] <= 0.0 {
                    *v = 0.0;
                }
                let ch = i % c;
                let xhat = f64::from(bn_x[i] - mean[ch]) * f64::from(invstd[ch]);
                sb[ch] += f64::from(*v);
                sg[ch] += f64::from(*v) * xhat;
                rb[ch] += (f64::from(*v) / 256.0).powi(2);
                rg[ch] += (f64::from(*v) * xhat / 256.0).powi(2);
            }
            let to_f32 = |v: &[f64]| -> Vec<f32> { v.iter().map(|&v| v as f32).collect() };
            let bound =
                |v: &[f64]| -> Vec<f32> { v.iter().map(|&v| (4.0 * v.sqrt()) as f32).collect() };
            let (sb, sg, rb, rg) = (to_f32(&sb), to_f32(&sg), bound(&rb), bound(&rg));
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
                    y: Some(&tby),
                    y_recomputable: false,
                    relu,
                    gamma: &tgamma,
                    beta: &tbeta,
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
            self.check_with_allowance(format!("conv_backward_data_bn dbeta {v}"), &tdb, &sb, &rb)?;
            self.check_with_allowance(format!("conv_backward_data_bn dgamma {v}"), &tdg, &sg, &rg)?;
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
            y: Some(&mut out),
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
            y: Some(&mut tout),
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
            y: Some(&out),
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
            y: Some(&tout_ref),
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
    let mut pair = Pair::new(backend, tol, true)?;
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
        // Read only where the mask is recomputed (no stored output): not here.
        let (gamma, beta) = (
            up(&random(&mut rng, c, 0.5, 1.5), TensorRole::Weight)?,
            up(&random(&mut rng, c, -0.5, 0.5), TensorRole::Weight)?,
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
                    y: Some(&by),
                    y_recomputable: false,
                    relu: true,
                    gamma: &gamma,
                    beta: &beta,
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
