//! The bad-files report: what the engine skipped, one JSON line per file.

use std::io::Write;
use std::path::Path;

use crate::{BadFile, PipelineError};

/// Writes the report: one JSON object per line (`path`, `kind`, `detail`), via a temporary
/// file renamed into place so a reader never sees half a report. With no bad file (yet)
/// nothing is written and an earlier report is left as it is: only a consumer that read the
/// whole split again knows it is stale (the trainer removes it after a finished run).
pub(crate) fn write_report(path: &Path, files: &[BadFile]) -> Result<(), PipelineError> {
    let err = |source| PipelineError::Report {
        path: path.to_path_buf(),
        source,
    };
    if files.is_empty() {
        return Ok(());
    }
    let tmp = path.with_extension("tmp");
    let mut out = std::io::BufWriter::new(std::fs::File::create(&tmp).map_err(err)?);
    for file in files {
        let line = serde_json::to_string(file).map_err(|e| err(std::io::Error::other(e)))?;
        writeln!(out, "{line}").map_err(err)?;
    }
    out.flush().map_err(err)?;
    drop(out);
    std::fs::rename(&tmp, path).map_err(err)
}
