//! Several handles on one cache file, as several processes hold it (flock locks belong to
//! each open file description, so two handles of one process are two fillers to each other).

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Barrier};

use super::format::{read_u32, Layout, STATE_COMPLETE, STATE_FILLING, STATE_SYNCED, VERSION};
use super::{Cache, CacheKey, Lookup};

const COUNT: usize = 100;
const SIDE: u32 = 4;

fn key(fingerprint: u64) -> CacheKey {
    CacheKey {
        image_size: SIDE,
        count: COUNT,
        fingerprint,
    }
}

fn labels() -> Vec<u32> {
    (0..COUNT as u32).map(|i| i % 3).collect()
}

fn open(path: &Path) -> Cache {
    Cache::open(path, key(7), &labels()).unwrap()
}

fn layout() -> Layout {
    Layout::new(COUNT, (SIDE * SIDE * 3) as usize)
}

/// The pixels record `i` decodes to, `salt` 0; another salt stands for another decode.
fn pixels(i: usize, salt: u8) -> Vec<u8> {
    (0..layout().record_bytes)
        .map(|j| (i as u8).wrapping_mul(31) ^ j as u8 ^ salt)
        .collect()
}

fn fill(cache: &Cache, records: impl Iterator<Item = usize>) {
    for i in records {
        let writer = cache.claim(i).expect("an unresolved record can be claimed");
        writer
            .write_and_commit(&pixels(i, 0), i as u64 + 1)
            .unwrap();
    }
}

fn state(path: &Path) -> u32 {
    read_u32(&std::fs::read(path).unwrap(), 12)
}

fn hit(cache: &Cache, i: usize) -> Vec<u8> {
    match cache.lookup(i) {
        Lookup::Hit(px) => px.to_vec(),
        other => panic!("record {i}: {other:?}"),
    }
}

fn temp_cache() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("train.bcache");
    (dir, path)
}

#[test]
fn two_fillers_fill_disjoint_records_and_the_last_to_let_go_seals_the_file() {
    let (_dir, path) = temp_cache();
    let a = open(&path);
    let b = open(&path);
    assert!(a.writable() && b.writable(), "both fill the file");
    fill(&a, (0..COUNT).step_by(2));
    fill(&b, (1..COUNT).step_by(2));
    // Each sees the other's records, verified on first serve.
    assert_eq!(a.resolved(), COUNT);
    assert_eq!(b.resolved(), COUNT);
    assert_eq!(hit(&a, 1), pixels(1, 0));
    assert_eq!(hit(&b, 0), pixels(0, 0));
    drop(a);
    assert_eq!(
        state(&path),
        STATE_FILLING,
        "b still fills it: nobody seals yet"
    );
    drop(b);
    assert_eq!(state(&path), STATE_COMPLETE, "the last to let go seals it");
    // A later open judges it whole (the map checksum holds) and serves every record.
    let c = open(&path);
    assert_eq!(c.resolved(), COUNT);
    for i in 0..COUNT {
        assert_eq!(hit(&c, i), pixels(i, 0));
    }
    assert_eq!(c.damaged(), 0);
}

#[test]
fn a_record_two_fillers_decoded_is_written_by_the_first_claim_only() {
    let (_dir, path) = temp_cache();
    let a = open(&path);
    let b = open(&path);
    // Both decoded record 3 (each holds its own process's claim); `b`'s decode differs, so
    // a write of it would show.
    let (wa, wb) = (a.claim(3).unwrap(), b.claim(3).unwrap());
    wa.write_and_commit(&pixels(3, 0), 4).unwrap();
    wb.write_and_commit(&pixels(3, 0xFF), 4).unwrap();
    assert_eq!(hit(&b, 3), pixels(3, 0), "b's bytes were never written");
    assert_eq!(hit(&a, 3), pixels(3, 0));
    // While `a` holds record 4's claim in the file (between its claim and its publish),
    // `b` writes nothing.
    assert!(a.claim_in_file(4));
    b.claim(4)
        .unwrap()
        .write_and_commit(&pixels(4, 0xFF), 5)
        .unwrap();
    assert!(
        matches!(b.lookup(4), Lookup::Miss),
        "nothing published by b"
    );
    // `a`'s write failed: it releases its claim, and `b` may write the record.
    a.word(a.layout.claims, 0)
        .fetch_and(!(1 << 4), Ordering::AcqRel);
    fill(&b, 4..5);
    assert_eq!(hit(&a, 4), pixels(4, 0));
    // A bad mark is claimed the same way.
    let (wa, wb) = (a.claim(5).unwrap(), b.claim(5).unwrap());
    wa.mark_bad(crate::BadFileKind::Empty);
    wb.write_and_commit(&pixels(5, 0), 6).unwrap();
    assert_eq!(b.bad_kind(5), Some(crate::BadFileKind::Empty));
}

#[test]
fn a_filler_killed_mid_write_leaves_a_claimed_torn_record_nobody_serves() {
    let (_dir, path) = temp_cache();
    let layout = layout();
    let a = open(&path);
    fill(&a, 0..10);
    // What a filler killed between its claim and its publish leaves: record 10's claim
    // taken, half its pixels written, its filled bit clear, its lock gone with it.
    let raw = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let half = &pixels(10, 0)[..layout.record_bytes / 2];
    raw.write_all_at(half, (layout.records + 10 * layout.record_bytes) as u64)
        .unwrap();
    raw.write_all_at(&(1u64 << 10).to_le_bytes(), layout.claims as u64)
        .unwrap();
    drop(raw);
    // The survivor never serves the torn record, and cannot write it while attached.
    assert!(matches!(a.lookup(10), Lookup::Miss));
    a.claim(10)
        .unwrap()
        .write_and_commit(&pixels(10, 0), 11)
        .unwrap();
    assert!(matches!(a.lookup(10), Lookup::Miss));
    fill(&a, 11..COUNT);
    drop(a);
    assert_eq!(state(&path), STATE_SYNCED, "one record short of complete");
    // The next process to have the file alone frees the stale claim and fills the record.
    let b = open(&path);
    assert!(matches!(b.lookup(10), Lookup::Miss));
    fill(&b, 10..11);
    assert_eq!(hit(&b, 10), pixels(10, 0));
    assert_eq!(b.resolved(), COUNT);
    drop(b);
    assert_eq!(state(&path), STATE_COMPLETE);
}

#[test]
fn processes_opening_a_missing_file_at_once_create_it_once_and_share_it() {
    let (dir, path) = temp_cache();
    let fillers = 4;
    let start = Arc::new(Barrier::new(fillers));
    let caches: Vec<Cache> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..fillers)
            .map(|_| {
                let (start, path) = (Arc::clone(&start), path.clone());
                s.spawn(move || {
                    start.wait();
                    open(&path)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (t, cache) in caches.iter().enumerate() {
        assert!(cache.writable());
        fill(cache, (t..COUNT).step_by(fillers));
    }
    for cache in &caches {
        assert_eq!(cache.resolved(), COUNT, "every filler maps the one file");
    }
    drop(caches);
    assert_eq!(state(&path), STATE_COMPLETE);
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["train.bcache"], "no temporary file left");
}

#[test]
fn a_file_in_use_is_never_rebuilt_under_its_fillers() {
    let (_dir, path) = temp_cache();
    let inode =
        |path: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(path).unwrap());
    let a = open(&path);
    fill(&a, 0..5);
    let before = inode(&path);
    // Another view of the dataset (another fingerprint) while `a` fills: decoded in memory.
    let other = Cache::open(&path, key(8), &labels()).unwrap();
    assert!(!other.writable());
    assert!(matches!(other.lookup(0), Lookup::Miss));
    assert_eq!(inode(&path), before, "the file in use was not replaced");
    assert_eq!(hit(&a, 0), pixels(0, 0));
    drop(other);
    drop(a);
    // Alone, it is rebuilt for the new view (a new file renamed over the old one).
    let other = Cache::open(&path, key(8), &labels()).unwrap();
    assert!(other.writable());
    assert_eq!(other.resolved(), 0);
    assert_ne!(inode(&path), before);
}

#[test]
fn a_file_of_an_older_format_version_is_rebuilt() {
    let (_dir, path) = temp_cache();
    let a = open(&path);
    fill(&a, 0..COUNT);
    drop(a);
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.write_all_at(&(VERSION - 1).to_le_bytes(), 8).unwrap();
    drop(file);
    let b = open(&path);
    assert_eq!(b.resolved(), 0, "nothing of the old file is served");
    assert_eq!(read_u32(&std::fs::read(&path).unwrap(), 8), VERSION);
}

#[test]
fn a_process_holding_the_file_alone_for_long_is_not_waited_for_forever() {
    let (_dir, path) = temp_cache();
    let a = open(&path);
    fill(&a, 0..COUNT);
    drop(a);
    // An engine of the previous format holds its file alone for its whole life.
    let old_engine = std::fs::File::open(&path).unwrap();
    assert!(super::file::try_lock_exclusive(&old_engine).unwrap());
    let start = std::time::Instant::now();
    let b = open(&path);
    assert!(start.elapsed() >= std::time::Duration::from_secs(2));
    assert!(!b.writable());
    assert!(
        matches!(b.lookup(0), Lookup::Miss),
        "decoded without the cache"
    );
    drop(b);
    drop(old_engine);
    let c = open(&path);
    assert_eq!(hit(&c, 0), pixels(0, 0), "the file was left as it was");
}
