//! Which batch-norm work a [`super::Network`] hands to the convolutions around each batch
//! norm when its backend fuses them ([`crate::backend::Backend::bn_fusion`]): a plan read off
//! the graph once.
//!
//! - Forward: a convolution whose output a batch norm reads leaves that batch norm's moments
//!   (`conv_forward_moments`), in training mode.
//! - Backward: the convolution that is the *first* reader of a batch norm's output (its data
//!   gradient is then the last contribution to that output's gradient) finishes the batch
//!   norm's incoming gradient: mask, reductions (`conv_backward_data_bn`). That batch norm's
//!   backward is then `prepared`.
//! - Residuals: a prepared batch norm with a residual input normally writes the residual's
//!   gradient (its g) into the residual's buffer, which the residual's first reader, a
//!   convolution, then adds its own data gradient to. When that reader's data gradient is
//!   fused as well, the copy is skipped: the convolution reads g straight from the batch
//!   norm's output gradient (`residual_grad`), which stays alive until then.
//! - Max pool: a batch norm (no residual) whose only reader is a max pool (ResNet's stem) is
//!   applied by the pool as it reads the batch norm's input (`maxpool_bn_forward`), so its
//!   output is never stored; the pool's backward finishes its incoming gradient
//!   (`maxpool_bn_backward`: mask, reductions), and its backward is `prepared`.
//! - Convolutions ([`FusionPlan::with_convs_applying`], where the backend's convolutions apply
//!   batch norm: [`crate::backend::Backend::conv_applies_bn`]): a batch norm (no residual)
//!   whose only reader is a convolution (a bottleneck's or a basic block's inner batch norm) is
//!   applied by that convolution as it reads the batch norm's input (`conv_forward_bn`, and
//!   `conv_backward_weight_bn` for its weight gradient), so its output is never stored; the
//!   convolution's fused data gradient recomputes the ReLU's mask from that input
//!   (`conv_backward_data_bn` with no output).

use super::graph::{Graph, Node};

/// The fused batch-norm sequence of one graph (indices are node indices).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FusionPlan {
    /// Conv node → the batch-norm node whose input is its output.
    pub stats_for: Vec<Option<usize>>,
    /// Conv node → the batch-norm node whose output is its input, when this convolution's
    /// data gradient is the last contribution to that output's gradient.
    pub finishes: Vec<Option<usize>>,
    /// Batch-norm node → whether a convolution finishes its incoming gradient.
    pub prepared: Vec<bool>,
    /// Batch-norm node → whether it leaves its residual's gradient in its own output's
    /// gradient buffer instead of writing it (the reader adds it from there).
    pub residual_in_place: Vec<bool>,
    /// Conv node → the value whose gradient buffer holds a residual gradient its fused data
    /// gradient adds (the output of a batch norm with `residual_in_place`).
    pub residual_from: Vec<Option<usize>>,
    /// Max-pool node → the batch-norm node it applies to its input (whose output it alone
    /// reads); that batch norm's output is never stored.
    pub pool_applies: Vec<Option<usize>>,
    /// Conv node → the batch-norm node it applies to its input (whose output it alone
    /// reads); that batch norm's output is never stored.
    pub conv_applies: Vec<Option<usize>>,
    /// Batch-norm node → whether its output is not stored (a max pool or a convolution
    /// applies it).
    pub unstored: Vec<bool>,
}

impl FusionPlan {
    /// The plan of `graph`.
    pub fn of(graph: &Graph) -> FusionPlan {
        let nodes = graph.nodes();
        let ValueUses {
            producer,
            first_reader,
            readers,
        } = ValueUses::of(graph);
        let mut plan = FusionPlan::none(graph);
        for (k, node) in nodes.iter().enumerate() {
            if let Node::BatchNorm { input, .. } = *node {
                if let Some(c) = producer[input].filter(|&c| matches!(nodes[c], Node::Conv { .. }))
                {
                    plan.stats_for[c] = Some(k);
                }
            }
            if let Node::MaxPool { input, .. } = *node {
                let bn = producer[input]
                    .filter(|&p| matches!(nodes[p], Node::BatchNorm { residual: None, .. }));
                if let (Some(p), 1) = (bn, readers[input]) {
                    plan.pool_applies[k] = Some(p);
                    plan.unstored[p] = true;
                    plan.prepared[p] = true;
                }
            }
            if let Node::Conv { input, .. } = *node {
                let bn = producer[input].filter(|&p| matches!(nodes[p], Node::BatchNorm { .. }));
                if input != 0 && first_reader[input] == Some(k) {
                    if let Some(p) = bn {
                        plan.finishes[k] = Some(p);
                        plan.prepared[p] = true;
                    }
                }
            }
        }
        for (q, node) in nodes.iter().enumerate() {
            let Node::BatchNorm {
                residual: Some(r),
                output,
                ..
            } = *node
            else {
                continue;
            };
            let Some(c1) = first_reader[r] else { continue };
            if plan.prepared[q] && plan.finishes[c1].is_some() && plan.residual_from[c1].is_none() {
                plan.residual_in_place[q] = true;
                plan.residual_from[c1] = Some(output);
            }
        }
        plan
    }

    /// This plan with every batch norm (no residual) whose only reader is a convolution
    /// applied by that convolution ([`FusionPlan::conv_applies`]): its output is never stored.
    /// Such a convolution already finishes the batch norm's gradient (it is its first reader).
    pub fn with_convs_applying(mut self, graph: &Graph) -> FusionPlan {
        let nodes = graph.nodes();
        let ValueUses {
            producer, readers, ..
        } = ValueUses::of(graph);
        for (k, node) in nodes.iter().enumerate() {
            let Node::Conv { input, .. } = *node else {
                continue;
            };
            let bn = producer[input]
                .filter(|&p| matches!(nodes[p], Node::BatchNorm { residual: None, .. }));
            if let (Some(p), 1, true) = (bn, readers[input], input != 0) {
                debug_assert_eq!(self.finishes[k], Some(p), "the one reader finishes it");
                self.conv_applies[k] = Some(p);
                self.unstored[p] = true;
            }
        }
        self
    }

    /// Value → whether it is the stored output of a batch norm with a residual and a ReLU
    /// whose incoming gradient a convolution's data gradient finishes: the mask that data
    /// gradient reads from it cannot be recomputed from the batch norm's input alone
    /// ([`Backend::keep_relu_signs`](crate::backend::Backend::keep_relu_signs)).
    pub fn residual_relu_outputs(&self, graph: &Graph) -> Vec<bool> {
        let mut marked = vec![false; graph.value_count()];
        for (k, node) in graph.nodes().iter().enumerate() {
            if let Node::BatchNorm {
                output,
                residual: Some(_),
                relu: true,
                ..
            } = node
            {
                marked[*output] = self.prepared[k] && !self.unstored[k];
            }
        }
        marked
    }

    /// The plan of a network that does not fuse: nothing moves.
    pub fn none(graph: &Graph) -> FusionPlan {
        let n = graph.nodes().len();
        FusionPlan {
            stats_for: vec![None; n],
            finishes: vec![None; n],
            prepared: vec![false; n],
            residual_in_place: vec![false; n],
            residual_from: vec![None; n],
            pool_applies: vec![None; n],
            conv_applies: vec![None; n],
            unstored: vec![false; n],
        }
    }
}

/// Per value of a graph: the node that writes it, the first node that reads it, and how many
/// reads of it the nodes make.
struct ValueUses {
    producer: Vec<Option<usize>>,
    first_reader: Vec<Option<usize>>,
    readers: Vec<usize>,
}

impl ValueUses {
    fn of(graph: &Graph) -> ValueUses {
        let values = graph.value_count();
        let mut uses = ValueUses {
            producer: vec![None; values],
            first_reader: vec![None; values],
            readers: vec![0; values],
        };
        for (k, node) in graph.nodes().iter().enumerate() {
            let (reads, output) = reads_and_output(node);
            uses.producer[output] = Some(k);
            for v in reads {
                uses.first_reader[v].get_or_insert(k);
                uses.readers[v] += 1;
            }
        }
        uses
    }
}

/// The values a node reads (input, and a batch norm's residual) and the value it writes.
fn reads_and_output(node: &Node) -> (Vec<usize>, usize) {
    match *node {
        Node::Conv { input, output, .. }
        | Node::MaxPool { input, output, .. }
        | Node::GlobalAvgPool { input, output }
        | Node::Linear { input, output, .. } => (vec![input], output),
        Node::BatchNorm {
            input,
            output,
            residual,
            ..
        } => (
            [Some(input), residual].into_iter().flatten().collect(),
            output,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Arch;

    fn name_of(graph: &Graph, node: usize) -> String {
        let w = match graph.nodes()[node] {
            Node::Conv { weight, .. } | Node::BatchNorm { weight, .. } => weight,
            _ => return format!("node {node}"),
        };
        graph.params()[w]
            .name
            .trim_end_matches(".weight")
            .to_string()
    }

    #[test]
    fn a_basic_block_hands_its_batch_norms_to_the_convolutions_around_them() {
        let graph = Graph::new(Arch::ResNet8, 10);
        let plan = FusionPlan::of(&graph);
        let find = |name: &str| {
            (0..graph.nodes().len())
                .find(|&k| name_of(&graph, k) == name)
                .unwrap_or_else(|| panic!("{name}"))
        };
        // Every convolution leaves the statistics of the batch norm after it.
        for (k, node) in graph.nodes().iter().enumerate() {
            if matches!(node, Node::Conv { .. }) {
                assert!(plan.stats_for[k].is_some(), "{}", name_of(&graph, k));
            }
        }
        assert_eq!(plan.stats_for[find("conv1")], Some(find("bn1")));
        // conv2 finishes bn1 within a block; a block's conv1 finishes the batch norm before
        // the block, the shortcut's convolution (read after conv1) never.
        assert_eq!(
            plan.finishes[find("layer1.0.conv2")],
            Some(find("layer1.0.bn1"))
        );
        assert_eq!(plan.finishes[find("layer1.0.conv1")], Some(find("bn1")));
        assert_eq!(
            plan.finishes[find("layer2.0.conv1")],
            Some(find("layer1.0.bn2"))
        );
        assert_eq!(plan.finishes[find("layer2.0.downsample.0")], None);
        // The stem convolution reads the image: it finishes nothing.
        assert_eq!(plan.finishes[find("conv1")], None);
        // The last batch norm feeds the pool, not a convolution: not prepared.
        assert!(!plan.prepared[find("layer3.0.bn2")]);
        assert!(plan.prepared[find("layer2.0.bn2")]);
        assert!(!plan.prepared[find("layer2.0.downsample.1")]);
        // An identity block's residual gradient stays in place for its conv1; a downsampling
        // block's shortcut is a batch norm, not a convolution: written as before.
        assert!(plan.residual_in_place[find("layer1.0.bn2")]);
        let out = match graph.nodes()[find("layer1.0.bn2")] {
            Node::BatchNorm { output, .. } => output,
            _ => unreachable!(),
        };
        assert_eq!(plan.residual_from[find("layer1.0.conv1")], Some(out));
        assert!(!plan.residual_in_place[find("layer2.0.bn2")]);
        assert!(!plan.residual_in_place[find("layer3.0.bn2")]);
        // No max pool: every batch norm's output is stored.
        assert!(plan.pool_applies.iter().all(Option::is_none));
        assert!(!plan.unstored.iter().any(|&u| u));
    }

    #[test]
    fn a_resnet50_hands_over_every_batch_norm_a_convolution_reads() {
        let graph = Graph::new(Arch::ResNet50, 10);
        let plan = FusionPlan::of(&graph);
        let bns: Vec<usize> = (0..graph.nodes().len())
            .filter(|&k| matches!(graph.nodes()[k], Node::BatchNorm { .. }))
            .collect();
        // 53 batch norms: each gets its statistics from its convolution.
        assert_eq!(bns.len(), 53);
        assert_eq!(plan.stats_for.iter().flatten().count(), 53);
        // Prepared: all but the four shortcuts' (read by the residual add) and the last
        // block's (read by the global pool); the stem's by the max pool that applies it.
        let prepared = bns.iter().filter(|&&k| plan.prepared[k]).count();
        assert_eq!(prepared, 53 - 4 - 1);
        let stem = bns[0];
        assert!(plan.unstored[stem]);
        assert_eq!(bns.iter().filter(|&&k| plan.unstored[k]).count(), 1);
        let pool = (0..graph.nodes().len())
            .find(|&k| matches!(graph.nodes()[k], Node::MaxPool { .. }))
            .unwrap();
        assert_eq!(plan.pool_applies[pool], Some(stem));
        assert_eq!(plan.pool_applies.iter().flatten().count(), 1);
        // In place: the identity blocks' residuals whose reader's data gradient is fused
        // (12 identity blocks; layer1.0's shortcut reads the max pool, but it is a
        // downsampling block anyway), less the last block, which is not prepared.
        let in_place = bns.iter().filter(|&&k| plan.residual_in_place[k]).count();
        assert_eq!(in_place, 16 - 4 - 1);
        assert_eq!(plan.residual_from.iter().flatten().count(), in_place);
        // resnet18: layer1.0 is an identity block reading the max pool: its conv1 finishes
        // nothing, so its residual is written as before.
        let r18 = Graph::new(Arch::ResNet18, 10);
        let p18 = FusionPlan::of(&r18);
        let conv1 = (0..r18.nodes().len())
            .find(|&k| name_of(&r18, k) == "layer1.0.conv1")
            .unwrap();
        assert_eq!(p18.finishes[conv1], None);
        assert_eq!(p18.residual_from[conv1], None);
        // Its max pool applies the stem's batch norm, whose output is then not stored.
        let bn1 = (0..r18.nodes().len())
            .find(|&k| name_of(&r18, k) == "bn1")
            .unwrap();
        assert!(p18.unstored[bn1] && p18.prepared[bn1]);
        assert_eq!(
            p18.pool_applies.iter().flatten().collect::<Vec<_>>(),
            [&bn1]
        );
    }

    #[test]
    fn convolutions_apply_every_inner_batch_norm_and_nothing_else() {
        // (arch, inner batch norms: one per basic block, two per bottleneck, max pool)
        for (arch, inner, pool) in [
            (Arch::ResNet8, 3, false),
            (Arch::ResNet18, 8, true),
            (Arch::ResNet50, 32, true),
        ] {
            let graph = Graph::new(arch, 10);
            let plain = FusionPlan::of(&graph);
            let plan = plain.clone().with_convs_applying(&graph);
            assert_eq!(plan.conv_applies.iter().flatten().count(), inner, "{arch}");
            for (k, p) in plan.conv_applies.iter().enumerate() {
                let Some(p) = *p else { continue };
                // The batch norm just before the convolution, inside a block, no residual.
                let (conv, bn) = (name_of(&graph, k), name_of(&graph, p));
                assert!(
                    conv.contains(".conv") && bn.contains(".bn"),
                    "{conv} applies {bn}"
                );
                assert!(
                    matches!(graph.nodes()[p], Node::BatchNorm { residual: None, .. }),
                    "{bn}"
                );
                assert_eq!(plan.finishes[k], Some(p), "{conv} finishes {bn}");
                assert!(plan.unstored[p] && plan.prepared[p], "{bn}");
            }
            let unstored = plan.unstored.iter().filter(|&&u| u).count();
            assert_eq!(unstored, inner + usize::from(pool), "{arch}");
            // Everything else as the plain fused plan has it.
            assert_eq!(
                (
                    plan.stats_for,
                    plan.finishes,
                    plan.prepared,
                    plan.pool_applies
                ),
                (
                    plain.stats_for,
                    plain.finishes,
                    plain.prepared,
                    plain.pool_applies
                )
            );
        }
    }

    #[test]
    fn the_empty_plan_moves_nothing() {
        let graph = Graph::new(Arch::ResNet8, 10);
        let plan = FusionPlan::none(&graph);
        assert!(plan.stats_for.iter().all(Option::is_none));
        assert!(plan.finishes.iter().all(Option::is_none));
        assert!(!plan.prepared.iter().any(|&p| p) && !plan.residual_in_place.iter().any(|&p| p));
        assert!(plan.pool_applies.iter().all(Option::is_none));
        assert!(plan.conv_applies.iter().all(Option::is_none));
        assert!(!plan.unstored.iter().any(|&u| u));
    }
}
