//! Fully connected layer and softmax cross-entropy.

use super::gemm::{matmul, MatRef};
use crate::backend::{BackendError, LinearShape, LossStats, Targets};
use crate::model::Mix;

pub(super) fn linear_forward(
    s: &LinearShape,
    x: &[f32],
    w: &[f32],
    b: &[f32],
    y: &mut [f32],
    threads: usize,
) {
    let a = MatRef {
        data: x,
        rows: s.n,
        cols: s.inputs,
        rs: s.inputs,
        cs: 1,
    };
    let wt = MatRef {
        data: w,
        rows: s.inputs,
        cols: s.outputs,
        rs: 1,
        cs: s.inputs,
    };
    let y = &mut y[..s.n * s.outputs];
    for row in y.chunks_exact_mut(s.outputs) {
        row.copy_from_slice(&b[..s.outputs]);
    }
    matmul(y, a, wt, true, threads);
}

#[allow(clippy::too_many_arguments)]
pub(super) fn linear_backward(
    s: &LinearShape,
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    dw: &mut [f32],
    db: &mut [f32],
    accumulate: bool,
    threads: usize,
) {
    let g = MatRef {
        data: dy,
        rows: s.n,
        cols: s.outputs,
        rs: s.outputs,
        cs: 1,
    };
    let wm = MatRef {
        data: w,
        rows: s.outputs,
        cols: s.inputs,
        rs: s.inputs,
        cs: 1,
    };
    matmul(&mut dx[..s.n * s.inputs], g, wm, accumulate, threads);
    let gt = MatRef {
        data: dy,
        rows: s.outputs,
        cols: s.n,
        rs: 1,
        cs: s.outputs,
    };
    let xm = MatRef {
        data: x,
        rows: s.n,
        cols: s.inputs,
        rs: s.inputs,
        cs: 1,
    };
    matmul(&mut dw[..s.outputs * s.inputs], gt, xm, false, threads);
    for (o, d) in db[..s.outputs].iter_mut().enumerate() {
        let mut acc = 0.0f64;
        for i in 0..s.n {
            acc += f64::from(dy[i * s.outputs + o]);
        }
        *d = acc as f32;
    }
}

pub(super) fn softmax_cross_entropy(
    n: usize,
    classes: usize,
    logits: &[f32],
    targets: &Targets<'_>,
    mut dlogits: Option<&mut Vec<f32>>,
    mut probs: Option<&mut Vec<f32>>,
) -> Result<LossStats, BackendError> {
    targets.check("softmax_cross_entropy", n, classes)?;
    let labels = targets.labels;
    if let Some(p) = probs.as_deref_mut() {
        p.clear();
        p.resize(n * classes, 0.0);
    }
    let eps = f64::from(targets.smoothing);
    let own = f64::from(targets.own_weight);
    let mut stats = LossStats::default();
    for i in 0..n {
        let z = &logits[i * classes..(i + 1) * classes];
        let label = labels[i] as usize;
        let partner = labels[Mix::partner(i, n)] as usize;
        let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum_exp: f64 = z.iter().map(|&v| f64::from(v - max).exp()).sum();
        let lse = f64::from(max) + sum_exp.ln();
        let mean_z: f64 = z.iter().map(|&v| f64::from(v)).sum::<f64>() / classes as f64;
        // The mixed target's cross-entropy: the labels' logits weighted, the smoothing shared.
        // Unmixed rows read no other logit (0·inf would turn an infinite row's loss into NaN).
        let z_target = if own == 1.0 {
            f64::from(z[label])
        } else {
            own * f64::from(z[label]) + (1.0 - own) * f64::from(z[partner])
        };
        stats.loss_sum += lse - (1.0 - eps) * z_target - eps * mean_z;
        // A row with a NaN or infinite logit is never counted correct (NaN compares false,
        // so it would otherwise rank first).
        let above = if z.iter().all(|v| v.is_finite()) {
            z.iter().filter(|&&v| v > z[label]).count()
        } else {
            usize::MAX
        };
        stats.correct_top1 += usize::from(above == 0);
        stats.correct_top5 += usize::from(above < 5);
        if let Some(p) = probs.as_deref_mut() {
            for (j, &v) in z.iter().enumerate() {
                p[i * classes + j] = (f64::from(v) - lse).exp() as f32;
            }
        }
        if let Some(d) = dlogits.as_deref_mut() {
            for (j, &v) in z.iter().enumerate() {
                let hot =
                    if j == label { own } else { 0.0 } + if j == partner { 1.0 - own } else { 0.0 };
                let target = eps / classes as f64 + (1.0 - eps) * hot;
                d[i * classes + j] = (((f64::from(v) - lse).exp() - target) / n as f64) as f32;
            }
        }
    }
    Ok(stats)
}
