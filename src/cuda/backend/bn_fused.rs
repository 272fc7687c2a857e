//! Batch norm fused into the convolutions around it (`BIRDTRAIN_BN_FUSION=1`; off by default
//! until a GPU run has passed its tests and measured it faster than the separate passes):
//! the launches behind [`Backend::conv_forward_moments`] and
//! [`Backend::conv_backward_data_bn`] on [`CudaBackend`], and the two pieces of the batch-norm
//! ops that read what they leave ([`BnForward::moments`], [`BnBackward::prepared`]).
//!
//! Forward: the v2 forward GEMM with the statistics epilogue (`conv2_fwd_stats_*`) writes
//! per-tile (mean, M2) records of its output, `bn_stats_merge` merges them in a fixed order
//! into the layer's moments (mean, M2, count per channel: a tensor of the network's), and the
//! batch norm's `bn_moments_finalize` turns those into the saved mean, 1/sqrt(var + eps) and
//! the running statistics; `bn_stats_partial` no longer reads the convolution's output. The
//! moments are where a cross-replica merge (synchronised batch norm) fits.
//!
//! Backward: the v2 dgrad GEMM with the batch-norm epilogue (`conv2_dgrad_bn_*`) of the
//! convolution that reads a batch norm's output finishes that batch norm's incoming gradient
//! (the residual's gradient added, the ReLU's mask applied) and writes per-tile Σg, Σg·x̂;
//! `bn_sums_merge` sums them in a fixed order into dβ and dγ, and the batch norm's backward is
//! one apply pass over g and x (`bn_bwd_partial` and the mask's read of y leave the step).
//!
//! Where no v2 kernel takes a shape (`BIRDTRAIN_CONV=v1`, channel counts v2 refuses), the same
//! ops run the plain convolution and then the slab reductions (`bn_stats_partial`,
//! `bn_grad_finish` + `bn_bwd_partial`), whose records the same merges read: the ops keep
//! their meaning on every path. No atomics anywhere: the same bits every run.

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::base::{
    check_len, elementwise_cfg, ensure, to_i32, AppliedArgs, Conv2Scratch, CudaBackend,
};
use super::bn::reduction_launch;
use super::conv::conv_args;
use super::conv3::DgradBn;
use crate::backend::{Backend, BackendError, BnGradEpilogue, ConvShape};
use crate::cuda::conv::{Conv2Launch, Pass};
use crate::cuda::error::CudaError;
use crate::cuda::launchers::{
    BnBwdPartial, BnGradFinish, BnStatsMerge, BnStatsPartial, BnSumsMerge, Conv2DgradBn,
    Conv2FwdStats, Conv2FwdStatsApply,
};
use crate::cuda::tensor::CudaTensor;

/// The environment variable that selects the batch-norm sequence: `1` (or unset) fuses batch
/// norm into the convolutions, `0` runs it in its own passes. On by default since its GPU
/// tests passed on an H100 and it measured faster there (2026-11-27: resnet50 at batch 256,
/// 62.40 against 64.18 ms a step, the median of three alternating rounds); `0` is the way
/// back, and what the timings of the separate passes use.
pub const BN_FUSION_ENV: &str = "BIRDTRAIN_BN_FUSION";

/// Parses the value of `BIRDTRAIN_BN_FUSION` (unset or empty: on).
pub fn parse_bn_fusion(value: Option<&str>) -> Result<bool, CudaError> {
    match value.map(str::trim) {
        None | Some("") | Some("1") => Ok(true),
        Some("0") => Ok(false),
        Some(other) => Err(CudaError::Unsupported {
            what: format!(
                "{BN_FUSION_ENV}={other:?}: expected 0 (batch norm in its own passes) or 1 \
                 (fused into the convolutions); unset means 1"
            ),
        }),
    }
}

/// Whether the environment asks for the fused sequence.
pub fn bn_fusion_from_env() -> Result<bool, CudaError> {
    parse_bn_fusion(std::env::var(BN_FUSION_ENV).ok().as_deref())
}

/// Rows of one forward tile record (BM of every v2 forward tile shape).
const TILE_ROWS: usize = 128;
/// Records merged in one launch at most; more are merged in groups of [`MERGE_GROUP`], then
/// the groups (a lane of the one-launch merge would walk hundreds of records: a layer of
/// 3.2M rows has 25 088 tiles).
const MERGE_SINGLE: usize = 256;
/// Records per group of the first of two merge launches.
const MERGE_GROUP: usize = 128;

/// bn_stats_merge / bn_sums_merge: block (32 channels, 32 record lanes), one block row per group.
fn merge_cfg(c: usize, groups: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (c.div_ceil(32) as u32, groups as u32, 1),
        block_dim: (32, 32, 1),
        shared_mem_bytes: 0,
    }
}

/// A v2 launch and the name of its kernel with the batch-norm epilogue.
struct EpilogueLaunch {
    launch: Conv2Launch,
    bn_epilogue_kernel: &'static str,
}

impl CudaBackend {
    /// Selects the fused batch-norm sequence (`true`) or the separate passes (`false`) for
    /// networks built afterwards (tests compare both on one device; `BIRDTRAIN_BN_FUSION` sets
    /// it at start).
    pub fn set_bn_fusion(&mut self, on: bool) {
        self.bn_fusion = on;
    }
}

/// The v2 launch of `pass` with its batch-norm epilogue kernel, when v2 takes the shape.
fn epilogue_plan(be: &CudaBackend, pass: Pass, s: &ConvShape) -> Option<EpilogueLaunch> {
    let launch = be.conv2_plan(pass, s)?;
    let bn_epilogue_kernel = launch.bn_epilogue_kernel()?;
    Some(EpilogueLaunch {
        launch,
        bn_epilogue_kernel,
    })
}

/// See [`Backend::conv_forward_moments`].
pub(super) fn conv_forward_moments(
    be: &CudaBackend,
    s: &ConvShape,
    x: &CudaTensor,
    w: &CudaTensor,
    y: &mut CudaTensor,
    moments: &mut CudaTensor,
) -> Result<(), BackendError> {
    let op = "conv_forward_moments";
    conv_args(op, s)?;
    check_len(op, "x", x.len, s.x_len())?;
    check_len(op, "w", w.len, s.w_len())?;
    check_len(op, "y", y.len, s.y_len())?;
    check_len(op, "moments", moments.len, 3 * s.c_out)?;
    let (rows, c) = (s.n * s.out_h() * s.out_w(), s.c_out);
    // The v3 GEMM's epilogue writes conv2's records (128-row tiles; the 4-D path's tiles (3×3,
    // strided 1×1) are whole, so each record covers 128 rows as the merge expects).
    let v3 = be.conv3_takes_forward(s);
    let fwd = if v3 {
        None
    } else {
        epilogue_plan(be, Pass::Forward, s)
    };
    if !v3 && fwd.is_none() {
        // No fused kernel: the convolution, then the slab statistics of its output.
        be.conv_forward(s, x, w, y)?;
        let (per, slabs) = be.slabs(rows);
        let (rows_i, c_i) = (to_i32(op, "rows", rows)?, to_i32(op, "channels", c)?);
        let per_i = to_i32(op, "rows per slab", per)?;
        let mut work = be.work();
        let w = &mut *work;
        ensure(&be.dev, &mut w.f32a, 2 * slabs * c, op)?;
        let part = w.f32a.as_mut().expect("ensured");
        {
            let (mut pm, mut pv) = part.split_at_mut(slabs * c);
            let (partial, cfg) = reduction_launch(c, slabs, "bn_stats_partial");
            let yb = y.bf16(op, "y")?;
            let stats = BnStatsPartial {
                x: yb.into(),
                rows: rows_i,
                channels: c_i,
                rows_per_slab: per_i,
                part_mean: (&mut pm).into(),
                part_m2: (&mut pv).into(),
            };
            be.launch(op, partial, cfg, stats)?;
            be.note_work(2 * rows * c, 0.0);
        }
        let moments = moments.f32_mut(op, "moments")?;
        return merge_moments(be, op, part, slabs, rows, c, per, moments, &mut w.f32b);
    }
    let records = fwd
        .as_ref()
        .map_or(rows.div_ceil(TILE_ROWS), |f| f.launch.grid.0 as usize);
    let (xs, ws, ys) = (x.bf16(op, "x")?, w.bf16(op, "w")?, y.bf16_mut(op, "y")?);
    let mut work = be.work();
    let wk = &mut *work;
    ensure(&be.dev, &mut wk.f32a, 2 * records * c, op)?;
    let part = wk.f32a.as_mut().expect("ensured");
    if let Some(fwd) = fwd {
        let launch = Conv2Launch {
            kernel: fwd.bn_epilogue_kernel,
            ..fwd.launch
        };
        let cfg = be.conv2_prepare(op, &launch)?;
        let mut scratch = be.conv2.lock().unwrap_or_else(|e| e.into_inner());
        let Conv2Scratch { x_stem, w_stem, .. } = &mut *scratch;
        let (xs, ws) = be.stem_operands(op, &launch, s, xs, Some(ws), (x_stem, w_stem))?;
        let gemm = Conv2FwdStats {
            x: xs.into(),
            w: ws.expect("given").into(),
            y: ys.into(),
            args: launch.args,
            part: (&mut *part).into(),
        };
        be.launch(op, fwd.bn_epilogue_kernel, cfg, gemm)?;
        be.note_work(
            2 * (s.x_len() + s.w_len() + s.y_len()) + 8 * records * c,
            s.flops(),
        );
    } else {
        be.conv3_forward(op, s, xs, ws, ys, Some(&mut *part))?;
    }
    let moments = moments.f32_mut(op, "moments")?;
    merge_moments(
        be,
        op,
        part,
        records,
        rows,
        c,
        TILE_ROWS,
        moments,
        &mut wk.f32b,
    )
}

/// [`Backend::conv_forward_bn`] with moments through `l`, a `conv2_fwd_stats_apply_*` launch
/// (`conv_bn.rs`'s `apply_plan`): y = conv(bn(z), w), its tile records merged into
/// `moments` as [`conv_forward_moments`] merges them (z, w, y and the batch norm checked by
/// the caller).
#[allow(clippy::too_many_arguments)]
pub(super) fn conv_forward_moments_applied(
    be: &CudaBackend,
    s: &ConvShape,
    z: &CudaTensor,
    applied: &AppliedArgs<'_>,
    w: &CudaTensor,
    y: &mut CudaTensor,
    moments: &mut CudaTensor,
    l: &Conv2Launch,
) -> Result<(), BackendError> {
    let op = "conv_forward_bn";
    check_len(op, "moments", moments.len, 3 * s.c_out)?;
    let (rows, c) = (s.n * s.out_h() * s.out_w(), s.c_out);
    let records = l.grid.0 as usize;
    let (zs, ws, ys) = (z.bf16(op, "z")?, w.bf16(op, "w")?, y.bf16_mut(op, "y")?);
    let cfg = be.conv2_prepare(op, l)?;
    let mut work = be.work();
    let wk = &mut *work;
    ensure(&be.dev, &mut wk.f32a, 2 * records * c, op)?;
    let part = wk.f32a.as_mut().expect("ensured");
    let gemm = Conv2FwdStatsApply {
        z: zs.into(),
        w: ws.into(),
        y: ys.into(),
        args: l.args,
        part: (&mut *part).into(),
        mean: applied.mean.into(),
        invstd: applied.invstd.into(),
        gamma: applied.gamma.into(),
        beta: applied.beta.into(),
        relu: applied.relu,
    };
    be.launch(op, l.kernel, cfg, gemm)?;
    be.note_work(
        2 * (s.x_len() + s.w_len() + s.y_len()) + 8 * records * c,
        s.flops(),
    );
    let moments = moments.f32_mut(op, "moments")?;
    merge_moments(
        be,
        op,
        part,
        records,
        rows,
        c,
        TILE_ROWS,
        moments,
        &mut wk.f32b,
    )
}

/// See [`Backend::conv_backward_data_bn`].
pub(super) fn conv_backward_data_bn(
    be: &CudaBackend,
    s: &ConvShape,
    dy: &CudaTensor,
    w: &CudaTensor,
    dx: &mut CudaTensor,
    accumulate: bool,
    bn: BnGradEpilogue<'_, CudaTensor>,
) -> Result<(), BackendError> {
    let op = "conv_backward_data_bn";
    match (bn.y, bn.relu) {
        // Never stored (the convolution applied the batch norm) and no v3 or v2 epilogue to
        // recompute the mask: its source recomputed into a scratch tensor.
        (None, true)
            if !be.conv3_takes_dgrad_bn(s) && epilogue_plan(be, Pass::Dgrad, s).is_none() =>
        {
            let rows = s.n * s.h * s.w;
            let applied = bn.applied();
            let x = bn.x;
            be.with_applied(op, rows, s.c_in, x, &applied, |y| {
                let bn = BnGradEpilogue { y: Some(y), ..bn };
                data_bn(be, s, dy, w, dx, accumulate, bn)
            })
        }
        // Stored, no ReLU (the mask is not read), or an epilogue that recomputes it from x, γ
        // and β.
        _ => data_bn(be, s, dy, w, dx, accumulate, bn),
    }
}

/// [`conv_backward_data_bn`] with the batch norm's output `bn.y` (read only with a ReLU), or
/// none (with a ReLU: the v2 or v3 epilogue recomputes the mask from x, γ, β; its caller has
/// checked that one of them takes the layer).
fn data_bn(
    be: &CudaBackend,
    s: &ConvShape,
    dy: &CudaTensor,
    w: &CudaTensor,
    dx: &mut CudaTensor,
    accumulate: bool,
    bn: BnGradEpilogue<'_, CudaTensor>,
) -> Result<(), BackendError> {
    let op = "conv_backward_data_bn";
    conv_args(op, s)?;
    check_len(op, "dy", dy.len, s.y_len())?;
    check_len(op, "w", w.len, s.w_len())?;
    check_len(op, "dx", dx.len, s.x_len())?;
    check_len(op, "bn x", bn.x.len, s.x_len())?;
    if let Some(y) = bn.y {
        check_len(op, "bn y", y.len, s.x_len())?;
    }
    if let Some(r) = bn.residual_grad {
        check_len(op, "residual_grad", r.len, s.x_len())?;
    }
    for (name, len) in [
        ("saved_mean", bn.saved_mean.len),
        ("saved_invstd", bn.saved_invstd.len),
        ("dgamma", bn.dgamma.len),
        ("dbeta", bn.dbeta.len),
    ] {
        check_len(op, name, len, s.c_in)?;
    }
    let (rows, c) = (s.n * s.h * s.w, s.c_in);
    // The optional inputs (none: no residual gradient, no ReLU; the kernels get null).
    let residual = bn
        .residual_grad
        .map(|t| t.bf16(op, "residual_grad"))
        .transpose()?;
    // The strided 1×1's v3 dgrad has no batch-norm epilogue: v2's fused kernel there.
    let v3 = be.conv3_takes_dgrad_bn(s);
    let plan = if v3 {
        None
    } else {
        epilogue_plan(be, Pass::Dgrad, s)
    };
    // A fused epilogue recomputes the mask of ReLU(BN(x)) from x rather than read y where
    // BIRDTRAIN_BN_MASK says so (it loads x anyway, for Σg·x̂).
    let skip_y = (v3 || plan.is_some()) && bn.y_recomputable && be.bn_mask.recomputes();
    // With `packed`, v3 reads the mask of an output with a residual from the signs its
    // forward packed beside it, when they are those of its current values.
    let signs = match bn.y {
        Some(y) if v3 && bn.relu && !skip_y && be.bn_mask.packs() => y.current_signs(),
        _ => None,
    };
    let bn_y = match bn.y {
        Some(y) if bn.relu && !skip_y && signs.is_none() => Some(y.bf16(op, "bn y")?),
        _ => None,
    };
    // No stored output (or its signs) with a ReLU: the mask recomputed from x, γ, β (the v2
    // and v3 epilogues).
    let recompute = bn.relu && bn_y.is_none() && signs.is_none();
    let applied = if recompute {
        Some(AppliedArgs::of(op, &bn.applied(), s.c_in)?)
    } else {
        None
    };
    let (bx, mean, invstd) = (
        bn.x.bf16(op, "bn x")?,
        bn.saved_mean.f32(op, "saved_mean")?,
        bn.saved_invstd.f32(op, "saved_invstd")?,
    );
    if recompute && !v3 && plan.is_none() {
        return Err(BackendError::Shape {
            op,
            detail: format!(
                "{s:?}: no stored batch-norm output and no v2 epilogue to recompute its mask"
            ),
        });
    }
    if !v3 && plan.is_none() {
        // No fused kernel: the plain data gradient first (before the workspace is held).
        be.conv_backward_data(s, dy, w, dx, accumulate)?;
    }
    let mut work = be.work();
    let wk = &mut *work;
    let records = match plan {
        // The v3 GEMM's batch-norm epilogue writes conv2's records (128-row tiles).
        None if v3 => {
            let records = rows.div_ceil(TILE_ROWS);
            ensure(&be.dev, &mut wk.f32a, 2 * records * c, op)?;
            let part = wk.f32a.as_mut().expect("ensured");
            let (dys, ws, dxs) = (dy.bf16(op, "dy")?, w.bf16(op, "w")?, dx.bf16_mut(op, "dx")?);
            let epilogue = DgradBn {
                part: &mut *part,
                bn_y,
                bn_x: bx,
                mean,
                invstd,
                residual,
                gamma_beta: applied.as_ref().map(|a| (a.gamma, a.beta)),
                relu: bn.relu,
                bn_signs: signs,
            };
            be.conv3_backward_data(op, s, dys, ws, dxs, accumulate, Some(epilogue))?;
            records
        }
        Some(dgrad) => {
            let mut launch = Conv2Launch {
                kernel: dgrad.bn_epilogue_kernel,
                ..dgrad.launch
            };
            launch.args.accumulate = i32::from(accumulate);
            let records = launch.grid.0 as usize * launch.grid.2 as usize;
            let cfg = be.conv2_prepare(op, &launch)?;
            ensure(&be.dev, &mut wk.f32a, 2 * records * c, op)?;
            let part = wk.f32a.as_mut().expect("ensured");
            let (dys, ws, dxs) = (dy.bf16(op, "dy")?, w.bf16(op, "w")?, dx.bf16_mut(op, "dx")?);
            let mut scratch = be.conv2.lock().unwrap_or_else(|e| e.into_inner());
            let ws = be.dgrad_weights(op, &launch, s, ws, &mut scratch)?;
            let gemm = Conv2DgradBn {
                dy: dys.into(),
                wt: ws.into(),
                dx: dxs.into(),
                args: launch.args,
                part: (&mut *part).into(),
                bn_y: bn_y.map(Into::into),
                bn_x: bx.into(),
                mean: mean.into(),
                invstd: invstd.into(),
                residual: residual.map(Into::into),
                gamma: applied.as_ref().map(|a| a.gamma.into()),
                beta: applied.as_ref().map(|a| a.beta.into()),
                relu: i32::from(bn.relu),
            };
            be.launch(op, dgrad.bn_epilogue_kernel, cfg, gemm)?;
            // dx written, x read for Σg·x̂, the prior dx, the residual's gradient, y for the mask.
            let streams = 2
                + usize::from(accumulate)
                + usize::from(bn.residual_grad.is_some())
                + usize::from(bn_y.is_some());
            be.note_work(
                2 * (s.y_len() + s.w_len() + s.x_len() * streams) + 8 * records * c,
                s.flops(),
            );
            records
        }
        None => {
            // Then its finish and the slab sums.
            let dxs = dx.bf16_mut(op, "dx")?;
            let total = (rows * c) as i64;
            let finish = BnGradFinish {
                g: (&mut *dxs).into(),
                residual: residual.map(Into::into),
                y: bn_y.map(Into::into),
                total,
            };
            be.launch(op, "bn_grad_finish", elementwise_cfg(rows * c), finish)?;
            let (per, slabs) = be.slabs(rows);
            let (rows_i, c_i) = (to_i32(op, "rows", rows)?, to_i32(op, "channels", c)?);
            let (per_i, no_relu) = (to_i32(op, "rows per slab", per)?, 0i32);
            ensure(&be.dev, &mut wk.f32a, 2 * slabs * c, op)?;
            let part = wk.f32a.as_mut().expect("ensured");
            let (mut pb, mut pg) = part.split_at_mut(slabs * c);
            let (partial, cfg) = reduction_launch(c, slabs, "bn_bwd_partial");
            let g = &*dxs;
            let sums = BnBwdPartial {
                dy: g.into(),
                y: g.into(),
                x: bx.into(),
                mean: mean.into(),
                invstd: invstd.into(),
                rows: rows_i,
                channels: c_i,
                rows_per_slab: per_i,
                relu: no_relu,
                part_dbeta: (&mut pb).into(),
                part_dgamma: (&mut pg).into(),
            };
            be.launch(op, partial, cfg, sums)?;
            slabs
        }
    };
    let part = wk.f32a.as_ref().expect("ensured");
    let (dbeta, dgamma) = (
        bn.dbeta.f32_mut(op, "dbeta")?,
        bn.dgamma.f32_mut(op, "dgamma")?,
    );
    merge_sums(be, op, part, records, c, dbeta, dgamma, &mut wk.f32b)
}

/// Merges `records` (mean, M2) records (planes of `records × c` at the start of `part`;
/// record b holds rows [b·per, (b + 1)·per) of `rows`) into `moments` (mean, M2, count),
/// in one launch or, beyond [`MERGE_SINGLE`] records, through groups in `mid`.
#[allow(clippy::too_many_arguments)]
fn merge_moments(
    be: &CudaBackend,
    op: &'static str,
    part: &CudaSlice<f32>,
    records: usize,
    rows: usize,
    c: usize,
    per: usize,
    moments: &mut CudaSlice<f32>,
    mid: &mut Option<CudaSlice<f32>>,
) -> Result<(), BackendError> {
    let (rows_i, c_i, records_i) = (
        to_i32(op, "rows", rows)?,
        to_i32(op, "channels", c)?,
        to_i32(op, "records", records)?,
    );
    let (pm, pv) = part.split_at(records * c);
    let (mut mm, mut rest) = moments.split_at_mut(c);
    let (mut mq, mut mn) = rest.split_at_mut(c);
    let per_i = per as i64;
    if records <= MERGE_SINGLE {
        let merge = BnStatsMerge {
            part_mean: (&pm).into(),
            part_m2: (&pv).into(),
            records: records_i,
            rows: rows_i,
            channels: c_i,
            rows_per_record: per_i,
            per_group: records_i,
            out_mean: (&mut mm).into(),
            out_m2: (&mut mq).into(),
            out_count: Some((&mut mn).into()),
        };
        return be.launch(op, "bn_stats_merge", merge_cfg(c, 1), merge);
    }
    let groups = records.div_ceil(MERGE_GROUP);
    ensure(&be.dev, mid, 2 * groups * c, op)?;
    let (mut gm, mut gq) = mid.as_mut().expect("ensured").split_at_mut(groups * c);
    let (group_i, groups_i) = (MERGE_GROUP as i32, to_i32(op, "groups", groups)?);
    let by_group = BnStatsMerge {
        part_mean: (&pm).into(),
        part_m2: (&pv).into(),
        records: records_i,
        rows: rows_i,
        channels: c_i,
        rows_per_record: per_i,
        per_group: group_i,
        out_mean: (&mut gm).into(),
        out_m2: (&mut gq).into(),
        out_count: None,
    };
    be.launch(op, "bn_stats_merge", merge_cfg(c, groups), by_group)?;
    let per_group = per_i * MERGE_GROUP as i64;
    let groups_merged = BnStatsMerge {
        part_mean: (&gm).into(),
        part_m2: (&gq).into(),
        records: groups_i,
        rows: rows_i,
        channels: c_i,
        rows_per_record: per_group,
        per_group: groups_i,
        out_mean: (&mut mm).into(),
        out_m2: (&mut mq).into(),
        out_count: Some((&mut mn).into()),
    };
    be.launch(op, "bn_stats_merge", merge_cfg(c, 1), groups_merged)
}

/// Sums `records` (Σg, Σg·x̂) records (planes of `records × c` at the start of `part`) into
/// dβ and dγ, in one launch or through groups in `mid`.
#[allow(clippy::too_many_arguments)]
pub(super) fn merge_sums(
    be: &CudaBackend,
    op: &'static str,
    part: &CudaSlice<f32>,
    records: usize,
    c: usize,
    dbeta: &mut CudaSlice<f32>,
    dgamma: &mut CudaSlice<f32>,
    mid: &mut Option<CudaSlice<f32>>,
) -> Result<(), BackendError> {
    let (c_i, records_i) = (to_i32(op, "channels", c)?, to_i32(op, "records", records)?);
    let (pb, pg) = part.split_at(records * c);
    if records <= MERGE_SINGLE {
        let merge = BnSumsMerge {
            part_b: (&pb).into(),
            part_g: (&pg).into(),
            records: records_i,
            channels: c_i,
            per_group: records_i,
            out_b: dbeta.into(),
            out_g: dgamma.into(),
        };
        return be.launch(op, "bn_sums_merge", merge_cfg(c, 1), merge);
    }
    let groups = records.div_ceil(MERGE_GROUP);
    ensure(&be.dev, mid, 2 * groups * c, op)?;
    let (mut gb, mut gg) = mid.as_mut().expect("ensured").split_at_mut(groups * c);
    let (group_i, groups_i) = (MERGE_GROUP as i32, to_i32(op, "groups", groups)?);
    let by_group = BnSumsMerge {
        part_b: (&pb).into(),
        part_g: (&pg).into(),
        records: records_i,
        channels: c_i,
        per_group: group_i,
        out_b: (&mut gb).into(),
        out_g: (&mut gg).into(),
    };
    be.launch(op, "bn_sums_merge", merge_cfg(c, groups), by_group)?;
    let groups_merged = BnSumsMerge {
        part_b: (&gb).into(),
        part_g: (&gg).into(),
        records: groups_i,
        channels: c_i,
        per_group: groups_i,
        out_b: dbeta.into(),
        out_g: dgamma.into(),
    };
    be.launch(op, "bn_sums_merge", merge_cfg(c, 1), groups_merged)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_parses_and_a_bad_value_names_it() {
        // On unless turned off: its GPU tests passed and it measured faster on an H100.
        assert!(parse_bn_fusion(None).unwrap());
        assert!(parse_bn_fusion(Some("")).unwrap());
        assert!(parse_bn_fusion(Some(" 1 ")).unwrap());
        assert!(!parse_bn_fusion(Some("0")).unwrap());
        let e = parse_bn_fusion(Some("yes")).unwrap_err().to_string();
        assert!(
            e.contains("BIRDTRAIN_BN_FUSION=\"yes\"") && e.contains("expected 0"),
            "{e}"
        );
    }

    #[test]
    fn merges_split_where_one_launch_would_walk_too_many_records() {
        // One launch: at most 8 records per lane (32 lanes).
        assert_eq!(MERGE_SINGLE / 32, 8);
        // resnet50's stem at batch 256: 25 088 tiles → 196 groups, then one merge of 196.
        let groups = 25_088usize.div_ceil(MERGE_GROUP);
        assert_eq!(groups, 196);
        assert!(groups <= MERGE_SINGLE);
        assert_eq!(TILE_ROWS, crate::cuda::conv::Conv2Tile::T128x64.dims().0);
        assert_eq!(TILE_ROWS, crate::cuda::conv::Conv2Tile::T128x128.dims().0);
    }
}
