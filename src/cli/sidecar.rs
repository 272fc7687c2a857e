//! Values `--resume` takes from a run's `checkpoint.json` are that file's: a bad one is
//! reported as the sidecar's field, never as a flag the user did not pass.

use std::path::Path;

use super::CliError;
use crate::train::checkpoint::SIDECAR_FILE;
use crate::train::folder::FolderError;
use crate::train::{RunSettings, TrainError};

/// Rewrites an error met while turning `run`'s sidecar into a configuration: a flag's check
/// becomes "checkpoint.json: field `settings.lr` is `-1` (…)".
pub(crate) fn sidecar_error(run: &Path, e: TrainError) -> CliError {
    let reason = match e {
        TrainError::InvalidConfig { flag, value, hint } => {
            let name = flag.trim_start_matches("--").replace('-', "_");
            let field = if RunSettings::FIELDS.contains(&name.as_str()) {
                format!("settings.{name}")
            } else {
                name
            };
            format!("{SIDECAR_FILE}: field `{field}` is `{value}` ({hint})")
        }
        other => format!("{SIDECAR_FILE}: {other}"),
    };
    CliError::Train(TrainError::Folder(FolderError::BadRunDir {
        path: run.to_path_buf(),
        reason: format!("{reason}; the file is damaged or was edited"),
    }))
}
