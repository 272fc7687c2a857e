//! The on-disk kernel cache: compiled images keyed by source, architecture, compiler and driver,
//! so that a second start compiles nothing.
//!
//! One file per key, `<key>.btk`: the magic `BTK1`, the PTX length (u64 LE), the PTX, the cubin.
//! Files are written to a temporary name and renamed, so a reader never sees a torn file; a file
//! that does not parse is treated as a miss and rewritten.

use std::path::{Path, PathBuf};
use std::time::Instant;

use super::arch::GpuArch;
use super::error::CudaError;
use super::nvrtc::{self, CompiledImage, CompiledKernelFile};
use super::sources::KernelFile;

const MAGIC: &[u8; 4] = b"BTK1";

/// What a compiled image depends on, hashed into the cache key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheKeyParts<'a> {
    /// The expanded kernel source.
    pub source: &'a str,
    /// The target architecture.
    pub arch: GpuArch,
    /// The NVRTC version and options, e.g. `nvrtc 13.0 --std=c++17 ...`.
    pub compiler: &'a str,
    /// The driver version (`none` when compiling without a GPU).
    pub driver: &'a str,
}

impl CacheKeyParts<'_> {
    /// The key: 128-bit xxh3 of every part, as 32 hex digits.
    pub fn key(&self) -> String {
        let text = format!(
            "{}\0{}\0{}\0{}",
            self.arch, self.compiler, self.driver, self.source
        );
        format!("{:032x}", xxhash_rust::xxh3::xxh3_128(text.as_bytes()))
    }
}

/// A folder of compiled kernel images.
#[derive(Debug, Clone)]
pub struct KernelCache {
    dir: PathBuf,
}

impl KernelCache {
    /// The default folder: `BIRDTRAIN_KERNEL_CACHE`, else `<user cache dir>/birdtrain/kernels`,
    /// else `<temp dir>/birdtrain-kernels`.
    pub fn default_dir() -> PathBuf {
        if let Some(dir) = std::env::var_os("BIRDTRAIN_KERNEL_CACHE") {
            return PathBuf::from(dir);
        }
        dirs::cache_dir()
            .map(|d| d.join("birdtrain").join("kernels"))
            .unwrap_or_else(|| std::env::temp_dir().join("birdtrain-kernels"))
    }

    /// A cache in `dir` (created on the first store).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        KernelCache { dir: dir.into() }
    }

    /// The cache folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.btk"))
    }

    /// The image stored under `key`, if present and well formed.
    pub fn load(&self, key: &str) -> Option<CompiledImage> {
        let bytes = std::fs::read(self.path(key)).ok()?;
        let rest = bytes.strip_prefix(MAGIC)?;
        let (len, rest) = rest.split_at_checked(8)?;
        let ptx_len = usize::try_from(u64::from_le_bytes(len.try_into().ok()?)).ok()?;
        let (ptx, cubin) = rest.split_at_checked(ptx_len)?;
        Some(CompiledImage {
            ptx: String::from_utf8(ptx.to_vec()).ok()?,
            cubin: cubin.to_vec(),
        })
    }

    /// Stores `image` under `key` (temporary file + rename).
    pub fn store(&self, key: &str, image: &CompiledImage) -> Result<(), CudaError> {
        let err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| CudaError::Cache { path, source }
        };
        std::fs::create_dir_all(&self.dir).map_err(err(&self.dir))?;
        let mut bytes = Vec::with_capacity(12 + image.ptx.len() + image.cubin.len());
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&(image.ptx.len() as u64).to_le_bytes());
        bytes.extend_from_slice(image.ptx.as_bytes());
        bytes.extend_from_slice(&image.cubin);
        let final_path = self.path(key);
        let tmp = self.dir.join(format!("{key}.{}.tmp", std::process::id()));
        std::fs::write(&tmp, &bytes).map_err(err(&tmp))?;
        std::fs::rename(&tmp, &final_path).map_err(err(&final_path))
    }
}

/// Compiles kernel files through the cache: NVRTC runs only on a miss.
#[derive(Debug, Clone)]
pub struct KernelCompiler {
    include: PathBuf,
    compiler: String,
    driver: String,
    cache: Option<KernelCache>,
}

impl KernelCompiler {
    /// A compiler using the CUDA headers in `include`; `driver` is the driver version
    /// (`none` without a GPU); `cache` is `None` to always compile.
    pub fn new(
        include: PathBuf,
        driver: String,
        cache: Option<KernelCache>,
    ) -> Result<Self, CudaError> {
        let (major, minor) = nvrtc::version()?;
        let opts = nvrtc::options(GpuArch::MIN, &include).join(" ");
        Ok(KernelCompiler {
            include,
            compiler: format!("nvrtc {major}.{minor} {opts}"),
            driver,
            cache,
        })
    }

    /// A compiler with the headers found by [`nvrtc::find_include`] and the default cache.
    pub fn discover(driver: String) -> Result<Self, CudaError> {
        super::library::require_nvrtc()?;
        // Loading NVRTC first lets the header search look next to the library.
        nvrtc::version()?;
        Self::new(
            nvrtc::find_include()?,
            driver,
            Some(KernelCache::new(KernelCache::default_dir())),
        )
    }

    /// The CUDA include folder in use.
    pub fn include(&self) -> &Path {
        &self.include
    }

    /// The cache key of `file` for `arch`.
    pub fn key(&self, file: KernelFile, arch: GpuArch) -> String {
        let source = file.expanded();
        CacheKeyParts {
            source: &source,
            arch,
            compiler: &self.compiler,
            driver: &self.driver,
        }
        .key()
    }

    /// `file` for `arch`, from the cache when present, else compiled (and stored).
    pub fn build(&self, file: KernelFile, arch: GpuArch) -> Result<CompiledKernelFile, CudaError> {
        let start = Instant::now();
        let key = self.key(file, arch);
        if let Some(image) = self.cache.as_ref().and_then(|c| c.load(&key)) {
            return Ok(CompiledKernelFile {
                file: file.name,
                arch,
                image,
                kernels: file.kernel_names(),
                seconds: start.elapsed().as_secs_f64(),
                from_cache: true,
            });
        }
        let compiled = nvrtc::compile_file(file, arch, &self.include)?;
        if let Some(cache) = &self.cache {
            cache.store(&key, &compiled.image)?;
        }
        Ok(compiled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_changes_with_every_part() {
        let arch = GpuArch { major: 8, minor: 0 };
        let base = CacheKeyParts {
            source: "a",
            arch,
            compiler: "nvrtc 13.0",
            driver: "13000",
        };
        let k = base.key();
        assert_eq!(k, base.clone().key());
        assert_ne!(
            k,
            CacheKeyParts {
                source: "b",
                ..base.clone()
            }
            .key()
        );
        assert_ne!(
            k,
            CacheKeyParts {
                arch: GpuArch { major: 9, minor: 0 },
                ..base.clone()
            }
            .key()
        );
        assert_ne!(
            k,
            CacheKeyParts {
                driver: "13010",
                ..base.clone()
            }
            .key()
        );
        assert_ne!(
            k,
            CacheKeyParts {
                compiler: "nvrtc 13.1",
                ..base
            }
            .key()
        );
    }

    #[test]
    fn store_then_load_round_trips_and_garbage_is_a_miss() {
        let dir = tempfile::tempdir().unwrap();
        let cache = KernelCache::new(dir.path().join("k"));
        let image = CompiledImage {
            ptx: ".version 9.0".into(),
            cubin: vec![0x7f, b'E', b'L', b'F', 0, 1],
        };
        assert!(cache.load("abc").is_none());
        cache.store("abc", &image).unwrap();
        assert_eq!(cache.load("abc"), Some(image));
        std::fs::write(
            dir.path().join("k/bad.btk"),
            b"BTK1\xff\xff\xff\xff\xff\xff\xff\x7fxx",
        )
        .unwrap();
        assert!(cache.load("bad").is_none());
    }
}
