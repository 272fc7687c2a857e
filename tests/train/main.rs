//! Training runs through the binary (CPU, small sets): accuracy, resume, faults, the best
//! epoch, EMA, mixing, fine-tuning, the run folder's cache (one test binary; `cargo test --test
//! train`).

mod accuracy;
mod best;
mod cache_folder_faults;
#[path = "../cli_support/mod.rs"]
mod cli_support;
mod csv_data;
mod data_identity;
mod elastic;
mod ema;
mod epoch_end;
mod faults;
mod finetune;
mod gpu_args;
mod grad_accum;
mod mix;
mod replicas;
mod resume;
