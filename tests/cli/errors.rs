//! Every user mistake of issue 3 ends in one clear line on stderr, a non-zero exit, and
//! nothing half-written (no run folder appears).

use std::path::{Path, PathBuf};

use pipeline::synth::{write_dataset, ImageFormatKind, SynthConfig};

use crate::cli_support;
use cli_support::{assert_one_line_error, birdtrain_output as birdtrain, s};

fn dataset(root: &Path, classes: usize, seed: u64) -> PathBuf {
    write_dataset(&SynthConfig {
        out: root.to_path_buf(),
        classes,
        train_per_class: 6,
        valid_per_class: 2,
        test_per_class: 0,
        width: 16,
        height: 16,
        format: ImageFormatKind::Png,
        seed,
    })
    .expect("synthetic dataset");
    root.to_path_buf()
}

/// A finished one-epoch resnet8 run on `data`; its output.
fn tiny_run(data: &Path, run: &Path, cache: &Path) -> std::process::Output {
    let out = birdtrain(&[
        "--data",
        s(data),
        "--gpus",
        "0",
        "--model",
        "resnet8",
        "--image-size",
        "16",
        "--epochs",
        "1",
        "--batch-size",
        "8",
        "--out",
        s(run),
        "--cache-dir",
        s(cache),
        "--quiet",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn unknown_model_lists_the_valid_names() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 0);
    let run = tmp.path().join("run");
    let out = birdtrain(&[
        "--data",
        s(&data),
        "--model",
        "resnet9",
        "--gpus",
        "0",
        "--out",
        s(&run),
    ]);
    assert_one_line_error(&out, &["resnet9", "resnet18", "resnet8"]);
    assert!(!run.exists(), "a failed start must write nothing");
}

#[test]
fn bad_flag_values_are_usage_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 0);
    let run = tmp.path().join("run");
    for (args, needle) in [
        (vec!["--epochs", "many"], "--epochs"),
        (vec!["--optimizer", "rmsprop"], "--optimizer"),
        (vec!["--last-batch", "sometimes"], "--last-batch"),
        (vec!["--lr=-1"], "--lr"),
        (vec!["--lr", "0"], "--lr"),
        (vec!["--batch-size", "0"], "--batch-size"),
        (vec!["--batch-size", "many"], "auto"),
        // auto measures a GPU: on the CPU it is refused, pointing to a number.
        (vec!["--batch-size", "auto"], "--batch-size 64"),
        (vec!["--schedule", "linear"], "--schedule"),
        (vec!["--valid-fraction", "0.2"], "--valid-fraction"),
        (vec!["--monitor", "loss"], "--monitor"),
        (vec!["--sampler", "weighted"], "--sampler"),
        (vec!["--min-delta=-0.1"], "--min-delta"),
        (vec!["--min-delta", "NaN"], "--min-delta"),
        (vec!["--augment", "crop"], "--augment"),
        (vec!["--crop-pct", "1.2"], "--crop-pct"),
        (
            vec!["--image-size", "32", "--store-size", "16"],
            "--store-size",
        ),
        (vec!["--store-size", "9000"], "--store-size"),
        (vec!["--color-jitter=-0.4"], "--color-jitter"),
        (vec!["--color-jitter", "NaN"], "--color-jitter"),
        (vec!["--resize-mode", "shorter"], "--resize-mode"),
        (vec!["--color-jitter-hue", "0.7"], "--color-jitter-hue"),
        (
            vec!["--schedule", "plateau", "--plateau-min-lr", "1"],
            "--plateau-min-lr",
        ),
        (
            vec!["--schedule", "plateau", "--plateau-min-lr=-0.1"],
            "--plateau-min-lr",
        ),
        (
            vec!["--no-augment", "--augment", "pad-crop"],
            "--no-augment",
        ),
        (vec!["--plateau-patience", "3"], "add --schedule plateau"),
        (
            vec!["--schedule", "cosine", "--plateau-factor", "0.5"],
            "--plateau-factor",
        ),
        (vec!["--plateau-cooldown", "1"], "--plateau-cooldown"),
        (vec!["--plateau-min-lr", "0.01"], "--plateau-min-lr"),
        (vec!["--step-every", "5"], "add --schedule step"),
        (
            vec!["--schedule", "plateau", "--step-gamma", "0.5"],
            "--step-gamma",
        ),
        (
            vec!["--schedule", "step", "--step-every", "0"],
            "--step-every",
        ),
        (vec!["--crop-scale", "0.3"], "add --augment resized-crop"),
        (
            vec!["--augment", "resized-crop", "--crop-scale", "0"],
            "--crop-scale",
        ),
        (
            vec!["--augment", "resized-crop", "--crop-scale", "1.5"],
            "--crop-scale",
        ),
    ] {
        let mut all = vec!["--data", s(&data), "--gpus", "0", "--out", s(&run)];
        all.extend(args);
        let out = birdtrain(&all);
        assert_one_line_error(&out, &[needle]);
        // A usage mistake, whichever layer (the CLI, the settings, the launch) refuses it.
        assert_eq!(out.status.code(), Some(2), "{all:?}");
        assert!(!run.exists(), "{all:?} wrote a run folder");
    }
    // Several nodes on the CPU: refused, not trained alone by each process.
    let mut all = vec!["--data", s(&data), "--gpus", "0", "--out", s(&run)];
    all.extend([
        "--nodes",
        "2",
        "--node-rank",
        "0",
        "--master",
        "127.0.0.1:29500",
    ]);
    let out = birdtrain(&all);
    assert_one_line_error(&out, &["2 nodes", "--replicas"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        !run.exists(),
        "a refused multi-node start wrote a run folder"
    );
}

#[test]
fn usage_errors_name_what_is_missing_and_keep_clap_s_tip() {
    let out = birdtrain(&["predict", "--checkpoint", "runs/r1"]);
    assert_one_line_error(&out, &["required arguments were not provided", "<IMAGE>"]);
    assert_eq!(out.status.code(), Some(2));
    let out = birdtrain(&["--data", "d", "--epoch", "2"]);
    assert_one_line_error(&out, &["--epoch", "similar argument exists", "--epochs"]);
    let out = birdtrain(&["evl"]);
    let line = assert_one_line_error(&out, &["evl", "birdtrain --help"]);
    assert!(!line.contains("Usage"), "{line}");
}

#[test]
fn missing_data_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-such-dataset");
    let out = birdtrain(&["--data", s(&missing), "--gpus", "0"]);
    assert_one_line_error(&out, &["no-such-dataset", "does not exist"]);
    let out = birdtrain(&["--gpus", "0"]);
    assert_one_line_error(&out, &["--data"]);
}

#[test]
fn more_gpus_than_present() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 0);
    let run = tmp.path().join("run");
    let out = birdtrain(&["--data", s(&data), "--gpus", "4096", "--out", s(&run)]);
    assert_one_line_error(&out, &["--gpus 4096", "--gpus 0"]);
    assert!(!run.exists());
}

#[test]
fn bad_resume_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 0);
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let out = birdtrain(&["--data", s(&data), "--gpus", "0", "--resume", s(&empty)]);
    assert_one_line_error(&out, &["bad run folder", "checkpoint.json"]);
    let out = birdtrain(&[
        "--data",
        s(&data),
        "--gpus",
        "0",
        "--resume",
        s(&tmp.path().join("nope")),
    ]);
    assert_one_line_error(&out, &["bad run folder"]);
    assert_eq!(std::fs::read_dir(&empty).unwrap().count(), 0);
}

#[test]
fn checkpoint_from_another_model_or_class_list() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 0);
    let other = dataset(&tmp.path().join("other"), 3, 1);
    let run = tmp.path().join("run");
    let cache = tmp.path().join("cache");
    tiny_run(&data, &run, &cache);
    let before = std::fs::read(run.join("model.safetensors")).unwrap();

    // Another model on resume.
    let out = birdtrain(&[
        "--data",
        s(&data),
        "--gpus",
        "0",
        "--resume",
        s(&run),
        "--model",
        "resnet20",
        "--epochs",
        "2",
        "--cache-dir",
        s(&cache),
    ]);
    assert_one_line_error(&out, &["model", "resnet20", "resnet8"]);
    // Another class list on resume.
    let out = birdtrain(&[
        "--data",
        s(&other),
        "--gpus",
        "0",
        "--resume",
        s(&run),
        "--epochs",
        "2",
        "--cache-dir",
        s(&cache),
    ]);
    assert_one_line_error(&out, &["class list"]);
    // --init-from cannot start a run that --resume continues.
    let weights = run.join("model.safetensors");
    let out = birdtrain(&[
        "--data",
        s(&data),
        "--gpus",
        "0",
        "--resume",
        s(&run),
        "--epochs",
        "2",
        "--init-from",
        s(&weights),
        "--cache-dir",
        s(&cache),
    ]);
    assert_one_line_error(&out, &["--init-from", "--resume"]);
    // --zero-init-residual shapes a fresh initialisation, which --init-from replaces.
    let out = birdtrain(&[
        "--data",
        s(&data),
        "--gpus",
        "0",
        "--zero-init-residual",
        "--init-from",
        s(&weights),
        "--out",
        s(&tmp.path().join("zeroed")),
    ]);
    assert_one_line_error(&out, &["--zero-init-residual", "--init-from"]);
    assert_eq!(out.status.code(), Some(2));
    // Plateau flags on a resumed run whose schedule is not plateau.
    let out = birdtrain(&[
        "--data",
        s(&data),
        "--gpus",
        "0",
        "--resume",
        s(&run),
        "--epochs",
        "2",
        "--plateau-patience",
        "2",
        "--cache-dir",
        s(&cache),
    ]);
    assert_one_line_error(&out, &["--plateau-patience", "--schedule plateau"]);
    // Another class list on eval.
    let out = birdtrain(&[
        "eval",
        "--checkpoint",
        s(&run),
        "--data",
        s(&other),
        "--cache-dir",
        s(&cache),
    ]);
    assert_one_line_error(&out, &["class list"]);
    // predict on a file that is no image names that file.
    let fake = tmp.path().join("holiday.jpg");
    std::fs::write(&fake, b"plain text").unwrap();
    let out = birdtrain(&["predict", "--checkpoint", s(&run), s(&fake)]);
    assert_one_line_error(&out, &["holiday.jpg", "not an image"]);
    // Nothing was overwritten by the failed attempts.
    assert_eq!(
        std::fs::read(run.join("model.safetensors")).unwrap(),
        before
    );
}

#[test]
fn bad_image_skipped_and_reported_or_fatal_with_on_bad_image_fail() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 0);
    let bad = data.join("train").join("class_00").join("broken.png");
    std::fs::write(&bad, b"\x89PNG\r\n\x1a\nnot really a png").unwrap();
    let cache = tmp.path().join("cache");

    let run = tmp.path().join("fail");
    let out = birdtrain(&[
        "--data",
        s(&data),
        "--gpus",
        "0",
        "--model",
        "resnet8",
        "--image-size",
        "16",
        "--epochs",
        "1",
        "--out",
        s(&run),
        "--cache-dir",
        s(&cache),
        "--on-bad-image",
        "fail",
        "--batch-size",
        "4",
        "--quiet",
    ]);
    assert_one_line_error(&out, &["broken.png"]);
    assert!(!run.exists(), "a failed run leaves no run folder");

    let run = tmp.path().join("skip");
    let out = tiny_run(&data, &run, &tmp.path().join("cache2"));
    let report = std::fs::read_to_string(run.join("bad_files_train.txt")).unwrap();
    assert!(report.contains("broken.png"), "bad-files report: {report}");
    // The summary counts it and says where it is listed.
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("unreadable files skipped: 1 in train (listed in")
            && stdout.contains("bad_files_train.txt"),
        "{stdout}"
    );
    // The warning, in plain text: stderr is no terminal here.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("WARN") && stderr.contains("broken.png"),
        "{stderr}"
    );
    assert!(
        !stderr.contains('\x1b'),
        "colour codes in a pipe: {stderr:?}"
    );
    // A refused resume (the data changed) touches no report.
    std::fs::write(&bad, valid_png()).unwrap();
    let refused = birdtrain(&[
        "--resume",
        s(&run),
        "--data",
        s(&data),
        "--gpus",
        "0",
        "--epochs",
        "2",
        "--quiet",
    ]);
    assert!(!refused.status.success(), "{refused:?}");
    assert!(
        run.join("bad_files_train.txt").exists(),
        "a refused resume removed the report"
    );
    // A run that reads the fixed data through to its end removes the stale report.
    let fixed = birdtrain(&[
        "--resume",
        s(&run),
        "--data",
        s(&data),
        "--gpus",
        "0",
        "--epochs",
        "2",
        "--quiet",
        "--allow-data-change",
    ]);
    assert!(fixed.status.success(), "{fixed:?}");
    assert!(
        !run.join("bad_files_train.txt").exists(),
        "the stale report stayed"
    );
}

/// A small valid PNG (what the synthetic sets hold).
fn valid_png() -> Vec<u8> {
    let img = image::RgbImage::from_pixel(16, 16, image::Rgb([40, 90, 200]));
    let mut bytes = std::io::Cursor::new(Vec::new());
    img.write_to(&mut bytes, image::ImageFormat::Png).unwrap();
    bytes.into_inner()
}

/// Runs the binary with the flags of every resumed-schedule test before `args`, asserting
/// success.
fn run_ok(data: &Path, cache: &Path, args: &[&str]) {
    let mut all = vec![
        "--data",
        s(data),
        "--gpus",
        "0",
        "--cache-dir",
        s(cache),
        "--quiet",
    ];
    all.extend_from_slice(args);
    let out = birdtrain(&all);
    assert!(
        out.status.success(),
        "{all:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The first leg of a resumed-schedule test: resnet8 for 3 epochs into `run` with the
/// `schedule` flags, stopped after one step.
fn first_leg<'a>(run: &'a Path, schedule: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "--model",
        "resnet8",
        "--image-size",
        "16",
        "--epochs",
        "3",
        "--batch-size",
        "8",
        "--out",
        s(run),
        "--stop-after-steps",
        "1",
    ];
    args.extend_from_slice(schedule);
    args
}

/// A resumed plateau run carries its schedule from the checkpoint: the --plateau-* flags
/// tune it without --schedule plateau again, and naming the schedule again keeps the
/// settings not given.
#[test]
fn plateau_flags_tune_a_resumed_plateau_run() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 0);
    let cache = tmp.path().join("cache");
    let run = tmp.path().join("run");
    let settings = || {
        let meta = birdtrain::train::CheckpointMeta::load(&run).unwrap();
        let p = meta.settings;
        (p.plateau_patience, p.plateau_factor, p.plateau_cooldown)
    };
    let first = first_leg(&run, &["--schedule", "plateau", "--plateau-factor", "0.5"]);
    run_ok(&data, &cache, &first);
    let resume = ["--resume", s(&run), "--plateau-patience", "4"];
    run_ok(
        &data,
        &cache,
        &[&resume[..], &["--stop-after-steps", "2"]].concat(),
    );
    assert_eq!((settings().0, settings().1), (4, 0.5));
    let again = [
        "--resume",
        s(&run),
        "--schedule",
        "plateau",
        "--plateau-cooldown",
        "1",
    ];
    run_ok(
        &data,
        &cache,
        &[&again[..], &["--stop-after-steps", "3"]].concat(),
    );
    assert_eq!(settings(), (4, 0.5, 1));
}

/// A resumed step-decay run keeps its period and factor; --step-every and --step-gamma
/// retune it without naming the schedule again.
#[test]
fn step_flags_tune_a_resumed_step_run() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 0);
    let cache = tmp.path().join("cache");
    let run = tmp.path().join("run");
    let settings = || {
        let meta = birdtrain::train::CheckpointMeta::load(&run).unwrap();
        (meta.settings.step_every, meta.settings.step_gamma)
    };
    let schedule = [
        "--schedule",
        "step",
        "--step-every",
        "2",
        "--step-gamma",
        "0.5",
    ];
    run_ok(&data, &cache, &first_leg(&run, &schedule));
    assert_eq!(settings(), (2, 0.5));
    // Naming the schedule again keeps its settings.
    let again = [
        "--resume",
        s(&run),
        "--schedule",
        "step",
        "--stop-after-steps",
        "2",
    ];
    run_ok(&data, &cache, &again);
    assert_eq!(settings(), (2, 0.5));
    let retune = [
        "--resume",
        s(&run),
        "--step-gamma",
        "0.25",
        "--stop-after-steps",
        "3",
    ];
    run_ok(&data, &cache, &retune);
    assert_eq!(settings(), (2, 0.25));
}

#[test]
fn a_flat_folder_without_a_validation_share_names_the_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 0);
    // The class folders straight under the root: the flat layout.
    let flat = data.join("train");
    let out = birdtrain(&["--data", s(&flat), "--gpus", "0", "--model", "resnet8"]);
    assert_one_line_error(&out, &["train", "--valid-fraction"]);
}

/// The training flags of a tiny CPU run on `data` into `out` (no cache folder of the user's),
/// plus `extra`.
fn train_flags<'a>(
    data: &'a Path,
    cache: &'a Path,
    out: &'a Path,
    extra: &[&'a str],
) -> Vec<&'a str> {
    let mut args = vec![
        "--data",
        s(data),
        "--gpus",
        "0",
        "--model",
        "resnet8",
        "--image-size",
        "16",
        "--epochs",
        "1",
        "--batch-size",
        "4",
        "--cache-dir",
        s(cache),
        "--out",
        s(out),
        "--quiet",
    ];
    args.extend_from_slice(extra);
    args
}

/// A CSV at `path` with the given header and rows.
fn csv(path: &Path, header: &str, rows: &[String]) -> PathBuf {
    let mut text = format!("{header}\n");
    for row in rows {
        text += row;
        text.push('\n');
    }
    std::fs::write(path, text).unwrap();
    path.to_path_buf()
}

/// Issue 34's messages that pointed the wrong way, about flags and layouts: each now names
/// the flag that is wrong and never suggests what was given already (or an internal name).
#[test]
fn messages_name_the_flag_that_is_wrong_and_not_what_was_given() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 0);
    let cache = tmp.path().join("cache");
    let out = tmp.path().join("run");
    // --step-gamma 0 was reported against --step-every.
    let run = birdtrain(&train_flags(
        &data,
        &cache,
        &out,
        &["--schedule", "step", "--step-gamma", "0"],
    ));
    let line = assert_one_line_error(&run, &["--step-gamma", "(0, 1]"]);
    assert!(!line.contains("--step-every"), "{line}");
    // An absurd --weight-decay diverges; the hint named --lr.
    let run = birdtrain(&train_flags(
        &data,
        &cache,
        &out,
        &["--weight-decay", "1e30"],
    ));
    let line = assert_one_line_error(&run, &["diverged", "hint: --weight-decay 1e30"]);
    assert!(!line.contains("lower --lr"), "{line}");
    assert!(!out.exists());
    // The flat layout's hints: without a share, no internal name; with one, images straight
    // in the root are no flat dataset, and the hint says so rather than <root>/train/.
    let flat = data.join("train");
    let run = birdtrain(&train_flags(&flat, &cache, &out, &[]));
    let line = assert_one_line_error(&run, &["--valid-fraction"]);
    assert!(!line.contains("DatasetSource"), "{line}");
    let loose = tmp.path().join("loose");
    std::fs::create_dir(&loose).unwrap();
    for entry in std::fs::read_dir(flat.join("class_00")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), loose.join(entry.file_name())).unwrap();
    }
    let run = birdtrain(&train_flags(
        &loose,
        &cache,
        &out,
        &["--valid-fraction", "0.2"],
    ));
    let line = assert_one_line_error(&run, &["flat", "<root>/<class>/"]);
    assert!(!line.contains("<root>/train/"), "{line}");
    // CSV files: the hint fits the file and the flags as given.
    let rows: Vec<String> = std::fs::read_dir(flat.join("class_00"))
        .unwrap()
        .map(|e| format!("{},a", e.unwrap().path().display()))
        .chain(
            std::fs::read_dir(flat.join("class_01"))
                .unwrap()
                .map(|e| format!("{},b", e.unwrap().path().display())),
        )
        .collect();
    let header_only = csv(&tmp.path().join("empty.csv"), "path,label", &[]);
    let run = birdtrain(&train_flags(
        &header_only,
        &cache,
        &out,
        &["--valid-fraction", "0.2"],
    ));
    let line = assert_one_line_error(&run, &["empty.csv", "lists no image"]);
    assert!(!line.contains("--valid-fraction"), "{line}");
    assert!(!line.contains("a header row"), "{line}");
    let unsplit = csv(&tmp.path().join("unsplit.csv"), "path,label", &rows);
    let run = birdtrain(&train_flags(&unsplit, &cache, &out, &[]));
    assert_one_line_error(
        &run,
        &[
            "no image of split `valid`",
            "split column",
            "--valid-fraction",
        ],
    );
    let split_rows: Vec<String> = rows.iter().map(|r| format!("{r},train")).collect();
    let split = csv(
        &tmp.path().join("split.csv"),
        "path,label,split",
        &split_rows,
    );
    let run = birdtrain(&train_flags(
        &split,
        &cache,
        &out,
        &["--valid-fraction", "0.2"],
    ));
    let line = assert_one_line_error(&run, &["--valid-fraction", "has a split column"]);
    assert!(!line.contains("[0, 1)"), "{line}");
    let run = birdtrain(&train_flags(&split, &cache, &out, &[]));
    let line = assert_one_line_error(&run, &["split.csv", "rows whose split is `valid`"]);
    assert!(!line.contains("a header row"), "{line}");
    assert!(!out.exists());
}

/// A run folder whose run has not written its first checkpoint is "in use", not "not a run
/// folder", for --resume, eval and predict.
#[test]
fn a_run_folder_in_use_before_its_first_checkpoint_is_called_in_use() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 0);
    let busy = tmp.path().join("busy");
    std::fs::create_dir(&busy).unwrap();
    // What a starting run holds: the folder's lock, no checkpoint.json yet.
    let lock = std::fs::File::create(busy.join(".birdtrain.lock")).unwrap();
    lock.lock().unwrap();
    let cache = tmp.path().join("cache");
    let resume = birdtrain(&train_flags(&data, &cache, &busy, &["--resume", s(&busy)]));
    let eval = birdtrain(&["eval", "--checkpoint", s(&busy), "--data", s(&data)]);
    let image = data.join("valid/class_00");
    let predict = birdtrain(&["predict", "--checkpoint", s(&busy), s(&image)]);
    for run in [&resume, &eval, &predict] {
        let line = assert_one_line_error(run, &["busy", "in use", "first checkpoint"]);
        assert!(!line.contains("is this a birdtrain run folder"), "{line}");
    }
    // Once nobody holds it, the folder is what it is: no run.
    drop(lock);
    let eval = birdtrain(&["eval", "--checkpoint", s(&busy), "--data", s(&data)]);
    assert_one_line_error(&eval, &["busy", "checkpoint.json"]);
}

/// `--init-from`: weights holding NaN are refused naming the file and the tensor (training
/// from them diverged at once, and the hint said "lower --lr"); a class head of another
/// class count is replaced, and the start says so; a backbone-only file (no head) starts a
/// new head too.
#[test]
fn init_from_checks_its_weights_and_says_what_it_replaces() {
    use safetensors::SafeTensors;
    let tmp = tempfile::tempdir().unwrap();
    let three = dataset(&tmp.path().join("d3"), 3, 0);
    let two = dataset(&tmp.path().join("d2"), 2, 1);
    let cache = tmp.path().join("cache");
    let source = tmp.path().join("source");
    tiny_run(&three, &source, &cache);
    let bytes = std::fs::read(source.join("model.safetensors")).unwrap();
    let tensors = SafeTensors::deserialize(&bytes).unwrap();
    // The file again, with `edit` applied to each (name, f32 values), `None` dropping it.
    /// Each tensor's new bytes, or `None` to leave it out.
    type Edit<'a> = &'a dyn Fn(&str, Vec<u8>) -> Option<Vec<u8>>;
    let rewrite = |name: &str, edit: Edit<'_>| {
        let kept: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = tensors
            .tensors()
            .into_iter()
            .filter_map(|(n, v)| {
                edit(&n, v.data().to_vec()).map(|data| (n, v.dtype(), v.shape().to_vec(), data))
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = kept
            .iter()
            .map(|(n, dtype, shape, data)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap(),
                )
            })
            .collect();
        let path = tmp.path().join(name);
        std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
        path
    };
    let nan = rewrite("nan.safetensors", &|n, mut data| {
        if n == "conv1.weight" {
            data[4..8].copy_from_slice(&f32::NAN.to_le_bytes());
        }
        Some(data)
    });
    let out = tmp.path().join("run");
    let run = birdtrain(&train_flags(
        &three,
        &cache,
        &out,
        &["--init-from", s(&nan)],
    ));
    let line = assert_one_line_error(&run, &["nan.safetensors", "conv1.weight", "NaN"]);
    assert!(!line.contains("--lr"), "{line}");
    assert!(!out.exists());
    // Three classes into two: a new head, said at the start.
    let run = birdtrain(&train_flags(
        &two,
        &cache,
        &out,
        &["--init-from", s(&source.join("model.safetensors"))],
    ));
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(
        stdout.contains("a new class head (fc.weight, fc.bias) for 2 classes")
            && stdout.contains("the file's is for 3 classes"),
        "{stdout}"
    );
    // A backbone without a head.
    let backbone = rewrite("backbone.safetensors", &|n, data| {
        (!n.starts_with("fc.")).then_some(data)
    });
    let out2 = tmp.path().join("run2");
    let run = birdtrain(&train_flags(
        &two,
        &cache,
        &out2,
        &["--init-from", s(&backbone)],
    ));
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(
        stdout.contains("the file has none (backbone only)"),
        "{stdout}"
    );
}

/// `--resume` with other values of settings that shape the training (seed, rate,
/// augmentation, mixup, sampler, label smoothing, frozen batch norm) says so, once, naming
/// each value and the checkpoint's, and which wins (as for another batch size).
#[test]
fn a_resume_with_other_settings_warns_naming_each() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 0);
    let cache = tmp.path().join("cache");
    let out = tmp.path().join("run");
    tiny_run(&data, &out, &cache);
    let resume = |epochs: &str, extra: &[&str]| {
        let mut args = vec![
            "--data",
            s(&data),
            "--gpus",
            "0",
            "--resume",
            s(&out),
            "--epochs",
            epochs,
            "--cache-dir",
            s(&cache),
            "--quiet",
        ];
        args.extend_from_slice(extra);
        let run = birdtrain(&args);
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
        String::from_utf8_lossy(&run.stderr).into_owned()
    };
    let stderr = resume(
        "2",
        &[
            "--seed",
            "5",
            "--lr",
            "0.1",
            "--augment",
            "none",
            "--mixup",
            "0.2",
            "--sampler",
            "balanced",
            "--label-smoothing",
            "0.1",
            "--freeze-bn",
        ],
    );
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warnings.len(), 1, "{stderr}");
    for needle in [
        "--seed 5 (the checkpoint's: 0)",
        "--lr 0.1 (the checkpoint's: 0.8)",
        "--augment none (the checkpoint's: pad-crop)",
        "--mixup 0.2 (the checkpoint's: 0)",
        "--sampler balanced (the checkpoint's: shuffle)",
        "--label-smoothing 0.1 (the checkpoint's: 0)",
        "--freeze-bn true (the checkpoint's: false)",
        "the values given win",
    ] {
        assert!(warnings[0].contains(needle), "`{needle}` missing: {stderr}");
    }
    // The checkpoint's own values (now those given above) again: nothing to say.
    let stderr = resume("3", &["--lr", "0.1", "--seed", "5"]);
    assert!(!stderr.contains("WARN"), "{stderr}");
}

/// A CSV listing a file twice, in both train and valid, or under two labels: one warning
/// each, naming the file and its lines (each row is used as written).
#[test]
fn a_csv_listing_a_file_again_is_warned_about_naming_the_lines() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 0);
    let file = |split: &str, class: &str, i: usize| {
        data.join(format!("{split}/{class}/{split}_{i:05}.png"))
            .display()
            .to_string()
    };
    let mut rows = Vec::new();
    for (class, label) in [("class_00", "a"), ("class_01", "b")] {
        for i in 0..6 {
            rows.push(format!("{},{label},train", file("train", class, i)));
        }
        for i in 0..2 {
            rows.push(format!("{},{label},valid", file("valid", class, i)));
        }
    }
    // Lines 18, 19 and 20 (the header is line 1).
    rows.push(format!("{},a,train", file("train", "class_00", 0)));
    rows.push(format!("{},a,valid", file("train", "class_00", 1)));
    rows.push(format!("{},b,train", file("train", "class_00", 2)));
    let list = csv(&tmp.path().join("list.csv"), "path,label,split", &rows);
    let cache = tmp.path().join("cache");
    let out = tmp.path().join("run");
    let run = birdtrain(&train_flags(&list, &cache, &out, &[]));
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    let warned = |name: &str| -> Vec<&str> {
        stderr
            .lines()
            .filter(|l| l.contains("WARN") && l.contains(name))
            .collect()
    };
    let twice = warned("train_00000.png");
    assert_eq!(twice.len(), 1, "{stderr}");
    assert!(
        twice[0].contains("more than once") && twice[0].contains("line 2, line 18"),
        "{stderr}"
    );
    let splits = warned("train_00001.png");
    assert_eq!(splits.len(), 1, "{stderr}");
    assert!(
        splits[0].contains("more than one split")
            && splits[0].contains("train line 3, valid line 19"),
        "{stderr}"
    );
    let labels = warned("train_00002.png");
    assert_eq!(labels.len(), 1, "{stderr}");
    assert!(
        labels[0].contains("more than one label") && labels[0].contains("`a` line 4, `b` line 20"),
        "{stderr}"
    );
}
