//! The CUDA backend: kernels/*.cu compiled at run time by NVRTC (cached on disk), a context,
//! a compute stream and a module cache per device, and [`CudaBackend`], the bf16 training
//! backend built on them.
//!
//! Nothing here needs CUDA at build time: cudarc loads libnvrtc and libcuda dynamically, and
//! [`library`] checks their presence first so that a missing library is an error with a hint,
//! never a panic.

pub mod arch;
pub mod backend;
pub mod cache;
pub mod conv;
pub mod device;
pub mod error;
pub mod library;
pub mod memory;
pub mod nvrtc;
pub mod optim;
pub mod sources;
pub mod tensor;

pub use arch::GpuArch;
pub use backend::{CudaBackend, KernelTime};
pub use cache::{KernelCache, KernelCompiler};
pub use device::GpuDevice;
pub use error::CudaError;
pub use sources::{KernelFile, KERNEL_FILES};
pub use tensor::{CudaTensor, DType};
