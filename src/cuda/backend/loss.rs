//! The loss (kernels/loss.cu): softmax cross-entropy with label smoothing and mixed targets,
//! its per-row loss and top-k rank read back to the host, or (`--gpus`) summed into the
//! step's figures on the device (`loss_totals`) so that nothing waits for the GPU.

use cudarc::driver::LaunchConfig;

use super::base::{check_len, drv_err, ensure, to_i32, CudaBackend};
use crate::backend::{BackendError, LossStats, Targets};
use crate::cuda::launch::{In, Out};
use crate::cuda::launchers::{LossTotals, SoftmaxXent};
use crate::cuda::tensor::CudaTensor;

/// Where the loss op leaves a step's figures on the device (kernels/loss.cu `loss_totals`).
#[derive(Debug, Clone, Copy)]
pub struct DeviceTotalsAt {
    /// Device address of the five f64: loss sum, top-1 hits, top-5 hits, rows, `stop`.
    pub addr: u64,
    /// This rank's wish to stop after the step.
    pub stop: bool,
    /// Add the figures to what is there (a later micro-batch of the step) instead of
    /// overwriting them.
    pub add: bool,
}

/// [`crate::backend::Backend::softmax_cross_entropy`]; with `totals`, the step's figures go
/// to the device (see [`DeviceTotalsAt`]) and nothing waits for the GPU.
#[allow(clippy::too_many_arguments)]
pub(super) fn softmax_cross_entropy(
    be: &CudaBackend,
    n: usize,
    classes: usize,
    logits: &CudaTensor,
    targets: &Targets<'_>,
    dlogits: Option<&mut CudaTensor>,
    probs: Option<&mut Vec<f32>>,
    totals: Option<DeviceTotalsAt>,
) -> Result<LossStats, BackendError> {
    let op = "softmax_cross_entropy";
    check_len(op, "logits", logits.len, n * classes)?;
    check_len(op, "labels", targets.labels.len(), n)?;
    if let Some(d) = &dlogits {
        check_len(op, "dlogits", d.len, n * classes)?;
    }
    targets.check(op, n, classes)?;
    let (labels, smoothing, own_weight) = (targets.labels, targets.smoothing, targets.own_weight);
    if n == 0 {
        return Ok(LossStats::default());
    }
    let k = to_i32(op, "classes", classes)?;
    let scale = 1.0 / n as f32;
    // Device values (kernels/loss.cu), each uploaded now unless a captured step preloaded it.
    let labels_at = be.step_labels(op, &labels[..n])?;
    let own_weight_at = be.step_own_weight(op, own_weight)?;
    let stop_at = totals.map(|at| be.step_stop(op, at.stop)).transpose()?;
    let stream = be.dev.stream().clone();
    let mut work = be.work();
    let w = &mut *work;
    ensure(&be.dev, &mut w.ints2, n, op)?;
    ensure(
        &be.dev,
        &mut w.f32a,
        n + if probs.is_some() { n * classes } else { 0 },
        op,
    )?;
    let rank = w.ints2.as_mut().expect("ensured");
    let f = w.f32a.as_mut().expect("ensured");
    let (mut loss, mut prob_buf) = f.split_at_mut(n);
    let z = logits.bf16(op, "logits")?;
    let cfg = LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let dlogits = dlogits.map(|d| d.bf16_mut(op, "dlogits")).transpose()?;
    let want_probs = probs.is_some();
    let args = SoftmaxXent {
        logits: z.into(),
        // SAFETY: the step's value buffers, grown to `n` labels and one weight above; they
        // live as long as the backend (a regrown one is freed in stream order).
        labels: unsafe { In::addr(labels_at) },
        k,
        smoothing,
        own_weight: unsafe { In::addr(own_weight_at) },
        grad_scale: scale,
        loss: (&mut loss).into(),
        rank: (&mut *rank).into(),
        dlogits: dlogits.map(Into::into),
        probs: want_probs.then(|| (&mut prob_buf).into()),
    };
    be.launch(op, "softmax_xent", cfg, args)?;
    if let Some(at) = totals {
        let n_i = to_i32(op, "n", n)?;
        let (add, totals) = (i32::from(at.add), at.addr);
        let stop_at = stop_at.expect("uploaded with the totals");
        let one_block = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = LossTotals {
            loss: Some((&loss).into()),
            rank: Some((&*rank).into()),
            n: n_i,
            // SAFETY: the step's stop buffer (one int, uploaded above).
            stop: unsafe { In::addr(stop_at) },
            add,
            // SAFETY: `totals` comes from softmax_cross_entropy_on_device alone, whose caller
            // vouches for the address.
            totals: unsafe { Out::addr(totals) },
        };
        be.launch(op, "loss_totals", one_block, args)?;
        return Ok(LossStats::default());
    }
    let losses = stream.clone_dtoh(&loss).map_err(drv_err(op))?;
    let ranks = stream.clone_dtoh(&rank.slice(0..n)).map_err(drv_err(op))?;
    if let Some(p) = probs {
        *p = stream
            .clone_dtoh(&prob_buf.slice(0..n * classes))
            .map_err(drv_err(op))?;
    }
    stream.synchronize().map_err(drv_err(op))?;
    let mut stats = LossStats::default();
    for (l, r) in losses.iter().zip(&ranks) {
        stats.loss_sum += f64::from(*l);
        stats.correct_top1 += usize::from(*r == 0);
        stats.correct_top5 += usize::from(*r < 5);
    }
    Ok(stats)
}

impl CudaBackend {
    /// [`Backend::softmax_cross_entropy`](crate::backend::Backend::softmax_cross_entropy)
    /// that leaves the step's figures on the device: the five f64 at `totals.addr` receive
    /// (or, with `totals.add`, have added) the loss sum, top-1 and top-5 hits, the row count,
    /// and `stop`, and nothing waits for the GPU (the trainer reads them a step later).
    ///
    /// # Safety
    /// `totals.addr` must address five f64 of this device's memory, alive until the kernels
    /// queued now have run.
    pub unsafe fn softmax_cross_entropy_on_device(
        &self,
        n: usize,
        classes: usize,
        logits: &CudaTensor,
        targets: &Targets<'_>,
        dlogits: Option<&mut CudaTensor>,
        totals: DeviceTotalsAt,
    ) -> Result<(), BackendError> {
        softmax_cross_entropy(
            self,
            n,
            classes,
            logits,
            targets,
            dlogits,
            None,
            Some(totals),
        )
        .map(|_| ())
    }

    /// The step figures of a rank without images: zeros and `stop`, written to the five f64
    /// at `totals` on the device (see [`CudaBackend::softmax_cross_entropy_on_device`]).
    ///
    /// # Safety
    /// As [`CudaBackend::softmax_cross_entropy_on_device`].
    pub unsafe fn empty_step_totals(&self, totals: u64, stop: bool) -> Result<(), BackendError> {
        let op = "empty step totals";
        let stop_at = self.step_stop(op, stop)?;
        let one_block = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = LossTotals {
            loss: None,
            rank: None,
            n: 0,
            // SAFETY: the step's stop buffer (one int, uploaded above).
            stop: unsafe { In::addr(stop_at) },
            add: 0,
            // SAFETY: the caller's (this function's contract).
            totals: unsafe { Out::addr(totals) },
        };
        self.launch(op, "loss_totals", one_block, args)
    }
}
