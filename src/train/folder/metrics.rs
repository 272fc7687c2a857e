//! `RUN/metrics.jsonl`: one JSON line per epoch and split.
//!
//! The line format is fixed by the CLI contract:
//! `{"epoch":3,"split":"valid","loss":0.41,"accuracy":0.91,"top5":0.99,"images_per_sec":812.0,"seconds":1.2}`.

use std::fs::OpenOptions;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::files::write_atomic;
use super::FolderError;

/// Which split a metrics line describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MetricsSplit {
    /// Training images (with augmentation, averaged over the epoch as it went).
    Train,
    /// Validation images (eval mode, no augmentation).
    Valid,
    /// Validation images through the moving average of the weights (`--model-ema`).
    #[serde(rename = "valid_ema")]
    ValidEma,
}

/// One line of `metrics.jsonl`. Field order is the serialised order.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EpochMetrics {
    /// Epoch number, counted from 1.
    pub epoch: u64,
    /// The split these figures belong to.
    pub split: MetricsSplit,
    /// Mean cross-entropy loss per image. JSON has no NaN: a non-finite value is written as
    /// `null` and read back as NaN, so every line a run writes reads back.
    #[serde(deserialize_with = "nan_if_null")]
    pub loss: f64,
    /// Top-1 accuracy in [0, 1].
    pub accuracy: f64,
    /// Top-5 accuracy in [0, 1].
    pub top5: f64,
    /// Images processed per second of wall time for this split in this epoch.
    pub images_per_sec: f64,
    /// Wall time spent on this split in this epoch.
    pub seconds: f64,
}

/// Running sums for one split of one epoch; turned into [`EpochMetrics`] at the end.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct MetricsAccumulator {
    /// Sum of per-image losses. Stored as a decimal string in checkpoints: Rust's float
    /// parsing is exact, serde_json's default one is not, and a resumed epoch must add up to
    /// the same bits as an uninterrupted one.
    #[serde(with = "exact_f64")]
    pub loss_sum: f64,
    /// Images whose top-1 prediction was right.
    pub correct_top1: u64,
    /// Images whose label was among the 5 highest scores.
    pub correct_top5: u64,
    /// Images seen.
    pub count: u64,
    /// Wall time accumulated so far (kept across a resume so the epoch line stays whole).
    pub seconds: f64,
    /// Part of `seconds` spent waiting for the input engine (training only).
    #[serde(default)]
    pub wait_seconds: f64,
}

impl MetricsAccumulator {
    /// Adds one micro-batch's figures.
    pub fn add(&mut self, loss_sum: f64, top1: u64, top5: u64, count: u64) {
        self.loss_sum += loss_sum;
        self.correct_top1 += top1;
        self.correct_top5 += top5;
        self.count += count;
    }

    /// Mean loss so far (0 when nothing was seen).
    pub fn mean_loss(&self) -> f64 {
        ratio(self.loss_sum, self.count)
    }

    /// Share of the wall time spent waiting for data (0 when no time passed).
    pub fn wait_share(&self) -> f64 {
        if self.seconds > 0.0 {
            (self.wait_seconds / self.seconds).min(1.0)
        } else {
            0.0
        }
    }

    /// Top-1 accuracy so far (0 when nothing was seen).
    pub fn accuracy(&self) -> f64 {
        ratio(self.correct_top1 as f64, self.count)
    }

    /// Closes the epoch: the figures of one `metrics.jsonl` line.
    pub fn finish(&self, epoch: u64, split: MetricsSplit) -> EpochMetrics {
        EpochMetrics {
            epoch,
            split,
            loss: self.mean_loss(),
            accuracy: self.accuracy(),
            top5: ratio(self.correct_top5 as f64, self.count),
            images_per_sec: if self.seconds > 0.0 {
                self.count as f64 / self.seconds
            } else {
                0.0
            },
            seconds: self.seconds,
        }
    }
}

fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// An f64 as the shortest decimal string that parses back to the same bits.
mod exact_f64 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{v:?}"))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

fn ratio(num: f64, count: u64) -> f64 {
    if count == 0 {
        0.0
    } else {
        num / count as f64
    }
}

/// Appends one line to `path` (created if missing) and flushes it.
pub fn append_metrics(path: &Path, line: &EpochMetrics) -> Result<(), FolderError> {
    let io = |source| FolderError::Io {
        path: path.to_path_buf(),
        what: "append to the metrics file",
        source,
    };
    let mut file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(io)?;
    let mut text = serde_json::to_string(line).expect("metrics serialise (plain numbers)");
    text.push('\n');
    file.write_all(text.as_bytes()).map_err(io)?;
    file.flush().map_err(io)
}

/// Reads every line of a `metrics.jsonl` file (for the report and the summary).
pub fn read_metrics(path: &Path) -> Result<Vec<EpochMetrics>, FolderError> {
    let io = |source| FolderError::Io {
        path: path.to_path_buf(),
        what: "read the metrics file",
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut out = Vec::new();
    for (index, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(io)?;
        if line.trim().is_empty() {
            continue;
        }
        let parsed = serde_json::from_str(&line).map_err(|source| FolderError::BadMetricsLine {
            path: path.to_path_buf(),
            line: index + 1,
            source,
        })?;
        out.push(parsed);
    }
    Ok(out)
}

/// Rewrites `path` keeping only the lines of epochs before `epoch` (a resumed run re-emits
/// the epoch it was stopped in, so no epoch appears twice).
pub fn truncate_metrics_from(path: &Path, epoch: u64) -> Result<(), FolderError> {
    if !path.exists() {
        return Ok(());
    }
    let kept: Vec<EpochMetrics> = read_metrics(path)?
        .into_iter()
        .filter(|m| m.epoch < epoch)
        .collect();
    let mut text = String::new();
    for line in &kept {
        text.push_str(&serde_json::to_string(line).expect("metrics serialise"));
        text.push('\n');
    }
    write_atomic(path, text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_has_the_contract_shape() {
        let line = EpochMetrics {
            epoch: 3,
            split: MetricsSplit::Valid,
            loss: 0.41,
            accuracy: 0.91,
            top5: 0.99,
            images_per_sec: 812.0,
            seconds: 1.2,
        };
        assert_eq!(
            serde_json::to_string(&line).unwrap(),
            r#"{"epoch":3,"split":"valid","loss":0.41,"accuracy":0.91,"top5":0.99,"images_per_sec":812.0,"seconds":1.2}"#
        );
    }

    #[test]
    fn accumulator_round_trips_exactly() {
        let mut acc = MetricsAccumulator::default();
        acc.add(0.1 + 0.2 + 1e-17 * 3.0, 1, 1, 1);
        acc.add(std::f64::consts::PI / 7.0, 0, 1, 1);
        let text = serde_json::to_string(&acc).unwrap();
        let back: MetricsAccumulator = serde_json::from_str(&text).unwrap();
        assert_eq!(back.loss_sum.to_bits(), acc.loss_sum.to_bits());
    }

    #[test]
    fn accumulator_means() {
        let mut acc = MetricsAccumulator::default();
        acc.add(2.0, 1, 2, 2);
        acc.add(1.0, 1, 1, 2);
        acc.seconds = 2.0;
        let m = acc.finish(1, MetricsSplit::Train);
        assert_eq!(m.loss, 0.75);
        assert_eq!(m.accuracy, 0.5);
        assert_eq!(m.top5, 0.75);
        assert_eq!(m.images_per_sec, 2.0);
    }

    #[test]
    fn append_read_and_truncate() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        for epoch in 1..=3 {
            let mut acc = MetricsAccumulator::default();
            acc.add(1.0, 1, 1, 1);
            append_metrics(&path, &acc.finish(epoch, MetricsSplit::Train)).unwrap();
        }
        assert_eq!(read_metrics(&path).unwrap().len(), 3);
        truncate_metrics_from(&path, 2).unwrap();
        let left = read_metrics(&path).unwrap();
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].epoch, 1);
    }
}
