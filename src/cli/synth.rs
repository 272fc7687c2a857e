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
    /// Image size, WIDTHxHEIGHT, each side from 8 to 8192 pixels.
    #[arg(long, value_name = "WxH", default_value = "64x64")]
    pub size: String,
    /// Image format: jpg or png.
    #[arg(long, value_name = "jpg|png", default_value = "jpg")]
    pub format: String,
    /// Seed (the same seed writes the same images).
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// Write into an existing, non-empty --out: its train/, valid/ and test/ folders are
    /// replaced (nothing else in it is touched).
    #[arg(long)]
    pub overwrite: bool,
}

/// Refuses to write a dataset into an existing non-empty folder unless `overwrite` is set;
/// with it, removes the split folders a previous dataset left (so no stale class or image
/// survives next to the new ones). `flag` names the folder's flag in the message.
pub(crate) fn prepare_out(
    out: &std::path::Path,
    flag: &'static str,
    overwrite: bool,
) -> Result<(), CliError> {
    let io = |what: &'static str, path: &std::path::Path| {
        let path = path.to_path_buf();
        move |source| CliError::Train(crate::train::TrainError::Io { path, what, source })
    };
    let mut entries = match std::fs::read_dir(out) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        // Something that is there but no folder (a file, a device) is named as what it is;
        // any other failure (a path through a file, no permission) as the OS says it.
        Err(e) if out.exists() || e.kind() != std::io::ErrorKind::NotADirectory => {
            return match super::paths::expect_dir(out, "the dataset is written into a folder") {
                Ok(()) => Err(io("read", out)(e)),
                other => other,
            }
        }
        Err(e) => return Err(io("create", out)(e)),
    };
    if entries.next().is_none() {
        return Ok(());
    }
    if !overwrite {
        return Err(CliError::NotEmpty {
            path: out.to_path_buf(),
            flag,
        });
    }
    for split in ["train", "valid", "test"] {
        let dir = out.join(split);
        if dir.is_dir() {
            std::fs::remove_dir_all(&dir).map_err(io("remove", &dir))?;
        }
    }
    Ok(())
}

/// Smallest side of a synthetic image, in pixels.
pub const MIN_SIDE: u32 = 8;
/// Largest side of a synthetic image, in pixels (the input engine's largest stored size).
pub const MAX_SIDE: u32 = 8192;

/// Parses `WxH` (e.g. `64x64`).
pub fn parse_size(text: &str) -> Result<(u32, u32), CliError> {
    let bad = || CliError::BadValue {
        flag: "--size",
        value: text.to_string(),
        hint: format!(
            "expected WIDTHxHEIGHT, each from {MIN_SIDE} to {MAX_SIDE} pixels, e.g. 64x64"
        ),
    };
    let (w, h) = text.trim().split_once(['x', 'X']).ok_or_else(bad)?;
    let w: u32 = w.trim().parse().map_err(|_| bad())?;
    let h: u32 = h.trim().parse().map_err(|_| bad())?;
    if !(MIN_SIDE..=MAX_SIDE).contains(&w) || !(MIN_SIDE..=MAX_SIDE).contains(&h) {
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
    prepare_out(&args.out, "--out", args.overwrite)?;
    let summary = write_dataset(&cfg)?;
    outln!(
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
