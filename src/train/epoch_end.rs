//! What rank 0 writes: after a validated epoch its metrics line, the best epoch (`best/`),
//! the plateau schedule's cut, the checkpoint and the report; inside an epoch
//! (`--save-every`, or a stop) the checkpoint alone.

use super::divergence::{check_finite_state, check_valid_loss};
use super::folder::metrics::EpochMetrics;
use super::folder::{BestEpoch, CheckpointMeta, CheckpointTensors};
use super::rank::{mean_buffers, Device, Rank};
use super::setup::{Shared, RANK_BUFFERS_TENSOR};
use super::validation::EpochFigures;
use super::TrainError;
use crate::optim::{Decay, RankOptimizer};

/// Metrics, the best epoch, checkpoint and report after a validated epoch (rank 0).
pub(crate) fn end_epoch<D: Device>(
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
pub(crate) fn save_checkpoint<D: Device>(
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
