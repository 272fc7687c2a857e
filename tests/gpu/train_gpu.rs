//! The NCCL training path on a GPU (`#[ignore]`: needs a CUDA GPU, NVRTC and NCCL).
//!
//! Run on a GPU machine with:
//! `cargo test --test gpu -- --ignored --test-threads=1 --nocapture train_gpu::`
//!
//! - `--gpus 1` through the full NCCL path (communicator, broadcast, bucketed all-reduce,
//!   staging ring, fused optimizer) ends with the same weights as the single-GPU generic loop.
//! - With a warm cache the staging ring keeps the data wait near zero.
//! - Ctrl-C before the first step stops after one step with a checkpoint.
//! - `--model-ema` leaves training alone on the GPU, and the CPU evaluates its average.
//! - `lr-find`'s sweep runs through the GPU loop and stops at divergence.
//! - `BIRDTRAIN_CUDA_GRAPH=1` (the step captured and replayed) trains to the eager run's bits.
//!
//! One GPU cannot show two ranks (NCCL refuses two ranks on one device): multi-GPU agreement
//! is checked by the cross-rank checksum at run time on real multi-GPU machines.

use crate::support::update_distance;
use std::path::Path;
use std::sync::atomic::AtomicBool;

use birdtrain::model::{Arch, Graph, HeadPolicy, ModelState};
use birdtrain::train::{self, DeviceChoice, TrainConfig, TrainOutcome};
use clap::Parser;
use pipeline::synth::{write_dataset, ImageFormatKind, SynthConfig};

/// The CLI's defaults of the distributed flags (what `birdtrain --gpus 1` uses).
fn default_dist() -> birdtrain::dist::DistSettings {
    let cli = birdtrain::cli::Cli::try_parse_from(["birdtrain", "--prefetch-depth", "2"]).unwrap();
    cli.train.dist.to_settings()
}

fn dataset(root: &Path, per_class: usize, size: u32) -> std::path::PathBuf {
    let data = root.join("d");
    write_dataset(&SynthConfig {
        out: data.clone(),
        classes: 4,
        train_per_class: per_class,
        valid_per_class: 4,
        test_per_class: 0,
        width: size,
        height: size,
        format: ImageFormatKind::Png,
        seed: 5,
    })
    .unwrap();
    data
}

fn config(data: &Path, cache: &Path, out: &Path, nccl: bool) -> TrainConfig {
    let mut cfg = TrainConfig::new(data);
    cfg.device = DeviceChoice::Cuda(1);
    cfg.replicas = 1;
    cfg.arch = Arch::ResNet8;
    cfg.image_size = 32;
    cfg.epochs = 2;
    cfg.batch_size = 16;
    cfg.cache_dir = Some(cache.to_path_buf());
    cfg.out = out.to_path_buf();
    cfg.seed = 11;
    cfg.lr = 0.4;
    cfg.warmup_epochs = 0;
    cfg.progress = false;
    cfg.verbose = true;
    // Without NCCL: one GPU and no communication library.
    cfg.dist = birdtrain::dist::DistSettings {
        nccl,
        ..default_dist()
    };
    cfg
}

fn weights(out: &Path, classes: usize) -> Vec<f32> {
    let graph = Graph::new(Arch::ResNet8, classes);
    ModelState::load_safetensors(&graph, &out.join("model.safetensors"), HeadPolicy::Strict)
        .unwrap()
        .flat_params()
}

fn data_wait_share(outcome: &TrainOutcome) -> f64 {
    let line = outcome
        .summary
        .lines()
        .find(|l| l.contains("data wait"))
        .unwrap_or_else(|| panic!("no data-wait line in\n{}", outcome.summary));
    let after = line.split("data wait ").nth(1).unwrap();
    after.split(' ').next().unwrap().parse::<f64>().unwrap() / 100.0
}

#[test]
#[ignore = "needs a CUDA GPU with NVRTC and NCCL"]
fn one_gpu_through_nccl_matches_the_generic_single_gpu_path() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), 24, 32);
    let cache = tmp.path().join("cache");
    let generic = config(&data, &cache, &tmp.path().join("generic"), false);
    let nccl = config(&data, &cache, &tmp.path().join("nccl"), true);
    let a = train::train(&generic, &AtomicBool::new(false)).unwrap();
    let b = train::train(&nccl, &AtomicBool::new(false)).unwrap();
    println!("{}", b.summary);
    assert_eq!(a.global_step, b.global_step);
    assert!(
        b.summary.contains("cross-rank checks passed"),
        "{}",
        b.summary
    );
    assert!(
        !b.summary.contains(" 0 cross-rank checks passed"),
        "{}",
        b.summary
    );
    let (wa, wb) = (weights(&a.out, 4), weights(&b.out, 4));
    assert_eq!(wa.len(), wb.len());
    // The generic loop's checkpoint holds the bf16 working copy, the NCCL path's the f32
    // master: they agree to bf16 precision (2^-8 relative) plus accumulated rounding.
    let mut worst = 0.0f32;
    for (x, y) in wa.iter().zip(&wb) {
        let err = (x - y).abs() / (1e-3 + x.abs());
        worst = worst.max(err);
    }
    println!("largest relative weight difference {worst:.3e}");
    assert!(worst < 5e-2, "weights differ by {worst}");
    let (va, vb) = (a.last_valid.unwrap(), b.last_valid.unwrap());
    assert!(
        (va.loss - vb.loss).abs() < 0.05 * va.loss.max(1.0),
        "{va:?} vs {vb:?}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU with NVRTC and NCCL"]
fn the_staging_ring_keeps_the_data_wait_low_with_a_warm_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), 256, 64);
    let cache = tmp.path().join("cache");
    let mut warm = config(&data, &cache, &tmp.path().join("warm"), true);
    warm.epochs = 1;
    warm.image_size = 64; // the cache is per image size: warm the one the run reads
    train::train(&warm, &AtomicBool::new(false)).unwrap();
    let mut cfg = config(&data, &cache, &tmp.path().join("run"), true);
    cfg.arch = Arch::ResNet18;
    cfg.image_size = 64;
    cfg.batch_size = 64;
    cfg.epochs = 2;
    let outcome = train::train(&cfg, &AtomicBool::new(false)).unwrap();
    println!("{}", outcome.summary);
    let share = data_wait_share(&outcome);
    // A share, not a time; generous so a busy machine passes, yet far below input-bound.
    assert!(share < 0.25, "data wait {:.1} %", 100.0 * share);
}

#[test]
#[ignore = "needs a CUDA GPU with NVRTC and NCCL"]
fn ctrl_c_stops_after_one_step_with_a_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), 24, 32);
    let cfg = config(
        &data,
        &tmp.path().join("cache"),
        &tmp.path().join("run"),
        true,
    );
    let outcome = train::train(&cfg, &AtomicBool::new(true)).unwrap();
    assert!(outcome.interrupted);
    assert_eq!(outcome.global_step, 1);
    assert!(cfg.out.join("model.safetensors").exists());
    let meta = train::CheckpointMeta::load(&cfg.out).unwrap();
    assert_eq!(meta.step, 1);
    // The checkpoint resumes (here on the same single GPU) and finishes the run.
    let mut resume = cfg.clone();
    resume.resume = Some(cfg.out.clone());
    let done = train::train(&resume, &AtomicBool::new(false)).unwrap();
    assert!(!done.interrupted);
    assert_eq!(done.epochs_done, 2);
}

#[test]
#[ignore = "needs a CUDA GPU with NVRTC and NCCL"]
fn the_trace_shows_copies_compute_buckets_waits_and_the_engine() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), 24, 32);
    let mut cfg = config(
        &data,
        &tmp.path().join("cache"),
        &tmp.path().join("run"),
        true,
    );
    cfg.epochs = 1;
    let trace = tmp.path().join("trace.json");
    cfg.dist.trace = Some(trace.clone());
    train::train(&cfg, &AtomicBool::new(false)).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let text = json.to_string();
    for name in [
        "H2D batch",
        "forward + backward",
        "all-reduce bucket 0",
        "optimizer",
        "input wait",
        "engine: ",
    ] {
        assert!(text.contains(name), "no {name:?} span in the trace");
    }
}

/// Largest relative difference between two weight vectors.
fn worst_relative(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / (1e-3 + x.abs()))
        .fold(0.0, f32::max)
}

#[test]
#[ignore = "needs a CUDA GPU with NVRTC and NCCL"]
fn many_small_buckets_launched_during_backward_give_the_same_weights() {
    // 0.02 MiB buckets split resnet8 into several all-reduces, each launched from the
    // backward hook while the earlier layers are still computing.
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), 24, 32);
    let cache = tmp.path().join("cache");
    let one = config(&data, &cache, &tmp.path().join("one"), true);
    let mut many = config(&data, &cache, &tmp.path().join("many"), true);
    many.dist.bucket_mb = 0.02;
    let trace = tmp.path().join("trace.json");
    many.dist.trace = Some(trace.clone());
    let a = train::train(&one, &AtomicBool::new(false)).unwrap();
    let b = train::train(&many, &AtomicBool::new(false)).unwrap();
    assert_eq!(a.global_step, b.global_step);
    // Averaging over one rank is exact, the bucket copies move bits unchanged and the v2
    // weight gradient sums its slices in a fixed order, so the weights should be equal; the
    // tolerance is the NCCL-vs-generic one above (a layer the v1 convolutions take, whose
    // weight gradient adds with atomics, differs by rounding); the printed figure says which.
    let worst = worst_relative(&weights(&a.out, 4), &weights(&b.out, 4));
    println!("largest relative weight difference, 1 vs many buckets {worst:.3e}");
    assert!(worst < 5e-2, "weights differ by {worst}");
    let text = std::fs::read_to_string(&trace).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut buckets: Vec<String> = json["traceEvents"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["name"].as_str())
        .filter(|n| n.starts_with("all-reduce bucket"))
        .map(str::to_string)
        .collect();
    buckets.sort();
    buckets.dedup();
    // Every bucket of the plan ran: resnet8's 0.02-MiB plan has 5 (each 147-KiB 3×3 weight
    // closes one alone), not the one of the default 25 MiB.
    let names: Vec<(String, usize)> = Graph::new(Arch::ResNet8, 4)
        .params()
        .iter()
        .map(|p| (p.name.clone(), p.numel()))
        .collect();
    let plan = birdtrain::dist::buckets::BucketPlan::new(
        &birdtrain::dist::buckets::specs_from_numel(&names, 4),
        many.dist.bucket_settings(),
    )
    .unwrap();
    assert!(
        plan.buckets().len() >= 5,
        "{} buckets",
        plan.buckets().len()
    );
    assert_eq!(
        buckets.len(),
        plan.buckets().len(),
        "the trace names {buckets:?}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU with NVRTC and NCCL"]
fn a_resumed_gpu_run_continues_with_its_optimizer_state() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), 24, 32);
    let cache = tmp.path().join("cache");
    let straight = config(&data, &cache, &tmp.path().join("straight"), true);
    let a = train::train(&straight, &AtomicBool::new(false)).unwrap();
    let mut first = config(&data, &cache, &tmp.path().join("split"), true);
    first.stop_after_steps = Some(3);
    let stopped = train::train(&first, &AtomicBool::new(false)).unwrap();
    assert!(stopped.interrupted && stopped.global_step == 3);
    // The checkpoint's optimizer file is the device state, in the host format.
    let graph = Graph::new(Arch::ResNet8, 4);
    let mut host = birdtrain::optim::Optimizer::new(
        birdtrain::optim::OptimizerKind::Sgd {
            momentum: 0.9,
            nesterov: false,
        },
        birdtrain::optim::Hyper {
            weight_decay: first.weight_decay,
            ..Default::default()
        },
        graph.params(),
    );
    host.load(&first.out.join("optimizer.safetensors")).unwrap();
    assert_eq!(host.steps(), 3);
    assert!(host.moments().0.iter().any(|&m| m != 0.0), "momentum saved");
    let mut resume = first.clone();
    resume.stop_after_steps = None;
    resume.resume = Some(first.out.clone());
    let b = train::train(&resume, &AtomicBool::new(false)).unwrap();
    assert_eq!(a.global_step, b.global_step);
    // Continuing the momentum keeps the weights with the uninterrupted run's (bit-exact with
    // the v2 convolutions: scripts/gpu-run.sh checks that on the CLI; tolerance as above).
    let worst = worst_relative(&weights(&a.out, 4), &weights(&b.out, 4));
    println!("largest relative weight difference after resume {worst:.3e}");
    assert!(worst < 5e-2, "weights differ by {worst}");
}

#[test]
#[ignore = "needs a CUDA GPU with NVRTC and NCCL"]
fn sync_bn_on_one_gpu_trains_like_per_gpu_bn() {
    // One rank: the global batch is the local one, so --sync-bn (statistics through NCCL and
    // the host, frozen-mode kernels, then bn_bwd_apply on the global reductions) must train
    // like the fused kernels.
    // The two paths round to bf16 at different points, so their weights are not equal; the
    // reference is the f32 CPU run of the same three steps: the synced run must be as near to
    // it as the fused one is (a wrong statistic or gradient moves it far off). A first H100
    // run with an element-wise bar instead found one near-zero weight 19 % apart after three
    // steps: that bar measured bf16 noise on single weights, not the path.
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), 24, 32);
    let cache = tmp.path().join("cache");
    let mut plain = config(&data, &cache, &tmp.path().join("plain"), true);
    plain.stop_after_steps = Some(3);
    let mut synced = plain.clone();
    synced.out = tmp.path().join("synced");
    synced.sync_bn = true;
    let mut on_cpu = plain.clone();
    on_cpu.out = tmp.path().join("cpu");
    on_cpu.device = DeviceChoice::Cpu;
    on_cpu.dist.nccl = false;
    let a = train::train(&plain, &AtomicBool::new(false)).unwrap();
    let b = train::train(&synced, &AtomicBool::new(false)).unwrap();
    let c = train::train(&on_cpu, &AtomicBool::new(false)).unwrap();
    assert!(b.summary.contains("identical"), "{}", b.summary);
    assert_eq!((a.global_step, b.global_step, c.global_step), (3, 3, 3));
    let start = ModelState::init(&Graph::new(Arch::ResNet8, 4), plain.seed).flat_params();
    let (fused, synced, cpu) = (weights(&a.out, 4), weights(&b.out, 4), weights(&c.out, 4));
    let fused_off = update_distance(&start, &fused, &cpu);
    let synced_off = update_distance(&start, &synced, &cpu);
    let between = update_distance(&start, &synced, &fused);
    println!(
        "distance of the three steps' update from the f32 CPU run's: fused BN {fused_off:.3e}, \
         sync BN {synced_off:.3e}; sync BN from fused BN {between:.3e}"
    );
    // The bf16 floor (the fused run's distance) with room for the other rounding order, and
    // 2 % for the case where the fused run happens to sit unusually near the CPU's.
    assert!(
        synced_off <= 2.0 * fused_off + 2e-2,
        "sync BN is {synced_off} from the CPU's update, fused BN {fused_off}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU with NVRTC and NCCL"]
fn the_moving_average_on_a_gpu_leaves_training_alone_and_evaluates_on_the_cpu() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), 24, 32);
    let cache = tmp.path().join("cache");
    let plain = config(&data, &cache, &tmp.path().join("plain"), true);
    let mut averaged = config(&data, &cache, &tmp.path().join("averaged"), true);
    // α = (1 − 0.999)·16·2/2 = 0.016: a real average, far from the last weights.
    averaged.model_ema = Some(train::EmaRecipe {
        steps: 2,
        decay: 0.999,
    });
    let a = train::train(&plain, &AtomicBool::new(false)).unwrap();
    let b = train::train(&averaged, &AtomicBool::new(false)).unwrap();
    println!("{}", b.summary);
    // Validating the average swaps it into the replica and back: training goes on from the
    // replica's own weights (equal, up to the v1 convolutions' atomics as above).
    let worst = worst_relative(&weights(&a.out, 4), &weights(&b.out, 4));
    println!("largest relative weight difference with the average kept {worst:.3e}");
    assert!(worst < 5e-2, "weights differ by {worst}");
    // The CPU's eval --ema gives what the GPU's validation of the average printed, to bf16
    // precision (the GPU runs the convolutions in bf16, the CPU in f32).
    let metrics = std::fs::read_to_string(b.out.join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = metrics
        .lines()
        .rfind(|l| l.contains("\"valid_ema\""))
        .map(|l| serde_json::from_str(l).unwrap())
        .expect("a valid_ema line");
    // BIRDTRAIN_BIN: the binary beside this test when it runs away from its build tree
    // (scripts/gpu-run.sh on the GPU machine sets it).
    let bin = std::env::var_os("BIRDTRAIN_BIN")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_birdtrain").into());
    let out = std::process::Command::new(bin)
        .args(["eval", "--json", "--ema", "--checkpoint"])
        .arg(&b.out)
        .arg("--data")
        .arg(&data)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let eval: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let (gpu, cpu) = (
        last["loss"].as_f64().unwrap(),
        eval["loss"].as_f64().unwrap(),
    );
    println!("average's valid loss: GPU {gpu:.5}, CPU eval --ema {cpu:.5}");
    assert!((gpu - cpu).abs() < 0.05 * gpu.max(1.0), "{gpu} vs {cpu}");
}

#[test]
#[ignore = "needs a CUDA GPU with NVRTC and NCCL"]
fn the_learning_rate_sweep_runs_on_a_gpu_and_stops_at_divergence() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), 24, 32);
    let cache = tmp.path().join("cache");
    let mut cfg = config(&data, &cache, &tmp.path().join("sweep"), true);
    let range = train::lr_find::LrRange {
        start: 1e-3,
        end: 1e6,
        steps: 60,
    };
    cfg.lr_range = Some(range);
    cfg.stop_after_steps = Some(range.steps);
    cfg.epochs = range.steps;
    let outcome = train::train(&cfg, &AtomicBool::new(false)).unwrap();
    let trace = outcome.lr_sweep.expect("a sweep");
    println!(
        "{} points · {:?} · suggestion {:?}",
        trace.points.len(),
        trace.diverged,
        train::lr_find::LrTrace::suggestion(&trace.points)
    );
    assert!(
        trace.diverged.is_some(),
        "a rate of 1e6 did not diverge on the GPU"
    );
    assert!(trace.points.len() > 12 && trace.points.len() < 60);
    assert!(!cfg.out.join("checkpoint.json").exists());
}

#[test]
#[ignore = "needs a CUDA GPU with NVRTC and NCCL"]
fn batch_size_auto_measures_the_gpu_and_the_batch_it_picks_trains() {
    // 64 px images so that the picked batch (thousands of resnet8 images) is a real load.
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(tmp.path(), 24, 64);
    let out = tmp.path().join("run");
    let (s, o) = (data.to_str().unwrap(), out.to_str().unwrap());
    let cli = birdtrain::cli::Cli::try_parse_from([
        "birdtrain",
        "--data",
        s,
        "--gpus",
        "1",
        "--model",
        "resnet8",
        "--image-size",
        "64",
        "--batch-size",
        "auto",
        "--epochs",
        "1",
        "--out",
        o,
        "--quiet",
    ])
    .unwrap();
    let (cfg, note) = birdtrain::cli::train_config::to_config(&cli.train).unwrap();
    let note = note.expect("the line that says what auto picked");
    println!("{note}");
    assert!(
        note.contains("--batch-size auto:") && note.contains("cuda:0"),
        "{note}"
    );
    let graph = Graph::new(Arch::ResNet8, 4);
    let backend = birdtrain::cuda::CudaBackend::new(0).unwrap();
    let (measured, _) = birdtrain::cuda::memory::auto_batch_size(&backend, &graph, 64, 1).unwrap();
    drop(backend);
    // The GPU holds thousands; the 96 training images cap the batch (one step takes the set),
    // and the line names both.
    let largest = measured / 8 * 8;
    assert!(largest > 96, "{measured}");
    assert_eq!(cfg.batch_size, 96);
    assert!(
        note.contains("capped at the training set's 96 images")
            && note.contains(&format!("holds {largest}")),
        "{note}"
    );
    // The largest measured batch must also fit a whole network of that size: build one.
    let backend = birdtrain::cuda::CudaBackend::new(0).unwrap();
    let net = birdtrain::model::Network::new(backend, &graph, largest, 64);
    assert!(
        net.is_ok(),
        "the measured batch {largest} does not fit: {:?}",
        net.err()
    );
    drop(net);
    // And the run trains with it (the 96 images make one step).
    let done = train::train(&cfg, &AtomicBool::new(false)).unwrap();
    assert_eq!(done.global_step, 1);
}

/// `BIRDTRAIN_CUDA_GRAPH=1` captures the steady-state step as a CUDA graph and replays it:
/// the same run with and without it ends with the same weights, to the bit, and the same
/// per-epoch training figures, with augmentation (crop, mirror, random erasing), mixup and
/// CutMix, label smoothing, Adam (its bias corrections change every step), gradient clipping
/// and a last partial batch (eager: another shape) in every epoch, and validation between
/// epochs (its larger loss scratch makes the graphs be captured again). Run alone
/// (`--test-threads=1`): the switch is an environment variable of the process.
#[test]
#[ignore = "needs a CUDA GPU with NVRTC"]
fn graph_replay_trains_to_the_same_bits_as_eager_launches() {
    use birdtrain::cuda::graph::{graph_launches, CUDA_GRAPH_ENV};
    use birdtrain::optim::OptimizerChoice;
    let tmp = tempfile::tempdir().unwrap();
    // 4 classes × 25 images: 6 batches of 16 and a last one of 4 each epoch.
    let data = dataset(tmp.path(), 25, 32);
    let cache = tmp.path().join("cache");
    let run = |name: &str, graph: bool| {
        let mut cfg = config(&data, &cache, &tmp.path().join(name), false);
        cfg.epochs = 3;
        cfg.optimizer = OptimizerChoice::AdamW;
        cfg.lr = 0.01;
        cfg.mixup = 0.4;
        cfg.cutmix = 1.0;
        cfg.random_erase = 0.5;
        cfg.label_smoothing = 0.1;
        cfg.clip_grad_norm = Some(1.0);
        std::env::set_var(CUDA_GRAPH_ENV, if graph { "1" } else { "0" });
        let before = graph_launches();
        let outcome = train::train(&cfg, &AtomicBool::new(false));
        std::env::remove_var(CUDA_GRAPH_ENV);
        (outcome.unwrap(), graph_launches() - before)
    };
    let (eager, eager_graphs) = run("eager", false);
    let (graph, graph_graphs) = run("graph", true);
    println!("{}", graph.summary);
    println!("graph launches: eager run {eager_graphs}, graph run {graph_graphs}");
    assert_eq!(eager_graphs, 0, "the eager run launched graphs");
    // 18 full steps: after each epoch's warm-up steps most of them run as graphs.
    assert!(graph_graphs >= 9, "only {graph_graphs} steps ran as graphs");
    assert_eq!(eager.global_step, graph.global_step);
    assert_eq!(
        eager.replica_checksums, graph.replica_checksums,
        "the weights differ"
    );
    let (we, wg) = (weights(&eager.out, 4), weights(&graph.out, 4));
    let differ = we
        .iter()
        .zip(&wg)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(differ, 0, "{differ} of {} weights differ", we.len());
    let train_lines = |out: &Path| -> Vec<String> {
        std::fs::read_to_string(out.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .map(|v| {
                let f = |k: &str| v[k].to_string();
                [f("epoch"), f("split"), f("loss"), f("accuracy"), f("top5")].join(" ")
            })
            .collect()
    };
    assert_eq!(train_lines(&eager.out), train_lines(&graph.out));
}
