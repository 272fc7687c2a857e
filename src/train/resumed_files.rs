//! `--resume` against what the checkpoint recorded of its training files' contents
//! ([`TrainFiles`]): the listing (names, sizes, labels) is compared by the data fingerprint;
//! this catches what the listing cannot see, a file whose bytes changed while its name and
//! size did not (two same-sized images swapped between classes).

use std::path::Path;

use pipeline::Pipeline;

use super::config::TrainConfig;
use super::folder::{CheckpointMeta, DataPosition, DatasetStamp, TrainFiles};
use super::TrainError;

/// Files named in a refusal; the count says how many more.
const NAMED: usize = 5;

/// Checks the resumed checkpoint `meta` of `run` against the training engine `train`: each
/// file whose size or times changed since the checkpoint is read again and its content hash
/// compared with the recorded one (files with nothing changed keep their recorded hash,
/// unread). A file whose contents differ refuses the resume, naming the files; with
/// `--allow-data-change` the interrupted epoch restarts on the new contents instead, with a
/// warning. The hashes found equal are handed to the engine, so the next checkpoint records
/// them before it reads those files again. Nothing is checked when the checkpoint recorded
/// no files (an older one) or another listing (the fingerprint check has spoken).
pub(crate) fn check_resumed_contents(
    cfg: &TrainConfig,
    run: &Path,
    meta: &CheckpointMeta,
    train: &Pipeline,
    position: &mut DataPosition,
) -> Result<(), TrainError> {
    let Some(then) = TrainFiles::load(run, meta.train_files.as_ref())? else {
        return Ok(());
    };
    let same_listing = meta.dataset.as_ref() == Some(&DatasetStamp::of(train));
    if !same_listing || then.files.len() != train.len() {
        return Ok(());
    }
    let mut changed = Vec::new();
    for (i, (was, now)) in then.files.iter().zip(train.files()).enumerate() {
        let Some(recorded) = was.content else {
            continue;
        };
        let path = train
            .sample_path(i as u64)
            .expect("the listing has this many files");
        let current = if now.may_differ_from(was) {
            // The engine's cache knows the hash of the file as it is now, when it holds the
            // file; else it is read. A file that cannot be read is the engine's to report.
            match now
                .content
                .map(Ok)
                .unwrap_or_else(|| pipeline::hash_file(path))
            {
                Ok(hash) => hash,
                Err(_) => continue,
            }
        } else {
            recorded
        };
        if current == recorded {
            train.assume_content(i, recorded);
        } else {
            changed.push(path.to_path_buf());
        }
    }
    if changed.is_empty() {
        return Ok(());
    }
    let root = cfg.data.as_path();
    let shown: Vec<String> = changed
        .iter()
        .take(NAMED)
        .map(|p| p.strip_prefix(root).unwrap_or(p).display().to_string())
        .collect();
    let more = match changed.len().saturating_sub(NAMED) {
        0 => String::new(),
        n => format!(" and {n} more"),
    };
    let change = format!(
        "the contents of {} training file{} changed though their names and sizes did not: {}{more}",
        changed.len(),
        if changed.len() == 1 { "" } else { "s" },
        shown.join("; ")
    );
    if !cfg.allow_data_change {
        return Err(TrainError::DataChanged {
            path: run.to_path_buf(),
            change,
            epoch: position.epoch + 1,
        });
    }
    tracing::warn!(
        "{change}; --allow-data-change restarts epoch {} on the new contents",
        position.epoch + 1
    );
    position.restart_epoch();
    position.global_step = position.epoch * train.steps_per_epoch() as u64;
    Ok(())
}
