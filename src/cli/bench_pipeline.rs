//! `birdtrain bench pipeline`: the input engine alone, one JSON line per epoch.

use std::path::PathBuf;

use clap::Args;
use pipeline::bench::{run_pipeline_bench_with, EpochReport, PipelineBenchOptions};
use pipeline::{RandomResizedCrop, Split};

use super::augment_args::AugmentArgs;
use super::choice::choice;
use super::CliError;
use crate::train::Augmentation;

/// Flags of `birdtrain bench pipeline`.
#[derive(Debug, Clone, Args)]
pub struct BenchPipelineArgs {
    /// Dataset root (train/valid[/test]/<class>/…, or <class>/… with --valid-fraction), or a
    /// CSV file listing the images.
    #[arg(long, value_name = "DIR|CSV")]
    pub data: PathBuf,
    /// Flat layout (<class>/<images>), or a CSV without a split column: the share held out
    /// for validation.
    #[arg(long, value_name = "F")]
    pub valid_fraction: Option<f32>,
    /// Split to read: train, valid or test.
    #[arg(long, value_name = "SPLIT", default_value = "train", value_parser = choice::<Split>(), ignore_case = true)]
    pub split: Split,
    /// Epochs (the first decodes and fills the cache, later ones read it).
    #[arg(long, value_name = "E", default_value_t = 3)]
    pub epochs: u64,
    /// Images per batch.
    #[arg(long, value_name = "B", default_value_t = 64)]
    pub batch_size: usize,
    /// Image size S (images handed out are S×S).
    #[arg(long, value_name = "S", default_value_t = 224)]
    pub image_size: u32,
    /// Decode workers (default, or 0: the available cores).
    #[arg(long, value_name = "W")]
    pub workers: Option<usize>,
    /// Pixel cache folder.
    #[arg(long, value_name = "C")]
    pub cache_dir: Option<PathBuf>,
    /// Batches prefetched.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub prefetch: usize,
    /// Seed of the epoch order.
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// The augmentation flags, as for training (the engine's part: --augment none or
    /// resized-crop).
    #[command(flatten)]
    pub augment: AugmentArgs,
    /// Print one JSON line per epoch (otherwise a readable line).
    #[arg(long)]
    pub json: bool,
}

/// Runs the benchmark and prints its epochs.
pub fn run(args: BenchPipelineArgs) -> Result<(), CliError> {
    let split = args.split;
    super::paths::expect_data(
        &args.data,
        "--data must be the dataset folder or its CSV file",
    )?;
    if args.epochs == 0 {
        return Err(CliError::BadValue {
            flag: "--epochs",
            value: "0".into(),
            hint: "measure at least 1 epoch (the first decodes, later ones read the cache)".into(),
        });
    }
    if let Some(w) = args.workers {
        super::counts::check_workers(w)?;
    }
    super::paths::check_cache_dir(args.cache_dir.as_deref())?;
    if let Some(dir) = &args.cache_dir {
        super::paths::Guarded {
            runs: Vec::new(),
            data: Some(&args.data),
        }
        .check_folder("--cache-dir", dir)?;
    }
    let mut opts = PipelineBenchOptions::new(&args.data);
    opts.split = split;
    opts.valid_fraction = args.valid_fraction;
    opts.epochs = args.epochs;
    opts.batch_size = args.batch_size;
    opts.image_size = args.image_size;
    let engine = &args.augment.engine;
    opts.store_size = engine.store_size;
    opts.resize_mode = engine.resize_mode.unwrap_or_default();
    opts.cache_dir = args.cache_dir.clone();
    opts.seed = args.seed;
    opts.prefetch = args.prefetch;
    if let Some(w) = args.workers.filter(|&w| w > 0) {
        opts.workers = w;
    }
    opts.crop = engine_crop(&args)?;
    opts.color_jitter = match (engine.color_jitter, engine.color_jitter_hue) {
        (None, None) => None,
        (f, h) => Some(pipeline::ColorJitter::uniform(f.unwrap_or(0.0)).with_hue(h.unwrap_or(0.0))),
    };
    opts.auto_augment = args.augment.policy(None)?;
    // Each epoch is printed as soon as it is measured.
    let json = args.json;
    run_pipeline_bench_with(&opts, |report| print_report(report, json))?;
    Ok(())
}

/// The crop asked for by `--augment` and `--crop-scale` (none by default; the pad-and-crop
/// is the model's, on the device, not the engine's).
fn engine_crop(args: &BenchPipelineArgs) -> Result<Option<RandomResizedCrop>, CliError> {
    match args.augment.augmentation(Augmentation::None)? {
        Augmentation::None => Ok(None),
        Augmentation::ResizedCrop(crop) => Ok(Some(crop)),
        Augmentation::PadCrop => Err(CliError::BadValue {
            flag: "--augment",
            value: "pad-crop".into(),
            hint: "expected none or resized-crop (the pad-and-crop is the model's, on the device, not the engine's)".into(),
        }),
    }
}

fn print_report(report: &EpochReport, json: bool) {
    if json {
        outln!(
            "{}",
            serde_json::to_string(report).expect("epoch reports serialise")
        );
    } else {
        outln!(
            "epoch {}: {} images ({} decoded) in {:.2} s = {:.1} images/s",
            report.epoch,
            report.images,
            report.decoded,
            report.seconds,
            report.images_per_sec
        );
    }
}
