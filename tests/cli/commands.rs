//! The other commands end to end through the binary: `synth`, `bench pipeline --json`,
//! `eval`, `predict`, `demo`, and Ctrl-C during training (checkpoint saved, exit 130,
//! resumable).

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::cli_support;
use cli_support::{birdtrain, birdtrain_closed_stdout, s};

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn synth(dir: &Path, classes: &str, train: &str, size: &str) {
    birdtrain(&[
        "synth",
        "--out",
        s(dir),
        "--classes",
        classes,
        "--train-per-class",
        train,
        "--valid-per-class",
        "4",
        "--test-per-class",
        "3",
        "--size",
        size,
        "--format",
        "jpg",
        "--seed",
        "4",
    ]);
}

#[test]
fn synth_then_bench_pipeline_prints_one_json_line_per_epoch() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d");
    synth(&data, "3", "8", "40x30");
    for split in ["train", "valid", "test"] {
        assert_eq!(
            std::fs::read_dir(data.join(split)).unwrap().count(),
            3,
            "{split}"
        );
    }
    let out = birdtrain(&[
        "bench",
        "pipeline",
        "--data",
        s(&data),
        "--split",
        "train",
        "--epochs",
        "2",
        "--batch-size",
        "5",
        "--image-size",
        "16",
        "--workers",
        "2",
        "--cache-dir",
        s(&tmp.path().join("c")),
        "--json",
    ]);
    let text = stdout(&out);
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l}: {e}")))
        .collect();
    assert_eq!(lines.len(), 2, "{text}");
    for (raw, line) in text.lines().zip(&lines) {
        // The exact field order of the contract.
        let at = |k: &str| raw.find(&format!("\"{k}\":")).unwrap_or(usize::MAX);
        let order = ["epoch", "images", "decoded", "seconds", "images_per_sec"].map(at);
        assert!(order.windows(2).all(|w| w[0] < w[1]), "field order: {raw}");
        assert_eq!(line.as_object().unwrap().len(), 5, "{raw}");
    }
    for (epoch, line) in lines.iter().enumerate() {
        assert_eq!(line["epoch"], epoch as u64);
        assert_eq!(line["images"], 24);
    }
    assert_eq!(
        lines[0]["decoded"], 24,
        "the first epoch decodes everything"
    );
    assert_eq!(lines[1]["decoded"], 0, "the second epoch reads the cache");

    // The same training images listed in a CSV (paths relative to it): the same count.
    let mut csv = String::from("path,label\n");
    for class in std::fs::read_dir(data.join("train")).unwrap() {
        let class = class.unwrap().path();
        for f in std::fs::read_dir(&class).unwrap() {
            let f = f.unwrap().path();
            let rel = f.strip_prefix(&data).unwrap();
            let label = class.file_name().unwrap().to_str().unwrap();
            csv += &format!("{},{label}\n", rel.display());
        }
    }
    std::fs::write(data.join("train.csv"), csv).unwrap();
    let out = birdtrain(&[
        "bench",
        "pipeline",
        "--data",
        s(&data.join("train.csv")),
        "--epochs",
        "1",
        "--image-size",
        "16",
        "--cache-dir",
        s(&tmp.path().join("c")),
        "--json",
    ]);
    let line: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    assert_eq!(line["images"], 24, "{line}");

    // With the training's random resized crop: every image, from the warm cache.
    let out = birdtrain(&[
        "bench",
        "pipeline",
        "--data",
        s(&data),
        "--epochs",
        "1",
        "--image-size",
        "16",
        "--cache-dir",
        s(&tmp.path().join("c")),
        "--augment",
        "resized-crop",
        "--crop-scale",
        "0.25",
        "--json",
    ]);
    let line: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    assert_eq!(
        (&line["images"], &line["decoded"]),
        (&24.into(), &0.into()),
        "{line}"
    );
    // From a larger store: its own cache, filled by this epoch.
    let out = birdtrain(&[
        "bench",
        "pipeline",
        "--data",
        s(&data),
        "--epochs",
        "2",
        "--image-size",
        "16",
        "--store-size",
        "24",
        "--cache-dir",
        s(&tmp.path().join("c")),
        "--augment",
        "resized-crop",
        "--json",
    ]);
    let lines: Vec<serde_json::Value> = stdout(&out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let decoded: Vec<_> = lines.iter().map(|l| l["decoded"].clone()).collect();
    assert_eq!(decoded, [24, 0], "{lines:?}");
}

#[test]
fn eval_and_predict_use_the_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d");
    let run = tmp.path().join("run");
    let cache = tmp.path().join("c");
    synth(&data, "3", "8", "24x24");
    birdtrain(&[
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
        "--batch-size",
        "6",
        "--replicas",
        "2",
        "--sync-bn",
        "--out",
        s(&run),
        "--cache-dir",
        s(&cache),
        "--quiet",
    ]);

    let out = birdtrain(&[
        "eval",
        "--checkpoint",
        s(&run),
        "--data",
        s(&data),
        "--split",
        "test",
        "--cache-dir",
        s(&cache),
    ]);
    let text = stdout(&out);
    assert!(text.contains("resnet8 on test: 9 images"), "{text}");
    for needle in ["loss", "top-1", "top-5", "class", "accuracy"] {
        assert!(text.contains(needle), "`{needle}` missing:\n{text}");
    }
    // One table row per class, each with its 3 test images.
    let rows: Vec<&str> = text.lines().filter(|l| l.starts_with("class_")).collect();
    assert_eq!(rows.len(), 3, "{text}");
    assert!(
        rows.iter()
            .all(|r| r.split_whitespace().nth(1) == Some("3")),
        "{text}"
    );

    let class0 = data.join("test").join(first_entry(&data.join("test")));
    let image = class0.join(first_entry(&class0));
    let out = birdtrain(&[
        "predict",
        "--checkpoint",
        s(&run),
        "--top-k",
        "2",
        s(&image),
        s(&image),
    ]);
    let text = stdout(&out);
    let probs: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with("  "))
        .map(|l| l.split_whitespace().next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(probs.len(), 4, "two images × top-2:\n{text}");
    assert!(probs.iter().all(|p| (0.0..=1.0).contains(p)), "{text}");
    assert!(probs[0] >= probs[1], "most likely first:\n{text}");
    assert_eq!(
        probs[0..2],
        probs[2..4],
        "the same image twice, the same answer"
    );
}

fn first_entry(dir: &Path) -> String {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names.remove(0)
}

#[test]
fn demo_synthesises_and_trains() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("demo-data");
    let run = tmp.path().join("demo-run");
    let out = birdtrain(&[
        "demo",
        "--data-dir",
        s(&data),
        "--out",
        s(&run),
        "--epochs",
        "1",
        "--gpus",
        "0",
        "--quiet",
    ]);
    let text = stdout(&out);
    assert!(text.contains("valid accuracy"), "{text}");
    assert!(data.join("train").join("class_00").is_dir());
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 2, "{metrics}");
}

#[cfg(unix)]
#[test]
fn ctrl_c_finishes_the_step_saves_and_exits_130() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d");
    let run = tmp.path().join("run");
    let cache = tmp.path().join("c");
    synth(&data, "3", "40", "16x16");
    let mut child = Command::new(env!("CARGO_BIN_EXE_birdtrain"))
        .args([
            "--data",
            s(&data),
            "--gpus",
            "0",
            "--model",
            "resnet8",
            "--image-size",
            "16",
            "--epochs",
            "1000",
            "--batch-size",
            "4",
            "--out",
            s(&run),
            "--cache-dir",
            s(&cache),
            "--quiet",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for the first epoch's checkpoint, so the run is well under way.
    let deadline = Instant::now() + Duration::from_secs(120);
    while !run.join("checkpoint.json").exists() {
        assert!(Instant::now() < deadline, "no checkpoint after 120 s");
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        std::thread::sleep(Duration::from_millis(50));
    }
    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(130),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("checkpoint.json")).unwrap())
            .unwrap();
    assert!(meta["step"].as_u64().unwrap() >= 30, "{meta}");
    assert!(meta["epoch"].as_u64().unwrap() < 1000);
    // No temporary file is left in the run folder.
    for entry in std::fs::read_dir(&run).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        assert!(!name.contains(".tmp"), "left behind: {name}");
    }
    // The saved run resumes (one more epoch than it had).
    let done = meta["epoch"].as_u64().unwrap();
    let target = (done + 1).to_string();
    birdtrain(&[
        "--data",
        s(&data),
        "--gpus",
        "0",
        "--resume",
        s(&run),
        "--epochs",
        &target,
        "--cache-dir",
        s(&cache),
        "--quiet",
    ]);
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("checkpoint.json")).unwrap())
            .unwrap();
    assert_eq!(meta["epoch"].as_u64().unwrap(), done + 1);
}

/// `birdtrain … | head`: a reader that goes away is no crash. Commands whose output is their
/// result stop quietly (exit 0, nothing on stderr); training goes on to the end, its run
/// folder complete.
#[test]
fn a_closed_stdout_stops_output_commands_quietly_and_training_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d");
    synth(&data, "2", "8", "16x16");
    for args in [
        vec!["bench", "step", "--plan", "--model", "resnet50"],
        vec!["env"],
        vec![
            "synth",
            "--out",
            s(&tmp.path().join("d2")),
            "--classes",
            "2",
            "--train-per-class",
            "2",
            "--valid-per-class",
            "1",
            "--size",
            "16x16",
        ],
    ] {
        let out = birdtrain_closed_stdout(&args);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            !String::from_utf8_lossy(&out.stderr).contains("error"),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let run = tmp.path().join("run");
    let out = birdtrain_closed_stdout(&[
        "--data",
        s(&data),
        "--gpus",
        "0",
        "--model",
        "resnet8",
        "--image-size",
        "16",
        "--epochs",
        "2",
        "--batch-size",
        "4",
        "--out",
        s(&run),
        "--cache-dir",
        s(&tmp.path().join("c")),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 4, "{metrics}");
    assert!(run.join("report.png").is_file());
}
