//! One driver thread per local GPU, each with its context, streams and NCCL communicator.
//!
//! [`run_local_ranks`] is the entry point of multi-GPU training: it spawns one OS thread per
//! GPU of the [`LaunchPlan`], gives each a [`RankContext`] (compute, copy and communication
//! streams, the communicator of its global rank) and runs the caller's body on it. Context and
//! stream creation finish on every thread before any thread enters `ncclCommInitRank` (a
//! [`StartGate`], which a thread the OS refuses calls off): NCCL's init blocks until every rank joins, so a rank that failed earlier would
//! otherwise leave the others waiting forever.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

use super::launch::LaunchPlan;
use super::nccl::{Communicator, NcclError};
use super::rendezvous::Assignment;
use super::start_gate::StartGate;

/// The error a rank's body returns (any error; the trainer returns its own and finds it
/// again by downcasting).
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// Errors of the per-GPU threads.
#[derive(Debug, thiserror::Error)]
pub enum RanksError {
    /// The plan has no GPU.
    #[error("no GPU in the launch plan (--gpus 0 trains on the CPU without driver threads)")]
    NoDevices,
    /// The rendezvous assignment does not match this node's GPUs.
    #[error(
        "the rendezvous assigned {assigned} GPU(s) to this node but the launch plan drives {local}"
    )]
    Mismatch {
        /// GPUs per the rendezvous.
        assigned: usize,
        /// GPUs in the plan.
        local: usize,
    },
    /// Creating the context or a stream failed.
    #[error("rank {rank} (GPU {ordinal}): CUDA setup failed: {source}")]
    Cuda {
        /// Global rank.
        rank: usize,
        /// Device ordinal.
        ordinal: usize,
        /// The driver error.
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// Another rank failed before the communicator was created.
    #[error("rank {rank}: not started because another rank failed during setup")]
    PeerFailed {
        /// Global rank.
        rank: usize,
    },
    /// Creating the communicator failed.
    #[error(transparent)]
    Nccl(#[from] NcclError),
    /// The body returned an error.
    #[error("rank {rank}: {source}")]
    Body {
        /// Global rank.
        rank: usize,
        /// The body's error.
        #[source]
        source: BodyError,
    },
    /// A rank's thread panicked (a bug).
    #[error("rank {rank}: driver thread panicked: {message}")]
    Panicked {
        /// Global rank.
        rank: usize,
        /// The panic message.
        message: String,
    },
    /// The OS refused a thread.
    #[error("rank {rank}: {source}")]
    Spawn {
        /// Global rank.
        rank: usize,
        /// The refused thread, the limit and a hint.
        #[source]
        source: pipeline::threads::ThreadStartError,
    },
}

/// What one GPU's driver thread owns.
#[derive(Debug)]
pub struct RankContext {
    /// Global NCCL rank.
    pub rank: usize,
    /// Index among this node's GPUs.
    pub local_index: usize,
    /// Total ranks over all nodes.
    pub world_size: usize,
    /// CUDA device ordinal.
    pub ordinal: usize,
    /// The device context.
    pub ctx: Arc<CudaContext>,
    /// Stream for forward, backward and the optimizer.
    pub compute: Arc<CudaStream>,
    /// Stream for host-to-device staging copies.
    pub copy: Arc<CudaStream>,
    /// The communicator (its stream is the communication stream).
    pub comm: Communicator,
}

/// Runs `body` on one thread per local GPU and returns each rank's result, in local order.
/// Creating the communicator may take up to `init_timeout` (every rank of every node must
/// join).
///
/// The first error (in local order) is returned; every thread is joined first, so no thread
/// outlives the call.
pub fn run_local_ranks<R, F>(
    plan: &LaunchPlan,
    assignment: &Assignment,
    init_timeout: std::time::Duration,
    body: F,
) -> Result<Vec<R>, RanksError>
where
    R: Send + 'static,
    F: Fn(RankContext) -> Result<R, BodyError> + Send + Sync + 'static,
{
    if plan.devices.is_empty() {
        return Err(RanksError::NoDevices);
    }
    let assigned = assignment
        .node_gpus
        .get(plan.node_rank)
        .copied()
        .unwrap_or(0);
    if assigned != plan.devices.len() {
        return Err(RanksError::Mismatch {
            assigned,
            local: plan.devices.len(),
        });
    }
    let body = Arc::new(body);
    // After their setup, and before NCCL's init, the threads wait for each other; a thread
    // that cannot start calls the start off.
    let gate = Arc::new(StartGate::new(plan.devices.len()));
    let failed = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::new();
    for (local_index, &ordinal) in plan.devices.iter().enumerate() {
        let rank = assignment.rank_offset + local_index;
        let world_size = assignment.world_size;
        let id = assignment.unique_id.clone();
        let (t_body, t_gate, t_failed) = (body.clone(), gate.clone(), failed.clone());
        let handle = std::thread::Builder::new()
            .name(format!("gpu-{ordinal}"))
            .spawn(move || -> Result<R, RanksError> {
                let setup = (|| {
                    let ctx = CudaContext::new(ordinal)?;
                    let compute = ctx.new_stream()?;
                    let copy = ctx.new_stream()?;
                    let comm_stream = ctx.new_stream()?;
                    Ok((ctx, compute, copy, comm_stream))
                })()
                .map_err(|source| RanksError::Cuda {
                    rank,
                    ordinal,
                    source,
                });
                if setup.is_err() {
                    t_failed.store(true, Ordering::SeqCst);
                }
                let all_started = t_gate.arrive();
                let (ctx, compute, copy, comm_stream) = setup?;
                if !all_started || t_failed.load(Ordering::SeqCst) {
                    return Err(RanksError::PeerFailed { rank });
                }
                let comm = Communicator::init(comm_stream, rank, world_size, &id, init_timeout)?;
                t_body(RankContext {
                    rank,
                    local_index,
                    world_size,
                    ordinal,
                    ctx,
                    compute,
                    copy,
                    comm,
                })
                .map_err(|source| RanksError::Body { rank, source })
            });
        match handle {
            Ok(h) => handles.push((rank, h)),
            Err(source) => {
                // Threads already started wait at the gate for this one: let them through
                // with the failure flag set (no helper threads: the OS refuses threads now).
                failed.store(true, Ordering::SeqCst);
                gate.call_off();
                for (_, h) in handles {
                    let _ = h.join();
                }
                let thread = format!("gpu-{ordinal}");
                let source = pipeline::threads::ThreadStartError { thread, source };
                return Err(RanksError::Spawn { rank, source });
            }
        }
    }
    let mut results = Vec::new();
    let mut first_error = None;
    for (rank, h) in handles {
        match h.join() {
            Ok(Ok(r)) => results.push(r),
            Ok(Err(e)) => {
                first_error.get_or_insert(e);
            }
            Err(panic) => {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".to_string());
                first_error.get_or_insert(RanksError::Panicked { rank, message });
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(results),
    }
}
