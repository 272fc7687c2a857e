//! How a training run ended ([`TrainOutcome`]): every local rank's report turned into the
//! summary (with the unreadable files skipped and the ranks' checksums), the trace saved where
//! this node writes it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::folder::metrics::EpochMetrics;
use super::folder::{machine_time, BestEpoch, MachineTime};
use super::lr_find::LrTrace;
use super::report::Launched;
use super::setup::{node_rank, Shared};
use super::summary::{format_summary, SummaryHeader};
use super::TrainError;

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

pub(crate) fn outcome(launched: Launched, wall: Duration) -> Result<TrainOutcome, TrainError> {
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
        machine_time: writer
            .then(|| MachineTime::of(&machine_time::recorded(&cfg.out)))
            .flatten(),
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
}
