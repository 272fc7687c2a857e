//! The run folder's error type.

use std::path::PathBuf;

/// What can go wrong reading or writing a run folder. Each variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum FolderError {
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
    /// Another process holds the run folder (trains, resumes or lr-finds into it).
    #[error("{path} is in use by another birdtrain process (hint: wait for it to end, or choose another --out)")]
    InUse {
        /// The run folder.
        path: PathBuf,
    },
    /// report.png could not be drawn.
    #[error("cannot draw report {path}: {reason}")]
    Report {
        /// The picture's path.
        path: PathBuf,
        /// The plotting error.
        reason: String,
    },
    /// The weights could not be serialised (a state of another model); boxed, so that the
    /// error stays small.
    #[error(transparent)]
    Model(Box<crate::model::ModelError>),
}

impl From<crate::model::ModelError> for FolderError {
    fn from(e: crate::model::ModelError) -> Self {
        FolderError::Model(Box::new(e))
    }
}
