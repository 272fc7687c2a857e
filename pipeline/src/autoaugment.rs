//! Automatic augmentation policies of training images: torchvision's `TrivialAugmentWide`
//! (`--auto-augment ta_wide`), `RandAugment` (`--auto-augment ra`, `--ra-magnitude M`),
//! `AugMix` (`--auto-augment augmix`, `--augmix-severity S`) and `AutoAugment` with its
//! learned ImageNet, CIFAR-10 and SVHN policies (`--auto-augment imagenet|cifar10|svhn`),
//! applied by the decode worker to each image after its crop, before
//! the colour jitter.
//!
//! TrivialAugmentWide and RandAugment draw operations from the same fourteen: identity, shear
//! and translation along either axis, rotation, brightness, colour (saturation), contrast,
//! sharpness, posterize, solarize, autocontrast and equalize.
//! - TrivialAugmentWide applies one operation per image, its strength drawn uniformly from 31
//!   bins (and its sign from a coin for the signed ones);
//! - RandAugment applies two in turn, each at the fixed bin `M` of 31 (default 9), with a
//!   random sign;
//! - AugMix blends the image with three chains of one to three operations (all but identity),
//!   each at a bin below `S` of 10 (default 3): a Beta(1, 1) weight for the image, the rest
//!   split among the chains by a Dirichlet(1, 1, 1) draw, summed in `f32` and truncated;
//! - AutoAugment picks one of its policy's 25 learned pairs per image and applies each
//!   operation of the pair with the pair's probability, at the pair's bin of 10, with a random
//!   sign; its policies also invert images.
//!
//! The bins and policies are torchvision's (`_augmentation_space` and `_get_policies` of each
//! class, torchvision 0.14), the operations its
//! tensor functions on `uint8` images, which the colour ones match to the byte:
//! - brightness, colour and contrast blend with black, the pixel's grey, the image's mean
//!   grey (the colour jitter's adjustments);
//! - sharpness blends with the image blurred by the 3×3 kernel `[1 1 1; 1 5 1; 1 1 1]/13`
//!   (rounded; the border rows and columns kept);
//! - posterize keeps the top `bits` of each byte, solarize inverts bytes ≥ the threshold;
//! - autocontrast stretches each channel to 0..=255, equalize flattens each channel's
//!   histogram (PIL's `ImageOps.equalize` rule);
//! - the geometric ones resample with bilinear weights (the ImageNet reference script's
//!   `--interpolation bilinear`), taps outside the image black: shears about the top-left
//!   corner, rotation about the centre, translations by whole pixels.
//!
//! The draw comes from `(seed, epoch, sample id)` alone, like the crop's window and the
//! jitter, so workers, replicas, the resume point and the cache do not change a pixel. The
//! mirror is applied later, on the device, where torchvision mirrors first: for the images
//! the consumer says it will mirror ([`crate::PipelineBuilder::mirrored_later`]) the draw is
//! applied as it looks in the mirror ([`AugmentDraw::mirrored`]: shears, shifts and turns
//! reversed, a vertical shear pivoting on the top-right corner), so the mirrored result is
//! torchvision's.

use rand::Rng;

use crate::PipelineError;

/// Bins of an operation's strength in TrivialAugmentWide and RandAugment (torchvision's
/// `num_magnitude_bins`).
pub const MAGNITUDE_BINS: u32 = 31;

/// Bins of an operation's strength in AutoAugment's policies.
const POLICY_BINS: u32 = 10;

/// Operations RandAugment applies to each image (torchvision's `num_ops` default).
const RAND_AUGMENT_OPS: usize = 2;

/// An automatic augmentation policy (`--auto-augment`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AutoAugment {
    /// One operation per image at a random strength (`ta_wide`).
    TrivialAugmentWide,
    /// Two operations per image at bin `magnitude` of [`MAGNITUDE_BINS`] (`ra`).
    RandAugment {
        /// The strength bin, 0..=30 (`--ra-magnitude`; torchvision's default 9).
        magnitude: u32,
    },
    /// AutoAugment's learned policy for ImageNet (`imagenet`).
    ImageNet,
    /// AutoAugment's learned policy for CIFAR-10 (`cifar10`).
    Cifar10,
    /// AutoAugment's learned policy for SVHN (`svhn`).
    Svhn,
    /// AugMix (`augmix`): three chains of one to three operations each, blended with the
    /// image by random weights.
    AugMix {
        /// The operations' strength: bins 0 to `severity − 1` of 10 (`--augmix-severity`,
        /// 1..=10; torchvision's default 3).
        severity: u32,
    },
}

/// AugMix's chains per image (torchvision's `mixture_width`).
const AUGMIX_WIDTH: usize = 3;

/// The most operations in one AugMix chain (its depth is drawn from 1 to this).
const AUGMIX_DEPTH: usize = 3;

/// The operations AugMix draws from, in torchvision's order (`all_ops`: the colour ones too).
const AUGMIX_OPS: [AugmentOp; 13] = [
    AugmentOp::ShearX,
    AugmentOp::ShearY,
    AugmentOp::TranslateX,
    AugmentOp::TranslateY,
    AugmentOp::Rotate,
    AugmentOp::Posterize,
    AugmentOp::Solarize,
    AugmentOp::AutoContrast,
    AugmentOp::Equalize,
    AugmentOp::Brightness,
    AugmentOp::Color,
    AugmentOp::Contrast,
    AugmentOp::Sharpness,
];

/// One operation of an AutoAugment pair: applied with probability `.1`, at bin `.2` of 10
/// (`None` for operations without a strength).
type PolicyOp = (AugmentOp, f32, Option<u32>);

/// torchvision's `_get_policies`, table by table.
const IMAGENET_POLICY: [[PolicyOp; 2]; 25] = {
    use AugmentOp::*;
    [
        [(Posterize, 0.4, Some(8)), (Rotate, 0.6, Some(9))],
        [(Solarize, 0.6, Some(5)), (AutoContrast, 0.6, None)],
        [(Equalize, 0.8, None), (Equalize, 0.6, None)],
        [(Posterize, 0.6, Some(7)), (Posterize, 0.6, Some(6))],
        [(Equalize, 0.4, None), (Solarize, 0.2, Some(4))],
        [(Equalize, 0.4, None), (Rotate, 0.8, Some(8))],
        [(Solarize, 0.6, Some(3)), (Equalize, 0.6, None)],
        [(Posterize, 0.8, Some(5)), (Equalize, 1.0, None)],
        [(Rotate, 0.2, Some(3)), (Solarize, 0.6, Some(8))],
        [(Equalize, 0.6, None), (Posterize, 0.4, Some(6))],
        [(Rotate, 0.8, Some(8)), (Color, 0.4, Some(0))],
        [(Rotate, 0.4, Some(9)), (Equalize, 0.6, None)],
        [(Equalize, 0.0, None), (Equalize, 0.8, None)],
        [(Invert, 0.6, None), (Equalize, 1.0, None)],
        [(Color, 0.6, Some(4)), (Contrast, 1.0, Some(8))],
        [(Rotate, 0.8, Some(8)), (Color, 1.0, Some(2))],
        [(Color, 0.8, Some(8)), (Solarize, 0.8, Some(7))],
        [(Sharpness, 0.4, Some(7)), (Invert, 0.6, None)],
        [(ShearX, 0.6, Some(5)), (Equalize, 1.0, None)],
        [(Color, 0.4, Some(0)), (Equalize, 0.6, None)],
        [(Equalize, 0.4, None), (Solarize, 0.2, Some(4))],
        [(Solarize, 0.6, Some(5)), (AutoContrast, 0.6, None)],
        [(Invert, 0.6, None), (Equalize, 1.0, None)],
        [(Color, 0.6, Some(4)), (Contrast, 1.0, Some(8))],
        [(Equalize, 0.8, None), (Equalize, 0.6, None)],
    ]
};

const CIFAR10_POLICY: [[PolicyOp; 2]; 25] = {
    use AugmentOp::*;
    [
        [(Invert, 0.1, None), (Contrast, 0.2, Some(6))],
        [(Rotate, 0.7, Some(2)), (TranslateX, 0.3, Some(9))],
        [(Sharpness, 0.8, Some(1)), (Sharpness, 0.9, Some(3))],
        [(ShearY, 0.5, Some(8)), (TranslateY, 0.7, Some(9))],
        [(AutoContrast, 0.5, None), (Equalize, 0.9, None)],
        [(ShearY, 0.2, Some(7)), (Posterize, 0.3, Some(7))],
        [(Color, 0.4, Some(3)), (Brightness, 0.6, Some(7))],
        [(Sharpness, 0.3, Some(9)), (Brightness, 0.7, Some(9))],
        [(Equalize, 0.6, None), (Equalize, 0.5, None)],
        [(Contrast, 0.6, Some(7)), (Sharpness, 0.6, Some(5))],
        [(Color, 0.7, Some(7)), (TranslateX, 0.5, Some(8))],
        [(Equalize, 0.3, None), (AutoContrast, 0.4, None)],
        [(TranslateY, 0.4, Some(3)), (Sharpness, 0.2, Some(6))],
        [(Brightness, 0.9, Some(6)), (Color, 0.2, Some(8))],
        [(Solarize, 0.5, Some(2)), (Invert, 0.0, None)],
        [(Equalize, 0.2, None), (AutoContrast, 0.6, None)],
        [(Equalize, 0.2, None), (Equalize, 0.6, None)],
        [(Color, 0.9, Some(9)), (Equalize, 0.6, None)],
        [(AutoContrast, 0.8, None), (Solarize, 0.2, Some(8))],
        [(Brightness, 0.1, Some(3)), (Color, 0.7, Some(0))],
        [(Solarize, 0.4, Some(5)), (AutoContrast, 0.9, None)],
        [(TranslateY, 0.9, Some(9)), (TranslateY, 0.7, Some(9))],
        [(AutoContrast, 0.9, None), (Solarize, 0.8, Some(3))],
        [(Equalize, 0.8, None), (Invert, 0.1, None)],
        [(TranslateY, 0.7, Some(9)), (AutoContrast, 0.9, None)],
    ]
};

const SVHN_POLICY: [[PolicyOp; 2]; 25] = {
    use AugmentOp::*;
    [
        [(ShearX, 0.9, Some(4)), (Invert, 0.2, None)],
        [(ShearY, 0.9, Some(8)), (Invert, 0.7, None)],
        [(Equalize, 0.6, None), (Solarize, 0.6, Some(6))],
        [(Invert, 0.9, None), (Equalize, 0.6, None)],
        [(Equalize, 0.6, None), (Rotate, 0.9, Some(3))],
        [(ShearX, 0.9, Some(4)), (AutoContrast, 0.8, None)],
        [(ShearY, 0.9, Some(8)), (Invert, 0.4, None)],
        [(ShearY, 0.9, Some(5)), (Solarize, 0.2, Some(6))],
        [(Invert, 0.9, None), (AutoContrast, 0.8, None)],
        [(Equalize, 0.6, None), (Rotate, 0.9, Some(3))],
        [(ShearX, 0.9, Some(4)), (Solarize, 0.3, Some(3))],
        [(ShearY, 0.8, Some(8)), (Invert, 0.7, None)],
        [(Equalize, 0.9, None), (TranslateY, 0.6, Some(6))],
        [(Invert, 0.9, None), (Equalize, 0.6, None)],
        [(Contrast, 0.3, Some(3)), (Rotate, 0.8, Some(4))],
        [(Invert, 0.8, None), (TranslateY, 0.0, Some(2))],
        [(ShearY, 0.7, Some(6)), (Solarize, 0.4, Some(8))],
        [(Invert, 0.6, None), (Rotate, 0.8, Some(4))],
        [(ShearY, 0.3, Some(7)), (TranslateX, 0.9, Some(3))],
        [(ShearX, 0.1, Some(6)), (Invert, 0.6, None)],
        [(Solarize, 0.7, Some(2)), (TranslateY, 0.6, Some(7))],
        [(ShearY, 0.8, Some(4)), (Invert, 0.8, None)],
        [(ShearX, 0.7, Some(9)), (TranslateY, 0.8, Some(3))],
        [(ShearY, 0.8, Some(5)), (AutoContrast, 0.7, None)],
        [(ShearX, 0.7, Some(2)), (Invert, 0.1, None)],
    ]
};

/// One of the operations the policies draw from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AugmentOp {
    /// The image unchanged.
    Identity,
    /// Horizontal shear about the top-left corner; the magnitude is the shear's tangent.
    ShearX,
    /// Vertical shear about the top-left corner; the magnitude is the shear's tangent.
    ShearY,
    /// Horizontal shift by the magnitude in pixels (truncated to whole pixels).
    TranslateX,
    /// Vertical shift by the magnitude in pixels (truncated to whole pixels).
    TranslateY,
    /// Counter-clockwise rotation about the centre by the magnitude in degrees.
    Rotate,
    /// Brightness factor 1 + magnitude.
    Brightness,
    /// Saturation factor 1 + magnitude.
    Color,
    /// Contrast factor 1 + magnitude.
    Contrast,
    /// Sharpness factor 1 + magnitude.
    Sharpness,
    /// Keep the magnitude's number of high bits of every byte.
    Posterize,
    /// Invert the bytes at or above the magnitude.
    Solarize,
    /// Stretch every channel to the full byte range.
    AutoContrast,
    /// Equalize every channel's histogram.
    Equalize,
    /// Invert every byte (AutoAugment's policies only).
    Invert,
    /// Vertical shear about the top-right corner: what `ShearY` with the opposite tangent is
    /// to the mirror image (no policy draws it; [`AugmentDraw::mirrored`] does).
    ShearYFromRight,
}

impl AugmentOp {
    /// The operations TrivialAugmentWide and RandAugment draw from, in torchvision's order.
    pub const ALL: [AugmentOp; 14] = [
        Self::Identity,
        Self::ShearX,
        Self::ShearY,
        Self::TranslateX,
        Self::TranslateY,
        Self::Rotate,
        Self::Brightness,
        Self::Color,
        Self::Contrast,
        Self::Sharpness,
        Self::Posterize,
        Self::Solarize,
        Self::AutoContrast,
        Self::Equalize,
    ];

    /// torchvision's name of the operation.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Identity => "Identity",
            Self::ShearX => "ShearX",
            Self::ShearY => "ShearY",
            Self::TranslateX => "TranslateX",
            Self::TranslateY => "TranslateY",
            Self::Rotate => "Rotate",
            Self::Brightness => "Brightness",
            Self::Color => "Color",
            Self::Contrast => "Contrast",
            Self::Sharpness => "Sharpness",
            Self::Posterize => "Posterize",
            Self::Solarize => "Solarize",
            Self::AutoContrast => "AutoContrast",
            Self::Equalize => "Equalize",
            Self::Invert => "Invert",
            Self::ShearYFromRight => "ShearYFromRight",
        }
    }

    /// Whether a draw gives the magnitude a random sign.
    fn signed(&self) -> bool {
        matches!(
            self,
            Self::ShearX
                | Self::ShearY
                | Self::ShearYFromRight
                | Self::TranslateX
                | Self::TranslateY
                | Self::Rotate
                | Self::Brightness
                | Self::Color
                | Self::Contrast
                | Self::Sharpness
        )
    }
}

/// One operation with its (signed) magnitude.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OpDraw {
    /// The operation.
    pub op: AugmentOp,
    /// Its magnitude, in the units [`AugmentOp`] names (0 for those without one).
    pub magnitude: f32,
}

/// The operations drawn for one image, applied in turn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AugmentDraw {
    /// The operations (`None`: no more; all `None` for AugMix, whose chains are in `mix`).
    pub ops: [Option<OpDraw>; RAND_AUGMENT_OPS],
    /// AugMix's chains and weights.
    pub mix: Option<AugMixDraw>,
}

/// One image's AugMix: the blend `original·image + Σ weight·chain(image)`, truncated to bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AugMixDraw {
    /// The image's own weight (a Beta(1, 1) draw).
    pub original: f32,
    /// The chains: each one's weight (the rest of 1, split by a Dirichlet(1, 1, 1) draw) and
    /// operations, applied in turn to the image (`None`: no more).
    pub chains: [(f32, [Option<OpDraw>; AUGMIX_DEPTH]); AUGMIX_WIDTH],
}

/// Buffers an [`AugmentDraw`] works in, reused from image to image.
#[derive(Debug, Default)]
pub struct AugmentScratch {
    /// What the geometric operations resample into.
    resampled: Vec<u8>,
    /// One AugMix chain's image.
    chain: Vec<u8>,
    /// AugMix's weighted sum.
    sum: Vec<f32>,
}

impl AutoAugment {
    /// The `--auto-augment` words.
    pub const CHOICES: &'static str =
        "ta_wide (TrivialAugmentWide), ra (RandAugment), augmix (AugMix), imagenet, cifar10 or svhn (AutoAugment's policies) or none";

    /// AugMix at torchvision's default severity (3).
    pub const AUGMIX: Self = Self::AugMix { severity: 3 };

    /// RandAugment at torchvision's default strength bin (9).
    pub const RAND_AUGMENT: Self = Self::RandAugment { magnitude: 9 };

    /// The policy named by `word` (`Some(None)`: `none`), RandAugment at the default bin.
    pub fn parse(word: &str) -> Option<Option<Self>> {
        match word.trim().to_ascii_lowercase().replace('-', "_").as_str() {
            "none" => Some(None),
            "ta_wide" | "trivialaugmentwide" | "trivial_augment_wide" => {
                Some(Some(Self::TrivialAugmentWide))
            }
            "ra" | "randaugment" | "rand_augment" => Some(Some(Self::RAND_AUGMENT)),
            "imagenet" => Some(Some(Self::ImageNet)),
            "cifar10" => Some(Some(Self::Cifar10)),
            "svhn" => Some(Some(Self::Svhn)),
            "augmix" => Some(Some(Self::AUGMIX)),
            _ => None,
        }
    }

    /// The command-line word.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::TrivialAugmentWide => "ta_wide",
            Self::RandAugment { .. } => "ra",
            Self::ImageNet => "imagenet",
            Self::Cifar10 => "cifar10",
            Self::Svhn => "svhn",
            Self::AugMix { .. } => "augmix",
        }
    }

    /// Rejects a strength bin outside the 31.
    pub fn validate(&self) -> Result<(), PipelineError> {
        match self {
            Self::RandAugment { magnitude } if *magnitude >= MAGNITUDE_BINS => {
                Err(PipelineError::InvalidSetting {
                    name: "--ra-magnitude",
                    value: magnitude.to_string(),
                    hint: "a strength bin from 0 to 30 (torchvision's default is 9)",
                })
            }
            Self::AugMix { severity } if !(1..=POLICY_BINS).contains(severity) => {
                Err(PipelineError::InvalidSetting {
                    name: "--augmix-severity",
                    value: severity.to_string(),
                    hint: "a severity from 1 to 10 (torchvision's default is 3)",
                })
            }
            _ => Ok(()),
        }
    }

    /// How many strength bins the policy's operations have (31, or 10 for AutoAugment's).
    pub fn bins(&self) -> u32 {
        match self {
            Self::TrivialAugmentWide | Self::RandAugment { .. } => MAGNITUDE_BINS,
            Self::ImageNet | Self::Cifar10 | Self::Svhn | Self::AugMix { .. } => POLICY_BINS,
        }
    }

    /// The magnitude of `op` at strength `bin` for images of side `side` (torchvision's
    /// `_augmentation_space` of the policy's class), unsigned.
    pub fn magnitude(&self, op: AugmentOp, bin: u32, side: u32) -> f32 {
        let wide = matches!(self, Self::TrivialAugmentWide);
        let bins = self.bins();
        let linspace =
            |start: f32, end: f32, bin: u32| linspace_f32(start, end, bins as usize, bin as usize);
        let augmix = matches!(self, Self::AugMix { .. });
        let (factor, shear, translate, rotate, posterize_bits) = if wide {
            (0.99, 0.99, 32.0, 135.0, 6.0)
        } else if augmix {
            (0.9, 0.3, side as f32 / 3.0, 30.0, 4.0)
        } else {
            (0.9, 0.3, 150.0 / 331.0 * side as f32, 30.0, 4.0)
        };
        // AugMix posterizes from 4 bits down to 0, the others from 8.
        let most_bits = if augmix { 4.0 } else { 8.0 };
        match op {
            AugmentOp::Identity
            | AugmentOp::AutoContrast
            | AugmentOp::Equalize
            | AugmentOp::Invert => 0.0,
            AugmentOp::ShearYFromRight => linspace(0.0, shear, bin),
            AugmentOp::ShearX | AugmentOp::ShearY => linspace(0.0, shear, bin),
            AugmentOp::TranslateX | AugmentOp::TranslateY => linspace(0.0, translate, bin),
            AugmentOp::Rotate => linspace(0.0, rotate, bin),
            AugmentOp::Brightness
            | AugmentOp::Color
            | AugmentOp::Contrast
            | AugmentOp::Sharpness => linspace(0.0, factor, bin),
            // most − round(bin / ((bins − 1) / steps)): the most bits down by `steps`.
            AugmentOp::Posterize => {
                most_bits - (bin as f32 / ((bins - 1) as f32 / posterize_bits)).round_ties_even()
            }
            AugmentOp::Solarize => linspace(255.0, 0.0, bin),
        }
    }

    /// The operations for sample `sample_id` in `epoch`, for images of side `side`.
    pub fn draw(&self, seed: u64, epoch: u64, sample_id: u64, side: u32) -> AugmentDraw {
        let mut rng = crate::crop::sample_rng(b"autoaug\0", seed, epoch, sample_id);
        let mut one = |bin: Option<u32>| {
            let op = AugmentOp::ALL[rng.random_range(0..AugmentOp::ALL.len())];
            let bin = bin.unwrap_or_else(|| rng.random_range(0..MAGNITUDE_BINS));
            let mut magnitude = self.magnitude(op, bin, side);
            if op.signed() && rng.random::<bool>() {
                magnitude = -magnitude;
            }
            OpDraw { op, magnitude }
        };
        match *self {
            Self::TrivialAugmentWide => AugmentDraw {
                ops: [Some(one(None)), None],
                mix: None,
            },
            Self::RandAugment { magnitude } => AugmentDraw {
                ops: std::array::from_fn(|_| Some(one(Some(magnitude)))),
                mix: None,
            },
            Self::AugMix { severity } => {
                use rand_distr::{Distribution, Exp1};
                // Dirichlet(1, …, 1) draws are normalised Exp(1) draws; Beta(1, 1) is the
                // first of a Dirichlet(1, 1).
                let mut dirichlet = |weights: &mut [f32]| {
                    weights.iter_mut().for_each(|w| *w = Exp1.sample(&mut rng));
                    let total: f32 = weights.iter().sum();
                    weights.iter_mut().for_each(|w| *w /= total);
                };
                let mut beta = [0f32; 2];
                dirichlet(&mut beta);
                let mut shares = [0f32; AUGMIX_WIDTH];
                dirichlet(&mut shares);
                let chains = shares.map(|share| {
                    let depth = rng.random_range(1..=AUGMIX_DEPTH);
                    let mut ops = [None; AUGMIX_DEPTH];
                    for slot in &mut ops[..depth] {
                        let op = AUGMIX_OPS[rng.random_range(0..AUGMIX_OPS.len())];
                        // A severity of 0 (refused by `validate`) draws from the first bin.
                        let bin = rng.random_range(0..severity.max(1));
                        let magnitude = self.magnitude(op, bin, side);
                        let negative = op.signed() && rng.random::<bool>();
                        *slot = Some(OpDraw {
                            op,
                            magnitude: if negative { -magnitude } else { magnitude },
                        });
                    }
                    (share * beta[1], ops)
                });
                AugmentDraw {
                    ops: [None; RAND_AUGMENT_OPS],
                    mix: Some(AugMixDraw {
                        original: beta[0],
                        chains,
                    }),
                }
            }
            Self::ImageNet | Self::Cifar10 | Self::Svhn => {
                let table = match self {
                    Self::ImageNet => &IMAGENET_POLICY,
                    Self::Cifar10 => &CIFAR10_POLICY,
                    _ => &SVHN_POLICY,
                };
                let pair = table[rng.random_range(0..table.len())];
                AugmentDraw {
                    mix: None,
                    ops: pair.map(|(op, probability, bin)| {
                        // torchvision applies an operation when its draw is ≤ the probability.
                        let applied = rng.random::<f32>() <= probability;
                        let negative = rng.random::<bool>();
                        applied.then(|| {
                            let magnitude = bin.map_or(0.0, |bin| self.magnitude(op, bin, side));
                            OpDraw {
                                op,
                                magnitude: if op.signed() && negative {
                                    -magnitude
                                } else {
                                    magnitude
                                },
                            }
                        })
                    }),
                }
            }
        }
    }
}

impl OpDraw {
    /// The operation as it looks to the mirror image: mirroring after it gives what it does
    /// to the mirrored image (shears, shifts and turns reverse; a vertical shear pivots on the
    /// other corner; the rest commute with a mirror).
    pub fn mirrored(self) -> Self {
        let (op, magnitude) = match self.op {
            AugmentOp::ShearX | AugmentOp::TranslateX | AugmentOp::Rotate => {
                (self.op, -self.magnitude)
            }
            AugmentOp::ShearY => (AugmentOp::ShearYFromRight, -self.magnitude),
            AugmentOp::ShearYFromRight => (AugmentOp::ShearY, -self.magnitude),
            op => (op, self.magnitude),
        };
        Self { op, magnitude }
    }
}

impl AugmentDraw {
    /// The draw as it looks to the mirror image ([`OpDraw::mirrored`], operation by
    /// operation): for images the consumer mirrors afterwards, as birdtrain's device does, so
    /// that the result is torchvision's (which mirrors first, then augments).
    pub fn mirrored(self) -> Self {
        let flip = |ops: [Option<OpDraw>; RAND_AUGMENT_OPS]| ops.map(|o| o.map(OpDraw::mirrored));
        Self {
            ops: flip(self.ops),
            mix: self.mix.map(|mix| AugMixDraw {
                chains: mix
                    .chains
                    .map(|(weight, ops)| (weight, ops.map(|o| o.map(OpDraw::mirrored)))),
                ..mix
            }),
        }
    }

    /// Applies the operations to the `side`×`side` packed RGB8 image `rgb` in place.
    pub fn apply(&self, rgb: &mut [u8], side: u32, scratch: &mut AugmentScratch) {
        for op in self.ops.iter().flatten() {
            op.apply(rgb, side, side, &mut scratch.resampled);
        }
        if let Some(mix) = &self.mix {
            mix.apply(rgb, side, scratch);
        }
    }
}

impl AugMixDraw {
    /// torchvision's `AugMix.forward` on a `uint8` image: `f32` sums of the weighted image
    /// and chains, truncated to bytes.
    fn apply(&self, rgb: &mut [u8], side: u32, scratch: &mut AugmentScratch) {
        let AugmentScratch {
            resampled,
            chain,
            sum,
        } = scratch;
        sum.clear();
        sum.extend(rgb.iter().map(|v| self.original * f32::from(*v)));
        for (weight, ops) in &self.chains {
            chain.clear();
            chain.extend_from_slice(rgb);
            for op in ops.iter().flatten() {
                op.apply(chain, side, side, resampled);
            }
            for (s, v) in sum.iter_mut().zip(chain.iter()) {
                *s += weight * f32::from(*v);
            }
        }
        for (v, s) in rgb.iter_mut().zip(sum.iter()) {
            *v = s.clamp(0.0, 255.0) as u8;
        }
    }
}

impl OpDraw {
    /// Applies the operation to the `width`×`height` packed RGB8 image `rgb` in place.
    /// An empty image, or a buffer shorter than `width × height × 3`, is left as it is.
    pub fn apply(&self, rgb: &mut [u8], width: u32, height: u32, scratch: &mut Vec<u8>) {
        let m = self.magnitude;
        let size = (width as usize, height as usize);
        if size.0 == 0 || size.1 == 0 || rgb.len() != size.0 * size.1 * 3 {
            return;
        }
        match self.op {
            AugmentOp::Identity => {}
            AugmentOp::ShearX => affine(rgb, size, scratch, Affine::shear(m, 0.0)),
            AugmentOp::ShearY => affine(rgb, size, scratch, Affine::shear(0.0, m)),
            AugmentOp::ShearYFromRight => {
                affine(rgb, size, scratch, Affine::shear_from_right(m, size))
            }
            // torchvision's `int(magnitude)`: truncated towards zero.
            AugmentOp::TranslateX => shift(rgb, size, m.trunc() as i64, 0),
            AugmentOp::TranslateY => shift(rgb, size, 0, m.trunc() as i64),
            AugmentOp::Rotate => affine(rgb, size, scratch, Affine::rotate(m, size)),
            AugmentOp::Brightness => crate::jitter::brightness(rgb, factor(m).0),
            AugmentOp::Color => {
                let (f, rest) = factor(m);
                crate::jitter::saturation_weighted(rgb, f, rest)
            }
            AugmentOp::Contrast => {
                let (f, rest) = factor(m);
                crate::jitter::contrast_weighted(rgb, f, rest)
            }
            AugmentOp::Sharpness => sharpness(rgb, size, scratch, factor(m)),
            AugmentOp::Posterize => posterize(rgb, m as u32),
            AugmentOp::Solarize => solarize(rgb, m),
            AugmentOp::AutoContrast => autocontrast(rgb),
            AugmentOp::Equalize => equalize(rgb),
            AugmentOp::Invert => rgb.iter_mut().for_each(|v| *v = 255 - *v),
        }
    }
}

/// The blend weights of a colour operation of magnitude `m`: the factor `1 + m` and its
/// complement `1 − (1 + m)`, each rounded to `f32` from the `f64` torchvision computes them in
/// (its magnitudes are Python floats, the image `f32`).
fn factor(m: f32) -> (f32, f32) {
    let f = 1.0 + f64::from(m);
    (f as f32, (1.0 - f) as f32)
}

/// The inverse map of an affine operation: output pixel coordinates (from the top-left
/// corner, pixel centres at +0.5) to input ones, `[a, b, c, d, e, f]` as
/// `(a·x + b·y + c, d·x + e·y + f)`.
#[derive(Debug, Clone, Copy)]
struct Affine([f64; 6]);

impl Affine {
    /// torchvision's `_get_inverse_affine_matrix(center, angle, translate, 1, shear)` with
    /// the angle in degrees as `F.affine` passes it (negated) and shears as angles.
    fn inverse(center: (f64, f64), angle: f64, translate: (f64, f64), shear: (f64, f64)) -> Self {
        let rot = (-angle).to_radians();
        let (sx, sy) = (shear.0.to_radians(), shear.1.to_radians());
        let a = (rot - sy).cos() / sy.cos();
        let b = -(rot - sy).cos() * sx.tan() / sy.cos() - rot.sin();
        let c = (rot - sy).sin() / sy.cos();
        let d = -(rot - sy).sin() * sx.tan() / sy.cos() + rot.cos();
        let mut m = [d, -b, 0.0, -c, a, 0.0];
        let (cx, cy) = center;
        let (tx, ty) = translate;
        m[2] += m[0] * (-cx - tx) + m[1] * (-cy - ty);
        m[5] += m[3] * (-cx - tx) + m[4] * (-cy - ty);
        m[2] += cx;
        m[5] += cy;
        Self(m)
    }

    /// Shear by the tangents `(x, y)` about the top-left corner (torchvision's `ShearX` and
    /// `ShearY`: `shear = degrees(atan(magnitude))`, `center = [0, 0]`).
    fn shear(x: f32, y: f32) -> Self {
        let deg = |t: f32| f64::from(t).atan().to_degrees();
        Self::inverse((0.0, 0.0), 0.0, (0.0, 0.0), (deg(x), deg(y)))
    }

    /// A vertical shear by the tangent `y` about the top-right corner.
    fn shear_from_right(y: f32, (w, _): (usize, usize)) -> Self {
        let deg = f64::from(y).atan().to_degrees();
        Self::inverse((w as f64, 0.0), 0.0, (0.0, 0.0), (0.0, deg))
    }

    /// A counter-clockwise rotation by `degrees` about the image's centre.
    fn rotate(degrees: f32, (w, h): (usize, usize)) -> Self {
        let center = (w as f64 * 0.5, h as f64 * 0.5);
        Self::inverse(center, f64::from(degrees), (0.0, 0.0), (0.0, 0.0))
    }
}

/// Resamples `rgb` (`w`×`h`, packed RGB8) through the inverse map `map` with bilinear
/// weights, taps outside the image black, rounded to the nearest byte: torchvision's
/// `_apply_grid_transform` (its affine grid, then torch's `grid_sample` with zero padding
/// and `align_corners=False`, then the cast back to `uint8`), in its `f32` steps and order,
/// so the bytes agree with its own.
fn affine(rgb: &mut [u8], (w, h): (usize, usize), scratch: &mut Vec<u8>, map: Affine) {
    // torchvision's theta works in coordinates centred on the image: shift the map's origin.
    let (hw, hh) = (w as f64 * 0.5, h as f64 * 0.5);
    let [a, b, c, d, e, f] = map.0;
    let theta = [
        a,
        b,
        a * hw + b * hh + c - hw,
        d,
        e,
        d * hw + e * hh + f - hh,
    ]
    .map(|v| v as f32);
    // `theta.T / [0.5 w, 0.5 h]`: the grid in `grid_sample`'s normalised coordinates.
    let (sw, sh) = (0.5 * w as f32, 0.5 * h as f32);
    let r = [
        [theta[0] / sw, theta[3] / sh],
        [theta[1] / sw, theta[4] / sh],
        [theta[2] / sw, theta[5] / sh],
    ];
    let base =
        |n: usize, i: usize| linspace_f32(-(n as f32) * 0.5 + 0.5, n as f32 * 0.5 - 0.5, n, i);
    let columns: Vec<f32> = (0..w).map(|x| base(w, x)).collect();
    scratch.clear();
    scratch.resize(rgb.len(), 0);
    let (wi, hi) = (w as i32, h as i32);
    // One row's sampling points, computed for the whole row first (the compiler vectorises
    // this pass), then gathered.
    let mut at = vec![(0i32, 0i32, [0f32; 4]); w];
    for (y, row) in scratch.chunks_exact_mut(3 * w).enumerate() {
        let by = base(h, y);
        for (bx, point) in columns.iter().zip(at.iter_mut()) {
            let gx = bx * r[0][0] + by * r[1][0] + r[2][0];
            let gy = bx * r[0][1] + by * r[1][1] + r[2][1];
            // grid_sample's unnormalise (align_corners=False) and bilinear weights, as its
            // CPU kernel computes them.
            let ix = (gx + 1.0) * sw - 0.5;
            let iy = (gy + 1.0) * sh - 0.5;
            let (x0, y0) = (floor(ix), floor(iy));
            let (we, wn) = (ix - x0 as f32, iy - y0 as f32);
            let (ww, ws) = (1.0 - we, 1.0 - wn);
            *point = (x0, y0, [ws * ww, ws * we, wn * ww, wn * we]);
        }
        for (&(x0, y0, weights), out) in at.iter().zip(row.chunks_exact_mut(3)) {
            if x0 >= 0 && y0 >= 0 && x0 < wi - 1 && y0 < hi - 1 {
                // All four taps inside: no checks per tap.
                let nw = 3 * (y0 as usize * w + x0 as usize);
                let taps = [nw, nw + 3, nw + 3 * w, nw + 3 * w + 3];
                for (ch, o) in out.iter_mut().enumerate() {
                    let mut acc = 0f32;
                    for (t, weight) in taps.iter().zip(weights) {
                        acc += f32::from(rgb[t + ch]) * weight;
                    }
                    *o = to_byte(acc);
                }
            } else if x0 >= -1 && y0 >= -1 && x0 < wi && y0 < hi {
                // On the border: taps outside are black (they would add an exact zero).
                let mut acc = [0f32; 3];
                let corners = [(0, 0), (1, 0), (0, 1), (1, 1)];
                for ((dx, dy), weight) in corners.into_iter().zip(weights) {
                    let (tx, ty) = (x0 + dx, y0 + dy);
                    if tx >= 0 && ty >= 0 && tx < wi && ty < hi {
                        let t = 3 * (ty as usize * w + tx as usize);
                        for (ch, a) in acc.iter_mut().enumerate() {
                            *a += f32::from(rgb[t + ch]) * weight;
                        }
                    }
                }
                for (o, v) in out.iter_mut().zip(acc) {
                    *o = to_byte(v);
                }
            }
            // Otherwise every tap is outside: the pixel stays black.
        }
    }
    rgb.copy_from_slice(scratch);
}

/// `v.floor()` as a whole number, without the library call `f32::floor` is on the baseline
/// x86-64 target (a far-off coordinate saturates, and stays outside the image).
#[inline(always)]
fn floor(v: f32) -> i32 {
    let t = v as i32;
    t.saturating_sub(i32::from(t as f32 > v))
}

/// A weighted sum of bytes (in 0..=255, up to rounding) to the nearest byte, ties to even as
/// torch rounds: adding and taking away 2²³ rounds an `f32` below it in the default mode.
#[inline(always)]
fn to_byte(v: f32) -> u8 {
    const MAGIC: f32 = 8_388_608.0;
    ((v.clamp(0.0, 255.0) + MAGIC) - MAGIC) as u8
}

/// `torch.linspace(start, end, steps)[i]` in `f32`: from the start for the first half, from
/// the end for the second, as torch computes it.
fn linspace_f32(start: f32, end: f32, steps: usize, i: usize) -> f32 {
    if steps <= 1 {
        return start;
    }
    let step = (end - start) / (steps - 1) as f32;
    if i < steps / 2 {
        start + step * i as f32
    } else {
        end - step * (steps - 1 - i) as f32
    }
}

/// A shift by whole pixels `(dx, dy)`, the uncovered pixels black: torchvision's `TranslateX`
/// and `TranslateY`. (Its grid lands on whole input pixels up to `f32` rounding, which the
/// rounding to bytes takes away: the same bytes as its resampling, without the resampling.)
fn shift(rgb: &mut [u8], (w, h): (usize, usize), dx: i64, dy: i64) {
    if dx.unsigned_abs() >= w as u64 || dy.unsigned_abs() >= h as u64 {
        rgb.fill(0);
        return;
    }
    let stride = 3 * w;
    // Rows move first, whole (copy_within handles the overlap), then each row's pixels.
    if dy != 0 {
        let rows = h - dy.unsigned_abs() as usize;
        let (from, to) = if dy > 0 {
            (0, dy as usize)
        } else {
            ((-dy) as usize, 0)
        };
        rgb.copy_within(from * stride..(from + rows) * stride, to * stride);
        let blank = if dy > 0 {
            0..to * stride
        } else {
            rows * stride..h * stride
        };
        rgb[blank].fill(0);
    }
    if dx != 0 {
        let cols = 3 * (w - dx.unsigned_abs() as usize);
        let moved = 3 * dx.unsigned_abs() as usize;
        for row in rgb.chunks_exact_mut(stride) {
            if dx > 0 {
                row.copy_within(0..cols, moved);
                row[..moved].fill(0);
            } else {
                row.copy_within(moved.., 0);
                row[cols..].fill(0);
            }
        }
    }
}

/// torchvision's `adjust_sharpness`: a blend with the image blurred by
/// `[1 1 1; 1 5 1; 1 1 1]/13` (rounded; the border kept), truncated.
fn sharpness(rgb: &mut [u8], (w, h): (usize, usize), scratch: &mut Vec<u8>, (f, rest): (f32, f32)) {
    if f == 1.0 || w < 3 || h < 3 {
        // An image without an interior is its own blur: the blend leaves it unchanged.
        return;
    }
    scratch.clear();
    scratch.extend_from_slice(rgb);
    let blurred = scratch;
    let stride = 3 * w;
    for y in 1..h - 1 {
        let (up, mid, down) = (
            &rgb[(y - 1) * stride..y * stride],
            &rgb[y * stride..(y + 1) * stride],
            &rgb[(y + 1) * stride..(y + 2) * stride],
        );
        let out = &mut blurred[y * stride..(y + 1) * stride];
        for i in 3..stride - 3 {
            let three =
                |row: &[u8]| u32::from(row[i - 3]) + u32::from(row[i]) + u32::from(row[i + 3]);
            let sum = three(up) + three(mid) + 4 * u32::from(mid[i]) + three(down);
            // round(sum / 13): a whole sum over 13 is never a tie, so this is torch's
            // rounding of its f32 convolution.
            out[i] = ((2 * sum + 13) / 26) as u8;
        }
    }
    for (v, g) in rgb.iter_mut().zip(blurred.iter()) {
        *v = (f * f32::from(*v) + rest * f32::from(*g)).clamp(0.0, 255.0) as u8;
    }
}

/// torchvision's `posterize`: the top `bits` bits of every byte.
fn posterize(rgb: &mut [u8], bits: u32) {
    let mask = if bits >= 8 { 0xff } else { !(0xffu8 >> bits) };
    rgb.iter_mut().for_each(|v| *v &= mask);
}

/// torchvision's `solarize`: bytes at or above `threshold` inverted.
fn solarize(rgb: &mut [u8], threshold: f32) {
    rgb.iter_mut()
        .filter(|v| f32::from(**v) >= threshold)
        .for_each(|v| *v = 255 - *v);
}

/// torchvision's `autocontrast`: each channel's range stretched to 0..=255 (a flat channel
/// left as it is), truncated.
fn autocontrast(rgb: &mut [u8]) {
    for ch in 0..3 {
        let channel = || rgb.iter().skip(ch).step_by(3);
        let (lo, hi) = (
            channel().copied().min().unwrap_or(0),
            channel().copied().max().unwrap_or(0),
        );
        if lo == hi {
            continue;
        }
        let scale = 255.0 / f32::from(hi - lo);
        let table: [u8; 256] =
            std::array::from_fn(|v| ((v as f32 - f32::from(lo)) * scale).clamp(0.0, 255.0) as u8);
        rgb.iter_mut()
            .skip(ch)
            .step_by(3)
            .for_each(|v| *v = table[usize::from(*v)]);
    }
}

/// torchvision's `equalize` (PIL's `ImageOps.equalize`) of each channel: the step is the
/// count of all pixels but those of the highest level present, over 255; each level maps to
/// the pixels below it plus half a step, in steps. A step of 0 leaves the channel.
fn equalize(rgb: &mut [u8]) {
    for ch in 0..3 {
        let mut hist = [0u64; 256];
        rgb.iter()
            .skip(ch)
            .step_by(3)
            .for_each(|v| hist[usize::from(*v)] += 1);
        let last = hist.iter().rposition(|&n| n != 0).unwrap_or(0);
        let step = hist[..last].iter().sum::<u64>() / 255;
        if step == 0 {
            continue;
        }
        let mut table = [0u8; 256];
        let mut below = 0u64;
        for (level, n) in hist.iter().enumerate() {
            table[level] = ((below + step / 2) / step).min(255) as u8;
            below += n;
        }
        rgb.iter_mut()
            .skip(ch)
            .step_by(3)
            .for_each(|v| *v = table[usize::from(*v)]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(side: usize, seed: u64) -> Vec<u8> {
        use rand::SeedableRng;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..side * side * 3).map(|_| rng.random::<u8>()).collect()
    }

    fn applied(op: AugmentOp, magnitude: f32, rgb: &[u8], side: u32) -> Vec<u8> {
        let mut out = rgb.to_vec();
        OpDraw { op, magnitude }.apply(&mut out, side, side, &mut Vec::new());
        out
    }

    #[test]
    fn the_bins_are_torchvisions() {
        let ta = AutoAugment::TrivialAugmentWide;
        let ra = AutoAugment::RAND_AUGMENT;
        // TrivialAugmentWide: posterize 8 bits down to 2, solarize 255 down to 0.
        assert_eq!(ta.magnitude(AugmentOp::Posterize, 0, 224), 8.0);
        assert_eq!(ta.magnitude(AugmentOp::Posterize, 30, 224), 2.0);
        // round(3 / 5) = 1 (0.6), round(15 / 5) = 3.
        assert_eq!(ta.magnitude(AugmentOp::Posterize, 3, 224), 7.0);
        assert_eq!(ta.magnitude(AugmentOp::Posterize, 15, 224), 5.0);
        assert_eq!(ra.magnitude(AugmentOp::Posterize, 30, 224), 4.0);
        // RandAugment's bin 9: 8 − round(9 / 7.5) = 7.
        assert_eq!(ra.magnitude(AugmentOp::Posterize, 9, 224), 7.0);
        assert_eq!(ta.magnitude(AugmentOp::Solarize, 0, 224), 255.0);
        assert_eq!(ta.magnitude(AugmentOp::Solarize, 30, 224), 0.0);
        assert_eq!(ta.magnitude(AugmentOp::Rotate, 30, 224), 135.0);
        assert_eq!(ta.magnitude(AugmentOp::TranslateX, 30, 224), 32.0);
        assert!((ra.magnitude(AugmentOp::TranslateY, 30, 331) - 150.0).abs() < 1e-3);
        assert!((ra.magnitude(AugmentOp::Rotate, 9, 224) - 9.0).abs() < 1e-5);
        assert!((ra.magnitude(AugmentOp::Brightness, 9, 224) - 0.27).abs() < 1e-6);
        assert_eq!(ta.magnitude(AugmentOp::Equalize, 17, 224), 0.0);
    }

    #[test]
    fn draws_cover_every_operation_and_depend_on_seed_epoch_and_sample() {
        let ta = AutoAugment::TrivialAugmentWide;
        let mut seen = std::collections::HashSet::new();
        let (mut negative, mut positive) = (0, 0);
        for id in 0..2000 {
            let draw = ta.draw(1, 0, id, 224);
            assert_eq!(
                draw,
                ta.draw(1, 0, id, 224),
                "a draw is a function of its inputs"
            );
            assert!(
                draw.ops[1].is_none(),
                "TrivialAugment applies one operation"
            );
            let op = draw.ops[0].unwrap();
            seen.insert(op.op);
            if op.op == AugmentOp::Rotate {
                assert!(op.magnitude.abs() <= 135.0);
                if op.magnitude < 0.0 {
                    negative += 1;
                } else {
                    positive += 1;
                }
            }
            if !op.op.signed() {
                assert!(op.magnitude >= 0.0, "{op:?}");
            }
        }
        assert_eq!(seen.len(), 14, "all 14 operations are drawn: {seen:?}");
        assert!(negative > 40 && positive > 40, "{negative} {positive}");
        let differs = |other: &dyn Fn(u64) -> AugmentDraw| {
            (0..50)
                .filter(|&id| other(id) != ta.draw(1, 0, id, 224))
                .count()
                > 40
        };
        assert!(differs(&|id| ta.draw(2, 0, id, 224)), "seed");
        assert!(differs(&|id| ta.draw(1, 1, id, 224)), "epoch");
        assert!(differs(&|id| ta.draw(1, 0, id + 1000, 224)), "sample");
    }

    #[test]
    fn rand_augment_applies_two_operations_at_its_bin() {
        let ra = AutoAugment::RandAugment { magnitude: 30 };
        for id in 0..300 {
            let draw = ra.draw(5, 2, id, 224);
            for op in draw.ops.map(Option::unwrap) {
                let want = ra.magnitude(op.op, 30, 224);
                assert_eq!(op.magnitude.abs(), want, "{op:?}");
            }
        }
    }

    #[test]
    fn auto_augment_applies_its_policys_pairs() {
        for (policy, table) in [
            (AutoAugment::ImageNet, &IMAGENET_POLICY),
            (AutoAugment::Cifar10, &CIFAR10_POLICY),
            (AutoAugment::Svhn, &SVHN_POLICY),
        ] {
            let mut applied = [0usize; 2];
            let mut signs = std::collections::HashSet::new();
            let draws = 4000;
            for id in 0..draws {
                let draw = policy.draw(3, 1, id, 32);
                // Every applied operation is its pair's, at its bin, in its place.
                let fits = table.iter().any(|pair| {
                    pair.iter()
                        .zip(draw.ops)
                        .all(|(&(op, p, bin), drawn)| match drawn {
                            None => p < 1.0,
                            Some(d) => {
                                let want = bin.map_or(0.0, |b| policy.magnitude(op, b, 32));
                                p > 0.0 && d.op == op && d.magnitude.abs() == want
                            }
                        })
                });
                assert!(fits, "{policy:?} drew {draw:?}, no pair of its policy");
                for (n, op) in applied.iter_mut().zip(draw.ops) {
                    *n += usize::from(op.is_some());
                }
                for op in draw.ops.iter().flatten().filter(|o| o.magnitude != 0.0) {
                    signs.insert((op.op, op.magnitude > 0.0));
                }
            }
            // Every signed operation of the table with a strength shows both signs.
            for op in table
                .iter()
                .flatten()
                .filter(|(op, p, bin)| op.signed() && *p > 0.0 && bin.is_some_and(|b| b > 0))
            {
                for positive in [true, false] {
                    assert!(
                        signs.contains(&(op.0, positive)),
                        "{policy:?} {:?} {positive}",
                        op.0
                    );
                }
            }
            // Each place is applied with its pairs' mean probability.
            for (place, n) in applied.iter().enumerate() {
                let p: f32 = table.iter().map(|pair| pair[place].1).sum::<f32>() / 25.0;
                let share = *n as f32 / draws as f32;
                assert!(
                    (share - p).abs() < 0.04,
                    "{policy:?} place {place}: {share} vs {p}"
                );
            }
        }
    }

    #[test]
    fn augmix_blends_three_chains_of_its_operations() {
        for severity in [1, 3, 10] {
            let policy = AutoAugment::AugMix { severity };
            let mut depths = std::collections::HashSet::new();
            for id in 0..500 {
                let draw = policy.draw(8, 0, id, 64);
                assert!(draw.ops.iter().all(Option::is_none));
                let mix = draw.mix.expect("AugMix draws a blend");
                let total = mix.original + mix.chains.iter().map(|c| c.0).sum::<f32>();
                assert!((total - 1.0).abs() < 1e-5, "weights sum to {total}");
                assert!(mix.original >= 0.0 && mix.chains.iter().all(|c| c.0 >= 0.0));
                for (_, ops) in mix.chains {
                    let depth = ops.iter().take_while(|o| o.is_some()).count();
                    assert!(ops[depth..].iter().all(Option::is_none), "{ops:?}");
                    depths.insert(depth);
                    for op in ops.iter().flatten() {
                        assert!(AUGMIX_OPS.contains(&op.op), "{op:?}");
                        let fits = (0..severity)
                            .any(|bin| policy.magnitude(op.op, bin, 64) == op.magnitude.abs());
                        assert!(fits, "{op:?} is beyond severity {severity}");
                    }
                }
            }
            assert_eq!(depths, [1, 2, 3].into(), "chains of 1 to 3 operations");
        }
        // The blend: 0.25 of the image, 0.75 of a chain that posterizes to 0 bits (black).
        let rgb = image(5, 3);
        let black = Some(OpDraw {
            op: AugmentOp::Posterize,
            magnitude: 0.0,
        });
        let none = [None; AUGMIX_DEPTH];
        let draw = AugmentDraw {
            ops: [None; RAND_AUGMENT_OPS],
            mix: Some(AugMixDraw {
                original: 0.25,
                chains: [(0.75, [black, None, None]), (0.0, none), (0.0, none)],
            }),
        };
        let mut out = rgb.clone();
        draw.apply(&mut out, 5, &mut AugmentScratch::default());
        for (o, v) in out.iter().zip(&rgb) {
            assert_eq!(*o, (0.25 * f32::from(*v)) as u8);
        }
    }

    #[test]
    fn an_impossible_bin_names_the_flag() {
        let err = AutoAugment::RandAugment { magnitude: 31 }
            .validate()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--ra-magnitude") && err.contains("31"),
            "{err}"
        );
        AutoAugment::RandAugment { magnitude: 30 }
            .validate()
            .unwrap();
        assert_eq!(
            AutoAugment::parse("TA-Wide"),
            Some(Some(AutoAugment::TrivialAugmentWide))
        );
        assert_eq!(AutoAugment::parse("none"), Some(None));
        assert_eq!(
            AutoAugment::parse("augmix"),
            Some(Some(AutoAugment::AUGMIX))
        );
        assert_eq!(AutoAugment::parse("cutout"), None);
        for severity in [0, 11] {
            let err = AutoAugment::AugMix { severity }
                .validate()
                .unwrap_err()
                .to_string();
            assert!(err.contains("--augmix-severity"), "{err}");
        }
    }

    #[test]
    fn the_geometric_operations_move_pixels_as_named() {
        let side = 8usize;
        let rgb = image(side, 1);
        let at = |img: &[u8], x: usize, y: usize| {
            img[3 * (y * side + x)..3 * (y * side + x) + 3].to_vec()
        };
        // A shift right by 2 whole pixels: column x comes from column x − 2, the first two black.
        let moved = applied(AugmentOp::TranslateX, 2.9, &rgb, side as u32);
        for y in 0..side {
            for x in 0..side {
                let want = if x < 2 {
                    vec![0; 3]
                } else {
                    at(&rgb, x - 2, y)
                };
                assert_eq!(at(&moved, x, y), want, "({x}, {y})");
            }
        }
        let up = applied(AugmentOp::TranslateY, -3.0, &rgb, side as u32);
        assert_eq!(at(&up, 4, 0), at(&rgb, 4, 3));
        assert_eq!(at(&up, 4, side - 1), vec![0; 3]);
        // A half turn about the centre of an even square maps pixel centres onto pixel centres.
        let turned = applied(AugmentOp::Rotate, 180.0, &rgb, side as u32);
        for y in 0..side {
            for x in 0..side {
                assert_eq!(at(&turned, x, y), at(&rgb, side - 1 - x, side - 1 - y));
            }
        }
        // A quarter turn counter-clockwise: the top row becomes the left column, reversed.
        let quarter = applied(AugmentOp::Rotate, 90.0, &rgb, side as u32);
        for x in 0..side {
            assert_eq!(at(&quarter, 0, side - 1 - x), at(&rgb, x, 0));
        }
        // A shear about the top-left corner keeps the top row (its pixel centres move by half
        // the tangent, which the bilinear weights blend), and 0 is the identity.
        assert_eq!(applied(AugmentOp::ShearX, 0.0, &rgb, side as u32), rgb);
        assert_eq!(applied(AugmentOp::Rotate, 0.0, &rgb, side as u32), rgb);
        let sheared = applied(AugmentOp::ShearY, 0.5, &rgb, side as u32);
        assert_ne!(sheared, rgb);
    }

    #[test]
    fn a_whole_pixel_shift_is_the_resampled_translation() {
        // The shortcut against the grid it replaces, over shifts past the edge, both signs,
        // and an odd side.
        for side in [7usize, 16] {
            let rgb = image(side, 9);
            for t in [-20i64, -7, -3, -1, 0, 1, 2, 6, 15, 40] {
                for (dx, dy) in [(t, 0), (0, t), (t, -t / 2)] {
                    let mut fast = rgb.clone();
                    shift(&mut fast, (side, side), dx, dy);
                    let mut slow = rgb.clone();
                    let map = Affine::inverse((0.0, 0.0), 0.0, (dx as f64, dy as f64), (0.0, 0.0));
                    affine(&mut slow, (side, side), &mut Vec::new(), map);
                    assert_eq!(fast, slow, "side {side} shift ({dx}, {dy})");
                }
            }
        }
    }

    #[test]
    fn absurd_magnitudes_give_an_image_not_a_panic() {
        // OpDraw is public: magnitudes far outside the policies' ranges must still give bytes.
        let rgb = image(9, 4);
        for op in AugmentOp::ALL.into_iter().chain([AugmentOp::Invert]) {
            for magnitude in [1e30, -1e30, f32::NAN, f32::INFINITY, 1e9, -77.0] {
                let out = applied(op, magnitude, &rgb, 9);
                assert_eq!(out.len(), rgb.len(), "{op:?} {magnitude}");
            }
        }
    }

    /// `rgb` (`side`×`side`) mirrored left to right.
    fn mirror(rgb: &[u8], side: usize) -> Vec<u8> {
        rgb.chunks_exact(3 * side)
            .flat_map(|row| row.chunks_exact(3).rev().flatten().copied())
            .collect()
    }

    #[test]
    fn a_mirrored_draw_then_the_mirror_is_the_mirror_then_the_draw() {
        // What the device's later mirror needs: mirror(op.mirrored()(x)) = op(mirror(x)).
        for side in [9usize, 16] {
            let rgb = image(side, 12);
            let flipped = mirror(&rgb, side);
            for op in AugmentOp::ALL.into_iter().chain([AugmentOp::Invert]) {
                // Shear tangents within the policies' ±0.99; shifts and turns in pixels, degrees.
                let geometric = [3.0, -7.0, 30.0, -135.0];
                let magnitudes = match op {
                    AugmentOp::TranslateX | AugmentOp::TranslateY | AugmentOp::Rotate => geometric,
                    _ => [0.4f32, -0.9, 0.99, -0.2],
                };
                for magnitude in magnitudes {
                    let draw = OpDraw { op, magnitude };
                    let want = applied(op, magnitude, &flipped, side as u32);
                    let m = draw.mirrored();
                    let got = mirror(&applied(m.op, m.magnitude, &rgb, side as u32), side);
                    let differ: Vec<i32> = got
                        .iter()
                        .zip(&want)
                        .map(|(g, w)| (i32::from(*g) - i32::from(*w)).abs())
                        .filter(|d| *d > 0)
                        .collect();
                    // The resampling grid is mirror-symmetric up to f32 rounding, which can
                    // tip a byte that sits on a half by one; tangents such as 0.2 put many
                    // taps at weight ½ exactly, so up to a tenth of the bytes can be ties.
                    let worst = differ.iter().max().copied().unwrap_or(0);
                    assert!(
                        worst <= 1 && differ.len() * 10 <= got.len(),
                        "{op:?} {magnitude} side {side}: {} bytes differ, worst {worst}",
                        differ.len()
                    );
                    assert_eq!(m.mirrored(), draw, "mirroring twice is the draw");
                }
            }
        }
        // A whole draw, AugMix's chains included.
        let policy = AutoAugment::AugMix { severity: 10 };
        for id in 0..20 {
            let draw = policy.draw(1, 0, id, 16);
            let rgb = image(16, id);
            let mut want = mirror(&rgb, 16);
            draw.apply(&mut want, 16, &mut AugmentScratch::default());
            let mut got = rgb.clone();
            draw.mirrored()
                .apply(&mut got, 16, &mut AugmentScratch::default());
            let got = mirror(&got, 16);
            let far = got
                .iter()
                .zip(&want)
                .filter(|(g, w)| g.abs_diff(**w) > 1)
                .count();
            assert_eq!(far, 0, "AugMix draw {id}");
        }
    }

    #[test]
    fn the_colour_operations_follow_their_formulas() {
        let rgb = image(6, 2);
        let posterized = applied(AugmentOp::Posterize, 3.0, &rgb, 6);
        assert!(posterized
            .iter()
            .zip(&rgb)
            .all(|(p, v)| *p == v & 0b1110_0000));
        assert_eq!(applied(AugmentOp::Posterize, 8.0, &rgb, 6), rgb);
        let solarized = applied(AugmentOp::Solarize, 128.0, &rgb, 6);
        for (s, v) in solarized.iter().zip(&rgb) {
            assert_eq!(*s, if *v >= 128 { 255 - v } else { *v });
        }
        assert_eq!(applied(AugmentOp::Solarize, 255.5, &rgb, 6), rgb);
        // Autocontrast: every channel spans 0..=255 afterwards.
        let dull: Vec<u8> = rgb.iter().map(|v| 100 + v / 4).collect();
        let stretched = applied(AugmentOp::AutoContrast, 0.0, &dull, 6);
        for ch in 0..3 {
            let c: Vec<u8> = stretched.iter().skip(ch).step_by(3).copied().collect();
            assert_eq!((c.iter().min(), c.iter().max()), (Some(&0), Some(&255)));
        }
        // A flat image is left as it is by both histogram operations.
        let flat = vec![77u8; 6 * 6 * 3];
        assert_eq!(applied(AugmentOp::AutoContrast, 0.0, &flat, 6), flat);
        assert_eq!(applied(AugmentOp::Equalize, 0.0, &flat, 6), flat);
        // Sharpness 1 + 0 and brightness 1 + 0 are the identity; sharpness keeps the border.
        assert_eq!(applied(AugmentOp::Sharpness, 0.0, &rgb, 6), rgb);
        let sharp = applied(AugmentOp::Sharpness, 0.9, &rgb, 6);
        assert_eq!(&sharp[..18], &rgb[..18], "the top row is kept");
        assert_ne!(sharp, rgb);
        assert_eq!(applied(AugmentOp::Brightness, 0.0, &rgb, 6), rgb);
    }

    #[test]
    fn equalize_is_pils_rule() {
        // One channel with levels 10 (4 pixels), 20 (4), 30 (248): step = 8 / 255 = 0, so
        // unchanged; with 255 pixels of 10, 255 of 20 and 2 of 30: step = 510 / 255 = 2.
        let mut rgb = Vec::new();
        for (level, n) in [(10u8, 255), (20, 255), (30, 2)] {
            for _ in 0..n {
                rgb.extend([level, level, level]);
            }
        }
        // Level 10 maps to (0 + 1) / 2 = 0, 20 to (255 + 1) / 2 = 128, 30 to (510 + 1) / 2 = 255.
        let mut out = rgb.clone();
        let equalize = OpDraw {
            op: AugmentOp::Equalize,
            magnitude: 0.0,
        };
        equalize.apply(&mut out, 512, 1, &mut Vec::new());
        let levels: std::collections::BTreeSet<u8> = out.iter().copied().collect();
        assert_eq!(levels.into_iter().collect::<Vec<_>>(), vec![0, 128, 255]);
    }

    /// Bytes torchvision 0.14's `_apply_op` gave (uint8 tensors, bilinear, no fill;
    /// `pipeline/tests/engine/torchvision_autoaugment.py`), so the check runs where torchvision is
    /// absent; `tests/engine/auto_augment.rs` compares every operation on larger images where it is
    /// present.
    #[test]
    fn operations_reproduce_torchvisions_bytes() {
        let input: [u8; 108] = [
            165, 77, 202, 24, 37, 48, 187, 29, 109, 19, 44, 222, 214, 35, 123, 46, 217, 30, 63,
            114, 31, 203, 25, 113, 23, 68, 148, 214, 73, 60, 157, 92, 52, 96, 190, 49, 32, 30, 105,
            254, 218, 160, 238, 232, 185, 153, 127, 92, 124, 41, 153, 253, 175, 229, 147, 37, 60,
            214, 84, 175, 77, 250, 215, 20, 39, 160, 174, 179, 254, 233, 35, 47, 138, 242, 33, 31,
            158, 228, 145, 197, 177, 11, 236, 181, 86, 59, 252, 30, 111, 147, 66, 126, 203, 200,
            254, 41, 85, 229, 205, 142, 70, 220, 142, 212, 183, 194, 118, 77,
        ];
        let sharpness: [u8; 108] = [
            165, 77, 202, 24, 37, 48, 187, 29, 109, 19, 44, 222, 214, 35, 123, 46, 217, 30, 63,
            114, 31, 237, 0, 108, 0, 54, 158, 246, 68, 27, 164, 82, 22, 96, 190, 49, 32, 30, 105,
            255, 255, 173, 255, 255, 203, 163, 129, 65, 107, 9, 168, 253, 175, 229, 147, 37, 60,
            249, 46, 187, 52, 255, 234, 0, 0, 147, 199, 211, 255, 233, 35, 47, 138, 242, 33, 0,
            149, 255, 165, 211, 176, 0, 255, 169, 72, 30, 255, 30, 111, 147, 66, 126, 203, 200,
            254, 41, 85, 229, 205, 142, 70, 220, 142, 212, 183, 194, 118, 77,
        ];
        let rotate: [u8; 108] = [
            10, 3, 7, 65, 21, 94, 91, 44, 179, 161, 93, 74, 104, 179, 61, 16, 15, 13, 36, 35, 51,
            113, 46, 124, 173, 71, 82, 156, 78, 90, 191, 116, 188, 143, 65, 86, 133, 60, 85, 161,
            101, 142, 188, 175, 149, 116, 96, 127, 168, 149, 228, 167, 66, 94, 58, 65, 87, 237,
            186, 160, 146, 223, 199, 41, 127, 178, 69, 132, 217, 81, 97, 196, 56, 20, 47, 173, 65,
            112, 114, 155, 201, 119, 204, 179, 85, 145, 203, 135, 190, 177, 12, 10, 4, 132, 214,
            34, 102, 197, 142, 120, 232, 156, 68, 83, 125, 12, 11, 17,
        ];
        let shear: [u8; 108] = [
            132, 62, 162, 10, 15, 19, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 83, 107, 65, 96, 32, 74,
            187, 29, 109, 11, 26, 133, 43, 7, 25, 0, 0, 0, 38, 47, 90, 223, 102, 132, 23, 68, 148,
            136, 61, 125, 203, 46, 109, 37, 174, 24, 124, 36, 69, 238, 164, 166, 238, 232, 185,
            177, 105, 79, 150, 82, 72, 86, 195, 45, 140, 201, 38, 141, 114, 196, 77, 250, 215, 73,
            74, 133, 134, 69, 173, 222, 178, 193, 80, 149, 169, 99, 196, 153, 145, 197, 177, 15,
            157, 173, 156, 155, 254, 237, 63, 83,
        ];
        for (op, magnitude, want) in [
            (AugmentOp::Sharpness, 0.7, sharpness),
            (AugmentOp::Rotate, 30.0, rotate),
            (AugmentOp::ShearY, -0.4, shear),
        ] {
            assert_eq!(
                applied(op, magnitude, &input, 6),
                want,
                "{op:?} {magnitude}"
            );
        }
        // The histogram operations need more pixels: a 24×24 pattern, its first row.
        let pattern: Vec<u8> = (0..24u32 * 24)
            .flat_map(|i| {
                let (y, x) = (i / 24, i % 24);
                [
                    (x * 5 + y * 3) % 97 + 40,
                    (x * x + y) % 61 + 100,
                    (x * y) % 50,
                ]
                .map(|v| v as u8)
            })
            .collect();
        let equalize: [u8; 72] = [
            0, 0, 0, 13, 5, 0, 27, 21, 0, 42, 46, 0, 57, 81, 0, 73, 135, 0, 89, 186, 0, 105, 237,
            0, 121, 16, 0, 136, 105, 0, 152, 198, 0, 168, 255, 0, 184, 117, 0, 200, 229, 0, 216,
            65, 0, 231, 210, 0, 245, 60, 0, 255, 222, 0, 255, 99, 0, 255, 255, 0, 8, 177, 0, 21,
            70, 0, 36, 255, 0, 51, 206, 0,
        ];
        let autocontrast: [u8; 72] = [
            0, 0, 0, 13, 4, 0, 26, 17, 0, 39, 38, 0, 53, 68, 0, 66, 106, 0, 79, 153, 0, 92, 208, 0,
            106, 12, 0, 119, 85, 0, 132, 165, 0, 146, 255, 0, 159, 93, 0, 172, 199, 0, 185, 55, 0,
            199, 178, 0, 212, 51, 0, 225, 191, 0, 239, 80, 0, 252, 238, 0, 7, 144, 0, 21, 59, 0,
            34, 242, 0, 47, 174, 0,
        ];
        for (op, want) in [
            (AugmentOp::Equalize, equalize),
            (AugmentOp::AutoContrast, autocontrast),
        ] {
            assert_eq!(applied(op, 0.0, &pattern, 24)[..72], want, "{op:?}");
        }
    }
}
