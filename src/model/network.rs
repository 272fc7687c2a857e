//! Executes a [`Graph`] forward and backward on a [`Backend`].

use crate::backend::bn_sync::{self, SumThroughHostError};
use crate::backend::{
    Backend, BnBackward, BnForward, BnGradEpilogue, BnMode, BnShape, BnSyncBackward, LinearShape,
    PoolShape, SumsMut, TensorRole,
};

use super::bn_fusion::FusionPlan;
use super::graph::{BufferKind, Graph, Node, ParamKind, ValueDims};
use super::{Augment, InputBatch, ModelError, ModelState, StepStats};

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
    dims: Vec<ValueDims>,
    acts: Vec<Option<B::Tensor>>,
    /// Activation-gradient buffers, shared by values whose gradients are never live at the
    /// same time (see [`plan_grad_buffers`]).
    grad_bufs: Vec<Option<B::Tensor>>,
    /// Buffer of each value's gradient (`usize::MAX` for the input image, which needs none).
    grad_slot: Vec<usize>,
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
    /// Which batch-norm work the convolutions take ([`Backend::bn_fusion`] when the network
    /// was built; [`FusionPlan::none`] otherwise).
    fusion: FusionPlan,
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

/// OIHW (torchvision) → OHWI (backend).
pub(crate) fn oihw_to_ohwi(v: &[f32], shape: &[usize]) -> Vec<f32> {
    let mut out = vec![0.0; v.len()];
    permute_conv_weight(v, shape, &mut out, false);
    out
}

/// OHWI (backend) → OIHW (torchvision).
pub(crate) fn ohwi_to_oihw(v: &[f32], shape: &[usize]) -> Vec<f32> {
    let mut out = vec![0.0; v.len()];
    ohwi_to_oihw_into(v, shape, &mut out);
    out
}

/// OHWI (backend) → OIHW (torchvision), written into `out` (`v.len()` values).
fn ohwi_to_oihw_into(v: &[f32], shape: &[usize], out: &mut [f32]) {
    permute_conv_weight(v, shape, out, true);
}

/// Transposes each output channel's `I × (H·W)` block between OIHW and OHWI (`to_oihw` picks
/// the direction). Output channels are independent, so they are done in parallel; a pure
/// permutation, hence the same bits whatever the thread count. Per parameter update this runs
/// over every convolution weight twice, which made it a visible share of a CPU step.
fn permute_conv_weight(v: &[f32], shape: &[usize], out: &mut [f32], to_oihw: bool) {
    use rayon::prelude::*;
    let (i, hw) = (shape[1], shape[2] * shape[3]);
    let block = i * hw;
    if block == 0 {
        return;
    }
    let permute = |(dst, src): (&mut [f32], &[f32])| {
        if to_oihw {
            // src is (hw × i), dst is (i × hw).
            for (p, row) in src.chunks_exact(i).enumerate() {
                for (b, &val) in row.iter().enumerate() {
                    dst[b * hw + p] = val;
                }
            }
        } else {
            // src is (i × hw), dst is (hw × i).
            for (b, row) in src.chunks_exact(hw).enumerate() {
                for (p, &val) in row.iter().enumerate() {
                    dst[p * i + b] = val;
                }
            }
        }
    };
    let out = &mut out[..v.len()];
    // Inside a pool (a backend op) the permutation shares it; elsewhere it runs on a pool of
    // its own, never rayon's global one, whose start panics where the OS refuses a thread.
    // Without threads it runs on the caller's: the same bits, later.
    let inside = rayon::current_thread_index().is_some();
    let pool = if inside { None } else { permute_pool() };
    if inside || pool.is_some() {
        let mut parallel = || {
            out.par_chunks_mut(block)
                .zip(v.par_chunks(block))
                .for_each(permute)
        };
        match pool {
            Some(pool) => pool.install(parallel),
            None => parallel(),
        }
    } else {
        out.chunks_mut(block).zip(v.chunks(block)).for_each(permute);
    }
}

/// The pool of the layout permutations outside a backend op (one thread per core), started
/// at the first use; `None` when the OS refused its threads.
fn permute_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        crate::backend::cpu::start_pool(cores, "weight-layout").ok()
    })
    .as_ref()
}

/// The values a node's backward writes gradients into (its input unless that is the image,
/// and its residual), and the value whose gradient it consumes.
fn grad_flow(node: &Node) -> (Vec<usize>, usize) {
    let (input, output, residual) = match *node {
        Node::Conv { input, output, .. }
        | Node::MaxPool { input, output, .. }
        | Node::GlobalAvgPool { input, output }
        | Node::Linear { input, output, .. } => (input, output, None),
        Node::BatchNorm {
            input,
            output,
            residual,
            ..
        } => (input, output, residual),
    };
    let writes = [Some(input), residual]
        .into_iter()
        .flatten()
        .filter(|&v| v != 0)
        .collect();
    (writes, output)
}

/// Assigns activation gradients to shared buffers. In the reverse pass a value's gradient is
/// live from the first contribution (at its last consumer) until its producer has consumed
/// it, so a ResNet needs only a few buffers at a time instead of one per value (about half
/// the activation memory). Returns each value's buffer and each buffer's per-image size.
///
/// With a [`FusionPlan`], a batch norm whose residual gradient stays in place writes no
/// residual gradient, and its output's gradient lives on until the convolution that reads it
/// as `residual_grad` (its residual's first reader) has run.
fn plan_grad_buffers(
    graph: &Graph,
    dims: &[ValueDims],
    fusion: &FusionPlan,
) -> (Vec<usize>, Vec<usize>) {
    let mut slot = vec![usize::MAX; dims.len()];
    let mut sizes: Vec<usize> = Vec::new();
    let mut free: Vec<usize> = Vec::new();
    let mut assign = |v: usize, slot: &mut Vec<usize>, free: &mut Vec<usize>| {
        if slot[v] != usize::MAX {
            return;
        }
        let need = dims[v].per_image();
        // Best fit among free buffers; else grow the largest free one; else a new buffer.
        let pick = free
            .iter()
            .enumerate()
            .filter(|(_, &b)| sizes[b] >= need)
            .min_by_key(|(_, &b)| sizes[b])
            .or_else(|| free.iter().enumerate().max_by_key(|(_, &b)| sizes[b]))
            .map(|(i, _)| i);
        let b = match pick {
            Some(i) => free.swap_remove(i),
            None => {
                sizes.push(0);
                sizes.len() - 1
            }
        };
        sizes[b] = sizes[b].max(need);
        slot[v] = b;
    };
    assign(dims.len() - 1, &mut slot, &mut free);
    for (k, node) in graph.nodes().iter().enumerate().rev() {
        let (mut writes, consumed) = grad_flow(node);
        if fusion.residual_in_place[k] {
            if let Node::BatchNorm {
                residual: Some(r), ..
            } = *node
            {
                writes.retain(|&v| v != r);
            }
        }
        for v in writes {
            assign(v, &mut slot, &mut free);
        }
        // In place: the consumer of the residual frees it (below).
        if !fusion.residual_in_place[k] {
            free.push(slot[consumed]);
        }
        if let Some(v) = fusion.residual_from[k] {
            free.push(slot[v]);
        }
    }
    (slot, sizes)
}

/// The elements a [`Network`] allocates (see [`Network::new`]), from the same buffer plan it
/// uses: for memory estimates that match what is really allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferPlan {
    /// Activations, per image (every value of the graph, the input included).
    pub activations_per_image: usize,
    /// Activation gradients, per image: the shared buffers of the reverse pass, far fewer
    /// than one per value (see [`Network`]).
    pub activation_grads_per_image: usize,
    /// Parameters (and as many parameter gradients).
    pub params: usize,
    /// Buffers (batch-norm running statistics and counters).
    pub buffers: usize,
    /// Saved batch mean and inverse std of every BN layer, its moments where the backend
    /// fuses batch norm into the convolutions, and the synchronised-BN scratch.
    pub statistics: usize,
}

/// The [`BufferPlan`] of `graph` at images of side `image_size`: the larger of the unfused
/// and the fused network's (a backend decides which runs).
pub fn buffer_plan(graph: &Graph, image_size: u32) -> BufferPlan {
    let dims = graph.value_dims(image_size);
    let grads =
        |fusion: &FusionPlan| -> usize { plan_grad_buffers(graph, &dims, fusion).1.iter().sum() };
    let activation_grads_per_image =
        grads(&FusionPlan::none(graph)).max(grads(&FusionPlan::of(graph)));
    let channels: Vec<usize> = graph
        .nodes()
        .iter()
        .filter_map(|node| match node {
            Node::BatchNorm { channels, .. } => Some(*channels),
            _ => None,
        })
        .collect();
    let widest = channels.iter().copied().max().unwrap_or(1);
    BufferPlan {
        activations_per_image: dims.iter().map(|d| d.per_image()).sum(),
        activation_grads_per_image,
        params: graph.param_count(),
        buffers: graph.buffers().iter().map(|b| b.numel()).sum(),
        // saved mean and invstd, the fused path's moments, the synchronised-BN scratch
        statistics: (2 + 3) * channels.iter().sum::<usize>() + 2 * widest,
    }
}

/// The gradient-ready callback of [`Network::train_step_with`]: parameter index (into
/// `graph.params()`) and its final gradient tensor.
pub type GradReadyHook<'a, T> = dyn FnMut(usize, &T) -> Result<(), GradHookError> + 'a;

/// What a gradient-ready hook may fail with (e.g. an NCCL launch error); it is carried to
/// the caller inside [`ModelError::GradHook`].
pub type GradHookError = Box<dyn std::error::Error + Send + Sync>;

/// Cross-replica sums for synchronised batch norm ([`Network::train_step_synced`]).
///
/// Every replica calls [`BnAllReduce::sum_in_place`] the same number of times, in the same
/// order (once per BN layer in forward, once per BN layer in backward), with vectors of the
/// same length; each call returns when every replica's values are summed into `values`.
pub trait BnAllReduce {
    /// Sums `values` element-wise over every replica, in place.
    fn sum_in_place(&mut self, values: &mut [f64]) -> Result<(), GradHookError>;

    /// Sums a backend's sums over every replica, in place, where they are. The default goes
    /// through the host ([`BnAllReduce::sum_in_place`]; device sums are downloaded and
    /// uploaded again); a reducer with a device path (NCCL) sums device memory on the device.
    fn sum_sums(&mut self, mut sums: SumsMut<'_>) -> Result<(), GradHookError> {
        sums.sum_through_host(|v| self.sum_in_place(v))
            .map_err(|e| match e {
                SumThroughHostError::Device(e) => Box::new(e) as GradHookError,
                SumThroughHostError::Sum(e) => e,
            })
    }
}

/// A shorter-lived handle on an optional reducer (`Option::as_deref_mut` cannot shorten the
/// trait object's lifetime, which `&mut` makes invariant).
fn reborrow<'a>(r: &'a mut Option<&mut dyn BnAllReduce>) -> Option<&'a mut dyn BnAllReduce> {
    match r {
        Some(r) => Some(&mut **r),
        None => None,
    }
}

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

/// See [`Network::grad_ready_order`].
fn grad_ready_order(graph: &Graph) -> Vec<usize> {
    let mut order = Vec::with_capacity(graph.params().len());
    for node in graph.nodes().iter().rev() {
        match *node {
            Node::Conv { weight, .. } => order.push(weight),
            Node::BatchNorm { weight, bias, .. } | Node::Linear { weight, bias, .. } => {
                order.extend([weight, bias])
            }
            Node::MaxPool { .. } | Node::GlobalAvgPool { .. } => {}
        }
    }
    order
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
        let dims = graph.value_dims(image_size);
        let mut acts = Vec::with_capacity(dims.len());
        for d in &dims {
            acts.push(Some(
                backend.alloc(max_batch * d.per_image(), TensorRole::Activation)?,
            ));
        }
        let fusion = if backend.bn_fusion() {
            FusionPlan::of(graph)
        } else {
            FusionPlan::none(graph)
        };
        let (grad_slot, sizes) = plan_grad_buffers(graph, &dims, &fusion);
        let mut grad_bufs = Vec::with_capacity(sizes.len());
        for per_image in sizes {
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
                Node::BatchNorm { channels, .. } if fusion.stats_for.contains(&Some(k)) => {
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
            dims,
            acts,
            grad_bufs,
            grad_slot,
            params,
            param_grads,
            buffers,
            batches_tracked: vec![0.0; graph.buffers().len()],
            saved,
            grads_for: None,
            bn_scratch,
            bn_sums: (0..graph.nodes().len()).map(|_| None).collect(),
            moments_ready: vec![false; graph.nodes().len()],
            fusion,
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
        let acts = self.graph.activation_elements(self.image_size);
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

    /// Uploads parameters and buffers (converting convolution weights to the backend layout).
    pub fn load_state(&mut self, s: &ModelState) -> Result<(), ModelError> {
        s.validate(&self.graph)?;
        for (i, spec) in self.graph.params().iter().enumerate() {
            let t = self.params[i]
                .as_mut()
                .expect("params not borrowed between calls");
            if spec.kind == ParamKind::ConvWeight {
                self.backend
                    .upload(&oihw_to_ohwi(&s.params[i], &spec.shape), t)?;
            } else {
                self.backend.upload(&s.params[i], t)?;
            }
        }
        self.set_buffers(&s.buffers)?;
        self.grads_for = None;
        Ok(())
    }

    /// The buffers (batch-norm running statistics and counters) in `graph.buffers()` order,
    /// as [`Network::state`] returns them, without downloading the parameters.
    pub fn buffers(&self) -> Result<Vec<Vec<f32>>, ModelError> {
        let mut out = Vec::with_capacity(self.buffers.len());
        for (i, spec) in self.graph.buffers().iter().enumerate() {
            out.push(if spec.kind == BufferKind::NumBatchesTracked {
                vec![self.batches_tracked[i]]
            } else {
                self.backend.download(get(&self.buffers, i))?
            });
        }
        Ok(out)
    }

    /// Replaces the buffers (see [`Network::buffers`]); parameters are kept.
    pub fn set_buffers(&mut self, buffers: &[Vec<f32>]) -> Result<(), ModelError> {
        let specs = self.graph.buffers();
        if buffers.len() != specs.len() {
            return Err(ModelError::StateMismatch(format!(
                "{} buffers given, {} has {}",
                buffers.len(),
                self.graph.arch(),
                specs.len()
            )));
        }
        for (i, spec) in specs.iter().enumerate() {
            if buffers[i].len() != spec.numel() {
                return Err(ModelError::StateMismatch(format!(
                    "buffer {} has {} values, expected {}",
                    spec.name,
                    buffers[i].len(),
                    spec.numel()
                )));
            }
            let t = self.buffers[i]
                .as_mut()
                .expect("buffers not borrowed between calls");
            self.backend.upload(&buffers[i], t)?;
            if spec.kind == BufferKind::NumBatchesTracked {
                self.batches_tracked[i] = buffers[i][0];
            }
        }
        Ok(())
    }

    /// Uploads parameter `index`'s values given in the backend's layout (convolutions OHWI),
    /// e.g. from an optimizer that keeps its master weights that way (no permutation).
    pub fn set_param_backend_layout(
        &mut self,
        index: usize,
        values: &[f32],
    ) -> Result<(), ModelError> {
        let t = self
            .params
            .get_mut(index)
            .ok_or_else(|| {
                ModelError::StateMismatch(format!(
                    "parameter {index} of {} does not exist",
                    self.graph.arch()
                ))
            })?
            .as_mut()
            .expect("params not borrowed between calls");
        self.backend.upload(values, t)?;
        Ok(())
    }

    /// Puts the parameter gradients into one flat buffer of `total` elements, parameter i at
    /// `ranges[i]` (a bucket plan's layout), so backward writes each gradient straight into
    /// its bucket and a collective reduces whole buckets in place. Returns the buffer's device
    /// address, or `None` when the backend has no views (the gradients stay separate).
    pub fn flatten_gradients(
        &mut self,
        total: usize,
        ranges: &[std::ops::Range<usize>],
    ) -> Result<Option<u64>, ModelError> {
        let params = self.graph.params();
        if ranges.len() != params.len()
            || ranges.iter().zip(params).any(|(r, p)| r.len() != p.numel())
        {
            return Err(ModelError::StateMismatch(format!(
                "a gradient layout of {} ranges does not fit the {} parameters of {}",
                ranges.len(),
                params.len(),
                self.graph.arch()
            )));
        }
        let Some((base, views)) =
            self.backend
                .alloc_views(total, ranges, TensorRole::WeightGrad)?
        else {
            return Ok(None);
        };
        self.param_grads = views.into_iter().map(Some).collect();
        self.grads_for = None;
        Ok(Some(base))
    }

    /// Downloads parameters and buffers into a host [`ModelState`] (torchvision layout).
    pub fn state(&self) -> Result<ModelState, ModelError> {
        let mut params = Vec::with_capacity(self.params.len());
        for (i, spec) in self.graph.params().iter().enumerate() {
            let v = self.backend.download(get(&self.params, i))?;
            params.push(if spec.kind == ParamKind::ConvWeight {
                let mut t = vec![0.0; v.len()];
                ohwi_to_oihw_into(&v, &spec.shape, &mut t);
                t
            } else {
                v
            });
        }
        let mut buffers = Vec::with_capacity(self.buffers.len());
        for (i, spec) in self.graph.buffers().iter().enumerate() {
            buffers.push(if spec.kind == BufferKind::NumBatchesTracked {
                vec![self.batches_tracked[i]]
            } else {
                self.backend.download(get(&self.buffers, i))?
            });
        }
        Ok(ModelState { params, buffers })
    }

    /// All parameters, flat, graph order, torchvision layout.
    pub fn params_f32(&self) -> Result<Vec<f32>, ModelError> {
        self.flat(&self.params)
    }

    /// Gradients of the mean loss of the last [`Network::train_step`], flat like
    /// [`Network::params_f32`].
    pub fn grads_f32(&self) -> Result<Vec<f32>, ModelError> {
        if self.grads_for.is_none() {
            return Err(ModelError::StateMismatch(
                "no gradients: call train_step first".into(),
            ));
        }
        self.flat(&self.param_grads)
    }

    /// Replaces all parameters from a flat vector (graph order, torchvision layout); buffers
    /// are kept. This is how data-parallel replicas receive the updated master copy.
    pub fn set_params_f32(&mut self, flat: &[f32]) -> Result<(), ModelError> {
        let (offsets, total) = self.graph.param_offsets();
        if flat.len() != total {
            return Err(ModelError::StateMismatch(format!(
                "flat vector has {} values, {} has {total}",
                flat.len(),
                self.graph.arch()
            )));
        }
        for (i, spec) in self.graph.params().iter().enumerate() {
            let v = &flat[offsets[i]..offsets[i] + spec.numel()];
            let t = self.params[i]
                .as_mut()
                .expect("params not borrowed between calls");
            if spec.kind == ParamKind::ConvWeight {
                self.backend.upload(&oihw_to_ohwi(v, &spec.shape), t)?;
            } else {
                self.backend.upload(v, t)?;
            }
        }
        Ok(())
    }

    /// The backend, mutably (e.g. to switch a device stream between steps).
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// Parameter tensors in graph order, in the backend's layout (OHWI convolutions): for
    /// device-side work (a fused optimizer, a broadcast) without a host round trip.
    pub fn param_tensors(&self) -> Vec<&B::Tensor> {
        self.params
            .iter()
            .map(|t| t.as_ref().expect(BORROWED))
            .collect()
    }

    /// Parameter tensors, mutably (a device optimizer writes the new working copy here).
    pub fn param_tensors_mut(&mut self) -> Vec<&mut B::Tensor> {
        self.params
            .iter_mut()
            .map(|t| t.as_mut().expect(BORROWED))
            .collect()
    }

    /// Gradient tensors of the last [`Network::train_step`] in graph order, backend layout.
    pub fn grad_tensors(&self) -> Vec<&B::Tensor> {
        self.param_grads
            .iter()
            .map(|t| t.as_ref().expect(BORROWED))
            .collect()
    }

    /// Gradient tensors, mutably (an all-reduce averages them in place).
    pub fn grad_tensors_mut(&mut self) -> Vec<&mut B::Tensor> {
        self.param_grads
            .iter_mut()
            .map(|t| t.as_mut().expect(BORROWED))
            .collect()
    }

    /// Gradients to read and parameters to write at once, for a fused update.
    pub fn grads_and_params_mut(&mut self) -> (Vec<&B::Tensor>, Vec<&mut B::Tensor>) {
        let grads = self
            .param_grads
            .iter()
            .map(|t| t.as_ref().expect(BORROWED))
            .collect();
        let params = self
            .params
            .iter_mut()
            .map(|t| t.as_mut().expect(BORROWED))
            .collect();
        (grads, params)
    }

    /// BN running-statistics tensors in `graph.buffers()` order (the `num_batches_tracked`
    /// entries are placeholders: the counts live on the host, see [`Network::state`]).
    pub fn buffer_tensors_mut(&mut self) -> Vec<&mut B::Tensor> {
        self.buffers
            .iter_mut()
            .map(|t| t.as_mut().expect(BORROWED))
            .collect()
    }

    fn flat(&self, tensors: &[Option<B::Tensor>]) -> Result<Vec<f32>, ModelError> {
        let mut out = Vec::with_capacity(self.graph.param_count());
        for (i, spec) in self.graph.params().iter().enumerate() {
            let v = self.backend.download(get(tensors, i))?;
            if spec.kind == ParamKind::ConvWeight {
                // Straight into the flat vector: no temporary per weight.
                let start = out.len();
                out.resize(start + v.len(), 0.0);
                ohwi_to_oihw_into(&v, &spec.shape, &mut out[start..]);
            } else {
                out.extend(v);
            }
        }
        Ok(out)
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
        let logits = self.dims.len() - 1;
        let classes = self.graph.num_classes();
        let mut dlogits = take(&mut self.grad_bufs, self.grad_slot[logits]);
        let loss = self.backend.softmax_cross_entropy(
            n,
            classes,
            get(&self.acts, logits),
            &input.targets(self.config.label_smoothing),
            Some(&mut dlogits),
            None,
        );
        self.grad_bufs[self.grad_slot[logits]] = Some(dlogits);
        let loss = loss?;
        self.backward(n, mode == BnMode::Train, on_grad_ready, bn_sync)?;
        if mode == BnMode::Train {
            for (i, b) in self.graph.buffers().iter().enumerate() {
                if b.kind == BufferKind::NumBatchesTracked {
                    self.batches_tracked[i] += 1.0;
                }
            }
        }
        self.grads_for = Some(n);
        Ok(StepStats {
            loss_sum: loss.loss_sum,
            correct_top1: loss.correct_top1,
            correct_top5: loss.correct_top5,
            count: n,
        })
    }

    /// Inference on one batch (BN running statistics, no augmentation unless the batch
    /// carries some): loss/accuracy sums (with the configured label smoothing) and softmax
    /// probabilities (`len × classes`, row-major). For prediction without labels pass dummy
    /// labels (e.g. zeros); only the statistics are then meaningless.
    pub fn eval_step(
        &mut self,
        input: &InputBatch<'_>,
    ) -> Result<(StepStats, Vec<f32>), ModelError> {
        input.validate(self.max_batch, self.image_size)?;
        let n = input.len;
        self.forward(input, BnMode::Eval, None)?;
        let logits = self.dims.len() - 1;
        let mut probs = Vec::new();
        let loss = self.backend.softmax_cross_entropy(
            n,
            self.graph.num_classes(),
            get(&self.acts, logits),
            &input.targets(self.config.label_smoothing),
            None,
            Some(&mut probs),
        )?;
        let stats = StepStats {
            loss_sum: loss.loss_sum,
            correct_top1: loss.correct_top1,
            correct_top5: loss.correct_top5,
            count: n,
        };
        Ok((stats, probs))
    }

    /// [`Self::eval_step`] with test-time augmentation: each image is classified as stored
    /// and mirrored left to right, and the two probability vectors are averaged. The
    /// statistics are those of the averaged probabilities (what a user of the answer sees).
    /// The batch must carry no augmentation of its own.
    pub fn eval_step_mirrored(
        &mut self,
        input: &InputBatch<'_>,
    ) -> Result<(StepStats, Vec<f32>), ModelError> {
        if input.augment.is_some() {
            return Err(ModelError::BadBatch(
                "a batch for test-time augmentation carries augmentation already".into(),
            ));
        }
        let (_, mut probs) = self.eval_step(input)?;
        let mirror = vec![
            Augment {
                flip: true,
                ..Augment::default()
            };
            input.len
        ];
        let (_, mirrored) = self.eval_step(&InputBatch {
            augment: Some(&mirror),
            ..*input
        })?;
        for (p, q) in probs.iter_mut().zip(&mirrored) {
            *p = 0.5 * (*p + q);
        }
        let stats = StepStats::of_probabilities(
            &probs,
            &input.labels[..input.len],
            self.graph.num_classes(),
            self.config.label_smoothing,
        );
        Ok((stats, probs))
    }

    fn forward(
        &mut self,
        input: &InputBatch<'_>,
        mode: BnMode,
        mut sync_bn: Option<&mut dyn BnAllReduce>,
    ) -> Result<(), ModelError> {
        let n = input.len;
        self.moments_ready.iter_mut().for_each(|r| *r = false);
        let mut x0 = take(&mut self.acts, 0);
        let r = self.backend.input(input, &mut x0);
        self.acts[0] = Some(x0);
        r?;
        let graph = self.graph.clone();
        for (k, node) in graph.nodes().iter().enumerate() {
            match *node {
                Node::Conv {
                    input,
                    output,
                    weight,
                    ..
                } => {
                    let s = self
                        .graph
                        .conv_shape(node, &self.dims, n)
                        .expect("conv node");
                    let mut y = take(&mut self.acts, output);
                    // Fused, in training: the batch norm's statistics come with the output.
                    let stats_for = self.fusion.stats_for[k].filter(|_| mode == BnMode::Train);
                    let r = match stats_for {
                        Some(bn) => {
                            let mut m = take(&mut self.bn_moments, bn);
                            let r = self.backend.conv_forward_moments(
                                &s,
                                get(&self.acts, input),
                                get(&self.params, weight),
                                &mut y,
                                &mut m,
                            );
                            self.bn_moments[bn] = Some(m);
                            self.moments_ready[bn] = r.is_ok();
                            r
                        }
                        None => self.backend.conv_forward(
                            &s,
                            get(&self.acts, input),
                            get(&self.params, weight),
                            &mut y,
                        ),
                    };
                    self.acts[output] = Some(y);
                    r?;
                }
                Node::BatchNorm {
                    input,
                    output,
                    residual,
                    relu,
                    weight,
                    bias,
                    running_mean,
                    running_var,
                    channels,
                    ..
                } => {
                    let d = self.dims[input];
                    let shape = BnShape {
                        rows: n * d.h * d.w,
                        channels,
                    };
                    let synced = match reborrow(&mut sync_bn) {
                        Some(r) => {
                            self.global_bn_stats(k, node, shape, r)?;
                            true
                        }
                        None => false,
                    };
                    let mut y = take(&mut self.acts, output);
                    let (mut mean, mut invstd) = self.saved[k].take().expect("bn saved stats");
                    // Synchronised: the global statistics stand in for the running ones.
                    let (mut rm, mut rv) = match synced {
                        true => self.bn_scratch.take().expect(BORROWED),
                        false => (
                            take(&mut self.buffers, running_mean),
                            take(&mut self.buffers, running_var),
                        ),
                    };
                    let moments = std::mem::take(&mut self.moments_ready[k])
                        .then(|| get(&self.bn_moments, k));
                    let r = self.backend.bn_forward(BnForward {
                        shape,
                        x: get(&self.acts, input),
                        gamma: get(&self.params, weight),
                        beta: get(&self.params, bias),
                        residual: residual.map(|v| get(&self.acts, v)),
                        relu,
                        y: &mut y,
                        saved_mean: &mut mean,
                        saved_invstd: &mut invstd,
                        running_mean: &mut rm,
                        running_var: &mut rv,
                        mode: if synced { BnMode::Frozen } else { mode },
                        momentum: self.config.bn_momentum,
                        eps: self.config.bn_eps,
                        // Synchronised: global_bn_stats read them already.
                        moments: moments.filter(|_| !synced),
                    });
                    self.acts[output] = Some(y);
                    self.saved[k] = Some((mean, invstd));
                    if synced {
                        self.bn_scratch = Some((rm, rv));
                    } else {
                        self.buffers[running_mean] = Some(rm);
                        self.buffers[running_var] = Some(rv);
                    }
                    r?;
                }
                Node::MaxPool {
                    input,
                    output,
                    kernel,
                    stride,
                    padding,
                } => {
                    let d = self.dims[input];
                    let s = PoolShape {
                        n,
                        h: d.h,
                        w: d.w,
                        c: d.c,
                        kernel,
                        stride,
                        padding,
                    };
                    let mut y = take(&mut self.acts, output);
                    let r = self
                        .backend
                        .maxpool_forward(&s, get(&self.acts, input), &mut y);
                    self.acts[output] = Some(y);
                    r?;
                }
                Node::GlobalAvgPool { input, output } => {
                    let d = self.dims[input];
                    let mut y = take(&mut self.acts, output);
                    let r =
                        self.backend
                            .gap_forward(n, d.h * d.w, d.c, get(&self.acts, input), &mut y);
                    self.acts[output] = Some(y);
                    r?;
                }
                Node::Linear {
                    input,
                    output,
                    weight,
                    bias,
                    inputs,
                    outputs,
                } => {
                    let s = LinearShape { n, inputs, outputs };
                    let mut y = take(&mut self.acts, output);
                    let r = self.backend.linear_forward(
                        &s,
                        get(&self.acts, input),
                        get(&self.params, weight),
                        get(&self.params, bias),
                        &mut y,
                    );
                    self.acts[output] = Some(y);
                    r?;
                }
            }
        }
        Ok(())
    }

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
    fn global_bn_stats(
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
        let mut y = take(&mut self.acts, output);
        let (mut mean_t, mut invstd_t) = self.saved[k].take().expect("bn saved stats");
        let r = self.backend.bn_forward(BnForward {
            shape,
            x: get(&self.acts, input),
            gamma: get(&self.params, weight),
            beta: get(&self.params, bias),
            residual: None,
            relu: false,
            y: &mut y,
            saved_mean: &mut mean_t,
            saved_invstd: &mut invstd_t,
            running_mean: &mut tm,
            running_var: &mut tv,
            mode: BnMode::Train,
            momentum: 1.0,
            eps: self.config.bn_eps,
            moments: self.moments_ready[k].then(|| get(&self.bn_moments, k)),
        });
        self.acts[output] = Some(y);
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
    fn sync_bn_backward(
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
        let prepared = self.fusion.prepared[k];
        let (mut moments, mut grads) = self.take_bn_sums(k, shape.channels)?;
        let mut dx = take(&mut self.grad_bufs, self.grad_slot[input]);
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
                        y: get(&self.acts, output),
                        gamma: get(&self.params, weight),
                        saved_mean: mean_t,
                        saved_invstd: invstd_t,
                        // Prepared: dy holds the masked gradient already.
                        relu: relu && !prepared,
                        dy: get(&self.grad_bufs, self.grad_slot[output]),
                        dx: &mut dx,
                    },
                )?)
            });
        self.grad_bufs[self.grad_slot[input]] = Some(dx);
        self.put_bn_sums(k, (moments, grads));
        r
    }

    /// Hands parameter `p`'s (final) gradient to the hook. Every parameter belongs to exactly
    /// one node and backend ops overwrite parameter gradients, so a gradient is final as soon
    /// as its node's backward has written it.
    fn grad_final(
        &self,
        p: usize,
        hook: &mut GradReadyHook<'_, B::Tensor>,
    ) -> Result<(), ModelError> {
        hook(p, get(&self.param_grads, p)).map_err(|source| ModelError::GradHook {
            param: self.graph.params()[p].name.clone(),
            source,
        })
    }

    /// Parameter indices in the order [`Network::train_step_with`] reports their gradients
    /// (nodes in reverse, a node's weight before its bias). It is close to, but not exactly,
    /// reverse parameter order: a downsampling block's residual BN is reported before its
    /// shortcut, which torchvision registers after it.
    pub fn grad_ready_order(&self) -> Vec<usize> {
        grad_ready_order(&self.graph)
    }

    /// The cross-replica events of a synchronised BN step in issue order (BN forward sums,
    /// then backward with BN reductions interleaved with gradient-ready reports). A replica
    /// with no images in a step replays this with zeros, so every replica issues the same
    /// collectives in the same order (NCCL's requirement).
    pub fn synced_step_events(&self) -> Vec<SyncEvent> {
        synced_step_events(&self.graph)
    }

    /// The data gradient of conv node `k` finishing the incoming gradient of batch-norm node
    /// `p` (which produced the convolution's input; [`FusionPlan::finishes`]): the mask, the
    /// residual gradient left in place for it, and p's two reductions into its γ and β
    /// gradients, which p's backward then reads (`prepared`).
    fn finishing_backward_data(
        &mut self,
        k: usize,
        p: usize,
        s: &crate::backend::ConvShape,
        written: &[bool],
    ) -> Result<(), ModelError> {
        let Node::Conv {
            input,
            output,
            weight,
            ..
        } = self.graph.nodes()[k]
        else {
            unreachable!("finishing_backward_data is only called for Conv nodes");
        };
        let Node::BatchNorm {
            input: bn_input,
            relu,
            weight: gamma,
            bias: beta,
            ..
        } = self.graph.nodes()[p]
        else {
            unreachable!("a convolution finishes a BatchNorm node");
        };
        let mut dx = take(&mut self.grad_bufs, self.grad_slot[input]);
        let mut dgamma = take(&mut self.param_grads, gamma);
        let mut dbeta = take(&mut self.param_grads, beta);
        let (mean, invstd) = self.saved[p].as_ref().expect("bn saved stats");
        let r = self.backend.conv_backward_data_bn(
            s,
            get(&self.grad_bufs, self.grad_slot[output]),
            get(&self.params, weight),
            &mut dx,
            written[input],
            BnGradEpilogue {
                x: get(&self.acts, bn_input),
                y: get(&self.acts, input),
                relu,
                saved_mean: mean,
                saved_invstd: invstd,
                residual_grad: self.fusion.residual_from[k]
                    .map(|v| get(&self.grad_bufs, self.grad_slot[v])),
                dgamma: &mut dgamma,
                dbeta: &mut dbeta,
            },
        );
        self.grad_bufs[self.grad_slot[input]] = Some(dx);
        self.param_grads[gamma] = Some(dgamma);
        self.param_grads[beta] = Some(dbeta);
        r?;
        Ok(())
    }

    /// Reverse pass. A value's gradient is complete before it is consumed, because every
    /// consumer comes after its producer in node order; `written` says whether a gradient
    /// buffer already holds a contribution (then the next one accumulates).
    fn backward(
        &mut self,
        n: usize,
        batch_stats: bool,
        hook: &mut GradReadyHook<'_, B::Tensor>,
        mut sync_bn: Option<&mut dyn BnAllReduce>,
    ) -> Result<(), ModelError> {
        let mut written = vec![false; self.dims.len()];
        written[self.dims.len() - 1] = true;
        let graph = self.graph.clone();
        for (k, node) in graph.nodes().iter().enumerate().rev() {
            match *node {
                Node::Linear {
                    input,
                    output,
                    weight,
                    bias,
                    inputs,
                    outputs,
                } => {
                    let s = LinearShape { n, inputs, outputs };
                    let mut dx = take(&mut self.grad_bufs, self.grad_slot[input]);
                    let mut dw = take(&mut self.param_grads, weight);
                    let mut db = take(&mut self.param_grads, bias);
                    let r = self.backend.linear_backward(
                        &s,
                        get(&self.acts, input),
                        get(&self.params, weight),
                        get(&self.grad_bufs, self.grad_slot[output]),
                        &mut dx,
                        &mut dw,
                        &mut db,
                        written[input],
                    );
                    self.grad_bufs[self.grad_slot[input]] = Some(dx);
                    self.param_grads[weight] = Some(dw);
                    self.param_grads[bias] = Some(db);
                    r?;
                    written[input] = true;
                    self.grad_final(weight, hook)?;
                    self.grad_final(bias, hook)?;
                }
                Node::GlobalAvgPool { input, output } => {
                    let d = self.dims[input];
                    let mut dx = take(&mut self.grad_bufs, self.grad_slot[input]);
                    let r = self.backend.gap_backward(
                        n,
                        d.h * d.w,
                        d.c,
                        get(&self.grad_bufs, self.grad_slot[output]),
                        &mut dx,
                        written[input],
                    );
                    self.grad_bufs[self.grad_slot[input]] = Some(dx);
                    r?;
                    written[input] = true;
                }
                Node::MaxPool {
                    input,
                    output,
                    kernel,
                    stride,
                    padding,
                } => {
                    let d = self.dims[input];
                    let s = PoolShape {
                        n,
                        h: d.h,
                        w: d.w,
                        c: d.c,
                        kernel,
                        stride,
                        padding,
                    };
                    let mut dx = take(&mut self.grad_bufs, self.grad_slot[input]);
                    let r = self.backend.maxpool_backward(
                        &s,
                        get(&self.acts, input),
                        get(&self.grad_bufs, self.grad_slot[output]),
                        &mut dx,
                        written[input],
                    );
                    self.grad_bufs[self.grad_slot[input]] = Some(dx);
                    r?;
                    written[input] = true;
                }
                Node::BatchNorm {
                    input,
                    output,
                    residual,
                    relu,
                    weight,
                    bias,
                    channels,
                    ..
                } => {
                    // A BN input is a convolution output with this single consumer.
                    debug_assert!(!written[input]);
                    let d = self.dims[input];
                    let mut dx = take(&mut self.grad_bufs, self.grad_slot[input]);
                    // Fused, the residual's gradient may stay in place: its reader takes it
                    // from dy (and its buffer is not this residual's yet: not touched).
                    let mut dres = residual
                        .filter(|_| !self.fusion.residual_in_place[k])
                        .map(|v| take(&mut self.grad_bufs, self.grad_slot[v]));
                    let mut dgamma = take(&mut self.param_grads, weight);
                    let mut dbeta = take(&mut self.param_grads, bias);
                    let (mean, invstd) = self.saved[k].as_ref().expect("bn saved stats");
                    let acc = residual.is_some_and(|v| written[v]);
                    let shape = BnShape {
                        rows: n * d.h * d.w,
                        channels,
                    };
                    let synced = batch_stats && sync_bn.is_some();
                    let r = self.backend.bn_backward(BnBackward {
                        shape,
                        x: get(&self.acts, input),
                        y: get(&self.acts, output),
                        gamma: get(&self.params, weight),
                        saved_mean: mean,
                        saved_invstd: invstd,
                        // Synchronised: the local op gives the two local reductions (dγ, dβ;
                        // prepared: the dgrad epilogue's, kept) and the residual's gradient;
                        // dx is written again from the global reductions.
                        batch_stats: batch_stats && !synced,
                        relu,
                        dy: get(&self.grad_bufs, self.grad_slot[output]),
                        dx: &mut dx,
                        dresidual: dres.as_mut().map(|t| (t, acc)),
                        dgamma: &mut dgamma,
                        dbeta: &mut dbeta,
                        prepared: self.fusion.prepared[k],
                    });
                    self.grad_bufs[self.grad_slot[input]] = Some(dx);
                    if let (Some(v), Some(t)) = (residual, dres) {
                        self.grad_bufs[self.grad_slot[v]] = Some(t);
                        written[v] = true;
                    }
                    self.param_grads[weight] = Some(dgamma);
                    self.param_grads[bias] = Some(dbeta);
                    r?;
                    written[input] = true;
                    if let (true, Some(r)) = (synced, reborrow(&mut sync_bn)) {
                        self.sync_bn_backward(k, node, shape, r)?;
                    }
                    self.grad_final(weight, hook)?;
                    self.grad_final(bias, hook)?;
                }
                Node::Conv {
                    input,
                    output,
                    weight,
                    ..
                } => {
                    let s = self
                        .graph
                        .conv_shape(node, &self.dims, n)
                        .expect("conv node");
                    let mut dw = take(&mut self.param_grads, weight);
                    let r = self.backend.conv_backward_weight(
                        &s,
                        get(&self.acts, input),
                        get(&self.grad_bufs, self.grad_slot[output]),
                        &mut dw,
                    );
                    self.param_grads[weight] = Some(dw);
                    r?;
                    // Reported before the data gradient is computed: the earlier the bucket
                    // completes, the more of backward its all-reduce hides behind.
                    self.grad_final(weight, hook)?;
                    if let Some(p) = self.fusion.finishes[k] {
                        self.finishing_backward_data(k, p, &s, &written)?;
                        written[input] = true;
                    } else if input != 0 {
                        let mut dx = take(&mut self.grad_bufs, self.grad_slot[input]);
                        let r = self.backend.conv_backward_data(
                            &s,
                            get(&self.grad_bufs, self.grad_slot[output]),
                            get(&self.params, weight),
                            &mut dx,
                            written[input],
                        );
                        self.grad_bufs[self.grad_slot[input]] = Some(dx);
                        r?;
                        written[input] = true;
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Arch;

    /// Replays the reverse pass's gradient reads and writes against the buffer plan of
    /// `graph` with `fusion`: every gradient read must still be in its buffer, and no write
    /// may land in a buffer that holds another live gradient.
    fn replay(graph: &Graph, fusion: &FusionPlan) {
        let dims = graph.value_dims(32);
        let (slot, sizes) = plan_grad_buffers(graph, &dims, fusion);
        let nodes = graph.nodes();
        let logits = dims.len() - 1;
        // The node (in reverse order: the last to run) that reads each gradient last.
        let mut last_read = vec![usize::MAX; dims.len()];
        let reads_of = |k: usize| -> Vec<usize> {
            let (_, consumed) = grad_flow(&nodes[k]);
            [Some(consumed), fusion.residual_from[k]]
                .into_iter()
                .flatten()
                .collect()
        };
        for k in 0..nodes.len() {
            for v in reads_of(k) {
                last_read[v] = last_read[v].min(k);
            }
        }
        let mut owner: Vec<Option<usize>> = vec![None; sizes.len()];
        owner[slot[logits]] = Some(logits);
        for k in (0..nodes.len()).rev() {
            let reads = reads_of(k);
            for &v in &reads {
                assert_eq!(
                    owner[slot[v]],
                    Some(v),
                    "node {k} reads {v}'s gradient from a buffer holding another"
                );
            }
            let (mut writes, _) = grad_flow(&nodes[k]);
            if fusion.residual_in_place[k] {
                if let Node::BatchNorm {
                    residual: Some(r), ..
                } = nodes[k]
                {
                    writes.retain(|&v| v != r);
                }
            }
            for v in writes {
                assert!(
                    owner[slot[v]].is_none() || owner[slot[v]] == Some(v),
                    "node {k} writes {v}'s gradient over {:?}'s",
                    owner[slot[v]]
                );
                owner[slot[v]] = Some(v);
            }
            for v in reads {
                if last_read[v] == k {
                    owner[slot[v]] = None;
                }
            }
        }
    }

    #[test]
    fn no_two_live_gradients_share_a_buffer_fused_or_not() {
        for arch in [
            Arch::ResNet8,
            Arch::ResNet20,
            Arch::ResNet18,
            Arch::ResNet50,
        ] {
            let graph = Graph::new(arch, 10);
            replay(&graph, &FusionPlan::none(&graph));
            replay(&graph, &FusionPlan::of(&graph));
        }
    }

    #[test]
    fn keeping_residual_gradients_in_place_needs_no_more_gradient_memory() {
        // The block output's gradient lives on in place of the block input's copy: the same
        // size in an identity block, so the plan's total does not grow.
        for arch in [
            Arch::ResNet8,
            Arch::ResNet56,
            Arch::ResNet18,
            Arch::ResNet50,
        ] {
            let graph = Graph::new(arch, 10);
            let dims = graph.value_dims(224);
            let total =
                |f: &FusionPlan| -> usize { plan_grad_buffers(&graph, &dims, f).1.iter().sum() };
            let separate = total(&FusionPlan::none(&graph));
            let fused = total(&FusionPlan::of(&graph));
            eprintln!("{arch}: gradient buffers {fused} fused, {separate} separate per image");
            assert!(
                fused <= separate,
                "{arch}: fused {fused} > separate {separate}"
            );
        }
    }
}
