//! # pipeline — birdtrain's embeddable input engine
//!
//! The engine turns a folder of images into a stream of ready-to-train micro-batches: it
//! **scans** an image-folder dataset (the Kaggle "285 birds" `train/valid/test/<class>/`
//! layout, a flat `<class>/` layout with a seeded valid split of each class, or a list of files with
//! labels, [`DatasetSource::list`]), **decodes** JPEG, PNG, BMP, WebP and GIF to RGB8 on a
//! pool of OS threads, **resizes** to `S×S` with SIMD
//! (`fast_image_resize`), **caches** the result in one memory-mapped file per split and resize
//! setting (so later epochs decode nothing), and **orders** samples by one permutation per
//! `(seed, epoch)` shared by all data-parallel replicas. A tokio runtime orchestrates the
//! stages; bounded flume channels give backpressure. Batches are assembled straight into
//! buffers from a caller-supplied [`BatchAllocator`] (a trainer hands it pinned memory) and are
//! recycled when dropped. Bad files are skipped with a warning and a report (or fail, if asked).
//! The crate has no CUDA dependency.
//!
//! ```no_run
//! use pipeline::{DatasetSource, PipelineBuilder, Split};
//!
//! # fn main() -> Result<(), pipeline::PipelineError> {
//! let pipeline = PipelineBuilder::new(DatasetSource::folder("./285birds"))
//!     .split(Split::Train)
//!     .image_size(64)
//!     .batch_size(32)
//!     .seed(7)
//!     .build()?;
//! for epoch in 0..2 {
//!     for batch in pipeline.epoch(epoch, 0, 0)? {
//!         let batch = batch?;
//!         // batch.pixels(): len × 64 × 64 × 3 u8 NHWC RGB; batch.labels(): class indices.
//!         assert_eq!(batch.pixels().len(), batch.len * 64 * 64 * 3);
//!     }
//!     println!("epoch {epoch}: {:?}", pipeline.stats());
//! }
//! # Ok(())
//! # }
//! ```
//!
//! ## Guarantees
//!
//! - The same `(seed, epoch, replica, step)` gives the same batch whatever the number of
//!   decode workers; [`Pipeline::epoch`] can start at any step (exact mid-epoch resume).
//! - Every replica yields the same number of steps; their shares are disjoint and their union
//!   is the epoch ([`LastBatch`] decides the tail, identically everywhere).
//! - With [`PipelineBuilder::random_resized_crop`], each image's crop window comes from
//!   `(seed, epoch, sample id)` alone: the same guarantees hold for the cropped pixels, and
//!   for images scaled from a larger stored square ([`PipelineBuilder::store_size`]).
//! - A cache record is served only after it is completely written; a torn or mismatched cache
//!   is resumed or rebuilt. One writer per cache file (an exclusive `flock`); other pipelines
//!   or processes on the same file read what it published and decode the rest in memory.
//! - Bad files never panic and never hang the engine; failures reach the consumer as
//!   [`PipelineError`] values that keep their source.
//!
//! The crate's `README.md` has the design notes and the benchmark against PyTorch's DataLoader.
//!
//! See `examples/embed_pipeline.rs` at the workspace root for a runnable version on synthetic
//! data, [`synth`] for the synthetic dataset writer and [`bench`](mod@bench) for the throughput benchmark.

mod autoaugment;
mod bad;
mod bad_report;
mod batch;
pub mod bench;
mod buffer;
mod builder;
mod cache;
mod content;
mod crop;
mod decode;
mod error;
mod jitter;
pub mod limits;
mod options;
mod order;
mod pipeline;
mod place;
mod resize;
mod scan;
mod split;
mod stats;
pub mod synth;
pub mod threads;
mod worker;

pub use autoaugment::{
    AugMixDraw, AugmentDraw, AugmentOp, AugmentScratch, AutoAugment, OpDraw, MAGNITUDE_BINS,
};
pub use bad::{BadFile, BadFileKind};
pub use batch::Batch;
pub use buffer::{BatchAllocator, HostBuffer, VecAllocator};
pub use builder::{check_store_size, MirroredLater, PipelineBuilder};
pub use content::{content_hash, hash_file, FileState};
pub use crop::{check_crop_pct, CropWindow, RandomResizedCrop};
pub use error::PipelineError;
pub use jitter::{Adjust, ColorJitter, JitterDraw};
pub use options::{LastBatch, OnBadImage, ResizeMode, Sampling, Split};
pub use pipeline::{EpochIter, EpochStream, Pipeline};
pub use place::resolve;
pub use scan::DatasetSource;
pub use split::{held_out, SplitRule};
pub use stats::{CacheHealth, EngineStats};
