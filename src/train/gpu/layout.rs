//! Flat parameters from the GPU optimizer's layout back to the checkpoint's.
//!
//! [`crate::cuda::optim::DeviceOptimizer`] keeps its f32 master weights in the backend's
//! layout (convolution weights OHWI); checkpoints store torchvision's (OIHW). Rank 0 writes
//! the f32 master weights, not the bf16 working copies, so a checkpoint loses no precision.

/// The inverse of [`crate::cuda::optim::to_backend_layout`]: OHWI convolutions → OIHW.
pub(crate) use crate::cuda::optim::from_backend_layout;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::optim::to_backend_layout;
    use crate::model::{Arch, Graph, ParamSpec};

    #[test]
    fn round_trips_through_the_backend_layout_and_actually_permutes() {
        let graph = Graph::new(Arch::ResNet8, 3);
        let n: usize = graph.params().iter().map(ParamSpec::numel).sum();
        let flat: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let backend = to_backend_layout(graph.params(), &flat);
        assert_ne!(backend, flat, "3×3 convolutions change layout");
        assert_eq!(from_backend_layout(graph.params(), &backend), flat);
    }
}
