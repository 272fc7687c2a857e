//! The fused optimizer on the GPU: one launch updates every parameter of the model.
//!
//! [`DeviceOptimizer`] keeps the f32 master weights and the optimizer state on the device as
//! flat buffers in graph parameter order, in the backend's layout (convolution weights OHWI, see
//! [`to_backend_layout`]); gradients and bf16 working copies stay in the model's own tensors. A
//! chunk table (multi-tensor apply, kernels/optim.cu) maps each block of the launch to a slice of
//! one tensor, with that tensor's weight decay and the addresses of its gradient and working
//! copy. The rules are exactly [`crate::optim::Optimizer`]'s (checked by the GPU tests).

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig};

use super::backend::CudaBackend;
use super::error::CudaError;
use super::launch::launch_on_device;
use super::launchers::{AdamUpdate, GradSumsq, GradSumsqTotal, SgdUpdate};
use super::tensor::CudaTensor;
use crate::backend::Backend;
use crate::model::{Network, ParamSpec};
use crate::optim::{
    ConvOrder, Hyper, OptimError, Optimizer, OptimizerKind, ParamLayout, RankOptimizer,
};

/// Elements per block of the update launch.
pub const CHUNK: usize = 65_536;

/// One chunk: (parameter index, offset inside the tensor, flat start, length, weight decay).
pub type Chunk = (usize, usize, i64, i32, f32);

/// The chunk table: every parameter split into chunks of at most [`CHUNK`] elements.
pub fn chunk_table(params: &[ParamSpec], weight_decay: f32) -> Vec<Chunk> {
    let mut table = Vec::new();
    let mut offset = 0usize;
    for (index, p) in params.iter().enumerate() {
        let wd = if p.decay { weight_decay } else { 0.0 };
        let mut done = 0;
        while done < p.numel() {
            let len = CHUNK.min(p.numel() - done);
            table.push((index, done, (offset + done) as i64, len as i32, wd));
            done += len;
        }
        offset += p.numel();
    }
    table
}

/// Flat parameters in torchvision layout (OIHW convolutions, as `Network::params_f32`) →
/// the backend's layout (OHWI), which gradients and working copies use.
pub fn to_backend_layout(params: &[ParamSpec], flat: &[f32]) -> Vec<f32> {
    ParamLayout::graph(params, ConvOrder::Backend).from_torchvision(params, flat)
}

/// The inverse of [`to_backend_layout`]: OHWI convolutions → torchvision's OIHW.
pub fn from_backend_layout(params: &[ParamSpec], flat: &[f32]) -> Vec<f32> {
    ParamLayout::graph(params, ConvOrder::Backend).to_torchvision(params, flat)
}

/// A [`DeviceOptimizer`]'s state on the host, in the **backend's** layout (OHWI
/// convolutions): what [`DeviceOptimizer::state`] downloads and
/// [`DeviceOptimizer::load_state`] uploads.
///
/// Checkpoints hold the host [`Optimizer`]'s file (safetensors `m`, `v`, metadata
/// `optimizer` and `steps`) in torchvision layout, whichever device wrote it;
/// [`DeviceState::from_host`] and [`DeviceState::to_host`] are the (pure) conversions, so a
/// state file means the same on the CPU and the GPU. The update rules are elementwise, so
/// permuting parameters, gradients and state alike changes nothing.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceState {
    /// Momentum buffer (SGD) or first moment (Adam).
    pub m: Vec<f32>,
    /// Second moment (Adam; empty for SGD).
    pub v: Vec<f32>,
    /// Steps taken (Adam's bias correction depends on it).
    pub steps: u64,
}

impl DeviceState {
    /// A host optimizer's state (torchvision layout) → device layout.
    pub fn from_host(params: &[ParamSpec], host: &Optimizer) -> DeviceState {
        let (m, v) = host.moments();
        DeviceState {
            m: to_backend_layout(params, m),
            v: if v.is_empty() {
                Vec::new()
            } else {
                to_backend_layout(params, v)
            },
            steps: host.steps(),
        }
    }

    /// Device layout → a host optimizer of `kind` (the one whose file a checkpoint stores).
    pub fn to_host(
        &self,
        kind: OptimizerKind,
        hyper: Hyper,
        params: &[ParamSpec],
    ) -> Result<Optimizer, OptimError> {
        let len: usize = params.iter().map(ParamSpec::numel).sum();
        if self.m.len() != len {
            return Err(OptimError::Length {
                what: "device optimizer state",
                got: self.m.len(),
                want: len,
            });
        }
        let mut host = Optimizer::new(kind, hyper, params);
        let v = if self.v.is_empty() {
            Vec::new()
        } else if self.v.len() == len {
            from_backend_layout(params, &self.v)
        } else {
            return Err(OptimError::Length {
                what: "device optimizer second moment",
                got: self.v.len(),
                want: len,
            });
        };
        host.set_state(from_backend_layout(params, &self.m), v, self.steps)?;
        Ok(host)
    }
}

/// Master weights and optimizer state on the device.
#[derive(Debug)]
pub struct DeviceOptimizer {
    backend: CudaBackend,
    kind: OptimizerKind,
    hyper: Hyper,
    params: Vec<ParamSpec>,
    sizes: Vec<usize>,
    table: Vec<Chunk>,
    master: CudaSlice<f32>,
    m: CudaSlice<f32>,
    v: Option<CudaSlice<f32>>,
    starts: CudaSlice<i64>,
    lens: CudaSlice<i32>,
    decays: CudaSlice<f32>,
    /// Per-chunk gradient and working-copy addresses, and the host values they were built from.
    grad_ptrs: CudaSlice<u64>,
    work_ptrs: CudaSlice<u64>,
    ptrs_for: Vec<u64>,
    steps: u64,
    /// `--clip-grad-norm` (0: off), the per-chunk sums of squared gradients and their total,
    /// which the update reads.
    max_grad_norm: f32,
    partial: CudaSlice<f64>,
    sumsq: CudaSlice<f64>,
    /// The step's lr and Adam's two bias corrections, read by the update kernels from here
    /// (so that a captured CUDA graph replays with each step's own), and whether the coming
    /// step's are uploaded already ([`DeviceOptimizer::preload_step`]).
    scalars: CudaSlice<f32>,
    preloaded: bool,
}

fn drv(context: &str) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError + '_ {
    move |source| CudaError::Driver {
        context: context.to_string(),
        source,
    }
}

impl DeviceOptimizer {
    /// An optimizer for `params` starting from `initial`, flat in the backend's layout.
    pub fn new(
        backend: &CudaBackend,
        kind: OptimizerKind,
        hyper: Hyper,
        params: &[ParamSpec],
        initial: &[f32],
    ) -> Result<Self, CudaError> {
        let sizes: Vec<usize> = params.iter().map(ParamSpec::numel).collect();
        let len: usize = sizes.iter().sum();
        if initial.len() != len {
            return Err(CudaError::Unsupported {
                what: format!("{} initial values for {len} parameters", initial.len()),
            });
        }
        let stream = backend.device().stream().clone();
        let table = chunk_table(params, hyper.weight_decay);
        let starts: Vec<i64> = table.iter().map(|t| t.2).collect();
        let lens: Vec<i32> = table.iter().map(|t| t.3).collect();
        let decays: Vec<f32> = table.iter().map(|t| t.4).collect();
        let adam = !matches!(kind, OptimizerKind::Sgd { .. });
        let chunks = table.len().max(1);
        Ok(DeviceOptimizer {
            backend: backend.clone(),
            kind,
            hyper,
            params: params.to_vec(),
            sizes,
            master: stream
                .clone_htod(initial)
                .map_err(drv("uploading master weights"))?,
            m: stream
                .alloc_zeros(len.max(1))
                .map_err(drv("allocating optimizer state"))?,
            v: if adam {
                Some(
                    stream
                        .alloc_zeros(len.max(1))
                        .map_err(drv("allocating optimizer state"))?,
                )
            } else {
                None
            },
            starts: stream
                .clone_htod(&starts)
                .map_err(drv("uploading the chunk table"))?,
            lens: stream
                .clone_htod(&lens)
                .map_err(drv("uploading the chunk table"))?,
            decays: stream
                .clone_htod(&decays)
                .map_err(drv("uploading the chunk table"))?,
            grad_ptrs: stream
                .alloc_zeros(chunks)
                .map_err(drv("allocating the chunk table"))?,
            work_ptrs: stream
                .alloc_zeros(chunks)
                .map_err(drv("allocating the chunk table"))?,
            ptrs_for: Vec::new(),
            table,
            steps: 0,
            max_grad_norm: 0.0,
            partial: stream
                .alloc_zeros(chunks)
                .map_err(drv("allocating the gradient norm"))?,
            sumsq: stream
                .alloc_zeros(1)
                .map_err(drv("allocating the gradient norm"))?,
            scalars: stream
                .alloc_zeros(3)
                .map_err(drv("allocating the step's scalars"))?,
            preloaded: false,
        })
    }

    /// Clips the gradients of every later step to global L2 norm `max_norm` (after
    /// `grad_scale`; PyTorch's `clip_grad_norm_`); `None` or 0: no clipping.
    pub fn set_max_grad_norm(&mut self, max_norm: Option<f32>) {
        self.max_grad_norm = max_norm.unwrap_or(0.0).max(0.0);
    }

    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Points the chunk table at these tensors (re-uploaded only when an address changed).
    fn bind(
        &mut self,
        grads: &[&CudaTensor],
        working: &mut [&mut CudaTensor],
    ) -> Result<(), CudaError> {
        let bad = |what: &str| CudaError::Unsupported {
            what: format!("DeviceOptimizer::step: {what}"),
        };
        if grads.len() != self.sizes.len() || working.len() != self.sizes.len() {
            return Err(bad(&format!(
                "{} gradients and {} working tensors for {} parameters",
                grads.len(),
                working.len(),
                self.sizes.len()
            )));
        }
        let stream = self.backend.device().stream().clone();
        let mut bases = Vec::with_capacity(2 * self.sizes.len());
        for (i, &n) in self.sizes.iter().enumerate() {
            let g = grads[i]
                .f32_slice()
                .ok_or_else(|| bad("gradients must be f32 (TensorRole::WeightGrad)"))?;
            let w = working[i]
                .bf16_slice_mut()
                .ok_or_else(|| bad("working copies must be bf16 (TensorRole::Weight)"))?;
            if g.len() < n || w.len() < n {
                return Err(bad(&format!("parameter {i} needs {n} elements")));
            }
            bases.push(g.device_ptr(&stream).0);
            bases.push(w.device_ptr(&stream).0);
        }
        if bases == self.ptrs_for {
            return Ok(());
        }
        let grad_ptrs: Vec<u64> = self
            .table
            .iter()
            .map(|c| bases[2 * c.0] + 4 * c.1 as u64)
            .collect();
        let work_ptrs: Vec<u64> = self
            .table
            .iter()
            .map(|c| bases[2 * c.0 + 1] + 2 * c.1 as u64)
            .collect();
        if !grad_ptrs.is_empty() {
            stream
                .memcpy_htod(&grad_ptrs, &mut self.grad_ptrs)
                .map_err(drv("uploading gradient addresses"))?;
            stream
                .memcpy_htod(&work_ptrs, &mut self.work_ptrs)
                .map_err(drv("uploading working-copy addresses"))?;
        }
        self.ptrs_for = bases;
        Ok(())
    }

    /// One update: gradients `grads[i]` (f32, × `grad_scale`, e.g. 1/world) of parameter i at
    /// learning rate `lr`; writes the new bf16 working copy into `working[i]`.
    pub fn step(
        &mut self,
        grads: &[&CudaTensor],
        working: &mut [&mut CudaTensor],
        lr: f32,
        grad_scale: f32,
    ) -> Result<(), CudaError> {
        self.bind(grads, working)?;
        if self.table.is_empty() {
            return Ok(());
        }
        if !std::mem::take(&mut self.preloaded) {
            self.upload_scalars(lr)?;
        }
        self.steps += 1;
        let dev = self.backend.device();
        let cfg = LaunchConfig {
            grid_dim: (self.table.len() as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let h = self.hyper;
        if self.max_grad_norm > 0.0 {
            let sums = GradSumsq {
                grad_ptr: (&self.grad_ptrs).into(),
                chunk_len: (&self.lens).into(),
                partial: (&mut self.partial).into(),
            };
            // SAFETY: the address table points into live gradient tensors of the checked
            // lengths (bind); one partial per chunk (allocated for the table in new); 256
            // threads, its shared array's size.
            unsafe { launch_on_device(dev, "grad_sumsq", cfg, sums) }?;
            let total = GradSumsqTotal {
                partial: (&self.partial).into(),
                n: self.table.len() as i32,
                sumsq: (&mut self.sumsq).into(),
            };
            let one = LaunchConfig {
                grid_dim: (1, 1, 1),
                ..cfg
            };
            // SAFETY: `n` partials were written above; one block of 256 threads, its shared
            // array's size.
            unsafe { launch_on_device(dev, "grad_sumsq_total", one, total) }?;
        }
        let max_norm = self.max_grad_norm;
        let (lr_at, bias_at) = (self.scalars.slice(0..1), self.scalars.slice(1..3));
        match self.kind {
            OptimizerKind::Sgd { momentum, nesterov } => {
                let update = SgdUpdate {
                    master: (&mut self.master).into(),
                    buf: (&mut self.m).into(),
                    grad_ptr: (&self.grad_ptrs).into(),
                    work_ptr: (&self.work_ptrs).into(),
                    chunk_start: (&self.starts).into(),
                    chunk_len: (&self.lens).into(),
                    chunk_wd: (&self.decays).into(),
                    lr: (&lr_at).into(),
                    momentum,
                    grad_scale,
                    nesterov: i32::from(nesterov),
                    max_norm,
                    sumsq: (&self.sumsq).into(),
                };
                // SAFETY: the address table points into live tensors of the checked lengths
                // (bind).
                unsafe { launch_on_device(dev, "sgd_update", cfg, update) }?;
            }
            OptimizerKind::Adam | OptimizerKind::AdamW => {
                let decoupled = i32::from(self.kind == OptimizerKind::AdamW);
                let v = self.v.as_mut().expect("Adam state is allocated in new");
                let update = AdamUpdate {
                    master: (&mut self.master).into(),
                    m: (&mut self.m).into(),
                    v: v.into(),
                    grad_ptr: (&self.grad_ptrs).into(),
                    work_ptr: (&self.work_ptrs).into(),
                    chunk_start: (&self.starts).into(),
                    chunk_len: (&self.lens).into(),
                    chunk_wd: (&self.decays).into(),
                    lr: (&lr_at).into(),
                    beta1: h.beta1,
                    beta2: h.beta2,
                    eps: h.eps,
                    grad_scale,
                    bias_c: (&bias_at).into(),
                    decoupled,
                    max_norm,
                    sumsq: (&self.sumsq).into(),
                };
                // SAFETY: as above, for adam_update.
                unsafe { launch_on_device(dev, "adam_update", cfg, update) }?;
            }
        }
        Ok(())
    }

    /// The values the update of step `step` (counted from 1) reads: the lr and Adam's bias
    /// corrections 1 − β1^t and 1 − β2^t (computed in f64, rounded to f32; 1 for SGD).
    fn scalars_of(&self, step: u64, lr: f32) -> [f32; 3] {
        match self.kind {
            OptimizerKind::Sgd { .. } => [lr, 1.0, 1.0],
            OptimizerKind::Adam | OptimizerKind::AdamW => {
                let t = step as i32;
                let h = self.hyper;
                let bc1 = (1.0 - f64::from(h.beta1).powi(t)) as f32;
                let bc2 = (1.0 - f64::from(h.beta2).powi(t)) as f32;
                [lr, bc1, bc2]
            }
        }
    }

    /// Uploads the next step's scalars (on the compute stream, before its update).
    fn upload_scalars(&mut self, lr: f32) -> Result<(), CudaError> {
        let values = self.scalars_of(self.steps + 1, lr);
        let stream = self.backend.device().stream().clone();
        stream
            .memcpy_htod(&values, &mut self.scalars)
            .map_err(drv("uploading the step's lr"))
    }

    /// Uploads the next step's lr and bias corrections now, before a captured or replayed
    /// step: its [`DeviceOptimizer::step`] (captured) uploads nothing.
    pub fn preload_step(&mut self, lr: f32) -> Result<(), CudaError> {
        self.upload_scalars(lr)?;
        self.preloaded = true;
        Ok(())
    }

    /// A step replayed from a graph: counts it as [`DeviceOptimizer::step`] does (the update
    /// itself ran on the device).
    pub fn replayed_step(&mut self) {
        self.preloaded = false;
        self.steps += 1;
    }

    /// Downloads the optimizer state (momentum / moments and step count, backend layout);
    /// waits for the GPU. Convert it with [`DeviceState::to_host`] to write a checkpoint.
    pub fn state(&self) -> Result<DeviceState, CudaError> {
        let len: usize = self.sizes.iter().sum();
        let stream = self.backend.device().stream();
        let what = "downloading optimizer state";
        let mut m = stream.clone_dtoh(&self.m).map_err(drv(what))?;
        let mut v = match &self.v {
            Some(v) => stream.clone_dtoh(v).map_err(drv(what))?,
            None => Vec::new(),
        };
        stream.synchronize().map_err(drv(what))?;
        // Buffers hold at least one element (an empty model still allocates).
        m.truncate(len);
        v.truncate(len);
        Ok(DeviceState {
            m,
            v,
            steps: self.steps,
        })
    }

    /// Uploads an optimizer state (backend layout, e.g. [`DeviceState::from_host`] of a
    /// checkpoint's file): the next [`DeviceOptimizer::step`] continues with its momentum and
    /// step count.
    pub fn load_state(&mut self, state: &DeviceState) -> Result<(), CudaError> {
        let len: usize = self.sizes.iter().sum();
        let adam = self.v.is_some();
        let want_v = if adam { len } else { 0 };
        if state.m.len() != len || state.v.len() != want_v {
            return Err(CudaError::Unsupported {
                what: format!(
                    "optimizer state with {} + {} values for a {} optimizer of {len} parameters (expected {len} + {want_v}); was it saved for another model or optimizer?",
                    state.m.len(),
                    state.v.len(),
                    self.kind.name()
                ),
            });
        }
        if len == 0 {
            self.steps = state.steps;
            return Ok(());
        }
        let stream = self.backend.device().stream().clone();
        let what = "uploading optimizer state";
        stream
            .memcpy_htod(&state.m, &mut self.m.slice_mut(0..len))
            .map_err(drv(what))?;
        if let Some(v) = &mut self.v {
            stream
                .memcpy_htod(&state.v, &mut v.slice_mut(0..len))
                .map_err(drv(what))?;
        }
        // The host slices are borrowed only for this call: wait for the copies.
        stream.synchronize().map_err(drv(what))?;
        self.steps = state.steps;
        Ok(())
    }

    /// The optimizer kind.
    pub fn kind(&self) -> OptimizerKind {
        self.kind
    }

    /// The f32 master weights, flat in the backend's layout (waits for the GPU).
    pub fn master(&self) -> Result<Vec<f32>, CudaError> {
        let stream = self.backend.device().stream();
        let out = stream
            .clone_dtoh(&self.master)
            .map_err(drv("downloading master weights"))?;
        stream
            .synchronize()
            .map_err(drv("downloading master weights"))?;
        Ok(out)
    }
}

fn device_error(e: CudaError) -> OptimError {
    OptimError::Device(Box::new(e))
}

/// The GPU rank's optimizer: it reads the network's gradient tensors (the flat buffer the
/// collective averaged) and writes the bf16 working copy into its parameter tensors.
impl<B: Backend<Tensor = CudaTensor>> RankOptimizer<B> for DeviceOptimizer {
    fn step(
        &mut self,
        net: &mut Network<B>,
        _grads: Option<&[f32]>,
        lr: f32,
    ) -> Result<(), OptimError> {
        let (grads, mut params) = net.grads_and_params_mut();
        DeviceOptimizer::step(self, &grads, &mut params, lr, 1.0).map_err(device_error)
    }

    fn master(&self, _net: &Network<B>) -> Result<Vec<f32>, OptimError> {
        let master = DeviceOptimizer::master(self).map_err(device_error)?;
        Ok(from_backend_layout(&self.params, &master))
    }

    fn to_host(&self) -> Result<Optimizer, OptimError> {
        self.state()
            .map_err(device_error)?
            .to_host(self.kind, self.hyper, &self.params)
    }

    fn load_host(&mut self, host: &Optimizer) -> Result<(), OptimError> {
        let state = DeviceState::from_host(&self.params, host);
        self.load_state(&state).map_err(device_error)
    }

    fn set_max_grad_norm(&mut self, max_norm: Option<f32>) {
        DeviceOptimizer::set_max_grad_norm(self, max_norm);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Arch, Graph};

    #[test]
    fn chunk_table_covers_every_parameter_once_with_its_decay() {
        let graph = Graph::new(Arch::ResNet18, 10);
        let table = chunk_table(graph.params(), 0.5);
        let total: usize = table.iter().map(|t| t.3 as usize).sum();
        assert_eq!(total, graph.param_count());
        let mut next = 0i64;
        for &(index, local, start, len, _) in &table {
            assert_eq!(start, next, "chunks are contiguous and ordered");
            assert!(len as usize <= CHUNK && len > 0);
            assert!(local + len as usize <= graph.params()[index].numel());
            next += i64::from(len);
        }
        // BN weights are exempt from decay, conv weights are not.
        let (offsets, _) = graph.param_offsets();
        for (i, p) in graph.params().iter().enumerate() {
            let chunk = table.iter().find(|t| t.2 as usize == offsets[i]).unwrap();
            assert_eq!((chunk.0, chunk.1), (i, 0));
            assert_eq!(chunk.4, if p.decay { 0.5 } else { 0.0 }, "{}", p.name);
        }
    }
}

#[cfg(test)]
mod layout_tests {
    use super::*;
    use crate::model::{Arch, Graph};

    #[test]
    fn backend_layout_moves_input_channels_innermost() {
        let graph = Graph::new(Arch::ResNet8, 10);
        let n = graph.param_count();
        let flat: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let out = to_backend_layout(graph.params(), &flat);
        assert_eq!(out.len(), n);
        // conv1 is OIHW [16, 3, 3, 3]: element (o=1, i=2, y=0, x=1) → OHWI ((1·3+0)·3+1)·3+2.
        let (o, i, y, x) = (1, 2, 0, 1);
        let src = ((o * 3 + i) * 3 + y) * 3 + x;
        let dst = ((o * 3 + y) * 3 + x) * 3 + i;
        assert_eq!(out[dst], src as f32);
        // A permutation: nothing lost, nothing duplicated.
        let mut sorted = out.clone();
        sorted.sort_by(f32::total_cmp);
        assert_eq!(sorted, flat);
    }
}
