//! The training loop: pipelines, replicas, optimizer, schedule, validation, checkpoints,
//! metrics, report and summary.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use pipeline::{DatasetSource, Pipeline, PipelineBuilder, Split};

use super::checkpoint::{
    clean_run_folder, CheckpointMeta, DataPosition, DatasetStamp, SIDECAR_FILE,
};
use super::config::{OptimizerChoice, TrainConfig};
use super::device::DeviceChoice;
use super::epoch::{reached_stop_step, train_epoch, validate};
use super::evaluate::summarise;
use super::metrics::{append_metrics, read_metrics, truncate_metrics_from, EpochMetrics};
use super::metrics::{MetricsAccumulator, MetricsSplit};
use super::replicas::Replicas;
use super::report::write_report;
use super::resume::{check_resume, copy_metrics, resume_position, save_checkpoint};
use super::summary::{format_summary, SummaryHeader};
use super::TrainError;
use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::cuda::CudaBackend;
use crate::model::{Graph, HeadPolicy, ModelState, NetworkConfig};
use crate::optim::{Hyper, Optimizer, OptimizerKind, Schedule};

/// How a training run ended.
#[derive(Debug, Clone)]
pub struct TrainOutcome {
    /// Stopped early (Ctrl-C or `stop_after_steps`) after saving a checkpoint.
    pub interrupted: bool,
    /// Epochs completed in total (including those of a resumed run).
    pub epochs_done: u64,
    /// Optimizer steps taken in total.
    pub global_step: u64,
    /// The last validation line, if an epoch finished.
    pub last_valid: Option<EpochMetrics>,
    /// The run folder.
    pub out: PathBuf,
    /// The summary as printed.
    pub summary: String,
    /// xxh3-64 of each replica's final parameters (all equal when replicas stay in sync).
    pub replica_checksums: Vec<u64>,
}

/// Trains as `cfg` says. `stop` is polled after every step (Ctrl-C sets it): the step is
/// finished, a checkpoint saved, and the run returns with `interrupted`.
pub fn train(cfg: &TrainConfig, stop: &AtomicBool) -> Result<TrainOutcome, TrainError> {
    cfg.validate()?;
    refuse_existing_run(cfg)?;
    // The engine writes its bad-files reports into the run folder while it scans, so the
    // folder exists from the start; a run that fails before its first checkpoint removes
    // the folder it created ("nothing half-written").
    let created = !cfg.out.exists();
    std::fs::create_dir_all(&cfg.out).map_err(|source| TrainError::Io {
        path: cfg.out.clone(),
        what: "create the run folder",
        source,
    })?;
    // What an interrupted checkpoint or run left behind (temporary files, superseded tensor
    // files) goes before anything new is written.
    clean_run_folder(&cfg.out);
    let result = train_on_device(cfg, stop);
    if result.is_err() && created && !cfg.out.join(SIDECAR_FILE).exists() {
        let _ = std::fs::remove_dir_all(&cfg.out);
    }
    result
}

/// A fresh run (or a resume into another folder) must not overwrite a run already in `--out`
/// unless `--overwrite` says so.
fn refuse_existing_run(cfg: &TrainConfig) -> Result<(), TrainError> {
    if cfg.overwrite || cfg.resume.as_deref() == Some(cfg.out.as_path()) {
        return Ok(());
    }
    let found: Vec<&str> = [SIDECAR_FILE, "metrics.jsonl"]
        .into_iter()
        .filter(|f| cfg.out.join(f).exists())
        .collect();
    if found.is_empty() {
        return Ok(());
    }
    Err(TrainError::RunExists {
        path: cfg.out.clone(),
        found: found.join(", "),
    })
}

/// Warnings about a training set that makes the figures misleading (the run goes on).
pub(super) fn warn_about_dataset(cfg: &TrainConfig, classes: usize, train_images: usize) {
    if classes == 1 {
        tracing::warn!(
            "the training set has a single class: every prediction is that class, so accuracy is 1.0 by construction (add at least one more class folder)"
        );
    }
    let global = cfg.global_batch();
    if global > train_images && cfg.last_batch != pipeline::LastBatch::Pad {
        tracing::warn!(
            "a global batch of {global} is larger than the {train_images} training images: each step holds all {train_images}, and the learning rate is scaled for {train_images} (hint: a smaller --batch-size)"
        );
    }
}

/// Stops the run on a NaN or infinite training loss (the sum over a step's `count` images),
/// before the diverged weights reach a checkpoint.
pub(super) fn check_loss(
    cfg: &TrainConfig,
    loss_sum: f64,
    count: usize,
    global_step: u64,
    epoch: u64,
    lr: f32,
) -> Result<(), TrainError> {
    if count == 0 || loss_sum.is_finite() {
        return Ok(());
    }
    Err(TrainError::NonFiniteLoss {
        what: "training loss",
        loss: loss_sum / count as f64,
        step: global_step + 1,
        epoch: epoch + 1,
        lr,
        out: cfg.out.clone(),
    })
}

/// Stops the run when validation after epoch `epoch` (counted from 1) gives a NaN or infinite
/// loss: the weights overflowed although each step's loss still looked finite.
pub(super) fn check_valid_loss(
    cfg: &TrainConfig,
    valid: &EpochMetrics,
    global_step: u64,
    lr: f32,
) -> Result<(), TrainError> {
    if valid.loss.is_finite() {
        return Ok(());
    }
    Err(TrainError::NonFiniteLoss {
        what: "validation loss",
        loss: valid.loss,
        step: global_step,
        epoch: valid.epoch,
        lr,
        out: cfg.out.clone(),
    })
}

/// Refuses to checkpoint weights or statistics that overflowed (a loss can stay finite while
/// a batch-norm variance already reached infinity).
pub(super) fn check_finite_state(
    cfg: &TrainConfig,
    graph: &Graph,
    state: &ModelState,
    position: &DataPosition,
    lr: f32,
) -> Result<(), TrainError> {
    let names = graph
        .params()
        .iter()
        .map(|p| &p.name)
        .zip(&state.params)
        .chain(graph.buffers().iter().map(|b| &b.name).zip(&state.buffers));
    for (name, values) in names {
        if values.iter().any(|v| !v.is_finite()) {
            return Err(TrainError::NonFiniteWeights {
                tensor: name.clone(),
                step: position.global_step,
                epoch: position.epoch + u64::from(position.step_in_epoch > 0),
                lr,
                out: cfg.out.clone(),
            });
        }
    }
    Ok(())
}

fn train_on_device(cfg: &TrainConfig, stop: &AtomicBool) -> Result<TrainOutcome, TrainError> {
    match cfg.device {
        DeviceChoice::Cpu => {
            // Replicas share one thread pool and run one after the other.
            let cpu = CpuBackend::new(cfg.threads)?;
            let backends = (0..cfg.replicas).map(|_| cpu.clone()).collect();
            train_with(cfg, stop, backends)
        }
        // The CLI always sets `dist` for CUDA: one driver thread per GPU, NCCL gradient sync.
        DeviceChoice::Cuda(_) if cfg.dist.is_some() => super::gpu::train_on_gpus(cfg, stop),
        DeviceChoice::Cuda(n) => {
            // Library callers without `dist`: one replica per GPU driven from this thread,
            // gradients averaged on the host.
            let backends = (0..n)
                .map(|ordinal| {
                    CudaBackend::new(ordinal).map_err(|e| TrainError::Device {
                        device: format!("cuda:{ordinal}"),
                        reason: e.to_string(),
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            train_with(cfg, stop, backends)
        }
    }
}

pub(super) fn source(cfg: &TrainConfig) -> DatasetSource {
    match cfg.valid_fraction {
        Some(f) => DatasetSource::flat(&cfg.data, f),
        None => DatasetSource::folder(&cfg.data),
    }
}

fn pipeline_for(cfg: &TrainConfig, split: Split) -> Result<Pipeline, TrainError> {
    let training = split == Split::Train;
    let mut b = PipelineBuilder::new(source(cfg))
        .split(split)
        .image_size(cfg.image_size)
        .seed(cfg.seed)
        .replicas(if training { cfg.replicas } else { 1 })
        .batch_size(cfg.batch_size)
        .shuffle(training)
        .last_batch(if training {
            cfg.last_batch
        } else {
            pipeline::LastBatch::Partial
        })
        .on_bad_image(cfg.on_bad_image)
        .bad_files_report(cfg.out.join(format!("bad_files_{}.txt", split)));
    if cfg.workers > 0 {
        b = b.workers(cfg.workers);
    }
    if let Some(dir) = &cfg.cache_dir {
        b = b.cache_dir(dir.clone());
    }
    Ok(b.build()?)
}

pub(super) fn optimizer_kind(cfg: &TrainConfig) -> OptimizerKind {
    match cfg.optimizer {
        OptimizerChoice::Sgd => OptimizerKind::Sgd {
            momentum: cfg.momentum,
            nesterov: cfg.nesterov,
        },
        OptimizerChoice::Adam => OptimizerKind::Adam,
        OptimizerChoice::AdamW => OptimizerKind::AdamW,
    }
}

/// Everything a run carries from step to step.
pub(super) struct RunState<B: Backend> {
    /// The replicas and the master copy.
    pub(super) replicas: Replicas<B>,
    /// The optimizer and its state.
    pub(super) optimizer: Optimizer,
    /// Where the run is in the data.
    pub(super) position: DataPosition,
}

pub(super) fn say(cfg: &TrainConfig, line: impl AsRef<str>) {
    if cfg.verbose {
        println!("{}", line.as_ref());
    }
}

/// The training loop on given backends (one per replica).
pub(crate) fn train_with<B: Backend>(
    cfg: &TrainConfig,
    stop: &AtomicBool,
    backends: Vec<B>,
) -> Result<TrainOutcome, TrainError> {
    let wall = Instant::now();
    // Read the checkpoint before anything is written, so a bad --resume leaves no trace.
    let resumed = match &cfg.resume {
        Some(run) => Some((run.clone(), CheckpointMeta::load(run)?)),
        None => None,
    };
    let train_pipe = pipeline_for(cfg, Split::Train)?;
    let valid_pipe = pipeline_for(cfg, Split::Valid)?;
    let classes = train_pipe.classes().to_vec();
    let graph = Graph::new(cfg.arch, classes.len());
    let steps_per_epoch = train_pipe.steps_per_epoch();
    if steps_per_epoch == 0 {
        return Err(TrainError::InvalidConfig {
            flag: "--batch-size",
            value: cfg.batch_size.to_string(),
            hint: format!(
                "with --last-batch drop the {} training images make no full global batch of {}",
                train_pipe.len(),
                cfg.global_batch()
            ),
        });
    }
    let dataset = DatasetStamp::of(&train_pipe);
    warn_about_dataset(cfg, classes.len(), train_pipe.len());
    let lr = cfg.scaled_lr_for(train_pipe.len());
    let schedule = Schedule {
        base_lr: lr,
        steps_per_epoch: steps_per_epoch as u64,
        warmup_epochs: cfg.warmup_epochs,
        total_epochs: cfg.epochs as u32,
        decay: cfg.schedule,
    };
    let hyper = Hyper {
        weight_decay: cfg.weight_decay,
        ..Hyper::default()
    };
    let mut optimizer = Optimizer::new(optimizer_kind(cfg), hyper, graph.params());
    let (state, position) = match &resumed {
        Some((run, meta)) => {
            check_resume(cfg, run, meta, &classes)?;
            let state = ModelState::load_safetensors(
                &graph,
                &run.join(&meta.model_file),
                HeadPolicy::Strict,
            )?;
            optimizer.load(&run.join(&meta.optimizer_state_file))?;
            let position = resume_position(cfg, run, meta, &dataset)?;
            (state, position)
        }
        None => {
            let state = match &cfg.init_from {
                Some(path) => ModelState::load_safetensors(
                    &graph,
                    path,
                    HeadPolicy::ReplaceMismatched { seed: cfg.seed },
                )?,
                None => ModelState::init(&graph, cfg.seed),
            };
            let position = DataPosition {
                epoch: 0,
                step_in_epoch: 0,
                samples_in_epoch: 0,
                global_step: 0,
                partial_train: MetricsAccumulator::default(),
            };
            (state, position)
        }
    };
    let net_config = NetworkConfig {
        label_smoothing: cfg.label_smoothing,
        freeze_bn: cfg.freeze_bn,
        ..NetworkConfig::default()
    };
    let replicas = Replicas::new(
        backends,
        &graph,
        cfg.batch_size,
        cfg.image_size,
        net_config,
        state,
    )?;
    std::fs::create_dir_all(&cfg.out).map_err(|source| TrainError::Io {
        path: cfg.out.clone(),
        what: "create the run folder",
        source,
    })?;
    let metrics_path = cfg.out.join("metrics.jsonl");
    match &resumed {
        Some((run, _)) => {
            if run != &cfg.out {
                copy_metrics(&run.join("metrics.jsonl"), &metrics_path)?;
            }
            truncate_metrics_from(&metrics_path, position.epoch + 1)?;
        }
        None => {
            // A fresh run starts a fresh metrics file.
            let _ = std::fs::remove_file(&metrics_path);
        }
    }

    let device_name = format!(
        "{} × {} replica{}",
        replicas_backend_name(&replicas),
        cfg.replicas,
        if cfg.replicas == 1 { "" } else { "s" }
    );
    say(
        cfg,
        format!(
            "model {} ({} parameters) · {} · {} train / {} valid images at {}×{}",
            cfg.arch,
            graph.param_count(),
            summarise(&classes),
            train_pipe.len(),
            valid_pipe.len(),
            cfg.image_size,
            cfg.image_size
        ),
    );
    say(cfg, format!(
        "device {device_name} · global batch {} ({} per replica) · lr {} for batch 256 → {:.6} scaled · {} · {} steps per epoch",
        cfg.global_batch(),
        cfg.batch_size,
        cfg.lr,
        lr,
        cfg.optimizer.name(),
        steps_per_epoch
    ));
    if let Some((run, meta)) = &resumed {
        say(cfg, format!(
            "resuming {} at epoch {}, step {} of {steps_per_epoch} (global step {}, {} epochs done)",
            run.display(),
            position.epoch + 1,
            position.step_in_epoch,
            position.global_step,
            meta.epoch
        ));
    }

    let mut run = RunState {
        replicas,
        optimizer,
        position,
    };
    let mut last_valid = None;
    let mut interrupted = false;
    // (seconds waiting for data, seconds training) over the epochs finished in this process.
    let mut session_wait = (0.0f64, 0.0f64);
    while run.position.epoch < cfg.epochs {
        let epoch = run.position.epoch;
        let finished = train_epoch(cfg, stop, &train_pipe, &schedule, &mut run, steps_per_epoch)?;
        if !finished {
            save_checkpoint(
                cfg,
                &graph,
                &classes,
                &dataset,
                &run,
                schedule.lr_at(run.position.global_step.saturating_sub(1)),
            )?;
            say(
                cfg,
                format!(
                    "stopped at epoch {}, step {} of {steps_per_epoch}: checkpoint saved in {}",
                    epoch + 1,
                    run.position.step_in_epoch,
                    cfg.out.display()
                ),
            );
            interrupted = true;
            break;
        }
        let train_line = run
            .position
            .partial_train
            .finish(epoch + 1, MetricsSplit::Train);
        let wait_share = run.position.partial_train.wait_share();
        session_wait.0 += run.position.partial_train.wait_seconds;
        session_wait.1 += run.position.partial_train.seconds;
        let valid_line = validate(cfg, &valid_pipe, &mut run, epoch + 1)?;
        check_valid_loss(
            cfg,
            &valid_line,
            run.position.global_step,
            schedule.lr_at(run.position.global_step.saturating_sub(1)),
        )?;
        append_metrics(&metrics_path, &train_line)?;
        append_metrics(&metrics_path, &valid_line)?;
        run.position = DataPosition {
            epoch: epoch + 1,
            step_in_epoch: 0,
            samples_in_epoch: 0,
            global_step: run.position.global_step,
            partial_train: MetricsAccumulator::default(),
        };
        save_checkpoint(
            cfg,
            &graph,
            &classes,
            &dataset,
            &run,
            schedule.lr_at(run.position.global_step.saturating_sub(1)),
        )?;
        write_report(&cfg.out.join("report.png"), &read_metrics(&metrics_path)?)?;
        say(cfg, format!(
            "epoch {}/{} · train loss {:.4} acc {:.4} · valid loss {:.4} acc {:.4} top-5 {:.4} · {:.0} images/s · data-wait {:.0}% · {:.1} s",
            epoch + 1,
            cfg.epochs,
            train_line.loss,
            train_line.accuracy,
            valid_line.loss,
            valid_line.accuracy,
            valid_line.top5,
            train_line.images_per_sec,
            wait_share * 100.0,
            train_line.seconds + valid_line.seconds
        ));
        last_valid = Some(valid_line);
        if stop.load(Ordering::SeqCst) || reached_stop_step(cfg, &run.position) {
            interrupted = run.position.epoch < cfg.epochs;
            break;
        }
    }
    let lines = if metrics_path.exists() {
        read_metrics(&metrics_path)?
    } else {
        Vec::new()
    };
    let header = SummaryHeader {
        title: format!(
            "{} · {} classes · {device_name} · global batch {}",
            cfg.arch,
            classes.len(),
            cfg.global_batch()
        ),
        wall_seconds: wall.elapsed().as_secs_f64(),
        out: cfg.out.clone(),
        data_wait_share: (session_wait.1 > 0.0).then(|| session_wait.0 / session_wait.1),
    };
    let replica_checksums = run.replicas.checksums()?;
    let in_sync = replica_checksums.windows(2).all(|w| w[0] == w[1]);
    let mut summary = format_summary(&header, &lines);
    summary.push_str(&format!(
        "\nweights checksum {:016x} on {} replica(s){}",
        replica_checksums[0],
        replica_checksums.len(),
        if in_sync {
            ", identical"
        } else {
            ", MISMATCH (replicas diverged)"
        }
    ));
    say(cfg, &summary);
    Ok(TrainOutcome {
        interrupted,
        epochs_done: run.position.epoch,
        global_step: run.position.global_step,
        last_valid,
        out: cfg.out.clone(),
        summary,
        replica_checksums,
    })
}

fn replicas_backend_name<B: Backend>(r: &Replicas<B>) -> String {
    r.backend_name()
}
