//! One driver thread per local GPU, each with its context, streams and NCCL communicator.
//!
//! [`run_local_ranks`] is the entry point of multi-GPU training: it spawns one OS thread per
//! GPU of the [`LaunchPlan`], gives each a [`RankContext`] (compute, copy and communication
//! streams, the communicator of its global rank) and runs the caller's body on it.
//!
//! What a driver thread does, in order:
//! 1. creates its context and streams; every thread finishes this before any enters
//!    `ncclCommInitRank` (a [`StartGate`], which a thread the OS refuses calls off), because NCCL's init blocks until every rank joins;
//! 2. joins the communicator, giving up as soon as another local rank has failed (its init
//!    would otherwise wait for a rank that will never come);
//! 3. puts the communicator into the process's [`AbortGroup`];
//! 4. passes a barrier on the new communicator (an all-reduce of one value, see
//!    [`Communicator::barrier`]) before the body allocates anything;
//! 5. runs the body.
//!
//! A failure at any step (an error or a panic) is reported to the [`AbortGroup`] at once, on the
//! failing thread, which aborts every communicator of the process: the other ranks' pending
//! collectives end within moments instead of at `--collective-timeout`. The call returns that
//! first failure, naming its rank, not the "aborted" errors it caused on the others.
//!
//! The thread logic is written against [`CommSetup`] (prepare, connect, barrier), so it is
//! tested on the CPU with fake devices and communicators; [`NcclSetup`] is the CUDA one.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream};

use super::abort_group::AbortGroup;
use super::launch::LaunchPlan;
use super::nccl::{Communicator, NcclError};
use super::rendezvous::Assignment;
use super::start_gate::StartGate;
use super::watchdog::Abortable;

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
    /// Another rank failed before this one's communicator was ready.
    #[error("rank {rank}: not started because another rank failed during setup")]
    PeerFailed {
        /// Global rank.
        rank: usize,
    },
    /// The barrier on the new communicator failed.
    #[error("rank {rank}: the barrier after joining the communicator failed: {source}")]
    Barrier {
        /// Global rank.
        rank: usize,
        /// Why.
        #[source]
        source: NcclError,
    },
    /// A rank failed, known only as text: a fake device's error in the CPU tests, or a failure
    /// reported to the abort group by a rank whose thread then gave no error of its own.
    #[error("rank {rank}: {reason}")]
    Failed {
        /// Global rank.
        rank: usize,
        /// What failed.
        reason: String,
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
    /// The process's abort fan-out: a rank that fails before its collective exists calls
    /// [`AbortGroup::fail`] so no other rank waits for it (returning the error does too).
    pub aborts: AbortGroup,
}

/// What a driver thread does before its body, per device kind: the CUDA one is [`NcclSetup`];
/// the tests use fakes.
pub trait CommSetup: Send + Sync + 'static {
    /// What a rank holds before its communicator (its context and streams).
    type Prepared: Send + 'static;
    /// The communicator.
    type Comm: Send + 'static;

    /// Creates the device context and streams of `rank` on device `ordinal`.
    fn prepare(&self, rank: usize, ordinal: usize) -> Result<Self::Prepared, RanksError>;

    /// Joins the communicator as `rank` of `world_size`. Blocks until every rank has joined,
    /// at most `timeout`, and gives up early once `abandon()` is true (another local rank
    /// failed and will never join).
    fn connect(
        &self,
        prepared: &Self::Prepared,
        rank: usize,
        world_size: usize,
        unique_id: &[u8],
        timeout: Duration,
        abandon: &dyn Fn() -> bool,
    ) -> Result<Self::Comm, RanksError>;

    /// What the process's abort group aborts for this communicator.
    fn abort_target(&self, comm: &Self::Comm) -> Arc<dyn Abortable>;

    /// The barrier on a new communicator (every rank has it working) before the body runs;
    /// at most `timeout`, and ended by an abort of the communicator.
    fn barrier(&self, comm: &Self::Comm, rank: usize, timeout: Duration) -> Result<(), RanksError>;
}

/// What the body of a driver thread gets from [`run_ranks_with`].
#[derive(Debug)]
pub struct RankSlot<P, C> {
    /// Global rank.
    pub rank: usize,
    /// Index among this node's ranks.
    pub local_index: usize,
    /// Total ranks over all nodes.
    pub world_size: usize,
    /// Device ordinal.
    pub ordinal: usize,
    /// What [`CommSetup::prepare`] made.
    pub prepared: P,
    /// The communicator, past its barrier.
    pub comm: C,
    /// The process's abort fan-out.
    pub aborts: AbortGroup,
}

/// How long the driver threads may take.
#[derive(Debug, Clone, Copy)]
pub struct RankLimits {
    /// Joining the communicator (every rank of every node must join), and its barrier.
    pub init_timeout: Duration,
    /// After the first failure, how long the other ranks get to end (their communicators are
    /// aborted, so they end within moments); one still running then is named and left behind
    /// rather than hanging the process, which is exiting with the error.
    pub stop_grace: Duration,
}

impl RankLimits {
    /// The limits of a training run: `init_timeout` to join, and a minute to stop.
    pub fn new(init_timeout: Duration) -> Self {
        RankLimits {
            init_timeout,
            stop_grace: Duration::from_secs(60),
        }
    }
}

/// The CUDA and NCCL setup of a GPU rank: context, compute, copy and communication streams,
/// `ncclCommInitRank`, the one-value all-reduce barrier.
#[derive(Debug, Clone, Copy, Default)]
pub struct NcclSetup;

/// What [`NcclSetup::prepare`] makes: the context and the three streams.
#[derive(Debug)]
pub struct GpuStreams {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    comm: Arc<CudaStream>,
}

impl CommSetup for NcclSetup {
    type Prepared = GpuStreams;
    type Comm = Communicator;

    fn prepare(&self, rank: usize, ordinal: usize) -> Result<GpuStreams, RanksError> {
        (|| {
            let ctx = CudaContext::new(ordinal)?;
            let compute = ctx.new_stream()?;
            let copy = ctx.new_stream()?;
            let comm = ctx.new_stream()?;
            Ok(GpuStreams {
                ctx,
                compute,
                copy,
                comm,
            })
        })()
        .map_err(|source| RanksError::Cuda {
            rank,
            ordinal,
            source,
        })
    }

    fn connect(
        &self,
        prepared: &GpuStreams,
        rank: usize,
        world_size: usize,
        unique_id: &[u8],
        timeout: Duration,
        abandon: &dyn Fn() -> bool,
    ) -> Result<Communicator, RanksError> {
        Communicator::init_unless(
            prepared.comm.clone(),
            rank,
            world_size,
            unique_id,
            timeout,
            abandon,
        )
        .map_err(|e| match e {
            NcclError::InitAbandoned { rank } => RanksError::PeerFailed { rank },
            other => RanksError::Nccl(other),
        })
    }

    fn abort_target(&self, comm: &Communicator) -> Arc<dyn Abortable> {
        comm.abort_target()
    }

    fn barrier(
        &self,
        comm: &Communicator,
        rank: usize,
        timeout: Duration,
    ) -> Result<(), RanksError> {
        comm.barrier(timeout)
            .map_err(|source| RanksError::Barrier { rank, source })
    }
}

/// Runs `body` on one thread per local GPU and returns each rank's result, in local order.
/// Creating the communicator may take up to `init_timeout` (every rank of every node must
/// join).
///
/// When a rank fails, every communicator of the process is aborted and the first failure is
/// returned (see the module docs); every thread is joined first, unless one outlives the
/// minute it gets to stop.
pub fn run_local_ranks<R, F>(
    plan: &LaunchPlan,
    assignment: &Assignment,
    init_timeout: Duration,
    body: F,
) -> Result<Vec<R>, RanksError>
where
    R: Send + 'static,
    F: Fn(RankContext) -> Result<R, BodyError> + Send + Sync + 'static,
{
    run_ranks_with(
        NcclSetup,
        plan,
        assignment,
        RankLimits::new(init_timeout),
        move |slot: RankSlot<GpuStreams, Communicator>| {
            let GpuStreams {
                ctx, compute, copy, ..
            } = slot.prepared;
            body(RankContext {
                rank: slot.rank,
                local_index: slot.local_index,
                world_size: slot.world_size,
                ordinal: slot.ordinal,
                ctx,
                compute,
                copy,
                comm: slot.comm,
                aborts: slot.aborts,
            })
        },
    )
}

/// A panic's message (`"unknown panic"` when it carries no text).
pub(crate) fn panic_text(panic: &(dyn Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string())
}

/// `f`, with a panic turned into [`RanksError::Panicked`].
fn unpanicked<T>(rank: usize, f: impl FnOnce() -> Result<T, RanksError>) -> Result<T, RanksError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        Err(RanksError::Panicked {
            rank,
            message: panic_text(&*panic),
        })
    })
}

/// [`run_local_ranks`] over any [`CommSetup`]: the thread logic, testable with fakes.
pub fn run_ranks_with<S, R, F>(
    setup: S,
    plan: &LaunchPlan,
    assignment: &Assignment,
    limits: RankLimits,
    body: F,
) -> Result<Vec<R>, RanksError>
where
    S: CommSetup,
    R: Send + 'static,
    F: Fn(RankSlot<S::Prepared, S::Comm>) -> Result<R, BodyError> + Send + Sync + 'static,
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
    let local = plan.devices.len();
    let setup = Arc::new(setup);
    let body = Arc::new(body);
    // After their setup, and before NCCL's init, the threads wait for each other; a thread
    // the OS refuses calls the start off.
    let gate = Arc::new(StartGate::new(local));
    let aborts = AbortGroup::new();
    let (done_tx, done_rx) = mpsc::channel::<(usize, Result<R, RanksError>)>();
    let mut handles = Vec::new();
    for (local_index, &ordinal) in plan.devices.iter().enumerate() {
        let rank = assignment.rank_offset + local_index;
        let world_size = assignment.world_size;
        let id = assignment.unique_id.clone();
        let (setup, body, t_gate, t_aborts, done) = (
            setup.clone(),
            body.clone(),
            gate.clone(),
            aborts.clone(),
            done_tx.clone(),
        );
        let spawned = pipeline::threads::spawn(format!("gpu-{ordinal}"), move || {
            let prepared = unpanicked(rank, || setup.prepare(rank, ordinal));
            if let Err(e) = &prepared {
                t_aborts.fail(rank, &e.to_string());
            }
            // Every thread reaches this, failed or not, so none waits here forever.
            let all_started = t_gate.arrive();
            let outcome = prepared.and_then(|prepared| {
                unpanicked(rank, || {
                    if !all_started || t_aborts.has_failed() {
                        return Err(RanksError::PeerFailed { rank });
                    }
                    let comm = setup.connect(
                        &prepared,
                        rank,
                        world_size,
                        &id,
                        limits.init_timeout,
                        &|| t_aborts.has_failed(),
                    )?;
                    t_aborts.join(rank, setup.abort_target(&comm));
                    setup.barrier(&comm, rank, limits.init_timeout)?;
                    body(RankSlot {
                        rank,
                        local_index,
                        world_size,
                        ordinal,
                        prepared,
                        comm,
                        aborts: t_aborts.clone(),
                    })
                    .map_err(|source| RanksError::Body { rank, source })
                })
            });
            if let Err(e) = &outcome {
                // At once, on this thread: the other ranks must not wait for the join.
                t_aborts.fail(rank, &e.to_string());
            }
            let _ = done.send((local_index, outcome));
        });
        match spawned {
            Ok(h) => handles.push(Some(h)),
            Err(source) => {
                // Threads already started wait at the gate for this one: call the start off
                // with the failure recorded (no helper threads: the OS refuses threads now).
                aborts.fail(rank, &format!("cannot start its driver thread: {source}"));
                gate.call_off();
                for h in handles.into_iter().flatten() {
                    let _ = h.join();
                }
                return Err(RanksError::Spawn { rank, source });
            }
        }
    }
    drop(done_tx);
    let results = collect(
        &done_rx,
        &aborts,
        local,
        limits.stop_grace,
        assignment.rank_offset,
    );
    // Join the threads that ended (their result is in); one left behind is detached.
    for (i, h) in handles.iter_mut().enumerate() {
        if results[i].is_some() {
            if let Some(h) = h.take() {
                let _ = h.join();
            }
        }
    }
    let first = aborts.failure();
    let mut outcomes: Vec<Option<Result<R, RanksError>>> = results;
    if let Some(first) = first {
        let index = first.rank - assignment.rank_offset;
        return match outcomes.get_mut(index).and_then(Option::take) {
            Some(Err(e)) => Err(e),
            _ => Err(RanksError::Failed {
                rank: first.rank,
                reason: first.reason,
            }),
        };
    }
    outcomes
        .into_iter()
        .enumerate()
        .map(|(i, o)| match o {
            Some(r) => r,
            None => Err(RanksError::Panicked {
                rank: assignment.rank_offset + i,
                message: "its driver thread ended without a result".into(),
            }),
        })
        .collect()
}

/// Each thread's result, in local order; after the first failure, waits at most `grace` for
/// the rest (a thread that has not ended then is named in a warning and has no result).
fn collect<R>(
    done: &mpsc::Receiver<(usize, Result<R, RanksError>)>,
    aborts: &AbortGroup,
    local: usize,
    grace: Duration,
    rank_offset: usize,
) -> Vec<Option<Result<R, RanksError>>> {
    let mut results: Vec<Option<Result<R, RanksError>>> = (0..local).map(|_| None).collect();
    let mut left = local;
    let mut deadline = None;
    while left > 0 {
        if deadline.is_none() && aborts.has_failed() {
            deadline = Some(std::time::Instant::now() + grace);
        }
        let received = match deadline {
            None => done
                .recv_timeout(Duration::from_millis(100))
                .map_err(|e| e == mpsc::RecvTimeoutError::Disconnected),
            Some(d) => {
                let wait = d.saturating_duration_since(std::time::Instant::now());
                if wait.is_zero() {
                    break;
                }
                done.recv_timeout(wait)
                    .map_err(|e| e == mpsc::RecvTimeoutError::Disconnected)
            }
        };
        match received {
            Ok((i, r)) => {
                results[i] = Some(r);
                left -= 1;
            }
            // Every sender is gone: no more results will come.
            Err(true) => break,
            Err(false) => {}
        }
    }
    let stuck: Vec<String> = results
        .iter()
        .enumerate()
        .filter(|(_, r)| r.is_none())
        .map(|(i, _)| (rank_offset + i).to_string())
        .collect();
    if !stuck.is_empty() {
        tracing::warn!(
            "rank(s) {} did not stop within {grace:?} after the failure; left behind",
            stuck.join(", ")
        );
    }
    results
}
