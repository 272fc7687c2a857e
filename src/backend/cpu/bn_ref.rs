//! The reference batch norm (fused residual add and ReLU), forward and backward, over
//! `rows × C`: straightforward loops with every reduction in f64 and the two-pass variance.
//! [`super::bn`] is the fast version; the conformance tests check it against this one.
//!
//! Per-channel reductions are computed per fixed block of rows (independent of the thread
//! count) and combined in block order, so results are bit-identical run to run.

use rayon::prelude::*;

use crate::backend::{BnBackward, BnForward, BnMode};

/// Rows per reduction block.
const BLOCK_ROWS: usize = 256;

/// Per-channel sums of `f(row, channel, value)` over `rows × c` data, deterministic.
fn channel_sums(
    data: &[f32],
    rows: usize,
    c: usize,
    f: impl Fn(usize, f32) -> f64 + Sync,
) -> Vec<f64> {
    let partials: Vec<Vec<f64>> = data[..rows * c]
        .par_chunks(BLOCK_ROWS * c)
        .map(|block| {
            let mut acc = vec![0.0f64; c];
            for row in block.chunks_exact(c) {
                for (ch, (a, &v)) in acc.iter_mut().zip(row).enumerate() {
                    *a += f(ch, v);
                }
            }
            acc
        })
        .collect();
    let mut total = vec![0.0f64; c];
    for p in partials {
        for (t, v) in total.iter_mut().zip(p) {
            *t += v;
        }
    }
    total
}

pub(super) fn forward(a: BnForward<'_, Vec<f32>>) {
    let (rows, c) = (a.shape.rows, a.shape.channels);
    let x = &a.x[..rows * c];
    match (a.mode, a.moments) {
        (BnMode::Train, Some(moments)) => {
            let (mean, var, n) = super::bn_fused::batch_stats(moments, c);
            let m = f64::from(a.momentum);
            for ch in 0..c {
                a.saved_mean[ch] = mean[ch] as f32;
                a.saved_invstd[ch] = (1.0 / (var[ch] + f64::from(a.eps)).sqrt()) as f32;
                let unbiased = if n > 1.0 {
                    var[ch] * n / (n - 1.0)
                } else {
                    var[ch]
                };
                a.running_mean[ch] =
                    ((1.0 - m) * f64::from(a.running_mean[ch]) + m * mean[ch]) as f32;
                a.running_var[ch] =
                    ((1.0 - m) * f64::from(a.running_var[ch]) + m * unbiased) as f32;
            }
        }
        (BnMode::Train, None) => {
            let sums = channel_sums(x, rows, c, |_, v| f64::from(v));
            let mean: Vec<f64> = sums.iter().map(|s| s / rows as f64).collect();
            let sq = channel_sums(x, rows, c, |ch, v| {
                let d = f64::from(v) - mean[ch];
                d * d
            });
            for ch in 0..c {
                let var = sq[ch] / rows as f64;
                a.saved_mean[ch] = mean[ch] as f32;
                a.saved_invstd[ch] = (1.0 / (var + f64::from(a.eps)).sqrt()) as f32;
                let unbiased = if rows > 1 {
                    sq[ch] / (rows - 1) as f64
                } else {
                    var
                };
                let m = f64::from(a.momentum);
                a.running_mean[ch] =
                    ((1.0 - m) * f64::from(a.running_mean[ch]) + m * mean[ch]) as f32;
                a.running_var[ch] =
                    ((1.0 - m) * f64::from(a.running_var[ch]) + m * unbiased) as f32;
            }
        }
        (BnMode::Frozen | BnMode::Eval, _) => {
            for ch in 0..c {
                a.saved_mean[ch] = a.running_mean[ch];
                a.saved_invstd[ch] = 1.0 / (a.running_var[ch] + a.eps).sqrt();
            }
        }
    }
    if let Some(y) = a.y {
        let norm = super::bn::Normalise {
            rows,
            c,
            x,
            residual: a.residual.map(|r| &r[..rows * c]),
            gamma: a.gamma,
            beta: a.beta,
            mean: a.saved_mean,
            invstd: a.saved_invstd,
            relu: a.relu,
        };
        normalise(&norm, y);
    }
}

/// The reference form of [`super::bn::normalise`]: `y = x·scale + shift (+ residual)` (ReLU)
/// with `scale = γ·invstd`, `shift = β − mean·scale`.
pub(super) fn normalise(n: &super::bn::Normalise<'_>, y: &mut [f32]) {
    let (rows, c) = (n.rows, n.c);
    let x = &n.x[..rows * c];
    let scale: Vec<f32> = (0..c).map(|ch| n.gamma[ch] * n.invstd[ch]).collect();
    let shift: Vec<f32> = (0..c)
        .map(|ch| n.beta[ch] - n.mean[ch] * scale[ch])
        .collect();
    let relu = n.relu;
    let residual = n.residual.map(|r| &r[..rows * c]);
    // Row by row so the channel index comes from the position, not a division per element.
    y[..rows * c]
        .par_chunks_mut(BLOCK_ROWS * c)
        .enumerate()
        .for_each(|(b, yb)| {
            let off = b * BLOCK_ROWS * c;
            let xb = &x[off..off + yb.len()];
            let rb = residual.map(|r| &r[off..off + yb.len()]);
            for (r, (yr, xr)) in yb.chunks_exact_mut(c).zip(xb.chunks_exact(c)).enumerate() {
                let res = rb.map(|rb| &rb[r * c..(r + 1) * c]);
                for ch in 0..c {
                    let mut v = xr[ch] * scale[ch] + shift[ch];
                    if let Some(res) = res {
                        v += res[ch];
                    }
                    yr[ch] = if relu && v < 0.0 { 0.0 } else { v };
                }
            }
        });
}

pub(super) fn backward(a: BnBackward<'_, Vec<f32>>) {
    let (rows, c) = (a.shape.rows, a.shape.channels);
    // Prepared: dy is the masked gradient already, and dgamma, dbeta its reductions.
    let relu = a.relu && !a.prepared;
    // No output (prepared, or no ReLU): the mask is not read; dy stands in.
    let y = &a.y.unwrap_or(a.dy)[..rows * c];
    let dy = &a.dy[..rows * c];
    let x = &a.x[..rows * c];
    let mean = a.saved_mean;
    let invstd = a.saved_invstd;
    // dz = dy masked by the ReLU (recomputed where needed instead of stored).
    let dz = |i: usize| if relu && y[i] <= 0.0 { 0.0 } else { dy[i] };
    // Σ dz and Σ dz·x̂ per channel, per fixed block of rows, combined in block order.
    let blocks = if a.prepared {
        0
    } else {
        rows.div_ceil(BLOCK_ROWS)
    };
    let partials: Vec<(Vec<f64>, Vec<f64>)> = (0..blocks)
        .into_par_iter()
        .map(|b| {
            let (mut sb, mut sg) = (vec![0.0f64; c], vec![0.0f64; c]);
            for r in b * BLOCK_ROWS..((b + 1) * BLOCK_ROWS).min(rows) {
                let (yr, dyr, xr) = (
                    &y[r * c..(r + 1) * c],
                    &dy[r * c..(r + 1) * c],
                    &x[r * c..(r + 1) * c],
                );
                for ch in 0..c {
                    let g = if relu && yr[ch] <= 0.0 { 0.0 } else { dyr[ch] };
                    sb[ch] += f64::from(g);
                    sg[ch] += f64::from(g * (xr[ch] - mean[ch]) * invstd[ch]);
                }
            }
            (sb, sg)
        })
        .collect();
    let (mut dbeta, mut dgamma) = (vec![0.0f64; c], vec![0.0f64; c]);
    if a.prepared {
        for ch in 0..c {
            dbeta[ch] = f64::from(a.dbeta[ch]);
            dgamma[ch] = f64::from(a.dgamma[ch]);
        }
    }
    for (sb, sg) in partials {
        for ch in 0..c {
            dbeta[ch] += sb[ch];
            dgamma[ch] += sg[ch];
        }
    }
    for ch in 0..c {
        a.dgamma[ch] = dgamma[ch] as f32;
        a.dbeta[ch] = dbeta[ch] as f32;
    }
    if let Some((dres, acc)) = a.dresidual {
        dres[..rows * c]
            .par_chunks_mut(BLOCK_ROWS * c)
            .enumerate()
            .for_each(|(b, db)| {
                let off = b * BLOCK_ROWS * c;
                for (i, d) in db.iter_mut().enumerate() {
                    let g = dz(off + i);
                    if acc {
                        *d += g;
                    } else {
                        *d = g;
                    }
                }
            });
    }
    let gamma = a.gamma;
    let batch = a.batch_stats;
    let mdb: Vec<f32> = dbeta.iter().map(|v| (*v / rows as f64) as f32).collect();
    let mdg: Vec<f32> = dgamma.iter().map(|v| (*v / rows as f64) as f32).collect();
    let k: Vec<f32> = (0..c).map(|ch| gamma[ch] * invstd[ch]).collect();
    a.dx[..rows * c]
        .par_chunks_mut(BLOCK_ROWS * c)
        .enumerate()
        .for_each(|(b, dxb)| {
            let off = b * BLOCK_ROWS * c;
            for (r, dxr) in dxb.chunks_exact_mut(c).enumerate() {
                let base = off + r * c;
                let (yr, dyr, xr) = (&y[base..base + c], &dy[base..base + c], &x[base..base + c]);
                for ch in 0..c {
                    let g = if relu && yr[ch] <= 0.0 { 0.0 } else { dyr[ch] };
                    dxr[ch] = if batch {
                        let xhat = (xr[ch] - mean[ch]) * invstd[ch];
                        k[ch] * (g - mdb[ch] - xhat * mdg[ch])
                    } else {
                        k[ch] * g
                    };
                }
            }
        });
}
