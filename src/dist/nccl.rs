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
//! watchdog's polling tick.
//!
//! libnccl is loaded at run time from wherever [`crate::cuda::library`] finds it (the CUDA
//! toolkit, `LD_LIBRARY_PATH`, or NVIDIA's pip wheel `nvidia/nccl/lib/libnccl.so.2`), so a
//! missing library is one clear error, never a panic, and no symlink is needed.

use std::ffi::{c_char, c_int, c_void};
use std::ops::Range;
use std::path::PathBuf;
use std::ptr;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cudarc::driver::{result as drv, CudaEvent, CudaSlice, CudaStream, DriverError};
use cudarc::nccl::sys::{
    cudaStream_t, ncclComm, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t, ncclUniqueId,
};

use super::collective::{Collective, CollectiveError};
use super::watchdog::{Abortable, Watchdog, WatchdogError};
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
}

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
struct RawComm(ncclComm_t);

// SAFETY: a freshly created communicator is not yet used by any thread; ownership moves to the
// receiving thread, which is the only one using it from then on.
unsafe impl Send for RawComm {}

/// The raw communicator, shared with the watchdog so it can abort from its own thread.
#[derive(Debug)]
struct CommHandle {
    comm: AtomicPtr<ncclComm>,
    rank: usize,
}

impl CommHandle {
    fn get(&self) -> Result<ncclComm_t, NcclError> {
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
        let lib = nccl().map_err(|e| e.to_string())?;
        // SAFETY: `p` came from ncclCommInitRank and is no longer reachable through the
        // handle, so it is aborted exactly once and never used again by this handle.
        lib.check("ncclCommAbort", self.rank, unsafe { (lib.comm_abort)(p) })
            .map_err(|e| e.to_string())
    }

    fn async_error(&self) -> Option<String> {
        let p = self.comm.load(Ordering::Acquire);
        if p.is_null() {
            return None;
        }
        let lib = nccl().ok()?;
        let mut code = ncclResult_t::ncclSuccess;
        // SAFETY: `p` is a live communicator (non-null) and `code` a valid out pointer.
        let r = unsafe { (lib.comm_get_async_error)(p, &mut code) };
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
        let mut internal = [0 as c_char; UNIQUE_ID_BYTES];
        for (dst, &src) in internal.iter_mut().zip(unique_id) {
            *dst = src as c_char;
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
                        Ok(RawComm(comm))
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
        let comm = self.handle.get()?;
        let code = (lib.broadcast)(
            ptr as *const c_void,
            ptr as *mut c_void,
            len,
            T::TYPE,
            root as c_int,
            comm,
            self.stream.cu_stream() as cudaStream_t,
        );
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
        let comm = self.handle.get()?;
        let op = if average {
            ncclRedOp_t::ncclAvg
        } else {
            ncclRedOp_t::ncclSum
        };
        let code = (lib.all_reduce)(
            ptr as *const c_void,
            ptr as *mut c_void,
            len,
            T::TYPE,
            op,
            comm,
            self.stream.cu_stream() as cudaStream_t,
        );
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
        let p = self.handle.comm.swap(ptr::null_mut(), Ordering::AcqRel);
        if p.is_null() {
            return;
        }
        if let Ok(lib) = nccl() {
            // SAFETY: `p` is live and owned by this communicator; after the swap nothing else
            // (the watchdog included) can reach it.
            let code = unsafe { (lib.comm_destroy)(p) };
            if let Err(e) = lib.check("ncclCommDestroy", self.rank, code) {
                tracing::warn!("{e}");
            }
        }
    }
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
        }
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
        self.watchdog.check()?;
        waited
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
        let done = Arc::new(self.event("record a device sum")?);
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
        scratch: &mut Scratch<T>,
        values: &mut [T],
        label: String,
        timeout: Option<Duration>,
        collective: impl FnOnce(&Communicator, u64, usize) -> Result<(), NcclError>,
    ) -> Result<(), NcclError> {
        let stream = self.comm.stream.clone();
        let n = values.len();
        let buf = scratch
            .get(&stream, n)
            .map_err(self.driver("allocate a host exchange buffer"))?;
        stream
            .memcpy_htod(values, &mut buf.slice_mut(0..n))
            .map_err(self.driver("upload host values"))?;
        {
            let (p, _record) = cudarc::driver::DevicePtr::device_ptr(&*buf, &stream);
            collective(&self.comm, p, n)?;
        }
        let done = Arc::new(self.event("record a host exchange")?);
        done.record(&stream)
            .map_err(self.driver("record a host exchange"))?;
        self.watch_within(label, timeout, &done)?;
        self.wait(&done, "wait for a host exchange")?;
        stream
            .memcpy_dtoh(&buf.slice(0..n), values)
            .map_err(self.driver("download host values"))?;
        stream
            .synchronize()
            .map_err(self.driver("download host values"))
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
        let result = self.host_exchange(&mut scratch, values, label, timeout, |comm, p, n| {
            // SAFETY: as in `broadcast`.
            unsafe { comm.all_reduce_raw::<f64>(p, n, false) }
        });
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
        self.watchdog.check().map_err(NcclError::from)?;
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
        self.watchdog.check().map_err(NcclError::from)?;
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
        let result = self.host_exchange(&mut scratch, values, label, None, |comm, p, n| {
            // SAFETY: `p` addresses the scratch buffer of at least `n` values, used by the
            // communication stream only.
            unsafe { comm.broadcast_raw::<f32>(p, n, root) }
        });
        self.small_f32 = scratch;
        Ok(result?)
    }

    fn sum(&mut self, values: &mut [f64]) -> Result<(), CollectiveError> {
        self.sum_for(values, None)
    }

    fn sum_within(&mut self, values: &mut [f64], timeout: Duration) -> Result<(), CollectiveError> {
        self.sum_for(values, Some(timeout))
    }

    fn check(&self) -> Result<(), CollectiveError> {
        Ok(self.watchdog.check().map_err(NcclError::from)?)
    }

    fn abort(&self, reason: &str) {
        tracing::error!(
            "rank {}: aborting the NCCL communicator: {reason}",
            self.comm.rank
        );
        if let Err(e) = self.comm.handle.abort() {
            tracing::warn!("rank {}: ncclCommAbort: {e}", self.comm.rank);
        }
    }
}
