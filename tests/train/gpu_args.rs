//! The GPU training path's flags on the training command (no GPU needed): the distributed
//! flags parse into `TrainArgs::dist`; a CPU run passes over the GPU-only ones (the launch flags it
//! checks, and refuses several nodes: `train::rank::cpu`).

use birdtrain::cli::train_config::to_config;
use birdtrain::cli::Cli;
use birdtrain::train::DeviceChoice;
use clap::Parser;

#[test]
fn the_distributed_flags_reach_the_training_args() {
    let cli = Cli::try_parse_from([
        "birdtrain",
        "--data",
        "d",
        "--prefetch-depth",
        "3",
        "--bucket-mb",
        "8",
        "--trace",
        "trace.json",
        "--nodes",
        "2",
        "--node-rank",
        "1",
        "--master",
        "10.0.0.1:29500",
        "--collective-timeout",
        "30",
    ])
    .unwrap();
    let dist = cli.train.dist.to_settings();
    assert_eq!(dist.prefetch_depth, 3);
    assert_eq!(dist.bucket_mb, 8.0);
    assert_eq!(
        dist.trace.as_deref(),
        Some(std::path::Path::new("trace.json"))
    );
    assert_eq!((dist.nodes, dist.node_rank), (Some(2), Some(1)));
    assert_eq!(dist.master.as_deref(), Some("10.0.0.1:29500"));
    assert_eq!(dist.collective_timeout, 30);
}

#[test]
fn without_distributed_flags_their_defaults_apply() {
    let cli = Cli::try_parse_from(["birdtrain", "--data", "d"]).unwrap();
    let dist = &cli.train.dist;
    // The documented defaults, which are the settings' own.
    assert_eq!(dist.prefetch_depth, 2);
    assert_eq!(dist.bucket_mb, 25.0);
    assert!(dist.trace.is_none());
    assert_eq!(dist.to_settings(), birdtrain::dist::DistSettings::default());
}

#[test]
fn a_bad_distributed_flag_is_a_parse_error_naming_it() {
    let err = Cli::try_parse_from(["birdtrain", "--data", "d", "--prefetch-depth", "two"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("--prefetch-depth"), "{err}");
}

#[test]
fn a_cpu_run_is_one_loop_on_cpu_ranks_with_the_same_settings() {
    let tmp = tempfile::tempdir().unwrap();
    for split in ["train", "valid"] {
        std::fs::create_dir_all(tmp.path().join(split).join("a")).unwrap();
    }
    let data = tmp.path().to_str().unwrap();
    let cli = Cli::try_parse_from([
        "birdtrain",
        "--data",
        data,
        "--gpus",
        "0",
        "--prefetch-depth",
        "4",
    ])
    .unwrap();
    let (cfg, _) = to_config(&cli.train).unwrap();
    assert_eq!(cfg.device, DeviceChoice::Cpu);
    // One loop for every device: the CPU ranks take the same settings (the staging depth
    // only matters to GPUs).
    assert_eq!(cfg.dist.prefetch_depth, 4);
    assert_eq!(cfg.replicas, 1);
}

#[test]
fn the_nccl_path_without_a_gpu_is_one_clear_error_and_leaves_nothing() {
    if !birdtrain::dist::launch::detect_cuda_devices().is_empty() {
        return; // a GPU machine trains instead (tests/gpu/train_gpu.rs)
    }
    let tmp = tempfile::tempdir().unwrap();
    for split in ["train", "valid"] {
        std::fs::create_dir_all(tmp.path().join(split).join("a")).unwrap();
    }
    let cli = Cli::try_parse_from(["birdtrain", "--data", tmp.path().to_str().unwrap()]).unwrap();
    let (mut cfg, _) = to_config(&cli.train).unwrap();
    cfg.device = DeviceChoice::Cuda(1);
    cfg.dist = cli.train.dist.to_settings();
    cfg.out = tmp.path().join("run");
    let err = birdtrain::train::train(&cfg, &std::sync::atomic::AtomicBool::new(false))
        .unwrap_err()
        .to_string();
    assert!(err.contains("--gpus"), "{err}");
    assert!(!cfg.out.exists(), "a failed start leaves no run folder");
}
