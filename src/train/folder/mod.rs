//! The run folder (`--out RUN`): checkpoint, metrics and report, in one place.
//!
//! A run folder holds `model.safetensors`, `optimizer.safetensors`, the `checkpoint.json`
//! sidecar ([`checkpoint`]) with the machine time of each segment ([`machine_time`]), the
//! record of the training files ([`train_files`]), `metrics.jsonl` ([`metrics`]), `report.png` ([`report`]), the input engine's
//! `bad_files_<split>.txt`, and `best/`: the checkpoint of the epoch with the best validation
//! figures, itself a run folder written by the same protocol, which nothing writes into but
//! the run that owns it (`--resume RUN/best` continues into a new `--out`). [`RunFolder`]
//! is the only writer; every file is written atomically ([`files`]). The module depends on
//! nothing else of the trainer (it takes serialised tensors and plain values), so the loop
//! and any later change to the folder's format meet in one place.

mod best;
pub mod checkpoint;
mod error;
pub mod fault;
pub mod files;
mod lock;
pub mod machine_time;
pub mod metrics;
pub mod names;
mod position;
pub mod report;
pub mod run_figures;
pub mod settings;
pub mod train_files;

use std::path::{Path, PathBuf};

pub use best::{BestEpoch, BestRule, Monitor};
pub use checkpoint::{CheckpointMeta, CheckpointTensors};
pub(crate) use error::io_hint;
pub use error::FolderError;
use files::write_atomic;
pub use lock::{is_in_use, RunLock, LOCK_FILE};
pub use machine_time::{MachineTime, Segment};
use metrics::{append_metrics, read_metrics, truncate_metrics_from, EpochMetrics};
pub use position::{DataPosition, DatasetStamp};
pub use run_figures::RunFigures;
pub use settings::RunSettings;
pub use train_files::{TrainFiles, TrainFilesRef};

pub use names::METRICS_FILE;
/// File name of the report picture inside a run folder.
pub const REPORT_FILE: &str = "report.png";
/// File of a learning-rate sweep's points (`birdtrain lr-find`) inside its folder.
pub const LR_FIND_FILE: &str = "lr_find.jsonl";
/// File of a learning-rate sweep's picture inside its folder.
pub const LR_FIND_PLOT_FILE: &str = "lr_find.png";

/// A run folder and the operations the trainer performs on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunFolder {
    root: PathBuf,
}

impl RunFolder {
    /// The folder at `root` (nothing is created yet).
    pub fn new(root: impl Into<PathBuf>) -> RunFolder {
        RunFolder { root: root.into() }
    }

    /// The folder.
    pub fn path(&self) -> &Path {
        &self.root
    }

    /// `metrics.jsonl`.
    pub fn metrics_path(&self) -> PathBuf {
        self.root.join(METRICS_FILE)
    }

    /// `report.png`.
    pub fn report_path(&self) -> PathBuf {
        self.root.join(REPORT_FILE)
    }

    /// The input engine's list of unreadable files of `split`.
    pub fn bad_files_path(&self, split: impl std::fmt::Display) -> PathBuf {
        self.root.join(format!("bad_files_{split}.txt"))
    }

    /// Whether a checkpoint has been committed here.
    pub fn has_checkpoint(&self) -> bool {
        self.root.join(checkpoint::SIDECAR_FILE).exists()
    }

    /// Creates the folder; returns whether it did not exist before.
    pub fn create(&self) -> Result<bool, FolderError> {
        let created = !self.root.exists();
        std::fs::create_dir_all(&self.root).map_err(|source| FolderError::Io {
            path: self.root.clone(),
            what: "create the run folder",
            source,
        })?;
        Ok(created)
    }

    /// Takes the folder for this process alone, before anything in it is cleaned or written:
    /// a second run, resume or `lr-find` into the same folder is refused instead of the two
    /// deleting each other's temporary files and writing the same epochs twice. The lock is
    /// the OS's advisory file lock on [`LOCK_FILE`], which a process killed with -9 drops.
    pub fn lock(&self) -> Result<RunLock, FolderError> {
        RunLock::take(&self.root)
    }

    /// Removes a folder this run created but never committed a checkpoint to ("nothing
    /// half-written" after a failed start).
    pub fn discard_if_unused(&self, created: bool) {
        if created && !self.has_checkpoint() {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }

    /// Prepares `metrics.jsonl` for a run that continues with epoch `next_epoch` (0-based):
    /// a fresh run starts an empty file; a resumed one keeps the lines of the epochs before
    /// (copied from `resumed_from` when that is another folder; from the run that holds it
    /// when that is a `best/` folder, which keeps no metrics of its own), so no epoch
    /// appears twice.
    pub fn start_metrics(
        &self,
        resumed_from: Option<&Path>,
        next_epoch: u64,
    ) -> Result<(), FolderError> {
        let path = self.metrics_path();
        match resumed_from {
            None => {
                let _ = std::fs::remove_file(&path);
                Ok(())
            }
            Some(run) => {
                let owner = best_folder_owner(run);
                let from = owner.as_deref().unwrap_or(run).join(METRICS_FILE);
                if run != self.root && from.exists() {
                    let bytes = std::fs::read(&from).map_err(|source| FolderError::Io {
                        path: from.clone(),
                        what: "read",
                        source,
                    })?;
                    write_atomic(&path, &bytes)?;
                }
                truncate_metrics_from(&path, next_epoch + 1)
            }
        }
    }

    /// Appends an epoch's train and validation lines, and the moving average's validation
    /// line when the run keeps one.
    pub fn record_epoch(
        &self,
        train: &EpochMetrics,
        valid: &EpochMetrics,
        valid_ema: Option<&EpochMetrics>,
    ) -> Result<(), FolderError> {
        let path = self.metrics_path();
        append_metrics(&path, train)?;
        append_metrics(&path, valid)?;
        match valid_ema {
            Some(line) => append_metrics(&path, line),
            None => Ok(()),
        }
    }

    /// Every metrics line so far (none when the file does not exist yet).
    pub fn metrics(&self) -> Result<Vec<EpochMetrics>, FolderError> {
        let path = self.metrics_path();
        if path.exists() {
            read_metrics(&path)
        } else {
            Ok(Vec::new())
        }
    }

    /// Redraws `report.png` from the metrics.
    pub fn write_report(&self) -> Result<(), FolderError> {
        report::write_report(&self.report_path(), &self.metrics()?)
    }

    /// Commits a checkpoint ([`checkpoint::write_checkpoint`]): the weights, optimizer
    /// state and any moving average (safetensors bytes) under names of their own, then the
    /// sidecar `meta` with their file names and checksums filled in, the single commit point.
    pub fn save_checkpoint(
        &self,
        mut meta: CheckpointMeta,
        tensors: CheckpointTensors<'_>,
    ) -> Result<(), FolderError> {
        meta.version = checkpoint::SIDECAR_VERSION;
        checkpoint::write_checkpoint(&self.root, meta, tensors)
    }

    /// Removes what an interrupted checkpoint or run left behind (temporary files, tensor
    /// files no sidecar names), here and in `best/`, before anything new is written.
    pub fn clean(&self) {
        checkpoint::clean_run_folder(&self.root);
        checkpoint::clean_run_folder(&self.best_path());
    }

    /// `best/`: the best epoch's checkpoint.
    pub fn best_path(&self) -> PathBuf {
        self.root.join(checkpoint::BEST_DIR)
    }

    /// Commits the best epoch's checkpoint into `best/` (the protocol of
    /// [`RunFolder::save_checkpoint`]; `meta.best` should name this epoch).
    pub fn save_best(
        &self,
        mut meta: CheckpointMeta,
        tensors: CheckpointTensors<'_>,
    ) -> Result<(), FolderError> {
        let dir = self.best_path();
        std::fs::create_dir_all(&dir).map_err(|source| FolderError::Io {
            path: dir.clone(),
            what: "create the best-epoch folder",
            source,
        })?;
        meta.version = checkpoint::SIDECAR_VERSION;
        checkpoint::write_checkpoint_for(fault::FaultTarget::Best, &dir, meta, tensors)
    }

    /// Removes `best/` (a fresh run in a folder that held another run).
    pub fn remove_best(&self) -> Result<(), FolderError> {
        let dir = self.best_path();
        match std::fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(FolderError::Io {
                path: dir,
                what: "remove the previous run's best-epoch folder",
                source: e,
            }),
            _ => Ok(()),
        }
    }

    /// Copies the best-epoch checkpoint of run folder `from` into this folder's `best/` (a
    /// run resumed into another folder keeps its best epoch). Returns the copied checkpoint's
    /// own record of its epoch; `None` (nothing copied) when `from` has no whole `best/`.
    pub fn copy_best_from(&self, from: &Path) -> Result<Option<BestEpoch>, FolderError> {
        self.copy_best_checkpoint(&from.join(checkpoint::BEST_DIR))
    }

    /// Copies the checkpoint in folder `source` (a `best/` folder, or a run resumed from its
    /// `best/`, which is then its own best epoch) into this folder's `best/`; `None`
    /// (nothing copied) when `source` holds no whole checkpoint.
    pub fn copy_best_checkpoint(&self, source: &Path) -> Result<Option<BestEpoch>, FolderError> {
        let Ok(meta) = CheckpointMeta::load(source) else {
            return Ok(None);
        };
        let read = |file: &str| {
            let path = source.join(file);
            std::fs::read(&path).map_err(|source| FolderError::Io {
                path,
                what: "read",
                source,
            })
        };
        let model = read(&meta.model_file)?;
        let optimizer = read(&meta.optimizer_state_file)?;
        let ema = meta.model_ema_file.as_deref().map(read).transpose()?;
        let record = meta
            .train_files
            .as_ref()
            .map(|r| read(&r.file))
            .transpose()?;
        let best = meta.best;
        self.save_best(
            meta,
            CheckpointTensors {
                model: &model,
                optimizer: &optimizer,
                ema: ema.as_deref(),
                train_files: record.as_deref(),
            },
        )?;
        Ok(best)
    }

    /// Deletes the run this folder holds, whole (`--overwrite`): the sidecar first, so that
    /// from then on the folder is no run to resume (a kill midway leaves no checkpoint
    /// without its history), then every other file a run writes and `best/`; files of
    /// other names are left alone, and so is the lock this process holds.
    pub fn remove_run(&self) -> Result<(), FolderError> {
        let remove = |path: PathBuf| {
            let result = if path.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
            match result {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(FolderError::Io {
                    path,
                    what: "remove (--overwrite) the previous run's",
                    source: e,
                }),
                _ => Ok(()),
            }
        };
        remove(self.root.join(checkpoint::SIDECAR_FILE))?;
        files::sync_dir(&self.root);
        let entries = std::fs::read_dir(&self.root).map_err(|source| FolderError::Io {
            path: self.root.clone(),
            what: "list",
            source,
        })?;
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name == LOCK_FILE {
                continue;
            }
            if name == checkpoint::BEST_DIR || is_run_file_name(&name) {
                remove(entry.path())?;
            }
        }
        files::sync_dir(&self.root);
        Ok(())
    }

    /// What in the folder shows that a run is there already (the sidecar, metrics), in
    /// words; empty when nothing does.
    pub fn existing_run(&self) -> Vec<&'static str> {
        [checkpoint::SIDECAR_FILE, METRICS_FILE, LR_FIND_FILE]
            .into_iter()
            .filter(|f| self.root.join(f).exists())
            .collect()
    }
}

/// Whether `dir` holds a run (its sidecar, metrics or lock file), a folder whose own files a
/// command must never overwrite.
pub fn is_run_folder(dir: &Path) -> bool {
    [
        checkpoint::SIDECAR_FILE,
        METRICS_FILE,
        LOCK_FILE,
        LR_FIND_FILE,
    ]
    .iter()
    .any(|f| dir.join(f).exists())
}

/// The run whose best-epoch folder `dir` is (`RUN` for `RUN/best`), when it is one: a folder
/// named `best` inside a run folder. Such a folder is written by its run alone.
pub fn best_folder_owner(dir: &Path) -> Option<PathBuf> {
    let dir = pipeline::resolve(dir);
    let owner = dir.parent()?;
    (dir.file_name()? == checkpoint::BEST_DIR && is_run_folder(owner)).then(|| owner.to_path_buf())
}

/// Whether `name` is a file a run writes into its folder (the sidecar, tensor files and their
/// stable names, the record of the training files, metrics, report, lock, bad-files
/// reports, an lr-find sweep's files, the temporary files of any of them).
pub fn is_run_file_name(name: &str) -> bool {
    const FIXED: [&str; 9] = [
        checkpoint::SIDECAR_FILE,
        checkpoint::MODEL_FILE,
        checkpoint::OPTIMIZER_FILE,
        checkpoint::MODEL_EMA_FILE,
        METRICS_FILE,
        REPORT_FILE,
        LOCK_FILE,
        LR_FIND_FILE,
        LR_FIND_PLOT_FILE,
    ];
    FIXED.contains(&name)
        || checkpoint::is_versioned_tensor_file(name)
        || checkpoint::is_temp_name(name)
        || (name.starts_with("bad_files_") && name.ends_with(".txt"))
}

#[cfg(test)]
mod tests {
    use super::metrics::{MetricsAccumulator, MetricsSplit};
    use super::*;

    fn line(epoch: u64, split: MetricsSplit) -> EpochMetrics {
        let mut acc = MetricsAccumulator::default();
        acc.add(1.0, 1, 1, 2);
        acc.finish(epoch, split)
    }

    #[test]
    fn one_process_holds_a_run_folder_at_a_time() {
        let tmp = tempfile::tempdir().unwrap();
        let folder = RunFolder::new(tmp.path().join("run"));
        folder.create().unwrap();
        let held = folder.lock().unwrap();
        // A second open file description is what a second process would hold.
        let e = folder.lock().unwrap_err();
        assert!(matches!(e, FolderError::InUse { .. }), "{e}");
        assert!(e.to_string().contains("another --out"), "{e}");
        drop(held);
        let _again = folder.lock().unwrap();
        // The lock file is no run of its own.
        assert!(folder.existing_run().is_empty());
    }

    #[test]
    fn a_lock_released_a_moment_later_is_taken_not_called_in_use() {
        // What a child process started by another thread does for an instant: hold the lock
        // a finished run released (its copy of the open file lives until its exec).
        let tmp = tempfile::tempdir().unwrap();
        let folder = RunFolder::new(tmp.path().join("run"));
        folder.create().unwrap();
        let held = folder.lock().unwrap();
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            drop(held);
        });
        let _taken = folder.lock().expect("the lock, once released");
        releaser.join().unwrap();
    }

    #[test]
    fn a_resumed_folder_keeps_the_epochs_before_and_a_fresh_one_starts_empty() {
        let tmp = tempfile::tempdir().unwrap();
        let first = RunFolder::new(tmp.path().join("first"));
        assert!(first.create().unwrap());
        for e in 1..=3 {
            first
                .record_epoch(
                    &line(e, MetricsSplit::Train),
                    &line(e, MetricsSplit::Valid),
                    None,
                )
                .unwrap();
        }
        // Resumed elsewhere at epoch index 2 (epochs 1 and 2 done): lines of 1 and 2 stay.
        let second = RunFolder::new(tmp.path().join("second"));
        second.create().unwrap();
        second.start_metrics(Some(first.path()), 2).unwrap();
        let kept: Vec<u64> = second.metrics().unwrap().iter().map(|m| m.epoch).collect();
        assert_eq!(kept, vec![1, 1, 2, 2]);
        first.start_metrics(None, 0).unwrap();
        assert!(first.metrics().unwrap().is_empty());
    }

    #[test]
    fn the_best_epoch_is_a_run_folder_of_its_own_and_travels_with_a_resume_elsewhere() {
        let tmp = tempfile::tempdir().unwrap();
        let first = RunFolder::new(tmp.path().join("first"));
        first.create().unwrap();
        assert_eq!(first.copy_best_from(tmp.path()).unwrap(), None);
        let best = BestEpoch {
            epoch: 2,
            accuracy: 0.75,
            loss: 0.5,
        };
        let mut meta = checkpoint::tests::meta(first.path());
        meta.best = Some(best);
        first
            .save_best(
                meta,
                CheckpointTensors {
                    model: b"best weights",
                    optimizer: b"best state",
                    ema: Some(b"best average"),
                    train_files: Some(b"best record"),
                },
            )
            .unwrap();
        let saved = CheckpointMeta::load(&first.best_path()).unwrap();
        assert_eq!(saved.best, Some(best));
        let second = RunFolder::new(tmp.path().join("second"));
        second.create().unwrap();
        assert_eq!(second.copy_best_from(first.path()).unwrap(), Some(best));
        let copied = CheckpointMeta::load(&second.best_path()).unwrap();
        assert_eq!(
            std::fs::read(second.best_path().join(&copied.model_file)).unwrap(),
            b"best weights"
        );
        let average = copied.model_ema_file.as_ref().expect("the average travels");
        assert_eq!(
            std::fs::read(second.best_path().join(average)).unwrap(),
            b"best average"
        );
        let record = copied.train_files.as_ref().expect("the record travels");
        assert_eq!(
            std::fs::read(second.best_path().join(&record.file)).unwrap(),
            b"best record"
        );
        // A damaged best/ is not copied (the resumed run starts a new best).
        std::fs::write(first.best_path().join(&saved.model_file), b"edited").unwrap();
        second.remove_best().unwrap();
        assert_eq!(second.copy_best_from(first.path()).unwrap(), None);
        assert!(!second.best_path().exists());
        second.remove_best().unwrap();
    }

    #[test]
    fn a_run_continued_from_its_best_folder_takes_the_runs_metrics_up_to_that_epoch() {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunFolder::new(tmp.path().join("run"));
        run.create().unwrap();
        for e in 1..=4 {
            run.record_epoch(
                &line(e, MetricsSplit::Train),
                &line(e, MetricsSplit::Valid),
                None,
            )
            .unwrap();
        }
        std::fs::create_dir(run.best_path()).unwrap();
        assert_eq!(
            best_folder_owner(&run.best_path()),
            Some(pipeline::resolve(run.path()))
        );
        assert_eq!(best_folder_owner(run.path()), None);
        // best/ holds epoch 2: the new folder's history is the run's first two epochs.
        let new = RunFolder::new(tmp.path().join("new"));
        new.create().unwrap();
        new.start_metrics(Some(&run.best_path()), 2).unwrap();
        let kept: Vec<u64> = new.metrics().unwrap().iter().map(|m| m.epoch).collect();
        assert_eq!(kept, vec![1, 1, 2, 2]);
        assert_eq!(run.metrics().unwrap().len(), 8, "the run keeps its own");
    }

    #[test]
    fn a_runs_own_files_are_known_by_name() {
        for name in [
            "checkpoint.json",
            "model.safetensors",
            "optimizer.safetensors",
            "model_ema.safetensors",
            "model-s00000010-0123456789abcdef.safetensors",
            "train_files-0123456789abcdef.bin",
            "metrics.jsonl",
            "report.png",
            ".birdtrain.lock",
            "bad_files_train.txt",
            "lr_find.jsonl",
            "lr_find.png",
            "checkpoint.json.tmp123",
        ] {
            assert!(is_run_file_name(name), "{name}");
        }
        for name in [
            "predictions.jsonl",
            "confusion.csv",
            "trace.json",
            "notes.txt",
        ] {
            assert!(!is_run_file_name(name), "{name}");
        }
    }

    #[test]
    fn an_unused_new_folder_is_discarded_and_a_committed_one_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let run = RunFolder::new(tmp.path().join("run"));
        let created = run.create().unwrap();
        run.discard_if_unused(created);
        assert!(!run.path().exists());
        let created = run.create().unwrap();
        std::fs::write(run.path().join(checkpoint::SIDECAR_FILE), b"{}").unwrap();
        run.discard_if_unused(created);
        assert!(run.path().exists());
    }
}
