//! Data parallelism on the CPU: R replicas × batch B give the same update as one replica on
//! R·B (with frozen batch norm, or with live batch norm under `--sync-bn`; otherwise BN
//! statistics are per replica, as in PyTorch DDP), and all replicas hold identical weights
//! after every step.

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

fn dataset(data: &Path) {
    write_dataset(&SynthConfig {
        out: data.to_path_buf(),
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
}

/// The trained weights of the run in `out`.
fn weights(out: &Path) -> Vec<f32> {
    load_checkpoint_for_inference(out, 4)
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
        .fold(0.0f32, f32::max)
}

#[test]
fn replicas_times_batch_equals_one_big_batch_and_replicas_agree() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d");
    dataset(&data);
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

    let (wa, wb) = (weights(&one.out), weights(&three.out));
    assert_ne!(wa, ModelInit::weights(&data), "training changed nothing");
    let diff = max_diff(&wa, &wb);
    assert!(diff < 1e-4, "3×4 and 1×12 differ by {diff}");
}

/// `--sync-bn` on CPU replicas: with live batch norm, each replica normalises with the
/// statistics of the global batch, so 3 replicas × 4 images train like 1 × 12; without it,
/// they normalise per replica and train differently (the comparison can fail).
#[test]
fn sync_bn_replicas_train_like_one_big_batch_with_live_batch_norm() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d");
    dataset(&data);
    let cache = tmp.path().join("cache");
    let live = |name: &str, replicas: usize, batch: usize, sync_bn: bool| {
        let mut cfg = config(&data, &cache, &tmp.path().join(name), replicas, batch);
        cfg.freeze_bn = false;
        cfg.lr = 0.4;
        cfg.dist.sync_bn = sync_bn;
        cfg
    };
    let one = live("one", 1, 12, false);
    let synced = live("synced", 3, 4, true);
    let per_replica = live("per-replica", 3, 4, false);
    let a = train::train(&one, &AtomicBool::new(false)).unwrap();
    let b = train::train(&synced, &AtomicBool::new(false)).unwrap();
    train::train(&per_replica, &AtomicBool::new(false)).unwrap();
    assert_eq!(a.global_step, b.global_step, "same number of global steps");
    assert!(
        b.replica_checksums.windows(2).all(|w| w[0] == w[1]),
        "synced replicas disagree: {:x?}",
        b.replica_checksums
    );

    let want = weights(&one.out);
    let synced_diff = max_diff(&want, &weights(&synced.out));
    let per_replica_diff = max_diff(&want, &weights(&per_replica.out));
    // f32 sums in another order (per replica, then across replicas in f64): a few ulps per
    // step, amplified by the steps of an epoch.
    assert!(
        synced_diff < 1e-4,
        "3×4 with --sync-bn and 1×12 differ by {synced_diff}"
    );
    assert!(
        per_replica_diff > 100.0 * synced_diff.max(1e-6),
        "without --sync-bn the replicas should train differently: {per_replica_diff} vs {synced_diff}"
    );
}

/// The initial weights, to prove the runs moved away from them.
struct ModelInit;

impl ModelInit {
    fn weights(_data: &Path) -> Vec<f32> {
        let graph = birdtrain::model::Graph::new(Arch::ResNet8, 4);
        birdtrain::model::ModelState::init(&graph, 3).flat_params()
    }
}
