//! Batch norm in its own passes (kernels/bn.cu): statistics from slab reductions, or from the
//! moments a fused convolution left ([`super::bn_fused`]), or the running statistics; the
//! normalisation with the residual add and ReLU; and the backward, whose reductions the fused
//! dgrad epilogue may have done already (`prepared`).

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::base::{check_len, dev_err, elementwise_cfg, ensure, to_i32, CudaBackend, THREADS};
use crate::backend::{missing_mask, BackendError, BnBackward, BnForward, BnMode};
use crate::cuda::launchers::{
    BnApply, BnApplySigns, BnBwdApply, BnBwdFinalize, BnBwdPartial, BnEvalPrepare,
    BnMomentsFinalize, BnStatsFinalize, BnStatsPartial,
};
use crate::cuda::tensor::CudaTensor;

impl CudaBackend {
    /// The launch of BN's 16-byte element-wise kernel `name` over `groups` 8-channel groups:
    /// 256 threads, one wave of blocks (as many as fit the SMs at once, so none waits for a
    /// second wave), each thread walking many rows; the stride (blocks × 256) is a multiple of
    /// C / 8 whenever C / 8 divides 256 (every ResNet layer), so a thread's channels, whose
    /// parameters it keeps in registers, never change.
    pub(super) fn channel_rows_cfg(
        &self,
        op: &'static str,
        name: &'static str,
        groups: usize,
    ) -> Result<LaunchConfig, BackendError> {
        let resident = self
            .dev
            .resident_blocks("bn.cu", name, THREADS)
            .map_err(dev_err(op))?;
        let wave = (resident.max(1) * self.sms.max(1)) as usize;
        let blocks = groups.div_ceil(THREADS as usize).clamp(1, wave) as u32;
        Ok(LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        })
    }

    /// Rows per slab and slab count of a per-channel reduction over `rows` rows.
    pub(super) fn slabs(&self, rows: usize) -> (usize, usize) {
        let target = (4 * self.sms as usize).max(1);
        let slabs = rows.div_ceil(64).clamp(1, target);
        let per = rows.div_ceil(slabs);
        (per, rows.div_ceil(per))
    }
}

/// The per-slab reduction kernel (`base` or its 16-byte `_vec` form, which needs C % 8 == 0 and
/// C ≤ 2048) and its launch configuration.
pub(super) fn reduction_launch(
    c: usize,
    slabs: usize,
    base: &'static str,
) -> (&'static str, LaunchConfig) {
    if c % 8 == 0 && c / 8 <= 256 {
        let name = if base == "bn_stats_partial" {
            "bn_stats_partial_vec"
        } else {
            "bn_bwd_partial_vec"
        };
        (
            name,
            LaunchConfig {
                grid_dim: (1, slabs as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
        )
    } else {
        (
            base,
            LaunchConfig {
                grid_dim: (c.div_ceil(32) as u32, slabs as u32, 1),
                block_dim: (32, 8, 1),
                shared_mem_bytes: 0,
            },
        )
    }
}

/// bn_stats_finalize / bn_bwd_finalize: block (32 channels, 32 slab lanes: `FIN_Y` in bn.cu).
fn finalize_cfg(c: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (c.div_ceil(32) as u32, 1, 1),
        block_dim: (32, 32, 1),
        shared_mem_bytes: 0,
    }
}

/// The element-wise kernel `base` (`bn_apply`, `bn_bwd_apply`) or its 16-byte form when every
/// row is whole groups of 8 channels, and its launch configuration.
pub(super) fn apply_launch(
    be: &CudaBackend,
    op: &'static str,
    base: &'static str,
    vec: &'static str,
    rows: usize,
    c: usize,
) -> Result<(&'static str, LaunchConfig), BackendError> {
    if c % 8 == 0 {
        Ok((vec, be.channel_rows_cfg(op, vec, rows * c / 8)?))
    } else {
        Ok((base, elementwise_cfg(rows * c)))
    }
}

/// The batch norm's statistics from the moments a fused convolution left
/// ([`BnForward::moments`], see [`super::bn_fused`]): saved mean and
/// 1/sqrt(var + eps), and the running statistics advanced with `momentum`.
#[allow(clippy::too_many_arguments)]
fn finalize_moments(
    be: &CudaBackend,
    op: &'static str,
    moments: &CudaTensor,
    c: usize,
    eps: f32,
    momentum: f32,
    mean: &mut CudaSlice<f32>,
    invstd: &mut CudaSlice<f32>,
    running_mean: &mut CudaSlice<f32>,
    running_var: &mut CudaSlice<f32>,
) -> Result<(), BackendError> {
    check_len(op, "moments", moments.len, 3 * c)?;
    let m = moments.f32(op, "moments")?;
    let c_i = to_i32(op, "channels", c)?;
    let cfg = LaunchConfig {
        grid_dim: (c.div_ceil(128) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let args = BnMomentsFinalize {
        moments: m.into(),
        channels: c_i,
        eps,
        momentum,
        mean_out: mean.into(),
        invstd_out: invstd.into(),
        running_mean: running_mean.into(),
        running_var: running_var.into(),
    };
    be.launch(op, "bn_moments_finalize", cfg, args)
}

/// See [`crate::backend::Backend::bn_forward`].
pub(super) fn forward(be: &CudaBackend, a: BnForward<'_, CudaTensor>) -> Result<(), BackendError> {
    let op = "bn_forward";
    let (rows, c) = (a.shape.rows, a.shape.channels);
    if rows == 0 {
        return Err(BackendError::Shape {
            op,
            detail: "zero rows".into(),
        });
    }
    check_len(op, "x", a.x.len, rows * c)?;
    match &a.y {
        Some(y) => check_len(op, "y", y.len, rows * c)?,
        None if a.residual.is_some() => {
            return Err(BackendError::InvalidInput {
                op,
                detail: "a residual without an output to add it to".into(),
            })
        }
        None => {}
    }
    if let Some(r) = a.residual {
        check_len(op, "residual", r.len, rows * c)?;
    }
    for (name, len) in [
        ("gamma", a.gamma.len),
        ("beta", a.beta.len),
        ("saved_mean", a.saved_mean.len),
        ("saved_invstd", a.saved_invstd.len),
        ("running_mean", a.running_mean.len),
        ("running_var", a.running_var.len),
    ] {
        check_len(op, name, len, c)?;
    }
    let (rows_i, c_i) = (to_i32(op, "rows", rows)?, to_i32(op, "channels", c)?);
    let x = a.x.bf16(op, "x")?;
    let chan_cfg = LaunchConfig {
        grid_dim: (c.div_ceil(128) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    {
        let mean = a.saved_mean.f32_mut(op, "saved_mean")?;
        let invstd = a.saved_invstd.f32_mut(op, "saved_invstd")?;
        let run_mean = a.running_mean.f32_mut(op, "running_mean")?;
        let run_var = a.running_var.f32_mut(op, "running_var")?;
        match (a.mode, a.moments) {
            (BnMode::Train, Some(moments)) => {
                // Fused: the convolution's epilogue reduced x already.
                finalize_moments(
                    be, op, moments, c, a.eps, a.momentum, mean, invstd, run_mean, run_var,
                )?;
            }
            (BnMode::Train, None) => {
                let (per, slabs) = be.slabs(rows);
                let mut work = be.work();
                let w = &mut *work;
                ensure(&be.dev, &mut w.f32a, slabs * c, op)?;
                ensure(&be.dev, &mut w.f32b, slabs * c, op)?;
                let (pm, pv) = (
                    w.f32a.as_mut().expect("ensured"),
                    w.f32b.as_mut().expect("ensured"),
                );
                let per_i = to_i32(op, "rows per slab", per)?;
                let slabs_i = to_i32(op, "slabs", slabs)?;
                let (partial, cfg) = reduction_launch(c, slabs, "bn_stats_partial");
                let stats = BnStatsPartial {
                    x: x.into(),
                    rows: rows_i,
                    channels: c_i,
                    rows_per_slab: per_i,
                    part_mean: (&mut *pm).into(),
                    part_m2: (&mut *pv).into(),
                };
                be.launch(op, partial, cfg, stats)?;
                be.note_work(2 * rows * c, 0.0);
                let finalize = BnStatsFinalize {
                    part_mean: (&*pm).into(),
                    part_m2: (&*pv).into(),
                    slabs: slabs_i,
                    rows: rows_i,
                    channels: c_i,
                    rows_per_slab: per_i,
                    eps: a.eps,
                    momentum: a.momentum,
                    mean_out: mean.into(),
                    invstd_out: invstd.into(),
                    running_mean: run_mean.into(),
                    running_var: run_var.into(),
                };
                be.launch(op, "bn_stats_finalize", finalize_cfg(c), finalize)?;
            }
            (BnMode::Frozen | BnMode::Eval, _) => {
                let prepare = BnEvalPrepare {
                    running_mean: (&*run_mean).into(),
                    running_var: (&*run_var).into(),
                    channels: c_i,
                    eps: a.eps,
                    mean_out: mean.into(),
                    invstd_out: invstd.into(),
                };
                be.launch(op, "bn_eval_prepare", chan_cfg, prepare)?;
            }
        }
    }
    // No output: the statistics only (the reader applies them: maxpool_bn_forward).
    let Some(y) = a.y else {
        return Ok(());
    };
    let total = (rows * c) as i64;
    let relu = i32::from(a.relu);
    let (mean, invstd) = (
        a.saved_mean.f32(op, "saved_mean")?,
        a.saved_invstd.f32(op, "saved_invstd")?,
    );
    let (gamma, beta) = (a.gamma.bf16(op, "gamma")?, a.beta.bf16(op, "beta")?);
    let residual = a.residual.map(|r| r.bf16(op, "residual")).transpose()?;
    let streams = 4 + 2 * usize::from(residual.is_some());
    // y's signs packed beside it, where the network asked the backend to keep them
    // (`Backend::keep_relu_signs`, BIRDTRAIN_BN_MASK=packed) and the 16-byte kernel runs.
    let pack = be.bn_mask.packs() && c % 8 == 0;
    let (ys, signs) = y.bf16_and_signs_mut(op, "y")?;
    match signs {
        Some(signs) if pack => {
            let vec = "bn_apply_signs_vec";
            let args = BnApplySigns {
                x: x.into(),
                mean: mean.into(),
                invstd: invstd.into(),
                gamma: gamma.into(),
                beta: beta.into(),
                residual: residual.map(Into::into),
                y: ys.into(),
                signs: signs.into(),
                total,
                channels: c_i,
                relu,
            };
            let cfg = be.channel_rows_cfg(op, vec, rows * c / 8)?;
            be.launch(op, vec, cfg, args)?;
            be.note_work(streams * rows * c + rows * c / 8, 0.0);
            y.signs_written();
        }
        _ => {
            // 16 bytes per thread when every row is whole groups of 8 channels.
            let (apply, cfg) = apply_launch(be, op, "bn_apply", "bn_apply_vec", rows, c)?;
            let args = BnApply {
                x: x.into(),
                mean: mean.into(),
                invstd: invstd.into(),
                gamma: gamma.into(),
                beta: beta.into(),
                residual: residual.map(Into::into),
                y: ys.into(),
                total,
                channels: c_i,
                relu,
            };
            be.launch(op, apply, cfg, args)?;
            be.note_work(streams * rows * c, 0.0);
        }
    }
    Ok(())
}

/// See [`crate::backend::Backend::bn_backward`].
pub(super) fn backward(
    be: &CudaBackend,
    a: BnBackward<'_, CudaTensor>,
) -> Result<(), BackendError> {
    let op = "bn_backward";
    let (rows, c) = (a.shape.rows, a.shape.channels);
    if rows == 0 {
        return Err(BackendError::Shape {
            op,
            detail: "zero rows".into(),
        });
    }
    for (name, len) in [
        ("x", a.x.len),
        ("y", a.y.map_or(rows * c, |y| y.len)),
        ("dy", a.dy.len),
        ("dx", a.dx.len),
    ] {
        check_len(op, name, len, rows * c)?;
    }
    if a.y.is_none() && a.relu && !a.prepared {
        return Err(missing_mask(op));
    }
    if let Some((d, _)) = &a.dresidual {
        check_len(op, "dresidual", d.len, rows * c)?;
    }
    for (name, len) in [
        ("gamma", a.gamma.len),
        ("saved_mean", a.saved_mean.len),
        ("saved_invstd", a.saved_invstd.len),
        ("dgamma", a.dgamma.len),
        ("dbeta", a.dbeta.len),
    ] {
        check_len(op, name, len, c)?;
    }
    let (rows_i, c_i) = (to_i32(op, "rows", rows)?, to_i32(op, "channels", c)?);
    // Prepared (bn_fused): dy is g already, masked; dgamma and dbeta are its reductions.
    let relu = i32::from(a.relu && !a.prepared);
    // No output (prepared, or no ReLU): the kernels do not read the mask; dy stands in.
    let y = a.y.unwrap_or(a.dy);
    let (x, y, dy) = (a.x.bf16(op, "x")?, y.bf16(op, "y")?, a.dy.bf16(op, "dy")?);
    let (mean, invstd) = (
        a.saved_mean.f32(op, "saved_mean")?,
        a.saved_invstd.f32(op, "saved_invstd")?,
    );
    let gamma = a.gamma.bf16(op, "gamma")?;
    let (per, slabs) = be.slabs(rows);
    let (per_i, slabs_i) = (
        to_i32(op, "rows per slab", per)?,
        to_i32(op, "slabs", slabs)?,
    );
    if !a.prepared {
        let mut work = be.work();
        let w = &mut *work;
        ensure(&be.dev, &mut w.f32a, slabs * c, op)?;
        ensure(&be.dev, &mut w.f32b, slabs * c, op)?;
        let (pb, pg) = (
            w.f32a.as_mut().expect("ensured"),
            w.f32b.as_mut().expect("ensured"),
        );
        let (partial, cfg) = reduction_launch(c, slabs, "bn_bwd_partial");
        let sums = BnBwdPartial {
            dy: dy.into(),
            y: y.into(),
            x: x.into(),
            mean: mean.into(),
            invstd: invstd.into(),
            rows: rows_i,
            channels: c_i,
            rows_per_slab: per_i,
            relu,
            part_dbeta: (&mut *pb).into(),
            part_dgamma: (&mut *pg).into(),
        };
        be.launch(op, partial, cfg, sums)?;
        be.note_work(2 * rows * c * (2 + relu as usize), 0.0);
        let dbeta = a.dbeta.f32_mut(op, "dbeta")?;
        let dgamma = a.dgamma.f32_mut(op, "dgamma")?;
        let finalize = BnBwdFinalize {
            part_dbeta: (&*pb).into(),
            part_dgamma: (&*pg).into(),
            slabs: slabs_i,
            channels: c_i,
            dbeta: dbeta.into(),
            dgamma: dgamma.into(),
        };
        be.launch(op, "bn_bwd_finalize", finalize_cfg(c), finalize)?;
    }
    let total = (rows * c) as i64;
    let batch_stats = i32::from(a.batch_stats);
    let (dbeta, dgamma) = (a.dbeta.f32(op, "dbeta")?, a.dgamma.f32(op, "dgamma")?);
    let dx = a.dx.bf16_mut(op, "dx")?;
    let (apply, cfg) = apply_launch(be, op, "bn_bwd_apply", "bn_bwd_apply_vec", rows, c)?;
    // The residual's gradient, and whether it is added into (no residual: neither).
    let (dres, acc) = match a.dresidual {
        Some((dres, acc)) => (Some(dres.bf16_mut(op, "dresidual")?), i32::from(acc)),
        None => (None, 0),
    };
    let streams = match &dres {
        Some(_) => 4 + relu as usize + usize::from(acc == 1),
        None => 3 + relu as usize,
    };
    let args = BnBwdApply {
        dy: dy.into(),
        y: y.into(),
        x: x.into(),
        mean: mean.into(),
        invstd: invstd.into(),
        gamma: gamma.into(),
        dbeta: dbeta.into(),
        dgamma: dgamma.into(),
        total,
        channels: c_i,
        relu,
        batch_stats,
        dx: dx.into(),
        dres: dres.map(Into::into),
        accumulate_res: acc,
    };
    be.launch(op, apply, cfg, args)?;
    be.note_work(2 * rows * c * streams, 0.0);
    Ok(())
}
