//! The trainer: one training loop for every device and rank count.
//!
//! A run is R ranks (`rank/`): each owns a backend, a model replica, its share of every
//! global batch and its optimizer, and they are joined by a collective
//! ([`crate::dist::collective::Collective`]): in-process for CPU ranks on threads
//! (`--replicas R`), NCCL for GPUs (`--gpus N`, also across machines), started by a launcher
//! (`launch/`). The loop (`epochs.rs`) is the same code for all of them: setup and resume
//! (`setup.rs`), epochs and steps, the agreement on stopping, validation (each rank its share
//! of the split, `validation.rs`), metrics, checkpoints and report in the run folder
//! ([`folder`], written by rank 0 alone, `epoch_end.rs`), the summary (`outcome.rs`); `run.rs`
//! is the entry. Batch-norm statistics are kept per
//! rank during an epoch (as in PyTorch DDP) and averaged over the ranks at every epoch end
//! and checkpoint.

// In layers, bottom first (`tests/architecture/dependency_order.rs` checks them): a module uses its own
// group and the groups above it, never one below; within a group, no circle.
mod augment;
mod device;
mod ema;
mod error;
mod evaluate;
pub mod folder;
pub mod lr_find;
mod mix;
mod progress;
mod summary;

mod config;

mod resumed_files;
mod setup;

mod rank;

mod divergence;
mod epoch_end;
mod epochs;
mod report;
mod validation;

mod launch;

mod outcome;
mod run;

#[cfg(test)]
mod multirank_tests;

pub use augment::{augment_for, augments_for, erase_for, max_shift, Augmentation};
pub use config::TrainConfig;
pub use device::DeviceChoice;
pub use ema::{EmaRecipe, ModelEma};
pub use error::TrainError;
pub use evaluate::{
    evaluate, load_checkpoint_for_inference, load_weights_for_inference, predict, predict_each,
    printable, EvalReport, InferenceModel, PredictOptions, Prediction, SampleResult, Views,
    Weights,
};
pub use folder::metrics::{EpochMetrics, MetricsAccumulator, MetricsSplit};
pub use folder::report::write_report;
pub use folder::{
    checkpoint, fault, BestRule, CheckpointMeta, DataPosition, DatasetStamp, FolderError, Monitor,
    RunFolder, RunSettings,
};
pub use launch::auto_batch::{check_auto_batch, largest_gpu_batch};
pub use mix::MixRecipe;
pub use outcome::TrainOutcome;
pub use run::train;
pub(crate) use setup::check_resumed;
pub use summary::{format_summary, SummaryHeader};

pub use crate::optim::OptimizerChoice;
