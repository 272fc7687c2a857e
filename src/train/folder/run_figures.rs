//! The headline figures of a finished (or stopped) run, read back from its folder: what
//! `birdtrain compare` sets side by side. Each comes from what the folder already records:
//! model, ranks and global batch from `checkpoint.json`, the time and price from its machine
//! time ([`super::machine_time`]), accuracies and the training speed from `metrics.jsonl`
//! (computed as the summary printed them, by [`training_rate`]).

use std::collections::BTreeMap;
use std::path::Path;

use super::checkpoint::CheckpointMeta;
use super::error::FolderError;
use super::machine_time::MachineTime;
use super::metrics::{read_metrics, EpochMetrics, MetricsSplit};
use super::names::METRICS_FILE;

/// A run's headline figures (`None`: the folder does not record it).
#[derive(Debug, Clone, PartialEq)]
pub struct RunFigures {
    /// The model, as `--model` spells it.
    pub model: String,
    /// Devices of the last segment (GPUs, or machines on the CPU).
    pub devices: Option<usize>,
    /// Ranks (replicas) of the last checkpoint.
    pub ranks: usize,
    /// Global batch of the last checkpoint.
    pub global_batch: usize,
    /// The highest validation accuracy of any epoch.
    pub best_accuracy: Option<f64>,
    /// The last epoch's validation accuracy.
    pub final_accuracy: Option<f64>,
    /// Seconds of machine time, every segment's.
    pub seconds: Option<f64>,
    /// Training images per second over the run's epochs (the summary's figure).
    pub images_per_sec: Option<f64>,
    /// The price to train, when every segment had one.
    pub cost: Option<f64>,
}

impl RunFigures {
    /// The figures of run folder `run`, refused when it holds no checkpoint.
    pub fn read(run: &Path) -> Result<RunFigures, FolderError> {
        let meta = CheckpointMeta::load_weights_only(run)?;
        let metrics = run.join(METRICS_FILE);
        let lines = match metrics.exists() {
            true => read_metrics(&metrics)?,
            false => Vec::new(),
        };
        let valid: Vec<&EpochMetrics> = lines
            .iter()
            .filter(|m| m.split == MetricsSplit::Valid)
            .collect();
        let time = MachineTime::of(&meta.machine_time);
        Ok(RunFigures {
            model: meta.model.clone(),
            devices: meta.machine_time.last().map(|s| s.devices),
            ranks: meta.replicas,
            global_batch: meta.global_batch,
            best_accuracy: valid.iter().map(|m| m.accuracy).reduce(f64::max),
            final_accuracy: valid.last().map(|m| m.accuracy),
            seconds: time.map(|t| t.seconds),
            images_per_sec: training_rate(&lines),
            cost: time.and_then(|t| t.cost),
        })
    }
}

/// Training images per second over a run's epochs: every epoch's images over every epoch's
/// training seconds (the last training line of each epoch); `None` without one.
pub fn training_rate(lines: &[EpochMetrics]) -> Option<f64> {
    let mut last = BTreeMap::new();
    for m in lines.iter().filter(|m| m.split == MetricsSplit::Train) {
        last.insert(m.epoch, m);
    }
    let images: f64 = last.values().map(|m| m.images_per_sec * m.seconds).sum();
    let seconds: f64 = last.values().map(|m| m.seconds).sum();
    (seconds > 0.0).then(|| images / seconds)
}
