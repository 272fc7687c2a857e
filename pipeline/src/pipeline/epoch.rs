//! One epoch iterator's stages: the planner that hands each image to the decode pool, the
//! assembler that turns finished images into batches, and the blocking iterator and async
//! stream the consumer reads them from.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use super::{Inner, Pipeline};
use crate::batch::Batch;
use crate::buffer::BufferPool;
use crate::order::{epoch_order, EpochPlan};
use crate::stats::Counters;
use crate::worker::{BufferHolder, Job, Outcome, Shared};
use crate::PipelineError;

impl Pipeline {
    /// Batches of `replica` for `epoch`, from `start_step` on, as a blocking iterator.
    pub fn epoch(
        &self,
        epoch: u64,
        replica: usize,
        start_step: usize,
    ) -> Result<EpochIter, PipelineError> {
        let (rx, expected) = self.launch(epoch, replica, start_step)?;
        Ok(EpochIter {
            rx,
            remaining: expected,
            shared: Arc::clone(&self.inner.shared),
            _inner: Arc::clone(&self.inner),
        })
    }

    /// The same batches as [`Pipeline::epoch`], as an async stream.
    pub fn epoch_stream(
        &self,
        epoch: u64,
        replica: usize,
        start_step: usize,
    ) -> Result<EpochStream, PipelineError> {
        let (rx, expected) = self.launch(epoch, replica, start_step)?;
        Ok(EpochStream {
            rx: rx.into_stream(),
            remaining: expected,
            shared: Arc::clone(&self.inner.shared),
            _inner: Arc::clone(&self.inner),
        })
    }

    /// Starts the planner and assembler tasks of one epoch iterator.
    pub(super) fn launch(
        &self,
        epoch: u64,
        replica: usize,
        start_step: usize,
    ) -> Result<(flume::Receiver<Result<Batch, PipelineError>>, usize), PipelineError> {
        let i = &self.inner;
        if replica >= i.replicas {
            return Err(PipelineError::InvalidSetting {
                name: "replica",
                value: replica.to_string(),
                hint: "must be below the pipeline's replica count",
            });
        }
        let steps = self.steps_per_epoch();
        if start_step > steps {
            return Err(PipelineError::StepOutOfRange {
                step: start_step,
                steps,
            });
        }
        if let Some(fatal) = i.shared.fatal() {
            return Err(i.shared.fatal_error(fatal));
        }
        let order = epoch_order(
            i.shared.samples.iter().map(|s| s.label),
            i.sampling,
            i.shuffle,
            i.seed,
            epoch,
        );
        let plan = EpochPlan::new(order, i.replicas, i.batch_size, i.last_batch);
        let (out_tx, out_rx) = flume::bounded(i.prefetch);
        let (pending_tx, pending_rx) = flume::bounded(i.prefetch);
        let cancel = Arc::new(AtomicBool::new(false));
        i.shared
            .counters
            .ready_capacity
            .fetch_add(i.prefetch, Ordering::Relaxed);
        let planner = Planner {
            shared: Arc::clone(&i.shared),
            plan,
            epoch,
            replica,
            jobs: i.jobs.clone(),
            pool_free: i.pool.returner(),
            cancel: Arc::clone(&cancel),
        };
        let pool = i.pool.clone();
        let runtime = &i
            .orchestrator
            .as_ref()
            .expect("the orchestrator lives as long as Inner")
            .handle;
        let planned = runtime.spawn(planner.run(start_step, steps, pool, pending_tx));
        let assembler = Assembler {
            shared: Arc::clone(&i.shared),
            cancel,
            prefetch: i.prefetch,
            returner: i.pool.returner(),
        };
        let errors = out_tx.clone();
        let supervised = Arc::clone(&i.shared);
        let assembled = runtime.spawn(assembler.run(pending_rx, out_tx));
        // A panicking stage must reach the consumer as an error with its message, not as a
        // silently short epoch: the supervisor holds a sender until both stages are done.
        runtime.spawn(async move {
            for (stage, handle) in [("planner", planned), ("assembler", assembled)] {
                if let Err(e) = handle.await {
                    let message = match e.try_into_panic() {
                        Ok(payload) => crate::worker::panic_message(payload.as_ref()),
                        Err(e) => e.to_string(),
                    };
                    // Counted as a ready item, as the consumer uncounts every item it takes.
                    let counters = &supervised.counters;
                    counters.ready_batches.fetch_add(1, Ordering::Relaxed);
                    let error = PipelineError::StagePanicked { stage, message };
                    if errors.send_async(Err(error)).await.is_err() {
                        counters.ready_batches.fetch_sub(1, Ordering::Relaxed);
                    }
                    return;
                }
            }
        });
        Ok((out_rx, steps - start_step))
    }
}

/// A planned micro-batch whose images are being produced.
struct Pending {
    epoch: u64,
    step: usize,
    replica: usize,
    indices: Vec<u32>,
    holder: Arc<BufferHolder>,
    done: flume::Receiver<(usize, Result<Outcome, PipelineError>)>,
}

struct Planner {
    shared: Arc<Shared>,
    plan: EpochPlan,
    epoch: u64,
    replica: usize,
    jobs: flume::Sender<Job>,
    pool_free: flume::Sender<crate::buffer::Slot>,
    cancel: Arc<AtomicBool>,
}

impl Planner {
    async fn run(
        self,
        start_step: usize,
        steps: usize,
        pool: BufferPool,
        pending_tx: flume::Sender<Result<Pending, PipelineError>>,
    ) {
        let record = self.shared.image_bytes();
        // The planner holds the pool, never the pipeline: the runtime is not kept alive (or
        // dropped) from inside its own tasks.
        for step in start_step..steps {
            let slot = match pool.take_async().await {
                Ok(slot) => slot,
                Err(e) => {
                    let _ = pending_tx.send_async(Err(e)).await;
                    return;
                }
            };
            let indices = self.plan.micro_batch(step, self.replica);
            let holder = Arc::new(BufferHolder {
                slot: Mutex::new(Some(slot)),
                returner: self.pool_free.clone(),
            });
            let (done_tx, done_rx) = flume::bounded(indices.len().max(1));
            let dests = holder.dests(indices.len(), record);
            for (position, (&index, dest)) in indices.iter().zip(dests).enumerate() {
                let job = Job {
                    shared: Arc::clone(&self.shared),
                    index,
                    epoch: self.epoch,
                    position,
                    dest,
                    holder: Arc::clone(&holder),
                    cancel: Arc::clone(&self.cancel),
                    done: done_tx.clone(),
                };
                if self.jobs.send_async(job).await.is_err() {
                    return; // The pipeline is shutting down.
                }
            }
            let pending = Pending {
                epoch: self.epoch,
                step,
                replica: self.replica,
                indices,
                holder,
                done: done_rx,
            };
            if pending_tx.send_async(Ok(pending)).await.is_err() {
                self.cancel.store(true, Ordering::Relaxed);
                return;
            }
        }
    }
}

impl BufferPool {
    /// A slot without blocking the orchestrator: allocation (possibly pinned memory, slow)
    /// runs on a thread of its own (a pool allocates at most `2 × prefetch + 2` buffers, so
    /// few such threads ever start; tokio's blocking pool would panic where the OS refuses
    /// one).
    async fn take_async(&self) -> Result<crate::buffer::Slot, PipelineError> {
        if self.free() > 0 {
            return self.take();
        }
        let (tx, rx) = flume::bounded(1);
        let this = self.clone();
        crate::threads::spawn("pipeline-alloc", move || {
            let _ = tx.send(this.take());
        })?;
        rx.recv_async()
            .await
            .map_err(|_| PipelineError::Allocator {
                message: "the allocation task ended without a result".into(),
                source: None,
            })?
    }
}

struct Assembler {
    shared: Arc<Shared>,
    cancel: Arc<AtomicBool>,
    prefetch: usize,
    returner: flume::Sender<crate::buffer::Slot>,
}

impl Assembler {
    async fn run(
        self,
        pending_rx: flume::Receiver<Result<Pending, PipelineError>>,
        out_tx: flume::Sender<Result<Batch, PipelineError>>,
    ) {
        let counters = &self.shared.counters;
        while let Ok(pending) = pending_rx.recv_async().await {
            let result = match pending {
                Ok(pending) => self.assemble(pending).await,
                Err(e) => Err(e),
            };
            let failed = result.is_err();
            let result = match result {
                Ok(batch) => match self.shared.fatal() {
                    Some(fatal) => Err(self.shared.fatal_error(fatal)),
                    None => Ok(batch),
                },
                Err(e) => Err(e),
            };
            let failed = failed || result.is_err();
            counters.ready_batches.fetch_add(1, Ordering::Relaxed);
            let delivered = out_tx.send_async(result).await.is_ok();
            if !delivered {
                counters.ready_batches.fetch_sub(1, Ordering::Relaxed);
            }
            if !delivered || failed {
                // Nothing more comes from this epoch: stop queued jobs from doing work.
                self.cancel.store(true, Ordering::Relaxed);
                break;
            }
        }
        counters
            .ready_capacity
            .fetch_sub(self.prefetch, Ordering::Relaxed);
    }

    async fn assemble(&self, p: Pending) -> Result<Batch, PipelineError> {
        let n = p.indices.len();
        let mut outcomes = vec![Outcome::Cancelled; n];
        for _ in 0..n {
            match p.done.recv_async().await {
                Ok((pos, Ok(outcome))) => outcomes[pos] = outcome,
                Ok((_, Err(e))) => return Err(e),
                Err(_) => {
                    return Err(PipelineError::Stopped {
                        reason:
                            "a decode job was dropped without a result (pipeline shutting down)"
                                .into(),
                    })
                }
            }
        }
        let mut slot = p
            .holder
            .slot
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .expect("every job has reported, so the slot is back (programmer error otherwise)");
        let record = self.shared.image_bytes();
        let pixels = slot.pixels.as_mut_slice();
        slot.labels.clear();
        slot.ids.clear();
        // Keep plan order; close the gaps of skipped bad files.
        for (pos, &index) in p.indices.iter().enumerate() {
            if outcomes[pos] == Outcome::Skipped {
                continue;
            }
            let to = slot.labels.len();
            if to != pos {
                pixels.copy_within(pos * record..(pos + 1) * record, to * record);
            }
            slot.labels.push(self.shared.samples[index as usize].label);
            slot.ids.push(u64::from(index));
        }
        self.shared.counters.batches.fetch_add(1, Ordering::Relaxed);
        let sample_ids = std::mem::take(&mut slot.ids);
        Ok(Batch {
            epoch: p.epoch,
            step: p.step,
            replica: p.replica,
            len: sample_ids.len(),
            image_size: self.shared.image_size,
            sample_ids,
            slot: Some(slot),
            returner: self.returner.clone(),
        })
    }
}

/// One replica's batches of one epoch, blocking. Ends after the last step or the first error.
pub struct EpochIter {
    rx: flume::Receiver<Result<Batch, PipelineError>>,
    remaining: usize,
    shared: Arc<Shared>,
    _inner: Arc<Inner>,
}

impl std::fmt::Debug for EpochIter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EpochIter")
            .field("remaining", &self.remaining)
            .finish_non_exhaustive()
    }
}

/// Turns one received item into the iterator's next value, ending after an error and
/// reporting an early end (a crashed stage) as an error rather than a short epoch.
fn next_item(
    remaining: &mut usize,
    shared: &Shared,
    item: Option<Result<Batch, PipelineError>>,
) -> Option<Result<Batch, PipelineError>> {
    if *remaining == 0 {
        return None;
    }
    match item {
        Some(Ok(batch)) => {
            shared
                .counters
                .ready_batches
                .fetch_sub(1, Ordering::Relaxed);
            *remaining -= 1;
            Some(Ok(batch))
        }
        Some(Err(e)) => {
            shared
                .counters
                .ready_batches
                .fetch_sub(1, Ordering::Relaxed);
            *remaining = 0;
            Some(Err(e))
        }
        None => {
            let left = std::mem::take(remaining);
            Some(Err(PipelineError::Stopped {
                reason: format!("the engine's stages ended with {left} steps of the epoch left"),
            }))
        }
    }
}

impl Iterator for EpochIter {
    type Item = Result<Batch, PipelineError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.remaining == 0 {
            return None;
        }
        let started = Instant::now();
        let item = self.rx.recv().ok();
        Counters::add_nanos(&self.shared.counters.wait_nanos, started);
        next_item(&mut self.remaining, &self.shared, item)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(self.remaining))
    }
}

/// One replica's batches of one epoch as an async stream; the same items as [`EpochIter`].
pub struct EpochStream {
    rx: flume::r#async::RecvStream<'static, Result<Batch, PipelineError>>,
    remaining: usize,
    shared: Arc<Shared>,
    _inner: Arc<Inner>,
}

impl std::fmt::Debug for EpochStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EpochStream")
            .field("remaining", &self.remaining)
            .finish_non_exhaustive()
    }
}

impl futures_core::Stream for EpochStream {
    type Item = Result<Batch, PipelineError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.remaining == 0 {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.rx).poll_next(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(item) => Poll::Ready(next_item(&mut this.remaining, &this.shared, item)),
        }
    }
}
