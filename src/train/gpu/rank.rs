//! One GPU's driver thread: staging, forward/backward, bucketed NCCL all-reduce, the fused
//! optimizer, and (rank 0) validation, metrics and checkpoints.
//!
//! Per step, in stream order:
//! 1. the feeder stages batch k+D−1 on the copy stream (after the compute that last read its
//!    slot) and hands batch k to compute, whose stream waits for its upload;
//! 2. a one-value all-reduce gives the step's global image count (a short last batch may be
//!    split unevenly; a rank's gradient is then weighted by its share);
//! 3. forward and backward on the compute stream, the input kernel reading the device slot
//!    (with `--sync-bn`, every BN layer sums its statistics over the ranks through a small
//!    host-side NCCL exchange, [`Network::train_step_synced`]);
//! 4. backward runs through [`Network::train_step_with`]: as soon as a parameter's gradient
//!    kernel is enqueued, the hook copies it (scaled by this rank's share of the step's images
//!    when the split is uneven) into its range of the flat bucket buffer on the compute stream
//!    and reports it to [`GradientSync`], which all-reduces each bucket on the NCCL stream as
//!    soon as it is complete — while backward goes on computing the earlier layers;
//! 5. the compute stream waits for the last bucket, the averaged gradients are copied back
//!    into the network's gradient tensors and the fused optimizer updates every parameter in
//!    one launch.
//!
//! Why a flat buffer and copies rather than all-reducing the gradient tensors in place: the
//! CUDA backend allocates each gradient as its own tensor, and one NCCL call per bucket needs
//! one contiguous range. The two device-to-device copies move 2 × 4 bytes per parameter
//! (≈ 0.2 GB for resnet50, ≈ 0.1 ms at H100 bandwidth), small against the step, and keep
//! the backend's allocation untouched. The flat buffer is not event-tracked by cudarc (the
//! backend's context disables tracking), so the only ordering is the explicit one: bucket-ready
//! events (compute → comm) and the last bucket's done event (comm → compute) — a copy into
//! bucket k+1's range never waits for bucket k's all-reduce.
//! 6. a small all-reduce sums the step's loss and hits and agrees on stopping (Ctrl-C on any
//!    rank stops every rank after the same step); every [`super::CHECKSUM_EVERY`] steps and at
//!    the end of every epoch rank 0's weight checksum is broadcast and every rank compares its
//!    own.

use std::cell::RefCell;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use pipeline::Batch;

use super::feed::{FeedError, Feeder, HostBatch};
use super::layout::from_backend_layout;
use super::pinned::is_pinned;
use super::report::{
    checksum_due, checksum_from_f64, checksum_to_f64, compare_checksum, data_wait_line,
    pack_totals, unpack_totals, TOTALS_LEN,
};
use super::staged::StagedBackend;
use super::Shared;
use crate::cuda::optim::{to_backend_layout, DeviceOptimizer, DeviceState};
use crate::cuda::{CudaBackend, CudaTensor};
use crate::dist::buckets::{specs_from_numel, BucketPlan};
use crate::dist::cuda_staging::CudaStaging;
use crate::dist::gpu_trace::{rows, GpuTimeline};
use crate::dist::nccl::{Communicator, GradientSync};
use crate::dist::ranks::RankContext;
use crate::dist::staging::{ExternalBatch, StagingError, StagingRing};
use crate::dist::watchdog::Watchdog;
use crate::model::{
    BnAllReduce, GradHookError, InputBatch, Network, NetworkConfig, StepStats, SyncEvent,
};
use crate::train::augment::augments_for;
use crate::train::checkpoint::{write_checkpoint, DataPosition, DatasetStamp};
use crate::train::evaluate::evaluate;
use crate::train::metrics::MetricsSplit;
use crate::train::metrics::{append_metrics, read_metrics, EpochMetrics, MetricsAccumulator};
use crate::train::progress::EpochBar;
use crate::train::report::write_report;
use crate::train::resume::checkpoint_meta;
use crate::train::run::{check_finite_state, check_loss, check_valid_loss, optimizer_kind};
use crate::train::TrainError;

/// What a driver thread reports when it ends.
#[derive(Debug, Clone)]
pub(crate) struct RankReport {
    /// xxh3-64 of its final f32 master weights.
    pub(crate) checksum: u64,
    /// Cross-rank checksum comparisons passed.
    pub(crate) checks_passed: u64,
    /// The printed data-wait line.
    pub(crate) data_wait_line: String,
    /// Stopped before the last epoch ended.
    pub(crate) interrupted: bool,
    /// Where training stands.
    pub(crate) position: DataPosition,
    /// The last validation line (rank 0).
    pub(crate) last_valid: Option<EpochMetrics>,
}

/// An engine batch as the staging ring's external buffer.
struct EngineBatch {
    /// Owns the (pinned) buffer `ptr` points into; returns it to the engine's pool on drop.
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

fn host_batch(batch: Batch) -> HostBatch {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !is_pinned(batch.buffer()) && !WARNED.swap(true, Ordering::Relaxed) {
        tracing::warn!("the engine's batch buffer is not pinned: uploads are synchronous");
    }
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

/// Small all-reduces and broadcasts on the NCCL stream (step totals, stop flag, checksums),
/// bounded by their own watchdog.
struct Agreement {
    stream: Arc<CudaStream>,
    buf: CudaSlice<f64>,
    watchdog: Watchdog,
    limit: Duration,
}

impl Agreement {
    /// Room for `capacity` values per exchange (at least the step totals).
    fn new(comm: &Communicator, timeout: Duration, capacity: usize) -> anyhow::Result<Self> {
        let stream = comm.stream().clone();
        Ok(Agreement {
            buf: stream
                .alloc_zeros::<f64>(capacity.max(TOTALS_LEN))
                .context("allocating the step-totals buffer")?,
            watchdog: comm.watchdog(timeout),
            limit: timeout + Duration::from_secs(5),
            stream,
        })
    }

    /// Sums `values` over every rank (`root: None`) or takes rank `root`'s.
    fn exchange(
        &mut self,
        comm: &Communicator,
        values: &[f64],
        root: Option<usize>,
        what: &str,
    ) -> anyhow::Result<Vec<f64>> {
        anyhow::ensure!(
            values.len() <= self.buf.len(),
            "{what}: {} values exceed the exchange buffer of {}",
            values.len(),
            self.buf.len()
        );
        let mut view = self.buf.slice_mut(0..values.len());
        self.stream.memcpy_htod(values, &mut view)?;
        match root {
            None => comm.all_reduce_sum_in_place(&mut view)?,
            Some(r) => comm.broadcast_in_place(&mut view, r)?,
        }
        let done = Arc::new(self.stream.record_event(None)?);
        let probe = done.clone();
        self.watchdog.watch(what.to_string(), move || {
            probe.try_is_complete().map_err(|e| e.to_string())
        })?;
        self.watchdog.wait_idle(self.limit)?;
        let out = self.stream.clone_dtoh(&self.buf.slice(0..values.len()))?;
        self.stream.synchronize()?;
        Ok(out)
    }
}

/// Multiplies the f32 values of `buf` by `alpha` on `stream` (cuBLAS sscal).
fn scale_in_place(
    blas: &cudarc::cublas::CudaBlas,
    stream: &Arc<CudaStream>,
    buf: &mut impl DevicePtrMut<f32>,
    alpha: f32,
) -> anyhow::Result<()> {
    use cudarc::cublas::sys;
    let n = i32::try_from(buf.len()).context("gradient buffer exceeds cuBLAS's 32-bit length")?;
    let (ptr, _record) = buf.device_ptr_mut(stream);
    // SAFETY: `ptr` addresses `buf.len()` f32 values on this device; the handle runs on
    // `stream` (the compute stream), after the kernels that wrote them.
    let status = unsafe { sys::cublasSscal_v2(*blas.handle(), n, &alpha, ptr as *mut f32, 1) };
    anyhow::ensure!(
        status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS,
        "cublasSscal failed: {status:?}"
    );
    Ok(())
}

fn pipeline_error(e: FeedError<pipeline::PipelineError>) -> anyhow::Error {
    match e {
        FeedError::Source(e) => TrainError::from(e).into(),
        FeedError::Staging(e) => anyhow::Error::new(e),
    }
}

/// What the gradient-ready hook needs: it stages each finished gradient into the flat bucket
/// buffer and lets [`GradientSync`] launch every bucket that became complete.
struct BucketLauncher<'a> {
    sync: &'a mut GradientSync,
    /// The small host-value all-reduces (synchronised BN statistics).
    agree: &'a mut Agreement,
    grads: &'a mut CudaSlice<f32>,
    /// Present when `share != 1`.
    blas: Option<&'a cudarc::cublas::CudaBlas>,
    stream: &'a Arc<CudaStream>,
    /// This rank's images × ranks / the step's images (1 for an even split).
    share: f32,
}

impl BucketLauncher<'_> {
    /// Parameter `param`'s gradient kernel is enqueued on the compute stream: copy it (after
    /// that kernel, same stream) into its range, scale it, report it.
    fn gradient_ready(&mut self, param: usize, grad: &CudaTensor) -> anyhow::Result<()> {
        let range = self.sync.plan().param_elements(param);
        let src = grad
            .f32_slice()
            .ok_or_else(|| anyhow::anyhow!("gradient {param} is not f32"))?;
        anyhow::ensure!(
            src.len() >= range.len(),
            "gradient {param} has {} values, the bucket plan expects {}",
            src.len(),
            range.len()
        );
        let mut dst = self.grads.slice_mut(range.clone());
        self.stream
            .memcpy_dtod(&src.slice(0..range.len()), &mut dst)?;
        if self.share != 1.0 {
            let blas = self
                .blas
                .ok_or_else(|| anyhow::anyhow!("uneven split without a cuBLAS handle"))?;
            scale_in_place(blas, self.stream, &mut dst, self.share)?;
        }
        self.sync.grad_ready(self.grads, param)?;
        Ok(())
    }

    /// Sums synchronised-BN statistics over every rank (NCCL, through the host).
    fn bn_sum(&mut self, values: &mut [f64]) -> anyhow::Result<()> {
        let out = self.agree.exchange(
            self.sync.communicator(),
            values,
            None,
            "synchronised batch-norm all-reduce",
        )?;
        values.copy_from_slice(&out);
        Ok(())
    }

    /// A rank without images this step replays a synchronised step's collectives with zeros
    /// (and its zero gradients' bucket launches), in exactly the order a stepping rank issues
    /// them ([`Network::synced_step_events`]).
    fn replay_empty(&mut self, events: &[SyncEvent]) -> anyhow::Result<()> {
        for e in events {
            match *e {
                SyncEvent::BnForward { channels } => {
                    self.bn_sum(&mut vec![0.0; 2 * channels + 1])?
                }
                SyncEvent::BnBackward { channels } => self.bn_sum(&mut vec![0.0; 2 * channels])?,
                SyncEvent::GradReady(p) => {
                    self.sync.grad_ready(self.grads, p)?;
                }
            }
        }
        Ok(())
    }
}

/// [`BnAllReduce`] over the launcher shared with the gradient hook (never re-entered: the
/// network calls one or the other).
struct BnOverNccl<'l, 'a>(&'l RefCell<BucketLauncher<'a>>);

impl BnAllReduce for BnOverNccl<'_, '_> {
    fn sum_in_place(&mut self, values: &mut [f64]) -> Result<(), GradHookError> {
        Ok(self.0.borrow_mut().bn_sum(values)?)
    }
}

/// Everything one rank carries from step to step.
struct Rank<'a> {
    shared: &'a Shared,
    rank: usize,
    /// Index among this node's GPUs (0 traces the node's input engine).
    local_index: usize,
    ordinal: usize,
    net: Network<StagedBackend>,
    stream: Arc<CudaStream>,
    // Declared (so dropped) before `sync`: its watchdog polls the communicator `sync` owns.
    agree: Agreement,
    sync: GradientSync,
    opt: DeviceOptimizer,
    grads: CudaSlice<f32>,
    feeder: Feeder<CudaStaging>,
    blas: Option<cudarc::cublas::CudaBlas>,
    position: DataPosition,
    checks_passed: u64,
}

/// The body of one driver thread.
pub(crate) fn drive(shared: &Shared, ctx: RankContext) -> anyhow::Result<RankReport> {
    let RankContext {
        rank,
        local_index,
        ordinal,
        comm,
        ..
    } = ctx;
    let cfg = &shared.cfg;
    let dist = &shared.dist;
    let graph = &shared.graph;
    let backend = CudaBackend::new(ordinal).with_context(|| format!("opening cuda:{ordinal}"))?;
    let mut net = Network::new(
        StagedBackend::new(backend),
        graph,
        cfg.batch_size,
        cfg.image_size,
    )
    .map_err(TrainError::from)?;
    net.set_config(NetworkConfig {
        label_smoothing: cfg.label_smoothing,
        freeze_bn: cfg.freeze_bn,
        ..NetworkConfig::default()
    });
    net.load_state(&shared.state).map_err(TrainError::from)?;
    // Every op of the backend runs on its one stream: that is the compute stream here.
    let stream = net.backend().device().stream().clone();
    let device_ctx = net.backend().device().context().clone();
    let names: Vec<(String, usize)> = graph
        .params()
        .iter()
        .map(|p| (p.name.clone(), p.numel()))
        .collect();
    let plan =
        BucketPlan::new(&specs_from_numel(&names, 4), dist.bucket_settings()).map_err(|e| {
            TrainError::InvalidConfig {
                flag: "--bucket-mb",
                value: dist.bucket_mb.to_string(),
                hint: e.to_string(),
            }
        })?;
    let mut sync = GradientSync::new(comm, stream.clone(), plan, dist.collective_timeout())?;
    if shared.trace.is_enabled() {
        let timeline = GpuTimeline::new(shared.trace.clone(), rank as u32, &stream)?;
        sync.set_timeline(Some(timeline));
    }
    // --sync-bn exchanges Σx, Σx² and the rows of the widest BN layer (2c + 1 values).
    let widest_bn = graph
        .nodes()
        .iter()
        .filter_map(|n| match n {
            crate::model::Node::BatchNorm { channels, .. } => Some(*channels),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    let agree = Agreement::new(
        sync.communicator(),
        dist.collective_timeout(),
        2 * widest_bn + 1,
    )?;

    // Rank 0's initial weights everywhere (same seed gives the same init, but --init-from or a
    // checkpoint read on one node only must not be trusted to agree).
    let mut weights = stream.clone_htod(&shared.state.flat_params())?;
    sync.broadcast_weights(&mut weights)?;
    let flat = stream.clone_dtoh(&weights)?;
    stream.synchronize()?;
    drop(weights);
    net.set_params_f32(&flat).map_err(TrainError::from)?;
    let mut opt = DeviceOptimizer::new(
        net.backend().inner(),
        optimizer_kind(cfg),
        shared.hyper,
        graph.params(),
        &to_backend_layout(graph.params(), &flat),
    )?;
    if let Some(host) = &shared.optimizer {
        // Every rank reads the same checkpoint file, so the state agrees across ranks as the
        // (broadcast) weights do.
        opt.load_state(&DeviceState::from_host(graph.params(), host))
            .context("loading the checkpoint's optimizer state onto the GPU")?;
    }
    let grads = stream.alloc_zeros::<f32>(sync.plan().total_elements().max(1))?;
    let slot_bytes = cfg.batch_size * (cfg.image_size as usize).pow(2) * 3;
    let staging = CudaStaging::new(&device_ctx, stream.clone(), dist.prefetch_depth, slot_bytes)
        .context("allocating the staging ring")?;
    let feeder = Feeder::new(StagingRing::new(staging)?);
    let mut me = Rank {
        shared,
        rank,
        local_index,
        ordinal,
        net,
        stream,
        sync,
        agree,
        opt,
        grads,
        feeder,
        blas: None,
        position: shared.position.clone(),
        checks_passed: 0,
    };
    let (interrupted, last_valid) = me.train()?;
    let master = me.opt.master()?;
    let checksum = crate::dist::checksum(&master);
    let meter = me.feeder.meter();
    let staging = me.feeder.ring().stats();
    let line = data_wait_line(rank, ordinal, &meter, &staging, dist.prefetch_depth);
    Ok(RankReport {
        checksum,
        checks_passed: me.checks_passed,
        data_wait_line: line,
        interrupted,
        position: me.position,
        last_valid,
    })
}

impl Rank<'_> {
    fn is_writer(&self) -> bool {
        self.rank == 0
    }

    /// The epochs; returns (interrupted, last validation line).
    fn train(&mut self) -> anyhow::Result<(bool, Option<EpochMetrics>)> {
        let cfg = &self.shared.cfg;
        let mut last_valid = None;
        while self.position.epoch < cfg.epochs {
            let epoch = self.position.epoch;
            let (finished, stop) = self.epoch()?;
            if !finished {
                if self.is_writer() {
                    self.save_checkpoint()?;
                    if cfg.verbose {
                        println!(
                            "stopped at epoch {}, step {} of {}: checkpoint saved in {}",
                            epoch + 1,
                            self.position.step_in_epoch,
                            self.shared.steps_per_epoch,
                            cfg.out.display()
                        );
                    }
                }
                return Ok((true, last_valid));
            }
            // Every epoch ends with a cross-rank comparison, however short the epoch.
            if !checksum_due(self.position.global_step, self.shared.checksum_every) {
                self.compare_checksums()?;
            }
            let train_line = self
                .position
                .partial_train
                .finish(epoch + 1, MetricsSplit::Train);
            self.position = DataPosition {
                epoch: epoch + 1,
                step_in_epoch: 0,
                samples_in_epoch: 0,
                global_step: self.position.global_step,
                partial_train: MetricsAccumulator::default(),
            };
            if self.is_writer() {
                last_valid = Some(self.end_epoch(&train_line, epoch + 1)?);
            }
            if cfg.verbose {
                let meter = self.feeder.meter();
                println!(
                    "{}",
                    data_wait_line(
                        self.rank,
                        self.ordinal,
                        &meter,
                        &self.feeder.ring().stats(),
                        self.shared.dist.prefetch_depth
                    )
                );
            }
            let stop_step = cfg
                .stop_after_steps
                .is_some_and(|n| self.position.global_step >= n);
            if stop || stop_step {
                return Ok((self.position.epoch < cfg.epochs, last_valid));
            }
        }
        Ok((false, last_valid))
    }

    /// Validation, metrics, checkpoint and report after an epoch (rank 0).
    fn end_epoch(&mut self, train_line: &EpochMetrics, epoch: u64) -> anyhow::Result<EpochMetrics> {
        let cfg = &self.shared.cfg;
        self.net.backend().clear_staged();
        let report = evaluate(&mut self.net, &self.shared.valid_pipe)?;
        let valid_line = report.totals.finish(epoch, MetricsSplit::Valid);
        let step = self.position.global_step;
        check_valid_loss(
            cfg,
            &valid_line,
            step,
            self.shared.schedule.lr_at(step.saturating_sub(1)),
        )?;
        append_metrics(&self.shared.metrics_path, train_line)?;
        append_metrics(&self.shared.metrics_path, &valid_line)?;
        self.save_checkpoint()?;
        write_report(
            &cfg.out.join("report.png"),
            &read_metrics(&self.shared.metrics_path)?,
        )?;
        if cfg.verbose {
            println!(
                "epoch {}/{} · train loss {:.4} acc {:.4} · valid loss {:.4} acc {:.4} top-5 {:.4} · {:.0} images/s · {:.1} s",
                epoch,
                cfg.epochs,
                train_line.loss,
                train_line.accuracy,
                valid_line.loss,
                valid_line.accuracy,
                valid_line.top5,
                train_line.images_per_sec,
                train_line.seconds + valid_line.seconds
            );
        }
        Ok(valid_line)
    }

    /// The rest of the current epoch: (finished, stop agreed on the last step).
    fn epoch(&mut self) -> anyhow::Result<(bool, bool)> {
        let shared = self.shared;
        let cfg = &shared.cfg;
        let steps = shared.steps_per_epoch;
        let epoch = self.position.epoch;
        let start_step = self.position.step_in_epoch.min(steps);
        let bar = EpochBar::new(
            self.is_writer() && cfg.progress && cfg.verbose,
            format!("epoch {}/{} train", epoch + 1, cfg.epochs),
            steps,
            start_step,
        );
        let mut source = shared
            .train_pipe
            .epoch(epoch, self.rank, start_step)
            .map_err(TrainError::from)?
            .map(|b| b.map(host_batch));
        self.feeder.restart();
        let started = Instant::now();
        let seconds_before = self.position.partial_train.seconds;
        let mut images = 0u64;
        let mut stop = false;
        let trace_engine = shared.trace.is_enabled() && self.local_index == 0;
        if trace_engine {
            shared.trace.name_process(ENGINE_PID, "input engine");
            shared
                .trace
                .name_thread(ENGINE_PID, 0, "decode, cache, assembly");
        }
        let mut engine_before = trace_engine.then(|| shared.train_pipe.stats());
        for step in start_step..steps {
            let t_step = Instant::now();
            let waited = {
                let mut timeline = self.sync.timeline_mut();
                let ready = self
                    .feeder
                    .next(&mut source, |ring, batch| {
                        stage_traced(ring, batch, timeline.as_deref_mut())
                    })
                    .map_err(pipeline_error)?;
                let Some(ready) = ready else {
                    return Err(TrainError::InvalidConfig {
                        flag: "--gpus",
                        value: shared.world_size.to_string(),
                        hint: format!(
                            "rank {} ran out of batches at step {step} of {steps} (input engine bug?)",
                            self.rank
                        ),
                    }
                    .into());
                };
                if shared.trace.is_enabled() {
                    shared.trace.record_since(
                        "input wait",
                        "wait",
                        self.rank as u32,
                        rows::HOST,
                        t_step,
                    );
                }
                let global =
                    self.step(&ready.batch, ready.staged.slot, ready.staged.bytes, epoch)?;
                let (totals, agreed_stop) = global;
                // Every rank sees the same summed loss, so all of them stop here together.
                check_loss(
                    cfg,
                    totals.loss_sum,
                    totals.count,
                    self.position.global_step,
                    epoch,
                    shared.schedule.lr_at(self.position.global_step),
                )?;
                stop = agreed_stop;
                self.position.samples_in_epoch += totals.count as u64;
                images += totals.count as u64;
                let acc = &mut self.position.partial_train;
                acc.add(
                    totals.loss_sum,
                    totals.correct_top1 as u64,
                    totals.correct_top5 as u64,
                    totals.count as u64,
                );
                ready.waited
            };
            self.position.global_step += 1;
            self.position.step_in_epoch = step + 1;
            if checksum_due(self.position.global_step, shared.checksum_every) {
                self.compare_checksums()?;
            }
            if let Some(t) = self.sync.timeline_mut() {
                t.flush()?;
            }
            if let Some(before) = &mut engine_before {
                let now = shared.train_pipe.stats();
                shared.trace.record_since(
                    &engine_span_name(before, &now),
                    "engine",
                    ENGINE_PID,
                    0,
                    t_step,
                );
                *before = now;
            }
            self.feeder.record(waited, t_step.elapsed());
            let elapsed = started.elapsed().as_secs_f64();
            let acc = &mut self.position.partial_train;
            acc.seconds = seconds_before + elapsed;
            bar.update(
                step + 1,
                images as f64 / elapsed.max(1e-9),
                acc.mean_loss(),
                acc.accuracy(),
                self.feeder.meter().share(),
            );
            let last = step + 1 == steps;
            let stop_step = cfg
                .stop_after_steps
                .is_some_and(|n| self.position.global_step >= n);
            if !last && (stop || stop_step) {
                bar.finish();
                return Ok((false, stop));
            }
        }
        bar.finish();
        Ok((true, stop))
    }

    /// One step on the batch in `slot`: returns the global step totals and the agreed stop.
    fn step(
        &mut self,
        batch: &HostBatch,
        slot: usize,
        bytes: usize,
        epoch: u64,
    ) -> anyhow::Result<(StepStats, bool)> {
        let shared = self.shared;
        let cfg = &shared.cfg;
        let world = shared.world_size;
        let counts = self.agree.exchange(
            self.sync.communicator(),
            &[batch.len as f64],
            None,
            "image count all-reduce",
        )?;
        let total = counts[0].round() as usize;
        // The all-reduce averages over ranks; the step's gradient is the image-weighted mean,
        // so a rank with a different share of the images scales its own first.
        let share = if total > 0 {
            (batch.len * world) as f32 / total as f32
        } else {
            1.0
        };
        if share != 1.0 && self.blas.is_none() {
            self.blas = Some(cudarc::cublas::CudaBlas::new(self.stream.clone())?);
        }
        self.sync.begin_step()?;
        let sync_bn = shared.dist.sync_bn && !cfg.freeze_bn;
        let span = match self.sync.timeline_mut() {
            Some(t) => t.begin(&self.stream)?,
            None => None,
        };
        let stats = if batch.len > 0 {
            let ptr = {
                let slice = self.feeder.ring().streams().device_slot(slot);
                let (ptr, _sync) = slice.device_ptr(&self.stream);
                ptr
            };
            // SAFETY: the slot's device buffer lives as long as the ring; the ring records the
            // slot's `consumed` event (after every kernel of this step) before it lets the
            // copy stream overwrite it.
            unsafe { self.net.backend().set_staged(ptr, bytes) };
            let augments = cfg.augment.then(|| {
                augments_for(
                    cfg.seed,
                    epoch,
                    &batch.sample_ids[..batch.len],
                    cfg.image_size,
                )
            });
            let input = InputBatch {
                pixels: (*batch.pixels).as_ref(),
                labels: &batch.labels,
                len: batch.len,
                image_size: batch.image_size,
                augment: augments.as_deref(),
            };
            let launcher = RefCell::new(BucketLauncher {
                sync: &mut self.sync,
                agree: &mut self.agree,
                grads: &mut self.grads,
                blas: self.blas.as_ref(),
                stream: &self.stream,
                share,
            });
            let mut bn = BnOverNccl(&launcher);
            let stats = self
                .net
                .train_step_synced(
                    &input,
                    &mut |i, g| {
                        launcher
                            .borrow_mut()
                            .gradient_ready(i, g)
                            .map_err(GradHookError::from)
                    },
                    sync_bn.then_some(&mut bn as &mut dyn BnAllReduce),
                )
                .map_err(TrainError::from);
            self.net.backend().clear_staged();
            stats?
        } else {
            // No images on this rank this step: it contributes zeros to every bucket and, with
            // --sync-bn, to every BN exchange (NCCL needs every rank in every collective, in
            // the same order).
            self.stream.memset_zeros(&mut self.grads)?;
            let events = if sync_bn {
                self.net.synced_step_events()
            } else {
                self.net
                    .grad_ready_order()
                    .into_iter()
                    .map(SyncEvent::GradReady)
                    .collect()
            };
            BucketLauncher {
                sync: &mut self.sync,
                agree: &mut self.agree,
                grads: &mut self.grads,
                blas: self.blas.as_ref(),
                stream: &self.stream,
                share,
            }
            .replay_empty(&events)?;
            StepStats::default()
        };
        self.feeder.done()?;
        if let Some(t) = self.sync.timeline_mut() {
            t.end(
                span,
                &self.stream,
                "forward + backward",
                "compute",
                rows::COMPUTE,
            )?;
        }
        self.finish_gradients()?;
        if total > 0 {
            let lr = shared.schedule.lr_at(self.position.global_step);
            let span = match self.sync.timeline_mut() {
                Some(t) => t.begin(&self.stream)?,
                None => None,
            };
            let (grads, mut params) = self.net.grads_and_params_mut();
            self.opt.step(&grads, &mut params, lr, 1.0)?;
            if let Some(t) = self.sync.timeline_mut() {
                t.end(span, &self.stream, "optimizer", "compute", rows::COMPUTE)?;
            }
        }
        let summed = self.agree.exchange(
            self.sync.communicator(),
            &pack_totals(&stats, shared.stop.load(Ordering::SeqCst)),
            None,
            "step totals all-reduce",
        )?;
        let summed: [f64; TOTALS_LEN] = summed
            .try_into()
            .map_err(|_| anyhow::anyhow!("step totals came back with the wrong length"))?;
        Ok(unpack_totals(summed))
    }

    /// Waits (on the compute stream) for the last bucket and copies the averaged gradients
    /// back into the network's gradient tensors, where the optimizer reads them.
    fn finish_gradients(&mut self) -> anyhow::Result<()> {
        self.sync.finish_step()?;
        let plan = self.sync.plan();
        let ranges: Vec<_> = (0..plan.param_count())
            .map(|i| plan.param_elements(i))
            .collect();
        for (i, g) in self.net.grad_tensors_mut().into_iter().enumerate() {
            let dst = g.f32_mut("gradient sync", "gradient")?;
            let range = ranges[i].clone();
            let n = range.len();
            self.stream
                .memcpy_dtod(&self.grads.slice(range), &mut dst.slice_mut(0..n))?;
        }
        Ok(())
    }

    /// Broadcasts rank 0's weight checksum; every rank compares its own.
    fn compare_checksums(&mut self) -> anyhow::Result<()> {
        let mine = crate::dist::checksum(&self.opt.master()?);
        let reference = self.agree.exchange(
            self.sync.communicator(),
            &checksum_to_f64(mine),
            Some(0),
            "checksum broadcast",
        )?;
        let reference = checksum_from_f64([reference[0], reference[1]]);
        compare_checksum(self.rank, self.position.global_step, mine, reference)?;
        self.checks_passed += 1;
        Ok(())
    }

    /// Writes rank 0's weights (f32 master), its optimizer state (host format) and the sidecar.
    fn save_checkpoint(&mut self) -> anyhow::Result<()> {
        let shared = self.shared;
        let cfg = &shared.cfg;
        let graph = &shared.graph;
        let mut state = self.net.state().map_err(TrainError::from)?;
        let master = from_backend_layout(graph.params(), &self.opt.master()?);
        state.set_flat_params(&master).map_err(TrainError::from)?;
        let lr = shared
            .schedule
            .lr_at(self.position.global_step.saturating_sub(1));
        check_finite_state(cfg, graph, &state, &self.position, lr)?;
        let model_bytes = state
            .to_safetensors_bytes(graph, None)
            .map_err(TrainError::from)?;
        let optim_bytes = self
            .opt
            .state()?
            .to_host(optimizer_kind(cfg), shared.hyper, graph.params())
            .map_err(TrainError::from)?
            .to_safetensors_bytes();
        let meta = checkpoint_meta(
            cfg,
            &shared.classes,
            &DatasetStamp::of(&shared.train_pipe),
            &self.position,
        );
        write_checkpoint(&cfg.out, meta, &model_bytes, &optim_bytes)?;
        Ok(())
    }
}

/// Trace process id of the input engine's row (GPUs use their rank).
const ENGINE_PID: u32 = 10_000;

/// What the engine did during one step, as a trace span name.
fn engine_span_name(before: &pipeline::EngineStats, now: &pipeline::EngineStats) -> String {
    format!(
        "engine: {} decoded · {} cache hits · {:.1} s decode work · ready queue {:.0} % · cache {:.0} % filled",
        now.decoded.saturating_sub(before.decoded),
        now.cache_hits.saturating_sub(before.cache_hits),
        (now.decode_seconds - before.decode_seconds).max(0.0),
        100.0 * now.ready_queue_fill,
        100.0 * now.cache_fill
    )
}

/// Stages one batch, timing its upload on the copy stream when tracing (the span starts when
/// the copy stream reaches it, so it includes the copy's wait for the slot to be consumed).
fn stage_traced(
    ring: &mut StagingRing<CudaStaging>,
    batch: ExternalBatch,
    timeline: Option<&mut GpuTimeline>,
) -> Result<u64, StagingError> {
    let wrap = |e: cudarc::driver::DriverError| StagingError::Streams(Box::new(e));
    let Some(timeline) = timeline else {
        return ring.stage_external(batch);
    };
    let copy = ring.streams().copy_stream().clone();
    let bytes = (*batch).as_ref().len();
    let span = timeline.begin(&copy).map_err(wrap)?;
    let seq = ring.stage_external(batch)?;
    timeline
        .end(
            span,
            &copy,
            format!("H2D batch {seq} ({:.1} MB)", bytes as f64 / 1e6),
            "copy",
            rows::COPY,
        )
        .map_err(wrap)?;
    Ok(seq)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engine_span_names_what_the_engine_did_during_the_step() {
        let before = pipeline::EngineStats {
            decoded: 10,
            cache_hits: 5,
            bad_files: 0,
            batches: 3,
            decode_seconds: 1.0,
            decode_images_per_sec: 0.0,
            consumer_wait_seconds: 0.0,
            decode_queue_fill: 0.0,
            ready_queue_fill: 0.0,
            cache_fill: 0.0,
            elapsed_seconds: 2.0,
        };
        let now = pipeline::EngineStats {
            decoded: 14,
            cache_hits: 9,
            decode_seconds: 1.5,
            ready_queue_fill: 0.5,
            cache_fill: 1.0,
            ..before.clone()
        };
        assert_eq!(
            engine_span_name(&before, &now),
            "engine: 4 decoded · 4 cache hits · 0.5 s decode work · ready queue 50 % · cache 100 % filled"
        );
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
            let host = host_batch(batch);
            assert_eq!((*host.pixels).as_ref(), &pixels[..]);
            assert_eq!(host.labels, labels);
            assert_eq!((host.len, host.image_size), (len, 8));
        }
    }
}
