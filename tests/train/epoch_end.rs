//! The end of an epoch with several ranks: rank 0's writing (metrics, `best/`, the checkpoint,
//! the report) may take longer than `--collective-timeout` without aborting the run (the
//! other ranks wait for it under `--epoch-end-timeout`), and a rank 0 that fails there
//! still releases the others at once. The slow disk is the fault hook's delay; every test
//! drives the real binary (CPU ranks, resnet8 on 16-pixel images).

use crate::cli_support;

use std::path::Path;
use std::time::{Duration, Instant};

use birdtrain::train::fault::FAULT_ENV;
use cli_support::small_run::{dataset, ok, run_with, text, train_args};
use cli_support::{assert_no_panic, s};

/// Two CPU ranks with a 2-second collective timeout.
fn two_ranks(data: &Path, cache: &Path, out: &Path, epochs: u32) -> Vec<String> {
    let mut args = train_args(data, cache, out, epochs);
    args.extend(
        ["--replicas", "2", "--collective-timeout", "2"]
            .iter()
            .map(|a| a.to_string()),
    );
    args
}

#[test]
fn rank_0_writing_longer_than_the_collective_timeout_does_not_abort_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 6);
    let cache = tmp.path().join("cache");
    let run = tmp.path().join("run");
    // The first epoch's checkpoint (and the first best/) waits 3 s at its commit point, as on
    // a slow disk: the other rank is waiting for rank 0 meanwhile.
    for fault in ["checkpoint:sidecar@1:delay=3", "best:model@1:delay=3"] {
        let _ = std::fs::remove_dir_all(&run);
        let started = Instant::now();
        let out = run_with(&two_ranks(&data, &cache, &run, 2), &[(FAULT_ENV, fault)]);
        assert_no_panic(&[fault], &out);
        ok(out);
        assert!(
            started.elapsed() >= Duration::from_secs(3),
            "{fault}: the delay was not applied"
        );
        let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
        assert_eq!(metrics.lines().count(), 4, "{fault}: {metrics}");
    }
}

#[test]
fn rank_0_failing_while_it_writes_releases_the_other_rank_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 6);
    let cache = tmp.path().join("cache");
    let run = tmp.path().join("run");
    let mut args = two_ranks(&data, &cache, &run, 2);
    // Were the failure found by a timeout, this one would hold the run for 10 minutes.
    args.extend(["--epoch-end-timeout", "600"].iter().map(|a| a.to_string()));
    let started = Instant::now();
    let out = run_with(&args, &[(FAULT_ENV, "checkpoint:sidecar@1:enospc")]);
    assert_no_panic(&[s(&run)], &out);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        started.elapsed() < Duration::from_secs(120),
        "took {:?}",
        started.elapsed()
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{}", text(&out));
    assert!(
        errors[0].contains("No space left on device") || errors[0].contains("full"),
        "the cause, not the abort it caused: {}",
        errors[0]
    );
}
