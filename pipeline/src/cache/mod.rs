//! The memory-mapped record cache: one file per dataset split and resize setting.
//!
//! Layout (little endian):
//!
//! | offset        | content                                                        |
//! |---------------|----------------------------------------------------------------|
//! | 0             | header: magic, version, state, image size, channels, count,   |
//! |               | fingerprint, record bytes, boot id, header checksum, map       |
//! |               | checksum (4096 bytes reserved)                                 |
//! | 4096          | labels: `count × u32`                                          |
//! | 8-aligned     | filled-records bitmap: `⌈count/64⌉ × u64`                      |
//! | after it      | bad-records bitmap (files that failed to decode), same size    |
//! | after it      | record checks: `count × u64`, a filled record's xxh3 or a bad  |
//! |               | record's tag (its index and its [`BadFileKind`])               |
//! | after it      | sources: `count × u64`, the content hash of the file a filled  |
//! |               | record was decoded from ([`crate::content_hash`])              |
//! | 4096-aligned  | records: `count × S·S·3` u8, NHWC RGB                          |
//!
//! **Never serve a damaged record.** Each record carries an xxh3-64 of its pixels (seeded
//! with its index and its source's content hash, so a record moved elsewhere, or given
//! another source's hash, fails too), verified the first time a process
//! serves it (later serves in that process trust the verified bit: about one hash per record
//! per process). A bad record carries a tag instead, so a stray "bad" bit is caught as well.
//! The header checksum covers the header fields and the labels; the map checksum covers the
//! bitmaps and the record checks and is written with the `synced`/`complete` state, so a
//! closed cache whose bits were altered is caught at open. A damaged record is decoded again
//! and rewritten; a damaged header or map rebuilds the file; either says so once, naming the
//! cache file.
//!
//! **The cache is an accelerator, never a reason to stop.** A cache folder that cannot be
//! written (full disk, read-only, quota) or a file that cannot be memory-mapped (an address
//! space limit, a file system without maps) gives one warning and the engine decodes what it
//! cannot cache; a complete cache in a read-only folder is served as it is. Every page the
//! writer touches through the map is allocated by an ordinary write when the file is made,
//! so a full disk surfaces as an error value, never as a SIGBUS; records are written with
//! positioned writes for the same reason.
//!
//! **Never serve a torn record.** A worker writes the pixels of record `i` straight into the
//! map, then sets bit `i` with release ordering; readers test the bit with acquire ordering. A
//! process killed mid-write leaves its page cache intact, so set bits are exact for any later
//! process of the same boot. A crash of the machine is different (pages may reach the disk in
//! any order), so the header carries a state: `filling` with the writer's boot id (bits are
//! trusted only within that boot), `synced` (the writer flushed the whole map before writing
//! this state, so bits are durable) or `complete` (every record resolved and flushed).
//!
//! **Two writers never share a file.** The writer holds an exclusive advisory lock
//! (flock(2) on Unix) on the cache file for its whole life. A second pipeline
//! or process that cannot get the lock opens the file read-only: it serves the records whose
//! bits are set and decodes the rest in memory without writing. A cache that must be rebuilt
//! (other fingerprint, wrong size, untrusted state) is built in a fresh temporary file and
//! renamed over the old one, so a reader still mapping the old file is never cut short.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use memmap2::{Mmap, MmapMut, MmapOptions};

use crate::{BadFileKind, PipelineError};

const MAGIC: &[u8; 8] = b"BRDCACHE";
/// Version 2 added the record checks and the two checksums. Version 3: the fingerprint
/// also covers each file's status-change time and inode number, and a file that could not
/// be opened or read is no longer kept as bad (older files may hold such marks, so they
/// are rebuilt). Version 4: `--resize-mode center-crop` stores torchvision's `Resize` then
/// `CenterCrop` square exactly (its whole-pixel roundings), not the image's exact centre.
/// Version 5: a JPEG whose header declares more blocks than its data can code is a bad file
/// (older caches may hold its grey-filled pixels). Version 6: each filled record keeps the
/// content hash of the file it was decoded from (what a run records of its training files).
const VERSION: u32 = 6;
const HEADER_BYTES: usize = 4096;
const STATE_FILLING: u32 = 1;
const STATE_COMPLETE: u32 = 2;
const STATE_SYNCED: u32 = 3;
const OFF_STATE: usize = 12;
const OFF_BOOT: usize = 48;
const BOOT_LEN: usize = 36;
const OFF_HEADER_SUM: usize = 88;
const OFF_MAP_SUM: usize = 96;
/// Seeds every checksum of the file, so a record of another file format never matches.
const SUM_SEED: u64 = 0x6272_6463_6163_6865;

/// Where each region lives for a given record count and size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Layout {
    count: usize,
    record_bytes: usize,
    labels: usize,
    filled: usize,
    bad: usize,
    checks: usize,
    sources: usize,
    records: usize,
    total: usize,
}

impl Layout {
    fn new(count: usize, record_bytes: usize) -> Self {
        let words = count.div_ceil(64);
        let labels = HEADER_BYTES;
        let filled = (labels + 4 * count).next_multiple_of(8);
        let bad = filled + 8 * words;
        let checks = bad + 8 * words;
        let sources = checks + 8 * count;
        let records = (sources + 8 * count).next_multiple_of(4096);
        Self {
            count,
            record_bytes,
            labels,
            filled,
            bad,
            checks,
            sources,
            records,
            total: records + count * record_bytes,
        }
    }

    /// The layout a header describes, if its sizes are possible for a file of `len` bytes.
    fn of_header(bytes: &[u8], len: u64) -> Option<Self> {
        let count = usize::try_from(read_u64(bytes, 24)).ok()?;
        let record_bytes = usize::try_from(read_u64(bytes, 40)).ok()?;
        let records_bytes = count.checked_mul(record_bytes)?;
        if count.checked_mul(16)? > len as usize || records_bytes > len as usize {
            return None;
        }
        let layout = Self::new(count, record_bytes);
        (layout.total as u64 == len).then_some(layout)
    }

    /// The end of the sources (the map checksum covers `filled..map_end`).
    fn map_end(&self) -> usize {
        self.sources + 8 * self.count
    }
}

/// The check of a filled record: xxh3-64 of its pixels, seeded with its index and the
/// content hash of its source file (so the check covers that hash too).
fn record_sum(pixels: &[u8], index: usize, source: u64) -> u64 {
    let seed = xxhash_rust::xxh3::xxh3_64_with_seed(&source.to_le_bytes(), SUM_SEED ^ index as u64);
    xxhash_rust::xxh3::xxh3_64_with_seed(pixels, seed)
}

/// The check of a bad record: a value only this index gives, with the kind in the low byte.
fn bad_tag(index: usize, kind: BadFileKind) -> u64 {
    (xxhash_rust::xxh3::xxh3_64_with_seed(b"bad record", SUM_SEED ^ index as u64) & !0xFF)
        | u64::from(kind.code())
}

/// The kind a bad record's check names, if it is a valid tag for `index`.
fn tag_kind(index: usize, tag: u64) -> Option<BadFileKind> {
    let expected = bad_tag(index, BadFileKind::Empty);
    if tag & !0xFF != expected & !0xFF {
        return None;
    }
    BadFileKind::from_code(tag as u8)
}

/// Checksum of the header fields (state and boot id excluded: they change) and the labels.
fn header_sum(bytes: &[u8], layout: &Layout) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::with_seed(SUM_SEED);
    h.update(&bytes[0..OFF_STATE]);
    h.update(&bytes[OFF_STATE + 4..OFF_BOOT]);
    h.update(&bytes[layout.labels..layout.labels + 4 * layout.count]);
    h.digest()
}

/// Checksum of the bitmaps and the record checks.
fn map_sum(bytes: &[u8], layout: &Layout) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(&bytes[layout.filled..layout.map_end()], SUM_SEED)
}

/// What the header must say for the cache to be usable.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CacheKey {
    pub(crate) image_size: u32,
    pub(crate) count: usize,
    pub(crate) fingerprint: u64,
}

enum Map {
    Write(MmapMut),
    Read(Mmap),
    /// No usable mapping: the engine decodes every image (see [`Cache::disabled`]).
    None,
}

/// What [`Cache::lookup`] found for a record.
#[derive(Debug)]
pub(crate) enum Lookup<'a> {
    /// The record's pixels, verified.
    Hit(&'a [u8]),
    /// The sample is a bad file, of this kind, found by an earlier pass.
    Bad(BadFileKind),
    /// Not cached (or damaged, and now treated as not cached): decode the image.
    Miss,
}

/// An open cache file (writer or read-only).
pub(crate) struct Cache {
    path: PathBuf,
    // Kept open: as the writer, its lock lives as long as this handle; records are written
    // through it (see `RecordWriter::write_and_commit`). `None` for a disabled cache.
    file: Option<File>,
    map: Map,
    base: *mut u8,
    layout: Layout,
    writable: bool,
    /// In-memory claims, so two workers of this process never write one record at once.
    claims: Vec<AtomicU64>,
    /// Records whose check this process has verified (or written).
    verified: Vec<AtomicU64>,
    /// Records this process found damaged and cannot rewrite (a reader): decoded each time.
    rejected: Vec<AtomicU64>,
    resolved: AtomicUsize,
    /// Whether the header says `filling` for this boot (required before any write).
    filling: AtomicBool,
    state_lock: Mutex<()>,
    damage_warned: AtomicBool,
    damaged: AtomicU64,
    write_failed: AtomicBool,
    write_failures: AtomicU64,
}

// SAFETY: the raw base pointer refers to the map owned by this struct. Shared access is
// coordinated by the atomic bitmaps: a record is written only by the worker that claimed it
// and read only after its filled bit is published (release/acquire), see the module docs.
unsafe impl Send for Cache {}
unsafe impl Sync for Cache {}

fn io_err<'a>(
    path: &'a Path,
    what: &'static str,
) -> impl FnOnce(std::io::Error) -> PipelineError + 'a {
    move |source| PipelineError::CacheIo {
        path: path.to_path_buf(),
        what,
        source,
    }
}

/// Errors that say "this place cannot hold a cache" (as opposed to a bug or a broken disk):
/// the engine goes on without the cache instead of stopping.
fn is_unwritable(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOSPC | libc::EDQUOT | libc::EROFS | libc::EACCES | libc::EPERM | libc::EFBIG)
    )
}

/// What [`Cache::disabled`] says failed when the file cannot be memory-mapped.
const MAPPING: &str = "mapping";

/// The check before every memory map of the cache file `path`: always fine, except where a
/// test makes it fail (`faults::map_fails`).
fn mapping_allowed(path: &Path) -> std::io::Result<()> {
    #[cfg(test)]
    faults::map_check(path)?;
    let _ = path;
    Ok(())
}

/// Takes an exclusive advisory lock without waiting: `Ok(false)` when someone else holds it.
/// flock(2) locks belong to the open file description, so a second handle in the same
/// process is refused too, which is what keeps two pipelines from writing one file.
#[cfg(unix)]
fn try_lock(file: &File) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a valid, open descriptor owned by `file`; no memory is passed.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(true);
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(err)
    }
}

/// Without flock every pipeline is a writer; concurrent writers of one file are then the
/// caller's responsibility (birdtrain targets Linux).
#[cfg(not(unix))]
fn try_lock(_file: &File) -> std::io::Result<bool> {
    Ok(true)
}

fn current_boot_id() -> Option<[u8; BOOT_LEN]> {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    text.trim().as_bytes().try_into().ok()
}

fn read_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn read_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// How an existing file's header relates to what we need.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Complete,
    Resumable,
    /// Another dataset, format or boot: rebuilt without a word (that is what caches do).
    Rebuild,
    /// The file contradicts its own checksums: rebuilt with a warning saying what failed.
    Damaged(&'static str),
}

fn judge(bytes: &[u8], key: &CacheKey, layout: &Layout, file_len: u64) -> Verdict {
    if bytes.len() < HEADER_BYTES || &bytes[0..8] != MAGIC || read_u32(bytes, 8) != VERSION {
        return Verdict::Rebuild;
    }
    // The header is checked against its own layout first, so damage is told apart from a
    // cache of another dataset.
    let Some(own) = Layout::of_header(bytes, file_len) else {
        return Verdict::Damaged("its header describes a file of another size");
    };
    if read_u64(bytes, OFF_HEADER_SUM) != header_sum(bytes, &own) {
        return Verdict::Damaged("its header or labels do not match their checksum");
    }
    let same = own == *layout
        && read_u32(bytes, 16) == key.image_size
        && read_u32(bytes, 20) == 3
        && read_u64(bytes, 32) == key.fingerprint;
    if !same {
        return Verdict::Rebuild;
    }
    match read_u32(bytes, OFF_STATE) {
        state @ (STATE_COMPLETE | STATE_SYNCED) => {
            if read_u64(bytes, OFF_MAP_SUM) != map_sum(bytes, layout) {
                Verdict::Damaged("its record bitmaps or checks do not match their checksum")
            } else if state == STATE_COMPLETE {
                Verdict::Complete
            } else {
                Verdict::Resumable
            }
        }
        STATE_FILLING => {
            let same_boot =
                current_boot_id().is_some_and(|id| bytes[OFF_BOOT..OFF_BOOT + BOOT_LEN] == id[..]);
            if same_boot {
                Verdict::Resumable
            } else {
                Verdict::Rebuild
            }
        }
        _ => Verdict::Damaged("its state word is not a known state"),
    }
}

/// Why a cache file of `len` bytes where `layout` needs another size is this dataset's
/// file cut short (or padded): empty, shorter than its header, or a header of this version
/// that names this dataset. `None` for a cache of another dataset or format (an edited
/// dataset reuses the file name: its rebuild is no damage).
fn cut_short(file: &File, len: u64, key: &CacheKey, layout: &Layout) -> Option<String> {
    use std::os::unix::fs::FileExt;
    let size = format!("{len} bytes where {} are needed", layout.total);
    if len == 0 {
        return Some(format!("it is empty ({size})"));
    }
    let mut header = vec![0u8; HEADER_BYTES.min(len as usize)];
    file.read_exact_at(&mut header, 0).ok()?;
    let ours = header.starts_with(&MAGIC[..header.len().min(MAGIC.len())]);
    if !ours {
        return None;
    }
    if header.len() < 48 {
        return Some(format!("it is cut short inside its header ({size})"));
    }
    let same_dataset = read_u32(&header, 8) == VERSION
        && read_u32(&header, 16) == key.image_size
        && read_u64(&header, 24) == key.count as u64
        && read_u64(&header, 32) == key.fingerprint;
    same_dataset.then(|| format!("it is cut short ({size})"))
}

impl Cache {
    /// Opens (resuming, or rebuilding) the cache at `path` for `key`, with `labels` per record.
    /// A place that cannot hold the cache, or a file that cannot be memory-mapped, gives a
    /// disabled cache and one warning, not an error.
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
        let opened = OpenOptions::new().read(true).write(true).open(path);
        #[cfg(test)]
        let opened = faults::deny_write(path, opened);
        match opened {
            Ok(file) => match try_lock(&file) {
                Ok(true) => {
                    let len = file.metadata().map_err(io_err(path, "stat"))?.len();
                    if len != layout.total as u64 {
                        // Truncated, or another shape: nothing in it can be trusted. A file
                        // of this very dataset cut short is damage, and said so.
                        if let Some(why) = cut_short(&file, len, &key, &layout) {
                            tracing::warn!(
                                "cache file {}: {why} (a damaged file); rebuilding it",
                                path.display()
                            );
                        }
                        return Self::create_or_disable(path, key, labels, layout);
                    }
                    // SAFETY: we hold the exclusive lock, so no other writer changes the file;
                    // it is only grown or replaced by rename, never truncated in place.
                    let map = match mapping_allowed(path)
                        .and_then(|()| unsafe { MmapOptions::new().map_mut(&file) })
                    {
                        Ok(map) => map,
                        Err(e) => return Ok(Self::disabled(path, layout, MAPPING, &e)),
                    };
                    match judge(&map, &key, &layout, len) {
                        Verdict::Rebuild => {
                            drop(map);
                            Self::create_or_disable(path, key, labels, layout)
                        }
                        Verdict::Damaged(why) => {
                            drop(map);
                            tracing::warn!(
                                "cache file {}: {why} (a damaged file); rebuilding it",
                                path.display()
                            );
                            Self::create_or_disable(path, key, labels, layout)
                        }
                        verdict => {
                            let cache =
                                Self::from_map(path, Some(file), Map::Write(map), layout, true);
                            if verdict == Verdict::Resumable {
                                cache.begin_writes();
                            }
                            Ok(cache)
                        }
                    }
                }
                Ok(false) => Self::open_reader(path, file, key, layout),
                Err(e) => Err(io_err(path, "locking")(e)),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Self::create_or_disable(path, key, labels, layout)
            }
            Err(e) if is_unwritable(&e) => match File::open(path) {
                Ok(file) => Self::open_read_only(path, file, key, layout),
                Err(e) => Ok(Self::disabled(path, layout, "opening", &e)),
            },
            Err(e) => Err(io_err(path, "opening")(e)),
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

    fn disabled(path: &Path, layout: Layout, what: &str, e: &std::io::Error) -> Self {
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
    fn readable(map: &[u8], key: &CacheKey, layout: &Layout, len: u64) -> Result<(), String> {
        match judge(map, key, layout, len) {
            Verdict::Complete | Verdict::Resumable => Ok(()),
            Verdict::Rebuild => Err("was built for another dataset, setting or format".into()),
            Verdict::Damaged(why) => Err(format!("is damaged: {why}")),
        }
    }

    /// Another pipeline writes this file: serve what it has published, write nothing.
    fn open_reader(
        path: &Path,
        file: File,
        key: CacheKey,
        layout: Layout,
    ) -> Result<Self, PipelineError> {
        let len = file.metadata().map_err(io_err(path, "stat"))?.len();
        if len != layout.total as u64 {
            // Not ours to rebuild: behave as an empty cache (decode in memory).
            return Ok(Self::from_map(
                path,
                Some(file),
                Map::None,
                Layout { count: 0, ..layout },
                false,
            ));
        }
        // SAFETY: the writer never truncates a cache file in place (rebuilds are renamed over).
        let map =
            match mapping_allowed(path).and_then(|()| unsafe { MmapOptions::new().map(&file) }) {
                Ok(map) => map,
                Err(e) => return Ok(Self::disabled(path, layout, MAPPING, &e)),
            };
        // The writer's map checksum is stale while it fills (state `filling`), so only the
        // header is checked here; every record is still verified before it is served.
        let usable = map.len() >= HEADER_BYTES
            && &map[0..8] == MAGIC
            && read_u32(&map, 8) == VERSION
            && read_u64(&map, OFF_HEADER_SUM) == header_sum(&map, &layout)
            && read_u32(&map, 16) == key.image_size
            && read_u64(&map, 24) == key.count as u64
            && read_u64(&map, 32) == key.fingerprint
            && read_u64(&map, 40) == layout.record_bytes as u64;
        // Not ours to rebuild when unusable: behave as an empty cache (decode in memory).
        let layout = if usable {
            layout
        } else {
            Layout { count: 0, ..layout }
        };
        Ok(Self::from_map(
            path,
            Some(file),
            Map::Read(map),
            layout,
            false,
        ))
    }

    /// The file cannot be opened for writing (a read-only folder or disk): serve it as it
    /// is when it is valid, else decode without it; one warning when it is not complete.
    fn open_read_only(
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

    /// [`Cache::create`], or a disabled cache when the place cannot hold one.
    fn create_or_disable(
        path: &Path,
        key: CacheKey,
        labels: &[u32],
        layout: Layout,
    ) -> Result<Self, PipelineError> {
        match Self::create(path, key, labels, layout) {
            Ok(cache) => Ok(cache),
            Err((what, e)) if is_unwritable(&e) || what == MAPPING => {
                Ok(Self::disabled(path, layout, what, &e))
            }
            Err((what, e)) => Err(io_err(path, what)(e)),
        }
    }

    /// Builds a fresh cache in a temporary file and renames it into place. The header, the
    /// labels, the bitmaps and the checks are written with one ordinary write, so every page
    /// the map later writes to is allocated (a full disk fails here, as an error value).
    fn create(
        path: &Path,
        key: CacheKey,
        labels: &[u32],
        layout: Layout,
    ) -> Result<Self, (&'static str, std::io::Error)> {
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
            if !try_lock(&file).map_err(|e| ("locking", e))? {
                return Err((
                    "locking",
                    std::io::Error::other("a brand-new temporary file is locked by someone else"),
                ));
            }
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
            std::fs::rename(&tmp, path).map_err(|e| ("renaming the new cache into place", e))?;
            Ok(map)
        })();
        match built {
            Ok(map) => {
                let cache = Self::from_map(path, Some(file), Map::Write(map), layout, true);
                cache.filling.store(true, Ordering::Release);
                Ok(cache)
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    fn from_map(
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
        let cache = Self {
            path: path.to_path_buf(),
            file,
            map,
            base,
            layout,
            writable,
            claims: bitmap(),
            verified: bitmap(),
            rejected: bitmap(),
            resolved: AtomicUsize::new(0),
            filling: AtomicBool::new(false),
            state_lock: Mutex::new(()),
            damage_warned: AtomicBool::new(false),
            damaged: AtomicU64::new(0),
            write_failed: AtomicBool::new(false),
            write_failures: AtomicU64::new(0),
        };
        let resolved = (0..words)
            .map(|w| {
                // Bits past the last record mean nothing (and are never set by a writer).
                let valid = layout.count - 64 * w;
                let mask = if valid >= 64 { !0 } else { (1u64 << valid) - 1 };
                ((cache.word(cache.layout.filled, w).load(Ordering::Acquire)
                    | cache.word(cache.layout.bad, w).load(Ordering::Acquire))
                    & mask)
                    .count_ones() as usize
            })
            .sum();
        cache.resolved.store(resolved, Ordering::Relaxed);
        cache
    }

    /// Makes the header say `filling` for this boot, durably, before anything is changed in
    /// a cache that said `complete` or `synced` (whose map checksum then no longer holds).
    fn begin_writes(&self) {
        if self.filling.load(Ordering::Acquire) {
            return;
        }
        let _guard = self.state_lock.lock().unwrap_or_else(|p| p.into_inner());
        if self.filling.load(Ordering::Acquire) {
            return;
        }
        if let Map::Write(map) = &self.map {
            // SAFETY: offsets inside the header page of our writable map; we are the only
            // writer (exclusive lock), and the state word is 4-aligned.
            unsafe {
                (*(self.base.add(OFF_STATE) as *const AtomicU32))
                    .store(STATE_FILLING, Ordering::Release);
                if let Some(id) = current_boot_id() {
                    std::ptr::copy_nonoverlapping(id.as_ptr(), self.base.add(OFF_BOOT), BOOT_LEN);
                }
            }
            if let Err(e) = map.flush_range(0, HEADER_BYTES) {
                tracing::warn!(
                    "cache file {}: flushing the header failed: {e}",
                    self.path.display()
                );
            }
        }
        self.filling.store(true, Ordering::Release);
    }

    fn word(&self, region: usize, w: usize) -> &AtomicU64 {
        debug_assert!(w < self.layout.count.div_ceil(64));
        // SAFETY: region offsets are multiples of 8 inside the page-aligned map, so the word is
        // aligned and in bounds; the map outlives `self`.
        unsafe { &*(self.base.add(region + 8 * w) as *const AtomicU64) }
    }

    fn check_word(&self, i: usize) -> &AtomicU64 {
        debug_assert!(i < self.layout.count);
        // SAFETY: as `word`: the checks region is 8-aligned and holds `count` words.
        unsafe { &*(self.base.add(self.layout.checks + 8 * i) as *const AtomicU64) }
    }

    fn source_word(&self, i: usize) -> &AtomicU64 {
        debug_assert!(i < self.layout.count);
        // SAFETY: as `word`: the sources region is 8-aligned and holds `count` words.
        unsafe { &*(self.base.add(self.layout.sources + 8 * i) as *const AtomicU64) }
    }

    /// The content hash of the file record `i` was decoded from, when the record is filled
    /// (not verified here: [`Cache::lookup`] verifies it with the pixels).
    pub(crate) fn source(&self, i: usize) -> Option<u64> {
        if i >= self.layout.count || Self::bit_set(&self.rejected, i) {
            return None;
        }
        let bit = 1u64 << (i % 64);
        if self
            .word(self.layout.filled, i / 64)
            .load(Ordering::Acquire)
            & bit
            == 0
        {
            return None;
        }
        Some(self.source_word(i).load(Ordering::Relaxed)).filter(|&h| h != 0)
    }

    /// The cache file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Whether this handle may write records.
    pub(crate) fn writable(&self) -> bool {
        self.writable && self.layout.count > 0 && !self.write_failed.load(Ordering::Relaxed)
    }

    /// Records that are filled or known bad.
    pub(crate) fn resolved(&self) -> usize {
        self.resolved.load(Ordering::Relaxed)
    }

    /// Records found damaged by this process.
    pub(crate) fn damaged(&self) -> u64 {
        self.damaged.load(Ordering::Relaxed)
    }

    /// Record writes that failed in this process.
    pub(crate) fn write_failures(&self) -> u64 {
        self.write_failures.load(Ordering::Relaxed)
    }

    fn bit_set(bitmap: &[AtomicU64], i: usize) -> bool {
        bitmap[i / 64].load(Ordering::Relaxed) & (1 << (i % 64)) != 0
    }

    /// What the cache holds for sample `i`: verified pixels, a bad file's kind, or nothing.
    /// A record whose check fails is reported once and treated as not cached (a writer then
    /// decodes and rewrites it).
    pub(crate) fn lookup(&self, i: usize) -> Lookup<'_> {
        if i >= self.layout.count || Self::bit_set(&self.rejected, i) {
            return Lookup::Miss;
        }
        let bit = 1u64 << (i % 64);
        if self
            .word(self.layout.filled, i / 64)
            .load(Ordering::Acquire)
            & bit
            != 0
        {
            let at = self.layout.records + i * self.layout.record_bytes;
            // SAFETY: the filled bit was observed with acquire ordering after the writer's
            // release, and a filled record is written again only after its bit is cleared;
            // the range is inside the map.
            let record =
                unsafe { std::slice::from_raw_parts(self.base.add(at), self.layout.record_bytes) };
            if Self::bit_set(&self.verified, i) {
                return Lookup::Hit(record);
            }
            let source = self.source_word(i).load(Ordering::Relaxed);
            if record_sum(record, i, source) == self.check_word(i).load(Ordering::Relaxed) {
                self.verified[i / 64].fetch_or(bit, Ordering::Relaxed);
                return Lookup::Hit(record);
            }
            self.damage(
                i,
                self.layout.filled,
                "its pixels do not match their checksum",
            );
            return Lookup::Miss;
        }
        match self.bad_kind(i) {
            Some(kind) => Lookup::Bad(kind),
            None => Lookup::Miss,
        }
    }

    /// The kind of bad file sample `i` is, if the cache knows it as one (bit and tag agree).
    pub(crate) fn bad_kind(&self, i: usize) -> Option<BadFileKind> {
        if i >= self.layout.count || Self::bit_set(&self.rejected, i) {
            return None;
        }
        let bit = 1u64 << (i % 64);
        if self.word(self.layout.bad, i / 64).load(Ordering::Acquire) & bit == 0 {
            return None;
        }
        let kind = tag_kind(i, self.check_word(i).load(Ordering::Relaxed));
        if kind.is_none() {
            self.damage(i, self.layout.bad, "it is marked bad without a valid tag");
        }
        kind
    }

    /// A record failed its check: warn once per process, and forget it (a writer clears its
    /// bit so it is decoded and rewritten; a reader decodes it each time).
    fn damage(&self, i: usize, region: usize, why: &str) {
        let bit = 1u64 << (i % 64);
        let counted = if self.writable() {
            self.begin_writes();
            let was = self.word(region, i / 64).fetch_and(!bit, Ordering::AcqRel);
            if was & bit != 0 {
                self.resolved.fetch_sub(1, Ordering::Relaxed);
            }
            was & bit != 0
        } else {
            self.rejected[i / 64].fetch_or(bit, Ordering::Relaxed) & bit == 0
        };
        if counted {
            self.damaged.fetch_add(1, Ordering::Relaxed);
        }
        if !self.damage_warned.swap(true, Ordering::Relaxed) {
            let action = if self.writable() {
                "decoded again and rewritten"
            } else {
                "decoded again"
            };
            tracing::warn!(
                "cache file {}: record {i} failed verification ({why}); damaged records are \
                 {action} (said once)",
                self.path.display()
            );
        }
    }

    /// Claims record `i` for writing; `None` if it is resolved, claimed, or not writable.
    pub(crate) fn claim(&self, i: usize) -> Option<RecordWriter<'_>> {
        if !self.writable() || i >= self.layout.count {
            return None;
        }
        let bit = 1u64 << (i % 64);
        let resolved = (self
            .word(self.layout.filled, i / 64)
            .load(Ordering::Acquire)
            | self.word(self.layout.bad, i / 64).load(Ordering::Acquire))
            & bit
            != 0;
        if resolved || self.claims[i / 64].fetch_or(bit, Ordering::AcqRel) & bit != 0 {
            return None;
        }
        self.begin_writes();
        Some(RecordWriter {
            cache: self,
            index: i,
            published: false,
        })
    }

    /// A record write failed: one warning for the whole process (a full disk fails every
    /// write after the first), and no more writes are tried.
    pub(crate) fn note_write_failure(&self, error: &std::io::Error) {
        self.write_failures.fetch_add(1, Ordering::Relaxed);
        if !self.write_failed.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "cache file {}: writing a record failed ({error}); {} of {} records are \
                 cached, the others are decoded every epoch (said once; hint: free space \
                 there or pass --cache-dir elsewhere)",
                self.path.display(),
                self.resolved(),
                self.layout.count
            );
        }
    }

    fn publish(&self, region: usize, i: usize) {
        let bit = 1u64 << (i % 64);
        if self.word(region, i / 64).fetch_or(bit, Ordering::Release) & bit == 0 {
            self.resolved.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Drop for Cache {
    /// Flushes the map and records how far the cache got, with the map checksum, so another
    /// boot can trust it.
    fn drop(&mut self) {
        let complete = self.resolved() == self.layout.count;
        let layout = self.layout;
        let quiet = self.write_failed.load(Ordering::Relaxed);
        if let Map::Write(map) = &mut self.map {
            if layout.count == 0 || map.flush().is_err() {
                return;
            }
            let state = if complete {
                STATE_COMPLETE
            } else {
                STATE_SYNCED
            };
            let sum = map_sum(map, &layout);
            map[OFF_MAP_SUM..OFF_MAP_SUM + 8].copy_from_slice(&sum.to_le_bytes());
            map[OFF_STATE..OFF_STATE + 4].copy_from_slice(&state.to_le_bytes());
            if let Err(e) = map.flush_range(0, HEADER_BYTES) {
                if !quiet {
                    tracing::warn!(
                        "cache file {}: flushing the header failed: {e}",
                        self.path.display()
                    );
                }
            }
        }
    }
}

/// Exclusive write access to one record, published on [`RecordWriter::write_and_commit`].
pub(crate) struct RecordWriter<'a> {
    cache: &'a Cache,
    index: usize,
    published: bool,
}

impl RecordWriter<'_> {
    /// Writes the whole record with one positioned write, then the content hash of its
    /// source file (`source`) and its check, then publishes it.
    /// Writing through the file rather than the shared map spares a page fault per page of a
    /// fresh record (about 8 % of a first epoch) and turns a full disk into an error value;
    /// the kernel keeps the map coherent with the file's page cache, so readers see the bytes
    /// through the map once the bit is published. On an error nothing is published and the
    /// claim is released (a later pass decodes the image again).
    pub(crate) fn write_and_commit(self, pixels: &[u8], source: u64) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let bytes = self.cache.layout.record_bytes;
        if pixels.len() != bytes {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("record of {} bytes, expected {bytes}", pixels.len()),
            ));
        }
        #[cfg(test)]
        faults::check(&self.cache.path)?;
        let file = self.cache.file.as_ref().ok_or_else(|| {
            std::io::Error::other("a disabled cache has no file (programmer error)")
        })?;
        let at = self.cache.layout.records + self.index * bytes;
        file.write_all_at(pixels, at as u64)?;
        let i = self.index;
        self.cache.source_word(i).store(source, Ordering::Relaxed);
        self.cache
            .check_word(i)
            .store(record_sum(pixels, i, source), Ordering::Relaxed);
        self.cache.verified[i / 64].fetch_or(1 << (i % 64), Ordering::Relaxed);
        self.commit();
        Ok(())
    }

    /// Publishes the record: every byte written so far becomes visible before the bit.
    fn commit(mut self) {
        fence(Ordering::Release);
        self.cache.publish(self.cache.layout.filled, self.index);
        self.published = true;
    }

    /// Marks the sample as a bad file of `kind`, so later epochs skip it without reading it.
    /// Only verdicts on the file's contents are kept: a file that could not be opened or
    /// read ([`BadFileKind::Unreadable`]) may be fine on the next run without any change to
    /// its size or times, so that kind only releases the claim.
    pub(crate) fn mark_bad(mut self, kind: BadFileKind) {
        if kind == BadFileKind::Unreadable {
            return;
        }
        self.cache
            .check_word(self.index)
            .store(bad_tag(self.index, kind), Ordering::Relaxed);
        self.cache.publish(self.cache.layout.bad, self.index);
        self.published = true;
    }
}

impl Drop for RecordWriter<'_> {
    /// An abandoned claim (error, panic) is released so a later epoch can fill the record.
    /// A published one stays claimed: the record must never be written again.
    fn drop(&mut self) {
        if !self.published {
            let bit = 1u64 << (self.index % 64);
            self.cache.claims[self.index / 64].fetch_and(!bit, Ordering::AcqRel);
        }
    }
}

/// Test-only fault injection: record writes to a given cache file fail with ENOSPC after a
/// number of successes, as on a disk that fills up mid-epoch; opening it for writing fails as
/// on a read-only mount; mapping it fails as under a low `ulimit -v`.
#[cfg(test)]
pub(crate) mod faults {
    use std::path::{Path, PathBuf};
    use std::sync::Mutex;

    static PLANS: Mutex<Vec<(PathBuf, usize)>> = Mutex::new(Vec::new());

    /// Lets `successes` more record writes to `path` through, then fails every one.
    pub(crate) fn fill_disk_after(path: &Path, successes: usize) {
        let mut plans = PLANS.lock().unwrap_or_else(|p| p.into_inner());
        plans.retain(|(p, _)| p != path);
        plans.push((path.to_path_buf(), successes));
    }

    /// The disk has room again (and is writable again).
    pub(crate) fn clear(path: &Path) {
        let mut plans = PLANS.lock().unwrap_or_else(|p| p.into_inner());
        plans.retain(|(p, _)| p != path);
        let mut read_only = READ_ONLY.lock().unwrap_or_else(|p| p.into_inner());
        read_only.retain(|p| p != path);
        let mut map_fails = MAP_FAILS.lock().unwrap_or_else(|p| p.into_inner());
        map_fails.retain(|(p, _)| p != path);
    }

    static READ_ONLY: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

    static MAP_FAILS: Mutex<Vec<(PathBuf, i32)>> = Mutex::new(Vec::new());

    /// Every memory map of the cache file `path` (or of the temporary file that becomes it)
    /// fails with the OS error `errno`, as under a low `ulimit -v` (ENOMEM).
    pub(crate) fn map_fails(path: &Path, errno: i32) {
        let mut fails = MAP_FAILS.lock().unwrap_or_else(|p| p.into_inner());
        fails.retain(|(p, _)| p != path);
        fails.push((path.to_path_buf(), errno));
    }

    pub(super) fn map_check(path: &Path) -> std::io::Result<()> {
        let fails = MAP_FAILS.lock().unwrap_or_else(|p| p.into_inner());
        match fails.iter().find(|(p, _)| p == path) {
            Some((_, errno)) => Err(std::io::Error::from_raw_os_error(*errno)),
            None => Ok(()),
        }
    }

    /// Opening `path` for writing fails with EROFS, as on a read-only mount (the tests run
    /// as root, which chmod cannot stop).
    pub(crate) fn read_only(path: &Path) {
        let mut read_only = READ_ONLY.lock().unwrap_or_else(|p| p.into_inner());
        read_only.push(path.to_path_buf());
    }

    pub(super) fn deny_write(
        path: &Path,
        opened: std::io::Result<std::fs::File>,
    ) -> std::io::Result<std::fs::File> {
        let read_only = READ_ONLY.lock().unwrap_or_else(|p| p.into_inner());
        if read_only.iter().any(|p| p == path) {
            return Err(std::io::Error::from_raw_os_error(libc::EROFS));
        }
        opened
    }

    pub(super) fn check(path: &Path) -> std::io::Result<()> {
        let mut plans = PLANS.lock().unwrap_or_else(|p| p.into_inner());
        match plans.iter_mut().find(|(p, _)| p == path) {
            Some((_, 0)) => Err(std::io::Error::from_raw_os_error(libc::ENOSPC)),
            Some((_, left)) => {
                *left -= 1;
                Ok(())
            }
            None => Ok(()),
        }
    }
}
