//! The training settings a checkpoint records (`checkpoint.json`'s `settings`), each declared
//! once in the table of the `recorded_settings!` macro.
//!
//! A row of the table is one setting: its documentation (the record field's doc and the
//! flag's `--help` text), how the record reads it from an older checkpoint (serde), its field
//! and type, the default of a new run, and (for a setting the user sets by a flag of its
//! own) the flag's value type, help heading, value name and its rule on `--resume`:
//! `keep` (a flag given again overrides the checkpoint's value), `warn` (it overrides, and
//! the run says so when the value differs) or `fixed` (it must match the checkpoint's:
//! `crate::train::check_resumed` refuses another). [`RunSettings`], its defaults and its
//! field list come from this table here; the command line builds its flags, their printed
//! defaults and the override on resume from the same table (`crate::cli`), so adding a
//! recorded setting is one row (and the code that reads it).
//!
//! The `engine` section holds the settings the input engine applies, which `birdtrain bench
//! pipeline` takes too; `unflagged` holds the recorded settings whose flags are spelled
//! differently from their record (`--augment` and `--crop-scale`, `--model-ema` and its
//! tuning, `--auto-augment` and its strengths) or that no flag sets (the split's version).

// The rows' docs are also the flags' `--help` texts, where `<class>` is a placeholder.
#![allow(rustdoc::invalid_html_tags)]

use serde::{Deserialize, Serialize};

use super::best::BestRule;
use crate::optim::{Decay, Plateau};

/// The table of recorded settings (see the module documentation); `$then` is the macro that
/// turns it into items (`define_run_settings` here, the flag structs in the CLI).
macro_rules! recorded_settings {
    ($then:ident) => {
        $then! {
            engine {
                /// Side of the squares the input engine caches, at least --image-size: the
                /// crops (--augment resized-crop, --crop-pct) are cut from this many pixels
                /// and scaled to the image size (ImageNet recipes store 256 for 224); absent:
                /// the image size.
                #[serde(default, skip_serializing_if = "Option::is_none")]
                store_size: Option<u32> = None => u32 ["Augmentation", "S", keep];
                /// How each image becomes its stored square: direct (stretched to the square)
                /// or center-crop (the centred square of its shorter side, keeping the aspect
                /// ratio, as torchvision's Resize then CenterCrop).
                #[serde(default, with = "resize_mode_name")]
                resize_mode: pipeline::ResizeMode = pipeline::ResizeMode::Direct
                    => pipeline::ResizeMode ["Augmentation", "MODE", fixed];
                /// Colour jitter of training images: brightness, contrast and saturation each
                /// scaled by a factor drawn from [max(0, 1−F), 1+F], in a random order
                /// (torchvision's ColorJitter(F, F, F), timm's --color-jitter; ImageNet recipes
                /// use 0.4; 0: none).
                #[serde(default)]
                color_jitter: f32 = 0.0 => f32 ["Augmentation", "F", keep];
                /// The hue part of the colour jitter: each training image's hue turned by a
                /// shift drawn from [−H, H] turns of the colour wheel, H ≤ 0.5, in a random
                /// order with the other three (torchvision's ColorJitter(…, hue=H); 0: none).
                #[serde(default)]
                color_jitter_hue: f32 = 0.0 => f32 ["Augmentation", "H", keep];
            }
            training {
                /// Learning rate for a global batch of 256 (scaled linearly to the real global
                /// batch; Adam and AdamW start a new run at 0.008 unless given).
                lr: f32 = 0.8 => f32 ["Optimizer", "X", warn];
                /// SGD momentum (Adam's β1 stays 0.9).
                momentum: f32 = 0.9 => f32 ["Optimizer", "M", keep];
                /// Nesterov momentum with SGD (`--nesterov false` for classical momentum).
                nesterov: bool = true => bool ["Optimizer", "BOOL", keep,
                    num_args = 0..=1, default_missing_value = "true"];
                /// Weight decay (not applied to batch norm or biases).
                weight_decay: f32 = 5e-4 => f32 ["Optimizer", "WD", keep];
                /// Label smoothing of the cross-entropy loss, in [0, 1).
                label_smoothing: f32 = 0.0 => f32 ["Optimizer", "EPS", warn];
                /// Clip the averaged gradients of every step to this global L2 norm before the
                /// update (PyTorch's clip_grad_norm_; torchvision's --clip-grad-norm, timm's
                /// --clip-grad); absent: off.
                #[serde(default, skip_serializing_if = "Option::is_none")]
                clip_grad_norm: Option<f32> = None => f32 ["Optimizer", "N", keep];
                /// Linear learning-rate warmup, in epochs.
                warmup_epochs: u32 = 1 => u32 ["Schedule", "E", keep];
                /// Decay after warmup: cosine, step, constant, or plateau (constant, cut by
                /// --plateau-factor after every --plateau-patience epochs without a better
                /// validation epoch by --monitor, as Keras' ReduceLROnPlateau).
                schedule: crate::optim::ScheduleChoice = crate::optim::ScheduleChoice::Cosine
                    => crate::optim::ScheduleChoice ["Schedule", "SCHEDULE", keep];
                /// With --schedule step: epochs between decays.
                step_every: u32 = 30 => u32 ["Schedule", "E", keep];
                /// With --schedule step: decay factor.
                step_gamma: f32 = 0.1 => f32 ["Schedule", "G", keep];
                /// With --schedule plateau: epochs without improvement before each cut.
                #[serde(default = "default_plateau_patience")]
                plateau_patience: u32 = crate::optim::Plateau::DEFAULT.patience
                    => u32 ["Schedule", "E", keep];
                /// With --schedule plateau: the factor of each cut.
                #[serde(default = "default_plateau_factor")]
                plateau_factor: f32 = crate::optim::Plateau::DEFAULT.factor
                    => f32 ["Schedule", "F", keep];
                /// With --schedule plateau: epochs after each cut that are not counted.
                #[serde(default)]
                plateau_cooldown: u32 = crate::optim::Plateau::DEFAULT.cooldown
                    => u32 ["Schedule", "E", keep];
                /// With --schedule plateau: the lowest rate the cuts go to, in --lr's units
                /// (for a global batch of 256).
                #[serde(default)]
                plateau_min_lr: f32 = crate::optim::Plateau::DEFAULT.min_lr
                    => f32 ["Schedule", "X", keep];
                /// Validation sees the centred square covering this share of each image's
                /// side, scaled to the image size (timm's crop_pct; 0.875 is the ImageNet
                /// recipe's 224 of 256; 1: the whole image); eval and predict of the
                /// checkpoint take it too.
                #[serde(default = "one")]
                crop_pct: f32 = 1.0 => f32 ["Augmentation", "F", keep];
                /// Random erasing: this share of training images gets a random rectangle
                /// (2–33 % of its area, aspect 0.3–3.3) set to the mean colour, after the crop
                /// and mirror (torchvision's RandomErasing; its recipe uses 0.1, timm's
                /// --reprob 0.25).
                #[serde(default)]
                random_erase: f32 = 0.0 => f32 ["Augmentation", "P", keep];
                /// Mixup of training batches: each image blended with another of its batch,
                /// λ·one + (1−λ)·other, and their labels likewise, λ drawn from Beta(A, A) per
                /// batch (timm's --mixup; ImageNet recipes use 0.1 to 0.8; 0: off).
                #[serde(default)]
                mixup: f32 = 0.0 => f32 ["Mixing", "A", warn];
                /// CutMix of training batches: a box of another image of the batch pasted in,
                /// the labels weighted by area, λ drawn from Beta(A, A) per batch (timm's
                /// --cutmix; recipes use 1.0; 0: off).
                #[serde(default)]
                cutmix: f32 = 0.0 => f32 ["Mixing", "A", warn];
                /// The share of training batches mixed by --mixup or --cutmix.
                #[serde(default = "one")]
                mixup_prob: f32 = 1.0 => f32 ["Mixing", "P", keep];
                /// With both --mixup and --cutmix, the share of mixed batches given CutMix.
                #[serde(default = "half")]
                mixup_switch_prob: f32 = 0.5 => f32 ["Mixing", "P", keep];
                /// Batch norm uses its running statistics while training (fine-tuning); a
                /// resumed run keeps it on.
                freeze_bn: bool = false => bool ["Model", "BOOL", warn,
                    num_args = 0, default_missing_value = "true"];
                /// Gradient accumulation: each optimizer step sums the gradients of K
                /// micro-batches of --batch-size per rank (batch norm sees each micro-batch
                /// alone), so the global batch is ranks × --batch-size × K.
                #[serde(default = "one_step")]
                grad_accum_steps: u32 = 1 => u32 ["Distributed", "K", warn];
                /// Synchronised batch norm: normalise with the statistics of the global batch
                /// (every rank's images, GPUs or CPU replicas) instead of each rank's own;
                /// costs two small all-reduces per BN layer. A resumed run keeps it on.
                #[serde(default)]
                sync_bn: bool = false => bool ["Distributed", "BOOL", keep,
                    num_args = 0, default_missing_value = "true"];
                /// The last incomplete batch: partial, drop or pad.
                #[serde(with = "last_batch_name")]
                last_batch: pipeline::LastBatch = pipeline::LastBatch::Partial
                    => pipeline::LastBatch ["Data", "POLICY", keep];
                /// Training order: shuffle (every image once per epoch) or balanced (as many
                /// draws with replacement, every class equally likely: for imbalanced
                /// classes).
                #[serde(default, with = "sampler_name")]
                sampler: pipeline::Sampling = pipeline::Sampling::Shuffle
                    => pipeline::Sampling ["Data", "ORDER", warn];
                /// Flat layout (<class>/<images>), or a CSV without a split column: the share
                /// of each class held out for validation.
                valid_fraction: Option<f32> = None => f32 ["Data", "F", keep];
                /// Also save a checkpoint every N optimizer steps inside an epoch (a killed
                /// run loses at most N steps); 0: at epoch ends only.
                #[serde(default)]
                save_every: u64 = 0 => u64 ["Checkpoints", "N", keep];
                /// Stop when the monitored validation figure (--monitor) has not improved for
                /// E epochs (0: never). The best epoch's checkpoint is kept in RUN/best/ in any
                /// case.
                #[serde(default)]
                early_stop: u64 = 0 => u64 ["Checkpoints", "E", keep];
                /// The validation figure that picks the best epoch (RUN/best/) and that
                /// --early-stop watches: val_accuracy (ties go to the lower loss) or val_loss,
                /// or with --model-ema the moving average's val_ema_accuracy or val_ema_loss
                /// (timm's choice).
                #[serde(default)]
                monitor: crate::train::folder::Monitor = crate::train::folder::Monitor::ValAccuracy
                    => crate::train::folder::Monitor ["Checkpoints", "FIGURE", keep];
                /// The least improvement of the monitored figure that counts as one, for
                /// RUN/best/ and --early-stop.
                #[serde(default)]
                min_delta: f64 = 0.0 => f64 ["Checkpoints", "D", keep];
            }
            unflagged {
                /// Training augmentation of any kind (`--augment` other than `none`).
                augment: bool = true;
                /// `--augment resized-crop` (`--crop-scale`): the crop's least and greatest
                /// area share; absent for the pad-and-crop (and in older checkpoints).
                #[serde(default, skip_serializing_if = "Option::is_none")]
                crop_scale: Option<[f32; 2]> = None;
                /// `--model-ema` (`--model-ema-steps`, `--model-ema-decay`): the moving
                /// average of the weights; absent when off (and in older checkpoints).
                #[serde(default, skip_serializing_if = "Option::is_none")]
                model_ema: Option<crate::train::EmaRecipe> = None;
                /// `--auto-augment` (with `--ra-magnitude`, `--augmix-severity`): the
                /// automatic augmentation policy; absent when off (and in older checkpoints).
                #[serde(default, skip_serializing_if = "Option::is_none", with = "auto_augment_policy")]
                auto_augment: Option<pipeline::AutoAugment> = None;
                /// How the validation share was held out ([`pipeline::SplitRule::version`]):
                /// 2, round(F × n) of each class; absent in checkpoints made before version 2
                /// existed, whose runs drew each file on its own (1), so they evaluate and
                /// resume on that split.
                #[serde(default = "split_version_one")]
                split_version: u32 = pipeline::SplitRule::CURRENT.version();
            }
        }
    };
}
pub(crate) use recorded_settings;

/// Defines [`RunSettings`] from the table.
macro_rules! define_run_settings {
    ($($section:ident {
        $(
            $(#[doc = $doc:literal])*
            $(#[serde($($serde:tt)*)])*
            $field:ident : $ty:ty = $default:expr $(=> $flag_ty:ty [$($flag:tt)*])? ;
        )*
    })*) => {
        /// The training settings a resumed run continues with (flags given on resume
        /// override them); the part of [`crate::train::TrainConfig`] a checkpoint records.
        /// [`Default`] is a new run's.
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        pub struct RunSettings {
            $($(
                $(#[doc = $doc])*
                $(#[serde($($serde)*)])*
                pub $field: $ty,
            )*)*
        }

        impl Default for RunSettings {
            fn default() -> Self {
                Self { $($( $field: $default, )*)* }
            }
        }

        impl RunSettings {
            /// The record's field names (`settings.<name>` in `checkpoint.json`).
            pub const FIELDS: &'static [&'static str] = &[$($(stringify!($field)),*),*];
        }
    };
}
recorded_settings!(define_run_settings);

impl RunSettings {
    /// The schedule's decay.
    pub fn decay(&self) -> Decay {
        let plateau = Plateau {
            patience: self.plateau_patience,
            factor: self.plateau_factor,
            cooldown: self.plateau_cooldown,
            min_lr: self.plateau_min_lr,
        };
        self.schedule
            .decay(self.step_every, self.step_gamma, plateau)
    }

    /// The rule that held the validation share out ([`RunSettings::split_version`]; an
    /// unknown version is refused when the sidecar is loaded).
    pub fn split_rule(&self) -> pipeline::SplitRule {
        pipeline::SplitRule::from_version(self.split_version)
            .unwrap_or(pipeline::SplitRule::CURRENT)
    }

    /// The rule that picks the best epoch.
    pub fn best_rule(&self) -> BestRule {
        BestRule {
            monitor: self.monitor,
            min_delta: self.min_delta,
        }
    }

    /// Sets the rule that picks the best epoch.
    pub fn set_best_rule(&mut self, rule: BestRule) {
        self.monitor = rule.monitor;
        self.min_delta = rule.min_delta;
    }
}

fn default_plateau_patience() -> u32 {
    Plateau::DEFAULT.patience
}

fn default_plateau_factor() -> f32 {
    Plateau::DEFAULT.factor
}

fn one() -> f32 {
    1.0
}

fn one_step() -> u32 {
    1
}

fn split_version_one() -> u32 {
    1
}

fn half() -> f32 {
    0.5
}

/// `--last-batch` as its command-line word in the sidecar.
mod last_batch_name {
    use pipeline::LastBatch;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(v: &LastBatch, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(v.as_str())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<LastBatch, D::Error> {
        let text = String::deserialize(d)?;
        text.parse()
            .map_err(|_| serde::de::Error::custom(format!("unknown last-batch policy {text:?}")))
    }
}

/// `--resize-mode` as its command-line word in the sidecar.
mod resize_mode_name {
    use pipeline::ResizeMode;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(v: &ResizeMode, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(v.as_str())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<ResizeMode, D::Error> {
        let text = String::deserialize(d)?;
        text.parse()
            .map_err(|_| serde::de::Error::custom(format!("unknown resize mode {text:?}")))
    }
}

/// `--sampler` as its command-line word in the sidecar.
mod sampler_name {
    use pipeline::Sampling;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(v: &Sampling, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(v.as_str())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Sampling, D::Error> {
        let text = String::deserialize(d)?;
        text.parse()
            .map_err(|_| serde::de::Error::custom(format!("unknown sampler {text:?}")))
    }
}

/// `--auto-augment` as `{"policy": "ta_wide"}`, `{"policy": "ra", "magnitude": M}` or
/// `{"policy": "augmix", "severity": S}`.
mod auto_augment_policy {
    use pipeline::AutoAugment;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    struct Recorded {
        policy: String,
        /// RandAugment's strength bin.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        magnitude: Option<u32>,
        /// AugMix's severity.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        severity: Option<u32>,
    }

    pub(super) fn serialize<S: Serializer>(
        v: &Option<AutoAugment>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        v.map(|policy| Recorded {
            policy: policy.as_str().to_string(),
            magnitude: match policy {
                AutoAugment::RandAugment { magnitude } => Some(magnitude),
                _ => None,
            },
            severity: match policy {
                AutoAugment::AugMix { severity } => Some(severity),
                _ => None,
            },
        })
        .serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<AutoAugment>, D::Error> {
        let Some(recorded) = Option::<Recorded>::deserialize(d)? else {
            return Ok(None);
        };
        match AutoAugment::parse(&recorded.policy) {
            Some(Some(AutoAugment::RandAugment { magnitude })) => {
                Ok(Some(AutoAugment::RandAugment {
                    magnitude: recorded.magnitude.unwrap_or(magnitude),
                }))
            }
            Some(Some(AutoAugment::AugMix { severity })) => Ok(Some(AutoAugment::AugMix {
                severity: recorded.severity.unwrap_or(severity),
            })),
            Some(policy) => Ok(policy),
            None => Err(serde::de::Error::custom(format!(
                "unknown augmentation policy {:?}",
                recorded.policy
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_field_list_is_the_records_keys() {
        let every = RunSettings {
            store_size: Some(256),
            clip_grad_norm: Some(1.0),
            valid_fraction: Some(0.2),
            crop_scale: Some([0.3, 1.0]),
            model_ema: Some(crate::train::EmaRecipe::TORCHVISION),
            auto_augment: Some(pipeline::AutoAugment::TrivialAugmentWide),
            ..RunSettings::default()
        };
        let value = serde_json::to_value(&every).unwrap();
        let mut keys: Vec<&str> = value
            .as_object()
            .unwrap()
            .keys()
            .map(|k| k.as_str())
            .collect();
        let mut fields = RunSettings::FIELDS.to_vec();
        keys.sort_unstable();
        fields.sort_unstable();
        assert_eq!(keys, fields);
    }

    #[test]
    fn a_new_run_records_the_current_split_and_reads_an_absent_one_as_version_1() {
        assert_eq!(
            RunSettings::default().split_rule(),
            pipeline::SplitRule::CURRENT
        );
        let mut value = serde_json::to_value(RunSettings::default()).unwrap();
        value.as_object_mut().unwrap().remove("split_version");
        let old: RunSettings = serde_json::from_value(value).unwrap();
        assert_eq!(old.split_version, 1);
    }
}
