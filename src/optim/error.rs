//! The optimizer error type.

use std::path::PathBuf;

/// Errors from optimizer steps and optimizer-state files.
#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    /// Parameter and gradient vectors do not match the optimizer's layout.
    #[error("optimizer step: {what} has {got} values, the model has {want} (hint: grads and params must be flat in graph order)")]
    Length {
        /// Which vector.
        what: &'static str,
        /// Its length.
        got: usize,
        /// The expected length.
        want: usize,
    },
    /// `--optimizer` named no known optimizer.
    #[error("unknown optimizer '{0}' (valid: sgd, adam, adamw)")]
    UnknownKind(String),
    /// `--schedule` named no known schedule.
    #[error("unknown schedule '{0}' (valid: cosine, step, constant)")]
    UnknownSchedule(String),
    /// Reading or writing a state file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The rank's optimizer (the GPU's device optimizer, the CPU's fused one) failed.
    #[error("optimizer on the rank's device: {0}")]
    Device(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The model failed (uploading updated weights); boxed, so that the error stays small.
    #[error(transparent)]
    Model(Box<crate::model::ModelError>),
    /// The state file is not valid safetensors or lacks a tensor.
    #[error("{}: bad optimizer state: {detail}", path.display())]
    BadState {
        /// The file.
        path: PathBuf,
        /// What is wrong (missing tensor, wrong length, another optimizer's state).
        detail: String,
    },
}

impl From<crate::model::ModelError> for OptimError {
    fn from(e: crate::model::ModelError) -> Self {
        OptimError::Model(Box::new(e))
    }
}
