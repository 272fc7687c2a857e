//! Scaling arithmetic: what data parallelism costs per step and how much of it backward hides.
//!
//! For N GPUs each all-reducing B bytes with a ring, every GPU sends and receives
//! 2(N−1)/N · B bytes, so at bus bandwidth `busbw` (the figure nccl-tests reports) one
//! all-reduce takes
//!
//! ```text
//! t(B) = latency + 2(N−1)/N · B / busbw
//! ```
//!
//! Gradients are reduced in buckets as backward produces them. Backward of length T_b walks the
//! parameters in reverse; parameter i's gradient is ready once the backward work of every
//! parameter after it (and its own) is done, so with per-parameter backward weights w
//! (`share_i = w_i / Σw`) bucket k is ready at `r_k = T_b · Σ shares of its and all later
//! parameters`. The communication stream runs one bucket at a time:
//!
//! ```text
//! start_k = max(r_k, end_{k−1}),  end_k = start_k + t(B_k)
//! exposed = max(0, end_last − T_b)     hidden = Σ t(B_k) − exposed
//! step_N  = step_1 + exposed           efficiency = step_1 / step_N
//! ```
//!
//! (Each GPU keeps its per-GPU batch, so images/s scale by N · efficiency.) The last bucket
//! can never hide: it is ready only when backward ends, which is why buckets are small
//! compared with the model.

use super::buckets::BucketPlan;

/// Errors of the projection inputs.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ScalingError {
    /// A time, share or bandwidth out of range.
    #[error("invalid {what} = {value}: {hint}")]
    Invalid {
        /// Which input.
        what: &'static str,
        /// Its value.
        value: f64,
        /// The valid range.
        hint: &'static str,
    },
    /// Weights do not match the plan.
    #[error("{got} backward weights for a plan of {expected} parameters")]
    WeightCount {
        /// Parameters in the plan.
        expected: usize,
        /// Weights given.
        got: usize,
    },
}

/// An interconnect, by its all-reduce bus bandwidth.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Interconnect {
    /// Display name.
    pub name: &'static str,
    /// All-reduce bus bandwidth in bytes per second (nccl-tests "busbw").
    pub bus_bytes_per_s: f64,
    /// Fixed cost per all-reduce in seconds.
    pub latency_s: f64,
}

/// NVLink/NVSwitch class nodes (H100 SXM: ~370 GB/s all-reduce bus bandwidth in nccl-tests).
pub const NVLINK: Interconnect = Interconnect {
    name: "NVLink",
    bus_bytes_per_s: 370e9,
    latency_s: 10e-6,
};

/// GPUs over PCIe without NVLink (~25 GB/s bus bandwidth).
pub const PCIE: Interconnect = Interconnect {
    name: "PCIe",
    bus_bytes_per_s: 25e9,
    latency_s: 20e-6,
};

/// Ring all-reduce time of `bytes` over `gpus` ranks, in seconds (0 for one GPU).
pub fn ring_allreduce_s(gpus: usize, bytes: f64, link: &Interconnect) -> f64 {
    if gpus <= 1 {
        return 0.0;
    }
    let n = gpus as f64;
    link.latency_s + 2.0 * (n - 1.0) / n * bytes / link.bus_bytes_per_s
}

/// The measured (or given) single-GPU step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepProfile {
    /// Single-GPU step time in seconds (forward + backward + optimizer).
    pub step_s: f64,
    /// Fraction of the step spent in backward (the window communication can hide in).
    pub backward_share: f64,
    /// Images per GPU per step.
    pub batch_per_gpu: usize,
}

/// The projection for one GPU count and interconnect.
#[derive(Debug, Clone, PartialEq)]
pub struct Projection {
    /// GPU count.
    pub gpus: usize,
    /// Interconnect name.
    pub link: &'static str,
    /// Total all-reduce time of one step, in seconds.
    pub comm_s: f64,
    /// Part of it overlapped with backward.
    pub hidden_s: f64,
    /// Part of it that lengthens the step.
    pub exposed_s: f64,
    /// Projected step time.
    pub step_s: f64,
    /// step_1 / step_N.
    pub efficiency: f64,
    /// Projected throughput over all GPUs.
    pub images_per_s: f64,
}

fn check(what: &'static str, value: f64, ok: bool, hint: &'static str) -> Result<(), ScalingError> {
    if ok && value.is_finite() {
        Ok(())
    } else {
        Err(ScalingError::Invalid { what, value, hint })
    }
}

/// Projects one step on `gpus` GPUs over `link` for gradients bucketed by `plan`.
///
/// `backward_weights[i]` is parameter i's (forward order) share of backward time, in any unit
/// (FLOPs, or element counts when nothing better is known).
pub fn project(
    plan: &BucketPlan,
    backward_weights: &[f64],
    profile: &StepProfile,
    gpus: usize,
    link: &Interconnect,
) -> Result<Projection, ScalingError> {
    check(
        "step time (s)",
        profile.step_s,
        profile.step_s > 0.0,
        "must be positive",
    )?;
    check(
        "backward share",
        profile.backward_share,
        (0.0..=1.0).contains(&profile.backward_share),
        "must be within 0..=1",
    )?;
    check(
        "bus bandwidth (bytes/s)",
        link.bus_bytes_per_s,
        link.bus_bytes_per_s > 0.0,
        "must be positive",
    )?;
    check(
        "latency (s)",
        link.latency_s,
        link.latency_s >= 0.0,
        "must be >= 0",
    )?;
    check("GPU count", gpus as f64, gpus >= 1, "at least 1")?;
    if backward_weights.len() != plan.param_count() {
        return Err(ScalingError::WeightCount {
            expected: plan.param_count(),
            got: backward_weights.len(),
        });
    }
    for &w in backward_weights {
        check("backward weight", w, w >= 0.0, "must be >= 0")?;
    }
    let total_w: f64 = backward_weights.iter().sum();
    let backward_s = profile.step_s * profile.backward_share;

    let mut done_w = 0.0;
    let mut comm_end = 0.0f64;
    let mut comm_s = 0.0;
    for bucket in plan.buckets() {
        done_w += bucket
            .params
            .iter()
            .map(|&i| backward_weights[i])
            .sum::<f64>();
        let ready = if total_w > 0.0 {
            backward_s * (done_w / total_w)
        } else {
            backward_s
        };
        let t = ring_allreduce_s(gpus, bucket.len_bytes as f64, link);
        comm_s += t;
        comm_end = comm_end.max(ready) + t;
    }
    let exposed_s = if gpus > 1 {
        (comm_end - backward_s).max(0.0)
    } else {
        0.0
    };
    let step_s = profile.step_s + exposed_s;
    let efficiency = profile.step_s / step_s;
    Ok(Projection {
        gpus,
        link: link.name,
        comm_s,
        hidden_s: comm_s - exposed_s,
        exposed_s,
        step_s,
        efficiency,
        images_per_s: (gpus * profile.batch_per_gpu) as f64 / step_s,
    })
}

/// A model's gradients as the projection needs them.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelCost {
    /// Gradient sizes, forward order.
    pub params: Vec<super::buckets::ParamSpec>,
    /// Per parameter (forward order): its share of backward work, in FLOPs per image.
    pub backward_weights: Vec<f64>,
}

impl ModelCost {
    /// Gradient sizes (`element_bytes` per element) and backward weights of `graph` at
    /// `image_size`.
    ///
    /// Backward work per layer is taken proportional to its forward FLOPs (a convolution's
    /// backward is two convolutions of the same size, the data and the weight gradient); batch
    /// norm is elementwise (about 8 FLOPs per output element, split over γ and β).
    pub fn from_graph(graph: &crate::model::Graph, image_size: u32, element_bytes: usize) -> Self {
        use crate::model::Node;
        let dims = graph.value_dims(image_size);
        let mut weights = vec![0.0; graph.params().len()];
        for node in graph.nodes() {
            match *node {
                Node::Conv { weight, .. } => {
                    weights[weight] += graph.conv_shape(node, &dims, 1).map_or(0.0, |s| s.flops());
                }
                Node::BatchNorm {
                    weight,
                    bias,
                    output,
                    ..
                } => {
                    let elements = dims[output].per_image() as f64;
                    weights[weight] += 4.0 * elements;
                    weights[bias] += 4.0 * elements;
                }
                Node::Linear {
                    weight,
                    bias,
                    inputs,
                    outputs,
                    ..
                } => {
                    weights[weight] += 2.0 * (inputs * outputs) as f64;
                    weights[bias] += outputs as f64;
                }
                Node::MaxPool { .. } | Node::GlobalAvgPool { .. } => {}
            }
        }
        ModelCost {
            params: graph
                .params()
                .iter()
                .map(|p| super::buckets::ParamSpec {
                    name: p.name.clone(),
                    bytes: p.numel() * element_bytes,
                })
                .collect(),
            backward_weights: weights,
        }
    }

    /// Gradient bytes per step (what one rank all-reduces, padding excluded).
    pub fn gradient_bytes(&self) -> usize {
        self.params.iter().map(|p| p.bytes).sum()
    }
}
