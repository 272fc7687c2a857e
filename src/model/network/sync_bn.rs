//! Synchronised batch norm: the order of a synchronised step's collectives, the global
//! statistics of forward, the global reductions of backward, and the step of a replica with
//! no image. The reducer a [`Network`] is handed lives in `hooks`.

use crate::backend::bn_sync;
use crate::backend::{Backend, BnForward, BnMode, BnShape, BnSyncBackward, SumsMut};
use crate::model::graph::{BufferKind, Graph, Node};
use crate::model::ModelError;

use super::hooks::{grad_ready_order, BnAllReduce, GradHookError};
use super::{get, take, BnSums, Network, BORROWED};

/// One cross-replica event of a synchronised training step, in the order
/// [`Network::train_step_synced`] issues them (see [`Network::synced_step_events`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncEvent {
    /// Forward BN statistics: a [`BnAllReduce::sum_in_place`] of `2·channels + 1` values.
    BnForward {
        /// Channels of the layer.
        channels: usize,
    },
    /// Backward BN reductions: a [`BnAllReduce::sum_in_place`] of `2·channels` values.
    BnBackward {
        /// Channels of the layer.
        channels: usize,
    },
    /// The gradient-ready hook for this parameter.
    GradReady(usize),
}

/// See [`Network::synced_step_events`].
fn synced_step_events(graph: &Graph) -> Vec<SyncEvent> {
    let mut events: Vec<SyncEvent> = graph
        .nodes()
        .iter()
        .filter_map(|node| match node {
            Node::BatchNorm { channels, .. } => Some(SyncEvent::BnForward {
                channels: *channels,
            }),
            _ => None,
        })
        .collect();
    for node in graph.nodes().iter().rev() {
        match *node {
            Node::Conv { weight, .. } => events.push(SyncEvent::GradReady(weight)),
            Node::BatchNorm {
                weight,
                bias,
                channels,
                ..
            } => events.extend([
                SyncEvent::BnBackward { channels },
                SyncEvent::GradReady(weight),
                SyncEvent::GradReady(bias),
            ]),
            Node::Linear { weight, bias, .. } => {
                events.extend([SyncEvent::GradReady(weight), SyncEvent::GradReady(bias)])
            }
            Node::MaxPool { .. } | Node::GlobalAvgPool { .. } => {}
        }
    }
    events
}

impl<B: Backend> Network<B> {
    /// Name of a BN node (its weight's name without `.weight`), for errors.
    fn bn_name(&self, weight: usize) -> String {
        let name = &self.graph.params()[weight].name;
        name.strip_suffix(".weight").unwrap_or(name).to_string()
    }

    /// The forward and backward sums of synchronised BN layer `k` (allocated on its first
    /// synchronised step); give them back with [`Network::put_bn_sums`].
    fn take_bn_sums(&mut self, k: usize, channels: usize) -> Result<BnSums<B>, ModelError> {
        match self.bn_sums[k].take() {
            Some(sums) => Ok(sums),
            None => Ok((
                self.backend.alloc_sums(bn_sync::moments_len(channels))?,
                self.backend.alloc_sums(bn_sync::grad_sums_len(channels))?,
            )),
        }
    }

    fn put_bn_sums(&mut self, k: usize, sums: BnSums<B>) {
        self.bn_sums[k] = Some(sums);
    }

    /// Synchronised BN forward, part 1: the global mean and biased variance of layer `k`'s
    /// batch over every replica into the scratch pair (what the frozen-statistics op then
    /// normalises with), and its running statistics advanced with them.
    ///
    /// The local moments come from the backend's own fused op in training mode with
    /// momentum 1 on the scratch pair (running mean ← batch mean, running variance ← unbiased
    /// batch variance): no extra statistics kernel. It also writes `y`, which the frozen-mode
    /// call right after overwrites. The backend packs Σx, Σx² and the rows into the layer's
    /// sums, the reducer sums them where they are (on a GPU with a device path: on the device),
    /// and the backend turns them into the statistics.
    pub(super) fn global_bn_stats(
        &mut self,
        k: usize,
        node: &Node,
        shape: BnShape,
        reduce: &mut dyn BnAllReduce,
    ) -> Result<(), ModelError> {
        let Node::BatchNorm {
            input,
            output,
            weight,
            bias,
            ..
        } = *node
        else {
            unreachable!("global_bn_stats is only called for BatchNorm nodes");
        };
        let c = shape.channels;
        let (mut tm, mut tv) = self.bn_scratch.take().expect(BORROWED);
        // None: not stored (its max pool applies it).
        let mut y = self.acts[output].take();
        assert_eq!(y.is_none(), self.plan.fusion.unstored[k], "{BORROWED}");
        let (mut mean_t, mut invstd_t) = self.saved[k].take().expect("bn saved stats");
        let r = self.backend.bn_forward(BnForward {
            shape,
            x: get(&self.acts, input),
            gamma: get(&self.params, weight),
            beta: get(&self.params, bias),
            residual: None,
            relu: false,
            y: y.as_mut(),
            saved_mean: &mut mean_t,
            saved_invstd: &mut invstd_t,
            running_mean: &mut tm,
            running_var: &mut tv,
            mode: BnMode::Train,
            momentum: 1.0,
            eps: self.config.bn_eps,
            moments: self.moments_ready[k].then(|| get(&self.bn_moments, k)),
        });
        self.acts[output] = y;
        self.saved[k] = Some((mean_t, invstd_t));
        let sums = match r
            .map_err(ModelError::from)
            .and_then(|()| self.take_bn_sums(k, c))
        {
            Ok(sums) => sums,
            Err(e) => {
                self.bn_scratch = Some((tm, tv));
                return Err(e);
            }
        };
        let (mut moments, grads) = sums;
        let r = self
            .backend
            .bn_sync_moments(shape, &tm, &tv, &mut moments)
            .map_err(ModelError::from);
        self.bn_scratch = Some((tm, tv));
        let r = r.and_then(|()| self.sum_bn_moments(node, &mut moments, reduce));
        self.put_bn_sums(k, (moments, grads));
        r
    }

    /// Synchronised BN forward, part 2: sums layer `node`'s packed moments over every replica
    /// and turns the total into the global mean and biased variance (into the scratch pair)
    /// and the advance of its running statistics: the same on every replica, one with no
    /// image included.
    fn sum_bn_moments(
        &mut self,
        node: &Node,
        moments: &mut B::Sums,
        reduce: &mut dyn BnAllReduce,
    ) -> Result<(), ModelError> {
        let Node::BatchNorm {
            weight,
            running_mean,
            running_var,
            channels,
            ..
        } = *node
        else {
            unreachable!("sum_bn_moments is only called for BatchNorm nodes");
        };
        reduce
            .sum_sums(self.backend.sums_mut(moments))
            .map_err(|source| ModelError::BnSync {
                layer: self.bn_name(weight),
                source,
            })?;
        let (mut tm, mut tv) = self.bn_scratch.take().expect(BORROWED);
        let mut rm = take(&mut self.buffers, running_mean);
        let mut rv = take(&mut self.buffers, running_var);
        let r = self.backend.bn_sync_statistics(
            channels,
            moments,
            &mut tm,
            &mut tv,
            &mut rm,
            &mut rv,
            self.config.bn_momentum,
        );
        self.buffers[running_mean] = Some(rm);
        self.buffers[running_var] = Some(rv);
        self.bn_scratch = Some((tm, tv));
        Ok(r?)
    }

    /// What a replica with no image in a step does instead of [`Network::train_step_synced`]
    /// (same `sync_bn`): it takes part in every collective of the step, in the order a replica
    /// with images issues them (NCCL pairs collectives by order), calling `on_grad_ready`
    /// where that replica reports a gradient and, with synchronised batch norm
    /// ([`Network::synced_step_events`]), summing zeros for its BN sums. The forward totals
    /// that come back are the global batch's: they advance this replica's running statistics
    /// (and its batch counters) exactly as every other replica's, so synchronised replicas
    /// keep identical statistics, as they would in PyTorch's SyncBatchNorm. Nothing is
    /// computed on images and the gradient tensors are left as they are.
    pub fn step_without_images(
        &mut self,
        on_grad_ready: &mut dyn FnMut(usize) -> Result<(), GradHookError>,
        sync_bn: Option<&mut dyn BnAllReduce>,
    ) -> Result<(), ModelError> {
        self.grads_for = None;
        let graph = self.graph.clone();
        let report = |p: usize, hook: &mut dyn FnMut(usize) -> Result<(), GradHookError>| {
            hook(p).map_err(|source| ModelError::GradHook {
                param: graph.params()[p].name.clone(),
                source,
            })
        };
        let reduce = match sync_bn {
            Some(r) if !self.config.freeze_bn => r,
            _ => {
                for p in grad_ready_order(&graph) {
                    report(p, on_grad_ready)?;
                }
                return Ok(());
            }
        };
        let bn_nodes: Vec<(usize, &Node)> = graph
            .nodes()
            .iter()
            .enumerate()
            .filter(|(_, node)| matches!(node, Node::BatchNorm { .. }))
            .collect();
        let (mut forward, mut backward) = (bn_nodes.iter(), bn_nodes.iter().rev());
        for event in synced_step_events(&graph) {
            match event {
                SyncEvent::BnForward { channels } => {
                    let &(k, node) = forward.next().expect("a forward event per BN node");
                    let (mut moments, grads) = self.take_bn_sums(k, channels)?;
                    let zeros = vec![0.0; bn_sync::moments_len(channels)];
                    let r = self
                        .backend
                        .sums_mut(&mut moments)
                        .write(&zeros)
                        .map_err(ModelError::from)
                        .and_then(|()| self.sum_bn_moments(node, &mut moments, reduce));
                    self.put_bn_sums(k, (moments, grads));
                    r?;
                }
                SyncEvent::BnBackward { channels } => {
                    let &(_, node) = backward.next().expect("a backward event per BN node");
                    let Node::BatchNorm { weight, .. } = *node else {
                        unreachable!("filtered to BatchNorm nodes");
                    };
                    // Nothing here reads the total back: host zeros do.
                    let mut zeros = vec![0.0; bn_sync::grad_sums_len(channels)];
                    reduce
                        .sum_sums(SumsMut::Host(&mut zeros))
                        .map_err(|source| ModelError::BnSync {
                            layer: self.bn_name(weight),
                            source,
                        })?;
                }
                SyncEvent::GradReady(p) => report(p, on_grad_ready)?,
            }
        }
        for (i, b) in graph.buffers().iter().enumerate() {
            if b.kind == BufferKind::NumBatchesTracked {
                self.batches_tracked[i] += 1.0;
            }
        }
        Ok(())
    }

    /// Synchronised BN backward: after the frozen-statistics op (which gave this replica's
    /// dγ = Σdz·x̂ and dβ = Σdz, and the residual's gradient), sums dγ and dβ over replicas
    /// (weighted by image share) and writes dx as the batch-statistics backward over the
    /// global batch, `k·(dz − Σdβ/N − x̂·Σdγ/N)`: the backend's own pass with the global
    /// reductions in place of the local ones (the `bn_sync_*` ops around the reducer's sum,
    /// as in forward). Over one replica this is plain batch norm's backward, bit for bit.
    ///
    /// Fused ([`FusionPlan::prepared`]), the layer's incoming gradient is finished before its
    /// backward: the dgrad epilogue of the convolution reading its output left g (residual
    /// gradient added, ReLU mask applied) in dy and this replica's Σg·x̂, Σg (x̂ from the
    /// global statistics the forward normalised with) in dγ, dβ, which the frozen-statistics
    /// op keeps. Those are the local sums summed here, and the batch-statistics pass reads g
    /// without masking it again: the same dx as the unfused layer's, up to rounding.
    pub(super) fn sync_bn_backward(
        &mut self,
        k: usize,
        node: &Node,
        shape: BnShape,
        reduce: &mut dyn BnAllReduce,
    ) -> Result<(), ModelError> {
        let Node::BatchNorm {
            input,
            output,
            weight,
            bias,
            relu,
            ..
        } = *node
        else {
            unreachable!("sync_bn_backward is only called for BatchNorm nodes");
        };
        let prepared = self.plan.fusion.prepared[k];
        let (mut moments, mut grads) = self.take_bn_sums(k, shape.channels)?;
        let mut dx = take(&mut self.grad_bufs, self.plan.grad_slot[input]);
        let (mean_t, invstd_t) = self.saved[k].as_ref().expect("bn saved stats");
        let r = self
            .backend
            .bn_sync_grad_sums(
                shape,
                &mut moments,
                get(&self.param_grads, weight),
                get(&self.param_grads, bias),
                &mut grads,
            )
            .map_err(ModelError::from)
            .and_then(|()| {
                reduce
                    .sum_sums(self.backend.sums_mut(&mut grads))
                    .map_err(|source| ModelError::BnSync {
                        layer: self.bn_name(weight),
                        source,
                    })
            })
            .and_then(|()| {
                Ok(self.backend.bn_sync_backward(
                    &mut grads,
                    BnSyncBackward {
                        shape,
                        x: get(&self.acts, input),
                        y: self.acts[output].as_ref(),
                        gamma: get(&self.params, weight),
                        saved_mean: mean_t,
                        saved_invstd: invstd_t,
                        // Prepared: dy holds the masked gradient already.
                        relu: relu && !prepared,
                        dy: get(&self.grad_bufs, self.plan.grad_slot[output]),
                        dx: &mut dx,
                    },
                )?)
            });
        self.grad_bufs[self.plan.grad_slot[input]] = Some(dx);
        self.put_bn_sums(k, (moments, grads));
        r
    }

    /// The cross-replica events of a synchronised BN step in issue order (BN forward sums,
    /// then backward with BN reductions interleaved with gradient-ready reports). A replica
    /// with no images in a step replays this with zeros, so every replica issues the same
    /// collectives in the same order (NCCL's requirement).
    pub fn synced_step_events(&self) -> Vec<SyncEvent> {
        synced_step_events(&self.graph)
    }
}
