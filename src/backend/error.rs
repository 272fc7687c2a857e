//! The backend error type.

/// Errors from a backend op.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// A tensor does not have the length an op's shape requires (a caller bug or corrupt input).
    #[error("{op}: {detail} (hint: tensors are sized for the network's max batch; check n and the shape)")]
    Shape {
        /// The op that checked.
        op: &'static str,
        /// What did not match.
        detail: String,
    },
    /// An input value is out of range (a label ≥ classes, an augment shift beyond the padding).
    #[error("{op}: invalid input: {detail}")]
    InvalidInput {
        /// The op that checked.
        op: &'static str,
        /// What was wrong, with the value.
        detail: String,
    },
    /// The device could not allocate memory.
    #[error("out of memory allocating {bytes} bytes for {what} (hint: {hint})")]
    OutOfMemory {
        /// Requested size.
        bytes: usize,
        /// What the allocation was for.
        what: String,
        /// How to recover, e.g. the batch size that would fit.
        hint: String,
    },
    /// A conformance check found a backend disagreeing with the CPU reference.
    #[error("{check}: {detail}")]
    Mismatch {
        /// The comparison, e.g. `conv_forward k3 s2 p1 2x9x7x5→4`.
        check: String,
        /// The first element out of tolerance.
        detail: String,
    },
    /// A thread of the backend's pool could not start (a limit on threads or memory).
    #[error(transparent)]
    Thread(#[from] pipeline::threads::ThreadStartError),
    /// A device/driver/kernel failure, with the underlying error.
    #[error("{op}: device error: {source}")]
    Device {
        /// The op that failed.
        op: &'static str,
        /// The driver or runtime error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Checks that a tensor length equals what an op expects.
pub(crate) fn check_len(
    op: &'static str,
    what: &str,
    got: usize,
    want: usize,
) -> Result<(), BackendError> {
    if got < want {
        return Err(BackendError::Shape {
            op,
            detail: format!("{what} has {got} elements, needs at least {want}"),
        });
    }
    Ok(())
}

/// The error of a batch-norm backward asked for a ReLU's mask without the batch norm's output
/// (an output never stored: only a prepared backward, whose gradient is masked, may omit it).
pub(crate) fn missing_mask(op: &'static str) -> BackendError {
    BackendError::InvalidInput {
        op,
        detail: "a ReLU's mask without the batch norm's output (omit it only when prepared)".into(),
    }
}
