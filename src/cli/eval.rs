//! `birdtrain eval --checkpoint RUN --data DIR [--split valid|test]`.

use std::path::PathBuf;

use clap::Args;
use pipeline::{DatasetSource, PipelineBuilder, Split};

use super::CliError;
use crate::train::{
    evaluate, load_checkpoint_for_inference, CheckpointMeta, EvalReport, TrainError,
};

/// Flags of `birdtrain eval`.
#[derive(Debug, Clone, Args)]
pub struct EvalArgs {
    /// Run folder holding checkpoint.json and model.safetensors.
    #[arg(long, value_name = "RUN")]
    pub checkpoint: PathBuf,
    /// Dataset root (the layout used for training).
    #[arg(long, value_name = "DIR")]
    pub data: PathBuf,
    /// Split to evaluate: valid or test (or train).
    #[arg(long, value_name = "valid|test", default_value = "valid")]
    pub split: String,
    /// Flat layout: the validation share used in training.
    #[arg(long, value_name = "F")]
    pub valid_fraction: Option<f32>,
    /// Images per batch.
    #[arg(long, value_name = "B", default_value_t = 64)]
    pub batch_size: usize,
    /// Decode workers (default: available cores).
    #[arg(long, value_name = "W")]
    pub workers: Option<usize>,
    /// Pixel cache folder.
    #[arg(long, value_name = "C")]
    pub cache_dir: Option<PathBuf>,
    /// Seed of the flat layout's split (the training seed).
    #[arg(long, value_name = "S")]
    pub seed: Option<u64>,
}

/// Evaluates and prints loss, top-1, top-5 and the per-class table.
pub fn run(args: EvalArgs) -> Result<(), CliError> {
    let split: Split = args.split.parse().map_err(|_| CliError::BadValue {
        flag: "--split",
        value: args.split.clone(),
        hint: "expected valid or test (or train)".into(),
    })?;
    super::paths::expect_dir(&args.data, "--data must be the dataset folder")?;
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
    // The split is listed first, so the network is sized for the batches that can really
    // come (a --batch-size beyond the split would otherwise allocate for images never seen).
    let meta = CheckpointMeta::load_weights_only(&args.checkpoint).map_err(TrainError::from)?;
    let source = match args.valid_fraction {
        Some(f) => DatasetSource::flat(&args.data, f),
        None => DatasetSource::folder(&args.data),
    };
    let mut b = PipelineBuilder::new(source)
        .split(split)
        .image_size(meta.image_size)
        .seed(args.seed.unwrap_or(meta.seed))
        .replicas(1)
        .batch_size(args.batch_size)
        .shuffle(false);
    if let Some(w) = args.workers {
        b = b.workers(w);
    }
    if let Some(c) = &args.cache_dir {
        b = b.cache_dir(c.clone());
    }
    let pipe = b.build()?;
    let mut model =
        load_checkpoint_for_inference(&args.checkpoint, args.batch_size.min(pipe.len()))?;
    model.check_classes(&pipe)?;
    let report = evaluate(&mut model.net, &pipe)?;
    print!(
        "{}",
        format_eval(&model.meta.model, &args.split, &model.meta.classes, &report)
    );
    Ok(())
}

/// The text `birdtrain eval` prints.
pub fn format_eval(model: &str, split: &str, classes: &[String], r: &EvalReport) -> String {
    use std::fmt::Write;
    let t = r.totals.finish(0, crate::train::MetricsSplit::Valid);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{model} on {split}: {} images · loss {:.4} · top-1 {:.4} · top-5 {:.4} · {:.0} images/s",
        r.totals.count, t.loss, t.accuracy, t.top5, t.images_per_sec
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
