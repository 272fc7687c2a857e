//! `birdtrain demo`: synthesise a small dataset and train on it — the README's first command.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use pipeline::synth::{write_dataset, ImageFormatKind, SynthConfig};

use super::{train_command, CliError, TrainArgs};

/// Flags of `birdtrain demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Where the synthetic dataset goes (default: the per-user cache folder).
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Run folder (default: runs/demo-<n>).
    #[arg(long, value_name = "RUN")]
    pub out: Option<PathBuf>,
    /// Epochs.
    #[arg(long, value_name = "E", default_value_t = 5)]
    pub epochs: u64,
    /// GPUs (default: every GPU, or the CPU when none).
    #[arg(long, value_name = "N|all")]
    pub gpus: Option<String>,
    /// No progress bars.
    #[arg(long)]
    pub quiet: bool,
    /// Replace an existing --data-dir that is not a finished demo dataset, and an existing
    /// --out run.
    #[arg(long)]
    pub overwrite: bool,
}

/// The demo dataset: 10 classes, 100 train / 20 valid PNGs of 64×64 each (the CI set).
pub fn demo_dataset(out: PathBuf) -> SynthConfig {
    SynthConfig {
        out,
        classes: 10,
        train_per_class: 100,
        valid_per_class: 20,
        test_per_class: 20,
        width: 64,
        height: 64,
        format: ImageFormatKind::Png,
        seed: 0,
    }
}

/// Writes the dataset (once; reused afterwards) and trains resnet8 at 32×32 on it.
pub fn run(args: DemoArgs) -> Result<ExitCode, CliError> {
    // The default folder is birdtrain's own: whatever an interrupted synthesis left there is
    // replaced. A folder the user names is only written into when empty (or --overwrite).
    let (data, ours) = match args.data_dir {
        Some(d) => (d, false),
        None => (
            dirs::cache_dir()
                .unwrap_or_else(std::env::temp_dir)
                .join("birdtrain")
                .join("demo-data-v1"),
            true,
        ),
    };
    // The marker is written last, so an interrupted synthesis is redone.
    let marker = data.join(".complete");
    if !marker.exists() {
        super::synth::prepare_out(&data, "--data-dir", ours || args.overwrite)?;
        outln!("writing a synthetic 10-class dataset to {}", data.display());
        write_dataset(&demo_dataset(data.clone()))?;
        std::fs::write(&marker, b"ok\n").map_err(|source| {
            CliError::Train(crate::train::TrainError::Io {
                path: marker.clone(),
                what: "write",
                source,
            })
        })?;
    } else {
        outln!("using the synthetic dataset in {}", data.display());
    }
    let train = TrainArgs {
        data: Some(data.clone()),
        gpus: args.gpus,
        model: Some("resnet8".into()),
        image_size: Some(32),
        epochs: Some(args.epochs),
        cache_dir: Some(data.join(".cache")),
        out: Some(args.out.unwrap_or_else(next_demo_dir)),
        quiet: args.quiet,
        overwrite: args.overwrite,
        ..TrainArgs::default()
    };
    train_command::run(train)
}

fn next_demo_dir() -> PathBuf {
    (1..)
        .map(|n| PathBuf::from("runs").join(format!("demo-{n}")))
        .find(|p| !p.exists())
        .expect("an unbounded range has a free name")
}
