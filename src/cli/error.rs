//! The CLI's error type.

use std::path::PathBuf;

use crate::train::TrainError;

/// A command failed. Displayed as one line by [`super::main_with_args`].
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Training, evaluation or prediction failed.
    #[error(transparent)]
    Train(#[from] TrainError),
    /// The input engine failed (synth, bench pipeline).
    #[error(transparent)]
    Pipeline(#[from] pipeline::PipelineError),
    /// Writing the synthetic dataset failed.
    #[error(transparent)]
    Synth(#[from] pipeline::synth::SynthError),
    /// A flag value that clap accepted but that makes no sense.
    #[error("invalid value `{value}` for {flag}: {hint}")]
    BadValue {
        /// The flag.
        flag: &'static str,
        /// The value given.
        value: String,
        /// What would be valid.
        hint: String,
    },
    /// A required flag is missing.
    #[error("missing {flag} (hint: {hint})")]
    Missing {
        /// The flag.
        flag: &'static str,
        /// What to do.
        hint: &'static str,
    },
    /// An input file is missing.
    #[error("{path} does not exist (hint: {hint})")]
    MissingPath {
        /// The path given.
        path: PathBuf,
        /// What was expected there.
        hint: &'static str,
    },
    /// A path of the wrong kind (a folder where a file is expected, a device…).
    #[error("{path} is {kind}, not {expected} (hint: {hint})")]
    WrongKind {
        /// The path given.
        path: PathBuf,
        /// What it is.
        kind: &'static str,
        /// What it should be.
        expected: &'static str,
        /// What was expected there.
        hint: &'static str,
    },
    /// A folder to write into already holds files.
    #[error(
        "{path} already exists and is not empty (hint: choose a new {flag}, or pass --overwrite to replace it)"
    )]
    NotEmpty {
        /// The folder given.
        path: PathBuf,
        /// Its flag.
        flag: &'static str,
    },
    /// A path a command would write lies where writing destroys something: a run folder's
    /// own file, a `best/` folder, the dataset.
    #[error("{flag} {path} {clash} (hint: {hint})")]
    WouldOverwrite {
        /// The flag naming the path.
        flag: &'static str,
        /// The path given.
        path: PathBuf,
        /// What is there, naming it.
        clash: String,
        /// What to do instead.
        hint: String,
    },
    /// Another command's error (benchmarks and kernel tools owned by other modules).
    #[error("{0:#}")]
    Other(anyhow::Error),
}

impl CliError {
    /// An error of a command that returns `anyhow`: the [`CliError`] it carries when it is
    /// one (a bad flag value keeps its exit code 2), else [`CliError::Other`].
    pub fn from_anyhow(e: anyhow::Error) -> CliError {
        e.downcast::<CliError>().unwrap_or_else(CliError::Other)
    }

    /// The process exit code: 2 for usage mistakes (a flag value the CLI or the trainer's
    /// settings refuse, a missing flag, launch flags or launcher variables that describe no
    /// run), 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::BadValue { .. }
            | CliError::Missing { .. }
            | CliError::WouldOverwrite { .. }
            | CliError::Pipeline(pipeline::PipelineError::InvalidSetting { .. })
            | CliError::Train(
                TrainError::InvalidConfig { .. }
                | TrainError::Launch(_)
                | TrainError::Pipeline(pipeline::PipelineError::InvalidSetting { .. }),
            ) => 2,
            _ => 1,
        }
    }
}
