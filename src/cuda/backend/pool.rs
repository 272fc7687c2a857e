//! Max pooling and global average pooling (kernels/pool.cu).

use cudarc::driver::LaunchConfig;

use super::base::{check_len, elementwise_cfg, ensure, to_i32, CudaBackend};
use super::bn::reduction_launch;
use super::bn_fused::merge_sums;
use crate::backend::{AppliedBn, BackendError, PoolShape};
use crate::cuda::launchers::{
    BnBwdPartial, GapBwd, GapFwd, MaxpoolBnBwd, MaxpoolBnBwdVec, MaxpoolBnFwd, MaxpoolBwd,
    MaxpoolFwd,
};
use crate::cuda::tensor::CudaTensor;

fn pool_check(op: &'static str, s: &PoolShape) -> Result<(), BackendError> {
    if s.kernel == 0
        || s.stride == 0
        || s.h + 2 * s.padding < s.kernel
        || s.w + 2 * s.padding < s.kernel
        || s.padding >= s.kernel
    {
        return Err(BackendError::Shape {
            op,
            detail: format!("{s:?}: window larger than the padded input, or padding ≥ kernel"),
        });
    }
    Ok(())
}

/// The kernels' nine dimensions: n, h, w, c, out_h, out_w, kernel, stride, padding.
fn pool_dims(op: &'static str, s: &PoolShape) -> Result<[i32; 9], BackendError> {
    Ok([
        to_i32(op, "n", s.n)?,
        to_i32(op, "h", s.h)?,
        to_i32(op, "w", s.w)?,
        to_i32(op, "c", s.c)?,
        to_i32(op, "out_h", s.out_h())?,
        to_i32(op, "out_w", s.out_w())?,
        to_i32(op, "kernel", s.kernel)?,
        to_i32(op, "stride", s.stride)?,
        to_i32(op, "padding", s.padding)?,
    ])
}

/// maxpool_bwd_vec: 256 threads, one block per tile of 7×7 outputs × 8 channel groups
/// (POOL_TP, POOL_TQ, POOL_GB in pool.cu), grid-stride beyond 65 535 tiles.
fn maxpool_bwd_vec_cfg(s: &PoolShape) -> LaunchConfig {
    let tiles = s.n * s.out_h().div_ceil(7) * s.out_w().div_ceil(7) * (s.c / 8).div_ceil(8);
    LaunchConfig {
        grid_dim: (tiles.clamp(1, 65_535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// See [`crate::backend::Backend::maxpool_forward`].
pub(super) fn max_forward(
    be: &CudaBackend,
    s: &PoolShape,
    x: &CudaTensor,
    y: &mut CudaTensor,
) -> Result<(), BackendError> {
    let op = "maxpool_forward";
    pool_check(op, s)?;
    let out = s.n * s.out_h() * s.out_w() * s.c;
    check_len(op, "x", x.len, s.n * s.h * s.w * s.c)?;
    check_len(op, "y", y.len, out)?;
    let [n, h, w, c, p, q, win, stride, pad] = pool_dims(op, s)?;
    let (x, y) = (x.bf16(op, "x")?, y.bf16_mut(op, "y")?);
    // 16-byte channel groups when C % 8 == 0: one thread per (output pixel, 8 channels).
    let vec = s.c % 8 == 0;
    let kernel = if vec {
        "maxpool_fwd_vec"
    } else {
        "maxpool_fwd"
    };
    let args = MaxpoolFwd {
        x: x.into(),
        y: y.into(),
        n,
        h,
        w,
        c,
        p,
        q,
        win,
        stride,
        pad,
    };
    be.launch(
        op,
        kernel,
        elementwise_cfg(if vec { out / 8 } else { out }),
        args,
    )?;
    be.note_work(2 * (s.n * s.h * s.w * s.c + out), 0.0);
    Ok(())
}

/// See [`crate::backend::Backend::maxpool_backward`].
pub(super) fn max_backward(
    be: &CudaBackend,
    s: &PoolShape,
    x: &CudaTensor,
    dy: &CudaTensor,
    dx: &mut CudaTensor,
    accumulate: bool,
) -> Result<(), BackendError> {
    let op = "maxpool_backward";
    pool_check(op, s)?;
    let input = s.n * s.h * s.w * s.c;
    check_len(op, "x", x.len, input)?;
    check_len(op, "dx", dx.len, input)?;
    check_len(op, "dy", dy.len, s.n * s.out_h() * s.out_w() * s.c)?;
    let [n, h, w, c, p, q, win, stride, pad] = pool_dims(op, s)?;
    let acc = i32::from(accumulate);
    let (x, dy, dx) = (x.bf16(op, "x")?, dy.bf16(op, "dy")?, dx.bf16_mut(op, "dx")?);
    // maxpool_bwd_vec where it applies; maxpool_bwd otherwise.
    let vec = backward_vec(s);
    let kernel = if vec {
        "maxpool_bwd_vec"
    } else {
        "maxpool_bwd"
    };
    let cfg = if vec {
        maxpool_bwd_vec_cfg(s)
    } else {
        elementwise_cfg(input)
    };
    let args = MaxpoolBwd {
        x: x.into(),
        dy: dy.into(),
        dx: dx.into(),
        n,
        h,
        w,
        c,
        p,
        q,
        win,
        stride,
        pad,
        accumulate: acc,
    };
    be.launch(op, kernel, cfg, args)?;
    be.note_work(
        2 * (input * (2 + usize::from(accumulate)) + s.n * s.out_h() * s.out_w() * s.c),
        0.0,
    );
    Ok(())
}

/// Whether maxpool_bwd_vec (and maxpool_bn_bwd_vec) takes `s`: C % 8 == 0, at most 2 windows
/// per dimension over an input cell, window positions in a byte (see pool.cu).
fn backward_vec(s: &PoolShape) -> bool {
    s.c % 8 == 0 && s.kernel <= 2 * s.stride && s.kernel <= 15
}

/// Checks a fused pool's batch norm (four vectors of `c` values).
fn check_bn(
    op: &'static str,
    s: &PoolShape,
    bn: &AppliedBn<'_, CudaTensor>,
) -> Result<(), BackendError> {
    for (name, len) in [
        ("gamma", bn.gamma.len),
        ("beta", bn.beta.len),
        ("saved_mean", bn.saved_mean.len),
        ("saved_invstd", bn.saved_invstd.len),
    ] {
        check_len(op, name, len, s.c)?;
    }
    Ok(())
}

/// See [`crate::backend::Backend::maxpool_bn_forward`]: maxpool_fwd(_vec)'s scan over the batch
/// norm's output of each element it reads (pool.cu, maxpool_bn_*).
pub(super) fn max_bn_forward(
    be: &CudaBackend,
    s: &PoolShape,
    z: &CudaTensor,
    bn: &AppliedBn<'_, CudaTensor>,
    y: &mut CudaTensor,
) -> Result<(), BackendError> {
    let op = "maxpool_bn_forward";
    pool_check(op, s)?;
    let out = s.n * s.out_h() * s.out_w() * s.c;
    check_len(op, "z", z.len, s.n * s.h * s.w * s.c)?;
    check_len(op, "y", y.len, out)?;
    check_bn(op, s, bn)?;
    let [n, h, w, c, p, q, win, stride, pad] = pool_dims(op, s)?;
    let vec = s.c % 8 == 0;
    let kernel = if vec {
        "maxpool_bn_fwd_vec"
    } else {
        "maxpool_bn_fwd"
    };
    let args = MaxpoolBnFwd {
        z: z.bf16(op, "z")?.into(),
        mean: bn.saved_mean.f32(op, "saved_mean")?.into(),
        invstd: bn.saved_invstd.f32(op, "saved_invstd")?.into(),
        gamma: bn.gamma.bf16(op, "gamma")?.into(),
        beta: bn.beta.bf16(op, "beta")?.into(),
        relu: i32::from(bn.relu),
        y: y.bf16_mut(op, "y")?.into(),
        n,
        h,
        w,
        c,
        p,
        q,
        win,
        stride,
        pad,
    };
    be.launch(
        op,
        kernel,
        elementwise_cfg(if vec { out / 8 } else { out }),
        args,
    )?;
    be.note_work(2 * (s.n * s.h * s.w * s.c + out), 0.0);
    Ok(())
}

/// See [`crate::backend::Backend::maxpool_bn_backward`]: maxpool_bwd(_vec)'s gather over the
/// transformed windows writes g masked (pool.cu, maxpool_bn_*) and, in its 16-byte form, the
/// batch norm's two reductions per tile; after the scalar form, bn_bwd_partial with the mask
/// off reduces them per slab (conv_backward_data_bn's slab path). bn_sums_merge sums the
/// records in a fixed order.
pub(super) fn max_bn_backward(
    be: &CudaBackend,
    s: &PoolShape,
    z: &CudaTensor,
    bn: &AppliedBn<'_, CudaTensor>,
    dy: &CudaTensor,
    g: &mut CudaTensor,
    sums: (&mut CudaTensor, &mut CudaTensor),
) -> Result<(), BackendError> {
    let op = "maxpool_bn_backward";
    pool_check(op, s)?;
    let (rows, ch) = (s.n * s.h * s.w, s.c);
    check_len(op, "z", z.len, rows * ch)?;
    check_len(op, "g", g.len, rows * ch)?;
    check_len(op, "dy", dy.len, s.n * s.out_h() * s.out_w() * ch)?;
    check_bn(op, s, bn)?;
    let (dgamma, dbeta) = sums;
    check_len(op, "dgamma", dgamma.len, ch)?;
    check_len(op, "dbeta", dbeta.len, ch)?;
    let [n, h, w, c, p, q, win, stride, pad] = pool_dims(op, s)?;
    let (zs, mean, invstd) = (
        z.bf16(op, "z")?,
        bn.saved_mean.f32(op, "saved_mean")?,
        bn.saved_invstd.f32(op, "saved_invstd")?,
    );
    let (gamma, beta) = (bn.gamma.bf16(op, "gamma")?, bn.beta.bf16(op, "beta")?);
    let (relu, dys) = (i32::from(bn.relu), dy.bf16(op, "dy")?);
    let gs = g.bf16_mut(op, "g")?;
    let mut work = be.work();
    let wk = &mut *work;
    let records = if backward_vec(s) {
        // The 16-byte gather reduces Σg, Σg·x̂ per tile itself (records of the tiles).
        let records = s.n * s.out_h().div_ceil(7) * s.out_w().div_ceil(7);
        ensure(&be.dev, &mut wk.f32a, 2 * records * ch, op)?;
        let part = wk.f32a.as_mut().expect("ensured");
        let (mut pb, mut pg) = part.split_at_mut(records * ch);
        let args = MaxpoolBnBwdVec {
            z: zs.into(),
            mean: mean.into(),
            invstd: invstd.into(),
            gamma: gamma.into(),
            beta: beta.into(),
            relu,
            dy: dys.into(),
            g: gs.into(),
            n,
            h,
            w,
            c,
            p,
            q,
            win,
            stride,
            pad,
            part_b: (&mut pb).into(),
            part_g: (&mut pg).into(),
        };
        be.launch(op, "maxpool_bn_bwd_vec", maxpool_bwd_vec_cfg(s), args)?;
        be.note_work(
            2 * (rows * ch * 2 + s.n * s.out_h() * s.out_w() * ch) + 8 * records * ch,
            0.0,
        );
        records
    } else {
        let args = MaxpoolBnBwd {
            z: zs.into(),
            mean: mean.into(),
            invstd: invstd.into(),
            gamma: gamma.into(),
            beta: beta.into(),
            relu,
            dy: dys.into(),
            g: (&mut *gs).into(),
            n,
            h,
            w,
            c,
            p,
            q,
            win,
            stride,
            pad,
        };
        be.launch(op, "maxpool_bn_bwd", elementwise_cfg(rows * ch), args)?;
        be.note_work(2 * (rows * ch * 2 + s.n * s.out_h() * s.out_w() * ch), 0.0);
        // Σg and Σg·x̂ per slab of rows (g is masked already).
        let (per, slabs) = be.slabs(rows);
        ensure(&be.dev, &mut wk.f32a, 2 * slabs * ch, op)?;
        let part = wk.f32a.as_mut().expect("ensured");
        let (mut pb, mut pg) = part.split_at_mut(slabs * ch);
        let (partial, cfg) = reduction_launch(ch, slabs, "bn_bwd_partial");
        let g = &*gs;
        let reduce = BnBwdPartial {
            dy: g.into(),
            y: g.into(),
            x: zs.into(),
            mean: mean.into(),
            invstd: invstd.into(),
            rows: to_i32(op, "rows", rows)?,
            channels: c,
            rows_per_slab: to_i32(op, "rows per slab", per)?,
            relu: 0,
            part_dbeta: (&mut pb).into(),
            part_dgamma: (&mut pg).into(),
        };
        be.launch(op, partial, cfg, reduce)?;
        be.note_work(2 * rows * ch * 2, 0.0);
        slabs
    };
    // The records merged in a fixed order.
    let part = wk.f32a.as_ref().expect("ensured");
    let (dbeta, dgamma) = (dbeta.f32_mut(op, "dbeta")?, dgamma.f32_mut(op, "dgamma")?);
    merge_sums(be, op, part, records, ch, dbeta, dgamma, &mut wk.f32b)
}

/// See [`crate::backend::Backend::gap_forward`].
pub(super) fn gap_forward(
    be: &CudaBackend,
    n: usize,
    hw: usize,
    c: usize,
    x: &CudaTensor,
    y: &mut CudaTensor,
) -> Result<(), BackendError> {
    let op = "gap_forward";
    check_len(op, "x", x.len, n * hw * c)?;
    check_len(op, "y", y.len, n * c)?;
    if hw == 0 {
        return Err(BackendError::Shape {
            op,
            detail: "empty spatial extent".into(),
        });
    }
    let (n_i, hw_i, c_i) = (
        to_i32(op, "n", n)?,
        to_i32(op, "hw", hw)?,
        to_i32(op, "c", c)?,
    );
    let (x, y) = (x.bf16(op, "x")?, y.bf16_mut(op, "y")?);
    let args = GapFwd {
        x: x.into(),
        y: y.into(),
        n: n_i,
        hw: hw_i,
        c: c_i,
    };
    be.launch(op, "gap_fwd", elementwise_cfg(n * c), args)?;
    be.note_work(2 * (n * hw * c + n * c), 0.0);
    Ok(())
}

/// See [`crate::backend::Backend::gap_backward`].
pub(super) fn gap_backward(
    be: &CudaBackend,
    n: usize,
    hw: usize,
    c: usize,
    dy: &CudaTensor,
    dx: &mut CudaTensor,
    accumulate: bool,
) -> Result<(), BackendError> {
    let op = "gap_backward";
    check_len(op, "dy", dy.len, n * c)?;
    check_len(op, "dx", dx.len, n * hw * c)?;
    if hw == 0 {
        return Err(BackendError::Shape {
            op,
            detail: "empty spatial extent".into(),
        });
    }
    let (n_i, hw_i, c_i) = (
        to_i32(op, "n", n)?,
        to_i32(op, "hw", hw)?,
        to_i32(op, "c", c)?,
    );
    let acc = i32::from(accumulate);
    let (dy, dx) = (dy.bf16(op, "dy")?, dx.bf16_mut(op, "dx")?);
    let args = GapBwd {
        dy: dy.into(),
        dx: dx.into(),
        n: n_i,
        hw: hw_i,
        c: c_i,
        accumulate: acc,
    };
    be.launch(op, "gap_bwd", elementwise_cfg(n * hw * c), args)?;
    be.note_work(
        2 * (n * c + n * hw * c * (1 + usize::from(accumulate))),
        0.0,
    );
    Ok(())
}
