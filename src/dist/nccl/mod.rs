//! NCCL: the communicator and [`NcclCollective`], the
//! [`Collective`](super::collective::Collective) of GPU ranks.
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
//! place: no copies. Every collective is registered with a
//! [`Watchdog`](super::watchdog::Watchdog); one that exceeds the
//! timeout (a rank stopped answering) or an asynchronous NCCL error aborts the communicator
//! (`ncclCommAbort`, which makes the pending kernels return) and surfaces as an error naming
//! the rank, never as a hang. Host exchanges wait on their own completion event, never on the
//! watchdog's polling tick. The raw communicator sits behind a
//! [`CommGuard`](super::comm_guard::CommGuard): every NCCL call
//! runs inside it, and an abort from another thread (the watchdog, the process's abort group)
//! frees the communicator only when no call is using it.
//!
//! libnccl is loaded at run time from wherever [`crate::cuda::library`] finds it (the CUDA
//! toolkit, `LD_LIBRARY_PATH`, or NVIDIA's pip wheel `nvidia/nccl/lib/libnccl.so.2`), so a
//! missing library is one clear error, never a panic, and no symlink is needed.
//!
//! By concept: the library and its entry points (`ffi`), one rank's communicator and its raw
//! collectives (`communicator`), the [`Collective`](super::collective::Collective) built on
//! it (`collective`), and the errors of all three (`error`).

mod collective;
mod communicator;
mod error;
mod ffi;

pub use collective::{DeviceGrads, NcclCollective};
pub use communicator::{host_wait_event, Communicator, NcclElement};
pub use error::NcclError;
pub use ffi::{ensure_available, library, new_unique_id, UNIQUE_ID_BYTES};
