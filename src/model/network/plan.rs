//! What a [`Network`](super::Network) computes at each node and where each value's gradient
//! lives, derived once from the graph when the network is built: every node's shape (read by
//! forward and backward), the shared activation-gradient buffers and the memory they take.

use crate::backend::{BnShape, ConvShape, LinearShape, PoolShape};
use crate::model::bn_fusion::FusionPlan;
use crate::model::graph::{Graph, Node, ValueDims};

/// A network's plan: node shapes for one image, gradient buffers and the batch-norm fusion.
#[derive(Debug, Clone)]
pub(super) struct Plan {
    /// Per-image dimensions of every value (the input image first, the logits last).
    pub(super) dims: Vec<ValueDims>,
    /// Each node's shape for one image (the accessors below scale it to a batch).
    shapes: Vec<NodeShape>,
    /// Buffer of each value's gradient (`usize::MAX` for the input image, which needs none).
    pub(super) grad_slot: Vec<usize>,
    /// Each gradient buffer's size per image.
    pub(super) grad_sizes: Vec<usize>,
    /// Which batch-norm work the convolutions take ([`FusionPlan::none`] unless the backend
    /// fuses).
    pub(super) fusion: FusionPlan,
}

/// One node's shape for one image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NodeShape {
    Conv(ConvShape),
    BatchNorm { pixels: usize, channels: usize },
    MaxPool(PoolShape),
    GlobalAvgPool(GapShape),
    Linear(LinearShape),
}

/// A global average pool's input: `pixels` values per channel map, `channels` maps per image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct GapShape {
    /// Pixels of one channel map (h·w).
    pub(super) pixels: usize,
    /// Channels.
    pub(super) channels: usize,
}

impl Plan {
    /// The plan of `graph` at images of side `image_size` with `fusion`.
    pub(super) fn new(graph: &Graph, image_size: u32, fusion: FusionPlan) -> Plan {
        let dims = graph.value_dims(image_size);
        let shapes = graph
            .nodes()
            .iter()
            .map(|node| node_shape(graph, node, &dims))
            .collect();
        let (grad_slot, grad_sizes) = plan_grad_buffers(graph, &dims, &fusion);
        Plan {
            dims,
            shapes,
            grad_slot,
            grad_sizes,
            fusion,
        }
    }

    /// Value → whether it is never stored: the output of a batch norm that a max pool applies
    /// itself ([`FusionPlan::unstored`]).
    pub(super) fn unstored_values(&self, graph: &Graph) -> Vec<bool> {
        let mut unstored = vec![false; self.dims.len()];
        for (k, node) in graph.nodes().iter().enumerate() {
            if let (Node::BatchNorm { output, .. }, true) = (node, self.fusion.unstored[k]) {
                unstored[*output] = true;
            }
        }
        unstored
    }

    /// The value holding the logits (the graph's last).
    pub(super) fn logits(&self) -> usize {
        self.dims.len() - 1
    }

    /// Convolution node `k` over `n` images.
    pub(super) fn conv(&self, k: usize, n: usize) -> ConvShape {
        match self.shapes[k] {
            NodeShape::Conv(s) => ConvShape { n, ..s },
            other => unreachable!("node {k} is no convolution: {other:?}"),
        }
    }

    /// Batch-norm node `k` over `n` images.
    pub(super) fn bn(&self, k: usize, n: usize) -> BnShape {
        match self.shapes[k] {
            NodeShape::BatchNorm { pixels, channels } => BnShape {
                rows: n * pixels,
                channels,
            },
            other => unreachable!("node {k} is no batch norm: {other:?}"),
        }
    }

    /// Max-pool node `k` over `n` images.
    pub(super) fn max_pool(&self, k: usize, n: usize) -> PoolShape {
        match self.shapes[k] {
            NodeShape::MaxPool(s) => PoolShape { n, ..s },
            other => unreachable!("node {k} is no max pool: {other:?}"),
        }
    }

    /// Global-average-pool node `k` (per image; the op takes the image count apart).
    pub(super) fn gap(&self, k: usize) -> GapShape {
        match self.shapes[k] {
            NodeShape::GlobalAvgPool(s) => s,
            other => unreachable!("node {k} is no global average pool: {other:?}"),
        }
    }

    /// Linear node `k` over `n` images.
    pub(super) fn linear(&self, k: usize, n: usize) -> LinearShape {
        match self.shapes[k] {
            NodeShape::Linear(s) => LinearShape { n, ..s },
            other => unreachable!("node {k} is no linear layer: {other:?}"),
        }
    }
}

/// `node`'s shape for one image, its input's dimensions read from `dims`.
fn node_shape(graph: &Graph, node: &Node, dims: &[ValueDims]) -> NodeShape {
    match *node {
        Node::Conv { .. } => NodeShape::Conv(graph.conv_shape(node, dims, 1).expect("conv node")),
        Node::BatchNorm {
            input, channels, ..
        } => NodeShape::BatchNorm {
            pixels: dims[input].h * dims[input].w,
            channels,
        },
        Node::MaxPool {
            input,
            kernel,
            stride,
            padding,
            ..
        } => {
            let d = dims[input];
            NodeShape::MaxPool(PoolShape {
                n: 1,
                h: d.h,
                w: d.w,
                c: d.c,
                kernel,
                stride,
                padding,
            })
        }
        Node::GlobalAvgPool { input, .. } => NodeShape::GlobalAvgPool(GapShape {
            pixels: dims[input].h * dims[input].w,
            channels: dims[input].c,
        }),
        Node::Linear {
            inputs, outputs, ..
        } => NodeShape::Linear(LinearShape {
            n: 1,
            inputs,
            outputs,
        }),
    }
}

/// The values a node's backward writes gradients into (its input unless that is the image,
/// and its residual), and the value whose gradient it consumes.
fn grad_flow(node: &Node) -> (Vec<usize>, usize) {
    let (input, output, residual) = match *node {
        Node::Conv { input, output, .. }
        | Node::MaxPool { input, output, .. }
        | Node::GlobalAvgPool { input, output }
        | Node::Linear { input, output, .. } => (input, output, None),
        Node::BatchNorm {
            input,
            output,
            residual,
            ..
        } => (input, output, residual),
    };
    let writes = [Some(input), residual]
        .into_iter()
        .flatten()
        .filter(|&v| v != 0)
        .collect();
    (writes, output)
}

/// Assigns activation gradients to shared buffers. In the reverse pass a value's gradient is
/// live from the first contribution (at its last consumer) until its producer has consumed
/// it, so a ResNet needs only a few buffers at a time instead of one per value (about half
/// the activation memory). Returns each value's buffer and each buffer's per-image size.
///
/// With a [`FusionPlan`], a batch norm whose residual gradient stays in place writes no
/// residual gradient, and its output's gradient lives on until the convolution that reads it
/// as `residual_grad` (its residual's first reader) has run.
fn plan_grad_buffers(
    graph: &Graph,
    dims: &[ValueDims],
    fusion: &FusionPlan,
) -> (Vec<usize>, Vec<usize>) {
    let mut slot = vec![usize::MAX; dims.len()];
    let mut sizes: Vec<usize> = Vec::new();
    let mut free: Vec<usize> = Vec::new();
    let mut assign = |v: usize, slot: &mut Vec<usize>, free: &mut Vec<usize>| {
        if slot[v] != usize::MAX {
            return;
        }
        let need = dims[v].per_image();
        // Best fit among free buffers; else grow the largest free one; else a new buffer.
        let pick = free
            .iter()
            .enumerate()
            .filter(|(_, &b)| sizes[b] >= need)
            .min_by_key(|(_, &b)| sizes[b])
            .or_else(|| free.iter().enumerate().max_by_key(|(_, &b)| sizes[b]))
            .map(|(i, _)| i);
        let b = match pick {
            Some(i) => free.swap_remove(i),
            None => {
                sizes.push(0);
                sizes.len() - 1
            }
        };
        sizes[b] = sizes[b].max(need);
        slot[v] = b;
    };
    assign(dims.len() - 1, &mut slot, &mut free);
    for (k, node) in graph.nodes().iter().enumerate().rev() {
        let (mut writes, consumed) = grad_flow(node);
        if fusion.residual_in_place[k] {
            if let Node::BatchNorm {
                residual: Some(r), ..
            } = *node
            {
                writes.retain(|&v| v != r);
            }
        }
        for v in writes {
            assign(v, &mut slot, &mut free);
        }
        // In place: the consumer of the residual frees it (below).
        if !fusion.residual_in_place[k] {
            free.push(slot[consumed]);
        }
        if let Some(v) = fusion.residual_from[k] {
            free.push(slot[v]);
        }
    }
    (slot, sizes)
}

/// The elements a [`Network`](super::Network) allocates (see
/// [`Network::new`](super::Network::new)), from the same buffer plan it
/// uses: for memory estimates that match what is really allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferPlan {
    /// Activations, per image (every value of the graph, the input included).
    pub activations_per_image: usize,
    /// Activation gradients, per image: the shared buffers of the reverse pass, far fewer
    /// than one per value (see [`Network`](super::Network)).
    pub activation_grads_per_image: usize,
    /// Parameters (and as many parameter gradients).
    pub params: usize,
    /// Buffers (batch-norm running statistics and counters).
    pub buffers: usize,
    /// Saved batch mean and inverse std of every BN layer, its moments where the backend
    /// fuses batch norm into the convolutions, and the synchronised-BN scratch.
    pub statistics: usize,
    /// Elements per image of the outputs a backend may keep packed signs beside
    /// ([`Backend::keep_relu_signs`](crate::backend::Backend::keep_relu_signs)): a bit each.
    pub residual_relu_outputs_per_image: usize,
}

/// The [`BufferPlan`] of `graph` at images of side `image_size`: the larger of the unfused
/// and the fused network's (a backend decides which runs).
pub fn buffer_plan(graph: &Graph, image_size: u32) -> BufferPlan {
    let dims = graph.value_dims(image_size);
    let grads =
        |fusion: &FusionPlan| -> usize { plan_grad_buffers(graph, &dims, fusion).1.iter().sum() };
    let fused = FusionPlan::of(graph);
    let activation_grads_per_image = grads(&FusionPlan::none(graph)).max(grads(&fused));
    let channels: Vec<usize> = graph
        .nodes()
        .iter()
        .filter_map(|node| match node {
            Node::BatchNorm { channels, .. } => Some(*channels),
            _ => None,
        })
        .collect();
    let widest = channels.iter().copied().max().unwrap_or(1);
    let residual_relu_outputs_per_image = fused
        .residual_relu_outputs(graph)
        .iter()
        .zip(&dims)
        .filter(|(marked, _)| **marked)
        .map(|(_, d)| d.per_image())
        .sum();
    BufferPlan {
        activations_per_image: dims.iter().map(|d| d.per_image()).sum(),
        activation_grads_per_image,
        params: graph.param_count(),
        buffers: graph.buffers().iter().map(|b| b.numel()).sum(),
        // saved mean and invstd, the fused path's moments, the synchronised-BN scratch
        statistics: (2 + 3) * channels.iter().sum::<usize>() + 2 * widest,
        residual_relu_outputs_per_image,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Arch;

    /// Replays the reverse pass's gradient reads and writes against the buffer plan of
    /// `graph` with `fusion`: every gradient read must still be in its buffer, and no write
    /// may land in a buffer that holds another live gradient.
    fn replay(graph: &Graph, fusion: &FusionPlan) {
        let dims = graph.value_dims(32);
        let (slot, sizes) = plan_grad_buffers(graph, &dims, fusion);
        let nodes = graph.nodes();
        let logits = dims.len() - 1;
        // The node (in reverse order: the last to run) that reads each gradient last.
        let mut last_read = vec![usize::MAX; dims.len()];
        let reads_of = |k: usize| -> Vec<usize> {
            let (_, consumed) = grad_flow(&nodes[k]);
            [Some(consumed), fusion.residual_from[k]]
                .into_iter()
                .flatten()
                .collect()
        };
        for k in 0..nodes.len() {
            for v in reads_of(k) {
                last_read[v] = last_read[v].min(k);
            }
        }
        let mut owner: Vec<Option<usize>> = vec![None; sizes.len()];
        owner[slot[logits]] = Some(logits);
        for k in (0..nodes.len()).rev() {
            let reads = reads_of(k);
            for &v in &reads {
                assert_eq!(
                    owner[slot[v]],
                    Some(v),
                    "node {k} reads {v}'s gradient from a buffer holding another"
                );
            }
            let (mut writes, _) = grad_flow(&nodes[k]);
            if fusion.residual_in_place[k] {
                if let Node::BatchNorm {
                    residual: Some(r), ..
                } = nodes[k]
                {
                    writes.retain(|&v| v != r);
                }
            }
            for v in writes {
                assert!(
                    owner[slot[v]].is_none() || owner[slot[v]] == Some(v),
                    "node {k} writes {v}'s gradient over {:?}'s",
                    owner[slot[v]]
                );
                owner[slot[v]] = Some(v);
            }
            for v in reads {
                if last_read[v] == k {
                    owner[slot[v]] = None;
                }
            }
        }
    }

    #[test]
    fn node_shapes_scale_to_the_batch_as_the_graph_derives_them() {
        for arch in [Arch::ResNet8, Arch::ResNet18, Arch::ResNet50] {
            let graph = Graph::new(arch, 10);
            let plan = Plan::new(&graph, 64, FusionPlan::none(&graph));
            let dims = graph.value_dims(64);
            let n = 3;
            for (k, node) in graph.nodes().iter().enumerate() {
                match *node {
                    Node::Conv { .. } => {
                        assert_eq!(Some(plan.conv(k, n)), graph.conv_shape(node, &dims, n))
                    }
                    Node::BatchNorm {
                        input, channels, ..
                    } => {
                        let s = plan.bn(k, n);
                        assert_eq!(s.rows, n * dims[input].h * dims[input].w);
                        assert_eq!(s.channels, channels);
                    }
                    Node::MaxPool { input, output, .. } => {
                        let s = plan.max_pool(k, n);
                        assert_eq!((s.n, s.h, s.w, s.c), (n, dims[input].h, dims[input].w, 64));
                        assert_eq!((s.out_h(), s.out_w()), (dims[output].h, dims[output].w));
                    }
                    Node::GlobalAvgPool { input, .. } => {
                        let s = plan.gap(k);
                        assert_eq!(s.pixels, dims[input].h * dims[input].w);
                        assert_eq!(s.channels, dims[input].c);
                    }
                    Node::Linear {
                        inputs, outputs, ..
                    } => assert_eq!(
                        plan.linear(k, n),
                        crate::backend::LinearShape { n, inputs, outputs }
                    ),
                }
            }
        }
    }

    #[test]
    fn the_residual_relu_outputs_are_the_blocks_outputs_a_convolution_finishes() {
        // Every block's output but the last, which the global average pool reads: resnet8 has
        // 3 blocks, resnet18 8, resnet50 16. Unfused, no convolution reads a mask.
        for (arch, blocks) in [
            (Arch::ResNet8, 3),
            (Arch::ResNet18, 8),
            (Arch::ResNet50, 16),
        ] {
            let graph = Graph::new(arch, 10);
            let marked = FusionPlan::of(&graph).residual_relu_outputs(&graph);
            let outputs: Vec<usize> = graph
                .nodes()
                .iter()
                .filter_map(|node| match node {
                    Node::BatchNorm {
                        output,
                        residual: Some(_),
                        relu: true,
                        ..
                    } => Some(*output),
                    _ => None,
                })
                .collect();
            assert_eq!(outputs.len(), blocks, "{arch}");
            let want: Vec<usize> = outputs[..blocks - 1].to_vec();
            let got: Vec<usize> = (0..marked.len()).filter(|&v| marked[v]).collect();
            assert_eq!(got, want, "{arch}");
            assert!(
                !FusionPlan::none(&graph)
                    .residual_relu_outputs(&graph)
                    .contains(&true),
                "{arch}"
            );
        }
    }

    #[test]
    fn no_two_live_gradients_share_a_buffer_fused_or_not() {
        for arch in [
            Arch::ResNet8,
            Arch::ResNet20,
            Arch::ResNet18,
            Arch::ResNet50,
        ] {
            let graph = Graph::new(arch, 10);
            replay(&graph, &FusionPlan::none(&graph));
            replay(&graph, &FusionPlan::of(&graph));
        }
    }

    #[test]
    fn keeping_residual_gradients_in_place_needs_no_more_gradient_memory() {
        // The block output's gradient lives on in place of the block input's copy: the same
        // size in an identity block, so the plan's total does not grow.
        for arch in [
            Arch::ResNet8,
            Arch::ResNet56,
            Arch::ResNet18,
            Arch::ResNet50,
        ] {
            let graph = Graph::new(arch, 10);
            let dims = graph.value_dims(224);
            let total =
                |f: &FusionPlan| -> usize { plan_grad_buffers(&graph, &dims, f).1.iter().sum() };
            let separate = total(&FusionPlan::none(&graph));
            let fused = total(&FusionPlan::of(&graph));
            eprintln!("{arch}: gradient buffers {fused} fused, {separate} separate per image");
            assert!(
                fused <= separate,
                "{arch}: fused {fused} > separate {separate}"
            );
        }
    }
}
