//! `birdtrain lr-find`: the training steps of the run the flags describe with the rate raised
//! geometrically, stopped when the loss diverges, the suggestion printed, the points and the
//! picture written and nothing else (no checkpoint, no metrics); bad values are one line
//! naming the flag. The sweep's rules are unit-tested in `src/train/lr_find.rs`.

use crate::cli_support;
use cli_support::assert_one_line_error;
use cli_support::small_run::{dataset, ok, run_with, text, train_args};

use birdtrain::train::lr_find::{LrPoint, LrTrace};

fn sweep_args(
    data: &std::path::Path,
    cache: &std::path::Path,
    out: &std::path::Path,
    extra: &[&str],
) -> Vec<String> {
    // The training flags of the small runs, minus --epochs (lr-find sets its own).
    let mut args = vec!["lr-find".to_string()];
    let train = train_args(data, cache, out, 1);
    let mut it = train.into_iter();
    while let Some(a) = it.next() {
        if a == "--epochs" {
            it.next();
        } else {
            args.push(a);
        }
    }
    args.extend(extra.iter().map(|a| a.to_string()));
    args
}

#[test]
fn the_sweep_stops_at_divergence_and_suggests_a_rate_from_its_points() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 3, 8);
    let cache = tmp.path().join("c");
    let out = tmp.path().join("sweep");
    let args = sweep_args(
        &data,
        &cache,
        &out,
        &["--start-lr", "1e-3", "--end-lr", "1e6", "--num-steps", "80"],
    );
    let said = text(&ok(run_with(&args, &[])));
    let points: Vec<LrPoint> = std::fs::read_to_string(out.join("lr_find.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        said.contains("stopped: "),
        "a rate of 1e6 did not diverge:\n{said}"
    );
    assert!(
        points.len() < 80 && points.len() > 12,
        "{} points",
        points.len()
    );
    assert!(
        said.contains(&format!("{} of 80 steps recorded", points.len())),
        "{said}"
    );
    // Steps in order from 0, rates rising by the same factor, (1e6 / 1e-3)^(1/79).
    let factor = 1e9f64.powf(1.0 / 79.0);
    for (i, w) in points.windows(2).enumerate() {
        assert_eq!((w[0].step, w[1].step), (i as u64, i as u64 + 1));
        let ratio = f64::from(w[1].lr) / f64::from(w[0].lr);
        assert!((ratio / factor - 1.0).abs() < 1e-4, "{ratio} vs {factor}");
    }
    assert!((points[0].lr - 1e-3).abs() < 1e-9);
    // The printed suggestion is the rule applied to the written points.
    let best = LrTrace::suggestion(&points).expect("enough points for a suggestion");
    assert!(
        said.contains(&format!("suggested --lr {:.3e}", best.lr)),
        "{said}"
    );
    assert!(
        said.contains("lr swept 1e-3 to 1e6 for batch 256"),
        "{said}"
    );
    // The sweep leaves its points and picture, and no run.
    let png = std::fs::read(out.join("lr_find.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    for file in [
        "checkpoint.json",
        "metrics.jsonl",
        "model.safetensors",
        "best",
        // No bad file, so no report (the sweep never reads the valid split at all).
        "bad_files_train.txt",
        "bad_files_valid.txt",
    ] {
        assert!(!out.join(file).exists(), "lr-find wrote {file}");
    }
}

#[test]
fn bad_sweep_values_are_one_line_naming_the_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 4);
    let cache = tmp.path().join("c");
    let out = tmp.path().join("sweep");
    for (extra, flag) in [
        (vec!["--start-lr", "0"], "--start-lr"),
        (vec!["--start-lr", "1", "--end-lr", "0.5"], "--end-lr"),
        (vec!["--num-steps", "1"], "--num-steps"),
        (vec!["--num-steps", "0"], "invalid value 0 for --num-steps"),
        (vec!["--end-lr", "NaN"], "--end-lr"),
        (vec!["--resume", "somewhere"], "--resume"),
    ] {
        let out_err = run_with(&sweep_args(&data, &cache, &out, &extra), &[]);
        assert_one_line_error(&out_err, &[flag]);
        // Every value is checked before the banner.
        assert!(
            out_err.stdout.is_empty(),
            "{extra:?} printed before failing: {}",
            String::from_utf8_lossy(&out_err.stdout)
        );
        assert!(!out.exists(), "{extra:?} left {}", out.display());
    }
    // Flags about validation and checkpoints have nothing to act on, and are no error.
    let extra = [
        "--num-steps",
        "4",
        "--model-ema",
        "--monitor",
        "val_ema_loss",
        "--early-stop",
        "1",
        "--save-every",
        "1",
    ];
    let said = text(&ok(run_with(&sweep_args(&data, &cache, &out, &extra), &[])));
    assert!(said.contains("4 of 4 steps recorded"), "{said}");
    assert!(!out.join("checkpoint.json").exists());
}

#[test]
fn a_sweep_keeps_off_folders_that_hold_a_run_or_a_sweep() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 4);
    let cache = tmp.path().join("c");
    let sweep = tmp.path().join("sweep");
    let steps = ["--num-steps", "13"];
    ok(run_with(&sweep_args(&data, &cache, &sweep, &steps), &[]));
    // A second sweep into it is refused (nothing to resume: no --resume in the hint) …
    let again = run_with(&sweep_args(&data, &cache, &sweep, &steps), &[]);
    let line = assert_one_line_error(&again, &["holds a run already", "--overwrite"]);
    assert!(!line.contains("--resume"), "{line}");
    // … unless --overwrite says so.
    let mut args = sweep_args(&data, &cache, &sweep, &steps);
    args.push("--overwrite".into());
    ok(run_with(&args, &[]));
    // A training run's folder: refused, --overwrite or not, and a sweep cannot continue it
    // either.
    let run = tmp.path().join("run");
    ok(run_with(&train_args(&data, &cache, &run, 1), &[]));
    let into_run = run_with(&sweep_args(&data, &cache, &run, &steps), &[]);
    let line = assert_one_line_error(&into_run, &["holds a training run", "--out"]);
    assert!(!line.contains("--resume"), "{line}");
}

#[test]
fn an_interrupted_sweep_says_its_suggestion_covers_only_the_rates_swept() {
    let range = birdtrain::train::lr_find::LrRange {
        start: 1e-6,
        end: 10.0,
        steps: 100,
    };
    let mut trace = LrTrace::default();
    for step in 0..30 {
        trace.add(step, range.lr_at(step), 2.0 - step as f64 * 0.01);
    }
    let suggestion = LrTrace::suggestion(&trace.points);
    let out = std::path::Path::new("runs/sweep");
    let cut = birdtrain::cli::lr_find::report(&trace, suggestion, range, out, true);
    assert!(
        cut.contains("interrupted at lr") && cut.contains("only the rates swept so far"),
        "{cut}"
    );
    let whole = birdtrain::cli::lr_find::report(&trace, suggestion, range, out, false);
    assert!(!whole.contains("interrupted"), "{whole}");
}
