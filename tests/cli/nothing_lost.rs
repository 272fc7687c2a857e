//! Issue 11, flags and files: absurd counts, paths of the wrong kind, damaged sidecars and
//! odd class names end in one clear line naming the flag, file or field; never a hang, a
//! panic, an abort or an out-of-memory kill.

use std::path::{Path, PathBuf};

use pipeline::synth::{write_dataset, ImageFormatKind, SynthConfig};

use crate::cli_support;
use cli_support::{assert_one_line_error, birdtrain_output as birdtrain, s};

fn dataset(root: &Path, classes: usize, train_per_class: usize) -> PathBuf {
    write_dataset(&SynthConfig {
        out: root.to_path_buf(),
        classes,
        train_per_class,
        valid_per_class: 2,
        test_per_class: 0,
        width: 16,
        height: 16,
        format: ImageFormatKind::Png,
        seed: 1,
    })
    .expect("synthetic dataset");
    root.to_path_buf()
}

/// Training flags for a tiny CPU run on `data` into `out`, plus `extra`.
fn train_args<'a>(data: &'a Path, out: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
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
        "--out",
        s(out),
        "--quiet",
    ];
    args.extend_from_slice(extra);
    args
}

#[test]
fn absurd_counts_name_the_flag_and_the_limit() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 3, 30);
    let out = tmp.path().join("run");
    let cache = tmp.path().join("cache");
    for (flag, value) in [("--threads", "1000"), ("--workers", "100000")] {
        let run = birdtrain(&train_args(&data, &out, &[flag, value]));
        assert_one_line_error(&run, &[flag, value, "at most", "cores"]);
    }
    // 90 training images cannot feed 100000 replicas: refused before any replica exists.
    let run = birdtrain(&train_args(
        &data,
        &out,
        &["--replicas", "100000", "--cache-dir", s(&cache)],
    ));
    assert_one_line_error(&run, &["replicas", "100000", "90 images"]);
    assert!(!out.join("checkpoint.json").exists());
    // A batch beyond the data is one step of every image: the network is sized for the
    // images that can come, not for a billion.
    let mut args = train_args(&data, &out, &["--cache-dir", s(&cache)]);
    let at = args.iter().position(|a| *a == "--batch-size").unwrap();
    args[at + 1] = "1000000000";
    let run = birdtrain(&args);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    assert!(
        stderr.contains("larger than the 90 training images"),
        "{stderr}"
    );
    assert!(out.join("checkpoint.json").exists());
}

#[test]
fn bench_pipeline_counts() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 3);
    let cache = tmp.path().join("cache");
    let bench = |extra: &[&str]| {
        let mut args = vec![
            "bench",
            "pipeline",
            "--data",
            s(&data),
            "--image-size",
            "16",
            "--cache-dir",
            s(&cache),
        ];
        args.extend_from_slice(extra);
        birdtrain(&args)
    };
    assert_one_line_error(&bench(&["--epochs", "0"]), &["--epochs", "at least 1"]);
    assert_one_line_error(
        &bench(&["--store-size", "8"]),
        &["--store-size", "at least the image size"],
    );
    assert_one_line_error(&bench(&["--augment", "pad-crop"]), &["--augment", "device"]);
    assert_one_line_error(
        &bench(&["--crop-scale", "0.5"]),
        &["--crop-scale", "resized-crop"],
    );
    assert_one_line_error(
        &bench(&["--augment", "resized-crop", "--crop-scale", "2"]),
        &["--crop-scale", "0 < min <= max <= 1"],
    );
    assert_one_line_error(&bench(&["--workers", "100000"]), &["--workers", "at most"]);
    assert_one_line_error(
        &bench(&["--prefetch", "1000000000000000"]),
        &["prefetch", "memory"],
    );
    // A batch larger than the split is one batch of every image, not a 600 GB allocation.
    let run = bench(&["--batch-size", "1000000000", "--epochs", "1"]);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(stdout.contains("6 images"), "{stdout}");
}

/// A finished one-epoch resnet8 run on `data`.
fn tiny_run(data: &Path, run: &Path, cache: &Path) {
    let args = train_args(data, run, &["--cache-dir", s(cache), "--threads", "1"]);
    cli_support::birdtrain(&args);
}

#[test]
fn paths_of_the_wrong_kind_say_what_they_are() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 3);
    let out = tmp.path().join("run");
    let file = tmp.path().join("file.txt");
    std::fs::write(&file, b"x").unwrap();
    let run = birdtrain(&train_args(&file, &out, &[]));
    // A file is read as a CSV listing the images; this one is not.
    assert_one_line_error(&run, &["file.txt", "line 1", "a path column"]);
    let run = birdtrain(&train_args(&data, &out, &["--init-from", s(tmp.path())]));
    assert_one_line_error(&run, &["is a folder, not a file", "--init-from"]);
    let run = birdtrain(&train_args(&data, &out, &["--init-from", "/dev/null"]));
    assert_one_line_error(&run, &["/dev/null", "character device", "--init-from"]);
    let run = birdtrain(&["predict", "--checkpoint", s(&out), "/dev/null"]);
    assert_one_line_error(
        &run,
        &["character device, not a file", "image files or folders"],
    );
    let run = birdtrain(&["bench", "pipeline", "--data", s(&file)]);
    assert_one_line_error(&run, &["file.txt", "line 1", "a path column"]);
    let run = birdtrain(&train_args(&data, &out, &["--cache-dir", s(&file)]));
    assert_one_line_error(&run, &["is a file, not a folder", "--cache-dir"]);
    let run = birdtrain(&train_args(&data, &file, &[]));
    assert_one_line_error(&run, &["is a file, not a folder", "--out"]);
    let run = birdtrain(&[
        "bench",
        "pipeline",
        "--data",
        s(&data),
        "--cache-dir",
        "/dev/null",
    ]);
    assert_one_line_error(&run, &["character device", "--cache-dir"]);
    // A path through a file: the OS's word for it and what it means.
    let through = file.join("run");
    let run = birdtrain(&train_args(&data, &through, &[]));
    assert_one_line_error(&run, &["not a directory", "a part of that path is a file"]);
    let run = birdtrain(&[
        "synth",
        "--out",
        s(&through),
        "--classes",
        "2",
        "--train-per-class",
        "1",
        "--valid-per-class",
        "1",
    ]);
    assert_one_line_error(&run, &["not a directory", "a part of that path is a file"]);
    assert!(!out.exists());
}

#[test]
fn inference_needs_the_weights_only_and_checks_its_inputs() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 4);
    let run = tmp.path().join("run");
    let cache = tmp.path().join("cache");
    tiny_run(&data, &run, &cache);
    let image = data.join("valid").join("class_00");
    let image = std::fs::read_dir(&image)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    // A run folder copied without its optimizer state still evaluates and predicts.
    for entry in std::fs::read_dir(&run).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with("optimizer") {
            std::fs::remove_file(&path).unwrap();
        }
    }
    // A batch beyond the split is one batch of the split, not an allocation for 1e9 images.
    let eval = birdtrain(&[
        "eval",
        "--checkpoint",
        s(&run),
        "--data",
        s(&data),
        "--batch-size",
        "1000000000",
    ]);
    assert!(
        eval.status.success(),
        "{}",
        String::from_utf8_lossy(&eval.stderr)
    );
    let predict = birdtrain(&["predict", "--checkpoint", s(&run), s(&image)]);
    assert!(
        predict.status.success(),
        "{}",
        String::from_utf8_lossy(&predict.stderr)
    );
    // So does a copy of the sidecar and the stable name alone (what a user copies by hand);
    // a stable file of another checkpoint is refused by the sidecar's checksum.
    let copy = tmp.path().join("copy");
    std::fs::create_dir(&copy).unwrap();
    for file in ["checkpoint.json", "model.safetensors"] {
        std::fs::copy(run.join(file), copy.join(file)).unwrap();
    }
    let copied = birdtrain(&["predict", "--checkpoint", s(&copy), s(&image)]);
    assert!(
        copied.status.success() && copied.stdout == predict.stdout,
        "{}",
        String::from_utf8_lossy(&copied.stderr)
    );
    let mut other = std::fs::read(copy.join("model.safetensors")).unwrap();
    let last = other.len() - 1;
    other[last] ^= 1;
    std::fs::write(copy.join("model.safetensors"), other).unwrap();
    let torn = birdtrain(&["predict", "--checkpoint", s(&copy), s(&image)]);
    assert_one_line_error(&torn, &["model.safetensors", "checksum"]);
    let run_predict = |extra: &[&str]| {
        let mut args = vec!["predict", "--checkpoint", s(&run)];
        args.extend_from_slice(extra);
        birdtrain(&args)
    };
    assert_one_line_error(&run_predict(&["--top-k", "0", s(&image)]), &["--top-k"]);
    // An empty file is named as the user gave it, not as a scratch copy.
    let empty = tmp.path().join("empty.jpg");
    std::fs::write(&empty, b"").unwrap();
    let stderr = assert_one_line_error(&run_predict(&[s(&empty)]), &[s(&empty)]);
    assert!(!stderr.contains("birdtrain-predict-"), "{stderr}");
}

#[test]
fn damaged_sidecar_fields_name_checkpoint_json_and_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 4);
    let run = tmp.path().join("run");
    let cache = tmp.path().join("cache");
    tiny_run(&data, &run, &cache);
    let sidecar = run.join("checkpoint.json");
    let original: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&sidecar).unwrap()).unwrap();
    let image = tmp.path().join("i.png");
    let first = std::fs::read_dir(data.join("valid").join("class_00"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    std::fs::copy(first, &image).unwrap();
    let cases: [(&str, serde_json::Value, &str); 7] = [
        ("/classes", serde_json::json!([]), "classes"),
        ("/image_size", serde_json::json!("big"), "image_size"),
        ("/image_size", serde_json::json!(0), "image_size"),
        ("/model_file", serde_json::json!("../x"), "model_file"),
        ("/batch_size", serde_json::json!(0), "batch_size"),
        ("/settings/lr", serde_json::json!(-1.0), "lr"),
        (
            "/settings/schedule",
            serde_json::json!("zigzag"),
            "schedule",
        ),
    ];
    for (pointer, value, field) in cases {
        let mut edited = original.clone();
        *edited.pointer_mut(pointer).unwrap() = value;
        // Pretty, as birdtrain writes it.
        std::fs::write(&sidecar, serde_json::to_string_pretty(&edited).unwrap()).unwrap();
        let resume = birdtrain(&[
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
        let line = assert_one_line_error(&resume, &["checkpoint.json", field]);
        assert!(
            !line.contains("--"),
            "names a flag the user never passed: {line}"
        );
        if matches!(field, "classes" | "image_size" | "model_file") {
            let predict = birdtrain(&["predict", "--checkpoint", s(&run), s(&image)]);
            assert_one_line_error(&predict, &["checkpoint.json", field]);
        }
    }
}

#[test]
fn class_names_with_a_newline_stay_on_their_line() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 4);
    for split in ["train", "valid"] {
        let dir = data.join(split);
        std::fs::rename(dir.join("class_01"), dir.join("two\nlines")).unwrap();
    }
    let run = tmp.path().join("run");
    let cache = tmp.path().join("cache");
    let args = train_args(&data, &run, &["--cache-dir", s(&cache)]);
    let train = birdtrain(&args);
    assert!(train.status.success());
    let stdout = String::from_utf8_lossy(&train.stdout);
    assert!(
        stdout.contains("2 classes: class_00, two\\nlines"),
        "{stdout}"
    );
    let image = data.join("valid").join("two\nlines");
    let image = std::fs::read_dir(&image)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let predict = birdtrain(&[
        "predict",
        "--checkpoint",
        s(&run),
        "--top-k",
        "2",
        s(&image),
    ]);
    assert!(predict.status.success());
    let stdout = String::from_utf8_lossy(&predict.stdout);
    // The image's path line, then one line per class.
    assert_eq!(stdout.lines().count(), 3, "{stdout}");
    assert!(stdout.contains("two\\nlines"), "{stdout}");
    let eval = birdtrain(&["eval", "--checkpoint", s(&run), "--data", s(&data)]);
    assert!(eval.status.success());
    let stdout = String::from_utf8_lossy(&eval.stdout);
    // Summary, header, two classes.
    assert_eq!(stdout.lines().count(), 4, "{stdout}");
}

#[test]
fn synth_and_demo_refuse_a_non_empty_folder_without_overwrite() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("data");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep.txt"), b"mine").unwrap();
    let synth = |extra: &[&str]| {
        let mut args = vec![
            "synth",
            "--out",
            s(&out),
            "--classes",
            "2",
            "--train-per-class",
            "2",
            "--valid-per-class",
            "1",
            "--size",
            "16x16",
        ];
        args.extend_from_slice(extra);
        birdtrain(&args)
    };
    assert_one_line_error(&synth(&[]), &["not empty", "--overwrite"]);
    assert!(!out.join("train").exists());
    let first = synth(&["--overwrite"]);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    // Overwriting with fewer classes leaves no stale class behind; other files stay.
    std::fs::create_dir(out.join("train").join("stale")).unwrap();
    let again = synth(&["--overwrite"]);
    assert!(again.status.success());
    assert!(!out.join("train").join("stale").exists());
    assert!(out.join("keep.txt").exists());
    let demo = birdtrain(&[
        "demo",
        "--data-dir",
        s(tmp.path()),
        "--out",
        s(&tmp.path().join("run")),
        "--epochs",
        "1",
        "--quiet",
    ]);
    assert_one_line_error(&demo, &["not empty", "--data-dir", "--overwrite"]);
    let size = birdtrain(&[
        "synth",
        "--out",
        s(&tmp.path().join("x")),
        "--size",
        "9000x64",
    ]);
    assert_one_line_error(&size, &["--size", "8192"]);
}

#[test]
fn a_panic_is_one_line_naming_a_bug_and_exit_101() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_birdtrain"))
        .args(["synth", "--out", "/nonexistent/never-written"])
        .env("BIRDTRAIN_FAULT", "panic")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(101));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].starts_with("error: birdtrain panicked at src/"),
        "{stderr}"
    );
    assert!(
        lines[0].contains(birdtrain::cli::panic_hook::BUG_MARKER),
        "{stderr}"
    );
    assert!(lines[0].contains("report it"), "{stderr}");
}

/// Under an address-space limit (`ulimit -v`) that runs out at any point of the setup, a
/// training run ends with one line about memory and exit code 1: never the allocator's abort
/// (exit 134, "memory allocation of N bytes failed").
#[test]
fn running_out_of_memory_is_one_line_not_an_abort() {
    use std::os::unix::process::CommandExt;
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 4);
    let cache = tmp.path().join("cache");
    // From "fails at once" to "the network's tensors do not fit": each limit runs out at
    // another allocation (the threads' stacks, the weights' initialisation, the tensors).
    for mib in [60usize, 100, 150, 250, 400, 700] {
        let out = tmp.path().join(format!("run-{mib}"));
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_birdtrain"));
        cmd.args([
            "--data",
            s(&data),
            "--gpus",
            "0",
            "--model",
            "resnet50",
            "--image-size",
            "224",
            "--batch-size",
            "256",
            "--epochs",
            "1",
            "--cache-dir",
            s(&cache),
            "--out",
            s(&out),
        ]);
        let bytes = (mib << 20) as libc::rlim_t;
        // SAFETY: only setrlimit, which is async-signal-safe, runs between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                let limit = libc::rlimit {
                    rlim_cur: bytes,
                    rlim_max: bytes,
                };
                if libc::setrlimit(libc::RLIMIT_AS, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let run = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(1), "{mib} MiB: {stderr}");
        let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
        assert_eq!(errors.len(), 1, "{mib} MiB: {stderr}");
        // A thread's stack is address space too: where a thread is what no longer fits,
        // the line names it.
        assert!(
            (errors[0].contains("out of memory") || errors[0].contains("could not start thread"))
                && errors[0].contains("hint"),
            "{mib} MiB: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{mib} MiB: {stderr}");
    }
}

/// Asserts the one line of a thread the OS refused: exit 1, one `error:` line naming the
/// thread, the limit and a hint, no panic (`what` says which run it was).
fn assert_refused_thread(run: &std::process::Output, thread: &str, what: &str) {
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{what}: {stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{what}: {stderr}");
    for needle in [
        &format!("could not start thread `{thread}"),
        "ulimit",
        "hint",
    ] {
        assert!(
            errors[0].contains(needle),
            "{what}: `{needle}` missing: {stderr}"
        );
    }
    assert!(!stderr.contains("panicked"), "{what}: {stderr}");
}

/// Every place that starts a thread, made to fail as the OS would (the fault hook
/// `BIRDTRAIN_FAULT=thread:<name>[@<n>]`): at start-up (the signal thread), in the input
/// engine (decode workers, the orchestrator, a buffer's allocation), in the CPU backend's
/// pool and in the ranks (a rank, its communication thread, its watchdog). Each ends in one
/// line naming the thread with a hint, exit 1: never a panic, never a rank waiting for a rank
/// that never started, and no run folder left behind.
#[test]
fn a_thread_that_cannot_start_is_one_line_with_a_hint() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 4);
    let cache = tmp.path().join("cache");
    for (fault, thread) in [
        ("stop-signals", "stop-signals"),
        ("pipeline-decode@2", "pipeline-decode-1"),
        ("pipeline-orchestrator@2", "pipeline-orchestrator"),
        ("pipeline-alloc", "pipeline-alloc"),
        ("cpu-backend@2", "cpu-backend-1"),
        ("rank-1", "rank-1"),
        ("comm-0", "comm-0"),
        ("watchdog-1", "watchdog-1"),
    ] {
        let out = tmp.path().join(format!("run-{fault}"));
        let args = train_args(
            &data,
            &out,
            &[
                "--replicas",
                "2",
                "--threads",
                "2",
                "--workers",
                "2",
                "--cache-dir",
                s(&cache),
                "--collective-timeout",
                "600",
            ],
        );
        let started = std::time::Instant::now();
        let run = std::process::Command::new(env!("CARGO_BIN_EXE_birdtrain"))
            .args(&args)
            .env("BIRDTRAIN_FAULT", format!("thread:{fault}"))
            .output()
            .unwrap();
        assert_refused_thread(&run, thread, fault);
        // The other rank was told at once, not after the collective timeout.
        assert!(
            started.elapsed().as_secs() < 120,
            "{fault}: took {:?}",
            started.elapsed()
        );
        assert!(
            !out.exists(),
            "{fault}: the failed run left {}",
            out.display()
        );
    }
    // Inference commands start the engine the same way.
    let run_dir = tmp.path().join("trained");
    tiny_run(&data, &run_dir, &cache);
    let eval = std::process::Command::new(env!("CARGO_BIN_EXE_birdtrain"))
        .args(["eval", "--checkpoint", s(&run_dir), "--data", s(&data)])
        .env("BIRDTRAIN_FAULT", "thread:pipeline-orchestrator")
        .output()
        .unwrap();
    assert_refused_thread(&eval, "pipeline-orchestrator", "eval");
}

/// Address-space limits that run out at thread creation or elsewhere in the start of a
/// small run (`ulimit -v` through the shell, as a user sets it): each ends in exit 1 with one
/// `error:` line and a hint, or in a clean success; never a panic (exit 101) or an abort
/// (exit 134).
#[test]
fn address_space_limits_at_start_up_are_one_line_or_a_success() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 4);
    let cache = tmp.path().join("cache");
    let mut failures = 0;
    for kib in [
        35_000, 40_000, 45_000, 50_000, 60_000, 80_000, 150_000, 300_000,
    ] {
        let out = tmp.path().join(format!("run-{kib}"));
        let args = train_args(&data, &out, &["--cache-dir", s(&cache), "--workers", "2"]);
        let command = format!("ulimit -v {kib}; exec \"$0\" \"$@\"");
        let run = std::process::Command::new("bash")
            .arg("-c")
            .arg(&command)
            .arg(env!("CARGO_BIN_EXE_birdtrain"))
            .args(&args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(!stderr.contains("panicked"), "{kib} KiB: {stderr}");
        if run.status.success() {
            assert!(out.join("checkpoint.json").exists(), "{kib} KiB: {stderr}");
            continue;
        }
        failures += 1;
        assert_eq!(run.status.code(), Some(1), "{kib} KiB: {stderr}");
        let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
        assert_eq!(errors.len(), 1, "{kib} KiB: {stderr}");
        assert!(errors[0].contains("hint"), "{kib} KiB: {stderr}");
    }
    assert!(failures > 0, "no limit was tight enough to fail");
}

/// A full disk while `report.png` is drawn: the run folder's one line with the disk's hint
/// (it was the plotting backend's raw error), and no temporary file left.
#[test]
fn a_full_disk_while_drawing_the_report_names_it_with_the_disk_hint() {
    use birdtrain::train::{EpochMetrics, MetricsSplit};
    let tmp = tempfile::tempdir().unwrap();
    let Some(disk) = cli_support::Tmpfs::mount(&tmp.path().join("full"), 64 * 1024) else {
        return;
    };
    // Filled to the last block.
    let _ = std::fs::write(disk.path().join("filler"), vec![0u8; 1 << 20]);
    let line = |split, loss| EpochMetrics {
        epoch: 1,
        split,
        loss,
        accuracy: 0.5,
        top5: 1.0,
        images_per_sec: 100.0,
        seconds: 1.0,
    };
    let report = disk.path().join("report.png");
    let err = birdtrain::train::write_report(
        &report,
        &[
            line(MetricsSplit::Train, 1.0),
            line(MetricsSplit::Valid, 0.9),
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("report.png")
            && err.contains("No space left")
            && err.contains("hint: free space"),
        "{err}"
    );
    let names: Vec<String> = std::fs::read_dir(disk.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["filler"]);
}
