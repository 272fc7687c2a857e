//! NCCL data parallelism: the communicator, the initial weight broadcast and the bucketed
//! gradient all-reduce that overlaps backward.
//!
//! One communicator rank per GPU, one driver thread per rank (`Communicator::init` with the id
//! from [`new_unique_id`] on rank 0, handed to the others in-process or through the
//! [`super::rendezvous`]). Collectives run on the rank's communication stream; ordering against
//! the compute stream is explicit, through events:
//!
//! ```text
//! compute: ..backward layers L..k.. [record ready_k] ..backward k-1..0.. [wait comm_done] optimizer
//! comm:                       [wait ready_k] all-reduce(avg) bucket k [record comm_done]
//! ```
//!
//! Every collective is registered with a [`Watchdog`]; a collective that exceeds the timeout
//! (a rank stopped answering) or an asynchronous NCCL error aborts the communicator
//! (`ncclCommAbort`) and surfaces as an error naming the rank, never as a hang.
//!
//! The NCCL library is loaded at run time: [`ensure_available`] checks for it (and for the CUDA
//! driver) before anything calls into it, so a missing library is an error, not a panic.

use std::ptr;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtrMut, DeviceRepr, DriverError};
use cudarc::nccl::{result, sys, NcclType};

use super::buckets::{BucketError, BucketPlan, BucketTracker};
use super::gpu_trace::{rows, GpuTimeline};
use super::watchdog::{Abortable, Watchdog, WatchdogError};

/// Errors of the NCCL layer.
#[derive(Debug, thiserror::Error)]
pub enum NcclError {
    /// libnccl could not be loaded.
    #[error("the NCCL library could not be loaded: {hint}")]
    LibraryMissing {
        /// What to do about it.
        hint: String,
    },
    /// libcuda could not be loaded.
    #[error("the CUDA driver library (libcuda.so) is not available; multi-GPU training needs an NVIDIA driver")]
    DriverMissing,
    /// An NCCL call failed.
    #[error("NCCL {op} failed on rank {rank}: {code}")]
    Call {
        /// The operation.
        op: &'static str,
        /// The rank.
        rank: usize,
        /// NCCL's result code.
        code: String,
    },
    /// A CUDA driver call around a collective failed.
    #[error("CUDA {op} failed on rank {rank}: {source}")]
    Driver {
        /// The operation.
        op: &'static str,
        /// The rank.
        rank: usize,
        /// The driver error.
        #[source]
        source: DriverError,
    },
    /// The unique id has the wrong size (a corrupted rendezvous).
    #[error("NCCL unique id must be {expected} bytes, got {got}")]
    BadUniqueId {
        /// Expected length.
        expected: usize,
        /// Received length.
        got: usize,
    },
    /// Rank or world size out of range.
    #[error("invalid NCCL rank {rank} for world size {world_size}")]
    BadRank {
        /// The rank.
        rank: usize,
        /// The world size.
        world_size: usize,
    },
    /// The communicator was aborted (by the watchdog or earlier failure).
    #[error(transparent)]
    Aborted(#[from] WatchdogError),
    /// Not every rank joined the communicator in time.
    #[error("rank {rank}: the NCCL communicator of {world_size} ranks was not complete after {waited:?}; a rank (or its node) never joined — check that every node is still running")]
    InitTimeout {
        /// This rank.
        rank: usize,
        /// Ranks expected.
        world_size: usize,
        /// Time waited.
        waited: Duration,
    },
    /// Using a communicator after it was aborted.
    #[error("rank {rank}: the NCCL communicator was aborted; no further collectives are possible")]
    UseAfterAbort {
        /// The rank.
        rank: usize,
    },
    /// Gradient bookkeeping failed (a parameter reported twice, or never).
    #[error(transparent)]
    Buckets(#[from] BucketError),
    /// A step ended with buckets never launched.
    #[error("rank {rank}: step ended but gradients of {missing} parameter(s) were never reported ready (first: {first:?}); every backward must report every parameter")]
    IncompleteStep {
        /// The rank.
        rank: usize,
        /// How many parameters are missing.
        missing: usize,
        /// The first missing parameter.
        first: String,
    },
    /// The gradient buffer does not match the bucket plan.
    #[error("gradient buffer has {got} elements but the bucket plan needs {expected}")]
    BufferSize {
        /// Plan size.
        expected: usize,
        /// Buffer size.
        got: usize,
    },
}

fn nccl_code(e: result::NcclError) -> String {
    format!("{:?}", e.0)
}

/// Checks that the CUDA driver and NCCL can be loaded; returns NCCL's version code
/// (e.g. 22703 for 2.27.3).
pub fn ensure_available() -> Result<i32, NcclError> {
    // SAFETY: these only try to dlopen the libraries; nothing is called through them.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(NcclError::DriverMissing);
    }
    if !unsafe { sys::is_culib_present() } {
        return Err(NcclError::LibraryMissing {
            hint: missing_library_hint(),
        });
    }
    result::get_nccl_version().map_err(|e| NcclError::Call {
        op: "ncclGetVersion",
        rank: 0,
        code: nccl_code(e),
    })
}

/// Explains a missing NCCL. cudarc looks for `libnccl.so` (and a few versioned names), while
/// NCCL's runtime packages (apt `libnccl2`, pip `nvidia-nccl-cu13`) ship only `libnccl.so.2`;
/// when that file exists somewhere usual, say exactly which symlink to create.
fn missing_library_hint() -> String {
    let mut dirs: Vec<std::path::PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    for d in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/local/cuda/lib64",
        "/usr/local/lib",
        "/usr/lib64",
        "/usr/lib",
    ] {
        dirs.push(d.into());
    }
    hint_for_dirs(&dirs)
}

fn hint_for_dirs(dirs: &[std::path::PathBuf]) -> String {
    match dirs.iter().map(|d| d.join("libnccl.so.2")).find(|p| p.is_file()) {
        Some(found) => format!(
            "{} exists but the loader looks for libnccl.so; create it with `mkdir -p ~/.local/nccl && ln -sf {} ~/.local/nccl/libnccl.so` and add ~/.local/nccl to LD_LIBRARY_PATH",
            found.display(),
            found.display()
        ),
        None => "libnccl.so is not on LD_LIBRARY_PATH; install NCCL (apt `libnccl2 libnccl-dev`, or `pip install nvidia-nccl-cu13` and symlink its lib/libnccl.so.2 as libnccl.so in a directory on LD_LIBRARY_PATH), or train on one GPU without NCCL".to_string(),
    }
}

/// Size of an NCCL unique id in bytes.
pub const UNIQUE_ID_BYTES: usize = 128;

/// Creates a new NCCL unique id (rank 0 does this once per communicator).
pub fn new_unique_id() -> Result<Vec<u8>, NcclError> {
    ensure_available()?;
    let id = result::get_uniqueid().map_err(|e| NcclError::Call {
        op: "ncclGetUniqueId",
        rank: 0,
        code: nccl_code(e),
    })?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

/// A raw communicator handed from the init thread to its owner.
struct RawComm(sys::ncclComm_t);

// SAFETY: a freshly created communicator is not yet used by any thread; ownership moves to the
// receiving thread, which is the only one using it from then on.
unsafe impl Send for RawComm {}

/// The raw communicator, shared with the watchdog so it can abort from its own thread.
#[derive(Debug)]
struct CommHandle {
    comm: AtomicPtr<sys::ncclComm>,
    rank: usize,
}

impl CommHandle {
    fn get(&self) -> Result<sys::ncclComm_t, NcclError> {
        let p = self.comm.load(Ordering::Acquire);
        if p.is_null() {
            Err(NcclError::UseAfterAbort { rank: self.rank })
        } else {
            Ok(p)
        }
    }
}

impl Abortable for CommHandle {
    fn abort(&self) -> Result<(), String> {
        let p = self.comm.swap(ptr::null_mut(), Ordering::AcqRel);
        if p.is_null() {
            return Ok(());
        }
        // SAFETY: `p` came from ncclCommInitRank and is no longer reachable through the
        // handle, so it is aborted exactly once and never used again by this handle.
        unsafe { result::comm_abort(p) }
            .map(|_| ())
            .map_err(nccl_code)
    }

    fn async_error(&self) -> Option<String> {
        let p = self.comm.load(Ordering::Acquire);
        if p.is_null() {
            return None;
        }
        let mut code = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `p` is a live communicator (non-null) and `code` a valid out pointer.
        let r = unsafe { sys::ncclCommGetAsyncError(p, &mut code) };
        match (r, code) {
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess)
            | (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclInProgress) => None,
            (sys::ncclResult_t::ncclSuccess, c) => Some(format!("asynchronous NCCL error {c:?}")),
            (e, _) => Some(format!("ncclCommGetAsyncError failed: {e:?}")),
        }
    }
}

/// One rank of an NCCL communicator, bound to its communication stream.
#[derive(Debug)]
pub struct Communicator {
    handle: Arc<CommHandle>,
    stream: Arc<CudaStream>,
    rank: usize,
    world_size: usize,
}

impl Communicator {
    /// Joins communicator `unique_id` as `rank` of `world_size`, collectives on `stream`.
    ///
    /// Blocks until every rank has joined (NCCL's own bootstrap), at most `timeout`: a rank
    /// that never arrives (its node died after the rendezvous) is an error, not a hang. Call it
    /// from each rank's driver thread concurrently.
    pub fn init(
        stream: Arc<CudaStream>,
        rank: usize,
        world_size: usize,
        unique_id: &[u8],
        timeout: Duration,
    ) -> Result<Self, NcclError> {
        ensure_available()?;
        if world_size == 0 || rank >= world_size || world_size > i32::MAX as usize {
            return Err(NcclError::BadRank { rank, world_size });
        }
        if unique_id.len() != UNIQUE_ID_BYTES {
            return Err(NcclError::BadUniqueId {
                expected: UNIQUE_ID_BYTES,
                got: unique_id.len(),
            });
        }
        let mut internal = [0 as std::ffi::c_char; UNIQUE_ID_BYTES];
        for (dst, &src) in internal.iter_mut().zip(unique_id) {
            *dst = src as std::ffi::c_char;
        }
        // ncclCommInitRank blocks until all ranks join, with no timeout of its own: run it on a
        // helper thread and give up after `timeout`. On timeout the helper stays blocked inside
        // NCCL (nothing can cancel it); the caller is expected to exit with the error.
        let ctx = stream.context().clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name(format!("nccl-init-{rank}"))
            .spawn(move || {
                let outcome = ctx
                    .bind_to_thread()
                    .map_err(|source| NcclError::Driver {
                        op: "bind context",
                        rank,
                        source,
                    })
                    .and_then(|()| {
                        let mut comm: sys::ncclComm_t = ptr::null_mut();
                        // SAFETY: `comm` is a valid out pointer; the id is NCCL's own 128-byte
                        // layout.
                        unsafe {
                            result::comm_init_rank(
                                &mut comm,
                                world_size as i32,
                                sys::ncclUniqueId { internal },
                                rank as i32,
                            )
                        }
                        .map(|_| RawComm(comm))
                        .map_err(|e| NcclError::Call {
                            op: "ncclCommInitRank",
                            rank,
                            code: nccl_code(e),
                        })
                    });
                // The receiver may have given up already; then the communicator leaks, which is
                // fine for a process that is exiting with an error.
                let _ = tx.send(outcome);
            })
            .map_err(|e| NcclError::Call {
                op: "spawn ncclCommInitRank thread",
                rank,
                code: e.to_string(),
            })?;
        let comm = match rx.recv_timeout(timeout) {
            Ok(outcome) => outcome?.0,
            Err(_) => {
                return Err(NcclError::InitTimeout {
                    rank,
                    world_size,
                    waited: timeout,
                })
            }
        };
        Ok(Communicator {
            handle: Arc::new(CommHandle {
                comm: AtomicPtr::new(comm),
                rank,
            }),
            stream,
            rank,
            world_size,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The communication stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The handle a [`Watchdog`] aborts.
    pub fn abort_target(&self) -> Arc<dyn Abortable> {
        self.handle.clone()
    }

    /// Starts a watchdog for this communicator.
    pub fn watchdog(&self, timeout: Duration) -> Watchdog {
        Watchdog::start(
            self.rank,
            timeout,
            Duration::from_millis(20),
            self.abort_target(),
        )
    }

    /// Broadcasts `buf` from `root` to every rank, in place, on the communication stream.
    pub fn broadcast_in_place<T: NcclType + DeviceRepr>(
        &self,
        buf: &mut impl DevicePtrMut<T>,
        root: usize,
    ) -> Result<(), NcclError> {
        let comm = self.handle.get()?;
        let count = buf.len();
        let (ptr, _record) = buf.device_ptr_mut(&self.stream);
        // SAFETY: `ptr` addresses `count` elements of T on this rank's device, kept alive and
        // ordered by cudarc's stream tracking (`_record`) until the call is enqueued.
        unsafe {
            result::broadcast(
                ptr as *const _,
                ptr as *mut _,
                count,
                T::as_nccl_type(),
                root as i32,
                comm,
                self.stream.cu_stream() as _,
            )
        }
        .map(|_| ())
        .map_err(|e| NcclError::Call {
            op: "ncclBroadcast",
            rank: self.rank,
            code: nccl_code(e),
        })
    }

    /// Averages `buf` over all ranks, in place, on the communication stream.
    pub fn all_reduce_avg_in_place<T: NcclType + DeviceRepr>(
        &self,
        buf: &mut impl DevicePtrMut<T>,
    ) -> Result<(), NcclError> {
        self.all_reduce_in_place(buf, sys::ncclRedOp_t::ncclAvg)
    }

    /// Sums `buf` over all ranks, in place, on the communication stream (synchronised batch
    /// norm reduces its per-channel sums and counts this way).
    pub fn all_reduce_sum_in_place<T: NcclType + DeviceRepr>(
        &self,
        buf: &mut impl DevicePtrMut<T>,
    ) -> Result<(), NcclError> {
        self.all_reduce_in_place(buf, sys::ncclRedOp_t::ncclSum)
    }

    fn all_reduce_in_place<T: NcclType + DeviceRepr>(
        &self,
        buf: &mut impl DevicePtrMut<T>,
        op: sys::ncclRedOp_t,
    ) -> Result<(), NcclError> {
        let comm = self.handle.get()?;
        let count = buf.len();
        let (ptr, _record) = buf.device_ptr_mut(&self.stream);
        // SAFETY: as in `broadcast_in_place`.
        unsafe {
            result::all_reduce(
                ptr as *const _,
                ptr as *mut _,
                count,
                T::as_nccl_type(),
                op,
                comm,
                self.stream.cu_stream() as _,
            )
        }
        .map(|_| ())
        .map_err(|e| NcclError::Call {
            op: "ncclAllReduce",
            rank: self.rank,
            code: nccl_code(e),
        })
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        let p = self.handle.comm.swap(ptr::null_mut(), Ordering::AcqRel);
        if !p.is_null() {
            // SAFETY: `p` is live and owned by this communicator; after the swap nothing else
            // (the watchdog included) can reach it.
            if let Err(e) = unsafe { result::comm_destroy(p) } {
                tracing::warn!("rank {}: ncclCommDestroy failed: {:?}", self.rank, e.0);
            }
        }
    }
}

/// Bucketed gradient averaging for one rank, overlapping backward.
///
/// The backend writes gradients into one flat f32 buffer laid out by the [`BucketPlan`]
/// (`plan.param_elements(i)` is parameter i's range). After launching the kernels that produce
/// parameter i's gradient on the compute stream it calls [`GradientSync::grad_ready`]; each
/// bucket whose parameters are all written is then all-reduced on the communication stream while
/// backward continues. (The training driver, `train::gpu`, does this from
/// [`crate::model::Network::train_step_with`]'s gradient-ready hook: the CUDA backend keeps each
/// gradient in its own tensor, so the hook copies it into its range of the flat buffer on the
/// compute stream, then reports it; the averaged values are copied back after the last bucket.) [`GradientSync::finish_step`] makes the compute stream wait for the last
/// bucket, so the optimizer (enqueued after it) sees averaged gradients.
pub struct GradientSync {
    // Declared first so it is dropped first: its thread must stop polling the communicator
    // before the communicator is destroyed.
    watchdog: Watchdog,
    comm: Communicator,
    compute: Arc<CudaStream>,
    plan: BucketPlan,
    tracker: BucketTracker,
    ready: Vec<CudaEvent>,
    done: Vec<Arc<CudaEvent>>,
    step: u64,
    timeline: Option<GpuTimeline>,
}

impl std::fmt::Debug for GradientSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradientSync")
            .field("rank", &self.comm.rank)
            .field("buckets", &self.plan.buckets().len())
            .field("step", &self.step)
            .finish()
    }
}

impl GradientSync {
    /// Synchronises gradients laid out by `plan` over `comm`; backward runs on `compute`.
    /// A collective pending longer than `timeout` aborts the communicator.
    pub fn new(
        comm: Communicator,
        compute: Arc<CudaStream>,
        plan: BucketPlan,
        timeout: Duration,
    ) -> Result<Self, NcclError> {
        let rank = comm.rank;
        let ctx = compute.context().clone();
        let event = |op| {
            ctx.new_event(None)
                .map_err(|source| NcclError::Driver { op, rank, source })
        };
        let ready = (0..plan.buckets().len())
            .map(|_| event("create bucket-ready event"))
            .collect::<Result<Vec<_>, _>>()?;
        let done = (0..plan.buckets().len())
            .map(|_| event("create bucket-done event").map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        let watchdog = comm.watchdog(timeout);
        Ok(GradientSync {
            tracker: BucketTracker::new(&plan),
            comm,
            compute,
            plan,
            ready,
            done,
            watchdog,
            step: 0,
            timeline: None,
        })
    }

    /// The bucket plan (the gradient buffer layout).
    pub fn plan(&self) -> &BucketPlan {
        &self.plan
    }

    /// The communicator.
    pub fn communicator(&self) -> &Communicator {
        &self.comm
    }

    /// Broadcasts rank 0's weights to every rank and waits (bounded by the watchdog) until
    /// they have arrived; call once before training.
    pub fn broadcast_weights(&self, weights: &mut CudaSlice<f32>) -> Result<(), NcclError> {
        let rank = self.comm.rank;
        // The weights were written on the compute stream; the broadcast must see them.
        self.comm
            .stream
            .join(&self.compute)
            .map_err(|source| NcclError::Driver {
                op: "order broadcast after compute",
                rank,
                source,
            })?;
        self.comm.broadcast_in_place(weights, 0)?;
        let done =
            Arc::new(
                self.comm
                    .stream
                    .record_event(None)
                    .map_err(|source| NcclError::Driver {
                        op: "record broadcast event",
                        rank,
                        source,
                    })?,
            );
        let probe = done.clone();
        self.watchdog
            .watch("broadcast of initial weights", move || {
                probe.try_is_complete().map_err(|e| e.to_string())
            })?;
        self.compute
            .wait(&done)
            .map_err(|source| NcclError::Driver {
                op: "order compute after broadcast",
                rank,
                source,
            })?;
        // Bounded: the watchdog aborts (and wait_idle returns) once the timeout passes.
        self.watchdog.wait_idle(Duration::from_secs(24 * 3600))?;
        Ok(())
    }

    /// Starts a step's gradient bookkeeping.
    pub fn begin_step(&mut self) -> Result<(), NcclError> {
        self.watchdog.check()?;
        self.tracker.reset();
        self.step += 1;
        Ok(())
    }

    /// Reports that parameter `param`'s gradient kernels are enqueued on the compute stream;
    /// launches every bucket that became complete. Returns the buckets launched.
    pub fn grad_ready(
        &mut self,
        grads: &mut CudaSlice<f32>,
        param: usize,
    ) -> Result<Vec<usize>, NcclError> {
        if grads.len() < self.plan.total_elements() {
            return Err(NcclError::BufferSize {
                expected: self.plan.total_elements(),
                got: grads.len(),
            });
        }
        let launch = self.tracker.mark_ready(param)?;
        let rank = self.comm.rank;
        for &k in &launch {
            self.ready[k]
                .record(&self.compute)
                .map_err(|source| NcclError::Driver {
                    op: "record bucket-ready event",
                    rank,
                    source,
                })?;
            self.comm
                .stream
                .wait(&self.ready[k])
                .map_err(|source| NcclError::Driver {
                    op: "wait bucket-ready event",
                    rank,
                    source,
                })?;
            let range = self.plan.bucket_elements(k);
            let mut view = grads.slice_mut(range);
            let span = match &self.timeline {
                Some(t) => t
                    .begin(&self.comm.stream)
                    .map_err(|source| NcclError::Driver {
                        op: "record trace event",
                        rank,
                        source,
                    })?,
                None => None,
            };
            self.comm.all_reduce_avg_in_place(&mut view)?;
            if let Some(t) = &mut self.timeline {
                t.end(
                    span,
                    &self.comm.stream,
                    format!("all-reduce bucket {k}"),
                    "comm",
                    rows::COMM,
                )
                .map_err(|source| NcclError::Driver {
                    op: "record trace event",
                    rank,
                    source,
                })?;
            }
            self.done[k]
                .record(&self.comm.stream)
                .map_err(|source| NcclError::Driver {
                    op: "record bucket-done event",
                    rank,
                    source,
                })?;
            let probe = self.done[k].clone();
            self.watchdog.watch(
                format!("all-reduce of bucket {k} in step {}", self.step),
                move || probe.try_is_complete().map_err(|e| e.to_string()),
            )?;
        }
        Ok(launch)
    }

    /// Ends the step: every gradient must have been reported; the compute stream then waits
    /// for the last bucket, so whatever is enqueued next (the optimizer) sees averaged values.
    pub fn finish_step(&mut self) -> Result<(), NcclError> {
        self.watchdog.check()?;
        if !self.tracker.all_launched() {
            let missing: Vec<usize> = (0..self.plan.param_count())
                .filter(|&i| !self.tracker.is_ready(i))
                .collect();
            return Err(NcclError::IncompleteStep {
                rank: self.comm.rank,
                missing: missing.len(),
                first: missing
                    .first()
                    .map_or_else(String::new, |&i| self.plan.param_name(i).to_string()),
            });
        }
        if let Some(last) = self.done.last() {
            self.compute
                .wait(last)
                .map_err(|source| NcclError::Driver {
                    op: "wait for the last bucket",
                    rank: self.comm.rank,
                    source,
                })?;
        }
        Ok(())
    }

    /// Traces every bucket's all-reduce on `timeline` (the `--trace` timeline of this GPU).
    pub fn set_timeline(&mut self, timeline: Option<GpuTimeline>) {
        self.timeline = timeline;
    }

    /// The timeline, to flush it at a step boundary.
    pub fn timeline_mut(&mut self) -> Option<&mut GpuTimeline> {
        self.timeline.as_mut()
    }

    /// Ok unless the watchdog aborted the communicator.
    pub fn check(&self) -> Result<(), NcclError> {
        Ok(self.watchdog.check()?)
    }
}

#[cfg(test)]
mod tests {
    use super::hint_for_dirs;

    #[test]
    fn a_versioned_nccl_gets_an_exact_symlink_hint() {
        let dir = tempfile::tempdir().unwrap();
        let empty = tempfile::tempdir().unwrap();
        let general = hint_for_dirs(&[empty.path().to_path_buf()]);
        assert!(general.contains("install NCCL"), "{general}");
        std::fs::write(dir.path().join("libnccl.so.2"), b"").unwrap();
        let hint = hint_for_dirs(&[empty.path().to_path_buf(), dir.path().to_path_buf()]);
        let so2 = dir.path().join("libnccl.so.2");
        assert!(
            hint.contains(&format!("ln -sf {}", so2.display())),
            "{hint}"
        );
    }
}
