//! One rank of an NCCL communicator: joining (init, split) with a timeout, the guard around
//! the raw handle, and the raw collectives on its communication stream.

use std::ffi::{c_char, c_int, c_void};
use std::ptr;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DriverError};
use cudarc::nccl::sys::{
    cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t, ncclUniqueId,
};

use super::ffi::{ensure_available, nccl, UNIQUE_ID_BYTES};
use super::NcclError;
use crate::dist::comm_guard::{CommGuard, CommGuardError, RawComm};
use crate::dist::watchdog::{Abortable, Watchdog};

/// A new event that the host will wait on: with blocking synchronisation, so the waiting
/// thread sleeps in the driver instead of spinning a core (one per rank otherwise) until the
/// GPU gets there. Timing stays on (the flag set cannot say "blocking without timing"), which
/// costs one timestamp per record.
pub fn host_wait_event(stream: &CudaStream) -> Result<CudaEvent, DriverError> {
    stream.context().new_event(Some(
        cudarc::driver::sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC,
    ))
}

/// A raw communicator handed from the init thread to its owner.
struct InitComm(ncclComm_t);

// SAFETY: a freshly created communicator is not yet used by any thread; ownership moves to the
// receiving thread, which is the only one using it from then on.
unsafe impl Send for InitComm {}

/// The communicator a helper thread blocked in NCCL (init or split) hands over: waited for at
/// most `timeout`, and given up when `abandon()` turns true (checked every 50 ms).
fn wait_for_comm(
    rx: &std::sync::mpsc::Receiver<Result<InitComm, NcclError>>,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    abandon: &dyn Fn() -> bool,
) -> Result<InitComm, NcclError> {
    let start = std::time::Instant::now();
    loop {
        let left = timeout.saturating_sub(start.elapsed());
        match rx.recv_timeout(left.min(Duration::from_millis(50))) {
            Ok(outcome) => return outcome,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) if !left.is_zero() => {
                if abandon() {
                    return Err(NcclError::InitAbandoned { rank });
                }
            }
            Err(_) => {
                return Err(NcclError::InitTimeout {
                    rank,
                    world_size,
                    waited: timeout,
                })
            }
        }
    }
}

/// A live NCCL communicator, as [`CommGuard`] hands it to one call at a time.
#[derive(Debug, Clone, Copy)]
pub(super) struct NcclHandle {
    comm: ncclComm_t,
    rank: usize,
}

// SAFETY: NCCL communicators may be used from any thread; the guard makes sure the handle is
// never freed while a call uses it, and freed exactly once.
unsafe impl Send for NcclHandle {}
// SAFETY: as above (shared only through the guard).
unsafe impl Sync for NcclHandle {}

impl RawComm for NcclHandle {
    fn abort(&self) -> Result<(), String> {
        let lib = nccl().map_err(|e| e.to_string())?;
        // SAFETY: the handle came from ncclCommInitRank; the guard calls this once, with no
        // call in flight, and never hands the handle out again.
        lib.check("ncclCommAbort", self.rank, unsafe {
            (lib.comm_abort)(self.comm)
        })
        .map_err(|e| e.to_string())
    }

    fn destroy(&self) -> Result<(), String> {
        let lib = nccl().map_err(|e| e.to_string())?;
        // SAFETY: as in `abort`.
        lib.check("ncclCommDestroy", self.rank, unsafe {
            (lib.comm_destroy)(self.comm)
        })
        .map_err(|e| e.to_string())
    }

    fn async_error(&self) -> Option<String> {
        let lib = nccl().ok()?;
        let mut code = ncclResult_t::ncclSuccess;
        // SAFETY: the guard keeps the communicator live during this call; `code` is a valid
        // out pointer.
        let r = unsafe { (lib.comm_get_async_error)(self.comm, &mut code) };
        match (r, code) {
            (ncclResult_t::ncclSuccess, ncclResult_t::ncclSuccess)
            | (ncclResult_t::ncclSuccess, ncclResult_t::ncclInProgress) => None,
            (ncclResult_t::ncclSuccess, c) => {
                Some(format!("asynchronous NCCL error {}", lib.describe(c)))
            }
            (e, _) => Some(format!("ncclCommGetAsyncError failed: {}", lib.describe(e))),
        }
    }
}

/// The raw communicator behind its guard, shared with the watchdog and the process's abort
/// group so they can abort it from their own threads.
pub(super) type CommHandle = CommGuard<NcclHandle>;

fn use_after_abort(e: CommGuardError) -> NcclError {
    match e {
        CommGuardError::UseAfterAbort { rank } => NcclError::UseAfterAbort { rank },
    }
}

/// Element types NCCL reduces.
pub trait NcclElement: cudarc::driver::DeviceRepr {
    /// NCCL's name for the type.
    const TYPE: ncclDataType_t;
}

impl NcclElement for f32 {
    const TYPE: ncclDataType_t = ncclDataType_t::ncclFloat32;
}

impl NcclElement for f64 {
    const TYPE: ncclDataType_t = ncclDataType_t::ncclFloat64;
}

impl NcclElement for u8 {
    const TYPE: ncclDataType_t = ncclDataType_t::ncclUint8;
}

/// One rank of an NCCL communicator, bound to its communication stream.
#[derive(Debug)]
pub struct Communicator {
    pub(super) handle: Arc<CommHandle>,
    pub(super) stream: Arc<CudaStream>,
    pub(super) rank: usize,
    pub(super) world_size: usize,
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
        Self::init_unless(stream, rank, world_size, unique_id, timeout, &|| false)
    }

    /// [`Communicator::init`] that gives up as soon as `abandon()` is true (checked every
    /// 50 ms): another rank of this process failed and will never join, so waiting for it
    /// would last the whole `timeout`.
    pub fn init_unless(
        stream: Arc<CudaStream>,
        rank: usize,
        world_size: usize,
        unique_id: &[u8],
        timeout: Duration,
        abandon: &dyn Fn() -> bool,
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
        let mut internal = [0 as c_char; UNIQUE_ID_BYTES];
        for (dst, &src) in internal.iter_mut().zip(unique_id) {
            *dst = src as c_char;
        }
        // ncclCommInitRank blocks until all ranks join, with no timeout of its own: run it on a
        // helper thread and give up after `timeout` or when abandoned. Then the helper stays
        // blocked inside NCCL (nothing can cancel it); the caller is expected to exit with the
        // error.
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
                        let lib = nccl()?;
                        let mut comm: ncclComm_t = ptr::null_mut();
                        // SAFETY: `comm` is a valid out pointer; the id is NCCL's own 128-byte
                        // layout.
                        let code = unsafe {
                            (lib.comm_init_rank)(
                                &mut comm,
                                world_size as c_int,
                                ncclUniqueId { internal },
                                rank as c_int,
                            )
                        };
                        lib.check("ncclCommInitRank", rank, code)?;
                        Ok(InitComm(comm))
                    });
                // The receiver may have given up already; then the communicator leaks, which is
                // fine for a process that is exiting with an error.
                let _ = tx.send(outcome);
            })
            .map_err(|source| NcclError::Call {
                op: "spawn ncclCommInitRank thread",
                rank,
                // The refused thread, the limit and the hint.
                code: pipeline::threads::ThreadStartError {
                    thread: format!("nccl-init-{rank}"),
                    source,
                }
                .to_string(),
            })?;
        let comm = wait_for_comm(&rx, rank, world_size, timeout, abandon)?.0;
        Ok(Communicator {
            handle: Arc::new(CommGuard::new(rank, NcclHandle { comm, rank })),
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

    /// A second communicator over the same ranks, its collectives on `stream`, made by
    /// `ncclCommSplit` (every rank calls it at the same point, as for an init). `None` when the
    /// library has no `ncclCommSplit` (NCCL before 2.18), or when `NCCL_COMM_SPLIT_SHARE_RESOURCES`
    /// asks the child to share the parent's resources (NCCL then forbids using the two
    /// concurrently, which is the point of a second communicator): the caller then makes one
    /// with a second init. Waits at most `timeout` for the other ranks, and gives up when this
    /// communicator is aborted meanwhile.
    pub fn split(
        &self,
        stream: Arc<CudaStream>,
        timeout: Duration,
    ) -> Result<Option<Communicator>, NcclError> {
        let lib = nccl()?;
        let Some(split) = lib.comm_split else {
            return Ok(None);
        };
        if std::env::var("NCCL_COMM_SPLIT_SHARE_RESOURCES").is_ok_and(|v| v.trim() != "0") {
            return Ok(None);
        }
        let rank = self.rank;
        let ctx = stream.context().clone();
        let handle = self.handle.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name(format!("nccl-split-{rank}"))
            .spawn(move || {
                let outcome = ctx
                    .bind_to_thread()
                    .map_err(|source| NcclError::Driver {
                        op: "bind context",
                        rank,
                        source,
                    })
                    .and_then(|()| {
                        let mut child: ncclComm_t = ptr::null_mut();
                        // Inside the guard: the parent is not freed while NCCL splits it (an
                        // abort meanwhile ends it when the split returns).
                        let code = handle
                            .with(|parent| {
                                // SAFETY: a live communicator, a valid out pointer, and a null
                                // config (inherit the parent's).
                                unsafe {
                                    split(
                                        parent.comm,
                                        0,
                                        rank as c_int,
                                        &mut child,
                                        ptr::null_mut(),
                                    )
                                }
                            })
                            .map_err(use_after_abort)?;
                        lib.check("ncclCommSplit", rank, code)?;
                        Ok(InitComm(child))
                    });
                let _ = tx.send(outcome);
            })
            .map_err(|e| NcclError::Call {
                op: "spawn ncclCommSplit thread",
                rank,
                code: e.to_string(),
            })?;
        let child = wait_for_comm(&rx, rank, self.world_size, timeout, &|| {
            self.handle.is_aborted()
        })?;
        Ok(Some(Communicator {
            handle: Arc::new(CommGuard::new(
                rank,
                NcclHandle {
                    comm: child.0,
                    rank,
                },
            )),
            stream,
            rank,
            world_size: self.world_size,
        }))
    }

    /// Makes `child` end with this communicator: aborting this one (its watchdog, the abort
    /// group) aborts the child too.
    pub fn adopt(&self, child: &Communicator) {
        self.handle.add_dependent(child.abort_target());
    }

    /// A barrier on the new communicator: an all-reduce of one value on the communication
    /// stream, waited for on the host (a blocking-sync event, under a watchdog of `timeout`).
    ///
    /// Why an all-reduce rather than a host barrier among the local threads: it covers every
    /// rank of every node, not only this process's; it proves the communicator works (its
    /// transports connect here, before the rank's first large allocations take the memory
    /// NCCL's connection buffers need, and a broken transport is an error at start naming the
    /// barrier, not a timeout in the first step's bucket); and an abort of the communicator
    /// (the watchdog, or the process's abort group when another local rank fails) ends it.
    pub fn barrier(&self, timeout: Duration) -> Result<(), NcclError> {
        let driver = |op: &'static str| {
            let rank = self.rank;
            move |source| NcclError::Driver { op, rank, source }
        };
        let mut one = self
            .stream
            .alloc_zeros::<f32>(1)
            .map_err(driver("allocate the barrier's value"))?;
        self.all_reduce_sum_in_place(&mut one)?;
        let done = Arc::new(host_wait_event(&self.stream).map_err(driver("record the barrier"))?);
        done.record(&self.stream)
            .map_err(driver("record the barrier"))?;
        let dog = self.watchdog(timeout);
        let probe = done.clone();
        dog.watch("the barrier after joining the communicator", move || {
            probe.try_is_complete().map_err(|e| e.to_string())
        })?;
        let waited = done.synchronize().map_err(driver("wait for the barrier"));
        dog.check()?;
        if self.handle.is_aborted() {
            return Err(NcclError::UseAfterAbort { rank: self.rank });
        }
        waited
    }

    /// Broadcasts `len` elements at device address `ptr` from `root` to every rank, in place,
    /// on the communication stream.
    ///
    /// # Safety
    /// `ptr` must address `len` live elements of `T` on this rank's device, untouched by other
    /// streams until the broadcast has completed.
    pub unsafe fn broadcast_raw<T: NcclElement>(
        &self,
        ptr: u64,
        len: usize,
        root: usize,
    ) -> Result<(), NcclError> {
        let lib = nccl()?;
        let stream = self.stream.cu_stream() as cudaStream_t;
        let code = self
            .handle
            .with(|comm| {
                (lib.broadcast)(
                    ptr as *const c_void,
                    ptr as *mut c_void,
                    len,
                    T::TYPE,
                    root as c_int,
                    comm.comm,
                    stream,
                )
            })
            .map_err(use_after_abort)?;
        lib.check("ncclBroadcast", self.rank, code)
    }

    /// Reduces `len` elements at `ptr` over every rank, in place, on the communication stream:
    /// the average when `average`, else the sum.
    ///
    /// # Safety
    /// As [`Communicator::broadcast_raw`].
    pub unsafe fn all_reduce_raw<T: NcclElement>(
        &self,
        ptr: u64,
        len: usize,
        average: bool,
    ) -> Result<(), NcclError> {
        let lib = nccl()?;
        let op = if average {
            ncclRedOp_t::ncclAvg
        } else {
            ncclRedOp_t::ncclSum
        };
        let stream = self.stream.cu_stream() as cudaStream_t;
        let code = self
            .handle
            .with(|comm| {
                (lib.all_reduce)(
                    ptr as *const c_void,
                    ptr as *mut c_void,
                    len,
                    T::TYPE,
                    op,
                    comm.comm,
                    stream,
                )
            })
            .map_err(use_after_abort)?;
        lib.check("ncclAllReduce", self.rank, code)
    }

    /// [`Communicator::broadcast_raw`] of a whole device buffer.
    pub fn broadcast_in_place<T: NcclElement>(
        &self,
        buf: &mut CudaSlice<T>,
        root: usize,
    ) -> Result<(), NcclError> {
        let len = buf.len();
        let (p, _record) = cudarc::driver::DevicePtrMut::device_ptr_mut(buf, &self.stream);
        // SAFETY: `p` addresses the whole live buffer; the communication stream orders it.
        unsafe { self.broadcast_raw::<T>(p, len, root) }
    }

    /// The average of a whole device buffer over every rank, in place.
    pub fn all_reduce_avg_in_place<T: NcclElement>(
        &self,
        buf: &mut CudaSlice<T>,
    ) -> Result<(), NcclError> {
        let len = buf.len();
        let (p, _record) = cudarc::driver::DevicePtrMut::device_ptr_mut(buf, &self.stream);
        // SAFETY: as above.
        unsafe { self.all_reduce_raw::<T>(p, len, true) }
    }

    /// The sum of a whole device buffer over every rank, in place.
    pub fn all_reduce_sum_in_place<T: NcclElement>(
        &self,
        buf: &mut CudaSlice<T>,
    ) -> Result<(), NcclError> {
        let len = buf.len();
        let (p, _record) = cudarc::driver::DevicePtrMut::device_ptr_mut(buf, &self.stream);
        // SAFETY: as above.
        unsafe { self.all_reduce_raw::<T>(p, len, false) }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // Destroyed unless it was aborted; the guard waits for any call in flight (the
        // watchdog's poll) and ends the communicator exactly once.
        self.handle.destroy();
    }
}
