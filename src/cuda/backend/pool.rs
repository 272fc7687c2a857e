//! Max pooling and global average pooling (kernels/pool.cu).

use cudarc::driver::LaunchConfig;

use super::base::{check_len, elementwise_cfg, to_i32, CudaBackend};
use crate::backend::{BackendError, PoolShape};
use crate::cuda::launchers::{GapBwd, GapFwd, MaxpoolBwd, MaxpoolFwd};
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
    // maxpool_bwd_vec: C % 8 == 0, at most 2 windows per dimension over an input cell, window
    // positions in a byte (see pool.cu); maxpool_bwd otherwise.
    let vec = s.c % 8 == 0 && s.kernel <= 2 * s.stride && s.kernel <= 15;
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
