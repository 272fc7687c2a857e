//! Direct convolution on NHWC activations with OHWI weights: forward, data gradient and
//! weight gradient without im2col, every padded tap skipped.
//!
//! # Algorithm
//!
//! A [`Plan`] (one per shape and direction, cached) sorts the output pixels into groups whose
//! valid kernel taps are the same; a 512-channel layer at 1×1 pixels is then one group whose
//! only tap is the centre, and a 32×32 map is one big interior group plus thin edge groups.
//! Each group lists its *runs*: stretches of the reduction that are contiguous in the input
//! for every pixel of the group (forward: one kernel row `ky` over its valid `kx` and all input
//! channels; data gradient: one tap over all output channels), and its pixels (where each one's
//! input starts, where its output goes).
//!
//! - **Forward** (`y = x ⊛ w`): a register tile of `R` pixels × `NV` vectors of output channels
//!   accumulates `acc[r][j] += x[pixel r, c] · w[c, j]` over every run of the group: one vector
//!   load of weights feeds `R` FMAs, one broadcast of an input value feeds `NV`. Weights are
//!   pre-packed per call into `[channel block][ky][kx][ci][CB]` (only the taps some pixel
//!   uses), so each weight vector is contiguous.
//! - **Data gradient** is the same kernel run as a forward convolution of `dy` with the
//!   weights flipped and transposed, packed per call into `[ci block][tap][co][CB]`; the taps
//!   of a pixel are those with `iy + p − ky ≡ 0 (mod stride)`, which also covers strided
//!   convolutions.
//! - **Weight gradient** is a reduction over pixels: a tile of `R` reduction positions
//!   (consecutive `(kx, ci)` of a forward run) × `NV` vectors of output channels accumulates
//!   `x[pixel, row r] · dy[pixel, j]` over a chunk of pixels and is added into a buffer laid
//!   out `[channel block][tap·ci][CB]` (vector adds). A chunk's `dy` rows of one channel block
//!   are first copied into an aligned contiguous buffer that stays in L1 while the tile sweeps
//!   the whole reduction. The pixels are cut into a number of parts fixed by the shape (not the
//!   thread count); each part sums into its own buffer and the parts are added in order while
//!   being turned into OHWI, so the result is the same bits for any thread count.
//!
//! Forward and data gradient write every output element from exactly one task, so they too are
//! independent of the thread count. Tiles at a group's end or a channel block's edge go
//! through a small stack buffer; no lane ever reads outside the tensors (the plan's offsets
//! are checked when it is built).
//!
//! # Layout
//!
//! `x` NHWC `[n][h][w][ci]`, `y`/`dy` NHWC `[n][ho][wo][co]`, `w`/`dw` OHWI
//! `[co][kh][kw][ci]`, packed forward weights `[co / CB][kh·kw][ci][CB]` (zero beyond `co`),
//! packed data-gradient weights `[ci / CB][kh·kw][co][CB]` (zero beyond `ci`).

use std::collections::HashMap;
use std::sync::Arc;

use rayon::prelude::*;

use super::simd::{dispatch, Simd, SimdLevel, SimdTask};
use crate::backend::ConvShape;

/// Largest channel block: 2 vectors of 16 lanes.
const MAX_CB: usize = 32;
/// Pixels per weight-gradient chunk (the reduction a tile sums before it is added out; the
/// chunk's dy rows of one channel block, `WGRAD_CHUNK × CB` values, stay in L1).
const WGRAD_CHUNK: usize = 128;
/// Pixels per weight-gradient part: more pixels than this are split into parts summed
/// separately (fixed by the shape, so results do not depend on the thread count).
const WGRAD_PART: usize = 2048;
/// Most weight-gradient parts.
const WGRAD_MAX_PARTS: usize = 16;

/// Where one output pixel reads its input and writes its output.
#[derive(Debug, Clone, Copy)]
pub(super) struct Pixel {
    /// Offset of the pixel's input origin (may lie outside the tensor; `origin + run.delta`
    /// never does).
    in_base: isize,
    /// Output pixel index (`(n·H + y)·W + x` of the output map).
    out: usize,
}

/// A stretch of the reduction, contiguous in the input for every pixel of a group.
#[derive(Debug, Clone, Copy)]
pub(super) struct Run {
    /// Input offset of the stretch from the pixel's origin.
    delta: isize,
    /// Forward: OHWI offset inside one output channel's weights (`tap·ci + c`); data
    /// gradient: the tap index.
    w_index: usize,
    /// Values in the stretch.
    len: usize,
}

/// Pixels that share their valid taps.
#[derive(Debug)]
pub(super) struct Group {
    runs: Vec<Run>,
    pixels: Vec<Pixel>,
}

/// Which pass a plan serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Pass {
    /// Forward and weight gradient (output pixels of `y`, input `x`).
    Forward,
    /// Data gradient (output pixels of `dx`, input `dy`).
    Data,
}

/// The pixel groups of one shape and pass.
#[derive(Debug)]
pub(super) struct Plan {
    groups: Vec<Group>,
    /// Taps used by at least one pixel (only those are packed).
    used_taps: Vec<bool>,
    pixels: usize,
}

/// Plans by shape, shared by every clone of a backend.
#[derive(Debug, Default)]
pub(super) struct PlanCache {
    plans: std::sync::Mutex<HashMap<(ConvShape, Pass), Arc<Plan>>>,
}

impl PlanCache {
    /// The plan for `s` and `pass`, built on first use.
    pub(super) fn get(&self, s: &ConvShape, pass: Pass) -> Arc<Plan> {
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = plans.get(&(*s, pass)) {
            return Arc::clone(p);
        }
        // Bounded: a run sees a handful of shapes per batch size.
        if plans.len() >= 512 {
            plans.clear();
        }
        let plan = Arc::new(match pass {
            Pass::Forward => forward_plan(s),
            Pass::Data => data_plan(s),
        });
        plans.insert((*s, pass), Arc::clone(&plan));
        plan
    }
}

/// Valid kernel offsets `[lo, hi)` along one axis for output coordinate `o`.
fn forward_range(
    o: usize,
    stride: usize,
    pad: usize,
    kernel: usize,
    size: usize,
) -> (usize, usize) {
    let start = o * stride;
    let lo = pad.saturating_sub(start).min(kernel);
    let hi = (size + pad).saturating_sub(start).min(kernel);
    (lo, hi.max(lo))
}

/// Groups pixels by a key, keeping first-seen order (deterministic).
struct Grouper<K> {
    index: HashMap<K, usize>,
    groups: Vec<Group>,
}

impl<K: std::hash::Hash + Eq> Grouper<K> {
    fn new() -> Self {
        Grouper {
            index: HashMap::new(),
            groups: Vec::new(),
        }
    }

    fn push(&mut self, key: K, pixel: Pixel, runs: impl FnOnce() -> Vec<Run>) {
        let g = *self.index.entry(key).or_insert_with(|| {
            self.groups.push(Group {
                runs: runs(),
                pixels: Vec::new(),
            });
            self.groups.len() - 1
        });
        self.groups[g].pixels.push(pixel);
    }
}

fn forward_plan(s: &ConvShape) -> Plan {
    let (k, st, p) = (s.kernel, s.stride, s.padding);
    let (h, w, ci) = (s.h, s.w, s.c_in);
    let (ho, wo) = (s.out_h(), s.out_w());
    let rows: Vec<(usize, usize)> = (0..ho).map(|o| forward_range(o, st, p, k, h)).collect();
    let cols: Vec<(usize, usize)> = (0..wo).map(|o| forward_range(o, st, p, k, w)).collect();
    let mut grouper = Grouper::new();
    for n in 0..s.n {
        for (oy, &(ky0, ky1)) in rows.iter().enumerate() {
            for (ox, &(kx0, kx1)) in cols.iter().enumerate() {
                let iy = (n * h + oy * st) as isize - p as isize;
                let ix = (ox * st) as isize - p as isize;
                let pixel = Pixel {
                    in_base: (iy * w as isize + ix) * ci as isize,
                    out: (n * ho + oy) * wo + ox,
                };
                grouper.push((ky0, ky1, kx0, kx1), pixel, || {
                    if kx0 == kx1 {
                        return Vec::new();
                    }
                    (ky0..ky1)
                        .map(|ky| Run {
                            delta: ((ky * w + kx0) * ci) as isize,
                            w_index: (ky * k + kx0) * ci,
                            len: (kx1 - kx0) * ci,
                        })
                        .collect()
                });
            }
        }
    }
    let mut used_taps = vec![false; k * k];
    for g in &grouper.groups {
        for r in &g.runs {
            let first = r.w_index / ci;
            used_taps[first..first + r.len / ci].fill(true);
        }
    }
    let plan = Plan {
        groups: grouper.groups,
        used_taps,
        pixels: s.n * ho * wo,
    };
    plan.check_bounds(s.x_len());
    plan
}

/// Valid `j` (kernel offset = residue + stride·j) along one axis of the data gradient for
/// input coordinate `i`: `(residue, q, jlo, jhi)` with input-of-dy coordinate `q − j`.
fn data_range(
    i: usize,
    stride: usize,
    pad: usize,
    kernel: usize,
    out: usize,
) -> (usize, usize, usize, usize) {
    let q = (i + pad) / stride;
    let residue = (i + pad) % stride;
    if residue >= kernel {
        return (residue, q, 0, 0);
    }
    let jmax = (kernel - 1 - residue) / stride; // largest j with residue + stride·j < kernel
    let lo = (q + 1).saturating_sub(out); // q − j < out
    let hi = jmax.min(q) + 1; // q − j ≥ 0
    (residue, q, lo, hi.max(lo))
}

fn data_plan(s: &ConvShape) -> Plan {
    let (k, st, p) = (s.kernel, s.stride, s.padding);
    let (h, w, co) = (s.h, s.w, s.c_out);
    let (ho, wo) = (s.out_h(), s.out_w());
    let rows: Vec<_> = (0..h).map(|i| data_range(i, st, p, k, ho)).collect();
    let cols: Vec<_> = (0..w).map(|i| data_range(i, st, p, k, wo)).collect();
    let mut grouper = Grouper::new();
    for n in 0..s.n {
        for (iy, &(ry, qy, jy0, jy1)) in rows.iter().enumerate() {
            for (ix, &(rx, qx, jx0, jx1)) in cols.iter().enumerate() {
                let pixel = Pixel {
                    in_base: (((n * ho + qy) * wo + qx) * co) as isize,
                    out: (n * h + iy) * w + ix,
                };
                grouper.push((ry, jy0, jy1, rx, jx0, jx1), pixel, || {
                    let mut runs = Vec::new();
                    for jy in jy0..jy1 {
                        for jx in jx0..jx1 {
                            let (ky, kx) = (ry + st * jy, rx + st * jx);
                            runs.push(Run {
                                delta: -(((jy * wo + jx) * co) as isize),
                                w_index: ky * k + kx,
                                len: co,
                            });
                        }
                    }
                    runs
                });
            }
        }
    }
    let mut used_taps = vec![false; k * k];
    for g in &grouper.groups {
        for r in &g.runs {
            used_taps[r.w_index] = true;
        }
    }
    let plan = Plan {
        groups: grouper.groups,
        used_taps,
        pixels: s.n * h * w,
    };
    plan.check_bounds(s.y_len());
    plan
}

impl Plan {
    /// Every run of every pixel lies inside the input (`len` values): the kernels' pointer
    /// arithmetic relies on it.
    ///
    /// # Panics
    /// If a plan builder is wrong (a programmer error).
    fn check_bounds(&self, len: usize) {
        for g in &self.groups {
            for px in &g.pixels {
                for r in &g.runs {
                    let start = px.in_base + r.delta;
                    assert!(
                        start >= 0 && start as usize + r.len <= len,
                        "direct convolution plan reads outside its input"
                    );
                }
            }
        }
    }

    /// `(group, first pixel, pixels)` tiles of at most `r` pixels.
    fn tiles(&self, r: usize) -> Vec<(u32, u32, u32)> {
        let mut tiles = Vec::with_capacity(self.pixels / r + self.groups.len());
        for (g, group) in self.groups.iter().enumerate() {
            let mut start = 0;
            while start < group.pixels.len() {
                let len = r.min(group.pixels.len() - start);
                tiles.push((g as u32, start as u32, len as u32));
                start += len;
            }
        }
        tiles
    }
}

/// A raw output pointer shared by tasks that write disjoint parts of one tensor.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: every use writes a region no other task touches (documented at each use).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The pointer (a method, so closures capture the whole `Send` wrapper).
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Vectors per channel block for `channels` output channels at `lanes` lanes.
fn vectors_for(channels: usize, lanes: usize) -> usize {
    if channels > lanes {
        2
    } else {
        1
    }
}

/// Register-tile height for `nv` vectors at `lanes` lanes (accumulators + weights +
/// broadcast within the register file: 16 ymm for AVX2, 32 zmm for AVX-512).
fn rows_for(lanes: usize, nv: usize) -> usize {
    match (lanes >= 16, nv) {
        (true, _) => 12,
        (false, 1) => 12,
        (false, _) => 6,
    }
}

/// A kernel over register tiles of `R` rows × `NV` vectors of output channels.
trait RegisterTiled {
    /// Vectors per channel block ([`vectors_for`]).
    fn nv(&self) -> usize;
    /// The kernel at one tile shape.
    fn go<S: Simd, const R: usize, const NV: usize>(&self);
}

/// Runs `task` at the tile shape [`rows_for`] gives for its vector count (the const generics
/// spelled out once, for every kernel that tiles).
#[inline(always)]
fn run_tiled<S: Simd, T: RegisterTiled>(task: &T) {
    match (S::LANES >= 16, task.nv()) {
        (_, 1) => task.go::<S, 12, 1>(),
        (true, _) => task.go::<S, 12, 2>(),
        (false, _) => task.go::<S, 6, 2>(),
    }
}

/// The forward / data-gradient micro-kernel: `R` pixels × `NV` vectors of output channels,
/// summed over every run of a group.
///
/// # Safety
/// For every run and pixel `r`, `x + bases[r] + run.delta` points at `run.len` readable
/// values; `w + run.w_index·w_scale + c·ks` at `NV·LANES` readable values for `c < run.len`;
/// each `outs[r]` at `NV·LANES` writable values (read first when `accumulate`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn tile_kernel<S: Simd, const R: usize, const NV: usize>(
    runs: &[Run],
    x: *const f32,
    bases: &[isize; R],
    w: *const f32,
    w_scale: usize,
    ks: usize,
    outs: &[*mut f32; R],
    accumulate: bool,
) {
    let mut acc = [[S::zero(); NV]; R];
    if accumulate {
        for r in 0..R {
            for (j, a) in acc[r].iter_mut().enumerate() {
                *a = S::load(outs[r].add(j * S::LANES));
            }
        }
    }
    for run in runs {
        let wp = w.add(run.w_index * w_scale);
        let xp: [*const f32; R] = std::array::from_fn(|r| x.offset(bases[r] + run.delta));
        for c in 0..run.len {
            let wc = wp.add(c * ks);
            let wv: [S::V; NV] = std::array::from_fn(|j| S::load(wc.add(j * S::LANES)));
            for r in 0..R {
                let b = S::splat(*xp[r].add(c));
                for j in 0..NV {
                    acc[r][j] = S::mul_add(b, wv[j], acc[r][j]);
                }
            }
        }
    }
    for r in 0..R {
        for (j, a) in acc[r].iter().enumerate() {
            S::store(outs[r].add(j * S::LANES), *a);
        }
    }
}

/// One task of a forward or data-gradient convolution: some tiles × some channel blocks.
struct TileTask<'a> {
    plan: &'a Plan,
    tiles: &'a [(u32, u32, u32)],
    blocks: std::ops::Range<usize>,
    nv: usize,
    x: &'a [f32],
    /// Weights; block `b` starts at `b · block_stride`.
    w: &'a [f32],
    block_stride: usize,
    w_scale: usize,
    ks: usize,
    out: SharedOut,
    out_channels: usize,
    accumulate: bool,
}

impl RegisterTiled for TileTask<'_> {
    fn nv(&self) -> usize {
        self.nv
    }

    #[inline(always)]
    fn go<S: Simd, const R: usize, const NV: usize>(&self) {
        let cb = S::LANES * NV;
        let oc = self.out_channels;
        for b in self.blocks.clone() {
            let width = cb.min(oc - b * cb);
            // SAFETY: the weights hold every block (packed or padded to whole blocks), and
            // the plan's offsets were checked against the input length when it was built.
            let wb = unsafe { self.w.as_ptr().add(b * self.block_stride) };
            for &(g, start, len) in self.tiles {
                let group = &self.plan.groups[g as usize];
                let px = &group.pixels[start as usize..(start + len) as usize];
                let last = px.len() - 1;
                let bases: [isize; R] = std::array::from_fn(|r| px[r.min(last)].in_base);
                if px.len() == R && width == cb {
                    // SAFETY: tasks own disjoint (pixel, block) regions of the output; each
                    // pointer addresses `cb` values of one output pixel.
                    let outs: [*mut f32; R] = std::array::from_fn(|r| unsafe {
                        self.out.get().add(px[r].out * oc + b * cb)
                    });
                    unsafe {
                        tile_kernel::<S, R, NV>(
                            &group.runs,
                            self.x.as_ptr(),
                            &bases,
                            wb,
                            self.w_scale,
                            self.ks,
                            &outs,
                            self.accumulate,
                        )
                    };
                } else {
                    // A short tile or a partial channel block: through a stack buffer.
                    let mut tmp = [[0.0f32; MAX_CB]; R];
                    for (r, p) in px.iter().enumerate() {
                        if self.accumulate {
                            // SAFETY: as above, `width` values of this task's region.
                            let src = unsafe {
                                std::slice::from_raw_parts(
                                    self.out.get().add(p.out * oc + b * cb),
                                    width,
                                )
                            };
                            tmp[r][..width].copy_from_slice(src);
                        }
                    }
                    let outs: [*mut f32; R] = std::array::from_fn(|r| tmp[r].as_mut_ptr());
                    // SAFETY: the stack rows hold MAX_CB ≥ cb values.
                    unsafe {
                        tile_kernel::<S, R, NV>(
                            &group.runs,
                            self.x.as_ptr(),
                            &bases,
                            wb,
                            self.w_scale,
                            self.ks,
                            &outs,
                            self.accumulate,
                        )
                    };
                    for (r, p) in px.iter().enumerate() {
                        // SAFETY: as above.
                        let dst = unsafe {
                            std::slice::from_raw_parts_mut(
                                self.out.get().add(p.out * oc + b * cb),
                                width,
                            )
                        };
                        dst.copy_from_slice(&tmp[r][..width]);
                    }
                }
            }
        }
    }
}

impl SimdTask for TileTask<'_> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self) {
        run_tiled::<S, _>(&self);
    }
}

/// Splits `tiles × blocks` into tasks for `threads` threads and runs them. Each task owns its
/// (pixel, block) outputs, so the partition does not change any result.
#[allow(clippy::too_many_arguments)]
fn run_tiles(
    level: SimdLevel,
    threads: usize,
    plan: &Plan,
    nv: usize,
    x: &[f32],
    w: &[f32],
    block_stride: usize,
    w_scale: usize,
    ks: usize,
    out: &mut [f32],
    out_channels: usize,
    accumulate: bool,
) {
    let lanes = level.lanes();
    let cb = lanes * nv;
    let r = rows_for(lanes, nv);
    let tiles = plan.tiles(r);
    let blocks = out_channels.div_ceil(cb);
    assert!(
        out.len() >= plan.pixels * out_channels,
        "direct convolution: output too small"
    );
    const TILES_PER_TASK: usize = 16;
    let tile_chunks = tiles.len().div_ceil(TILES_PER_TASK).max(1);
    let block_chunks = (4 * threads).div_ceil(tile_chunks).clamp(1, blocks.max(1));
    let per_block_chunk = blocks.div_ceil(block_chunks);
    let out = SharedOut(out.as_mut_ptr());
    (0..tile_chunks * block_chunks)
        .into_par_iter()
        .for_each(|task| {
            let (tc, bc) = (task / block_chunks, task % block_chunks);
            let t0 = tc * TILES_PER_TASK;
            let t1 = (t0 + TILES_PER_TASK).min(tiles.len());
            let b0 = (bc * per_block_chunk).min(blocks);
            let b1 = (b0 + per_block_chunk).min(blocks);
            if t0 >= t1 || b0 >= b1 {
                return;
            }
            dispatch(
                level,
                TileTask {
                    plan,
                    tiles: &tiles[t0..t1],
                    blocks: b0..b1,
                    nv,
                    x,
                    w,
                    block_stride,
                    w_scale,
                    ks,
                    out,
                    out_channels,
                    accumulate,
                },
            );
        });
}

/// Copies `src` into the front of `dst` and zeroes the rest. Whole channel blocks are
/// fixed-size copies the compiler turns into vector moves (a copy of a run-time length is a
/// `memmove` call, per 64-byte row here).
#[inline(always)]
fn copy_padded(dst: &mut [f32], src: &[f32]) {
    fn fixed<const N: usize>(dst: &mut [f32], src: &[f32]) {
        if let (Ok(d), Ok(s)) = (<&mut [f32; N]>::try_from(dst), <&[f32; N]>::try_from(src)) {
            *d = *s;
        }
    }
    match (dst.len(), src.len()) {
        (8, 8) => fixed::<8>(dst, src),
        (16, 16) => fixed::<16>(dst, src),
        (32, 32) => fixed::<32>(dst, src),
        _ => {
            dst[..src.len()].copy_from_slice(src);
            dst[src.len()..].fill(0.0);
        }
    }
}

/// Grows `buf` to `len` values and returns them (contents unspecified).
fn grow(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    &mut buf[..len]
}

/// `y = conv(x, w)`, overwriting `y`.
#[allow(clippy::too_many_arguments)]
pub(super) fn forward(
    level: SimdLevel,
    threads: usize,
    plans: &PlanCache,
    s: &ConvShape,
    x: &[f32],
    w: &[f32],
    y: &mut [f32],
    packed: &mut Vec<f32>,
) {
    let plan = plans.get(s, Pass::Forward);
    let (co, ci, taps) = (s.c_out, s.c_in, s.kernel * s.kernel);
    let nv = vectors_for(co, level.lanes());
    let cb = level.lanes() * nv;
    let blocks = co.div_ceil(cb);
    let block_stride = taps * ci * cb;
    let packed = grow(packed, blocks * block_stride);
    // [block][tap][ci][cb] from [co][tap][ci], only the taps some pixel uses.
    packed
        .par_chunks_mut(block_stride)
        .enumerate()
        .for_each(|(b, dst)| {
            for (t, _) in plan.used_taps.iter().enumerate().filter(|(_, u)| **u) {
                let dt = &mut dst[t * ci * cb..(t + 1) * ci * cb];
                for j in 0..cb {
                    let o = b * cb + j;
                    if o < co {
                        let src = &w[(o * taps + t) * ci..(o * taps + t + 1) * ci];
                        for (c, &v) in src.iter().enumerate() {
                            dt[c * cb + j] = v;
                        }
                    } else {
                        for c in 0..ci {
                            dt[c * cb + j] = 0.0;
                        }
                    }
                }
            }
        });
    run_tiles(
        level,
        threads,
        &plan,
        nv,
        x,
        packed,
        block_stride,
        cb,
        cb,
        y,
        co,
        false,
    );
}

/// `dx (+)= conv_transpose(dy, w)`.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward_data(
    level: SimdLevel,
    threads: usize,
    plans: &PlanCache,
    s: &ConvShape,
    dy: &[f32],
    w: &[f32],
    dx: &mut [f32],
    accumulate: bool,
    packed: &mut Vec<f32>,
) {
    let plan = plans.get(s, Pass::Data);
    let (co, ci, taps) = (s.c_out, s.c_in, s.kernel * s.kernel);
    let nv = vectors_for(ci, level.lanes());
    let cb = level.lanes() * nv;
    let blocks = ci.div_ceil(cb);
    let block_stride = taps * co * cb;
    // [ci block][tap][co][cb] from OHWI [co][tap][ci]: read in place, consecutive output
    // channels sit `taps·ci` floats apart, a power-of-two-ish stride that maps a whole run
    // onto a few L1 sets; packed, each block's weights stream contiguously.
    let packed = grow(packed, blocks * block_stride);
    packed
        .par_chunks_mut(block_stride)
        .enumerate()
        .for_each(|(b, dst)| {
            let (c0, width) = (b * cb, cb.min(ci - b * cb));
            for (t, _) in plan.used_taps.iter().enumerate().filter(|(_, u)| **u) {
                let dt = &mut dst[t * co * cb..(t + 1) * co * cb];
                for (o, d) in dt.chunks_exact_mut(cb).enumerate() {
                    let src = (o * taps + t) * ci + c0;
                    copy_padded(d, &w[src..src + width]);
                }
            }
        });
    run_tiles(
        level,
        threads,
        &plan,
        nv,
        dy,
        packed,
        block_stride,
        co * cb,
        cb,
        dx,
        ci,
        accumulate,
    );
}

/// The weight-gradient micro-kernel: `R` reduction rows × `NV` vectors of output channels,
/// summed over `pixels` and added into the first `rows` rows of `out` (`[row][CB]`).
///
/// # Safety
/// `x + pixel.in_base + delta + min(r, rows − 1)` is readable for every pixel and `r < R`;
/// `dyp` holds `pixels.len()` rows of `NV·LANES` values; `out` holds `rows` rows of `NV·LANES`
/// values, `cb` apart.
#[inline(always)]
unsafe fn wgrad_kernel<S: Simd, const R: usize, const NV: usize>(
    pixels: &[Pixel],
    x: *const f32,
    delta: isize,
    rows: usize,
    dyp: *const f32,
    out: *mut f32,
) {
    let cb = S::LANES * NV;
    let offs: [isize; R] = std::array::from_fn(|r| delta + r.min(rows - 1) as isize);
    let mut acc = [[S::zero(); NV]; R];
    for (i, p) in pixels.iter().enumerate() {
        let xb = x.offset(p.in_base);
        let dp = dyp.add(i * cb);
        let dv: [S::V; NV] = std::array::from_fn(|j| S::load(dp.add(j * S::LANES)));
        for r in 0..R {
            let b = S::splat(*xb.offset(offs[r]));
            for j in 0..NV {
                acc[r][j] = S::mul_add(b, dv[j], acc[r][j]);
            }
        }
    }
    for (r, a) in acc.iter().enumerate().take(rows) {
        for (j, v) in a.iter().enumerate() {
            let o = out.add(r * cb + j * S::LANES);
            S::store(o, S::add(S::load(o), *v));
        }
    }
}

/// One weight-gradient task: one part of the pixels × some output-channel blocks, summed into
/// the part's buffer laid out `[block][tap·ci][CB]` (so a tile is added with vector stores).
struct WgradTask<'a> {
    plan: &'a Plan,
    /// `(group, first pixel, pixels)` segments of this part, in order.
    segments: &'a [(usize, usize, usize)],
    blocks: std::ops::Range<usize>,
    nv: usize,
    x: &'a [f32],
    dy: &'a [f32],
    s: ConvShape,
    dst: SharedOut,
}

impl RegisterTiled for WgradTask<'_> {
    fn nv(&self) -> usize {
        self.nv
    }

    #[inline(always)]
    fn go<S: Simd, const R: usize, const NV: usize>(&self) {
        let cb = S::LANES * NV;
        let co = self.s.c_out;
        let k_len = self.s.kernel * self.s.kernel * self.s.c_in;
        // SAFETY (all blocks below): this task alone writes blocks `self.blocks` of its part's
        // buffer, `k_len · cb` values per block.
        for b in self.blocks.clone() {
            let out = unsafe {
                std::slice::from_raw_parts_mut(self.dst.get().add(b * k_len * cb), k_len * cb)
            };
            out.fill(0.0);
        }
        // The chunk's dy rows of one block, contiguous and aligned to the vector width: they
        // stay in L1 while the tile sweeps the whole reduction.
        let mut dyp_buf = vec![0.0f32; WGRAD_CHUNK * cb + 16];
        let align = dyp_buf.as_ptr().align_offset(64).min(16);
        let dyp = &mut dyp_buf[align..align + WGRAD_CHUNK * cb];
        for &(g, start, len) in self.segments {
            let group = &self.plan.groups[g];
            let mut c0 = start;
            while c0 < start + len {
                let c1 = (c0 + WGRAD_CHUNK).min(start + len);
                let pixels = &group.pixels[c0..c1];
                for b in self.blocks.clone() {
                    let width = cb.min(co - b * cb);
                    for (row, p) in dyp.chunks_exact_mut(cb).zip(pixels) {
                        let src = p.out * co + b * cb;
                        copy_padded(row, &self.dy[src..src + width]);
                    }
                    for run in &group.runs {
                        let mut s0 = 0;
                        while s0 < run.len {
                            let rows = R.min(run.len - s0);
                            let k = run.w_index + s0;
                            // SAFETY: the plan keeps every run inside x; `k + rows ≤ k_len`
                            // rows of this block's buffer.
                            unsafe {
                                wgrad_kernel::<S, R, NV>(
                                    pixels,
                                    self.x.as_ptr(),
                                    run.delta + s0 as isize,
                                    rows,
                                    dyp.as_ptr(),
                                    self.dst.get().add((b * k_len + k) * cb),
                                )
                            };
                            s0 += rows;
                        }
                    }
                }
                c0 = c1;
            }
        }
    }
}

impl SimdTask for WgradTask<'_> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self) {
        run_tiled::<S, _>(&self);
    }
}

/// `dw = Σ_pixels x ⊗ dy`, overwriting `dw`. `partials` holds the parts' sums.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward_weight(
    level: SimdLevel,
    threads: usize,
    plans: &PlanCache,
    s: &ConvShape,
    x: &[f32],
    dy: &[f32],
    dw: &mut [f32],
    partials: &mut Vec<f32>,
) {
    let plan = plans.get(s, Pass::Forward);
    let (co, taps, ci) = (s.c_out, s.kernel * s.kernel, s.c_in);
    let k_len = taps * ci;
    let dw = &mut dw[..co * k_len];
    let nv = vectors_for(co, level.lanes());
    let cb = level.lanes() * nv;
    let blocks = co.div_ceil(cb);
    let pixels = plan.pixels;
    assert!(dy.len() >= pixels * co, "direct convolution: dy too small");
    // Parts: a fixed function of the shape, so the sum order never depends on the threads.
    let parts = (pixels / WGRAD_PART).clamp(1, WGRAD_MAX_PARTS);
    let mut part_segments: Vec<Vec<(usize, usize, usize)>> = vec![Vec::new(); parts];
    let mut flat = 0usize;
    for (g, group) in plan.groups.iter().enumerate() {
        let mut start = 0;
        while start < group.pixels.len() {
            let part = flat * parts / pixels.max(1);
            let part_end = ((part + 1) * pixels).div_ceil(parts);
            let len = (part_end - flat).min(group.pixels.len() - start);
            part_segments[part].push((g, start, len));
            start += len;
            flat += len;
        }
    }
    let part_len = blocks * k_len * cb;
    let sums = grow(partials, parts * part_len);
    let block_chunks = (4 * threads).div_ceil(parts).clamp(1, blocks);
    let per_chunk = blocks.div_ceil(block_chunks);
    let base = SharedOut(sums.as_mut_ptr());
    (0..parts * block_chunks).into_par_iter().for_each(|task| {
        let (part, bc) = (task / block_chunks, task % block_chunks);
        let b0 = (bc * per_chunk).min(blocks);
        let b1 = (b0 + per_chunk).min(blocks);
        if b0 >= b1 {
            return;
        }
        // SAFETY: part `part`'s buffer is `part_len` values at `part · part_len`; tasks of
        // one part write disjoint blocks.
        let dst = SharedOut(unsafe { base.get().add(part * part_len) });
        dispatch(
            level,
            WgradTask {
                plan: &plan,
                segments: &part_segments[part],
                blocks: b0..b1,
                nv,
                x,
                dy,
                s: *s,
                dst,
            },
        );
    });
    // The parts added in order (the same bits for any thread count) and turned from
    // `[block][k][CB]` into OHWI `[co][k]`.
    let sums = &*sums;
    dw.par_chunks_mut(cb * k_len)
        .enumerate()
        .for_each(|(b, out)| {
            let width = out.len() / k_len;
            for k in 0..k_len {
                let at = (b * k_len + k) * cb;
                for j in 0..width {
                    let mut v = sums[at + j];
                    for part in 1..parts {
                        v += sums[part * part_len + at + j];
                    }
                    out[j * k_len + k] = v;
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(n: usize, h: usize, w: usize, k: usize, st: usize, p: usize) -> ConvShape {
        ConvShape {
            n,
            h,
            w,
            c_in: 2,
            c_out: 3,
            kernel: k,
            stride: st,
            padding: p,
        }
    }

    #[test]
    fn plans_cover_each_output_once_and_skip_padded_taps() {
        for s in [
            shape(2, 7, 6, 3, 1, 1),
            shape(2, 9, 7, 3, 2, 1),
            shape(1, 11, 10, 7, 2, 3),
            shape(3, 1, 1, 3, 1, 1),
            shape(1, 8, 8, 3, 3, 2),
            shape(2, 5, 4, 2, 1, 0),
            shape(1, 6, 6, 1, 2, 0),
        ] {
            let (ho, wo) = (s.out_h(), s.out_w());
            // Forward: every output pixel once; a tap is in a run iff it lands inside x.
            let f = forward_plan(&s);
            let mut seen = vec![0; s.n * ho * wo];
            let mut macs = 0;
            for g in &f.groups {
                for px in &g.pixels {
                    seen[px.out] += 1;
                    macs += g.runs.iter().map(|r| r.len).sum::<usize>();
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "{s:?}");
            let mut want = 0;
            for oy in 0..ho {
                for ox in 0..wo {
                    for ky in 0..s.kernel {
                        for kx in 0..s.kernel {
                            let iy = (oy * s.stride + ky) as isize - s.padding as isize;
                            let ix = (ox * s.stride + kx) as isize - s.padding as isize;
                            if iy >= 0 && ix >= 0 && iy < s.h as isize && ix < s.w as isize {
                                want += s.c_in;
                            }
                        }
                    }
                }
            }
            assert_eq!(macs, want * s.n, "forward taps of {s:?}");
            // Data gradient: every input pixel once, and the same multiply count transposed.
            let d = data_plan(&s);
            let mut seen = vec![0; s.n * s.h * s.w];
            let mut macs = 0;
            for g in &d.groups {
                for px in &g.pixels {
                    seen[px.out] += 1;
                    macs += g.runs.len() * s.c_in;
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "{s:?}");
            assert_eq!(macs, want * s.n, "data-gradient taps of {s:?}");
        }
    }

    #[test]
    fn a_one_pixel_map_uses_only_the_centre_tap() {
        let s = ConvShape {
            n: 4,
            h: 1,
            w: 1,
            c_in: 8,
            c_out: 8,
            kernel: 3,
            stride: 1,
            padding: 1,
        };
        let f = forward_plan(&s);
        assert_eq!(f.groups.len(), 1);
        assert_eq!(f.groups[0].runs.len(), 1);
        assert_eq!(f.used_taps.iter().filter(|u| **u).count(), 1);
        assert!(f.used_taps[4]);
    }
}
