//! `birdtrain kernels check [--arch sm_80,sm_90,sm_90a]`: compiles every CUDA kernel with NVRTC.
//! Needs no GPU, only libnvrtc and the CUDA headers.

use std::io::Write;

use clap::Args;

use crate::cuda::{self, GpuArch, KERNEL_FILES};

/// Arguments of `birdtrain kernels check` (the CLI's `kernels` subcommand enum wraps them).
#[derive(Debug, Clone, Args)]
pub struct KernelsArgs {
    /// Comma-separated target architectures.
    #[arg(long, default_value = "sm_80,sm_90,sm_90a")]
    pub arch: String,
}

/// One compiled file × architecture, as `kernels check` reports it.
#[derive(Debug, Clone)]
pub struct CheckLine {
    /// The kernel file name.
    pub file: &'static str,
    /// The architecture.
    pub arch: GpuArch,
    /// Number of kernels the file exports.
    pub kernels: usize,
    /// PTX size in bytes.
    pub ptx_bytes: usize,
    /// Cubin size in bytes.
    pub cubin_bytes: usize,
    /// Compile time.
    pub seconds: f64,
}

impl std::fmt::Display for CheckLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:<13} {:<6} {:>2} kernels  ptx {:>8} B  cubin {:>8} B  {:>6.2} s",
            self.file, self.arch, self.kernels, self.ptx_bytes, self.cubin_bytes, self.seconds
        )
    }
}

/// Compiles every kernel file for each of `archs` (no cache), calling `report` after each.
/// Stops at the first failure, which carries the compiler's log.
pub fn check(
    archs: &[GpuArch],
    mut report: impl FnMut(&CheckLine),
) -> Result<Vec<CheckLine>, cuda::CudaError> {
    cuda::library::require_nvrtc()?;
    cuda::nvrtc::version()?;
    let include = cuda::nvrtc::find_include()?;
    let mut lines = Vec::new();
    for &arch in archs {
        for &file in KERNEL_FILES {
            let built = cuda::nvrtc::compile_file(file, arch, &include)?;
            let line = CheckLine {
                file: built.file,
                arch,
                kernels: built.kernels.len(),
                ptx_bytes: built.image.ptx.len(),
                cubin_bytes: built.image.cubin.len(),
                seconds: built.seconds,
            };
            report(&line);
            lines.push(line);
        }
    }
    Ok(lines)
}

/// Runs `birdtrain kernels check`: one line per kernel file × architecture; an error (with
/// the compiler's log, or the NVRTC install instructions) on any failure.
pub fn run(args: KernelsArgs) -> anyhow::Result<()> {
    let archs = GpuArch::parse_list(&args.arch)?;
    if archs.is_empty() {
        anyhow::bail!("--arch is empty: give architectures such as sm_80,sm_90,sm_90a");
    }
    cuda::library::require_nvrtc()?;
    let (major, minor) = cuda::nvrtc::version()?;
    outln!(
        "NVRTC {major}.{minor}, headers from {}",
        cuda::nvrtc::find_include()?.display()
    );
    let lines = check(&archs, |line| {
        outln!("{line}");
        let _ = std::io::stdout().flush();
    })?;
    outln!(
        "ok: {} kernel files x {} architectures compiled",
        lines.len() / archs.len(),
        archs.len()
    );
    Ok(())
}
