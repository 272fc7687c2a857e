//! The GPU training path: one driver thread per GPU, NCCL for everything between GPUs.
//!
//! [`train_on_gpus`] resolves the launch plan (`--gpus`, `--nodes`, `--node-rank`, `--master`
//! or torchrun's variables), runs the rendezvous (node 0 creates the NCCL unique id; a single
//! node just creates it), builds the input engine with a pinned-memory allocator and starts
//! one driver thread per local GPU through [`crate::dist::ranks::run_local_ranks`]. The NCCL
//! communicator is created even for `--gpus 1`, so one GPU takes the same path as many.
//!
//! Each driver thread ([`rank`]) owns a [`crate::cuda::CudaBackend`] wrapped so its input
//! op reads the staging ring's device slot ([`staged::StagedBackend`]), a ring of
//! `--prefetch-depth` slots fed from the engine ([`feed::Feeder`]), a
//! [`crate::dist::nccl::GradientSync`] over `--bucket-mb` buckets and the fused
//! [`crate::cuda::optim::DeviceOptimizer`]. Rank 0 validates, writes metrics and checkpoints.
//!
//! Differences from the generic loop of `run.rs`, on purpose:
//! - each replica keeps its own batch-norm running statistics (as PyTorch DDP); the
//!   checkpoint holds rank 0's. With `--sync-bn` every GPU normalises with the global batch's
//!   statistics ([`crate::model::Network::train_step_synced`], summed over NCCL through the
//!   host), so the running statistics agree too;
//! - the checkpoint's weights are the optimizer's f32 master weights;
//! - the optimizer's state (momentum / Adam moments, step count) lives on the GPU; rank 0
//!   downloads it for each checkpoint and writes it in the host optimizer's format and
//!   layout ([`crate::cuda::optim::DeviceState`]), so a checkpoint's optimizer file means
//!   the same to the CPU and GPU paths and a resumed run continues with its momentum.

mod feed;
mod layout;
mod pinned;
mod rank;
mod report;
mod staged;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use pipeline::{BatchAllocator, Pipeline, PipelineBuilder, Split};

use super::checkpoint::DatasetStamp;
use super::checkpoint::{CheckpointMeta, DataPosition};
use super::config::TrainConfig;
use super::device::DeviceChoice;
use super::metrics::{read_metrics, truncate_metrics_from, MetricsAccumulator};
use super::resume::{check_resume, copy_metrics, resume_position};
use super::run::{optimizer_kind, source, TrainOutcome};
use super::summary::{format_summary, SummaryHeader};
use super::TrainError;
use crate::dist::args::DistArgs;
use crate::dist::launch::{self, LaunchPlan};
use crate::dist::rendezvous::{self, NodeInfo};
use crate::dist::trace::TraceRecorder;
use crate::dist::{nccl, ranks};
use crate::model::{Graph, HeadPolicy, ModelState};
use crate::optim::{Hyper, Optimizer, Schedule};

pub(crate) use rank::RankReport;

/// Steps between two comparisons of the replicas' weight checksums.
pub(crate) const CHECKSUM_EVERY: u64 = 50;

/// Everything the driver threads share (read-only).
pub(crate) struct Shared {
    pub(crate) cfg: TrainConfig,
    pub(crate) dist: DistArgs,
    pub(crate) graph: Graph,
    pub(crate) classes: Vec<String>,
    pub(crate) train_pipe: Pipeline,
    pub(crate) valid_pipe: Pipeline,
    pub(crate) state: ModelState,
    /// The resumed checkpoint's optimizer state (host layout); `None` starts fresh.
    pub(crate) optimizer: Option<Optimizer>,
    pub(crate) position: DataPosition,
    pub(crate) schedule: Schedule,
    pub(crate) hyper: Hyper,
    pub(crate) steps_per_epoch: usize,
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) trace: TraceRecorder,
    pub(crate) metrics_path: PathBuf,
    pub(crate) checksum_every: u64,
    pub(crate) world_size: usize,
}

#[derive(Parser)]
struct DefaultsOnly {
    #[command(flatten)]
    dist: DistArgs,
}

/// The flags' defaults, as `birdtrain train` parses them with none given.
pub(crate) fn default_dist_args() -> DistArgs {
    DefaultsOnly::try_parse_from(["birdtrain"])
        .map(|d| d.dist)
        .expect("DistArgs parses with no arguments (every field has a default)")
}

fn config_error(flag: &'static str, value: impl ToString, hint: impl ToString) -> TrainError {
    TrainError::InvalidConfig {
        flag,
        value: value.to_string(),
        hint: hint.to_string(),
    }
}

fn build_pipeline(
    cfg: &TrainConfig,
    split: Split,
    replicas: usize,
    allocator: Option<Arc<dyn BatchAllocator>>,
) -> Result<Pipeline, TrainError> {
    let training = split == Split::Train;
    let mut b = PipelineBuilder::new(source(cfg))
        .split(split)
        .image_size(cfg.image_size)
        .seed(cfg.seed)
        .replicas(replicas)
        .batch_size(cfg.batch_size)
        .shuffle(training)
        .last_batch(if training {
            cfg.last_batch
        } else {
            pipeline::LastBatch::Partial
        })
        .on_bad_image(cfg.on_bad_image)
        .bad_files_report(cfg.out.join(format!("bad_files_{split}.txt")));
    if cfg.workers > 0 {
        b = b.workers(cfg.workers);
    }
    if let Some(dir) = &cfg.cache_dir {
        b = b.cache_dir(dir.clone());
    }
    if let Some(a) = allocator {
        b = b.allocator(a);
    }
    Ok(b.build()?)
}

/// The launch plan for `--gpus n` and the distributed flags.
pub(crate) fn launch_plan(n: usize, dist: &DistArgs) -> Result<LaunchPlan, TrainError> {
    let flags = dist
        .launch_flags(Some(&n.to_string()))
        .map_err(|e| config_error("--gpus", n, e))?;
    launch::resolve(&flags, &launch::process_env, &launch::detect_cuda_devices())
        .map_err(|e| config_error("--gpus", n, e))
}

/// Trains on `n` GPUs of this node (and those of the other nodes, if any) through NCCL.
pub(crate) fn train_on_gpus(
    cfg: &TrainConfig,
    stop: &AtomicBool,
) -> Result<TrainOutcome, TrainError> {
    let wall = Instant::now();
    let DeviceChoice::Cuda(n) = cfg.device else {
        return Err(config_error(
            "--gpus",
            0,
            "the NCCL path needs at least one GPU",
        ));
    };
    let dist = cfg.dist.clone().unwrap_or_else(default_dist_args);
    if dist.prefetch_depth == 0 {
        return Err(config_error(
            "--prefetch-depth",
            0,
            "use at least 1 staging slot (2 overlaps the copy of batch k+1 with batch k)",
        ));
    }
    let plan = launch_plan(n, &dist)?;
    for note in &plan.overrides {
        tracing::info!("{note}");
    }
    let resumed = match &cfg.resume {
        Some(run) => Some((run.clone(), CheckpointMeta::load(run)?)),
        None => None,
    };
    // The validation engine also gives the dataset's fingerprint for the rendezvous.
    let valid_pipe = build_pipeline(cfg, Split::Valid, 1, None)?;
    let me = NodeInfo {
        nodes: plan.nodes,
        node_rank: plan.node_rank,
        local_gpus: plan.devices.len(),
        fingerprint: valid_pipe.fingerprint(),
        model: cfg.arch.name().to_string(),
    };
    let master = plan.master.as_ref().map(ToString::to_string);
    let assignment =
        rendezvous::rendezvous(master.as_deref(), &me, dist.rendezvous_timeout(), || {
            nccl::new_unique_id().map_err(|e| e.to_string())
        })
        .map_err(|e| TrainError::Device {
            device: format!("node {} of {}", plan.node_rank, plan.nodes),
            reason: format!("rendezvous failed: {e}"),
        })?;
    let world_size = assignment.world_size;
    let mut run_cfg = cfg.clone();
    // The global batch is every rank's micro-batch; the learning rate scales with it.
    run_cfg.replicas = world_size;
    let first = *plan.devices.first().ok_or_else(|| {
        config_error(
            "--gpus",
            n,
            "no GPU in the launch plan (--gpus 0 trains on the CPU)",
        )
    })?;
    let ctx = cudarc::driver::CudaContext::new(first).map_err(|e| TrainError::Device {
        device: format!("cuda:{first}"),
        reason: e.to_string(),
    })?;
    let allocator = pinned::pinned_allocator(ctx);
    let train_pipe = build_pipeline(&run_cfg, Split::Train, world_size, Some(allocator.clone()))?;
    let classes = train_pipe.classes().to_vec();
    let graph = Graph::new(cfg.arch, classes.len());
    let steps_per_epoch = train_pipe.steps_per_epoch();
    if steps_per_epoch == 0 {
        return Err(config_error(
            "--batch-size",
            cfg.batch_size,
            format!(
                "with --last-batch drop the {} training images make no full global batch of {}",
                train_pipe.len(),
                run_cfg.global_batch()
            ),
        ));
    }
    super::run::warn_about_dataset(&run_cfg, classes.len(), train_pipe.len());
    let schedule = Schedule {
        base_lr: run_cfg.scaled_lr_for(train_pipe.len()),
        steps_per_epoch: steps_per_epoch as u64,
        warmup_epochs: cfg.warmup_epochs,
        total_epochs: cfg.epochs as u32,
        decay: cfg.schedule,
    };
    let hyper = Hyper {
        weight_decay: cfg.weight_decay,
        ..Hyper::default()
    };
    let (state, optimizer, position) = initial_state(
        &run_cfg,
        &graph,
        &classes,
        hyper,
        resumed.as_ref(),
        &DatasetStamp::of(&train_pipe),
    )?;
    let metrics_path = cfg.out.join("metrics.jsonl");
    if plan.is_master() {
        match &resumed {
            Some((run, _)) => {
                if run != &cfg.out {
                    copy_metrics(&run.join("metrics.jsonl"), &metrics_path)?;
                }
                truncate_metrics_from(&metrics_path, position.epoch + 1)?;
            }
            None => {
                let _ = std::fs::remove_file(&metrics_path);
            }
        }
    }
    if cfg.verbose && plan.is_master() {
        println!(
            "model {} ({} parameters) · {} GPU(s) on {} node(s) through NCCL · global batch {} ({} per GPU) · lr {:.6} · prefetch depth {} · buckets of {} MiB · batch norm {} · {} steps per epoch",
            cfg.arch,
            graph.param_count(),
            world_size,
            plan.nodes,
            run_cfg.global_batch(),
            cfg.batch_size,
            schedule.base_lr,
            dist.prefetch_depth,
            dist.bucket_mb,
            if dist.sync_bn && !cfg.freeze_bn {
                "synchronised across GPUs"
            } else {
                "per GPU"
            },
            steps_per_epoch
        );
    }
    let trace = if dist.trace.is_some() {
        TraceRecorder::new()
    } else {
        TraceRecorder::disabled()
    };
    let shared = Arc::new(Shared {
        cfg: run_cfg,
        dist: dist.clone(),
        graph,
        classes,
        train_pipe,
        valid_pipe,
        state,
        optimizer,
        position,
        schedule,
        hyper,
        steps_per_epoch,
        stop: Arc::new(AtomicBool::new(false)),
        trace: trace.clone(),
        metrics_path,
        checksum_every: CHECKSUM_EVERY,
        world_size,
    });
    let reports = run_with_stop_bridge(stop, &shared.stop, || {
        let body_shared = shared.clone();
        ranks::run_local_ranks(&plan, &assignment, dist.rendezvous_timeout(), move |ctx| {
            rank::drive(&body_shared, ctx)
        })
    })
    .map_err(ranks_error)?;
    if let Some(path) = &dist.trace {
        trace.save(path).map_err(|e| TrainError::Device {
            device: "trace".into(),
            reason: format!("cannot write {}: {e}", path.display()),
        })?;
    }
    let (buffers, bytes) = allocator.allocated();
    let pinned_line = format!(
        "engine batches assembled in pinned host memory: {buffers} buffer(s), {:.1} MiB",
        bytes as f64 / (1024.0 * 1024.0)
    );
    outcome(cfg, &shared, &plan, reports, wall.elapsed(), &pinned_line)
}

/// Runs `f` while a helper thread copies the caller's `stop` flag (Ctrl-C) into `local`, which
/// the driver threads (needing `'static` data) poll.
fn run_with_stop_bridge<R>(stop: &AtomicBool, local: &Arc<AtomicBool>, f: impl FnOnce() -> R) -> R {
    let finished = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !finished.load(Ordering::SeqCst) {
                if stop.load(Ordering::SeqCst) {
                    local.store(true, Ordering::SeqCst);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let r = f();
        finished.store(true, Ordering::SeqCst);
        r
    })
}

/// A rank's failure as the trainer's error: the trainer's own errors pass through unchanged.
fn ranks_error(e: ranks::RanksError) -> TrainError {
    match e {
        ranks::RanksError::Body { rank, source } => match source.downcast::<TrainError>() {
            Ok(train) => train,
            Err(other) => TrainError::Device {
                device: format!("GPU rank {rank}"),
                reason: format!("{other:#}"),
            },
        },
        other => TrainError::Device {
            device: "GPUs".into(),
            reason: other.to_string(),
        },
    }
}

/// The starting weights, optimizer state (resume only) and data position: a checkpoint,
/// `--init-from` or a fresh init.
fn initial_state(
    cfg: &TrainConfig,
    graph: &Graph,
    classes: &[String],
    hyper: Hyper,
    resumed: Option<&(PathBuf, CheckpointMeta)>,
    dataset: &DatasetStamp,
) -> Result<(ModelState, Option<Optimizer>, DataPosition), TrainError> {
    match resumed {
        Some((run, meta)) => {
            check_resume(cfg, run, meta, classes)?;
            let state = ModelState::load_safetensors(
                graph,
                &run.join(&meta.model_file),
                HeadPolicy::Strict,
            )?;
            let position = resume_position(cfg, run, meta, dataset)?;
            let mut optimizer = Optimizer::new(optimizer_kind(cfg), hyper, graph.params());
            optimizer.load(&run.join(&meta.optimizer_state_file))?;
            Ok((state, Some(optimizer), position))
        }
        None => {
            let state = match &cfg.init_from {
                Some(path) => ModelState::load_safetensors(
                    graph,
                    path,
                    HeadPolicy::ReplaceMismatched { seed: cfg.seed },
                )?,
                None => ModelState::init(graph, cfg.seed),
            };
            Ok((
                state,
                None,
                DataPosition {
                    epoch: 0,
                    step_in_epoch: 0,
                    samples_in_epoch: 0,
                    global_step: 0,
                    partial_train: MetricsAccumulator::default(),
                },
            ))
        }
    }
}

fn outcome(
    cfg: &TrainConfig,
    shared: &Shared,
    plan: &LaunchPlan,
    reports: Vec<RankReport>,
    wall: Duration,
    pinned_line: &str,
) -> Result<TrainOutcome, TrainError> {
    let first = reports
        .first()
        .ok_or_else(|| config_error("--gpus", 0, "no driver thread reported"))?;
    let lines = if plan.is_master() && shared.metrics_path.exists() {
        read_metrics(&shared.metrics_path)?
    } else {
        Vec::new()
    };
    let header = SummaryHeader {
        title: format!(
            "{} · {} classes · {} GPU(s) via NCCL · global batch {}",
            cfg.arch,
            shared.classes.len(),
            shared.world_size,
            shared.cfg.global_batch()
        ),
        wall_seconds: wall.as_secs_f64(),
        out: cfg.out.clone(),
        // Each GPU's share is printed on its own line below.
        data_wait_share: None,
    };
    let replica_checksums: Vec<u64> = reports.iter().map(|r| r.checksum).collect();
    let in_sync = replica_checksums.windows(2).all(|w| w[0] == w[1]);
    let mut summary = format_summary(&header, &lines);
    for r in &reports {
        summary.push('\n');
        summary.push_str(&r.data_wait_line);
    }
    summary.push('\n');
    summary.push_str(pinned_line);
    summary.push_str(&format!(
        "\nweights checksum {:016x} on {} local GPU(s){} · {} cross-rank checks passed",
        replica_checksums[0],
        replica_checksums.len(),
        if in_sync {
            ", identical"
        } else {
            ", MISMATCH (replicas diverged)"
        },
        first.checks_passed
    ));
    if cfg.verbose {
        // Every node prints its own GPUs' lines; only node 0 has the metrics.
        println!("{summary}");
    }
    Ok(TrainOutcome {
        interrupted: first.interrupted,
        epochs_done: first.position.epoch,
        global_step: first.position.global_step,
        last_valid: first.last_valid,
        out: cfg.out.clone(),
        summary,
        replica_checksums,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_the_cli_defaults() {
        let d = default_dist_args();
        assert_eq!(d.prefetch_depth, 2);
        assert_eq!(d.bucket_mb, 25.0);
        assert!(d.trace.is_none() && d.nodes.is_none() && d.master.is_none());
    }

    #[test]
    fn the_stop_bridge_forwards_ctrl_c_to_the_driver_threads() {
        let outer = AtomicBool::new(false);
        let local = Arc::new(AtomicBool::new(false));
        let seen = run_with_stop_bridge(&outer, &local, || {
            outer.store(true, Ordering::SeqCst);
            // The driver threads poll; bounded so a broken bridge fails instead of hanging.
            let start = Instant::now();
            while !local.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(30) {
                std::thread::sleep(Duration::from_millis(5));
            }
            local.load(Ordering::SeqCst)
        });
        assert!(seen);
    }

    #[test]
    fn a_trainer_error_from_a_rank_passes_through_unchanged() {
        let e = ranks_error(ranks::RanksError::Body {
            rank: 1,
            source: anyhow::Error::new(config_error("--bucket-mb", 0, "positive")),
        });
        assert!(
            matches!(
                e,
                TrainError::InvalidConfig {
                    flag: "--bucket-mb",
                    ..
                }
            ),
            "{e}"
        );
        let e = ranks_error(ranks::RanksError::Body {
            rank: 2,
            source: anyhow::anyhow!("NCCL timed out"),
        });
        let text = e.to_string();
        assert!(
            text.contains("GPU rank 2") && text.contains("NCCL timed out"),
            "{text}"
        );
    }

    #[test]
    fn more_gpus_than_present_is_an_error_listing_the_devices() {
        // This machine may have no GPU: asking for 64 fails either way, naming the flag.
        let e = launch_plan(64, &default_dist_args()).unwrap_err();
        assert!(e.to_string().contains("--gpus"), "{e}");
    }
}
