//! The trainer: data-parallel replicas on one backend fed by the input engine, the optimizer
//! step on a master copy, validation each epoch, checkpoints, metrics, report and summary.
//!
//! Data parallelism on the CPU uses R [`crate::model::Network`] replicas that run one after
//! the other on the same thread pool: each takes its micro-batch (slice r of the global batch
//! from the pipeline), gradients are averaged weighted by image count, one optimizer step
//! updates the master parameters, and every replica reloads them. Batch-norm statistics are
//! per replica (as in PyTorch DDP); the master's running statistics are the count-weighted
//! mean of the replicas'.

mod augment;
pub mod checkpoint;
mod config;
mod device;
mod epoch;
mod error;
mod evaluate;
pub mod fault;
mod gpu;
pub mod metrics;
mod progress;
mod replicas;
mod report;
mod resume;
mod run;
mod summary;

pub use augment::{augment_for, augments_for, max_shift};
pub use checkpoint::{CheckpointMeta, DataPosition, DatasetStamp, RunSettings};
pub use config::{OptimizerChoice, TrainConfig};
pub use device::{cuda_device_count, DeviceChoice};
pub use error::TrainError;
pub use evaluate::{
    evaluate, load_checkpoint_for_inference, predict, EvalReport, InferenceModel, Prediction,
};
pub(crate) use gpu::default_dist_args;
pub use metrics::{EpochMetrics, MetricsAccumulator, MetricsSplit};
pub use report::write_report;
pub use run::{train, TrainOutcome};
pub use summary::{format_summary, SummaryHeader};
