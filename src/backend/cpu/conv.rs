//! Convolution on NHWC activations with OHWI weights by im2col + GEMM, or one plain GEMM for
//! 1×1 stride-1 convolutions. The fast backend uses it for those 1×1 convolutions only (the
//! direct kernels do the rest); the reference backend for every convolution. Images are
//! processed in chunks so the column buffer stays bounded; a 1×1 weight gradient over many
//! pixels is cut into parts fixed by the shape, summed in order.

use rayon::prelude::*;

use super::gemm::{matmul, MatRef};
use crate::backend::ConvShape;

/// Column buffer budget in f32 elements (~64 MiB).
const COLS_BUDGET: usize = 16 << 20;

/// The scratch buffer grown to at least `len` (kept between calls, so steady-state steps
/// allocate nothing and touch no fresh pages).
fn grow(scratch: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if scratch.len() < len {
        scratch.resize(len, 0.0);
    }
    &mut scratch[..len]
}

/// 1×1, stride 1, no padding: the convolution is one GEMM over the pixels.
pub(super) fn is_pointwise(s: &ConvShape) -> bool {
    s.kernel == 1 && s.stride == 1 && s.padding == 0
}

/// Images per chunk so that `chunk × Ho·Wo × K` stays within the budget (at least 1).
fn images_per_chunk(s: &ConvShape) -> usize {
    let per_image = s.out_h() * s.out_w() * s.kernel * s.kernel * s.c_in;
    (COLS_BUDGET / per_image.max(1)).clamp(1, s.n.max(1))
}

/// Gathers patches of images `[first, first+count)` into `cols` (`count·Ho·Wo × K`,
/// K ordered (ky, kx, ci) to match OHWI weights).
fn im2col(s: &ConvShape, x: &[f32], first: usize, count: usize, cols: &mut [f32]) {
    let (ho, wo) = (s.out_h(), s.out_w());
    let k = s.kernel * s.kernel * s.c_in;
    let ci = s.c_in;
    cols[..count * ho * wo * k]
        .par_chunks_mut(wo * k)
        .enumerate()
        .for_each(|(row, out)| {
            let img = first + row / ho;
            let oy = row % ho;
            let xi = &x[img * s.h * s.w * ci..(img + 1) * s.h * s.w * ci];
            for ox in 0..wo {
                let patch = &mut out[ox * k..(ox + 1) * k];
                for ky in 0..s.kernel {
                    let iy = (oy * s.stride + ky) as isize - s.padding as isize;
                    for kx in 0..s.kernel {
                        let ix = (ox * s.stride + kx) as isize - s.padding as isize;
                        let dst =
                            &mut patch[(ky * s.kernel + kx) * ci..(ky * s.kernel + kx + 1) * ci];
                        if iy < 0 || ix < 0 || iy >= s.h as isize || ix >= s.w as isize {
                            dst.fill(0.0);
                        } else {
                            let src = (iy as usize * s.w + ix as usize) * ci;
                            dst.copy_from_slice(&xi[src..src + ci]);
                        }
                    }
                }
            }
        });
}

/// Scatters-adds column gradients of images `[first, first+count)` back into `dx`
/// (one image per task, so sums are in a fixed order).
fn col2im(
    s: &ConvShape,
    dcols: &[f32],
    first: usize,
    count: usize,
    dx: &mut [f32],
    accumulate: bool,
) {
    let (ho, wo) = (s.out_h(), s.out_w());
    let k = s.kernel * s.kernel * s.c_in;
    let ci = s.c_in;
    let img_len = s.h * s.w * ci;
    dx[first * img_len..(first + count) * img_len]
        .par_chunks_mut(img_len)
        .enumerate()
        .for_each(|(j, dxi)| {
            if !accumulate {
                dxi.fill(0.0);
            }
            let base = j * ho * wo * k;
            for oy in 0..ho {
                for ox in 0..wo {
                    let patch = &dcols[base + (oy * wo + ox) * k..base + (oy * wo + ox + 1) * k];
                    for ky in 0..s.kernel {
                        let iy = (oy * s.stride + ky) as isize - s.padding as isize;
                        if iy < 0 || iy >= s.h as isize {
                            continue;
                        }
                        for kx in 0..s.kernel {
                            let ix = (ox * s.stride + kx) as isize - s.padding as isize;
                            if ix < 0 || ix >= s.w as isize {
                                continue;
                            }
                            let dst = (iy as usize * s.w + ix as usize) * ci;
                            let src =
                                &patch[(ky * s.kernel + kx) * ci..(ky * s.kernel + kx + 1) * ci];
                            for (d, v) in dxi[dst..dst + ci].iter_mut().zip(src) {
                                *d += v;
                            }
                        }
                    }
                }
            }
        });
}

/// `w` viewed as `Wᵀ` (K × Co) for `cols · Wᵀ`.
fn w_transposed<'a>(s: &ConvShape, w: &'a [f32]) -> MatRef<'a> {
    let k = s.kernel * s.kernel * s.c_in;
    MatRef {
        data: w,
        rows: k,
        cols: s.c_out,
        rs: 1,
        cs: k,
    }
}

pub(super) fn forward(
    s: &ConvShape,
    x: &[f32],
    w: &[f32],
    y: &mut [f32],
    threads: usize,
    scratch: &mut Vec<f32>,
) {
    let (ho, wo) = (s.out_h(), s.out_w());
    let k = s.kernel * s.kernel * s.c_in;
    if is_pointwise(s) {
        let m = s.n * s.h * s.w;
        let a = MatRef {
            data: x,
            rows: m,
            cols: k,
            rs: k,
            cs: 1,
        };
        matmul(&mut y[..m * s.c_out], a, w_transposed(s, w), false, threads);
        return;
    }
    let chunk = images_per_chunk(s);
    let cols = grow(scratch, chunk * ho * wo * k);
    let mut first = 0;
    while first < s.n {
        let count = chunk.min(s.n - first);
        im2col(s, x, first, count, cols);
        let m = count * ho * wo;
        let a = MatRef {
            data: cols,
            rows: m,
            cols: k,
            rs: k,
            cs: 1,
        };
        let out = &mut y[first * ho * wo * s.c_out..(first + count) * ho * wo * s.c_out];
        matmul(out, a, w_transposed(s, w), false, threads);
        first += count;
    }
}

pub(super) fn backward_data(
    s: &ConvShape,
    dy: &[f32],
    w: &[f32],
    dx: &mut [f32],
    accumulate: bool,
    threads: usize,
    scratch: &mut Vec<f32>,
) {
    let (ho, wo) = (s.out_h(), s.out_w());
    let k = s.kernel * s.kernel * s.c_in;
    let wm = MatRef {
        data: w,
        rows: s.c_out,
        cols: k,
        rs: k,
        cs: 1,
    };
    if is_pointwise(s) {
        let m = s.n * s.h * s.w;
        let a = MatRef {
            data: dy,
            rows: m,
            cols: s.c_out,
            rs: s.c_out,
            cs: 1,
        };
        matmul(&mut dx[..m * k], a, wm, accumulate, threads);
        return;
    }
    let chunk = images_per_chunk(s);
    let dcols = grow(scratch, chunk * ho * wo * k);
    let mut first = 0;
    while first < s.n {
        let count = chunk.min(s.n - first);
        let m = count * ho * wo;
        let dyc = &dy[first * ho * wo * s.c_out..(first + count) * ho * wo * s.c_out];
        let a = MatRef {
            data: dyc,
            rows: m,
            cols: s.c_out,
            rs: s.c_out,
            cs: 1,
        };
        matmul(&mut dcols[..m * k], a, wm, false, threads);
        col2im(s, dcols, first, count, dx, accumulate);
        first += count;
    }
}

pub(super) fn backward_weight(
    s: &ConvShape,
    x: &[f32],
    dy: &[f32],
    dw: &mut [f32],
    threads: usize,
    scratch: &mut Vec<f32>,
) {
    let (ho, wo) = (s.out_h(), s.out_w());
    let k = s.kernel * s.kernel * s.c_in;
    let dw = &mut dw[..s.c_out * k];
    if is_pointwise(s) {
        let m = s.n * s.h * s.w;
        if m >= 4 * POINTWISE_PART {
            pointwise_weight_split(s, x, dy, dw, scratch);
            return;
        }
        let a = MatRef {
            data: dy,
            rows: s.c_out,
            cols: m,
            rs: 1,
            cs: s.c_out,
        };
        let b = MatRef {
            data: x,
            rows: m,
            cols: k,
            rs: k,
            cs: 1,
        };
        matmul(dw, a, b, false, threads);
        return;
    }
    let chunk = images_per_chunk(s);
    let cols = grow(scratch, chunk * ho * wo * k);
    let mut first = 0;
    while first < s.n {
        let count = chunk.min(s.n - first);
        im2col(s, x, first, count, cols);
        let m = count * ho * wo;
        let dyc = &dy[first * ho * wo * s.c_out..(first + count) * ho * wo * s.c_out];
        let a = MatRef {
            data: dyc,
            rows: s.c_out,
            cols: m,
            rs: 1,
            cs: s.c_out,
        };
        let b = MatRef {
            data: cols,
            rows: m,
            cols: k,
            rs: k,
            cs: 1,
        };
        matmul(dw, a, b, first > 0, threads);
        first += count;
    }
}

/// Pixels per part of a split 1×1 weight gradient.
const POINTWISE_PART: usize = 1024;

/// The 1×1 weight gradient with its long reduction (the pixels) cut into parts fixed by the
/// shape: each part is a single-threaded GEMM into its own buffer, the parts run in parallel
/// and are added in order (the same bits for any thread count). One threaded GEMM whose output
/// is small (64 × 64 channels) over 8 192 pixels keeps the threads only partly busy (measured
/// with `cargo bench --bench cpu_conv`: the 16-pixel 1×1 weight gradients of resnet50 went
/// from 60–110 to 95–125 GFLOP/s on 2 threads).
fn pointwise_weight_split(
    s: &ConvShape,
    x: &[f32],
    dy: &[f32],
    dw: &mut [f32],
    scratch: &mut Vec<f32>,
) {
    let (m, ci, co) = (s.n * s.h * s.w, s.c_in, s.c_out);
    let parts = (m / POINTWISE_PART).clamp(1, 16);
    let len = co * ci;
    let sums = grow(scratch, parts * len);
    sums.par_chunks_mut(len)
        .enumerate()
        .for_each(|(part, out)| {
            let p0 = part * m / parts;
            let p1 = (part + 1) * m / parts;
            let a = MatRef {
                data: &dy[p0 * co..p1 * co],
                rows: co,
                cols: p1 - p0,
                rs: 1,
                cs: co,
            };
            let b = MatRef {
                data: &x[p0 * ci..p1 * ci],
                rows: p1 - p0,
                cols: ci,
                rs: ci,
                cs: 1,
            };
            matmul(out, a, b, false, 1);
        });
    let sums = &*sums;
    dw[..len]
        .par_chunks_mut(1 << 12)
        .enumerate()
        .for_each(|(i, out)| {
            let off = i << 12;
            out.copy_from_slice(&sums[off..off + out.len()]);
            for part in 1..parts {
                for (o, v) in out.iter_mut().zip(&sums[part * len + off..]) {
                    *o += v;
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
    }

    #[test]
    fn a_split_pointwise_weight_gradient_matches_the_plain_sum_for_any_thread_count() {
        // 4 224 pixels: cut into 4 parts of uneven length; odd channel counts.
        let s = ConvShape {
            n: 4,
            h: 32,
            w: 33,
            c_in: 5,
            c_out: 3,
            kernel: 1,
            stride: 1,
            padding: 0,
        };
        let m = s.n * s.h * s.w;
        assert!(
            m >= 4 * POINTWISE_PART,
            "the shape must take the split path"
        );
        let x: Vec<f32> = (0..m * 5)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect();
        let dy: Vec<f32> = (0..m * 3)
            .map(|i| ((i * 53 % 89) as f32 - 44.0) / 44.0)
            .collect();
        let mut want = vec![0.0f64; 15];
        for p in 0..m {
            for o in 0..3 {
                for c in 0..5 {
                    want[o * 5 + c] += dy[p * 3 + o] as f64 * x[p * 5 + c] as f64;
                }
            }
        }
        let mut runs = Vec::new();
        for threads in [1, 2, 3] {
            let mut dw = vec![f32::NAN; 15];
            pool(threads)
                .install(|| backward_weight(&s, &x, &dy, &mut dw, threads, &mut Vec::new()));
            for (g, w) in dw.iter().zip(&want) {
                assert!(
                    (*g as f64 - w).abs() <= 1e-4 * (1.0 + w.abs()),
                    "{g} vs {w}"
                );
            }
            runs.push(dw);
        }
        assert!(
            runs.iter().all(|r| r == &runs[0]),
            "bits differ by thread count"
        );
    }
}
