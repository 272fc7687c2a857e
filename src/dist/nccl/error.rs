//! The errors of the NCCL layer.

use std::ops::Range;
use std::time::Duration;

use cudarc::driver::DriverError;

use crate::dist::watchdog::WatchdogError;

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
