//! Data parallelism across GPUs and machines.
//!
//! [`args::DistArgs`] holds the flags (`--nodes`, `--node-rank`, `--master`, `--bucket-mb`,
//! `--prefetch-depth`, `--trace`, `--sync-bn`, timeouts) for the training command to flatten in.
//!
//! The pieces, each small and testable without a GPU where the logic allows it:
//!
//! - [`launch`]: resolves `--gpus`, `--nodes`, `--node-rank`, `--master` and the torchrun
//!   environment variables into a [`launch::LaunchPlan`].
//! - [`rendezvous`]: the TCP handshake through which node 0 hands the NCCL unique id (and each
//!   node's global rank offset) to every other node, after checking that all nodes agree on the
//!   world size, dataset and model.
//! - [`buckets`]: groups parameters (in backward order) into gradient buckets laid out
//!   contiguously in one flat buffer, and launches them in a deterministic order.
//! - [`staging`]: the ring of D host/device staging slots, generic over a small stream/event
//!   trait; a simulated implementation tests the reuse logic on CPU, [`cuda_staging`] drives a GPU.
//! - [`trace`]: a thread-safe Chrome trace (Perfetto) writer for `--trace`; [`gpu_trace`]
//!   times stream work with CUDA events and adds it as per-GPU spans.
//! - [`nccl`]: the NCCL communicator, weight broadcast and bucketed gradient all-reduce;
//!   [`watchdog`] aborts a collective that exceeds its timeout.
//! - [`ranks`]: one driver thread per local GPU with its streams and communicator.
//! - [`scaling`]: the arithmetic behind `birdtrain bench scaling` (ring all-reduce time,
//!   overlap with backward, projected efficiency).
//! - [`sync_bn`]: synchronised batch norm's cross-replica sums (`--sync-bn`); the model does
//!   the math, a reducer sums per-channel vectors (in-process for CPU replicas, NCCL on GPUs).
//! - [`checksum()`]: a bit-exact weight checksum to prove replicas stay identical.
//!
//! # How a multi-GPU run fits together
//!
//! ```text
//! plan = launch::resolve(&dist_args.launch_flags(gpus)?, &launch::process_env, &detect_cuda_devices())
//! assignment = rendezvous::rendezvous(master, &NodeInfo{..}, timeout, || nccl::new_unique_id())
//! ranks::run_local_ranks(&plan, &assignment, timeout, |rank| {   // one thread per GPU
//!     sync = nccl::GradientSync::new(rank.comm, rank.compute, BucketPlan::new(..), timeout)
//!     sync.broadcast_weights(&mut weights)                      // rank 0's initial weights
//!     ring = StagingRing::new(CudaStaging::new(&rank.ctx, rank.compute, depth, bytes))
//!     loop {                                                    // per step
//!         while ring.can_fill() { ring.stage_external(next engine batch) }
//!         staged = ring.begin_compute(); forward(staged.slot) ... ring.end_compute()
//!         sync.begin_step(); net.train_step_with(batch, |i, g| sync.grad_ready(..i..));
//!         sync.finish_step(); optimizer; every N steps compare checksum(weights)
//!     }
//! })
//! ```

pub mod args;
pub mod buckets;
pub mod checksum;
pub mod cuda_staging;
pub mod gpu_trace;
pub mod launch;
pub mod nccl;
pub mod ranks;
pub mod rendezvous;
pub mod scaling;
pub mod staging;
pub mod sync_bn;
pub mod trace;
pub mod watchdog;

pub use checksum::checksum;
