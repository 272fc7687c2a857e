//! Presence checks for the CUDA shared libraries.
//!
//! cudarc loads NVRTC and the driver lazily and *panics* when a library is missing. Every path
//! into cudarc therefore first calls [`require_nvrtc`] or [`require_driver`], which try the same
//! library names with `dlopen` and turn absence into a [`CudaError`] with an install hint.

use std::path::PathBuf;

use super::error::CudaError;

/// The file names cudarc tries for the library `name` (e.g. `"nvrtc"`, `"cuda"`).
pub fn candidates(name: &str) -> Vec<String> {
    cudarc::get_lib_name_candidates(name)
}

/// Whether any of `names` can be loaded by the dynamic loader.
pub fn any_loadable(names: &[String]) -> bool {
    names.iter().any(|name| {
        // SAFETY: loading a CUDA library runs its initialisers, which are safe to run; the
        // handle is dropped at once (cudarc keeps its own).
        unsafe { libloading::Library::new(name) }.is_ok()
    })
}

/// Succeeds when one of `names` (NVRTC library names) loads; otherwise the install hint.
pub fn require_nvrtc_from(names: &[String]) -> Result<(), CudaError> {
    if any_loadable(names) {
        Ok(())
    } else {
        Err(CudaError::NvrtcMissing {
            tried: names.join(", "),
        })
    }
}

/// Succeeds when cudarc will be able to load NVRTC.
pub fn require_nvrtc() -> Result<(), CudaError> {
    require_nvrtc_from(&candidates("nvrtc"))
}

/// Succeeds when one of `names` (driver library names) loads; otherwise the `--gpus 0` hint.
pub fn require_driver_from(names: &[String]) -> Result<(), CudaError> {
    if any_loadable(names) {
        Ok(())
    } else {
        Err(CudaError::DriverMissing {
            tried: names.join(", "),
        })
    }
}

/// Succeeds when cudarc will be able to load the CUDA driver (libcuda.so).
pub fn require_driver() -> Result<(), CudaError> {
    require_driver_from(&candidates("cuda"))
}

/// The path of the loaded shared object whose file name starts with `prefix`, read from
/// /proc/self/maps (Linux); `None` elsewhere or when it is not loaded.
pub fn loaded_library_path(prefix: &str) -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .map(PathBuf::from)
        .find(|path| {
            path.file_name()
                .and_then(|f| f.to_str())
                .is_some_and(|f| f.starts_with(prefix))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_nvrtc_is_an_error_with_the_install_hint() {
        let err =
            require_nvrtc_from(&["libbirdtrain-no-such-nvrtc.so.99".to_string()]).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("scripts/install-cuda-tools.sh"), "{text}");
        assert!(text.contains("nvidia-cuda-nvrtc==13.0.88"), "{text}");
        assert!(text.contains("libbirdtrain-no-such-nvrtc.so.99"), "{text}");
    }

    #[test]
    fn missing_driver_points_to_the_cpu() {
        let err = require_driver_from(&["libbirdtrain-no-such-cuda.so.1".to_string()]).unwrap_err();
        assert!(
            err.to_string().contains("use --gpus 0 to train on the CPU"),
            "{err}"
        );
    }

    #[test]
    fn candidates_include_the_versioned_soname() {
        assert!(candidates("nvrtc").iter().any(|c| c == "libnvrtc.so.13"));
    }
}
