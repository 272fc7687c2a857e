//! The input engine's integration tests: sources, scanning, decoding, the cache, augmentations,
//! ordering and the stream (one test binary; `cargo test -p pipeline --test engine`).

mod auto_augment;
mod bad_file_kinds;
mod bad_file_warnings;
mod bench_report;
mod cache_corruption;
mod cache_fillers;
mod cache_processes;
mod cache_reuse;
mod cache_truncation;
mod color_jitter;
mod common;
mod count_limits;
mod csv_source;
mod dataset_vanished;
mod decode_formats;
mod fd_limit;
mod list_source;
mod order_sharding;
mod random_crop;
mod scan_errors;
mod store_size;
mod stream;
mod synth_dataset;
mod valid_split;
