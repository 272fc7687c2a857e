//! A [`Network`]'s state in and out: parameters and buffers to and from the host (torchvision
//! layout), and the tensors themselves for device-side work.

use crate::backend::{Backend, TensorRole};
use crate::model::graph::{BufferKind, ParamKind};
use crate::model::{ModelError, ModelState};

use super::layout::{ohwi_to_oihw_into, oihw_to_ohwi};
use super::{get, Network, BORROWED};

impl<B: Backend> Network<B> {
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
}
