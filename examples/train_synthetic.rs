//! Trains a CIFAR-style resnet8 on a synthetic dataset through the library API (no CLI):
//! the input engine writes and reads the images, the trainer runs on the CPU backend with two
//! data-parallel replicas, and the run folder gets metrics.jsonl, report.png and a
//! checkpoint that is then loaded for inference.
//!
//! ```text
//! cargo run --release --example train_synthetic [-- OUT_DIR]
//! ```

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;

use birdtrain::model::Arch;
use birdtrain::train::{self, load_checkpoint_for_inference, TrainConfig};
use pipeline::synth::{write_dataset, ImageFormatKind, SynthConfig};

fn main() -> anyhow::Result<()> {
    let root = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("birdtrain-train-synthetic"));
    let data = root.join("data");
    if !data.join("train").is_dir() {
        let summary = write_dataset(&SynthConfig {
            out: data.clone(),
            classes: 6,
            train_per_class: 60,
            valid_per_class: 12,
            test_per_class: 0,
            width: 48,
            height: 48,
            format: ImageFormatKind::Png,
            seed: 1,
        })?;
        println!(
            "synthetic dataset: {:?} files in {}",
            summary.files,
            data.display()
        );
    }

    let mut cfg = TrainConfig::new(&data);
    cfg.arch = Arch::ResNet8;
    cfg.image_size = 32;
    cfg.epochs = 3;
    cfg.batch_size = 16;
    cfg.replicas = 2; // two CPU replicas, gradients averaged, one optimizer step
    cfg.cache_dir = Some(root.join("cache"));
    cfg.out = root.join("run");
    let outcome = train::train(&cfg, &AtomicBool::new(false))?;
    println!(
        "trained {} epochs, {} steps; replica checksums {:x?}",
        outcome.epochs_done, outcome.global_step, outcome.replica_checksums
    );

    // The checkpoint loads on the CPU whatever replica count trained it.
    let model = load_checkpoint_for_inference(&cfg.out, 8)?;
    println!(
        "checkpoint: {} with {} classes at {}×{}",
        model.meta.model,
        model.meta.classes.len(),
        model.meta.image_size,
        model.meta.image_size
    );
    Ok(())
}
