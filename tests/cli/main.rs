//! The `birdtrain` binary end to end: each command, its errors, its environment and the
//! places it writes (one test binary; `cargo test --test cli`).

mod bench_cpu;
#[path = "../cli_support/mod.rs"]
mod cli_support;
mod commands;
mod compare;
mod env;
mod errors;
mod inference;
mod kernels_report;
mod launch;
mod lr_find;
mod nothing_lost;
mod write_places;
