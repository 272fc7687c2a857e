//! The ResNet family: one layer-graph definition ([`Graph`]), its parameters in torchvision's
//! `state_dict` names and layouts ([`ModelState`], safetensors in and out), and [`Network`],
//! which executes the graph forward and backward on any [`crate::backend::Backend`].
//!
//! Families:
//! - `resnet18/34` (BasicBlock) and `resnet50/101/152` (Bottleneck, stride in the 3×3: v1.5),
//!   exactly torchvision's layer names and shapes;
//! - the CIFAR-style `resnet8/20/56` of He et al.: 3×3 stem with 16 channels, three stages of
//!   16-32-64 channels with n = (depth−2)/6 BasicBlocks each, and option-B shortcuts
//!   (1×1 convolution + batch norm where the shape changes) named like torchvision's
//!   (`layer2.0.downsample.0.weight`).

mod arch;
mod bn_fusion;
mod error;
mod graph;
mod init;
mod input;
mod network;
mod state;

pub use arch::Arch;
pub use bn_fusion::FusionPlan;
pub use error::ModelError;
pub use graph::{BufferKind, BufferSpec, Graph, Node, ParamKind, ParamSpec, ValueDims};
pub use input::{Augment, InputBatch, Mix, PixelBox, StepStats, IMAGENET_MEAN, IMAGENET_STD};
pub use network::{
    buffer_plan, BnAllReduce, BufferPlan, GradHookError, GradReadyHook, Network, NetworkConfig,
    SyncEvent,
};
pub(crate) use network::{ohwi_to_oihw, oihw_to_ohwi};
pub use state::{HeadPolicy, ModelState, NewHead};
