//! The optimizers, over flat f32 vectors in graph parameter order.

use std::collections::HashMap;
use std::path::Path;
use std::str::FromStr;

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use super::layout::{ConvOrder, ParamLayout};
use super::OptimError;
use crate::model::ParamSpec;

/// Which update rule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptimizerKind {
    /// SGD as torch: `buf = μ·buf + g`, step `g + μ·buf` (Nesterov) or `buf`; L2 decay added to
    /// the gradient.
    Sgd {
        /// Momentum μ (0 = plain SGD).
        momentum: f32,
        /// Nesterov momentum.
        nesterov: bool,
    },
    /// Adam as torch, weight decay as L2 added to the gradient.
    Adam,
    /// AdamW: decoupled weight decay `p ← p·(1 − lr·wd)` before the Adam step.
    AdamW,
}

impl OptimizerKind {
    /// The command-line name.
    pub fn name(&self) -> &'static str {
        match self {
            OptimizerKind::Sgd { .. } => "sgd",
            OptimizerKind::Adam => "adam",
            OptimizerKind::AdamW => "adamw",
        }
    }
}

impl FromStr for OptimizerKind {
    type Err = OptimError;

    /// "sgd" (momentum 0.9, no Nesterov), "adam", "adamw".
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "sgd" => Ok(OptimizerKind::Sgd {
                momentum: 0.9,
                nesterov: false,
            }),
            "adam" => Ok(OptimizerKind::Adam),
            "adamw" => Ok(OptimizerKind::AdamW),
            _ => Err(OptimError::UnknownKind(s.to_string())),
        }
    }
}

/// Hyper-parameters other than the learning rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hyper {
    /// Weight decay (applied only to parameters with `decay`).
    pub weight_decay: f32,
    /// Adam β₁.
    pub beta1: f32,
    /// Adam β₂.
    pub beta2: f32,
    /// Adam ε.
    pub eps: f32,
}

impl Default for Hyper {
    /// torch's defaults: no weight decay, β = (0.9, 0.999), ε = 1e-8.
    fn default() -> Self {
        Hyper {
            weight_decay: 0.0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }
}

/// An optimizer with its state (momentum buffer, or Adam's first and second moments).
#[derive(Debug, Clone, PartialEq)]
pub struct Optimizer {
    kind: OptimizerKind,
    hyper: Hyper,
    /// (offset, len, decay) per parameter.
    segments: Vec<(usize, usize, bool)>,
    len: usize,
    /// Momentum buffer (SGD) or first moment (Adam).
    m: Vec<f32>,
    /// Second moment (Adam only; empty for SGD).
    v: Vec<f32>,
    steps: u64,
}

impl Optimizer {
    /// A fresh optimizer for parameters `params` (graph order; their `decay` flags choose where
    /// weight decay applies).
    pub fn new(kind: OptimizerKind, hyper: Hyper, params: &[ParamSpec]) -> Optimizer {
        Self::with_layout(
            kind,
            hyper,
            params,
            &ParamLayout::graph(params, ConvOrder::Torchvision),
        )
    }

    /// A fresh optimizer for parameters laid out as `layout` says in the vectors it steps
    /// (its state follows the same layout; padding between parameters is never touched).
    pub fn with_layout(
        kind: OptimizerKind,
        hyper: Hyper,
        params: &[ParamSpec],
        layout: &ParamLayout,
    ) -> Optimizer {
        let segments: Vec<(usize, usize, bool)> = params
            .iter()
            .enumerate()
            .map(|(i, p)| (layout.range(i).start, p.numel(), p.decay))
            .collect();
        let len = layout.len();
        let v = match kind {
            OptimizerKind::Sgd { .. } => Vec::new(),
            _ => vec![0.0; len],
        };
        Optimizer {
            kind,
            hyper,
            segments,
            len,
            m: vec![0.0; len],
            v,
            steps: 0,
        }
    }

    /// The update rule.
    pub fn kind(&self) -> OptimizerKind {
        self.kind
    }

    /// Hyper-parameters.
    pub fn hyper(&self) -> Hyper {
        self.hyper
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The state: momentum buffer (SGD) or first moment (Adam), second moment (Adam; empty for
    /// SGD), flat in the layout of the parameters it was stepped with (graph order).
    pub fn moments(&self) -> (&[f32], &[f32]) {
        (&self.m, &self.v)
    }

    /// Replaces the state (see [`Optimizer::moments`]) and the step count, e.g. with a device
    /// optimizer's state converted to this layout. `v` must be empty for SGD.
    pub fn set_state(&mut self, m: Vec<f32>, v: Vec<f32>, steps: u64) -> Result<(), OptimError> {
        if m.len() != self.len {
            return Err(OptimError::Length {
                what: "first moment / momentum",
                got: m.len(),
                want: self.len,
            });
        }
        if v.len() != self.v.len() {
            return Err(OptimError::Length {
                what: "second moment",
                got: v.len(),
                want: self.v.len(),
            });
        }
        self.m = m;
        self.v = v;
        self.steps = steps;
        Ok(())
    }

    /// One update of `params` with `grads` (both flat, graph order) at learning rate `lr`.
    pub fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32) -> Result<(), OptimError> {
        if params.len() != self.len {
            return Err(OptimError::Length {
                what: "params",
                got: params.len(),
                want: self.len,
            });
        }
        if grads.len() != self.len {
            return Err(OptimError::Length {
                what: "grads",
                got: grads.len(),
                want: self.len,
            });
        }
        self.steps += 1;
        let h = self.hyper;
        let t = self.steps as i32;
        for &(off, n, decay) in &self.segments {
            let wd = if decay { h.weight_decay } else { 0.0 };
            let p = &mut params[off..off + n];
            let g = &grads[off..off + n];
            let m = &mut self.m[off..off + n];
            match self.kind {
                OptimizerKind::Sgd { momentum, nesterov } => {
                    for i in 0..n {
                        let gi = g[i] + wd * p[i];
                        let d = if momentum != 0.0 {
                            m[i] = momentum * m[i] + gi;
                            if nesterov {
                                gi + momentum * m[i]
                            } else {
                                m[i]
                            }
                        } else {
                            gi
                        };
                        p[i] -= lr * d;
                    }
                }
                OptimizerKind::Adam | OptimizerKind::AdamW => {
                    let v = &mut self.v[off..off + n];
                    let decoupled = self.kind == OptimizerKind::AdamW;
                    // In f64, as PyTorch forms them (and the device optimizer), then f32.
                    let bc1 = (1.0 - f64::from(h.beta1).powi(t)) as f32;
                    let bc2 = (1.0 - f64::from(h.beta2).powi(t)) as f32;
                    for i in 0..n {
                        let gi = if decoupled { g[i] } else { g[i] + wd * p[i] };
                        if decoupled {
                            p[i] *= 1.0 - lr * wd;
                        }
                        m[i] = h.beta1 * m[i] + (1.0 - h.beta1) * gi;
                        v[i] = h.beta2 * v[i] + (1.0 - h.beta2) * gi * gi;
                        let mhat = m[i] / bc1;
                        let vhat = v[i] / bc2;
                        p[i] -= lr * mhat / (vhat.sqrt() + h.eps);
                    }
                }
            }
        }
        Ok(())
    }

    /// The state as safetensors bytes (`m`, and `v` for Adam; kind and step count in the
    /// metadata), for the trainer's checkpoint.
    pub fn to_safetensors_bytes(&self) -> Vec<u8> {
        self.to_safetensors_bytes_with(None)
    }

    /// [`Optimizer::to_safetensors_bytes`] with one more f32 tensor of the trainer's own
    /// (`name`, shape, values), which [`Optimizer::load_safetensors_bytes`] passes over and
    /// [`read_f32_tensor`] reads back: training state that belongs with the optimizer's,
    /// outside the weights file that PyTorch reads.
    pub fn to_safetensors_bytes_with(&self, extra: Option<(&str, &[usize], &[f32])>) -> Vec<u8> {
        let mb: Vec<u8> = self.m.iter().flat_map(|x| x.to_le_bytes()).collect();
        let vb: Vec<u8> = self.v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let eb: Vec<u8> = extra
            .map(|(_, _, values)| values.iter().flat_map(|x| x.to_le_bytes()).collect())
            .unwrap_or_default();
        let mut tensors = vec![(
            "m".to_string(),
            TensorView::new(Dtype::F32, vec![self.len], &mb).expect("length matches shape"),
        )];
        if !self.v.is_empty() {
            tensors.push((
                "v".to_string(),
                TensorView::new(Dtype::F32, vec![self.len], &vb).expect("length matches shape"),
            ));
        }
        if let Some((name, shape, values)) = extra {
            assert_eq!(
                shape.iter().product::<usize>(),
                values.len(),
                "extra tensor {name}: shape and values disagree (programmer error)"
            );
            tensors.push((
                name.to_string(),
                TensorView::new(Dtype::F32, shape.to_vec(), &eb).expect("length matches shape"),
            ));
        }
        let meta = HashMap::from([
            ("optimizer".to_string(), self.kind.name().to_string()),
            ("steps".to_string(), self.steps.to_string()),
        ]);
        let bytes = safetensors::serialize(tensors, Some(meta))
            .expect("in-memory serialisation of f32 vectors");
        with_sorted_header(bytes)
    }

    /// Restores the state saved by [`Optimizer::to_safetensors_bytes`] (`path` only names the
    /// source in errors). The kind and parameter count must match.
    pub fn load_safetensors_bytes(&mut self, bytes: &[u8], path: &Path) -> Result<(), OptimError> {
        let bad = |detail: String| OptimError::BadState {
            path: path.to_path_buf(),
            detail,
        };
        let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| bad(e.to_string()))?;
        let st = SafeTensors::deserialize(bytes).map_err(|e| bad(e.to_string()))?;
        let info = meta.metadata().clone().unwrap_or_default();
        let kind = info.get("optimizer").cloned().unwrap_or_default();
        if kind != self.kind.name() {
            return Err(bad(format!(
                "state is for optimizer '{kind}', this run uses '{}'",
                self.kind.name()
            )));
        }
        let steps: u64 = info
            .get("steps")
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| bad("no step count in metadata".into()))?;
        let read = |name: &str| -> Result<Vec<f32>, OptimError> {
            let t = st
                .tensor(name)
                .map_err(|_| bad(format!("missing tensor '{name}'")))?;
            if t.dtype() != Dtype::F32 || t.shape() != [self.len] {
                return Err(bad(format!(
                    "tensor '{name}' is {:?} {:?}, expected F32 [{}]",
                    t.dtype(),
                    t.shape(),
                    self.len
                )));
            }
            Ok(t.data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect())
        };
        let m = read("m")?;
        let v = if self.v.is_empty() {
            Vec::new()
        } else {
            read("v")?
        };
        self.m = m;
        self.v = v;
        self.steps = steps;
        Ok(())
    }

    /// Writes the state to a file (temporary name, then rename).
    pub fn save(&self, path: &Path) -> Result<(), OptimError> {
        let io = |source| OptimError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut name = path.file_name().unwrap_or_default().to_os_string();
        name.push(format!(".tmp{}", std::process::id()));
        let tmp = path.with_file_name(name);
        std::fs::write(&tmp, self.to_safetensors_bytes()).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// Reads a state file written by [`Optimizer::save`].
    pub fn load(&mut self, path: &Path) -> Result<(), OptimError> {
        let bytes = std::fs::read(path).map_err(|source| OptimError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        self.load_safetensors_bytes(&bytes, path)
    }
}

/// The f32 tensor `name` of a safetensors file (shape, values), or `None` when the file has
/// no such tensor of that type or does not parse (the caller then goes on without it).
pub fn read_f32_tensor(bytes: &[u8], name: &str) -> Option<(Vec<usize>, Vec<f32>)> {
    let st = SafeTensors::deserialize(bytes).ok()?;
    let t = st.tensor(name).ok()?;
    if t.dtype() != Dtype::F32 {
        return None;
    }
    let values = t
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Some((t.shape().to_vec(), values))
}

/// safetensors writes its `__metadata__` from a `HashMap`, whose order changes from process to
/// process; rewriting the JSON header with sorted keys makes identical states give identical
/// files (a resumed run's checkpoint compares equal byte for byte). The header keeps its
/// length, so the tensor offsets stay valid.
fn with_sorted_header(mut bytes: Vec<u8>) -> Vec<u8> {
    use serde_json::{Map, Value};
    fn sorted(v: Value) -> Value {
        match v {
            Value::Object(m) => {
                let mut entries: Vec<(String, Value)> = m.into_iter().collect();
                entries.sort_by(|a, b| a.0.cmp(&b.0));
                Value::Object(
                    entries
                        .into_iter()
                        .map(|(k, v)| (k, sorted(v)))
                        .collect::<Map<_, _>>(),
                )
            }
            other => other,
        }
    }
    let Some(len) = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
    else {
        return bytes;
    };
    let Some(header) = bytes.get(8..8 + len) else {
        return bytes;
    };
    let Ok(parsed) = serde_json::from_slice::<Value>(header) else {
        return bytes;
    };
    let Ok(mut canonical) = serde_json::to_vec(&sorted(parsed)) else {
        return bytes;
    };
    if canonical.len() > len {
        return bytes;
    }
    // safetensors pads headers with spaces; same content, so normally the same length.
    canonical.resize(len, b' ');
    bytes[8..8 + len].copy_from_slice(&canonical);
    bytes
}
