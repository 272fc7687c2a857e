//! Checkpoints: `RUN/model.safetensors` (torchvision names), `RUN/optimizer.safetensors`
//! and the `RUN/checkpoint.json` sidecar.
//!
//! Every file is written to a temporary name, synced and renamed. The sidecar is renamed
//! last and records an xxh3 checksum of both tensor files, so a crash between two renames
//! is caught on load ("torn checkpoint") instead of silently resuming from mixed files.

use std::fs;
use std::path::Path;

use pipeline::LastBatch;
use serde::{Deserialize, Serialize};

use super::files::{file_checksum, write_atomic};
use super::metrics::MetricsAccumulator;
use super::FolderError;
use crate::optim::{Decay, OptimizerChoice, ScheduleChoice};

/// File name of the weights inside a run folder.
pub const MODEL_FILE: &str = "model.safetensors";
/// File name of the optimizer state inside a run folder.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// File name of the JSON sidecar inside a run folder.
pub const SIDECAR_FILE: &str = "checkpoint.json";
/// Version of the sidecar format; bumped on incompatible changes.
pub const SIDECAR_VERSION: u32 = 1;

/// Where in the data a checkpoint was taken: enough to restart the exact batch sequence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DataPosition {
    /// The epoch to run next (0-based, as the pipeline counts).
    pub epoch: u64,
    /// The step inside that epoch to run next (0 at an epoch boundary).
    pub step_in_epoch: usize,
    /// Training samples of that epoch already consumed (lets another global batch resume).
    pub samples_in_epoch: u64,
    /// Steps taken since the start of training (drives the learning-rate schedule).
    pub global_step: u64,
    /// Training figures of the unfinished epoch, so its metrics line covers all of it.
    pub partial_train: MetricsAccumulator,
}

impl DataPosition {
    /// The start of training.
    pub fn start() -> DataPosition {
        DataPosition {
            epoch: 0,
            step_in_epoch: 0,
            samples_in_epoch: 0,
            global_step: 0,
            partial_train: MetricsAccumulator::default(),
        }
    }

    /// The start of the next epoch (the global step carries on).
    pub fn next_epoch(&self) -> DataPosition {
        DataPosition {
            epoch: self.epoch + 1,
            global_step: self.global_step,
            ..DataPosition::start()
        }
    }
}

/// `--last-batch` as its command-line word in the sidecar.
mod last_batch_name {
    use pipeline::LastBatch;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(v: &LastBatch, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(v.as_str())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<LastBatch, D::Error> {
        let text = String::deserialize(d)?;
        text.parse()
            .map_err(|_| serde::de::Error::custom(format!("unknown last-batch policy {text:?}")))
    }
}

/// The training settings a resumed run continues with (flags given on resume override them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunSettings {
    /// `--lr` (for a global batch of 256).
    pub lr: f32,
    /// SGD momentum.
    pub momentum: f32,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// Weight decay.
    pub weight_decay: f32,
    /// Label smoothing.
    pub label_smoothing: f32,
    /// Warmup epochs.
    pub warmup_epochs: u32,
    /// The decay family.
    pub schedule: ScheduleChoice,
    /// Step decay period in epochs (step schedule).
    pub step_every: u32,
    /// Step decay factor (step schedule).
    pub step_gamma: f32,
    /// Random crop + flip.
    pub augment: bool,
    /// Frozen batch norm.
    pub freeze_bn: bool,
    /// The last incomplete batch.
    #[serde(with = "last_batch_name")]
    pub last_batch: LastBatch,
    /// Flat layout validation share.
    pub valid_fraction: Option<f32>,
}

impl RunSettings {
    /// The schedule's decay.
    pub fn decay(&self) -> Decay {
        self.schedule.decay(self.step_every, self.step_gamma)
    }
}

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
}

impl CheckpointMeta {
    /// Reads and checks the sidecar of run folder `run`: it must exist, parse, and match the
    /// checksums of the tensor files beside it.
    pub fn load(run: &Path) -> Result<Self, FolderError> {
        let bad = |reason: String| FolderError::BadRunDir {
            path: run.to_path_buf(),
            reason,
        };
        if !run.is_dir() {
            return Err(bad("it is not a folder".into()));
        }
        let path = run.join(SIDECAR_FILE);
        let text = fs::read_to_string(&path).map_err(|e| {
            bad(format!(
                "cannot read {SIDECAR_FILE} ({e}); is this a birdtrain run folder?"
            ))
        })?;
        let meta: CheckpointMeta = serde_json::from_str(&text)
            .map_err(|e| bad(format!("{SIDECAR_FILE} is not a valid checkpoint sidecar: {e}")))?;
        if meta.version != SIDECAR_VERSION {
            return Err(bad(format!(
                "sidecar version {} is not supported (expected {SIDECAR_VERSION})",
                meta.version
            )));
        }
        for (file, want) in [
            (&meta.model_file, &meta.model_checksum),
            (&meta.optimizer_state_file, &meta.optimizer_checksum),
        ] {
            let got = file_checksum(&run.join(file))
                .map_err(|e| bad(format!("cannot read {file}: {e}")))?;
            if &got != want {
                return Err(bad(format!(
                    "{file} does not match the checksum in {SIDECAR_FILE} (torn or edited checkpoint)"
                )));
            }
        }
        Ok(meta)
    }

    /// Writes the sidecar atomically into `run`.
    pub fn save(&self, run: &Path) -> Result<(), FolderError> {
        let text = serde_json::to_string_pretty(self).expect("sidecar serialises");
        write_atomic(&run.join(SIDECAR_FILE), text.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(dir: &Path) -> CheckpointMeta {
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
                augment: true,
                freeze_bn: false,
                last_batch: LastBatch::Partial,
                valid_fraction: None,
            },
            model_checksum: file_checksum(&dir.join(MODEL_FILE)).unwrap(),
            optimizer_checksum: file_checksum(&dir.join(OPTIMIZER_FILE)).unwrap(),
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
        ] {
            assert!(text.contains(word), "{word} missing from {text}");
        }
        let bad = text.replace(r#""last_batch":"partial""#, r#""last_batch":"sometimes""#);
        let err = serde_json::from_str::<CheckpointMeta>(&bad).unwrap_err();
        assert!(err.to_string().contains("sometimes"), "{err}");
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

    #[test]
    fn missing_sidecar_is_a_bad_run_dir() {
        let dir = tempfile::tempdir().unwrap();
        let err = CheckpointMeta::load(dir.path()).unwrap_err();
        assert!(matches!(err, FolderError::BadRunDir { .. }));
    }
}
