//! Data parallelism: how the ranks of a run are launched, find each other, and do things
//! together.
//!
//! - [`collective`]: the [`collective::Collective`] interface every rank talks through
//!   (bucket averages started from the backward hook, broadcast, small sums, abort);
//!   [`local`] implements it for CPU ranks on threads of one process, [`nccl`] for GPUs (also
//!   across machines), [`single`] for one rank with nothing to exchange.
//! - [`buckets`]: groups parameters (in backward order) into gradient buckets laid out
//!   contiguously in one flat buffer, and [`buckets::GradientSync`], which starts each bucket's
//!   average as soon as backward has produced it, in the same order on every rank.
//! - [`comm_guard`]: the raw communicator behind a count of the calls in flight, so an abort
//!   from another thread never frees it under a call.
//! - [`watchdog`]: aborts a collective that exceeds its timeout, naming the rank, so a rank
//!   that stops answering is an error, never a hang.
//! - [`launch`]: resolves `--gpus`, `--nodes`, `--node-rank`, `--master` and the variables of
//!   the launcher (torchrun, Slurm's `srun`, a PyTorchJob) into a [`launch::LaunchPlan`];
//!   [`settings`] holds those settings and their defaults.
//! - [`rendezvous`]: the TCP handshake through which node 0 hands the NCCL unique id (and each
//!   node's global rank offset) to every other node, after checking that all nodes agree on the
//!   world size, dataset, model and the checkpoint they start from.
//! - [`ranks`]: one driver thread per local GPU with its streams and communicator;
//!   [`abort_group`]: the first failing rank aborts every communicator of the process;
//!   [`start_gate`]: the threads of a group start together or not at all.
//! - [`sync_bn`]: synchronised batch norm's cross-rank sums over any collective.
//! - [`device_group`]: the test-only rehearsal's collective of N GPU ranks sharing one GPU in
//!   one process (no NCCL), reduced in rank order on the device; [`same_gpu`] its CUDA side.
//! - [`scaling`]: the arithmetic behind `birdtrain bench scaling`.
//! - [`checksum()`]: a bit-exact weight checksum to prove replicas stay identical.
//!
//! The training loop (`crate::train`) is written once against [`collective::Collective`]: the
//! multi-rank logic (buckets overlapping backward, uneven last batches, agreeing on a stop,
//! watchdog aborts) runs on CPU threads exactly as it runs on GPUs.

pub mod abort_group;
mod bucket_error;
pub mod buckets;
pub mod checksum;
pub mod collective;
pub mod comm_guard;
pub mod device_group;
pub mod launch;
pub mod local;
pub mod nccl;
pub mod ranks;
pub mod rendezvous;
pub mod same_gpu;
pub mod scaling;
pub mod settings;
pub mod single;
pub mod start_gate;
pub mod sync_bn;
pub mod watchdog;

pub use checksum::checksum;
pub use settings::DistSettings;
