//! Helpers shared by the gradient-check tests.
#![allow(dead_code)]

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `n` values uniform in [-1, 1).
pub(crate) fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
}

/// Σ r·y in f64: the scalar whose gradient with respect to y is r.
pub(crate) fn project(y: &[f32], r: &[f32]) -> f64 {
    y.iter()
        .zip(r)
        .map(|(a, b)| f64::from(*a) * f64::from(*b))
        .sum()
}

/// Compares `analytic` with central differences of `loss` around `x` at up to `samples`
/// evenly spread indices. Tolerance: |a − n| ≤ atol + rtol·|n|, where atol is `rel` times the
/// largest analytic magnitude (f32 forward passes limit the finite differences' precision).
pub(crate) fn check(
    what: &str,
    x: &[f32],
    analytic: &[f32],
    h: f32,
    rel: f64,
    samples: usize,
    mut loss: impl FnMut(&[f32]) -> f64,
) {
    assert_eq!(x.len(), analytic.len(), "{what}: gradient length");
    let scale = analytic
        .iter()
        .fold(0.0f64, |m, g| m.max(f64::from(g.abs())));
    assert!(scale > 0.0, "{what}: gradient is identically zero");
    let step = (x.len() / samples.min(x.len())).max(1);
    let mut worst = 0.0f64;
    let mut xp = x.to_vec();
    for i in (0..x.len()).step_by(step) {
        xp[i] = x[i] + h;
        let lp = loss(&xp);
        xp[i] = x[i] - h;
        let lm = loss(&xp);
        xp[i] = x[i];
        let num = (lp - lm) / (2.0 * f64::from(h));
        let a = f64::from(analytic[i]);
        let err = (a - num).abs();
        let tol = rel * scale + rel * num.abs();
        worst = worst.max(err / tol);
        assert!(
            err <= tol,
            "{what}[{i}]: analytic {a} vs numeric {num} (scale {scale})"
        );
    }
    eprintln!("{what}: worst error/tolerance {worst:.3}");
}
