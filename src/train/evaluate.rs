//! Validation, `birdtrain eval` and `birdtrain predict`: inference with a network in eval mode.

use std::path::{Path, PathBuf};

use pipeline::{DatasetSource, OnBadImage, Pipeline, PipelineBuilder, PipelineError, Split};

use super::folder::checkpoint::{CheckpointMeta, MODEL_FILE};
use super::folder::metrics::MetricsAccumulator;
use super::folder::FolderError;
use super::TrainError;
use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::model::{Arch, Graph, HeadPolicy, InputBatch, ModelState, Network};

/// Loss, top-1, top-5 and per-class accuracy of a network on one split.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalReport {
    /// Sums over the split (seconds included).
    pub totals: MetricsAccumulator,
    /// Per class: (correct top-1, images), index = label.
    pub per_class: Vec<(u64, u64)>,
}

/// Runs `net` in eval mode over every batch of epoch 0 of `pipe` (build it with
/// `shuffle(false)` and one replica).
pub fn evaluate<B: Backend>(
    net: &mut Network<B>,
    pipe: &Pipeline,
) -> Result<EvalReport, TrainError> {
    let start = std::time::Instant::now();
    let classes = net.graph().num_classes();
    let mut totals = MetricsAccumulator::default();
    let mut per_class = vec![(0u64, 0u64); classes];
    for batch in pipe.epoch(0, 0, 0)? {
        let batch = batch?;
        if batch.len == 0 {
            continue;
        }
        let labels = batch.labels();
        let input = InputBatch {
            pixels: batch.pixels(),
            labels,
            len: batch.len,
            image_size: batch.image_size,
            augment: None,
        };
        let (stats, probs) = net.eval_step(&input)?;
        totals.add(
            stats.loss_sum,
            stats.correct_top1 as u64,
            stats.correct_top5 as u64,
            stats.count as u64,
        );
        for (i, &label) in labels[..batch.len].iter().enumerate() {
            let row = &probs[i * classes..(i + 1) * classes];
            let best = argmax(row);
            if let Some(entry) = per_class.get_mut(label as usize) {
                entry.1 += 1;
                entry.0 += u64::from(best == label as usize);
            }
        }
    }
    totals.seconds = start.elapsed().as_secs_f64();
    Ok(EvalReport { totals, per_class })
}

fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &p)| {
            if p > best.1 {
                (i, p)
            } else {
                best
            }
        })
        .0
}

/// A checkpoint loaded on the CPU for inference.
pub struct InferenceModel {
    /// The run folder it came from.
    pub run: PathBuf,
    /// Its sidecar.
    pub meta: CheckpointMeta,
    /// The network (CPU backend, eval mode).
    pub net: Network<CpuBackend>,
}

impl std::fmt::Debug for InferenceModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InferenceModel")
            .field("run", &self.run)
            .field("model", &self.meta.model)
            .field("classes", &self.meta.classes.len())
            .finish()
    }
}

/// Loads `run/model.safetensors` with its sidecar onto the CPU, for batches of up to
/// `max_batch` images (whatever replica count or device trained it).
pub fn load_checkpoint_for_inference(
    run: &Path,
    max_batch: usize,
) -> Result<InferenceModel, TrainError> {
    // Inference needs the weights only: a run folder copied without its optimizer state works.
    let meta = CheckpointMeta::load_weights_only(run)?;
    let arch: Arch =
        meta.model
            .parse()
            .map_err(|e: crate::model::ModelError| FolderError::BadRunDir {
                path: run.to_path_buf(),
                reason: e.to_string(),
            })?;
    let graph = Graph::new(arch, meta.classes.len());
    let state =
        ModelState::load_safetensors(&graph, &run.join(&meta.model_file), HeadPolicy::Strict)?;
    let mut net = Network::new(
        CpuBackend::new(0)?,
        &graph,
        max_batch.max(1),
        meta.image_size,
    )?;
    net.load_state(&state)?;
    debug_assert_eq!(MODEL_FILE, "model.safetensors");
    Ok(InferenceModel {
        run: run.to_path_buf(),
        meta,
        net,
    })
}

impl InferenceModel {
    /// Checks that `pipe` has the checkpoint's classes in the same order.
    pub fn check_classes(&self, pipe: &Pipeline) -> Result<(), TrainError> {
        if pipe.classes() != self.meta.classes.as_slice() {
            return Err(TrainError::CheckpointMismatch {
                path: self.run.clone(),
                what: "class list",
                expected: summarise(pipe.classes()),
                found: summarise(&self.meta.classes),
                hint: "evaluate on the dataset the checkpoint was trained on",
            });
        }
        Ok(())
    }
}

/// A name for one line of output: control characters (a newline in a class folder's name)
/// are written as escapes, so each record stays on its line.
pub fn printable(name: &str) -> std::borrow::Cow<'_, str> {
    if !name.chars().any(char::is_control) {
        return name.into();
    }
    name.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect::<String>()
        .into()
}

/// "10 classes: a, b, c, …".
pub(crate) fn summarise(classes: &[String]) -> String {
    let shown: Vec<_> = classes.iter().take(4).map(|c| printable(c)).collect();
    let more = if classes.len() > 4 { ", …" } else { "" };
    format!("{} classes: {}{more}", classes.len(), shown.join(", "))
}

/// One image's top-k classes.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// The image file.
    pub path: PathBuf,
    /// (class name, probability), most likely first.
    pub top: Vec<(String, f32)>,
}

/// Classifies image files with a loaded checkpoint: decoded and resized by the input engine
/// exactly as training images were (same decoder, same resize), top `k` classes each.
///
/// The images are copied into a scratch folder laid out as a one-class dataset, so the
/// engine's public API does the decoding; `scratch` holds that copy and its pixel cache.
pub fn predict(
    model: &mut InferenceModel,
    images: &[PathBuf],
    k: usize,
    scratch: &Path,
) -> Result<Vec<Prediction>, TrainError> {
    let class_dir = scratch.join("train").join("input");
    let io = |path: &Path, what: &'static str| {
        let path = path.to_path_buf();
        move |source| TrainError::Io { path, what, source }
    };
    std::fs::create_dir_all(&class_dir).map_err(io(&class_dir, "create"))?;
    let mut staged = Vec::with_capacity(images.len());
    for (i, image) in images.iter().enumerate() {
        let name = image
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "image".into());
        // The index prefix keeps the engine's file order equal to the argument order.
        let dst = class_dir.join(format!("{i:06}_{name}"));
        let bytes = std::fs::copy(image, &dst).map_err(io(image, "read"))?;
        // The engine skips an empty file when it lists the folder, before any error could
        // name it: name the user's file here.
        if bytes == 0 {
            return Err(TrainError::BadImage {
                path: image.clone(),
                reason: "the file is empty (zero bytes)".into(),
            });
        }
        staged.push(dst);
    }
    // Errors name the user's file, not its staged copy.
    let unstage = |e: PipelineError| match e {
        PipelineError::BadImage { path, kind, .. } => {
            let original = staged
                .iter()
                .position(|p| *p == path)
                .map_or(path, |i| images[i].clone());
            TrainError::BadImage {
                path: original,
                reason: kind.to_string(),
            }
        }
        other => TrainError::Pipeline(other),
    };
    let batch = model.net.max_batch();
    let pipe = PipelineBuilder::new(DatasetSource::folder(scratch))
        .split(Split::Train)
        .image_size(model.meta.image_size)
        .cache_dir(scratch.join("cache"))
        .batch_size(batch)
        .replicas(1)
        .workers(1)
        .shuffle(false)
        .on_bad_image(OnBadImage::Fail)
        .build()
        .map_err(unstage)?;
    let classes = model.meta.classes.len();
    let mut out = Vec::with_capacity(images.len());
    for b in pipe.epoch(0, 0, 0).map_err(unstage)? {
        let b = b.map_err(unstage)?;
        if b.len == 0 {
            continue;
        }
        let zero_labels = vec![0u32; b.len];
        let input = InputBatch {
            pixels: b.pixels(),
            labels: &zero_labels,
            len: b.len,
            image_size: b.image_size,
            augment: None,
        };
        let (_, probs) = model.net.eval_step(&input)?;
        for i in 0..b.len {
            let row = &probs[i * classes..(i + 1) * classes];
            let mut order: Vec<usize> = (0..classes).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            let top = order
                .into_iter()
                .take(k.max(1))
                .map(|c| (model.meta.classes[c].clone(), row[c]))
                .collect();
            out.push(top);
        }
    }
    // shuffle(false) keeps file order, which the index prefix made the argument order.
    Ok(out
        .into_iter()
        .zip(images)
        .map(|(top, path)| Prediction {
            path: path.clone(),
            top,
        })
        .collect())
}
