//! Finite-difference gradient checks of every CPU backend op (the reference the GPU kernels
//! are compared with). Each op's loss is Σ r·y with a fixed random r, so dy = r.
//!
//! ReLU and the residual add are fused into batch norm (as in the CUDA kernels), so they are
//! checked through it: `relu=true` cases check the ReLU mask, `residual=true` cases check the
//! add (its gradient `dresidual`), in training, frozen and eval modes.

use crate::common;

use birdtrain::backend::cpu::CpuBackend;
use birdtrain::backend::{
    Backend, BnBackward, BnForward, BnMode, BnShape, ConvShape, LinearShape, PoolShape, Targets,
};
use common::{check, project, random};

fn cpu() -> CpuBackend {
    CpuBackend::new(2).unwrap()
}

fn conv_case(s: ConvShape, seed: u64) {
    let b = cpu();
    let x = random(s.x_len(), seed);
    let w = random(s.w_len(), seed + 1);
    let r = random(s.y_len(), seed + 2);
    let fwd = |x: &[f32], w: &[f32]| {
        let mut y = vec![0.0; s.y_len()];
        b.conv_forward(&s, &x.to_vec(), &w.to_vec(), &mut y)
            .unwrap();
        project(&y, &r)
    };
    let mut dx = vec![0.0; s.x_len()];
    b.conv_backward_data(&s, &r, &w, &mut dx, false).unwrap();
    let mut dw = vec![0.0; s.w_len()];
    b.conv_backward_weight(&s, &x, &r, &mut dw).unwrap();
    let name = format!(
        "conv k{} s{} p{} {}x{}",
        s.kernel, s.stride, s.padding, s.h, s.w
    );
    check(&format!("{name} dx"), &x, &dx, 1e-2, 2e-3, 40, |xp| {
        fwd(xp, &w)
    });
    check(&format!("{name} dw"), &w, &dw, 1e-2, 2e-3, 40, |wp| {
        fwd(&x, wp)
    });
    // accumulate adds onto what is there
    let mut acc = vec![1.0; s.x_len()];
    b.conv_backward_data(&s, &r, &w, &mut acc, true).unwrap();
    for (a, d) in acc.iter().zip(&dx) {
        assert!((a - 1.0 - d).abs() < 1e-5);
    }
}

#[test]
fn conv_gradients_match_finite_differences() {
    let shapes = [
        (3, 1, 1, 7, 6, 3, 4),
        (3, 2, 1, 9, 7, 4, 5),
        (1, 1, 0, 5, 5, 6, 3),
        (1, 2, 0, 7, 6, 4, 8),
        (7, 2, 3, 11, 10, 3, 4),
        (2, 1, 0, 5, 4, 2, 3),
        (3, 3, 2, 8, 8, 2, 2),
    ];
    for (i, &(k, st, p, h, w, ci, co)) in shapes.iter().enumerate() {
        conv_case(
            ConvShape {
                n: 2,
                h,
                w,
                c_in: ci,
                c_out: co,
                kernel: k,
                stride: st,
                padding: p,
            },
            10 * i as u64,
        );
    }
}

#[test]
fn conv_matches_direct_definition() {
    // A 3x3 stride-2 pad-1 convolution computed by the textbook loop.
    let s = ConvShape {
        n: 2,
        h: 5,
        w: 6,
        c_in: 3,
        c_out: 4,
        kernel: 3,
        stride: 2,
        padding: 1,
    };
    let x = random(s.x_len(), 1);
    let w = random(s.w_len(), 2);
    let mut y = vec![0.0; s.y_len()];
    cpu().conv_forward(&s, &x, &w, &mut y).unwrap();
    let (ho, wo) = (s.out_h(), s.out_w());
    for n in 0..s.n {
        for oy in 0..ho {
            for ox in 0..wo {
                for o in 0..s.c_out {
                    let mut acc = 0.0f64;
                    for ky in 0..3 {
                        for kx in 0..3 {
                            let iy = (oy * 2 + ky) as isize - 1;
                            let ix = (ox * 2 + kx) as isize - 1;
                            if iy < 0 || ix < 0 || iy >= s.h as isize || ix >= s.w as isize {
                                continue;
                            }
                            for c in 0..s.c_in {
                                let xv =
                                    x[((n * s.h + iy as usize) * s.w + ix as usize) * s.c_in + c];
                                let wv = w[((o * 3 + ky) * 3 + kx) * s.c_in + c];
                                acc += f64::from(xv) * f64::from(wv);
                            }
                        }
                    }
                    let got = y[((n * ho + oy) * wo + ox) * s.c_out + o];
                    assert!(
                        (f64::from(got) - acc).abs() < 1e-5,
                        "y[{n},{oy},{ox},{o}] {got} vs {acc}"
                    );
                }
            }
        }
    }
}

struct BnCase {
    rows: usize,
    c: usize,
    residual: bool,
    relu: bool,
    mode: BnMode,
}

fn bn_case(case: &BnCase, seed: u64) {
    let b = cpu();
    let (rows, c) = (case.rows, case.c);
    let shape = BnShape { rows, channels: c };
    let x: Vec<f32> = random(rows * c, seed)
        .iter()
        .map(|v| v * 2.0 + 0.3)
        .collect();
    let gamma: Vec<f32> = random(c, seed + 1).iter().map(|v| 1.0 + 0.5 * v).collect();
    let beta = random(c, seed + 2);
    let res = random(rows * c, seed + 3);
    let r = random(rows * c, seed + 4);
    let run_mean = random(c, seed + 5);
    let run_var: Vec<f32> = random(c, seed + 6).iter().map(|v| 1.0 + 0.5 * v).collect();
    let fwd = |x: &[f32], g: &[f32], bt: &[f32], rs: &[f32]| {
        let mut y = vec![0.0; rows * c];
        let (mut m, mut is) = (vec![0.0; c], vec![0.0; c]);
        let (mut rm, mut rv) = (run_mean.clone(), run_var.clone());
        let rs = rs.to_vec();
        b.bn_forward(BnForward {
            shape,
            x: &x.to_vec(),
            gamma: &g.to_vec(),
            beta: &bt.to_vec(),
            residual: case.residual.then_some(&rs),
            relu: case.relu,
            y: Some(&mut y),
            saved_mean: &mut m,
            saved_invstd: &mut is,
            running_mean: &mut rm,
            running_var: &mut rv,
            mode: case.mode,
            momentum: 0.1,
            eps: 1e-5,
            moments: None,
        })
        .unwrap();
        (y, m, is, rm, rv)
    };
    let (y, m, is, rm, rv) = fwd(&x, &gamma, &beta, &res);
    if case.mode == BnMode::Train {
        // running statistics: momentum 0.1, unbiased variance
        for ch in 0..c {
            let col: Vec<f64> = (0..rows).map(|i| f64::from(x[i * c + ch])).collect();
            let mean = col.iter().sum::<f64>() / rows as f64;
            let var_u = col.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (rows - 1) as f64;
            let want_m = 0.9 * f64::from(run_mean[ch]) + 0.1 * mean;
            let want_v = 0.9 * f64::from(run_var[ch]) + 0.1 * var_u;
            assert!(
                (f64::from(rm[ch]) - want_m).abs() < 1e-5,
                "running mean {ch}"
            );
            assert!(
                (f64::from(rv[ch]) - want_v).abs() < 1e-5,
                "running var {ch}"
            );
        }
    } else {
        assert_eq!(rm, run_mean, "running stats must not move outside training");
        assert_eq!(rv, run_var);
    }
    let (mut dx, mut dg, mut db) = (vec![0.0; rows * c], vec![0.0; c], vec![0.0; c]);
    let mut dres = vec![0.0; rows * c];
    b.bn_backward(BnBackward {
        shape,
        x: &x,
        y: Some(&y),
        gamma: &gamma,
        saved_mean: &m,
        saved_invstd: &is,
        batch_stats: case.mode == BnMode::Train,
        relu: case.relu,
        dy: &r,
        dx: &mut dx,
        dresidual: case.residual.then_some((&mut dres, false)),
        dgamma: &mut dg,
        dbeta: &mut db,
        prepared: false,
    })
    .unwrap();
    let name = format!(
        "bn {:?} res={} relu={}",
        case.mode, case.residual, case.relu
    );
    // Small h: fewer pre-activations cross the ReLU kink (f32 noise stays below tol).
    let h = 2e-4;
    let tol = 1e-2;
    check(&format!("{name} dx"), &x, &dx, h, tol, 40, |p| {
        project(&fwd(p, &gamma, &beta, &res).0, &r)
    });
    check(&format!("{name} dgamma"), &gamma, &dg, h, tol, 40, |p| {
        project(&fwd(&x, p, &beta, &res).0, &r)
    });
    check(&format!("{name} dbeta"), &beta, &db, h, tol, 40, |p| {
        project(&fwd(&x, &gamma, p, &res).0, &r)
    });
    if case.residual {
        check(&format!("{name} dresidual"), &res, &dres, h, tol, 40, |p| {
            project(&fwd(&x, &gamma, &beta, p).0, &r)
        });
    }
}

#[test]
fn batchnorm_gradients_match_finite_differences() {
    let cases = [
        BnCase {
            rows: 24,
            c: 3,
            residual: false,
            relu: false,
            mode: BnMode::Train,
        },
        BnCase {
            rows: 30,
            c: 4,
            residual: false,
            relu: true,
            mode: BnMode::Train,
        },
        BnCase {
            rows: 600,
            c: 5,
            residual: true,
            relu: true,
            mode: BnMode::Train,
        },
        BnCase {
            rows: 20,
            c: 3,
            residual: true,
            relu: true,
            mode: BnMode::Frozen,
        },
        BnCase {
            rows: 20,
            c: 2,
            residual: false,
            relu: false,
            mode: BnMode::Eval,
        },
        BnCase {
            rows: 256,
            c: 16,
            residual: false,
            relu: true,
            mode: BnMode::Train,
        },
        BnCase {
            rows: 1000,
            c: 16,
            residual: true,
            relu: true,
            mode: BnMode::Train,
        },
    ];
    for (i, case) in cases.iter().enumerate() {
        bn_case(case, 100 + 10 * i as u64);
    }
}

#[test]
fn maxpool_and_gap_gradients_match_finite_differences() {
    let b = cpu();
    for (k, st, p, h, w) in [(3, 2, 1, 7, 8), (2, 2, 0, 6, 6), (3, 1, 1, 5, 4)] {
        let s = PoolShape {
            n: 2,
            h,
            w,
            c: 3,
            kernel: k,
            stride: st,
            padding: p,
        };
        let x = random(s.n * h * w * s.c, 7);
        let ylen = s.n * s.out_h() * s.out_w() * s.c;
        let r = random(ylen, 8);
        let fwd = |x: &[f32]| {
            let mut y = vec![0.0; ylen];
            b.maxpool_forward(&s, &x.to_vec(), &mut y).unwrap();
            project(&y, &r)
        };
        let mut dx = vec![0.0; x.len()];
        b.maxpool_backward(&s, &x, &r, &mut dx, false).unwrap();
        // Small h: random inputs are well separated, so no window changes its winner.
        check(
            &format!("maxpool k{k} s{st} p{p} dx"),
            &x,
            &dx,
            1e-4,
            1e-2,
            60,
            fwd,
        );
    }
    let (n, hw, c) = (3, 5, 4);
    let x = random(n * hw * c, 9);
    let r = random(n * c, 10);
    let mut dx = vec![0.0; x.len()];
    b.gap_backward(n, hw, c, &r, &mut dx, false).unwrap();
    check("gap dx", &x, &dx, 1e-2, 1e-3, 60, |x| {
        let mut y = vec![0.0; n * c];
        b.gap_forward(n, hw, c, &x.to_vec(), &mut y).unwrap();
        project(&y, &r)
    });
}

#[test]
fn linear_gradients_match_finite_differences() {
    let b = cpu();
    let s = LinearShape {
        n: 3,
        inputs: 7,
        outputs: 5,
    };
    let x = random(21, 1);
    let w = random(35, 2);
    let bias = random(5, 3);
    let r = random(15, 4);
    let fwd = |x: &[f32], w: &[f32], bias: &[f32]| {
        let mut y = vec![0.0; 15];
        b.linear_forward(&s, &x.to_vec(), &w.to_vec(), &bias.to_vec(), &mut y)
            .unwrap();
        project(&y, &r)
    };
    let (mut dx, mut dw, mut db) = (vec![0.0; 21], vec![0.0; 35], vec![0.0; 5]);
    b.linear_backward(&s, &x, &w, &r, &mut dx, &mut dw, &mut db, false)
        .unwrap();
    check("linear dx", &x, &dx, 1e-2, 1e-3, 30, |p| fwd(p, &w, &bias));
    check("linear dw", &w, &dw, 1e-2, 1e-3, 40, |p| fwd(&x, p, &bias));
    check("linear db", &bias, &db, 1e-2, 1e-3, 5, |p| fwd(&x, &w, p));
}

#[test]
fn cross_entropy_gradient_and_counts() {
    let b = cpu();
    let (n, classes) = (4, 7);
    let logits: Vec<f32> = random(n * classes, 5).iter().map(|v| v * 3.0).collect();
    let labels = [0u32, 3, 6, 2];
    // Plain and smoothed targets, then mixed ones (mixup and CutMix: row i's target gives
    // `own` to its label and the rest to row n−1−i's).
    for (smoothing, own) in [(0.0f32, 1.0f32), (0.1, 1.0), (0.1, 0.3), (0.0, 0.75)] {
        let targets = Targets {
            own_weight: own,
            ..Targets::labels(&labels, smoothing)
        };
        let mut d = vec![0.0; n * classes];
        let stats = b
            .softmax_cross_entropy(n, classes, &logits, &targets, Some(&mut d), None)
            .unwrap();
        // loss by definition, mean over images
        let mut want = 0.0f64;
        for i in 0..n {
            let z: Vec<f64> = logits[i * classes..(i + 1) * classes]
                .iter()
                .map(|&v| f64::from(v))
                .collect();
            let lse = z.iter().map(|v| v.exp()).sum::<f64>().ln();
            let partner = labels[n - 1 - i] as usize;
            for (j, zj) in z.iter().enumerate() {
                let hot = if j == labels[i] as usize {
                    f64::from(own)
                } else {
                    0.0
                } + if j == partner {
                    1.0 - f64::from(own)
                } else {
                    0.0
                };
                let t = f64::from(smoothing) / classes as f64 + (1.0 - f64::from(smoothing)) * hot;
                want -= t * (zj - lse);
            }
        }
        assert!(
            (stats.loss_sum - want).abs() < 1e-5,
            "loss {} vs {want}",
            stats.loss_sum
        );
        check(
            &format!("ce eps={smoothing} own={own} dlogits"),
            &logits,
            &d,
            1e-2,
            1e-3,
            28,
            |z| {
                b.softmax_cross_entropy(n, classes, &z.to_vec(), &targets, None, None)
                    .unwrap()
                    .loss_sum
                    / n as f64
            },
        );
    }
    // top-1 / top-5 counts against a direct ranking
    let stats = b
        .softmax_cross_entropy(
            n,
            classes,
            &logits,
            &Targets::labels(&labels, 0.0),
            None,
            None,
        )
        .unwrap();
    let (mut t1, mut t5) = (0, 0);
    for i in 0..n {
        let z = &logits[i * classes..(i + 1) * classes];
        let rank = z.iter().filter(|&&v| v > z[labels[i] as usize]).count();
        t1 += usize::from(rank == 0);
        t5 += usize::from(rank < 5);
    }
    assert_eq!((stats.correct_top1, stats.correct_top5), (t1, t5));
    assert!(b
        .softmax_cross_entropy(
            n,
            classes,
            &logits,
            &Targets::labels(&[0, 1, 7, 0], 0.0),
            None,
            None
        )
        .is_err());
    for own_weight in [-0.1, 1.5, f32::NAN] {
        let bad = Targets {
            own_weight,
            ..Targets::labels(&labels, 0.0)
        };
        assert!(b
            .softmax_cross_entropy(n, classes, &logits, &bad, None, None)
            .is_err());
    }
}

#[test]
fn shape_errors_are_values_not_panics() {
    let b = cpu();
    let s = ConvShape {
        n: 2,
        h: 4,
        w: 4,
        c_in: 3,
        c_out: 2,
        kernel: 3,
        stride: 1,
        padding: 1,
    };
    let mut y = vec![0.0; 5];
    let err = b
        .conv_forward(&s, &vec![0.0; s.x_len()], &vec![0.0; s.w_len()], &mut y)
        .unwrap_err();
    assert!(err.to_string().contains("y has 5 elements"), "{err}");
    let big = ConvShape {
        kernel: 9,
        padding: 0,
        ..s
    };
    assert!(b
        .conv_forward(&big, &vec![0.0; 96], &vec![0.0; 486], &mut vec![0.0; 100])
        .is_err());
}
