//! Host copy of a model's parameters and buffers, and its safetensors form.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use super::graph::{BufferKind, Graph, Node, ParamKind};
use super::init::{init_buffer, init_param};
use super::ModelError;

/// What to do when a file's classifier (`fc.weight`/`fc.bias`) does not match the graph's
/// class count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadPolicy {
    /// Refuse: a clear error naming the tensor (resuming, evaluating).
    Strict,
    /// Fine-tuning: initialise a fresh head from `seed` (torchvision's `nn.Linear` init) and
    /// keep every other tensor from the file.
    ReplaceMismatched {
        /// Seed for the new head.
        seed: u64,
    },
}

/// f32 host copy of all parameters and buffers, in torchvision layout and `state_dict` order
/// (`params[i]` matches `graph.params()[i]`, `buffers[j]` matches `graph.buffers()[j]`).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelState {
    /// Parameter values, torchvision layout (OIHW convolutions).
    pub params: Vec<Vec<f32>>,
    /// Buffer values (`num_batches_tracked` as an f32 scalar).
    pub buffers: Vec<Vec<f32>>,
}

fn linear_fan_in(graph: &Graph) -> usize {
    graph
        .params()
        .iter()
        .find(|p| p.kind == ParamKind::LinearWeight)
        .map_or(1, |p| p.shape[1])
}

impl ModelState {
    /// torchvision's initialisation: convolutions kaiming-normal (fan_out, ReLU), BN γ=1 β=0,
    /// classifier `nn.Linear` default; running mean 0, var 1. Deterministic in `seed`.
    pub fn init(graph: &Graph, seed: u64) -> ModelState {
        let fan_in = linear_fan_in(graph);
        ModelState {
            params: graph
                .params()
                .iter()
                .map(|p| init_param(p, seed, fan_in))
                .collect(),
            buffers: graph.buffers().iter().map(init_buffer).collect(),
        }
    }

    /// torchvision's `zero_init_residual`: the γ of every batch norm whose output is added to
    /// a shortcut (`bn3` of a bottleneck, `bn2` of a basic block) set to 0, so each residual
    /// block starts as the identity (Goyal et al., "Accurate, Large Minibatch SGD", 2017).
    pub fn zero_residual_gammas(&mut self, graph: &Graph) {
        for node in graph.nodes() {
            if let Node::BatchNorm {
                residual: Some(_),
                weight,
                ..
            } = node
            {
                self.params[*weight].fill(0.0);
            }
        }
    }

    /// Checks every tensor's length against the graph.
    pub fn validate(&self, graph: &Graph) -> Result<(), ModelError> {
        if self.params.len() != graph.params().len() || self.buffers.len() != graph.buffers().len()
        {
            return Err(ModelError::StateMismatch(format!(
                "{} params / {} buffers, {} {} needs {} / {}",
                self.params.len(),
                self.buffers.len(),
                graph.arch(),
                graph.num_classes(),
                graph.params().len(),
                graph.buffers().len()
            )));
        }
        for (v, p) in self.params.iter().zip(graph.params()) {
            if v.len() != p.numel() {
                return Err(ModelError::StateMismatch(format!(
                    "'{}' has {} values, needs {}",
                    p.name,
                    v.len(),
                    p.numel()
                )));
            }
        }
        for (v, b) in self.buffers.iter().zip(graph.buffers()) {
            if v.len() != b.numel() {
                return Err(ModelError::StateMismatch(format!(
                    "'{}' has {} values, needs {}",
                    b.name,
                    v.len(),
                    b.numel()
                )));
            }
        }
        Ok(())
    }

    /// All parameters concatenated in graph order.
    pub fn flat_params(&self) -> Vec<f32> {
        self.params.concat()
    }

    /// Replaces all parameters from a flat vector in graph order.
    pub fn set_flat_params(&mut self, flat: &[f32]) -> Result<(), ModelError> {
        let total: usize = self.params.iter().map(Vec::len).sum();
        if flat.len() != total {
            return Err(ModelError::StateMismatch(format!(
                "flat vector has {} values, the model {}",
                flat.len(),
                total
            )));
        }
        let mut off = 0;
        for p in &mut self.params {
            let n = p.len();
            p.copy_from_slice(&flat[off..off + n]);
            off += n;
        }
        Ok(())
    }

    /// Serialises to safetensors bytes: parameters and running statistics as F32 with
    /// torchvision names and shapes, `num_batches_tracked` as I64 scalars (as torch saves them),
    /// plus optional string metadata.
    pub fn to_safetensors_bytes(
        &self,
        graph: &Graph,
        metadata: Option<HashMap<String, String>>,
    ) -> Result<Vec<u8>, ModelError> {
        self.validate(graph)?;
        let mut blobs: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        for (v, p) in self.params.iter().zip(graph.params()) {
            blobs.push((p.name.clone(), Dtype::F32, p.shape.clone(), f32_bytes(v)));
        }
        for (v, b) in self.buffers.iter().zip(graph.buffers()) {
            if b.kind == BufferKind::NumBatchesTracked {
                let bytes = (v[0] as i64).to_le_bytes().to_vec();
                blobs.push((b.name.clone(), Dtype::I64, vec![], bytes));
            } else {
                blobs.push((b.name.clone(), Dtype::F32, b.shape.clone(), f32_bytes(v)));
            }
        }
        let views = blobs
            .iter()
            .map(|(name, dtype, shape, bytes)| {
                TensorView::new(*dtype, shape.clone(), bytes).map(|t| (name.clone(), t))
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|source| ModelError::Safetensors {
                path: "<memory>".into(),
                source,
            })?;
        safetensors::serialize(views, metadata).map_err(|source| ModelError::Safetensors {
            path: "<memory>".into(),
            source,
        })
    }

    /// Writes a safetensors file atomically (temporary file in the same folder, then rename).
    pub fn save_safetensors(&self, graph: &Graph, path: &Path) -> Result<(), ModelError> {
        let bytes = self.to_safetensors_bytes(graph, None)?;
        write_atomic(path, &bytes)
    }

    /// Reads a safetensors file written by [`ModelState::save_safetensors`] or by PyTorch
    /// (`safetensors.torch.save_file(model.state_dict(), …)`; F32, F16, BF16 or F64 tensors).
    /// Extra tensors in the file are ignored; a missing `num_batches_tracked` reads as 0; a
    /// tensor holding NaN or an infinity is refused, naming it.
    pub fn load_safetensors(
        graph: &Graph,
        path: &Path,
        head: HeadPolicy,
    ) -> Result<ModelState, ModelError> {
        Self::load_with_head(graph, path, head).map(|(state, _)| state)
    }

    /// [`ModelState::load_safetensors`], also saying what became of the class head: with
    /// [`HeadPolicy::ReplaceMismatched`], a head of another class count, or none at all (a
    /// backbone-only file), is initialised afresh, and the returned [`NewHead`] says so.
    pub fn load_with_head(
        graph: &Graph,
        path: &Path,
        head: HeadPolicy,
    ) -> Result<(ModelState, Option<NewHead>), ModelError> {
        let bytes = std::fs::read(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(graph, &bytes, path, head)
    }

    /// Parses safetensors bytes (`path` is only used in error messages).
    pub fn from_safetensors_bytes(
        graph: &Graph,
        bytes: &[u8],
        path: &Path,
        head: HeadPolicy,
    ) -> Result<ModelState, ModelError> {
        Self::parse(graph, bytes, path, head).map(|(state, _)| state)
    }

    fn parse(
        graph: &Graph,
        bytes: &[u8],
        path: &Path,
        head: HeadPolicy,
    ) -> Result<(ModelState, Option<NewHead>), ModelError> {
        let st = SafeTensors::deserialize(bytes).map_err(|source| ModelError::Safetensors {
            path: path.to_path_buf(),
            source,
        })?;
        let fan_in = linear_fan_in(graph);
        let missing = |name: &str| ModelError::MissingTensor {
            path: path.to_path_buf(),
            name: name.to_string(),
            arch: graph.arch().to_string(),
        };
        let mut new_head: Option<NewHead> = None;
        let mut params = Vec::with_capacity(graph.params().len());
        for spec in graph.params() {
            let is_head = matches!(spec.kind, ParamKind::LinearWeight | ParamKind::LinearBias);
            let fresh_head = match head {
                HeadPolicy::ReplaceMismatched { seed } if is_head => Some(seed),
                _ => None,
            };
            let view = match (st.tensor(&spec.name), fresh_head) {
                (Ok(view), _) => view,
                (Err(_), Some(seed)) => {
                    // A backbone-only file: the classifier starts afresh.
                    new_head
                        .get_or_insert_with(|| NewHead::empty(graph))
                        .tensors
                        .push(spec.name.clone());
                    params.push(init_param(spec, seed, fan_in));
                    continue;
                }
                (Err(_), None) => return Err(missing(&spec.name)),
            };
            if view.shape() != spec.shape.as_slice() {
                if let Some(seed) = fresh_head {
                    let note = new_head.get_or_insert_with(|| NewHead::empty(graph));
                    note.tensors.push(spec.name.clone());
                    if spec.kind == ParamKind::LinearWeight {
                        note.file_classes = view.shape().first().copied();
                    }
                    params.push(init_param(spec, seed, fan_in));
                    continue;
                }
                let hint = if is_head {
                    ", hint: the class count differs; fine-tune with a fresh head (--init-from)"
                } else {
                    ", hint: the file is from another model"
                };
                return Err(ModelError::TensorMismatch {
                    path: path.to_path_buf(),
                    name: spec.name.clone(),
                    expected: format!("{:?}", spec.shape),
                    got: format!("{:?}", view.shape()),
                    hint: hint.to_string(),
                });
            }
            params.push(finite(to_f32(&view, &spec.name, path)?, &spec.name, path)?);
        }
        let mut buffers = Vec::with_capacity(graph.buffers().len());
        for spec in graph.buffers() {
            let view = match st.tensor(&spec.name) {
                Ok(v) => v,
                Err(_) if spec.kind == BufferKind::NumBatchesTracked => {
                    buffers.push(vec![0.0]);
                    continue;
                }
                Err(_) => return Err(missing(&spec.name)),
            };
            if view.shape().iter().product::<usize>() != spec.numel() {
                return Err(ModelError::TensorMismatch {
                    path: path.to_path_buf(),
                    name: spec.name.clone(),
                    expected: format!("{:?}", spec.shape),
                    got: format!("{:?}", view.shape()),
                    hint: ", hint: the file is from another model".to_string(),
                });
            }
            buffers.push(finite(to_f32(&view, &spec.name, path)?, &spec.name, path)?);
        }
        Ok((ModelState { params, buffers }, new_head))
    }
}

/// A class head initialised afresh by [`ModelState::load_with_head`] (fine-tuning).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewHead {
    /// The head tensors initialised afresh (`fc.weight`, `fc.bias`).
    pub tensors: Vec<String>,
    /// The file's class count, when it has a head of another size; `None`: it has none.
    pub file_classes: Option<usize>,
    /// The model's class count.
    pub classes: usize,
}

impl NewHead {
    fn empty(graph: &Graph) -> Self {
        Self {
            tensors: Vec::new(),
            file_classes: None,
            classes: graph.num_classes(),
        }
    }

    /// What happened, in words: "a new class head (fc.weight, fc.bias) for 3 classes: the
    /// file's is for 1000".
    pub fn describe(&self) -> String {
        let why = match self.file_classes {
            Some(n) => format!("the file's is for {n} classes"),
            None => "the file has none (backbone only)".into(),
        };
        format!(
            "a new class head ({}) for {} classes, initialised from the seed: {why}",
            self.tensors.join(", "),
            self.classes
        )
    }
}

/// `values` when every one is finite, else the error naming the tensor and the file.
fn finite(values: Vec<f32>, name: &str, path: &Path) -> Result<Vec<f32>, ModelError> {
    match values.iter().position(|v| !v.is_finite()) {
        None => Ok(values),
        Some(at) => Err(ModelError::NonFinite {
            path: path.to_path_buf(),
            name: name.to_string(),
            value: values[at],
            index: at,
        }),
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Converts a tensor of any float or int64 dtype to f32.
fn to_f32(view: &TensorView<'_>, name: &str, path: &Path) -> Result<Vec<f32>, ModelError> {
    let d = view.data();
    let out = match view.dtype() {
        Dtype::F32 => d
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F64 => d
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().expect("chunk of 8")) as f32)
            .collect(),
        Dtype::F16 => d
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::BF16 => d
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::I64 => d
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("chunk of 8")) as f32)
            .collect(),
        other => {
            return Err(ModelError::TensorMismatch {
                path: path.to_path_buf(),
                name: name.to_string(),
                expected: "F32, F16, BF16, F64 or I64".to_string(),
                got: format!("{other:?}"),
                hint: String::new(),
            })
        }
    };
    Ok(out)
}

/// Writes `bytes` to a temporary file beside `path`, syncs it, then renames it over `path`, so
/// a reader never sees a half-written file.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ModelError> {
    use std::io::Write;
    let io = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp{}", std::process::id()));
    let tmp = path.with_file_name(name);
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(e));
    }
    Ok(())
}
