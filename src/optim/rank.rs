//! The optimizer of one training rank, which belongs to the rank's backend.
//!
//! Every rank of a data-parallel run updates its own replica with the same averaged
//! gradients, so every rank needs an optimizer and its f32 master weights, kept wherever its
//! backend computes: [`HostOptimizer`] in host memory for the CPU,
//! `crate::cuda::optim::DeviceOptimizer` on the GPU. The training loop sees only
//! [`RankOptimizer`]: step, the master weights and the state in the checkpoint's format.

use super::layout::{ConvOrder, ParamLayout};
use super::{Hyper, OptimError, Optimizer, OptimizerKind};
use crate::backend::Backend;
use crate::model::{Network, ParamSpec};

/// One rank's optimizer: f32 master weights and state, updated with the averaged gradients.
pub trait RankOptimizer<B: Backend> {
    /// Updates the master weights at learning rate `lr` and writes the working copy into
    /// `net`'s parameter tensors. `grads` are the averaged gradients where the rank keeps
    /// them: a host optimizer reads its flat buffer (in its own layout); a device optimizer
    /// reads the network's gradient tensors and gets `None`.
    fn step(
        &mut self,
        net: &mut Network<B>,
        grads: Option<&[f32]>,
        lr: f32,
    ) -> Result<(), OptimError>;

    /// The f32 master weights, flat in graph order, torchvision layout (what a checkpoint
    /// stores).
    fn master(&self) -> Result<Vec<f32>, OptimError>;

    /// The state as the host [`Optimizer`] of graph order and torchvision layout (what
    /// `optimizer.safetensors` stores, whichever device wrote it).
    fn to_host(&self) -> Result<Optimizer, OptimError>;

    /// Continues from a checkpoint's state (see [`RankOptimizer::to_host`]).
    fn load_host(&mut self, host: &Optimizer) -> Result<(), OptimError>;
}

/// An optimizer in host memory whose master weights and state follow a [`ParamLayout`] with
/// backend-ordered convolutions: it steps the flat gradient buffer the rank's collective
/// averaged, and uploads each parameter's new values into the network unpermuted.
#[derive(Debug, Clone)]
pub struct HostOptimizer {
    opt: Optimizer,
    layout: ParamLayout,
    params: Vec<ParamSpec>,
    master: Vec<f32>,
}

impl HostOptimizer {
    /// An optimizer of `kind` over `params` laid out as `layout` (convolutions in the
    /// backend's order), starting from `initial` (graph order, torchvision layout).
    pub fn new(
        kind: OptimizerKind,
        hyper: Hyper,
        params: &[ParamSpec],
        layout: ParamLayout,
        initial: &[f32],
    ) -> Result<HostOptimizer, OptimError> {
        let want: usize = params.iter().map(ParamSpec::numel).sum();
        if initial.len() != want {
            return Err(OptimError::Length {
                what: "initial weights",
                got: initial.len(),
                want,
            });
        }
        if layout.conv_order() != ConvOrder::Backend {
            return Err(OptimError::Device(
                "a host rank optimizer keeps convolutions in the backend's order".into(),
            ));
        }
        Ok(HostOptimizer {
            opt: Optimizer::with_layout(kind, hyper, params, &layout),
            master: layout.from_torchvision(params, initial),
            params: params.to_vec(),
            layout,
        })
    }

    /// The layout of the gradient buffer it steps.
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }
}

impl<B: Backend> RankOptimizer<B> for HostOptimizer {
    fn step(
        &mut self,
        net: &mut Network<B>,
        grads: Option<&[f32]>,
        lr: f32,
    ) -> Result<(), OptimError> {
        let grads = grads.ok_or(OptimError::Length {
            what: "host gradients",
            got: 0,
            want: self.layout.len(),
        })?;
        self.opt.step(&mut self.master, grads, lr)?;
        for i in 0..self.params.len() {
            net.set_param_backend_layout(i, &self.master[self.layout.range(i)])?;
        }
        Ok(())
    }

    fn master(&self) -> Result<Vec<f32>, OptimError> {
        Ok(self.layout.to_torchvision(&self.params, &self.master))
    }

    fn to_host(&self) -> Result<Optimizer, OptimError> {
        let mut host = Optimizer::new(self.opt.kind(), self.opt.hyper(), &self.params);
        let (m, v) = self.opt.moments();
        let v = if v.is_empty() {
            Vec::new()
        } else {
            self.layout.to_torchvision(&self.params, v)
        };
        host.set_state(
            self.layout.to_torchvision(&self.params, m),
            v,
            self.opt.steps(),
        )?;
        Ok(host)
    }

    fn load_host(&mut self, host: &Optimizer) -> Result<(), OptimError> {
        let (m, v) = host.moments();
        let want: usize = self.params.iter().map(ParamSpec::numel).sum();
        if m.len() != want {
            return Err(OptimError::Length {
                what: "saved optimizer state",
                got: m.len(),
                want,
            });
        }
        let v = if v.is_empty() {
            Vec::new()
        } else {
            self.layout.from_torchvision(&self.params, v)
        };
        self.opt.set_state(
            self.layout.from_torchvision(&self.params, m),
            v,
            host.steps(),
        )
    }
}
