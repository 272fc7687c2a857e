//! The one-screen summary printed at the end of a run.

use std::fmt::Write;

use super::folder::metrics::{EpochMetrics, MetricsSplit};
use super::folder::run_figures::training_rate;
use super::folder::{BestEpoch, BestRule, MachineTime, Monitor};

/// What the summary says besides the per-epoch table.
#[derive(Debug, Clone)]
pub struct SummaryHeader {
    /// "resnet8 · 10 classes · cpu (2 threads) × 1 replica · global batch 32".
    pub title: String,
    /// Wall time of this process's run, seconds.
    pub wall_seconds: f64,
    /// Run folder.
    pub out: std::path::PathBuf,
    /// Share of training time spent waiting for the input engine, when measured.
    pub data_wait_share: Option<f64>,
    /// The best epoch, whose checkpoint is in `out/best/`.
    pub best: Option<BestEpoch>,
    /// The rule that picked it (`--monitor`, `--min-delta`).
    pub best_rule: BestRule,
    /// The machine time the run's checkpoint records (all its segments), when it has one.
    pub machine_time: Option<MachineTime>,
}

/// Formats the per-epoch table (train and valid side by side) and the headline figures.
pub fn format_summary(header: &SummaryHeader, lines: &[EpochMetrics]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "\n── summary: {} ──", header.title);
    let _ = writeln!(
        s,
        "{:>5} │ {:>10} {:>9} │ {:>10} {:>9} {:>6} │ {:>9} {:>8}",
        "epoch",
        "train loss",
        "train acc",
        "valid loss",
        "valid acc",
        "top-5",
        "images/s",
        "seconds"
    );
    let epochs: std::collections::BTreeSet<u64> = lines.iter().map(|m| m.epoch).collect();
    let find = |e: u64, split| {
        lines
            .iter()
            .rev()
            .find(|m| m.epoch == e && m.split == split)
    };
    let mut train_seconds = 0.0;
    for &e in &epochs {
        let t = find(e, MetricsSplit::Train);
        let v = find(e, MetricsSplit::Valid);
        let cell = |x: Option<f64>, w: usize, p: usize| match x {
            Some(x) => format!("{x:>w$.p$}"),
            None => format!("{:>w$}", "-"),
        };
        if let Some(t) = t {
            train_seconds += t.seconds;
        }
        let _ = writeln!(
            s,
            "{:>5} │ {} {} │ {} {} {} │ {} {}",
            e,
            cell(t.map(|m| m.loss), 10, 4),
            cell(t.map(|m| m.accuracy), 9, 4),
            cell(v.map(|m| m.loss), 10, 4),
            cell(v.map(|m| m.accuracy), 9, 4),
            cell(v.map(|m| m.top5), 6, 3),
            cell(t.map(|m| m.images_per_sec), 9, 1),
            cell(t.map(|m| m.seconds + v.map_or(0.0, |v| v.seconds)), 8, 2),
        );
    }
    let judged = if header.best_rule.monitor.follows_average() {
        MetricsSplit::ValidEma
    } else {
        MetricsSplit::Valid
    };
    let of = |split| -> Vec<&EpochMetrics> { lines.iter().filter(|m| m.split == split).collect() };
    let valid = of(MetricsSplit::Valid);
    // The trainer's record, else its rule for the best epoch applied in epoch order.
    let best = header.best.or_else(|| {
        of(judged)
            .iter()
            .map(|m| BestEpoch::of(m))
            .reduce(|best, m| {
                if header.best_rule.improves(&best, m.accuracy, m.loss) {
                    m
                } else {
                    best
                }
            })
    });
    if let (Some(last), Some(best)) = (valid.last(), best) {
        let (figure, value) = match header.best_rule.monitor {
            Monitor::ValAccuracy => ("best", best.accuracy),
            Monitor::ValLoss => ("lowest loss", best.loss),
            Monitor::ValEmaAccuracy => ("best of the moving average", best.accuracy),
            Monitor::ValEmaLoss => ("lowest loss of the moving average", best.loss),
        };
        let _ = writeln!(
            s,
            "valid accuracy {:.4} (top-5 {:.4}) · {figure} {value:.4} at epoch {}",
            last.accuracy, last.top5, best.epoch
        );
    }
    let averaged: Vec<&EpochMetrics> = lines
        .iter()
        .filter(|m| m.split == MetricsSplit::ValidEma)
        .collect();
    if let Some(last) = averaged.last() {
        // A run judged by the average names its best epoch in the line above, by its rule
        // (ties and --min-delta included): this line names no other.
        let highest = if judged == MetricsSplit::ValidEma {
            String::new()
        } else {
            let top = averaged
                .iter()
                .copied()
                .reduce(|a, b| if b.accuracy > a.accuracy { b } else { a })
                .unwrap_or(last);
            format!(" · highest {:.4} at epoch {}", top.accuracy, top.epoch)
        };
        let _ = writeln!(
            s,
            "moving average: valid accuracy {:.4} (top-5 {:.4}){highest} · eval --ema and predict --ema use it",
            last.accuracy, last.top5
        );
    }
    let mean_speed = training_rate(lines).unwrap_or(0.0);
    let per_epoch = if epochs.is_empty() {
        0.0
    } else {
        train_seconds / epochs.len() as f64
    };
    let wait = header
        .data_wait_share
        .map_or(String::new(), |w| format!(" · data-wait {:.1}%", w * 100.0));
    let _ = writeln!(
        s,
        "wall time {:.1} s · training {:.1} images/s · {:.2} s per epoch (training){wait}",
        header.wall_seconds, mean_speed, per_epoch
    );
    if let Some(time) = header.machine_time {
        let _ = writeln!(s, "{}", time.line());
    }
    let _ = write!(
        s,
        "run folder {}: {}",
        header.out.display(),
        run_files(&header.out, header.best)
    );
    s
}

/// The files of the run folder `out` that exist now, in the order a finished run has them
/// (a run stopped before its first epoch has no metrics or report yet); `best/` with its
/// epoch when there is one.
fn run_files(out: &std::path::Path, best: Option<BestEpoch>) -> String {
    use super::folder::checkpoint::{BEST_DIR, MODEL_EMA_FILE, MODEL_FILE, SIDECAR_FILE};
    use super::folder::{METRICS_FILE, REPORT_FILE};
    let mut names: Vec<String> = [
        MODEL_FILE,
        MODEL_EMA_FILE,
        SIDECAR_FILE,
        METRICS_FILE,
        REPORT_FILE,
    ]
    .into_iter()
    .filter(|name| out.join(name).is_file())
    .map(str::to_string)
    .collect();
    if let Some(b) = best.filter(|_| out.join(BEST_DIR).is_dir()) {
        names.push(format!("{BEST_DIR}/ (epoch {})", b.epoch));
    }
    if names.is_empty() {
        "nothing written yet".to_string()
    } else {
        names.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_has_every_epoch_and_headline() {
        let mk = |epoch, split, acc| EpochMetrics {
            epoch,
            split,
            loss: 1.0,
            accuracy: acc,
            top5: 1.0,
            images_per_sec: 100.0,
            seconds: 2.0,
        };
        let lines = vec![
            mk(1, MetricsSplit::Train, 0.5),
            mk(1, MetricsSplit::Valid, 0.6),
            mk(2, MetricsSplit::Train, 0.7),
            mk(2, MetricsSplit::Valid, 0.9),
        ];
        let dir = tempfile::tempdir().unwrap();
        for file in [
            "model.safetensors",
            "checkpoint.json",
            "metrics.jsonl",
            "report.png",
        ] {
            std::fs::write(dir.path().join(file), b"x").unwrap();
        }
        std::fs::create_dir(dir.path().join("best")).unwrap();
        let mut header = SummaryHeader {
            title: "resnet8".into(),
            wall_seconds: 9.0,
            out: dir.path().into(),
            data_wait_share: Some(0.012),
            best: None,
            best_rule: BestRule::default(),
            machine_time: None,
        };
        let text = format_summary(&header, &lines);
        assert!(text.contains("valid accuracy 0.9000"), "{text}");
        assert!(text.contains("best 0.9000 at epoch 2"), "{text}");
        assert!(text.ends_with("report.png"), "{text}");
        header.best = Some(BestEpoch {
            epoch: 2,
            accuracy: 0.9,
            loss: 1.0,
        });
        let text = format_summary(&header, &lines);
        assert!(text.ends_with("report.png, best/ (epoch 2)"), "{text}");
        assert!(text.contains("training 100.0 images/s"), "{text}");
        assert!(text.contains("data-wait 1.2%"), "{text}");
        assert_eq!(text.lines().filter(|l| l.contains('│')).count(), 3);
        assert!(!text.contains("moving average"), "{text}");
        assert!(!text.contains("machine time"), "none recorded: {text}");
        let priced = SummaryHeader {
            machine_time: MachineTime::of(&[crate::train::folder::Segment {
                devices: 2,
                ranks: 2,
                seconds: 1800.0,
                price_per_hour: Some(3.0),
            }]),
            ..header.clone()
        };
        let text = format_summary(&priced, &lines);
        assert!(
            text.contains("\nmachine time 1800.0 s · 1.0000 device-hours · cost 3.0000\n"),
            "{text}"
        );
        // A run with --model-ema: its figures and file, the table unchanged.
        let mut averaged = lines.clone();
        averaged.push(mk(1, MetricsSplit::ValidEma, 0.8));
        averaged.push(mk(2, MetricsSplit::ValidEma, 0.7));
        let text = format_summary(&header, &averaged);
        assert!(
            text.contains(
                "moving average: valid accuracy 0.7000 (top-5 1.0000) · highest 0.8000 at epoch 1"
            ),
            "{text}"
        );
        // Judged by the average: one best epoch, named once, by the rule (epoch 2 here, the
        // later of two equal accuracies with the lower loss), never a second one.
        let mut tied = lines.clone();
        tied.push(mk(1, MetricsSplit::ValidEma, 0.8));
        tied.push(EpochMetrics {
            loss: 0.1,
            ..mk(2, MetricsSplit::ValidEma, 0.8)
        });
        let judged_by_average = SummaryHeader {
            best: None,
            best_rule: BestRule {
                monitor: Monitor::ValEmaAccuracy,
                min_delta: 0.0,
            },
            ..header.clone()
        };
        let text = format_summary(&judged_by_average, &tied);
        assert!(
            text.contains("best of the moving average 0.8000 at epoch 2"),
            "{text}"
        );
        assert!(!text.contains("at epoch 1"), "{text}");
        std::fs::write(dir.path().join("model_ema.safetensors"), b"x").unwrap();
        let text = format_summary(&header, &averaged);
        assert!(
            text.contains("model.safetensors, model_ema.safetensors, "),
            "{text}"
        );
        assert_eq!(text.lines().filter(|l| l.contains('│')).count(), 3);
    }

    #[test]
    fn only_the_files_that_exist_are_listed() {
        let dir = tempfile::tempdir().unwrap();
        let mut header = SummaryHeader {
            title: "resnet8".into(),
            wall_seconds: 0.1,
            out: dir.path().into(),
            data_wait_share: None,
            best: Some(BestEpoch {
                epoch: 1,
                accuracy: 0.5,
                loss: 1.0,
            }),
            best_rule: BestRule::default(),
            machine_time: None,
        };
        // Stopped before the first epoch ended: a checkpoint, no metrics, no report, no best/.
        std::fs::write(dir.path().join("model.safetensors"), b"x").unwrap();
        std::fs::write(dir.path().join("checkpoint.json"), b"x").unwrap();
        let text = format_summary(&header, &[]);
        assert!(
            text.ends_with(": model.safetensors, checkpoint.json"),
            "{text}"
        );
        header.out = dir.path().join("never-written");
        let text = format_summary(&header, &[]);
        assert!(text.ends_with(": nothing written yet"), "{text}");
    }

    #[test]
    fn the_best_epoch_is_the_most_accurate_and_of_those_the_lowest_loss() {
        let mk = |epoch, accuracy, loss| EpochMetrics {
            epoch,
            split: MetricsSplit::Valid,
            loss,
            accuracy,
            top5: 1.0,
            images_per_sec: 1.0,
            seconds: 1.0,
        };
        let header = SummaryHeader {
            title: "t".into(),
            wall_seconds: 1.0,
            out: "o".into(),
            data_wait_share: None,
            best: None,
            best_rule: BestRule::default(),
            machine_time: None,
        };
        let lines = [
            mk(1, 0.5, 1.0),
            mk(2, 0.9, 0.4),
            mk(3, 0.9, 0.3),
            mk(4, 0.9, 0.35),
            mk(5, 0.8, 0.25),
        ];
        let text = format_summary(&header, &lines);
        assert!(text.contains("best 0.9000 at epoch 3"), "{text}");
        let by_loss = SummaryHeader {
            best_rule: BestRule {
                monitor: Monitor::ValLoss,
                min_delta: 0.0,
            },
            ..header
        };
        let text = format_summary(&by_loss, &lines);
        assert!(text.contains("lowest loss 0.2500 at epoch 5"), "{text}");
    }
}
