//! Per-stage counters of the engine and the snapshot [`EngineStats`] they produce.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

/// A snapshot of the engine's counters since the pipeline was built.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EngineStats {
    /// Images decoded and resized (cache misses).
    pub decoded: u64,
    /// Images served from the cache.
    pub cache_hits: u64,
    /// Bad files met (scan time and decode time), each counted once.
    pub bad_files: u64,
    /// Batches handed to consumers.
    pub batches: u64,
    /// Seconds decode workers spent reading, decoding and resizing, summed over workers.
    pub decode_seconds: f64,
    /// Seconds decode workers spent on what follows the cache: cutting crops, scaling from
    /// the stored side and jittering colours, summed over workers (0 when there is nothing
    /// to do but copy).
    pub transform_seconds: f64,
    /// Decode-stage throughput: decoded images per second of one worker's busy time, times
    /// the number of workers.
    pub decode_images_per_sec: f64,
    /// Seconds consumers spent blocked waiting for a batch.
    pub consumer_wait_seconds: f64,
    /// Jobs waiting in the decode queue right now, over its capacity (0..=1).
    pub decode_queue_fill: f64,
    /// Finished batches waiting for consumers right now, over the prefetch capacity (0..=1).
    pub ready_queue_fill: f64,
    /// Records in the cache that are filled or known bad, over the split's samples (0..=1).
    pub cache_fill: f64,
    /// Seconds since the pipeline was built.
    pub elapsed_seconds: f64,
}

/// What went wrong with the pixel cache in this process; the engine served every image
/// regardless (damaged records and unwritable ones are decoded instead).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CacheHealth {
    /// Records that failed verification (a damaged cache file) and were decoded again.
    pub damaged_records: u64,
    /// Record writes that failed (a full disk); after the first, no more are tried.
    pub write_failures: u64,
}

/// The live counters, updated by workers, assemblers and iterators.
#[derive(Debug)]
pub(crate) struct Counters {
    pub(crate) decoded: AtomicU64,
    pub(crate) cache_hits: AtomicU64,
    pub(crate) bad_files: AtomicU64,
    pub(crate) batches: AtomicU64,
    pub(crate) decode_nanos: AtomicU64,
    pub(crate) transform_nanos: AtomicU64,
    pub(crate) wait_nanos: AtomicU64,
    pub(crate) ready_batches: AtomicUsize,
    pub(crate) ready_capacity: AtomicUsize,
    pub(crate) started: Instant,
}

impl Counters {
    pub(crate) fn new() -> Self {
        Self {
            decoded: AtomicU64::new(0),
            cache_hits: AtomicU64::new(0),
            bad_files: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            decode_nanos: AtomicU64::new(0),
            transform_nanos: AtomicU64::new(0),
            wait_nanos: AtomicU64::new(0),
            ready_batches: AtomicUsize::new(0),
            ready_capacity: AtomicUsize::new(0),
            started: Instant::now(),
        }
    }

    pub(crate) fn add_nanos(counter: &AtomicU64, since: Instant) {
        let nanos = u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX);
        counter.fetch_add(nanos, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(
        &self,
        workers: usize,
        queue: (usize, usize),
        cache_fill: f64,
    ) -> EngineStats {
        let decoded = self.decoded.load(Ordering::Relaxed);
        let decode_seconds = self.decode_nanos.load(Ordering::Relaxed) as f64 * 1e-9;
        let ready_cap = self.ready_capacity.load(Ordering::Relaxed);
        EngineStats {
            decoded,
            cache_hits: self.cache_hits.load(Ordering::Relaxed),
            bad_files: self.bad_files.load(Ordering::Relaxed),
            batches: self.batches.load(Ordering::Relaxed),
            decode_seconds,
            transform_seconds: self.transform_nanos.load(Ordering::Relaxed) as f64 * 1e-9,
            decode_images_per_sec: if decode_seconds > 0.0 {
                decoded as f64 / decode_seconds * workers as f64
            } else {
                0.0
            },
            consumer_wait_seconds: self.wait_nanos.load(Ordering::Relaxed) as f64 * 1e-9,
            decode_queue_fill: if queue.1 > 0 {
                queue.0 as f64 / queue.1 as f64
            } else {
                0.0
            },
            ready_queue_fill: if ready_cap > 0 {
                (self.ready_batches.load(Ordering::Relaxed) as f64 / ready_cap as f64).min(1.0)
            } else {
                0.0
            },
            cache_fill,
            elapsed_seconds: self.started.elapsed().as_secs_f64(),
        }
    }
}
