//! The hooks a training step is handed and the order it calls them in: the gradient-ready
//! callback and its error, the order parameter gradients become final, and the cross-replica
//! reducer of synchronised batch norm. Both passes and the synchronised step use them, so they
//! sit below all three.

use crate::backend::bn_sync::SumThroughHostError;
use crate::backend::SumsMut;
use crate::model::graph::{Graph, Node};

/// The gradient-ready callback of
/// [`Network::train_step_with`](super::Network::train_step_with): parameter index (into
/// `graph.params()`) and its final gradient tensor.
pub type GradReadyHook<'a, T> = dyn FnMut(usize, &T) -> Result<(), GradHookError> + 'a;

/// What a gradient-ready hook may fail with (e.g. an NCCL launch error); it is carried to
/// the caller inside [`ModelError::GradHook`](crate::model::ModelError::GradHook).
pub type GradHookError = Box<dyn std::error::Error + Send + Sync>;

/// See [`Network::grad_ready_order`](super::Network::grad_ready_order).
pub(super) fn grad_ready_order(graph: &Graph) -> Vec<usize> {
    let mut order = Vec::with_capacity(graph.params().len());
    for node in graph.nodes().iter().rev() {
        match *node {
            Node::Conv { weight, .. } => order.push(weight),
            Node::BatchNorm { weight, bias, .. } | Node::Linear { weight, bias, .. } => {
                order.extend([weight, bias])
            }
            Node::MaxPool { .. } | Node::GlobalAvgPool { .. } => {}
        }
    }
    order
}

/// Cross-replica sums for synchronised batch norm
/// ([`Network::train_step_synced`](super::Network::train_step_synced)).
///
/// Every replica calls [`BnAllReduce::sum_in_place`] the same number of times, in the same
/// order (once per BN layer in forward, once per BN layer in backward), with vectors of the
/// same length; each call returns when every replica's values are summed into `values`.
pub trait BnAllReduce {
    /// Sums `values` element-wise over every replica, in place.
    fn sum_in_place(&mut self, values: &mut [f64]) -> Result<(), GradHookError>;

    /// Sums a backend's sums over every replica, in place, where they are. The default goes
    /// through the host ([`BnAllReduce::sum_in_place`]; device sums are downloaded and
    /// uploaded again); a reducer with a device path (NCCL) sums device memory on the device.
    fn sum_sums(&mut self, mut sums: SumsMut<'_>) -> Result<(), GradHookError> {
        sums.sum_through_host(|v| self.sum_in_place(v))
            .map_err(|e| match e {
                SumThroughHostError::Device(e) => Box::new(e) as GradHookError,
                SumThroughHostError::Sum(e) => e,
            })
    }
}

/// A shorter-lived handle on an optional reducer (`Option::as_deref_mut` cannot shorten the
/// trait object's lifetime, which `&mut` makes invariant).
pub(super) fn reborrow<'a>(
    r: &'a mut Option<&mut dyn BnAllReduce>,
) -> Option<&'a mut dyn BnAllReduce> {
    match r {
        Some(r) => Some(&mut **r),
        None => None,
    }
}
