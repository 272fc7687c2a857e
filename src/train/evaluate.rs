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
    /// Images per (true class, top-1 class), row-major `classes × classes`.
    pub confusion: Vec<u64>,
    /// Every image's top-1 answer, in the split's order.
    pub samples: Vec<SampleResult>,
}

/// The top-1 answer for one image of an evaluated split.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleResult {
    /// Its index in the split ([`Pipeline::sample_path`] names the file).
    pub id: u64,
    /// Its class.
    pub label: u32,
    /// The most likely class.
    pub predicted: u32,
    /// That class's probability.
    pub probability: f32,
}

/// Which views of each image inference classifies (test-time augmentation).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Views {
    /// The image as stored.
    #[default]
    AsStored,
    /// The image as stored and mirrored left to right, their probabilities averaged
    /// (`--tta`; twice the compute).
    WithMirror,
}

impl Views {
    /// `--tta` on the command line.
    pub fn from_tta(tta: bool) -> Self {
        if tta {
            Self::WithMirror
        } else {
            Self::AsStored
        }
    }
}

/// One batch through `net` in eval mode with `views`: statistics and probabilities.
fn classify<B: Backend>(
    net: &mut Network<B>,
    input: &InputBatch<'_>,
    views: Views,
) -> Result<(crate::model::StepStats, Vec<f32>), TrainError> {
    Ok(match views {
        Views::AsStored => net.eval_step(input)?,
        Views::WithMirror => net.eval_step_mirrored(input)?,
    })
}

/// Runs `net` in eval mode over every batch of epoch 0 of `pipe` (build it with
/// `shuffle(false)` and one replica), classifying `views` of each image.
pub fn evaluate<B: Backend>(
    net: &mut Network<B>,
    pipe: &Pipeline,
    views: Views,
) -> Result<EvalReport, TrainError> {
    let never = || false;
    evaluate_until(net, pipe, views, &never)?
        .ok_or_else(|| TrainError::Internal("an evaluation nobody stopped stopped".into()))
}

/// [`evaluate`], asking `stop` before every batch: `None` once it says yes (Ctrl-C or SIGTERM
/// during the validation of a training run, which then stops without waiting for the pass).
pub(crate) fn evaluate_until<B: Backend>(
    net: &mut Network<B>,
    pipe: &Pipeline,
    views: Views,
    stop: &dyn Fn() -> bool,
) -> Result<Option<EvalReport>, TrainError> {
    evaluate_share_until(net, pipe, 0, views, stop)
}

/// [`evaluate_until`] over replica `share`'s slice of the split only (a training run's
/// ranks each validate theirs, `pipe` built with one replica per rank and `shuffle(false)`):
/// the shares' figures add up to the whole split's, up to the order of the loss sums. A share
/// may hold no image.
pub(crate) fn evaluate_share_until<B: Backend>(
    net: &mut Network<B>,
    pipe: &Pipeline,
    share: usize,
    views: Views,
    stop: &dyn Fn() -> bool,
) -> Result<Option<EvalReport>, TrainError> {
    let start = std::time::Instant::now();
    let classes = net.graph().num_classes();
    let mut totals = MetricsAccumulator::default();
    let mut per_class = vec![(0u64, 0u64); classes];
    let mut confusion = vec![0u64; classes * classes];
    let mut samples = Vec::with_capacity(pipe.len().div_ceil(pipe.replicas()));
    for batch in pipe.epoch(0, share, 0)? {
        if stop() {
            return Ok(None);
        }
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
            mix: None,
        };
        let (stats, probs) = classify(net, &input, views)?;
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
                confusion[label as usize * classes + best] += 1;
            }
            samples.push(SampleResult {
                id: batch.sample_ids[i],
                label,
                predicted: best as u32,
                probability: row[best],
            });
        }
    }
    totals.seconds = start.elapsed().as_secs_f64();
    Ok(Some(EvalReport {
        totals,
        per_class,
        confusion,
        samples,
    }))
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

/// Which of a checkpoint's weights inference uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Weights {
    /// The weights training reached (`model.safetensors`).
    #[default]
    Trained,
    /// Their moving average (`model_ema.safetensors`, a run with `--model-ema`; `--ema`).
    MovingAverage,
}

impl Weights {
    /// `--ema` on the command line.
    pub fn from_ema(ema: bool) -> Self {
        if ema {
            Self::MovingAverage
        } else {
            Self::Trained
        }
    }
}

/// Loads `run/model.safetensors` with its sidecar onto the CPU, for batches of up to
/// `max_batch` images (whatever replica count or device trained it).
pub fn load_checkpoint_for_inference(
    run: &Path,
    max_batch: usize,
) -> Result<InferenceModel, TrainError> {
    load_weights_for_inference(run, max_batch, Weights::Trained)
}

/// [`load_checkpoint_for_inference`] with the checkpoint's `weights` of choice.
pub fn load_weights_for_inference(
    run: &Path,
    max_batch: usize,
    weights: Weights,
) -> Result<InferenceModel, TrainError> {
    // Inference needs the weights only: a run folder copied without its optimizer state works.
    let meta = CheckpointMeta::load_weights_only(run)?;
    let file = match weights {
        Weights::Trained => meta.model_file.clone(),
        Weights::MovingAverage => {
            let Some((file, sum)) = meta.model_ema() else {
                return Err(FolderError::BadRunDir {
                    path: run.to_path_buf(),
                    reason: "it holds no moving average of the weights (it was trained without --model-ema): leave out --ema".into(),
                }
                .into());
            };
            meta.check_file(run, file, sum)?;
            file.clone()
        }
    };
    let arch: Arch =
        meta.model
            .parse()
            .map_err(|e: crate::model::ModelError| FolderError::BadRunDir {
                path: run.to_path_buf(),
                reason: e.to_string(),
            })?;
    let graph = Graph::new(arch, meta.classes.len());
    let state = ModelState::load_safetensors(&graph, &run.join(file), HeadPolicy::Strict)?;
    let mut net = Network::new(
        CpuBackend::new(0)?,
        &graph,
        max_batch.max(1),
        meta.image_size,
    )?;
    net.load_state(&state)?;
    // The loss the run validated with (Keras and torchvision's reference script validate
    // with the training criterion), so `eval` repeats the figures of `metrics.jsonl`.
    net.set_config(crate::model::NetworkConfig {
        label_smoothing: meta.settings.label_smoothing,
        ..net.config()
    });
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
    // Joined by ", ", a name holding a comma (or edge spaces, or nothing) would read as two
    // classes, or none: then every name is quoted.
    let ambiguous = classes
        .iter()
        .any(|c| c.contains(',') || c.trim() != c || c.is_empty());
    let shown: Vec<String> = classes
        .iter()
        .take(4)
        .map(|c| {
            if ambiguous {
                format!("`{}`", printable(c))
            } else {
                printable(c).into_owned()
            }
        })
        .collect();
    let more = if classes.len() > 4 { ", …" } else { "" };
    let noun = if classes.len() == 1 {
        "class"
    } else {
        "classes"
    };
    format!("{} {noun}: {}{more}", classes.len(), shown.join(", "))
}

/// One image's top-k classes, or why it could not be read.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// The image file.
    pub path: PathBuf,
    /// (class name, probability), most likely first; or the reason the file was skipped
    /// (with [`OnBadImage::Skip`]).
    pub top: Result<Vec<(String, f32)>, String>,
}

/// How [`predict`] reads its images.
#[derive(Debug, Clone)]
pub struct PredictOptions {
    /// Classes per image, most likely first.
    pub top_k: usize,
    /// Decode workers (`None`: the engine's default).
    pub workers: Option<usize>,
    /// A file that is no readable image: fail naming it, or skip it with its reason.
    pub on_bad_image: OnBadImage,
    /// The views of each image classified (`--tta`).
    pub views: Views,
    /// The centred share of each image's side classified (`--crop-pct`; 1: all of it).
    pub crop_pct: f32,
}

/// Classifies image files with a loaded checkpoint: decoded and resized by the input engine
/// exactly as training images were (same decoder, same resize), in batches of the network's
/// `max_batch`. The answer has one entry per file, in the order given (a file named twice
/// gets two). Each file is read once, so no pixel cache is written.
pub fn predict(
    model: &mut InferenceModel,
    images: &[PathBuf],
    opts: &PredictOptions,
) -> Result<Vec<Prediction>, TrainError> {
    let mut all = Vec::with_capacity(images.len());
    predict_each(model, images, opts, |p| all.push(p))?;
    Ok(all)
}

/// [`predict`], handing each file's answer to `emit` as soon as its batch is classified, in
/// the order given, so that a long list's answers so far are not lost when it is cut short.
pub fn predict_each(
    model: &mut InferenceModel,
    images: &[PathBuf],
    opts: &PredictOptions,
    mut emit: impl FnMut(Prediction),
) -> Result<(), TrainError> {
    let mut b = PipelineBuilder::new(DatasetSource::files(images.iter().cloned()))
        .split(Split::Test)
        .image_size(model.meta.image_size)
        .store_size(model.meta.settings.store_size)
        .resize_mode(model.meta.settings.resize_mode)
        .cache(false)
        .batch_size(model.net.max_batch())
        .replicas(1)
        .shuffle(false)
        .center_crop(Some(opts.crop_pct))
        .on_bad_image(opts.on_bad_image);
    if let Some(w) = opts.workers {
        b = b.workers(w);
    }
    // Told to skip, and no file is a readable image: each is still reported, then the
    // error (nothing was classified).
    let every_file_bad = |e: PipelineError,
                          images: &[PathBuf],
                          emit: &mut dyn FnMut(Prediction)| {
        if let (PipelineError::ListAllBad { files, .. }, OnBadImage::Skip) = (&e, opts.on_bad_image)
        {
            for path in images {
                let reason = files.iter().find(|f| &f.path == path);
                emit(Prediction {
                    path: path.clone(),
                    top: Err(reason.map_or("not read".to_string(), |f| {
                        format!("{} ({})", f.kind, f.detail)
                    })),
                });
            }
        }
        bad_image_error(e)
    };
    let pipe = match b.build() {
        Ok(pipe) => pipe,
        Err(e) => return Err(every_file_bad(e, images, &mut emit)),
    };
    let classes = model.meta.classes.len();
    // A file the engine passed over (rejected by the scan, or skipped as no readable image
    // before the samples that follow it were delivered): the reason it logged. The engine's
    // list is copied again only when it lacks the file, not once per skipped file.
    let mut logged: Vec<pipeline::BadFile> = Vec::new();
    let mut skipped = |path: &PathBuf| {
        if !logged.iter().any(|f| &f.path == path) {
            logged = pipe.bad_files();
        }
        let reason = logged.iter().find(|f| &f.path == path);
        Prediction {
            path: path.clone(),
            top: Err(reason.map_or("not read".to_string(), |f| {
                format!("{} ({})", f.kind, f.detail)
            })),
        }
    };
    // Samples are the list minus the files the engine passed over, in order; every copy of
    // a path shares its fate, so matching each sample to the next equal path is exact.
    let mut next = 0;
    for b in pipe.epoch(0, 0, 0).map_err(bad_image_error)? {
        let b = match b {
            Ok(b) => b,
            Err(e) => return Err(every_file_bad(e, &images[next..], &mut emit)),
        };
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
            mix: None,
        };
        let (_, probs) = classify(&mut model.net, &input, opts.views)?;
        for (i, &id) in b.sample_ids.iter().enumerate() {
            let path = pipe.sample_path(id).unwrap_or(Path::new(""));
            while next < images.len() && images[next] != path {
                emit(skipped(&images[next]));
                next += 1;
            }
            if next == images.len() {
                break;
            }
            let row = &probs[i * classes..(i + 1) * classes];
            let mut order: Vec<usize> = (0..classes).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            emit(Prediction {
                path: images[next].clone(),
                top: Ok(order
                    .into_iter()
                    .take(opts.top_k.max(1))
                    .map(|c| (model.meta.classes[c].clone(), row[c]))
                    .collect()),
            });
            next += 1;
        }
    }
    for path in &images[next..] {
        emit(skipped(path));
    }
    Ok(())
}

/// A bad image is the user's file: the pipeline's error names it already.
fn bad_image_error(e: PipelineError) -> TrainError {
    match e {
        PipelineError::BadImage { path, kind, source } => TrainError::BadImage {
            path,
            reason: match source {
                Some(detail) => format!("{kind} ({detail})"),
                None => kind.to_string(),
            },
        },
        other => TrainError::Pipeline(other),
    }
}

#[cfg(test)]
mod tests {
    use super::summarise;

    #[test]
    fn a_class_list_is_quoted_when_a_name_would_read_as_two() {
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(summarise(&names(&["a", "b"])), "2 classes: a, b");
        assert_eq!(summarise(&names(&["a"])), "1 class: a");
        // "bird, small" and "owl" are two classes, not three.
        assert_eq!(
            summarise(&names(&["bird, small", "owl"])),
            "2 classes: `bird, small`, `owl`"
        );
        assert_eq!(
            summarise(&names(&["a", "b", "c", "d", "e"])),
            "5 classes: a, b, c, d, …"
        );
    }
}
