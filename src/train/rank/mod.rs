//! One rank of a run: a backend, a model replica, its share of every global batch, its
//! optimizer and its end of the [`Collective`]. [`Rank`] is the same code on every device;
//! what differs between a CPU rank and a GPU rank is a [`Device`]: where batches wait for
//! compute, where gradients are reduced, where the step's figures are summed.
//!
//! One training step ([`Rank::step`]), in order:
//! 1. the next micro-batch from the device's feed (a GPU stages it on its copy stream ahead);
//! 2. forward and backward; as soon as a parameter's gradient is final the backward hook puts
//!    it into its range of the flat gradient buffer (a GPU's backward writes it there itself)
//!    and every bucket that became complete starts averaging on the collective, scaled by
//!    this rank's share of the step's images (computed from the data order, no exchange);
//!    with synchronised batch norm each BN layer sums its statistics over the ranks;
//! 3. a rank without images this step issues the same collectives with zeros (every rank must
//!    take part in every collective, in the same order); with synchronised batch norm the
//!    global statistics advance its running statistics as every other rank's;
//! 4. the step's averages finish, the optimizer updates the master weights and the replica;
//! 5. the step's loss and hit counts and this rank's wish to stop start a small sum over the
//!    ranks, read one step later ([`Rank::settle`]), so a step never waits for the host.

pub(crate) mod cpu;
pub(crate) mod cuda;
mod device;

pub(crate) use device::Device;

use std::cell::RefCell;
use std::ops::Range;
use std::time::{Duration, Instant};

use super::config::TrainConfig;
use super::ema::ModelEma;
use super::folder::metrics::MetricsAccumulator;
use super::folder::DataPosition;
use super::lr_find::LrTrace;
use super::setup::Shared;
use super::TrainError;
use crate::backend::SumsMut;
use crate::cuda::graph::GraphAction;
use crate::cuda::staging::feed::HostBatch;
use crate::dist::buckets::GradientSync;
use crate::dist::collective::{broadcast_checksum, Collective, CollectiveError};
use crate::model::{
    BnAllReduce, BufferKind, GradHookError, InputBatch, ModelState, Network, NetworkConfig,
    StepStats,
};
use crate::optim::RankOptimizer;

/// Values in a step's totals: loss sum, top-1 hits, top-5 hits, images, stop wishes.
pub(crate) const TOTALS_LEN: usize = 5;

/// The step's figures and stop wish as the vector the ranks sum.
pub(crate) fn pack_totals(stats: &StepStats, stop: bool) -> [f64; TOTALS_LEN] {
    [
        stats.loss_sum,
        stats.correct_top1 as f64,
        stats.correct_top5 as f64,
        stats.count as f64,
        if stop { 1.0 } else { 0.0 },
    ]
}

/// The summed vector as the step's global figures and whether any rank asked to stop.
pub(crate) fn unpack_totals(v: [f64; TOTALS_LEN]) -> (StepStats, bool) {
    let stats = StepStats {
        loss_sum: v[0],
        correct_top1: v[1].round() as usize,
        correct_top5: v[2].round() as usize,
        count: v[3].round() as usize,
    };
    (stats, v[4] > 0.5)
}

/// The options of a rank's replica, the same on every device.
pub(crate) fn network_config(cfg: &TrainConfig) -> NetworkConfig {
    NetworkConfig {
        label_smoothing: cfg.label_smoothing,
        freeze_bn: cfg.freeze_bn,
        ..NetworkConfig::default()
    }
}

/// What the loop asks of one step.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepPlan {
    /// The epoch (for augmentation).
    pub epoch: u64,
    /// The step within the epoch.
    pub step: usize,
    /// Learning rate.
    pub lr: f32,
    /// This rank's images, from the data order.
    pub local_images: usize,
    /// Every rank's images together.
    pub global_images: usize,
    /// This rank would like to stop after this step.
    pub stop: bool,
    /// Micro-batches of the step, the same on every rank (`--grad-accum-steps`; 1 without
    /// accumulation): the most any rank's share of the step holds.
    pub micro_batches: usize,
}

/// How one micro-batch's gradients reach the flat buffer when a step accumulates several.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MicroStep {
    /// The step's first micro-batch: its gradients start the sum.
    pub first: bool,
    /// The step's last micro-batch: its backward starts the buckets' averages.
    pub last: bool,
    /// The micro-batch holding this rank's last images of the step: after it the sum is
    /// complete (the later micro-batches of the step, if any, have no images here).
    pub last_images: bool,
    /// The micro-batch's share of this rank's images in the step (each micro-batch's
    /// gradient is its images' mean, the sum of the weighted ones the rank's mean).
    pub weight: f32,
}

/// A step whose totals are on their way.
pub(crate) struct PendingStep<P> {
    pending: P,
}

/// [`BnAllReduce`] over the collective the gradient hook also uses (never re-entered: the
/// network calls one or the other).
struct BnOverCollective<'c, 'a, C: Collective> {
    state: &'c RefCell<HookState<'a, C>>,
}

struct HookState<'a, C: Collective> {
    comm: &'a mut C,
    grads: &'a mut C::Buffer,
    sync: &'a mut GradientSync,
}

impl<C: Collective> BnAllReduce for BnOverCollective<'_, '_, C> {
    fn sum_in_place(&mut self, values: &mut [f64]) -> Result<(), GradHookError> {
        Ok(self.state.borrow_mut().comm.sum(values)?)
    }

    fn sum_sums(&mut self, sums: SumsMut<'_>) -> Result<(), GradHookError> {
        Ok(self.state.borrow_mut().comm.sum_sums(sums)?)
    }
}

/// One rank: see the module docs. Fields are dropped in declaration order: the device and
/// the collective (whose threads may still touch the gradient buffer) before the buffer, the
/// buffer (which may point into the network's memory) before the network.
pub(crate) struct Rank<D: Device> {
    /// This rank.
    pub rank: usize,
    /// Ranks in the run.
    pub world: usize,
    /// Index among this machine's ranks (0 traces the machine's input engine).
    pub local_index: usize,
    pub(crate) device: D,
    pub(crate) comm: D::Comm,
    grads: <D::Comm as Collective>::Buffer,
    sync: GradientSync,
    pub(crate) opt: D::Optim,
    /// Where training stands.
    pub position: DataPosition,
    /// Cross-rank checksum comparisons passed.
    pub checks_passed: u64,
    /// The moving average of the weights (`--model-ema`; the writer only).
    pub(crate) ema: Option<ModelEma>,
    /// The learning-rate sweep's record (`lr-find`; every rank, from the same totals).
    pub(crate) lr_trace: Option<LrTrace>,
    pub(crate) net: Network<D::Backend>,
}

impl<D: Device> Rank<D> {
    /// Assembles a rank and makes its replica start from rank 0's weights (broadcast: every
    /// rank read the same checkpoint or seed, but another node's file must not be trusted to
    /// agree) and the checkpoint's optimizer state, if any.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        shared: &Shared,
        rank: usize,
        local_index: usize,
        device: D,
        mut comm: D::Comm,
        grads: <D::Comm as Collective>::Buffer,
        mut net: Network<D::Backend>,
        make_optimizer: impl FnOnce(&[f32]) -> Result<D::Optim, TrainError>,
    ) -> Result<Self, TrainError> {
        let setup = (|| -> Result<D::Optim, TrainError> {
            let mut flat = shared.initial.flat_params();
            comm.broadcast(&mut flat, 0)?;
            net.load_state(&shared.initial)?;
            net.set_params_f32(&flat)?;
            // Inside an epoch each rank had statistics of its own (the checkpoint's weights
            // file holds their average): take this rank's back, so the run goes on bit for
            // bit as if never stopped.
            if let Some(rows) = &shared.rank_buffers {
                let row = rows.get(rank).ok_or_else(|| {
                    TrainError::Internal(format!("no saved statistics for rank {rank}"))
                })?;
                net.set_buffers(&unflatten_buffers(shared, row))?;
            }
            let mut opt = make_optimizer(&flat)?;
            opt.set_max_grad_norm(shared.cfg.clip_grad_norm);
            if let Some(host) = &shared.optimizer {
                opt.load_host(host)?;
            }
            Ok(opt)
        })();
        let opt = match setup {
            Ok(opt) => opt,
            Err(e) => {
                if !e.is_abort_consequence() {
                    comm.abort(&format!("rank {rank} failed: {e}"));
                }
                return Err(e);
            }
        };
        Ok(Rank {
            rank,
            world: comm.world_size(),
            local_index,
            device,
            comm,
            grads,
            sync: GradientSync::new(shared.bucket_plan.clone()),
            opt,
            position: shared.position.clone(),
            checks_passed: 0,
            ema: if rank == 0 { shared.ema.clone() } else { None },
            lr_trace: shared.cfg.lr_range.map(|_| LrTrace::default()),
            net,
        })
    }

    /// Rank 0 writes the run folder (every rank validates its share).
    pub(crate) fn is_writer(&self) -> bool {
        self.rank == 0
    }

    /// Issues one training step; its totals are read by [`Rank::settle`] later.
    pub(crate) fn step(
        &mut self,
        shared: &Shared,
        plan: &StepPlan,
    ) -> Result<(PendingStep<D::Pending>, Duration), TrainError> {
        let Some((batch, waited)) = self.device.next_batch(&self.net, &mut self.comm)? else {
            return Err(TrainError::InvalidConfig {
                flag: "--batch-size",
                value: shared.cfg.batch_size.to_string(),
                hint: format!(
                    "rank {} ran out of batches at step {} of {} (input engine bug?)",
                    self.rank, plan.step, shared.steps_per_epoch
                ),
            });
        };
        // Fewer images than the data order gives: the engine skipped unreadable files
        // (`--on-bad-image skip`). More would be an engine bug.
        if batch.len > plan.local_images {
            return Err(TrainError::InvalidConfig {
                flag: "--last-batch",
                value: shared.cfg.last_batch.as_str().into(),
                hint: format!(
                    "rank {} got {} images at step {}, the data order gives it {} (input engine bug?)",
                    self.rank, batch.len, plan.step, plan.local_images
                ),
            });
        }
        if shared.trace.is_enabled() && !waited.is_zero() {
            shared.trace.record_since(
                "input wait",
                "wait",
                self.rank as u32,
                crate::cuda::timeline::rows::HOST,
                Instant::now() - waited,
            );
        }
        // The step's gradient is the image-weighted mean of the ranks' mean-loss gradients;
        // the collective averages over ranks, so each rank first scales by its share, known
        // from the data order without an exchange. An image the engine skipped as unreadable
        // counts as a zero gradient in that share; a rank alone keeps the mean of what it got.
        let scale = if self.world > 1 && plan.global_images > 0 {
            (batch.len * self.world) as f32 / plan.global_images as f32
        } else {
            1.0
        };
        self.sync.begin_step(scale);
        let sync_bn = shared.cfg.sync_bn && !shared.cfg.freeze_bn;
        // A CUDA graph (BIRDTRAIN_CUDA_GRAPH=1) only for a full batch of one rank alone, one
        // micro-batch, without synchronised batch norm: the shapes and the launch sequence
        // that were captured (the device also declines under --trace).
        let action = if plan.micro_batches == 1 && batch.len > 0 {
            let eligible = self.world == 1
                && !sync_bn
                && batch.len == self.net.max_batch()
                && plan.global_images > 0;
            self.device.graph_action(&mut self.comm, eligible)?
        } else {
            GraphAction::Eager
        };
        let mark = self.device.mark(&mut self.comm)?;
        let stats = if action != GraphAction::Eager {
            self.graph_step(shared, plan, &batch, action)?
        } else if plan.micro_batches > 1 {
            self.accumulate(shared, plan, &batch, sync_bn)?
        } else if batch.len > 0 {
            self.device.before_compute(&self.net, plan.stop)?;
            let stats = self.forward_backward(shared, plan, &batch, 0..batch.len, sync_bn, None);
            self.device.after_compute(&self.net)?;
            stats?
        } else {
            self.device.zero_gradients(&mut self.grads)?;
            self.replay_empty(sync_bn)?;
            self.device.after_compute(&self.net)?;
            StepStats::default()
        };
        self.device
            .span(&mut self.comm, mark, "forward + backward")?;
        if action == GraphAction::Eager {
            self.eager_update(plan)?;
        }
        let pending = self.device.start_totals(
            &self.net,
            &mut self.comm,
            &stats,
            plan.stop,
            batch.len > 0,
        )?;
        Ok((PendingStep { pending }, waited))
    }

    /// The step's averages finish, then the optimizer's update (a step with images anywhere).
    fn eager_update(&mut self, plan: &StepPlan) -> Result<(), TrainError> {
        self.sync.finish_step(&mut self.comm, &mut self.grads)?;
        if plan.global_images > 0 {
            let mark = self.device.mark(&mut self.comm)?;
            let grads = D::host_gradients(&self.grads)?;
            self.opt.step(&mut self.net, grads, plan.lr)?;
            self.device.span(&mut self.comm, mark, "optimizer")?;
        }
        Ok(())
    }

    /// A step of one full batch as a CUDA graph: the values its kernels read go to the
    /// device first; then either its launches (forward, backward, the buckets' bookkeeping,
    /// the optimizer, exactly the eager step's) are captured and the new graph launched, or
    /// the graph captured earlier for its addresses is launched, and the host's record of the
    /// step (bucket bookkeeping, batch counters, optimizer steps) is kept as the eager code
    /// keeps it. The staging slot is released after the graph.
    fn graph_step(
        &mut self,
        shared: &Shared,
        plan: &StepPlan,
        batch: &HostBatch,
        action: GraphAction,
    ) -> Result<StepStats, TrainError> {
        let n = batch.len;
        let (augments, mix) = step_augmentation(shared, plan, &batch.sample_ids[..n]);
        let input = InputBatch {
            pixels: (*batch.pixels).as_ref(),
            labels: &batch.labels,
            len: n,
            image_size: batch.image_size,
            augment: augments.as_deref(),
            mix,
        };
        self.device.before_compute(&self.net, plan.stop)?;
        self.device
            .preload_step(&self.net, &mut self.opt, &input, plan.lr, plan.stop)?;
        let issued = match action {
            GraphAction::Capture => self.capture_step(shared, plan, batch),
            _ => self.replay_step(n),
        };
        self.device.end_graph_step(&self.net);
        let stats = issued?;
        self.device.after_compute(&self.net)?;
        Ok(stats)
    }

    /// Captures the step's launches (as [`Rank::step`] issues them eagerly) and launches the
    /// graph.
    fn capture_step(
        &mut self,
        shared: &Shared,
        plan: &StepPlan,
        batch: &HostBatch,
    ) -> Result<StepStats, TrainError> {
        self.device.begin_capture()?;
        let issued = self
            .forward_backward(shared, plan, batch, 0..batch.len, false, None)
            .and_then(|stats| {
                self.sync.finish_step(&mut self.comm, &mut self.grads)?;
                let grads = D::host_gradients(&self.grads)?;
                self.opt.step(&mut self.net, grads, plan.lr)?;
                Ok(stats)
            });
        self.device.end_capture(issued.is_ok())?;
        let stats = issued?;
        self.device
            .replay(&mut self.net, &mut self.opt, batch.len, false)?;
        Ok(stats)
    }

    /// Launches the graph captured for this step's addresses and keeps the host's record of
    /// the step: the buckets' bookkeeping (one rank: no collective work), the replica's and
    /// the optimizer's step counts.
    fn replay_step(&mut self, n: usize) -> Result<StepStats, TrainError> {
        self.device.replay(&mut self.net, &mut self.opt, n, true)?;
        for param in self.net.grad_ready_order() {
            self.sync
                .grad_ready(&mut self.comm, &mut self.grads, param)?;
        }
        self.sync.finish_step(&mut self.comm, &mut self.grads)?;
        Ok(StepStats {
            count: n,
            ..StepStats::default()
        })
    }

    /// A step of several micro-batches (`--grad-accum-steps`): each of `--batch-size` of this
    /// rank's images, forward and backward on its own (batch norm normalises each alone),
    /// their gradients summed, weighted by their shares of the rank's images, into the flat
    /// buffer; only the last micro-batch's backward starts the averages, so the ranks average
    /// once per optimizer step. Every rank runs `plan.micro_batches` of them, those past its
    /// images without images, so that every rank issues the same collectives (synchronised
    /// batch norm sums per micro-batch).
    fn accumulate(
        &mut self,
        shared: &Shared,
        plan: &StepPlan,
        batch: &HostBatch,
        sync_bn: bool,
    ) -> Result<StepStats, TrainError> {
        let size = shared.cfg.batch_size;
        let mut total = StepStats::default();
        if batch.len == 0 {
            self.device.zero_gradients(&mut self.grads)?;
        } else {
            self.device.before_compute(&self.net, plan.stop)?;
        }
        let image_bytes = (batch.image_size as usize).pow(2) * 3;
        for micro in 0..plan.micro_batches {
            let last = micro + 1 == plan.micro_batches;
            let images = (micro * size).min(batch.len)..((micro + 1) * size).min(batch.len);
            if images.is_empty() {
                self.replay_micro_without_images(sync_bn, last)?;
                continue;
            }
            let step = MicroStep {
                first: micro == 0,
                last,
                last_images: images.end == batch.len,
                weight: images.len() as f32 / batch.len as f32,
            };
            self.device.begin_micro(
                &self.net,
                images.clone(),
                image_bytes,
                step.first,
                plan.stop,
            )?;
            let stats = self.forward_backward(shared, plan, batch, images, sync_bn, Some(step))?;
            total.loss_sum += stats.loss_sum;
            total.correct_top1 += stats.correct_top1;
            total.correct_top5 += stats.correct_top5;
            total.count += stats.count;
        }
        self.device.after_compute(&self.net)?;
        Ok(total)
    }

    /// Forward and backward of `images` of `batch`; `micro`: one micro-batch of several,
    /// whose gradients add into the buffer (none: the step's only batch, whose gradients are
    /// placed there and averaged).
    fn forward_backward(
        &mut self,
        shared: &Shared,
        plan: &StepPlan,
        batch: &HostBatch,
        images: Range<usize>,
        sync_bn: bool,
        micro: Option<MicroStep>,
    ) -> Result<StepStats, TrainError> {
        let ids = &batch.sample_ids[images.clone()];
        let (augments, mix) = step_augmentation(shared, plan, ids);
        let image_bytes = batch.image_size as usize * batch.image_size as usize * 3;
        let pixels: &[u8] = (*batch.pixels).as_ref();
        let input = InputBatch {
            pixels: &pixels[images.start * image_bytes..],
            // From the micro-batch's first image on (the network reads `len` of them).
            labels: &batch.labels[images.start.min(batch.labels.len())..],
            len: images.len(),
            image_size: batch.image_size,
            augment: augments.as_deref(),
            mix,
        };
        let Rank {
            net,
            comm,
            grads,
            sync,
            device,
            ..
        } = self;
        let state = RefCell::new(HookState::<D::Comm> { comm, grads, sync });
        let mut bn = BnOverCollective { state: &state };
        let stats = net.train_step_synced(
            &input,
            &mut |param, grad| {
                let mut st = state.borrow_mut();
                let st = &mut *st;
                let range = st.sync.plan().param_elements(param);
                match micro {
                    None => D::place_gradient(st.grads, range, grad)?,
                    Some(m) => device.accumulate_gradient(st.grads, range, grad, m)?,
                }
                if micro.is_none_or(|m| m.last) {
                    st.sync.grad_ready(&mut *st.comm, st.grads, param)?;
                }
                Ok(())
            },
            sync_bn.then_some(&mut bn as &mut dyn BnAllReduce),
        )?;
        Ok(stats)
    }

    /// A rank without images takes part in the step's collectives with zeros, in exactly the
    /// order a rank with images issues them; with synchronised batch norm its BN layers' sums
    /// are zeros and the global statistics advance its running statistics as every other
    /// rank's ([`Network::step_without_images`]).
    fn replay_empty(&mut self, sync_bn: bool) -> Result<(), TrainError> {
        self.replay_micro_without_images(sync_bn, true)
    }

    /// One micro-batch without images of a step that has several: the same collectives as a
    /// rank with images (its synchronised batch norm sums), and where it is the `last`, the
    /// buckets' averages of what the buffer holds.
    fn replay_micro_without_images(&mut self, sync_bn: bool, last: bool) -> Result<(), TrainError> {
        let Rank {
            net,
            comm,
            grads,
            sync,
            ..
        } = self;
        let state = RefCell::new(HookState::<D::Comm> { comm, grads, sync });
        let mut bn = BnOverCollective { state: &state };
        net.step_without_images(
            &mut |param| {
                if !last {
                    return Ok(());
                }
                let mut st = state.borrow_mut();
                let st = &mut *st;
                st.sync.grad_ready(&mut *st.comm, st.grads, param)?;
                Ok(())
            },
            sync_bn.then_some(&mut bn as &mut dyn BnAllReduce),
        )?;
        Ok(())
    }

    /// The global totals of a step issued earlier, and whether any rank asked to stop.
    pub(crate) fn settle(
        &mut self,
        pending: PendingStep<D::Pending>,
    ) -> Result<(StepStats, bool), TrainError> {
        let v = self.device.finish_totals(&mut self.comm, pending.pending)?;
        Ok(unpack_totals(v))
    }

    /// Broadcasts rank 0's weight checksum; every rank compares its own.
    pub(crate) fn compare_checksums(&mut self) -> Result<u64, TrainError> {
        let mine = crate::dist::checksum(&self.opt.master(&self.net)?);
        let reference = broadcast_checksum(&mut self.comm, mine, 0)?;
        if mine != reference {
            return Err(TrainError::Diverged {
                rank: self.rank,
                step: self.position.global_step,
                mine,
                reference,
            });
        }
        self.checks_passed += 1;
        Ok(mine)
    }

    /// Averages the batch-norm running statistics over the ranks (each rank kept its own
    /// during the epoch, as in DDP), so that validation and the checkpoint see the mean and
    /// every rank goes on from it. The running statistics advance linearly, so averaging at
    /// the end equals averaging at every step up to rounding. The counters are rank 0's
    /// (it has images at every step).
    pub(crate) fn average_bn_statistics(&mut self, shared: &Shared) -> Result<(), TrainError> {
        if self.world == 1 {
            return Ok(());
        }
        let mut buffers = self.net.buffers()?;
        let specs = shared.graph.buffers();
        let mut flat: Vec<f64> = Vec::new();
        for (spec, b) in specs.iter().zip(&buffers) {
            let take = spec.kind != BufferKind::NumBatchesTracked || self.rank == 0;
            flat.extend(b.iter().map(|&v| if take { f64::from(v) } else { 0.0 }));
        }
        self.comm.sum(&mut flat)?;
        let world = self.world as f64;
        let mut at = 0;
        for (spec, b) in specs.iter().zip(&mut buffers) {
            for v in b.iter_mut() {
                let sum = flat[at];
                at += 1;
                *v = if spec.kind == BufferKind::NumBatchesTracked {
                    sum as f32
                } else {
                    (sum / world) as f32
                };
            }
        }
        self.net.set_buffers(&buffers)?;
        Ok(())
    }

    /// Every rank's batch-norm buffers, flattened in graph order, one row per rank, for a
    /// checkpoint inside an epoch; the ranks' own statistics stay as they are (averaging them
    /// there, as the epoch end does, would make a run checkpointed mid-epoch differ in its
    /// last bits from one that was not, and a resume from it differ from both). Every rank
    /// must call it at the same step; the rows arrive on every rank (a sum where each rank
    /// fills only its own row is a gather). `None` with a single rank.
    pub(crate) fn gather_bn_buffers(&mut self) -> Result<Option<Vec<Vec<f32>>>, TrainError> {
        if self.world == 1 {
            return Ok(None);
        }
        let mine: Vec<f32> = self.net.buffers()?.concat();
        let len = mine.len();
        let mut flat = vec![0.0f64; len * self.world];
        for (slot, v) in flat[self.rank * len..][..len].iter_mut().zip(&mine) {
            *slot = f64::from(*v);
        }
        self.comm.sum(&mut flat)?;
        // Exact: each slot is one f32 plus zeros.
        Ok(Some(
            flat.chunks(len)
                .map(|row| row.iter().map(|&v| v as f32).collect())
                .collect(),
        ))
    }

    /// The replica's state as a checkpoint stores it: the optimizer's f32 master weights and
    /// the network's buffers.
    pub(crate) fn master_state(&mut self, shared: &Shared) -> Result<ModelState, TrainError> {
        let mut state = ModelState {
            params: shared
                .graph
                .params()
                .iter()
                .map(|p| vec![0.0; p.numel()])
                .collect(),
            buffers: self.net.buffers()?,
        };
        state.set_flat_params(&self.opt.master(&self.net)?)?;
        Ok(state)
    }

    /// Moves the average of the weights toward the replica's after the step of `plan`, when
    /// an update is due there (the writer keeps the average; the other ranks do nothing).
    pub(crate) fn update_average(
        &mut self,
        shared: &Shared,
        plan: &StepPlan,
    ) -> Result<(), TrainError> {
        let due = shared.cfg.model_ema.is_some_and(|r| r.due(plan.step));
        if !due || self.ema.is_none() {
            return Ok(());
        }
        let live = self.master_state(shared)?;
        if let Some(ema) = &mut self.ema {
            ema.update(&shared.graph, &live, plan.epoch);
        }
        Ok(())
    }

    /// The moving average of the weights on every rank, for each to validate its share of
    /// the split with: rank 0 keeps it, the others receive it in one broadcast of its
    /// parameters and buffers (exact: f32 values copied). `None` when the run keeps none.
    /// Every rank must call it at the same point.
    pub(crate) fn shared_average(
        &mut self,
        shared: &Shared,
    ) -> Result<Option<ModelState>, TrainError> {
        if shared.cfg.model_ema.is_none() {
            return Ok(None);
        }
        let kept = self.ema.as_ref().map(|e| &e.state);
        if self.world == 1 {
            return Ok(kept.cloned());
        }
        let graph = &shared.graph;
        let params: usize = graph.params().iter().map(|p| p.numel()).sum();
        let buffers: usize = graph.buffers().iter().map(|b| b.numel()).sum();
        let mut flat = if self.is_writer() {
            let state = kept.ok_or_else(|| {
                TrainError::Internal("rank 0 holds no moving average of the weights".into())
            })?;
            let mut flat = state.flat_params();
            flat.extend(state.buffers.iter().flatten());
            flat
        } else {
            vec![0.0; params + buffers]
        };
        self.comm.broadcast(&mut flat, 0)?;
        if flat.len() != params + buffers {
            return Err(TrainError::Internal(format!(
                "the moving average arrived with {} values, the model has {}",
                flat.len(),
                params + buffers
            )));
        }
        let mut state = ModelState {
            params: graph
                .params()
                .iter()
                .map(|p| vec![0.0; p.numel()])
                .collect(),
            buffers: unflatten_buffers(shared, &flat[params..]),
        };
        state.set_flat_params(&flat[..params])?;
        Ok(Some(state))
    }

    /// Aborts the collective (this rank failed: nobody may wait for it).
    pub(crate) fn abort(&self, reason: &str) {
        self.comm.abort(reason);
    }
}

/// The device augmentation and the mixing of images `ids` in the step of `plan`.
fn step_augmentation(
    shared: &Shared,
    plan: &StepPlan,
    ids: &[u64],
) -> (
    Option<Vec<crate::model::Augment>>,
    Option<crate::model::Mix>,
) {
    let cfg = &shared.cfg;
    let augments = cfg.augmentation().device_augments(
        cfg.random_erase,
        cfg.seed,
        plan.epoch,
        ids,
        cfg.image_size,
    );
    let mix = cfg.mix().draw(cfg.seed, plan.epoch, ids, cfg.image_size);
    (augments, mix)
}

/// Accumulates a settled step into the epoch's figures.
pub(crate) fn account(acc: &mut MetricsAccumulator, totals: &StepStats) {
    acc.add(
        totals.loss_sum,
        totals.correct_top1 as u64,
        totals.correct_top5 as u64,
        totals.count as u64,
    );
}

impl From<CollectiveError> for TrainError {
    fn from(e: CollectiveError) -> Self {
        TrainError::Collective(Box::new(e))
    }
}

/// Splits a flat row of buffers (graph order) into the network's buffer tensors.
pub(crate) fn unflatten_buffers(shared: &Shared, row: &[f32]) -> Vec<Vec<f32>> {
    let mut at = 0;
    shared
        .graph
        .buffers()
        .iter()
        .map(|spec| {
            let n = spec.numel();
            let t = row[at..at + n].to_vec();
            at += n;
            t
        })
        .collect()
}

/// The buffers a checkpoint inside an epoch stores in its weights file: the mean of the
/// ranks' rows, in f64 and rank order, as [`Rank::average_bn_statistics`] forms it at an
/// epoch end, with rank 0's batch counters.
pub(crate) fn mean_buffers(shared: &Shared, rows: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let world = rows.len() as f64;
    let kinds = shared
        .graph
        .buffers()
        .iter()
        .flat_map(|spec| std::iter::repeat_n(spec.kind, spec.numel()));
    let mean: Vec<f32> = kinds
        .enumerate()
        .map(|(i, kind)| {
            if kind == BufferKind::NumBatchesTracked {
                rows[0][i]
            } else {
                (rows.iter().map(|r| f64::from(r[i])).sum::<f64>() / world) as f32
            }
        })
        .collect();
    unflatten_buffers(shared, &mean)
}
