//! Max pooling and global average pooling on NHWC.

use rayon::prelude::*;

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

pub(super) fn max_forward(s: &PoolShape, x: &[f32], y: &mut [f32]) {
    let (ho, wo, c) = (s.out_h(), s.out_w(), s.c);
    let img = s.h * s.w * c;
    y[..s.n * ho * wo * c]
        .par_chunks_mut(ho * wo * c)
        .enumerate()
        .for_each(|(n, yi)| {
            let xi = &x[n * img..(n + 1) * img];
            for oy in 0..ho {
                for ox in 0..wo {
                    let (y0, y1, x0, x1) = window(s, oy, ox);
                    let out = &mut yi[(oy * wo + ox) * c..(oy * wo + ox + 1) * c];
                    out.fill(f32::NEG_INFINITY);
                    for iy in y0..y1 {
                        for ix in x0..x1 {
                            let src = &xi[(iy * s.w + ix) * c..(iy * s.w + ix + 1) * c];
                            for (o, &v) in out.iter_mut().zip(src) {
                                if v > *o {
                                    *o = v;
                                }
                            }
                        }
                    }
                }
            }
        });
}

pub(super) fn max_backward(s: &PoolShape, x: &[f32], dy: &[f32], dx: &mut [f32], accumulate: bool) {
    let (ho, wo, c) = (s.out_h(), s.out_w(), s.c);
    let img = s.h * s.w * c;
    dx[..s.n * img]
        .par_chunks_mut(img)
        .enumerate()
        .for_each(|(n, dxi)| {
            if !accumulate {
                dxi.fill(0.0);
            }
            let xi = &x[n * img..(n + 1) * img];
            let dyi = &dy[n * ho * wo * c..(n + 1) * ho * wo * c];
            for oy in 0..ho {
                for ox in 0..wo {
                    let (y0, y1, x0, x1) = window(s, oy, ox);
                    for ch in 0..c {
                        // First maximum in row-major order wins, as in the forward scan.
                        let mut best = f32::NEG_INFINITY;
                        let mut at = usize::MAX;
                        for iy in y0..y1 {
                            for ix in x0..x1 {
                                let p = (iy * s.w + ix) * c + ch;
                                if at == usize::MAX || xi[p] > best {
                                    best = xi[p];
                                    at = p;
                                }
                            }
                        }
                        if at != usize::MAX {
                            dxi[at] += dyi[(oy * wo + ox) * c + ch];
                        }
                    }
                }
            }
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
