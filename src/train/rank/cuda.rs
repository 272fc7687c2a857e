//! GPU ranks: one driver thread per GPU, NCCL between them (also across machines).
//!
//! [`launch`] resolves the launch plan (`--gpus`, `--nodes`, `--node-rank`, `--master` or
//! torchrun's variables), runs the rendezvous (node 0 creates the NCCL unique id; a single
//! node just creates it), builds the input engine with a pinned-memory allocator and starts
//! one driver thread per local GPU through [`crate::dist::ranks::run_local_ranks`]. The NCCL
//! communicator is created even for `--gpus 1`, so one GPU takes the same path as many (a
//! single GPU can also run without NCCL: [`crate::dist::DistSettings::nccl`]).
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
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaEvent, CudaSlice, DevicePtr, PinnedHostSlice};
use pipeline::{Pipeline, PipelineError, Split};

use super::cpu::network_config;
use super::{Device, Rank, TOTALS_LEN};
use crate::cuda::optim::{to_backend_layout, DeviceOptimizer};
use crate::cuda::staged::StagedBackend;
use crate::cuda::staging::device::CudaStaging;
use crate::cuda::staging::feed::{data_wait_line, FeedError, Feeder, HostBatch};
use crate::cuda::staging::pinned::{is_pinned, pinned_allocator};
use crate::cuda::staging::{ExternalBatch, StagingError, StagingRing};
use crate::cuda::timeline::{rows, GpuTimeline};
use crate::cuda::{CudaBackend, CudaTensor, GpuDevice};
use crate::dist::collective::{Collective, CollectiveError};
use crate::dist::launch::{self, LaunchPlan};
use crate::dist::nccl::{self, Communicator, DeviceGrads, NcclCollective};
use crate::dist::ranks::{self, RankContext};
use crate::dist::rendezvous::{self, Assignment, NodeInfo};
use crate::dist::single::SingleRank;
use crate::model::{GradHookError, Network, StepStats};
use crate::train::config::TrainConfig;
use crate::train::folder::{CheckpointMeta, RunFolder};
use crate::train::run::{run_rank, Launched, RankReport, StopWish};
use crate::train::setup::{pipeline_for, start_point, Shared};
use crate::train::TrainError;

mod rehearsal;

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
        if ready.batch.len > 0 {
            let slot = d.feeder.ring().streams().device_slot(ready.staged.slot);
            let ptr = slot.device_ptr(d.device.stream()).0;
            // SAFETY: the slot's device buffer lives as long as the ring; the ring records the
            // slot's `consumed` event (after every kernel of this step) before it lets the copy
            // stream overwrite it.
            unsafe { net.backend().set_staged(ptr, ready.staged.bytes) };
        }
        Ok(Some((ready.batch, ready.waited)))
    }

    fn before_compute(
        &mut self,
        net: &Network<StagedBackend>,
        stop: bool,
    ) -> Result<(), TrainError> {
        let d = self;
        // SAFETY: the totals buffer lives as long as this device; the slot is summed and read
        // before it is written again two steps later.
        unsafe { net.backend().defer_loss(d.totals.device_slot(), stop) };
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

fn config_error(flag: &'static str, value: impl ToString, hint: impl ToString) -> TrainError {
    TrainError::InvalidConfig {
        flag,
        value: value.to_string(),
        hint: hint.to_string(),
    }
}

/// The launch plan for `--gpus n` and the distributed settings.
pub(crate) fn launch_plan(n: usize, cfg: &TrainConfig) -> Result<LaunchPlan, TrainError> {
    let flags = cfg
        .dist
        .launch_flags(Some(&n.to_string()))
        .map_err(|e| config_error("--gpus", n, e))?;
    Ok(launch::resolve(
        &flags,
        &launch::process_env,
        &launch::probe_gpus(),
    )?)
}

/// Where a GPU rank is and how it reaches the others.
struct GpuRankSpec<'a> {
    rank: usize,
    local_index: usize,
    ordinal: usize,
    /// Aborts every communicator of the process when this rank fails before its collective
    /// exists (returning the error does too; this is the earliest moment).
    abort_early: &'a dyn Fn(&str),
}

/// Builds the GPU rank of `spec` and runs it to the end.
fn run_gpu_rank<C>(
    shared: &Shared,
    spec: GpuRankSpec<'_>,
    make_comm: impl FnOnce(&Arc<GpuDevice>) -> Result<C, TrainError>,
    stop: &dyn Fn(u64) -> bool,
) -> Result<RankReport, TrainError>
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
        let slot_bytes = shared.network_batch() * (cfg.image_size as usize).pow(2) * 3;
        let staging = CudaStaging::new(
            device.context(),
            device.stream().clone(),
            dist.prefetch_depth,
            slot_bytes,
        )
        .map_err(cuda("allocating the staging ring"))?;
        let ring = StagingRing::new(staging)
            .map_err(|e| config_error("--prefetch-depth", dist.prefetch_depth, e))?;
        let gpu = CudaDevice::<C> {
            feeder: Feeder::new(ring),
            source: None,
            totals: DeviceTotals::new(&device)?,
            device: device.clone(),
            ordinal,
            prefetch_depth: dist.prefetch_depth,
            deferred: false,
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
    let mut r = Rank::new(shared, rank, local_index, gpu, comm, grads, net, |flat| {
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
    })?;
    run_rank(shared, &mut r, stop)
}

/// Runs `f` while a helper thread copies the caller's stop wishes into `local`, which the
/// driver threads (needing `'static` data) poll; an error when the OS refuses that thread.
fn with_stop_bridge<R>(
    stop: &StopWish<'_>,
    ranks: usize,
    rank_offset: usize,
    local: &Arc<Vec<AtomicBool>>,
    f: impl FnOnce() -> R,
) -> Result<R, TrainError> {
    let finished = AtomicBool::new(false);
    std::thread::scope(|s| {
        pipeline::threads::spawn_scoped(s, "stop-bridge", || {
            while !finished.load(Ordering::SeqCst) {
                for i in 0..ranks {
                    if stop(rank_offset + i, u64::MAX) {
                        local[i].store(true, Ordering::SeqCst);
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })?;
        let r = f();
        finished.store(true, Ordering::SeqCst);
        Ok(r)
    })
}

/// A rank's failure as the error the user sees. In a run of several ranks it names the rank
/// and its device (`device` gives a global rank's): the trainer's own errors keep their kind
/// inside [`TrainError::OnRank`] (unless they name the rank already), the rest become a
/// device error of that rank.
fn ranks_error(e: ranks::RanksError, world: usize, device: &dyn Fn(usize) -> String) -> TrainError {
    match e {
        ranks::RanksError::Body { rank, source } => match source.downcast::<TrainError>() {
            Ok(train) if world > 1 => train.on_rank(rank, device(rank)),
            Ok(train) => *train,
            Err(other) => TrainError::Device {
                device: format!("{} (rank {rank})", device(rank)),
                reason: other.to_string(),
            },
        },
        // A refused thread is no fault of the GPUs: its own line and hint (its name,
        // `gpu-O`, gives the device, not the rank).
        ranks::RanksError::Spawn { rank, source } if world > 1 => {
            TrainError::Thread(source).on_rank(rank, device(rank))
        }
        ranks::RanksError::Spawn { source, .. } => TrainError::Thread(source),
        other => TrainError::Device {
            device: "GPUs".into(),
            reason: other.to_string(),
        },
    }
}

/// Trains on `n` GPUs of this node (and those of the other nodes, if any).
pub(crate) fn launch(
    cfg: &TrainConfig,
    n: usize,
    folder: &RunFolder,
    resumed: Option<&(PathBuf, CheckpointMeta)>,
    stop: &StopWish<'_>,
) -> Result<Launched, TrainError> {
    let dist = &cfg.dist;
    if dist.prefetch_depth == 0 {
        return Err(config_error(
            "--prefetch-depth",
            0,
            "use at least 1 staging slot (2 overlaps the copy of batch k+1 with batch k)",
        ));
    }
    if let Some(ranks) = rehearsal::requested()? {
        return rehearsal::launch(cfg, n, ranks, folder, resumed, stop);
    }
    let plan = launch_plan(n, cfg)?;
    for note in &plan.overrides {
        tracing::info!("{note}");
    }
    let first = *plan.devices.first().ok_or_else(|| {
        config_error(
            "--gpus",
            n,
            "no GPU in the launch plan (--gpus 0 trains on the CPU)",
        )
    })?;
    let alone = plan.devices.len() == 1 && plan.nodes == 1;
    let mut notes = Vec::new();
    let use_nccl = match (dist.nccl, alone) {
        (true, _) | (false, false) => match nccl::ensure_available() {
            Ok(_) => true,
            Err(e) if alone => {
                notes.push(format!("one GPU without NCCL ({e})"));
                false
            }
            Err(e) => {
                return Err(TrainError::Device {
                    device: format!("{} GPUs", plan.devices.len()),
                    reason: e.to_string(),
                })
            }
        },
        (false, true) => false,
    };
    // The validation engine also gives the dataset's fingerprint for the rendezvous.
    let valid = pipeline_for(cfg, folder, Split::Valid, 1, None)?;
    let assignment = if use_nccl {
        let me = NodeInfo {
            nodes: plan.nodes,
            node_rank: plan.node_rank,
            local_gpus: plan.devices.len(),
            fingerprint: valid.fingerprint(),
            model: cfg.arch.name().to_string(),
            start: start_point(resumed),
        };
        let master = plan.rendezvous_addr().map(|m| m.to_string());
        rendezvous::rendezvous(master.as_deref(), &me, dist.rendezvous_timeout(), || {
            nccl::new_unique_id().map_err(|e| e.to_string())
        })
        .map_err(|e| TrainError::Device {
            device: format!("node {} of {}", plan.node_rank, plan.nodes),
            reason: format!("rendezvous failed: {e}"),
        })?
    } else {
        Assignment {
            rank_offset: 0,
            world_size: 1,
            node_gpus: vec![1],
            unique_id: Vec::new(),
        }
    };
    let world = assignment.world_size;
    let ctx = cudarc::driver::CudaContext::new(first).map_err(|e| TrainError::Device {
        device: format!("cuda:{first}"),
        reason: e.to_string(),
    })?;
    let allocator = pinned_allocator(ctx);
    let train = pipeline_for(cfg, folder, Split::Train, world, Some(allocator.clone()))?;
    let shared = Arc::new(Shared::new(
        cfg,
        world,
        resumed,
        train,
        valid,
        folder.clone(),
        plan.is_master(),
    )?);
    let devices = format!(
        "{world} GPU(s) on {} node(s){} · prefetch depth {} · buckets of {} MiB · batch norm {}",
        plan.nodes,
        if use_nccl { " via NCCL" } else { "" },
        dist.prefetch_depth,
        dist.bucket_mb,
        if cfg.sync_bn && !cfg.freeze_bn {
            "synchronised across GPUs"
        } else {
            "per GPU"
        }
    );
    if plan.is_master() {
        shared.say_start(&devices, resumed);
    }
    let local_stops: Arc<Vec<AtomicBool>> = Arc::new(
        (0..plan.devices.len())
            .map(|_| AtomicBool::new(false))
            .collect(),
    );
    let timeout = dist.collective_timeout();
    let reports = if use_nccl {
        with_stop_bridge(
            stop,
            plan.devices.len(),
            assignment.rank_offset,
            &local_stops,
            || {
                let body_shared = shared.clone();
                let stops = local_stops.clone();
                ranks::run_local_ranks(&plan, &assignment, dist.rendezvous_timeout(), move |ctx| {
                    let RankContext {
                        rank,
                        local_index,
                        ordinal,
                        comm,
                        aborts,
                        ..
                    } = ctx;
                    let stops = stops.clone();
                    // Every communicator of this process, not only this rank's: the other
                    // local ranks must not wait in their collectives for this one.
                    let abort_early = move |reason: &str| {
                        aborts.fail(rank, reason);
                    };
                    run_gpu_rank(
                        &body_shared,
                        GpuRankSpec {
                            rank,
                            local_index,
                            ordinal,
                            abort_early: &abort_early,
                        },
                        |device| nccl_collective(comm, device, &body_shared, rank, timeout),
                        &move |_| stops[local_index].load(Ordering::SeqCst),
                    )
                    .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
                })
            },
        )?
        .map_err(|e| {
            ranks_error(e, world, &|rank| {
                let ordinal = rank
                    .checked_sub(assignment.rank_offset)
                    .and_then(|local| plan.devices.get(local));
                match ordinal {
                    Some(o) => format!("cuda:{o}"),
                    None => "a GPU of another node".into(),
                }
            })
        })?
    } else {
        let report = run_gpu_rank(
            &shared,
            GpuRankSpec {
                rank: 0,
                local_index: 0,
                ordinal: first,
                abort_early: &|_| {},
            },
            |device| {
                let mut single = SingleRank::new(Some(device.clone()));
                if shared.trace.is_enabled() {
                    match GpuTimeline::new(shared.trace.clone(), 0, device.stream()) {
                        Ok(t) => single.timeline = Some(t),
                        Err(e) => tracing::warn!("no trace timeline: {e}"),
                    }
                }
                Ok(single)
            },
            &|step| stop(0, step),
        )?;
        vec![report]
    };
    let (buffers, bytes) = allocator.allocated();
    notes.push(format!(
        "engine batches assembled in pinned host memory: {buffers} buffer(s), {:.1} MiB",
        bytes as f64 / (1024.0 * 1024.0)
    ));
    Ok(Launched {
        shared,
        reports,
        devices,
        notes,
        writer: plan.is_master(),
    })
}

/// The NCCL collective of a rank, with its trace timeline when tracing, and with `--sync-bn`
/// (batch norm not frozen) the side communicator its BN sums run on, on the device, beside
/// the gradient buckets.
fn nccl_collective(
    comm: Communicator,
    device: &Arc<GpuDevice>,
    shared: &Shared,
    rank: usize,
    timeout: Duration,
) -> Result<NcclCollective, TrainError> {
    let mut c = NcclCollective::new(comm, device.clone(), timeout);
    if shared.trace.is_enabled() {
        match GpuTimeline::new(shared.trace.clone(), rank as u32, device.stream()) {
            Ok(t) => c.set_timeline(Some(t)),
            Err(e) => tracing::warn!("rank {rank}: no trace timeline: {e}"),
        }
    }
    let cfg = &shared.cfg;
    if cfg.sync_bn && !cfg.freeze_bn {
        c.open_side_sums(cfg.dist.rendezvous_timeout())
            .map_err(|e| TrainError::from(CollectiveError::from(e)))?;
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ranks_error_names_the_rank_and_device_once_and_keeps_its_kind() {
        let device = |rank: usize| format!("cuda:{}", rank + 4);
        // A trainer error that does not say where it happened (an out-of-memory of the
        // backend, a refused setting): the rank and its device in front, the kind kept.
        let oom = TrainError::Backend(crate::backend::BackendError::OutOfMemory {
            bytes: 1 << 30,
            what: "activations".into(),
            hint: "--batch-size 64 fits".into(),
        });
        let e = ranks_error(
            ranks::RanksError::Body {
                rank: 1,
                source: Box::new(oom),
            },
            2,
            &device,
        );
        let text = e.to_string();
        assert!(text.starts_with("rank 1 (cuda:5): "), "{text}");
        assert!(matches!(e.unranked(), TrainError::Backend(_)), "{e:?}");
        let e = ranks_error(
            ranks::RanksError::Body {
                rank: 1,
                source: Box::new(config_error("--bucket-mb", 0, "positive")),
            },
            2,
            &device,
        );
        assert!(
            matches!(
                e.unranked(),
                TrainError::InvalidConfig {
                    flag: "--bucket-mb",
                    ..
                }
            ),
            "{e}"
        );
        // One that names its rank already is not named twice.
        let diverged = TrainError::Diverged {
            rank: 1,
            step: 7,
            mine: 1,
            reference: 2,
        };
        let e = ranks_error(
            ranks::RanksError::Body {
                rank: 1,
                source: Box::new(diverged),
            },
            2,
            &device,
        );
        assert!(matches!(e, TrainError::Diverged { rank: 1, .. }), "{e}");
        assert_eq!(e.to_string().matches("rank 1").count(), 1, "{e}");
        // One rank alone: nothing to tell apart.
        let e = ranks_error(
            ranks::RanksError::Body {
                rank: 0,
                source: Box::new(config_error("--bucket-mb", 0, "positive")),
            },
            1,
            &device,
        );
        assert!(matches!(e, TrainError::InvalidConfig { .. }), "{e}");
        // A failure that is not the trainer's: a device error naming both.
        let e = ranks_error(
            ranks::RanksError::Body {
                rank: 2,
                source: "NCCL timed out".into(),
            },
            3,
            &device,
        );
        let text = e.to_string();
        assert!(
            text.contains("cuda:6 (rank 2)") && text.contains("NCCL timed out"),
            "{text}"
        );
        // A driver thread the OS refused: its own line and hint, the rank named once in
        // front (the thread's name gives only the device).
        let refused = |rank: usize, world: usize| {
            ranks_error(
                ranks::RanksError::Spawn {
                    rank,
                    source: pipeline::threads::ThreadStartError {
                        thread: format!("gpu-{}", rank + 4),
                        source: std::io::Error::from(std::io::ErrorKind::WouldBlock),
                    },
                },
                world,
                &device,
            )
        };
        let e = refused(1, 2);
        let text = e.to_string();
        assert!(
            text.starts_with("rank 1 (cuda:5): could not start thread `gpu-5`"),
            "{text}"
        );
        assert_eq!(text.matches("rank 1").count(), 1, "{text}");
        assert!(matches!(e.unranked(), TrainError::Thread(_)), "{e:?}");
        assert!(matches!(refused(0, 1), TrainError::Thread(_)));
    }

    #[test]
    fn more_gpus_than_present_is_an_error_listing_the_devices() {
        // This machine may have no GPU: asking for 64 fails either way, naming the flag.
        let mut cfg = TrainConfig::new("data");
        cfg.device = crate::train::DeviceChoice::Cuda(64);
        let e = launch_plan(64, &cfg).unwrap_err();
        assert!(e.to_string().contains("--gpus"), "{e}");
    }
}
