//! `--price-per-hour` and `birdtrain compare`: small CPU runs (one and two replicas, two
//! batch sizes, the same data) whose `compare --json` figures are those of their own
//! summaries and records; the cost is hours × price × devices, summed over the segments of a
//! resumed run; bad prices and folders that hold no run are refused in one line.

use std::path::Path;

use birdtrain::train::CheckpointMeta;
use serde_json::Value;

use crate::cli_support::small_run::{dataset, ok, resume_args, run_with, text, train_args};
use crate::cli_support::{assert_one_line_error, birdtrain_output, s};

const PRICE_ENV: &str = "BIRDTRAIN_PRICE_PER_HOUR";

/// The training flags with `replicas` replicas of batch `batch`.
fn args(data: &Path, cache: &Path, out: &Path, replicas: usize, batch: usize) -> Vec<String> {
    let mut a = train_args(data, cache, out, 1);
    let at = a.iter().position(|x| x == "--batch-size").unwrap();
    a[at + 1] = batch.to_string();
    a.extend(["--replicas".to_string(), replicas.to_string()]);
    a
}

/// The number after `before` on the summary line holding it.
fn figure(stdout: &str, before: &str) -> f64 {
    let at = stdout
        .rfind(before)
        .unwrap_or_else(|| panic!("no `{before}` in:\n{stdout}"));
    let rest = &stdout[at + before.len()..];
    let end = rest
        .find(|c: char| c != '.' && !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end]
        .parse()
        .unwrap_or_else(|e| panic!("`{before}`{rest}: {e}"))
}

/// `compare --json` of `runs`, one object per run.
fn compare(runs: &[&Path]) -> Vec<Value> {
    let mut a = vec!["compare"];
    a.extend(runs.iter().map(|r| s(r)));
    a.push("--json");
    let out = birdtrain_output(&a);
    assert!(out.status.success(), "{}", text(&out));
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Σ seconds / 3600 × price × devices of the run's recorded segments.
fn recorded_cost(run: &Path) -> f64 {
    let meta = CheckpointMeta::load(run).unwrap();
    meta.machine_time
        .iter()
        .map(|s| s.seconds / 3600.0 * s.price_per_hour.unwrap() * s.devices as f64)
        .sum()
}

#[test]
fn compare_reproduces_each_runs_summary_and_the_cost_is_hours_times_price_times_devices() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("data"), 3, 8);
    let cache = tmp.path().join("cache");
    let one = tmp.path().join("one");
    let two = tmp.path().join("two");
    let wide = tmp.path().join("wide");
    // The flag; the variable; the flag winning over the variable; no price at all.
    let summaries = [
        ok(run_with(
            &[
                args(&data, &cache, &one, 1, 4),
                vec!["--price-per-hour".into(), "0.5".into()],
            ]
            .concat(),
            &[],
        )),
        ok(run_with(
            &args(&data, &cache, &two, 2, 4),
            &[(PRICE_ENV, "2")],
        )),
        ok(run_with(&args(&data, &cache, &wide, 2, 8), &[])),
    ]
    .map(|out| String::from_utf8(out.stdout).unwrap());
    let rows = compare(&[&one, &two, &wide]);
    assert_eq!(rows.len(), 3);
    let fields = [
        "run",
        "model",
        "devices",
        "ranks",
        "global_batch",
        "best_accuracy",
        "final_accuracy",
        "seconds",
        "images_per_sec",
        "speedup",
        "efficiency",
        "cost",
    ];
    for (i, (row, summary)) in rows.iter().zip(&summaries).enumerate() {
        let keys: Vec<&str> = row
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        let mut want = fields.to_vec();
        want.sort_unstable();
        let mut got = keys.clone();
        got.sort_unstable();
        assert_eq!(got, want, "{row}");
        assert_eq!(row["model"], "resnet8");
        // CPU runs pay for one machine, whatever their replicas.
        assert_eq!(row["devices"], 1, "{row}");
        // The summary's figures, as it rounded them.
        let close = |field: &str, printed: f64, places: i32| {
            let x = row[field]
                .as_f64()
                .unwrap_or_else(|| panic!("{field}: {row}"));
            assert!(
                (x - printed).abs() <= 0.5 * 10f64.powi(-places) + 1e-12,
                "run {i} {field}: {x} against the summary's {printed}\n{summary}"
            );
        };
        close("images_per_sec", figure(summary, "training "), 1);
        close("seconds", figure(summary, "machine time "), 1);
        close("final_accuracy", figure(summary, "valid accuracy "), 4);
        let best = row["best_accuracy"].as_f64().unwrap();
        assert!(best >= row["final_accuracy"].as_f64().unwrap(), "{row}");
        if i < 2 {
            close("cost", figure(summary, "cost "), 4);
            let cost = row["cost"].as_f64().unwrap();
            let run = [&one, &two][i];
            assert!((cost - recorded_cost(run)).abs() < 1e-12, "{row}");
        } else {
            assert!(row["cost"].is_null(), "no price given: {row}");
            assert!(!summary.contains("· cost"), "{summary}");
        }
    }
    let (r0, r1, r2) = (&rows[0], &rows[1], &rows[2]);
    assert_eq!(
        (r0["ranks"].as_u64(), r0["global_batch"].as_u64()),
        (Some(1), Some(4))
    );
    assert_eq!(
        (r1["ranks"].as_u64(), r1["global_batch"].as_u64()),
        (Some(2), Some(8))
    );
    assert_eq!(
        (r2["ranks"].as_u64(), r2["global_batch"].as_u64()),
        (Some(2), Some(16))
    );
    assert_eq!(
        (r0["speedup"].as_f64(), r0["efficiency"].as_f64()),
        (Some(1.0), Some(1.0))
    );
    for r in [r1, r2] {
        let ratio = r["images_per_sec"].as_f64().unwrap() / r0["images_per_sec"].as_f64().unwrap();
        assert!(
            (r["speedup"].as_f64().unwrap() - ratio).abs() < 1e-12,
            "{r}"
        );
        // One machine each: the efficiency is the speed-up.
        assert_eq!(r["efficiency"], r["speedup"], "{r}");
    }
    // The flag wins over the variable.
    let flagged = tmp.path().join("flagged");
    ok(run_with(
        &[
            args(&data, &cache, &flagged, 1, 4),
            vec!["--price-per-hour".into(), "3".into()],
        ]
        .concat(),
        &[(PRICE_ENV, "100")],
    ));
    let meta = CheckpointMeta::load(&flagged).unwrap();
    assert_eq!(meta.machine_time.len(), 1);
    assert_eq!(meta.machine_time[0].price_per_hour, Some(3.0));
    assert_eq!(
        (meta.machine_time[0].devices, meta.machine_time[0].ranks),
        (1, 1)
    );
    // The table prints the same runs.
    let out = birdtrain_output(&["compare", s(&one), s(&two), s(&wide)]);
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success(), "{table}");
    assert!(table.starts_with("run "), "{table}");
    assert_eq!(table.lines().count(), 4, "{table}");
    assert!(table.contains("1 × 2"), "{table}");
}

#[test]
fn a_resumed_run_at_another_price_adds_a_segment_and_the_cost_sums_them() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("data"), 2, 6);
    let cache = tmp.path().join("cache");
    let run = tmp.path().join("run");
    ok(run_with(
        &args(&data, &cache, &run, 1, 4),
        &[(PRICE_ENV, "1.5")],
    ));
    let first = CheckpointMeta::load(&run).unwrap().machine_time;
    assert_eq!(first.len(), 1);
    let resumed = [
        resume_args(&run, &data),
        vec![
            "--epochs".into(),
            "2".into(),
            "--replicas".into(),
            "2".into(),
        ],
        vec!["--price-per-hour".into(), "4".into()],
    ]
    .concat();
    let out = ok(run_with(&resumed, &[]));
    let summary = String::from_utf8(out.stdout).unwrap();
    let segments = CheckpointMeta::load(&run).unwrap().machine_time;
    assert_eq!(segments.len(), 2, "{segments:?}");
    assert_eq!(segments[0], first[0], "the earlier segment stays as it was");
    assert_eq!(segments[1].price_per_hour, Some(4.0));
    assert_eq!((segments[1].devices, segments[1].ranks), (1, 2));
    assert!(summary.contains(" in 2 segments"), "{summary}");
    let want = segments[0].seconds / 3600.0 * 1.5 + segments[1].seconds / 3600.0 * 4.0;
    let row = &compare(&[&run])[0];
    assert!(
        (row["cost"].as_f64().unwrap() - want).abs() < 1e-12,
        "{row}"
    );
    let seconds = segments[0].seconds + segments[1].seconds;
    assert!(
        (row["seconds"].as_f64().unwrap() - seconds).abs() < 1e-9,
        "{row}"
    );
    assert!(
        (figure(&summary, "cost ") - want).abs() <= 0.5e-4,
        "{summary}"
    );
    // A resume without a price: the price to train is unknown.
    let unpriced = [
        resume_args(&run, &data),
        vec!["--epochs".into(), "3".into()],
    ]
    .concat();
    ok(run_with(&unpriced, &[]));
    assert!(compare(&[&run])[0]["cost"].is_null());
}

#[test]
fn a_bad_price_is_refused_naming_the_flag_or_the_variable() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("data"), 2, 2);
    let cache = tmp.path().join("cache");
    let out = tmp.path().join("run");
    for bad in ["-1", "NaN", "inf", "cheap"] {
        let a = [
            args(&data, &cache, &out, 1, 4),
            vec![format!("--price-per-hour={bad}")],
        ]
        .concat();
        let got = run_with(&a, &[]);
        assert_eq!(got.status.code(), Some(2), "{}", text(&got));
        assert_one_line_error(&got, &["--price-per-hour", bad]);
        let got = run_with(&args(&data, &cache, &out, 1, 4), &[(PRICE_ENV, bad)]);
        assert_eq!(got.status.code(), Some(2), "{}", text(&got));
        assert_one_line_error(&got, &[PRICE_ENV, bad]);
        assert!(!out.exists(), "a refused run writes nothing");
    }
}

#[test]
fn compare_refuses_a_folder_that_holds_no_run_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let empty = tmp.path().join("not-a-run");
    std::fs::create_dir(&empty).unwrap();
    let out = birdtrain_output(&["compare", s(&empty), "--json"]);
    assert_eq!(out.status.code(), Some(1));
    assert_one_line_error(&out, &["not-a-run"]);
    assert!(out.stdout.is_empty());
    let missing = tmp.path().join("missing");
    let out = birdtrain_output(&["compare", s(&missing)]);
    assert_one_line_error(&out, &["missing"]);
}

#[test]
fn a_checkpoint_from_before_the_record_reads_with_its_time_and_price_unknown() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("data"), 2, 4);
    let cache = tmp.path().join("cache");
    let run = tmp.path().join("old");
    ok(run_with(
        &args(&data, &cache, &run, 1, 4),
        &[(PRICE_ENV, "1")],
    ));
    let sidecar = run.join("checkpoint.json");
    let mut value: Value =
        serde_json::from_str(&std::fs::read_to_string(&sidecar).unwrap()).unwrap();
    value
        .as_object_mut()
        .unwrap()
        .remove("machine_time")
        .expect("a new run records its machine time");
    std::fs::write(&sidecar, serde_json::to_string_pretty(&value).unwrap()).unwrap();
    let row = &compare(&[&run])[0];
    for unknown in ["devices", "seconds", "cost"] {
        assert!(row[unknown].is_null(), "{unknown}: {row}");
    }
    assert_eq!(
        (row["speedup"].as_f64(), row["efficiency"].as_f64()),
        (Some(1.0), Some(1.0))
    );
    assert!(row["images_per_sec"].as_f64().unwrap() > 0.0, "{row}");
    // Resumed, it records the segments from then on.
    let resumed = [
        resume_args(&run, &data),
        vec!["--epochs".into(), "2".into()],
    ]
    .concat();
    ok(run_with(&resumed, &[(PRICE_ENV, "1")]));
    assert_eq!(CheckpointMeta::load(&run).unwrap().machine_time.len(), 1);
}
