//! What the engine knows of each file of a split beyond its name: its size and times as the
//! scan found them, and a hash of its bytes once they were read.
//!
//! The engine reads every file's bytes the first time it decodes it, so it hashes them there
//! (xxh3, a few GB/s: nothing next to the decode), and the cache keeps the hash beside the
//! record, so a warm epoch, which reads no file, still knows it. A trainer records these
//! with its run and, at a resume, reads again only the files whose size or times changed,
//! to tell a file whose contents changed from one that was only touched or copied.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// Seeds the content hash, so it is never mistaken for another xxh3 of the same bytes.
const CONTENT_SEED: u64 = 0x6669_6c65_6279_7465;

/// The content hash of a file's bytes: xxh3-64, never 0 (0 stands for "not known").
pub fn content_hash(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(bytes, CONTENT_SEED).max(1)
}

/// Reads the file at `path` whole and returns its [`content_hash`].
pub fn hash_file(path: &Path) -> std::io::Result<u64> {
    std::fs::read(path).map(|bytes| content_hash(&bytes))
}

/// One file of a split as the engine knows it (see [`Pipeline::files`](crate::Pipeline::files)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileState {
    /// Bytes, at the scan.
    pub size: u64,
    /// Modification time, nanoseconds since the epoch, at the scan (0 where unknown).
    pub mtime_ns: u64,
    /// Status-change time, nanoseconds since the epoch, at the scan (0 where unknown). Not
    /// part of any identity (a copy of the data elsewhere has others): only a sign that the
    /// file may have been replaced, e.g. by a rename that kept its mtime.
    pub ctime_ns: i64,
    /// Inode number at the scan (0 where unknown); a sign of replacement, like `ctime_ns`.
    pub inode: u64,
    /// The [`content_hash`] of its bytes, when this engine or its cache has read them.
    pub content: Option<u64>,
}

impl FileState {
    /// Whether the file may have changed since `then` was taken of it: another size, mtime,
    /// status-change time or inode. (Equal ones say nothing changed short of a write that put
    /// every one of them back, which no ordinary tool does.)
    pub fn may_differ_from(&self, then: &FileState) -> bool {
        (self.size, self.mtime_ns, self.ctime_ns, self.inode)
            != (then.size, then.mtime_ns, then.ctime_ns, then.inode)
    }
}

/// The content hashes known so far, one slot per sample (0: not known).
pub(crate) struct Contents {
    slots: Vec<AtomicU64>,
}

impl Contents {
    pub(crate) fn new(count: usize) -> Self {
        Self {
            slots: (0..count).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Records sample `i`'s hash, unless one is known already (one load on a warm epoch).
    pub(crate) fn note(&self, i: usize, hash: u64) {
        if let Some(slot) = self.slots.get(i) {
            if slot.load(Ordering::Relaxed) == 0 {
                slot.store(hash, Ordering::Relaxed);
            }
        }
    }

    /// Sample `i`'s hash, when known.
    pub(crate) fn get(&self, i: usize) -> Option<u64> {
        self.slots
            .get(i)
            .map(|s| s.load(Ordering::Relaxed))
            .filter(|&h| h != 0)
    }
}
