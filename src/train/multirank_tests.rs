//! The one loop with several CPU ranks on threads (real concurrency: each rank its own thread,
//! the collective's reductions on communication threads): ranks against one rank on the whole
//! batch, uneven last batches, synchronised batch norm, a stop wished by one rank, resume onto
//! another rank count, a rank that stops answering, and bucket averages overlapping backward.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pipeline::synth::{write_dataset, ImageFormatKind, SynthConfig};
use pipeline::LastBatch;

use super::evaluate::load_checkpoint_for_inference;
use super::folder::{CheckpointMeta, RunFolder};
use super::launch::cpu::{run_cpu_ranks, shared_for_cpu};
use super::report::RankReport;
use super::run::train_until;
use super::{TrainConfig, TrainError, TrainOutcome};
use crate::dist::collective::{Collective, CollectiveError};
use crate::dist::local::{HostGrads, LocalCollective, LocalGroup};
use crate::model::Arch;

const CLASSES: usize = 4;

fn dataset(root: &Path, per_class: usize) -> PathBuf {
    let data = root.join("d");
    write_dataset(&SynthConfig {
        out: data.clone(),
        classes: CLASSES,
        train_per_class: per_class,
        valid_per_class: 2,
        test_per_class: 0,
        width: 16,
        height: 16,
        format: ImageFormatKind::Png,
        seed: 9,
    })
    .unwrap();
    data
}

/// resnet8 on 16-pixel images with frozen batch norm (so that the ranks' split of a batch
/// changes nothing but the order of sums).
fn config(data: &Path, root: &Path, name: &str, ranks: usize, batch: usize) -> TrainConfig {
    let mut cfg = TrainConfig::new(data);
    cfg.arch = Arch::ResNet8;
    cfg.image_size = 16;
    cfg.epochs = 1;
    cfg.batch_size = batch;
    cfg.replicas = ranks;
    cfg.threads = 2;
    cfg.workers = 1;
    cfg.cache_dir = Some(root.join("cache"));
    cfg.out = root.join(name);
    cfg.freeze_bn = true;
    cfg.seed = 3;
    cfg.lr = 1.6;
    cfg.warmup_epochs = 0;
    cfg.progress = false;
    cfg.verbose = false;
    cfg
}

fn train(cfg: &TrainConfig) -> TrainOutcome {
    train_until(cfg, &|_, _| false).unwrap()
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
        .fold(0.0f32, f32::max)
}

fn assert_ranks_agree(outcome: &TrainOutcome, ranks: usize) {
    assert_eq!(outcome.replica_checksums.len(), ranks);
    assert!(
        outcome.replica_checksums.windows(2).all(|w| w[0] == w[1]),
        "ranks disagree: {:x?}",
        outcome.replica_checksums
    );
}

#[test]
fn two_three_and_four_ranks_equal_one_rank_on_the_whole_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), 12);
    let one = config(&data, tmp.path(), "one", 1, 12);
    let reference = train(&one);
    let w1 = weights(&one.out);
    for (ranks, batch) in [(2, 6), (3, 4), (4, 3)] {
        let cfg = config(&data, tmp.path(), &format!("r{ranks}"), ranks, batch);
        let outcome = train(&cfg);
        assert_eq!(outcome.global_step, reference.global_step, "{ranks} ranks");
        assert_ranks_agree(&outcome, ranks);
        let d = max_diff(&weights(&cfg.out), &w1);
        assert!(d < 1e-4, "{ranks}×{batch} and 1×12 differ by {d}");
    }
}

/// `--sync-bn`: with live batch norm, each rank normalises with the statistics of the global
/// batch, so 3 ranks × 4 images train like 1 × 12; without it, they normalise per rank and
/// train differently (which shows the comparison can fail).
#[test]
fn sync_bn_ranks_train_like_one_rank_with_live_batch_norm() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), 10);
    let live = |name: &str, ranks: usize, batch: usize, sync_bn: bool| {
        let mut cfg = config(&data, tmp.path(), name, ranks, batch);
        cfg.freeze_bn = false;
        cfg.lr = 0.4;
        cfg.sync_bn = sync_bn;
        cfg
    };
    let one = live("one", 1, 12, false);
    let synced = live("synced", 3, 4, true);
    let per_rank = live("per-rank", 3, 4, false);
    let reference = train(&one);
    let outcome = train(&synced);
    train(&per_rank);
    assert_eq!(reference.global_step, outcome.global_step);
    assert_ranks_agree(&outcome, 3);

    let want = weights(&one.out);
    let synced_diff = max_diff(&want, &weights(&synced.out));
    let per_rank_diff = max_diff(&want, &weights(&per_rank.out));
    // The same sums in another order (per rank, then across ranks in f64): ulps per step.
    assert!(
        synced_diff < 1e-4,
        "3×4 with --sync-bn and 1×12 differ by {synced_diff}"
    );
    assert!(
        per_rank_diff > 100.0 * synced_diff.max(1e-6),
        "without --sync-bn the ranks should train differently: {per_rank_diff} vs {synced_diff}"
    );
}

#[test]
fn uneven_last_batches_match_one_rank_on_every_policy() {
    let tmp = tempfile::tempdir().unwrap();
    // 40 training images in global batches of 12: a last batch of 4 (3 ranks × 4 leave two
    // ranks without images in it unless padded).
    let data = dataset(tmp.path(), 10);
    for (policy, steps) in [
        (LastBatch::Partial, 4),
        (LastBatch::Drop, 3),
        (LastBatch::Pad, 4),
    ] {
        let mut one = config(&data, tmp.path(), &format!("one-{policy:?}"), 1, 12);
        one.last_batch = policy;
        let mut three = config(&data, tmp.path(), &format!("three-{policy:?}"), 3, 4);
        three.last_batch = policy;
        let a = train(&one);
        let b = train(&three);
        assert_eq!(a.global_step, steps, "{policy:?}");
        assert_eq!(b.global_step, steps, "{policy:?}");
        assert_ranks_agree(&b, 3);
        let d = max_diff(&weights(&one.out), &weights(&three.out));
        assert!(d < 1e-4, "{policy:?}: 3×4 and 1×12 differ by {d}");
    }
}

#[test]
fn a_stop_wished_by_one_rank_stops_every_rank_after_the_same_step_with_one_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), 12);
    // 48 images, 3 ranks × 2: 8 steps in the epoch.
    let cfg = config(&data, tmp.path(), "run", 3, 2);
    let outcome = train_until(&cfg, &|rank, step| rank == 2 && step >= 2).unwrap();
    assert!(outcome.interrupted);
    // Rank 2 wishes to stop while issuing step index 2; every rank reads the wish with that
    // step's totals, one step later, and stops after step index 3.
    assert_eq!(outcome.global_step, 4);
    assert_ranks_agree(&outcome, 3);
    let meta = CheckpointMeta::load(&cfg.out).unwrap();
    assert_eq!(meta.data_position.global_step, 4);
    assert_eq!(meta.data_position.step_in_epoch, 4);
    let tensor_files: Vec<String> = std::fs::read_dir(&cfg.out)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("model-s"))
        .collect();
    assert_eq!(tensor_files.len(), 1, "{tensor_files:?}");
}

#[test]
fn a_second_run_into_a_folder_in_use_is_refused_and_disturbs_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), 12);
    let mut first = config(&data, tmp.path(), "run", 2, 6);
    first.epochs = 2;
    first.save_every = 1;
    let mut second = config(&data, tmp.path(), "run", 1, 4);
    second.resume = Some(first.out.clone());
    second.epochs = 2;
    // While the first run is at step 5 (a checkpoint of step 4 committed), a resume into its
    // folder starts, as a second process would.
    let refused = std::sync::Mutex::new(None);
    let outcome = train_until(&first, &|rank, step| {
        if rank == 0 && step == 5 {
            *refused.lock().unwrap() = Some(train_until(&second, &|_, _| false));
        }
        false
    })
    .unwrap();
    let refused = refused
        .into_inner()
        .unwrap()
        .expect("the second run was tried");
    let e = refused.expect_err("a second writer is refused");
    assert!(
        matches!(
            e,
            TrainError::Folder(crate::train::folder::FolderError::InUse { .. })
        ),
        "{e}"
    );
    // The first run went on undisturbed: all its epochs, one metrics line each.
    assert_eq!((outcome.epochs_done, outcome.global_step), (2, 8));
    let metrics = std::fs::read_to_string(first.out.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 4, "{metrics}");
    // And the folder is free again once it ended.
    train(&second);
}

#[test]
fn ranks_with_their_own_statistics_resume_bit_for_bit_from_inside_an_epoch() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), 12);
    let live = |name: &str| {
        let mut cfg = config(&data, tmp.path(), name, 2, 6);
        cfg.freeze_bn = false;
        cfg.epochs = 2;
        cfg
    };
    let whole = live("whole");
    train(&whole);
    // Checkpoints inside every epoch leave the training as it was.
    let mut saving = live("saving");
    saving.save_every = 1;
    train(&saving);
    let bytes = |cfg: &TrainConfig| std::fs::read(cfg.out.join("model.safetensors")).unwrap();
    assert!(
        bytes(&whole) == bytes(&saving),
        "--save-every changed the run"
    );
    // A stop inside an epoch (SIGTERM's path), then a resume: the same bytes at the end.
    let mut first = live("stopped");
    first.stop_after_steps = Some(3);
    assert!(train(&first).interrupted);
    // The weights file holds the ranks' mean; the optimizer file each rank's own.
    let optimizer = std::fs::read(first.out.join("optimizer.safetensors")).unwrap();
    let (shape, _) =
        crate::optim::read_f32_tensor(&optimizer, super::setup::RANK_BUFFERS_TENSOR).unwrap();
    assert_eq!(shape[0], 2);
    let mut second = live("stopped");
    second.resume = Some(first.out.clone());
    train(&second);
    assert!(
        bytes(&whole) == bytes(&second),
        "the run stopped at step 3 and resumed differs from the whole run"
    );
    // An epoch-end checkpoint has no rows: the ranks agree there.
    let optimizer = std::fs::read(second.out.join("optimizer.safetensors")).unwrap();
    assert!(crate::optim::read_f32_tensor(&optimizer, super::setup::RANK_BUFFERS_TENSOR).is_none());
}

#[test]
fn a_stop_during_validation_checkpoints_at_once_and_the_resume_validates_first() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), 12);
    let live = |name: &str| {
        let mut cfg = config(&data, tmp.path(), name, 2, 6);
        cfg.freeze_bn = false;
        cfg.epochs = 2;
        cfg
    };
    let whole = live("whole");
    train(&whole);
    // 48 images, 2 ranks × 6: 4 steps an epoch. The wish comes with the global step count
    // of epoch 1's end, which validation is the first to ask about.
    let cut = live("cut");
    let outcome = train_until(&cut, &|_, step| step == 4).unwrap();
    assert!(outcome.interrupted);
    let meta = CheckpointMeta::load(&cut.out).unwrap();
    let at = &meta.data_position;
    assert_eq!((at.epoch, at.step_in_epoch, at.global_step), (0, 4, 4));
    let metrics = std::fs::read_to_string(cut.out.join("metrics.jsonl")).unwrap_or_default();
    assert_eq!(metrics.lines().count(), 0, "{metrics}");
    let mut resumed = live("cut");
    resumed.resume = Some(cut.out.clone());
    let done = train(&resumed);
    assert_eq!((done.epochs_done, done.global_step), (2, 8));
    let bytes = |cfg: &TrainConfig, file: &str| std::fs::read(cfg.out.join(file)).unwrap();
    assert!(
        bytes(&whole, "model.safetensors") == bytes(&cut, "model.safetensors"),
        "stopped in validation and resumed differs from the whole run"
    );
    // The resumed run wrote epoch 1's lines, as the whole run did (times aside).
    let figures = |cfg: &TrainConfig| -> Vec<(u64, String, f64, f64)> {
        String::from_utf8(bytes(cfg, "metrics.jsonl"))
            .unwrap()
            .lines()
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
    assert_eq!(figures(&whole), figures(&cut));
}

/// The validation figures of epoch 1 in a run folder, by split: (accuracy, top-5, loss).
fn validation_figures(run: &Path) -> Vec<(String, f64, f64, f64)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["split"] != "train")
        .map(|v| {
            (
                v["split"].as_str().unwrap().to_string(),
                v["accuracy"].as_f64().unwrap(),
                v["top5"].as_f64().unwrap(),
                v["loss"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// Every rank validates its slice of the split (with the replica's weights and the moving
/// average rank 0 broadcasts), and one sum gives the whole split's figures: three ranks give
/// one rank's accuracy exactly, and its loss up to the order of the sums, on the same
/// checkpoint, also with an odd split (the last batch leaves two ranks without an image) and
/// a split smaller than the rank count (a rank with no validation image at all).
#[test]
fn three_ranks_validate_their_shares_and_give_one_ranks_figures() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), 12);
    // 7 validation images (odd) of 4 classes; and 2 of 2 classes (one each, every class
    // needs one) with as many training images.
    let mut files: Vec<PathBuf> = std::fs::read_dir(data.join("valid").join("class_00"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    std::fs::remove_file(&files[0]).unwrap();
    let small = tmp.path().join("small");
    write_dataset(&SynthConfig {
        out: small.clone(),
        classes: 2,
        train_per_class: 24,
        valid_per_class: 1,
        test_per_class: 0,
        width: 16,
        height: 16,
        format: ImageFormatKind::Png,
        seed: 9,
    })
    .unwrap();
    for (data, images, shares) in [(&data, 7, [3u64, 2, 2]), (&small, 2, [1, 1, 0])] {
        let run = |name: &str, ranks: usize, batch: usize| {
            let mut cfg = config(data, tmp.path(), name, ranks, batch);
            cfg.freeze_bn = false;
            cfg.model_ema = Some(crate::train::EmaRecipe {
                steps: 1,
                decay: 0.9,
            });
            cfg
        };
        // The checkpoint: epoch 1 trained (48 images, 2 ranks × 3: 8 steps) and stopped
        // during its validation, which each resume below does first.
        let cut = run(&format!("cut-{images}"), 2, 3);
        let stopped = train_until(&cut, &|_, step| step == 8).unwrap();
        assert!(stopped.interrupted);
        let resumed = |name: &str, ranks: usize, batch: usize| {
            let mut cfg = run(&format!("{name}-{images}"), ranks, batch);
            cfg.resume = Some(cut.out.clone());
            let outcome = train(&cfg);
            (outcome, validation_figures(&cfg.out))
        };
        // The same global batch (6), so both resume at the same point.
        let (one, one_figures) = resumed("one", 1, 6);
        let (three, three_figures) = resumed("three", 3, 2);
        assert_eq!(one.epochs_done, 1);
        assert_eq!(three.epochs_done, 1);
        // Two passes (the weights and their average), each rank its share.
        assert_eq!(one.validated_images, vec![2 * images]);
        assert_eq!(
            three.validated_images,
            shares.iter().map(|n| 2 * n).collect::<Vec<_>>(),
            "{images} images"
        );
        assert_eq!(one_figures.len(), 2, "{one_figures:?}");
        for (a, b) in one_figures.iter().zip(&three_figures) {
            assert_eq!(a.0, b.0);
            assert_eq!((a.1, a.2), (b.1, b.2), "{images} images, {}: accuracy", a.0);
            let d = (a.3 - b.3).abs();
            assert!(
                d <= 1e-6 * a.3.abs().max(1.0),
                "{images} images, {}: loss {} on one rank, {} on three",
                a.0,
                a.3,
                b.3
            );
        }
    }
}

#[test]
fn a_run_stopped_on_two_ranks_resumes_on_three_as_if_never_stopped() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), 12);
    let mut reference = config(&data, tmp.path(), "reference", 2, 6);
    reference.epochs = 2;
    let whole = train(&reference);
    assert_eq!(whole.global_step, 8);

    let mut first = config(&data, tmp.path(), "run", 2, 6);
    first.epochs = 2;
    first.stop_after_steps = Some(3);
    let stopped = train(&first);
    assert!(stopped.interrupted);
    assert_eq!(stopped.global_step, 3);

    let mut second = config(&data, tmp.path(), "run", 3, 4);
    second.epochs = 2;
    second.resume = Some(first.out.clone());
    let resumed = train(&second);
    assert_eq!(resumed.global_step, 8);
    assert_ranks_agree(&resumed, 3);
    let d = max_diff(&weights(&second.out), &weights(&reference.out));
    assert!(
        d < 1e-4,
        "resumed 2 → 3 ranks differs from the whole run by {d}"
    );
}

/// A collective that behaves, except as the test tells it.
struct Scripted {
    inner: LocalCollective,
    /// This rank stops answering at its n-th sum (0-based): it waits until the group is
    /// aborted, as a rank stuck in a kernel or a dead peer would look to the others.
    stall_at_sum: Option<usize>,
    /// This rank fails its n-th sum (0-based) with an error that does not say where it
    /// happened, as a device running out of memory would.
    fail_at_sum: Option<usize>,
    sums: usize,
    /// Buckets of a step; with `watch_overlap`, the last one's start waits (10 s at most)
    /// for an earlier one's average and counts in `overlapped` when it came.
    buckets: usize,
    watch_overlap: bool,
    averages_before_step: usize,
    overlapped: Arc<AtomicUsize>,
}

impl Scripted {
    fn new(inner: LocalCollective, buckets: usize, overlapped: Arc<AtomicUsize>) -> Self {
        let averages_before_step = inner.averages_done().load(Ordering::Acquire);
        Scripted {
            inner,
            stall_at_sum: None,
            fail_at_sum: None,
            sums: 0,
            buckets,
            watch_overlap: false,
            averages_before_step,
            overlapped,
        }
    }
}

impl Collective for Scripted {
    type Buffer = HostGrads;

    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn start_average(
        &mut self,
        buffer: &mut HostGrads,
        bucket: usize,
        range: std::ops::Range<usize>,
        scale: f32,
    ) -> Result<(), CollectiveError> {
        if self.watch_overlap && bucket + 1 == self.buckets {
            // Still inside backward (this is the hook of its last gradient): an earlier
            // bucket's average must complete on the communication thread meanwhile.
            let done = self.inner.averages_done();
            let until = Instant::now() + Duration::from_secs(10);
            while done.load(Ordering::Acquire) == self.averages_before_step
                && Instant::now() < until
            {
                std::thread::sleep(Duration::from_millis(1));
            }
            if done.load(Ordering::Acquire) > self.averages_before_step {
                self.overlapped.fetch_add(1, Ordering::SeqCst);
            }
        }
        self.inner.start_average(buffer, bucket, range, scale)
    }

    fn finish_averages(&mut self, buffer: &mut HostGrads) -> Result<(), CollectiveError> {
        let result = self.inner.finish_averages(buffer);
        self.averages_before_step = self.inner.averages_done().load(Ordering::Acquire);
        result
    }

    fn broadcast(&mut self, values: &mut [f32], root: usize) -> Result<(), CollectiveError> {
        self.inner.broadcast(values, root)
    }

    fn sum(&mut self, values: &mut [f64]) -> Result<(), CollectiveError> {
        let n = self.sums;
        self.sums += 1;
        if self.stall_at_sum == Some(n) {
            let until = Instant::now() + Duration::from_secs(30);
            while Instant::now() < until {
                self.inner.check()?;
                std::thread::sleep(Duration::from_millis(5));
            }
            panic!("the group was never aborted");
        }
        if self.fail_at_sum == Some(n) {
            return Err(CollectiveError::Buckets(
                crate::dist::buckets::BucketError::EmptyParameter {
                    name: "injected: out of memory".into(),
                },
            ));
        }
        self.inner.sum(values)
    }

    fn sum_within(&mut self, values: &mut [f64], timeout: Duration) -> Result<(), CollectiveError> {
        self.inner.sum_within(values, timeout)
    }

    fn check(&self) -> Result<(), CollectiveError> {
        self.inner.check()
    }

    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}

/// Runs `cfg`'s ranks on scripted collectives (`script` adjusts each; the group's watchdog
/// timeout is `timeout`).
fn run_scripted(
    cfg: &TrainConfig,
    timeout: Duration,
    overlapped: &Arc<AtomicUsize>,
    script: impl Fn(&mut Scripted),
) -> Result<Vec<RankReport>, TrainError> {
    let folder = RunFolder::new(&cfg.out);
    folder.create().unwrap();
    let shared = shared_for_cpu(cfg, &folder, None)?;
    let buckets = shared.bucket_plan.buckets().len();
    let comms: Vec<Scripted> = LocalGroup::ranks(cfg.replicas, timeout)
        .into_iter()
        .map(|c| {
            let mut s = Scripted::new(c, buckets, overlapped.clone());
            script(&mut s);
            s
        })
        .collect();
    let stop = AtomicBool::new(false);
    run_cpu_ranks(&shared, comms, &|_, _| stop.load(Ordering::SeqCst))
}

#[test]
fn a_rank_that_stops_answering_is_aborted_by_the_watchdog_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), 6);
    let cfg = config(&data, tmp.path(), "run", 3, 2);
    let timeout = Duration::from_millis(300);
    let start = Instant::now();
    let overlapped = Arc::new(AtomicUsize::new(0));
    let err = run_scripted(&cfg, timeout, &overlapped, |c| {
        if c.rank() == 2 {
            c.stall_at_sum = Some(2);
        }
    })
    .unwrap_err()
    .to_string();
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "took {:?}",
        start.elapsed()
    );
    assert!(err.contains("rank 2 never joined"), "{err}");
    assert!(err.contains("300ms"), "{err}");
}

#[test]
fn a_failing_ranks_error_names_it_and_its_device() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), 6);
    let cfg = config(&data, tmp.path(), "run", 3, 2);
    let overlapped = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let err = run_scripted(&cfg, Duration::from_secs(60), &overlapped, |c| {
        if c.rank() == 1 {
            c.fail_at_sum = Some(2);
        }
    })
    .unwrap_err();
    // Its own error, not another rank's report of the abort, named once by rank and device.
    let text = err.to_string();
    assert!(
        text.starts_with("rank 1 (CPU): ") && text.contains("injected: out of memory"),
        "{text}"
    );
    assert_eq!(text.matches("rank 1").count(), 1, "{text}");
    assert!(start.elapsed() < Duration::from_secs(30));
}

#[test]
fn a_bucket_is_averaged_while_backward_still_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), 6);
    // 24 images, 2 ranks × 4: 3 steps; buckets of 50 kB: several per step.
    let mut cfg = config(&data, tmp.path(), "run", 2, 4);
    cfg.dist.bucket_mb = 0.05;
    let overlapped = Arc::new(AtomicUsize::new(0));
    let reports = run_scripted(&cfg, Duration::from_secs(60), &overlapped, |c| {
        assert!(c.buckets >= 2, "{} bucket(s)", c.buckets);
        c.watch_overlap = true;
    })
    .unwrap();
    let steps = reports[0].position.global_step as usize;
    assert_eq!(steps, 3);
    // Every rank, every step: an earlier bucket's average finished before the last bucket
    // was started from the backward hook.
    assert_eq!(overlapped.load(Ordering::SeqCst), 2 * steps);
}

/// A data set of `images` training images over three classes (11 per class at most).
fn odd_dataset(root: &Path, name: &str, images: usize) -> PathBuf {
    let data = root.join(name);
    write_dataset(&SynthConfig {
        out: data.clone(),
        classes: 3,
        train_per_class: images.div_ceil(3),
        valid_per_class: 1,
        test_per_class: 0,
        width: 16,
        height: 16,
        format: ImageFormatKind::Png,
        seed: 9,
    })
    .unwrap();
    // Drop files from the last classes down to the count asked for.
    let mut extra = 3 * images.div_ceil(3) - images;
    for class in (0..3).rev() {
        if extra == 0 {
            break;
        }
        let mut files: Vec<PathBuf> =
            std::fs::read_dir(data.join("train").join(format!("class_{class:02}")))
                .unwrap()
                .map(|e| e.unwrap().path())
                .collect();
        files.sort();
        std::fs::remove_file(&files[0]).unwrap();
        extra -= 1;
    }
    data
}

/// Parameters and BN buffers (running statistics, batch counters) of a run's checkpoint.
fn state(run: &Path) -> crate::model::ModelState {
    load_checkpoint_for_inference(run, 4)
        .unwrap()
        .net
        .state()
        .unwrap()
}

/// The largest |a − b| / max(1, |b|) over every value, and where.
fn worst_relative(a: &[Vec<f32>], b: &[Vec<f32>]) -> (f32, usize) {
    assert_eq!(a.len(), b.len());
    let mut worst = (0.0f32, 0);
    for (t, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.len(), y.len(), "tensor {t}");
        for (p, q) in x.iter().zip(y) {
            let d = (p - q).abs() / q.abs().max(1.0);
            // NaN (in either) counts as the worst.
            let d = if d.is_nan() { f32::INFINITY } else { d };
            if d > worst.0 {
                worst = (d, t);
            }
        }
    }
    worst
}

/// `--sync-bn` over 2 ranks × 4 equals 1 rank × 8 over epochs of 33 images, whose last step
/// has one image: rank 0 holds it, rank 1 none. Every rank must then normalise with that
/// image's statistics and advance its running statistics with them, the empty one included;
/// the epoch end averages the ranks' statistics, so an empty rank that kept its own would pull
/// the checkpoint's halfway back (half a momentum step, ~1e-2 here).
///
/// Tolerance: both runs take the synchronised path; they differ in how a step's sums are
/// formed (each rank's f32 mean and variance, 2^-24 relative each, summed in f64, against one
/// rank's) and in the order the bucket averages add the ranks' f32 gradients. That is a few
/// f32 ulps per step; ten SGD steps at lr 0.4 carry it to ~1e-6 of a value (measured: 3e-7).
/// 1e-5 relative (absolute below 1) leaves a margin of 30 and is 1000 times below the defect
/// (7e-2 before the empty rank advanced its statistics).
#[test]
fn sync_bn_ranks_equal_one_rank_when_the_last_step_leaves_a_rank_without_images() {
    let tmp = tempfile::tempdir().unwrap();
    let data = odd_dataset(tmp.path(), "d33", 33);
    let live = |name: &str, ranks: usize, batch: usize| {
        let mut cfg = config(&data, tmp.path(), name, ranks, batch);
        cfg.freeze_bn = false;
        cfg.sync_bn = true;
        cfg.lr = 0.4;
        cfg.epochs = 2;
        cfg
    };
    let one = live("one", 1, 8);
    let two = live("two", 2, 4);
    let reference = train(&one);
    let outcome = train(&two);
    // 33 images in global batches of 8: 4 full steps and one of a single image, per epoch.
    assert_eq!(reference.global_step, 10);
    assert_eq!(outcome.global_step, 10);
    assert_ranks_agree(&outcome, 2);
    let (want, got) = (state(&one.out), state(&two.out));
    let (params, p_at) = worst_relative(&got.params, &want.params);
    let (buffers, b_at) = worst_relative(&got.buffers, &want.buffers);
    assert!(
        params <= 1e-5,
        "parameter tensor {p_at}: 2×4 and 1×8 differ by {params} (relative)"
    );
    assert!(
        buffers <= 1e-5,
        "BN buffer {b_at}: 2×4 and 1×8 differ by {buffers} (relative)"
    );
}

/// `--sync-bn` on one rank is plain batch norm: the same run with and without it, over
/// 33-image epochs whose last step has one image, ends with the same parameters and BN
/// statistics up to rounding (the statistics reach the normalisation through f32 means and
/// variances summed in f64 on one path, straight from the fused op on the other: ulps per
/// step; measured 5e-7 after two epochs, so 1e-5 leaves a margin of 20). The degenerate case
/// (one value per channel), which resnet8 cannot reach above 8 pixels, is checked on the
/// network in `tests/dist/sync_bn.rs`.
#[test]
fn sync_bn_on_one_rank_trains_as_plain_batch_norm() {
    let tmp = tempfile::tempdir().unwrap();
    let data = odd_dataset(tmp.path(), "d33", 33);
    let run = |name: &str, sync_bn: bool| {
        let mut cfg = config(&data, tmp.path(), name, 1, 8);
        cfg.freeze_bn = false;
        cfg.sync_bn = sync_bn;
        cfg.lr = 0.4;
        cfg.epochs = 2;
        cfg.image_size = 8;
        cfg
    };
    let (plain, synced) = (run("plain", false), run("synced", true));
    assert_eq!(train(&plain).global_step, 10);
    assert_eq!(train(&synced).global_step, 10);
    let (want, got) = (state(&plain.out), state(&synced.out));
    let (params, p_at) = worst_relative(&got.params, &want.params);
    let (buffers, b_at) = worst_relative(&got.buffers, &want.buffers);
    assert!(
        params <= 1e-5,
        "parameter tensor {p_at}: differs by {params}"
    );
    assert!(buffers <= 1e-5, "BN buffer {b_at}: differs by {buffers}");
}
