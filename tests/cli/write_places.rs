//! Issue 34, data loss: what a command writes never lands on what it must keep. `--resume
//! RUN/best` continues into a new `--out` and never trains inside `best/`; an output file
//! (`eval --predictions/--confusion`, `--trace`, …) is never one of a run folder's own files,
//! never inside a `best/` folder or the dataset; lr-find never half-deletes a training run;
//! `--out` and `--cache-dir` never lie inside `--data`. Each refusal is one line naming the
//! flag and what it would have overwritten, before anything is written.

use crate::cli_support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use birdtrain::train::CheckpointMeta;
use cli_support::small_run::{dataset, ok, resume_args, run_with, text, train_args};
use cli_support::{assert_one_line_error, birdtrain_output, s};

/// Every file under `dir` with its bytes (what must stay exactly as it was).
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                out.insert(path.clone(), std::fs::read(&path).unwrap());
            }
        }
    }
    out
}

fn with(mut args: Vec<String>, extra: &[&str]) -> Vec<String> {
    args.extend(extra.iter().map(|a| a.to_string()));
    args
}

/// A finished two-epoch run with its `best/`, on a 2-class set.
struct Trained {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    data: PathBuf,
    cache: PathBuf,
    run: PathBuf,
}

fn trained() -> Trained {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().to_path_buf();
    let data = dataset(&root.join("d"), 2, 6);
    let cache = root.join("cache");
    let run = root.join("run");
    ok(run_with(&train_args(&data, &cache, &run, 2), &[]));
    assert!(run.join("best/checkpoint.json").exists());
    Trained {
        _tmp: tmp,
        root,
        data,
        cache,
        run,
    }
}

/// Issue 34, item 1.
#[test]
fn a_resume_from_best_needs_a_new_out_and_never_writes_inside_best() {
    let t = trained();
    let best = t.run.join("best");
    let kept = snapshot(&t.run);
    let best_epoch = CheckpointMeta::load(&best).unwrap().epoch;
    // Without --out: refused, naming --resume and the way out.
    let refused = run_with(&with(resume_args(&best, &t.data), &["--epochs", "3"]), &[]);
    assert_one_line_error(&refused, &["--resume", "best-epoch folder", "--out NEW"]);
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused));
    // Into the run that holds it: refused too (its files would be replaced while read).
    let refused = run_with(
        &with(
            resume_args(&best, &t.data),
            &["--epochs", "3", "--out", s(&t.run), "--overwrite"],
        ),
        &[],
    );
    assert_one_line_error(&refused, &["--out", "holds the run --resume"]);
    // A fresh run into best/: refused.
    let refused = run_with(
        &with(train_args(&t.data, &t.cache, &best, 1), &["--overwrite"]),
        &[],
    );
    assert_one_line_error(&refused, &["--out", "best-epoch folder"]);
    assert_eq!(
        snapshot(&t.run),
        kept,
        "the run and its best/ are untouched"
    );

    // With --out NEW: a new run folder continues from best's checkpoint (weights, optimizer
    // state, data position) and takes the run's history up to that epoch.
    let new = t.root.join("new");
    ok(run_with(
        &with(
            resume_args(&best, &t.data),
            &["--epochs", "3", "--out", s(&new)],
        ),
        &[],
    ));
    assert_eq!(snapshot(&t.run), kept, "best/ is read, never written");
    let meta = CheckpointMeta::load(&new).unwrap();
    assert_eq!(meta.epoch, 3);
    let epochs: Vec<u64> = std::fs::read_to_string(new.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["epoch"]
                .as_u64()
                .unwrap()
        })
        .collect();
    let mut want = Vec::new();
    for e in 1..=3 {
        want.extend([e, e]);
    }
    assert_eq!(
        epochs, want,
        "epochs 1..={best_epoch} from the run, then the new ones"
    );
    // The history up to the best epoch is the run's own (its figures, line for line).
    let figures = |run: &Path| -> Vec<(String, u64, f64)> {
        std::fs::read_to_string(run.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .take(2 * best_epoch as usize)
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                let split = v["split"].as_str().unwrap().to_string();
                (
                    split,
                    v["epoch"].as_u64().unwrap(),
                    v["loss"].as_f64().unwrap(),
                )
            })
            .collect()
    };
    assert_eq!(figures(&t.run), figures(&new));
    assert!(new.join("best/checkpoint.json").exists());
}

/// Issue 34, items 2 and 3.
#[test]
fn output_files_never_replace_a_runs_own_files_a_best_folder_or_the_data() {
    let t = trained();
    let kept_run = snapshot(&t.run);
    let kept_data = snapshot(&t.data);
    let eval = |extra: &[&str]| {
        let mut args = vec![
            "eval",
            "--checkpoint",
            s(&t.run),
            "--data",
            s(&t.data),
            "--workers",
            "1",
            "--cache-dir",
            s(&t.cache),
        ];
        args.extend_from_slice(extra);
        birdtrain_output(&args)
    };
    let sidecar = t.run.join("checkpoint.json");
    let weights = t.run.join("model.safetensors");
    let best_file = t.run.join("best").join("predictions.jsonl");
    let image = std::fs::read_dir(t.data.join("valid/class_00"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let link = t.root.join("link.csv");
    std::os::unix::fs::symlink(&sidecar, &link).unwrap();
    for (flag, path, needles) in [
        (
            "--confusion",
            &sidecar,
            &["checkpoint.json", "run folder"][..],
        ),
        (
            "--predictions",
            &sidecar,
            &["checkpoint.json", "run folder"],
        ),
        (
            "--predictions",
            &weights,
            &["model.safetensors", "run folder"],
        ),
        ("--confusion", &link, &["link.csv", "run folder"]),
        ("--predictions", &best_file, &["best-epoch folder"]),
        ("--predictions", &image, &["inside the dataset"]),
    ] {
        let out = eval(&[flag, s(path)]);
        let mut all = vec![flag];
        all.extend_from_slice(needles);
        assert_one_line_error(&out, &all);
        assert_eq!(out.status.code(), Some(2));
    }
    // --trace on a resume, or on a training image.
    for (path, needle) in [(&sidecar, "run folder"), (&image, "inside the dataset")] {
        let args = with(
            resume_args(&t.run, &t.data),
            &["--epochs", "3", "--trace", s(path)],
        );
        let out = run_with(&args, &[]);
        assert_one_line_error(&out, &["--trace", needle]);
    }
    // lr-find with --overwrite on a training run: refused whole, nothing deleted.
    let sweep = [
        "lr-find",
        "--data",
        s(&t.data),
        "--gpus",
        "0",
        "--model",
        "resnet8",
        "--image-size",
        "16",
        "--batch-size",
        "4",
        "--threads",
        "1",
        "--workers",
        "1",
        "--cache-dir",
        s(&t.cache),
        "--num-steps",
        "12",
        "--quiet",
        "--overwrite",
        "--out",
    ];
    let mut args: Vec<&str> = sweep.to_vec();
    args.push(s(&t.run));
    let out = birdtrain_output(&args);
    assert_one_line_error(
        &out,
        &[
            "--out",
            "training run",
            "even with --overwrite",
            "checkpoint.json",
            "metrics.jsonl",
            "best/",
        ],
    );
    assert_eq!(snapshot(&t.run), kept_run, "the run is untouched");
    assert_eq!(snapshot(&t.data), kept_data, "the dataset is untouched");
    // What may be written: a new file inside the run folder, and an earlier sweep replaced.
    let predictions = t.run.join("predictions.jsonl");
    let out = eval(&["--predictions", s(&predictions)]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(predictions.exists());
    let swept = t.root.join("sweep");
    let mut args: Vec<&str> = sweep.to_vec();
    args.push(s(&swept));
    let first = birdtrain_output(&args);
    assert!(first.status.success(), "{}", text(&first));
    let again = birdtrain_output(&args);
    assert!(again.status.success(), "{}", text(&again));
    assert!(swept.join("lr_find.jsonl").exists());
}

/// Issue 34, item 4.
#[test]
fn out_and_cache_dir_inside_the_data_are_refused_before_anything_is_written() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 3);
    // The flat layout: class folders at the root.
    let flat = tmp.path().join("flat");
    std::fs::rename(data.join("train"), &flat).unwrap();
    let cache = tmp.path().join("cache");
    let kept = snapshot(&flat);
    let flat_run = |out: &Path, cache: &Path| {
        run_with(
            &with(
                train_args(&flat, cache, out, 1),
                &["--valid-fraction", "0.3"],
            ),
            &[],
        )
    };
    let inside = flat.join("run");
    let out = flat_run(&inside, &cache);
    assert_one_line_error(&out, &["--out", "inside the dataset", s(&flat)]);
    let out = flat_run(&tmp.path().join("run"), &flat.join("class_00/cache"));
    assert_one_line_error(&out, &["--cache-dir", "inside the dataset"]);
    // Through a link to the data, too.
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&flat, &link).unwrap();
    let out = flat_run(&link.join("run"), &cache);
    assert_one_line_error(&out, &["--out", "inside the dataset"]);
    assert_eq!(snapshot(&flat), kept, "nothing written among the images");
    // A CSV: a folder holding an image it lists is the dataset; the CSV's own folder is not.
    let csv = tmp.path().join("list.csv");
    let mut rows = String::from("path,label\n");
    for class in ["class_00", "class_01"] {
        for f in std::fs::read_dir(flat.join(class)).unwrap() {
            rows += &format!("{},{class}\n", f.unwrap().path().display());
        }
    }
    std::fs::write(&csv, rows).unwrap();
    let csv_run = |out: &Path| {
        let args = with(
            train_args(&csv, &cache, out, 1),
            &["--valid-fraction", "0.3"],
        );
        run_with(&args, &[])
    };
    let out = csv_run(&flat.join("class_01").join("run"));
    assert_one_line_error(&out, &["--out", "class_01", "holds images"]);
    assert_eq!(snapshot(&flat), kept);
    let beside = tmp.path().join("csv-run");
    ok(csv_run(&beside));
    assert!(beside.join("checkpoint.json").exists());
}

/// `--overwrite` replaces a run whole: a new run that fails before its first checkpoint (it
/// diverges at once) leaves no run behind, never the old checkpoint and weights without
/// their metrics and `best/` (a half-deleted run that still resumed); files of other names
/// stay. A new run that succeeds is all that is there.
#[test]
fn overwrite_replaces_a_run_whole_even_when_the_new_run_fails() {
    let t = trained();
    let notes = t.run.join("notes.txt");
    std::fs::write(&notes, b"mine").unwrap();
    let failing = with(
        train_args(&t.data, &t.cache, &t.run, 1),
        &["--overwrite", "--lr", "1e7"],
    );
    let out = run_with(&failing, &[]);
    assert_one_line_error(&out, &["diverged"]);
    let left: Vec<String> = std::fs::read_dir(&t.run)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    assert_eq!(left, ["notes.txt"], "{}", text(&out));
    let resume = run_with(&resume_args(&t.run, &t.data), &[]);
    assert!(!resume.status.success(), "{}", text(&resume));
    // A new run over it: its own files only, and the notes.
    ok(run_with(
        &with(train_args(&t.data, &t.cache, &t.run, 1), &["--overwrite"]),
        &[],
    ));
    let meta = CheckpointMeta::load(&t.run).unwrap();
    assert_eq!(meta.epoch, 1);
    assert_eq!(std::fs::read(&notes).unwrap(), b"mine");
    let metrics = std::fs::read_to_string(t.run.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 2, "{metrics}");
}
