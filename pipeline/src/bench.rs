//! The engine's throughput benchmark with no model: every batch of every epoch is produced and
//! dropped, and each epoch reports its images, decodes and images/s. `birdtrain bench
//! pipeline --json` prints one [`EpochReport`] per line.

use std::path::PathBuf;
use std::time::Instant;

use crate::{
    AutoAugment, ColorJitter, DatasetSource, PipelineBuilder, PipelineError, RandomResizedCrop,
    ResizeMode, Split,
};

/// Settings of one benchmark run.
#[derive(Debug, Clone, PartialEq)]
pub struct PipelineBenchOptions {
    /// The dataset: a folder or a CSV file, as [`DatasetSource::at`] reads it.
    pub data: PathBuf,
    /// A flat `<class>/` folder (or a CSV without a split column): the valid share.
    pub valid_fraction: Option<f32>,
    /// Split to read.
    pub split: Split,
    /// Epochs to run (the first fills the cache, the rest read it).
    pub epochs: u64,
    /// Images per batch.
    pub batch_size: usize,
    /// Side of the images handed out.
    pub image_size: u32,
    /// Side of the cached squares (`None`: the image size).
    pub store_size: Option<u32>,
    /// Resize mode.
    pub resize_mode: ResizeMode,
    /// Decode threads.
    pub workers: usize,
    /// Cache directory (`None`: the per-user cache directory).
    pub cache_dir: Option<PathBuf>,
    /// Permutation seed.
    pub seed: u64,
    /// Batches prefetched.
    pub prefetch: usize,
    /// The random resized crop of every image, as for training (`None`: images as stored).
    pub crop: Option<RandomResizedCrop>,
    /// The colour jitter of every image, as for training (`None`: colours as stored).
    pub color_jitter: Option<ColorJitter>,
    /// The automatic augmentation of every image, as for training (`None`: none).
    pub auto_augment: Option<AutoAugment>,
}

impl PipelineBenchOptions {
    /// Defaults: train split, 2 epochs, batch 64, 224 px, one worker per core, seed 0.
    pub fn new(data: impl Into<PathBuf>) -> Self {
        Self {
            data: data.into(),
            valid_fraction: None,
            split: Split::Train,
            epochs: 2,
            batch_size: 64,
            image_size: 224,
            store_size: None,
            resize_mode: ResizeMode::Direct,
            workers: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(2),
            cache_dir: None,
            seed: 0,
            prefetch: 4,
            crop: None,
            color_jitter: None,
            auto_augment: None,
        }
    }
}

/// One epoch's measurements; serialises to
/// `{"epoch":0,"images":400,"decoded":400,"seconds":0.71,"images_per_sec":563.4}`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EpochReport {
    /// The epoch.
    pub epoch: u64,
    /// Images delivered.
    pub images: u64,
    /// Images actually decoded in this epoch (0 once the cache is full).
    pub decoded: u64,
    /// Wall-clock seconds of the epoch.
    pub seconds: f64,
    /// `images / seconds`.
    pub images_per_sec: f64,
}

/// Runs the benchmark; the cache (and its fill time) is part of the first epoch.
pub fn run_pipeline_bench(opts: &PipelineBenchOptions) -> Result<Vec<EpochReport>, PipelineError> {
    run_pipeline_bench_with(opts, |_| {})
}

/// [`run_pipeline_bench`], calling `on_epoch` with each report as soon as it is measured.
pub fn run_pipeline_bench_with(
    opts: &PipelineBenchOptions,
    mut on_epoch: impl FnMut(&EpochReport),
) -> Result<Vec<EpochReport>, PipelineError> {
    let mut builder = PipelineBuilder::new(DatasetSource::at(&opts.data, opts.valid_fraction))
        .split(opts.split)
        .image_size(opts.image_size)
        .store_size(opts.store_size)
        .resize_mode(opts.resize_mode)
        .batch_size(opts.batch_size)
        .workers(opts.workers)
        .prefetch(opts.prefetch)
        .random_resized_crop(opts.crop)
        .color_jitter(opts.color_jitter)
        .auto_augment(opts.auto_augment)
        .seed(opts.seed);
    if let Some(dir) = &opts.cache_dir {
        builder = builder.cache_dir(dir);
    }
    let pipeline = builder.build()?;
    let mut reports = Vec::new();
    for epoch in 0..opts.epochs {
        let decoded_before = pipeline.stats().decoded;
        let started = Instant::now();
        let mut images = 0u64;
        for batch in pipeline.epoch(epoch, 0, 0)? {
            images += batch?.len as u64;
        }
        let seconds = started.elapsed().as_secs_f64();
        let report = EpochReport {
            epoch,
            images,
            decoded: pipeline.stats().decoded - decoded_before,
            seconds: (seconds * 1e6).round() / 1e6,
            images_per_sec: if seconds > 0.0 {
                (images as f64 / seconds * 10.0).round() / 10.0
            } else {
                0.0
            },
        };
        on_epoch(&report);
        reports.push(report);
    }
    Ok(reports)
}
