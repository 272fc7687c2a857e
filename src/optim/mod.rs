//! Optimizers (SGD with momentum/Nesterov, Adam, AdamW) over flat f32 parameter vectors, and
//! learning-rate schedules (linear warmup, then cosine or step decay).
//!
//! Weight decay applies only where [`crate::model::ParamSpec::decay`] is true (convolution and
//! linear weights), never to batch-norm parameters or biases.

mod error;
mod optimizer;
mod schedule;

pub use error::OptimError;
pub use optimizer::{Hyper, Optimizer, OptimizerKind};
pub use schedule::{scaled_lr, Decay, Schedule};
