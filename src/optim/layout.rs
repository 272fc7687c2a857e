//! Where each parameter lives in a flat f32 vector, and in which layout.
//!
//! Checkpoints (weights and optimizer state) are flat in graph parameter order with
//! torchvision's layouts (convolutions OIHW). A rank's optimizer may keep its master weights
//! and state elsewhere: the CPU rank keeps them where its gradients are reduced (each
//! parameter at its bucket-plan offset, convolutions OHWI as the backend computes them, so an
//! update needs no permutation), the GPU optimizer keeps graph order with OHWI convolutions.
//! A [`ParamLayout`] describes one such vector and converts to and from the checkpoint's.

use std::ops::Range;

use crate::model::{ohwi_to_oihw, oihw_to_ohwi, ParamKind, ParamSpec};

/// How convolution weights are ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConvOrder {
    /// torchvision's OIHW (checkpoints).
    Torchvision,
    /// The backends' OHWI (input channels innermost).
    Backend,
}

/// The layout of a flat vector of a model's parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamLayout {
    offsets: Vec<usize>,
    sizes: Vec<usize>,
    len: usize,
    conv: ConvOrder,
}

impl ParamLayout {
    /// Parameters back to back in graph order.
    pub fn graph(params: &[ParamSpec], conv: ConvOrder) -> ParamLayout {
        let mut offsets = Vec::with_capacity(params.len());
        let mut len = 0;
        for p in params {
            offsets.push(len);
            len += p.numel();
        }
        ParamLayout {
            offsets,
            sizes: params.iter().map(ParamSpec::numel).collect(),
            len,
            conv,
        }
    }

    /// Parameter i at `offsets[i]` of a vector of `len` values (gaps between parameters are
    /// padding, kept at zero).
    ///
    /// # Panics
    /// When `offsets` does not have one entry per parameter or a parameter runs past `len`
    /// (a programmer error: the offsets come from a plan of the same parameters).
    pub fn with_offsets(
        params: &[ParamSpec],
        offsets: Vec<usize>,
        len: usize,
        conv: ConvOrder,
    ) -> ParamLayout {
        assert_eq!(offsets.len(), params.len(), "one offset per parameter");
        let sizes: Vec<usize> = params.iter().map(ParamSpec::numel).collect();
        assert!(
            offsets.iter().zip(&sizes).all(|(o, n)| o + n <= len),
            "every parameter lies inside the vector"
        );
        ParamLayout {
            offsets,
            sizes,
            len,
            conv,
        }
    }

    /// Length of the vector (padding included).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a model without parameters.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Parameters described.
    pub fn param_count(&self) -> usize {
        self.offsets.len()
    }

    /// The convolution order.
    pub fn conv_order(&self) -> ConvOrder {
        self.conv
    }

    /// Parameter `index`'s range.
    ///
    /// # Panics
    /// When `index` is out of range (a programmer error).
    pub fn range(&self, index: usize) -> Range<usize> {
        self.offsets[index]..self.offsets[index] + self.sizes[index]
    }

    /// Every parameter's range, in graph order.
    pub fn ranges(&self) -> Vec<Range<usize>> {
        (0..self.param_count()).map(|i| self.range(i)).collect()
    }

    fn convert(&self, spec: &ParamSpec, v: &[f32], to: ConvOrder) -> Vec<f32> {
        let is_conv = spec.kind == ParamKind::ConvWeight && spec.shape.len() == 4;
        match (is_conv, self.conv, to) {
            (true, ConvOrder::Backend, ConvOrder::Torchvision) => ohwi_to_oihw(v, &spec.shape),
            (true, ConvOrder::Torchvision, ConvOrder::Backend) => oihw_to_ohwi(v, &spec.shape),
            _ => v.to_vec(),
        }
    }

    /// A vector in this layout → graph order, torchvision layout (what checkpoints hold).
    ///
    /// # Panics
    /// When `flat` is not [`ParamLayout::len`] long (a programmer error).
    pub fn to_torchvision(&self, params: &[ParamSpec], flat: &[f32]) -> Vec<f32> {
        assert_eq!(flat.len(), self.len, "vector in this layout");
        let mut out = Vec::with_capacity(self.sizes.iter().sum());
        for (i, spec) in params.iter().enumerate() {
            out.extend(self.convert(spec, &flat[self.range(i)], ConvOrder::Torchvision));
        }
        out
    }

    /// Graph order, torchvision layout → a vector in this layout (padding zero).
    ///
    /// # Panics
    /// When `graph` does not hold every parameter (a programmer error).
    pub fn from_torchvision(&self, params: &[ParamSpec], graph: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; self.len];
        let mut at = 0;
        for (i, spec) in params.iter().enumerate() {
            let n = spec.numel();
            let v = match (
                spec.kind == ParamKind::ConvWeight && spec.shape.len() == 4,
                self.conv,
            ) {
                (true, ConvOrder::Backend) => oihw_to_ohwi(&graph[at..at + n], &spec.shape),
                _ => graph[at..at + n].to_vec(),
            };
            out[self.range(i)].copy_from_slice(&v);
            at += n;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Arch, Graph};

    #[test]
    fn a_padded_backend_layout_round_trips_and_really_permutes() {
        let graph = Graph::new(Arch::ResNet8, 3);
        let params = graph.params();
        let n: usize = params.iter().map(ParamSpec::numel).sum();
        let tv: Vec<f32> = (0..n).map(|i| i as f32).collect();
        // Reverse order with 5 values of padding after each parameter.
        let mut offsets = vec![0; params.len()];
        let mut at = 0;
        for i in (0..params.len()).rev() {
            offsets[i] = at;
            at += params[i].numel() + 5;
        }
        let layout = ParamLayout::with_offsets(params, offsets, at, ConvOrder::Backend);
        let flat = layout.from_torchvision(params, &tv);
        assert_eq!(flat.len(), at);
        assert_eq!(layout.to_torchvision(params, &flat), tv);
        let first = &flat[layout.range(0)];
        assert_ne!(first, &tv[..params[0].numel()], "conv1 is permuted");
        let graph_layout = ParamLayout::graph(params, ConvOrder::Torchvision);
        assert_eq!(graph_layout.from_torchvision(params, &tv), tv);
    }
}
