//! The CUDA backend: kernels/*.cu compiled at run time by NVRTC (cached on disk), a context,
//! a compute stream and a module cache per device, and [`CudaBackend`], the bf16 training
//! backend built on them; and what only a GPU rank needs around it: the staging ring that
//! uploads batches from pinned memory on a copy stream ([`staging`]), the backend wrapper
//! that reads them and leaves the loss on the device ([`staged`]), the fused optimizer with
//! f32 master weights ([`optim`]), the gradient scale kernel ([`grad`]), the reductions over
//! ranks sharing one GPU ([`rank_reduce`], for the rehearsal's collective), memory planning
//! ([`memory`]), the `--trace` timeline of stream work ([`timeline`]) and the CUDA graphs of
//! the training step ([`graph`], `BIRDTRAIN_CUDA_GRAPH=1`).
//!
//! Nothing here needs CUDA at build time: cudarc loads libnvrtc and libcuda dynamically, and
//! [`library`] finds and checks them first so that a missing library is an error naming every
//! place searched, never a panic.

pub mod arch;
pub mod backend;
pub mod bn_mask;
pub mod cache;
pub mod conv;
pub mod conv3;
pub mod conv3_schedule;
pub mod device;
pub mod error;
pub mod grad;
pub mod graph;
mod kernel_types;
mod launch;
mod launchers;
pub mod library;
pub mod memory;
pub mod nvrtc;
pub mod optim;
pub mod rank_reduce;
pub mod sources;
pub mod staged;
pub mod staging;
pub mod tensor;
pub mod timeline;

pub use arch::GpuArch;
pub use backend::{CudaBackend, CudaSums, DeviceTotalsAt, KernelTime};
pub use cache::{KernelCache, KernelCompiler};
pub use device::GpuDevice;
pub use error::CudaError;
pub use sources::{KernelFile, KERNEL_FILES};
pub use tensor::{CudaTensor, DType};
