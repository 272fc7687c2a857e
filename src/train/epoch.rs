//! One epoch of training (all replicas, one optimizer step per global batch) and the
//! validation pass that follows it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use pipeline::Pipeline;

use super::augment::augments_for;
use super::checkpoint::DataPosition;
use super::config::TrainConfig;
use super::evaluate::evaluate;
use super::metrics::{EpochMetrics, MetricsSplit};
use super::progress::EpochBar;
use super::run::{check_loss, RunState};
use super::TrainError;
use crate::backend::Backend;
use crate::model::InputBatch;
use crate::optim::Schedule;

/// Whether `--stop-after-steps` has been reached.
pub(super) fn reached_stop_step(cfg: &TrainConfig, pos: &DataPosition) -> bool {
    cfg.stop_after_steps.is_some_and(|n| pos.global_step >= n)
}

/// Runs the rest of the current epoch. Returns false when stopped early (Ctrl-C or
/// `stop_after_steps`) before the epoch's last step.
pub(super) fn train_epoch<B: Backend>(
    cfg: &TrainConfig,
    stop: &AtomicBool,
    pipe: &Pipeline,
    schedule: &Schedule,
    run: &mut RunState<B>,
    steps_per_epoch: usize,
) -> Result<bool, TrainError> {
    let epoch = run.position.epoch;
    let start_step = run.position.step_in_epoch.min(steps_per_epoch);
    let bar = EpochBar::new(
        cfg.progress && cfg.verbose,
        format!("epoch {}/{} train", epoch + 1, cfg.epochs),
        steps_per_epoch,
        start_step,
    );
    let mut iters = (0..run.replicas.len())
        .map(|r| pipe.epoch(epoch, r, start_step))
        .collect::<Result<Vec<_>, _>>()?;
    let started = Instant::now();
    let seconds_before = run.position.partial_train.seconds;
    let mut images_this_session = 0u64;
    for step in start_step..steps_per_epoch {
        let t_wait = Instant::now();
        let mut batches = Vec::with_capacity(iters.len());
        for (r, it) in iters.iter_mut().enumerate() {
            match it.next() {
                Some(b) => batches.push(b?),
                None => {
                    return Err(TrainError::InvalidConfig {
                        flag: "--replicas",
                        value: cfg.replicas.to_string(),
                        hint: format!(
                            "replica {r} ran out of batches at step {step} of {steps_per_epoch} (input engine bug?)"
                        ),
                    })
                }
            }
        }
        run.position.partial_train.wait_seconds += t_wait.elapsed().as_secs_f64();
        let augments: Vec<Vec<_>> = batches
            .iter()
            .map(|b| {
                if cfg.augment {
                    augments_for(cfg.seed, epoch, &b.sample_ids[..b.len], cfg.image_size)
                } else {
                    Vec::new()
                }
            })
            .collect();
        let inputs: Vec<Option<InputBatch<'_>>> = batches
            .iter()
            .zip(&augments)
            .map(|(b, aug)| {
                (b.len > 0).then(|| InputBatch {
                    pixels: b.pixels(),
                    labels: b.labels(),
                    len: b.len,
                    image_size: b.image_size,
                    augment: cfg.augment.then_some(aug.as_slice()),
                })
            })
            .collect();
        let (stats, grad) = run.replicas.forward_backward(&inputs)?;
        drop(inputs);
        drop(batches);
        let lr = schedule.lr_at(run.position.global_step);
        check_loss(
            cfg,
            stats.loss_sum,
            stats.count,
            run.position.global_step,
            epoch,
            lr,
        )?;
        if let Some(grad) = grad {
            run.optimizer.step(run.replicas.params_mut(), &grad, lr)?;
            run.replicas.broadcast_params()?;
        }
        run.position.global_step += 1;
        run.position.step_in_epoch = step + 1;
        run.position.samples_in_epoch += stats.count as u64;
        images_this_session += stats.count as u64;
        let acc = &mut run.position.partial_train;
        acc.add(
            stats.loss_sum,
            stats.correct_top1 as u64,
            stats.correct_top5 as u64,
            stats.count as u64,
        );
        let elapsed = started.elapsed().as_secs_f64();
        acc.seconds = seconds_before + elapsed;
        bar.update(
            step + 1,
            images_this_session as f64 / elapsed.max(1e-9),
            acc.mean_loss(),
            acc.accuracy(),
            acc.wait_share(),
        );
        let last = step + 1 == steps_per_epoch;
        if !last && (stop.load(Ordering::SeqCst) || reached_stop_step(cfg, &run.position)) {
            bar.finish();
            return Ok(false);
        }
    }
    bar.finish();
    Ok(true)
}

pub(super) fn validate<B: Backend>(
    cfg: &TrainConfig,
    pipe: &Pipeline,
    run: &mut RunState<B>,
    epoch: u64,
) -> Result<EpochMetrics, TrainError> {
    let bar = EpochBar::new(
        cfg.progress && cfg.verbose,
        format!("epoch {epoch}/{} valid", cfg.epochs),
        pipe.steps_per_epoch(),
        0,
    );
    let report = evaluate(run.replicas.eval_net(), pipe)?;
    bar.finish();
    Ok(report.totals.finish(epoch, MetricsSplit::Valid))
}
