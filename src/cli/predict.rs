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
    /// Decode workers (default, or 0: the available cores).
    #[arg(long, value_name = "W")]
    pub workers: Option<usize>,
    /// A file that is no readable image (or a link loop in a folder): fail (stop, naming it)
    /// or skip (report it, classify the others).
    #[arg(long, value_name = "POLICY", default_value = "fail", value_parser = super::choice::choice::<OnBadImage>(), ignore_case = true)]
    pub on_bad_image: OnBadImage,
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
    let on_bad_image = args.on_bad_image;
    let listed = expand(&args.images, on_bad_image)?;
    let images: Vec<PathBuf> = listed
        .iter()
        .filter_map(|l| match l {
            Listed::File(path) => Some(path.clone()),
            Listed::Skipped(..) => None,
        })
        .collect();
    let print = |p: &Prediction| {
        if args.json {
            outln!("{}", json_line(p));
        } else {
            out!("{}", text_lines(p));
        }
    };
    if images.is_empty() {
        // Every entry is a link loop skipped: each is reported, and nothing is classified.
        for l in &listed {
            if let Listed::Skipped(path, reason) = l {
                print(&Prediction {
                    path: path.clone(),
                    top: Err(reason.clone()),
                });
            }
        }
        return Err(CliError::BadValue {
            flag: "IMAGE",
            value: args.images[0].display().to_string(),
            hint: "no file to classify: every entry is a link loop (listed above)".into(),
        });
    }
    let mut model = load_weights_for_inference(
        &args.checkpoint,
        args.batch_size.min(images.len()),
        Weights::from_ema(args.ema),
    )?;
    let opts = PredictOptions {
        top_k: args.top_k,
        workers: args.workers.filter(|&w| w > 0),
        on_bad_image,
        views: Views::from_tta(args.tta),
        crop_pct: super::eval::crop_pct_for(args.crop_pct, &model.meta)?,
    };
    // Each answer is printed as its batch is classified: a list cut short keeps what was done.
    // The entries the listing skipped (link loops) are printed in their place.
    let mut skipped = 0;
    let mut pending = listed.iter().peekable();
    let print_skipped_before = |pending: &mut std::iter::Peekable<std::slice::Iter<'_, Listed>>,
                                skipped: &mut usize| {
        while let Some(Listed::Skipped(path, reason)) = pending.peek() {
            *skipped += 1;
            print(&Prediction {
                path: path.clone(),
                top: Err(reason.clone()),
            });
            pending.next();
        }
    };
    predict_each(&mut model, &images, &opts, |p| {
        print_skipped_before(&mut pending, &mut skipped);
        pending.next();
        skipped += usize::from(p.top.is_err());
        print(&p);
    })?;
    print_skipped_before(&mut pending, &mut skipped);
    if skipped > 0 {
        eprintln!(
            "warning: {skipped} of {} files skipped: not readable images (listed above)",
            listed.len()
        );
    }
    Ok(())
}

/// An entry of the listing: a file to classify, or one skipped with its reason (a link
/// loop, with `--on-bad-image skip`).
enum Listed {
    File(PathBuf),
    Skipped(PathBuf, String),
}

/// The files to classify: each file as given, each folder's files walked in sorted order.
/// With `--on-bad-image skip`, a link loop in a folder is listed as skipped (training skips
/// such an entry too); with `fail` it is an error naming it.
fn expand(args: &[PathBuf], on_bad_image: OnBadImage) -> Result<Vec<Listed>, CliError> {
    const HINT: &str = "predict takes image files or folders of them";
    let mut files = Vec::new();
    for arg in args {
        match super::paths::kind_of(arg) {
            Some("a folder") => {
                let before = files.len();
                walk(arg, on_bad_image, &mut files)?;
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
            None if arg.symlink_metadata().is_ok() => files.push(Listed::File(arg.clone())),
            _ => {
                super::paths::expect_file(arg, HINT)?;
                files.push(Listed::File(arg.clone()));
            }
        }
    }
    Ok(files)
}

/// The non-hidden files under `dir`, sorted by name at each level; links are followed (a
/// loop is skipped or an error naming it, as `on_bad_image` says). A broken link is listed
/// like a file: classifying it fails as for any unreadable file, so `--on-bad-image` decides
/// (skip reports it, fail names it).
fn walk(dir: &Path, on_bad_image: OnBadImage, out: &mut Vec<Listed>) -> Result<(), CliError> {
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
                out.push(Listed::File(link));
                continue;
            }
            if let (Some(ancestor), Some(path), OnBadImage::Skip) =
                (e.loop_ancestor(), e.path(), on_bad_image)
            {
                out.push(Listed::Skipped(
                    path.to_path_buf(),
                    format!(
                        "a link loop: it leads back to {}",
                        printable(&ancestor.to_string_lossy())
                    ),
                ));
                continue;
            }
        }
        let entry = entry.map_err(|e| {
            let path = e.path().unwrap_or(dir).to_path_buf();
            let source = if e.loop_ancestor().is_some() {
                std::io::Error::other(format!(
                    "{e} (hint: remove the link, or --on-bad-image skip passes over it)"
                ))
            } else {
                e.into()
            };
            TrainError::Io {
                path,
                what: "list",
                source,
            }
        })?;
        if !entry.file_type().is_dir() {
            out.push(Listed::File(entry.into_path()));
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
                .map(|(class, prob)| {
                    serde_json::json!({"class": class, "probability": super::eval::as_given(*prob)})
                })
                .collect::<Vec<_>>(),
        }),
        Err(reason) => serde_json::json!({"path": path, "error": reason}),
    };
    value.to_string()
}
