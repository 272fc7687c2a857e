//! Optimizers (SGD with momentum/Nesterov, Adam, AdamW) over flat f32 parameter vectors,
//! learning-rate schedules (linear warmup, then cosine or step decay), and the optimizer of a
//! training rank ([`RankOptimizer`]), which belongs to the rank's backend.
//!
//! Weight decay applies only where [`crate::model::ParamSpec::decay`] is true (convolution and
//! linear weights), never to batch-norm parameters or biases.

mod choice;
mod error;
mod layout;
mod optimizer;
mod rank;
mod schedule;

pub use choice::OptimizerChoice;
pub use error::OptimError;
pub use layout::{ConvOrder, ParamLayout};
pub use optimizer::{read_f32_tensor, Hyper, Optimizer, OptimizerKind};
pub use rank::{CpuRankOptimizer, RankOptimizer};
pub use schedule::{scaled_lr, Decay, Plateau, Schedule, ScheduleChoice};
