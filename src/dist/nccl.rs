//! NCCL: the communicator and [`NcclCollective`], the [`Collective`] of GPU ranks.
//!
//! One communicator rank per GPU, one driver thread per rank (`Communicator::init` with the id
//! from [`new_unique_id`] on rank 0, handed to the others in-process or through the
//! [`super::rendezvous`]). Collectives run on the rank's communication stream; ordering
//! against the compute stream is explicit, through events:
//!
//! ```text
//! compute: ..backward layers L..k.. [scale k] [record ready_k] ..backward k-1..0.. [wait done_last] optimizer
//! comm:                              [wait ready_k] all-reduce(avg) bucket k [record done_k]
//! ```
//!
//! Gradients are written by the backward kernels straight into their bucket's range of one
//! flat device buffer (the network's gradient tensors are views of it) and averaged there in
//! place: no copies. Every collective is registered with a [`Watchdog`]; one that exceeds the
//! timeout (a rank stopped answering) or an asynchronous NCCL error aborts the communicator
//! (`ncclCommAbort`, which makes the pending kernels return) and surfaces as an error naming
//! the rank, never as a hang. Host exchanges wait on their own completion event, never on the
//! watchdog's polling tick. The raw communicator sits behind a [`CommGuard`]: every NCCL call
//! runs inside it, and an abort from another thread (the watchdog, the process's abort group)
//! frees the communicator only when no call is using it.
//!
//! libnccl is loaded at run time from wherever [`crate::cuda::library`] finds it (the CUDA
//! toolkit, `LD_LIBRARY_PATH`, or NVIDIA's pip wheel `nvidia/nccl/lib/libnccl.so.2`), so a
//! missing library is one clear error, never a panic, and no symlink is needed.

use std::ffi::{c_char, c_int, c_void};
use std::ops::Range;
use std::path::PathBuf;
use std::ptr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cudarc::driver::{result as drv, CudaEvent, CudaSlice, CudaStream, DriverError};
use cudarc::nccl::sys::{
    cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t, ncclUniqueId,
};

use super::collective::{Collective, CollectiveError};
use super::comm_guard::{CommGuard, CommGuardError, RawComm};
use super::watchdog::{Abortable, Watchdog, WatchdogError};
use crate::backend::bn_sync::SumThroughHostError;
use crate::backend::SumsMut;
use crate::cuda::library::{self, Lib};
use crate::cuda::timeline::{rows, GpuTimeline};
use crate::cuda::{grad, GpuDevice};

/// Errors of the NCCL layer.
#[derive(Debug, thiserror::Error)]
pub enum NcclError {
    /// libnccl could not be found or loaded.
    #[error("the NCCL library could not be loaded: {hint}")]
    LibraryMissing {
        /// Where it was looked for, and what to do about it.
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
    /// A kernel around a collective (the gradient scale) failed.
    #[error("rank {rank}: {source}")]
    Kernel {
        /// The rank.
        rank: usize,
        /// The backend's error.
        #[source]
        source: crate::cuda::CudaError,
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
    /// Joining the communicator was given up because another rank of this process failed.
    #[error("rank {rank}: stopped joining the NCCL communicator because another rank of this process failed")]
    InitAbandoned {
        /// This rank.
        rank: usize,
    },
    /// Using a communicator after it was aborted.
    #[error("rank {rank}: the NCCL communicator was aborted; no further collectives are possible")]
    UseAfterAbort {
        /// The rank.
        rank: usize,
    },
    /// A buffer range outside the gradient buffer.
    #[error("rank {rank}: range {range:?} is outside the {len}-element gradient buffer")]
    OutOfRange {
        /// The rank.
        rank: usize,
        /// The range asked for.
        range: Range<usize>,
        /// The buffer's length.
        len: usize,
    },
}

/// The NCCL entry points birdtrain uses, from the library [`library::load`] found.
struct NcclLib {
    _lib: libloading::Library,
    /// What was opened: a name the loader resolved, or the file found by the search.
    path: PathBuf,
    get_version: unsafe extern "C" fn(*mut c_int) -> ncclResult_t,
    get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> ncclResult_t,
    comm_init_rank:
        unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> ncclResult_t,
    comm_abort: unsafe extern "C" fn(ncclComm_t) -> ncclResult_t,
    comm_destroy: unsafe extern "C" fn(ncclComm_t) -> ncclResult_t,
    comm_get_async_error: unsafe extern "C" fn(ncclComm_t, *mut ncclResult_t) -> ncclResult_t,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclRedOp_t,
        ncclComm_t,
        cudaStream_t,
    ) -> ncclResult_t,
    broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        c_int,
        ncclComm_t,
        cudaStream_t,
    ) -> ncclResult_t,
    error_string: unsafe extern "C" fn(ncclResult_t) -> *const c_char,
    /// `ncclCommSplit` (NCCL ≥ 2.18), when the library has it.
    comm_split: Option<CommSplitFn>,
}

/// `ncclCommSplit(comm, color, key, &newcomm, config)`; a null config inherits the parent's.
type CommSplitFn =
    unsafe extern "C" fn(ncclComm_t, c_int, c_int, *mut ncclComm_t, *mut c_void) -> ncclResult_t;

impl NcclLib {
    fn open() -> Result<NcclLib, String> {
        let path = library::load(Lib::Nccl).map_err(|e| e.to_string())?;
        // SAFETY: loading NCCL runs its initialisers, which are safe to run.
        let lib = unsafe { libloading::Library::new(&path) }
            .map_err(|e| format!("{} does not load: {e}", path.display()))?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol is NCCL's C function of this signature (nccl.h); the
                // library stays loaded as long as this struct.
                *unsafe { lib.get($name) }.map_err(|e| {
                    format!(
                        "{} has no {}: {e} (an NCCL older than 2.12?)",
                        path.display(),
                        String::from_utf8_lossy(&$name[..$name.len() - 1])
                    )
                })?
            };
        }
        Ok(NcclLib {
            get_version: sym!(b"ncclGetVersion\0"),
            get_unique_id: sym!(b"ncclGetUniqueId\0"),
            comm_init_rank: sym!(b"ncclCommInitRank\0"),
            comm_abort: sym!(b"ncclCommAbort\0"),
            comm_destroy: sym!(b"ncclCommDestroy\0"),
            comm_get_async_error: sym!(b"ncclCommGetAsyncError\0"),
            all_reduce: sym!(b"ncclAllReduce\0"),
            broadcast: sym!(b"ncclBroadcast\0"),
            error_string: sym!(b"ncclGetErrorString\0"),
            // SAFETY: NCCL's C function of this signature (nccl.h, 2.18 and later); optional:
            // an older library gets the second communicator from a second init instead.
            comm_split: unsafe { lib.get::<CommSplitFn>(b"ncclCommSplit\0") }
                .ok()
                .map(|f| *f),
            _lib: lib,
            path,
        })
    }

    fn describe(&self, code: ncclResult_t) -> String {
        // SAFETY: NCCL returns a static NUL-terminated string for every result code.
        let text = unsafe { (self.error_string)(code) };
        if text.is_null() {
            return format!("{code:?}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        let s = unsafe { std::ffi::CStr::from_ptr(text) }.to_string_lossy();
        format!("{code:?} ({s})")
    }

    fn check(&self, op: &'static str, rank: usize, code: ncclResult_t) -> Result<(), NcclError> {
        match code {
            ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress => Ok(()),
            other => Err(NcclError::Call {
                op,
                rank,
                code: self.describe(other),
            }),
        }
    }
}

fn nccl() -> Result<&'static NcclLib, NcclError> {
    static LIB: OnceLock<Result<NcclLib, String>> = OnceLock::new();
    LIB.get_or_init(NcclLib::open)
        .as_ref()
        .map_err(|hint| NcclError::LibraryMissing { hint: hint.clone() })
}

/// Checks that the CUDA driver and NCCL can be loaded; returns NCCL's version code
/// (e.g. 22703 for 2.27.3).
pub fn ensure_available() -> Result<i32, NcclError> {
    // SAFETY: only tries to dlopen the driver library; nothing is called through it.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(NcclError::DriverMissing);
    }
    library().map(|(_, version)| version)
}

/// The NCCL library this process uses: the file (or loader name) it was opened from, and its
/// version code. Needs no driver (`birdtrain env` reports it on any machine).
pub fn library() -> Result<(PathBuf, i32), NcclError> {
    let lib = nccl()?;
    let mut version = 0;
    // SAFETY: out-parameter; ncclGetVersion touches no device.
    lib.check("ncclGetVersion", 0, unsafe {
        (lib.get_version)(&mut version)
    })?;
    Ok((lib.path.clone(), version))
}

/// Size of an NCCL unique id in bytes.
pub const UNIQUE_ID_BYTES: usize = 128;

/// Creates a new NCCL unique id (rank 0 does this once per communicator).
pub fn new_unique_id() -> Result<Vec<u8>, NcclError> {
    ensure_available()?;
    let lib = nccl()?;
    let mut id = ncclUniqueId {
        internal: [0; UNIQUE_ID_BYTES],
    };
    // SAFETY: out-parameter of NCCL's 128-byte id type.
    lib.check("ncclGetUniqueId", 0, unsafe {
        (lib.get_unique_id)(&mut id)
    })?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
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
struct NcclHandle {
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
type CommHandle = CommGuard<NcclHandle>;

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

/// A new event that the host will wait on: with blocking synchronisation, so the waiting
/// thread sleeps in the driver instead of spinning a core (one per rank otherwise) until the
/// GPU gets there. Timing stays on (the flag set cannot say "blocking without timing"), which
/// costs one timestamp per record.
pub fn host_wait_event(stream: &CudaStream) -> Result<CudaEvent, DriverError> {
    stream.context().new_event(Some(
        cudarc::driver::sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC,
    ))
}

/// A rank's flat gradient buffer on its GPU: the device address and length of the f32 arena
/// the network's gradient tensors are views of. It does not own the memory: the network does,
/// and outlives every collective on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceGrads {
    /// Device address of element 0.
    pub ptr: u64,
    /// Elements.
    pub len: usize,
}

/// A host exchange's device buffer (grown on demand).
struct Scratch<T> {
    buf: Option<CudaSlice<T>>,
}

impl<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits> Scratch<T> {
    fn get(
        &mut self,
        stream: &Arc<CudaStream>,
        len: usize,
    ) -> Result<&mut CudaSlice<T>, DriverError> {
        if self.buf.as_ref().is_none_or(|b| b.len() < len) {
            self.buf = None;
            self.buf = Some(stream.alloc_zeros::<T>(len.max(16))?);
        }
        Ok(self.buf.as_mut().expect("allocated above"))
    }
}

/// The [`Collective`] of one GPU rank: bucket averages on the communication stream ordered
/// against the compute stream by events, host exchanges that wait on their own event.
pub struct NcclCollective {
    // Declared first so it is dropped first: its thread must stop polling the communicator
    // before the communicator is destroyed.
    watchdog: Watchdog,
    comm: Communicator,
    device: Arc<GpuDevice>,
    ready: Vec<CudaEvent>,
    done: Vec<Arc<CudaEvent>>,
    last: Option<usize>,
    step: u64,
    small_f64: Scratch<f64>,
    small_f32: Scratch<f32>,
    timeline: Option<GpuTimeline>,
    /// Synchronised batch norm's sums, once [`NcclCollective::open_side_sums`] made them a
    /// communicator and stream of their own.
    side: Option<SideSums>,
}

/// The communicator and stream of synchronised batch norm's small sums, beside the gradient
/// buckets' (see [`NcclCollective::open_side_sums`]).
struct SideSums {
    comm: Communicator,
    /// Recorded on the compute stream before each sum; the side stream waits for it.
    ready: CudaEvent,
    /// Host sums (a rank replaying a step without images) go through this buffer.
    scratch: Scratch<f64>,
}

impl std::fmt::Debug for NcclCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCollective")
            .field("rank", &self.comm.rank)
            .field("world", &self.comm.world_size)
            .field("step", &self.step)
            .finish()
    }
}

impl NcclCollective {
    /// The collective of `comm`'s rank; compute runs on `device`'s stream. A collective pending
    /// longer than `timeout` aborts the communicator.
    pub fn new(comm: Communicator, device: Arc<GpuDevice>, timeout: Duration) -> Self {
        NcclCollective {
            watchdog: comm.watchdog(timeout),
            comm,
            device,
            ready: Vec::new(),
            done: Vec::new(),
            last: None,
            step: 0,
            small_f64: Scratch { buf: None },
            small_f32: Scratch { buf: None },
            timeline: None,
            side: None,
        }
    }

    /// Gives synchronised batch norm's sums ([`Collective::sum_sums`]) a communicator and a
    /// stream of their own, so they run beside the gradient buckets' all-reduces instead of
    /// queueing behind them on the communication stream. Every rank calls it at the same point
    /// (a collective call), before its first sync-BN step; `timeout` bounds the wait for the
    /// others.
    ///
    /// The communicator comes from `ncclCommSplit` (NCCL ≥ 2.18, loaded when present); with an
    /// older library, from a second `ncclCommInitRank` whose unique id rank 0 draws and hands
    /// to the others over the first communicator (no second rendezvous). Either way it is
    /// aborted with the first (the watchdog and the abort group reach it) and passes the same
    /// barrier before use.
    pub fn open_side_sums(&mut self, timeout: Duration) -> Result<(), NcclError> {
        if self.side.is_some() {
            return Ok(());
        }
        let (rank, world) = (self.comm.rank, self.comm.world_size);
        let stream = self
            .compute()
            .context()
            .new_stream()
            .map_err(self.driver("create the sync-BN stream"))?;
        let (comm, how) = match self.comm.split(stream.clone(), timeout)? {
            Some(comm) => (comm, "ncclCommSplit"),
            None => {
                let mut id = if rank == 0 {
                    new_unique_id()?
                } else {
                    vec![0u8; UNIQUE_ID_BYTES]
                };
                let mut scratch = Scratch { buf: None };
                let label = "hand-out of the sync-BN communicator's id".to_string();
                self.host_exchange(
                    &self.comm,
                    &mut scratch,
                    &mut id,
                    label,
                    None,
                    |comm, p, n| {
                        // SAFETY: `p` addresses the scratch buffer of `n` bytes, used by the
                        // communication stream only.
                        unsafe { comm.broadcast_raw::<u8>(p, n, 0) }
                    },
                )?;
                let main = self.comm.handle.clone();
                let comm = Communicator::init_unless(stream, rank, world, &id, timeout, &|| {
                    main.is_aborted()
                })?;
                (comm, "a second ncclCommInitRank")
            }
        };
        tracing::info!(
            "rank {rank}: sync-BN sums on a communicator and stream of their own ({how}), on the device"
        );
        self.comm.adopt(&comm);
        comm.barrier(timeout)?;
        let ready = self.event("create the sync-BN ready event")?;
        self.side = Some(SideSums {
            comm,
            ready,
            scratch: Scratch { buf: None },
        });
        Ok(())
    }

    /// Whether synchronised batch norm's sums have their own communicator.
    pub fn has_side_sums(&self) -> bool {
        self.side.is_some()
    }

    /// The communicator.
    pub fn communicator(&self) -> &Communicator {
        &self.comm
    }

    /// Times every bucket's all-reduce on `timeline` (the `--trace` timeline of this GPU).
    pub fn set_timeline(&mut self, timeline: Option<GpuTimeline>) {
        self.timeline = timeline;
    }

    /// The timeline, to add spans or flush it at a step boundary.
    pub fn timeline_mut(&mut self) -> Option<&mut GpuTimeline> {
        self.timeline.as_mut()
    }

    fn driver(&self, op: &'static str) -> impl Fn(DriverError) -> NcclError {
        let rank = self.comm.rank;
        move |source| NcclError::Driver { op, rank, source }
    }

    fn compute(&self) -> &Arc<CudaStream> {
        self.device.stream()
    }

    fn event(&self, op: &'static str) -> Result<CudaEvent, NcclError> {
        self.compute()
            .context()
            .new_event(None)
            .map_err(self.driver(op))
    }

    /// Registers `event` (recorded after a collective) with the watchdog.
    fn watch(&self, label: String, event: &Arc<CudaEvent>) -> Result<(), NcclError> {
        self.watch_within(label, None, event)
    }

    /// [`NcclCollective::watch`] with a timeout of its own (`None`: the collective timeout).
    fn watch_within(
        &self,
        label: String,
        timeout: Option<Duration>,
        event: &Arc<CudaEvent>,
    ) -> Result<(), NcclError> {
        let probe = event.clone();
        let done = move || probe.try_is_complete().map_err(|e| e.to_string());
        match timeout {
            Some(t) => self.watchdog.watch_within(label, t, done)?,
            None => self.watchdog.watch(label, done)?,
        }
        Ok(())
    }

    /// Waits for `event` itself (the host blocks in the driver until the collective is done;
    /// an abort by the watchdog ends the wait too), then reports a fault if there was one.
    fn wait(&self, event: &CudaEvent, op: &'static str) -> Result<(), NcclError> {
        let waited = event.synchronize().map_err(self.driver(op));
        self.check_live()?;
        waited
    }

    /// Ok unless this rank's watchdog fired or the communicator was aborted from elsewhere
    /// (the process's abort group): an aborted collective's event completes too, and its
    /// result must not be taken for a real one.
    fn check_live(&self) -> Result<(), NcclError> {
        self.watchdog.check()?;
        if self.comm.handle.is_aborted() {
            return Err(NcclError::UseAfterAbort {
                rank: self.comm.rank,
            });
        }
        Ok(())
    }

    /// Sums `len` f64 values at device address `ptr` over every rank, after the compute work
    /// issued so far, and copies the result to host memory at `host` on the communication
    /// stream. Returns the event that completes with the copy: the host reads `host` after
    /// waiting for it (one step later, so a step has no host synchronisation).
    ///
    /// # Safety
    /// `ptr` must address `len` live f64 on this device and `host` `len` f64 of page-locked
    /// host memory; neither may be touched until the returned event has completed.
    pub unsafe fn sum_on_device(
        &mut self,
        ptr: u64,
        len: usize,
        host: *mut f64,
        label: &str,
    ) -> Result<Arc<CudaEvent>, NcclError> {
        let after = self.event("record compute for a device sum")?;
        after
            .record(self.compute())
            .map_err(self.driver("record compute for a device sum"))?;
        let stream = self.comm.stream.clone();
        stream
            .wait(&after)
            .map_err(self.driver("order a device sum after compute"))?;
        self.comm.all_reduce_raw::<f64>(ptr, len, false)?;
        let dst = std::slice::from_raw_parts_mut(host, len);
        drv::memcpy_dtoh_async(dst, ptr, stream.cu_stream())
            .map_err(self.driver("copy a device sum to the host"))?;
        // The host waits on it (`wait_device_sum`): blocking sync, no spinning core.
        let done = Arc::new(host_wait_event(&stream).map_err(self.driver("record a device sum"))?);
        done.record(&stream)
            .map_err(self.driver("record a device sum"))?;
        self.watch(format!("{label} in step {}", self.step + 1), &done)?;
        Ok(done)
    }

    /// A collective on host `values`: uploads them into `scratch` on the communication
    /// stream, runs `collective` on the device copy (address, length), waits for it (watched
    /// under `label`, for `timeout` when given, else the collective timeout), and downloads
    /// the result into `values`.
    fn host_exchange<
        T: NcclElement + cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits,
    >(
        &self,
        comm: &Communicator,
        scratch: &mut Scratch<T>,
        values: &mut [T],
        label: String,
        timeout: Option<Duration>,
        collective: impl FnOnce(&Communicator, u64, usize) -> Result<(), NcclError>,
    ) -> Result<(), NcclError> {
        let stream = comm.stream.clone();
        let n = values.len();
        let buf = scratch
            .get(&stream, n)
            .map_err(self.driver("allocate a host exchange buffer"))?;
        stream
            .memcpy_htod(values, &mut buf.slice_mut(0..n))
            .map_err(self.driver("upload host values"))?;
        {
            let (p, _record) = cudarc::driver::DevicePtr::device_ptr(&*buf, &stream);
            collective(comm, p, n)?;
        }
        let done =
            Arc::new(host_wait_event(&stream).map_err(self.driver("record a host exchange"))?);
        done.record(&stream)
            .map_err(self.driver("record a host exchange"))?;
        self.watch_within(label, timeout, &done)?;
        self.wait(&done, "wait for a host exchange")?;
        stream
            .memcpy_dtoh(&buf.slice(0..n), values)
            .map_err(self.driver("download host values"))?;
        // The download into pageable memory is done when the call returns; the event's wait
        // (not a stream synchronise, which spins under the default scheduling) is a guard.
        done.record(&stream)
            .map_err(self.driver("download host values"))?;
        done.synchronize()
            .map_err(self.driver("download host values"))
    }

    /// Sums `len` f64 at device address `ptr` over every rank on the side communicator:
    /// after the compute work issued so far, before the compute work issued next (events), with
    /// no host wait.
    fn side_device_sum(&self, side: &SideSums, ptr: u64, len: usize) -> Result<(), NcclError> {
        self.check_live()?;
        side.ready
            .record(self.compute())
            .map_err(self.driver("record compute for a sync-BN sum"))?;
        let stream = side.comm.stream();
        stream
            .wait(&side.ready)
            .map_err(self.driver("order a sync-BN sum after compute"))?;
        // SAFETY: the backend's sums hold `len` live f64 at `ptr` (DeviceSums); compute wrote
        // them before `ready` and reads them again only after `done`.
        unsafe { side.comm.all_reduce_raw::<f64>(ptr, len, false) }?;
        let done = Arc::new(self.event("record a sync-BN sum")?);
        done.record(stream)
            .map_err(self.driver("record a sync-BN sum"))?;
        self.compute()
            .wait(&done)
            .map_err(self.driver("order compute after a sync-BN sum"))?;
        self.watch(
            format!("sync-BN sum of {len} values in step {}", self.step + 1),
            &done,
        )
    }

    /// A sum of host values over every rank, watched for `timeout` (`None`: the collective
    /// timeout).
    fn sum_for(
        &mut self,
        values: &mut [f64],
        timeout: Option<Duration>,
    ) -> Result<(), CollectiveError> {
        let mut scratch = std::mem::replace(&mut self.small_f64, Scratch { buf: None });
        let label = format!("sum of {} values in step {}", values.len(), self.step + 1);
        let result = self.host_exchange(
            &self.comm,
            &mut scratch,
            values,
            label,
            timeout,
            |comm, p, n| {
                // SAFETY: as in `broadcast`.
                unsafe { comm.all_reduce_raw::<f64>(p, n, false) }
            },
        );
        self.small_f64 = scratch;
        Ok(result?)
    }

    /// Waits for an event returned by [`NcclCollective::sum_on_device`].
    pub fn wait_device_sum(&self, event: &CudaEvent) -> Result<(), NcclError> {
        self.wait(event, "wait for a device sum")
    }
}

impl Collective for NcclCollective {
    type Buffer = DeviceGrads;

    fn rank(&self) -> usize {
        self.comm.rank
    }

    fn world_size(&self) -> usize {
        self.comm.world_size
    }

    fn start_average(
        &mut self,
        buffer: &mut DeviceGrads,
        bucket: usize,
        range: Range<usize>,
        scale: f32,
    ) -> Result<(), CollectiveError> {
        let rank = self.comm.rank;
        self.check_live()?;
        if range.start > range.end || range.end > buffer.len {
            return Err(NcclError::OutOfRange {
                rank,
                range,
                len: buffer.len,
            }
            .into());
        }
        let ptr = buffer.ptr + 4 * range.start as u64;
        if scale != 1.0 {
            // On the compute stream, after the kernels that wrote the bucket.
            grad::scale_f32(&self.device, ptr, range.len(), scale)
                .map_err(|source| NcclError::Kernel { rank, source })?;
        }
        while self.ready.len() <= bucket {
            let ready = self.event("create bucket-ready event")?;
            let done = Arc::new(self.event("create bucket-done event")?);
            self.ready.push(ready);
            self.done.push(done);
        }
        self.ready[bucket]
            .record(self.compute())
            .map_err(self.driver("record bucket-ready event"))?;
        let stream = self.comm.stream.clone();
        stream
            .wait(&self.ready[bucket])
            .map_err(self.driver("wait bucket-ready event"))?;
        let span = match &self.timeline {
            Some(t) => t
                .begin(&stream)
                .map_err(self.driver("record trace event"))?,
            None => None,
        };
        // SAFETY: the range lies inside the arena (checked), which the network keeps alive;
        // the compute stream writes it only before `ready` and after `done` (finish_averages).
        unsafe { self.comm.all_reduce_raw::<f32>(ptr, range.len(), true) }?;
        if let Some(t) = &mut self.timeline {
            t.end(
                span,
                &stream,
                format!("all-reduce bucket {bucket}"),
                "comm",
                rows::COMM,
            )
            .map_err(|source| NcclError::Driver {
                op: "record trace event",
                rank,
                source,
            })?;
        }
        self.done[bucket]
            .record(&stream)
            .map_err(self.driver("record bucket-done event"))?;
        let label = format!("all-reduce of bucket {bucket} in step {}", self.step + 1);
        let done = self.done[bucket].clone();
        self.watch(label, &done)?;
        self.last = Some(bucket);
        Ok(())
    }

    fn finish_averages(&mut self, _buffer: &mut DeviceGrads) -> Result<(), CollectiveError> {
        self.step += 1;
        self.check_live()?;
        // The communication stream runs buckets in order: the last one done means all are.
        if let Some(last) = self.last.take() {
            self.compute()
                .wait(&self.done[last])
                .map_err(self.driver("wait for the last bucket"))?;
        }
        Ok(())
    }

    fn broadcast(&mut self, values: &mut [f32], root: usize) -> Result<(), CollectiveError> {
        let mut scratch = std::mem::replace(&mut self.small_f32, Scratch { buf: None });
        let label = format!("broadcast of {} values from rank {root}", values.len());
        let result = self.host_exchange(
            &self.comm,
            &mut scratch,
            values,
            label,
            None,
            |comm, p, n| {
                // SAFETY: `p` addresses the scratch buffer of at least `n` values, used by the
                // communication stream only.
                unsafe { comm.broadcast_raw::<f32>(p, n, root) }
            },
        );
        self.small_f32 = scratch;
        Ok(result?)
    }

    fn sum(&mut self, values: &mut [f64]) -> Result<(), CollectiveError> {
        self.sum_for(values, None)
    }

    fn sum_within(&mut self, values: &mut [f64], timeout: Duration) -> Result<(), CollectiveError> {
        self.sum_for(values, Some(timeout))
    }

    fn sum_sums(&mut self, mut sums: SumsMut<'_>) -> Result<(), CollectiveError> {
        let Some(mut side) = self.side.take() else {
            // No side communicator: through the host, on the main one.
            let rank = self.comm.rank;
            return sums.sum_through_host(|v| self.sum(v)).map_err(|e| match e {
                SumThroughHostError::Sum(e) => e,
                SumThroughHostError::Device(e) => CollectiveError::Buffer {
                    rank,
                    detail: format!("synchronised batch norm's sums: {e}"),
                },
            });
        };
        let result = match &mut sums {
            SumsMut::Device(d) => self.side_device_sum(&side, d.device_ptr(), d.len()),
            SumsMut::Host(values) => {
                let label = format!(
                    "sync-BN sum of {} values in step {}",
                    values.len(),
                    self.step + 1
                );
                let mut scratch = std::mem::replace(&mut side.scratch, Scratch { buf: None });
                let r = self.host_exchange(
                    &side.comm,
                    &mut scratch,
                    values,
                    label,
                    None,
                    |comm, p, n| {
                        // SAFETY: as in `sum`, on the side communicator's stream.
                        unsafe { comm.all_reduce_raw::<f64>(p, n, false) }
                    },
                );
                side.scratch = scratch;
                r
            }
        };
        self.side = Some(side);
        Ok(result?)
    }

    fn check(&self) -> Result<(), CollectiveError> {
        Ok(self.check_live()?)
    }

    fn abort(&self, reason: &str) {
        tracing::error!(
            "rank {}: aborting the NCCL communicator: {reason}",
            self.comm.rank
        );
        if let Err(e) = Abortable::abort(&*self.comm.handle) {
            tracing::warn!("rank {}: ncclCommAbort: {e}", self.comm.rank);
        }
    }
}
