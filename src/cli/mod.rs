//! Command-line interface (being written).

pub mod bench_scaling;
pub mod bench_step;
pub mod kernels;
