//! What the ranks and their launcher hand back: each rank's report when it ends, a launch's
//! reports with what the summary says of its devices, the stop wish a launcher passes down
//! to every rank, and the first cause among several ranks' errors.

use super::folder::metrics::EpochMetrics;
use super::folder::{BestEpoch, DataPosition};
use super::lr_find::LrTrace;
use super::setup::Shared;
use super::TrainError;

/// Whether a rank wants to stop before global step `step` (Ctrl-C, or a test's plan): asked
/// with the rank and the step.
pub(crate) type StopWish<'a> = dyn Fn(usize, u64) -> bool + Sync + 'a;

/// What a launcher hands back: the shared state, every local rank's report, and what the
/// summary says about the devices.
pub(crate) struct Launched {
    /// The run's shared state.
    pub shared: std::sync::Arc<Shared>,
    /// One report per local rank, in rank order.
    pub reports: Vec<RankReport>,
    /// "cpu (2 threads) × 3 ranks".
    pub devices: String,
    /// Extra summary lines (pinned memory, …).
    pub notes: Vec<String>,
    /// Whether this process writes the run folder (node 0).
    pub writer: bool,
}

/// What a rank reports when it ends.
#[derive(Debug, Clone)]
pub(crate) struct RankReport {
    /// xxh3-64 of its final master weights.
    pub checksum: u64,
    /// Cross-rank checksum comparisons passed.
    pub checks_passed: u64,
    /// Its input report, when the device measures one.
    pub input_line: Option<String>,
    /// Stopped before the last epoch ended.
    pub interrupted: bool,
    /// Where training stands.
    pub position: DataPosition,
    /// The last validation line (rank 0).
    pub last_valid: Option<EpochMetrics>,
    /// Stopped by `--early-stop`.
    pub early_stopped: bool,
    /// The best epoch (rank 0's record).
    pub best: Option<BestEpoch>,
    /// Seconds waiting for input and seconds training, over the epochs of this process.
    pub session: (f64, f64),
    /// The learning-rate sweep's record (`lr-find`).
    pub lr_trace: Option<LrTrace>,
    /// Validation images this rank evaluated (its share of every pass).
    pub validated_images: u64,
}

/// The first error of the ranks, preferring a cause over the aborts it caused elsewhere.
pub(crate) fn first_cause(errors: Vec<TrainError>) -> Option<TrainError> {
    let mut errors = errors;
    let cause = errors.iter().position(|e| !e.is_abort_consequence());
    match cause {
        Some(i) => Some(errors.swap_remove(i)),
        None => errors.into_iter().next(),
    }
}
