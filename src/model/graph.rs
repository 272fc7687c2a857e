//! The one layer-graph definition of every ResNet variant.
//!
//! A graph is a list of [`Node`]s in execution order over numbered values (value 0 is the
//! normalised input image, the last value the logits). Parameters and buffers are listed in
//! torchvision's `state_dict` order with its names and shapes.

use crate::backend::ConvShape;

use super::Arch;

/// What a learnable parameter is (decides layout conversion and weight decay).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamKind {
    /// Convolution weight, OIHW in torchvision layout.
    ConvWeight,
    /// Batch-norm scale γ.
    BnWeight,
    /// Batch-norm shift β.
    BnBias,
    /// Classifier weight `[classes][features]`.
    LinearWeight,
    /// Classifier bias.
    LinearBias,
}

/// One learnable parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    /// torchvision `state_dict` name, e.g. `layer1.0.conv1.weight`.
    pub name: String,
    /// torchvision shape (OIHW for convolutions).
    pub shape: Vec<usize>,
    /// What it is.
    pub kind: ParamKind,
    /// Whether weight decay applies (convolution and linear weights; never BN or bias).
    pub decay: bool,
}

impl ParamSpec {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// What a buffer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufferKind {
    /// `bn.running_mean`.
    RunningMean,
    /// `bn.running_var` (unbiased, as torch).
    RunningVar,
    /// `bn.num_batches_tracked` (an int64 scalar in torch; f32 here, i64 in files).
    NumBatchesTracked,
}

/// One non-learnable tensor of the state dict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferSpec {
    /// torchvision name, e.g. `bn1.running_mean`.
    pub name: String,
    /// Shape (`[]` for `num_batches_tracked`).
    pub shape: Vec<usize>,
    /// What it is.
    pub kind: BufferKind,
}

impl BufferSpec {
    /// Number of elements (1 for a scalar).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// One op of the graph. Value, parameter and buffer fields are indices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    /// Convolution without bias.
    Conv {
        /// Input value.
        input: usize,
        /// Output value.
        output: usize,
        /// Weight parameter (OIHW).
        weight: usize,
        /// Input channels.
        c_in: usize,
        /// Output channels.
        c_out: usize,
        /// Square kernel size.
        kernel: usize,
        /// Stride.
        stride: usize,
        /// Zero padding.
        padding: usize,
    },
    /// Batch norm, optionally followed by a residual add and a ReLU (fused).
    BatchNorm {
        /// Input value.
        input: usize,
        /// Output value.
        output: usize,
        /// Shortcut value added before the ReLU.
        residual: Option<usize>,
        /// Apply ReLU.
        relu: bool,
        /// γ parameter.
        weight: usize,
        /// β parameter.
        bias: usize,
        /// `running_mean` buffer.
        running_mean: usize,
        /// `running_var` buffer.
        running_var: usize,
        /// `num_batches_tracked` buffer.
        num_batches_tracked: usize,
        /// Channels.
        channels: usize,
    },
    /// Max pool.
    MaxPool {
        /// Input value.
        input: usize,
        /// Output value.
        output: usize,
        /// Window.
        kernel: usize,
        /// Stride.
        stride: usize,
        /// Padding.
        padding: usize,
    },
    /// Global average pool to one vector per image.
    GlobalAvgPool {
        /// Input value.
        input: usize,
        /// Output value.
        output: usize,
    },
    /// Fully connected classifier.
    Linear {
        /// Input value.
        input: usize,
        /// Output value (the logits).
        output: usize,
        /// Weight parameter `[out][in]`.
        weight: usize,
        /// Bias parameter.
        bias: usize,
        /// Input features.
        inputs: usize,
        /// Output features.
        outputs: usize,
    },
}

/// Per-image dimensions of a value (NHWC without the N).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ValueDims {
    /// Height.
    pub h: usize,
    /// Width.
    pub w: usize,
    /// Channels.
    pub c: usize,
}

impl ValueDims {
    /// Elements per image.
    pub fn per_image(&self) -> usize {
        self.h * self.w * self.c
    }
}

/// The network an [`Arch`] names, counted (it is built here, from the graph, so the
/// architecture list needs no graph).
impl Arch {
    /// FLOPs (2 × multiply-adds) of one image's forward pass, convolutions and the classifier
    /// (batch norm, pooling and activations are ignored, as usual for MFU). A training step
    /// costs about 3× this.
    pub fn forward_flops(self, image_size: u32, num_classes: usize) -> f64 {
        Graph::new(self, num_classes).forward_flops(image_size)
    }
}

/// The layer graph of one architecture and class count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Graph {
    arch: Arch,
    num_classes: usize,
    params: Vec<ParamSpec>,
    buffers: Vec<BufferSpec>,
    nodes: Vec<Node>,
    values: usize,
}

impl Graph {
    /// Builds the graph of `arch` with a `num_classes`-way classifier.
    ///
    /// # Panics
    /// If `num_classes` is 0 (a programmer error: a dataset always has classes).
    pub fn new(arch: Arch, num_classes: usize) -> Graph {
        assert!(num_classes > 0, "Graph::new: num_classes must be > 0");
        let mut b = Builder {
            g: Graph {
                arch,
                num_classes,
                params: Vec::new(),
                buffers: Vec::new(),
                nodes: Vec::new(),
                values: 1,
            },
        };
        let features = match arch {
            Arch::ResNet8 | Arch::ResNet20 | Arch::ResNet56 => {
                let n = match arch {
                    Arch::ResNet8 => 1,
                    Arch::ResNet20 => 3,
                    _ => 9,
                };
                let x = b.conv("conv1", 0, 3, 16, 3, 1, 1);
                let mut x = b.bn("bn1", x, 16, None, true);
                let mut c = 16;
                for (i, (planes, stride)) in [(16, 1), (32, 2), (64, 2)].into_iter().enumerate() {
                    for j in 0..n {
                        let s = if j == 0 { stride } else { 1 };
                        x = b.basic_block(&format!("layer{}.{j}", i + 1), x, c, planes, s);
                        c = planes;
                    }
                }
                (x, c)
            }
            _ => {
                let (bottleneck, counts) = match arch {
                    Arch::ResNet18 => (false, [2, 2, 2, 2]),
                    Arch::ResNet34 => (false, [3, 4, 6, 3]),
                    Arch::ResNet50 => (true, [3, 4, 6, 3]),
                    Arch::ResNet101 => (true, [3, 4, 23, 3]),
                    _ => (true, [3, 8, 36, 3]),
                };
                let x = b.conv("conv1", 0, 3, 64, 7, 2, 3);
                let x = b.bn("bn1", x, 64, None, true);
                let mut x = b.value_after(Node::MaxPool {
                    input: x,
                    output: 0,
                    kernel: 3,
                    stride: 2,
                    padding: 1,
                });
                let mut c = 64;
                for (i, &count) in counts.iter().enumerate() {
                    let planes = 64 << i;
                    let stride = if i == 0 { 1 } else { 2 };
                    for j in 0..count {
                        let s = if j == 0 { stride } else { 1 };
                        let name = format!("layer{}.{j}", i + 1);
                        x = if bottleneck {
                            b.bottleneck(&name, x, c, planes, s)
                        } else {
                            b.basic_block(&name, x, c, planes, s)
                        };
                        c = if bottleneck { planes * 4 } else { planes };
                    }
                }
                (x, c)
            }
        };
        let (x, c) = features;
        let pooled = b.value_after(Node::GlobalAvgPool {
            input: x,
            output: 0,
        });
        let weight = b.param("fc.weight", vec![num_classes, c], ParamKind::LinearWeight);
        let bias = b.param("fc.bias", vec![num_classes], ParamKind::LinearBias);
        b.value_after(Node::Linear {
            input: pooled,
            output: 0,
            weight,
            bias,
            inputs: c,
            outputs: num_classes,
        });
        b.g
    }

    /// The architecture.
    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// Classifier width.
    pub fn num_classes(&self) -> usize {
        self.num_classes
    }

    /// Learnable parameters in torchvision `state_dict` order.
    pub fn params(&self) -> &[ParamSpec] {
        &self.params
    }

    /// Buffers (BN running statistics and batch counters) in `state_dict` order.
    pub fn buffers(&self) -> &[BufferSpec] {
        &self.buffers
    }

    /// Ops in execution order.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Number of values (activations), input and logits included.
    pub fn value_count(&self) -> usize {
        self.values
    }

    /// Total learnable elements (resnet18/1000: 11,689,512).
    pub fn param_count(&self) -> usize {
        self.params.iter().map(ParamSpec::numel).sum()
    }

    /// Index of a parameter by name.
    pub fn param_index(&self, name: &str) -> Option<usize> {
        self.params.iter().position(|p| p.name == name)
    }

    /// Offset of each parameter in the flat vector (graph order) and the total length.
    pub fn param_offsets(&self) -> (Vec<usize>, usize) {
        let mut offs = Vec::with_capacity(self.params.len());
        let mut total = 0;
        for p in &self.params {
            offs.push(total);
            total += p.numel();
        }
        (offs, total)
    }

    /// Per-image dimensions of every value for square `image_size` inputs.
    pub fn value_dims(&self, image_size: u32) -> Vec<ValueDims> {
        let s = image_size as usize;
        let mut dims = vec![ValueDims { h: 0, w: 0, c: 0 }; self.values];
        dims[0] = ValueDims { h: s, w: s, c: 3 };
        for node in &self.nodes {
            match *node {
                Node::Conv {
                    input,
                    output,
                    c_out,
                    kernel,
                    stride,
                    padding,
                    ..
                } => {
                    let d = dims[input];
                    let out = |x: usize| (x + 2 * padding).saturating_sub(kernel) / stride + 1;
                    dims[output] = ValueDims {
                        h: out(d.h),
                        w: out(d.w),
                        c: c_out,
                    };
                }
                Node::MaxPool {
                    input,
                    output,
                    kernel,
                    stride,
                    padding,
                } => {
                    let d = dims[input];
                    let out = |x: usize| (x + 2 * padding).saturating_sub(kernel) / stride + 1;
                    dims[output] = ValueDims {
                        h: out(d.h),
                        w: out(d.w),
                        c: d.c,
                    };
                }
                Node::BatchNorm { input, output, .. } => dims[output] = dims[input],
                Node::GlobalAvgPool { input, output } => {
                    dims[output] = ValueDims {
                        h: 1,
                        w: 1,
                        c: dims[input].c,
                    }
                }
                Node::Linear {
                    output, outputs, ..
                } => {
                    dims[output] = ValueDims {
                        h: 1,
                        w: 1,
                        c: outputs,
                    }
                }
            }
        }
        dims
    }

    /// Activation elements one image needs: every value of the graph (input and logits
    /// included) at `image_size`. [`super::Network`] keeps this many activations per image,
    /// plus its shared gradient buffers ([`super::Network::elements_per_image`] has the total).
    pub fn activation_elements(&self, image_size: u32) -> usize {
        self.value_dims(image_size)
            .iter()
            .map(ValueDims::per_image)
            .sum()
    }

    /// The convolution shape of a `Conv` node for `n` images (None for other nodes).
    pub fn conv_shape(&self, node: &Node, dims: &[ValueDims], n: usize) -> Option<ConvShape> {
        match *node {
            Node::Conv {
                input,
                c_in,
                c_out,
                kernel,
                stride,
                padding,
                ..
            } => Some(ConvShape {
                n,
                h: dims[input].h,
                w: dims[input].w,
                c_in,
                c_out,
                kernel,
                stride,
                padding,
            }),
            _ => None,
        }
    }

    /// FLOPs (2 × multiply-adds) of one image's forward pass: convolutions and classifier.
    pub fn forward_flops(&self, image_size: u32) -> f64 {
        let dims = self.value_dims(image_size);
        self.nodes
            .iter()
            .map(|node| match node {
                Node::Linear {
                    inputs, outputs, ..
                } => 2.0 * (*inputs * *outputs) as f64,
                _ => self.conv_shape(node, &dims, 1).map_or(0.0, |s| s.flops()),
            })
            .sum()
    }
}

/// Appends nodes, parameters and buffers with torchvision's names.
struct Builder {
    g: Graph,
}

impl Builder {
    fn param(&mut self, name: &str, shape: Vec<usize>, kind: ParamKind) -> usize {
        let decay = matches!(kind, ParamKind::ConvWeight | ParamKind::LinearWeight);
        self.g.params.push(ParamSpec {
            name: name.to_string(),
            shape,
            kind,
            decay,
        });
        self.g.params.len() - 1
    }

    fn buffer(&mut self, name: &str, shape: Vec<usize>, kind: BufferKind) -> usize {
        self.g.buffers.push(BufferSpec {
            name: name.to_string(),
            shape,
            kind,
        });
        self.g.buffers.len() - 1
    }

    /// Pushes `node` with a fresh output value and returns that value.
    fn value_after(&mut self, mut node: Node) -> usize {
        let v = self.g.values;
        self.g.values += 1;
        match &mut node {
            Node::Conv { output, .. }
            | Node::BatchNorm { output, .. }
            | Node::MaxPool { output, .. }
            | Node::GlobalAvgPool { output, .. }
            | Node::Linear { output, .. } => *output = v,
        }
        self.g.nodes.push(node);
        v
    }

    #[allow(clippy::too_many_arguments)]
    fn conv(
        &mut self,
        name: &str,
        input: usize,
        c_in: usize,
        c_out: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
    ) -> usize {
        let weight = self.param(
            &format!("{name}.weight"),
            vec![c_out, c_in, kernel, kernel],
            ParamKind::ConvWeight,
        );
        self.value_after(Node::Conv {
            input,
            output: 0,
            weight,
            c_in,
            c_out,
            kernel,
            stride,
            padding,
        })
    }

    fn bn(
        &mut self,
        name: &str,
        input: usize,
        channels: usize,
        residual: Option<usize>,
        relu: bool,
    ) -> usize {
        let weight = self.param(
            &format!("{name}.weight"),
            vec![channels],
            ParamKind::BnWeight,
        );
        let bias = self.param(&format!("{name}.bias"), vec![channels], ParamKind::BnBias);
        let running_mean = self.buffer(
            &format!("{name}.running_mean"),
            vec![channels],
            BufferKind::RunningMean,
        );
        let running_var = self.buffer(
            &format!("{name}.running_var"),
            vec![channels],
            BufferKind::RunningVar,
        );
        let num_batches_tracked = self.buffer(
            &format!("{name}.num_batches_tracked"),
            vec![],
            BufferKind::NumBatchesTracked,
        );
        self.value_after(Node::BatchNorm {
            input,
            output: 0,
            residual,
            relu,
            weight,
            bias,
            running_mean,
            running_var,
            num_batches_tracked,
            channels,
        })
    }

    /// Shortcut: identity, or 1×1 conv + BN (`downsample.0`, `downsample.1`) when the shape
    /// changes. torchvision registers `downsample` after the block's own layers, so callers
    /// build the main path's parameters first.
    fn shortcut(
        &mut self,
        name: &str,
        x: usize,
        c_in: usize,
        c_out: usize,
        stride: usize,
    ) -> usize {
        if stride == 1 && c_in == c_out {
            return x;
        }
        let d = self.conv(
            &format!("{name}.downsample.0"),
            x,
            c_in,
            c_out,
            1,
            stride,
            0,
        );
        self.bn(&format!("{name}.downsample.1"), d, c_out, None, false)
    }

    fn basic_block(
        &mut self,
        name: &str,
        x: usize,
        c_in: usize,
        planes: usize,
        stride: usize,
    ) -> usize {
        let a = self.conv(&format!("{name}.conv1"), x, c_in, planes, 3, stride, 1);
        let a = self.bn(&format!("{name}.bn1"), a, planes, None, true);
        let a = self.conv(&format!("{name}.conv2"), a, planes, planes, 3, 1, 1);
        // torchvision's state_dict order is conv1, bn1, conv2, bn2, downsample; the residual
        // must exist before bn2 consumes it, so bn2's parameters are reordered afterwards.
        let short = self.shortcut(name, x, c_in, planes, stride);
        let out = self.bn(&format!("{name}.bn2"), a, planes, Some(short), true);
        self.move_last_bn_before_downsample(name);
        out
    }

    fn bottleneck(
        &mut self,
        name: &str,
        x: usize,
        c_in: usize,
        planes: usize,
        stride: usize,
    ) -> usize {
        let width = planes;
        let c_out = planes * 4;
        let a = self.conv(&format!("{name}.conv1"), x, c_in, width, 1, 1, 0);
        let a = self.bn(&format!("{name}.bn1"), a, width, None, true);
        let a = self.conv(&format!("{name}.conv2"), a, width, width, 3, stride, 1);
        let a = self.bn(&format!("{name}.bn2"), a, width, None, true);
        let a = self.conv(&format!("{name}.conv3"), a, width, c_out, 1, 1, 0);
        let short = self.shortcut(name, x, c_in, c_out, stride);
        let out = self.bn(&format!("{name}.bn3"), a, c_out, Some(short), true);
        self.move_last_bn_before_downsample(name);
        out
    }

    /// Moves the block's final BN parameters/buffers (just pushed) in front of its downsample
    /// entries so that the listing follows torchvision's `state_dict` order exactly.
    fn move_last_bn_before_downsample(&mut self, name: &str) {
        let prefix = format!("{name}.downsample.");
        if let Some(first) = self
            .g
            .params
            .iter()
            .position(|p| p.name.starts_with(&prefix))
        {
            let moved: Vec<ParamSpec> = self.g.params.drain(self.g.params.len() - 2..).collect();
            let remap_from = self.g.params.len();
            for (k, p) in moved.into_iter().enumerate() {
                self.g.params.insert(first + k, p);
            }
            let bfirst = self
                .g
                .buffers
                .iter()
                .position(|b| b.name.starts_with(&prefix))
                .expect("downsample BN has buffers");
            let bmoved: Vec<BufferSpec> =
                self.g.buffers.drain(self.g.buffers.len() - 3..).collect();
            let bremap_from = self.g.buffers.len();
            for (k, b) in bmoved.into_iter().enumerate() {
                self.g.buffers.insert(bfirst + k, b);
            }
            // Rewrite indices in nodes: moved entries go to first.., the ones after shift by 2/3.
            let pmap = |i: usize| {
                if i >= remap_from {
                    first + (i - remap_from)
                } else if i >= first {
                    i + 2
                } else {
                    i
                }
            };
            let bmap = |i: usize| {
                if i >= bremap_from {
                    bfirst + (i - bremap_from)
                } else if i >= bfirst {
                    i + 3
                } else {
                    i
                }
            };
            for node in &mut self.g.nodes {
                match node {
                    Node::Conv { weight, .. } => *weight = pmap(*weight),
                    Node::BatchNorm {
                        weight,
                        bias,
                        running_mean,
                        running_var,
                        num_batches_tracked,
                        ..
                    } => {
                        *weight = pmap(*weight);
                        *bias = pmap(*bias);
                        *running_mean = bmap(*running_mean);
                        *running_var = bmap(*running_var);
                        *num_batches_tracked = bmap(*num_batches_tracked);
                    }
                    Node::Linear { weight, bias, .. } => {
                        *weight = pmap(*weight);
                        *bias = pmap(*bias);
                    }
                    Node::MaxPool { .. } | Node::GlobalAvgPool { .. } => {}
                }
            }
        }
    }
}
