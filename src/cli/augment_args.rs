//! The augmentation flags of `train` and `bench pipeline`, declared once: the engine's
//! recorded settings ([`EngineArgs`]: store size, resize mode, colour jitter) and the flags
//! that pick the crop and the automatic augmentation.

use clap::Args;

use super::choice::{choice, AugmentWord, PolicyWord};
use super::settings_args::EngineArgs;
use super::CliError;
use crate::train::Augmentation;

/// The augmentation flags shared by `train` and `bench pipeline`.
#[derive(Debug, Clone, Default, PartialEq, Args)]
pub struct AugmentArgs {
    /// The input engine's recorded settings.
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Training augmentation: pad-crop (shift by up to S/8 and mirror, the CIFAR recipe; the
    /// default of training), resized-crop (torchvision's RandomResizedCrop of the stored
    /// image and mirror, the ImageNet recipe) or none (the default of bench pipeline, which
    /// takes none or resized-crop).
    #[arg(long, value_name = "KIND", help_heading = "Augmentation", value_parser = choice::<AugmentWord>(), ignore_case = true)]
    pub augment: Option<AugmentWord>,
    /// With --augment resized-crop: the least share of the image's area a crop covers
    /// [default: 0.08, torchvision's]
    #[arg(long, value_name = "MIN", help_heading = "Augmentation")]
    pub crop_scale: Option<f32>,
    /// Automatic augmentation of training images, after the crop and before the colour
    /// jitter: ta_wide (torchvision's TrivialAugmentWide, one of 14 operations per image at a
    /// random strength; its ResNet-50 recipe's), ra (RandAugment, two operations at the
    /// --ra-magnitude strength), augmix (AugMix: the image blended with three chains of
    /// operations), imagenet, cifar10 or svhn (AutoAugment's learned policies) or none
    /// (torchvision's --auto-augment) [default: none]
    #[arg(long, value_name = "POLICY", help_heading = "Augmentation", value_parser = choice::<PolicyWord>(), ignore_case = true)]
    pub auto_augment: Option<PolicyWord>,
    /// With --auto-augment ra: the strength of every operation, a bin from 0 to 30
    /// (torchvision's --ra-magnitude) [default: 9]
    #[arg(long, value_name = "M", help_heading = "Augmentation")]
    pub ra_magnitude: Option<u32>,
    /// With --auto-augment augmix: the operations' strength, 1 to 10 (torchvision's
    /// --augmix-severity) [default: 3]
    #[arg(long, value_name = "S", help_heading = "Augmentation")]
    pub augmix_severity: Option<u32>,
}

impl AugmentArgs {
    /// The policy: `--auto-augment`'s (or `current` when it is absent or names the same
    /// policy, which keeps a resumed run's strength), with `--ra-magnitude` and
    /// `--augmix-severity` applied; either without its policy is an error naming it.
    pub(crate) fn policy(
        &self,
        current: Option<pipeline::AutoAugment>,
    ) -> Result<Option<pipeline::AutoAugment>, CliError> {
        let mut policy = current;
        if let Some(PolicyWord(named)) = self.auto_augment {
            let same = named.map(|p| p.as_str()) == current.map(|p| p.as_str());
            if !same {
                policy = named;
            }
        }
        if let Some(m) = self.ra_magnitude {
            let Some(pipeline::AutoAugment::RandAugment { magnitude }) = &mut policy else {
                return Err(CliError::BadValue {
                    flag: "--ra-magnitude",
                    value: m.to_string(),
                    hint: "it sets RandAugment's strength: add --auto-augment ra".into(),
                });
            };
            *magnitude = m;
        }
        if let Some(n) = self.augmix_severity {
            let Some(pipeline::AutoAugment::AugMix { severity }) = &mut policy else {
                return Err(CliError::BadValue {
                    flag: "--augmix-severity",
                    value: n.to_string(),
                    hint: "it sets AugMix's strength: add --auto-augment augmix".into(),
                });
            };
            *severity = n;
        }
        Ok(policy)
    }

    /// The augmentation: `--augment`'s kind (or `current`), its resized crop's least share
    /// from `--crop-scale`, which is an error with another kind.
    pub(crate) fn augmentation(&self, current: Augmentation) -> Result<Augmentation, CliError> {
        let mut augmentation = self.augment.map_or(current, |AugmentWord(a)| a);
        if let Some(min) = self.crop_scale {
            let Augmentation::ResizedCrop(crop) = &mut augmentation else {
                return Err(CliError::BadValue {
                    flag: "--crop-scale",
                    value: min.to_string(),
                    hint: format!(
                        "it sets the resized crop, and this run's augmentation is {}: add --augment resized-crop",
                        augmentation.as_str()
                    ),
                });
            };
            crop.scale.0 = min;
        }
        Ok(augmentation)
    }
}
