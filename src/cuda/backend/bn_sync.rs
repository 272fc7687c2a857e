//! Synchronised batch norm (`--sync-bn`) on the GPU: the replicas' f64 sums in device memory
//! ([`CudaSums`], which the collective sums in place) and the kernels around them, one thread
//! per channel, whose arithmetic is the host's (`src/backend/bn_sync.rs`); the backward's
//! element-wise pass is batch norm's own `bn_bwd_apply` on the global reductions.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::base::{check_len, drv_err, ensure, oom_or_device, to_i32, CudaBackend};
use super::bn;
use crate::backend::bn_sync::{grad_sums_len, moments_len};
use crate::backend::{missing_mask, BackendError, BnShape, BnSyncBackward, DeviceSums};
use crate::cuda::launchers::{
    BnBwdApply, BnSyncGradSums, BnSyncMoments, BnSyncReductions, BnSyncStatistics,
};
use crate::cuda::tensor::CudaTensor;

/// Synchronised batch norm's sums on the GPU (f64 device memory): the collective sums them in
/// place on the device, or, without a device path, through the host.
pub struct CudaSums {
    buf: CudaSlice<f64>,
    stream: Arc<cudarc::driver::CudaStream>,
}

impl std::fmt::Debug for CudaSums {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaSums")
            .field("len", &self.buf.len())
            .finish()
    }
}

impl DeviceSums for CudaSums {
    fn device_ptr(&self) -> u64 {
        use cudarc::driver::DevicePtr;
        let (p, _record) = self.buf.device_ptr(&self.stream);
        p
    }

    fn len(&self) -> usize {
        self.buf.len()
    }

    fn download(&self) -> Result<Vec<f64>, BackendError> {
        // On the compute stream, after the kernels that wrote them (returns when copied).
        self.stream
            .clone_dtoh(&self.buf)
            .map_err(drv_err("download synchronised BN sums"))
    }

    fn upload(&mut self, values: &[f64]) -> Result<(), BackendError> {
        if values.len() != self.buf.len() {
            return Err(BackendError::Shape {
                op: "upload synchronised BN sums",
                detail: format!("{} values into {}", values.len(), self.buf.len()),
            });
        }
        self.stream
            .memcpy_htod(values, &mut self.buf)
            .map_err(drv_err("upload synchronised BN sums"))
    }
}

/// One thread per channel, 128 per block (bn_eval_prepare, the bn_sync_* kernels).
fn per_channel_cfg(c: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (c.div_ceil(128).max(1) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `sums` holds exactly `want` values (a reducer sums all of them).
fn check_sums(op: &'static str, sums: &CudaSums, want: usize) -> Result<(), BackendError> {
    if sums.buf.len() != want {
        return Err(BackendError::Shape {
            op,
            detail: format!("{} sums, needs {want}", sums.buf.len()),
        });
    }
    Ok(())
}

/// See [`crate::backend::Backend::alloc_sums`].
pub(super) fn alloc_sums(be: &CudaBackend, len: usize) -> Result<CudaSums, BackendError> {
    let op = "alloc_sums";
    let buf = be
        .dev
        .stream()
        .alloc_zeros::<f64>(len.max(1))
        .map_err(|e| oom_or_device(op, 8 * len, e))?;
    be.dev.note_allocation(8 * len.max(1));
    Ok(CudaSums {
        buf,
        stream: be.dev.stream().clone(),
    })
}

/// See [`crate::backend::Backend::bn_sync_moments`].
pub(super) fn moments(
    be: &CudaBackend,
    shape: BnShape,
    mean: &CudaTensor,
    var: &CudaTensor,
    moments: &mut CudaSums,
) -> Result<(), BackendError> {
    let op = "bn_sync_moments";
    let c = shape.channels;
    check_len(op, "mean", mean.len, c)?;
    check_len(op, "var", var.len, c)?;
    check_sums(op, moments, moments_len(c))?;
    let (c_i, rows) = (to_i32(op, "channels", c)?, shape.rows as f64);
    let (m, v) = (mean.f32(op, "mean")?, var.f32(op, "var")?);
    let args = BnSyncMoments {
        mean: m.into(),
        var: v.into(),
        rows,
        channels: c_i,
        sums: (&mut moments.buf).into(),
    };
    be.launch(op, "bn_sync_moments", per_channel_cfg(c), args)
}

/// See [`crate::backend::Backend::bn_sync_statistics`].
#[allow(clippy::too_many_arguments)]
pub(super) fn statistics(
    be: &CudaBackend,
    channels: usize,
    moments: &mut CudaSums,
    mean: &mut CudaTensor,
    var: &mut CudaTensor,
    running_mean: &mut CudaTensor,
    running_var: &mut CudaTensor,
    momentum: f32,
) -> Result<(), BackendError> {
    let op = "bn_sync_statistics";
    let c = channels;
    for (what, len) in [
        ("mean", mean.len),
        ("var", var.len),
        ("running_mean", running_mean.len),
        ("running_var", running_var.len),
    ] {
        check_len(op, what, len, c)?;
    }
    check_sums(op, moments, moments_len(c))?;
    let c_i = to_i32(op, "channels", c)?;
    let (m, v) = (mean.f32_mut(op, "mean")?, var.f32_mut(op, "var")?);
    let (rm, rv) = (
        running_mean.f32_mut(op, "running_mean")?,
        running_var.f32_mut(op, "running_var")?,
    );
    let args = BnSyncStatistics {
        sums: (&moments.buf).into(),
        channels: c_i,
        momentum,
        mean: m.into(),
        var: v.into(),
        running_mean: rm.into(),
        running_var: rv.into(),
    };
    be.launch(op, "bn_sync_statistics", per_channel_cfg(c), args)
}

/// See [`crate::backend::Backend::bn_sync_grad_sums`].
pub(super) fn grad_sums(
    be: &CudaBackend,
    shape: BnShape,
    moments: &mut CudaSums,
    dgamma: &CudaTensor,
    dbeta: &CudaTensor,
    grads: &mut CudaSums,
) -> Result<(), BackendError> {
    let op = "bn_sync_grad_sums";
    let c = shape.channels;
    check_len(op, "dgamma", dgamma.len, c)?;
    check_len(op, "dbeta", dbeta.len, c)?;
    check_sums(op, moments, moments_len(c))?;
    check_sums(op, grads, grad_sums_len(c))?;
    let (c_i, rows) = (to_i32(op, "channels", c)?, shape.rows as f64);
    let (dg, db) = (dgamma.f32(op, "dgamma")?, dbeta.f32(op, "dbeta")?);
    let args = BnSyncGradSums {
        dgamma: dg.into(),
        dbeta: db.into(),
        moments: (&moments.buf).into(),
        rows,
        channels: c_i,
        sums: (&mut grads.buf).into(),
    };
    be.launch(op, "bn_sync_grad_sums", per_channel_cfg(c), args)
}

/// See [`crate::backend::Backend::bn_sync_backward`].
pub(super) fn backward(
    be: &CudaBackend,
    grads: &mut CudaSums,
    a: BnSyncBackward<'_, CudaTensor>,
) -> Result<(), BackendError> {
    let op = "bn_sync_backward";
    let (rows, c) = (a.shape.rows, a.shape.channels);
    for (what, len) in [
        ("gamma", a.gamma.len),
        ("saved_mean", a.saved_mean.len),
        ("saved_invstd", a.saved_invstd.len),
    ] {
        check_len(op, what, len, c)?;
    }
    for (what, len) in [
        ("x", a.x.len),
        ("y", a.y.map_or(rows * c, |y| y.len)),
        ("dy", a.dy.len),
        ("dx", a.dx.len),
    ] {
        check_len(op, what, len, rows * c)?;
    }
    if a.y.is_none() && a.relu {
        return Err(missing_mask(op));
    }
    check_sums(op, grads, grad_sums_len(c))?;
    if c == 0 || rows == 0 {
        return Ok(());
    }
    let c_i = to_i32(op, "channels", c)?;
    let total = (rows * c) as i64;
    let mut work = be.work();
    let w = &mut *work;
    ensure(&be.dev, &mut w.sync_a, c, op)?;
    ensure(&be.dev, &mut w.sync_b, c, op)?;
    let (dgamma, dbeta) = (
        w.sync_a.as_mut().expect("ensured"),
        w.sync_b.as_mut().expect("ensured"),
    );
    let reductions = BnSyncReductions {
        sums: (&grads.buf).into(),
        channels: c_i,
        dgamma: (&mut *dgamma).into(),
        dbeta: (&mut *dbeta).into(),
    };
    be.launch(op, "bn_sync_reductions", per_channel_cfg(c), reductions)?;
    // The batch-statistics backward's own element-wise pass, on the global reductions (in
    // the workspace, in stream order: no wait, no host copy); the residual's gradient was
    // written by the frozen-statistics backward before.
    // No output (no ReLU): the kernel does not read the mask; dy stands in.
    let y = a.y.unwrap_or(a.dy);
    let (x, y, dy) = (a.x.bf16(op, "x")?, y.bf16(op, "y")?, a.dy.bf16(op, "dy")?);
    let (mean, invstd) = (
        a.saved_mean.f32(op, "saved_mean")?,
        a.saved_invstd.f32(op, "saved_invstd")?,
    );
    let gamma = a.gamma.bf16(op, "gamma")?;
    let dx = a.dx.bf16_mut(op, "dx")?;
    let (apply, cfg) = bn::apply_launch(be, op, "bn_bwd_apply", "bn_bwd_apply_vec", rows, c)?;
    let args = BnBwdApply {
        dy: dy.into(),
        y: y.into(),
        x: x.into(),
        mean: mean.into(),
        invstd: invstd.into(),
        gamma: gamma.into(),
        dbeta: (&*dbeta).into(),
        dgamma: (&*dgamma).into(),
        total,
        channels: c_i,
        relu: i32::from(a.relu),
        batch_stats: 1,
        dx: dx.into(),
        dres: None,
        accumulate_res: 0,
    };
    be.launch(op, apply, cfg, args)?;
    be.note_work(2 * rows * c * (4 + usize::from(a.relu)), 0.0);
    Ok(())
}
