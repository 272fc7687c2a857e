//! Issue 34, wrong results: the validation split holds out round(F × n) of each class and
//! the start line says how many; a run keeps the split it trained with (an older checkpoint,
//! whose runs drew each file on its own, resumes and evaluates on that split); a class left
//! without a training image is refused naming it; and a resume after the contents of
//! same-sized files changed is refused naming them, while the same data copied elsewhere
//! still resumes. Real runs of the binary (CPU, resnet8 on 16-pixel images).

use crate::cli_support;

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use birdtrain::train::{CheckpointMeta, TrainConfig};
use cli_support::small_run::{dataset, ok, resume_args, run_with, text, train_args};
use cli_support::{assert_one_line_error, birdtrain, s};
use pipeline::{DatasetSource, PipelineBuilder, Split, SplitRule};

fn with(mut args: Vec<String>, extra: &[&str]) -> Vec<String> {
    args.extend(extra.iter().map(|a| a.to_string()));
    args
}

/// A flat `<root>/class_0k/` set whose classes hold `sizes[k]` 16×16 PNGs.
fn flat(root: &Path, sizes: &[usize]) -> PathBuf {
    let most = *sizes.iter().max().unwrap();
    let synth = dataset(&root.join("synth"), sizes.len(), most);
    let flat = root.join("flat");
    std::fs::rename(synth.join("train"), &flat).unwrap();
    for (k, &n) in sizes.iter().enumerate() {
        let dir = flat.join(format!("class_{k:02}"));
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        for extra in files.into_iter().skip(n) {
            std::fs::remove_file(extra).unwrap();
        }
    }
    flat
}

/// `eval --json`'s image count for `run` on the validation split of `data`.
fn evaluated_images(run: &Path, data: &Path, cache: &Path) -> u64 {
    let out = birdtrain(&[
        "eval",
        "--checkpoint",
        s(run),
        "--data",
        s(data),
        "--workers",
        "1",
        "--cache-dir",
        s(cache),
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["images"].as_u64().unwrap()
}

/// The validation images of `data` at share 0.25 and seed 3 under `rule`.
fn valid_under(data: &Path, cache: &Path, rule: SplitRule) -> usize {
    PipelineBuilder::new(DatasetSource::flat(data, 0.25).with_split_rule(rule))
        .split(Split::Valid)
        .seed(3)
        .image_size(16)
        .cache_dir(cache)
        .build()
        .unwrap()
        .len()
}

/// Issue 34, item 5.
#[test]
fn the_split_holds_out_each_classs_share_and_a_run_keeps_the_split_it_trained_with() {
    let tmp = tempfile::tempdir().unwrap();
    let data = flat(tmp.path(), &[4, 9, 11]);
    let cache = tmp.path().join("cache");
    // A new run: 1 + 2 + 3 of the 24 images (0.25 × 4, 9, 11 rounded), said at the start.
    let run = tmp.path().join("run");
    let mut args = with(
        train_args(&data, &cache, &run, 1),
        &["--valid-fraction", "0.25"],
    );
    args.retain(|a| a != "--quiet");
    let out = ok(run_with(&args, &[]));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("18 train / 6 valid images")
            && said.contains("validation split: 6 of 24 images held out, round(F × n) of each class's n images (--valid-fraction 0.25, seed 3)"),
        "{said}"
    );
    assert_eq!(
        CheckpointMeta::load(&run).unwrap().settings.split_version,
        2
    );
    assert_eq!(evaluated_images(&run, &data, &cache), 6);

    // A run of the per-file draw (what runs before split version 2 did), its checkpoint made
    // to look as one of that time wrote it: no `split_version`.
    let (old_valid, new_valid) = (
        valid_under(&data, &cache, SplitRule::PerFileDraw),
        valid_under(&data, &cache, SplitRule::PerClass),
    );
    assert_ne!(old_valid, new_valid, "the two splits differ on this set");
    let old = tmp.path().join("old");
    let mut cfg = TrainConfig::new(&data);
    cfg.valid_fraction = Some(0.25);
    cfg.split_version = SplitRule::PerFileDraw.version();
    cfg.arch = "resnet8".parse().unwrap();
    (cfg.image_size, cfg.epochs, cfg.batch_size, cfg.seed) = (16, 1, 4, 3);
    (cfg.threads, cfg.workers) = (1, 1);
    cfg.cache_dir = Some(cache.clone());
    cfg.out = old.clone();
    (cfg.verbose, cfg.progress) = (false, false);
    birdtrain::train::train(&cfg, &AtomicBool::new(false)).unwrap();
    let sidecar = old.join("checkpoint.json");
    let mut value: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&sidecar).unwrap()).unwrap();
    value["settings"]
        .as_object_mut()
        .unwrap()
        .remove("split_version")
        .expect("the sidecar records the split version");
    std::fs::write(&sidecar, serde_json::to_string_pretty(&value).unwrap()).unwrap();
    // eval scores the images that run held out; --resume trains on the split it trained with
    // (the new split's training set would be refused as changed data) and keeps recording it.
    assert_eq!(evaluated_images(&old, &data, &cache), old_valid as u64);
    ok(run_with(
        &with(resume_args(&old, &data), &["--epochs", "2"]),
        &[],
    ));
    let resumed = CheckpointMeta::load(&old).unwrap();
    assert_eq!((resumed.epoch, resumed.settings.split_version), (2, 1));
}

/// Issue 34, item 6.
#[test]
fn a_class_held_out_whole_is_refused_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let data = flat(tmp.path(), &[2, 6]);
    let cache = tmp.path().join("cache");
    let run = tmp.path().join("run");
    let out = run_with(
        &with(
            train_args(&data, &cache, &run, 1),
            &["--valid-fraction", "0.8"],
        ),
        &[],
    );
    assert_one_line_error(
        &out,
        &[
            "class `class_00`",
            "no readable training image",
            "--valid-fraction 0.8",
            "2 of its 2 files",
        ],
    );
    assert!(!run.exists(), "nothing is left behind");
    // A CSV listing the same files, without a split column.
    let csv = tmp.path().join("list.csv");
    let mut rows = String::from("path,label\n");
    for class in ["class_00", "class_01"] {
        for f in std::fs::read_dir(data.join(class)).unwrap() {
            rows += &format!("{},{class}\n", f.unwrap().path().display());
        }
    }
    std::fs::write(&csv, rows).unwrap();
    let out = run_with(
        &with(
            train_args(&csv, &cache, &run, 1),
            &["--valid-fraction", "0.8"],
        ),
        &[],
    );
    assert_one_line_error(&out, &["class `class_00`", "no readable training image"]);
}

/// Pads the smaller of two files with zero bytes (after the PNG's end, where decoders stop)
/// so both have the same size.
fn same_size(a: &Path, b: &Path) {
    let (mut x, mut y) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
    let n = x.len().max(y.len());
    x.resize(n, 0);
    y.resize(n, 0);
    std::fs::write(a, x).unwrap();
    std::fs::write(b, y).unwrap();
}

/// Swaps two files' contents by renaming (their mtimes travel with them).
fn swap_by_rename(a: &Path, b: &Path) {
    let tmp = a.with_extension("swap");
    std::fs::rename(a, &tmp).unwrap();
    std::fs::rename(b, a).unwrap();
    std::fs::rename(&tmp, b).unwrap();
}

/// Swaps two files' contents by rewriting them (new mtimes).
fn swap_by_writing(a: &Path, b: &Path) {
    let (x, y) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
    std::fs::write(a, y).unwrap();
    std::fs::write(b, x).unwrap();
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        let target = to.join(path.file_name().unwrap());
        if path.is_dir() {
            copy_tree(&path, &target);
        } else {
            std::fs::copy(&path, &target).unwrap();
        }
    }
}

/// Issue 34, item 7.
#[test]
fn a_resume_after_same_sized_files_changed_contents_is_refused_naming_them() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 6);
    let a = data.join("train/class_00/train_00000.png");
    let b = data.join("train/class_01/train_00000.png");
    same_size(&a, &b);
    let cache = tmp.path().join("cache");
    let run = tmp.path().join("run");
    ok(run_with(&train_args(&data, &cache, &run, 1), &[]));
    let meta = CheckpointMeta::load(&run).unwrap();
    assert!(
        meta.train_files.is_some(),
        "the checkpoint records its files"
    );
    let kept = std::fs::read(run.join("checkpoint.json")).unwrap();
    let resume = |data: &Path| run_with(&with(resume_args(&run, data), &["--epochs", "2"]), &[]);
    let needles = [
        "cannot resume",
        "contents of 2 training files changed",
        "class_00/train_00000.png",
        "class_01/train_00000.png",
        "--allow-data-change",
    ];
    // Swapped by renaming (the mtimes stay), then by rewriting: refused each time.
    swap_by_rename(&a, &b);
    assert_one_line_error(&resume(&data), &needles);
    swap_by_rename(&a, &b);
    swap_by_writing(&a, &b);
    assert_one_line_error(&resume(&data), &needles);
    assert_eq!(std::fs::read(run.join("checkpoint.json")).unwrap(), kept);
    // Put back: new times, same contents. Copied elsewhere (other times and inodes), the
    // data still resumes.
    swap_by_writing(&a, &b);
    let copy = tmp.path().join("copy");
    copy_tree(&data, &copy);
    ok(resume(&copy));
    assert_eq!(CheckpointMeta::load(&run).unwrap().epoch, 2);
    // --allow-data-change goes on with the new contents, saying so.
    swap_by_writing(
        &copy.join("train/class_00/train_00000.png"),
        &copy.join("train/class_01/train_00000.png"),
    );
    let out = ok(run_with(
        &with(
            resume_args(&run, &copy),
            &["--epochs", "3", "--allow-data-change"],
        ),
        &[],
    ));
    let stderr = text(&out);
    assert!(
        stderr.contains("contents of 2 training files changed")
            && stderr.contains("restarts epoch 3"),
        "{stderr}"
    );
}
