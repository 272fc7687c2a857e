//! The fused optimizer on the GPU: one launch updates every parameter of the model.
//!
//! [`DeviceOptimizer`] keeps the f32 master weights and the optimizer state on the device as
//! flat buffers in graph parameter order (the layout of `Network::params_f32`, conv weights in
//! the backend's OHWI order) and, after each f32 update, writes the bf16 working copy the
//! forward pass reads. The rules are exactly [`crate::optim::Optimizer`]'s (checked against it
//! by the GPU tests). A chunk table built once maps each block of the launch to a slice of one
//! parameter tensor with that tensor's weight decay (kernels/optim.cu).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::backend::CudaBackend;
use super::error::CudaError;
use crate::model::ParamSpec;
use crate::optim::{Hyper, OptimizerKind};

/// Elements per block of the update launch.
pub const CHUNK: usize = 65_536;

/// The chunk table: (start, length, weight decay) per block, each chunk inside one tensor.
pub fn chunk_table(params: &[ParamSpec], weight_decay: f32) -> Vec<(i64, i32, f32)> {
    let mut table = Vec::new();
    let mut offset = 0usize;
    for p in params {
        let wd = if p.decay { weight_decay } else { 0.0 };
        let mut done = 0;
        while done < p.numel() {
            let len = CHUNK.min(p.numel() - done);
            table.push(((offset + done) as i64, len as i32, wd));
            done += len;
        }
        offset += p.numel();
    }
    table
}

/// Master weights and optimizer state on the device.
#[derive(Debug)]
pub struct DeviceOptimizer {
    backend: CudaBackend,
    kind: OptimizerKind,
    hyper: Hyper,
    len: usize,
    master: CudaSlice<f32>,
    m: CudaSlice<f32>,
    v: Option<CudaSlice<f32>>,
    starts: CudaSlice<i64>,
    lens: CudaSlice<i32>,
    decays: CudaSlice<f32>,
    chunks: usize,
    steps: u64,
}

fn drv(context: &str) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError + '_ {
    move |source| CudaError::Driver {
        context: context.to_string(),
        source,
    }
}

impl DeviceOptimizer {
    /// An optimizer for `params` starting from the flat master weights `initial`.
    pub fn new(
        backend: &CudaBackend,
        kind: OptimizerKind,
        hyper: Hyper,
        params: &[ParamSpec],
        initial: &[f32],
    ) -> Result<Self, CudaError> {
        let len: usize = params.iter().map(ParamSpec::numel).sum();
        if initial.len() != len {
            return Err(CudaError::Unsupported {
                what: format!("{} initial values for {len} parameters", initial.len()),
            });
        }
        let stream = backend.device().stream().clone();
        let table = chunk_table(params, hyper.weight_decay);
        let starts: Vec<i64> = table.iter().map(|t| t.0).collect();
        let lens: Vec<i32> = table.iter().map(|t| t.1).collect();
        let decays: Vec<f32> = table.iter().map(|t| t.2).collect();
        let adam = !matches!(kind, OptimizerKind::Sgd { .. });
        Ok(DeviceOptimizer {
            backend: backend.clone(),
            kind,
            hyper,
            len,
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
            chunks: table.len(),
            steps: 0,
        })
    }

    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// One update with the flat f32 gradient `grads` (× `grad_scale`, e.g. 1/world) at
    /// learning rate `lr`; writes the bf16 working copy into `working` when given.
    pub fn step(
        &mut self,
        grads: &CudaSlice<f32>,
        working: Option<&mut CudaSlice<u16>>,
        lr: f32,
        grad_scale: f32,
    ) -> Result<(), CudaError> {
        if grads.len() < self.len || working.as_ref().is_some_and(|w| w.len() < self.len) {
            return Err(CudaError::Unsupported {
                what: format!(
                    "gradient/working buffers shorter than the {} parameters",
                    self.len
                ),
            });
        }
        if self.chunks == 0 {
            return Ok(());
        }
        self.steps += 1;
        let dev = self.backend.device();
        let stream = dev.stream();
        let cfg = LaunchConfig {
            grid_dim: (self.chunks as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        static NULL_PTR: u64 = 0;
        let h = self.hyper;
        match self.kind {
            OptimizerKind::Sgd { momentum, nesterov } => {
                let f = dev.function("optim.cu", "sgd_update")?;
                let nesterov = i32::from(nesterov);
                let mut b = stream.launch_builder(&f);
                b.arg(&mut self.master).arg(grads).arg(&mut self.m);
                match working {
                    Some(w) => b.arg(w),
                    None => b.arg(&NULL_PTR),
                };
                b.arg(&self.starts)
                    .arg(&self.lens)
                    .arg(&self.decays)
                    .arg(&lr)
                    .arg(&momentum)
                    .arg(&grad_scale)
                    .arg(&nesterov);
                // SAFETY: argument list matches sgd_update in kernels/optim.cu; lengths checked.
                unsafe { b.launch(cfg) }.map_err(drv("sgd_update"))?;
            }
            OptimizerKind::Adam | OptimizerKind::AdamW => {
                let f = dev.function("optim.cu", "adam_update")?;
                let t = self.steps as i32;
                let bc1 = (1.0 - f64::from(h.beta1).powi(t)) as f32;
                let bc2 = (1.0 - f64::from(h.beta2).powi(t)) as f32;
                let decoupled = i32::from(self.kind == OptimizerKind::AdamW);
                let v = self.v.as_mut().expect("Adam state allocated in new");
                let mut b = stream.launch_builder(&f);
                b.arg(&mut self.master).arg(grads).arg(&mut self.m).arg(v);
                match working {
                    Some(w) => b.arg(w),
                    None => b.arg(&NULL_PTR),
                };
                b.arg(&self.starts)
                    .arg(&self.lens)
                    .arg(&self.decays)
                    .arg(&lr)
                    .arg(&h.beta1)
                    .arg(&h.beta2)
                    .arg(&h.eps)
                    .arg(&grad_scale)
                    .arg(&bc1)
                    .arg(&bc2)
                    .arg(&decoupled);
                // SAFETY: argument list matches adam_update in kernels/optim.cu; lengths checked.
                unsafe { b.launch(cfg) }.map_err(drv("adam_update"))?;
            }
        }
        Ok(())
    }

    /// The f32 master weights (waits for the GPU).
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Arch, Graph};

    #[test]
    fn chunk_table_covers_every_parameter_once_with_its_decay() {
        let graph = Graph::new(Arch::ResNet18, 10);
        let table = chunk_table(graph.params(), 0.5);
        let total: usize = table.iter().map(|t| t.1 as usize).sum();
        assert_eq!(total, graph.param_count());
        let mut next = 0i64;
        for &(start, len, _) in &table {
            assert_eq!(start, next, "chunks are contiguous and ordered");
            assert!(len as usize <= CHUNK && len > 0);
            next += i64::from(len);
        }
        // BN weights are exempt from decay, conv weights are not.
        let (offsets, _) = graph.param_offsets();
        for (i, p) in graph.params().iter().enumerate() {
            let chunk = table.iter().find(|t| t.0 as usize == offsets[i]).unwrap();
            assert_eq!(chunk.2, if p.decay { 0.5 } else { 0.0 }, "{}", p.name);
        }
    }
}
