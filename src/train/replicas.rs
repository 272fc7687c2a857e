//! R data-parallel replicas of one network and the master copy they share.
//!
//! Each step: every replica with images runs forward + backward on its micro-batch, the
//! gradients (of each replica's *mean* loss) are averaged weighted by image count — the
//! gradient of the mean loss over the whole global batch — the optimizer updates the master
//! parameters once, and every replica reloads them, so all hold identical weights.
//! Batch-norm running statistics are per replica during the step; afterwards the master's are
//! the count-weighted mean of the replicas' (the replicas then reload them), which keeps the
//! checkpoint independent of which replica it is read from.

use crate::backend::Backend;
use crate::model::{BufferKind, Graph, InputBatch, ModelState, Network, NetworkConfig, StepStats};

use super::TrainError;

/// The replicas, the master parameters and the master buffers.
pub(crate) struct Replicas<B: Backend> {
    nets: Vec<Network<B>>,
    graph: Graph,
    master: ModelState,
    flat: Vec<f32>,
}

impl<B: Backend> Replicas<B> {
    /// Builds one network per backend and loads `state` into each.
    pub(crate) fn new(
        backends: Vec<B>,
        graph: &Graph,
        max_batch: usize,
        image_size: u32,
        config: NetworkConfig,
        state: ModelState,
    ) -> Result<Self, TrainError> {
        let mut nets = Vec::with_capacity(backends.len());
        for backend in backends {
            let mut net = Network::new(backend, graph, max_batch, image_size)?;
            net.set_config(config);
            net.load_state(&state)?;
            nets.push(net);
        }
        let flat = state.flat_params();
        Ok(Self {
            nets,
            graph: graph.clone(),
            master: state,
            flat,
        })
    }

    /// Replica count.
    pub(crate) fn len(&self) -> usize {
        self.nets.len()
    }

    /// The master copy (parameters and buffers), as checkpoints store it.
    pub(crate) fn master_state(&self) -> Result<ModelState, TrainError> {
        if self.nets.len() == 1 {
            // One replica: its buffers are the master's; its parameters equal `flat`.
            return Ok(self.nets[0].state()?);
        }
        Ok(self.master.clone())
    }

    /// The first replica, for validation (every replica holds the master weights).
    pub(crate) fn eval_net(&mut self) -> &mut Network<B> {
        &mut self.nets[0]
    }

    /// Forward + backward on each replica's micro-batch (`None` or empty: no images this
    /// step) and the count-weighted mean gradient. Returns the summed stats and the
    /// gradient (None when no replica had images).
    pub(crate) fn forward_backward(
        &mut self,
        inputs: &[Option<InputBatch<'_>>],
    ) -> Result<(StepStats, Option<Vec<f32>>), TrainError> {
        let mut total = StepStats::default();
        let mut grad: Option<Vec<f32>> = None;
        let mut per_replica = Vec::with_capacity(self.nets.len());
        for (net, input) in self.nets.iter_mut().zip(inputs) {
            match input {
                Some(input) if input.len > 0 => {
                    let stats = net.train_step(input)?;
                    total.merge(&stats);
                    per_replica.push(Some(stats.count));
                }
                _ => per_replica.push(None),
            }
        }
        if total.count == 0 {
            return Ok((total, None));
        }
        for (net, count) in self.nets.iter().zip(&per_replica) {
            let Some(count) = *count else { continue };
            let g = net.grads_f32()?;
            let w = count as f32 / total.count as f32;
            match &mut grad {
                // One replica with every image: keep its gradient bit-exact.
                None if count == total.count => grad = Some(g),
                None => grad = Some(g.iter().map(|v| v * w).collect()),
                Some(acc) => acc.iter_mut().zip(&g).for_each(|(a, v)| *a += v * w),
            }
        }
        self.sync_buffers(&per_replica, total.count)?;
        Ok((total, grad))
    }

    /// The master parameters, for the optimizer to update in place.
    pub(crate) fn params_mut(&mut self) -> &mut Vec<f32> {
        &mut self.flat
    }

    /// Sends the updated master parameters to every replica.
    pub(crate) fn broadcast_params(&mut self) -> Result<(), TrainError> {
        self.master.set_flat_params(&self.flat)?;
        for net in &mut self.nets {
            net.set_params_f32(&self.flat)?;
        }
        Ok(())
    }

    /// Count-weighted mean of the replicas' BN running statistics into the master; the
    /// replicas reload it. One replica needs nothing (see [`Replicas::master_state`]).
    fn sync_buffers(&mut self, counts: &[Option<usize>], total: usize) -> Result<(), TrainError> {
        if self.nets.len() == 1 {
            return Ok(());
        }
        let mut trained = Vec::new();
        for (net, count) in self.nets.iter().zip(counts) {
            if let Some(count) = *count {
                trained.push((count as f32 / total as f32, net.state()?.buffers));
            }
        }
        let Some((_, first)) = trained.first() else {
            return Ok(());
        };
        let mut mean: Vec<Vec<f32>> = first.iter().map(|b| vec![0.0; b.len()]).collect();
        for (i, spec) in self.graph.buffers().iter().enumerate() {
            if spec.kind == BufferKind::NumBatchesTracked {
                // A step counter, not a statistic: every replica that trained advanced it once.
                mean[i] = first[i].clone();
                continue;
            }
            for (w, bufs) in &trained {
                mean[i]
                    .iter_mut()
                    .zip(&bufs[i])
                    .for_each(|(m, v)| *m += w * v);
            }
        }
        self.master.buffers = mean;
        self.master.set_flat_params(&self.flat)?;
        for net in &mut self.nets {
            net.load_state(&self.master)?;
        }
        Ok(())
    }
}

impl<B: Backend> Replicas<B> {
    /// The backend's name, for the start line.
    pub(crate) fn backend_name(&self) -> String {
        self.nets[0].backend().name()
    }
}

impl<B: Backend> Replicas<B> {
    /// xxh3-64 of each replica's parameters: equal values prove the replicas agree.
    pub(crate) fn checksums(&self) -> Result<Vec<u64>, TrainError> {
        self.nets
            .iter()
            .map(|net| {
                let params = net.params_f32()?;
                let bytes: Vec<u8> = params.iter().flat_map(|v| v.to_le_bytes()).collect();
                Ok(xxhash_rust::xxh3::xxh3_64(&bytes))
            })
            .collect()
    }
}
