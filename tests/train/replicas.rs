//! Data parallelism on the CPU: R replicas × batch B give the same update as one replica on
//! R·B (frozen batch norm: otherwise BN statistics are per replica, as in PyTorch DDP, unless
//! `--sync-bn`, tested in `src/train/multirank_tests.rs`), and all replicas hold identical
//! weights after every step.

use std::path::Path;
use std::sync::atomic::AtomicBool;

use birdtrain::model::Arch;
use birdtrain::train::{self, load_checkpoint_for_inference, TrainConfig};
use pipeline::synth::{write_dataset, ImageFormatKind, SynthConfig};

fn config(data: &Path, cache: &Path, out: &Path, replicas: usize, batch: usize) -> TrainConfig {
    let mut cfg = TrainConfig::new(data);
    cfg.arch = Arch::ResNet8;
    cfg.image_size = 16;
    cfg.epochs = 1;
    cfg.batch_size = batch;
    cfg.replicas = replicas;
    cfg.cache_dir = Some(cache.to_path_buf());
    cfg.out = out.to_path_buf();
    cfg.freeze_bn = true;
    cfg.seed = 3;
    cfg.lr = 1.6;
    cfg.warmup_epochs = 0;
    cfg.progress = false;
    cfg.verbose = false;
    cfg
}

#[test]
fn replicas_times_batch_equals_one_big_batch_and_replicas_agree() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d");
    write_dataset(&SynthConfig {
        out: data.clone(),
        classes: 4,
        train_per_class: 10,
        valid_per_class: 2,
        test_per_class: 0,
        width: 16,
        height: 16,
        format: ImageFormatKind::Png,
        seed: 9,
    })
    .unwrap();
    let cache = tmp.path().join("cache");
    let one = config(&data, &cache, &tmp.path().join("one"), 1, 12);
    let three = config(&data, &cache, &tmp.path().join("three"), 3, 4);
    let a = train::train(&one, &AtomicBool::new(false)).unwrap();
    let b = train::train(&three, &AtomicBool::new(false)).unwrap();
    assert_eq!(a.global_step, b.global_step, "same number of global steps");

    // Every replica ends with the same weights (checksums of their parameters).
    assert_eq!(b.replica_checksums.len(), 3);
    assert!(
        b.replica_checksums.windows(2).all(|w| w[0] == w[1]),
        "replicas disagree: {:x?}",
        b.replica_checksums
    );

    let wa = load_checkpoint_for_inference(&one.out, 4)
        .unwrap()
        .net
        .params_f32()
        .unwrap();
    let wb = load_checkpoint_for_inference(&three.out, 4)
        .unwrap()
        .net
        .params_f32()
        .unwrap();
    assert_ne!(wa, ModelInit::weights(&data), "training changed nothing");
    let max_diff = wa
        .iter()
        .zip(&wb)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(max_diff < 1e-4, "3×4 and 1×12 differ by {max_diff}");
}

/// The initial weights, to prove the runs moved away from them.
struct ModelInit;

impl ModelInit {
    fn weights(_data: &Path) -> Vec<f32> {
        let graph = birdtrain::model::Graph::new(Arch::ResNet8, 4);
        birdtrain::model::ModelState::init(&graph, 3).flat_params()
    }
}
