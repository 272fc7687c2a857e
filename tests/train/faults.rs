//! Nothing lost: a run folder survives kill -9 and a full disk at every stage of a checkpoint
//! (the run's own, a periodic one inside an epoch, and the best epoch's copy in `best/`),
//! SIGTERM stops a run like Ctrl-C, a diverged loss stops without saving garbage, an existing
//! run is never overwritten by accident, and a changed training set is noticed on resume.
//! Every test drives the real binary (CPU, resnet8 on 16-pixel images).

use crate::cli_support;

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use birdtrain::train::checkpoint::CHECKPOINT_STAGES;
use birdtrain::train::fault::FAULT_ENV;
use birdtrain::train::folder::{BestEpoch, BestRule};
use birdtrain::train::{CheckpointMeta, MetricsSplit, RunFolder};
use cli_support::small_run::{
    average, dataset, ok, resume_args, run_with, text, train_args, weights,
};
use cli_support::{birdtrain, s, Tmpfs};

/// Files of the run folder that no checkpoint names: temporaries and superseded tensors.
fn leftovers(run: &Path) -> Vec<String> {
    let meta = CheckpointMeta::load(run).unwrap();
    std::fs::read_dir(run)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| {
            n.contains(".tmp")
                || (["model-s", "optimizer-s", "model_ema-s"]
                    .iter()
                    .any(|p| n.starts_with(p))
                    && *n != meta.model_file
                    && *n != meta.optimizer_state_file
                    && Some(n) != meta.model_ema_file.as_ref())
        })
        .collect()
}

fn one_error_line(out: &Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "expected one error line:\n{}", text(out));
    lines[0].to_string()
}

#[test]
fn a_checkpoint_interrupted_at_any_stage_leaves_a_run_that_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 6);
    let cache = tmp.path().join("cache");
    // With the moving average of the weights: the checkpoint's third file is written and
    // committed under the same protocol.
    let train_args = |data: &Path, cache: &Path, run: &Path, epochs| {
        let mut args = train_args(data, cache, run, epochs);
        // No warm-up: a warm-up epoch's average is a plain copy of the weights, which a
        // resume that lost the average would rebuild alike.
        args.extend(
            [
                "--model-ema",
                "--model-ema-steps",
                "1",
                "--warmup-epochs",
                "0",
            ]
            .map(String::from),
        );
        args
    };
    let reference = tmp.path().join("reference");
    ok(run_with(&train_args(&data, &cache, &reference, 3), &[]));
    let want = weights(&reference);
    let want_average = average(&reference);

    // kill -9 at every stage of the second checkpoint (the end of epoch 2).
    for stage in CHECKPOINT_STAGES {
        let run = tmp.path().join(format!("kill-{stage}"));
        let fault = format!("checkpoint:{stage}@2");
        let out = run_with(&train_args(&data, &cache, &run, 3), &[(FAULT_ENV, &fault)]);
        assert_eq!(out.status.signal(), Some(9), "{stage}: {}", text(&out));
        let meta = CheckpointMeta::load(&run)
            .unwrap_or_else(|e| panic!("kill at {stage} left no loadable checkpoint: {e}"));
        let committed = CHECKPOINT_STAGES.iter().position(|s| *s == stage).unwrap()
            >= CHECKPOINT_STAGES
                .iter()
                .position(|s| *s == "sidecar")
                .unwrap();
        assert_eq!(meta.epoch, if committed { 2 } else { 1 }, "kill at {stage}");
        ok(run_with(&resume_args(&run, &data), &[]));
        assert!(
            weights(&run) == want,
            "kill at {stage}: resumed weights differ"
        );
        assert!(
            average(&run) == want_average,
            "kill at {stage}: resumed average differs"
        );
        assert!(leftovers(&run).is_empty(), "{stage}: {:?}", leftovers(&run));
        assert_eq!(
            std::fs::read(run.join("model.safetensors")).unwrap(),
            want,
            "{stage}: model.safetensors is not the final checkpoint's"
        );
    }

    // A full disk (ENOSPC) at each stage before the commit: one error line naming the file,
    // the previous checkpoint intact, nothing half-written left behind.
    for stage in ["model", "optimizer", "sidecar-temp"] {
        let run = tmp.path().join(format!("full-{stage}"));
        let fault = format!("checkpoint:{stage}@2:enospc");
        let out = run_with(&train_args(&data, &cache, &run, 3), &[(FAULT_ENV, &fault)]);
        assert_eq!(out.status.code(), Some(1), "{stage}: {}", text(&out));
        let line = one_error_line(&out);
        assert!(
            line.contains("No space left on device") && line.contains(s(&run)),
            "{stage}: {line}"
        );
        assert_eq!(CheckpointMeta::load(&run).unwrap().epoch, 1, "{stage}");
        ok(run_with(&resume_args(&run, &data), &[]));
        assert!(
            weights(&run) == want && average(&run) == want_average,
            "full disk at {stage}: resumed weights or average differ"
        );
        assert!(leftovers(&run).is_empty(), "{stage}: {:?}", leftovers(&run));
    }
}

/// A real full disk: the run folder on a small tmpfs that holds one checkpoint but not the
/// files of a second beside it. Needs permission to mount (root, as on the project's machines);
/// elsewhere the fault hook above covers the same path.
#[test]
fn a_run_on_a_full_tmpfs_keeps_its_last_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 6);
    let cache = tmp.path().join("cache");
    // Measure what one epoch leaves, and one checkpoint's tensor files.
    let probe = tmp.path().join("probe");
    ok(run_with(&train_args(&data, &cache, &probe, 1), &[]));
    // Hard links (the stable names) share their blocks: count each file once, those of
    // best/ (the first epoch is the best so far) included.
    let mut inodes = std::collections::BTreeMap::new();
    for dir in [probe.clone(), probe.join("best")] {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let m = entry.unwrap().metadata().unwrap();
            inodes.insert(
                std::os::unix::fs::MetadataExt::ino(&m),
                m.len().div_ceil(4096) * 4096,
            );
        }
    }
    let folder_bytes: u64 = inodes.values().sum();
    let meta = CheckpointMeta::load(&probe).unwrap();
    let model_bytes = std::fs::metadata(probe.join(&meta.model_file))
        .unwrap()
        .len();
    // Room for the first epoch's files (the stable names are links, counted once more here)
    // plus half a model file: the second checkpoint cannot fit.
    let size = folder_bytes + model_bytes / 2 + 64 * 1024;
    let Some(disk) = Tmpfs::mount(&tmp.path().join("small"), size) else {
        return;
    };
    let run = disk.path().join("run");
    let out = run_with(&train_args(&data, &cache, &run, 3), &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let line = one_error_line(&out);
    assert!(line.contains("No space left on device"), "{line}");
    let meta = CheckpointMeta::load(&run).expect("the first checkpoint survives the full disk");
    assert_eq!(meta.epoch, 1);
    assert!(leftovers(&run).is_empty(), "{:?}", leftovers(&run));
    // Moved to a disk with room, it resumes to the same weights as an uninterrupted run.
    let moved = tmp.path().join("moved");
    copy_folder(&run, &moved);
    ok(run_with(&resume_args(&moved, &data), &[]));
    let reference = tmp.path().join("reference");
    ok(run_with(&train_args(&data, &cache, &reference, 3), &[]));
    assert!(weights(&moved) == weights(&reference));
}

/// Copies a run folder with its best/ folder.
fn copy_folder(from: &Path, to: &Path) {
    std::fs::create_dir(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_dir() {
            copy_folder(&entry.path(), &to.join(entry.file_name()));
        } else {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

/// `--save-every 2` on 3 steps per epoch: checkpoints at global steps 2, 3 (epoch end), 4,
/// 6 (epoch end), 8 and 9 (the end). A kill -9 loses at most the steps since the last one,
/// and the resumed run ends where the uninterrupted one does.
#[test]
fn periodic_checkpoints_inside_an_epoch_bound_what_a_kill_loses() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 6);
    let cache = tmp.path().join("cache");
    let reference = tmp.path().join("reference");
    ok(run_with(&train_args(&data, &cache, &reference, 3), &[]));
    let want = weights(&reference);
    // (fault, global step, epoch index and step of the checkpoint left behind)
    let cases = [
        ("checkpoint:cleanup@5", 8, 2, 2),
        ("checkpoint:sidecar-temp@3", 3, 1, 0),
        ("checkpoint:links@1", 2, 0, 2),
    ];
    for (fault, step, epoch, in_epoch) in cases {
        let run = tmp.path().join(fault.replace([':', '@'], "-"));
        let mut args = train_args(&data, &cache, &run, 3);
        args.extend(["--save-every".into(), "2".into()]);
        let out = run_with(&args, &[(FAULT_ENV, fault)]);
        assert_eq!(out.status.signal(), Some(9), "{fault}: {}", text(&out));
        let meta = CheckpointMeta::load(&run).unwrap();
        let pos = &meta.data_position;
        assert_eq!(
            (pos.global_step, pos.epoch, pos.step_in_epoch),
            (step, epoch, in_epoch),
            "{fault}"
        );
        assert_eq!(
            meta.settings.save_every, 2,
            "the sidecar keeps --save-every"
        );
        ok(run_with(&resume_args(&run, &data), &[]));
        assert!(weights(&run) == want, "{fault}: resumed weights differ");
        assert!(leftovers(&run).is_empty(), "{fault}: {:?}", leftovers(&run));
    }
}

/// The epochs whose validation beat every earlier one (1-based), from `metrics.jsonl`.
fn improving_epochs(run: &Path) -> Vec<u64> {
    let mut best: Option<BestEpoch> = None;
    let mut epochs = Vec::new();
    for m in RunFolder::new(run).metrics().unwrap() {
        let rule = BestRule::default();
        if m.split == MetricsSplit::Valid
            && best.is_none_or(|b| rule.improves(&b, m.accuracy, m.loss))
        {
            best = Some(BestEpoch::of(&m));
            epochs.push(m.epoch);
        }
    }
    epochs
}

/// best/ is written before the run's checkpoint at the end of an epoch that beat the earlier
/// ones: a kill at any stage of it, or a full disk, leaves the run's previous checkpoint,
/// and the resumed run writes the same best/ an uninterrupted run has.
#[test]
fn a_kill_or_a_full_disk_while_the_best_epoch_is_written_loses_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 6);
    let cache = tmp.path().join("cache");
    let reference = tmp.path().join("reference");
    ok(run_with(&train_args(&data, &cache, &reference, 3), &[]));
    let want = weights(&reference);
    let want_best = weights(&reference.join("best"));
    let improving = improving_epochs(&reference);
    assert!(
        improving.len() >= 2 && improving[0] == 1,
        "the test needs a later epoch to beat the first: {improving:?}"
    );
    assert_eq!(
        CheckpointMeta::load(&reference.join("best")).unwrap().epoch,
        *improving.last().unwrap()
    );
    // The second best/ write is at the end of epoch improving[1].
    let at = improving[1];
    let faults = CHECKPOINT_STAGES
        .iter()
        .map(|stage| (format!("best:{stage}@2"), true))
        .chain([("best:optimizer@2:enospc".to_string(), false)]);
    for (fault, killed) in faults {
        let run = tmp.path().join(fault.replace([':', '@'], "-"));
        let out = run_with(&train_args(&data, &cache, &run, 3), &[(FAULT_ENV, &fault)]);
        if killed {
            assert_eq!(out.status.signal(), Some(9), "{fault}: {}", text(&out));
        } else {
            let line = one_error_line(&out);
            assert!(line.contains("No space left on device"), "{fault}: {line}");
        }
        assert_eq!(CheckpointMeta::load(&run).unwrap().epoch, at - 1, "{fault}");
        ok(run_with(&resume_args(&run, &data), &[]));
        assert!(weights(&run) == want, "{fault}: resumed weights differ");
        assert!(
            weights(&run.join("best")) == want_best,
            "{fault}: best/ differs from the uninterrupted run's"
        );
        let best = run.join("best");
        assert!(
            leftovers(&best).is_empty(),
            "{fault}: {:?}",
            leftovers(&best)
        );
    }
}

#[test]
fn sigterm_stops_after_the_step_with_a_checkpoint_like_ctrl_c() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 6);
    let cache = tmp.path().join("cache");
    let run = tmp.path().join("run");
    let mut args = train_args(&data, &cache, &run, 400);
    args.retain(|a| a != "--quiet");
    let mut child = Command::new(env!("CARGO_BIN_EXE_birdtrain"))
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for the first epoch line: training is under way and a checkpoint exists. The
    // reader keeps draining stdout afterwards, as a terminal would.
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        let mut seen = Vec::new();
        for line in std::io::BufReader::new(stdout).lines() {
            let line = line.unwrap();
            if line.starts_with("epoch 1/") {
                let _ = tx.send(());
            }
            seen.push(line);
        }
        seen
    });
    let started = rx.recv_timeout(std::time::Duration::from_secs(120)).is_ok();
    if !started {
        let _ = child.kill();
        panic!("no epoch line: {:?}", reader.join().unwrap());
    }
    // SAFETY: kill(2) on the child's pid with a valid signal.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let out = child.wait_with_output().unwrap();
    let printed = reader.join().unwrap();
    assert_eq!(out.status.code(), Some(143), "{}\n{printed:?}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("SIGTERM"), "{err}");
    let meta = CheckpointMeta::load(&run).unwrap();
    assert!(meta.epoch < 400, "stopped early: {meta:?}");
    // It goes on from there (a short continuation: two more epochs in total).
    let mut resume = resume_args(&run, &data);
    resume.extend(["--epochs".into(), (meta.epoch + 2).to_string()]);
    ok(run_with(&resume, &[]));
    assert_eq!(CheckpointMeta::load(&run).unwrap().epoch, meta.epoch + 2);
}

/// Every f32 of a safetensors file is finite.
fn all_finite(bytes: &[u8]) -> bool {
    let tensors = safetensors::SafeTensors::deserialize(bytes).unwrap();
    tensors.tensors().iter().all(|(_, t)| {
        t.dtype() != safetensors::Dtype::F32
            || t.data()
                .chunks_exact(4)
                .all(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite())
    })
}

#[test]
fn a_diverged_loss_stops_the_run_and_keeps_the_last_good_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 6);
    let cache = tmp.path().join("cache");
    let run = tmp.path().join("run");
    ok(run_with(&train_args(&data, &cache, &run, 1), &[]));
    let mut args = resume_args(&run, &data);
    args.extend(["--epochs", "20", "--lr", "1e7"].map(String::from));
    let out = run_with(&args, &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let line = one_error_line(&out);
    for part in [
        "diverged",
        "step",
        "learning rate",
        "--lr",
        "last checkpoint in",
    ] {
        assert!(line.contains(part), "{part}: {line}");
    }
    // A fresh run that diverges before its first checkpoint says so (and leaves no folder).
    let fresh = tmp.path().join("fresh");
    let mut args = train_args(&data, &cache, &fresh, 1);
    args.extend(["--lr", "1e7"].map(String::from));
    let out = run_with(&args, &[]);
    let line = one_error_line(&out);
    assert!(line.contains("no checkpoint had been saved yet"), "{line}");
    assert!(!fresh.exists());
    // The checkpoint left is one taken before the loss went non-finite: loadable, finite,
    // short of the 20 epochs asked for.
    let meta = CheckpointMeta::load(&run).unwrap();
    assert!(meta.epoch < 20, "{meta:?}");
    assert!(
        all_finite(&weights(&run)),
        "non-finite weights reached the checkpoint"
    );
    // Every metrics line reads back as a finite figure, and eval works on the checkpoint.
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert!(
        metrics.lines().count() as u64 >= 2 * meta.epoch,
        "{metrics}"
    );
    for l in metrics.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        assert!(v["loss"].is_number(), "{l}");
    }
    let eval = birdtrain(&["eval", "--checkpoint", s(&run), "--data", s(&data)]);
    assert!(eval.status.success());
}

#[test]
fn an_existing_run_is_not_overwritten_without_overwrite() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 6);
    let cache = tmp.path().join("cache");
    let run = tmp.path().join("run");
    ok(run_with(&train_args(&data, &cache, &run, 1), &[]));
    let sidecar = std::fs::read(run.join("checkpoint.json")).unwrap();
    let metrics = std::fs::read(run.join("metrics.jsonl")).unwrap();
    let out = run_with(&train_args(&data, &cache, &run, 1), &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let line = one_error_line(&out);
    assert!(
        line.contains("holds a run already")
            && line.contains("--resume")
            && line.contains("--overwrite"),
        "{line}"
    );
    assert_eq!(std::fs::read(run.join("checkpoint.json")).unwrap(), sidecar);
    assert_eq!(std::fs::read(run.join("metrics.jsonl")).unwrap(), metrics);
    // A resume into another folder that holds a run is refused too.
    let other = tmp.path().join("other");
    ok(run_with(&train_args(&data, &cache, &other, 1), &[]));
    let mut args = resume_args(&run, &data);
    args.extend([
        "--out".into(),
        s(&other).into(),
        "--epochs".into(),
        "2".into(),
    ]);
    let out = run_with(&args, &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    // --overwrite replaces it.
    let mut args = train_args(&data, &cache, &run, 2);
    args.push("--overwrite".into());
    ok(run_with(&args, &[]));
    assert_eq!(CheckpointMeta::load(&run).unwrap().epoch, 2);
    let lines = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 4, "{lines}");
}

#[test]
fn a_changed_training_set_is_refused_on_resume_or_restarts_the_epoch() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 8);
    let cache = tmp.path().join("cache");
    let run = tmp.path().join("run");
    let mut args = train_args(&data, &cache, &run, 2);
    args.extend(["--stop-after-steps", "2"].map(String::from));
    ok(run_with(&args, &[]));
    let meta = CheckpointMeta::load(&run).unwrap();
    assert_eq!(meta.data_position.step_in_epoch, 2);
    let class = data.join("train").join("class_00");
    let mut images: Vec<_> = std::fs::read_dir(&class)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    images.sort();
    for p in &images[..2] {
        std::fs::remove_file(p).unwrap();
    }
    let out = run_with(&resume_args(&run, &data), &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let line = one_error_line(&out);
    assert!(
        line.contains("training data changed")
            && line.contains("16 training images then, 14 now: 2 removed")
            && line.contains("--allow-data-change"),
        "{line}"
    );
    assert_eq!(
        CheckpointMeta::load(&run).unwrap(),
        meta,
        "a refused resume changed nothing"
    );
    let mut args = resume_args(&run, &data);
    args.push("--allow-data-change".into());
    let out = ok(run_with(&args, &[]));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("restarts epoch 1"),
        "{}",
        text(&out)
    );
    let done = CheckpointMeta::load(&run).unwrap();
    assert_eq!(done.epoch, 2);
    let stamp = done.dataset.expect("the checkpoint records its data");
    assert_eq!(stamp.train_images, 14);
}

#[test]
fn misleading_datasets_get_a_warning() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 1, 5);
    let cache = tmp.path().join("cache");
    let run = tmp.path().join("run");
    let mut args = train_args(&data, &cache, &run, 1);
    args.retain(|a| a != "--quiet");
    let pos = args.iter().position(|a| a == "--batch-size").unwrap();
    args[pos + 1] = "64".into();
    let out = ok(run_with(&args, &[]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("single class"), "{err}");
    assert!(
        err.contains("larger than the 5 training images") && err.contains("scaled for 5"),
        "{err}"
    );
    // The start line shows the learning rate scaled for the 5 images a step really holds:
    // 0.8 × 5 / 256.
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("0.015625 scaled"), "{stdout}");
}

#[test]
fn a_resume_with_nothing_left_to_train_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 4);
    let cache = tmp.path().join("cache");
    let run = tmp.path().join("run");
    ok(run_with(&train_args(&data, &cache, &run, 2), &[]));
    let sidecar = std::fs::read(run.join("checkpoint.json")).unwrap();
    let mut args = resume_args(&run, &data);
    args.extend(["--epochs", "1"].map(String::from));
    let out = ok(run_with(&args, &[]));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("trained 2 epochs already") && err.contains("nothing to train"),
        "{err}"
    );
    assert_eq!(std::fs::read(run.join("checkpoint.json")).unwrap(), sidecar);
}
