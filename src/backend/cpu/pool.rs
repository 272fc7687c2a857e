//! Max pooling and global average pooling on NHWC, vectorised across channels.

use rayon::prelude::*;

use super::simd::{dispatch, Simd, SimdLevel, SimdTask};
use crate::backend::PoolShape;

/// The window of output (oy, ox) clipped to the image: (y0, y1, x0, x1), half-open.
fn window(s: &PoolShape, oy: usize, ox: usize) -> (usize, usize, usize, usize) {
    let y0 = (oy * s.stride) as isize - s.padding as isize;
    let x0 = (ox * s.stride) as isize - s.padding as isize;
    let y1 = (y0 + s.kernel as isize).min(s.h as isize);
    let x1 = (x0 + s.kernel as isize).min(s.w as isize);
    (
        y0.max(0) as usize,
        y1.max(0) as usize,
        x0.max(0) as usize,
        x1.max(0) as usize,
    )
}

/// Max pooling of one image: the window's maximum per channel, `NaN`s ignored (as a strict
/// `>` scan from −∞ does), vectorised across channels.
struct MaxForward<'a> {
    s: &'a PoolShape,
    x: &'a [f32],
    y: &'a mut [f32],
}

impl SimdTask for MaxForward<'_> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self) {
        for (o, out) in self.y.chunks_exact_mut(self.s.c).enumerate() {
            window_max(self.s, self.x, o, out);
        }
    }
}

/// The maximum per channel of output pixel `o`'s window into `out` (`c` values): a strict `>`
/// scan from −∞, written as a select so it vectorises across channels.
#[inline(always)]
fn window_max(s: &PoolShape, x: &[f32], o: usize, out: &mut [f32]) {
    let (c, wo) = (s.c, s.out_w());
    let (y0, y1, x0, x1) = window(s, o / wo, o % wo);
    out.fill(f32::NEG_INFINITY);
    for iy in y0..y1 {
        for ix in x0..x1 {
            let src = &x[(iy * s.w + ix) * c..][..c];
            for (m, &v) in out.iter_mut().zip(src) {
                *m = if v > *m { v } else { *m };
            }
        }
    }
}

pub(super) fn max_forward(level: SimdLevel, s: &PoolShape, x: &[f32], y: &mut [f32]) {
    let (ho, wo, c) = (s.out_h(), s.out_w(), s.c);
    let img = s.h * s.w * c;
    y[..s.n * ho * wo * c]
        .par_chunks_mut(ho * wo * c)
        .zip(x[..s.n * img].par_chunks(img))
        .for_each(|(y, x)| dispatch(level, MaxForward { s, x, y }));
}

/// The max-pooling gradient of one image: each output's gradient goes to the first input of
/// its window (row-major) that equals the window's maximum, as the forward scan picks it.
/// Branch-free across channels: a channel's pending gradient is added where the input equals
/// the maximum and then set to zero, so later equal inputs add nothing.
struct MaxBackward<'a> {
    s: &'a PoolShape,
    x: &'a [f32],
    dy: &'a [f32],
    dx: &'a mut [f32],
    accumulate: bool,
    best: &'a mut [f32],
    pending: &'a mut [f32],
}

impl SimdTask for MaxBackward<'_> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self) {
        let (s, c, wo) = (self.s, self.s.c, self.s.out_w());
        if !self.accumulate {
            self.dx.fill(0.0);
        }
        for (o, g) in self.dy.chunks_exact(c).enumerate() {
            window_max(s, self.x, o, self.best);
            let (y0, y1, x0, x1) = window(s, o / wo, o % wo);
            self.pending.copy_from_slice(g);
            for iy in y0..y1 {
                for ix in x0..x1 {
                    let at = (iy * s.w + ix) * c;
                    let src = &self.x[at..][..c];
                    let dst = &mut self.dx[at..][..c];
                    for (((d, &v), &m), p) in dst
                        .iter_mut()
                        .zip(src)
                        .zip(self.best.iter())
                        .zip(self.pending.iter_mut())
                    {
                        let hit = v == m;
                        *d += if hit { *p } else { 0.0 };
                        *p = if hit { 0.0 } else { *p };
                    }
                }
            }
        }
    }
}

pub(super) fn max_backward(
    level: SimdLevel,
    s: &PoolShape,
    x: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    accumulate: bool,
) {
    let (ho, wo, c) = (s.out_h(), s.out_w(), s.c);
    let img = s.h * s.w * c;
    dx[..s.n * img]
        .par_chunks_mut(img)
        .zip(x[..s.n * img].par_chunks(img))
        .zip(dy[..s.n * ho * wo * c].par_chunks(ho * wo * c))
        .for_each(|((dx, x), dy)| {
            let (mut best, mut pending) = (vec![0.0; c], vec![0.0; c]);
            dispatch(
                level,
                MaxBackward {
                    s,
                    x,
                    dy,
                    dx,
                    accumulate,
                    best: &mut best,
                    pending: &mut pending,
                },
            )
        });
}

pub(super) fn gap_forward(n: usize, hw: usize, c: usize, x: &[f32], y: &mut [f32]) {
    let inv = 1.0 / hw as f32;
    y[..n * c]
        .par_chunks_mut(c)
        .enumerate()
        .for_each(|(i, yi)| {
            yi.fill(0.0);
            for p in x[i * hw * c..(i + 1) * hw * c].chunks_exact(c) {
                for (o, v) in yi.iter_mut().zip(p) {
                    *o += v;
                }
            }
            for o in yi.iter_mut() {
                *o *= inv;
            }
        });
}

pub(super) fn gap_backward(
    n: usize,
    hw: usize,
    c: usize,
    dy: &[f32],
    dx: &mut [f32],
    accumulate: bool,
) {
    let inv = 1.0 / hw as f32;
    dx[..n * hw * c]
        .par_chunks_mut(hw * c)
        .enumerate()
        .for_each(|(i, dxi)| {
            let g = &dy[i * c..(i + 1) * c];
            for p in dxi.chunks_exact_mut(c) {
                for (d, v) in p.iter_mut().zip(g) {
                    if accumulate {
                        *d += v * inv;
                    } else {
                        *d = v * inv;
                    }
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain loops: the first maximum of each window in row-major order gets the gradient.
    fn naive(s: &PoolShape, x: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let (ho, wo, c) = (s.out_h(), s.out_w(), s.c);
        let mut y = vec![0.0; s.n * ho * wo * c];
        let mut dx = vec![0.0; x.len()];
        for n in 0..s.n {
            for oy in 0..ho {
                for ox in 0..wo {
                    let (y0, y1, x0, x1) = window(s, oy, ox);
                    for ch in 0..c {
                        let (mut best, mut at) = (f32::NEG_INFINITY, None);
                        for iy in y0..y1 {
                            for ix in x0..x1 {
                                let p = ((n * s.h + iy) * s.w + ix) * c + ch;
                                if at.is_none() || x[p] > best {
                                    (best, at) = (x[p], Some(p));
                                }
                            }
                        }
                        let o = ((n * ho + oy) * wo + ox) * c + ch;
                        y[o] = best;
                        dx[at.unwrap()] += dy[o];
                    }
                }
            }
        }
        (y, dx)
    }

    #[test]
    fn max_pooling_matches_the_plain_loops_with_ties_at_every_vector_width() {
        // Values from a small set, so windows hold tied maxima; 19 channels (a partial vector).
        let s = PoolShape {
            n: 2,
            h: 7,
            w: 6,
            c: 19,
            kernel: 3,
            stride: 2,
            padding: 1,
        };
        let x: Vec<f32> = (0..s.n * s.h * s.w * s.c)
            .map(|i| [-1.0, 0.5, 2.0, 2.0, f32::NEG_INFINITY][i * 7 % 5])
            .collect();
        let out = s.n * s.out_h() * s.out_w() * s.c;
        let dy: Vec<f32> = (0..out).map(|i| 1.0 + i as f32).collect();
        let (want_y, want_dx) = naive(&s, &x, &dy);
        for level in [SimdLevel::Portable, SimdLevel::Avx2, SimdLevel::Avx512] {
            if !level.supported() {
                continue;
            }
            let mut y = vec![0.0; out];
            max_forward(level, &s, &x, &mut y);
            assert_eq!(y, want_y, "{level}");
            let mut dx = vec![7.0; x.len()];
            max_backward(level, &s, &x, &dy, &mut dx, false);
            assert_eq!(dx, want_dx, "{level}");
            let mut acc = vec![1.0; x.len()];
            max_backward(level, &s, &x, &dy, &mut acc, true);
            let want: Vec<f32> = want_dx.iter().map(|v| v + 1.0).collect();
            assert_eq!(acc, want, "{level} accumulated");
        }
    }
}
