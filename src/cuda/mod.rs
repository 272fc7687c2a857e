//! The CUDA backend: kernels/*.cu compiled at run time by NVRTC (cached on disk), a context
//! and streams per device, and the bf16 training backend built on them.
//!
//! Nothing here needs CUDA at build time: cudarc loads libnvrtc and libcuda dynamically, and
//! [`library`] checks their presence first so that a missing library is an error with a hint,
//! never a panic.

pub mod arch;
pub mod cache;
pub mod error;
pub mod library;
pub mod nvrtc;
pub mod sources;

pub use arch::GpuArch;
pub use cache::{KernelCache, KernelCompiler};
pub use error::CudaError;
pub use sources::{KernelFile, KERNEL_FILES};
