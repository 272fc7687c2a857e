//! The backward pass of a [`Network`]: each node's gradients in reverse order, every parameter
//! gradient handed to the gradient-ready hook as soon as it is final.

use crate::backend::{Backend, BnBackward, BnGradEpilogue, ConvShape};
use crate::model::graph::Node;
use crate::model::ModelError;

use super::hooks::{grad_ready_order, reborrow, BnAllReduce, GradReadyHook};
use super::{get, take, Network};

impl<B: Backend> Network<B> {
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

    /// The data gradient of conv node `k` finishing the incoming gradient of batch-norm node
    /// `p` (which produced the convolution's input; [`FusionPlan::finishes`]): the mask, the
    /// residual gradient left in place for it, and p's two reductions into its γ and β
    /// gradients, which p's backward then reads (`prepared`).
    fn finishing_backward_data(
        &mut self,
        k: usize,
        p: usize,
        s: &ConvShape,
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
            residual: bn_residual,
            relu,
            weight: gamma,
            bias: beta,
            ..
        } = self.graph.nodes()[p]
        else {
            unreachable!("a convolution finishes a BatchNorm node");
        };
        let mut dx = take(&mut self.grad_bufs, self.plan.grad_slot[input]);
        let mut dgamma = take(&mut self.param_grads, gamma);
        let mut dbeta = take(&mut self.param_grads, beta);
        let (mean, invstd) = self.saved[p].as_ref().expect("bn saved stats");
        let r = self.backend.conv_backward_data_bn(
            s,
            get(&self.grad_bufs, self.plan.grad_slot[output]),
            get(&self.params, weight),
            &mut dx,
            written[input],
            BnGradEpilogue {
                x: get(&self.acts, bn_input),
                // None: not stored (this convolution applied it): the mask is recomputed.
                y: self.acts[input].as_ref(),
                y_recomputable: bn_residual.is_none(),
                relu,
                gamma: get(&self.params, gamma),
                beta: get(&self.params, beta),
                saved_mean: mean,
                saved_invstd: invstd,
                residual_grad: self.plan.fusion.residual_from[k]
                    .map(|v| get(&self.grad_bufs, self.plan.grad_slot[v])),
                dgamma: &mut dgamma,
                dbeta: &mut dbeta,
            },
        );
        self.grad_bufs[self.plan.grad_slot[input]] = Some(dx);
        self.param_grads[gamma] = Some(dgamma);
        self.param_grads[beta] = Some(dbeta);
        r?;
        Ok(())
    }

    /// The backward of max-pool node `k` that applies batch-norm node `p`
    /// ([`FusionPlan::pool_applies`]): p's incoming gradient finished (mask) and reduced into
    /// its γ and β gradients, which p's backward then reads (`prepared`).
    fn pool_bn_backward(&mut self, k: usize, p: usize, n: usize) -> Result<(), ModelError> {
        let Node::MaxPool { input, output, .. } = self.graph.nodes()[k] else {
            unreachable!("pool_bn_backward is only called for MaxPool nodes");
        };
        let Node::BatchNorm {
            weight: gamma,
            bias: beta,
            ..
        } = self.graph.nodes()[p]
        else {
            unreachable!("a max pool applies a BatchNorm node");
        };
        let s = self.plan.max_pool(k, n);
        let mut g = take(&mut self.grad_bufs, self.plan.grad_slot[input]);
        let mut dgamma = take(&mut self.param_grads, gamma);
        let mut dbeta = take(&mut self.param_grads, beta);
        let r = {
            let (z, bn) = self.applied_bn(p);
            self.backend.maxpool_bn_backward(
                &s,
                get(&self.acts, z),
                &bn,
                get(&self.grad_bufs, self.plan.grad_slot[output]),
                &mut g,
                &mut dgamma,
                &mut dbeta,
            )
        };
        self.grad_bufs[self.plan.grad_slot[input]] = Some(g);
        self.param_grads[gamma] = Some(dgamma);
        self.param_grads[beta] = Some(dbeta);
        Ok(r?)
    }

    /// Reverse pass. A value's gradient is complete before it is consumed, because every
    /// consumer comes after its producer in node order; `written` says whether a gradient
    /// buffer already holds a contribution (then the next one accumulates).
    pub(super) fn backward(
        &mut self,
        n: usize,
        batch_stats: bool,
        hook: &mut GradReadyHook<'_, B::Tensor>,
        mut sync_bn: Option<&mut dyn BnAllReduce>,
    ) -> Result<(), ModelError> {
        let mut written = vec![false; self.plan.dims.len()];
        written[self.plan.logits()] = true;
        let graph = self.graph.clone();
        for (k, node) in graph.nodes().iter().enumerate().rev() {
            match *node {
                Node::Linear {
                    input,
                    output,
                    weight,
                    bias,
                    ..
                } => {
                    let s = self.plan.linear(k, n);
                    let mut dx = take(&mut self.grad_bufs, self.plan.grad_slot[input]);
                    let mut dw = take(&mut self.param_grads, weight);
                    let mut db = take(&mut self.param_grads, bias);
                    let r = self.backend.linear_backward(
                        &s,
                        get(&self.acts, input),
                        get(&self.params, weight),
                        get(&self.grad_bufs, self.plan.grad_slot[output]),
                        &mut dx,
                        &mut dw,
                        &mut db,
                        written[input],
                    );
                    self.grad_bufs[self.plan.grad_slot[input]] = Some(dx);
                    self.param_grads[weight] = Some(dw);
                    self.param_grads[bias] = Some(db);
                    r?;
                    written[input] = true;
                    self.grad_final(weight, hook)?;
                    self.grad_final(bias, hook)?;
                }
                Node::GlobalAvgPool { input, output } => {
                    let s = self.plan.gap(k);
                    let mut dx = take(&mut self.grad_bufs, self.plan.grad_slot[input]);
                    let r = self.backend.gap_backward(
                        n,
                        s.pixels,
                        s.channels,
                        get(&self.grad_bufs, self.plan.grad_slot[output]),
                        &mut dx,
                        written[input],
                    );
                    self.grad_bufs[self.plan.grad_slot[input]] = Some(dx);
                    r?;
                    written[input] = true;
                }
                Node::MaxPool { input, .. } if self.plan.fusion.pool_applies[k].is_some() => {
                    // The pool is the batch norm output's only reader: nothing written yet.
                    debug_assert!(!written[input]);
                    let p = self.plan.fusion.pool_applies[k].expect("matched");
                    self.pool_bn_backward(k, p, n)?;
                    written[input] = true;
                }
                Node::MaxPool { input, output, .. } => {
                    let s = self.plan.max_pool(k, n);
                    let mut dx = take(&mut self.grad_bufs, self.plan.grad_slot[input]);
                    let r = self.backend.maxpool_backward(
                        &s,
                        get(&self.acts, input),
                        get(&self.grad_bufs, self.plan.grad_slot[output]),
                        &mut dx,
                        written[input],
                    );
                    self.grad_bufs[self.plan.grad_slot[input]] = Some(dx);
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
                    ..
                } => {
                    // A BN input is a convolution output with this single consumer.
                    debug_assert!(!written[input]);
                    let mut dx = take(&mut self.grad_bufs, self.plan.grad_slot[input]);
                    // Fused, the residual's gradient may stay in place: its reader takes it
                    // from dy (and its buffer is not this residual's yet: not touched).
                    let mut dres = residual
                        .filter(|_| !self.plan.fusion.residual_in_place[k])
                        .map(|v| take(&mut self.grad_bufs, self.plan.grad_slot[v]));
                    let mut dgamma = take(&mut self.param_grads, weight);
                    let mut dbeta = take(&mut self.param_grads, bias);
                    let (mean, invstd) = self.saved[k].as_ref().expect("bn saved stats");
                    let acc = residual.is_some_and(|v| written[v]);
                    let shape = self.plan.bn(k, n);
                    let synced = batch_stats && sync_bn.is_some();
                    let r = self.backend.bn_backward(BnBackward {
                        shape,
                        x: get(&self.acts, input),
                        // None: not stored (prepared by the max pool that applied it).
                        y: self.acts[output].as_ref(),
                        gamma: get(&self.params, weight),
                        saved_mean: mean,
                        saved_invstd: invstd,
                        // Synchronised: the local op gives the two local reductions (dγ, dβ;
                        // prepared: the dgrad epilogue's, kept) and the residual's gradient;
                        // dx is written again from the global reductions.
                        batch_stats: batch_stats && !synced,
                        relu,
                        dy: get(&self.grad_bufs, self.plan.grad_slot[output]),
                        dx: &mut dx,
                        dresidual: dres.as_mut().map(|t| (t, acc)),
                        dgamma: &mut dgamma,
                        dbeta: &mut dbeta,
                        prepared: self.plan.fusion.prepared[k],
                    });
                    self.grad_bufs[self.plan.grad_slot[input]] = Some(dx);
                    if let (Some(v), Some(t)) = (residual, dres) {
                        self.grad_bufs[self.plan.grad_slot[v]] = Some(t);
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
                    let s = self.plan.conv(k, n);
                    let mut dw = take(&mut self.param_grads, weight);
                    let dy = get(&self.grad_bufs, self.plan.grad_slot[output]);
                    let r = match self.plan.fusion.conv_applies[k] {
                        // Its input never stored: the batch norm applied again as it is read.
                        Some(p) => {
                            let (z, bn) = self.applied_bn(p);
                            self.backend.conv_backward_weight_bn(
                                &s,
                                get(&self.acts, z),
                                &bn,
                                dy,
                                &mut dw,
                            )
                        }
                        None => self.backend.conv_backward_weight(
                            &s,
                            get(&self.acts, input),
                            dy,
                            &mut dw,
                        ),
                    };
                    self.param_grads[weight] = Some(dw);
                    r?;
                    // Reported before the data gradient is computed: the earlier the bucket
                    // completes, the more of backward its all-reduce hides behind.
                    self.grad_final(weight, hook)?;
                    if let Some(p) = self.plan.fusion.finishes[k] {
                        self.finishing_backward_data(k, p, &s, &written)?;
                        written[input] = true;
                    } else if input != 0 {
                        let mut dx = take(&mut self.grad_bufs, self.plan.grad_slot[input]);
                        let r = self.backend.conv_backward_data(
                            &s,
                            get(&self.grad_bufs, self.plan.grad_slot[output]),
                            get(&self.params, weight),
                            &mut dx,
                            written[input],
                        );
                        self.grad_bufs[self.plan.grad_slot[input]] = Some(dx);
                        r?;
                        written[input] = true;
                    }
                }
            }
        }
        Ok(())
    }
}
