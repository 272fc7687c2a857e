//! `birdtrain eval --checkpoint RUN --data DIR [--split valid|test]`.

use std::path::PathBuf;

use clap::Args;
use pipeline::{PipelineBuilder, Split};

use super::CliError;
use crate::train::{
    evaluate, load_weights_for_inference, CheckpointMeta, EvalReport, TrainError, Views, Weights,
};

/// Flags of `birdtrain eval`.
#[derive(Debug, Clone, Args)]
pub struct EvalArgs {
    /// Run folder holding checkpoint.json and model.safetensors.
    #[arg(long, value_name = "RUN")]
    pub checkpoint: PathBuf,
    /// Dataset root, or its CSV file (the layout used for training).
    #[arg(long, value_name = "DIR")]
    pub data: PathBuf,
    /// Split to evaluate: valid or test (or train). A test/ folder without train/, or a CSV
    /// of test rows only, is evaluated with the checkpoint's classes.
    #[arg(long, value_name = "SPLIT", default_value = "valid", value_parser = super::choice::choice::<Split>(), ignore_case = true)]
    pub split: Split,
    /// Flat layout (or a CSV file without a split column): the validation share [default:
    /// the checkpoint's, the share used in training]
    #[arg(long, value_name = "F")]
    pub valid_fraction: Option<f32>,
    /// Images per batch.
    #[arg(long, value_name = "B", default_value_t = 64)]
    pub batch_size: usize,
    /// Decode workers (default, or 0: the available cores).
    #[arg(long, value_name = "W")]
    pub workers: Option<usize>,
    /// Pixel cache folder.
    #[arg(long, value_name = "C")]
    pub cache_dir: Option<PathBuf>,
    /// Seed of the flat layout's split [default: the checkpoint's, the training seed]
    #[arg(long, value_name = "S")]
    pub seed: Option<u64>,
    /// Print one JSON object instead of the table: model, split, tta, crop_pct, ema,
    /// label_smoothing, images, loss, accuracy, top5, images_per_sec and per_class [{class,
    /// images, accuracy}].
    #[arg(long)]
    pub json: bool,
    /// Write every image's answer to FILE, one JSON object per line: path, label,
    /// predicted, probability, correct (`jq 'select(.correct|not)'` lists the mistakes).
    #[arg(long, value_name = "FILE")]
    pub predictions: Option<PathBuf>,
    /// Write the confusion matrix to FILE as CSV: a row per true class, a column per
    /// predicted class, image counts.
    #[arg(long, value_name = "FILE")]
    pub confusion: Option<PathBuf>,
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
}

/// How the images were shown to the network: the views of each, and the centred share of
/// its side.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct InputView {
    /// As stored, or averaged with the mirror image (`--tta`).
    pub views: Views,
    /// The centred share of each image's side (`--crop-pct`; 1: all of it).
    pub crop_pct: f32,
    /// The weights or their moving average (`--ema`).
    pub weights: Weights,
    /// The loss's label smoothing: the checkpoint's `--label-smoothing`, so the loss is the
    /// figure its validation lines in `metrics.jsonl` report for the same weights.
    pub label_smoothing: f32,
}

/// `--crop-pct` of `eval` and `predict`: the flag's value, else the checkpoint's, checked.
pub(crate) fn crop_pct_for(flag: Option<f32>, meta: &CheckpointMeta) -> Result<f32, CliError> {
    let f = flag.unwrap_or(meta.settings.crop_pct);
    if f > 0.0 && f <= 1.0 {
        Ok(f)
    } else {
        Err(CliError::BadValue {
            flag: "--crop-pct",
            value: f.to_string(),
            hint: "the centre crop's share of the side, in (0, 1] (timm's ImageNet default: 0.875)"
                .into(),
        })
    }
}

/// Evaluates and prints loss, top-1, top-5 and the per-class table.
pub fn run(args: EvalArgs) -> Result<(), CliError> {
    let split = args.split;
    super::paths::expect_data(
        &args.data,
        "--data must be the dataset folder or its CSV file",
    )?;
    if args.batch_size == 0 {
        return Err(CliError::BadValue {
            flag: "--batch-size",
            value: "0".into(),
            hint: "at least 1".into(),
        });
    }
    if let Some(w) = args.workers {
        super::counts::check_workers(w)?;
    }
    super::paths::check_cache_dir(args.cache_dir.as_deref())?;
    if let Some(path) = &args.predictions {
        super::paths::check_output_file(path, "--predictions takes a file to write (JSON lines)")?;
    }
    if let Some(path) = &args.confusion {
        super::paths::check_output_file(path, "--confusion takes a file to write (CSV)")?;
    }
    // No output may replace a file of the run evaluated (or of any run), land in a best/
    // folder or among the dataset's images.
    let guard = super::paths::Guarded {
        runs: vec![("--checkpoint", args.checkpoint.as_path())],
        data: Some(&args.data),
    };
    if let Some(path) = &args.predictions {
        guard.check_file("--predictions", path)?;
    }
    if let Some(path) = &args.confusion {
        guard.check_file("--confusion", path)?;
    }
    if let Some(dir) = &args.cache_dir {
        guard.check_folder("--cache-dir", dir)?;
    }
    // Neither output may overwrite the other, nor the CSV file the images are listed in.
    let mut files: Vec<(&'static str, &std::path::Path)> = Vec::new();
    if args.data.is_file() {
        files.push(("--data", &args.data));
    }
    files.extend(args.predictions.as_deref().map(|p| ("--predictions", p)));
    files.extend(args.confusion.as_deref().map(|p| ("--confusion", p)));
    super::paths::check_distinct_files(&files)?;
    // The split is listed first, so the network is sized for the batches that can really
    // come (a --batch-size beyond the split would otherwise allocate for images never seen).
    let meta = CheckpointMeta::load_weights_only(&args.checkpoint).map_err(TrainError::from)?;
    let crop_pct = crop_pct_for(args.crop_pct, &meta)?;
    let (valid_fraction, seed) = split_settings(&args, split, &meta)?;
    // The checkpoint's split rule: a run trained before per-class splitting is scored on the
    // images it held out then.
    let source = pipeline::DatasetSource::at(&args.data, valid_fraction)
        .with_split_rule(meta.settings.split_rule());
    let mut b = PipelineBuilder::new(source)
        .split(split)
        // A test set alone (a folder without train/, a CSV without train rows) is numbered
        // by the checkpoint's classes.
        .known_classes(meta.classes.clone())
        .image_size(meta.image_size)
        .store_size(meta.settings.store_size)
        .resize_mode(meta.settings.resize_mode)
        .seed(seed)
        .replicas(1)
        .batch_size(args.batch_size)
        .center_crop(Some(crop_pct))
        .shuffle(false);
    if let Some(w) = args.workers.filter(|&w| w > 0) {
        b = b.workers(w);
    }
    if let Some(c) = &args.cache_dir {
        b = b.cache_dir(c.clone());
    }
    let pipe = b.build()?;
    let weights = Weights::from_ema(args.ema);
    let mut model =
        load_weights_for_inference(&args.checkpoint, args.batch_size.min(pipe.len()), weights)?;
    model.check_classes(&pipe)?;
    let views = Views::from_tta(args.tta);
    let input = InputView {
        views,
        crop_pct,
        weights,
        label_smoothing: model.net.config().label_smoothing,
    };
    let report = evaluate(&mut model.net, &pipe, views)?;
    let classes = &model.meta.classes;
    if let Some(path) = &args.predictions {
        write_output(path, predictions_jsonl(&pipe, classes, &report).as_bytes())?;
    }
    if let Some(path) = &args.confusion {
        write_output(path, &confusion_csv(classes, &report)?)?;
    }
    if args.json {
        outln!(
            "{}",
            eval_json(&model.meta.model, split.as_str(), classes, input, &report)
        );
    } else {
        out!(
            "{}",
            format_eval(&model.meta.model, split.as_str(), classes, input, &report)
        );
    }
    Ok(())
}

/// The validation share and seed that split a flat layout (or a CSV file's rows without a
/// split column): the flags', else the checkpoint's, so eval scores the images training held
/// out. Flags that differ from the checkpoint's are taken, with one warning (that split is
/// not training's and may hold training images); a flat folder with no share known is an
/// error that says how to give one.
fn split_settings(
    args: &EvalArgs,
    split: Split,
    meta: &CheckpointMeta,
) -> Result<(Option<f32>, u64), CliError> {
    let seed = args.seed.unwrap_or(meta.seed);
    // The folder layout's train/ implies a folder; it holds its own valid/ split.
    if args.data.join("train").is_dir() {
        if let Some(f) = args.valid_fraction {
            return Err(CliError::BadValue {
                flag: "--valid-fraction",
                value: f.to_string(),
                hint: format!(
                    "{} has a train/ folder, so its {split}/ folder is the split evaluated; --valid-fraction is for flat <class>/<images> folders",
                    args.data.display()
                ),
            });
        }
        return Ok((None, seed));
    }
    let trained = meta.settings.valid_fraction;
    // A split folder alone (test/ without train/): the folder layout, numbered by the
    // checkpoint's classes. A flat layout has no test split, so test/ is never its class;
    // valid/ is read so only when training had no flat split.
    let alone = args.data.is_dir() && args.data.join(split.as_str()).is_dir();
    if alone
        && args.valid_fraction.is_none()
        && (split == Split::Test || (split == Split::Valid && trained.is_none()))
    {
        return Ok((None, seed));
    }
    let fraction = args.valid_fraction.or(trained);
    if fraction.is_none() {
        if args.data.is_dir() {
            return Err(CliError::MissingPath {
                path: args.data.join("train"),
                hint: "the folder layout needs <root>/train/<class>/; for flat <root>/<class>/ folders give the validation share used in training with --valid-fraction F (and its --seed)",
            });
        }
        return Ok((None, seed));
    }
    let mut differ = Vec::new();
    if let (Some(given), Some(trained)) = (args.valid_fraction, trained) {
        if given != trained {
            differ.push(format!("--valid-fraction {given} (trained with {trained})"));
        }
    }
    if seed != meta.seed {
        differ.push(format!("--seed {seed} (trained with {})", meta.seed));
    }
    if trained.is_some() && !differ.is_empty() {
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "warning: {}: this split is not the one training held out and may include training images (leave the flag out to use the checkpoint's)",
            differ.join(", ")
        );
    }
    Ok((fraction, seed))
}

/// Writes one of eval's output files whole (the run folder's synced temporary file and
/// rename), so a kill or a full disk leaves the old file or the new one; an error names it.
fn write_output(path: &std::path::Path, bytes: &[u8]) -> Result<(), CliError> {
    crate::train::folder::files::write_atomic(path, bytes).map_err(TrainError::from)?;
    Ok(())
}

/// Every image's answer, one JSON object per line, in the split's order.
fn predictions_jsonl(pipe: &pipeline::Pipeline, classes: &[String], r: &EvalReport) -> String {
    let mut out = String::new();
    for s in &r.samples {
        let path = pipe
            .sample_path(s.id)
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        let line = serde_json::json!({
            "path": path,
            "label": classes[s.label as usize],
            "predicted": classes[s.predicted as usize],
            "probability": as_given(s.probability),
            "correct": s.label == s.predicted,
        });
        out += &line.to_string();
        out.push('\n');
    }
    out
}

/// The confusion matrix as CSV: header `true \ predicted,<class>…`, then one row per class.
fn confusion_csv(classes: &[String], r: &EvalReport) -> Result<Vec<u8>, CliError> {
    let csv_error = |e: csv::Error| CliError::Other(anyhow::anyhow!("confusion matrix: {e}"));
    let mut w = csv::Writer::from_writer(Vec::new());
    let header = std::iter::once("true \\ predicted").chain(classes.iter().map(String::as_str));
    w.write_record(header).map_err(csv_error)?;
    let k = classes.len();
    for (class, row) in classes.iter().zip(r.confusion.chunks(k.max(1))) {
        let cells = std::iter::once(class.clone()).chain(row.iter().map(u64::to_string));
        w.write_record(cells).map_err(csv_error)?;
    }
    w.into_inner()
        .map_err(|e| CliError::Other(anyhow::anyhow!("confusion matrix: {e}")))
}

/// An `f32` setting as it was written (`0.01`), not its binary value widened to f64
/// (`0.009999999776482582`): the shortest decimal that reads back as the same f32.
pub(crate) fn as_given(value: f32) -> f64 {
    value.to_string().parse().unwrap_or(f64::from(value))
}

/// What `birdtrain eval --json` prints.
pub fn eval_json(
    model: &str,
    split: &str,
    classes: &[String],
    input: InputView,
    r: &EvalReport,
) -> String {
    let t = r.totals.finish(0, crate::train::MetricsSplit::Valid);
    let per_class: Vec<_> = classes
        .iter()
        .zip(&r.per_class)
        .map(|(class, &(correct, total))| {
            let accuracy = (total > 0).then(|| correct as f64 / total as f64);
            serde_json::json!({"class": class, "images": total, "accuracy": accuracy})
        })
        .collect();
    serde_json::json!({
        "model": model,
        "split": split,
        "tta": input.views == Views::WithMirror,
        "crop_pct": as_given(input.crop_pct),
        "ema": input.weights == Weights::MovingAverage,
        "label_smoothing": as_given(input.label_smoothing),
        "images": r.totals.count,
        "loss": t.loss,
        "accuracy": t.accuracy,
        "top5": t.top5,
        "images_per_sec": t.images_per_sec,
        "per_class": per_class,
    })
    .to_string()
}

/// The text `birdtrain eval` prints.
pub fn format_eval(
    model: &str,
    split: &str,
    classes: &[String],
    input: InputView,
    r: &EvalReport,
) -> String {
    use std::fmt::Write;
    let t = r.totals.finish(0, crate::train::MetricsSplit::Valid);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{model}{} on {split}{}{}: {} images · loss {:.4}{} · top-1 {:.4} · top-5 {:.4} · {:.0} images/s",
        if input.weights == Weights::MovingAverage {
            " (moving average of the weights)"
        } else {
            ""
        },
        if input.views == Views::WithMirror {
            " with mirror TTA"
        } else {
            ""
        },
        if input.crop_pct < 1.0 {
            format!(" (centre crop {})", input.crop_pct)
        } else {
            String::new()
        },
        r.totals.count,
        t.loss,
        if input.label_smoothing > 0.0 {
            format!(" (label smoothing {})", input.label_smoothing)
        } else {
            String::new()
        },
        t.accuracy,
        t.top5,
        t.images_per_sec
    );
    let classes: Vec<_> = classes.iter().map(|c| super::paths::printable(c)).collect();
    let width = classes.iter().map(|c| c.len()).max().unwrap_or(5).max(5);
    let _ = writeln!(s, "{:<width$}  {:>7}  {:>8}", "class", "images", "accuracy");
    for (name, &(correct, total)) in classes.iter().zip(&r.per_class) {
        let acc = if total == 0 {
            "-".to_string()
        } else {
            format!("{:.4}", correct as f64 / total as f64)
        };
        let _ = writeln!(s, "{name:<width$}  {total:>7}  {acc:>8}");
    }
    s
}
