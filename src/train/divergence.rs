//! Stopping a run whose numbers overflowed: a NaN or infinite training or validation loss, or
//! weights and statistics that are no longer finite, stop it before they reach a checkpoint,
//! with what the folder keeps and what to change.

use super::folder::metrics::EpochMetrics;
use super::folder::DataPosition;
use super::setup::Shared;
use super::TrainError;
use crate::model::{ModelState, StepStats};

/// Stops the run on a NaN or infinite training loss (the sum over a step's `count` images,
/// the same on every rank), before the diverged weights reach a checkpoint. `step_index` is
/// the 0-based global step the loss belongs to.
pub(crate) fn check_loss(
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
pub(crate) fn check_valid_loss(
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
pub(crate) fn check_finite_state(
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
