//! The test-only rehearsal of an N-GPU run on one GPU: with `BIRDTRAIN_REHEARSE_RANKS=N`,
//! `--gpus 1` runs N GPU ranks on the plan's one device, each on its own thread with its own
//! backend (compute stream, staging ring, gradient buffer, device optimizer, step totals), joined
//! by the device-side collective of [`crate::dist::device_group`] instead of NCCL (which refuses
//! two ranks on one device). Everything above the collective is the N-GPU code as it runs on N
//! GPUs: the same loop, staging rings, buckets launched from the backward hook, device totals,
//! stop agreement, checksums and checkpoints. Not a user flag: ARCHITECTURE.md documents it as a
//! test switch.
//!
//! `BIRDTRAIN_REHEARSE_FAULT=R@S` (also test-only) makes rank R fail at its first bucket average
//! of global step S, as a device fault would: the fault tests check that the whole process ends
//! at once, naming the rank.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaEvent};
use pipeline::Split;

use super::plan::launch_plan;
use super::rank_threads::join_ranks;
use crate::cuda::rank_reduce::MAX_RANKS;
use crate::cuda::staging::pinned::pinned_allocator;
use crate::cuda::timeline::GpuTimeline;
use crate::cuda::GpuDevice;
use crate::dist::device_group::{DeviceCollective, DeviceGroup};
use crate::dist::same_gpu::SameGpuRank;
use crate::train::config::TrainConfig;
use crate::train::epochs::run_rank;
use crate::train::folder::{CheckpointMeta, RunFolder};
use crate::train::rank::cuda::{config_error, gpu_rank, GpuRankSpec};
use crate::train::report::{Launched, StopWish};
use crate::train::setup::{pipeline_for, Shared};
use crate::train::TrainError;

/// How many GPU ranks to rehearse on the one GPU of `--gpus 1` (test-only).
pub(crate) const RANKS_ENV: &str = "BIRDTRAIN_REHEARSE_RANKS";

/// `R@S`: rank R fails at its first bucket average of global step S (test-only).
pub(crate) const FAULT_ENV: &str = "BIRDTRAIN_REHEARSE_FAULT";

/// A fault to inject: which rank, at which global step (1-based).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fault {
    rank: usize,
    step: u64,
}

/// The rank count `BIRDTRAIN_REHEARSE_RANKS` asks for (`None`: no rehearsal).
pub(crate) fn requested() -> Result<Option<usize>, TrainError> {
    parse_ranks(std::env::var(RANKS_ENV).ok().as_deref())
}

fn parse_ranks(value: Option<&str>) -> Result<Option<usize>, TrainError> {
    let Some(text) = value.map(str::trim).filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    match text.parse::<usize>() {
        Ok(n) if (1..=MAX_RANKS).contains(&n) => Ok(Some(n)),
        _ => Err(TrainError::InvalidConfig {
            flag: RANKS_ENV,
            value: text.to_string(),
            hint: format!(
                "a rank count from 1 to {MAX_RANKS} (a test switch: that many GPU ranks rehearsed on the one GPU of --gpus 1); unset it to train normally"
            ),
        }),
    }
}

fn parse_fault(value: Option<&str>, ranks: usize) -> Result<Option<Fault>, TrainError> {
    let Some(text) = value.map(str::trim).filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    let parsed = text.split_once('@').and_then(|(r, s)| {
        let rank = r.trim().parse::<usize>().ok()?;
        let step = s.trim().parse::<u64>().ok()?;
        (rank < ranks && step >= 1).then_some(Fault { rank, step })
    });
    parsed.map(Some).ok_or_else(|| TrainError::InvalidConfig {
        flag: FAULT_ENV,
        value: text.to_string(),
        hint: format!(
            "RANK@STEP, a rank below {ranks} and a global step from 1, such as 1@3 (a test switch of {RANKS_ENV})"
        ),
    })
}

/// The collective of rehearsed rank `rank`, on `device`.
fn rank_collective(
    device: &Arc<GpuDevice>,
    group: &Arc<DeviceGroup<Arc<CudaEvent>>>,
    rank: usize,
    timeout: Duration,
    fault: Option<Fault>,
    shared: &Shared,
) -> DeviceCollective<SameGpuRank> {
    let ops = SameGpuRank::new(device.clone()).map_err(|e| e.to_string());
    let mut c = DeviceCollective::new(group, rank, timeout, ops);
    if let Some(f) = fault.filter(|f| f.rank == rank) {
        c.fail_at_step(f.step, format!("{FAULT_ENV}={}@{}", f.rank, f.step));
    }
    if shared.trace.is_enabled() {
        match GpuTimeline::new(shared.trace.clone(), rank as u32, device.stream()) {
            Ok(t) => c.set_timeline(Some(t)),
            Err(e) => tracing::warn!("rank {rank}: no trace timeline: {e}"),
        }
    }
    c
}

/// Aborts the group when a rank's thread unwinds before its collective exists (the collective
/// aborts it itself from then on), so no rank waits for a thread that is gone.
struct AbortOnPanic<'a> {
    group: &'a DeviceGroup<Arc<CudaEvent>>,
    rank: usize,
}

impl Drop for AbortOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.group
                .abort(&format!("rank {} stopped: its thread panicked", self.rank));
        }
    }
}

/// Trains `ranks` GPU ranks on the one GPU of `--gpus n` (which must plan one GPU on one node).
pub(crate) fn launch(
    cfg: &TrainConfig,
    n: usize,
    ranks: usize,
    folder: &RunFolder,
    resumed: Option<&(PathBuf, CheckpointMeta)>,
    stop: &StopWish<'_>,
) -> Result<Launched, TrainError> {
    let dist = &cfg.dist;
    let plan = launch_plan(n, cfg)?;
    if plan.nodes != 1 || plan.devices.len() != 1 {
        return Err(config_error(
            "--gpus",
            n,
            format!(
                "{RANKS_ENV}={ranks} rehearses {ranks} ranks on one GPU of one node: run it with --gpus 1 and one node (this launch plans {} GPU(s) on {} node(s))",
                plan.devices.len(),
                plan.nodes
            ),
        ));
    }
    let fault = parse_fault(std::env::var(FAULT_ENV).ok().as_deref(), ranks)?;
    let ordinal = plan.devices[0];
    let valid = pipeline_for(cfg, folder, Split::Valid, 1, None)?;
    let ctx = CudaContext::new(ordinal).map_err(|e| TrainError::Device {
        device: format!("cuda:{ordinal}"),
        reason: e.to_string(),
    })?;
    let allocator = pinned_allocator(ctx);
    let train = pipeline_for(cfg, folder, Split::Train, ranks, Some(allocator.clone()))?;
    let shared = Arc::new(Shared::new(
        cfg,
        ranks,
        resumed,
        train,
        valid,
        folder.clone(),
        true,
    )?);
    let devices = format!(
        "{ranks} GPU ranks rehearsed on cuda:{ordinal} ({RANKS_ENV}: one process, device-side collective, no NCCL) · prefetch depth {} · buckets of {} MiB · batch norm {}",
        dist.prefetch_depth,
        dist.bucket_mb,
        if cfg.sync_bn && !cfg.freeze_bn {
            "synchronised across GPUs"
        } else {
            "per GPU"
        }
    );
    shared.say_start(&devices, resumed);
    let group = DeviceGroup::<Arc<CudaEvent>>::new(ranks);
    let timeout = dist.collective_timeout();
    let reports = std::thread::scope(|s| {
        let handles: Vec<_> = (0..ranks)
            .map(|rank| {
                let (shared, group) = (&shared, &group);
                pipeline::threads::spawn_scoped(
                    s,
                    format!("gpu-{ordinal}-rank-{rank}"),
                    move || {
                        let _guard = AbortOnPanic { group, rank };
                        let abort_early = |reason: &str| {
                            tracing::error!("{reason}");
                            group.abort(reason);
                        };
                        let spec = GpuRankSpec {
                            rank,
                            local_index: rank,
                            ordinal,
                            abort_early: &abort_early,
                        };
                        let mut r = gpu_rank(shared, spec, |device| {
                            Ok(rank_collective(device, group, rank, timeout, fault, shared))
                        })?;
                        run_rank(shared, &mut r, &|step| stop(rank, step))
                    },
                )
            })
            .collect();
        // Before any join: the ranks that started would wait for this one.
        if let Some(Err(e)) = handles.iter().find(|h| h.is_err()) {
            group.abort(&e.to_string());
        }
        join_ranks(handles, &|_| format!("cuda:{ordinal}"))
    })?;
    let (buffers, bytes) = allocator.allocated();
    let notes = vec![format!(
        "engine batches assembled in pinned host memory: {buffers} buffer(s), {:.1} MiB",
        bytes as f64 / (1024.0 * 1024.0)
    )];
    Ok(Launched {
        shared,
        reports,
        devices,
        notes,
        writer: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rank_count_is_one_to_eight_and_anything_else_names_the_variable() {
        assert_eq!(parse_ranks(None).unwrap(), None);
        assert_eq!(parse_ranks(Some("")).unwrap(), None);
        assert_eq!(parse_ranks(Some("2")).unwrap(), Some(2));
        assert_eq!(parse_ranks(Some(" 4 ")).unwrap(), Some(4));
        assert_eq!(parse_ranks(Some("1")).unwrap(), Some(1));
        for bad in ["0", "9", "two", "-1", "2.5"] {
            let e = parse_ranks(Some(bad)).unwrap_err().to_string();
            assert!(e.contains(RANKS_ENV) && e.contains(bad), "{e}");
            assert!(e.contains("from 1 to 8"), "{e}");
        }
    }

    #[test]
    fn a_fault_names_a_rank_of_the_rehearsal_and_a_step_from_one() {
        assert_eq!(parse_fault(None, 2).unwrap(), None);
        assert_eq!(
            parse_fault(Some("1@3"), 2).unwrap(),
            Some(Fault { rank: 1, step: 3 })
        );
        for bad in ["2@3", "1@0", "1", "a@b", "1@-2"] {
            let e = parse_fault(Some(bad), 2).unwrap_err().to_string();
            assert!(e.contains(FAULT_ENV) && e.contains("RANK@STEP"), "{e}");
        }
    }
}
