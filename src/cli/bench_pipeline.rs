//! `birdtrain bench pipeline`: the input engine alone, one JSON line per epoch.

use std::path::PathBuf;

use clap::Args;
use pipeline::bench::{run_pipeline_bench_with, EpochReport, PipelineBenchOptions};
use pipeline::{RandomResizedCrop, ResizeMode, Split};

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
    #[arg(long, value_name = "SPLIT", default_value = "train")]
    pub split: String,
    /// Epochs (the first decodes and fills the cache, later ones read it).
    #[arg(long, value_name = "E", default_value_t = 3)]
    pub epochs: u64,
    /// Images per batch.
    #[arg(long, value_name = "B", default_value_t = 64)]
    pub batch_size: usize,
    /// Image size S (images handed out are S×S).
    #[arg(long, value_name = "S", default_value_t = 224)]
    pub image_size: u32,
    /// Side of the cached squares, at least S (default: S): every image is then scaled
    /// from its stored square.
    #[arg(long, value_name = "S")]
    pub store_size: Option<u32>,
    /// Decode workers (default, or 0: the available cores).
    #[arg(long, value_name = "W")]
    pub workers: Option<usize>,
    /// Pixel cache folder.
    #[arg(long, value_name = "C")]
    pub cache_dir: Option<PathBuf>,
    /// Resize: direct (stretch to S×S) or center-crop (shorter side, centred square).
    #[arg(long, value_name = "direct|center-crop", default_value = "direct")]
    pub resize_mode: String,
    /// Batches prefetched.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub prefetch: usize,
    /// Seed of the epoch order.
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// What the engine does to each image after the cache: none, or resized-crop (the
    /// training's random resized crop, cut at every epoch).
    #[arg(long, value_name = "none|resized-crop", default_value = "none")]
    pub augment: String,
    /// With --augment resized-crop: the least share of the image's area a crop covers.
    #[arg(long, value_name = "MIN")]
    pub crop_scale: Option<f32>,
    /// Colour jitter of every image (brightness, contrast and saturation), as for training.
    #[arg(long, value_name = "F")]
    pub color_jitter: Option<f32>,
    /// The hue part of the colour jitter, as for training.
    #[arg(long, value_name = "H")]
    pub color_jitter_hue: Option<f32>,
    /// Automatic augmentation of every image (ta_wide, ra, augmix, imagenet, cifar10, svhn or
    /// none), as for training.
    #[arg(long, value_name = "ta_wide|ra|augmix|imagenet|cifar10|svhn|none")]
    pub auto_augment: Option<String>,
    /// With --auto-augment ra: the strength bin of every operation (0 to 30).
    #[arg(long, value_name = "M")]
    pub ra_magnitude: Option<u32>,
    /// With --auto-augment augmix: the operations' strength (1 to 10).
    #[arg(long, value_name = "S")]
    pub augmix_severity: Option<u32>,
    /// Print one JSON line per epoch (otherwise a readable line).
    #[arg(long)]
    pub json: bool,
}

/// Runs the benchmark and prints its epochs.
pub fn run(args: BenchPipelineArgs) -> Result<(), CliError> {
    let split: Split = args.split.parse().map_err(|_| CliError::BadValue {
        flag: "--split",
        value: args.split.clone(),
        hint: "expected train, valid or test".into(),
    })?;
    super::paths::expect_data(
        &args.data,
        "--data must be the dataset folder or its CSV file",
    )?;
    let resize_mode: ResizeMode = args.resize_mode.parse().map_err(|_| CliError::BadValue {
        flag: "--resize-mode",
        value: args.resize_mode.clone(),
        hint: "expected direct or center-crop".into(),
    })?;
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
    opts.store_size = args.store_size;
    opts.resize_mode = resize_mode;
    opts.cache_dir = args.cache_dir.clone();
    opts.seed = args.seed;
    opts.prefetch = args.prefetch;
    if let Some(w) = args.workers.filter(|&w| w > 0) {
        opts.workers = w;
    }
    opts.crop = engine_crop(&args)?;
    opts.color_jitter = match (args.color_jitter, args.color_jitter_hue) {
        (None, None) => None,
        (f, h) => Some(pipeline::ColorJitter::uniform(f.unwrap_or(0.0)).with_hue(h.unwrap_or(0.0))),
    };
    opts.auto_augment = auto_augment(&args)?;
    // Each epoch is printed as soon as it is measured.
    let json = args.json;
    run_pipeline_bench_with(&opts, |report| print_report(report, json))?;
    Ok(())
}

/// The policy asked for by `--auto-augment`, `--ra-magnitude` and `--augmix-severity`.
fn auto_augment(args: &BenchPipelineArgs) -> Result<Option<pipeline::AutoAugment>, CliError> {
    let mut policy = match &args.auto_augment {
        None => None,
        Some(word) => super::train_args::parse_policy(word)?,
    };
    super::train_args::set_policy_strength(&mut policy, args.ra_magnitude, args.augmix_severity)?;
    Ok(policy)
}

/// The crop asked for by `--augment` and `--crop-scale`.
fn engine_crop(args: &BenchPipelineArgs) -> Result<Option<RandomResizedCrop>, CliError> {
    let crop = match Augmentation::parse(&args.augment) {
        Some(Augmentation::None) => None,
        Some(Augmentation::ResizedCrop(crop)) => Some(crop),
        Some(Augmentation::PadCrop) | None => {
            return Err(CliError::BadValue {
                flag: "--augment",
                value: args.augment.clone(),
                hint: "expected none or resized-crop (the pad-and-crop is the model's, on the device, not the engine's)".into(),
            })
        }
    };
    // The engine checks the range when it is built.
    match (crop, args.crop_scale) {
        (None, Some(min)) => Err(CliError::BadValue {
            flag: "--crop-scale",
            value: min.to_string(),
            hint: "it sets the resized crop: add --augment resized-crop".into(),
        }),
        (Some(_), Some(min)) => Ok(Some(RandomResizedCrop::with_min_scale(min))),
        (crop, None) => Ok(crop),
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
