//! Where in the data a checkpoint was taken, and what it records of that data.

use serde::{Deserialize, Serialize};

use super::metrics::MetricsAccumulator;

/// Where in the data a checkpoint was taken: enough to restart the exact batch sequence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DataPosition {
    /// The epoch to run next (0-based, as the pipeline counts).
    pub epoch: u64,
    /// The step inside that epoch to run next (0 at an epoch boundary).
    pub step_in_epoch: usize,
    /// Training samples of that epoch already consumed (lets another global batch resume).
    pub samples_in_epoch: u64,
    /// Steps taken since the start of training (drives the learning-rate schedule).
    pub global_step: u64,
    /// Training figures of the unfinished epoch, so its metrics line covers all of it.
    pub partial_train: MetricsAccumulator,
    /// The product of the plateau schedule's cuts so far (1 without them); absent in older
    /// checkpoints.
    #[serde(default = "one")]
    pub lr_scale: f32,
    /// The epoch (1-based) of the plateau schedule's last cut, which its cooldown counts
    /// from; absent before the first cut and in older checkpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plateau_last_cut: Option<u64>,
}

impl DataPosition {
    /// The start of training.
    pub fn start() -> DataPosition {
        DataPosition {
            epoch: 0,
            step_in_epoch: 0,
            samples_in_epoch: 0,
            global_step: 0,
            partial_train: MetricsAccumulator::default(),
            lr_scale: 1.0,
            plateau_last_cut: None,
        }
    }

    /// The start of this position's epoch, with its figures so far dropped (the epoch is
    /// trained again from its first step; the global step is recounted by the caller).
    pub fn restart_epoch(&mut self) {
        self.step_in_epoch = 0;
        self.samples_in_epoch = 0;
        self.partial_train = MetricsAccumulator::default();
    }

    /// The start of the next epoch (the global step carries on).
    pub fn next_epoch(&self) -> DataPosition {
        DataPosition {
            epoch: self.epoch + 1,
            global_step: self.global_step,
            lr_scale: self.lr_scale,
            plateau_last_cut: self.plateau_last_cut,
            ..DataPosition::start()
        }
    }
}

fn one() -> f32 {
    1.0
}

/// What a checkpoint records of its training data, so that a resumed run notices a changed set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatasetStamp {
    /// Training images at the time of the checkpoint.
    pub train_images: usize,
    /// The input engine's fingerprint of the training split (relative paths, sizes, labels,
    /// class names and resize settings), hex.
    pub train_fingerprint: String,
}

impl DatasetStamp {
    /// The stamp of a training pipeline.
    pub fn of(train: &pipeline::Pipeline) -> Self {
        Self {
            train_images: train.len(),
            train_fingerprint: format!("{:016x}", train.fingerprint()),
        }
    }
}
