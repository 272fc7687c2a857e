//! The run folder's error type.

use std::path::PathBuf;

/// What can go wrong reading or writing a run folder. Each variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum FolderError {
    /// A file could not be read or written.
    #[error("cannot {what} {path}: {source}{}", io_hint(source))]
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
    /// A `--resume` or `--checkpoint` folder that a run is writing, before its first
    /// checkpoint.
    #[error("{path} is in use by a birdtrain run that has not saved its first checkpoint yet (no checkpoint.json) (hint: wait until its first epoch ends, when it writes one)")]
    InUseBeforeCheckpoint {
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

/// A hint for the I/O errors a user can act on (empty for the others): what to do about a
/// full or read-only disk, a missing permission, a path through a file.
pub(crate) fn io_hint(e: &std::io::Error) -> &'static str {
    use std::io::ErrorKind;
    match e.kind() {
        ErrorKind::StorageFull | ErrorKind::QuotaExceeded => {
            " (hint: free space on that disk; the run keeps its last whole checkpoint, and --resume continues from it)"
        }
        ErrorKind::ReadOnlyFilesystem => {
            " (hint: the disk is read-only: write elsewhere with --out, e.g. --resume RUN --out NEW)"
        }
        ErrorKind::PermissionDenied => " (hint: this user may not write there: choose another --out or fix the permissions)",
        ErrorKind::NotADirectory => " (hint: a part of that path is a file, not a folder)",
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_disk_errors_a_user_can_act_on_carry_a_hint() {
        let io = |kind| FolderError::Io {
            path: "run/model.safetensors".into(),
            what: "write",
            source: std::io::Error::from(kind),
        };
        use std::io::ErrorKind;
        for (kind, words) in [
            (ErrorKind::StorageFull, "free space"),
            (ErrorKind::ReadOnlyFilesystem, "--out"),
            (ErrorKind::PermissionDenied, "permissions"),
            (ErrorKind::NotADirectory, "is a file"),
        ] {
            let text = io(kind).to_string();
            assert!(text.contains("hint") && text.contains(words), "{text}");
        }
        assert!(!io(ErrorKind::UnexpectedEof).to_string().contains("hint"));
    }
}
