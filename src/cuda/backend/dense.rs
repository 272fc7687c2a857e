//! The classifier head's fully connected layer (kernels/linear.cu).

use cudarc::driver::LaunchConfig;

use super::base::{check_len, to_i32, CudaBackend};
use crate::backend::{BackendError, LinearShape};
use crate::cuda::launchers::{LinearBiasGrad, LinearBwdData, LinearBwdWeight, LinearFwd};
use crate::cuda::tensor::CudaTensor;

fn linear_dims(op: &'static str, s: &LinearShape) -> Result<(i32, i32, i32), BackendError> {
    Ok((
        to_i32(op, "n", s.n)?,
        to_i32(op, "inputs", s.inputs)?,
        to_i32(op, "outputs", s.outputs)?,
    ))
}

fn tile16(cols: usize, rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (cols.div_ceil(16) as u32, rows.div_ceil(16) as u32, 1),
        block_dim: (16, 16, 1),
        shared_mem_bytes: 0,
    }
}

/// See [`crate::backend::Backend::linear_forward`].
pub(super) fn linear_forward(
    be: &CudaBackend,
    s: &LinearShape,
    x: &CudaTensor,
    w: &CudaTensor,
    b: &CudaTensor,
    y: &mut CudaTensor,
) -> Result<(), BackendError> {
    let op = "linear_forward";
    check_len(op, "x", x.len, s.n * s.inputs)?;
    check_len(op, "w", w.len, s.outputs * s.inputs)?;
    check_len(op, "b", b.len, s.outputs)?;
    check_len(op, "y", y.len, s.n * s.outputs)?;
    let (n, inputs, outputs) = linear_dims(op, s)?;
    let (x, w, b, y) = (
        x.bf16(op, "x")?,
        w.bf16(op, "w")?,
        b.bf16(op, "b")?,
        y.bf16_mut(op, "y")?,
    );
    let args = LinearFwd {
        x: x.into(),
        w: w.into(),
        b: b.into(),
        y: y.into(),
        n,
        inputs,
        outputs,
    };
    be.launch(op, "linear_fwd", tile16(s.outputs, s.n), args)
}

/// See [`crate::backend::Backend::linear_backward`].
#[allow(clippy::too_many_arguments)]
pub(super) fn linear_backward(
    be: &CudaBackend,
    s: &LinearShape,
    x: &CudaTensor,
    w: &CudaTensor,
    dy: &CudaTensor,
    dx: &mut CudaTensor,
    dw: &mut CudaTensor,
    db: &mut CudaTensor,
    accumulate: bool,
) -> Result<(), BackendError> {
    let op = "linear_backward";
    check_len(op, "x", x.len, s.n * s.inputs)?;
    check_len(op, "dx", dx.len, s.n * s.inputs)?;
    check_len(op, "w", w.len, s.outputs * s.inputs)?;
    check_len(op, "dw", dw.len, s.outputs * s.inputs)?;
    check_len(op, "db", db.len, s.outputs)?;
    check_len(op, "dy", dy.len, s.n * s.outputs)?;
    let (n, inputs, outputs) = linear_dims(op, s)?;
    let acc = i32::from(accumulate);
    let (x, w, dy) = (x.bf16(op, "x")?, w.bf16(op, "w")?, dy.bf16(op, "dy")?);
    let dx = dx.bf16_mut(op, "dx")?;
    let data = LinearBwdData {
        dy: dy.into(),
        w: w.into(),
        dx: dx.into(),
        n,
        inputs,
        outputs,
        accumulate: acc,
    };
    be.launch(op, "linear_bwd_data", tile16(s.inputs, s.n), data)?;
    let dw = dw.f32_mut(op, "dw")?;
    let weight = LinearBwdWeight {
        dy: dy.into(),
        x: x.into(),
        dw: dw.into(),
        n,
        inputs,
        outputs,
    };
    be.launch(op, "linear_bwd_weight", tile16(s.inputs, s.outputs), weight)?;
    let db = db.f32_mut(op, "db")?;
    let cfg = LaunchConfig {
        grid_dim: (s.outputs.div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let bias = LinearBiasGrad {
        dy: dy.into(),
        db: db.into(),
        n,
        outputs,
    };
    be.launch(op, "linear_bias_grad", cfg, bias)
}
