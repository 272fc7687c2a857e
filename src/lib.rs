//! birdtrain: a data-pipeline-centric ResNet trainer.
//!
//! The input engine lives in the `pipeline` crate; this crate holds the model (one layer graph
//! for every backend), the CPU reference backend, the CUDA backend, data parallelism and the CLI.
//! See ARCHITECTURE.md for the data flow and who owns what.

pub mod backend;
pub mod cli;
pub mod cuda;
pub mod dist;
pub mod model;
pub mod oom;
pub mod optim;
pub mod panics;
pub mod trace;
pub mod train;
