//! Opening a cache: creating, resuming or rebuilding it alone, joining its fillers, opening it
//! read-only, or going on without one.

use std::fs::{File, OpenOptions};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use memmap2::MmapOptions;

use crate::PipelineError;

#[cfg(test)]
use super::faults;
use super::file::{
    io_err, is_unwritable, lock_shared, lock_shared_within, mapping_allowed, still_at,
    try_lock_exclusive, MAPPING,
};
use super::format::*;
use super::key::CacheKey;
use super::validate::{cut_short, judge, Verdict};
use super::{Cache, Map};

/// Where [`Cache::create`] puts its new file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Place {
    /// Where no file is: another process that created one first wins.
    New,
    /// Over the file this process holds alone (a rebuild).
    Replace,
}

/// Links `tmp` at `path` unless a file is there already (`Ok(false)`), then removes the
/// temporary name: two processes that both found no cache never both create one. A file
/// system without hard links gets a rename (where two processes racing to create the file
/// may each fill their own, one of them then unlinked: never a damaged record).
fn place_new(tmp: &Path, path: &Path) -> std::io::Result<bool> {
    match std::fs::hard_link(tmp, path) {
        Ok(()) => {
            let _ = std::fs::remove_file(tmp);
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EPERM | libc::ENOTSUP | libc::EMLINK | libc::ENOSYS)
            ) =>
        {
            std::fs::rename(tmp, path).map(|()| true)
        }
        Err(e) => Err(e),
    }
}

/// How long an open waits for a process that holds the file alone (judging, rebuilding or
/// sealing it takes moments).
#[cfg(not(test))]
const LOCK_PATIENCE: std::time::Duration = std::time::Duration::from_secs(60);
/// Shorter in the unit tests, which hold a file alone to see an open give up.
#[cfg(test)]
const LOCK_PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);

/// How many times an open starts over because the file it opened was replaced or created by
/// another process meanwhile (each start over means another process made progress).
const OPEN_ATTEMPTS: usize = 100;

impl Cache {
    /// Opens the cache at `path` for `key`, with `labels` per record: creates it when missing,
    /// resumes or rebuilds it when no other process has it open, joins the processes filling
    /// it otherwise (see the module docs). A place that cannot hold the cache, or a file that
    /// cannot be memory-mapped, gives a disabled cache and one warning, not an error.
    pub(crate) fn open(path: &Path, key: CacheKey, labels: &[u32]) -> Result<Self, PipelineError> {
        let layout = Layout::new(
            key.count,
            key.image_size as usize * key.image_size as usize * 3,
        );
        if let Some(dir) = path.parent() {
            if let Err(e) = std::fs::create_dir_all(dir) {
                if is_unwritable(&e) {
                    return Ok(Self::disabled(path, layout, "creating its folder", &e));
                }
                return Err(io_err(dir, "creating the cache directory")(e));
            }
        }
        for _ in 0..OPEN_ATTEMPTS {
            let opened = OpenOptions::new().read(true).write(true).open(path);
            #[cfg(test)]
            let opened = faults::deny_write(path, opened);
            let file = match opened {
                Ok(file) => file,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    match Self::create(path, key, labels, layout, Place::New) {
                        Ok(Some(cache)) => return Ok(cache),
                        // Another process created it first: open that one.
                        Ok(None) => continue,
                        Err(e) => return Self::disable_or_fail(path, layout, e),
                    }
                }
                Err(e) if is_unwritable(&e) => {
                    return match File::open(path) {
                        Ok(file) => Self::open_read_only(path, file, key, layout),
                        Err(e) => Ok(Self::disabled(path, layout, "opening", &e)),
                    };
                }
                Err(e) => return Err(io_err(path, "opening")(e)),
            };
            let alone = try_lock_exclusive(&file).map_err(io_err(path, "locking"))?;
            // Others fill it, or one process holds it alone for a moment (opening, rebuilding
            // or sealing it): wait for that moment to pass.
            if !alone
                && !lock_shared_within(&file, LOCK_PATIENCE).map_err(io_err(path, "locking"))?
            {
                tracing::warn!(
                    "cache file {}: another process has held it alone for {} s (an engine of \
                     an older cache format does so for its whole run); decoding without it",
                    path.display(),
                    LOCK_PATIENCE.as_secs()
                );
                return Ok(Self::from_map(
                    path,
                    None,
                    Map::None,
                    Layout { count: 0, ..layout },
                    false,
                ));
            }
            // A rebuild may have renamed a new file over this one before we locked it.
            if !still_at(&file, path).map_err(io_err(path, "locking"))? {
                continue;
            }
            return if alone {
                Self::open_alone(path, file, key, labels, layout)
            } else {
                Self::join(path, file, key, layout)
            };
        }
        let e = std::io::Error::other("other processes kept replacing it");
        Ok(Self::disabled(path, layout, "opening", &e))
    }

    /// No other process has the file open (we hold its exclusive lock): judge it as a whole,
    /// and resume it or rebuild it; then hold the shared lock every filler holds.
    fn open_alone(
        path: &Path,
        file: File,
        key: CacheKey,
        labels: &[u32],
        layout: Layout,
    ) -> Result<Self, PipelineError> {
        // The old file stays locked until its replacement is in place, so a process that
        // opened it meanwhile finds it replaced once it gets its lock, and starts over.
        let rebuild = |why: Option<String>| {
            if let Some(why) = why {
                tracing::warn!("cache file {}: {why}; rebuilding it", path.display());
            }
            match Self::create(path, key, labels, layout, Place::Replace) {
                Ok(cache) => Ok(cache.expect("a replacing create always places its file")),
                Err(e) => Self::disable_or_fail(path, layout, e),
            }
        };
        let len = file.metadata().map_err(io_err(path, "stat"))?.len();
        if len != layout.total as u64 {
            // Truncated, or another shape: nothing in it can be trusted. A file of this very
            // dataset cut short is damage, and said so.
            let why =
                cut_short(&file, len, &key, &layout).map(|why| format!("{why} (a damaged file)"));
            return rebuild(why);
        }
        // SAFETY: we hold the exclusive lock, so no other process changes the file; it is only
        // grown or replaced by rename, never truncated in place.
        let map = match mapping_allowed(path)
            .and_then(|()| unsafe { MmapOptions::new().map_mut(&file) })
        {
            Ok(map) => map,
            Err(e) => return Ok(Self::disabled(path, layout, MAPPING, &e)),
        };
        match judge(&map, &key, &layout, len) {
            Verdict::Rebuild => {
                drop(map);
                rebuild(None)
            }
            Verdict::OtherVersion(version) => {
                drop(map);
                rebuild(Some(format!(
                    "it was written in cache format version {version}, this engine writes \
                     version {VERSION}"
                )))
            }
            Verdict::Damaged(why) => {
                drop(map);
                rebuild(Some(format!("{why} (a damaged file)")))
            }
            verdict => {
                lock_shared(&file).map_err(io_err(path, "locking"))?;
                let cache = Self::from_map(path, Some(file), Map::Write(map), layout, true);
                // Claims of records never published were left by processes that are gone
                // (killed mid-write): free them, so those records can be written.
                cache.drop_stale_claims();
                if verdict == Verdict::Resumable {
                    cache.begin_writes();
                }
                Ok(cache)
            }
        }
    }

    /// Other processes have the file open: fill it beside them when its header fits `key`
    /// (its map checksum is stale while they fill, so only the header is checked here; every
    /// record is still verified before it is served), else decode without it (it is not ours
    /// to rebuild while others use it).
    fn join(path: &Path, file: File, key: CacheKey, layout: Layout) -> Result<Self, PipelineError> {
        let len = file.metadata().map_err(io_err(path, "stat"))?.len();
        let unusable = |file| {
            Self::from_map(
                path,
                Some(file),
                Map::None,
                Layout { count: 0, ..layout },
                false,
            )
        };
        if len != layout.total as u64 {
            return Ok(unusable(file));
        }
        // SAFETY: no process truncates a cache file in place (rebuilds are renamed over), and
        // its records are written by the claims protocol (see the module docs).
        let map = match mapping_allowed(path)
            .and_then(|()| unsafe { MmapOptions::new().map_mut(&file) })
        {
            Ok(map) => map,
            Err(e) => return Ok(Self::disabled(path, layout, MAPPING, &e)),
        };
        let fits = map.len() >= HEADER_BYTES
            && &map[0..8] == MAGIC
            && read_u32(&map, 8) == VERSION
            && read_u64(&map, OFF_HEADER_SUM) == header_sum(&map, &layout)
            && read_u32(&map, 16) == key.image_size
            && read_u64(&map, 24) == key.count as u64
            && read_u64(&map, 32) == key.fingerprint
            && read_u64(&map, 40) == layout.record_bytes as u64
            && matches!(
                read_u32(&map, OFF_STATE),
                STATE_FILLING | STATE_COMPLETE | STATE_SYNCED
            );
        if !fits {
            drop(map);
            return Ok(unusable(file));
        }
        Ok(Self::from_map(
            path,
            Some(file),
            Map::Write(map),
            layout,
            true,
        ))
    }

    /// A failed create: a disabled cache when the place cannot hold one, else the error.
    fn disable_or_fail(
        path: &Path,
        layout: Layout,
        (what, e): (&'static str, std::io::Error),
    ) -> Result<Self, PipelineError> {
        if is_unwritable(&e) || what == MAPPING {
            Ok(Self::disabled(path, layout, what, &e))
        } else {
            Err(io_err(path, what)(e))
        }
    }

    /// A cache that caches nothing, after one warning saying why (`what` failed with `e`).
    /// No cache at all, asked for ([`PipelineBuilder::cache`](crate::PipelineBuilder::cache)):
    /// no file is made and every image is decoded each time it is served.
    pub(crate) fn off(path: &Path, key: CacheKey) -> Self {
        let layout = Layout::new(
            key.count,
            key.image_size as usize * key.image_size as usize * 3,
        );
        Self::from_map(path, None, Map::None, Layout { count: 0, ..layout }, false)
    }

    pub(super) fn disabled(path: &Path, layout: Layout, what: &str, e: &std::io::Error) -> Self {
        let hint = if what != MAPPING {
            "free space there or pass a writable --cache-dir".to_string()
        } else if e.raw_os_error() == Some(libc::ENOMEM) {
            let size = if layout.total >= 1 << 30 {
                format!("{:.1} GiB", layout.total as f64 / (1u64 << 30) as f64)
            } else {
                format!("{} MiB", layout.total.div_ceil(1 << 20))
            };
            format!(
                "mapping it takes {size} of address space: raise the memory limit \
                 (`ulimit -v`, a cgroup), use a smaller image size, or free memory"
            )
        } else {
            "its file system may not support memory maps: pass a --cache-dir on a local disk"
                .to_string()
        };
        tracing::warn!(
            "cache file {}: {what} failed ({e}); going on without the pixel cache, so every \
             epoch decodes its images (hint: {hint})",
            path.display()
        );
        Self::from_map(path, None, Map::None, Layout { count: 0, ..layout }, false)
    }

    /// Whether a header (mapped read-only) fits `key` and its checksums; the reason if not.
    pub(super) fn readable(
        map: &[u8],
        key: &CacheKey,
        layout: &Layout,
        len: u64,
    ) -> Result<(), String> {
        match judge(map, key, layout, len) {
            Verdict::Complete | Verdict::Resumable => Ok(()),
            Verdict::Rebuild | Verdict::OtherVersion(_) => {
                Err("was built for another dataset, setting or format".into())
            }
            Verdict::Damaged(why) => Err(format!("is damaged: {why}")),
        }
    }

    /// The file cannot be opened for writing (a read-only folder or disk): serve it as it
    /// is when it is valid, else decode without it; one warning when it is not complete.
    pub(super) fn open_read_only(
        path: &Path,
        file: File,
        key: CacheKey,
        layout: Layout,
    ) -> Result<Self, PipelineError> {
        let len = file.metadata().map_err(io_err(path, "stat"))?.len();
        let unusable = |why: String| {
            tracing::warn!(
                "cache file {} is read-only and {why}; decoding without it (hint: pass a \
                 writable --cache-dir)",
                path.display()
            );
            Self::from_map(path, None, Map::None, Layout { count: 0, ..layout }, false)
        };
        if len != layout.total as u64 {
            return Ok(unusable(
                "was built for another dataset, setting or format".into(),
            ));
        }
        // SAFETY: a read-only file on a read-only place; nobody can change it under us.
        let map =
            match mapping_allowed(path).and_then(|()| unsafe { MmapOptions::new().map(&file) }) {
                Ok(map) => map,
                Err(e) => return Ok(Self::disabled(path, layout, MAPPING, &e)),
            };
        if let Err(why) = Self::readable(&map, &key, &layout, len) {
            return Ok(unusable(why));
        }
        let complete = read_u32(&map, OFF_STATE) == STATE_COMPLETE;
        let cache = Self::from_map(path, Some(file), Map::Read(map), layout, false);
        if !complete {
            tracing::warn!(
                "cache file {} is read-only and holds {} of {} records; the others are \
                 decoded every epoch",
                path.display(),
                cache.resolved(),
                layout.count
            );
        }
        Ok(cache)
    }

    /// Builds a fresh cache in a temporary file and puts it in place: as a new file, only if
    /// no other process created one meanwhile (`Ok(None)` then), or over the old file this
    /// process holds alone. The header, the labels, the bitmaps and the checks are written
    /// with one ordinary write, so every page the map later writes to is allocated (a full
    /// disk fails here, as an error value). The new file is under our shared lock before any
    /// other process can open it.
    pub(super) fn create(
        path: &Path,
        key: CacheKey,
        labels: &[u32],
        layout: Layout,
        place: Place,
    ) -> Result<Option<Self>, (&'static str, std::io::Error)> {
        use std::os::unix::fs::FileExt;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let tmp = path.with_extension(format!("tmp.{}.{nanos}", std::process::id()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| ("creating", e))?;
        let built = (|| {
            lock_shared(&file).map_err(|e| ("locking", e))?;
            let mut meta = vec![0u8; layout.records];
            meta[0..8].copy_from_slice(MAGIC);
            meta[8..12].copy_from_slice(&VERSION.to_le_bytes());
            meta[12..16].copy_from_slice(&STATE_FILLING.to_le_bytes());
            meta[16..20].copy_from_slice(&key.image_size.to_le_bytes());
            meta[20..24].copy_from_slice(&3u32.to_le_bytes());
            meta[24..32].copy_from_slice(&(key.count as u64).to_le_bytes());
            meta[32..40].copy_from_slice(&key.fingerprint.to_le_bytes());
            meta[40..48].copy_from_slice(&(layout.record_bytes as u64).to_le_bytes());
            if let Some(id) = current_boot_id() {
                meta[OFF_BOOT..OFF_BOOT + BOOT_LEN].copy_from_slice(&id);
            }
            for (i, label) in labels.iter().enumerate() {
                let at = layout.labels + 4 * i;
                meta[at..at + 4].copy_from_slice(&label.to_le_bytes());
            }
            let sum = header_sum(&meta, &layout);
            meta[OFF_HEADER_SUM..OFF_HEADER_SUM + 8].copy_from_slice(&sum.to_le_bytes());
            file.write_all_at(&meta, 0)
                .map_err(|e| ("writing the header", e))?;
            file.set_len(layout.total as u64)
                .map_err(|e| ("sizing", e))?;
            // SAFETY: a file only this process knows about yet, locked by us.
            let map = mapping_allowed(path)
                .and_then(|()| unsafe { MmapOptions::new().map_mut(&file) })
                .map_err(|e| (MAPPING, e))?;
            map.flush_range(0, layout.records)
                .map_err(|e| ("flushing the header", e))?;
            let placed = match place {
                Place::New => place_new(&tmp, path),
                Place::Replace => std::fs::rename(&tmp, path).map(|()| true),
            };
            Ok(placed
                .map_err(|e| ("putting the new cache into place", e))?
                .then_some(map))
        })();
        match built {
            Ok(Some(map)) => {
                let cache = Self::from_map(path, Some(file), Map::Write(map), layout, true);
                cache.filling.store(true, Ordering::Release);
                Ok(Some(cache))
            }
            Ok(None) => {
                let _ = std::fs::remove_file(&tmp);
                Ok(None)
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    pub(super) fn from_map(
        path: &Path,
        file: Option<File>,
        mut map: Map,
        layout: Layout,
        writable: bool,
    ) -> Self {
        let base = match &mut map {
            Map::Write(m) => m.as_mut_ptr(),
            Map::Read(m) => m.as_ptr().cast_mut(),
            Map::None => std::ptr::NonNull::<u64>::dangling().as_ptr().cast(),
        };
        let words = layout.count.div_ceil(64);
        let bitmap = || (0..words).map(|_| AtomicU64::new(0)).collect::<Vec<_>>();
        Self {
            path: path.to_path_buf(),
            file,
            map,
            base,
            layout,
            writable,
            in_flight: bitmap(),
            verified: bitmap(),
            rejected: bitmap(),
            filling: AtomicBool::new(false),
            state_lock: Mutex::new(()),
            damage_warned: AtomicBool::new(false),
            damaged: AtomicU64::new(0),
            write_failed: AtomicBool::new(false),
            write_failures: AtomicU64::new(0),
        }
    }
}
