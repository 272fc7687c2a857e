//! Small real runs of the binary on the CPU (resnet8 on 16-pixel images, one thread, so
//! every run is deterministic): the dataset, the flags, and what the run folder holds.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use birdtrain::train::CheckpointMeta;
use pipeline::synth::{write_dataset, ImageFormatKind, SynthConfig};

use super::s;

/// A synthetic set of `classes` × `per_class` 16×16 PNGs (2 validation images per class).
pub(crate) fn dataset(root: &Path, classes: usize, per_class: usize) -> PathBuf {
    write_dataset(&SynthConfig {
        out: root.to_path_buf(),
        classes,
        train_per_class: per_class,
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

/// The flags of every run here: deterministic (one thread), small and quick.
pub(crate) fn train_args(data: &Path, cache: &Path, out: &Path, epochs: u32) -> Vec<String> {
    [
        "--data",
        s(data),
        "--gpus",
        "0",
        "--model",
        "resnet8",
        "--image-size",
        "16",
        "--epochs",
        &epochs.to_string(),
        "--batch-size",
        "4",
        "--threads",
        "1",
        "--workers",
        "1",
        "--cache-dir",
        s(cache),
        "--out",
        s(out),
        "--seed",
        "3",
        "--quiet",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect()
}

pub(crate) fn run_with(args: &[String], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_birdtrain"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("the birdtrain binary runs")
}

pub(crate) fn text(out: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

pub(crate) fn ok(out: Output) -> Output {
    assert!(out.status.success(), "{}", text(&out));
    out
}

pub(crate) fn resume_args(run: &Path, data: &Path) -> Vec<String> {
    [
        "--resume",
        s(run),
        "--data",
        s(data),
        "--threads",
        "1",
        "--workers",
        "1",
        "--quiet",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect()
}

/// The moving average of the weights the run's sidecar names (`--model-ema`).
pub(crate) fn average(run: &Path) -> Vec<u8> {
    let meta = CheckpointMeta::load(run).unwrap_or_else(|e| panic!("{}: {e}", run.display()));
    std::fs::read(run.join(meta.model_ema_file.expect("the sidecar names an average"))).unwrap()
}

/// The weights the run's sidecar names (what `--resume`, `eval` and `predict` read).
pub(crate) fn weights(run: &Path) -> Vec<u8> {
    let meta = CheckpointMeta::load(run).unwrap_or_else(|e| panic!("{}: {e}", run.display()));
    std::fs::read(run.join(meta.model_file)).unwrap()
}
