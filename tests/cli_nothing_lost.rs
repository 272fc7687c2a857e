//! Issue 11, flags and files: absurd counts, paths of the wrong kind, damaged sidecars and
//! odd class names end in one clear line naming the flag, file or field; never a hang, a
//! panic, an abort or an out-of-memory kill.

use std::path::{Path, PathBuf};
use std::process::Output;

use pipeline::synth::{write_dataset, ImageFormatKind, SynthConfig};

mod cli_support;
use cli_support::{birdtrain_output as birdtrain, s};

/// Asserts a failure with exactly one non-empty stderr line containing every `needle`.
fn assert_one_line_error(out: &Output, needles: &[&str]) -> String {
    assert!(!out.status.success(), "expected a failure, got success");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected one line, got:\n{stderr}");
    assert!(lines[0].starts_with("error"), "{stderr}");
    for needle in needles {
        assert!(
            lines[0].to_lowercase().contains(&needle.to_lowercase()),
            "`{needle}` missing from: {stderr}"
        );
    }
    stderr
}

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
