//! The fused batch-norm sequence on the CPU ([`super::CpuBackend::set_bn_fusion`]): the same
//! ops the CUDA backend fuses into its convolution epilogues, computed here after the
//! convolution in plain loops, so that a network's fused sequence (which op reduces what, the
//! residual gradients it routes, the buffers it keeps) can be checked on the CPU against the
//! unfused one. Off by default: on the CPU it saves nothing.
//!
//! Reductions run in f64 over fixed blocks of rows combined in block order (Chan's
//! combination for the moments), so results do not depend on the thread count.
//!
//! # Layout
//!
//! `y`, `x`, `dx` are `rows × C` row-major; moments are `[3][C]` f32 (mean, M2, count), as
//! [`crate::backend::BnForward::moments`] defines them.

use rayon::prelude::*;

/// Rows per reduction block (fixed, so results do not depend on the thread count).
const BLOCK_ROWS: usize = 256;

/// Writes the moments of `y` (`rows × c`) into `out` (`3·c`: mean, M2 = Σ(y − mean)², count).
pub(super) fn moments(y: &[f32], rows: usize, c: usize, out: &mut [f32]) {
    // Per block: the block mean, then Σ(v − mean)² around it (two passes, f64).
    let blocks: Vec<(f64, Vec<f64>, Vec<f64>)> = y[..rows * c]
        .par_chunks(BLOCK_ROWS * c)
        .map(|block| {
            let n = (block.len() / c) as f64;
            let mut mean = vec![0.0f64; c];
            for row in block.chunks_exact(c) {
                for (m, &v) in mean.iter_mut().zip(row) {
                    *m += f64::from(v);
                }
            }
            mean.iter_mut().for_each(|m| *m /= n);
            let mut m2 = vec![0.0f64; c];
            for row in block.chunks_exact(c) {
                for ((q, &v), m) in m2.iter_mut().zip(row).zip(&mean) {
                    let d = f64::from(v) - m;
                    *q += d * d;
                }
            }
            (n, mean, m2)
        })
        .collect();
    // Chan's combination, block after block.
    let (mut n, mut mean, mut m2) = (0.0f64, vec![0.0f64; c], vec![0.0f64; c]);
    for (nb, mb, qb) in blocks {
        let total = n + nb;
        for ch in 0..c {
            let delta = mb[ch] - mean[ch];
            mean[ch] += delta * nb / total;
            m2[ch] += qb[ch] + delta * delta * n * nb / total;
        }
        n = total;
    }
    for ch in 0..c {
        out[ch] = mean[ch] as f32;
        out[c + ch] = m2[ch] as f32;
        out[2 * c + ch] = n as f32;
    }
}

/// The batch statistics that `moments` (`3·c`) hold: per channel (mean, biased variance), and
/// the row count.
pub(super) fn batch_stats(moments: &[f32], c: usize) -> (Vec<f64>, Vec<f64>, f64) {
    let n = f64::from(moments[2 * c]);
    let mean = moments[..c].iter().map(|&m| f64::from(m)).collect();
    let var = moments[c..2 * c]
        .iter()
        .map(|&q| if n > 0.0 { f64::from(q) / n } else { 0.0 })
        .collect();
    (mean, var, n)
}

/// What the fused data-gradient epilogue does after the convolution: `dx ← [y > 0]·(dx +
/// residual)` in place (the mask only with `relu`), then `dbeta = Σdx`, `dgamma = Σdx·x̂` per
/// channel, `x̂ = (x − mean)·invstd`.
#[allow(clippy::too_many_arguments)]
pub(super) fn finish_grad(
    rows: usize,
    c: usize,
    dx: &mut [f32],
    residual: Option<&[f32]>,
    y: &[f32],
    relu: bool,
    x: &[f32],
    mean: &[f32],
    invstd: &[f32],
    dgamma: &mut [f32],
    dbeta: &mut [f32],
) {
    let partials: Vec<(Vec<f64>, Vec<f64>)> = dx[..rows * c]
        .par_chunks_mut(BLOCK_ROWS * c)
        .enumerate()
        .map(|(b, block)| {
            let off = b * BLOCK_ROWS * c;
            let (mut sb, mut sg) = (vec![0.0f64; c], vec![0.0f64; c]);
            for (r, row) in block.chunks_exact_mut(c).enumerate() {
                let base = off + r * c;
                for ch in 0..c {
                    let i = base + ch;
                    let mut g = row[ch];
                    if let Some(res) = residual {
                        g += res[i];
                    }
                    if relu && y[i] <= 0.0 {
                        g = 0.0;
                    }
                    row[ch] = g;
                    sb[ch] += f64::from(g);
                    sg[ch] += f64::from(g * (x[i] - mean[ch]) * invstd[ch]);
                }
            }
            (sb, sg)
        })
        .collect();
    let (mut sb, mut sg) = (vec![0.0f64; c], vec![0.0f64; c]);
    for (pb, pg) in partials {
        for ch in 0..c {
            sb[ch] += pb[ch];
            sg[ch] += pg[ch];
        }
    }
    for ch in 0..c {
        dbeta[ch] = sb[ch] as f32;
        dgamma[ch] = sg[ch] as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moments_match_a_direct_two_pass_over_several_blocks() {
        let (rows, c) = (3 * BLOCK_ROWS + 17, 3);
        let y: Vec<f32> = (0..rows * c)
            .map(|i| ((i * 7919) % 1000) as f32 * 0.01 + 1000.0 * (i % c) as f32)
            .collect();
        let mut out = vec![0.0f32; 3 * c];
        moments(&y, rows, c, &mut out);
        for ch in 0..c {
            let vals: Vec<f64> = (0..rows).map(|r| f64::from(y[r * c + ch])).collect();
            let mean = vals.iter().sum::<f64>() / rows as f64;
            let m2: f64 = vals.iter().map(|v| (v - mean) * (v - mean)).sum();
            assert!((f64::from(out[ch]) - mean).abs() <= 1e-6 * mean.abs().max(1.0));
            assert!((f64::from(out[c + ch]) - m2).abs() <= 1e-5 * m2);
            assert_eq!(out[2 * c + ch], rows as f32);
        }
        let (m, v, n) = batch_stats(&out, c);
        assert_eq!(n, rows as f64);
        assert_eq!(m[1], f64::from(out[1]));
        assert!((v[2] - f64::from(out[c + 2]) / rows as f64).abs() < 1e-12);
    }

    #[test]
    fn the_gradient_is_masked_after_the_residual_and_reduced() {
        let (rows, c) = (5, 2);
        let mut dx = vec![1.0f32; rows * c];
        let residual = vec![0.5f32; rows * c];
        let y: Vec<f32> = (0..rows * c)
            .map(|i| if i % 3 == 0 { -1.0 } else { 1.0 })
            .collect();
        let x: Vec<f32> = (0..rows * c).map(|i| i as f32).collect();
        let (mean, invstd) = (vec![1.0, 2.0], vec![0.5, 0.25]);
        let (mut dg, mut db) = (vec![9.0; c], vec![9.0; c]);
        finish_grad(
            rows,
            c,
            &mut dx,
            Some(&residual),
            &y,
            true,
            &x,
            &mean,
            &invstd,
            &mut dg,
            &mut db,
        );
        for (i, &g) in dx.iter().enumerate() {
            assert_eq!(g, if i % 3 == 0 { 0.0 } else { 1.5 });
        }
        for ch in 0..c {
            let rows_on: Vec<usize> = (0..rows).filter(|r| (r * c + ch) % 3 != 0).collect();
            assert_eq!(db[ch], 1.5 * rows_on.len() as f32);
            let want: f32 = rows_on
                .iter()
                .map(|r| 1.5 * (x[r * c + ch] - mean[ch]) * invstd[ch])
                .sum();
            assert!((dg[ch] - want).abs() < 1e-5);
        }
    }
}
