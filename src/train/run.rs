//! The training loop: one for every device and rank count.
//!
//! [`train`] prepares the run folder (node 0 alone), lets the device's launcher
//! ([`super::rank::cpu`] or [`super::rank::cuda`]) set up the shared state and start one
//! thread per local rank, and each rank runs [`run_rank`]: the epochs, each step
//! ([`super::rank::Rank::step`]), the agreement on stopping, cross-rank checksums, and at
//! every epoch end the batch-norm average, its share of the validation
//! ([`super::validation`]), then rank 0's metrics, checkpoint and report, which the others
//! wait for under `--epoch-end-timeout`. The summary is built from every rank's report.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::config::TrainConfig;
use super::device::DeviceChoice;
use super::folder::metrics::{EpochMetrics, MetricsSplit};
use super::folder::{BestEpoch, CheckpointMeta, CheckpointTensors, DataPosition, RunFolder};
use super::lr_find::LrTrace;
use super::progress::EpochBar;
use super::rank::{
    account, mean_buffers, Device, PendingStep, Rank, StepPlan, RANK_BUFFERS_TENSOR,
};
use super::setup::{node_rank, Shared};
use super::summary::{format_summary, SummaryHeader};
use super::validation::{validate, EpochFigures, Validation};
use super::TrainError;
use crate::dist::collective::Collective;
use crate::model::{ModelState, StepStats};
use crate::optim::{Decay, RankOptimizer};

/// How a training run ended.
#[derive(Debug, Clone)]
pub struct TrainOutcome {
    /// Stopped early (Ctrl-C or `stop_after_steps`) after saving a checkpoint.
    pub interrupted: bool,
    /// Stopped by `--early-stop`: validation accuracy had not improved for that many epochs.
    pub early_stopped: bool,
    /// The epoch with the best validation figures (its checkpoint is in `RUN/best/`).
    pub best: Option<BestEpoch>,
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
    /// xxh3-64 of each local rank's final master weights (all equal when ranks stay in sync).
    pub replica_checksums: Vec<u64>,
    /// The learning-rate sweep's record (`birdtrain lr-find`; none for a training run).
    pub lr_sweep: Option<LrTrace>,
    /// Whether this process wrote the run folder (node 0 of a multi-node run).
    pub writer: bool,
    /// Validation images each local rank evaluated over the run (its share of every pass,
    /// the moving average's included): every rank validates a slice of the split.
    pub validated_images: Vec<u64>,
}

/// Whether a rank wants to stop before global step `step` (Ctrl-C, or a test's plan): asked
/// with the rank and the step.
pub(crate) type StopWish<'a> = dyn Fn(usize, u64) -> bool + Sync + 'a;

/// Trains as `cfg` says. `stop` is polled before every step (Ctrl-C sets it): every rank
/// finishes the same step, a checkpoint is saved, and the run returns with `interrupted`.
pub fn train(cfg: &TrainConfig, stop: &AtomicBool) -> Result<TrainOutcome, TrainError> {
    train_until(cfg, &|_, _| stop.load(Ordering::SeqCst))
}

/// [`train`] with a stop wish per rank and step.
pub(crate) fn train_until(
    cfg: &TrainConfig,
    stop: &StopWish<'_>,
) -> Result<TrainOutcome, TrainError> {
    cfg.validate()?;
    if let Some(path) = &cfg.dist.trace {
        let path = node_trace_path(path, node_rank(cfg));
        crate::trace::check_destination(&path).map_err(|e| TrainError::Trace(e.to_string()))?;
    }
    let folder = RunFolder::new(&cfg.out);
    if node_rank(cfg) != 0 {
        // Only node 0 writes the run folder, and only node 0 cleans or removes it: the other
        // nodes of a multi-node run may share it on a network file system, where their
        // cleaning would delete node 0's temporary files and their removal its run. They
        // neither create, lock nor check it (its state is node 0's to judge).
        return run(cfg, &folder, stop);
    }
    refuse_existing_run(cfg)?;
    // The engine writes its bad-files reports into the run folder while it scans, so the
    // folder exists from the start; a run that fails before its first checkpoint removes the
    // folder it created ("nothing half-written").
    let created = folder.create()?;
    // One writer per folder, held until the run returns.
    // (A folder this process created is left alone when the lock fails: the holder may be
    // the process that won the race to create it.)
    let _lock = folder.lock()?;
    // --overwrite replaces the run there whole, at once, before anything new is written:
    // never its checkpoint kept while its history and best/ are gone (a new run failing
    // before its first checkpoint left such a half-deleted run that still resumed).
    if cfg.overwrite
        && cfg.resume.as_deref() != Some(cfg.out.as_path())
        && !folder.existing_run().is_empty()
    {
        folder.remove_run()?;
    }
    // What an interrupted checkpoint or run left behind (temporary files, superseded tensor
    // files) goes before anything new is written.
    folder.clean();
    let result = run(cfg, &folder, stop);
    if result.is_err() {
        folder.discard_if_unused(created);
    }
    result
}

/// Where node `node` writes the `--trace` asked for as `path`: node 0 (or the only node) the
/// path itself, node k > 0 a file of its own beside it, `trace.node<k>.json` for
/// `trace.json` (the nodes may share a file system, where one path would hold only the last
/// node to finish).
pub(crate) fn node_trace_path(path: &Path, node: usize) -> PathBuf {
    if node == 0 {
        return path.to_path_buf();
    }
    let stem = path.file_stem().map_or_else(
        || std::ffi::OsString::from("trace"),
        std::ffi::OsStr::to_os_string,
    );
    let mut name = stem;
    name.push(format!(".node{node}"));
    if let Some(ext) = path.extension() {
        name.push(".");
        name.push(ext);
    }
    path.with_file_name(name)
}

/// A fresh run (or a resume into another folder) must not overwrite a run already in `--out`
/// unless `--overwrite` says so.
fn refuse_existing_run(cfg: &TrainConfig) -> Result<(), TrainError> {
    if let Some(owner) = super::folder::best_folder_owner(&cfg.out) {
        return Err(TrainError::InvalidConfig {
            flag: "--out",
            value: cfg.out.display().to_string(),
            hint: format!(
                "it is the best-epoch folder of the run {}, which only that run writes; continue from it into a new folder (--resume {} --out NEW)",
                owner.display(),
                cfg.out.display()
            ),
        });
    }
    if cfg.overwrite || cfg.resume.as_deref() == Some(cfg.out.as_path()) {
        return Ok(());
    }
    let found = RunFolder::new(&cfg.out).existing_run();
    if found.is_empty() {
        return Ok(());
    }
    Err(TrainError::RunExists {
        path: cfg.out.clone(),
        found: found.join(", "),
        resumable: cfg.lr_range.is_none() && RunFolder::new(&cfg.out).has_checkpoint(),
    })
}

/// Stops the run on a NaN or infinite training loss (the sum over a step's `count` images,
/// the same on every rank), before the diverged weights reach a checkpoint. `step_index` is
/// the 0-based global step the loss belongs to.
fn check_loss(
    shared: &Shared,
    totals: &StepStats,
    step_index: u64,
    position: &DataPosition,
) -> Result<(), TrainError> {
    if totals.count == 0 || totals.loss_sum.is_finite() {
        return Ok(());
    }
    Err(TrainError::NonFiniteLoss {
        what: "training loss",
        loss: totals.loss_sum / totals.count as f64,
        step: step_index + 1,
        epoch: position.epoch + 1,
        lr: shared.lr_at(step_index, position),
        kept: kept_checkpoint(shared),
        hint: diverged_hint(shared),
    })
}

/// What to change after a divergence (see [`super::error::divergence_hint`]).
fn diverged_hint(shared: &Shared) -> String {
    super::error::divergence_hint(shared.cfg.weight_decay, shared.schedule.base_lr)
}

/// What a diverged run leaves in its folder, for the error line: the last checkpoint, or
/// none when the run diverged before its first (its new folder is then removed).
fn kept_checkpoint(shared: &Shared) -> String {
    if shared.folder.has_checkpoint() {
        format!(
            "the last checkpoint in {} is kept",
            shared.cfg.out.display()
        )
    } else {
        "no checkpoint had been saved yet".to_string()
    }
}

/// Stops the run when validation gives a NaN or infinite loss: the weights overflowed
/// although each step's loss still looked finite.
fn check_valid_loss(
    shared: &Shared,
    valid: &EpochMetrics,
    position: &DataPosition,
) -> Result<(), TrainError> {
    let global_step = position.global_step;
    if valid.loss.is_finite() {
        return Ok(());
    }
    Err(TrainError::NonFiniteLoss {
        what: "validation loss",
        loss: valid.loss,
        step: global_step,
        epoch: valid.epoch,
        lr: shared.lr_at(global_step.saturating_sub(1), position),
        kept: kept_checkpoint(shared),
        hint: diverged_hint(shared),
    })
}

/// Refuses to checkpoint weights or statistics that overflowed (a loss can stay finite while
/// a batch-norm variance already reached infinity).
fn check_finite_state(
    shared: &Shared,
    state: &ModelState,
    position: &DataPosition,
) -> Result<(), TrainError> {
    let graph = &shared.graph;
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
                lr: shared.lr_at(position.global_step.saturating_sub(1), position),
                kept: kept_checkpoint(shared),
                hint: diverged_hint(shared),
            });
        }
    }
    Ok(())
}

fn run(
    cfg: &TrainConfig,
    folder: &RunFolder,
    stop: &StopWish<'_>,
) -> Result<TrainOutcome, TrainError> {
    let wall = Instant::now();
    // Read the checkpoint before anything is written, so a bad --resume leaves no trace.
    let resumed = match &cfg.resume {
        Some(run) => Some((run.clone(), CheckpointMeta::load(run)?)),
        None => None,
    };
    let launched = match cfg.device {
        DeviceChoice::Cpu => super::rank::cpu::launch(cfg, folder, resumed.as_ref(), stop)?,
        DeviceChoice::Cuda(n) => super::rank::cuda::launch(cfg, n, folder, resumed.as_ref(), stop)?,
    };
    outcome(launched, wall.elapsed())
}

/// What a launcher hands back: the shared state, every local rank's report, and what the
/// summary says about the devices.
pub(crate) struct Launched {
    /// The run's shared state.
    pub shared: std::sync::Arc<Shared>,
    /// One report per local rank, in rank order.
    pub reports: Vec<RankReport>,
    /// "cpu (2 threads) × 3 ranks".
    pub devices: String,
    /// Extra summary lines (pinned memory, …).
    pub notes: Vec<String>,
    /// Whether this process writes the run folder (node 0).
    pub writer: bool,
}

/// What a rank reports when it ends.
#[derive(Debug, Clone)]
pub(crate) struct RankReport {
    /// xxh3-64 of its final master weights.
    pub checksum: u64,
    /// Cross-rank checksum comparisons passed.
    pub checks_passed: u64,
    /// Its input report, when the device measures one.
    pub input_line: Option<String>,
    /// Stopped before the last epoch ended.
    pub interrupted: bool,
    /// Where training stands.
    pub position: DataPosition,
    /// The last validation line (rank 0).
    pub last_valid: Option<EpochMetrics>,
    /// Stopped by `--early-stop`.
    pub early_stopped: bool,
    /// The best epoch (rank 0's record).
    pub best: Option<BestEpoch>,
    /// Seconds waiting for input and seconds training, over the epochs of this process.
    pub session: (f64, f64),
    /// The learning-rate sweep's record (`lr-find`).
    pub lr_trace: Option<LrTrace>,
    /// Validation images this rank evaluated (its share of every pass).
    pub validated_images: u64,
}

/// The first error of the ranks, preferring a cause over the aborts it caused elsewhere.
pub(crate) fn first_cause(errors: Vec<TrainError>) -> Option<TrainError> {
    let mut errors = errors;
    let cause = errors.iter().position(|e| !e.is_abort_consequence());
    match cause {
        Some(i) => Some(errors.swap_remove(i)),
        None => errors.into_iter().next(),
    }
}

/// Runs one rank to the end of training. On an error it aborts the collective first, so no
/// other rank waits for it.
pub(crate) fn run_rank<D: Device>(
    shared: &Shared,
    rank: &mut Rank<D>,
    stop: &dyn Fn(u64) -> bool,
) -> Result<RankReport, TrainError> {
    let result = epochs(shared, rank, stop);
    if let Err(e) = &result {
        if !e.is_abort_consequence() {
            rank.abort(&format!("rank {} failed: {e}", rank.rank));
        }
    }
    result
}

fn reached_stop_step(cfg: &TrainConfig, pos: &DataPosition) -> bool {
    cfg.stop_after_steps.is_some_and(|n| pos.global_step >= n)
}

fn checksum_due(step: u64, every: u64) -> bool {
    every > 0 && step > 0 && step % every == 0
}

fn epochs<D: Device>(
    shared: &Shared,
    rank: &mut Rank<D>,
    stop: &dyn Fn(u64) -> bool,
) -> Result<RankReport, TrainError> {
    let cfg = &shared.cfg;
    let mut last_valid = None;
    let mut interrupted = false;
    let mut early_stopped = false;
    let mut best = shared.best;
    let mut session = (0.0f64, 0.0f64);
    let mut validated_images = 0u64;
    if rank.position.epoch >= cfg.epochs && rank.is_writer() && cfg.resume.is_some() {
        tracing::warn!(
            "--epochs {}: the resumed run has trained {} epoch{} already, so there is nothing to train (hint: a larger --epochs goes on)",
            cfg.epochs,
            rank.position.epoch,
            if rank.position.epoch == 1 { "" } else { "s" }
        );
    }
    // A resumed run that had already stopped early stops again at once (a larger or zero
    // --early-stop lets it go on).
    if rank.position.epoch < cfg.epochs && early_stop_due(shared, rank, best)? {
        early_stopped = true;
    }
    while !early_stopped && rank.position.epoch < cfg.epochs {
        let epoch = rank.position.epoch;
        let (finished, stop_agreed) = train_epoch(shared, rank, stop, best)?;
        // The learning-rate sweep neither validates nor checkpoints: it ends here.
        let sweep = cfg.lr_range.is_some();
        if !finished {
            // Inside the epoch: the checkpoint keeps every rank's own statistics.
            let rows = if sweep {
                None
            } else {
                rank.gather_bn_buffers()?
            };
            if rank.is_writer() && !sweep {
                save_checkpoint(shared, rank, best, rows.as_deref())?;
                shared.say(format!(
                    "stopped at epoch {}, step {} of {}: checkpoint saved in {}",
                    epoch + 1,
                    rank.position.step_in_epoch,
                    shared.steps_per_epoch,
                    cfg.out.display()
                ));
            }
            interrupted = true;
            break;
        }
        // Every epoch ends with a cross-rank comparison, however short the epoch.
        if !checksum_due(rank.position.global_step, shared.checksum_every) {
            rank.compare_checksums()?;
        }
        let acc = rank.position.partial_train;
        let train_line = acc.finish(epoch + 1, MetricsSplit::Train);
        session.0 += acc.wait_seconds;
        session.1 += acc.seconds;
        rank.average_bn_statistics(shared)?;
        // The epoch with its steps done and its figures, not yet validated: where a run
        // stopped during validation resumes (it validates the epoch first).
        let unvalidated = rank.position.clone();
        rank.position = rank.position.next_epoch();
        let mut validation_stopped = false;
        if !sweep {
            let at = rank.position.global_step;
            let wish = || stop(at);
            // Every rank validates its share and learns the whole split's figures, or that a
            // rank was stopped during its pass.
            match validate(shared, rank, epoch + 1, &wish)? {
                Validation::Stopped => validation_stopped = true,
                Validation::Done(figures) => {
                    validated_images += figures.own_images;
                    if rank.is_writer() {
                        let line = end_epoch(
                            shared,
                            rank,
                            &train_line,
                            acc.wait_share(),
                            &mut best,
                            figures,
                        )?;
                        last_valid = Some(line);
                    }
                    wait_for_writer(shared, rank)?;
                }
            }
        }
        if validation_stopped {
            rank.position = unvalidated;
            if rank.is_writer() {
                save_checkpoint(shared, rank, best, None)?;
                shared.say(format!(
                    "stopped during the validation of epoch {}: checkpoint saved in {} (--resume validates that epoch first)",
                    epoch + 1,
                    cfg.out.display()
                ));
            }
            interrupted = true;
            break;
        }
        if let Some(line) = rank.device.input_line(rank.rank) {
            shared.say(line);
        }
        if stop_agreed || reached_stop_step(cfg, &rank.position) {
            interrupted = rank.position.epoch < cfg.epochs;
            break;
        }
        early_stopped = rank.position.epoch < cfg.epochs && early_stop_due(shared, rank, best)?;
    }
    if early_stopped && rank.is_writer() {
        if let Some(b) = best {
            let idle = rank.position.epoch - b.epoch;
            let already = if session.1 == 0.0 {
                " (it had stopped there before; a larger --early-stop, or 0, lets it go on)"
            } else {
                ""
            };
            let rule = cfg.best_rule();
            let by = if rule.min_delta > 0.0 {
                format!(" by more than {}", rule.min_delta)
            } else {
                String::new()
            };
            shared.say(format!(
                "early stop after epoch {}: {} has not improved{by} for {idle} epoch{}; the best, epoch {} (accuracy {:.4}, loss {:.4}), is in {}{already}",
                rank.position.epoch,
                rule.monitor.words(),
                if idle == 1 { "" } else { "s" },
                b.epoch,
                b.accuracy,
                b.loss,
                shared.folder.best_path().display()
            ));
        }
    }
    let checksum = crate::dist::checksum(&rank.opt.master(&rank.net)?);
    Ok(RankReport {
        checksum,
        checks_passed: rank.checks_passed,
        input_line: rank.device.input_line(rank.rank),
        interrupted,
        position: rank.position.clone(),
        last_valid,
        early_stopped,
        best,
        session,
        lr_trace: rank.lr_trace.take(),
        validated_images,
    })
}

/// Whether `--early-stop` ends the run here, at an epoch boundary: the epochs since the best
/// one (rank 0 holds the record) reached the patience. Every rank learns rank 0's answer.
fn early_stop_due<D: Device>(
    shared: &Shared,
    rank: &mut Rank<D>,
    best: Option<BestEpoch>,
) -> Result<bool, TrainError> {
    let patience = shared.cfg.early_stop;
    if patience == 0 || rank.position.step_in_epoch > 0 {
        return Ok(false);
    }
    let done = rank.position.epoch;
    let due = best.is_some_and(|b| done.saturating_sub(b.epoch) >= patience);
    Ok(writer_value(rank, if due { 1.0 } else { 0.0 })? > 0.0)
}

/// Rank 0's `value` on every rank, through a one-value sum to which the others give 0 (rank
/// 0 alone holds the best epoch's record); a rank alone keeps its own.
fn writer_value<D: Device>(rank: &mut Rank<D>, value: f64) -> Result<f64, TrainError> {
    if rank.world == 1 {
        return Ok(value);
    }
    let mut sum = [if rank.is_writer() { value } else { 0.0 }];
    rank.comm.sum(&mut sum)?;
    Ok(sum[0])
}

/// Every rank waits here for rank 0 to finish writing the run folder (the epoch's metrics,
/// `best/`, the checkpoint and the report, or a `--save-every` checkpoint), and learns rank
/// 0's learning-rate scale (the plateau schedule's cut, decided before the checkpoint that
/// records it; the other ranks never decide). The wait is bounded by `--epoch-end-timeout`,
/// not the collective timeout: a large split or a slow disk may take longer than any
/// collective should, and a rank 0 that fails meanwhile aborts the group at once (its error,
/// its thread's panic or its process's death end the wait without a timeout; see
/// [`crate::dist::collective::Collective::sum_within`]).
fn wait_for_writer<D: Device>(shared: &Shared, rank: &mut Rank<D>) -> Result<(), TrainError> {
    if rank.world == 1 {
        return Ok(());
    }
    // An f32 through f64 and back is exact.
    let mut scale = [if rank.is_writer() {
        f64::from(rank.position.lr_scale)
    } else {
        0.0
    }];
    rank.comm
        .sum_within(&mut scale, shared.cfg.dist.epoch_end_timeout())?;
    if matches!(shared.schedule.decay, Decay::Plateau(_)) {
        rank.position.lr_scale = scale[0] as f32;
    }
    Ok(())
}

/// Whether a checkpoint is due inside the epoch after global step `step` (`--save-every`).
fn periodic_save_due(cfg: &TrainConfig, step: u64) -> bool {
    cfg.save_every > 0 && step % cfg.save_every == 0
}

/// The rest of the current epoch. Returns (finished, stop agreed): not finished when the
/// ranks stopped before the epoch's last step.
fn train_epoch<D: Device>(
    shared: &Shared,
    rank: &mut Rank<D>,
    stop: &dyn Fn(u64) -> bool,
    best: Option<BestEpoch>,
) -> Result<(bool, bool), TrainError> {
    let cfg = &shared.cfg;
    let steps = shared.steps_per_epoch;
    let epoch = rank.position.epoch;
    let start_step = rank.position.step_in_epoch.min(steps);
    let bar = EpochBar::new(
        rank.is_writer() && cfg.progress && cfg.verbose,
        format!("epoch {}/{} train", epoch + 1, cfg.epochs),
        steps,
        start_step,
    );
    rank.device
        .begin_epoch(&shared.train_pipe, epoch, rank.rank, start_step)?;
    let started = Instant::now();
    let seconds_before = rank.position.partial_train.seconds;
    let mut images = 0u64;
    let mut stop_agreed = false;
    let mut pending = None;
    let trace_engine = shared.trace.is_enabled() && rank.local_index == 0;
    if trace_engine {
        shared.trace.name_process(ENGINE_PID, "input engine");
        shared
            .trace
            .name_thread(ENGINE_PID, 0, "decode, cache, assembly");
    }
    let mut engine_before = trace_engine.then(|| shared.train_pipe.stats());
    for step in start_step..steps {
        let t_step = Instant::now();
        let plan = StepPlan {
            epoch,
            step,
            lr: shared.lr_at(rank.position.global_step, &rank.position),
            local_images: shared.rank_images(step, rank.rank),
            global_images: shared.step_images(step),
            stop: stop(rank.position.global_step),
        };
        let (issued, waited) = rank.step(shared, &plan)?;
        rank.update_average(shared, &plan)?;
        // A rank alone decides by itself; ranks agree through the step totals, read one step
        // later, so every rank stops after the same step.
        if rank.world == 1 && plan.stop {
            stop_agreed = true;
        }
        if let Some(earlier) = pending.replace(issued) {
            stop_agreed |= settle(shared, rank, earlier)?;
        }
        let pos = &mut rank.position;
        pos.global_step += 1;
        pos.step_in_epoch = step + 1;
        pos.samples_in_epoch += plan.global_images as u64;
        pos.partial_train.wait_seconds += waited.as_secs_f64();
        images += plan.global_images as u64;
        if checksum_due(pos.global_step, shared.checksum_every) {
            rank.compare_checksums()?;
        }
        if let Some(before) = &mut engine_before {
            let now = shared.train_pipe.stats();
            shared.trace.record_since(
                &engine_span_name(before, &now),
                "engine",
                ENGINE_PID,
                0,
                t_step,
            );
            *before = now;
        }
        rank.device
            .end_step(&mut rank.comm, waited, t_step.elapsed())?;
        let last = step + 1 == steps;
        let early = !last && (stop_agreed || reached_stop_step(cfg, &rank.position));
        if last || early {
            if let Some(earlier) = pending.take() {
                stop_agreed |= settle(shared, rank, earlier)?;
            }
        } else if periodic_save_due(cfg, rank.position.global_step) {
            // The checkpoint's figures must cover every step taken: settle the last one first
            // (a stop wish read here ends the run after the next step, as it would anyway).
            if let Some(earlier) = pending.take() {
                stop_agreed |= settle(shared, rank, earlier)?;
            }
            let rows = rank.gather_bn_buffers()?;
            if rank.is_writer() {
                save_checkpoint(shared, rank, best, rows.as_deref())?;
            }
            wait_for_writer(shared, rank)?;
        }
        let elapsed = started.elapsed().as_secs_f64();
        let acc = &mut rank.position.partial_train;
        acc.seconds = seconds_before + elapsed;
        bar.update(
            step + 1,
            images as f64 / elapsed.max(1e-9),
            acc.mean_loss(),
            acc.accuracy(),
            acc.wait_share(),
        );
        if early {
            bar.finish();
            return Ok((false, true));
        }
    }
    bar.finish();
    Ok((true, stop_agreed))
}

/// Reads the totals of the step before the last one issued (global step index
/// `position.global_step - 1`), stops on a non-finite loss, adds them to the epoch's figures;
/// returns whether any rank asked to stop.
fn settle<D: Device>(
    shared: &Shared,
    rank: &mut Rank<D>,
    earlier: PendingStep<D::Pending>,
) -> Result<bool, TrainError> {
    let (totals, wish) = rank.settle(earlier)?;
    let index = rank.position.global_step.saturating_sub(1);
    account(&mut rank.position.partial_train, &totals);
    if let Some(trace) = &mut rank.lr_trace {
        // The sweep drives the rate until the loss diverges: a non-finite loss ends it, it
        // is no fault.
        if totals.count > 0 {
            let lr = shared.cfg.lr_range.map_or(0.0, |r| r.lr_at(index));
            trace.add(index, lr, totals.mean_loss());
        }
        return Ok(wish || trace.is_over());
    }
    check_loss(shared, &totals, index, &rank.position)?;
    Ok(wish)
}

/// Metrics, the best epoch, checkpoint and report after a validated epoch (rank 0).
fn end_epoch<D: Device>(
    shared: &Shared,
    rank: &mut Rank<D>,
    train_line: &EpochMetrics,
    wait_share: f64,
    best: &mut Option<BestEpoch>,
    figures: EpochFigures,
) -> Result<EpochMetrics, TrainError> {
    let cfg = &shared.cfg;
    let epoch = train_line.epoch;
    let EpochFigures {
        valid: valid_line,
        average: ema_line,
        ..
    } = figures;
    check_valid_loss(shared, &valid_line, &rank.position)?;
    // `--monitor val_ema_…` judges the epoch by its moving average (refused without one).
    let judged = match &ema_line {
        Some(line) if cfg.best_rule().monitor.follows_average() => line,
        _ => &valid_line,
    };
    // A non-finite figure of the average is never the best (nothing could beat it after).
    let improved = judged.loss.is_finite()
        && best.is_none_or(|b| cfg.best_rule().improves(&b, judged.accuracy, judged.loss));
    if improved {
        *best = Some(BestEpoch::of(judged));
    }
    // The plateau schedule's cut is decided here, before the checkpoint that records it;
    // the other ranks learn it from `wait_for_writer`.
    let mut cut_note = String::new();
    if let (Decay::Plateau(p), Some(b)) = (shared.schedule.decay, *best) {
        let position = &mut rank.position;
        let last_cut = position.plateau_last_cut;
        if let Some(scale) = p.cut(epoch, b.epoch, last_cut, position.lr_scale, cfg.lr) {
            // The floor raised the cut: say so rather than print a factor that was not applied.
            let floored = scale > position.lr_scale * p.factor;
            (position.lr_scale, position.plateau_last_cut) = (scale, Some(epoch));
            cut_note = format!(
                " · lr cut {} to {:.6} ({} has not improved for {} epochs{})",
                if floored {
                    "to its floor".to_string()
                } else {
                    format!("×{}", p.factor)
                },
                shared.lr_at(position.global_step, position),
                cfg.best_rule().monitor.words(),
                epoch - b.epoch,
                match p.cooldown {
                    0 => String::new(),
                    1 => "; the next epoch is not counted".into(),
                    c => format!("; the next {c} are not counted"),
                }
            );
        }
    }
    shared
        .folder
        .record_epoch(train_line, &valid_line, ema_line.as_ref())?;
    let files = checkpoint_files(shared, rank, *best, None)?;
    // best/ first: a kill between the two leaves the run's checkpoint at the epoch before,
    // whose resumed run redoes this epoch and writes the same best/ again.
    if improved {
        shared
            .folder
            .save_best(files.meta.clone(), files.tensors())?;
    }
    shared
        .folder
        .save_checkpoint(files.meta.clone(), files.tensors())?;
    shared.folder.write_report()?;
    shared.say(format!(
        "epoch {}/{} · train loss {:.4} acc {:.4} · valid loss {:.4} acc {:.4} top-5 {:.4} · {:.0} images/s · data-wait {:.1}% · {:.1} s{}",
        epoch,
        cfg.epochs,
        train_line.loss,
        train_line.accuracy,
        valid_line.loss,
        valid_line.accuracy,
        valid_line.top5,
        train_line.images_per_sec,
        wait_share * 100.0,
        train_line.seconds + valid_line.seconds + ema_line.map_or(0.0, |l| l.seconds),
        if improved { " · best so far" } else { "" }
    ));
    if let Some(line) = ema_line {
        shared.say(format!(
            "epoch {}/{} · moving average · valid loss {:.4} acc {:.4} top-5 {:.4}",
            epoch, cfg.epochs, line.loss, line.accuracy, line.top5
        ));
    }
    if !cut_note.is_empty() {
        shared.say(format!("epoch {epoch}/{}{cut_note}", cfg.epochs));
    }
    Ok(valid_line)
}

/// Writes the run's checkpoint ([`checkpoint_files`]); `rank_rows` are the ranks' own batch-norm buffers of a
/// checkpoint inside an epoch ([`Rank::gather_bn_buffers`]), `None` at an epoch end (where
/// the ranks hold the average already).
fn save_checkpoint<D: Device>(
    shared: &Shared,
    rank: &mut Rank<D>,
    best: Option<BestEpoch>,
    rank_rows: Option<&[Vec<f32>]>,
) -> Result<(), TrainError> {
    let files = checkpoint_files(shared, rank, best, rank_rows)?;
    shared
        .folder
        .save_checkpoint(files.meta.clone(), files.tensors())?;
    Ok(())
}

/// A checkpoint's sidecar and tensor files.
struct CheckpointFiles {
    meta: CheckpointMeta,
    model: Vec<u8>,
    optimizer: Vec<u8>,
    ema: Option<Vec<u8>>,
    /// What the training engine has read of its files so far ([`super::folder::TrainFiles`]).
    train_files: Vec<u8>,
}

impl CheckpointFiles {
    fn tensors(&self) -> CheckpointTensors<'_> {
        CheckpointTensors {
            model: &self.model,
            optimizer: &self.optimizer,
            ema: self.ema.as_deref(),
            train_files: Some(&self.train_files),
        }
    }
}

/// What a checkpoint holds: the sidecar (with the best epoch so far), the optimizer's f32
/// master weights with the network's buffers, the optimizer state in the host format, and
/// the moving average of the weights when the run keeps one. Overflowed weights are refused
/// instead.
fn checkpoint_files<D: Device>(
    shared: &Shared,
    rank: &mut Rank<D>,
    best: Option<BestEpoch>,
    rank_rows: Option<&[Vec<f32>]>,
) -> Result<CheckpointFiles, TrainError> {
    let mut state = rank.master_state(shared)?;
    // The weights file holds what validation and inference should see: the ranks' mean.
    if let Some(rows) = rank_rows {
        state.buffers = mean_buffers(shared, rows);
    }
    check_finite_state(shared, &state, &rank.position)?;
    let model = state.to_safetensors_bytes(&shared.graph, None)?;
    let host = rank.opt.to_host()?;
    let optimizer = match rank_rows {
        Some(rows) => {
            let flat = rows.concat();
            let shape = [rows.len(), rows.first().map_or(0, Vec::len)];
            host.to_safetensors_bytes_with(Some((RANK_BUFFERS_TENSOR, &shape, &flat)))
        }
        None => host.to_safetensors_bytes(),
    };
    let ema = rank
        .ema
        .as_ref()
        .map(|e| e.to_safetensors_bytes(&shared.graph))
        .transpose()?;
    let mut meta = shared.checkpoint_meta(&rank.position);
    meta.best = best;
    Ok(CheckpointFiles {
        meta,
        model,
        optimizer,
        ema,
        train_files: super::folder::TrainFiles::of(&shared.train_pipe).to_bytes(),
    })
}

/// The run's engines with the split each reads.
fn split_engines(shared: &Shared) -> [(pipeline::Split, &pipeline::Pipeline); 2] {
    [
        (pipeline::Split::Train, &shared.train_pipe),
        (pipeline::Split::Valid, &shared.valid_pipe),
    ]
}

/// The summary's count of the unreadable files the engines skipped, with where they are
/// listed (by node 0, the `writer`); `None` when every file was read.
fn bad_files_line(shared: &Shared, writer: bool) -> Option<String> {
    let parts: Vec<String> = split_engines(shared)
        .iter()
        .map(|(split, pipe)| (split, pipe.bad_files().len()))
        .filter(|(_, n)| *n > 0)
        .map(|(split, n)| match writer {
            true => format!(
                "{n} in {split} (listed in {})",
                shared.folder.bad_files_path(split).display()
            ),
            false => format!("{n} in {split} (node 0 lists its own in its run folder)"),
        })
        .collect();
    (!parts.is_empty()).then(|| format!("unreadable files skipped: {}", parts.join(", ")))
}

/// After a run that trained and ended normally, every split was read again: a report left
/// by an earlier run in this folder for a split with no bad file now lists fixed files.
fn remove_stale_bad_file_reports(shared: &Shared) {
    for (split, pipe) in split_engines(shared) {
        let path = shared.folder.bad_files_path(split);
        if pipe.bad_files().is_empty() && path.exists() {
            if let Err(e) = std::fs::remove_file(&path) {
                tracing::warn!("could not remove the stale report {}: {e}", path.display());
            }
        }
    }
}

/// Trace process id of the input engine's row (ranks use their rank).
const ENGINE_PID: u32 = 10_000;

/// What the engine did during one step, as a trace span name.
fn engine_span_name(before: &pipeline::EngineStats, now: &pipeline::EngineStats) -> String {
    format!(
        "engine: {} decoded · {} cache hits · {:.1} s decode work · {:.1} s crop and jitter work · ready queue {:.0} % · cache {:.0} % filled",
        now.decoded.saturating_sub(before.decoded),
        now.cache_hits.saturating_sub(before.cache_hits),
        (now.decode_seconds - before.decode_seconds).max(0.0),
        (now.transform_seconds - before.transform_seconds).max(0.0),
        100.0 * now.ready_queue_fill,
        100.0 * now.cache_fill
    )
}

fn outcome(launched: Launched, wall: Duration) -> Result<TrainOutcome, TrainError> {
    let Launched {
        shared,
        reports,
        devices,
        notes,
        writer,
    } = launched;
    let cfg = &shared.cfg;
    let first = reports.first().ok_or_else(|| TrainError::InvalidConfig {
        flag: "--gpus",
        value: "0".into(),
        hint: "no rank reported".into(),
    })?;
    if let Some(path) = &cfg.dist.trace {
        shared
            .trace
            .save(&node_trace_path(path, node_rank(cfg)))
            .map_err(|e| TrainError::Trace(e.to_string()))?;
    }
    let lines = if writer {
        shared.folder.metrics()?
    } else {
        Vec::new()
    };
    let header = SummaryHeader {
        title: format!(
            "{} · {} classes · {devices} · global batch {}",
            cfg.arch,
            shared.classes.len(),
            cfg.global_batch()
        ),
        wall_seconds: wall.as_secs_f64(),
        out: cfg.out.clone(),
        data_wait_share: (first.session.1 > 0.0).then(|| first.session.0 / first.session.1),
        best: first.best.filter(|_| writer),
        best_rule: cfg.best_rule(),
    };
    let replica_checksums: Vec<u64> = reports.iter().map(|r| r.checksum).collect();
    let in_sync = replica_checksums.windows(2).all(|w| w[0] == w[1]);
    let mut summary = format_summary(&header, &lines);
    for r in &reports {
        if let Some(line) = &r.input_line {
            summary.push('\n');
            summary.push_str(line);
        }
    }
    for note in &notes {
        summary.push('\n');
        summary.push_str(note);
    }
    if let Some(line) = bad_files_line(&shared, writer) {
        summary.push('\n');
        summary.push_str(&line);
    }
    if writer && !first.interrupted && first.session.1 > 0.0 {
        remove_stale_bad_file_reports(&shared);
    }
    summary.push_str(&format!(
        "\nweights checksum {:016x} on {} rank(s){} · {} cross-rank checks passed",
        replica_checksums[0],
        replica_checksums.len(),
        if in_sync {
            ", identical"
        } else {
            ", MISMATCH (ranks diverged)"
        },
        first.checks_passed
    ));
    if cfg.lr_range.is_none() {
        shared.say(&summary);
    }
    Ok(TrainOutcome {
        interrupted: first.interrupted,
        early_stopped: first.early_stopped,
        best: first.best,
        epochs_done: first.position.epoch,
        global_step: first.position.global_step,
        last_valid: first.last_valid,
        out: cfg.out.clone(),
        summary,
        replica_checksums,
        lr_sweep: first.lr_trace.clone(),
        writer,
        validated_images: reports.iter().map(|r| r.validated_images).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engine_span_names_what_the_engine_did_during_the_step() {
        let before = pipeline::EngineStats {
            decoded: 10,
            cache_hits: 5,
            bad_files: 0,
            batches: 3,
            decode_seconds: 1.0,
            transform_seconds: 0.2,
            decode_images_per_sec: 0.0,
            consumer_wait_seconds: 0.0,
            decode_queue_fill: 0.0,
            ready_queue_fill: 0.0,
            cache_fill: 0.0,
            elapsed_seconds: 2.0,
        };
        let now = pipeline::EngineStats {
            decoded: 14,
            cache_hits: 9,
            decode_seconds: 1.5,
            transform_seconds: 0.6,
            ready_queue_fill: 0.5,
            cache_fill: 1.0,
            ..before.clone()
        };
        assert_eq!(
            engine_span_name(&before, &now),
            "engine: 4 decoded · 4 cache hits · 0.5 s decode work · 0.4 s crop and jitter work · ready queue 50 % · cache 100 % filled"
        );
    }

    #[test]
    fn node_k_writes_its_trace_beside_node_0s() {
        let at = |p: &str, node| node_trace_path(Path::new(p), node);
        assert_eq!(at("out/trace.json", 0), Path::new("out/trace.json"));
        assert_eq!(at("out/trace.json", 3), Path::new("out/trace.node3.json"));
        assert_eq!(at("trace", 1), Path::new("trace.node1"));
        assert_eq!(
            at("/t/run.trace.json", 2),
            Path::new("/t/run.trace.node2.json")
        );
    }

    /// A node other than 0 leaves the run folder to node 0: it cleans nothing (node 0's
    /// temporary files of a checkpoint in progress on a shared folder), creates nothing and
    /// removes nothing, even when its run fails.
    #[test]
    fn a_node_other_than_0_never_cleans_creates_or_removes_the_run_folder() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        std::fs::create_dir_all(run.join("best")).unwrap();
        let leftovers = [
            "checkpoint.json.tmp4242",
            "model-s00000007-0011223344556677.safetensors.tmp4242",
            "best/checkpoint.json.tmp4242",
        ];
        for f in leftovers {
            std::fs::write(run.join(f), b"node 0 is writing this").unwrap();
        }
        let mut cfg = TrainConfig::new(tmp.path().join("data"));
        cfg.out = run.clone();
        cfg.dist.nodes = Some(2);
        cfg.dist.node_rank = Some(1);
        cfg.dist.master = Some("127.0.0.1:29500".into());
        // Several nodes on the CPU are refused by the launch, after the folder's handling.
        let e = train_until(&cfg, &|_, _| false).unwrap_err();
        assert!(e.to_string().contains("multi-node"), "{e}");
        for f in leftovers {
            assert!(run.join(f).exists(), "node 1 removed {f}");
        }
        assert!(run.join("best").is_dir());
        // Nor does it create a missing folder (and so never removes one either).
        cfg.out = tmp.path().join("absent");
        train_until(&cfg, &|_, _| false).unwrap_err();
        assert!(!cfg.out.exists());
        // Node 0 does clean: the same leftovers go.
        cfg.out = run.clone();
        cfg.dist.node_rank = Some(0);
        train_until(&cfg, &|_, _| false).unwrap_err();
        for f in leftovers {
            assert!(!run.join(f).exists(), "node 0 kept {f}");
        }
    }

    #[test]
    fn periodic_saves_are_due_every_n_steps_and_never_with_zero() {
        let mut cfg = TrainConfig::new("d");
        assert!(!(1..100).any(|s| periodic_save_due(&cfg, s)));
        cfg.save_every = 3;
        let due: Vec<u64> = (1..=10).filter(|&s| periodic_save_due(&cfg, s)).collect();
        assert_eq!(due, vec![3, 6, 9]);
    }

    #[test]
    fn checksums_are_due_every_n_steps_and_never_with_zero() {
        let due: Vec<u64> = (0..=10).filter(|&s| checksum_due(s, 4)).collect();
        assert_eq!(due, vec![4, 8]);
        assert!(!(0..100).any(|s| checksum_due(s, 0)));
    }
}
