//! Flat parameters from the GPU optimizer's layout back to the checkpoint's.
//!
//! [`crate::cuda::optim::DeviceOptimizer`] keeps its f32 master weights in the backend's
//! layout (convolution weights OHWI); checkpoints store torchvision's (OIHW). Rank 0 writes
//! the f32 master weights, not the bf16 working copies, so a checkpoint loses no precision.

use crate::model::{ParamKind, ParamSpec};

/// The inverse of [`crate::cuda::optim::to_backend_layout`]: OHWI convolutions → OIHW.
pub(crate) fn from_backend_layout(params: &[ParamSpec], flat: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(flat.len());
    let mut offset = 0;
    for p in params {
        let v = &flat[offset..offset + p.numel()];
        if p.kind == ParamKind::ConvWeight && p.shape.len() == 4 {
            let (o, i, kh, kw) = (p.shape[0], p.shape[1], p.shape[2], p.shape[3]);
            let mut t = vec![0.0; v.len()];
            for a in 0..o {
                for y in 0..kh {
                    for x in 0..kw {
                        for b in 0..i {
                            t[((a * i + b) * kh + y) * kw + x] = v[((a * kh + y) * kw + x) * i + b];
                        }
                    }
                }
            }
            out.extend(t);
        } else {
            out.extend_from_slice(v);
        }
        offset += p.numel();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::optim::to_backend_layout;
    use crate::model::{Arch, Graph};

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
