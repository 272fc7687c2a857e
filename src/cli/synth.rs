//! `birdtrain synth`: write a synthetic dataset in the 285-birds layout.

use std::path::PathBuf;

use clap::Args;
use pipeline::synth::{write_dataset, ImageFormatKind, SynthConfig};

use super::CliError;

/// Flags of `birdtrain synth`.
#[derive(Debug, Clone, Args)]
pub struct SynthArgs {
    /// Output folder (train/, valid/, test/ are created inside).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Number of classes.
    #[arg(long, value_name = "K", default_value_t = 10)]
    pub classes: usize,
    /// Training images per class.
    #[arg(long, value_name = "N", default_value_t = 100)]
    pub train_per_class: usize,
    /// Validation images per class.
    #[arg(long, value_name = "M", default_value_t = 20)]
    pub valid_per_class: usize,
    /// Test images per class.
    #[arg(long, value_name = "T", default_value_t = 0)]
    pub test_per_class: usize,
    /// Image size, WIDTHxHEIGHT.
    #[arg(long, value_name = "WxH", default_value = "64x64")]
    pub size: String,
    /// Image format: jpg or png.
    #[arg(long, value_name = "jpg|png", default_value = "jpg")]
    pub format: String,
    /// Seed (the same seed writes the same images).
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
}

/// Parses `WxH` (e.g. `64x64`).
pub fn parse_size(text: &str) -> Result<(u32, u32), CliError> {
    let bad = || CliError::BadValue {
        flag: "--size",
        value: text.to_string(),
        hint: "expected WIDTHxHEIGHT with both at least 8, e.g. 64x64".into(),
    };
    let (w, h) = text.trim().split_once(['x', 'X']).ok_or_else(bad)?;
    let w: u32 = w.trim().parse().map_err(|_| bad())?;
    let h: u32 = h.trim().parse().map_err(|_| bad())?;
    if w < 8 || h < 8 || w > 8192 || h > 8192 {
        return Err(bad());
    }
    Ok((w, h))
}

/// Parses `jpg` / `jpeg` / `png`.
pub fn parse_format(text: &str) -> Result<ImageFormatKind, CliError> {
    match text.trim().to_ascii_lowercase().as_str() {
        "jpg" | "jpeg" => Ok(ImageFormatKind::Jpg),
        "png" => Ok(ImageFormatKind::Png),
        _ => Err(CliError::BadValue {
            flag: "--format",
            value: text.to_string(),
            hint: "expected jpg or png".into(),
        }),
    }
}

/// The library configuration for these flags.
pub fn to_config(args: &SynthArgs) -> Result<SynthConfig, CliError> {
    let (width, height) = parse_size(&args.size)?;
    if args.classes == 0 || args.train_per_class == 0 {
        return Err(CliError::BadValue {
            flag: "--classes/--train-per-class",
            value: format!("{}/{}", args.classes, args.train_per_class),
            hint: "at least one class and one training image per class".into(),
        });
    }
    Ok(SynthConfig {
        out: args.out.clone(),
        classes: args.classes,
        train_per_class: args.train_per_class,
        valid_per_class: args.valid_per_class,
        test_per_class: args.test_per_class,
        width,
        height,
        format: parse_format(&args.format)?,
        seed: args.seed,
    })
}

/// Writes the dataset and prints what was written.
pub fn run(args: SynthArgs) -> Result<(), CliError> {
    let cfg = to_config(&args)?;
    let summary = write_dataset(&cfg)?;
    println!(
        "wrote {} {}x{} {} images ({} train, {} valid, {} test) in {} classes to {}",
        summary.files.iter().sum::<usize>(),
        cfg.width,
        cfg.height,
        args.format,
        summary.files[0],
        summary.files[1],
        summary.files[2],
        summary.classes.len(),
        summary.out.display()
    );
    Ok(())
}
