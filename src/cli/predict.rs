//! `birdtrain predict --checkpoint RUN IMAGE…`.

use std::path::PathBuf;

use clap::Args;

use super::paths::printable;
use super::CliError;
use crate::train::{load_checkpoint_for_inference, predict};

/// Flags of `birdtrain predict`.
#[derive(Debug, Clone, Args)]
pub struct PredictArgs {
    /// Run folder holding checkpoint.json and model.safetensors.
    #[arg(long, value_name = "RUN")]
    pub checkpoint: PathBuf,
    /// Classes to show per image.
    #[arg(long, value_name = "K", default_value_t = 5)]
    pub top_k: usize,
    /// Image files.
    #[arg(value_name = "IMAGE", required = true)]
    pub images: Vec<PathBuf>,
}

/// Prints the top-k classes with probabilities for each image.
pub fn run(args: PredictArgs) -> Result<(), CliError> {
    if args.top_k == 0 {
        return Err(CliError::BadValue {
            flag: "--top-k",
            value: "0".into(),
            hint: "show at least 1 class per image".into(),
        });
    }
    for image in &args.images {
        super::paths::expect_file(image, "predict takes image files")?;
    }
    let mut model = load_checkpoint_for_inference(&args.checkpoint, args.images.len().min(64))?;
    let scratch = scratch_dir()?;
    let result = predict(&mut model, &args.images, args.top_k, scratch.path());
    let predictions = result?;
    for p in predictions {
        println!("{}", printable(&p.path.to_string_lossy()));
        for (class, prob) in p.top {
            println!("  {prob:>7.4}  {}", printable(&class));
        }
    }
    Ok(())
}

/// A scratch folder removed on drop (the images are copied there for the engine).
fn scratch_dir() -> Result<tempfile::TempDir, CliError> {
    tempfile::Builder::new()
        .prefix("birdtrain-predict-")
        .tempdir()
        .map_err(|e| {
            CliError::Train(crate::train::TrainError::Io {
                path: std::env::temp_dir(),
                what: "create a scratch folder in",
                source: e,
            })
        })
}
