//! The optimizer of one training rank, which belongs to the rank's backend.
//!
//! Every rank of a data-parallel run updates its own replica with the same averaged
//! gradients, so every rank needs an optimizer and its f32 master weights, kept wherever its
//! backend computes: [`CpuRankOptimizer`] updating the CPU network's tensors in place,
//! `crate::cuda::optim::DeviceOptimizer` on the GPU. The training loop sees only
//! [`RankOptimizer`]: step, the master weights and the state in the checkpoint's format.

use super::layout::{ConvOrder, ParamLayout};
use super::{Hyper, OptimError, Optimizer, OptimizerKind};
use crate::backend::cpu::{CpuBackend, CpuOptimizer, UpdateRule};
use crate::backend::Backend;
use crate::model::{Network, ParamSpec};

/// One rank's optimizer: f32 master weights and state, updated with the averaged gradients.
pub trait RankOptimizer<B: Backend> {
    /// Updates the master weights at learning rate `lr` and writes the working copy into
    /// `net`'s parameter tensors. `grads` are the averaged gradients where the rank keeps
    /// them: the CPU rank's optimizer reads its flat buffer (bucket layout); a device optimizer
    /// reads the network's gradient tensors and gets `None`.
    fn step(
        &mut self,
        net: &mut Network<B>,
        grads: Option<&[f32]>,
        lr: f32,
    ) -> Result<(), OptimError>;

    /// The f32 master weights of `net`'s rank, flat in graph order, torchvision layout (what a
    /// checkpoint stores). A CPU rank's master weights are the network's own parameters.
    fn master(&self, net: &Network<B>) -> Result<Vec<f32>, OptimError>;

    /// The state as the host [`Optimizer`] of graph order and torchvision layout (what
    /// `optimizer.safetensors` stores, whichever device wrote it).
    fn to_host(&self) -> Result<Optimizer, OptimError>;

    /// Continues from a checkpoint's state (see [`RankOptimizer::to_host`]).
    fn load_host(&mut self, host: &Optimizer) -> Result<(), OptimError>;

    /// Clips every later step's averaged gradients to global L2 norm `max_norm` before the
    /// update (PyTorch's `clip_grad_norm_`: all of them times min(1, max_norm / (‖g‖ +
    /// 1e-6)); `--clip-grad-norm`); `None`: no clipping.
    fn set_max_grad_norm(&mut self, max_norm: Option<f32>);
}

/// PyTorch's clipping coefficient for gradients of global L2 norm `norm`.
pub(crate) fn clip_coefficient(norm: f64, max_norm: f32) -> f32 {
    (f64::from(max_norm) / (norm + 1e-6)).min(1.0) as f32
}

/// The CPU rank's optimizer: the network's own f32 parameters are the master weights, updated
/// in place in the backend's layout by the CPU backend's fused [`CpuOptimizer`] from the flat
/// gradient buffer the rank's collective averaged (each parameter at its range of `layout`).
/// No copy of the parameters per step; torchvision layout only for checkpoints.
#[derive(Debug, Clone)]
pub struct CpuRankOptimizer {
    opt: CpuOptimizer,
    kind: OptimizerKind,
    hyper: Hyper,
    /// Where each parameter's gradient sits in the averaged buffer (backend order).
    layout: ParamLayout,
    /// The state's layout: parameters back to back in graph order, backend order.
    state_layout: ParamLayout,
    params: Vec<ParamSpec>,
    backend: CpuBackend,
    max_grad_norm: Option<f32>,
}

impl CpuRankOptimizer {
    /// An optimizer of `kind` over `params` whose gradients arrive laid out as `layout`
    /// (convolutions in the backend's order), updating tensors on `backend`'s threads.
    pub fn new(
        kind: OptimizerKind,
        hyper: Hyper,
        params: &[ParamSpec],
        layout: ParamLayout,
        backend: CpuBackend,
    ) -> Result<CpuRankOptimizer, OptimError> {
        if layout.conv_order() != ConvOrder::Backend || layout.param_count() != params.len() {
            return Err(OptimError::Device(
                "a CPU rank optimizer takes gradients in the backend's order, one range per \
                 parameter"
                    .into(),
            ));
        }
        let rule = match kind {
            OptimizerKind::Sgd { momentum, nesterov } => UpdateRule::Sgd { momentum, nesterov },
            OptimizerKind::Adam | OptimizerKind::AdamW => UpdateRule::Adam {
                beta1: hyper.beta1,
                beta2: hyper.beta2,
                eps: hyper.eps,
                decoupled: kind == OptimizerKind::AdamW,
            },
        };
        let opt = CpuOptimizer::new(
            rule,
            params.iter().map(ParamSpec::numel).collect(),
            params
                .iter()
                .map(|p| if p.decay { hyper.weight_decay } else { 0.0 })
                .collect(),
        )
        .map_err(|e| OptimError::Device(Box::new(e)))?;
        Ok(CpuRankOptimizer {
            opt,
            kind,
            hyper,
            layout,
            state_layout: ParamLayout::graph(params, ConvOrder::Backend),
            params: params.to_vec(),
            backend,
            max_grad_norm: None,
        })
    }

    /// The layout of the gradient buffer it steps.
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }
}

impl RankOptimizer<CpuBackend> for CpuRankOptimizer {
    fn step(
        &mut self,
        net: &mut Network<CpuBackend>,
        grads: Option<&[f32]>,
        lr: f32,
    ) -> Result<(), OptimError> {
        let grads = grads.ok_or(OptimError::Length {
            what: "host gradients",
            got: 0,
            want: self.layout.len(),
        })?;
        if grads.len() != self.layout.len() {
            return Err(OptimError::Length {
                what: "host gradients",
                got: grads.len(),
                want: self.layout.len(),
            });
        }
        let per_param: Vec<&[f32]> = self
            .layout
            .ranges()
            .into_iter()
            .map(|r| &grads[r])
            .collect();
        let grad_scale = match self.max_grad_norm {
            Some(max_norm) => {
                let sumsq: f64 = per_param
                    .iter()
                    .flat_map(|g| g.iter())
                    .map(|&g| f64::from(g) * f64::from(g))
                    .sum();
                clip_coefficient(sumsq.sqrt(), max_norm)
            }
            None => 1.0,
        };
        let mut params = net.param_tensors_mut();
        self.opt
            .step(&self.backend, &mut params, &per_param, lr, grad_scale)
            .map_err(|e| OptimError::Device(Box::new(e)))
    }

    fn set_max_grad_norm(&mut self, max_norm: Option<f32>) {
        self.max_grad_norm = max_norm;
    }

    fn master(&self, net: &Network<CpuBackend>) -> Result<Vec<f32>, OptimError> {
        let flat: Vec<f32> = net.param_tensors().into_iter().flatten().copied().collect();
        Ok(self.state_layout.to_torchvision(&self.params, &flat))
    }

    fn to_host(&self) -> Result<Optimizer, OptimError> {
        let mut host = Optimizer::new(self.kind, self.hyper, &self.params);
        let (m, v, steps) = self.opt.state();
        let v = if v.is_empty() {
            Vec::new()
        } else {
            self.state_layout.to_torchvision(&self.params, v)
        };
        host.set_state(self.state_layout.to_torchvision(&self.params, m), v, steps)?;
        Ok(host)
    }

    fn load_host(&mut self, host: &Optimizer) -> Result<(), OptimError> {
        let (m, v) = host.moments();
        let want: usize = self.params.iter().map(ParamSpec::numel).sum();
        if m.len() != want || !(v.is_empty() || v.len() == want) {
            return Err(OptimError::Length {
                what: "saved optimizer state",
                got: m.len(),
                want,
            });
        }
        let v = if v.is_empty() {
            Vec::new()
        } else {
            self.state_layout.from_torchvision(&self.params, v)
        };
        self.opt
            .set_state(
                self.state_layout.from_torchvision(&self.params, m),
                v,
                host.steps(),
            )
            .map_err(|e| OptimError::Device(Box::new(e)))
    }
}
