//! GPU ranks: the per-step device side of a rank on one GPU, over NCCL, over the same-GPU
//! rehearsal's collective, or (one GPU) no collective at all, and how one is built
//! ([`gpu_rank`]). The launchers that start the driver threads, run the rendezvous and create
//! the NCCL communicators are above, in `train/launch/` (`cuda.rs`, `rehearsal.rs`).
//!
//! A GPU rank ([`CudaDevice`]) feeds its backend from a ring of `--prefetch-depth` device
//! slots (batch k+1 uploads on the copy stream while batch k computes); backward writes each
//! gradient straight into its bucket's range of one flat device buffer, which the NCCL
//! collective averages in place on the communication stream; the fused
//! [`DeviceOptimizer`] keeps f32 master weights on the device; the step's loss and hit
//! counts and the stop wish stay on the device and are summed there, read one step later:
//! a step has no host synchronisation. With `--sync-bn`, the BN layers' sums stay on the
//! device too, summed on a side communicator and stream of their own beside the buckets.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaEvent, CudaSlice, DevicePtr, PinnedHostSlice};
use pipeline::{Pipeline, PipelineError};

use super::{network_config, Device, MicroStep, Rank, TOTALS_LEN};
use crate::cuda::graph::{cuda_graph_from_env, GraphAction, GraphKey, StepCase, StepGraphs};
use crate::cuda::optim::{to_backend_layout, DeviceOptimizer};
use crate::cuda::staged::StagedBackend;
use crate::cuda::staging::device::CudaStaging;
use crate::cuda::staging::feed::{data_wait_line, FeedError, Feeder, HostBatch};
use crate::cuda::staging::pinned::is_pinned;
use crate::cuda::staging::{ExternalBatch, StagingError, StagingRing};
use crate::cuda::timeline::{rows, GpuTimeline};
use crate::cuda::{grad, CudaBackend, CudaTensor, DeviceTotalsAt, GpuDevice};
use crate::dist::collective::{Collective, CollectiveError};
use crate::dist::device_group::{DeviceCollective, HostTarget};
use crate::dist::nccl::{self, DeviceGrads, NcclCollective};
use crate::dist::same_gpu::SameGpuRank;
use crate::dist::single::SingleRank;
use crate::model::{GradHookError, InputBatch, Network, StepStats};
use crate::train::setup::Shared;
use crate::train::TrainError;

/// The step totals of the last two steps: on the device (written by the loss kernels, summed
/// by NCCL) and in page-locked host memory (copied there after the sum), one slot per step.
struct DeviceTotals {
    _device: CudaSlice<f64>,
    base: u64,
    _host: PinnedHostSlice<f64>,
    host: *mut f64,
    slot: usize,
}

// SAFETY: `host` points into `_host`, owned here; it is read only after the event that ends
// the copy into it has completed, and written only by that copy.
unsafe impl Send for DeviceTotals {}

impl DeviceTotals {
    const SLOTS: usize = 2;

    fn new(device: &GpuDevice) -> Result<DeviceTotals, TrainError> {
        let n = Self::SLOTS * TOTALS_LEN;
        let stream = device.stream();
        let dev = stream.alloc_zeros::<f64>(n).map_err(cuda("step totals"))?;
        let base = dev.device_ptr(stream).0;
        // SAFETY: the memory is only ever written by the device before it is read.
        let mut host = unsafe { device.context().alloc_pinned_with_flags::<f64>(n, 0) }
            .map_err(cuda("step totals (host)"))?;
        let ptr = host.as_mut_ptr().map_err(cuda("step totals (host)"))?;
        Ok(DeviceTotals {
            _device: dev,
            base,
            _host: host,
            host: ptr,
            slot: 0,
        })
    }

    fn device_slot(&self) -> u64 {
        self.base + (8 * TOTALS_LEN * self.slot) as u64
    }

    fn host_slot(&self, slot: usize) -> *mut f64 {
        // SAFETY: `slot < SLOTS`, inside the allocation.
        unsafe { self.host.add(TOTALS_LEN * slot) }
    }
}

fn cuda(what: &'static str) -> impl Fn(cudarc::driver::DriverError) -> TrainError {
    move |e| TrainError::Device {
        device: "the GPU".into(),
        reason: format!("{what}: {e}"),
    }
}

type BatchSource = Box<dyn Iterator<Item = Result<HostBatch, PipelineError>> + Send>;

/// The GPU side of a rank, over NCCL or (one GPU) no collective at all.
pub(crate) struct CudaDevice<C> {
    feeder: Feeder<CudaStaging>,
    source: Option<BatchSource>,
    device: Arc<GpuDevice>,
    totals: DeviceTotals,
    ordinal: usize,
    prefetch_depth: usize,
    deferred: bool,
    /// The staged slot of the step's batch (device address, bytes): each micro-batch of a
    /// `--grad-accum-steps` step reads its images from there.
    staged: Option<(u64, usize)>,
    /// `--grad-accum-steps` above 1: the f32 sum of the micro-batches' gradients, beside the
    /// flat buffer the backward writes (kernels/optim.cu `grad_accumulate`), and its address.
    accumulator: Option<(CudaSlice<f32>, u64)>,
    /// `BIRDTRAIN_CUDA_GRAPH=1`: the captured steps, and the key of the step under way.
    graphs: StepGraphs,
    graph_key: Option<GraphKey>,
    _comm: std::marker::PhantomData<fn() -> C>,
}

/// A step's totals on their way: the slot and the event after their copy to the host.
pub(crate) struct PendingTotals {
    slot: usize,
    done: Arc<CudaEvent>,
}

fn feed_error(e: FeedError<PipelineError>) -> TrainError {
    match e {
        FeedError::Source(e) => e.into(),
        FeedError::Staging(e) => TrainError::Device {
            device: "the staging ring".into(),
            reason: e.to_string(),
        },
    }
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

impl<C> Device for CudaDevice<C>
where
    C: Collective<Buffer = DeviceGrads> + GpuCollective,
{
    type Backend = StagedBackend;
    type Comm = C;
    type Optim = DeviceOptimizer;
    type Pending = PendingTotals;
    type Mark = Option<CudaEvent>;

    fn begin_epoch(
        &mut self,
        pipe: &Pipeline,
        epoch: u64,
        rank: usize,
        start_step: usize,
    ) -> Result<(), TrainError> {
        let d = self;
        let source = pipe.epoch(epoch, rank, start_step)?.map(|b| {
            b.map(|b| {
                static WARNED: AtomicBool = AtomicBool::new(false);
                if !is_pinned(b.buffer()) && !WARNED.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "the engine's batch buffer is not pinned: uploads are synchronous"
                    );
                }
                HostBatch::from_engine(b)
            })
        });
        d.source = Some(Box::new(source));
        d.feeder.restart();
        Ok(())
    }

    fn next_batch(
        &mut self,
        net: &Network<StagedBackend>,
        comm: &mut C,
    ) -> Result<Option<(HostBatch, Duration)>, TrainError> {
        let d = self;
        let Some(source) = d.source.as_mut() else {
            return Ok(None);
        };
        let mut timeline = comm.timeline();
        let ready = d
            .feeder
            .next(source, |ring, batch| {
                stage_traced(ring, batch, timeline.as_deref_mut())
            })
            .map_err(feed_error)?;
        let Some(ready) = ready else {
            return Ok(None);
        };
        d.totals.slot = (d.totals.slot + 1) % DeviceTotals::SLOTS;
        d.deferred = false;
        d.staged = None;
        if ready.batch.len > 0 {
            let slot = d.feeder.ring().streams().device_slot(ready.staged.slot);
            let ptr = slot.device_ptr(d.device.stream()).0;
            // SAFETY: the slot's device buffer lives as long as the ring; the ring records the
            // slot's `consumed` event (after every kernel of this step) before it lets the copy
            // stream overwrite it.
            unsafe { net.backend().set_staged(ptr, ready.staged.bytes) };
            d.staged = Some((ptr, ready.staged.bytes));
        }
        Ok(Some((ready.batch, ready.waited)))
    }

    fn before_compute(
        &mut self,
        net: &Network<StagedBackend>,
        stop: bool,
    ) -> Result<(), TrainError> {
        let d = self;
        let at = DeviceTotalsAt {
            addr: d.totals.device_slot(),
            stop,
            add: false,
        };
        // SAFETY: the totals buffer lives as long as this device; the slot is summed and read
        // before it is written again two steps later.
        unsafe { net.backend().defer_loss(at) };
        d.deferred = true;
        Ok(())
    }

    fn begin_micro(
        &mut self,
        net: &Network<StagedBackend>,
        images: Range<usize>,
        image_bytes: usize,
        first: bool,
        stop: bool,
    ) -> Result<(), TrainError> {
        let d = self;
        let (ptr, bytes) = d
            .staged
            .ok_or_else(|| TrainError::Internal("a micro-batch without a staged batch".into()))?;
        let (start, len) = (images.start * image_bytes, images.len() * image_bytes);
        if start + len > bytes {
            return Err(TrainError::Internal(format!(
                "micro-batch images {images:?} of {image_bytes} bytes past the staged {bytes} bytes"
            )));
        }
        // SAFETY: inside the staged slot (checked above), under `next_batch`'s guarantee.
        unsafe { net.backend().set_staged(ptr + start as u64, len) };
        let at = DeviceTotalsAt {
            addr: d.totals.device_slot(),
            stop,
            add: !first,
        };
        // SAFETY: as in `before_compute`.
        unsafe { net.backend().defer_loss(at) };
        d.deferred = true;
        Ok(())
    }

    fn after_compute(&mut self, net: &Network<StagedBackend>) -> Result<(), TrainError> {
        net.backend().clear_staged();
        self.feeder.done().map_err(|e| TrainError::Device {
            device: "the staging ring".into(),
            reason: e.to_string(),
        })
    }

    fn accumulate_gradient(
        &mut self,
        grads: &mut DeviceGrads,
        range: Range<usize>,
        grad: &CudaTensor,
        micro: MicroStep,
    ) -> Result<(), GradHookError> {
        // The backward wrote this micro-batch's gradient into its range of the buffer (a
        // view, as for `place_gradient`); the sum so far is in the accumulator beside it.
        let at = grads.ptr + 4 * range.start as u64;
        if grad.device_address() != at || range.end > grads.len {
            return Err(format!(
                "a gradient at {:#x} is not the view of its bucket range {range:?} at {at:#x}",
                grad.device_address()
            )
            .into());
        }
        let (_, base) = self
            .accumulator
            .as_ref()
            .ok_or("a micro-batch's gradient on a GPU rank built without an accumulator")?;
        let mode = grad::AccumulateMode::of(micro.first, micro.last_images);
        grad::accumulate(
            &self.device,
            base + 4 * range.start as u64,
            at,
            range.len(),
            micro.weight,
            mode,
        )
        .map_err(|e| e.to_string())?;
        Ok(())
    }

    fn place_gradient(
        grads: &mut DeviceGrads,
        range: Range<usize>,
        grad: &CudaTensor,
    ) -> Result<(), GradHookError> {
        // Backward wrote it there: the gradient tensors are views of the buffer.
        let want = grads.ptr + 4 * range.start as u64;
        if grad.device_address() != want || range.end > grads.len {
            return Err(format!(
                "a gradient at {:#x} is not the view of its bucket range {range:?} at {want:#x}",
                grad.device_address()
            )
            .into());
        }
        Ok(())
    }

    fn zero_gradients(&mut self, grads: &mut DeviceGrads) -> Result<(), TrainError> {
        let stream = self.device.stream();
        // SAFETY: the arena holds `len` f32 (the network owns it); on the compute stream, in
        // order with every kernel that touches it.
        unsafe {
            cudarc::driver::result::memset_d8_async(grads.ptr, 0, 4 * grads.len, stream.cu_stream())
        }
        .map_err(cuda("zeroing the gradient buffer"))
    }

    fn host_gradients(_grads: &DeviceGrads) -> Result<Option<&[f32]>, TrainError> {
        Ok(None)
    }

    fn start_totals(
        &mut self,
        net: &Network<StagedBackend>,
        comm: &mut C,
        _local: &StepStats,
        stop: bool,
        _had_images: bool,
    ) -> Result<PendingTotals, TrainError> {
        let d = self;
        let at = d.totals.device_slot();
        if !d.deferred {
            // SAFETY: as in `before_compute`.
            unsafe { net.backend().inner().empty_step_totals(at, stop) }?;
        }
        let slot = d.totals.slot;
        // SAFETY: device slot and host slot hold TOTALS_LEN f64 each and are not touched until
        // the returned event has completed (the next use of this slot is two steps later,
        // after `finish_totals`).
        let done = unsafe { comm.sum_on_device(at, TOTALS_LEN, d.totals.host_slot(slot)) }?;
        Ok(PendingTotals { slot, done })
    }

    fn finish_totals(
        &mut self,
        comm: &mut C,
        pending: PendingTotals,
    ) -> Result<[f64; TOTALS_LEN], TrainError> {
        comm.wait_device_sum(&pending.done)?;
        let mut out = [0.0; TOTALS_LEN];
        // SAFETY: the copy into this host slot completed (the event above).
        let src =
            unsafe { std::slice::from_raw_parts(self.totals.host_slot(pending.slot), TOTALS_LEN) };
        out.copy_from_slice(src);
        Ok(out)
    }

    fn mark(&mut self, comm: &mut C) -> Result<Option<CudaEvent>, TrainError> {
        match comm.timeline() {
            Some(t) => t.begin(self.device.stream()).map_err(cuda("trace event")),
            None => Ok(None),
        }
    }

    fn span(
        &mut self,
        comm: &mut C,
        start: Option<CudaEvent>,
        name: &str,
    ) -> Result<(), TrainError> {
        let stream = self.device.stream().clone();
        match comm.timeline() {
            Some(t) => t
                .end(start, &stream, name, "compute", rows::COMPUTE)
                .map_err(cuda("trace event")),
            None => Ok(()),
        }
    }

    fn end_step(
        &mut self,
        comm: &mut C,
        waited: Duration,
        total: Duration,
    ) -> Result<(), TrainError> {
        self.feeder.record(waited, total);
        // How long the GPU waited for the uploads it has got past (no host wait).
        self.feeder
            .ring_mut()
            .measure_waits()
            .map_err(|e| feed_error(FeedError::Staging(e)))?;
        if let Some(t) = comm.timeline() {
            t.flush().map_err(cuda("trace flush"))?;
        }
        Ok(())
    }

    fn input_line(&self, rank: usize) -> Option<String> {
        let d = self;
        Some(data_wait_line(
            rank,
            d.ordinal,
            &d.feeder.meter(),
            &d.feeder.ring().stats(),
            d.prefetch_depth,
        ))
    }

    fn graph_action(&mut self, comm: &mut C, eligible: bool) -> Result<GraphAction, TrainError> {
        let d = self;
        d.graph_key = None;
        if !d.graphs.enabled() {
            return Ok(GraphAction::Eager);
        }
        // --trace records events between the step's parts: not inside a capture.
        let traced = comm.timeline().is_some();
        let Some((input, _)) = d.staged else {
            return Ok(GraphAction::Eager);
        };
        let key = GraphKey {
            input,
            totals: d.totals.device_slot(),
        };
        let action = d
            .graphs
            .decide(StepCase {
                eligible: eligible && !traced,
                key,
                allocated: d.device.allocated_bytes(),
            })
            .map_err(|e| graph_failure(d.ordinal, e))?;
        if action != GraphAction::Eager {
            d.graph_key = Some(key);
        }
        Ok(action)
    }

    fn preload_step(
        &mut self,
        net: &Network<StagedBackend>,
        opt: &mut DeviceOptimizer,
        input: &InputBatch<'_>,
        lr: f32,
        stop: bool,
    ) -> Result<(), TrainError> {
        let smoothing = net.config().label_smoothing;
        net.backend()
            .preload_step(input, smoothing, stop)
            .map_err(|e| graph_failure(self.ordinal, e))?;
        opt.preload_step(lr)
            .map_err(|e| graph_failure(self.ordinal, e))
    }

    fn begin_capture(&mut self) -> Result<(), TrainError> {
        self.graphs
            .begin_capture()
            .map_err(|e| graph_failure(self.ordinal, e))
    }

    fn end_capture(&mut self, keep: bool) -> Result<(), TrainError> {
        let key = self.graph_key.ok_or_else(|| {
            TrainError::Internal("a CUDA graph capture without its step's key".into())
        })?;
        self.graphs
            .end_capture(key, keep)
            .map_err(|e| graph_failure(self.ordinal, e))
    }

    fn replay(
        &mut self,
        net: &mut Network<StagedBackend>,
        opt: &mut DeviceOptimizer,
        images: usize,
        replayed: bool,
    ) -> Result<(), TrainError> {
        let key = self.graph_key.ok_or_else(|| {
            TrainError::Internal("a CUDA graph replay without its step's key".into())
        })?;
        self.graphs
            .replay(key)
            .map_err(|e| graph_failure(self.ordinal, e))?;
        if replayed {
            net.replayed_train_step(images);
            opt.replayed_step();
        }
        Ok(())
    }

    fn end_graph_step(&mut self, net: &Network<StagedBackend>) {
        net.backend().end_preload();
        self.graph_key = None;
    }
}

/// A failure of the CUDA graph path, naming the GPU (the message names the switch).
fn graph_failure(ordinal: usize, e: impl std::fmt::Display) -> TrainError {
    TrainError::Device {
        device: format!("cuda:{ordinal}"),
        reason: e.to_string(),
    }
}

/// What a GPU rank needs of its collective besides [`Collective`]: the device-side sum of the
/// step totals and the trace timeline. NCCL, or nothing for a single GPU without NCCL.
pub(crate) trait GpuCollective {
    /// See [`NcclCollective::sum_on_device`].
    ///
    /// # Safety
    /// As [`NcclCollective::sum_on_device`].
    unsafe fn sum_on_device(
        &mut self,
        ptr: u64,
        len: usize,
        host: *mut f64,
    ) -> Result<Arc<CudaEvent>, TrainError>;

    /// Waits for an event of [`GpuCollective::sum_on_device`].
    fn wait_device_sum(&self, event: &CudaEvent) -> Result<(), TrainError>;

    /// The `--trace` timeline of this GPU.
    fn timeline(&mut self) -> Option<&mut GpuTimeline>;
}

impl GpuCollective for NcclCollective {
    unsafe fn sum_on_device(
        &mut self,
        ptr: u64,
        len: usize,
        host: *mut f64,
    ) -> Result<Arc<CudaEvent>, TrainError> {
        NcclCollective::sum_on_device(self, ptr, len, host, "step totals sum")
            .map_err(|e| CollectiveError::from(e).into())
    }

    fn wait_device_sum(&self, event: &CudaEvent) -> Result<(), TrainError> {
        NcclCollective::wait_device_sum(self, event).map_err(|e| CollectiveError::from(e).into())
    }

    fn timeline(&mut self) -> Option<&mut GpuTimeline> {
        self.timeline_mut()
    }
}

impl GpuCollective for SingleRank<DeviceGrads> {
    unsafe fn sum_on_device(
        &mut self,
        ptr: u64,
        len: usize,
        host: *mut f64,
    ) -> Result<Arc<CudaEvent>, TrainError> {
        let device = self
            .device
            .clone()
            .ok_or_else(|| TrainError::Internal("a GPU rank without its device".into()))?;
        let stream = device.stream();
        // One rank: the sum is the values; copy them to the host after the compute work.
        let dst = std::slice::from_raw_parts_mut(host, len);
        cudarc::driver::result::memcpy_dtoh_async(dst, ptr, stream.cu_stream())
            .map_err(cuda("copy the step totals"))?;
        // The host waits on it: blocking sync, so no core spins per rank.
        let done = Arc::new(nccl::host_wait_event(stream).map_err(cuda("record the step totals"))?);
        done.record(stream)
            .map_err(cuda("record the step totals"))?;
        Ok(done)
    }

    fn wait_device_sum(&self, event: &CudaEvent) -> Result<(), TrainError> {
        event
            .synchronize()
            .map_err(cuda("wait for the step totals"))
    }

    fn timeline(&mut self) -> Option<&mut GpuTimeline> {
        self.timeline.as_mut()
    }
}

impl GpuCollective for DeviceCollective<SameGpuRank> {
    unsafe fn sum_on_device(
        &mut self,
        ptr: u64,
        len: usize,
        host: *mut f64,
    ) -> Result<Arc<CudaEvent>, TrainError> {
        Ok(self.start_device_sum(ptr, len, HostTarget(host), "step totals sum")?)
    }

    fn wait_device_sum(&self, event: &CudaEvent) -> Result<(), TrainError> {
        Ok(DeviceCollective::wait_device_sum(self, |m| {
            std::ptr::eq(Arc::as_ptr(m), event)
        })?)
    }

    fn timeline(&mut self) -> Option<&mut GpuTimeline> {
        self.timeline_mut()
    }
}

/// A refused setting: `flag` with `value`, and what to give instead.
pub(crate) fn config_error(
    flag: &'static str,
    value: impl ToString,
    hint: impl ToString,
) -> TrainError {
    TrainError::InvalidConfig {
        flag,
        value: value.to_string(),
        hint: hint.to_string(),
    }
}

/// Where a GPU rank is and how it reaches the others.
pub(crate) struct GpuRankSpec<'a> {
    pub rank: usize,
    pub local_index: usize,
    pub ordinal: usize,
    /// Aborts every communicator of the process when this rank fails before its collective
    /// exists (returning the error does too; this is the earliest moment).
    pub abort_early: &'a dyn Fn(&str),
}

/// Builds the GPU rank of `spec`: its backend on the device, its collective from `make_comm`,
/// its replica with the gradients as views of one flat buffer, its staging ring and step
/// totals, its device optimizer. A failure aborts the others first (before the collective
/// exists through `spec`'s `abort_early`, then through the collective).
pub(crate) fn gpu_rank<C>(
    shared: &Shared,
    spec: GpuRankSpec<'_>,
    make_comm: impl FnOnce(&Arc<GpuDevice>) -> Result<C, TrainError>,
) -> Result<Rank<CudaDevice<C>>, TrainError>
where
    C: Collective<Buffer = DeviceGrads> + GpuCollective,
{
    let GpuRankSpec {
        rank,
        local_index,
        ordinal,
        abort_early,
    } = spec;
    let cfg = &shared.cfg;
    let dist = &cfg.dist;
    let graphs = match cuda_graph_from_env() {
        Ok(on) => on,
        Err(e) => {
            let e = graph_failure(ordinal, e);
            abort_early(&format!("rank {rank} failed: {e}"));
            return Err(e);
        }
    };
    let backend = match CudaBackend::new(ordinal) {
        Ok(b) => b,
        Err(e) => {
            let e = TrainError::Device {
                device: format!("cuda:{ordinal}"),
                reason: e.to_string(),
            };
            abort_early(&format!("rank {rank} failed: {e}"));
            return Err(e);
        }
    };
    let device = backend.device().clone();
    // The optimizer works on the same device and stream as the network.
    let opt_backend = backend.clone();
    // Before the network's allocations: a collective that connects (the sync-BN side
    // communicator) takes its memory first.
    let comm = match make_comm(&device) {
        Ok(c) => c,
        Err(e) => {
            abort_early(&format!("rank {rank} failed: {e}"));
            return Err(e);
        }
    };
    let built = (|| -> Result<_, TrainError> {
        let mut net = Network::new(
            StagedBackend::new(backend),
            &shared.graph,
            shared.network_batch(),
            cfg.image_size,
        )?;
        net.set_config(network_config(cfg));
        let plan = &shared.bucket_plan;
        let ranges: Vec<Range<usize>> = (0..plan.param_count())
            .map(|i| plan.param_elements(i))
            .collect();
        let base = net
            .flatten_gradients(plan.total_elements(), &ranges)?
            .ok_or_else(|| TrainError::Internal("the CUDA backend has tensor views".into()))?;
        let grads = DeviceGrads {
            ptr: base,
            len: plan.total_elements(),
        };
        // A slot holds the engine's batch: one step of this rank, all its micro-batches.
        let slot_bytes = shared.engine_batch() * (cfg.image_size as usize).pow(2) * 3;
        let staging = CudaStaging::new(
            device.context(),
            device.stream().clone(),
            dist.prefetch_depth,
            slot_bytes,
        )
        .map_err(cuda("allocating the staging ring"))?;
        let ring = StagingRing::new(staging)
            .map_err(|e| config_error("--prefetch-depth", dist.prefetch_depth, e))?;
        let accumulator = match cfg.grad_accum_steps > 1 {
            true => {
                let stream = device.stream();
                let acc = stream
                    .alloc_zeros::<f32>(grads.len.max(1))
                    .map_err(cuda("the gradient accumulator"))?;
                let base = acc.device_ptr(stream).0;
                Some((acc, base))
            }
            false => None,
        };
        let gpu = CudaDevice::<C> {
            feeder: Feeder::new(ring),
            source: None,
            totals: DeviceTotals::new(&device)?,
            device: device.clone(),
            ordinal,
            prefetch_depth: dist.prefetch_depth,
            deferred: false,
            staged: None,
            accumulator,
            graphs: StepGraphs::new(device.stream().clone(), graphs),
            graph_key: None,
            _comm: std::marker::PhantomData,
        };
        Ok((net, grads, gpu))
    })();
    let (net, grads, gpu) = match built {
        Ok(b) => b,
        Err(e) => {
            comm.abort(&format!("rank {rank} failed: {e}"));
            return Err(e);
        }
    };
    let params = shared.graph.params();
    Rank::new(shared, rank, local_index, gpu, comm, grads, net, |flat| {
        DeviceOptimizer::new(
            &opt_backend,
            shared.kind,
            shared.hyper,
            params,
            &to_backend_layout(params, flat),
        )
        .map_err(|e| TrainError::Device {
            device: format!("cuda:{ordinal}"),
            reason: e.to_string(),
        })
    })
}
