//! What one device brings to a rank ([`Device`]): where batches wait for compute, where
//! gradients are reduced, where the step's figures are summed. [`super::Rank`] is the same
//! code on every device; `cpu.rs` and `cuda.rs` implement this trait.

use std::ops::Range;
use std::time::Duration;

use pipeline::Pipeline;

use super::{MicroStep, TOTALS_LEN};
use crate::backend::Backend;
use crate::cuda::graph::GraphAction;
use crate::cuda::staging::feed::HostBatch;
use crate::dist::collective::Collective;
use crate::model::{GradHookError, InputBatch, Network, StepStats};
use crate::optim::RankOptimizer;
use crate::train::TrainError;

/// What one device brings to a rank.
pub(crate) trait Device {
    /// The backend the replica computes on.
    type Backend: Backend;
    /// The collective joining this rank to the others.
    type Comm: Collective;
    /// The optimizer that owns the master weights.
    type Optim: RankOptimizer<Self::Backend>;
    /// A step's totals on their way.
    type Pending;
    /// The start of a traced span.
    type Mark;

    /// Starts epoch `epoch`'s input for `rank` at step `start_step`.
    fn begin_epoch(
        &mut self,
        pipe: &Pipeline,
        epoch: u64,
        rank: usize,
        start_step: usize,
    ) -> Result<(), TrainError>;

    /// The next micro-batch (`None` once the epoch's input is exhausted) and how long the
    /// host waited for it. A GPU device makes the backend read it from its staging slot.
    fn next_batch(
        &mut self,
        net: &Network<Self::Backend>,
        comm: &mut Self::Comm,
    ) -> Result<Option<(HostBatch, Duration)>, TrainError>;

    /// Prepares the backend for a step with images (a GPU leaves the loss, and this rank's
    /// wish to `stop`, on the device).
    fn before_compute(
        &mut self,
        net: &Network<Self::Backend>,
        stop: bool,
    ) -> Result<(), TrainError>;

    /// Before each micro-batch of a `--grad-accum-steps` step: its images are `images` of
    /// the step's batch (`image_bytes` each), the step's `first` micro-batch starts the
    /// step's figures and later ones add to them (a GPU reads the micro-batch from its
    /// staged slot and leaves the figures on the device; the CPU needs nothing).
    fn begin_micro(
        &mut self,
        net: &Network<Self::Backend>,
        images: Range<usize>,
        image_bytes: usize,
        first: bool,
        stop: bool,
    ) -> Result<(), TrainError>;

    /// The step's forward and backward are issued: the batch's input is no longer read.
    fn after_compute(&mut self, net: &Network<Self::Backend>) -> Result<(), TrainError>;

    /// Puts a parameter's final gradient into `range` of the flat buffer (a no-op where the
    /// backward wrote it there).
    fn place_gradient(
        grads: &mut <Self::Comm as Collective>::Buffer,
        range: Range<usize>,
        grad: &<Self::Backend as Backend>::Tensor,
    ) -> Result<(), GradHookError>;

    /// Adds `micro.weight` × a parameter's gradient of one micro-batch into the step's sum
    /// for `--grad-accum-steps` (`micro.first`: the step's first micro-batch, which starts the
    /// sum): by the end of the rank's last micro-batch with images (`micro.last_images`),
    /// `range` of the flat buffer holds the sum.
    fn accumulate_gradient(
        &mut self,
        grads: &mut <Self::Comm as Collective>::Buffer,
        range: Range<usize>,
        grad: &<Self::Backend as Backend>::Tensor,
        micro: MicroStep,
    ) -> Result<(), GradHookError>;

    /// Zeros the flat buffer (a rank without images contributes zeros).
    fn zero_gradients(
        &mut self,
        grads: &mut <Self::Comm as Collective>::Buffer,
    ) -> Result<(), TrainError>;

    /// The averaged gradients as the optimizer reads them: host values, or `None` when the
    /// optimizer reads the network's own gradient tensors.
    fn host_gradients(
        grads: &<Self::Comm as Collective>::Buffer,
    ) -> Result<Option<&[f32]>, TrainError>;

    /// Starts summing the step's totals over the ranks (`local`: this rank's figures where
    /// the host has them; `had_images`: whether the step ran forward and backward).
    fn start_totals(
        &mut self,
        net: &Network<Self::Backend>,
        comm: &mut Self::Comm,
        local: &StepStats,
        stop: bool,
        had_images: bool,
    ) -> Result<Self::Pending, TrainError>;

    /// The summed totals of a step started earlier.
    fn finish_totals(
        &mut self,
        comm: &mut Self::Comm,
        pending: Self::Pending,
    ) -> Result<[f64; TOTALS_LEN], TrainError>;

    /// Marks the start of a traced span.
    fn mark(&mut self, comm: &mut Self::Comm) -> Result<Self::Mark, TrainError>;

    /// Ends a traced span begun at `start`.
    fn span(
        &mut self,
        comm: &mut Self::Comm,
        start: Self::Mark,
        name: &str,
    ) -> Result<(), TrainError>;

    /// A step is over: `waited` of its `total` wall time went to input.
    fn end_step(
        &mut self,
        comm: &mut Self::Comm,
        waited: Duration,
        total: Duration,
    ) -> Result<(), TrainError>;

    /// A line on how well the input kept up, when the device measures it in detail.
    fn input_line(&self, rank: usize) -> Option<String>;

    /// How the coming step runs (after [`Device::next_batch`]): eagerly, captured into a CUDA
    /// graph, or replayed from one (`eligible`: the rank allows a graph for this step, see
    /// [`crate::cuda::graph`]). A device without graphs runs every step eagerly.
    fn graph_action(
        &mut self,
        _comm: &mut Self::Comm,
        _eligible: bool,
    ) -> Result<GraphAction, TrainError> {
        Ok(GraphAction::Eager)
    }

    /// Before a captured or replayed step: uploads what its kernels read from device memory
    /// (`input`'s augmentation, mixing and labels, the stop wish, the lr); the step's ops
    /// upload nothing until [`Device::end_graph_step`].
    fn preload_step(
        &mut self,
        _net: &Network<Self::Backend>,
        _opt: &mut Self::Optim,
        _input: &InputBatch<'_>,
        _lr: f32,
        _stop: bool,
    ) -> Result<(), TrainError> {
        Err(no_graphs())
    }

    /// Starts capturing the step's launches.
    fn begin_capture(&mut self) -> Result<(), TrainError> {
        Err(no_graphs())
    }

    /// Ends the capture; `keep`: the step was issued whole, its graph is kept (else discarded).
    fn end_capture(&mut self, _keep: bool) -> Result<(), TrainError> {
        Err(no_graphs())
    }

    /// Launches the step's graph (just captured, or captured earlier; `replayed`: the step's
    /// code did not run, so the replica and optimizer count a step of `images` here).
    fn replay(
        &mut self,
        _net: &mut Network<Self::Backend>,
        _opt: &mut Self::Optim,
        _images: usize,
        _replayed: bool,
    ) -> Result<(), TrainError> {
        Err(no_graphs())
    }

    /// After a captured or replayed step: the ops upload their own values again.
    fn end_graph_step(&mut self, _net: &Network<Self::Backend>) {}
}

fn no_graphs() -> TrainError {
    TrainError::Internal("a CUDA graph step on a device without graphs".into())
}
