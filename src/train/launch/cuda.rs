//! The launcher of GPU ranks: one driver thread per GPU, NCCL between them (also across
//! machines).
//!
//! [`launch`] resolves the launch plan (`--gpus`, `--nodes`, `--node-rank`, `--master` or
//! torchrun's variables), runs the rendezvous (node 0 creates the NCCL unique id; a single
//! node just creates it), builds the input engine with a pinned-memory allocator and starts
//! one driver thread per local GPU through [`crate::dist::ranks::run_local_ranks`], each
//! building its rank ([`gpu_rank`]) and running it ([`run_rank`]). The NCCL communicator is
//! created even for `--gpus 1`, so one GPU takes the same path as many (a single GPU can also
//! run without NCCL: [`crate::dist::DistSettings::nccl`]). With the rehearsal's test switch,
//! [`super::rehearsal`] runs the ranks on one GPU instead.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pipeline::Split;

use super::plan::launch_plan;
use super::rehearsal;
use crate::cuda::staging::pinned::pinned_allocator;
use crate::cuda::timeline::GpuTimeline;
use crate::cuda::GpuDevice;
use crate::dist::collective::CollectiveError;
use crate::dist::nccl::{self, Communicator, NcclCollective};
use crate::dist::ranks::{self, RankContext};
use crate::dist::rendezvous::{self, Assignment, NodeInfo};
use crate::dist::single::SingleRank;
use crate::train::config::TrainConfig;
use crate::train::epochs::run_rank;
use crate::train::folder::{CheckpointMeta, RunFolder};
use crate::train::rank::cuda::{config_error, gpu_rank, GpuRankSpec};
use crate::train::report::{Launched, StopWish};
use crate::train::setup::{pipeline_for, start_point, Shared};
use crate::train::TrainError;

/// Runs `f` while a helper thread copies the caller's stop wishes into `local`, which the
/// driver threads (needing `'static` data) poll; an error when the OS refuses that thread.
fn with_stop_bridge<R>(
    stop: &StopWish<'_>,
    ranks: usize,
    rank_offset: usize,
    local: &Arc<Vec<AtomicBool>>,
    f: impl FnOnce() -> R,
) -> Result<R, TrainError> {
    let finished = AtomicBool::new(false);
    std::thread::scope(|s| {
        pipeline::threads::spawn_scoped(s, "stop-bridge", || {
            while !finished.load(Ordering::SeqCst) {
                for i in 0..ranks {
                    if stop(rank_offset + i, u64::MAX) {
                        local[i].store(true, Ordering::SeqCst);
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })?;
        let r = f();
        finished.store(true, Ordering::SeqCst);
        Ok(r)
    })
}

/// A rank's failure as the error the user sees. In a run of several ranks it names the rank
/// and its device (`device` gives a global rank's): the trainer's own errors keep their kind
/// inside [`TrainError::OnRank`] (unless they name the rank already), the rest become a
/// device error of that rank.
fn ranks_error(e: ranks::RanksError, world: usize, device: &dyn Fn(usize) -> String) -> TrainError {
    match e {
        ranks::RanksError::Body { rank, source } => match source.downcast::<TrainError>() {
            Ok(train) if world > 1 => train.on_rank(rank, device(rank)),
            Ok(train) => *train,
            Err(other) => TrainError::Device {
                device: format!("{} (rank {rank})", device(rank)),
                reason: other.to_string(),
            },
        },
        // A refused thread is no fault of the GPUs: its own line and hint (its name,
        // `gpu-O`, gives the device, not the rank).
        ranks::RanksError::Spawn { rank, source } if world > 1 => {
            TrainError::Thread(source).on_rank(rank, device(rank))
        }
        ranks::RanksError::Spawn { source, .. } => TrainError::Thread(source),
        other => TrainError::Device {
            device: "GPUs".into(),
            reason: other.to_string(),
        },
    }
}

/// Trains on `n` GPUs of this node (and those of the other nodes, if any).
pub(crate) fn launch(
    cfg: &TrainConfig,
    n: usize,
    folder: &RunFolder,
    resumed: Option<&(PathBuf, CheckpointMeta)>,
    stop: &StopWish<'_>,
) -> Result<Launched, TrainError> {
    let dist = &cfg.dist;
    if dist.prefetch_depth == 0 {
        return Err(config_error(
            "--prefetch-depth",
            0,
            "use at least 1 staging slot (2 overlaps the copy of batch k+1 with batch k)",
        ));
    }
    if let Some(ranks) = rehearsal::requested()? {
        return rehearsal::launch(cfg, n, ranks, folder, resumed, stop);
    }
    let plan = launch_plan(n, cfg)?;
    for note in &plan.overrides {
        tracing::info!("{note}");
    }
    let first = *plan.devices.first().ok_or_else(|| {
        config_error(
            "--gpus",
            n,
            "no GPU in the launch plan (--gpus 0 trains on the CPU)",
        )
    })?;
    let alone = plan.devices.len() == 1 && plan.nodes == 1;
    let mut notes = Vec::new();
    let use_nccl = match (dist.nccl, alone) {
        (true, _) | (false, false) => match nccl::ensure_available() {
            Ok(_) => true,
            Err(e) if alone => {
                notes.push(format!("one GPU without NCCL ({e})"));
                false
            }
            Err(e) => {
                return Err(TrainError::Device {
                    device: format!("{} GPUs", plan.devices.len()),
                    reason: e.to_string(),
                })
            }
        },
        (false, true) => false,
    };
    // The validation engine also gives the dataset's fingerprint for the rendezvous.
    let valid = pipeline_for(cfg, folder, Split::Valid, 1, None)?;
    let assignment = if use_nccl {
        let me = NodeInfo {
            nodes: plan.nodes,
            node_rank: plan.node_rank,
            local_gpus: plan.devices.len(),
            fingerprint: valid.fingerprint(),
            model: cfg.arch.name().to_string(),
            start: start_point(resumed),
        };
        let master = plan.rendezvous_addr().map(|m| m.to_string());
        rendezvous::rendezvous(master.as_deref(), &me, dist.rendezvous_timeout(), || {
            nccl::new_unique_id().map_err(|e| e.to_string())
        })
        .map_err(|e| TrainError::Device {
            device: format!("node {} of {}", plan.node_rank, plan.nodes),
            reason: format!("rendezvous failed: {e}"),
        })?
    } else {
        Assignment {
            rank_offset: 0,
            world_size: 1,
            node_gpus: vec![1],
            unique_id: Vec::new(),
        }
    };
    let world = assignment.world_size;
    let ctx = cudarc::driver::CudaContext::new(first).map_err(|e| TrainError::Device {
        device: format!("cuda:{first}"),
        reason: e.to_string(),
    })?;
    let allocator = pinned_allocator(ctx);
    let train = pipeline_for(cfg, folder, Split::Train, world, Some(allocator.clone()))?;
    let shared = Arc::new(Shared::new(
        cfg,
        world,
        resumed,
        train,
        valid,
        folder.clone(),
        plan.is_master(),
    )?);
    let devices = format!(
        "{world} GPU(s) on {} node(s){} · prefetch depth {} · buckets of {} MiB · batch norm {}",
        plan.nodes,
        if use_nccl { " via NCCL" } else { "" },
        dist.prefetch_depth,
        dist.bucket_mb,
        if cfg.sync_bn && !cfg.freeze_bn {
            "synchronised across GPUs"
        } else {
            "per GPU"
        }
    );
    if plan.is_master() {
        shared.say_start(&devices, resumed);
    }
    let local_stops: Arc<Vec<AtomicBool>> = Arc::new(
        (0..plan.devices.len())
            .map(|_| AtomicBool::new(false))
            .collect(),
    );
    let timeout = dist.collective_timeout();
    let reports = if use_nccl {
        with_stop_bridge(
            stop,
            plan.devices.len(),
            assignment.rank_offset,
            &local_stops,
            || {
                let body_shared = shared.clone();
                let stops = local_stops.clone();
                ranks::run_local_ranks(&plan, &assignment, dist.rendezvous_timeout(), move |ctx| {
                    let RankContext {
                        rank,
                        local_index,
                        ordinal,
                        comm,
                        aborts,
                        ..
                    } = ctx;
                    let stops = stops.clone();
                    // Every communicator of this process, not only this rank's: the other
                    // local ranks must not wait in their collectives for this one.
                    let abort_early = move |reason: &str| {
                        aborts.fail(rank, reason);
                    };
                    let spec = GpuRankSpec {
                        rank,
                        local_index,
                        ordinal,
                        abort_early: &abort_early,
                    };
                    gpu_rank(&body_shared, spec, |device| {
                        nccl_collective(comm, device, &body_shared, rank, timeout)
                    })
                    .and_then(|mut r| {
                        run_rank(&body_shared, &mut r, &move |_| {
                            stops[local_index].load(Ordering::SeqCst)
                        })
                    })
                    .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
                })
            },
        )?
        .map_err(|e| {
            ranks_error(e, world, &|rank| {
                let ordinal = rank
                    .checked_sub(assignment.rank_offset)
                    .and_then(|local| plan.devices.get(local));
                match ordinal {
                    Some(o) => format!("cuda:{o}"),
                    None => "a GPU of another node".into(),
                }
            })
        })?
    } else {
        let spec = GpuRankSpec {
            rank: 0,
            local_index: 0,
            ordinal: first,
            abort_early: &|_| {},
        };
        let mut r = gpu_rank(&shared, spec, |device| {
            let mut single = SingleRank::new(Some(device.clone()));
            if shared.trace.is_enabled() {
                match GpuTimeline::new(shared.trace.clone(), 0, device.stream()) {
                    Ok(t) => single.timeline = Some(t),
                    Err(e) => tracing::warn!("no trace timeline: {e}"),
                }
            }
            Ok(single)
        })?;
        let report = run_rank(&shared, &mut r, &|step| stop(0, step))?;
        vec![report]
    };
    let (buffers, bytes) = allocator.allocated();
    notes.push(format!(
        "engine batches assembled in pinned host memory: {buffers} buffer(s), {:.1} MiB",
        bytes as f64 / (1024.0 * 1024.0)
    ));
    Ok(Launched {
        shared,
        reports,
        devices,
        notes,
        writer: plan.is_master(),
    })
}

/// The NCCL collective of a rank, with its trace timeline when tracing, and with `--sync-bn`
/// (batch norm not frozen) the side communicator its BN sums run on, on the device, beside
/// the gradient buckets.
fn nccl_collective(
    comm: Communicator,
    device: &Arc<GpuDevice>,
    shared: &Shared,
    rank: usize,
    timeout: Duration,
) -> Result<NcclCollective, TrainError> {
    let mut c = NcclCollective::new(comm, device.clone(), timeout);
    if shared.trace.is_enabled() {
        match GpuTimeline::new(shared.trace.clone(), rank as u32, device.stream()) {
            Ok(t) => c.set_timeline(Some(t)),
            Err(e) => tracing::warn!("rank {rank}: no trace timeline: {e}"),
        }
    }
    let cfg = &shared.cfg;
    if cfg.sync_bn && !cfg.freeze_bn {
        c.open_side_sums(cfg.dist.rendezvous_timeout())
            .map_err(|e| TrainError::from(CollectiveError::from(e)))?;
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ranks_error_names_the_rank_and_device_once_and_keeps_its_kind() {
        let device = |rank: usize| format!("cuda:{}", rank + 4);
        // A trainer error that does not say where it happened (an out-of-memory of the
        // backend, a refused setting): the rank and its device in front, the kind kept.
        let oom = TrainError::Backend(crate::backend::BackendError::OutOfMemory {
            bytes: 1 << 30,
            what: "activations".into(),
            hint: "--batch-size 64 fits".into(),
        });
        let e = ranks_error(
            ranks::RanksError::Body {
                rank: 1,
                source: Box::new(oom),
            },
            2,
            &device,
        );
        let text = e.to_string();
        assert!(text.starts_with("rank 1 (cuda:5): "), "{text}");
        assert!(matches!(e.unranked(), TrainError::Backend(_)), "{e:?}");
        let e = ranks_error(
            ranks::RanksError::Body {
                rank: 1,
                source: Box::new(config_error("--bucket-mb", 0, "positive")),
            },
            2,
            &device,
        );
        assert!(
            matches!(
                e.unranked(),
                TrainError::InvalidConfig {
                    flag: "--bucket-mb",
                    ..
                }
            ),
            "{e}"
        );
        // One that names its rank already is not named twice.
        let diverged = TrainError::Diverged {
            rank: 1,
            step: 7,
            mine: 1,
            reference: 2,
        };
        let e = ranks_error(
            ranks::RanksError::Body {
                rank: 1,
                source: Box::new(diverged),
            },
            2,
            &device,
        );
        assert!(matches!(e, TrainError::Diverged { rank: 1, .. }), "{e}");
        assert_eq!(e.to_string().matches("rank 1").count(), 1, "{e}");
        // One rank alone: nothing to tell apart.
        let e = ranks_error(
            ranks::RanksError::Body {
                rank: 0,
                source: Box::new(config_error("--bucket-mb", 0, "positive")),
            },
            1,
            &device,
        );
        assert!(matches!(e, TrainError::InvalidConfig { .. }), "{e}");
        // A failure that is not the trainer's: a device error naming both.
        let e = ranks_error(
            ranks::RanksError::Body {
                rank: 2,
                source: "NCCL timed out".into(),
            },
            3,
            &device,
        );
        let text = e.to_string();
        assert!(
            text.contains("cuda:6 (rank 2)") && text.contains("NCCL timed out"),
            "{text}"
        );
        // A driver thread the OS refused: its own line and hint, the rank named once in
        // front (the thread's name gives only the device).
        let refused = |rank: usize, world: usize| {
            ranks_error(
                ranks::RanksError::Spawn {
                    rank,
                    source: pipeline::threads::ThreadStartError {
                        thread: format!("gpu-{}", rank + 4),
                        source: std::io::Error::from(std::io::ErrorKind::WouldBlock),
                    },
                },
                world,
                &device,
            )
        };
        let e = refused(1, 2);
        let text = e.to_string();
        assert!(
            text.starts_with("rank 1 (cuda:5): could not start thread `gpu-5`"),
            "{text}"
        );
        assert_eq!(text.matches("rank 1").count(), 1, "{text}");
        assert!(matches!(e.unranked(), TrainError::Thread(_)), "{e:?}");
        assert!(matches!(refused(0, 1), TrainError::Thread(_)));
    }
}
