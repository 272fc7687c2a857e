//! Feeding one GPU: engine batches → staging ring → compute, with the data wait measured.
//!
//! Per step the driver thread calls [`Feeder::next`]: it first tops the ring up (staging
//! batches k+1 … k+D−1 while their slots are free, each upload enqueued on the copy stream and
//! ordered after the compute that last read the slot), then hands batch k to compute (the
//! compute stream waits for its upload). The compute of batch k therefore overlaps the upload
//! of batch k+1. Time the host spends blocked on the engine or on a busy slot is the step's
//! *data wait*, accumulated in a [`DataWaitMeter`].
//!
//! Generic over [`StagingStreams`], so the ordering is tested on CPU with
//! [`super::SimStreams`].

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pipeline::Batch;

use super::{DataWaitMeter, ExternalBatch, StagedBatch, StagingError, StagingRing, StagingStreams};

/// Errors of the feeder: the engine's or the ring's.
#[derive(Debug, thiserror::Error)]
pub enum FeedError<E: std::error::Error + 'static> {
    /// The input engine failed.
    #[error("input engine: {0}")]
    Source(#[source] E),
    /// The staging ring failed (a CUDA error or a reuse-order bug).
    #[error("staging ring: {0}")]
    Staging(#[from] StagingError),
}

/// One replica's micro-batch as the feeder carries it: pixels in (pinned) host memory and
/// what compute needs besides them.
#[derive(Clone)]
pub struct HostBatch {
    /// `len × S × S × 3` u8 NHWC bytes, kept alive until their upload has completed.
    pub pixels: ExternalBatch,
    /// Labels of the `len` images.
    pub labels: Vec<u32>,
    /// Sample ids (for augmentation).
    pub sample_ids: Vec<u64>,
    /// Images (may be 0 on a replica that got none of a short last batch).
    pub len: usize,
    /// Side S.
    pub image_size: u32,
}

/// An engine batch as the staging ring's external buffer.
struct EngineBatch {
    /// Owns the buffer `ptr` points into; returns it to the engine's pool on drop.
    _batch: Batch,
    ptr: *const u8,
    len: usize,
}

// SAFETY: `ptr`/`len` address the pixels owned by `_batch`, which is never touched again while
// this value lives (only read through `as_ref`); moving a `Batch` between threads is allowed
// (it is `Send`), and shared access is read-only.
unsafe impl Send for EngineBatch {}
// SAFETY: as above: `&EngineBatch` only reads immutable bytes.
unsafe impl Sync for EngineBatch {}

impl AsRef<[u8]> for EngineBatch {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: see the Send impl: the bytes stay allocated and unmodified while `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl HostBatch {
    /// An engine batch, its pixels left where the engine assembled them (for a GPU: pinned
    /// memory the copy stream reads directly); the buffer returns to the engine's pool once
    /// the last clone is dropped.
    pub fn from_engine(batch: Batch) -> HostBatch {
        let pixels = batch.pixels();
        let (ptr, len) = (pixels.as_ptr(), pixels.len());
        let labels = batch.labels().to_vec();
        let sample_ids = batch.sample_ids.clone();
        let (n, image_size) = (batch.len, batch.image_size);
        HostBatch {
            pixels: Arc::new(EngineBatch {
                _batch: batch,
                ptr,
                len,
            }),
            labels,
            sample_ids,
            len: n,
            image_size,
        }
    }
}

/// One GPU's input report: `GPU 0 (rank 0): data wait 0.4 % of 120 steps (…)`.
pub fn data_wait_line(
    rank: usize,
    ordinal: usize,
    meter: &DataWaitMeter,
    staging: &super::StagingStats,
    depth: usize,
) -> String {
    let verdict = match meter.share() {
        s if s < 0.02 => "compute-bound: input keeps up",
        s if s < 0.10 => "input mostly keeps up",
        _ => "input-bound: more --workers, a warm cache or a larger --prefetch-depth",
    };
    format!(
        "GPU {ordinal} (rank {rank}): data wait {:.1} % of {:.1} s over {} steps · the GPU waited for {} of {} uploads ({:.1} ms in all) · {} host waits on a busy slot (depth {depth}) · {verdict}",
        100.0 * meter.share(),
        meter.total.as_secs_f64(),
        meter.steps,
        staging.compute_stalls,
        staging.measured,
        staging.compute_wait_time.as_secs_f64() * 1e3,
        staging.host_waits,
    )
}

impl std::fmt::Debug for HostBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBatch")
            .field("bytes", &(*self.pixels).as_ref().len())
            .field("len", &self.len)
            .finish()
    }
}

/// A batch handed to compute.
#[derive(Debug)]
pub struct Ready {
    /// Where its pixels are on the device.
    pub staged: StagedBatch,
    /// The host side (labels, ids, length).
    pub batch: HostBatch,
    /// Host time this step waited for input before compute could start.
    pub waited: Duration,
}

/// The ring of one GPU plus the batches in flight through it.
pub struct Feeder<S: StagingStreams> {
    ring: StagingRing<S>,
    in_flight: VecDeque<HostBatch>,
    source_done: bool,
    meter: DataWaitMeter,
}

impl<S: StagingStreams> Feeder<S> {
    /// Feeds through `ring`.
    pub fn new(ring: StagingRing<S>) -> Self {
        Feeder {
            ring,
            in_flight: VecDeque::new(),
            source_done: false,
            meter: DataWaitMeter::default(),
        }
    }

    /// The ring (for compute to reach the device slots).
    pub fn ring(&self) -> &StagingRing<S> {
        &self.ring
    }

    /// The ring, mutable (to measure its waits; for tests and simulators).
    pub fn ring_mut(&mut self) -> &mut StagingRing<S> {
        &mut self.ring
    }

    /// Data-wait accounting so far.
    pub fn meter(&self) -> DataWaitMeter {
        self.meter
    }

    /// Stages batches from `source` while a slot is free; `stage` enqueues one upload (usually
    /// `StagingRing::stage_external`, wrapped in trace spans on a GPU).
    fn top_up<E, I, F>(&mut self, source: &mut I, stage: &mut F) -> Result<(), FeedError<E>>
    where
        E: std::error::Error + 'static,
        I: Iterator<Item = Result<HostBatch, E>>,
        F: FnMut(&mut StagingRing<S>, ExternalBatch) -> Result<u64, StagingError>,
    {
        while !self.source_done && self.ring.can_fill() {
            match source.next() {
                None => self.source_done = true,
                Some(batch) => {
                    let batch = batch.map_err(FeedError::Source)?;
                    stage(&mut self.ring, batch.pixels.clone())?;
                    self.in_flight.push_back(batch);
                }
            }
        }
        Ok(())
    }

    /// The next batch for compute (None once the source is exhausted and every batch was
    /// computed). Call [`Feeder::done`] after the kernels that read it are enqueued.
    pub fn next<E, I, F>(
        &mut self,
        source: &mut I,
        mut stage: F,
    ) -> Result<Option<Ready>, FeedError<E>>
    where
        E: std::error::Error + 'static,
        I: Iterator<Item = Result<HostBatch, E>>,
        F: FnMut(&mut StagingRing<S>, ExternalBatch) -> Result<u64, StagingError>,
    {
        let start = Instant::now();
        self.top_up(source, &mut stage)?;
        let Some(batch) = self.in_flight.pop_front() else {
            return Ok(None);
        };
        let staged = self.ring.begin_compute()?;
        Ok(Some(Ready {
            staged,
            batch,
            waited: start.elapsed(),
        }))
    }

    /// Marks the current batch's device slot as consumed: call it once the kernels that read
    /// the slot are enqueued (the `consumed` event is recorded after them).
    pub fn done(&mut self) -> Result<(), StagingError> {
        self.ring.end_compute()
    }

    /// Records a finished step: `waited` of its `total` wall time went to input.
    pub fn record(&mut self, waited: Duration, total: Duration) {
        self.meter.record(waited, total);
    }

    /// Starts a new source (the next epoch). Every batch of the previous one must have been
    /// computed, or dropped with an interrupted epoch.
    pub fn restart(&mut self) {
        self.in_flight.clear();
        self.source_done = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::staging::SimStreams;

    #[derive(Debug, thiserror::Error)]
    #[error("engine broke at batch {0}")]
    struct EngineBroke(usize);

    const BYTES: usize = 24;

    fn batches(n: usize) -> impl Iterator<Item = Result<HostBatch, EngineBroke>> {
        (0..n).map(|k| {
            let pixels: Vec<u8> = (0..BYTES).map(|i| (k * 31 + i) as u8).collect();
            Ok(HostBatch {
                pixels: Arc::new(pixels),
                labels: vec![k as u32],
                sample_ids: vec![k as u64],
                len: 1,
                image_size: 2,
            })
        })
    }

    type Drive = (Vec<(u32, u64)>, Vec<Vec<u8>>, Vec<String>);

    /// Drives `n` steps the way the GPU driver does and returns, per step, the batch index
    /// compute got and how many batches had been staged when its compute was enqueued.
    fn drive(depth: usize, n: usize, seed: u64, eagerness: u32) -> Drive {
        let ring = StagingRing::new(SimStreams::new(depth, BYTES, seed, eagerness)).unwrap();
        let mut feeder = Feeder::new(ring);
        let mut source = batches(n);
        let mut seen = Vec::new();
        while let Some(ready) = feeder
            .next(&mut source, |r, b| r.stage_external(b))
            .unwrap()
        {
            let staged_total = feeder.ring().staged() + ready.staged.seq;
            seen.push((ready.batch.labels[0], staged_total));
            assert_eq!(ready.staged.seq, u64::from(ready.batch.labels[0]));
            feeder
                .ring_mut()
                .streams_mut()
                .launch_consume(ready.staged.slot)
                .unwrap();
            feeder.done().unwrap();
            feeder.record(ready.waited, ready.waited + Duration::from_millis(1));
        }
        feeder.ring_mut().streams_mut().drain();
        let sim = feeder.ring().streams();
        let consumed = sim.consumed().to_vec();
        let violations = sim.violations().to_vec();
        assert_eq!(feeder.meter().steps, n as u64);
        (seen, consumed, violations)
    }

    #[test]
    fn compute_gets_every_batch_in_order_with_the_next_one_already_uploading() {
        for depth in 1..=4 {
            for seed in 0..16 {
                for eagerness in [0, 1, 3, 50] {
                    let n = 9;
                    let (seen, consumed, violations) = drive(depth, n, seed, eagerness);
                    let order: Vec<u32> = seen.iter().map(|s| s.0).collect();
                    assert_eq!(order, (0..n as u32).collect::<Vec<_>>());
                    for (k, &(_, staged)) in seen.iter().enumerate() {
                        // Before batch k computes, batches up to k + depth − 1 are staged
                        // (fewer at the end of the source): the prefetch runs ahead.
                        let want = (k + depth).min(n) as u64;
                        assert_eq!(staged, want, "depth {depth} step {k}");
                    }
                    assert!(violations.is_empty(), "{violations:?}");
                    let want: Vec<Vec<u8>> = batches(n)
                        .map(|b| (*b.unwrap().pixels).as_ref().to_vec())
                        .collect();
                    assert_eq!(consumed, want, "depth {depth} seed {seed}");
                }
            }
        }
    }

    #[test]
    fn an_engine_error_stops_the_feed_with_the_engines_error() {
        let ring = StagingRing::new(SimStreams::new(2, BYTES, 1, 1)).unwrap();
        let mut feeder = Feeder::new(ring);
        let mut source = batches(1).chain(std::iter::once(Err(EngineBroke(1))));
        let err = feeder
            .next(&mut source, |r, b| r.stage_external(b))
            .unwrap_err();
        assert!(matches!(err, FeedError::Source(EngineBroke(1))), "{err}");
    }

    #[test]
    fn the_meter_reports_the_share_of_time_spent_waiting() {
        let ring = StagingRing::new(SimStreams::new(2, BYTES, 1, 1)).unwrap();
        let mut feeder = Feeder::new(ring);
        let mut source = batches(2);
        let ready = feeder
            .next(&mut source, |r, b| r.stage_external(b))
            .unwrap()
            .unwrap();
        feeder
            .ring_mut()
            .streams_mut()
            .launch_consume(ready.staged.slot)
            .unwrap();
        feeder.done().unwrap();
        feeder.record(Duration::from_millis(1), Duration::from_millis(4));
        assert_eq!(feeder.meter().steps, 1);
        assert!((feeder.meter().share() - 0.25).abs() < 1e-9);
    }

    #[test]
    fn the_data_wait_line_gives_the_share_and_a_verdict() {
        let mut meter = DataWaitMeter::default();
        meter.record(Duration::from_millis(1), Duration::from_millis(100));
        meter.record(Duration::from_millis(0), Duration::from_millis(100));
        let stats = crate::cuda::staging::StagingStats {
            batches: 2,
            measured: 2,
            compute_stalls: 1,
            compute_wait_time: Duration::from_micros(250),
            ..Default::default()
        };
        let line = data_wait_line(1, 3, &meter, &stats, 2);
        assert!(
            line.starts_with("GPU 3 (rank 1): data wait 0.5 % of 0.2 s over 2 steps"),
            "{line}"
        );
        assert!(
            line.contains("the GPU waited for 1 of 2 uploads (0.2 ms in all)"),
            "{line}"
        );
        assert!(line.contains("compute-bound"), "{line}");
        meter.record(Duration::from_millis(100), Duration::from_millis(100));
        assert!(data_wait_line(0, 0, &meter, &stats, 2).contains("input-bound"));
    }

    #[test]
    fn an_engine_batch_exposes_exactly_its_pixels() {
        let root = tempfile::tempdir().unwrap();
        let mut synth = pipeline::synth::SynthConfig::new(root.path().join("data"));
        synth.classes = 2;
        synth.train_per_class = 3;
        synth.valid_per_class = 1;
        synth.test_per_class = 0;
        synth.width = 8;
        synth.height = 8;
        pipeline::synth::write_dataset(&synth).unwrap();
        let pipe = pipeline::PipelineBuilder::new(pipeline::DatasetSource::folder(
            root.path().join("data"),
        ))
        .image_size(8)
        .batch_size(4)
        .cache_dir(root.path().join("cache"))
        .build()
        .unwrap();
        for batch in pipe.epoch(0, 0, 0).unwrap() {
            let batch = batch.unwrap();
            let (pixels, labels, len) =
                (batch.pixels().to_vec(), batch.labels().to_vec(), batch.len);
            let host = HostBatch::from_engine(batch);
            assert_eq!((*host.pixels).as_ref(), &pixels[..]);
            assert_eq!(host.labels, labels);
            assert_eq!((host.len, host.image_size), (len, 8));
        }
    }
}
