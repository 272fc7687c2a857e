//! `birdtrain predict --checkpoint RUN IMAGE_OR_FOLDER…`.

use std::path::{Path, PathBuf};

use clap::Args;
use pipeline::OnBadImage;

use super::paths::printable;
use super::CliError;
use crate::train::{
    load_weights_for_inference, predict_each, PredictOptions, Prediction, TrainError, Views,
    Weights,
};

/// Flags of `birdtrain predict`.
#[derive(Debug, Clone, Args)]
pub struct PredictArgs {
    /// Run folder holding checkpoint.json and model.safetensors.
    #[arg(long, value_name = "RUN")]
    pub checkpoint: PathBuf,
    /// Classes to show per image.
    #[arg(long, value_name = "K", default_value_t = 5)]
    pub top_k: usize,
    /// One JSON object per image and line: {"path", "top": [{"class", "probability"}]}, or
    /// {"path", "error"} for a skipped file.
    #[arg(long)]
    pub json: bool,
    /// Images per batch.
    #[arg(long, value_name = "B", default_value_t = 64)]
    pub batch_size: usize,
    /// Decode workers (default: available cores).
    #[arg(long, value_name = "W")]
    pub workers: Option<usize>,
    /// A file that is no readable image: fail (stop, naming it) or skip (report it, classify
    /// the others).
    #[arg(long, value_name = "fail|skip", default_value = "fail")]
    pub on_bad_image: String,
    /// Test-time augmentation: classify each image and its mirror image and average the
    /// probabilities (twice the compute).
    #[arg(long)]
    pub tta: bool,
    /// Classify the centred square covering this share of each image's side, scaled to the
    /// model's image size [default: the checkpoint's --crop-pct]
    #[arg(long, value_name = "F")]
    pub crop_pct: Option<f32>,
    /// Use the moving average of the weights (model_ema.safetensors of a run trained with
    /// --model-ema) instead of the weights themselves.
    #[arg(long)]
    pub ema: bool,
    /// Image files, or folders whose files (all of them, sorted, hidden ones left out) are
    /// classified.
    #[arg(value_name = "IMAGE", required = true)]
    pub images: Vec<PathBuf>,
}

/// Prints the top-k classes with probabilities for each image.
pub fn run(args: PredictArgs) -> Result<(), CliError> {
    let positive = |flag: &'static str, value: usize, hint: &str| {
        if value == 0 {
            Err(CliError::BadValue {
                flag,
                value: "0".into(),
                hint: hint.into(),
            })
        } else {
            Ok(())
        }
    };
    positive("--top-k", args.top_k, "show at least 1 class per image")?;
    positive("--batch-size", args.batch_size, "at least 1")?;
    if let Some(w) = args.workers {
        super::counts::check_workers(w)?;
    }
    let on_bad_image: OnBadImage = args.on_bad_image.parse().map_err(|_| CliError::BadValue {
        flag: "--on-bad-image",
        value: args.on_bad_image.clone(),
        hint: "expected fail or skip".into(),
    })?;
    let images = expand(&args.images)?;
    let mut model = load_weights_for_inference(
        &args.checkpoint,
        args.batch_size.min(images.len()),
        Weights::from_ema(args.ema),
    )?;
    let opts = PredictOptions {
        top_k: args.top_k,
        workers: args.workers,
        on_bad_image,
        views: Views::from_tta(args.tta),
        crop_pct: super::eval::crop_pct_for(args.crop_pct, &model.meta)?,
    };
    // Each answer is printed as its batch is classified: a list cut short keeps what was done.
    let mut skipped = 0;
    predict_each(&mut model, &images, &opts, |p| {
        skipped += usize::from(p.top.is_err());
        if args.json {
            outln!("{}", json_line(&p));
        } else {
            out!("{}", text_lines(&p));
        }
    })?;
    if skipped > 0 {
        eprintln!(
            "warning: {skipped} of {} files skipped: not readable images (listed above)",
            images.len()
        );
    }
    Ok(())
}

/// The files to classify: each file as given, each folder's files walked in sorted order.
fn expand(args: &[PathBuf]) -> Result<Vec<PathBuf>, CliError> {
    const HINT: &str = "predict takes image files or folders of them";
    let mut files = Vec::new();
    for arg in args {
        match super::paths::kind_of(arg) {
            Some("a folder") => {
                let before = files.len();
                walk(arg, &mut files)?;
                if files.len() == before {
                    return Err(CliError::BadValue {
                        flag: "IMAGE",
                        value: arg.display().to_string(),
                        hint: "the folder holds no files to classify".into(),
                    });
                }
            }
            // A broken link named on the command line is a bad file like one in a folder
            // (--on-bad-image decides), not a mistyped path.
            None if arg.symlink_metadata().is_ok() => files.push(arg.clone()),
            _ => {
                super::paths::expect_file(arg, HINT)?;
                files.push(arg.clone());
            }
        }
    }
    Ok(files)
}

/// The non-hidden files under `dir`, sorted by name at each level; links are followed (a
/// loop is an error naming it). A broken link is listed like a file: classifying it fails
/// as for any unreadable file, so `--on-bad-image` decides (skip reports it, fail names it).
fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), CliError> {
    let hidden =
        |e: &walkdir::DirEntry| e.depth() > 0 && e.file_name().as_encoded_bytes()[0] == b'.';
    let entries = walkdir::WalkDir::new(dir)
        .follow_links(true)
        .sort_by_file_name()
        .into_iter()
        .filter_entry(|e| !hidden(e));
    for entry in entries {
        if let Err(e) = &entry {
            if let Some(link) = broken_link(e) {
                out.push(link);
                continue;
            }
        }
        let entry = entry.map_err(|e| {
            let path = e.path().unwrap_or(dir).to_path_buf();
            TrainError::Io {
                path,
                what: "list",
                source: e.into(),
            }
        })?;
        if !entry.file_type().is_dir() {
            out.push(entry.into_path());
        }
    }
    Ok(())
}

/// The path of a link whose target is missing, when that is what `e` is about (a hidden one,
/// left out like every hidden file, gives `None` too).
fn broken_link(e: &walkdir::Error) -> Option<PathBuf> {
    let path = e.path()?;
    let missing = e
        .io_error()
        .is_some_and(|io| io.kind() == std::io::ErrorKind::NotFound);
    let is_link = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    let hidden = path
        .file_name()
        .is_some_and(|n| n.as_encoded_bytes().first() == Some(&b'.'));
    (missing && is_link && !hidden && e.depth() > 0).then(|| path.to_path_buf())
}

/// `path` then one `  probability  class` line per class (or `  skipped: reason`).
fn text_lines(p: &Prediction) -> String {
    let mut s = format!("{}\n", printable(&p.path.to_string_lossy()));
    match &p.top {
        Ok(top) => {
            for (class, prob) in top {
                s += &format!("  {prob:>7.4}  {}\n", printable(class));
            }
        }
        Err(reason) => s += &format!("  skipped: {}\n", printable(reason)),
    }
    s
}

/// One JSON object on one line.
fn json_line(p: &Prediction) -> String {
    let path = p.path.to_string_lossy();
    let value = match &p.top {
        Ok(top) => serde_json::json!({
            "path": path,
            "top": top
                .iter()
                .map(|(class, prob)| serde_json::json!({"class": class, "probability": prob}))
                .collect::<Vec<_>>(),
        }),
        Err(reason) => serde_json::json!({"path": path, "error": reason}),
    };
    value.to_string()
}
