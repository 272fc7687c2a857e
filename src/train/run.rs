//! A training run, from the top: [`train`] prepares the run folder (node 0 alone), reads the
//! checkpoint it resumes, lets the device's launcher ([`super::launch`]) set up the shared
//! state and start one thread per local rank (each runs [`super::epochs::run_rank`]), and
//! builds the outcome and its summary from every rank's report ([`super::outcome`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use super::config::TrainConfig;
use super::folder::{CheckpointMeta, RunFolder};
use super::launch::launch;
use super::outcome::{node_trace_path, outcome, TrainOutcome};
use super::report::StopWish;
use super::setup::node_rank;
use super::TrainError;

/// Trains as `cfg` says. `stop` is polled before every step (Ctrl-C sets it): every rank
/// finishes the same step, a checkpoint is saved, and the run returns with `interrupted`.
pub fn train(cfg: &TrainConfig, stop: &AtomicBool) -> Result<TrainOutcome, TrainError> {
    train_until(cfg, &|_, _| stop.load(Ordering::SeqCst))
}

/// [`train`] with a stop wish per rank and step.
pub(crate) fn train_until(
    cfg: &TrainConfig,
    stop: &StopWish<'_>,
) -> Result<TrainOutcome, TrainError> {
    cfg.validate()?;
    if let Some(path) = &cfg.dist.trace {
        let path = node_trace_path(path, node_rank(cfg));
        crate::trace::check_destination(&path).map_err(|e| TrainError::Trace(e.to_string()))?;
    }
    let folder = RunFolder::new(&cfg.out);
    if node_rank(cfg) != 0 {
        // Only node 0 writes the run folder, and only node 0 cleans or removes it: the other
        // nodes of a multi-node run may share it on a network file system, where their
        // cleaning would delete node 0's temporary files and their removal its run. They
        // neither create, lock nor check it (its state is node 0's to judge).
        return run(cfg, &folder, stop);
    }
    refuse_existing_run(cfg)?;
    // The engine writes its bad-files reports into the run folder while it scans, so the
    // folder exists from the start; a run that fails before its first checkpoint removes the
    // folder it created ("nothing half-written").
    let created = folder.create()?;
    // One writer per folder, held until the run returns.
    // (A folder this process created is left alone when the lock fails: the holder may be
    // the process that won the race to create it.)
    let _lock = folder.lock()?;
    // --overwrite replaces the run there whole, at once, before anything new is written:
    // never its checkpoint kept while its history and best/ are gone (a new run failing
    // before its first checkpoint left such a half-deleted run that still resumed).
    if cfg.overwrite
        && cfg.resume.as_deref() != Some(cfg.out.as_path())
        && !folder.existing_run().is_empty()
    {
        folder.remove_run()?;
    }
    // What an interrupted checkpoint or run left behind (temporary files, superseded tensor
    // files) goes before anything new is written.
    folder.clean();
    let result = run(cfg, &folder, stop);
    if result.is_err() {
        folder.discard_if_unused(created);
    }
    result
}

/// A fresh run (or a resume into another folder) must not overwrite a run already in `--out`
/// unless `--overwrite` says so.
fn refuse_existing_run(cfg: &TrainConfig) -> Result<(), TrainError> {
    if let Some(owner) = super::folder::best_folder_owner(&cfg.out) {
        return Err(TrainError::InvalidConfig {
            flag: "--out",
            value: cfg.out.display().to_string(),
            hint: format!(
                "it is the best-epoch folder of the run {}, which only that run writes; continue from it into a new folder (--resume {} --out NEW)",
                owner.display(),
                cfg.out.display()
            ),
        });
    }
    if cfg.overwrite || cfg.resume.as_deref() == Some(cfg.out.as_path()) {
        return Ok(());
    }
    let found = RunFolder::new(&cfg.out).existing_run();
    if found.is_empty() {
        return Ok(());
    }
    Err(TrainError::RunExists {
        path: cfg.out.clone(),
        found: found.join(", "),
        resumable: cfg.lr_range.is_none() && RunFolder::new(&cfg.out).has_checkpoint(),
    })
}

fn run(
    cfg: &TrainConfig,
    folder: &RunFolder,
    stop: &StopWish<'_>,
) -> Result<TrainOutcome, TrainError> {
    let wall = Instant::now();
    // Read the checkpoint before anything is written, so a bad --resume leaves no trace.
    let resumed = match &cfg.resume {
        Some(run) => Some((run.clone(), CheckpointMeta::load(run)?)),
        None => None,
    };
    let launched = launch(cfg, folder, resumed.as_ref(), stop)?;
    outcome(launched, wall.elapsed())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node other than 0 leaves the run folder to node 0: it cleans nothing (node 0's
    /// temporary files of a checkpoint in progress on a shared folder), creates nothing and
    /// removes nothing, even when its run fails.
    #[test]
    fn a_node_other_than_0_never_cleans_creates_or_removes_the_run_folder() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        std::fs::create_dir_all(run.join("best")).unwrap();
        let leftovers = [
            "checkpoint.json.tmp4242",
            "model-s00000007-0011223344556677.safetensors.tmp4242",
            "best/checkpoint.json.tmp4242",
        ];
        for f in leftovers {
            std::fs::write(run.join(f), b"node 0 is writing this").unwrap();
        }
        let mut cfg = TrainConfig::new(tmp.path().join("data"));
        cfg.out = run.clone();
        cfg.dist.nodes = Some(2);
        cfg.dist.node_rank = Some(1);
        cfg.dist.master = Some("127.0.0.1:29500".into());
        // Several nodes on the CPU are refused by the launch, after the folder's handling.
        let e = train_until(&cfg, &|_, _| false).unwrap_err();
        assert!(e.to_string().contains("multi-node"), "{e}");
        for f in leftovers {
            assert!(run.join(f).exists(), "node 1 removed {f}");
        }
        assert!(run.join("best").is_dir());
        // Nor does it create a missing folder (and so never removes one either).
        cfg.out = tmp.path().join("absent");
        train_until(&cfg, &|_, _| false).unwrap_err();
        assert!(!cfg.out.exists());
        // Node 0 does clean: the same leftovers go.
        cfg.out = run.clone();
        cfg.dist.node_rank = Some(0);
        train_until(&cfg, &|_, _| false).unwrap_err();
        for f in leftovers {
            assert!(!run.join(f).exists(), "node 0 kept {f}");
        }
    }
}
