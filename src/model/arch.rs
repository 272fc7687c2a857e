//! Model names.

use std::fmt;
use std::str::FromStr;

use super::ModelError;

/// A ResNet variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    /// CIFAR-style, 3 stages × 1 BasicBlock (16-32-64 channels).
    ResNet8,
    /// CIFAR-style, 3 stages × 3 BasicBlocks.
    ResNet20,
    /// CIFAR-style, 3 stages × 9 BasicBlocks.
    ResNet56,
    /// torchvision resnet18 (BasicBlock blocks 2,2,2,2).
    ResNet18,
    /// torchvision resnet34 (BasicBlock blocks 3,4,6,3).
    ResNet34,
    /// torchvision resnet50 (Bottleneck blocks 3,4,6,3, v1.5).
    ResNet50,
    /// torchvision resnet101 (Bottleneck blocks 3,4,23,3).
    ResNet101,
    /// torchvision resnet152 (Bottleneck blocks 3,8,36,3).
    ResNet152,
}

impl Arch {
    /// Every variant, smallest first.
    pub const ALL: [Arch; 8] = [
        Arch::ResNet8,
        Arch::ResNet20,
        Arch::ResNet56,
        Arch::ResNet18,
        Arch::ResNet34,
        Arch::ResNet50,
        Arch::ResNet101,
        Arch::ResNet152,
    ];

    /// The lowercase name used on the command line and in checkpoints ("resnet18").
    pub fn name(self) -> &'static str {
        match self {
            Arch::ResNet8 => "resnet8",
            Arch::ResNet20 => "resnet20",
            Arch::ResNet56 => "resnet56",
            Arch::ResNet18 => "resnet18",
            Arch::ResNet34 => "resnet34",
            Arch::ResNet50 => "resnet50",
            Arch::ResNet101 => "resnet101",
            Arch::ResNet152 => "resnet152",
        }
    }

    /// Whether this is one of the CIFAR-style small-image models.
    pub fn is_cifar(self) -> bool {
        matches!(self, Arch::ResNet8 | Arch::ResNet20 | Arch::ResNet56)
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Arch {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let wanted = s.trim().to_ascii_lowercase().replace(['-', '_'], "");
        Arch::ALL
            .into_iter()
            .find(|a| a.name() == wanted)
            .ok_or_else(|| ModelError::UnknownArch {
                name: s.to_string(),
                valid: Arch::ALL
                    .iter()
                    .map(|a| a.name())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }
}
