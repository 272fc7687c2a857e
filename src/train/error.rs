//! The trainer's error type.

use std::path::PathBuf;

use crate::backend::BackendError;
use crate::model::ModelError;
use crate::optim::OptimError;
use pipeline::PipelineError;

/// Everything that can stop a training, evaluation or prediction run. Each variant names the
/// file, flag or value involved and, where it helps, what to do.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A file could not be read or written.
    #[error("cannot {what} {path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// What was being done ("write", "read the metrics file", …).
        what: &'static str,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A line of metrics.jsonl does not parse.
    #[error("{path}:{line}: not a metrics line: {source}")]
    BadMetricsLine {
        /// The metrics file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// A `--resume` or `--checkpoint` folder is not a usable run folder.
    #[error("bad run folder {path}: {reason}")]
    BadRunDir {
        /// The folder given.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A checkpoint does not fit the requested run (another model, class list, image size).
    #[error(
        "checkpoint {path} is for {what} `{found}`, but this run has `{expected}` (hint: {hint})"
    )]
    CheckpointMismatch {
        /// The run folder.
        path: PathBuf,
        /// What differs ("model", "class list", "image size").
        what: &'static str,
        /// The value of this run.
        expected: String,
        /// The value in the checkpoint.
        found: String,
        /// What to do about it.
        hint: &'static str,
    },
    /// An option value that cannot work.
    #[error("invalid value {value} for {flag}: {hint}")]
    InvalidConfig {
        /// The flag (`--epochs`, …).
        flag: &'static str,
        /// The offending value.
        value: String,
        /// What would be valid.
        hint: String,
    },
    /// More GPUs were asked for than are present.
    #[error("--gpus {requested}: only {found} CUDA device(s) present (hint: --gpus 0 trains on the CPU{extra})")]
    NotEnoughGpus {
        /// The count asked for.
        requested: usize,
        /// The count found.
        found: usize,
        /// Extra detail (why no device was found).
        extra: String,
    },
    /// An image given to `predict` cannot be decoded.
    #[error("cannot classify {path}: {reason}")]
    BadImage {
        /// The file as the user named it.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A GPU could not be opened.
    #[error("cannot open {device}: {reason} (hint: --gpus 0 trains on the CPU)")]
    Device {
        /// The device ("cuda:0").
        device: String,
        /// The driver's answer.
        reason: String,
    },
    /// report.png could not be drawn.
    #[error("cannot draw report {path}: {reason}")]
    Report {
        /// The picture's path.
        path: PathBuf,
        /// The plotting error.
        reason: String,
    },
    /// The input engine failed.
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    /// The model failed (bad weights file, shape mismatch…).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A backend op failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The optimizer failed (state file from another model…).
    #[error(transparent)]
    Optim(#[from] OptimError),
}
