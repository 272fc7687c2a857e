//! Checkpoints: the weights (torchvision names) and optimizer state as safetensors files, and
//! the `RUN/checkpoint.json` sidecar that names them.
//!
//! `checkpoint.json` is the single commit point. [`write_checkpoint`] writes each checkpoint's
//! tensor files under names of their own (`model-s<step>-<checksum>.safetensors`), synced,
//! then replaces the sidecar (temporary file, sync, rename, sync of the folder), and only then
//! removes the files of the checkpoint it superseded. Until the sidecar's rename the previous
//! sidecar names the previous, untouched files; after it, the new one names the new files.
//! So a kill at any moment, or a full disk, leaves the previous or the new checkpoint, whole.
//! The sidecar records an xxh3 checksum of both tensor files, so a file edited or damaged
//! later is refused on load ("torn checkpoint") instead of silently resumed.
//!
//! `RUN/model.safetensors` and `RUN/optimizer.safetensors` are kept as stable names for the
//! current files (hard links, refreshed after each commit), for PyTorch users and scripts;
//! birdtrain itself always reads the files the sidecar names. A run with `--model-ema` adds a
//! third tensor file, the moving average of the weights (`model_ema-s…`, stable name
//! `model_ema.safetensors`), written and checked the same way.

use std::fs;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::best::BestEpoch;
use super::fault::{self, FaultTarget};
use super::files::{
    bytes_checksum, commit_temp, file_checksum, sync_dir, temp_path, write_atomic, write_temp,
};
use super::machine_time::Segment;
use super::position::{DataPosition, DatasetStamp};
use super::settings::RunSettings;
use super::train_files::{self, TrainFilesRef};
use super::FolderError;
use crate::optim::OptimizerChoice;

pub use super::names::{BEST_DIR, MODEL_EMA_FILE, MODEL_FILE, OPTIMIZER_FILE, SIDECAR_FILE};

/// The tensor files of one checkpoint, as safetensors bytes, and the record of its training
/// files.
#[derive(Debug, Clone, Copy)]
pub struct CheckpointTensors<'a> {
    /// The weights and buffers.
    pub model: &'a [u8],
    /// The optimizer state.
    pub optimizer: &'a [u8],
    /// The moving average of the weights, when the run keeps one.
    pub ema: Option<&'a [u8]>,
    /// The record of the training files ([`super::train_files::TrainFiles::to_bytes`]), when
    /// the run keeps one.
    pub train_files: Option<&'a [u8]>,
}

impl<'a> CheckpointTensors<'a> {
    /// Weights and optimizer state, no average, no record of the training files.
    pub fn pair(model: &'a [u8], optimizer: &'a [u8]) -> Self {
        Self {
            model,
            optimizer,
            ema: None,
            train_files: None,
        }
    }
}
/// Version of the sidecar format; bumped on incompatible changes.
pub const SIDECAR_VERSION: u32 = 1;

/// The JSON sidecar of a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// Sidecar format version ([`SIDECAR_VERSION`]).
    pub version: u32,
    /// Model name as `--model` spells it.
    pub model: String,
    /// Class names, index = label.
    pub classes: Vec<String>,
    /// Stored (and training) image size.
    pub image_size: u32,
    /// Completed epochs.
    pub epoch: u64,
    /// Optimizer steps taken.
    pub step: u64,
    /// The optimizer family.
    pub optimizer: OptimizerChoice,
    /// File of the optimizer state, relative to the run folder.
    pub optimizer_state_file: String,
    /// File of the weights, relative to the run folder.
    pub model_file: String,
    /// Training seed.
    pub seed: u64,
    /// Where to continue in the data.
    pub data_position: DataPosition,
    /// Global batch (replicas × per-replica batch).
    pub global_batch: usize,
    /// Replicas (ranks) the run used (a checkpoint resumes on any count).
    pub replicas: usize,
    /// Per-replica batch size.
    pub batch_size: usize,
    /// Epochs the run was asked for.
    pub epochs: u64,
    /// Everything else a resumed run needs to continue the same way.
    pub settings: RunSettings,
    /// xxh3-64 of the weights file, hex.
    pub model_checksum: String,
    /// xxh3-64 of the optimizer state file, hex.
    pub optimizer_checksum: String,
    /// The training data the run was on (absent in checkpoints of older versions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dataset: Option<DatasetStamp>,
    /// The best epoch up to this checkpoint (none before the first validation, and in
    /// checkpoints of older versions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best: Option<BestEpoch>,
    /// File of the moving average of the weights (`--model-ema`), relative to the run folder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_ema_file: Option<String>,
    /// xxh3-64 of the moving average's file, hex.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_ema_checksum: Option<String>,
    /// The record of the training files' sizes, times and content hashes
    /// ([`super::train_files`]); absent in older checkpoints and lr-find's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_files: Option<TrainFilesRef>,
    /// The machine time of each segment of the run up to this checkpoint
    /// ([`super::machine_time`]); absent in older checkpoints (their time is unknown).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub machine_time: Vec<Segment>,
}

impl CheckpointMeta {
    /// Reads and checks the sidecar of run folder `run`: it must exist, parse, hold usable
    /// values, and match the checksums of the tensor files beside it.
    pub fn load(run: &Path) -> Result<Self, FolderError> {
        Self::load_checked(run, true)
    }

    /// [`CheckpointMeta::load`] for inference (`eval`, `predict`): only the weights file must
    /// be present and match; the optimizer state may be absent.
    pub fn load_weights_only(run: &Path) -> Result<Self, FolderError> {
        Self::load_checked(run, false)
    }

    fn load_checked(run: &Path, with_optimizer: bool) -> Result<Self, FolderError> {
        let bad = |reason: String| FolderError::BadRunDir {
            path: run.to_path_buf(),
            reason,
        };
        if !run.is_dir() {
            return Err(bad("it is not a folder".into()));
        }
        let path = run.join(SIDECAR_FILE);
        let text = fs::read_to_string(&path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound && super::is_in_use(run) {
                return FolderError::InUseBeforeCheckpoint {
                    path: run.to_path_buf(),
                };
            }
            bad(format!(
                "cannot read {SIDECAR_FILE} ({e}); is this a birdtrain run folder?"
            ))
        })?;
        let meta: CheckpointMeta = serde_json::from_str(&text).map_err(|e| {
            bad(format!(
                "{SIDECAR_FILE} is not a valid checkpoint sidecar{}: {e}",
                field_on_line(&text, e.line())
                    .map(|k| format!(" (field `{k}`)"))
                    .unwrap_or_default()
            ))
        })?;
        if meta.version != SIDECAR_VERSION {
            return Err(bad(format!(
                "sidecar version {} is not supported (expected {SIDECAR_VERSION})",
                meta.version
            )));
        }
        meta.check_fields().map_err(|reason| {
            bad(format!(
                "{SIDECAR_FILE}: {reason}; the file is damaged or was edited"
            ))
        })?;
        let mut meta = meta;
        if !with_optimizer {
            meta.use_stable_names_where_missing(run);
        }
        meta.check_file(run, &meta.model_file, &meta.model_checksum)?;
        if with_optimizer {
            meta.check_file(run, &meta.optimizer_state_file, &meta.optimizer_checksum)?;
            if let Some((file, sum)) = meta.model_ema() {
                meta.check_file(run, file, sum)?;
            }
            if let Some(r) = &meta.train_files {
                meta.check_file(run, &r.file, &r.checksum)?;
            }
        }
        Ok(meta)
    }

    /// For inference from a folder copied with only `checkpoint.json` and the stable names
    /// (`model.safetensors`, `model_ema.safetensors`): a tensor file the sidecar names but the
    /// folder lacks is read under its stable name instead. The checksum still decides, so a
    /// stable file of another checkpoint is refused as torn.
    fn use_stable_names_where_missing(&mut self, run: &Path) {
        let swap = |file: &mut String, stable: &str| {
            if !run.join(&*file).exists() && run.join(stable).exists() {
                *file = stable.to_string();
            }
        };
        swap(&mut self.model_file, MODEL_FILE);
        if let Some(file) = self.model_ema_file.as_mut() {
            swap(file, MODEL_EMA_FILE);
        }
    }

    /// The moving average's file and checksum, when the checkpoint has one.
    pub fn model_ema(&self) -> Option<(&String, &String)> {
        self.model_ema_file
            .as_ref()
            .zip(self.model_ema_checksum.as_ref())
    }

    /// Checks that tensor file `file` of run folder `run` matches checksum `want`.
    pub fn check_file(&self, run: &Path, file: &str, want: &str) -> Result<(), FolderError> {
        let bad = |reason: String| FolderError::BadRunDir {
            path: run.to_path_buf(),
            reason,
        };
        let got =
            file_checksum(&run.join(file)).map_err(|e| bad(format!("cannot read {file}: {e}")))?;
        if got != want {
            return Err(bad(format!(
                "{file} does not match the checksum in {SIDECAR_FILE} (torn or edited checkpoint)"
            )));
        }
        Ok(())
    }

    /// The values no run can have, as "field `name` …" (the sidecar's own field names).
    fn check_fields(&self) -> Result<(), String> {
        if self.classes.is_empty() {
            return Err("field `classes` is empty (a model needs at least one class)".into());
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(dup) = self.classes.iter().find(|c| !seen.insert(c.as_str())) {
            return Err(format!("field `classes` names `{dup}` twice"));
        }
        if !(8..=1024).contains(&self.image_size) {
            return Err(format!(
                "field `image_size` is {} (training uses 8 to 1024 pixels)",
                self.image_size
            ));
        }
        if pipeline::SplitRule::from_version(self.settings.split_version).is_none() {
            return Err(format!(
                "field `split_version` is {} (this birdtrain knows split versions 1 and 2; a newer one wrote it)",
                self.settings.split_version
            ));
        }
        if self.model_ema_file.is_some() != self.model_ema_checksum.is_some() {
            return Err(
                "fields `model_ema_file` and `model_ema_checksum` come together or not at all"
                    .into(),
            );
        }
        let ema = self.model_ema_file.iter().map(|f| ("model_ema_file", f));
        let files = self.train_files.iter().map(|r| ("train_files", &r.file));
        for (name, file) in [
            ("model_file", &self.model_file),
            ("optimizer_state_file", &self.optimizer_state_file),
        ]
        .into_iter()
        .chain(ema)
        .chain(files)
        {
            // Tensor files live inside the run folder: a bare file name.
            let bare = Path::new(file)
                .file_name()
                .is_some_and(|n| n == file.as_str());
            if !bare {
                return Err(format!(
                    "field `{name}` is `{file}` (expected a file name inside the run folder)"
                ));
            }
        }
        Ok(())
    }

    /// Writes the sidecar atomically into `run` (the tensor files it names must be in place;
    /// [`write_checkpoint`] is the whole protocol).
    pub fn save(&self, run: &Path) -> Result<(), FolderError> {
        let text = serde_json::to_string_pretty(self).expect("sidecar serialises");
        write_atomic(&run.join(SIDECAR_FILE), text.as_bytes())
    }
}

/// The key on 1-based `line` of a pretty-printed JSON object (`  "image_size": 32,`), so a
/// parse error can name the field (the sidecar is written one field per line).
fn field_on_line(text: &str, line: usize) -> Option<&str> {
    let rest = text.lines().nth(line.checked_sub(1)?)?.trim_start();
    let (key, after) = rest.strip_prefix('"')?.split_once('"')?;
    after.trim_start().starts_with(':').then_some(key)
}

/// The stages of [`write_checkpoint`], in order (fault-injection points of the tests).
pub const CHECKPOINT_STAGES: [&str; 6] = [
    "model",
    "optimizer",
    "sidecar-temp",
    "sidecar",
    "links",
    "cleanup",
];

/// Writes one checkpoint into `run`: its `tensors` under names of their own, then `meta`
/// (its file names and checksums are filled in here) as the sidecar, the commit point; then
/// refreshes the stable names and removes what the previous checkpoint left. See the module
/// documentation for why any interruption is safe.
pub fn write_checkpoint(
    run: &Path,
    meta: CheckpointMeta,
    tensors: CheckpointTensors<'_>,
) -> Result<(), FolderError> {
    write_checkpoint_for(FaultTarget::Checkpoint, run, meta, tensors)
}

/// [`write_checkpoint`], counted as a checkpoint of `target` by the fault hook.
pub(crate) fn write_checkpoint_for(
    target: FaultTarget,
    run: &Path,
    mut meta: CheckpointMeta,
    tensors: CheckpointTensors<'_>,
) -> Result<(), FolderError> {
    let CheckpointTensors {
        model,
        optimizer,
        ema,
        train_files: files_record,
    } = tensors;
    let nth = fault::begin_checkpoint(target);
    let stage = |name: &'static str, path: &Path| {
        fault::at(target, name, nth).map_err(|source| FolderError::Io {
            path: path.to_path_buf(),
            what: "write",
            source,
        })
    };
    let step = meta.data_position.global_step;
    let model_sum = bytes_checksum(model);
    let optimizer_sum = bytes_checksum(optimizer);
    meta.model_file = format!("model-s{step:08}-{model_sum}.safetensors");
    meta.optimizer_state_file = format!("optimizer-s{step:08}-{optimizer_sum}.safetensors");
    meta.model_checksum = model_sum;
    meta.optimizer_checksum = optimizer_sum;
    // A name is its content's checksum, so rewriting a file the current sidecar names (the
    // same step saved twice) puts the same bytes back.
    let model_path = run.join(&meta.model_file);
    write_atomic(&model_path, model)?;
    (meta.model_ema_file, meta.model_ema_checksum) = match ema {
        Some(bytes) => {
            let sum = bytes_checksum(bytes);
            let file = format!("model_ema-s{step:08}-{sum}.safetensors");
            write_atomic(&run.join(&file), bytes)?;
            (Some(file), Some(sum))
        }
        None => (None, None),
    };
    stage("model", &model_path)?;
    let optimizer_path = run.join(&meta.optimizer_state_file);
    write_atomic(&optimizer_path, optimizer)?;
    meta.train_files = match files_record {
        Some(bytes) => {
            let checksum = bytes_checksum(bytes);
            let file = train_files::file_name(&checksum);
            // Named by its checksum: a file of that name holds these bytes already (the
            // record changes only while the first epoch reads the files).
            let path = run.join(&file);
            if !path.exists() {
                write_atomic(&path, bytes)?;
            }
            Some(TrainFilesRef { file, checksum })
        }
        None => None,
    };
    stage("optimizer", &optimizer_path)?;

    let sidecar = run.join(SIDECAR_FILE);
    let text = serde_json::to_string_pretty(&meta).expect("sidecar serialises");
    let tmp = write_temp(&sidecar, text.as_bytes())?;
    if let Err(e) = stage("sidecar-temp", &sidecar) {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    commit_temp(&tmp, &sidecar)?;
    sync_dir(run);
    stage("sidecar", &sidecar)?;

    // Committed. What follows only tidies up: a failure is a warning, never a lost checkpoint.
    let ema = meta.model_ema_file.iter().map(|f| (MODEL_EMA_FILE, f));
    for (stable, current) in [
        (MODEL_FILE, &meta.model_file),
        (OPTIMIZER_FILE, &meta.optimizer_state_file),
    ]
    .into_iter()
    .chain(ema)
    {
        if let Err(e) = link_stable(run, stable, current) {
            tracing::warn!(
                "checkpoint saved, but {} could not be refreshed: {e}",
                run.join(stable).display()
            );
        }
    }
    stage("links", &run.join(MODEL_FILE))?;
    remove_superseded(run, &meta);
    stage("cleanup", run)?;
    Ok(())
}

/// Removes what an interrupted checkpoint or run left in `run`: temporary files and tensor
/// files that no sidecar names. A folder without a readable sidecar keeps its tensor files
/// (they may be all that is left of a run).
pub fn clean_run_folder(run: &Path) {
    let Ok(entries) = fs::read_dir(run) else {
        return;
    };
    let named = fs::read_to_string(run.join(SIDECAR_FILE))
        .ok()
        .and_then(|t| serde_json::from_str::<CheckpointMeta>(&t).ok());
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let stale_temp = is_temp_name(name);
        let superseded = named
            .as_ref()
            .is_some_and(|m| is_versioned_tensor_file(name) && !m.names(name));
        if stale_temp || superseded {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// `model-s…` / `optimizer-s…` / `model_ema-s…` files and `train_files-…` records written
/// by [`write_checkpoint`].
pub(crate) fn is_versioned_tensor_file(name: &str) -> bool {
    let tensors = ["model-s", "optimizer-s", "model_ema-s"]
        .iter()
        .any(|p| name.starts_with(p))
        && name.ends_with(".safetensors");
    tensors || (name.starts_with(train_files::PREFIX) && name.ends_with(".bin"))
}

impl CheckpointMeta {
    /// Whether the sidecar names tensor file (or record) `name`.
    fn names(&self, name: &str) -> bool {
        name == self.model_file
            || name == self.optimizer_state_file
            || self.model_ema_file.as_deref() == Some(name)
            || self.train_files.as_ref().is_some_and(|r| r.file == name)
    }
}

/// Names made by [`temp_path`]: `<name>.tmp<pid>`.
pub(crate) fn is_temp_name(name: &str) -> bool {
    name.rsplit_once(".tmp").is_some_and(|(stem, pid)| {
        !stem.is_empty() && !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit())
    })
}

fn remove_superseded(run: &Path, meta: &CheckpointMeta) {
    let Ok(entries) = fs::read_dir(run) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        // A stable average name with no average behind it is another run's: it goes too.
        let stale_ema = name == MODEL_EMA_FILE && meta.model_ema_file.is_none();
        if (is_versioned_tensor_file(name) && !meta.names(name)) || stale_ema {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// Points `run/stable` at `run/current`: a hard link (a copy where links are not supported)
/// under a temporary name, renamed over the old one.
fn link_stable(run: &Path, stable: &str, current: &str) -> std::io::Result<()> {
    let target = run.join(stable);
    let tmp = temp_path(&target);
    let _ = fs::remove_file(&tmp);
    if fs::hard_link(run.join(current), &tmp).is_err() {
        fs::copy(run.join(current), &tmp)?;
    }
    fs::rename(&tmp, &target).inspect_err(|_| {
        let _ = fs::remove_file(&tmp);
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::optim::{Plateau, ScheduleChoice};
    use crate::train::folder::metrics::MetricsAccumulator;
    use crate::train::folder::{BestRule, Monitor};
    use crate::train::EmaRecipe;
    use pipeline::{LastBatch, ResizeMode, Sampling};

    /// A sidecar for tensor files `model.safetensors` and `optimizer.safetensors` written
    /// into `dir`.
    #[allow(clippy::needless_update)]
    pub(crate) fn meta(dir: &Path) -> CheckpointMeta {
        fs::write(dir.join(MODEL_FILE), b"weights").unwrap();
        fs::write(dir.join(OPTIMIZER_FILE), b"state").unwrap();
        CheckpointMeta {
            version: SIDECAR_VERSION,
            model: "resnet8".into(),
            classes: vec!["a".into(), "b".into()],
            image_size: 32,
            epoch: 1,
            step: 10,
            optimizer: OptimizerChoice::Sgd,
            optimizer_state_file: OPTIMIZER_FILE.into(),
            model_file: MODEL_FILE.into(),
            seed: 7,
            data_position: DataPosition {
                epoch: 1,
                step_in_epoch: 3,
                samples_in_epoch: 48,
                global_step: 10,
                partial_train: MetricsAccumulator::default(),
                lr_scale: 0.25,
                plateau_last_cut: Some(1),
            },
            global_batch: 16,
            replicas: 2,
            batch_size: 8,
            epochs: 5,
            settings: RunSettings {
                lr: 0.8,
                momentum: 0.9,
                nesterov: true,
                weight_decay: 5e-4,
                label_smoothing: 0.0,
                warmup_epochs: 1,
                schedule: ScheduleChoice::Cosine,
                step_every: 30,
                step_gamma: 0.1,
                plateau_patience: 4,
                plateau_factor: 0.5,
                plateau_cooldown: 2,
                plateau_min_lr: 0.001,
                augment: true,
                crop_scale: Some([0.25, 1.0]),
                crop_pct: 0.875,
                store_size: Some(256),
                resize_mode: ResizeMode::ShorterSideCenterCrop,
                random_erase: 0.25,
                color_jitter_hue: 0.1,
                mixup: 0.8,
                cutmix: 1.0,
                mixup_prob: 0.9,
                mixup_switch_prob: 0.25,
                model_ema: Some(EmaRecipe {
                    steps: 16,
                    decay: 0.9999,
                }),
                clip_grad_norm: Some(5.0),
                color_jitter: 0.4,
                auto_augment: Some(pipeline::AutoAugment::RandAugment { magnitude: 12 }),
                freeze_bn: false,
                sync_bn: true,
                last_batch: LastBatch::Partial,
                sampler: Sampling::Balanced,
                valid_fraction: None,
                split_version: 2,
                save_every: 0,
                early_stop: 3,
                monitor: Monitor::ValLoss,
                min_delta: 0.01,
                // A setting recorded later starts at its default here.
                ..RunSettings::default()
            },
            model_checksum: file_checksum(&dir.join(MODEL_FILE)).unwrap(),
            optimizer_checksum: file_checksum(&dir.join(OPTIMIZER_FILE)).unwrap(),
            dataset: None,
            best: Some(BestEpoch {
                epoch: 1,
                accuracy: 0.5,
                loss: 0.7,
            }),
            model_ema_file: None,
            model_ema_checksum: None,
            train_files: None,
            machine_time: vec![Segment {
                devices: 1,
                ranks: 2,
                seconds: 12.5,
                price_per_hour: Some(0.4),
            }],
        }
    }

    #[test]
    fn sidecar_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let m = meta(dir.path());
        m.save(dir.path()).unwrap();
        assert_eq!(CheckpointMeta::load(dir.path()).unwrap(), m);
        // No temporary file is left behind.
        let names: Vec<_> = fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 3);
    }

    #[test]
    fn typed_settings_keep_the_command_line_words_in_the_sidecar() {
        let dir = tempfile::tempdir().unwrap();
        let m = meta(dir.path());
        let text = serde_json::to_string(&m).unwrap();
        for word in [
            r#""optimizer":"sgd""#,
            r#""schedule":"cosine""#,
            r#""last_batch":"partial""#,
            r#""monitor":"val_loss""#,
            r#""sampler":"balanced""#,
        ] {
            assert!(text.contains(word), "{word} missing from {text}");
        }
        let bad = text.replace(r#""last_batch":"partial""#, r#""last_batch":"sometimes""#);
        let err = serde_json::from_str::<CheckpointMeta>(&bad).unwrap_err();
        assert!(err.to_string().contains("sometimes"), "{err}");
    }

    #[test]
    fn a_sidecar_of_an_older_version_reads_with_the_new_fields_off() {
        let dir = tempfile::tempdir().unwrap();
        let m = meta(dir.path());
        let mut value = serde_json::to_value(&m).unwrap();
        value.as_object_mut().unwrap().remove("best");
        value
            .as_object_mut()
            .unwrap()
            .remove("machine_time")
            .unwrap();
        value["data_position"]
            .as_object_mut()
            .unwrap()
            .remove("lr_scale")
            .unwrap();
        value["data_position"]
            .as_object_mut()
            .unwrap()
            .remove("plateau_last_cut")
            .unwrap();
        let settings = value["settings"].as_object_mut().unwrap();
        for field in [
            "save_every",
            "early_stop",
            "sync_bn",
            "monitor",
            "min_delta",
            "sampler",
            "plateau_patience",
            "plateau_factor",
            "plateau_cooldown",
            "plateau_min_lr",
            "crop_scale",
            "crop_pct",
            "store_size",
            "resize_mode",
            "random_erase",
            "color_jitter_hue",
            "mixup",
            "cutmix",
            "mixup_prob",
            "mixup_switch_prob",
            "model_ema",
            "clip_grad_norm",
            "color_jitter",
            "auto_augment",
            "split_version",
            "grad_accum_steps",
        ] {
            settings.remove(field).unwrap();
        }
        let old: CheckpointMeta = serde_json::from_value(value).unwrap();
        assert_eq!(old.best, None);
        assert!(old.machine_time.is_empty(), "its time is unknown");
        assert_eq!(old.data_position.lr_scale, 1.0);
        assert_eq!(old.data_position.plateau_last_cut, None);
        assert_eq!(
            old.settings.decay(),
            m.settings.decay().choice().decay(
                m.settings.step_every,
                m.settings.step_gamma,
                Plateau {
                    patience: 10,
                    factor: 0.1,
                    ..Plateau::DEFAULT
                },
            )
        );
        assert_eq!(old.settings.best_rule(), BestRule::default());
        assert_eq!(old.settings.sampler, Sampling::Shuffle);
        assert_eq!(old.settings.crop_scale, None, "pad-and-crop");
        assert_eq!(old.settings.crop_pct, 1.0, "the whole image");
        assert_eq!(old.settings.store_size, None, "stored at the image size");
        assert_eq!(old.settings.resize_mode, ResizeMode::Direct, "stretched");
        assert_eq!(old.settings.random_erase, 0.0, "no erasing");
        assert_eq!(old.settings.color_jitter_hue, 0.0, "no hue jitter");
        assert_eq!(
            (
                old.settings.mixup,
                old.settings.cutmix,
                old.settings.mixup_prob,
                old.settings.mixup_switch_prob
            ),
            (0.0, 0.0, 1.0, 0.5),
            "no mixing, timm's shares"
        );
        assert_eq!(old.settings.color_jitter, 0.0, "no colour jitter");
        assert_eq!(old.settings.model_ema, None, "no moving average");
        assert_eq!(old.settings.clip_grad_norm, None, "no clipping");
        assert_eq!(old.settings.auto_augment, None, "no automatic augmentation");
        assert_eq!(
            old.settings.split_rule(),
            pipeline::SplitRule::PerFileDraw,
            "the split of its time: each file drawn on its own"
        );
        assert_eq!(old.train_files, None);
        assert_eq!(old.model_ema(), None);
        assert_eq!(
            (old.settings.plateau_patience, old.settings.plateau_factor),
            (10, 0.1)
        );
        assert_eq!(
            (
                old.settings.save_every,
                old.settings.early_stop,
                old.settings.sync_bn
            ),
            (0, 0, false)
        );
        // A checkpoint from before gradient accumulation took one micro-batch per step.
        assert_eq!(old.settings.grad_accum_steps, 1);
    }

    #[test]
    fn torn_checkpoint_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let m = meta(dir.path());
        m.save(dir.path()).unwrap();
        fs::write(dir.path().join(MODEL_FILE), b"other weights").unwrap();
        let err = CheckpointMeta::load(dir.path()).unwrap_err().to_string();
        assert!(err.contains("checksum"), "{err}");
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_checkpoint_supersedes_the_previous_one_and_leaves_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let mut m = meta(dir.path());
        fs::remove_file(dir.path().join(MODEL_FILE)).unwrap();
        fs::remove_file(dir.path().join(OPTIMIZER_FILE)).unwrap();
        write_checkpoint(
            dir.path(),
            m.clone(),
            CheckpointTensors::pair(b"weights 1", b"state 1"),
        )
        .unwrap();
        let first = CheckpointMeta::load(dir.path()).unwrap();
        assert!(first.model_file.starts_with("model-s00000010-"));
        assert_eq!(fs::read(dir.path().join(MODEL_FILE)).unwrap(), b"weights 1");
        m.data_position.global_step = 11;
        write_checkpoint(
            dir.path(),
            m.clone(),
            CheckpointTensors::pair(b"weights 2", b"state 2"),
        )
        .unwrap();
        let second = CheckpointMeta::load(dir.path()).unwrap();
        assert_ne!(first.model_file, second.model_file);
        assert_eq!(
            names(dir.path()),
            vec![
                SIDECAR_FILE.to_string(),
                MODEL_FILE.to_string(),
                second.model_file.clone(),
                OPTIMIZER_FILE.to_string(),
                second.optimizer_state_file.clone(),
            ]
            .into_iter()
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect::<Vec<_>>()
        );
        assert_eq!(
            fs::read(dir.path().join(OPTIMIZER_FILE)).unwrap(),
            b"state 2"
        );
        // The same step saved again (same bytes) keeps a loadable checkpoint.
        write_checkpoint(
            dir.path(),
            m,
            CheckpointTensors::pair(b"weights 2", b"state 2"),
        )
        .unwrap();
        assert_eq!(CheckpointMeta::load(dir.path()).unwrap(), second);
    }

    #[test]
    fn the_moving_average_is_a_checked_third_file_and_leaves_with_the_run_that_kept_it() {
        let dir = tempfile::tempdir().unwrap();
        let mut m = meta(dir.path());
        let with_average = |model: &'static [u8], ema: &'static [u8]| CheckpointTensors {
            model,
            optimizer: b"state",
            ema: Some(ema),
            train_files: None,
        };
        write_checkpoint(dir.path(), m.clone(), with_average(b"w 1", b"avg 1")).unwrap();
        let first = CheckpointMeta::load(dir.path()).unwrap();
        let file = first.model_ema_file.clone().expect("the sidecar names it");
        assert!(file.starts_with("model_ema-s00000010-"), "{file}");
        assert_eq!(fs::read(dir.path().join(MODEL_EMA_FILE)).unwrap(), b"avg 1");
        m.data_position.global_step = 11;
        write_checkpoint(dir.path(), m.clone(), with_average(b"w 2", b"avg 2")).unwrap();
        assert!(
            !dir.path().join(&file).exists(),
            "the superseded average stays"
        );
        // Damaged: a resume refuses it, inference of the weights does not need it.
        let second = CheckpointMeta::load(dir.path()).unwrap();
        let current = dir.path().join(second.model_ema_file.as_ref().unwrap());
        fs::write(&current, b"avg ?").unwrap();
        let err = CheckpointMeta::load(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("model_ema-s00000011-") && err.contains("checksum"),
            "{err}"
        );
        CheckpointMeta::load_weights_only(dir.path()).unwrap();
        // Half of the pair is an edited sidecar.
        let mut half = second.clone();
        half.model_ema_checksum = None;
        half.save(dir.path()).unwrap();
        let err = CheckpointMeta::load(dir.path()).unwrap_err().to_string();
        assert!(err.contains("model_ema_checksum"), "{err}");
        // A checkpoint without one (another run in the folder) takes every trace of it away.
        m.data_position.global_step = 12;
        write_checkpoint(dir.path(), m, CheckpointTensors::pair(b"w 3", b"s 3")).unwrap();
        let third = CheckpointMeta::load(dir.path()).unwrap();
        assert_eq!(third.model_ema(), None);
        assert!(names(dir.path())
            .iter()
            .all(|n| !n.starts_with("model_ema")));
    }

    #[test]
    fn the_record_of_the_training_files_is_a_checked_file_written_once_per_content() {
        let dir = tempfile::tempdir().unwrap();
        let mut m = meta(dir.path());
        let with_record = |record: &'static [u8]| CheckpointTensors {
            train_files: Some(record),
            ..CheckpointTensors::pair(b"w", b"s")
        };
        write_checkpoint(dir.path(), m.clone(), with_record(b"record 1")).unwrap();
        let first = CheckpointMeta::load(dir.path()).unwrap();
        let r = first.train_files.clone().expect("the sidecar names it");
        assert!(r.file.starts_with("train_files-") && r.file.ends_with(".bin"));
        assert_eq!(fs::read(dir.path().join(&r.file)).unwrap(), b"record 1");
        // The same record at the next checkpoint is the same file, kept.
        m.data_position.global_step = 11;
        write_checkpoint(dir.path(), m.clone(), with_record(b"record 1")).unwrap();
        assert_eq!(
            CheckpointMeta::load(dir.path()).unwrap().train_files,
            Some(r.clone())
        );
        // Another one supersedes it; a damaged one is a torn checkpoint for a resume.
        m.data_position.global_step = 12;
        write_checkpoint(dir.path(), m.clone(), with_record(b"record 2")).unwrap();
        assert!(!dir.path().join(&r.file).exists());
        let third = CheckpointMeta::load(dir.path()).unwrap();
        let current = third.train_files.clone().unwrap();
        fs::write(dir.path().join(&current.file), b"record ?").unwrap();
        let err = CheckpointMeta::load(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains(&current.file) && err.contains("checksum"),
            "{err}"
        );
        CheckpointMeta::load_weights_only(dir.path()).unwrap();
        // A split version this build does not know is refused, naming the field.
        let mut newer = third;
        newer.settings.split_version = 3;
        newer.save(dir.path()).unwrap();
        let err = CheckpointMeta::load_weights_only(dir.path())
            .unwrap_err()
            .to_string();
        assert!(err.contains("split_version"), "{err}");
    }

    #[test]
    fn cleaning_removes_temporaries_and_unnamed_tensor_files_only() {
        let dir = tempfile::tempdir().unwrap();
        let m = meta(dir.path());
        write_checkpoint(dir.path(), m, CheckpointTensors::pair(b"w", b"s")).unwrap();
        let before = names(dir.path());
        for leftover in [
            "model-s00000099-0123456789abcdef.safetensors",
            "checkpoint.json.tmp4242",
            "model-s00000099-0123456789abcdef.safetensors.tmp17",
            "model_ema-s00000099-0123456789abcdef.safetensors",
        ] {
            fs::write(dir.path().join(leftover), b"x").unwrap();
        }
        fs::write(dir.path().join("notes.tmpx"), b"mine").unwrap();
        clean_run_folder(dir.path());
        let mut expected = before;
        expected.push("notes.tmpx".into());
        expected.sort();
        assert_eq!(names(dir.path()), expected);
        CheckpointMeta::load(dir.path()).unwrap();
    }

    #[test]
    fn missing_sidecar_is_a_bad_run_dir() {
        let dir = tempfile::tempdir().unwrap();
        let err = CheckpointMeta::load(dir.path()).unwrap_err();
        assert!(matches!(err, FolderError::BadRunDir { .. }));
    }
}
