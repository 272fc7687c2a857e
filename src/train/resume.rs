//! Checkpoint writing and the checks and copies a resumed run needs.

use std::path::Path;

use super::checkpoint::{
    write_atomic, CheckpointMeta, MODEL_FILE, OPTIMIZER_FILE, SIDECAR_VERSION,
};
use super::config::TrainConfig;
use super::evaluate::summarise;
use super::run::RunState;
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

/// Writes weights, optimizer state and sidecar (sidecar last, with checksums).
pub(super) fn save_checkpoint<B: Backend>(
    cfg: &TrainConfig,
    graph: &Graph,
    classes: &[String],
    run: &RunState<B>,
) -> Result<(), TrainError> {
    let state = run.replicas.master_state()?;
    let model_bytes = state.to_safetensors_bytes(graph, None)?;
    let optim_bytes = run.optimizer.to_safetensors_bytes();
    write_atomic(&cfg.out.join(MODEL_FILE), &model_bytes)?;
    write_atomic(&cfg.out.join(OPTIMIZER_FILE), &optim_bytes)?;
    let checksum = |bytes: &[u8]| format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes));
    let meta = CheckpointMeta {
        version: SIDECAR_VERSION,
        model: cfg.arch.name().into(),
        classes: classes.to_vec(),
        image_size: cfg.image_size,
        epoch: run.position.epoch,
        step: run.position.global_step,
        optimizer: cfg.optimizer.name().into(),
        optimizer_state_file: OPTIMIZER_FILE.into(),
        model_file: MODEL_FILE.into(),
        seed: cfg.seed,
        data_position: run.position.clone(),
        global_batch: cfg.global_batch(),
        replicas: cfg.replicas,
        batch_size: cfg.batch_size,
        epochs: cfg.epochs,
        settings: cfg.settings(),
        model_checksum: checksum(&model_bytes),
        optimizer_checksum: checksum(&optim_bytes),
    };
    meta.save(&cfg.out)
}
