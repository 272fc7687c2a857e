//! The plain ops against the CPU reference: convolutions, batch norm, max pooling, global
//! average pooling with the classifier and loss, and the input stage.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{compare, conv, random, CheckReport, Pair, Tolerance};
use crate::backend::{
    Backend, BackendError, BnBackward, BnForward, BnMode, BnShape, ConvShape, LinearShape,
    PoolShape, Targets, TensorRole,
};
use crate::model::{Augment, InputBatch, Mix, PixelBox};

impl<B: Backend> Pair<'_, B> {
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
            y: Some(&mut y),
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
            y: Some(&y),
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
            y: Some(&mut ty),
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
            y: Some(&ty),
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

/// Checks every op of `backend` against the CPU reference at several shapes, odd sizes
/// included. Returns one report per comparison, or the first mismatch as
/// [`BackendError::Mismatch`].
pub fn check_ops<B: Backend>(
    backend: &B,
    tol: Tolerance,
) -> Result<Vec<CheckReport>, BackendError> {
    let mut pair = Pair::new(backend, tol, false)?;
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
    let mut pair = Pair::new(backend, tol, true)?;
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
