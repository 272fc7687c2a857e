//! What several GPU test modules measure the same way.

/// How far weights `a` are from `b`, relative to how far `b` moved from `start`: the L2 norm
/// of the difference of the two updates over the norm of `b`'s update.
pub(crate) fn update_distance(start: &[f32], a: &[f32], b: &[f32]) -> f64 {
    assert!(start.len() == a.len() && a.len() == b.len());
    let (mut diff, mut moved) = (0.0f64, 0.0f64);
    for ((&s, &x), &y) in start.iter().zip(a).zip(b) {
        diff += f64::from(x - y).powi(2);
        moved += f64::from(y - s).powi(2);
    }
    (diff / moved.max(f64::MIN_POSITIVE)).sqrt()
}
