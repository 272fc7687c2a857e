//! Batch norm fused with the residual add and ReLU, forward and backward, over `rows × C`:
//! vectorised ([`Simd`]) and branch-free.
//!
//! # Algorithm
//!
//! - Forward, training: one pass gathers per-channel `Σ(x − s)` and `Σ(x − s)²` around a
//!   shift `s` (the first row; shifting keeps `E[d²] − E[d]²` from cancelling when the mean
//!   is large against the spread), a second writes `y = act((x − mean)·scale + β (+ residual))`
//!   with the per-channel `scale = γ·invstd`: the mean subtracted first, so that a channel
//!   of one value per batch (its own mean) gives exactly β, as the GPU's kernel does, not the
//!   rounding residue of `x·scale` (large: invstd is 1/√eps there). ReLU is a `max`.
//! - Backward: one pass computes `dz` (the incoming gradient masked by the ReLU with a
//!   select on `y`), writes the residual's gradient, and gathers `Σdz` and `Σdz·(x − mean)`; a
//!   second writes `dx = k·(dz − (mdb + (x − mean)·c2))` with per-channel constants
//!   (`k = γ·invstd`, `mdb = mean(dz)`, `c2 = invstd·mean(dz·x̂)`, see [`input_gradient`]).
//!   With fixed statistics (frozen, eval) the first pass writes `dx = k·dz` itself.
//!
//! Reductions run in f32 lanes within a fixed block of rows and are combined across blocks in
//! f64 in block order, so the result does not depend on the thread count. Inner loops index by
//! pointer over whole rows (channels contiguous), a scalar tail for channels past the last full
//! vector; the residual/ReLU choices are constant parameters of the loop, not branches in it.
//!
//! # Layout
//!
//! `x`, `y`, `residual`, `dy`, `dx` are `rows × C` row-major (NHWC flattened); per-channel
//! vectors are `C` values.

use rayon::prelude::*;

use super::simd::{dispatch, Simd, SimdLevel, SimdTask};
use crate::backend::{BnBackward, BnForward, BnMode};

/// Rows per reduction block (fixed, so sums do not depend on the thread count).
const BLOCK_ROWS: usize = 256;

/// Per-channel `(Σ(x − shift), Σ(x − shift)²)` of one block of rows.
struct Moments<'a> {
    x: &'a [f32],
    c: usize,
    shift: &'a [f32],
}

impl SimdTask for Moments<'_> {
    type Output = (Vec<f32>, Vec<f32>);
    #[inline(always)]
    fn run<S: Simd>(self) -> Self::Output {
        let c = self.c;
        let (mut s1, mut s2) = (vec![0.0f32; c], vec![0.0f32; c]);
        let full = c - c % S::LANES;
        for row in self.x.chunks_exact(c) {
            let mut ch = 0;
            while ch < full {
                // SAFETY: ch + LANES ≤ c for the row and the three per-channel vectors.
                unsafe {
                    let d = S::sub(
                        S::load(row.as_ptr().add(ch)),
                        S::load(self.shift.as_ptr().add(ch)),
                    );
                    let p1 = s1.as_mut_ptr().add(ch);
                    let p2 = s2.as_mut_ptr().add(ch);
                    S::store(p1, S::add(S::load(p1), d));
                    S::store(p2, S::mul_add(d, d, S::load(p2)));
                }
                ch += S::LANES;
            }
            for ch in full..c {
                let d = row[ch] - self.shift[ch];
                s1[ch] += d;
                s2[ch] += d * d;
            }
        }
        (s1, s2)
    }
}

/// `y = act((x − mean)·scale + β (+ residual))` over one block of rows.
struct Apply<'a> {
    x: &'a [f32],
    residual: Option<&'a [f32]>,
    y: &'a mut [f32],
    c: usize,
    mean: &'a [f32],
    scale: &'a [f32],
    beta: &'a [f32],
    relu: bool,
}

impl Apply<'_> {
    #[inline(always)]
    fn go<S: Simd, const RES: bool, const RELU: bool>(self) {
        let c = self.c;
        let full = c - c % S::LANES;
        let res = self.residual.unwrap_or(self.x);
        for ((yr, xr), rr) in self
            .y
            .chunks_exact_mut(c)
            .zip(self.x.chunks_exact(c))
            .zip(res.chunks_exact(c))
        {
            let mut ch = 0;
            while ch < full {
                // SAFETY: ch + LANES ≤ c for every row and per-channel vector.
                unsafe {
                    let d = S::sub(
                        S::load(xr.as_ptr().add(ch)),
                        S::load(self.mean.as_ptr().add(ch)),
                    );
                    let mut v = S::mul_add(
                        d,
                        S::load(self.scale.as_ptr().add(ch)),
                        S::load(self.beta.as_ptr().add(ch)),
                    );
                    if RES {
                        v = S::add(v, S::load(rr.as_ptr().add(ch)));
                    }
                    if RELU {
                        v = S::relu(v);
                    }
                    S::store(yr.as_mut_ptr().add(ch), v);
                }
                ch += S::LANES;
            }
            for ch in full..c {
                let mut v = (xr[ch] - self.mean[ch]) * self.scale[ch] + self.beta[ch];
                if RES {
                    v += rr[ch];
                }
                if RELU && v < 0.0 {
                    v = 0.0;
                }
                yr[ch] = v;
            }
        }
    }
}

impl SimdTask for Apply<'_> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self) {
        match (self.residual.is_some(), self.relu) {
            (false, false) => self.go::<S, false, false>(),
            (false, true) => self.go::<S, false, true>(),
            (true, false) => self.go::<S, true, false>(),
            (true, true) => self.go::<S, true, true>(),
        }
    }
}

pub(super) fn forward(level: SimdLevel, a: BnForward<'_, Vec<f32>>) {
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
            let shift = &x[..c];
            let partials: Vec<(Vec<f32>, Vec<f32>)> = x
                .par_chunks(BLOCK_ROWS * c)
                .map(|block| dispatch(level, Moments { x: block, c, shift }))
                .collect();
            let (mut s1, mut s2) = (vec![0.0f64; c], vec![0.0f64; c]);
            for (p1, p2) in &partials {
                for ch in 0..c {
                    s1[ch] += f64::from(p1[ch]);
                    s2[ch] += f64::from(p2[ch]);
                }
            }
            let n = rows as f64;
            let m = f64::from(a.momentum);
            for ch in 0..c {
                let d = s1[ch] / n;
                let var = (s2[ch] / n - d * d).max(0.0);
                let mean = f64::from(shift[ch]) + d;
                a.saved_mean[ch] = mean as f32;
                a.saved_invstd[ch] = (1.0 / (var + f64::from(a.eps)).sqrt()) as f32;
                let unbiased = if rows > 1 { var * n / (n - 1.0) } else { var };
                a.running_mean[ch] = ((1.0 - m) * f64::from(a.running_mean[ch]) + m * mean) as f32;
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
        let norm = Normalise {
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
        normalise(level, &norm, y);
    }
}

/// The normalisation of `rows × c` values `x` with given statistics:
/// `y = act((x − mean)·γ·invstd + β (+ residual))` ([`normalise`]).
pub(super) struct Normalise<'a> {
    /// Rows.
    pub rows: usize,
    /// Channels.
    pub c: usize,
    /// The batch norm's input.
    pub x: &'a [f32],
    /// Added before the ReLU.
    pub residual: Option<&'a [f32]>,
    /// γ.
    pub gamma: &'a [f32],
    /// β.
    pub beta: &'a [f32],
    /// The mean normalised with.
    pub mean: &'a [f32],
    /// The inverse standard deviation normalised with.
    pub invstd: &'a [f32],
    /// Whether a ReLU follows.
    pub relu: bool,
}

/// Writes the batch norm's output `n` describes into `y`: the forward's own pass, so that a
/// reader applying the batch norm itself (the fused max pool) sees the same bits.
pub(super) fn normalise(level: SimdLevel, n: &Normalise<'_>, y: &mut [f32]) {
    let (rows, c) = (n.rows, n.c);
    let scale: Vec<f32> = (0..c).map(|ch| n.gamma[ch] * n.invstd[ch]).collect();
    let (x, mean, beta, relu) = (&n.x[..rows * c], n.mean, n.beta, n.relu);
    let residual = n.residual.map(|r| &r[..rows * c]);
    y[..rows * c]
        .par_chunks_mut(BLOCK_ROWS * c)
        .enumerate()
        .for_each(|(b, y)| {
            let off = b * BLOCK_ROWS * c;
            let x = &x[off..off + y.len()];
            let residual = residual.map(|r| &r[off..off + y.len()]);
            dispatch(
                level,
                Apply {
                    x,
                    residual,
                    y,
                    c,
                    mean,
                    scale: &scale,
                    beta,
                    relu,
                },
            );
        });
}

/// Backward pass 1 over one block of rows: `dz` (ReLU-masked `dy`), the residual's gradient,
/// per-channel `Σdz` and `Σdz·(x − mean)`; with fixed statistics also `dx = k·dz`.
struct Reduce<'a> {
    x: &'a [f32],
    y: &'a [f32],
    dy: &'a [f32],
    c: usize,
    mean: &'a [f32],
    relu: bool,
    /// The residual's gradient and whether to add into it.
    dres: Option<(&'a mut [f32], bool)>,
    /// Fixed statistics: `dx = k·dz` written here.
    dx: Option<(&'a mut [f32], &'a [f32])>,
}

impl Reduce<'_> {
    #[inline(always)]
    fn go<S: Simd, const RELU: bool, const RES: bool, const ACC: bool, const DX: bool>(
        self,
    ) -> (Vec<f32>, Vec<f32>) {
        let c = self.c;
        let full = c - c % S::LANES;
        let (mut sb, mut sg) = (vec![0.0f32; c], vec![0.0f32; c]);
        let rows = self.x.len() / c;
        let (dres, _) = match self.dres {
            Some((d, acc)) => (Some(d), acc),
            None => (None, false),
        };
        let (dx, k) = match self.dx {
            Some((d, k)) => (Some(d), k),
            None => (None, &[][..]),
        };
        let dres_ptr = dres.map_or(std::ptr::null_mut(), |d| d.as_mut_ptr());
        let dx_ptr = dx.map_or(std::ptr::null_mut(), |d| d.as_mut_ptr());
        for r in 0..rows {
            let o = r * c;
            let mut ch = 0;
            while ch < full {
                // SAFETY: o + ch + LANES ≤ rows·c for every row tensor (the optional ones
                // have the block's length when present, checked by the caller); ch + LANES
                // ≤ c for the per-channel vectors.
                unsafe {
                    let i = o + ch;
                    let g = S::load(self.dy.as_ptr().add(i));
                    let dz = if RELU {
                        S::pass_where_positive(S::load(self.y.as_ptr().add(i)), g)
                    } else {
                        g
                    };
                    if RES {
                        let p = dres_ptr.add(i);
                        S::store(p, if ACC { S::add(S::load(p), dz) } else { dz });
                    }
                    if DX {
                        S::store(dx_ptr.add(i), S::mul(S::load(k.as_ptr().add(ch)), dz));
                    }
                    let d = S::sub(
                        S::load(self.x.as_ptr().add(i)),
                        S::load(self.mean.as_ptr().add(ch)),
                    );
                    let pb = sb.as_mut_ptr().add(ch);
                    let pg = sg.as_mut_ptr().add(ch);
                    S::store(pb, S::add(S::load(pb), dz));
                    S::store(pg, S::mul_add(dz, d, S::load(pg)));
                }
                ch += S::LANES;
            }
            for ch in full..c {
                let i = o + ch;
                let dz = if RELU && self.y[i] <= 0.0 {
                    0.0
                } else {
                    self.dy[i]
                };
                if RES {
                    // SAFETY: as above.
                    unsafe {
                        let p = dres_ptr.add(i);
                        *p = if ACC { *p + dz } else { dz };
                    }
                }
                if DX {
                    // SAFETY: as above.
                    unsafe { *dx_ptr.add(i) = k[ch] * dz };
                }
                sb[ch] += dz;
                sg[ch] += dz * (self.x[i] - self.mean[ch]);
            }
        }
        (sb, sg)
    }
}

impl SimdTask for Reduce<'_> {
    type Output = (Vec<f32>, Vec<f32>);
    #[inline(always)]
    fn run<S: Simd>(self) -> Self::Output {
        let acc = self.dres.as_ref().is_some_and(|d| d.1);
        match (self.relu, self.dres.is_some(), acc, self.dx.is_some()) {
            (false, false, _, false) => self.go::<S, false, false, false, false>(),
            (false, false, _, true) => self.go::<S, false, false, false, true>(),
            (false, true, false, false) => self.go::<S, false, true, false, false>(),
            (false, true, false, true) => self.go::<S, false, true, false, true>(),
            (false, true, true, false) => self.go::<S, false, true, true, false>(),
            (false, true, true, true) => self.go::<S, false, true, true, true>(),
            (true, false, _, false) => self.go::<S, true, false, false, false>(),
            (true, false, _, true) => self.go::<S, true, false, false, true>(),
            (true, true, false, false) => self.go::<S, true, true, false, false>(),
            (true, true, false, true) => self.go::<S, true, true, false, true>(),
            (true, true, true, false) => self.go::<S, true, true, true, false>(),
            (true, true, true, true) => self.go::<S, true, true, true, true>(),
        }
    }
}

/// Backward pass 2 with batch statistics: `dx = k·(dz − (mdb + (x − mean)·c2))` per channel
/// (see [`input_gradient`]).
struct InputGrad<'a> {
    x: &'a [f32],
    y: &'a [f32],
    dy: &'a [f32],
    dx: &'a mut [f32],
    c: usize,
    mean: &'a [f32],
    k: &'a [f32],
    mdb: &'a [f32],
    c2: &'a [f32],
    relu: bool,
}

impl InputGrad<'_> {
    #[inline(always)]
    fn go<S: Simd, const RELU: bool>(self) {
        let c = self.c;
        let full = c - c % S::LANES;
        for (r, dxr) in self.dx.chunks_exact_mut(c).enumerate() {
            let o = r * c;
            let (xr, yr, dyr) = (&self.x[o..o + c], &self.y[o..o + c], &self.dy[o..o + c]);
            let mut ch = 0;
            while ch < full {
                // SAFETY: ch + LANES ≤ c for every row slice and per-channel vector.
                unsafe {
                    let g = S::load(dyr.as_ptr().add(ch));
                    let dz = if RELU {
                        S::pass_where_positive(S::load(yr.as_ptr().add(ch)), g)
                    } else {
                        g
                    };
                    let d = S::sub(
                        S::load(xr.as_ptr().add(ch)),
                        S::load(self.mean.as_ptr().add(ch)),
                    );
                    let centred = S::mul_add(
                        d,
                        S::load(self.c2.as_ptr().add(ch)),
                        S::load(self.mdb.as_ptr().add(ch)),
                    );
                    let v = S::mul(S::load(self.k.as_ptr().add(ch)), S::sub(dz, centred));
                    S::store(dxr.as_mut_ptr().add(ch), v);
                }
                ch += S::LANES;
            }
            for ch in full..c {
                let dz = if RELU && yr[ch] <= 0.0 { 0.0 } else { dyr[ch] };
                let centred = (xr[ch] - self.mean[ch]) * self.c2[ch] + self.mdb[ch];
                dxr[ch] = self.k[ch] * (dz - centred);
            }
        }
    }
}

impl SimdTask for InputGrad<'_> {
    type Output = ();
    #[inline(always)]
    fn run<S: Simd>(self) {
        if self.relu {
            self.go::<S, true>()
        } else {
            self.go::<S, false>()
        }
    }
}

/// Backward of [`forward`]. Pass 1 gives dβ = Σdz and dγ = Σdz·x̂ (and, with fixed
/// statistics, `dx = k·dz`); with batch statistics pass 2 is [`input_gradient`] from them.
pub(super) fn backward(level: SimdLevel, a: BnBackward<'_, Vec<f32>>) {
    let (rows, c) = (a.shape.rows, a.shape.channels);
    let n = rows * c;
    // No output (prepared, or no ReLU): the mask is not read; dy stands in.
    let (x, y, dy) = (&a.x[..n], &a.y.unwrap_or(a.dy)[..n], &a.dy[..n]);
    let (mean, invstd, gamma) = (a.saved_mean, a.saved_invstd, a.gamma);
    let k: Vec<f32> = (0..c).map(|ch| gamma[ch] * invstd[ch]).collect();
    let batch = a.batch_stats;
    let block = BLOCK_ROWS * c;
    let blocks = rows.div_ceil(BLOCK_ROWS);
    let (dres, acc) = match a.dresidual {
        Some((d, acc)) => (Some(d), acc),
        None => (None, false),
    };
    let dres_blocks: Vec<Option<&mut [f32]>> = match dres {
        Some(d) => d[..n].chunks_mut(block).map(Some).collect(),
        None => (0..blocks).map(|_| None).collect(),
    };
    let dx_all = &mut a.dx[..n];
    // Fixed statistics: pass 1 writes dx too.
    let dx_blocks: Vec<Option<&mut [f32]>> = if batch {
        (0..blocks).map(|_| None).collect()
    } else {
        dx_all.chunks_mut(block).map(Some).collect()
    };
    // Prepared: dy is the masked gradient already, and dgamma, dbeta its reductions.
    let relu = a.relu && !a.prepared;
    let partials: Vec<(Vec<f32>, Vec<f32>)> = dres_blocks
        .into_par_iter()
        .zip(dx_blocks)
        .enumerate()
        .map(|(b, (dres, dx))| {
            let off = b * block;
            let end = (off + block).min(n);
            dispatch(
                level,
                Reduce {
                    x: &x[off..end],
                    y: &y[off..end],
                    dy: &dy[off..end],
                    c,
                    mean,
                    relu,
                    dres: dres.map(|d| (d, acc)),
                    dx: dx.map(|d| (d, &k[..])),
                },
            )
        })
        .collect();
    // Prepared: dgamma and dbeta hold the reductions already, as input_gradient reads them.
    if !a.prepared {
        let (mut sb, mut sg) = (vec![0.0f64; c], vec![0.0f64; c]);
        for (pb, pg) in &partials {
            for ch in 0..c {
                sb[ch] += f64::from(pb[ch]);
                sg[ch] += f64::from(pg[ch]);
            }
        }
        for ch in 0..c {
            a.dbeta[ch] = sb[ch] as f32;
            a.dgamma[ch] = (sg[ch] * f64::from(invstd[ch])) as f32;
        }
    }
    if !batch {
        return;
    }
    input_gradient(
        level,
        InputGradient {
            rows,
            channels: c,
            x,
            y,
            dy,
            mean,
            invstd,
            gamma,
            relu,
            dgamma: a.dgamma,
            dbeta: a.dbeta,
        },
        &mut a.dx[..n],
    );
}

/// What [`input_gradient`] reads: a batch norm's forward (`rows × channels`) and the two
/// reductions of its backward.
pub(super) struct InputGradient<'a> {
    pub rows: usize,
    pub channels: usize,
    pub x: &'a [f32],
    pub y: &'a [f32],
    pub dy: &'a [f32],
    pub mean: &'a [f32],
    pub invstd: &'a [f32],
    pub gamma: &'a [f32],
    pub relu: bool,
    /// Σdz·x̂ per channel.
    pub dgamma: &'a [f32],
    /// Σdz per channel.
    pub dbeta: &'a [f32],
}

/// The input gradient of batch norm with batch statistics,
/// `dx = k·(dz − Σdz/N − x̂·Σdz·x̂/N)`, `k = γ·invstd`, `x̂ = (x − mean)·invstd`, from dβ = Σdz
/// and dγ = Σdz·x̂ ([`crate::backend::bn_sync::input_gradient_constants`]). The mean terms are
/// subtracted from dz before the product with k, as the GPU's kernel does: a channel whose dz
/// is all its mean (one row) gets exactly 0, not the rounding residue of two products of k.
/// Synchronised batch norm runs it with the global reductions in place of the local ones.
pub(super) fn input_gradient(level: SimdLevel, a: InputGradient<'_>, dx: &mut [f32]) {
    let (rows, c) = (a.rows, a.channels);
    let n = rows * c;
    let (k, mdb, c2) = crate::backend::bn_sync::input_gradient_constants(
        rows, a.gamma, a.invstd, a.dgamma, a.dbeta,
    );
    let block = BLOCK_ROWS * c;
    let (x, y, dy) = (&a.x[..n], &a.y[..n], &a.dy[..n]);
    let (mean, relu) = (a.mean, a.relu);
    dx[..n]
        .par_chunks_mut(block)
        .enumerate()
        .for_each(|(bi, dx)| {
            let off = bi * block;
            let end = off + dx.len();
            dispatch(
                level,
                InputGrad {
                    x: &x[off..end],
                    y: &y[off..end],
                    dy: &dy[off..end],
                    dx,
                    c,
                    mean,
                    k: &k,
                    mdb: &mdb,
                    c2: &c2,
                    relu,
                },
            );
        });
}
