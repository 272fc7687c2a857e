//! The staging ring: D slots, each a pinned host buffer paired with a device buffer, so batch
//! k+1 is uploaded on the copy stream while batch k computes.
//!
//! Two events per slot guard reuse:
//! - `copied` is recorded on the copy stream after the upload of the slot. The host waits on it
//!   before writing the slot's host buffer again (the previous upload may still be reading it),
//!   and the compute stream waits on it before reading the device buffer.
//! - `consumed` is recorded on the compute stream after the last kernel that reads the device
//!   buffer. The copy stream waits on it before overwriting the device buffer.
//!
//! A stream wait on an event that was never recorded is a no-op (CUDA semantics), so a slot may
//! only be refilled once its previous batch's `consumed` event has been *recorded*; the ring
//! enforces that ordering and reports a violation as [`StagingError::RingFull`] instead of
//! letting an upload race the compute that still reads the slot.
//!
//! The ring is generic over [`StagingStreams`] (record, wait, query, upload), implemented for
//! CUDA in [`device`] and by [`SimStreams`], a deterministic simulator of two
//! asynchronous streams that checks every reuse rule on CPU.

pub mod device;
pub mod feed;
pub mod pinned;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Errors of the staging ring.
#[derive(Debug, thiserror::Error)]
pub enum StagingError {
    /// The next slot still holds a batch whose compute has not been recorded.
    #[error("staging ring full: slot {slot} still holds batch {holding} (state {state}); call end_compute before staging more than {depth} batches ahead")]
    RingFull {
        /// The slot.
        slot: usize,
        /// Batch sequence number it holds.
        holding: u64,
        /// Its state.
        state: &'static str,
        /// Ring depth.
        depth: usize,
    },
    /// `begin_compute` with no uploaded batch.
    #[error(
        "no staged batch to compute: batch {seq} has not been uploaded (finish_fill it first)"
    )]
    NothingStaged {
        /// The batch expected next.
        seq: u64,
    },
    /// Calls out of order (finish without begin, two fills at once...).
    #[error("staging calls out of order: {what}")]
    OutOfOrder {
        /// What happened.
        what: &'static str,
    },
    /// A batch larger than a slot.
    #[error(
        "batch of {bytes} bytes does not fit a {slot_bytes}-byte staging slot; raise the slot size"
    )]
    TooLarge {
        /// Batch bytes.
        bytes: usize,
        /// Slot bytes.
        slot_bytes: usize,
    },
    /// `--prefetch-depth 0`.
    #[error("--prefetch-depth must be at least 1 (2 overlaps one upload with one compute)")]
    ZeroDepth,
    /// The stream implementation failed.
    #[error("staging stream operation failed: {0}")]
    Streams(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// The stream and event operations the ring needs, for one GPU.
///
/// Implementations own `slot_count()` host buffers and device buffers of `slot_bytes()` each.
pub trait StagingStreams {
    /// An event handle.
    type Event;
    /// The implementation's error.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Number of slots (the ring depth).
    fn slot_count(&self) -> usize;
    /// Bytes per slot.
    fn slot_bytes(&self) -> usize;
    /// A new event with no work recorded.
    fn new_event(&mut self) -> Result<Self::Event, Self::Error>;
    /// True when all work recorded in `event` has completed (never recorded: true).
    fn is_complete(&mut self, event: &Self::Event) -> Result<bool, Self::Error>;
    /// Blocks the host until `event` completes.
    fn host_wait(&mut self, event: &Self::Event) -> Result<(), Self::Error>;
    /// The host buffer of `slot`, for the engine to assemble a batch into.
    fn host_slot(&mut self, slot: usize) -> Result<&mut [u8], Self::Error>;
    /// On the copy stream: wait for `reuse`, copy `bytes` of host slot to device slot, record
    /// `copied`.
    fn enqueue_upload(
        &mut self,
        slot: usize,
        bytes: usize,
        reuse: &Self::Event,
        copied: &Self::Event,
    ) -> Result<(), Self::Error>;
    /// Like [`StagingStreams::enqueue_upload`], but from a caller-owned buffer (a batch the
    /// engine assembled in its own pinned memory) instead of the slot's host buffer. The ring
    /// keeps a clone of `src` until `copied` has completed, so the buffer cannot return to the
    /// engine's pool while the copy still reads it.
    fn enqueue_upload_external(
        &mut self,
        slot: usize,
        src: &ExternalBatch,
        reuse: &Self::Event,
        copied: &Self::Event,
    ) -> Result<(), Self::Error>;
    /// Makes the compute stream wait for `event`.
    fn compute_wait(&mut self, event: &Self::Event) -> Result<(), Self::Error>;
    /// Records the compute stream's current work into `event`.
    fn compute_record(&mut self, event: &Self::Event) -> Result<(), Self::Error>;
    /// Milliseconds on the device's clock from `from`'s completion to `to`'s (negative when
    /// `to` completed first), once both have completed; `None` before.
    fn elapsed_ms(
        &mut self,
        from: &Self::Event,
        to: &Self::Event,
    ) -> Result<Option<f32>, Self::Error>;
}

/// A batch in caller-owned host memory (for CUDA: pinned), shared with the ring until its
/// upload completed.
pub type ExternalBatch = std::sync::Arc<dyn AsRef<[u8]> + Send + Sync>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    Filling { seq: u64 },
    Uploaded { seq: u64, bytes: usize },
    Computing { seq: u64 },
    Consumed { seq: u64 },
}

impl SlotState {
    fn name(self) -> &'static str {
        match self {
            SlotState::Free => "free",
            SlotState::Filling { .. } => "filling",
            SlotState::Uploaded { .. } => "uploaded",
            SlotState::Computing { .. } => "computing",
            SlotState::Consumed { .. } => "consumed",
        }
    }

    fn seq(self) -> u64 {
        match self {
            SlotState::Free => 0,
            SlotState::Filling { seq }
            | SlotState::Uploaded { seq, .. }
            | SlotState::Computing { seq }
            | SlotState::Consumed { seq } => seq,
        }
    }
}

struct Slot<E> {
    copied: E,
    consumed: E,
    /// Recorded on the compute stream just before it waits for `copied`: the device time
    /// from `asked` to `copied` is how long compute waited for this upload.
    asked: E,
    /// `asked` and `copied` of the last batch computed from this slot are not measured yet.
    unmeasured: bool,
    state: SlotState,
    /// The caller's buffer of the last external upload, released once that upload completed.
    held: Option<ExternalBatch>,
}

/// Counters of how often and how long input held up the step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StagingStats {
    /// Batches handed to compute.
    pub batches: u64,
    /// Fills that had to block the host on a previous upload of the same slot.
    pub host_waits: u64,
    /// Host time spent in those waits.
    pub host_wait_time: Duration,
    /// Batches whose upload completed after the compute stream reached them, so that it
    /// waited for the copy (measured on the device's clock: a GPU-side data wait).
    pub compute_stalls: u64,
    /// The compute stream's time waiting for those uploads.
    pub compute_wait_time: Duration,
    /// Batches whose wait has been measured (the last few of a run may not be yet).
    pub measured: u64,
}

/// A batch ready for compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagedBatch {
    /// Batch sequence number (0, 1, 2, ... in fill order).
    pub seq: u64,
    /// The slot whose device buffer holds it.
    pub slot: usize,
    /// Bytes uploaded.
    pub bytes: usize,
}

/// The ring of staging slots for one GPU.
pub struct StagingRing<S: StagingStreams> {
    streams: S,
    slots: Vec<Slot<S::Event>>,
    next_fill: u64,
    next_compute: u64,
    stats: StagingStats,
}

fn wrap<E: std::error::Error + Send + Sync + 'static>(e: E) -> StagingError {
    StagingError::Streams(Box::new(e))
}

impl<S: StagingStreams> StagingRing<S> {
    /// A ring over `streams` (one slot per `streams.slot_count()`).
    pub fn new(mut streams: S) -> Result<Self, StagingError> {
        if streams.slot_count() == 0 {
            return Err(StagingError::ZeroDepth);
        }
        let slots = (0..streams.slot_count())
            .map(|_| {
                Ok(Slot {
                    copied: streams.new_event().map_err(wrap)?,
                    consumed: streams.new_event().map_err(wrap)?,
                    asked: streams.new_event().map_err(wrap)?,
                    unmeasured: false,
                    state: SlotState::Free,
                    held: None,
                })
            })
            .collect::<Result<Vec<_>, StagingError>>()?;
        Ok(StagingRing {
            streams,
            slots,
            next_fill: 0,
            next_compute: 0,
            stats: StagingStats::default(),
        })
    }

    /// Ring depth.
    pub fn depth(&self) -> usize {
        self.slots.len()
    }

    /// The stream implementation (for the compute kernels to reach the device slots).
    pub fn streams(&self) -> &S {
        &self.streams
    }

    /// Mutable access to the stream implementation.
    pub fn streams_mut(&mut self) -> &mut S {
        &mut self.streams
    }

    /// Counters so far.
    pub fn stats(&self) -> StagingStats {
        self.stats
    }

    /// Batches filled but not yet handed to compute.
    pub fn staged(&self) -> u64 {
        self.next_fill - self.next_compute
    }

    /// True when the next slot can be filled now without a [`StagingError::RingFull`].
    pub fn can_fill(&self) -> bool {
        let slot = &self.slots[(self.next_fill % self.depth() as u64) as usize];
        matches!(slot.state, SlotState::Free | SlotState::Consumed { .. })
    }

    /// Waits until the next slot may be refilled (its previous upload finished reading host
    /// memory) and returns its index.
    fn acquire_next(&mut self) -> Result<usize, StagingError> {
        let depth = self.depth();
        let index = (self.next_fill % depth as u64) as usize;
        if self
            .slots
            .iter()
            .any(|s| matches!(s.state, SlotState::Filling { .. }))
        {
            return Err(StagingError::OutOfOrder {
                what: "begin_fill while another fill is open",
            });
        }
        let slot = &self.slots[index];
        if !matches!(slot.state, SlotState::Free | SlotState::Consumed { .. }) {
            return Err(StagingError::RingFull {
                slot: index,
                holding: slot.state.seq(),
                state: slot.state.name(),
                depth,
            });
        }
        if !self.streams.is_complete(&slot.copied).map_err(wrap)? {
            let start = Instant::now();
            self.streams.host_wait(&slot.copied).map_err(wrap)?;
            self.stats.host_waits += 1;
            self.stats.host_wait_time += start.elapsed();
        }
        // The previous external batch of this slot has been copied: give it back.
        self.slots[index].held = None;
        // The last chance to measure how long compute waited for the slot's previous batch:
        // the refill records `copied` again (a measurement the device has not reached yet
        // is left out, never blocked on).
        self.measure_waits()?;
        self.slots[index].unmeasured = false;
        Ok(index)
    }

    /// Starts staging the next batch: returns its sequence number and the slot's host buffer.
    ///
    /// Blocks the host only while the previous upload from this slot is still reading it.
    pub fn begin_fill(&mut self) -> Result<(u64, &mut [u8]), StagingError> {
        let index = self.acquire_next()?;
        let seq = self.next_fill;
        self.slots[index].state = SlotState::Filling { seq };
        let buffer = self.streams.host_slot(index).map_err(wrap)?;
        Ok((seq, buffer))
    }

    /// Stages a batch the engine assembled in its own (pinned) buffer: uploads `batch` into the
    /// next slot's device buffer and keeps `batch` alive until the upload completed. Returns
    /// the batch's sequence number.
    pub fn stage_external(&mut self, batch: ExternalBatch) -> Result<u64, StagingError> {
        let bytes = (*batch).as_ref().len();
        let slot_bytes = self.streams.slot_bytes();
        if bytes > slot_bytes {
            return Err(StagingError::TooLarge { bytes, slot_bytes });
        }
        let index = self.acquire_next()?;
        let seq = self.next_fill;
        let slot = &self.slots[index];
        self.streams
            .enqueue_upload_external(index, &batch, &slot.consumed, &slot.copied)
            .map_err(wrap)?;
        self.slots[index].state = SlotState::Uploaded { seq, bytes };
        self.slots[index].held = Some(batch);
        self.next_fill += 1;
        Ok(seq)
    }

    /// Ends the open fill: `bytes` of the host buffer are uploaded on the copy stream once the
    /// slot's previous compute has finished.
    pub fn finish_fill(&mut self, bytes: usize) -> Result<(), StagingError> {
        let index = (self.next_fill % self.depth() as u64) as usize;
        let SlotState::Filling { seq } = self.slots[index].state else {
            return Err(StagingError::OutOfOrder {
                what: "finish_fill without begin_fill",
            });
        };
        let slot_bytes = self.streams.slot_bytes();
        if bytes > slot_bytes {
            return Err(StagingError::TooLarge { bytes, slot_bytes });
        }
        let slot = &self.slots[index];
        self.streams
            .enqueue_upload(index, bytes, &slot.consumed, &slot.copied)
            .map_err(wrap)?;
        self.slots[index].state = SlotState::Uploaded { seq, bytes };
        self.next_fill += 1;
        Ok(())
    }

    /// Hands the oldest uploaded batch to compute: the compute stream waits for its upload.
    pub fn begin_compute(&mut self) -> Result<StagedBatch, StagingError> {
        let index = (self.next_compute % self.depth() as u64) as usize;
        let slot = &self.slots[index];
        let (seq, bytes) = match slot.state {
            SlotState::Uploaded { seq, bytes } => (seq, bytes),
            SlotState::Computing { .. } => {
                return Err(StagingError::OutOfOrder {
                    what: "begin_compute twice without end_compute",
                })
            }
            _ => {
                return Err(StagingError::NothingStaged {
                    seq: self.next_compute,
                })
            }
        };
        let slot = &self.slots[index];
        self.streams.compute_record(&slot.asked).map_err(wrap)?;
        self.streams.compute_wait(&slot.copied).map_err(wrap)?;
        self.slots[index].unmeasured = true;
        self.slots[index].state = SlotState::Computing { seq };
        self.stats.batches += 1;
        Ok(StagedBatch {
            seq,
            slot: index,
            bytes,
        })
    }

    /// Adds to the counters the compute waits of the batches whose `asked` and `copied` have
    /// both completed on the device, without blocking the host (the trainer calls it at the
    /// end of each step, and a slot's refill first).
    pub fn measure_waits(&mut self) -> Result<(), StagingError> {
        for slot in self.slots.iter_mut().filter(|s| s.unmeasured) {
            let Some(ms) = self
                .streams
                .elapsed_ms(&slot.asked, &slot.copied)
                .map_err(wrap)?
            else {
                continue;
            };
            slot.unmeasured = false;
            self.stats.measured += 1;
            if ms > 0.0 {
                self.stats.compute_stalls += 1;
                self.stats.compute_wait_time += Duration::from_secs_f64(f64::from(ms) / 1e3);
            }
        }
        Ok(())
    }

    /// Marks the end of the kernels reading the current batch (records `consumed` on the
    /// compute stream), which frees its slot for the batch `depth` places later.
    pub fn end_compute(&mut self) -> Result<(), StagingError> {
        let index = (self.next_compute % self.depth() as u64) as usize;
        let SlotState::Computing { seq } = self.slots[index].state else {
            return Err(StagingError::OutOfOrder {
                what: "end_compute without begin_compute",
            });
        };
        self.streams
            .compute_record(&self.slots[index].consumed)
            .map_err(wrap)?;
        self.slots[index].state = SlotState::Consumed { seq };
        self.next_compute += 1;
        Ok(())
    }
}

impl<S: StagingStreams> Drop for StagingRing<S> {
    /// Waits for the uploads still reading caller-owned batches before releasing them, so a
    /// batch buffer never returns to the engine's pool while a copy reads it.
    fn drop(&mut self) {
        for slot in &mut self.slots {
            if slot.held.is_some() {
                if let Err(e) = self.streams.host_wait(&slot.copied) {
                    tracing::error!("staging ring dropped while an upload failed: {e}");
                }
                slot.held = None;
            }
        }
    }
}

/// Accumulates per-step wall time and the part of it spent waiting for input.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DataWaitMeter {
    /// Steps recorded.
    pub steps: u64,
    /// Total time waiting for input (engine batch not ready, staging slot not free).
    pub waited: Duration,
    /// Total step wall time.
    pub total: Duration,
}

impl DataWaitMeter {
    /// Adds one step: `waited` of its `total` wall time went to waiting for input.
    pub fn record(&mut self, waited: Duration, total: Duration) {
        self.steps += 1;
        self.waited += waited.min(total);
        self.total += total;
    }

    /// Share of the wall time spent waiting for input, in [0, 1] (0 with no steps).
    pub fn share(&self) -> f64 {
        if self.total.is_zero() {
            0.0
        } else {
            self.waited.as_secs_f64() / self.total.as_secs_f64()
        }
    }
}

/// Errors of the stream simulator.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SimError {
    /// A host wait that can never finish (the event depends on work that is blocked forever).
    #[error("simulated deadlock: host waits on event {event} but no stream can make progress")]
    Deadlock {
        /// The event.
        event: usize,
    },
    /// A slot index out of range.
    #[error("slot {slot} outside the simulator's {slots} slots")]
    BadSlot {
        /// The slot.
        slot: usize,
        /// Slots present.
        slots: usize,
    },
}

#[derive(Clone)]
enum Op {
    /// Blocks the stream until the event's completed generation reaches `generation`.
    Wait {
        event: usize,
        generation: u64,
    },
    Upload {
        slot: usize,
        bytes: usize,
    },
    /// Copies a caller-owned batch; the simulator holds its own clone, so it can tell when the
    /// ring released the batch before the copy ran.
    UploadExternal {
        slot: usize,
        src: ExternalBatch,
    },
    Record {
        event: usize,
        generation: u64,
    },
    Consume {
        slot: usize,
    },
}

#[derive(Debug, Clone, Copy, Default)]
struct EventState {
    recorded: u64,
    completed: u64,
    /// The simulator's clock (operations run so far) when the latest recording completed.
    completed_at: u64,
}

/// A deterministic simulator of a copy stream and a compute stream, for testing the ring's
/// reuse logic on CPU.
///
/// Operations queue up per stream and run later, interleaved by a seeded pseudo-random
/// scheduler; waits and records follow CUDA event semantics (a wait captures the event's latest
/// record; waiting on a never-recorded event is a no-op). Uploads copy the host slot at the
/// moment they *run*, and [`SimStreams::launch_consume`] reads the device slot when it runs, so
/// a reuse bug shows up as corrupted or reordered batches, and is also flagged in
/// [`SimStreams::violations`].
pub struct SimStreams {
    host: Vec<Vec<u8>>,
    device: Vec<Vec<u8>>,
    /// Per slot: an upload is queued and has not run (the host buffer is still being read).
    upload_pending: Vec<bool>,
    /// Per slot: the device buffer holds an upload no consume has read yet.
    device_unread: Vec<bool>,
    events: Vec<EventState>,
    copy: VecDeque<Op>,
    compute: VecDeque<Op>,
    rng: u64,
    /// At most this many operations run per API call (0 = streams only move on host waits).
    eagerness: u32,
    /// Operations run so far: the clock of [`StagingStreams::elapsed_ms`] (one per ms).
    clock: u64,
    /// When both streams can move: always the compute stream (`Some(true)`), always the copy
    /// stream (`Some(false)`), or a seeded coin (`None`).
    prefer_compute: Option<bool>,
    consumed: Vec<Vec<u8>>,
    violations: Vec<String>,
}

impl std::fmt::Debug for SimStreams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimStreams")
            .field("slots", &self.host.len())
            .field("queued_copy_ops", &self.copy.len())
            .field("queued_compute_ops", &self.compute.len())
            .field("violations", &self.violations)
            .finish()
    }
}

impl SimStreams {
    /// `slots` slots of `slot_bytes`; `seed` picks the interleaving; `eagerness` bounds how far
    /// the streams run on each call (0 = lazy streams, larger = streams keep up with the host).
    pub fn new(slots: usize, slot_bytes: usize, seed: u64, eagerness: u32) -> Self {
        SimStreams {
            host: vec![vec![0; slot_bytes]; slots],
            device: vec![vec![0; slot_bytes]; slots],
            upload_pending: vec![false; slots],
            device_unread: vec![false; slots],
            events: Vec::new(),
            copy: VecDeque::new(),
            compute: VecDeque::new(),
            rng: seed ^ 0x9E37_79B9_7F4A_7C15,
            eagerness,
            clock: 0,
            prefer_compute: None,
            consumed: Vec::new(),
            violations: Vec::new(),
        }
    }

    fn next_random(&mut self) -> u64 {
        // xorshift64*: tiny, deterministic, good enough to shuffle interleavings.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn runnable(&self, queue: &VecDeque<Op>) -> bool {
        match queue.front() {
            None => false,
            Some(Op::Wait { event, generation }) => self.events[*event].completed >= *generation,
            Some(_) => true,
        }
    }

    /// Runs one operation of a runnable stream; false when neither stream can move.
    fn step(&mut self) -> bool {
        let copy_ok = self.runnable(&self.copy);
        let compute_ok = self.runnable(&self.compute);
        let pick_copy = match (copy_ok, compute_ok) {
            (false, false) => return false,
            (true, false) => true,
            (false, true) => false,
            (true, true) => match self.prefer_compute {
                Some(compute) => !compute,
                None => self.next_random() & 1 == 0,
            },
        };
        let op = if pick_copy {
            self.copy.pop_front()
        } else {
            self.compute.pop_front()
        };
        self.clock += 1;
        match op.expect("a runnable stream has an operation") {
            Op::Wait { .. } => {}
            Op::Record { event, generation } => {
                let e = &mut self.events[event];
                e.completed = e.completed.max(generation);
                e.completed_at = self.clock;
            }
            Op::Upload { slot, bytes } => {
                if self.device_unread[slot] {
                    self.violations.push(format!(
                        "device slot {slot} overwritten before the compute of its previous batch read it"
                    ));
                }
                self.device_unread[slot] = true;
                let (src, dst) = (&self.host[slot], &mut self.device[slot]);
                dst[..bytes].copy_from_slice(&src[..bytes]);
                dst[bytes..].iter_mut().for_each(|b| *b = 0);
                self.upload_pending[slot] = false;
            }
            Op::UploadExternal { slot, src } => {
                if std::sync::Arc::strong_count(&src) < 2 {
                    self.violations.push(format!(
                        "external batch for slot {slot} released before its upload ran"
                    ));
                }
                if self.device_unread[slot] {
                    self.violations.push(format!(
                        "device slot {slot} overwritten before the compute of its previous batch read it"
                    ));
                }
                self.device_unread[slot] = true;
                let data = (*src).as_ref();
                let dst = &mut self.device[slot];
                dst[..data.len()].copy_from_slice(data);
                dst[data.len()..].iter_mut().for_each(|b| *b = 0);
            }
            Op::Consume { slot } => {
                if !self.device_unread[slot] {
                    self.violations.push(format!(
                        "compute read device slot {slot} before its upload ran (stale data)"
                    ));
                }
                self.device_unread[slot] = false;
                self.consumed.push(self.device[slot].clone());
            }
        }
        true
    }

    /// Lets the streams run a pseudo-random number of operations (up to `eagerness`).
    fn wander(&mut self) {
        if self.eagerness == 0 {
            return;
        }
        let n = self.next_random() % (u64::from(self.eagerness) + 1);
        for _ in 0..n {
            if !self.step() {
                break;
            }
        }
    }

    /// Queues the compute kernel that reads device slot `slot` (what the trainer's forward pass
    /// does between `begin_compute` and `end_compute`).
    pub fn launch_consume(&mut self, slot: usize) -> Result<(), SimError> {
        self.check_slot(slot)?;
        self.compute.push_back(Op::Consume { slot });
        self.wander();
        Ok(())
    }

    /// Runs both streams until neither can move.
    pub fn drain(&mut self) {
        while self.step() {}
    }

    /// The device contents each consume read, in the order the consumes ran.
    pub fn consumed(&self) -> &[Vec<u8>] {
        &self.consumed
    }

    /// Reuse rules broken so far (empty when the ring behaved).
    pub fn violations(&self) -> &[String] {
        &self.violations
    }

    /// The same simulator, but whenever both streams can move it runs the compute stream
    /// (`true`: compute always gets ahead of the copies) or the copy stream (`false`).
    pub fn preferring_compute(mut self, compute: bool) -> Self {
        self.prefer_compute = Some(compute);
        self
    }

    fn check_slot(&self, slot: usize) -> Result<(), SimError> {
        if slot < self.host.len() {
            Ok(())
        } else {
            Err(SimError::BadSlot {
                slot,
                slots: self.host.len(),
            })
        }
    }

    /// A wait for `event`'s latest recording.
    fn wait_op(&self, event: usize) -> Op {
        Op::Wait {
            event,
            generation: self.events[event].recorded,
        }
    }

    /// A new recording of `event`.
    fn record_op(&mut self, event: usize) -> Op {
        let e = &mut self.events[event];
        e.recorded += 1;
        Op::Record {
            event,
            generation: e.recorded,
        }
    }

    /// `copy` on the copy stream after `reuse`, then a recording of `copied`.
    fn enqueue_copy(&mut self, copy: Op, reuse: usize, copied: usize) {
        let wait = self.wait_op(reuse);
        self.copy.push_back(wait);
        self.copy.push_back(copy);
        let record = self.record_op(copied);
        self.copy.push_back(record);
        self.wander();
    }
}

impl StagingStreams for SimStreams {
    type Event = usize;
    type Error = SimError;

    fn slot_count(&self) -> usize {
        self.host.len()
    }

    fn slot_bytes(&self) -> usize {
        self.host.first().map_or(0, Vec::len)
    }

    fn new_event(&mut self) -> Result<usize, SimError> {
        self.events.push(EventState::default());
        Ok(self.events.len() - 1)
    }

    fn is_complete(&mut self, event: &usize) -> Result<bool, SimError> {
        self.wander();
        let e = self.events[*event];
        Ok(e.completed >= e.recorded)
    }

    fn host_wait(&mut self, event: &usize) -> Result<(), SimError> {
        loop {
            let e = self.events[*event];
            if e.completed >= e.recorded {
                return Ok(());
            }
            if !self.step() {
                return Err(SimError::Deadlock { event: *event });
            }
        }
    }

    fn host_slot(&mut self, slot: usize) -> Result<&mut [u8], SimError> {
        self.check_slot(slot)?;
        if self.upload_pending[slot] {
            self.violations.push(format!(
                "host slot {slot} handed out for writing while its upload had not run"
            ));
        }
        Ok(&mut self.host[slot])
    }

    fn enqueue_upload(
        &mut self,
        slot: usize,
        bytes: usize,
        reuse: &usize,
        copied: &usize,
    ) -> Result<(), SimError> {
        self.check_slot(slot)?;
        self.upload_pending[slot] = true;
        self.enqueue_copy(Op::Upload { slot, bytes }, *reuse, *copied);
        Ok(())
    }

    fn enqueue_upload_external(
        &mut self,
        slot: usize,
        src: &ExternalBatch,
        reuse: &usize,
        copied: &usize,
    ) -> Result<(), SimError> {
        self.check_slot(slot)?;
        let copy = Op::UploadExternal {
            slot,
            src: src.clone(),
        };
        self.enqueue_copy(copy, *reuse, *copied);
        Ok(())
    }

    fn compute_wait(&mut self, event: &usize) -> Result<(), SimError> {
        let wait = self.wait_op(*event);
        self.compute.push_back(wait);
        self.wander();
        Ok(())
    }

    fn compute_record(&mut self, event: &usize) -> Result<(), SimError> {
        let record = self.record_op(*event);
        self.compute.push_back(record);
        self.wander();
        Ok(())
    }

    fn elapsed_ms(&mut self, from: &usize, to: &usize) -> Result<Option<f32>, SimError> {
        let (a, b) = (self.events[*from], self.events[*to]);
        let done = |e: EventState| e.recorded > 0 && e.completed >= e.recorded;
        Ok((done(a) && done(b)).then_some(b.completed_at as f32 - a.completed_at as f32))
    }
}
