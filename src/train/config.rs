//! Everything a training run is asked to do, independent of how it was asked (CLI, test).

use std::ops::{Deref, DerefMut};
use std::path::PathBuf;

use pipeline::{LastBatch, OnBadImage};

use super::device::DeviceChoice;
use super::folder::RunSettings;
use super::lr_find::LrRange;
use super::TrainError;
use crate::dist::DistSettings;
use crate::model::Arch;
use crate::optim::{Decay, OptimizerChoice};

/// A training run's settings: the recorded recipe ([`RunSettings`], what `checkpoint.json`
/// stores and a resumed run continues with) and what this invocation adds (data, device,
/// run folder, …). [`TrainConfig::new`] holds every default (the command line takes its
/// defaults from it and from [`RunSettings::default`]). The recipe's fields read through
/// the config (`cfg.lr`), since the training code uses both alike.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// The recorded recipe: optimizer hyper-parameters, schedule, augmentation, data order,
    /// checkpoints (see [`RunSettings`]).
    pub settings: RunSettings,
    /// Dataset root (`train/valid/test/<class>/…`, or flat `<class>/…` with `valid_fraction`).
    pub data: PathBuf,
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
    /// Optimizer family.
    pub optimizer: OptimizerChoice,
    /// Training image size S (S×S).
    pub image_size: u32,
    /// `birdtrain lr-find`: the swept rates, which replace the schedule; the run then
    /// neither validates nor checkpoints (none: a training run).
    pub lr_range: Option<LrRange>,
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
    /// Start from these weights (torchvision names); the head is replaced if classes differ.
    pub init_from: Option<PathBuf>,
    /// A fresh initialisation starts every residual block as the identity
    /// (`--zero-init-residual`, see [`crate::model::ModelState::zero_residual_gammas`]).
    pub zero_init_residual: bool,
    /// Bad image policy.
    pub on_bad_image: OnBadImage,
    /// Stop (saving a checkpoint, as on Ctrl-C) once this many optimizer steps were taken in
    /// total. For tests of resume and for quick looks.
    pub stop_after_steps: Option<u64>,
    /// Draw progress bars (they also hide themselves when stderr is not a terminal).
    pub progress: bool,
    /// Print the start lines, epoch lines and summary on stdout.
    pub verbose: bool,
    /// How the ranks are launched and joined (buckets, timeouts, trace; GPUs: staging depth,
    /// nodes).
    pub dist: DistSettings,
    /// The price of one device for one hour (`--price-per-hour`: per GPU on GPUs, per
    /// machine on the CPU), recorded with this segment of the run; not a recorded setting, as
    /// a resumed run may run elsewhere at another price.
    pub price_per_hour: Option<f64>,
}

impl Deref for TrainConfig {
    type Target = RunSettings;

    fn deref(&self) -> &RunSettings {
        &self.settings
    }
}

impl DerefMut for TrainConfig {
    fn deref_mut(&mut self) -> &mut RunSettings {
        &mut self.settings
    }
}

impl TrainConfig {
    /// The defaults of `birdtrain --data DATA`.
    pub fn new(data: impl Into<PathBuf>) -> Self {
        Self {
            settings: RunSettings::default(),
            data: data.into(),
            device: DeviceChoice::Cpu,
            arch: Arch::ResNet50,
            epochs: 10,
            batch_size: 32,
            replicas: 1,
            optimizer: OptimizerChoice::Sgd,
            image_size: 224,
            lr_range: None,
            workers: 0,
            threads: 0,
            cache_dir: None,
            out: PathBuf::from("runs/run"),
            seed: 0,
            resume: None,
            allow_data_change: false,
            overwrite: false,
            init_from: None,
            zero_init_residual: false,
            on_bad_image: OnBadImage::Skip,
            stop_after_steps: None,
            progress: true,
            verbose: true,
            dist: DistSettings::default(),
            price_per_hour: None,
        }
    }

    /// The recipe a checkpoint records: the settings, with a store size equal to the image
    /// size left out (the engine's default).
    pub fn recorded_settings(&self) -> RunSettings {
        let mut settings = self.settings.clone();
        settings.store_size = self.store_size.filter(|&s| s != self.image_size);
        settings
    }

    /// The images of one rank's optimizer step: `--batch-size` × `--grad-accum-steps` (the
    /// input engine's batch; the network sees micro-batches of `--batch-size`).
    pub fn rank_step_batch(&self) -> usize {
        self.batch_size * self.grad_accum_steps as usize
    }

    /// Replicas × per-replica batch × accumulation steps: the images of one optimizer step.
    pub fn global_batch(&self) -> usize {
        self.replicas * self.rank_step_batch()
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
        if self.grad_accum_steps == 0 {
            return bad(
                "--grad-accum-steps",
                "0".into(),
                "use at least 1 micro-batch per optimizer step",
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
        let delta = self.min_delta;
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
        } = self.decay()
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
        if let Some(crop) = self.augmentation().engine_crop() {
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
        self.mix().validate()?;
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
        } else if self.monitor.follows_average() {
            return bad(
                "--monitor",
                self.monitor.name().into(),
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
        if let Decay::Plateau(p) = self.decay() {
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
