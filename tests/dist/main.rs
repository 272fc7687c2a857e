//! The distributed layer without a GPU: launch plans, rendezvous, rank threads, buckets,
//! staging, synchronised batch norm on CPU replicas, the watchdog, traces (one test binary;
//! `cargo test --test dist`).

mod buckets;
mod launch;
mod ranks;
mod rendezvous;
mod scaling;
mod staging;
mod sync_bn;
mod trace;
mod watchdog;
