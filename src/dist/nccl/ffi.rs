//! libnccl, loaded at run time: the entry points birdtrain calls, the library's version and
//! unique ids.

use std::ffi::{c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

use cudarc::nccl::sys::{
    cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t, ncclUniqueId,
};

use super::NcclError;
use crate::cuda::library::{self, Lib};

/// The NCCL entry points birdtrain uses, from the library [`library::load`] found.
pub(super) struct NcclLib {
    pub(super) _lib: libloading::Library,
    /// What was opened: a name the loader resolved, or the file found by the search.
    pub(super) path: PathBuf,
    pub(super) get_version: unsafe extern "C" fn(*mut c_int) -> ncclResult_t,
    pub(super) get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> ncclResult_t,
    pub(super) comm_init_rank:
        unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> ncclResult_t,
    pub(super) comm_abort: unsafe extern "C" fn(ncclComm_t) -> ncclResult_t,
    pub(super) comm_destroy: unsafe extern "C" fn(ncclComm_t) -> ncclResult_t,
    pub(super) comm_get_async_error:
        unsafe extern "C" fn(ncclComm_t, *mut ncclResult_t) -> ncclResult_t,
    pub(super) all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclRedOp_t,
        ncclComm_t,
        cudaStream_t,
    ) -> ncclResult_t,
    pub(super) broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        c_int,
        ncclComm_t,
        cudaStream_t,
    ) -> ncclResult_t,
    pub(super) error_string: unsafe extern "C" fn(ncclResult_t) -> *const c_char,
    /// `ncclCommSplit` (NCCL ≥ 2.18), when the library has it.
    pub(super) comm_split: Option<CommSplitFn>,
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

    pub(super) fn describe(&self, code: ncclResult_t) -> String {
        // SAFETY: NCCL returns a static NUL-terminated string for every result code.
        let text = unsafe { (self.error_string)(code) };
        if text.is_null() {
            return format!("{code:?}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        let s = unsafe { std::ffi::CStr::from_ptr(text) }.to_string_lossy();
        format!("{code:?} ({s})")
    }

    pub(super) fn check(
        &self,
        op: &'static str,
        rank: usize,
        code: ncclResult_t,
    ) -> Result<(), NcclError> {
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

pub(super) fn nccl() -> Result<&'static NcclLib, NcclError> {
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
