//! The on-disk kernel cache: compiled images keyed by source, architecture, compiler and driver,
//! so that a second start compiles nothing.
//!
//! One file per key, `<key>.btk`: the magic `BTK1`, the PTX length (u64 LE), the PTX, the cubin.
//! Files are written to a temporary name of their writer's own and renamed, so a reader never
//! sees a torn file and concurrent writers (rank threads, pods on a shared volume) never clash;
//! a file that does not parse is treated as a miss and rewritten. A cache that cannot be written
//! is one warning: the compiled kernels are used anyway.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
            log: String::new(), // not kept: only `kernels report` reads it, from a fresh build
        })
    }

    /// Stores `image` under `key`: written whole under a temporary name no other writer
    /// uses, then renamed over the entry, so readers see the old entry or the new one, never
    /// a part of either.
    ///
    /// Many writers may store one key at once: the rank threads of one process compile the
    /// same kernels at the same moment on a cold cache, and pods sharing a cache volume may
    /// share process ids. The temporary name holds the process id, a per-process counter and a
    /// random salt, and is created exclusively, so no writer ever truncates another's file.
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
        let (tmp, mut file) = self.create_temp(key)?;
        let written = std::io::Write::write_all(&mut file, &bytes)
            .map_err(err(&tmp))
            .and_then(|()| {
                drop(file);
                std::fs::rename(&tmp, &final_path).map_err(err(&final_path))
            });
        if written.is_err() {
            // Best effort: a leftover temporary file only wastes space.
            let _ = std::fs::remove_file(&tmp);
        }
        written
    }

    /// A new, exclusively created temporary file for `key` (see [`KernelCache::store`]).
    fn create_temp(&self, key: &str) -> Result<(PathBuf, std::fs::File), CudaError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let pid = std::process::id();
        let mut attempt = 0;
        loop {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let salt: u64 = rand::random();
            let tmp = self.dir.join(format!("{key}.{pid}.{n}.{salt:016x}.tmp"));
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp)
            {
                Ok(file) => return Ok((tmp, file)),
                // Another writer's name (vanishingly unlikely): draw again.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempt < 8 => {
                    attempt += 1;
                }
                Err(source) => return Err(CudaError::Cache { path: tmp, source }),
            }
        }
    }

    /// [`KernelCache::store`] for a kernel that was just compiled and will be used either way:
    /// a failure (a read-only or missing folder, a full disk) is a warning, given once per
    /// `warned` flag, since every kernel file of the run would fail the same way. Returns
    /// whether the image was stored.
    pub fn store_or_warn(&self, key: &str, image: &CompiledImage, warned: &AtomicBool) -> bool {
        match self.store(key, image) {
            Ok(()) => true,
            Err(e) => {
                if !warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "{e}; compiled kernels are used but not cached, so the next start \
                         compiles them again"
                    );
                }
                false
            }
        }
    }
}

/// Whether this process has already warned that its kernel cache cannot be written.
static STORE_WARNED: AtomicBool = AtomicBool::new(false);

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
            cache.store_or_warn(&key, &compiled.image, &STORE_WARNED);
        }
        Ok(compiled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_changes_with_every_part() {
        let arch = GpuArch::new(8, 0);
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
                arch: GpuArch::new(9, 0),
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
            log: String::new(),
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

#[cfg(test)]
mod race_tests {
    use super::*;

    #[test]
    fn eight_writers_storing_one_key_all_succeed_and_readers_see_whole_entries() {
        let dir = tempfile::tempdir().unwrap();
        let cache = KernelCache::new(dir.path().join("k"));
        // A large entry, so a torn or truncated file cannot go unnoticed.
        let image = CompiledImage {
            ptx: "x".repeat(64 * 1024),
            cubin: (0..128 * 1024).map(|i| (i % 251) as u8).collect(),
            log: String::new(),
        };
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let reader = s.spawn(|| {
                let mut seen = 0usize;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    if let Ok(bytes) = std::fs::read(cache.path("k1")) {
                        let loaded = cache.load("k1");
                        assert_eq!(
                            loaded.as_ref(),
                            Some(&image),
                            "a reader saw a partial entry ({} bytes on disk)",
                            bytes.len()
                        );
                        seen += 1;
                    }
                }
                seen
            });
            let writers: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        (0..100)
                            .try_for_each(|_| cache.store("k1", &image).map_err(|e| e.to_string()))
                    })
                })
                .collect();
            let stored: Vec<_> = writers.into_iter().map(|w| w.join()).collect();
            // Stop the reader before judging, so a failure cannot leave it spinning.
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
            let seen = reader.join().expect("the reader saw only whole entries");
            for r in stored {
                r.expect("writer thread").expect("every store succeeds");
            }
            assert!(seen > 0);
        });
        assert_eq!(cache.load("k1"), Some(image));
        let left: Vec<_> = std::fs::read_dir(dir.path().join("k"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n != "k1.btk")
            .collect();
        assert!(left.is_empty(), "temporary files left behind: {left:?}");
    }
}

#[cfg(test)]
mod unwritable_tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// Everything logged at warning level while `f` runs.
    fn warnings(f: impl FnOnce()) -> String {
        #[derive(Clone, Default)]
        struct Sink(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Sink {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let sink = Sink::default();
        let writer = sink.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        text
    }

    fn image() -> CompiledImage {
        CompiledImage {
            ptx: ".version 9.0".into(),
            cubin: vec![1, 2, 3],
            log: String::new(),
        }
    }

    fn assert_warns_once_and_stores_nothing(cache: &KernelCache) {
        let warned = AtomicBool::new(false);
        let mut stored = Vec::new();
        let text = warnings(|| {
            for key in ["a", "b", "c"] {
                stored.push(cache.store_or_warn(key, &image(), &warned));
            }
        });
        assert_eq!(stored, [false, false, false]);
        assert_eq!(text.matches("WARN").count(), 1, "{text}");
        assert!(
            text.contains("kernel cache") && text.contains("not cached"),
            "{text}"
        );
        assert!(cache.load("a").is_none());
    }

    #[test]
    fn a_cache_folder_that_cannot_exist_warns_once_and_the_kernel_is_still_used() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a-file");
        std::fs::write(&file, b"not a folder").unwrap();
        assert_warns_once_and_stores_nothing(&KernelCache::new(file.join("kernels")));
    }

    #[test]
    fn an_entry_that_cannot_be_replaced_warns_once_and_leaves_no_temporary_file() {
        // The rename fails (the entry's name is taken by a folder): the write path's failure
        // after the temporary file exists, which must clean it up.
        let dir = tempfile::tempdir().unwrap();
        let cache = KernelCache::new(dir.path());
        for key in ["a", "b", "c"] {
            std::fs::create_dir_all(dir.path().join(format!("{key}.btk")).join("x")).unwrap();
        }
        assert_warns_once_and_stores_nothing(&cache);
        let temps: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(temps.is_empty(), "{temps:?}");
    }
}
