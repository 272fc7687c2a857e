//! The model error type.

use std::path::PathBuf;

use crate::backend::BackendError;

/// Errors from building, loading, saving or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// `--model` named no known architecture.
    #[error("unknown model '{name}' (valid: {valid})")]
    UnknownArch {
        /// What was asked for.
        name: String,
        /// The valid names, comma separated.
        valid: String,
    },
    /// Reading or writing a weights file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid safetensors.
    #[error("{}: not a valid safetensors file: {source}", path.display())]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        #[source]
        source: safetensors::SafeTensorError,
    },
    /// A tensor the model needs is absent from the file.
    #[error("{}: missing tensor '{name}' (hint: is this a {arch} checkpoint?)", path.display())]
    MissingTensor {
        /// The file.
        path: PathBuf,
        /// The tensor name.
        name: String,
        /// The model we tried to load into.
        arch: String,
    },
    /// A tensor has the wrong shape or element type.
    #[error("{}: tensor '{name}' is {got}, expected {expected}{hint}", path.display())]
    TensorMismatch {
        /// The file.
        path: PathBuf,
        /// The tensor name.
        name: String,
        /// What the model needs.
        expected: String,
        /// What the file holds.
        got: String,
        /// Extra advice (", hint: …") or empty.
        hint: String,
    },
    /// A tensor of a weights file holds NaN or an infinity (a damaged file, or the weights
    /// of a run that diverged): training from it would diverge at once.
    #[error("{}: tensor '{name}' holds {value} at index {index} (hint: the file is damaged or comes from a run that diverged; use other weights)", path.display())]
    NonFinite {
        /// The file.
        path: PathBuf,
        /// The tensor name.
        name: String,
        /// The first value that is not finite.
        value: f32,
        /// Its index in the tensor.
        index: usize,
    },
    /// A [`super::ModelState`] or flat vector does not match the graph.
    #[error("state mismatch: {0}")]
    StateMismatch(String),
    /// A batch does not fit the network (too many images, wrong image size, short buffers).
    #[error("bad batch: {0}")]
    BadBatch(String),
    /// A gradient-ready hook of [`super::Network::train_step_with`] failed (backward stopped
    /// there; the step's gradients are incomplete).
    #[error("gradient hook failed at parameter '{param}': {source}")]
    GradHook {
        /// The parameter whose gradient was being reported.
        param: String,
        /// The hook's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The cross-replica reduction of synchronised batch norm failed.
    #[error("synchronised batch norm failed at layer '{layer}': {source}")]
    BnSync {
        /// The BN layer (torchvision name without `.weight`).
        layer: String,
        /// The reduction's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A backend op failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
}
