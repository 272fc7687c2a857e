//! Elastic resume: `--resume RUN` on another number of ranks keeps the checkpoint's global
//! batch (and so its learning rate, schedule and data position), splitting it over the new
//! ranks with `--grad-accum-steps` where a rank cannot hold its share at once.

use super::CliError;
use crate::train::{CheckpointMeta, DeviceChoice, TrainConfig};

/// The split of a global batch over ranks: `batch` images per micro-batch, `accum` of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Split {
    /// `--batch-size`: images per rank per micro-batch.
    pub batch: usize,
    /// `--grad-accum-steps`.
    pub accum: u32,
}

/// How `global` images a step split over `ranks` ranks whose micro-batches held at most
/// `recorded` images before: each rank's share `global / ranks` (refused when it is not
/// whole), in micro-batches of the largest divisor of the share that is at most `recorded`.
/// Fewer ranks keep the recorded batch and accumulate (4 × 8 on 2 ranks: 8 × 2); more ranks
/// take smaller batches without accumulating (4 × 8 on 8 ranks: 4 × 1).
pub(crate) fn split(global: usize, ranks: usize, recorded: usize) -> Option<Split> {
    if ranks == 0 || global % ranks != 0 {
        return None;
    }
    let share = global / ranks;
    let batch = (1..=recorded.min(share)).rev().find(|b| share % b == 0)?;
    Some(Split {
        batch,
        accum: u32::try_from(share / batch).ok()?,
    })
}

/// The rank counts up to 64 that split `global` into whole shares, for a hint.
fn whole_splits(global: usize) -> String {
    let counts: Vec<String> = (1..=global.min(64))
        .filter(|r| global % r == 0)
        .map(|r| r.to_string())
        .collect();
    counts.join(", ")
}

/// Gives `cfg`, resumed from `meta` on `ranks` ranks (every node's), the checkpoint's global
/// batch when the rank count changed and neither `--batch-size` nor `--grad-accum-steps` was
/// given (`explicit`): the line that says how, or `None` when nothing changed. Refused, naming
/// the flag that set the rank count, when the global batch does not split into whole shares.
pub(crate) fn keep_global_batch(
    cfg: &mut TrainConfig,
    meta: &CheckpointMeta,
    ranks: usize,
    explicit: bool,
) -> Result<Option<String>, CliError> {
    if explicit || ranks == meta.replicas {
        return Ok(None);
    }
    let global = meta.global_batch;
    let flag = match cfg.device {
        DeviceChoice::Cuda(_) => "--gpus",
        DeviceChoice::Cpu => "--replicas",
    };
    let Some(s) = split(global, ranks, meta.batch_size) else {
        return Err(CliError::BadValue {
            flag,
            value: ranks.to_string(),
            hint: format!(
                "the checkpoint's global batch of {global} ({} ranks × {} × {} accumulated) does not split into {ranks} equal shares; resume on a rank count that divides it ({}), or give --batch-size (and --grad-accum-steps) to train with another global batch",
                meta.replicas,
                meta.batch_size,
                meta.settings.grad_accum_steps,
                whole_splits(global)
            ),
        });
    };
    cfg.batch_size = s.batch;
    cfg.settings.grad_accum_steps = s.accum;
    Ok(Some(format!(
        "resuming on {ranks} ranks where the checkpoint had {}: its global batch of {global} kept as {} per rank × {} accumulated, so the learning rate and the schedule go on unchanged (give --batch-size to choose another global batch)",
        meta.replicas, s.batch, s.accum
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fewer_ranks_accumulate_more_ranks_take_smaller_batches() {
        // The case: 4 ranks × 8 = 32.
        assert_eq!(split(32, 2, 8), Some(Split { batch: 8, accum: 2 }));
        assert_eq!(split(32, 1, 8), Some(Split { batch: 8, accum: 4 }));
        assert_eq!(split(32, 4, 8), Some(Split { batch: 8, accum: 1 }));
        assert_eq!(split(32, 8, 8), Some(Split { batch: 4, accum: 1 }));
        assert_eq!(split(32, 32, 8), Some(Split { batch: 1, accum: 1 }));
        assert_eq!(split(32, 3, 8), None);
        assert_eq!(split(32, 64, 8), None);
        // 3 ranks × 8 = 24 on 2 ranks: a share of 12 in micro-batches of at most 8: 6 × 2.
        assert_eq!(split(24, 2, 8), Some(Split { batch: 6, accum: 2 }));
        // A share of a prime number of images above the recorded batch: single images.
        assert_eq!(
            split(26, 2, 8),
            Some(Split {
                batch: 1,
                accum: 13
            })
        );
        assert_eq!(split(8, 0, 8), None);
        // Every split holds the global batch.
        for global in 1..=96 {
            for ranks in 1..=12 {
                for recorded in 1..=16 {
                    if let Some(s) = split(global, ranks, recorded) {
                        assert_eq!(ranks * s.batch * s.accum as usize, global);
                        assert!(s.batch <= recorded);
                    }
                }
            }
        }
    }

    #[test]
    fn the_hint_lists_the_rank_counts_that_divide_the_global_batch() {
        assert_eq!(whole_splits(32), "1, 2, 4, 8, 16, 32");
        assert_eq!(whole_splits(7), "1, 7");
    }
}
