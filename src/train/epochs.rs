//! One rank's epochs: the steps ([`Rank::step`]), the agreement on stopping, cross-rank
//! checksums, and at every epoch end the batch-norm average, its share of the validation
//! ([`super::validation`]), then rank 0's metrics, checkpoint and report
//! ([`super::epoch_end`]), which the others wait for under `--epoch-end-timeout`. Every
//! launcher runs each of its ranks through [`run_rank`].

use std::time::Instant;

use super::config::TrainConfig;
use super::divergence::check_loss;
use super::epoch_end::{end_epoch, save_checkpoint};
use super::folder::metrics::MetricsSplit;
use super::folder::{BestEpoch, DataPosition};
use super::progress::EpochBar;
use super::rank::{account, Device, PendingStep, Rank, StepPlan};
use super::report::RankReport;
use super::setup::Shared;
use super::validation::{validate, Validation};
use super::TrainError;
use crate::dist::collective::Collective;
use crate::optim::{Decay, RankOptimizer};

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
            micro_batches: shared.micro_batches(step),
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
