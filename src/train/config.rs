//! Everything a training run is asked to do, independent of how it was asked (CLI, test).

use std::path::PathBuf;

use pipeline::{LastBatch, OnBadImage, ResizeMode, Sampling};

use super::augment::Augmentation;
use super::device::DeviceChoice;
use super::ema::EmaRecipe;
use super::folder::{BestRule, RunSettings};
use super::lr_find::LrRange;
use super::mix::MixRecipe;
use super::TrainError;
use crate::dist::DistSettings;
use crate::model::Arch;
use crate::optim::{Decay, OptimizerChoice, Plateau};

/// A training run's settings. [`TrainConfig::new`] holds every default (the command line
/// takes its defaults from it).
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// Dataset root (`train/valid/test/<class>/…`, or flat `<class>/…` with `valid_fraction`).
    pub data: PathBuf,
    /// Flat layout: the share of each class held out for validation.
    pub valid_fraction: Option<f32>,
    /// How that share is held out: the current rule for a new run, the checkpoint's for a
    /// resumed one (so it keeps the split it trained with).
    pub split_rule: pipeline::SplitRule,
    /// Where to train.
    pub device: DeviceChoice,
    /// Network.
    pub arch: Arch,
    /// Epochs to train in total (a resumed run counts those already done).
    pub epochs: u64,
    /// Images per replica per step.
    pub batch_size: usize,
    /// Data-parallel replicas (CPU) or GPUs.
    pub replicas: usize,
    /// Learning rate for a global batch of 256; scaled linearly to the real global batch.
    pub lr: f32,
    /// Optimizer family.
    pub optimizer: OptimizerChoice,
    /// SGD momentum; Adam's β1 stays 0.9.
    pub momentum: f32,
    /// Nesterov momentum for SGD.
    pub nesterov: bool,
    /// Weight decay (never on batch norm or biases).
    pub weight_decay: f32,
    /// Label smoothing of the cross-entropy.
    pub label_smoothing: f32,
    /// Linear warmup length in epochs.
    pub warmup_epochs: u32,
    /// Decay after warmup.
    pub schedule: Decay,
    /// Training image size S (S×S).
    pub image_size: u32,
    /// Side of the squares the input engine caches, the crops' source (`--store-size`;
    /// `None`: the image size).
    pub store_size: Option<u32>,
    /// How each image becomes its stored square (`--resize-mode`).
    pub resize_mode: ResizeMode,
    /// The hue part of the colour jitter (`--color-jitter-hue`; 0: none).
    pub color_jitter_hue: f32,
    /// The share of training images randomly erased (`--random-erase`; 0: none).
    pub random_erase: f32,
    /// Mixup and CutMix of training batches (`--mixup`, `--cutmix`, …).
    pub mix: MixRecipe,
    /// The moving average of the weights (`--model-ema`; none: off).
    pub model_ema: Option<EmaRecipe>,
    /// The global L2 norm the averaged gradients are clipped to (`--clip-grad-norm`).
    pub clip_grad_norm: Option<f32>,
    /// `birdtrain lr-find`: the swept rates, which replace the schedule; the run then
    /// neither validates nor checkpoints (none: a training run).
    pub lr_range: Option<LrRange>,
    /// Strength of the training images' colour jitter (`--color-jitter`; 0: none).
    pub color_jitter: f32,
    /// The automatic augmentation policy of training images (`--auto-augment`,
    /// `--ra-magnitude`, `--augmix-severity`; none: off).
    pub auto_augment: Option<pipeline::AutoAugment>,
    /// Decode workers (0 = available cores).
    pub workers: usize,
    /// CPU backend threads (0 = available cores). Results are bit-reproducible for a given
    /// thread count.
    pub threads: usize,
    /// Pixel cache folder (None = per-user cache dir).
    pub cache_dir: Option<PathBuf>,
    /// Run folder: metrics, report, checkpoints.
    pub out: PathBuf,
    /// Seed of the initialisation, the data order and the augmentation.
    pub seed: u64,
    /// Continue the run saved in this folder.
    pub resume: Option<PathBuf>,
    /// On resume, a training set that changed since the checkpoint restarts the interrupted
    /// epoch instead of being refused.
    pub allow_data_change: bool,
    /// Replace the run already in `out` (without it, such a folder is refused).
    pub overwrite: bool,
    /// What training does to each image (`--augment`).
    pub augment: Augmentation,
    /// Validation (and, by default, `eval` and `predict` of the checkpoint) sees the centred
    /// square covering this share of each stored image's side (`--crop-pct`; 1: all of it).
    pub crop_pct: f32,
    /// Start from these weights (torchvision names); the head is replaced if classes differ.
    pub init_from: Option<PathBuf>,
    /// A fresh initialisation starts every residual block as the identity
    /// (`--zero-init-residual`, see [`crate::model::ModelState::zero_residual_gammas`]).
    pub zero_init_residual: bool,
    /// Last incomplete batch policy.
    pub last_batch: LastBatch,
    /// How each training epoch's order is drawn (`--sampler`).
    pub sampler: Sampling,
    /// Bad image policy.
    pub on_bad_image: OnBadImage,
    /// Batch norm uses running statistics during training (fine-tuning; exact replica
    /// equivalence).
    pub freeze_bn: bool,
    /// Stop (saving a checkpoint, as on Ctrl-C) once this many optimizer steps were taken in
    /// total. For tests of resume and for quick looks.
    pub stop_after_steps: Option<u64>,
    /// Also checkpoint every this many optimizer steps inside an epoch, so that a killed run
    /// loses at most that many (0: at epoch ends only).
    pub save_every: u64,
    /// Stop once the monitored figure has not improved for this many epochs (0: never). The
    /// best epoch's checkpoint is kept in `RUN/best/` either way.
    pub early_stop: u64,
    /// What picks the best epoch (`RUN/best/`) and counts as an improvement for
    /// `early_stop`: `--monitor` and `--min-delta`.
    pub best_rule: BestRule,
    /// Draw progress bars (they also hide themselves when stderr is not a terminal).
    pub progress: bool,
    /// Print the start lines, epoch lines and summary on stdout.
    pub verbose: bool,
    /// How the ranks are launched and joined (buckets, timeouts, trace; GPUs: staging depth,
    /// nodes, synchronised batch norm).
    pub dist: DistSettings,
}

impl TrainConfig {
    /// The defaults of `birdtrain --data DATA`.
    pub fn new(data: impl Into<PathBuf>) -> Self {
        Self {
            data: data.into(),
            valid_fraction: None,
            split_rule: pipeline::SplitRule::CURRENT,
            device: DeviceChoice::Cpu,
            arch: Arch::ResNet50,
            epochs: 10,
            batch_size: 32,
            replicas: 1,
            lr: 0.8,
            optimizer: OptimizerChoice::Sgd,
            momentum: 0.9,
            nesterov: true,
            weight_decay: 5e-4,
            label_smoothing: 0.0,
            warmup_epochs: 1,
            schedule: Decay::Cosine,
            image_size: 224,
            workers: 0,
            threads: 0,
            cache_dir: None,
            out: PathBuf::from("runs/run"),
            seed: 0,
            resume: None,
            allow_data_change: false,
            overwrite: false,
            augment: Augmentation::PadCrop,
            crop_pct: 1.0,
            store_size: None,
            resize_mode: ResizeMode::Direct,
            mix: MixRecipe::OFF,
            model_ema: None,
            clip_grad_norm: None,
            lr_range: None,
            random_erase: 0.0,
            color_jitter_hue: 0.0,
            color_jitter: 0.0,
            auto_augment: None,
            init_from: None,
            zero_init_residual: false,
            last_batch: LastBatch::Partial,
            sampler: Sampling::Shuffle,
            on_bad_image: OnBadImage::Skip,
            freeze_bn: false,
            stop_after_steps: None,
            save_every: 0,
            early_stop: 0,
            best_rule: BestRule::default(),
            progress: true,
            verbose: true,
            dist: DistSettings::default(),
        }
    }

    /// `--step-every` when the schedule is not step decay (what a checkpoint records).
    pub const DEFAULT_STEP_EVERY: u32 = 30;
    /// `--step-gamma` when the schedule is not step decay.
    pub const DEFAULT_STEP_GAMMA: f32 = 0.1;

    /// Replicas × per-replica batch.
    pub fn global_batch(&self) -> usize {
        self.replicas * self.batch_size
    }

    /// `--lr` scaled linearly from a global batch of 256 to this run's.
    pub fn scaled_lr(&self) -> f32 {
        self.lr * self.global_batch() as f32 / 256.0
    }

    /// The images a full step really holds on `train_images` training images: the global
    /// batch, or the whole set when the batch is larger (`--last-batch pad` fills it up).
    pub fn effective_global_batch(&self, train_images: usize) -> usize {
        match self.last_batch {
            LastBatch::Pad => self.global_batch(),
            _ => self.global_batch().min(train_images.max(1)),
        }
    }

    /// `--lr` scaled to the batch a step really holds ([`Self::effective_global_batch`]).
    pub fn scaled_lr_for(&self, train_images: usize) -> f32 {
        self.lr * self.effective_global_batch(train_images) as f32 / 256.0
    }

    /// The settings a checkpoint records so that `--resume` continues the same way.
    pub fn settings(&self) -> RunSettings {
        let (step_every, step_gamma) = match self.schedule {
            Decay::Step {
                every_epochs,
                gamma,
            } => (every_epochs, gamma),
            _ => (Self::DEFAULT_STEP_EVERY, Self::DEFAULT_STEP_GAMMA),
        };
        let plateau = match self.schedule {
            Decay::Plateau(p) => p,
            _ => Plateau::DEFAULT,
        };
        RunSettings {
            lr: self.lr,
            momentum: self.momentum,
            nesterov: self.nesterov,
            weight_decay: self.weight_decay,
            label_smoothing: self.label_smoothing,
            warmup_epochs: self.warmup_epochs,
            schedule: self.schedule.choice(),
            step_every,
            step_gamma,
            plateau_patience: plateau.patience,
            plateau_factor: plateau.factor,
            plateau_cooldown: plateau.cooldown,
            plateau_min_lr: plateau.min_lr,
            augment: self.augment != Augmentation::None,
            crop_scale: self.augment.recorded_crop_scale(),
            crop_pct: self.crop_pct,
            store_size: self.store_size.filter(|&s| s != self.image_size),
            resize_mode: self.resize_mode,
            random_erase: self.random_erase,
            color_jitter_hue: self.color_jitter_hue,
            mixup: self.mix.mixup,
            cutmix: self.mix.cutmix,
            mixup_prob: self.mix.prob,
            mixup_switch_prob: self.mix.switch_prob,
            model_ema: self.model_ema,
            clip_grad_norm: self.clip_grad_norm,
            color_jitter: self.color_jitter,
            auto_augment: self.auto_augment,
            freeze_bn: self.freeze_bn,
            sync_bn: self.dist.sync_bn,
            last_batch: self.last_batch,
            sampler: self.sampler,
            valid_fraction: self.valid_fraction,
            split_version: self.split_rule.version(),
            save_every: self.save_every,
            early_stop: self.early_stop,
            monitor: self.best_rule.monitor,
            min_delta: self.best_rule.min_delta,
        }
    }

    /// Takes over the settings of a checkpoint (before flags given on resume are applied).
    pub fn apply_settings(&mut self, s: &RunSettings) {
        self.lr = s.lr;
        self.momentum = s.momentum;
        self.nesterov = s.nesterov;
        self.weight_decay = s.weight_decay;
        self.label_smoothing = s.label_smoothing;
        self.warmup_epochs = s.warmup_epochs;
        self.schedule = s.decay();
        self.augment = Augmentation::recorded(s.augment, s.crop_scale);
        self.crop_pct = s.crop_pct;
        self.store_size = s.store_size;
        self.resize_mode = s.resize_mode;
        self.random_erase = s.random_erase;
        self.color_jitter_hue = s.color_jitter_hue;
        self.mix = MixRecipe {
            mixup: s.mixup,
            cutmix: s.cutmix,
            prob: s.mixup_prob,
            switch_prob: s.mixup_switch_prob,
        };
        self.model_ema = s.model_ema;
        self.clip_grad_norm = s.clip_grad_norm;
        self.color_jitter = s.color_jitter;
        self.auto_augment = s.auto_augment;
        self.freeze_bn = s.freeze_bn;
        self.dist.sync_bn = s.sync_bn;
        self.last_batch = s.last_batch;
        self.sampler = s.sampler;
        self.valid_fraction = s.valid_fraction;
        self.split_rule = s.split_rule();
        self.save_every = s.save_every;
        self.early_stop = s.early_stop;
        self.best_rule = s.best_rule();
    }

    /// The input engine's colour jitter of training images, when asked for.
    pub fn engine_jitter(&self) -> Option<pipeline::ColorJitter> {
        let jitter =
            pipeline::ColorJitter::uniform(self.color_jitter).with_hue(self.color_jitter_hue);
        jitter.is_on().then_some(jitter)
    }

    /// Rejects values that cannot work, naming the flag.
    pub fn validate(&self) -> Result<(), TrainError> {
        let bad = |flag: &'static str, value: String, hint: &str| {
            Err(TrainError::InvalidConfig {
                flag,
                value,
                hint: hint.to_string(),
            })
        };
        if self.epochs == 0 {
            return bad("--epochs", "0".into(), "train for at least 1 epoch");
        }
        if self.batch_size == 0 {
            return bad(
                "--batch-size",
                "0".into(),
                "use at least 1 image per replica",
            );
        }
        if self.replicas == 0 {
            return bad("--replicas", "0".into(), "use at least 1 replica");
        }
        if !(self.dist.bucket_mb.is_finite() && self.dist.bucket_mb > 0.0) {
            return bad(
                "--bucket-mb",
                self.dist.bucket_mb.to_string(),
                "a positive size in MiB, such as 25",
            );
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad("--lr", self.lr.to_string(), "a positive number, e.g. 0.1");
        }
        if self.image_size < 8 || self.image_size > 1024 {
            return bad(
                "--image-size",
                self.image_size.to_string(),
                "between 8 and 1024 pixels",
            );
        }
        if !(0.0..1.0).contains(&self.label_smoothing) {
            return bad(
                "--label-smoothing",
                self.label_smoothing.to_string(),
                "in [0, 1)",
            );
        }
        let delta = self.best_rule.min_delta;
        if !(delta >= 0.0 && delta.is_finite()) {
            return bad(
                "--min-delta",
                delta.to_string(),
                "a number ≥ 0 (the least change of the monitored figure that counts)",
            );
        }
        if !(self.weight_decay >= 0.0 && self.weight_decay.is_finite()) {
            return bad(
                "--weight-decay",
                self.weight_decay.to_string(),
                "a number ≥ 0",
            );
        }
        if !(0.0..1.0).contains(&self.momentum) {
            return bad("--momentum", self.momentum.to_string(), "in [0, 1)");
        }
        if let Some(f) = self.valid_fraction {
            if !(f > 0.0 && f < 1.0) {
                return bad(
                    "--valid-fraction",
                    f.to_string(),
                    "strictly between 0 and 1",
                );
            }
        }
        if let Decay::Step {
            every_epochs,
            gamma,
        } = self.schedule
        {
            if every_epochs == 0 {
                return bad(
                    "--step-every",
                    every_epochs.to_string(),
                    "decay every ≥ 1 epoch",
                );
            }
            if !(gamma > 0.0 && gamma <= 1.0) {
                return bad(
                    "--step-gamma",
                    gamma.to_string(),
                    "the factor each step multiplies the learning rate by, in (0, 1]",
                );
            }
        }
        // The engine owns the crops' rules; checked here, before anything is written.
        if let Some(crop) = self.augment.engine_crop() {
            crop.validate()?;
        }
        pipeline::check_crop_pct(self.crop_pct)?;
        if let Some(store) = self.store_size {
            pipeline::check_store_size(store, self.image_size)?;
        }
        pipeline::ColorJitter::uniform(self.color_jitter)
            .with_hue(self.color_jitter_hue)
            .validate()?;
        if let Some(policy) = self.auto_augment {
            policy.validate()?;
        }
        self.mix.validate()?;
        if let Some(n) = self.clip_grad_norm {
            if !(n > 0.0 && n.is_finite()) {
                return bad(
                    "--clip-grad-norm",
                    n.to_string(),
                    "the largest global L2 norm of the gradients, above 0 (recipes use 1 to 10)",
                );
            }
        }
        if let Some(range) = &self.lr_range {
            range.validate()?;
        }
        if let Some(ema) = &self.model_ema {
            ema.validate()?;
        } else if self.best_rule.monitor.follows_average() {
            return bad(
                "--monitor",
                self.best_rule.monitor.name().into(),
                "it watches the moving average of the weights, which is off: add --model-ema",
            );
        }
        if !(0.0..=1.0).contains(&self.random_erase) {
            return bad(
                "--random-erase",
                self.random_erase.to_string(),
                "the share of training images erased, from 0 to 1 (torchvision's recipe uses 0.1, timm's 0.25)",
            );
        }
        if let Decay::Plateau(p) = self.schedule {
            if p.patience == 0 {
                return bad(
                    "--plateau-patience",
                    "0".into(),
                    "at least 1 epoch without improvement before a cut",
                );
            }
            if !(p.factor > 0.0 && p.factor < 1.0) {
                return bad(
                    "--plateau-factor",
                    p.factor.to_string(),
                    "a cut strictly between 0 and 1 (Keras' default: 0.1)",
                );
            }
            if !(p.min_lr >= 0.0 && p.min_lr < self.lr) {
                return bad(
                    "--plateau-min-lr",
                    p.min_lr.to_string(),
                    &format!(
                        "the lowest rate the cuts go to, in --lr's units: at least 0 and below --lr {}",
                        self.lr
                    ),
                );
            }
        }
        Ok(())
    }
}
