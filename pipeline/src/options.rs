//! The small enums that configure the engine, each parseable from its command-line spelling.

use std::fmt;
use std::str::FromStr;

use crate::PipelineError;

macro_rules! cli_enum {
    ($(#[$meta:meta])* $name:ident, $flag:literal, $hint:literal, { $($(#[$vmeta:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
        pub enum $name {
            $($(#[$vmeta])* $variant),+
        }

        impl $name {
            /// Every value's command-line spelling, in declaration order.
            pub const NAMES: &'static [&'static str] = &[$($text),+];

            /// The command-line spelling of this value.
            pub fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $text),+ }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = PipelineError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s.trim().to_ascii_lowercase().as_str() {
                    $($text => Ok(Self::$variant),)+
                    _ => Err(PipelineError::InvalidSetting { name: $flag, value: s.to_string(), hint: $hint }),
                }
            }
        }
    };
}

cli_enum!(
    /// A split of an image-folder dataset.
    Split, "--split", "expected train, valid or test", {
        /// `train/`
        #[default]
        Train => "train",
        /// `valid/`
        Valid => "valid",
        /// `test/`
        Test => "test",
    }
);

cli_enum!(
    /// How an image becomes the stored `S×S` square.
    ResizeMode, "--resize-mode", "expected direct or center-crop", {
        /// Stretch the whole image to `S×S` (Keras' `image_dataset_from_directory`).
        #[default]
        Direct => "direct",
        /// Take the centred square of side `min(w, h)` and scale it to `S×S`.
        ShorterSideCenterCrop => "center-crop",
    }
);

cli_enum!(
    /// How an epoch's order of samples is drawn (`--sampler`).
    Sampling, "--sampler", "expected shuffle or balanced", {
        /// Every sample once per epoch, in a fresh random order (or in file order without
        /// shuffling).
        #[default]
        Shuffle => "shuffle",
        /// As many draws as samples, with replacement, each sample's chance inversely
        /// proportional to its class's size, so every class is drawn equally often on
        /// average (PyTorch's `WeightedRandomSampler` with weights `1 / class count`).
        /// Always random, whatever the shuffle setting.
        Balanced => "balanced",
    }
);

cli_enum!(
    /// What happens to the last, incomplete global batch of an epoch.
    LastBatch, "--last-batch", "expected partial, drop or pad", {
        /// Yield it, split as evenly as possible over replicas (some may get 0 images).
        #[default]
        Partial => "partial",
        /// Skip it (a split smaller than one global batch then has no step at all).
        Drop => "drop",
        /// Fill it up by wrapping around to the start of the epoch's permutation.
        Pad => "pad",
    }
);

cli_enum!(
    /// What a corrupt, truncated, empty, unreadable or non-image file does.
    OnBadImage, "--on-bad-image", "expected skip or fail", {
        /// Log a warning naming it, count it, list it in the report, go on without it.
        #[default]
        Skip => "skip",
        /// Stop with an error naming it.
        Fail => "fail",
    }
);
