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
//! | after it      | claims bitmap: a record's bit is taken by the one process that |
//! |               | writes it (see "Several processes fill one file")             |
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
//! filler touches through the map is allocated by an ordinary write when the file is made,
//! so a full disk surfaces as an error value, never as a SIGBUS; records are written with
//! positioned writes for the same reason.
//!
//! **Never serve a torn record.** A filler writes the pixels of record `i` straight into the
//! file, then its source hash and check, then sets bit `i` with release ordering; readers test
//! the bit with acquire ordering. A process killed mid-write leaves its page cache intact, so
//! set bits are exact for any later process of the same boot. A crash of the machine is
//! different (pages may reach the disk in any order), so the header carries a state:
//! `filling` with the fillers' boot id (bits are trusted only within that boot), `synced` (the
//! whole map was flushed before this state was written, so bits are durable) or `complete`
//! (every record resolved and flushed).
//!
//! **Several processes fill one file** (the ranks of one node, or loaders sharing a cache
//! folder), each the records of its own samples, so a node's ranks fill it in one epoch. They
//! are processes of one machine (one boot id, one page cache), and hold these locks (flock(2)
//! on the cache file; its locks belong to each open file description, so two pipelines of one
//! process are two fillers to each other):
//! - Every filler holds a shared lock for as long as it has the file open.
//! - A missing file is built in a temporary file, under our shared lock, and hard-linked into
//!   place, which fails when another process created the file first: that process's file is
//!   then opened. A file is created once.
//! - Only a process that gets the exclusive lock without waiting (no other process has the file
//!   open) judges the file as a whole (header, map checksum, state and boot id), frees the
//!   claims of records never published (their claimants are gone) and resumes it, then holds
//!   the shared lock; or rebuilds it: a fresh temporary file renamed over the old one while the
//!   old one is still locked. Any other process waits for a shared lock (a process holds the
//!   file alone only for such a moment), checks that the path still names the file it locked
//!   (after a rebuild it starts over) and joins it, checking the header only (the map checksum
//!   is stale while others fill). A header that does not fit its key (another view of the
//!   dataset) is not its to rebuild while others fill: it decodes in memory. So a file is never
//!   replaced under its fillers. (An engine of format 6 or older held its file alone for its
//!   whole run: after a minute's wait the open gives up and decodes without the cache.)
//! - A worker claims a record in its process (in memory) before decoding it, so two workers
//!   never both decode it for the cache; then, with the pixels ready, in the file: one atomic
//!   `fetch_or` on the mapped claims word, so of all processes exactly one sees the bit clear,
//!   and only that one writes the record. Another process that decoded the same image (ranks of
//!   different world sizes, a bad split, a balanced sampler's repeat) serves its own pixels and
//!   writes nothing, so no record is ever written by two processes at once. A claim stays set
//!   while its record is resolved; a failed write releases it; a damaged record loses its bit,
//!   then its claim, so any process may rewrite it. A process killed between claim and publish
//!   leaves a claim without its bit: nobody serves those bytes, nobody writes the record while
//!   the file has fillers, and the next process to have the file alone frees the claim (claims
//!   are outside the map checksum).
//! - A record another process published is served once its xxh3 is verified, the first time
//!   this process serves it, as any record found at open; a process trusts its own writes.
//! - Every filler writes state `filling` and its boot id (the same bytes from every filler of
//!   one machine) before its first change. When it drops the cache it flushes its map, lets go
//!   of its lock, then tries the exclusive lock without waiting: the one that gets it has the
//!   file alone, so every other filler flushed and left, and it seals the file: `complete` or
//!   `synced` with the map checksum, then flushes the header. Of fillers leaving at once, the
//!   last always gets it (each lets go before trying). If every filler is killed, the state
//!   stays `filling`: resumed in this boot, rebuilt after a reboot.
//!
//! A file that cannot be opened for writing (a read-only place) is served as it is when it is
//! valid, without a lock: no process rewrites a file in place.
//!
//! The files: `format` (the header's fields, the [`Layout`] of the regions, the checks and
//! checksums), `key` (what a file must have been made for), `validate` (what an existing
//! header says), `open` (creating, resuming, rebuilding, joining, read-only or no cache),
//! `writer` (claiming, writing and publishing a record), `file` (error values, the locks, the
//! mapping check) and, in tests, `faults` and `tests` (several handles on one file); this file
//! holds the open cache, serves its records and seals it.

mod file;
mod format;
mod key;
mod open;
mod validate;
mod writer;

#[cfg(test)]
pub(crate) mod faults;
#[cfg(test)]
mod tests;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

use memmap2::{Mmap, MmapMut};

use crate::BadFileKind;

use format::*;

pub(crate) use key::CacheKey;

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

/// An open cache file (a filler, or read-only).
pub(crate) struct Cache {
    path: PathBuf,
    // Kept open: as a filler, its lock lives as long as this handle; records are written
    // through it (see `RecordWriter::write_and_commit`). `None` for a disabled cache.
    file: Option<File>,
    map: Map,
    base: *mut u8,
    layout: Layout,
    writable: bool,
    /// Records a worker of this process decodes to write, so two workers of this process
    /// never both decode one for the cache (the file's claims bitmap is taken at the write).
    in_flight: Vec<AtomicU64>,
    /// Records whose check this process has verified (or written).
    verified: Vec<AtomicU64>,
    /// Records this process found damaged and cannot rewrite (read-only): decoded each time.
    rejected: Vec<AtomicU64>,
    /// Whether the header says `filling` for this boot (required before any write).
    filling: AtomicBool,
    state_lock: Mutex<()>,
    damage_warned: AtomicBool,
    damaged: AtomicU64,
    write_failed: AtomicBool,
    write_failures: AtomicU64,
}

// SAFETY: the raw base pointer refers to the map owned by this struct. Shared access is
// coordinated by the atomic bitmaps: a record is written only by the worker whose process
// holds its bit in the file's claims bitmap, and read only after its filled bit is published
// (release/acquire), see the module docs.
unsafe impl Send for Cache {}
unsafe impl Sync for Cache {}

impl Cache {
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
            // SAFETY: offsets inside the header page of our writable map, the state word
            // 4-aligned. Other fillers may store the same values (state `filling`, this
            // boot's id: identical bytes); only a process holding the file alone writes
            // another state (see `Drop`).
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

    /// Records that are filled or known bad, by this process or any other filling the file.
    pub(crate) fn resolved(&self) -> usize {
        (0..self.layout.count.div_ceil(64))
            .map(|w| (self.resolved_word(w) & self.valid_bits(w)).count_ones() as usize)
            .sum()
    }

    /// The filled and bad bits of bitmap word `w`.
    fn resolved_word(&self, w: usize) -> u64 {
        self.word(self.layout.filled, w).load(Ordering::Acquire)
            | self.word(self.layout.bad, w).load(Ordering::Acquire)
    }

    /// The bits of bitmap word `w` that stand for records (the last word's others mean
    /// nothing and are never set by a filler).
    fn valid_bits(&self, w: usize) -> u64 {
        let valid = self.layout.count - 64 * w;
        if valid >= 64 {
            !0
        } else {
            (1u64 << valid) - 1
        }
    }

    /// Frees the claims of records that were never published: called by a process that has
    /// the file alone, so their claimants are gone (killed between claim and publish).
    fn drop_stale_claims(&self) {
        if !self.writable() {
            return;
        }
        for w in 0..self.layout.count.div_ceil(64) {
            let stale =
                self.word(self.layout.claims, w).load(Ordering::Relaxed) & !self.resolved_word(w);
            if stale != 0 {
                self.word(self.layout.claims, w)
                    .fetch_and(!stale, Ordering::Relaxed);
            }
        }
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
    /// A record whose check fails is reported once and treated as not cached (a filler then
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
            // SAFETY: the filled bit was observed with acquire ordering after the filler's
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

    /// A record failed its check: warn once per process, and forget it (a filler clears its
    /// bit, then its claim, so it is decoded and rewritten by whichever process claims it
    /// next; read-only, it decodes it each time).
    fn damage(&self, i: usize, region: usize, why: &str) {
        let bit = 1u64 << (i % 64);
        let counted = if self.writable() {
            self.begin_writes();
            let was = self.word(region, i / 64).fetch_and(!bit, Ordering::AcqRel);
            if was & bit != 0 {
                self.word(self.layout.claims, i / 64)
                    .fetch_and(!bit, Ordering::AcqRel);
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
        self.word(region, i / 64)
            .fetch_or(1 << (i % 64), Ordering::Release);
    }
}

impl Drop for Cache {
    /// Flushes the map and lets go of the file; the last filler to let go (the one that then
    /// gets the file alone) records how far the cache got, with the map checksum, so another
    /// boot can trust it. Letting go before trying for the exclusive lock means that of
    /// fillers leaving at once, the last always gets it.
    fn drop(&mut self) {
        let layout = self.layout;
        let quiet = self.write_failed.load(Ordering::Relaxed);
        let (Map::Write(map), Some(file)) = (&mut self.map, &self.file) else {
            return;
        };
        if layout.count == 0 || map.flush().is_err() {
            return;
        }
        if file::unlock(file).is_err() || !file::try_lock_exclusive(file).unwrap_or(false) {
            // Others still fill it: the last of them seals it.
            return;
        }
        // Alone: every other filler flushed its writes before letting go (the flush above
        // then costs nothing for pages already clean).
        if map.flush().is_err() {
            return;
        }
        let resolved: usize = (0..layout.count.div_ceil(64))
            .map(|w| {
                let valid = layout.count - 64 * w;
                let mask = if valid >= 64 { !0 } else { (1u64 << valid) - 1 };
                let word = |region: usize| read_u64(map, region + 8 * w);
                ((word(layout.filled) | word(layout.bad)) & mask).count_ones() as usize
            })
            .sum();
        let state = if resolved == layout.count {
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
