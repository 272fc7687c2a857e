//! `birdtrain env [--json]`: what birdtrain finds on this machine (the processor and its vector
//! level, the CUDA driver and its GPUs, NVRTC, the CUDA headers, NCCL, the kernel cache), each
//! with where it was found or the one line saying where it was looked for.
//!
//! It is the first thing to run when `--gpus` does not do what was expected: it goes through
//! the same discovery as training (`crate::cuda::library`), and proves NVRTC works by
//! compiling one real kernel file with the headers it found. Nothing here fails the command:
//! every missing part is a line of the report.

use std::path::PathBuf;

use clap::Args;
use serde::Serialize;

use crate::backend::cpu::SimdLevel;
use crate::cuda::{self, GpuArch, KernelCache, KernelFile};
use crate::dist::nccl;

/// Arguments of `birdtrain env`.
#[derive(Debug, Clone, Args)]
pub struct EnvArgs {
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// One library or folder birdtrain needs: where it was found, or why not.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Found {
    /// Whether it is usable.
    pub ok: bool,
    /// The file or folder used (a bare name when the dynamic loader resolved it).
    pub path: Option<String>,
    /// Its version, when it has one (`13.0`, `2.27.3`).
    pub version: Option<String>,
    /// Why it is not usable: the error line training would print.
    pub error: Option<String>,
}

impl Found {
    fn ok(path: Option<String>, version: Option<String>) -> Found {
        Found {
            ok: true,
            path,
            version,
            error: None,
        }
    }

    fn missing(error: impl ToString) -> Found {
        Found {
            ok: false,
            path: None,
            version: None,
            error: Some(error.to_string()),
        }
    }

    fn line(&self) -> String {
        match (self.ok, &self.version, &self.path) {
            (false, ..) => format!("not usable: {}", self.error.as_deref().unwrap_or("unknown")),
            (true, Some(v), Some(p)) => format!("{v} ({p})"),
            (true, Some(v), None) => v.clone(),
            (true, None, Some(p)) => p.clone(),
            (true, None, None) => "ok".into(),
        }
    }
}

/// The processor training on the CPU uses.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Cpu {
    /// `model name` from /proc/cpuinfo (empty elsewhere).
    pub model: String,
    /// Threads the CPU backend and the decoders use by default.
    pub threads: usize,
    /// The vector level the CPU kernels run at (`BIRDTRAIN_CPU_SIMD` may lower it).
    pub simd: String,
}

/// The compilation `birdtrain env` tries: one kernel file, as training would build it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CompileProbe {
    /// Whether it compiled.
    pub ok: bool,
    /// The kernel file.
    pub file: &'static str,
    /// The target architecture (`sm_90`).
    pub arch: String,
    /// Compile time in seconds (0 when it did not run).
    pub seconds: f64,
    /// The compiler's error, or what is missing for it to run.
    pub error: Option<String>,
}

impl CompileProbe {
    const FILE: &'static str = "loss.cu";

    fn run(include: &Result<Option<PathBuf>, String>, arch: GpuArch) -> CompileProbe {
        let failed = |error: String| CompileProbe {
            ok: false,
            file: Self::FILE,
            arch: arch.to_string(),
            seconds: 0.0,
            error: Some(error),
        };
        let dir = match include {
            Ok(Some(dir)) => dir,
            _ => return failed("needs NVRTC and the CUDA headers (above)".into()),
        };
        let file = KernelFile::by_name(Self::FILE).expect("loss.cu is a kernel file");
        match cuda::nvrtc::compile_file(file, arch, dir) {
            Ok(built) => CompileProbe {
                ok: true,
                file: Self::FILE,
                arch: arch.to_string(),
                seconds: built.seconds,
                error: None,
            },
            Err(e) => failed(e.to_string()),
        }
    }

    fn line(&self) -> String {
        match &self.error {
            None => format!("{} for {} in {:.2} s", self.file, self.arch, self.seconds),
            Some(e) => format!("not usable: {e}"),
        }
    }
}

/// One GPU the driver lists.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Gpu {
    /// Its ordinal (`--gpus` counts from 0).
    pub index: usize,
    /// The device name.
    pub name: String,
    /// Compute capability, e.g. `9.0`.
    pub compute_capability: String,
    /// Streaming multiprocessors.
    pub sms: i32,
    /// Device memory in bytes.
    pub memory_bytes: usize,
}

/// Everything `birdtrain env` reports.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct EnvReport {
    /// birdtrain's version.
    pub birdtrain: String,
    /// The processor.
    pub cpu: Cpu,
    /// The CUDA driver (`libcuda`), with its CUDA version.
    pub driver: Found,
    /// The GPUs the driver lists (none without a driver).
    pub gpus: Vec<Gpu>,
    /// The runtime compiler, `libnvrtc`.
    pub nvrtc: Found,
    /// The folder holding `cuda_bf16.h`.
    pub cuda_headers: Found,
    /// One kernel file compiled with the NVRTC and headers above (the whole chain, builtins
    /// included), for the first GPU's architecture or sm_90.
    pub kernel_compile: CompileProbe,
    /// NCCL, for `--gpus N` with N > 1 and several machines.
    pub nccl: Found,
    /// Where compiled kernels are cached (`BIRDTRAIN_KERNEL_CACHE` overrides).
    pub kernel_cache: String,
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_default()
}

fn gpus() -> Result<Vec<Gpu>, cuda::CudaError> {
    let count = cuda::device::device_count()?;
    (0..count)
        .map(|index| {
            let ctx = cudarc::driver::CudaContext::new(index)
                .map_err(cuda::CudaError::driver(format!("opening device {index}")))?;
            let read = || cuda::CudaError::driver(format!("reading device {index}"));
            let (major, minor) = ctx.compute_capability().map_err(read())?;
            Ok(Gpu {
                index,
                name: ctx.name().map_err(read())?,
                compute_capability: format!("{major}.{minor}"),
                sms: ctx
                    .attribute(
                        cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                    )
                    .map_err(read())?,
                memory_bytes: ctx.total_mem().map_err(read())?,
            })
        })
        .collect()
}

/// The architecture to compile the probe for: the first GPU's, else sm_90.
fn probe_arch(gpus: &[Gpu]) -> GpuArch {
    gpus.first()
        .and_then(|g| {
            let digits: String = g.compute_capability.chars().filter(|c| *c != '.').collect();
            GpuArch::parse_list(&format!("sm_{digits}")).ok()
        })
        .and_then(|archs| archs.first().copied())
        .unwrap_or(GpuArch::new(9, 0))
}

/// Looks at this machine (loads the libraries it finds, as training would).
pub fn collect() -> EnvReport {
    let simd = SimdLevel::detect()
        .map(|l| l.name().to_string())
        .unwrap_or_else(|e| format!("invalid: {e}"));
    let cpu = Cpu {
        model: cpu_model(),
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        simd,
    };
    let driver = match cuda::device::driver_version() {
        Ok(v) => Found::ok(
            cuda::library::loaded_library_path("libcuda.so").map(|p| p.display().to_string()),
            Some(format!("CUDA {}.{}", v / 1000, (v % 1000) / 10)),
        ),
        Err(e) => Found::missing(e),
    };
    let (gpus, driver) = match (driver.ok, gpus()) {
        (true, Ok(list)) => (list, driver),
        (true, Err(e)) => (Vec::new(), Found::missing(e)),
        (false, _) => (Vec::new(), driver),
    };
    let nvrtc = match cuda::library::require_nvrtc().and_then(|()| cuda::nvrtc::version()) {
        Ok((major, minor)) => Found::ok(
            cuda::library::loaded_library_path("libnvrtc.so").map(|p| p.display().to_string()),
            Some(format!("{major}.{minor}")),
        ),
        Err(e) => Found::missing(e),
    };
    let include = nvrtc
        .ok
        .then(cuda::nvrtc::find_include)
        .transpose()
        .map_err(|e| e.to_string());
    let cuda_headers = match &include {
        Ok(Some(dir)) => Found::ok(Some(dir.display().to_string()), None),
        Ok(None) => Found::missing("needs NVRTC (above)"),
        Err(e) => Found::missing(e),
    };
    let kernel_compile = CompileProbe::run(&include, probe_arch(&gpus));
    let nccl = match nccl::library() {
        Ok((path, code)) => Found::ok(
            Some(path.display().to_string()),
            Some(format!(
                "{}.{}.{}",
                code / 10_000,
                (code % 10_000) / 100,
                code % 100
            )),
        ),
        Err(e) => Found::missing(e),
    };
    EnvReport {
        birdtrain: env!("CARGO_PKG_VERSION").to_string(),
        cpu,
        driver,
        gpus,
        nvrtc,
        cuda_headers,
        kernel_compile,
        nccl,
        kernel_cache: KernelCache::default_dir().display().to_string(),
    }
}

impl std::fmt::Display for EnvReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let row = |f: &mut std::fmt::Formatter<'_>, name: &str, value: &str| {
            writeln!(f, "{name:<15} {value}")
        };
        row(f, "birdtrain", &self.birdtrain)?;
        let cpu = &self.cpu;
        let model = if cpu.model.is_empty() {
            "processor"
        } else {
            &cpu.model
        };
        row(
            f,
            "cpu",
            &format!("{model}, {} threads, {}", cpu.threads, cpu.simd),
        )?;
        row(f, "cuda driver", &self.driver.line())?;
        if self.gpus.is_empty() {
            row(f, "gpus", "none (training runs on the CPU: --gpus 0)")?;
        }
        for g in &self.gpus {
            row(
                f,
                &format!("gpu {}", g.index),
                &format!(
                    "{}, compute {}, {} SMs, {:.1} GiB",
                    g.name,
                    g.compute_capability,
                    g.sms,
                    g.memory_bytes as f64 / (1u64 << 30) as f64
                ),
            )?;
        }
        row(f, "nvrtc", &self.nvrtc.line())?;
        row(f, "cuda headers", &self.cuda_headers.line())?;
        row(f, "kernel compile", &self.kernel_compile.line())?;
        row(f, "nccl", &self.nccl.line())?;
        row(f, "kernel cache", &self.kernel_cache)
    }
}

/// Runs `birdtrain env`.
pub fn run(args: EnvArgs) -> anyhow::Result<()> {
    let report = collect();
    if args.json {
        outln!("{}", serde_json::to_string(&report)?);
    } else {
        out!("{report}");
    }
    Ok(())
}
