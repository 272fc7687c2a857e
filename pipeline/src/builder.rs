//! [`PipelineBuilder`]: every setting of the engine, validated by [`PipelineBuilder::build`].

use std::path::PathBuf;
use std::sync::Arc;

use crate::buffer::{BatchAllocator, VecAllocator};
use crate::{
    AutoAugment, ColorJitter, DatasetSource, LastBatch, OnBadImage, PipelineError,
    RandomResizedCrop, ResizeMode, Sampling, Split,
};

/// Configures and builds a [`Pipeline`](crate::Pipeline).
#[derive(Clone)]
pub struct PipelineBuilder {
    pub(crate) source: DatasetSource,
    pub(crate) split: Split,
    pub(crate) known_classes: Option<Vec<String>>,
    pub(crate) image_size: u32,
    pub(crate) store_size: Option<u32>,
    pub(crate) resize_mode: ResizeMode,
    pub(crate) cache_dir: Option<PathBuf>,
    pub(crate) cache: bool,
    pub(crate) seed: u64,
    pub(crate) replicas: usize,
    pub(crate) batch_size: usize,
    pub(crate) workers: usize,
    pub(crate) prefetch: usize,
    pub(crate) shuffle: bool,
    pub(crate) sampling: Sampling,
    pub(crate) crop: Option<RandomResizedCrop>,
    pub(crate) center_crop: Option<f32>,
    pub(crate) color_jitter: Option<ColorJitter>,
    pub(crate) auto_augment: Option<AutoAugment>,
    pub(crate) mirrored_later: Option<MirroredLater>,
    pub(crate) last_batch: LastBatch,
    pub(crate) on_bad_image: OnBadImage,
    pub(crate) bad_files_report: Option<PathBuf>,
    pub(crate) max_pixels: u64,
    pub(crate) allocator: Arc<dyn BatchAllocator>,
}

/// Which images a consumer mirrors after the engine: `(epoch, sample id) → mirrored`
/// ([`PipelineBuilder::mirrored_later`]).
pub type MirroredLater = Arc<dyn Fn(u64, u64) -> bool + Send + Sync>;

impl std::fmt::Debug for PipelineBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelineBuilder")
            .field("source", &self.source)
            .field("split", &self.split)
            .field("image_size", &self.image_size)
            .field("store_size", &self.store_size)
            .field("resize_mode", &self.resize_mode)
            .field("cache_dir", &self.cache_dir)
            .field("cache", &self.cache)
            .field("seed", &self.seed)
            .field("replicas", &self.replicas)
            .field("batch_size", &self.batch_size)
            .field("workers", &self.workers)
            .field("prefetch", &self.prefetch)
            .field("shuffle", &self.shuffle)
            .field("sampling", &self.sampling)
            .field("crop", &self.crop)
            .field("center_crop", &self.center_crop)
            .field("color_jitter", &self.color_jitter)
            .field("auto_augment", &self.auto_augment)
            .field("last_batch", &self.last_batch)
            .field("on_bad_image", &self.on_bad_image)
            .finish_non_exhaustive()
    }
}

impl PipelineBuilder {
    /// A builder with defaults: train split, 224 px direct resize, seed 0, 1 replica,
    /// batch 32, one worker per core, prefetch 4, shuffled, `partial` last batch, skip bad
    /// images, cache in the per-user cache directory, heap buffers.
    pub fn new(source: DatasetSource) -> Self {
        Self {
            source,
            split: Split::Train,
            known_classes: None,
            image_size: 224,
            store_size: None,
            resize_mode: ResizeMode::Direct,
            cache_dir: None,
            cache: true,
            seed: 0,
            replicas: 1,
            batch_size: 32,
            workers: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(2),
            prefetch: 4,
            shuffle: true,
            sampling: Sampling::Shuffle,
            crop: None,
            center_crop: None,
            color_jitter: None,
            auto_augment: None,
            mirrored_later: None,
            last_batch: LastBatch::Partial,
            on_bad_image: OnBadImage::Skip,
            bad_files_report: None,
            max_pixels: crate::decode::DEFAULT_MAX_PIXELS,
            allocator: Arc::new(VecAllocator),
        }
    }

    /// Which split to read.
    pub fn split(mut self, split: Split) -> Self {
        self.split = split;
        self
    }
    /// The class list of a model trained before, numbering the classes where the source
    /// has no training split to take them from: a folder without `train/`, a CSV file
    /// without train rows (a test set evaluated alone). A source with a training split
    /// numbers its classes itself, as always; a class of the split outside the list is an
    /// error.
    pub fn known_classes(mut self, classes: Vec<String>) -> Self {
        self.known_classes = Some(classes);
        self
    }
    /// Side `S` of the square images handed out (and stored, unless
    /// [`PipelineBuilder::store_size`] says otherwise).
    pub fn image_size(mut self, size: u32) -> Self {
        self.image_size = size;
        self
    }
    /// Side of the squares kept in the cache, at least the image size (`None`, the default:
    /// the image size). A larger store keeps more detail for the crops, which are cut from
    /// it and scaled to the image size (FFCV's `max_resolution`; torchvision's ImageNet
    /// evaluation is a store of 256 and a centre crop of 224): every image handed out is
    /// then one resize of its stored square, at every epoch.
    pub fn store_size(mut self, size: Option<u32>) -> Self {
        self.store_size = size;
        self
    }
    /// How images become `S×S`.
    pub fn resize_mode(mut self, mode: ResizeMode) -> Self {
        self.resize_mode = mode;
        self
    }
    /// Where the cache file lives (default: the per-user cache directory + `birdtrain`).
    pub fn cache_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cache_dir = Some(dir.into());
        self
    }

    /// Whether resized pixels are kept in the cache file (default: yes). Without it nothing
    /// is written to disk and every epoch decodes every image: for data read once, such as
    /// files to classify.
    pub fn cache(mut self, enabled: bool) -> Self {
        self.cache = enabled;
        self
    }

    /// Seed of the epoch permutations (and of the flat layout's valid split).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }
    /// Number of data-parallel replicas sharing each global batch.
    pub fn replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas;
        self
    }
    /// Images per replica per step.
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size;
        self
    }
    /// Decode threads.
    pub fn workers(mut self, workers: usize) -> Self {
        self.workers = workers;
        self
    }
    /// Batches prepared ahead of the consumer, per epoch iterator.
    pub fn prefetch(mut self, prefetch: usize) -> Self {
        self.prefetch = prefetch;
        self
    }
    /// Shuffle each epoch (`false` keeps file order, for evaluation).
    pub fn shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }
    /// How each epoch's order is drawn: every sample once (default), or class-balanced
    /// draws with replacement ([`Sampling::Balanced`]).
    pub fn sampling(mut self, sampling: Sampling) -> Self {
        self.sampling = sampling;
        self
    }
    /// Hands out a random resized crop of each stored square instead of the square itself
    /// (`None`, the default: the square as stored). The cache keeps whole squares; the crop
    /// is cut and scaled back to `S×S` by the decode worker at every epoch, its window drawn
    /// from `(seed, epoch, sample id)`. For training splits.
    pub fn random_resized_crop(mut self, crop: Option<RandomResizedCrop>) -> Self {
        self.crop = crop;
        self
    }
    /// Hands out the centred square covering `fraction` of each stored square's side,
    /// scaled back to `S×S` (`None`, the default: the square as stored): the evaluation crop
    /// of ImageNet recipes (0.875, torchvision's resize to 256 and crop to 224); 1 is the
    /// square as stored. Not with
    /// [`PipelineBuilder::random_resized_crop`].
    pub fn center_crop(mut self, fraction: Option<f32>) -> Self {
        self.center_crop = fraction;
        self
    }
    /// Jitters the colours of every image handed out, after its crop (`None`, the default:
    /// colours as stored): torchvision's `ColorJitter`, its factors and order
    /// drawn from `(seed, epoch, sample id)`. For training splits.
    pub fn color_jitter(mut self, jitter: Option<ColorJitter>) -> Self {
        self.color_jitter = jitter;
        self
    }
    /// Applies an automatic augmentation policy to every image handed out, after its crop and
    /// before the colour jitter (`None`, the default: none): torchvision's
    /// `TrivialAugmentWide`, `RandAugment`, `AugMix` or `AutoAugment`, its operations drawn
    /// from `(seed, epoch, sample id)`. For training splits.
    pub fn auto_augment(mut self, policy: Option<AutoAugment>) -> Self {
        self.auto_augment = policy;
        self
    }
    /// Says which images the consumer mirrors after the engine, by `(epoch, sample id)`
    /// (`None`, the default: none). The policy's operations are then applied to those as they
    /// look in the mirror ([`crate::AugmentDraw::mirrored`]), so that the mirrored result is
    /// torchvision's, which mirrors before it augments.
    pub fn mirrored_later(mut self, mirrored: Option<MirroredLater>) -> Self {
        self.mirrored_later = mirrored;
        self
    }
    /// Policy for the last, incomplete global batch.
    pub fn last_batch(mut self, policy: LastBatch) -> Self {
        self.last_batch = policy;
        self
    }
    /// Policy for bad files.
    pub fn on_bad_image(mut self, policy: OnBadImage) -> Self {
        self.on_bad_image = policy;
        self
    }
    /// Where to write the bad-files report (JSON lines), kept up to date as files are found;
    /// not written while there is none (an earlier report there is left alone).
    pub fn bad_files_report(mut self, path: impl Into<PathBuf>) -> Self {
        self.bad_files_report = Some(path.into());
        self
    }
    /// Decompression-bomb guard: images with more pixels are bad files (default 64 Mi).
    pub fn max_pixels(mut self, pixels: u64) -> Self {
        self.max_pixels = pixels;
        self
    }
    /// Who allocates batch buffers (the trainer passes pinned memory).
    pub fn allocator(mut self, allocator: Arc<dyn BatchAllocator>) -> Self {
        self.allocator = allocator;
        self
    }

    /// The side of the squares the cache keeps.
    pub(crate) fn stored_side(&self) -> u32 {
        self.store_size.unwrap_or(self.image_size)
    }

    /// Checks every setting, as [`PipelineBuilder::build`] does before it starts anything.
    pub(crate) fn validate(&self) -> Result<(), PipelineError> {
        let positive = |name: &'static str, value: usize| {
            if value == 0 {
                Err(PipelineError::InvalidSetting {
                    name,
                    value: "0".into(),
                    hint: "must be at least 1",
                })
            } else {
                Ok(())
            }
        };
        positive("replicas", self.replicas)?;
        positive("batch_size", self.batch_size)?;
        positive("workers", self.workers)?;
        positive("prefetch", self.prefetch)?;
        let max_workers = crate::limits::max_workers();
        if self.workers > max_workers {
            return Err(PipelineError::Limit {
                name: "workers",
                value: self.workers.to_string(),
                limit: format!(
                    "at most {max_workers} decode threads ({} per core, {} cores available)",
                    crate::limits::WORKERS_PER_CORE,
                    crate::limits::cores()
                ),
                hint: format!("use at most {max_workers}; more threads than that only wait"),
            });
        }
        if !(1..=8192).contains(&self.image_size) {
            return Err(PipelineError::InvalidSetting {
                name: "image_size",
                value: self.image_size.to_string(),
                hint: "expected 1..=8192 pixels",
            });
        }
        if let Some(store) = self.store_size {
            check_store_size(store, self.image_size)?;
        }
        if let Some(jitter) = &self.color_jitter {
            jitter.validate()?;
        }
        if let Some(policy) = &self.auto_augment {
            policy.validate()?;
        }
        if let Some(crop) = &self.crop {
            crop.validate()?;
        }
        if let Some(fraction) = self.center_crop {
            crate::check_crop_pct(fraction)?;
            if self.crop.is_some() {
                return Err(PipelineError::InvalidSetting {
                    name: "center_crop",
                    value: fraction.to_string(),
                    hint: "an engine cuts one crop: the random resized one (training) or the centred one (evaluation)",
                });
            }
        }
        Ok(())
    }
}

/// Checks a stored squares' side (`--store-size`) against the image size: at least the image
/// (a smaller store would only lose detail) and at most 8192 pixels.
pub fn check_store_size(store: u32, image_size: u32) -> Result<(), PipelineError> {
    if (image_size..=8192).contains(&store) {
        return Ok(());
    }
    Err(PipelineError::InvalidSetting {
        name: "--store-size",
        value: store.to_string(),
        hint: "the stored squares' side is at least the image size (a smaller store only loses detail) and at most 8192 pixels; ImageNet recipes store 256 for 224",
    })
}
