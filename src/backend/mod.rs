//! The backend trait: every numeric op of the ResNet graph, forward and backward.
//!
//! The model (`crate::model::Network`) is written once against [`Backend`]; the CPU reference
//! backend ([`cpu::CpuBackend`], f32 everywhere) and the CUDA backend (bf16 activations and
//! weights, f32 statistics) implement it. Tensors are opaque to the model ([`Backend::Tensor`]);
//! only f32 upload/download crosses the boundary, for tests and checkpoints.
//!
//! Conventions every implementation follows (the CPU backend is the reference):
//! - Activations are NHWC, contiguous: element `(n, y, x, c)` at `((n*H + y)*W + x)*C + c`.
//! - Convolution weights are OHWI (`[c_out][kh][kw][c_in]`); the model converts from
//!   torchvision's OIHW when it uploads. Linear weights are `[out][in]` as in torch.
//! - Every op works on the first `n` images of tensors sized for the network's maximum batch.
//! - `accumulate: true` means "add into the destination" (a value with two consumers, such as a
//!   residual block input, receives gradient from both); `false` overwrites.

pub mod bn_sync;
pub mod conformance;
pub mod cpu;

mod error;
mod shapes;

pub use bn_sync::{DeviceSums, SumsMut};
pub(crate) use error::missing_mask;
pub use error::BackendError;
pub use shapes::{BnMode, BnShape, ConvShape, LinearShape, PoolShape};

use crate::model::InputBatch;

/// What a tensor holds; a backend may pick a storage type per role (CUDA: bf16 for
/// activations and weights, f32 for statistics). The CPU backend stores f32 for every role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorRole {
    /// Layer inputs/outputs and their gradients.
    Activation,
    /// Learnable parameters as the forward pass reads them.
    Weight,
    /// Parameter gradients.
    WeightGrad,
    /// Batch-norm running statistics and saved batch mean / inverse std (always f32).
    Statistic,
}

/// Per-image results of the loss op, summed over the batch.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LossStats {
    /// Sum over images of the (label-smoothed) cross-entropy.
    pub loss_sum: f64,
    /// Images whose label is the arg-max logit.
    pub correct_top1: usize,
    /// Images whose label is among the five largest logits.
    pub correct_top5: usize,
}

/// What the loss op compares each row of logits with: its label, smoothed, and in a mixed
/// batch ([`crate::model::Mix`]) blended with the label of its partner, row `n − 1 − i`.
///
/// Row `i`'s target is `w·t(label_i) + (1 − w)·t(label_{n−1−i})` with
/// `t(y) = (1 − ε)·onehot(y) + ε/classes` (timm's mixup target). Accuracy counts always
/// compare with the row's own label.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Targets<'a> {
    /// One label per row (at least `n`).
    pub labels: &'a [u32],
    /// Label smoothing ε in [0, 1).
    pub smoothing: f32,
    /// `w`, the weight of the row's own label, in [0, 1]; 1 without mixing.
    pub own_weight: f32,
}

impl<'a> Targets<'a> {
    /// Plain targets: each row's own label, smoothed by `smoothing`.
    pub fn labels(labels: &'a [u32], smoothing: f32) -> Self {
        Self {
            labels,
            smoothing,
            own_weight: 1.0,
        }
    }

    /// What the loss compares `input`'s logits with: its labels smoothed by `smoothing`, mixed
    /// as the images were. (Built here, not by the batch, so the model's input types do not
    /// depend back on the backend.)
    pub fn of_batch(input: &InputBatch<'a>, smoothing: f32) -> Self {
        Self {
            labels: &input.labels[..input.len.min(input.labels.len())],
            smoothing,
            own_weight: input.mix.map_or(1.0, |m| m.own_weight(input.image_size)),
        }
    }

    /// Checks the labels against `classes` and the two weights' ranges (for `op`'s errors).
    pub fn check(&self, op: &'static str, n: usize, classes: usize) -> Result<(), BackendError> {
        let bad = |detail: String| BackendError::InvalidInput { op, detail };
        if self.labels.len() < n {
            return Err(bad(format!("{} labels for {n} rows", self.labels.len())));
        }
        if let Some(&l) = self.labels[..n].iter().find(|&&l| l as usize >= classes) {
            return Err(bad(format!(
                "label {l} is out of range for {classes} classes"
            )));
        }
        if !(0.0..1.0).contains(&self.smoothing) {
            return Err(bad(format!(
                "label smoothing {} is outside [0, 1)",
                self.smoothing
            )));
        }
        if !(0.0..=1.0).contains(&self.own_weight) {
            return Err(bad(format!(
                "mixing weight {} is outside [0, 1]",
                self.own_weight
            )));
        }
        Ok(())
    }
}

/// Inputs of a fused batch-norm forward: `y = act(bn(x) + residual)`.
///
/// Fusing the residual add and the ReLU into batch norm is what the CUDA kernels do, and it
/// keeps the graph small: a BasicBlock is conv, bn+relu, conv, bn+add+relu.
#[derive(Debug)]
pub struct BnForward<'a, T> {
    /// Shape of `x` seen as `rows × channels`.
    pub shape: BnShape,
    /// Pre-normalisation input (a convolution output).
    pub x: &'a T,
    /// Scale γ, `channels` values.
    pub gamma: &'a T,
    /// Shift β, `channels` values.
    pub beta: &'a T,
    /// Added after the affine transform, before the ReLU (a block's shortcut), same shape as x.
    pub residual: Option<&'a T>,
    /// Apply ReLU at the end.
    pub relu: bool,
    /// Output. `None`: the statistics only (saved mean and inverse std, running statistics),
    /// for a batch norm whose reader applies them itself ([`Backend::maxpool_bn_forward`]);
    /// then there is no residual.
    pub y: Option<&'a mut T>,
    /// Saved mean used for normalisation (batch mean in `Train`, running mean otherwise).
    pub saved_mean: &'a mut T,
    /// Saved 1/sqrt(var + eps) used for normalisation.
    pub saved_invstd: &'a mut T,
    /// Running mean (updated in `Train` with momentum).
    pub running_mean: &'a mut T,
    /// Running variance, unbiased as torch (updated in `Train`).
    pub running_var: &'a mut T,
    /// Which statistics to use.
    pub mode: BnMode,
    /// Running-statistics momentum (torch: 0.1).
    pub momentum: f32,
    /// Variance epsilon (torch: 1e-5).
    pub eps: f32,
    /// `Train` only: the batch statistics of `x` already reduced, as [`Backend::conv_forward_moments`]
    /// leaves them (f32, `3·channels`: every channel's mean, then its M2 = Σ(x − mean)², then
    /// its row count); the op then reads them instead of `x` to normalise with and to advance
    /// the running statistics (the unbiased variance divides by count − 1). The one interface
    /// between the statistics and the normalisation, so moments merged over replicas (Chan's
    /// combination, for synchronised batch norm) may stand in for the local ones. `None`: the
    /// op reduces `x` itself.
    pub moments: Option<&'a T>,
}

/// Inputs of the fused batch-norm backward (inverse of [`BnForward`]).
#[derive(Debug)]
pub struct BnBackward<'a, T> {
    /// Shape of `x` seen as `rows × channels`.
    pub shape: BnShape,
    /// The forward input.
    pub x: &'a T,
    /// The forward output (its sign is the ReLU mask). `None` for an output that was never
    /// stored (its reader applied the batch norm: [`Backend::maxpool_bn_forward`]), which
    /// needs `prepared` or no ReLU: the mask is then not read.
    pub y: Option<&'a T>,
    /// Scale γ.
    pub gamma: &'a T,
    /// Saved mean from the forward.
    pub saved_mean: &'a T,
    /// Saved inverse std from the forward.
    pub saved_invstd: &'a T,
    /// Whether the forward used batch statistics (`BnMode::Train`): then the gradient flows
    /// through the mean and variance too; otherwise the normalisation is a fixed affine map.
    pub batch_stats: bool,
    /// Whether the forward applied ReLU.
    pub relu: bool,
    /// Gradient of the loss with respect to `y`.
    pub dy: &'a T,
    /// Gradient with respect to `x` (overwritten).
    pub dx: &'a mut T,
    /// Gradient with respect to the residual input, and whether to accumulate into it.
    pub dresidual: Option<(&'a mut T, bool)>,
    /// Gradient of γ (overwritten).
    pub dgamma: &'a mut T,
    /// Gradient of β (overwritten).
    pub dbeta: &'a mut T,
    /// The incoming gradient is already finished ([`Backend::conv_backward_data_bn`]): `dy`
    /// holds g, the gradient at the normalisation's output (every contribution summed, the
    /// ReLU's mask applied), and `dgamma`, `dbeta` already hold Σg·x̂ and Σg. The op then
    /// neither masks nor reduces: it writes `dx` (and the residual's gradient, g) from them.
    pub prepared: bool,
}

/// The batch norm whose output a convolution reads, for [`Backend::conv_backward_data_bn`]:
/// the data gradient of that convolution is the last contribution to the batch norm's
/// incoming gradient, so its epilogue can finish that gradient and reduce it.
#[derive(Debug)]
pub struct BnGradEpilogue<'a, T> {
    /// The batch norm's input (for x̂), shaped as the convolution's input.
    pub x: &'a T,
    /// The batch norm's output (the convolution's input): its sign is the ReLU's mask. `None`
    /// for an output that was never stored (the convolution applied the batch norm:
    /// [`Backend::conv_forward_bn`]): the mask is then recomputed from `x`, `gamma` and `beta`
    /// as that output's sign.
    pub y: Option<&'a T>,
    /// `y` is ReLU(BN(x)) alone (no residual added before the ReLU), so a backend may
    /// recompute the mask from `x`, `gamma` and `beta` instead of reading a stored `y`
    /// (`BIRDTRAIN_BN_MASK`); false where a residual entered it or `y` is not that output.
    pub y_recomputable: bool,
    /// Whether the batch norm applied a ReLU.
    pub relu: bool,
    /// Its scale γ (read only to recompute the mask, when `y` is `None`).
    pub gamma: &'a T,
    /// Its shift β (as `gamma`).
    pub beta: &'a T,
    /// Its saved mean (the statistics it normalised with).
    pub saved_mean: &'a T,
    /// Its saved inverse standard deviation.
    pub saved_invstd: &'a T,
    /// A gradient added before the mask: the batch norm's output reaches a residual add too,
    /// whose gradient (the consumer's g) is not in `dx`. `None` when `dx` has every other
    /// contribution (or there is none).
    pub residual_grad: Option<&'a T>,
    /// Receives Σg·x̂ per channel (overwritten): the batch norm's γ gradient.
    pub dgamma: &'a mut T,
    /// Receives Σg per channel (overwritten): its β gradient.
    pub dbeta: &'a mut T,
}

impl<'a, T> BnGradEpilogue<'a, T> {
    /// The batch norm as its reader applies it (its output recomputed from `x`).
    pub fn applied(&self) -> AppliedBn<'a, T> {
        AppliedBn {
            gamma: self.gamma,
            beta: self.beta,
            saved_mean: self.saved_mean,
            saved_invstd: self.saved_invstd,
            relu: self.relu,
        }
    }
}

/// A batch norm whose output is never stored because its one reader applies it as it reads
/// the batch norm's input: a max pool ([`Backend::maxpool_bn_forward`],
/// [`Backend::maxpool_bn_backward`]) or a convolution ([`Backend::conv_forward_bn`],
/// [`Backend::conv_backward_weight_bn`]). The statistics its forward saved ([`BnForward`] with
/// no `y`) and its affine parameters. No residual.
#[derive(Debug, Clone, Copy)]
pub struct AppliedBn<'a, T> {
    /// Scale γ.
    pub gamma: &'a T,
    /// Shift β.
    pub beta: &'a T,
    /// The saved mean the batch norm normalises with.
    pub saved_mean: &'a T,
    /// The saved inverse standard deviation.
    pub saved_invstd: &'a T,
    /// Whether the batch norm applies a ReLU.
    pub relu: bool,
}

/// Inputs of synchronised batch norm's input gradient ([`Backend::bn_sync_backward`]): the
/// layer's forward and the gradient of its output, as [`BnBackward`] reads them.
#[derive(Debug)]
pub struct BnSyncBackward<'a, T> {
    /// Shape of `x` seen as `rows × channels` (this replica's rows).
    pub shape: BnShape,
    /// The forward input.
    pub x: &'a T,
    /// The forward output (its sign is the ReLU mask); `None` (an output never stored) only
    /// without `relu`.
    pub y: Option<&'a T>,
    /// Scale γ.
    pub gamma: &'a T,
    /// The global mean the forward normalised with.
    pub saved_mean: &'a T,
    /// The global inverse std the forward normalised with.
    pub saved_invstd: &'a T,
    /// Whether the forward applied ReLU.
    pub relu: bool,
    /// Gradient of the loss with respect to `y`.
    pub dy: &'a T,
    /// Gradient with respect to `x` (overwritten).
    pub dx: &'a mut T,
}

/// A buffer's device address and the tensors viewing ranges of it ([`Backend::alloc_views`]).
pub type GradientViews<T> = (u64, Vec<T>);

/// The ops of the ResNet graph. One implementation per device kind.
///
/// Errors are values ([`BackendError`]); implementations never panic on bad input (shape
/// mismatches are reported as [`BackendError::Shape`]).
pub trait Backend: Send {
    /// Opaque device tensor (a flat buffer of a known element count).
    type Tensor: Send;

    /// A short human-readable name ("cpu (2 threads)", "cuda:0 NVIDIA H100").
    fn name(&self) -> String;

    /// A zero-filled tensor of `len` elements.
    fn alloc(&self, len: usize, role: TensorRole) -> Result<Self::Tensor, BackendError>;

    /// Zero-filled tensors of `role` that are views of one buffer of `total` elements, tensor
    /// i at `ranges[i]` (writing through a view writes the buffer), and the buffer's device
    /// address, so that a collective can reduce whole ranges of it in place: a network's
    /// parameter gradients laid out by a bucket plan. `None` when the backend has no views;
    /// the caller then copies each gradient into its own flat buffer. No default: a backend
    /// that wraps another must pass this on (a wrapper that fell back to `None` once cost the
    /// GPU trainer its gradient buffer).
    fn alloc_views(
        &self,
        total: usize,
        ranges: &[std::ops::Range<usize>],
        role: TensorRole,
    ) -> Result<Option<GradientViews<Self::Tensor>>, BackendError>;

    /// A hint for `y`, a tensor that will hold the output of a batch norm with a residual
    /// and a ReLU whose incoming gradient a convolution's data gradient finishes
    /// ([`Backend::conv_backward_data_bn`], reading the ReLU's mask from that output): the
    /// backend may keep y's signs packed beside it, written with it by [`Backend::bn_forward`]
    /// and read for the mask instead of y (the CUDA backend's `BIRDTRAIN_BN_MASK=packed`). The
    /// results are the same bits either way. No default: a backend that wraps another must
    /// pass this on.
    fn keep_relu_signs(&self, y: &mut Self::Tensor) -> Result<(), BackendError>;

    /// Element count of a tensor.
    fn len(&self, t: &Self::Tensor) -> usize;

    /// Copies host f32 values into a tensor of the same length (converting its storage type).
    fn upload(&self, src: &[f32], dst: &mut Self::Tensor) -> Result<(), BackendError>;

    /// Copies a tensor to host f32.
    fn download(&self, src: &Self::Tensor) -> Result<Vec<f32>, BackendError>;

    /// Turns a u8 NHWC batch into the normalised network input (ImageNet mean/std after /255,
    /// as torchvision), applying each image's [`crate::model::Augment`] when given: the image is
    /// shifted by (dy, dx) with zero padding (pad-and-crop at the stored size) and mirrored.
    /// Padding is zero in normalised space, as torch pads the normalised tensor. With a
    /// [`crate::model::Mix`], each image is then blended with (mixup) or pasted over by
    /// (CutMix) its partner `n − 1 − i`, itself augmented.
    fn input(&self, batch: &InputBatch<'_>, out: &mut Self::Tensor) -> Result<(), BackendError>;

    /// `y = conv(x, w)`, no bias. `x` NHWC, `w` OHWI, `y` NHWC.
    fn conv_forward(
        &self,
        s: &ConvShape,
        x: &Self::Tensor,
        w: &Self::Tensor,
        y: &mut Self::Tensor,
    ) -> Result<(), BackendError>;

    /// Gradient with respect to the convolution input.
    fn conv_backward_data(
        &self,
        s: &ConvShape,
        dy: &Self::Tensor,
        w: &Self::Tensor,
        dx: &mut Self::Tensor,
        accumulate: bool,
    ) -> Result<(), BackendError>;

    /// Gradient with respect to the convolution weight (overwritten).
    fn conv_backward_weight(
        &self,
        s: &ConvShape,
        x: &Self::Tensor,
        dy: &Self::Tensor,
        dw: &mut Self::Tensor,
    ) -> Result<(), BackendError>;

    /// Whether a network on this backend should run batch norm fused into the convolutions
    /// around it: [`Backend::conv_forward_moments`] for the statistics and
    /// [`Backend::conv_backward_data_bn`] for the backward reductions (the CUDA backend's
    /// `BIRDTRAIN_BN_FUSION`). Both ops work whatever this says (a backend without fused
    /// kernels composes them from its other ops); it only chooses the sequence. No default: a
    /// backend that wraps another must pass this on.
    fn bn_fusion(&self) -> bool;

    /// With [`Backend::bn_fusion`], whether a network on this backend should also let a
    /// convolution apply the batch norm before it as it reads that batch norm's input
    /// ([`Backend::conv_forward_bn`], [`Backend::conv_backward_weight_bn`], and
    /// [`Backend::conv_backward_data_bn`] with no stored output), for a batch norm whose
    /// output that convolution alone reads: the output is then never stored (the CUDA
    /// backend's `BIRDTRAIN_BN_PROLOGUE`). The ops work whatever this says; it only chooses
    /// the sequence. No default: a backend that wraps another must pass this on.
    fn conv_applies_bn(&self) -> bool;

    /// `y = conv(x, w)` as [`Backend::conv_forward`], and the batch statistics of `y` in
    /// `moments` (`3·c_out` values: the layout of [`BnForward::moments`]), for the batch norm
    /// in training mode that reads `y`.
    fn conv_forward_moments(
        &self,
        s: &ConvShape,
        x: &Self::Tensor,
        w: &Self::Tensor,
        y: &mut Self::Tensor,
        moments: &mut Self::Tensor,
    ) -> Result<(), BackendError>;

    /// `y = conv(bn(z), w)` for a batch norm's output that is never stored: `bn(z)` computed
    /// per element exactly as [`Backend::bn_forward`] computes its output (the same
    /// arithmetic, rounded to the storage type) as the convolution reads it, so `y` has the
    /// bits of [`Backend::conv_forward`] over that output. The padding stays zero (it is not a
    /// transformed zero). `z` has the convolution's input shape. With `moments`, the batch
    /// statistics of `y` too, as [`Backend::conv_forward_moments`] leaves them.
    fn conv_forward_bn(
        &self,
        s: &ConvShape,
        z: &Self::Tensor,
        bn: &AppliedBn<'_, Self::Tensor>,
        w: &Self::Tensor,
        y: &mut Self::Tensor,
        moments: Option<&mut Self::Tensor>,
    ) -> Result<(), BackendError>;

    /// Weight gradient of [`Backend::conv_forward_bn`]: `dw = wgrad(bn(z), dy)` (overwritten),
    /// with the bits of [`Backend::conv_backward_weight`] over the batch norm's output.
    fn conv_backward_weight_bn(
        &self,
        s: &ConvShape,
        z: &Self::Tensor,
        bn: &AppliedBn<'_, Self::Tensor>,
        dy: &Self::Tensor,
        dw: &mut Self::Tensor,
    ) -> Result<(), BackendError>;

    /// The data gradient of a convolution whose input is the output of a batch norm, finished
    /// for that batch norm's backward: `dx = [y > 0]·(dgrad(dy, w) [+ dx] [+ residual_grad])`
    /// (the mask only with `bn.relu`; `dx` added with `accumulate`), each sum rounded to the
    /// storage type in that order, and its reductions Σdx·x̂ into `bn.dgamma` and Σdx into
    /// `bn.dbeta`. The batch norm's backward then runs with [`BnBackward::prepared`].
    fn conv_backward_data_bn(
        &self,
        s: &ConvShape,
        dy: &Self::Tensor,
        w: &Self::Tensor,
        dx: &mut Self::Tensor,
        accumulate: bool,
        bn: BnGradEpilogue<'_, Self::Tensor>,
    ) -> Result<(), BackendError>;

    /// Fused batch norm (+ residual add) (+ ReLU), see [`BnForward`].
    fn bn_forward(&self, a: BnForward<'_, Self::Tensor>) -> Result<(), BackendError>;

    /// Backward of [`Backend::bn_forward`], see [`BnBackward`].
    fn bn_backward(&self, a: BnBackward<'_, Self::Tensor>) -> Result<(), BackendError>;

    /// f64 values synchronised batch norm sums over replicas ([`bn_sync`]), kept where the
    /// backend computes: host memory on the CPU, device memory on a GPU.
    type Sums: Send;

    /// Zeroed sums of `len` values.
    fn alloc_sums(&self, len: usize) -> Result<Self::Sums, BackendError>;

    /// The sums as a reducer sees them (it sums them in place, over replicas).
    fn sums_mut<'a>(&self, sums: &'a mut Self::Sums) -> SumsMut<'a>;

    /// Synchronised BN forward, before the replicas' sum: `moments` (2·channels + 1 values)
    /// ← Σx, Σx² per channel and the rows of this replica's batch, from its batch `mean` and
    /// unbiased `var` ([`bn_sync::moments`]).
    ///
    /// The defaults of the four `bn_sync_*` ops compute on the host through download and
    /// upload (the CPU backend's; exact). The CUDA backend runs them as kernels, so with a
    /// collective that sums device memory a synchronised layer never crosses to the host.
    fn bn_sync_moments(
        &self,
        shape: BnShape,
        mean: &Self::Tensor,
        var: &Self::Tensor,
        moments: &mut Self::Sums,
    ) -> Result<(), BackendError> {
        let sums = bn_sync::moments(shape, &self.download(mean)?, &self.download(var)?)?;
        self.sums_mut(moments).write(&sums)
    }

    /// Synchronised BN forward, after the sum: the global batch's mean and biased variance
    /// into the first `channels` values of `mean` and `var` (what the frozen-statistics op
    /// then normalises with), and the running statistics advanced with the global mean and
    /// unbiased variance by `momentum` ([`bn_sync::global_statistics`],
    /// [`bn_sync::advance_running`]).
    #[allow(clippy::too_many_arguments)]
    fn bn_sync_statistics(
        &self,
        channels: usize,
        moments: &mut Self::Sums,
        mean: &mut Self::Tensor,
        var: &mut Self::Tensor,
        running_mean: &mut Self::Tensor,
        running_var: &mut Self::Tensor,
        momentum: f32,
    ) -> Result<(), BackendError> {
        let sums = self.sums_mut(moments).read()?;
        let (gm, gv, rows) = bn_sync::global_statistics(channels, &sums)?;
        let len = self.len(mean);
        let mut hm = vec![0.0f32; len];
        let mut hv = vec![1.0f32; len];
        for ch in 0..channels.min(len) {
            hm[ch] = gm[ch] as f32;
            hv[ch] = gv[ch] as f32;
        }
        self.upload(&hm, mean)?;
        self.upload(&hv, var)?;
        let mut rm = self.download(running_mean)?;
        let mut rv = self.download(running_var)?;
        bn_sync::advance_running(&mut rm, &mut rv, &gm, &gv, rows, momentum);
        self.upload(&rm, running_mean)?;
        self.upload(&rv, running_var)
    }

    /// Synchronised BN backward, before the sum: `grads` (2·channels values) ← this
    /// replica's dγ and dβ times its share of the global rows, read from the summed
    /// `moments` of the same layer's forward ([`bn_sync::grad_sums`]).
    fn bn_sync_grad_sums(
        &self,
        shape: BnShape,
        moments: &mut Self::Sums,
        dgamma: &Self::Tensor,
        dbeta: &Self::Tensor,
        grads: &mut Self::Sums,
    ) -> Result<(), BackendError> {
        let global_rows = self
            .sums_mut(moments)
            .read()?
            .get(2 * shape.channels)
            .copied()
            .ok_or_else(|| BackendError::Shape {
                op: "bn_sync_grad_sums",
                detail: format!("forward sums too short for {} channels", shape.channels),
            })?;
        let sums = bn_sync::grad_sums(
            shape,
            global_rows,
            &self.download(dgamma)?,
            &self.download(dbeta)?,
        )?;
        self.sums_mut(grads).write(&sums)
    }

    /// Synchronised BN backward, after the sum: `dx` ← the batch-statistics input gradient of
    /// the layer with the global reductions of the summed `grads` in place of this replica's
    /// own ([`bn_sync::global_reductions`]), i.e. the backend's own batch-norm backward pass
    /// over the global batch, overwriting what the frozen-statistics backward wrote. One
    /// evaluation per element, rounded once: no correction added to a rounded gradient (a
    /// channel whose dz is all its mean, as with one value per channel, gets exactly 0).
    ///
    /// The default computes on the host ([`bn_sync::input_gradient`]); the CPU backend runs
    /// its own SIMD pass, the CUDA backend its `bn_bwd_apply` kernel.
    fn bn_sync_backward(
        &self,
        grads: &mut Self::Sums,
        a: BnSyncBackward<'_, Self::Tensor>,
    ) -> Result<(), BackendError> {
        let sums = self.sums_mut(grads).read()?;
        let (dgamma, dbeta) = bn_sync::global_reductions(a.shape.channels, &sums)?;
        if a.y.is_none() && a.relu {
            return Err(error::missing_mask("bn_sync_backward"));
        }
        let (x, dy) = (self.download(a.x)?, self.download(a.dy)?);
        // No output (no ReLU): the mask is not read; any tensor of its length stands in.
        let y = self.download(a.y.unwrap_or(a.dy))?;
        let (gamma, mean, invstd) = (
            self.download(a.gamma)?,
            self.download(a.saved_mean)?,
            self.download(a.saved_invstd)?,
        );
        let mut dx = self.download(a.dx)?;
        bn_sync::input_gradient(
            bn_sync::InputGradientArgs {
                shape: a.shape,
                x: &x,
                y: &y,
                dy: &dy,
                gamma: &gamma,
                mean: &mean,
                invstd: &invstd,
                relu: a.relu,
                dgamma: &dgamma,
                dbeta: &dbeta,
            },
            &mut dx,
        )?;
        self.upload(&dx, a.dx)
    }

    /// Max pooling (torch semantics: padding never wins a max).
    fn maxpool_forward(
        &self,
        s: &PoolShape,
        x: &Self::Tensor,
        y: &mut Self::Tensor,
    ) -> Result<(), BackendError>;

    /// Max-pool backward: each output gradient goes to the first maximum of its window
    /// (row-major scan), recomputed from `x`.
    fn maxpool_backward(
        &self,
        s: &PoolShape,
        x: &Self::Tensor,
        dy: &Self::Tensor,
        dx: &mut Self::Tensor,
        accumulate: bool,
    ) -> Result<(), BackendError>;

    /// Max pooling of a batch norm's output that is never stored: `y = maxpool(bn(z))`, with
    /// `bn(z) = [ReLU]((z − mean)·invstd·γ + β)` computed per element exactly as
    /// [`Backend::bn_forward`] computes its output (the same arithmetic, rounded to the
    /// storage type), so `y` has the bits of [`Backend::maxpool_forward`] over that output.
    /// Padding never wins, as there (it is not a transformed zero). `z` has the pool's input
    /// shape; `bn`'s statistics are those its forward saved in any mode.
    fn maxpool_bn_forward(
        &self,
        s: &PoolShape,
        z: &Self::Tensor,
        bn: &AppliedBn<'_, Self::Tensor>,
        y: &mut Self::Tensor,
    ) -> Result<(), BackendError>;

    /// Backward of [`Backend::maxpool_bn_forward`], finished for the batch norm as
    /// [`Backend::conv_backward_data_bn`] finishes a convolution's: `g` (overwritten) ←
    /// `[bn(z) > 0]·maxpool_backward(bn(z), dy)` (the mask only with `bn.relu`; each output
    /// gradient to the first maximum of its window over the transformed values, the tie rule
    /// of [`Backend::maxpool_backward`]), rounded to the storage type, and its reductions
    /// Σg·x̂ into `dgamma`, Σg into `dbeta` (x̂ = (z − mean)·invstd). The batch norm's backward
    /// then runs [`BnBackward::prepared`] with no `y`. The pool must be the batch norm
    /// output's only reader (its gradient is complete here).
    #[allow(clippy::too_many_arguments)]
    fn maxpool_bn_backward(
        &self,
        s: &PoolShape,
        z: &Self::Tensor,
        bn: &AppliedBn<'_, Self::Tensor>,
        dy: &Self::Tensor,
        g: &mut Self::Tensor,
        dgamma: &mut Self::Tensor,
        dbeta: &mut Self::Tensor,
    ) -> Result<(), BackendError>;

    /// Global average pool: `x` is `n × hw × c` → `y` is `n × c`.
    fn gap_forward(
        &self,
        n: usize,
        hw: usize,
        c: usize,
        x: &Self::Tensor,
        y: &mut Self::Tensor,
    ) -> Result<(), BackendError>;

    /// Global average pool backward.
    fn gap_backward(
        &self,
        n: usize,
        hw: usize,
        c: usize,
        dy: &Self::Tensor,
        dx: &mut Self::Tensor,
        accumulate: bool,
    ) -> Result<(), BackendError>;

    /// `y = x · wᵀ + b` with `w` `[out][in]`.
    fn linear_forward(
        &self,
        s: &LinearShape,
        x: &Self::Tensor,
        w: &Self::Tensor,
        b: &Self::Tensor,
        y: &mut Self::Tensor,
    ) -> Result<(), BackendError>;

    /// Linear backward: `dx` (overwritten or accumulated), `dw` and `db` (overwritten).
    #[allow(clippy::too_many_arguments)]
    fn linear_backward(
        &self,
        s: &LinearShape,
        x: &Self::Tensor,
        w: &Self::Tensor,
        dy: &Self::Tensor,
        dx: &mut Self::Tensor,
        dw: &mut Self::Tensor,
        db: &mut Self::Tensor,
        accumulate: bool,
    ) -> Result<(), BackendError>;

    /// Softmax cross-entropy over `n` rows of `classes` logits against `targets` (label
    /// smoothing as torch defines it, target = (1-ε)·onehot + ε/classes, and the mixed
    /// targets of [`Targets`]). Writes `dlogits` (gradient of the *mean* loss over the `n`
    /// images) when given and the softmax probabilities into `probs` (resized to
    /// `n × classes`) when given.
    fn softmax_cross_entropy(
        &self,
        n: usize,
        classes: usize,
        logits: &Self::Tensor,
        targets: &Targets<'_>,
        dlogits: Option<&mut Self::Tensor>,
        probs: Option<&mut Vec<f32>>,
    ) -> Result<LossStats, BackendError>;
}
