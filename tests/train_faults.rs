//! Nothing lost: a run folder survives kill -9 and a full disk at every stage of a checkpoint,
//! SIGTERM stops a run like Ctrl-C, a diverged loss stops without saving garbage, an existing
//! run is never overwritten by accident, and a changed training set is noticed on resume.
//! Every test drives the real binary (CPU, resnet8 on 16-pixel images).

mod cli_support;

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use birdtrain::train::checkpoint::CHECKPOINT_STAGES;
use birdtrain::train::fault::FAULT_ENV;
use birdtrain::train::CheckpointMeta;
use cli_support::{birdtrain, s, Tmpfs};
use pipeline::synth::{write_dataset, ImageFormatKind, SynthConfig};

fn dataset(root: &Path, classes: usize, per_class: usize) -> PathBuf {
    write_dataset(&SynthConfig {
        out: root.to_path_buf(),
        classes,
        train_per_class: per_class,
        valid_per_class: 2,
        test_per_class: 0,
        width: 16,
        height: 16,
        format: ImageFormatKind::Png,
        seed: 9,
    })
    .unwrap();
    root.to_path_buf()
}

/// The flags of every run here: deterministic (one thread), small and quick.
fn train_args(data: &Path, cache: &Path, out: &Path, epochs: u32) -> Vec<String> {
    [
        "--data",
        s(data),
        "--gpus",
        "0",
        "--model",
        "resnet8",
        "--image-size",
        "16",
        "--epochs",
        &epochs.to_string(),
        "--batch-size",
        "4",
        "--threads",
        "1",
        "--workers",
        "1",
        "--cache-dir",
        s(cache),
        "--out",
        s(out),
        "--seed",
        "3",
        "--quiet",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect()
}

fn run_with(args: &[String], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_birdtrain"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("the birdtrain binary runs")
}

fn text(out: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn ok(out: Output) -> Output {
    assert!(out.status.success(), "{}", text(&out));
    out
}

fn resume_args(run: &Path, data: &Path) -> Vec<String> {
    [
        "--resume",
        s(run),
        "--data",
        s(data),
        "--threads",
        "1",
        "--workers",
        "1",
        "--quiet",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect()
}

/// The weights the run's sidecar names (what `--resume`, `eval` and `predict` read).
fn weights(run: &Path) -> Vec<u8> {
    let meta = CheckpointMeta::load(run).unwrap_or_else(|e| panic!("{}: {e}", run.display()));
    std::fs::read(run.join(meta.model_file)).unwrap()
}

/// Files of the run folder that no checkpoint names: temporaries and superseded tensors.
fn leftovers(run: &Path) -> Vec<String> {
    let meta = CheckpointMeta::load(run).unwrap();
    std::fs::read_dir(run)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| {
            n.contains(".tmp")
                || ((n.starts_with("model-s") || n.starts_with("optimizer-s"))
                    && *n != meta.model_file
                    && *n != meta.optimizer_state_file)
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
    let reference = tmp.path().join("reference");
    ok(run_with(&train_args(&data, &cache, &reference, 3), &[]));
    let want = weights(&reference);

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
            weights(&run) == want,
            "full disk at {stage}: resumed weights differ"
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
    // Hard links (the stable names) share their blocks: count each file once.
    let mut inodes = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(&probe).unwrap() {
        let m = entry.unwrap().metadata().unwrap();
        inodes.insert(
            std::os::unix::fs::MetadataExt::ino(&m),
            m.len().div_ceil(4096) * 4096,
        );
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
    std::fs::create_dir(&moved).unwrap();
    for entry in std::fs::read_dir(&run).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), moved.join(entry.file_name())).unwrap();
    }
    ok(run_with(&resume_args(&moved, &data), &[]));
    let reference = tmp.path().join("reference");
    ok(run_with(&train_args(&data, &cache, &reference, 3), &[]));
    assert!(weights(&moved) == weights(&reference));
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
    for part in ["diverged", "step", "learning rate", "--lr"] {
        assert!(line.contains(part), "{part}: {line}");
    }
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
