//! CPU ranks: R threads in this process, each with its own replica on the shared CPU thread
//! pool, joined by the in-process collective (`LocalCollective`, or any collective of host
//! gradient buffers): the per-step device side, and how one is built ([`cpu_rank`]). The
//! launcher that starts the threads is above, in `train/launch/cpu.rs`.
//!
//! A CPU rank's batches come straight from the engine; the backward hook copies each
//! finished gradient into its bucket's range of the rank's host gradient buffer, and the
//! collective's communication thread averages a bucket while backward computes the layers
//! before it. The optimizer ([`CpuRankOptimizer`]) updates the network's own parameters in
//! place from that buffer (the parameters are the master weights), with no copy or permutation.

use std::ops::Range;
use std::time::{Duration, Instant};

use pipeline::{EpochIter, Pipeline};

use super::{network_config, pack_totals, Device, MicroStep, Rank, TOTALS_LEN};
use crate::backend::cpu::CpuBackend;
use crate::cuda::staging::feed::HostBatch;
use crate::dist::collective::Collective;
use crate::dist::local::HostGrads;
use crate::model::{GradHookError, Network, StepStats};
use crate::optim::{ConvOrder, CpuRankOptimizer, ParamLayout};
use crate::train::setup::Shared;
use crate::train::TrainError;

/// The CPU side of a rank, over any collective of host gradient buffers.
pub(crate) struct CpuDevice<C> {
    batches: Option<EpochIter>,
    trace: crate::trace::TraceRecorder,
    pid: u32,
    _comm: std::marker::PhantomData<fn() -> C>,
}

impl<C> CpuDevice<C> {
    fn new(shared: &Shared, rank: usize) -> Self {
        if shared.trace.is_enabled() {
            shared
                .trace
                .name_process(rank as u32, &format!("CPU rank {rank}"));
            shared.trace.name_thread(rank as u32, 0, "rank thread");
        }
        CpuDevice {
            batches: None,
            trace: shared.trace.clone(),
            pid: rank as u32,
            _comm: std::marker::PhantomData,
        }
    }
}

impl<C: Collective<Buffer = HostGrads>> Device for CpuDevice<C> {
    type Backend = CpuBackend;
    type Comm = C;
    type Optim = CpuRankOptimizer;
    type Pending = [f64; TOTALS_LEN];
    type Mark = Instant;

    fn begin_epoch(
        &mut self,
        pipe: &Pipeline,
        epoch: u64,
        rank: usize,
        start_step: usize,
    ) -> Result<(), TrainError> {
        self.batches = Some(pipe.epoch(epoch, rank, start_step)?);
        Ok(())
    }

    fn next_batch(
        &mut self,
        _net: &Network<CpuBackend>,
        _comm: &mut C,
    ) -> Result<Option<(HostBatch, Duration)>, TrainError> {
        let t = Instant::now();
        let next = self.batches.as_mut().and_then(Iterator::next);
        match next {
            Some(batch) => Ok(Some((HostBatch::from_engine(batch?), t.elapsed()))),
            None => Ok(None),
        }
    }

    fn before_compute(
        &mut self,
        _net: &Network<CpuBackend>,
        _stop: bool,
    ) -> Result<(), TrainError> {
        Ok(())
    }

    fn after_compute(&mut self, _net: &Network<CpuBackend>) -> Result<(), TrainError> {
        Ok(())
    }

    fn place_gradient(
        grads: &mut HostGrads,
        range: Range<usize>,
        grad: &Vec<f32>,
    ) -> Result<(), GradHookError> {
        let n = range.len();
        let dst = grads.range_mut(range)?;
        let src = grad
            .get(..n)
            .ok_or_else(|| format!("a gradient of {} values for a range of {n}", grad.len()))?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn begin_micro(
        &mut self,
        _net: &Network<CpuBackend>,
        _images: Range<usize>,
        _image_bytes: usize,
        _first: bool,
        _stop: bool,
    ) -> Result<(), TrainError> {
        // The host batch's slice is the micro-batch; its figures come back to the host.
        Ok(())
    }

    fn accumulate_gradient(
        &mut self,
        grads: &mut HostGrads,
        range: Range<usize>,
        grad: &Vec<f32>,
        micro: MicroStep,
    ) -> Result<(), GradHookError> {
        // The buffer holds the running sum: the backward hands each gradient over apart.
        let (weight, first) = (micro.weight, micro.first);
        let n = range.len();
        let dst = grads.range_mut(range)?;
        let src = grad
            .get(..n)
            .ok_or_else(|| format!("a gradient of {} values for a range of {n}", grad.len()))?;
        if first {
            dst.iter_mut().zip(src).for_each(|(d, &g)| *d = weight * g);
        } else {
            dst.iter_mut().zip(src).for_each(|(d, &g)| *d += weight * g);
        }
        Ok(())
    }

    fn zero_gradients(&mut self, grads: &mut HostGrads) -> Result<(), TrainError> {
        grads.fill_zero().map_err(TrainError::Internal)
    }

    fn host_gradients(grads: &HostGrads) -> Result<Option<&[f32]>, TrainError> {
        grads.as_slice().map(Some).map_err(TrainError::Internal)
    }

    fn start_totals(
        &mut self,
        _net: &Network<CpuBackend>,
        comm: &mut C,
        local: &StepStats,
        stop: bool,
        _had_images: bool,
    ) -> Result<[f64; TOTALS_LEN], TrainError> {
        let mut v = pack_totals(local, stop);
        comm.sum(&mut v)?;
        Ok(v)
    }

    fn finish_totals(
        &mut self,
        _comm: &mut C,
        pending: [f64; TOTALS_LEN],
    ) -> Result<[f64; TOTALS_LEN], TrainError> {
        Ok(pending)
    }

    fn mark(&mut self, _comm: &mut C) -> Result<Instant, TrainError> {
        Ok(Instant::now())
    }

    fn span(&mut self, _comm: &mut C, start: Instant, name: &str) -> Result<(), TrainError> {
        self.trace.record_since(name, "compute", self.pid, 0, start);
        Ok(())
    }

    fn end_step(
        &mut self,
        _comm: &mut C,
        _waited: Duration,
        _total: Duration,
    ) -> Result<(), TrainError> {
        Ok(())
    }

    fn input_line(&self, _rank: usize) -> Option<String> {
        None
    }
}

/// Builds the rank of `comm` in a CPU run on `backend`: its replica, its host gradient buffer
/// and its optimizer over the network's own tensors. A failure to build the network aborts
/// the collective first, so no other rank waits for this one.
pub(crate) fn cpu_rank<C: Collective<Buffer = HostGrads>>(
    shared: &Shared,
    backend: CpuBackend,
    comm: C,
) -> Result<Rank<CpuDevice<C>>, TrainError> {
    let cfg = &shared.cfg;
    let rank = comm.rank();
    let mut net = match Network::new(
        backend,
        &shared.graph,
        shared.network_batch(),
        cfg.image_size,
    ) {
        Ok(net) => net,
        Err(e) => {
            comm.abort(&format!("rank {rank} failed: {e}"));
            return Err(e.into());
        }
    };
    net.set_config(network_config(cfg));
    let plan = &shared.bucket_plan;
    let layout = ParamLayout::with_offsets(
        shared.graph.params(),
        (0..plan.param_count())
            .map(|i| plan.param_elements(i).start)
            .collect(),
        plan.total_elements(),
        ConvOrder::Backend,
    );
    let grads = HostGrads::zeros(plan.total_elements());
    let device = CpuDevice::new(shared, rank);
    let threads = net.backend().clone();
    // The network already holds rank 0's weights (Rank::new loads them): they are the master.
    Rank::new(shared, rank, rank, device, comm, grads, net, |_weights| {
        Ok(CpuRankOptimizer::new(
            shared.kind,
            shared.hyper,
            shared.graph.params(),
            layout,
            threads,
        )?)
    })
}
