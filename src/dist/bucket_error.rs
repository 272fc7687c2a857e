//! What planning gradient buckets or tracking their readiness fails with (also carried by
//! [`CollectiveError`](super::collective::CollectiveError), so it sits below both).

/// Errors from planning buckets or tracking readiness.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BucketError {
    /// `--bucket-mb 0` or an alignment of 0.
    #[error("invalid bucket setting {what} = {value}: {hint}")]
    InvalidSetting {
        /// Which setting.
        what: &'static str,
        /// Its value.
        value: usize,
        /// How to fix it.
        hint: &'static str,
    },
    /// A parameter with zero bytes (it would make an empty all-reduce).
    #[error("parameter {name:?} has no elements; remove it from the gradient list")]
    EmptyParameter {
        /// Parameter name.
        name: String,
    },
    /// A parameter's size is not a multiple of the element size.
    #[error(
        "parameter {name:?} has {bytes} bytes, not a multiple of the {element_bytes}-byte element"
    )]
    Misaligned {
        /// Parameter name.
        name: String,
        /// Its byte size.
        bytes: usize,
        /// Element size.
        element_bytes: usize,
    },
    /// A parameter index outside the plan.
    #[error("parameter index {index} is outside the plan's {count} parameters")]
    UnknownParameter {
        /// The index.
        index: usize,
        /// Parameters in the plan.
        count: usize,
    },
    /// The same gradient reported ready twice in one step.
    #[error("gradient of parameter {index} ({name:?}) reported ready twice in one step")]
    DuplicateReady {
        /// The index.
        index: usize,
        /// Parameter name.
        name: String,
    },
    /// A step ended with gradients never reported, so some buckets were never averaged.
    #[error("the step ended but the gradients of {missing} parameter(s) were never reported ready (first: {first:?}); every backward must report every parameter")]
    IncompleteStep {
        /// How many parameters are missing.
        missing: usize,
        /// The first missing parameter.
        first: String,
    },
}
