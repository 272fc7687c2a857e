//! Gradient accumulation (`--grad-accum-steps K`, CPU ranks): K micro-batches of B per rank
//! train to the weights of one batch of K·B (frozen batch norm, so batch statistics do not
//! depend on the micro-batch), on one and on two replicas, also through a partial last step;
//! a stop wished during a cycle checkpoints after it and resumes bit-exact; with live batch
//! norm, micro-batches train as replicas of the same size (each normalised alone), not as one
//! batch; the banner and the checkpoint show the global batch; K = 0 is refused, and a GPU
//! launch counts K in its global batch (tests/gpu/train_gpu_accum.rs runs it on a GPU).

use std::path::Path;
use std::sync::atomic::AtomicBool;

use birdtrain::model::Arch;
use birdtrain::train::{self, load_checkpoint_for_inference, DeviceChoice, TrainConfig};
use pipeline::synth::{write_dataset, ImageFormatKind, SynthConfig};

use crate::cli_support::small_run::{dataset, run_with, text, train_args};
use crate::cli_support::{assert_one_line_error, birdtrain_output};

/// The largest difference allowed between accumulated and whole-batch weights after three
/// SGD steps (lr 1.6, momentum, weight decay): the micro-batches' weighted means summed in
/// another order than one batch's mean differ by f32 roundings, measured at 1.2e-7 (one
/// replica and two), so the bound leaves two orders of magnitude for other thread
/// counts; each micro-batch's mean taken whole (no weighting) moves them by 1.5.
const BOUND: f32 = 1e-5;

/// 5 classes × 17 = 85 training images: with a global batch of 32, steps of 32, 32 and a
/// partial 21, which one replica takes as micro-batches of 8, 8 and 5, and two replicas as
/// 11 (8 + 3) and 10 (8 + 2): unequal shares, each accumulated.
fn data(root: &Path) -> std::path::PathBuf {
    write_dataset(&SynthConfig {
        out: root.to_path_buf(),
        classes: 5,
        train_per_class: 17,
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

fn config(data: &Path, out: &Path, replicas: usize, batch: usize, accum: u32) -> TrainConfig {
    let mut cfg = TrainConfig::new(data);
    cfg.arch = Arch::ResNet8;
    cfg.image_size = 16;
    cfg.epochs = 1;
    cfg.batch_size = batch;
    cfg.grad_accum_steps = accum;
    cfg.replicas = replicas;
    cfg.cache_dir = Some(data.with_file_name("cache"));
    cfg.out = out.to_path_buf();
    cfg.freeze_bn = true;
    cfg.seed = 3;
    cfg.lr = 1.6;
    cfg.warmup_epochs = 0;
    cfg.progress = false;
    cfg.verbose = false;
    cfg
}

fn weights(run: &Path) -> Vec<f32> {
    load_checkpoint_for_inference(run, 4)
        .unwrap()
        .net
        .params_f32()
        .unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn accumulated_equals_whole(replicas: usize, batch: usize, accum: u32) {
    let tmp = tempfile::tempdir().unwrap();
    let data = data(&tmp.path().join("d"));
    let whole = config(
        &data,
        &tmp.path().join("whole"),
        replicas,
        batch * accum as usize,
        1,
    );
    let micro = config(&data, &tmp.path().join("micro"), replicas, batch, accum);
    assert_eq!(whole.global_batch(), micro.global_batch());
    let a = train::train(&whole, &AtomicBool::new(false)).unwrap();
    let b = train::train(&micro, &AtomicBool::new(false)).unwrap();
    assert_eq!(a.global_step, 3, "85 images in global batches of 32");
    assert_eq!(a.global_step, b.global_step, "the same optimizer steps");
    assert!(
        b.replica_checksums.windows(2).all(|w| w[0] == w[1]),
        "replicas disagree: {:x?}",
        b.replica_checksums
    );
    let (wa, wb) = (weights(&whole.out), weights(&micro.out));
    let start =
        birdtrain::model::ModelState::init(&birdtrain::model::Graph::new(Arch::ResNet8, 5), 3)
            .flat_params();
    assert!(max_diff(&wa, &start) > 1e-3, "training changed nothing");
    let d = max_diff(&wa, &wb);
    assert!(
        d < BOUND,
        "{replicas} × {batch} × {accum} and {replicas} × {} differ by {d}",
        batch * accum as usize
    );
}

#[test]
fn four_micro_batches_of_8_train_as_one_batch_of_32() {
    accumulated_equals_whole(1, 8, 4);
}

#[test]
fn two_replicas_of_two_micro_batches_train_as_two_batches_of_16() {
    accumulated_equals_whole(2, 8, 2);
}

#[test]
fn a_stop_during_a_cycle_checkpoints_after_it_and_resumes_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let data = data(&tmp.path().join("d"));
    let full = config(&data, &tmp.path().join("full"), 2, 8, 2);
    let done = train::train(&full, &AtomicBool::new(false)).unwrap();
    assert!(!done.interrupted);

    // A stop wished from the start arrives during the first cycle: no rank stops inside a
    // cycle; two ranks agree on it through the first step's totals, read during the second,
    // so the run ends after the second optimizer step, its 64 images counted.
    let stopped_dir = tmp.path().join("stopped");
    let first = config(&data, &stopped_dir, 2, 8, 2);
    let stopped = train::train(&first, &AtomicBool::new(true)).unwrap();
    assert!(stopped.interrupted);
    assert_eq!(stopped.global_step, 2);
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(stopped_dir.join("checkpoint.json")).unwrap())
            .unwrap();
    assert_eq!(meta["data_position"]["samples_in_epoch"], 64, "{meta}");
    assert_eq!(meta["data_position"]["step_in_epoch"], 2, "{meta}");

    let mut second = config(&data, &stopped_dir, 2, 8, 2);
    second.resume = Some(stopped_dir.clone());
    let resumed = train::train(&second, &AtomicBool::new(false)).unwrap();
    assert!(!resumed.interrupted);
    assert_eq!(resumed.global_step, done.global_step);
    assert!(
        std::fs::read(full.out.join("model.safetensors")).unwrap()
            == std::fs::read(stopped_dir.join("model.safetensors")).unwrap(),
        "the resumed run's weights differ from the uninterrupted run's"
    );
}

#[test]
fn the_banner_and_the_checkpoint_show_the_global_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 8);
    let out = tmp.path().join("run");
    let mut args = train_args(&data, &tmp.path().join("cache"), &out, 1);
    args.extend(["--grad-accum-steps".into(), "2".into()]);
    let run = run_with(&args, &[]);
    assert!(run.status.success(), "{}", text(&run));
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        stdout.contains("global batch 8 (4 per rank × 2 accumulated)"),
        "{}",
        text(&run)
    );
    assert!(stdout.contains("2 steps per epoch"), "{}", text(&run));
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("checkpoint.json")).unwrap()).unwrap();
    assert_eq!(meta["global_batch"], 8, "{meta}");
    assert_eq!(meta["settings"]["grad_accum_steps"], 2, "{meta}");
}

#[test]
fn zero_accumulation_steps_are_refused_naming_the_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 4);
    let out = tmp.path().join("run");
    let mut args: Vec<String> = train_args(&data, &tmp.path().join("cache"), &out, 1);
    args.extend(["--grad-accum-steps".into(), "0".into()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let run = birdtrain_output(&args);
    assert_eq!(run.status.code(), Some(2));
    assert_one_line_error(&run, &["--grad-accum-steps"]);
}

#[test]
fn accumulation_on_gpus_counts_every_gpu_and_micro_batch_in_the_global_batch() {
    // GPU ranks accumulate too (tests/gpu/train_gpu_accum.rs runs them): the launch a user
    // checks before queueing it holds 2 GPUs × 8 × 4 = 64 images a step.
    let mut cfg = TrainConfig::new("d");
    cfg.grad_accum_steps = 4;
    cfg.device = DeviceChoice::Cuda(2);
    cfg.validate().unwrap();
    let run = birdtrain_output(&[
        "--data",
        "absent",
        "--gpus",
        "2",
        "--batch-size",
        "8",
        "--grad-accum-steps",
        "4",
        "--dry-run",
        "--json",
    ]);
    assert!(run.status.success(), "{}", text(&run));
    let plan: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&run.stdout).trim()).unwrap();
    assert_eq!(plan["global_batch"], 64, "{plan}");
}

#[test]
fn with_live_batch_norm_micro_batches_differ_only_by_their_own_statistics() {
    // Live batch norm normalises each micro-batch of 8 with its own statistics: 4 micro-batches
    // on one replica must train as 4 replicas of 8 (per-replica batch norm, the same groups of
    // 8 images), not as one batch of 32, whose statistics span all 32. The two full steps
    // only: the partial third splits its 21 images 8 + 8 + 5 on one replica, 6 + 5 + 5 + 5
    // on four, other groups.
    let tmp = tempfile::tempdir().unwrap();
    let data = data(&tmp.path().join("d"));
    let live = |out: &str, replicas: usize, batch: usize, accum: u32| {
        let mut cfg = config(&data, &tmp.path().join(out), replicas, batch, accum);
        cfg.freeze_bn = false;
        cfg.stop_after_steps = Some(2);
        cfg
    };
    let micro = live("micro", 1, 8, 4);
    let replicas = live("replicas", 4, 8, 1);
    let whole = live("whole", 1, 32, 1);
    for cfg in [&micro, &replicas, &whole] {
        train::train(cfg, &AtomicBool::new(false)).unwrap();
    }
    let (wm, wr, ww) = (
        weights(&micro.out),
        weights(&replicas.out),
        weights(&whole.out),
    );
    let (same_groups, one_batch) = (max_diff(&wm, &wr), max_diff(&wm, &ww));
    println!(
        "live batch norm: 1 × 8 × 4 against 4 replicas × 8: {same_groups:.3e}; against 1 × 32: {one_batch:.3e}"
    );
    assert!(same_groups < BOUND, "{same_groups}");
    assert!(
        one_batch > 100.0 * BOUND,
        "one batch of 32 should differ by its statistics: {one_batch}"
    );
}
