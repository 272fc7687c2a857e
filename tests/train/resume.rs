//! Checkpoint exactness: a run stopped mid-epoch and resumed ends bit-identical to the
//! uninterrupted run (CPU backend); a checkpoint from R replicas resumes on another count
//! and loads on the CPU for inference.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use birdtrain::model::Arch;
use birdtrain::train::{self, load_checkpoint_for_inference, TrainConfig};
use pipeline::synth::{write_dataset, ImageFormatKind, SynthConfig};

fn dataset(root: &Path) -> PathBuf {
    write_dataset(&SynthConfig {
        out: root.to_path_buf(),
        classes: 3,
        train_per_class: 12,
        valid_per_class: 4,
        test_per_class: 0,
        width: 20,
        height: 20,
        format: ImageFormatKind::Png,
        seed: 5,
    })
    .unwrap();
    root.to_path_buf()
}

fn config(data: &Path, cache: &Path, out: &Path, replicas: usize, batch: usize) -> TrainConfig {
    let mut cfg = TrainConfig::new(data);
    cfg.arch = Arch::ResNet8;
    cfg.image_size = 16;
    cfg.epochs = 2;
    cfg.batch_size = batch;
    cfg.replicas = replicas;
    cfg.workers = 2;
    cfg.cache_dir = Some(cache.to_path_buf());
    cfg.out = out.to_path_buf();
    cfg.seed = 11;
    cfg.lr = 1.6;
    cfg.progress = false;
    cfg.verbose = false;
    cfg
}

fn run(cfg: &TrainConfig) -> train::TrainOutcome {
    train::train(cfg, &AtomicBool::new(false)).expect("training runs")
}

fn read(p: PathBuf) -> Vec<u8> {
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

type OptimizerState = (
    std::collections::BTreeMap<String, String>,
    std::collections::BTreeMap<String, Vec<u8>>,
);

fn optimizer_state(run: &Path) -> OptimizerState {
    let bytes = read(run.join("optimizer.safetensors"));
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = header
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    let tensors = safetensors::SafeTensors::deserialize(&bytes)
        .unwrap()
        .tensors()
        .into_iter()
        .map(|(name, view)| (name, view.data().to_vec()))
        .collect();
    (meta, tensors)
}

fn weights(run: &Path) -> Vec<f32> {
    let model = load_checkpoint_for_inference(run, 4).unwrap();
    model.net.params_f32().unwrap()
}

#[test]
fn stopped_mid_epoch_and_resumed_is_bit_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"));
    let cache = tmp.path().join("cache");
    // 36 images, global batch 8: 5 steps per epoch (last one partial).
    let full = config(&data, &cache, &tmp.path().join("full"), 1, 8);
    let outcome = run(&full);
    assert!(!outcome.interrupted);
    assert_eq!(outcome.epochs_done, 2);

    let stop_dir = tmp.path().join("stopped");
    let mut first = config(&data, &cache, &stop_dir, 1, 8);
    first.stop_after_steps = Some(7); // epoch 2, step 2 of 5
    let stopped = run(&first);
    assert!(stopped.interrupted);
    assert_eq!(stopped.global_step, 7);
    let mut second = config(&data, &cache, &stop_dir, 1, 8);
    second.resume = Some(stop_dir.clone());
    let resumed = run(&second);
    assert!(!resumed.interrupted);

    assert!(
        read(full.out.join("model.safetensors")) == read(stop_dir.join("model.safetensors")),
        "model.safetensors differs between the uninterrupted and the resumed run"
    );
    // The optimizer file's header holds a metadata map whose key order is not fixed, so its
    // state is compared tensor by tensor, bit for bit, and metadata entry by entry.
    assert_eq!(
        optimizer_state(&full.out),
        optimizer_state(&stop_dir),
        "optimizer state differs between the uninterrupted and the resumed run"
    );
    // Same metrics too: the resumed epoch's train line covers the whole epoch.
    let a = std::fs::read_to_string(full.out.join("metrics.jsonl")).unwrap();
    let b = std::fs::read_to_string(stop_dir.join("metrics.jsonl")).unwrap();
    let strip = |t: &str| -> Vec<(u64, String, f64, f64)> {
        t.lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                (
                    v["epoch"].as_u64().unwrap(),
                    v["split"].as_str().unwrap().to_string(),
                    v["loss"].as_f64().unwrap(),
                    v["accuracy"].as_f64().unwrap(),
                )
            })
            .collect()
    };
    assert_eq!(strip(&a), strip(&b));
}

#[test]
fn checkpoint_from_two_replicas_resumes_on_one_and_loads_for_inference() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"));
    let cache = tmp.path().join("cache");
    // Frozen BN makes 2 × 4 and 1 × 8 the same computation up to float rounding.
    let mut full = config(&data, &cache, &tmp.path().join("full"), 2, 4);
    full.freeze_bn = true;
    run(&full);

    let dir = tmp.path().join("switch");
    let mut first = config(&data, &cache, &dir, 2, 4);
    first.freeze_bn = true;
    first.stop_after_steps = Some(3);
    assert!(run(&first).interrupted);
    let mut second = config(&data, &cache, &dir, 1, 8);
    second.freeze_bn = true;
    second.resume = Some(dir.clone());
    let resumed = run(&second);
    assert_eq!(resumed.epochs_done, 2);

    let (a, b) = (weights(&full.out), weights(&dir));
    let max_diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    let scale = a.iter().map(|x| x.abs()).fold(0.0f32, f32::max);
    assert!(
        max_diff <= 1e-3 * scale.max(1.0),
        "2×4 then 1×8 drifted from 2×4 throughout: max |Δ| {max_diff}"
    );
    // And the checkpoint serves inference on the CPU.
    let model = load_checkpoint_for_inference(&dir, 8).unwrap();
    assert_eq!(model.meta.classes.len(), 3);
    assert_eq!(model.meta.replicas, 1);
}

#[test]
fn a_resume_with_another_global_batch_goes_on_from_the_same_point_of_the_schedule() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"));
    let cache = tmp.path().join("cache");
    let dir = tmp.path().join("run");
    // 36 images: 9 steps per epoch at batch 4, then 3 per epoch at batch 12.
    let mut first = config(&data, &cache, &dir, 1, 4);
    first.stop_after_steps = Some(9);
    let stopped = run(&first);
    assert_eq!((stopped.epochs_done, stopped.global_step), (1, 9));
    let after_one = read(dir.join("model.safetensors"));
    let mut second = config(&data, &cache, &dir, 1, 12);
    second.resume = Some(dir.clone());
    let resumed = run(&second);
    assert_eq!(resumed.epochs_done, 2);
    // Epoch 2 of the cosine schedule at 3 steps per epoch is steps 3..6, not 9..12 (past
    // the schedule's end, where the rate is 0 and epoch 2 would change no weight).
    assert_eq!(resumed.global_step, 6);
    let meta = train::CheckpointMeta::load(&dir).unwrap();
    assert_eq!(meta.data_position.global_step, 6);
    assert!(
        read(dir.join("model.safetensors")) != after_one,
        "epoch 2 after the resume changed no weight"
    );
}

#[test]
fn resume_through_the_cli_keeps_the_runs_settings_without_repeating_flags() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"));
    let cache = tmp.path().join("cache");
    let (full, dir) = (tmp.path().join("full"), tmp.path().join("stopped"));
    let cli = |extra: &[&str]| {
        let mut args = vec![
            "--data",
            data.to_str().unwrap(),
            "--gpus",
            "0",
            "--cache-dir",
            cache.to_str().unwrap(),
            "--quiet",
        ];
        args.extend_from_slice(extra);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_birdtrain"))
            .args(&args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let settings = [
        "--model",
        "resnet8",
        "--image-size",
        "16",
        "--epochs",
        "2",
        "--batch-size",
        "8",
        "--optimizer",
        "adamw",
        "--lr",
        "0.02",
        "--label-smoothing",
        "0.1",
        "--augment",
        "resized-crop",
        "--crop-scale",
        "0.3",
        "--store-size",
        "20",
        "--color-jitter",
        "0.3",
        "--random-erase",
        "0.5",
        "--color-jitter-hue",
        "0.1",
        "--mixup",
        "0.4",
        "--cutmix",
        "1.0",
        "--mixup-prob",
        "0.8",
        "--clip-grad-norm",
        "0.5",
        "--auto-augment",
        "ra",
        "--ra-magnitude",
        "12",
        "--schedule",
        "step",
        "--step-every",
        "1",
        "--step-gamma",
        "0.5",
        "--seed",
        "4",
        "--replicas",
        "2",
        "--sync-bn",
        "--sampler",
        "balanced",
    ];
    let mut a = settings.to_vec();
    a.extend(["--out", full.to_str().unwrap()]);
    cli(&a);
    let mut b = settings.to_vec();
    b.extend(["--out", dir.to_str().unwrap(), "--stop-after-steps", "4"]);
    cli(&b);
    let meta = train::CheckpointMeta::load(&dir).unwrap();
    assert_eq!(meta.settings.sampler, pipeline::Sampling::Balanced);
    assert_eq!(meta.settings.crop_scale, Some([0.3, 1.0]));
    assert_eq!(meta.settings.store_size, Some(20));
    assert_eq!(meta.settings.color_jitter, 0.3);
    assert_eq!(meta.settings.random_erase, 0.5);
    assert_eq!(meta.settings.clip_grad_norm, Some(0.5));
    assert_eq!(
        meta.settings.auto_augment,
        Some(pipeline::AutoAugment::RandAugment { magnitude: 12 })
    );
    assert_eq!(meta.settings.color_jitter_hue, 0.1);
    assert_eq!(
        (
            meta.settings.mixup,
            meta.settings.cutmix,
            meta.settings.mixup_prob
        ),
        (0.4, 1.0, 0.8)
    );
    // Only --resume: every setting comes from the checkpoint (--sync-bn, the balanced draws,
    // the engine's crops and the batches' mixing included).
    cli(&["--resume", dir.to_str().unwrap()]);
    assert!(
        read(full.join("model.safetensors")) == read(dir.join("model.safetensors")),
        "the resumed run did not continue with the run's own settings"
    );
    // Naming the run's own policy on resume keeps its strength (RandAugment's 12, not the
    // default 9).
    let again = tmp.path().join("again");
    let mut c = settings.to_vec();
    c.extend(["--out", again.to_str().unwrap(), "--stop-after-steps", "4"]);
    cli(&c);
    cli(&["--resume", again.to_str().unwrap(), "--auto-augment", "ra"]);
    assert!(
        read(full.join("model.safetensors")) == read(again.join("model.safetensors")),
        "--auto-augment ra on resume changed the run's RandAugment strength"
    );
}
