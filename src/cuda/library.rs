//! Finding and loading the CUDA shared libraries: the driver, NVRTC and NCCL.
//!
//! cudarc loads NVRTC and the driver lazily, by file name, and *panics* when a library is
//! missing. Every path into cudarc therefore first calls [`require_nvrtc`] or
//! [`require_driver`], which turn absence into a [`CudaError`].
//!
//! The dynamic loader alone does not find the libraries where CUDA users have them: NVIDIA's
//! pip wheels (what a PyTorch install brings) put NVRTC in `site-packages/nvidia/cu13/lib`
//! (where `libnvrtc.so.13` loads `libnvrtc-builtins.so.13.0` *by bare name*) and NCCL in
//! `site-packages/nvidia/nccl/lib/libnccl.so.2`, a name cudarc never tries. So when the loader
//! fails, [`search_places`] lists where to look (`CUDA_HOME`/`CUDA_PATH`, `LD_LIBRARY_PATH`,
//! the toolkit's folders, the system's, and `python3`'s site-packages with the wheels'
//! folders), [`find_in`] picks the first folder holding the library, and:
//! - NVRTC is loaded from there by full path, its builtins first, and kept loaded: the
//!   loader then matches cudarc's later load by name against the loaded library's soname
//!   (`libnvrtc.so.13`), and libnvrtc's own load of its builtins likewise;
//! - NCCL is opened from that path by birdtrain's own NCCL bindings (`crate::dist::nccl`).
//!
//! No symlink is made; a library found nowhere is one error line naming every place looked.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::error::{CudaError, NVRTC_INSTALL_HINT};

/// A library birdtrain loads at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lib {
    /// The runtime compiler, `libnvrtc.so.*`.
    Nvrtc,
    /// NVRTC's builtins, `libnvrtc-builtins.so.*`, which libnvrtc loads by bare name.
    NvrtcBuiltins,
    /// NCCL, `libnccl.so.*`.
    Nccl,
}

impl Lib {
    /// The library's name in messages.
    pub fn title(self) -> &'static str {
        match self {
            Lib::Nvrtc => "NVRTC",
            Lib::NvrtcBuiltins => "NVRTC's builtins",
            Lib::Nccl => "NCCL",
        }
    }

    /// The file name without version (`libnccl.so`); versioned files add `.N…`.
    pub fn stem(self) -> &'static str {
        match self {
            Lib::Nvrtc => "libnvrtc.so",
            Lib::NvrtcBuiltins => "libnvrtc-builtins.so",
            Lib::Nccl => "libnccl.so",
        }
    }

    /// The names the dynamic loader is asked for first (its own search: `LD_LIBRARY_PATH`,
    /// the cache, the system folders).
    pub fn loader_names(self) -> Vec<String> {
        match self {
            Lib::Nvrtc => candidates("nvrtc"),
            Lib::NvrtcBuiltins => vec!["libnvrtc-builtins.so.13.0".into()],
            Lib::Nccl => {
                let mut names = vec!["libnccl.so.2".to_string()];
                names.extend(candidates("nccl"));
                names
            }
        }
    }

    /// Folders of NVIDIA's pip wheels, relative to a site-packages folder.
    pub fn wheel_dirs(self) -> &'static [&'static str] {
        match self {
            Lib::Nvrtc | Lib::NvrtcBuiltins => &["nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib"],
            Lib::Nccl => &["nvidia/nccl/lib", "nvidia/cu13/lib"],
        }
    }

    fn hint(self) -> &'static str {
        match self {
            Lib::Nvrtc | Lib::NvrtcBuiltins => NVRTC_INSTALL_HINT,
            Lib::Nccl => "install NCCL: `pip install nvidia-nccl-cu13` (it sits next to PyTorch's wheels), or the distribution's libnccl2 package; or train on the CPU with --gpus 0",
        }
    }
}

/// A folder to look in, and why it is on the list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    /// The folder.
    pub dir: PathBuf,
    /// Where it came from (`CUDA_HOME`, `LD_LIBRARY_PATH`, `python3 site-packages`, …).
    pub source: &'static str,
}

/// A library found nowhere.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{title} not found: the loader knows none of {names}; looked in {places} ({hint})")]
pub struct NotFound {
    /// The library's name.
    pub title: &'static str,
    /// The file names given to the loader, comma-separated.
    pub names: String,
    /// Every folder searched with its source.
    pub places: String,
    /// What to do.
    pub hint: &'static str,
}

/// The file names cudarc tries for the library `name` (e.g. `"nvrtc"`, `"cuda"`).
pub fn candidates(name: &str) -> Vec<String> {
    let mut names = cudarc::get_lib_name_candidates(name);
    // cudarc's list repeats some names; each is tried (and named in errors) once.
    let mut seen = std::collections::HashSet::new();
    names.retain(|n| seen.insert(n.clone()));
    names
}

/// Whether any of `names` can be loaded by the dynamic loader.
pub fn any_loadable(names: &[String]) -> bool {
    names.iter().any(|name| {
        // SAFETY: loading a CUDA library runs its initialisers, which are safe to run; the
        // handle is dropped at once (cudarc keeps its own).
        unsafe { libloading::Library::new(name) }.is_ok()
    })
}

/// The folders to search for `lib`, in order: `CUDA_HOME` and `CUDA_PATH` (their `lib64`,
/// `lib` and `targets/x86_64-linux/lib`), `LD_LIBRARY_PATH`, the CUDA toolkit's usual
/// folders, the system's, then every `python3` site-packages folder with the wheels' folders
/// ([`Lib::wheel_dirs`]). `env` reads an environment variable; `python_sites` lists the
/// site-packages folders (called only here, so tests pass fake ones).
pub fn search_places(
    lib: Lib,
    env: &dyn Fn(&str) -> Option<String>,
    python_sites: &dyn Fn() -> Vec<PathBuf>,
) -> Vec<Place> {
    let mut places = Vec::new();
    for (var, source) in [("CUDA_HOME", "CUDA_HOME"), ("CUDA_PATH", "CUDA_PATH")] {
        if let Some(root) = env(var).filter(|v| !v.is_empty()) {
            let root = PathBuf::from(root);
            for sub in ["lib64", "lib", "targets/x86_64-linux/lib"] {
                places.push(Place {
                    dir: root.join(sub),
                    source,
                });
            }
        }
    }
    if let Some(paths) = env("LD_LIBRARY_PATH") {
        for dir in std::env::split_paths(&paths).filter(|d| !d.as_os_str().is_empty()) {
            places.push(Place {
                dir,
                source: "LD_LIBRARY_PATH",
            });
        }
    }
    let mut toolkits = vec![PathBuf::from("/usr/local/cuda")];
    if let Ok(entries) = std::fs::read_dir("/usr/local") {
        let mut versioned: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("cuda-"))
            })
            .collect();
        versioned.sort();
        versioned.reverse();
        toolkits.extend(versioned);
    }
    toolkits.push(PathBuf::from("/opt/cuda"));
    for root in toolkits {
        for sub in ["lib64", "targets/x86_64-linux/lib"] {
            places.push(Place {
                dir: root.join(sub),
                source: "the CUDA toolkit",
            });
        }
    }
    for dir in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/local/lib",
        "/usr/lib64",
        "/usr/lib",
    ] {
        places.push(Place {
            dir: dir.into(),
            source: "the system",
        });
    }
    for site in python_sites() {
        for sub in lib.wheel_dirs() {
            places.push(Place {
                dir: site.join(sub),
                source: "python3 site-packages",
            });
        }
    }
    let mut seen = std::collections::HashSet::new();
    places.retain(|p| seen.insert(p.dir.clone()));
    places
}

/// The file of `lib` in `dir`: the stem itself or a versioned name (`libnccl.so.2`), the
/// shortest such name.
fn in_dir(lib: Lib, dir: &Path) -> Option<PathBuf> {
    let stem = lib.stem();
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n == stem
                    || n.strip_prefix(stem)
                        .and_then(|v| v.strip_prefix('.'))
                        .is_some_and(|v| v.chars().next().is_some_and(|c| c.is_ascii_digit()))
            })
        })
        .filter(|p| p.is_file())
        .collect();
    found.sort_by_key(|p| (p.as_os_str().len(), p.clone()));
    found.into_iter().next()
}

/// The first place holding `lib`, or the error naming every place.
pub fn find_in(lib: Lib, places: &[Place]) -> Result<PathBuf, NotFound> {
    places
        .iter()
        .find_map(|p| in_dir(lib, &p.dir))
        .ok_or_else(|| not_found(lib, places))
}

fn not_found(lib: Lib, places: &[Place]) -> NotFound {
    let mut groups: Vec<(&'static str, Vec<String>)> = Vec::new();
    for p in places {
        let dir = p.dir.display().to_string();
        match groups.iter_mut().find(|(s, _)| *s == p.source) {
            Some((_, dirs)) => dirs.push(dir),
            None => groups.push((p.source, vec![dir])),
        }
    }
    let places = if groups.is_empty() {
        "no folder (none configured)".to_string()
    } else {
        groups
            .iter()
            .map(|(source, dirs)| format!("{source}: {}", dirs.join(", ")))
            .collect::<Vec<_>>()
            .join("; ")
    };
    NotFound {
        title: lib.title(),
        names: lib.loader_names().join(", "),
        places,
        hint: lib.hint(),
    }
}

/// `python3`'s site-packages folders (system and user), asked once per process; none when
/// there is no `python3`.
pub fn python_site_packages() -> Vec<PathBuf> {
    static SITES: OnceLock<Vec<PathBuf>> = OnceLock::new();
    SITES
        .get_or_init(|| {
            let script = "import site\nfor p in site.getsitepackages() + [site.getusersitepackages()]: print(p)";
            std::process::Command::new("python3")
                .args(["-c", script])
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| {
                    String::from_utf8_lossy(&o.stdout)
                        .lines()
                        .filter(|l| !l.trim().is_empty())
                        .map(PathBuf::from)
                        .collect()
                })
                .unwrap_or_default()
        })
        .clone()
}

fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// Makes `lib` loadable and returns what to open: a name the loader resolves, or the path of
/// the file found by [`search_places`]. NVRTC found that way is loaded now (its builtins
/// first) and stays loaded, so cudarc's load by name finds it.
pub fn load(lib: Lib) -> Result<PathBuf, NotFound> {
    if let Some(name) = lib
        .loader_names()
        .into_iter()
        .find(|n| any_loadable(std::slice::from_ref(n)))
    {
        return Ok(PathBuf::from(name));
    }
    let places = search_places(lib, &process_env, &python_site_packages);
    let path = find_in(lib, &places)?;
    if lib == Lib::Nvrtc {
        let dir = path.parent().unwrap_or(Path::new("."));
        if let Some(builtins) = in_dir(Lib::NvrtcBuiltins, dir) {
            keep_loaded(&builtins);
        }
        keep_loaded(&path);
    }
    Ok(path)
}

/// Loads `path` and never unloads it.
fn keep_loaded(path: &Path) {
    // SAFETY: loading a CUDA library runs its initialisers, which are safe to run.
    match unsafe { libloading::Library::new(path) } {
        // Kept for the life of the process: later loads by soname resolve to it.
        Ok(lib) => std::mem::forget(lib),
        Err(e) => tracing::warn!("{} does not load: {e}", path.display()),
    }
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

/// Succeeds when cudarc will be able to load NVRTC: by name, or after loading it from the
/// first place [`search_places`] finds it in.
pub fn require_nvrtc() -> Result<(), CudaError> {
    static FOUND: OnceLock<Result<(), String>> = OnceLock::new();
    let names = candidates("nvrtc");
    FOUND
        .get_or_init(|| {
            if any_loadable(&names) {
                return Ok(());
            }
            let loaded = load(Lib::Nvrtc)
                .map_err(|e| format!("{}; looked in {}", names.join(", "), e.places))?;
            if any_loadable(&names) {
                Ok(())
            } else {
                Err(format!(
                    "{} (found {}, but its name is none of those cudarc loads)",
                    names.join(", "),
                    loaded.display()
                ))
            }
        })
        .clone()
        .map_err(|tried| CudaError::NvrtcMissing { tried })
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

    fn touch(path: &Path) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, b"not really a library").unwrap();
    }

    fn env_of(vars: Vec<(&'static str, String)>) -> impl Fn(&str) -> Option<String> {
        move |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.clone())
        }
    }

    #[test]
    fn the_pip_wheel_layouts_are_found_in_site_packages() {
        let root = tempfile::tempdir().unwrap();
        let site = root.path().join("site-packages");
        touch(&site.join("nvidia/nccl/lib/libnccl.so.2"));
        touch(&site.join("nvidia/cu13/lib/libnvrtc.so.13"));
        touch(&site.join("nvidia/cu13/lib/libnvrtc-builtins.so.13.0"));
        touch(&site.join("nvidia/cu13/lib/libnvrtc.alt.so.13"));
        let env = env_of(vec![]);
        let sites = || vec![site.clone()];
        let nccl = find_in(Lib::Nccl, &search_places(Lib::Nccl, &env, &sites)).unwrap();
        assert_eq!(nccl, site.join("nvidia/nccl/lib/libnccl.so.2"));
        let nvrtc = find_in(Lib::Nvrtc, &search_places(Lib::Nvrtc, &env, &sites)).unwrap();
        assert_eq!(nvrtc, site.join("nvidia/cu13/lib/libnvrtc.so.13"));
        let builtins = search_places(Lib::NvrtcBuiltins, &env, &sites);
        assert_eq!(
            find_in(Lib::NvrtcBuiltins, &builtins).unwrap(),
            site.join("nvidia/cu13/lib/libnvrtc-builtins.so.13.0")
        );
    }

    #[test]
    fn cuda_home_and_ld_library_path_come_before_site_packages() {
        let root = tempfile::tempdir().unwrap();
        let home = root.path().join("cuda-13.0");
        let extra = root.path().join("extra");
        let site = root.path().join("site");
        touch(&home.join("lib64/libnvrtc.so.13.0.88"));
        touch(&extra.join("libnccl.so.2"));
        touch(&site.join("nvidia/cu13/lib/libnvrtc.so.13"));
        touch(&site.join("nvidia/nccl/lib/libnccl.so.2"));
        let env = env_of(vec![
            ("CUDA_HOME", home.display().to_string()),
            ("LD_LIBRARY_PATH", format!("/nowhere:{}", extra.display())),
        ]);
        let sites = || vec![site.clone()];
        let places = search_places(Lib::Nvrtc, &env, &sites);
        assert_eq!(places[0].source, "CUDA_HOME");
        assert_eq!(
            find_in(Lib::Nvrtc, &places).unwrap(),
            home.join("lib64/libnvrtc.so.13.0.88")
        );
        let places = search_places(Lib::Nccl, &env, &sites);
        assert_eq!(
            find_in(Lib::Nccl, &places).unwrap(),
            extra.join("libnccl.so.2")
        );
    }

    #[test]
    fn a_library_found_nowhere_is_one_line_naming_every_place() {
        let root = tempfile::tempdir().unwrap();
        let home = root.path().join("home");
        let site = root.path().join("site");
        std::fs::create_dir_all(&site).unwrap();
        touch(&site.join("nvidia/nccl/lib/libnccl-net.so"));
        let env = env_of(vec![
            ("CUDA_HOME", home.display().to_string()),
            ("LD_LIBRARY_PATH", "/opt/elsewhere".to_string()),
        ]);
        let sites = || vec![site.clone()];
        let places = search_places(Lib::Nccl, &env, &sites);
        let err = find_in(Lib::Nccl, &places).unwrap_err();
        let text = err.to_string();
        assert!(!text.contains('\n'), "{text}");
        for p in &places {
            assert!(text.contains(&p.dir.display().to_string()), "{text}");
        }
        for what in [
            "NCCL not found",
            "libnccl.so.2",
            "CUDA_HOME:",
            "LD_LIBRARY_PATH: /opt/elsewhere",
            "python3 site-packages:",
            "pip install nvidia-nccl-cu13",
        ] {
            assert!(text.contains(what), "{what:?} missing from {text}");
        }
    }
}
