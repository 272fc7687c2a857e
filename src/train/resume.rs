//! Checkpoint writing and the checks and copies a resumed run needs.

use std::path::Path;

use super::checkpoint::{
    write_atomic, write_checkpoint, CheckpointMeta, DataPosition, DatasetStamp, SIDECAR_VERSION,
};
use super::config::TrainConfig;
use super::evaluate::summarise;
use super::run::{check_finite_state, RunState};
use super::TrainError;
use crate::backend::Backend;
use crate::model::Graph;

/// Checks a resumed checkpoint against this run: model, image size, class list.
pub(super) fn check_resume(
    cfg: &TrainConfig,
    run: &Path,
    meta: &CheckpointMeta,
    classes: &[String],
) -> Result<(), TrainError> {
    let mismatch = |what, expected: String, found: String, hint| TrainError::CheckpointMismatch {
        path: run.to_path_buf(),
        what,
        expected,
        found,
        hint,
    };
    if meta.model != cfg.arch.name() {
        return Err(mismatch(
            "model",
            cfg.arch.name().into(),
            meta.model.clone(),
            "resume with the checkpoint's --model, or start a new run",
        ));
    }
    if meta.image_size != cfg.image_size {
        return Err(mismatch(
            "image size",
            cfg.image_size.to_string(),
            meta.image_size.to_string(),
            "resume with the checkpoint's --image-size",
        ));
    }
    if meta.classes != classes {
        return Err(mismatch(
            "class list",
            summarise(classes),
            summarise(&meta.classes),
            "resume on the dataset the checkpoint was trained on",
        ));
    }
    Ok(())
}

/// Where a resumed run continues: the checkpoint's data position, moved to the same sample
/// count when the global batch changed, and back to the start of the interrupted epoch when
/// the training data changed and `--allow-data-change` allows going on (otherwise a changed
/// training set is refused, saying what changed).
pub(super) fn resume_position(
    cfg: &TrainConfig,
    run: &Path,
    meta: &CheckpointMeta,
    now: &DatasetStamp,
) -> Result<DataPosition, TrainError> {
    let mut position = meta.data_position.clone();
    if let Some(then) = &meta.dataset {
        if then != now {
            if !cfg.allow_data_change {
                return Err(TrainError::DataChanged {
                    path: run.to_path_buf(),
                    change: describe_change(then, now),
                    epoch: position.epoch + 1,
                });
            }
            tracing::warn!(
                "the training data changed since the checkpoint ({}): --allow-data-change restarts epoch {} on the new data",
                describe_change(then, now),
                position.epoch + 1
            );
            position.step_in_epoch = 0;
            position.samples_in_epoch = 0;
            position.partial_train = Default::default();
            return Ok(position);
        }
    }
    if meta.global_batch != cfg.global_batch() && position.step_in_epoch > 0 {
        // Another global batch: continue from the same sample count when it divides.
        let gb = cfg.global_batch() as u64;
        position.step_in_epoch = (position.samples_in_epoch / gb) as usize;
        if position.samples_in_epoch % gb != 0 {
            tracing::warn!(
                "resuming with global batch {gb} (was {}): {} samples of epoch {} are seen again",
                meta.global_batch,
                position.samples_in_epoch % gb,
                position.epoch + 1
            );
        }
    }
    Ok(position)
}

/// What differs between two stamps of the training data, in words.
fn describe_change(then: &DatasetStamp, now: &DatasetStamp) -> String {
    use std::cmp::Ordering;
    let (a, b) = (then.train_images, now.train_images);
    match b.cmp(&a) {
        Ordering::Less => format!("{a} training images then, {b} now: {} removed", a - b),
        Ordering::Greater => format!("{a} training images then, {b} now: {} added", b - a),
        Ordering::Equal => format!(
            "{a} training images then and now, but file names, sizes, labels or the image size differ"
        ),
    }
}

pub(super) fn copy_metrics(from: &Path, to: &Path) -> Result<(), TrainError> {
    if !from.exists() {
        return Ok(());
    }
    let bytes = std::fs::read(from).map_err(|source| TrainError::Io {
        path: from.to_path_buf(),
        what: "read",
        source,
    })?;
    write_atomic(to, &bytes)
}

/// Writes weights, optimizer state and sidecar ([`write_checkpoint`]: the sidecar commits);
/// overflowed weights are refused instead (`lr`, the last step's, is for that message).
pub(super) fn save_checkpoint<B: Backend>(
    cfg: &TrainConfig,
    graph: &Graph,
    classes: &[String],
    dataset: &DatasetStamp,
    run: &RunState<B>,
    lr: f32,
) -> Result<(), TrainError> {
    let state = run.replicas.master_state()?;
    check_finite_state(cfg, graph, &state, &run.position, lr)?;
    let model_bytes = state.to_safetensors_bytes(graph, None)?;
    let optim_bytes = run.optimizer.to_safetensors_bytes();
    let meta = checkpoint_meta(cfg, classes, dataset, &run.position);
    write_checkpoint(&cfg.out, meta, &model_bytes, &optim_bytes)
}

/// The sidecar of a checkpoint at `position` ([`write_checkpoint`] fills in the file names
/// and checksums).
pub(super) fn checkpoint_meta(
    cfg: &TrainConfig,
    classes: &[String],
    dataset: &DatasetStamp,
    position: &DataPosition,
) -> CheckpointMeta {
    CheckpointMeta {
        version: SIDECAR_VERSION,
        model: cfg.arch.name().into(),
        classes: classes.to_vec(),
        image_size: cfg.image_size,
        epoch: position.epoch,
        step: position.global_step,
        optimizer: cfg.optimizer.name().into(),
        optimizer_state_file: String::new(),
        model_file: String::new(),
        seed: cfg.seed,
        data_position: position.clone(),
        global_batch: cfg.global_batch(),
        replicas: cfg.replicas,
        batch_size: cfg.batch_size,
        epochs: cfg.epochs,
        settings: cfg.settings(),
        model_checksum: String::new(),
        optimizer_checksum: String::new(),
        dataset: Some(dataset.clone()),
    }
}
