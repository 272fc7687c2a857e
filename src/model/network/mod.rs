//! Executes a [`Graph`] forward and backward on a [`Backend`].
//!
//! [`Network`] is one struct whose work is split by concept: the plan it is built from (node
//! shapes computed once, gradient buffers: `plan`), the weight layout conversion (`layout`),
//! state in and out (`state`), the forward and backward passes (`forward`, `backward`) and
//! synchronised batch norm (`sync_bn`), with the hooks a step calls (`hooks`). This file allocates a network and runs a step.

mod backward;
mod forward;
mod hooks;
mod layout;
mod plan;
mod state;
mod sync_bn;

use crate::backend::{Backend, BnMode, Targets, TensorRole};

use super::bn_fusion::FusionPlan;
use super::graph::{BufferKind, Graph, Node};
use super::{InputBatch, ModelError, ModelState, StepStats};

pub use hooks::{BnAllReduce, GradHookError, GradReadyHook};
pub(crate) use layout::{ohwi_to_oihw, oihw_to_ohwi};
pub use plan::{buffer_plan, BufferPlan};
pub use sync_bn::SyncEvent;

use hooks::reborrow;
use plan::Plan;

/// Training options that change the math.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NetworkConfig {
    /// Label smoothing ε of the cross-entropy (0 = none).
    pub label_smoothing: f32,
    /// Batch norm uses (and keeps) its running statistics during training, as when
    /// fine-tuning. With it, R replicas × batch B compute exactly the gradient of one replica
    /// on R·B; without it batch statistics are per replica (as in PyTorch DDP without SyncBN).
    pub freeze_bn: bool,
    /// Running-statistics momentum (torch: 0.1).
    pub bn_momentum: f32,
    /// Batch-norm epsilon (torch: 1e-5).
    pub bn_eps: f32,
}

impl Default for NetworkConfig {
    fn default() -> Self {
        NetworkConfig {
            label_smoothing: 0.0,
            freeze_bn: false,
            bn_momentum: 0.1,
            bn_eps: 1e-5,
        }
    }
}

/// A model instantiated on a backend: parameters, gradients, BN statistics and every
/// activation for `max_batch` images of side `image_size`, allocated once in [`Network::new`].
///
/// Parameters cross the API in torchvision layout (flat vectors follow `graph.params()`
/// order); the network converts convolution weights to the backend's OHWI.
pub struct Network<B: Backend> {
    backend: B,
    /// Shared so a pass can walk the nodes while calling `&mut self` helpers.
    graph: std::sync::Arc<Graph>,
    config: NetworkConfig,
    max_batch: usize,
    image_size: u32,
    /// Node shapes, gradient buffer assignment and batch-norm fusion, derived once.
    plan: Plan,
    acts: Vec<Option<B::Tensor>>,
    /// Activation-gradient buffers, shared by values whose gradients are never live at the
    /// same time (`plan.grad_slot` says which value's gradient lives where).
    grad_bufs: Vec<Option<B::Tensor>>,
    params: Vec<Option<B::Tensor>>,
    param_grads: Vec<Option<B::Tensor>>,
    buffers: Vec<Option<B::Tensor>>,
    /// `num_batches_tracked` per buffer index (host side; only BN counter entries are used).
    batches_tracked: Vec<f32>,
    /// Saved (mean, invstd) per node (BatchNorm nodes only).
    saved: Vec<Option<(B::Tensor, B::Tensor)>>,
    /// Images of the last training forward, whose gradients are held.
    grads_for: Option<usize>,
    /// Global (mean, biased variance) scratch of synchronised batch norm, `max_channels`
    /// values each: the frozen-statistics op reads them as its "running" statistics.
    bn_scratch: Option<(B::Tensor, B::Tensor)>,
    /// Per BN node, the sums of synchronised batch norm: forward (Σx, Σx², rows) and
    /// backward (Σdγ, Σdβ), allocated by the first synchronised step.
    bn_sums: Vec<Option<BnSums<B>>>,
    /// Per BN node (fused networks only): its input's moments, as the convolution before it
    /// leaves them in a training forward.
    bn_moments: Vec<Option<B::Tensor>>,
    /// Per BN node: whether `bn_moments` holds this forward's moments.
    moments_ready: Vec<bool>,
}

/// A synchronised BN layer's forward and backward sums.
type BnSums<B> = (<B as Backend>::Sums, <B as Backend>::Sums);

impl<B: Backend> std::fmt::Debug for Network<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Network")
            .field("backend", &self.backend.name())
            .field("arch", &self.graph.arch())
            .field("classes", &self.graph.num_classes())
            .field("max_batch", &self.max_batch)
            .field("image_size", &self.image_size)
            .field("config", &self.config)
            .finish()
    }
}

/// Tensors are only taken out of their slots for the duration of one op call; finding a slot
/// empty is a bug in this module (two roles aliasing one tensor), hence a panic.
const BORROWED: &str = "Network: tensor already borrowed (graph aliasing bug)";

fn take<T>(v: &mut [Option<T>], i: usize) -> T {
    v[i].take().expect(BORROWED)
}

fn get_ref<T>(t: &Option<T>) -> &T {
    t.as_ref().expect(BORROWED)
}

fn get<T>(v: &[Option<T>], i: usize) -> &T {
    v[i].as_ref().expect(BORROWED)
}

impl<B: Backend> Network<B> {
    /// Allocates everything for batches of up to `max_batch` images of side `image_size` and
    /// loads torchvision's initialisation with seed 0 (call [`Network::load_state`] for
    /// another).
    pub fn new(
        backend: B,
        graph: &Graph,
        max_batch: usize,
        image_size: u32,
    ) -> Result<Self, ModelError> {
        if max_batch == 0 {
            return Err(ModelError::BadBatch("max_batch must be at least 1".into()));
        }
        let min = if graph.arch().is_cifar() { 4 } else { 32 };
        if image_size < min {
            return Err(ModelError::BadBatch(format!(
                "image size {image_size} is too small for {} (at least {min})",
                graph.arch()
            )));
        }
        // Which batch-norm work the convolutions take: `Backend::bn_fusion` decides, and
        // `Backend::conv_applies_bn` whether they apply the batch norms they alone read.
        let fusion = match (backend.bn_fusion(), backend.conv_applies_bn()) {
            (true, true) => FusionPlan::of(graph).with_convs_applying(graph),
            (true, false) => FusionPlan::of(graph),
            (false, _) => FusionPlan::none(graph),
        };
        let plan = Plan::new(graph, image_size, fusion);
        // A batch norm's output that its reader (max pool, convolution) applies itself is
        // never stored.
        let unstored = plan.unstored_values(graph);
        let mut acts = Vec::with_capacity(plan.dims.len());
        for (v, d) in plan.dims.iter().enumerate() {
            acts.push(match unstored[v] {
                true => None,
                false => Some(backend.alloc(max_batch * d.per_image(), TensorRole::Activation)?),
            });
        }
        // The outputs whose ReLU mask a data gradient reads and no input recomputes: the
        // backend may keep their signs packed beside them.
        for (v, marked) in plan
            .fusion
            .residual_relu_outputs(graph)
            .into_iter()
            .enumerate()
        {
            if let (true, Some(y)) = (marked, acts[v].as_mut()) {
                backend.keep_relu_signs(y)?;
            }
        }
        let mut grad_bufs = Vec::with_capacity(plan.grad_sizes.len());
        for &per_image in &plan.grad_sizes {
            grad_bufs.push(Some(
                backend.alloc(max_batch * per_image, TensorRole::Activation)?,
            ));
        }
        let mut params = Vec::new();
        let mut param_grads = Vec::new();
        for p in graph.params() {
            params.push(Some(backend.alloc(p.numel(), TensorRole::Weight)?));
            param_grads.push(Some(backend.alloc(p.numel(), TensorRole::WeightGrad)?));
        }
        let mut buffers = Vec::new();
        for b in graph.buffers() {
            buffers.push(Some(backend.alloc(b.numel(), TensorRole::Statistic)?));
        }
        let mut saved = Vec::new();
        for node in graph.nodes() {
            saved.push(match node {
                Node::BatchNorm { channels, .. } => Some((
                    backend.alloc(*channels, TensorRole::Statistic)?,
                    backend.alloc(*channels, TensorRole::Statistic)?,
                )),
                _ => None,
            });
        }
        let max_channels = graph
            .nodes()
            .iter()
            .filter_map(|node| match node {
                Node::BatchNorm { channels, .. } => Some(*channels),
                _ => None,
            })
            .max()
            .unwrap_or(1);
        let bn_scratch = Some((
            backend.alloc(max_channels, TensorRole::Statistic)?,
            backend.alloc(max_channels, TensorRole::Statistic)?,
        ));
        let mut bn_moments = Vec::new();
        for (k, node) in graph.nodes().iter().enumerate() {
            bn_moments.push(match node {
                Node::BatchNorm { channels, .. } if plan.fusion.stats_for.contains(&Some(k)) => {
                    Some(backend.alloc(3 * channels, TensorRole::Statistic)?)
                }
                _ => None,
            });
        }
        let mut net = Network {
            backend,
            graph: std::sync::Arc::new(graph.clone()),
            config: NetworkConfig::default(),
            max_batch,
            image_size,
            plan,
            acts,
            grad_bufs,
            params,
            param_grads,
            buffers,
            batches_tracked: vec![0.0; graph.buffers().len()],
            saved,
            grads_for: None,
            bn_scratch,
            bn_sums: (0..graph.nodes().len()).map(|_| None).collect(),
            moments_ready: vec![false; graph.nodes().len()],
            bn_moments,
        };
        net.load_state(&ModelState::init(graph, 0))?;
        Ok(net)
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The graph.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// Current options.
    pub fn config(&self) -> NetworkConfig {
        self.config
    }

    /// Changes options (label smoothing, frozen BN, BN momentum/eps).
    pub fn set_config(&mut self, config: NetworkConfig) {
        self.config = config;
    }

    /// Largest batch accepted.
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// Activation and activation-gradient elements held per image of `max_batch` (the part
    /// of the memory that scales with the batch; parameters, gradients and optimizer state
    /// come on top). Multiply by the backend's bytes per activation element.
    pub fn elements_per_image(&self) -> usize {
        let unstored: usize = (self.plan.unstored_values(&self.graph).iter())
            .zip(&self.plan.dims)
            .filter(|(&u, _)| u)
            .map(|(_, d)| d.per_image())
            .sum();
        let acts = self.graph.activation_elements(self.image_size) - unstored;
        let grads: usize = self
            .grad_bufs
            .iter()
            .map(|t| self.backend.len(get_ref(t)))
            .sum();
        acts + grads / self.max_batch
    }

    /// Image side the network was built for.
    pub fn image_size(&self) -> u32 {
        self.image_size
    }

    /// The backend, mutably (e.g. to switch a device stream between steps).
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// Forward and backward on one batch: returns the loss/accuracy sums and keeps the
    /// gradients of the batch's *mean* loss (read them with [`Network::grads_f32`]). BN running
    /// statistics advance unless `freeze_bn`.
    pub fn train_step(&mut self, input: &InputBatch<'_>) -> Result<StepStats, ModelError> {
        self.train_step_with(input, &mut |_, _| Ok(()))
    }

    /// [`Network::train_step`] that also calls `on_grad_ready(param, gradient)` as soon as
    /// each parameter's gradient is final during backward: exactly once per parameter, in the
    /// order backward produces them ([`Network::grad_ready_order`]), right after the backend
    /// op that writes it was issued (on an asynchronous backend the op is enqueued, not
    /// necessarily finished: the hook must order its own work after it, e.g. on the same
    /// stream). `param` indexes `graph.params()`; the tensor is in the backend's layout.
    ///
    /// This is what lets a data-parallel driver start each gradient bucket's all-reduce while
    /// backward is still computing the earlier layers. An error from the hook stops backward
    /// and is returned as [`ModelError::GradHook`]; the gradients are then incomplete.
    pub fn train_step_with(
        &mut self,
        input: &InputBatch<'_>,
        on_grad_ready: &mut GradReadyHook<'_, B::Tensor>,
    ) -> Result<StepStats, ModelError> {
        self.train_step_synced(input, on_grad_ready, None)
    }

    /// What a training step of `n` images records on the host once its kernels are issued:
    /// the batch counters advance (unless batch norm is frozen), the gradients are `n`'s.
    fn count_train_step(&mut self, n: usize, mode: BnMode) {
        if mode == BnMode::Train {
            for (i, b) in self.graph.buffers().iter().enumerate() {
                if b.kind == BufferKind::NumBatchesTracked {
                    self.batches_tracked[i] += 1.0;
                }
            }
        }
        self.grads_for = Some(n);
    }

    /// A training step of `n` images whose kernels ran from a captured CUDA graph (the same
    /// launches as [`Network::train_step`]'s, replayed): the host's record of it, as
    /// `train_step` keeps it.
    pub fn replayed_train_step(&mut self, n: usize) {
        let mode = if self.config.freeze_bn {
            BnMode::Frozen
        } else {
            BnMode::Train
        };
        self.count_train_step(n, mode);
    }

    /// [`Network::train_step_with`] with synchronised batch norm when `sync_bn` is given (and
    /// BN is not frozen): every BN layer normalises with the statistics of the *global* batch
    /// (all replicas' images, each replica weighted by its rows), and its backward uses the
    /// global sums of the two backward reductions, as PyTorch's SyncBatchNorm.
    ///
    /// How: forward sums per-channel Σx, Σx² and the row count over replicas, then runs the
    /// backend's fused op in frozen mode with those statistics and advances the running
    /// statistics itself (unbiased variance over the global rows). Backward runs the fused op
    /// in frozen mode (local Σdz and Σdz·x̂ come back as dβ and dγ, and the residual's
    /// gradient), sums them over replicas and writes dx with the backend's batch-statistics
    /// input gradient on the global sums ([`Backend::bn_sync_backward`]). The parameter
    /// gradients stay local, to be averaged with every other gradient.
    ///
    /// The per-channel sums stay where the backend keeps them ([`Backend::Sums`]): the
    /// backend packs them and turns the summed values into statistics and reductions
    /// (`bn_sync_*` ops, kernels on a GPU), and the reducer sums them in place
    /// ([`BnAllReduce::sum_sums`]: NCCL on the device; other reducers through the host).
    pub fn train_step_synced(
        &mut self,
        input: &InputBatch<'_>,
        on_grad_ready: &mut GradReadyHook<'_, B::Tensor>,
        mut sync_bn: Option<&mut dyn BnAllReduce>,
    ) -> Result<StepStats, ModelError> {
        input.validate(self.max_batch, self.image_size)?;
        let n = input.len;
        self.grads_for = None;
        let mode = if self.config.freeze_bn {
            BnMode::Frozen
        } else {
            BnMode::Train
        };
        let mut bn_sync = if mode == BnMode::Train {
            sync_bn.take()
        } else {
            None
        };
        self.forward(input, mode, reborrow(&mut bn_sync))?;
        let logits = self.plan.logits();
        let classes = self.graph.num_classes();
        let mut dlogits = take(&mut self.grad_bufs, self.plan.grad_slot[logits]);
        let loss = self.backend.softmax_cross_entropy(
            n,
            classes,
            get(&self.acts, logits),
            &Targets::of_batch(input, self.config.label_smoothing),
            Some(&mut dlogits),
            None,
        );
        self.grad_bufs[self.plan.grad_slot[logits]] = Some(dlogits);
        let loss = loss?;
        self.backward(n, mode == BnMode::Train, on_grad_ready, bn_sync)?;
        self.count_train_step(n, mode);
        Ok(StepStats {
            loss_sum: loss.loss_sum,
            correct_top1: loss.correct_top1,
            correct_top5: loss.correct_top5,
            count: n,
        })
    }
}
