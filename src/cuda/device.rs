//! One GPU: its context, its compute stream and a lazily filled per-device module cache.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::Ptx;

use super::arch::GpuArch;
use super::cache::KernelCompiler;
use super::error::CudaError;
use super::library;
use super::sources::KernelFile;

/// The number of CUDA devices, or the error explaining why there is no usable driver.
pub fn device_count() -> Result<usize, CudaError> {
    library::require_driver()?;
    let count =
        CudaContext::device_count().map_err(CudaError::driver("cuInit / cuDeviceGetCount"))?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// The CUDA driver version as cuDriverGetVersion reports it (e.g. 13000 for 13.0).
pub fn driver_version() -> Result<i32, CudaError> {
    library::require_driver()?;
    let mut version = 0;
    // SAFETY: out-parameter; the library is present.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(CudaError::driver("cuDriverGetVersion"))?;
    Ok(version)
}

/// A GPU ready to run birdtrain's kernels.
#[derive(Debug)]
pub struct GpuDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: GpuArch,
    name: String,
    compiler: KernelCompiler,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<(&'static str, &'static str), CudaFunction>>,
    /// Blocks of (file, kernel, threads) that fit one SM at once (asked of the driver once).
    resident: Mutex<HashMap<(&'static str, &'static str, u32), u32>>,
    /// Bytes of every allocation the backend made on this device (tensors and workspace).
    allocated: std::sync::atomic::AtomicU64,
}

impl GpuDevice {
    /// Opens device `ordinal`: checks the driver, creates the context and a compute stream and
    /// finds NVRTC (kernels compile on first use, through the on-disk cache).
    pub fn open(ordinal: usize) -> Result<Arc<GpuDevice>, CudaError> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(CudaError::driver(format!(
            "creating a context on device {ordinal}"
        )))?;
        // One compute stream per device and explicit ordering: cudarc's per-buffer event
        // tracking would add two events to every launch.
        // SAFETY: called before any buffer of this context exists.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx
            .compute_capability()
            .map_err(CudaError::driver("reading the compute capability"))?;
        let arch = GpuArch::new(major as u32, minor as u32);
        if arch < GpuArch::MIN {
            return Err(CudaError::Unsupported {
                what: format!(
                    "device {ordinal} is {arch}; the bf16 tensor-core kernels need sm_80 or newer"
                ),
            });
        }
        let name = ctx
            .name()
            .map_err(CudaError::driver("reading the device name"))?;
        let stream = ctx
            .new_stream()
            .map_err(CudaError::driver("creating the compute stream"))?;
        let compiler = KernelCompiler::discover(driver_version()?.to_string())?;
        Ok(Arc::new(GpuDevice {
            ctx,
            stream,
            arch,
            name,
            compiler,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            resident: Mutex::new(HashMap::new()),
            allocated: std::sync::atomic::AtomicU64::new(0),
        }))
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The compute stream every op runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device's architecture.
    pub fn arch(&self) -> GpuArch {
        self.arch
    }

    /// The device's marketing name (`NVIDIA H100 80GB HBM3`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Counts an allocation of `bytes` (the backend calls this for every buffer it makes).
    pub fn note_allocation(&self, bytes: usize) {
        self.allocated
            .fetch_add(bytes as u64, std::sync::atomic::Ordering::Relaxed);
    }

    /// Bytes allocated by the backend so far (a running total; frees are not subtracted).
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// (free, total) device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize), CudaError> {
        self.ctx
            .mem_get_info()
            .map_err(CudaError::driver("cuMemGetInfo"))
    }

    /// The module of `file`, compiled (or read from the disk cache) and loaded on first use.
    pub fn module(&self, file: &'static str) -> Result<Arc<CudaModule>, CudaError> {
        let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = modules.get(file) {
            return Ok(m.clone());
        }
        let source = KernelFile::by_name(file).ok_or_else(|| CudaError::MissingKernel {
            file: file.into(),
            kernel: String::new(),
        })?;
        let target = source.target_for(self.arch);
        let built = self.compiler.build(source, target)?;
        let module = self
            .ctx
            .load_module(Ptx::from_binary(built.image.cubin))
            .map_err(CudaError::driver(format!("loading {file} for {target}")))?;
        modules.insert(file, module.clone());
        Ok(module)
    }

    /// Kernel `name` of `file` (cached per device).
    pub fn function(
        &self,
        file: &'static str,
        name: &'static str,
    ) -> Result<CudaFunction, CudaError> {
        if let Some(f) = self
            .functions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(file, name))
        {
            return Ok(f.clone());
        }
        let module = self.module(file)?;
        let function = module
            .load_function(name)
            .map_err(|_| CudaError::MissingKernel {
                file: file.into(),
                kernel: name.into(),
            })?;
        self.functions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((file, name), function.clone());
        Ok(function)
    }

    /// How many blocks of `threads` threads of kernel `name` fit one SM at once (its registers
    /// and shared memory decide; cached per device).
    pub fn resident_blocks(
        &self,
        file: &'static str,
        name: &'static str,
        threads: u32,
    ) -> Result<u32, CudaError> {
        let key = (file, name, threads);
        if let Some(&n) = self
            .resident
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
        {
            return Ok(n);
        }
        let n = self
            .function(file, name)?
            .occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)
            .map_err(CudaError::driver(format!("the occupancy of {name}")))?;
        self.resident
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, n);
        Ok(n)
    }

    /// Compiles and loads every kernel file now (so the first step does not pay for it).
    pub fn warm_up(&self) -> Result<(), CudaError> {
        for file in super::sources::KERNEL_FILES {
            self.module(file.name)?;
        }
        Ok(())
    }

    /// Waits for all work queued on the compute stream.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(CudaError::driver("synchronizing the compute stream"))
    }
}
