//! The memory-mapped record cache: one file per dataset split and resize setting.
//!
//! Layout (little endian):
//!
//! | offset        | content                                                        |
//! |---------------|----------------------------------------------------------------|
//! | 0             | header: magic, version, state, image size, channels, count,   |
//! |               | fingerprint, record bytes, boot id (4096 bytes reserved)       |
//! | 4096          | labels: `count × u32`                                          |
//! | 8-aligned     | filled-records bitmap: `⌈count/64⌉ × u64`                      |
//! | after it      | bad-records bitmap (files that failed to decode), same size    |
//! | 4096-aligned  | records: `count × S·S·3` u8, NHWC RGB                          |
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
use std::sync::atomic::{fence, AtomicU64, AtomicUsize, Ordering};

use memmap2::{Mmap, MmapMut, MmapOptions};

use crate::PipelineError;

const MAGIC: &[u8; 8] = b"BRDCACHE";
const VERSION: u32 = 1;
const HEADER_BYTES: usize = 4096;
const STATE_FILLING: u32 = 1;
const STATE_COMPLETE: u32 = 2;
const STATE_SYNCED: u32 = 3;
const OFF_STATE: usize = 12;
const OFF_BOOT: usize = 48;
const BOOT_LEN: usize = 36;

/// Where each region lives for a given record count and size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Layout {
    count: usize,
    record_bytes: usize,
    labels: usize,
    filled: usize,
    bad: usize,
    records: usize,
    total: usize,
}

impl Layout {
    fn new(count: usize, record_bytes: usize) -> Self {
        let words = count.div_ceil(64);
        let labels = HEADER_BYTES;
        let filled = (labels + 4 * count).next_multiple_of(8);
        let bad = filled + 8 * words;
        let records = (bad + 8 * words).next_multiple_of(4096);
        Self {
            count,
            record_bytes,
            labels,
            filled,
            bad,
            records,
            total: records + count * record_bytes,
        }
    }
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
    /// No usable mapping (a read-only handle on a file of the wrong size).
    None,
}

/// An open cache file (writer or read-only).
pub(crate) struct Cache {
    path: PathBuf,
    // Kept open: as the writer, its lock lives as long as this handle; records are written
    // through it (see `RecordWriter::write_and_commit`).
    file: File,
    map: Map,
    base: *mut u8,
    layout: Layout,
    writable: bool,
    /// In-memory claims, so two workers of this process never write one record at once.
    claims: Vec<AtomicU64>,
    resolved: AtomicUsize,
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
    Rebuild,
}

fn judge(bytes: &[u8], key: &CacheKey, layout: &Layout, file_len: u64) -> Verdict {
    if file_len != layout.total as u64 || bytes.len() < HEADER_BYTES || &bytes[0..8] != MAGIC {
        return Verdict::Rebuild;
    }
    let same = read_u32(bytes, 8) == VERSION
        && read_u32(bytes, 16) == key.image_size
        && read_u32(bytes, 20) == 3
        && read_u64(bytes, 24) == key.count as u64
        && read_u64(bytes, 32) == key.fingerprint
        && read_u64(bytes, 40) == layout.record_bytes as u64;
    if !same {
        return Verdict::Rebuild;
    }
    match read_u32(bytes, OFF_STATE) {
        STATE_COMPLETE => Verdict::Complete,
        STATE_SYNCED => Verdict::Resumable,
        STATE_FILLING => {
            let same_boot =
                current_boot_id().is_some_and(|id| bytes[OFF_BOOT..OFF_BOOT + BOOT_LEN] == id[..]);
            if same_boot {
                Verdict::Resumable
            } else {
                Verdict::Rebuild
            }
        }
        _ => Verdict::Rebuild,
    }
}

impl Cache {
    /// Opens (resuming, or rebuilding) the cache at `path` for `key`, with `labels` per record.
    pub(crate) fn open(path: &Path, key: CacheKey, labels: &[u32]) -> Result<Self, PipelineError> {
        let layout = Layout::new(
            key.count,
            key.image_size as usize * key.image_size as usize * 3,
        );
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io_err(dir, "creating the cache directory"))?;
        }
        match OpenOptions::new().read(true).write(true).open(path) {
            Ok(file) => match try_lock(&file) {
                Ok(true) => {
                    let len = file.metadata().map_err(io_err(path, "stat"))?.len();
                    if len != layout.total as u64 {
                        // Truncated, or another shape: nothing in it can be trusted.
                        return Self::create(path, key, labels, layout);
                    }
                    // SAFETY: we hold the exclusive lock, so no other writer changes the file;
                    // it is only grown or replaced by rename, never truncated in place.
                    let map = unsafe { MmapOptions::new().map_mut(&file) }
                        .map_err(io_err(path, "mapping"))?;
                    match judge(&map, &key, &layout, len) {
                        Verdict::Rebuild => {
                            drop(map);
                            Self::create(path, key, labels, layout)
                        }
                        verdict => {
                            let mut cache =
                                Self::from_map(path, file, Map::Write(map), layout, true);
                            if verdict == Verdict::Resumable {
                                cache.mark_filling()?;
                            }
                            Ok(cache)
                        }
                    }
                }
                Ok(false) => Self::open_reader(path, file, key, layout),
                Err(e) => Err(io_err(path, "locking")(e)),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Self::create(path, key, labels, layout)
            }
            Err(e) => Err(io_err(path, "opening")(e)),
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
                file,
                Map::None,
                Layout { count: 0, ..layout },
                false,
            ));
        }
        // SAFETY: the writer never truncates a cache file in place (rebuilds are renamed over).
        let map = unsafe { MmapOptions::new().map(&file) }.map_err(io_err(path, "mapping"))?;
        let usable = len == layout.total as u64
            && map.len() >= HEADER_BYTES
            && &map[0..8] == MAGIC
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
        Ok(Self::from_map(path, file, Map::Read(map), layout, false))
    }

    /// Builds a fresh cache in a temporary file and renames it into place.
    fn create(
        path: &Path,
        key: CacheKey,
        labels: &[u32],
        layout: Layout,
    ) -> Result<Self, PipelineError> {
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
            .map_err(io_err(&tmp, "creating"))?;
        if !try_lock(&file).map_err(io_err(&tmp, "locking"))? {
            return Err(io_err(&tmp, "locking")(std::io::Error::other(
                "a brand-new temporary file is locked by someone else",
            )));
        }
        file.set_len(layout.total as u64)
            .map_err(io_err(&tmp, "sizing"))?;
        // SAFETY: a file only this process knows about yet, locked by us.
        let mut map =
            unsafe { MmapOptions::new().map_mut(&file) }.map_err(io_err(&tmp, "mapping"))?;
        map[0..8].copy_from_slice(MAGIC);
        map[8..12].copy_from_slice(&VERSION.to_le_bytes());
        map[12..16].copy_from_slice(&STATE_FILLING.to_le_bytes());
        map[16..20].copy_from_slice(&key.image_size.to_le_bytes());
        map[20..24].copy_from_slice(&3u32.to_le_bytes());
        map[24..32].copy_from_slice(&(key.count as u64).to_le_bytes());
        map[32..40].copy_from_slice(&key.fingerprint.to_le_bytes());
        map[40..48].copy_from_slice(&(layout.record_bytes as u64).to_le_bytes());
        if let Some(id) = current_boot_id() {
            map[OFF_BOOT..OFF_BOOT + BOOT_LEN].copy_from_slice(&id);
        }
        for (i, label) in labels.iter().enumerate() {
            let at = layout.labels + 4 * i;
            map[at..at + 4].copy_from_slice(&label.to_le_bytes());
        }
        map.flush_range(0, layout.records)
            .map_err(io_err(&tmp, "flushing the header"))?;
        std::fs::rename(&tmp, path).map_err(io_err(path, "renaming the new cache into place"))?;
        Ok(Self::from_map(path, file, Map::Write(map), layout, true))
    }

    fn from_map(path: &Path, file: File, mut map: Map, layout: Layout, writable: bool) -> Self {
        let base = match &mut map {
            Map::Write(m) => m.as_mut_ptr(),
            Map::Read(m) => m.as_ptr().cast_mut(),
            Map::None => std::ptr::NonNull::<u64>::dangling().as_ptr().cast(),
        };
        let words = layout.count.div_ceil(64);
        let cache = Self {
            path: path.to_path_buf(),
            file,
            map,
            base,
            layout,
            writable,
            claims: (0..words).map(|_| AtomicU64::new(0)).collect(),
            resolved: AtomicUsize::new(0),
        };
        let resolved = (0..words)
            .map(|w| {
                (cache.word(cache.layout.filled, w).load(Ordering::Acquire)
                    | cache.word(cache.layout.bad, w).load(Ordering::Acquire))
                .count_ones() as usize
            })
            .sum();
        cache.resolved.store(resolved, Ordering::Relaxed);
        cache
    }

    /// Marks a resumed cache as being filled by this boot, durably, before any record is written.
    fn mark_filling(&mut self) -> Result<(), PipelineError> {
        if let Map::Write(map) = &mut self.map {
            map[OFF_STATE..OFF_STATE + 4].copy_from_slice(&STATE_FILLING.to_le_bytes());
            if let Some(id) = current_boot_id() {
                map[OFF_BOOT..OFF_BOOT + BOOT_LEN].copy_from_slice(&id);
            }
            map.flush_range(0, HEADER_BYTES)
                .map_err(io_err(&self.path, "flushing the header"))?;
        }
        Ok(())
    }

    fn word(&self, region: usize, w: usize) -> &AtomicU64 {
        debug_assert!(w < self.layout.count.div_ceil(64));
        // SAFETY: region offsets are multiples of 8 inside the page-aligned map, so the word is
        // aligned and in bounds; the map outlives `self`.
        unsafe { &*(self.base.add(region + 8 * w) as *const AtomicU64) }
    }

    /// The cache file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Whether this handle may write records.
    pub(crate) fn writable(&self) -> bool {
        self.writable && self.layout.count > 0
    }

    /// Whether record `i` is fully written and may be read.
    pub(crate) fn is_filled(&self, i: usize) -> bool {
        i < self.layout.count
            && self
                .word(self.layout.filled, i / 64)
                .load(Ordering::Acquire)
                & (1 << (i % 64))
                != 0
    }

    /// Whether sample `i` is known to be a bad file.
    pub(crate) fn is_bad(&self, i: usize) -> bool {
        i < self.layout.count
            && self.word(self.layout.bad, i / 64).load(Ordering::Acquire) & (1 << (i % 64)) != 0
    }

    /// Records that are filled or known bad.
    pub(crate) fn resolved(&self) -> usize {
        self.resolved.load(Ordering::Relaxed)
    }

    /// The pixels of a filled record.
    pub(crate) fn record(&self, i: usize) -> Option<&[u8]> {
        if !self.is_filled(i) {
            return None;
        }
        let at = self.layout.records + i * self.layout.record_bytes;
        // SAFETY: the filled bit was observed with acquire ordering after the writer's release,
        // and a filled record is never written again; the range is inside the map.
        Some(unsafe { std::slice::from_raw_parts(self.base.add(at), self.layout.record_bytes) })
    }

    /// Claims record `i` for writing; `None` if it is filled, bad, claimed, or read-only.
    pub(crate) fn claim(&self, i: usize) -> Option<RecordWriter<'_>> {
        if !self.writable() || self.is_filled(i) || self.is_bad(i) {
            return None;
        }
        let bit = 1u64 << (i % 64);
        if self.claims[i / 64].fetch_or(bit, Ordering::AcqRel) & bit != 0 {
            return None;
        }
        Some(RecordWriter {
            cache: self,
            index: i,
            published: false,
        })
    }

    fn publish(&self, region: usize, i: usize) {
        let bit = 1u64 << (i % 64);
        if self.word(region, i / 64).fetch_or(bit, Ordering::Release) & bit == 0 {
            self.resolved.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Drop for Cache {
    /// Flushes the map and records how far the cache got, so another boot can trust it.
    fn drop(&mut self) {
        let complete = self.resolved() == self.layout.count;
        if let Map::Write(map) = &mut self.map {
            if self.layout.count == 0 || map.flush().is_err() {
                return;
            }
            let state = if complete {
                STATE_COMPLETE
            } else {
                STATE_SYNCED
            };
            map[OFF_STATE..OFF_STATE + 4].copy_from_slice(&state.to_le_bytes());
            if let Err(e) = map.flush_range(0, HEADER_BYTES) {
                tracing::warn!(
                    "cache {}: flushing the header failed: {e}",
                    self.path.display()
                );
            }
        }
    }
}

/// Exclusive write access to one record, published on [`RecordWriter::commit`].
pub(crate) struct RecordWriter<'a> {
    cache: &'a Cache,
    index: usize,
    published: bool,
}

impl RecordWriter<'_> {
    /// Writes the whole record with one positioned write, then publishes it. Writing through
    /// the file rather than the shared map spares a page fault per page of a fresh record
    /// (about 8 % of a first epoch); the kernel keeps the map coherent with the file's page
    /// cache, so readers see the bytes through the map once the bit is published. On an error
    /// nothing is published and the claim is released (a later pass decodes the image again).
    pub(crate) fn write_and_commit(self, pixels: &[u8]) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let bytes = self.cache.layout.record_bytes;
        if pixels.len() != bytes {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("record of {} bytes, expected {bytes}", pixels.len()),
            ));
        }
        let at = self.cache.layout.records + self.index * bytes;
        self.cache.file.write_all_at(pixels, at as u64)?;
        self.commit();
        Ok(())
    }

    /// Publishes the record: every byte written so far becomes visible before the bit.
    fn commit(mut self) {
        fence(Ordering::Release);
        self.cache.publish(self.cache.layout.filled, self.index);
        self.published = true;
    }

    /// Marks the sample as a bad file, so later epochs skip it without reading it.
    pub(crate) fn mark_bad(mut self) {
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
