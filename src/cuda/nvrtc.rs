//! Compiling kernels/*.cu with NVRTC: header search, compilation to PTX and cubin, the log.

use std::ffi::{c_char, CString};
use std::path::{Path, PathBuf};
use std::time::Instant;

use cudarc::nvrtc::{result, sys};

use super::arch::GpuArch;
use super::error::CudaError;
use super::library;

/// The header every kernel needs; its folder is the CUDA include folder.
const MARKER_HEADER: &str = "cuda_bf16.h";

/// The folders searched for the CUDA headers, in order: `BIRDTRAIN_CUDA_INCLUDE`,
/// `$CUDA_HOME/include`, `$CUDA_PATH/include`, `/usr/local/cuda/include`, then `../include`
/// next to the loaded libnvrtc (the layout of NVIDIA's PyPI wheels).
pub fn include_candidates() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(dir) = std::env::var_os("BIRDTRAIN_CUDA_INCLUDE") {
        dirs.push(PathBuf::from(dir));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = std::env::var_os(var) {
            dirs.push(PathBuf::from(root).join("include"));
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/include"));
    if let Some(lib) = library::loaded_library_path("libnvrtc") {
        if let Some(lib_dir) = lib.parent() {
            dirs.push(lib_dir.join("../include"));
        }
    }
    dirs
}

/// The first folder of `candidates` that holds `cuda_bf16.h`.
pub fn find_include_in(candidates: &[PathBuf]) -> Result<PathBuf, CudaError> {
    candidates
        .iter()
        .find(|dir| dir.join(MARKER_HEADER).is_file())
        .cloned()
        .ok_or_else(|| CudaError::HeadersMissing {
            searched: candidates
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// The CUDA include folder (see [`include_candidates`]). Call after [`library::require_nvrtc`]
/// so that the folder next to the loaded library is among the candidates.
pub fn find_include() -> Result<PathBuf, CudaError> {
    find_include_in(&include_candidates())
}

/// NVRTC's version, `(major, minor)`. Loads the library: call [`library::require_nvrtc`] first.
pub fn version() -> Result<(i32, i32), CudaError> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters; the library is present (checked by the caller).
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| CudaError::Nvrtc {
            call: "nvrtcVersion",
            file: String::new(),
            status: format!("{e:?}"),
        })?;
    Ok((major, minor))
}

/// The output of one compilation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompiledImage {
    /// The PTX text (what `kernels check` reports the size of).
    pub ptx: String,
    /// The cubin for the target architecture (what the driver loads, no JIT).
    pub cubin: Vec<u8>,
    /// NVRTC's log of the compilation, ptxas's notes among it (such as a `wgmma` it had to
    /// wait for or serialise); empty for an image read from the cache.
    pub log: String,
}

/// An NVRTC program, destroyed on drop.
struct Program {
    handle: sys::nvrtcProgram,
    // NVRTC may keep pointers into these until the program is destroyed.
    _source: CString,
    _name: CString,
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the handle came from create_program and is destroyed exactly once.
        let _ = unsafe { result::destroy_program(self.handle) };
    }
}

/// The compiler options every kernel is built with.
pub fn options(arch: GpuArch, include: &Path) -> Vec<String> {
    vec![
        arch.nvrtc_option(),
        format!("--include-path={}", include.display()),
        "--std=c++17".to_string(),
        // Line tables cost nothing at run time and make profiler output readable.
        "--generate-line-info".to_string(),
    ]
}

fn nul_to_string(raw: &[c_char]) -> String {
    let bytes: Vec<u8> = raw
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compiles one translation unit for `arch`. `file` names it in errors and in the log.
/// On a compiler error the returned [`CudaError::Compile`] carries NVRTC's log.
pub fn compile(
    file: &str,
    source: &str,
    arch: GpuArch,
    include: &Path,
) -> Result<CompiledImage, CudaError> {
    library::require_nvrtc()?;
    let nvrtc_err = |call: &'static str| {
        move |e: result::NvrtcError| CudaError::Nvrtc {
            call,
            file: file.to_string(),
            status: format!("{e:?}"),
        }
    };
    let source_c = CString::new(source).map_err(|_| CudaError::Compile {
        file: file.to_string(),
        arch: arch.to_string(),
        status: "invalid source".to_string(),
        log: "the source contains a NUL byte".to_string(),
    })?;
    let name_c = CString::new(file.replace('\0', "")).unwrap_or_default();
    let handle = result::create_program(&source_c, Some(&name_c))
        .map_err(nvrtc_err("nvrtcCreateProgram"))?;
    let program = Program {
        handle,
        _source: source_c,
        _name: name_c,
    };

    let opts = options(arch, include);
    // SAFETY: the program is alive for the whole block (dropped at its end).
    let compiled = unsafe { result::compile_program(program.handle, &opts) };
    // SAFETY: as above.
    let log = unsafe { result::get_program_log(program.handle) }
        .map(|raw| nul_to_string(&raw))
        .unwrap_or_default();
    if let Err(status) = compiled {
        return Err(CudaError::Compile {
            file: file.to_string(),
            arch: arch.to_string(),
            status: format!("{status:?}"),
            log,
        });
    }
    // SAFETY: compiled successfully; the program is alive.
    let ptx_raw = unsafe { result::get_ptx(program.handle) }.map_err(nvrtc_err("nvrtcGetPTX"))?;
    let mut cubin_len = 0usize;
    // SAFETY: out-parameter for a live, compiled program.
    unsafe { sys::nvrtcGetCUBINSize(program.handle, &mut cubin_len) }
        .result()
        .map_err(nvrtc_err("nvrtcGetCUBINSize"))?;
    let mut cubin = vec![0u8; cubin_len];
    // SAFETY: `cubin` has exactly the size NVRTC reported.
    unsafe { sys::nvrtcGetCUBIN(program.handle, cubin.as_mut_ptr().cast()) }
        .result()
        .map_err(nvrtc_err("nvrtcGetCUBIN"))?;
    Ok(CompiledImage {
        ptx: nul_to_string(&ptx_raw),
        cubin,
        log,
    })
}

/// One kernel file compiled (or read from the cache) for one architecture.
#[derive(Debug, Clone)]
pub struct CompiledKernelFile {
    /// The kernel file name.
    pub file: &'static str,
    /// The architecture it was built for.
    pub arch: GpuArch,
    /// The PTX and cubin.
    pub image: CompiledImage,
    /// The kernels the file exports.
    pub kernels: Vec<String>,
    /// Wall time of the compilation (or of the cache read).
    pub seconds: f64,
    /// Whether the image came from the on-disk cache.
    pub from_cache: bool,
}

/// Compiles `file` for `arch` without touching any cache and times it.
pub fn compile_file(
    file: super::sources::KernelFile,
    arch: GpuArch,
    include: &Path,
) -> Result<CompiledKernelFile, CudaError> {
    let start = Instant::now();
    let image = compile(file.name, &file.expanded(), arch, include)?;
    Ok(CompiledKernelFile {
        file: file.name,
        arch,
        image,
        kernels: file.kernel_names(),
        seconds: start.elapsed().as_secs_f64(),
        from_cache: false,
    })
}
