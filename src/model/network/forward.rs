//! The forward pass of a [`Network`], and the inference steps built on it alone.

use crate::backend::{AppliedBn, Backend, BnForward, BnMode, Targets};
use crate::model::graph::Node;
use crate::model::{Augment, InputBatch, ModelError, StepStats};

use super::hooks::{reborrow, BnAllReduce};
use super::{get, take, Network, BORROWED};

impl<B: Backend> Network<B> {
    /// Batch-norm node `p`, applied by the max pool or convolution that reads its output
    /// ([`super::FusionPlan::pool_applies`], [`super::FusionPlan::conv_applies`]): its input
    /// value and what the reader applies.
    pub(super) fn applied_bn(&self, p: usize) -> (usize, AppliedBn<'_, B::Tensor>) {
        let Node::BatchNorm {
            input,
            relu,
            weight,
            bias,
            ..
        } = self.graph.nodes()[p]
        else {
            unreachable!("a reader applies a BatchNorm node");
        };
        let (mean, invstd) = self.saved[p].as_ref().expect("bn saved stats");
        let bn = AppliedBn {
            gamma: get(&self.params, weight),
            beta: get(&self.params, bias),
            saved_mean: mean,
            saved_invstd: invstd,
            relu,
        };
        (input, bn)
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
        let logits = self.plan.logits();
        let mut probs = Vec::new();
        let loss = self.backend.softmax_cross_entropy(
            n,
            self.graph.num_classes(),
            get(&self.acts, logits),
            &Targets::of_batch(input, self.config.label_smoothing),
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

    /// Runs every node in order on `input`'s images, batch norm in `mode` (synchronised over
    /// replicas with `sync_bn`); the activations stay for backward and the loss.
    pub(super) fn forward(
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
                    let s = self.plan.conv(k, n);
                    let mut y = take(&mut self.acts, output);
                    // Fused, in training: the batch norm's statistics come with the output.
                    let stats_for = self.plan.fusion.stats_for[k].filter(|_| mode == BnMode::Train);
                    let r = match (self.plan.fusion.conv_applies[k], stats_for) {
                        // The batch norm before it, applied as the convolution reads its input.
                        (Some(p), stats_for) => {
                            let mut m = stats_for.map(|bn| take(&mut self.bn_moments, bn));
                            let r = {
                                let (z, bn) = self.applied_bn(p);
                                self.backend.conv_forward_bn(
                                    &s,
                                    get(&self.acts, z),
                                    &bn,
                                    get(&self.params, weight),
                                    &mut y,
                                    m.as_mut(),
                                )
                            };
                            if let (Some(bn), Some(m)) = (stats_for, m) {
                                self.bn_moments[bn] = Some(m);
                                self.moments_ready[bn] = r.is_ok();
                            }
                            r
                        }
                        (None, Some(bn)) => {
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
                        (None, None) => self.backend.conv_forward(
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
                    ..
                } => {
                    let shape = self.plan.bn(k, n);
                    let synced = match reborrow(&mut sync_bn) {
                        Some(r) => {
                            self.global_bn_stats(k, node, shape, r)?;
                            true
                        }
                        None => false,
                    };
                    // None: not stored (the max pool after it applies it).
                    let mut y = self.acts[output].take();
                    assert_eq!(y.is_none(), self.plan.fusion.unstored[k], "{BORROWED}");
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
                        y: y.as_mut(),
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
                    self.acts[output] = y;
                    self.saved[k] = Some((mean, invstd));
                    if synced {
                        self.bn_scratch = Some((rm, rv));
                    } else {
                        self.buffers[running_mean] = Some(rm);
                        self.buffers[running_var] = Some(rv);
                    }
                    r?;
                }
                Node::MaxPool { input, output, .. } => {
                    let s = self.plan.max_pool(k, n);
                    let mut y = take(&mut self.acts, output);
                    let r = match self.plan.fusion.pool_applies[k] {
                        // The batch norm before it, applied as the pool reads its input.
                        Some(p) => {
                            let (z, bn) = self.applied_bn(p);
                            self.backend
                                .maxpool_bn_forward(&s, get(&self.acts, z), &bn, &mut y)
                        }
                        None => self
                            .backend
                            .maxpool_forward(&s, get(&self.acts, input), &mut y),
                    };
                    self.acts[output] = Some(y);
                    r?;
                }
                Node::GlobalAvgPool { input, output } => {
                    let s = self.plan.gap(k);
                    let mut y = take(&mut self.acts, output);
                    let r = self.backend.gap_forward(
                        n,
                        s.pixels,
                        s.channels,
                        get(&self.acts, input),
                        &mut y,
                    );
                    self.acts[output] = Some(y);
                    r?;
                }
                Node::Linear {
                    input,
                    output,
                    weight,
                    bias,
                    ..
                } => {
                    let s = self.plan.linear(k, n);
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
}
