//! The error type of the CUDA backend: every failure is one clear line with a hint.

use std::path::PathBuf;

/// The shell commands that install NVRTC and the CUDA headers without a GPU.
pub const NVRTC_INSTALL_HINT: &str =
    "install it with `bash scripts/install-cuda-tools.sh && . scripts/cuda-env.sh` \
     (or `pip install nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.88` and put the wheel's \
     nvidia/cu13/lib folder on LD_LIBRARY_PATH)";

/// Everything that can go wrong between a kernel source and a running kernel.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The NVRTC shared library could not be loaded.
    #[error(
        "the NVRTC library (libnvrtc.so) could not be loaded (tried {tried}): {NVRTC_INSTALL_HINT}"
    )]
    NvrtcMissing {
        /// The library names that were tried, comma-separated.
        tried: String,
    },
    /// The CUDA driver library could not be loaded.
    #[error("no CUDA driver found (libcuda.so): use --gpus 0 to train on the CPU (tried {tried})")]
    DriverMissing {
        /// The library names that were tried, comma-separated.
        tried: String,
    },
    /// The driver loaded but reports fewer devices than asked for.
    #[error("CUDA device {ordinal} requested but {count} visible: use --gpus {count} (or --gpus 0 for the CPU)")]
    NoDevice {
        /// The ordinal that was asked for.
        ordinal: usize,
        /// How many devices the driver sees.
        count: usize,
    },
    /// `cuda_bf16.h` was found in none of the searched folders.
    #[error("CUDA headers (cuda_bf16.h) not found in: {searched}; set BIRDTRAIN_CUDA_INCLUDE to a CUDA include folder, or {NVRTC_INSTALL_HINT}")]
    HeadersMissing {
        /// The folders that were searched, in order.
        searched: String,
    },
    /// An `--arch` value that is not `sm_XY`.
    #[error("bad GPU architecture {value:?}: expected sm_<major><minor> such as sm_80 or sm_90")]
    BadArch {
        /// The rejected value.
        value: String,
    },
    /// NVRTC rejected a kernel source; `log` is the compiler's own message.
    #[error("kernel {file} failed to compile for {arch} ({status}):\n{log}")]
    Compile {
        /// The kernel file name, e.g. `conv.cu`.
        file: String,
        /// The target architecture.
        arch: String,
        /// NVRTC's status code name.
        status: String,
        /// The compiler log.
        log: String,
    },
    /// An NVRTC call other than the compilation itself failed.
    #[error("NVRTC {call} failed for {file}: {status}")]
    Nvrtc {
        /// The NVRTC function.
        call: &'static str,
        /// The kernel file.
        file: String,
        /// NVRTC's status.
        status: String,
    },
    /// Reading or writing the on-disk kernel cache failed.
    #[error("kernel cache {path}: {source} (set BIRDTRAIN_KERNEL_CACHE to a writable folder)")]
    Cache {
        /// The file or folder involved.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A CUDA driver call failed.
    #[error("CUDA {context}: {source}")]
    Driver {
        /// What was being done (a kernel name, an allocation size, ...).
        context: String,
        /// The driver's error.
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// A module does not export the kernel the host asked for (a kernels/*.cu vs ops.rs mismatch).
    #[error("kernel {kernel} not found in {file}: kernels/{file} and src/cuda/ops.rs disagree")]
    MissingKernel {
        /// The kernel file.
        file: String,
        /// The kernel name.
        kernel: String,
    },
    /// The device ran out of memory for the requested batch size.
    #[error("out of GPU memory at batch size {batch_size} (needs {needed_mib} MiB, {free_mib} MiB free): use --batch-size {fits}")]
    OutOfMemory {
        /// The requested per-GPU batch size.
        batch_size: usize,
        /// The planned footprint.
        needed_mib: u64,
        /// The free device memory.
        free_mib: u64,
        /// The largest batch size that fits.
        fits: usize,
    },
    /// A shape or argument the backend cannot handle.
    #[error("unsupported by the CUDA backend: {what}")]
    Unsupported {
        /// Description of the unsupported case.
        what: String,
    },
}

impl CudaError {
    /// Wraps a driver error with what was being done.
    pub fn driver(context: impl Into<String>) -> impl FnOnce(cudarc::driver::DriverError) -> Self {
        let context = context.into();
        move |source| CudaError::Driver { context, source }
    }
}
