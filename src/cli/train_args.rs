//! `birdtrain [train] --data DIR …`: the training flags and their translation to
//! [`TrainConfig`].

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;

use clap::Args;
use pipeline::{AutoAugment, LastBatch, OnBadImage, ResizeMode, Sampling};

use super::CliError;
use crate::dist::launch::{self, LaunchPlan};
use crate::dist::DistSettings;
use crate::model::Arch;
use crate::optim::{Decay, Plateau, ScheduleChoice};
use crate::train::{
    self, Augmentation, CheckpointMeta, DeviceChoice, EmaRecipe, Monitor, OptimizerChoice,
    TrainConfig, TrainError,
};

/// Multi-GPU and multi-node flags (`--gpus` itself belongs to the training flags). Their
/// defaults are [`DistSettings::default`]'s: the settings own them, the flags only spell them.
#[derive(Debug, Clone, PartialEq, Args)]
pub struct DistArgs {
    /// Number of nodes (processes) in a multi-node run [default: WORLD_SIZE or
    /// SLURM_NTASKS, else 1].
    #[arg(long)]
    pub nodes: Option<usize>,
    /// This node's rank, 0..nodes; node 0 serves the rendezvous [default: RANK or
    /// SLURM_PROCID, else 0].
    #[arg(long)]
    pub node_rank: Option<usize>,
    /// Rendezvous address host:port of node 0 [default: MASTER_ADDR:MASTER_PORT, under
    /// torchrun MASTER_PORT + 1; under Slurm its first host:29500].
    #[arg(long)]
    pub master: Option<String>,
    /// Seconds to wait for every node at the rendezvous.
    #[arg(long, default_value_t = DistSettings::default().rendezvous_timeout)]
    pub rendezvous_timeout: u64,
    /// Seconds a collective may take before every rank aborts (a rank stopped answering).
    #[arg(long, default_value_t = DistSettings::default().collective_timeout)]
    pub collective_timeout: u64,
    /// Seconds the ranks wait for each other at an epoch end or a checkpoint (validation of
    /// each rank's share, rank 0 writing the run folder), in place of --collective-timeout;
    /// a rank that fails there still stops the others at once.
    #[arg(long, default_value_t = DistSettings::default().epoch_end_timeout)]
    pub epoch_end_timeout: u64,
    /// Gradient bucket size in MiB (one average per bucket, started during backward).
    #[arg(long, default_value_t = DistSettings::default().bucket_mb)]
    pub bucket_mb: f64,
    /// Staging slots per GPU (batch k+1 uploads while batch k computes).
    #[arg(long, default_value_t = DistSettings::default().prefetch_depth)]
    pub prefetch_depth: usize,
    /// Write a Chrome trace (open in Perfetto) of copies, compute, all-reduces and waits;
    /// node k > 0 of a multi-node run writes its own beside it (trace.node<k>.json for
    /// trace.json).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Synchronised batch norm: normalise with the statistics of the global batch (every
    /// rank's images, GPUs or CPU replicas) instead of each rank's own; costs two small
    /// all-reduces per BN layer.
    #[arg(long)]
    pub sync_bn: bool,
}

impl Default for DistArgs {
    fn default() -> Self {
        DistArgs::from(&DistSettings::default())
    }
}

impl From<&DistSettings> for DistArgs {
    fn from(d: &DistSettings) -> Self {
        DistArgs {
            nodes: d.nodes,
            node_rank: d.node_rank,
            master: d.master.clone(),
            rendezvous_timeout: d.rendezvous_timeout,
            collective_timeout: d.collective_timeout,
            epoch_end_timeout: d.epoch_end_timeout,
            bucket_mb: d.bucket_mb,
            prefetch_depth: d.prefetch_depth,
            trace: d.trace.clone(),
            sync_bn: d.sync_bn,
        }
    }
}

impl DistArgs {
    /// The settings these flags ask for.
    pub fn to_settings(&self) -> DistSettings {
        DistSettings {
            nodes: self.nodes,
            node_rank: self.node_rank,
            master: self.master.clone(),
            rendezvous_timeout: self.rendezvous_timeout,
            collective_timeout: self.collective_timeout,
            epoch_end_timeout: self.epoch_end_timeout,
            bucket_mb: self.bucket_mb,
            prefetch_depth: self.prefetch_depth,
            trace: self.trace.clone(),
            sync_bn: self.sync_bn,
            ..DistSettings::default()
        }
    }
}

/// Training flags. `--lr` is for a global batch of 256 and scales linearly.
#[derive(Debug, Clone, Default, Args)]
pub struct TrainArgs {
    /// Dataset root: train/valid[/test]/<class>/<images>, or <class>/<images> with --valid-fraction, or a CSV file listing the images (path, label[, split] columns).
    #[arg(long, value_name = "DIR")]
    pub data: Option<PathBuf>,
    /// GPUs to use: a count (0 = CPU) or `all`. Default: every GPU, or the CPU when none;
    /// one process per GPU (torchrun, srun): the GPU of LOCAL_RANK or SLURM_LOCALID.
    #[arg(long, value_name = "N|all")]
    pub gpus: Option<String>,
    /// Print what this launch resolves to (nodes, ranks, devices, batch, lr, workers) and
    /// exit: reads no data, writes nothing, asks no GPU driver.
    #[arg(long)]
    pub dry_run: bool,
    /// With --dry-run: print it as one line of JSON.
    #[arg(long, requires = "dry_run")]
    pub json: bool,
    /// Multi-GPU and multi-node flags.
    #[command(flatten)]
    pub dist: DistArgs,
    /// CPU data-parallel replicas (each gets its own micro-batch of --batch-size images).
    #[arg(long, value_name = "R")]
    pub replicas: Option<usize>,
    /// Network: resnet8, resnet20, resnet56 (small images), resnet18/34/50/101/152 (default resnet50).
    #[arg(long, value_name = "M")]
    pub model: Option<String>,
    /// Epochs to train in total.
    #[arg(long, value_name = "E")]
    pub epochs: Option<u64>,
    /// Images per replica per step (the global batch is replicas × this); `auto` on GPUs:
    /// the most every GPU holds, measured on them.
    #[arg(long, value_name = "B|auto", value_parser = batch_size_value)]
    pub batch_size: Option<BatchSize>,
    /// Learning rate for a global batch of 256 (scaled linearly to the real global batch).
    #[arg(long, value_name = "X")]
    pub lr: Option<f32>,
    /// Optimizer: sgd, adam or adamw.
    #[arg(long, value_name = "sgd|adam|adamw")]
    pub optimizer: Option<String>,
    /// SGD momentum.
    #[arg(long, value_name = "M")]
    pub momentum: Option<f32>,
    /// Nesterov momentum with SGD (default on; `--nesterov false` for classical momentum).
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
    pub nesterov: Option<bool>,
    /// Weight decay (not applied to batch norm or biases).
    #[arg(long, value_name = "WD")]
    pub weight_decay: Option<f32>,
    /// Label smoothing of the cross-entropy loss, in [0, 1).
    #[arg(long, value_name = "EPS")]
    pub label_smoothing: Option<f32>,
    /// Linear learning-rate warmup, in epochs.
    #[arg(long, value_name = "E")]
    pub warmup_epochs: Option<u32>,
    /// Decay after warmup: cosine, step, constant, or plateau (constant, cut by
    /// --plateau-factor after every --plateau-patience epochs without a better validation
    /// epoch by --monitor, as Keras' ReduceLROnPlateau).
    #[arg(long, value_name = "cosine|step|constant|plateau")]
    pub schedule: Option<String>,
    /// With --schedule step: epochs between decays [default: 30]
    #[arg(long, value_name = "E")]
    pub step_every: Option<u32>,
    /// With --schedule step: decay factor [default: 0.1]
    #[arg(long, value_name = "G")]
    pub step_gamma: Option<f32>,
    /// With --schedule plateau: epochs without improvement before each cut [default: 10]
    #[arg(long, value_name = "E")]
    pub plateau_patience: Option<u32>,
    /// With --schedule plateau: the factor of each cut [default: 0.1]
    #[arg(long, value_name = "F")]
    pub plateau_factor: Option<f32>,
    /// With --schedule plateau: epochs after each cut that are not counted [default: 0]
    #[arg(long, value_name = "E")]
    pub plateau_cooldown: Option<u32>,
    /// With --schedule plateau: the lowest rate the cuts go to, in --lr's units (for a
    /// global batch of 256) [default: 0]
    #[arg(long, value_name = "X")]
    pub plateau_min_lr: Option<f32>,
    /// Stored and training image size S (images become S×S).
    #[arg(long, value_name = "S")]
    pub image_size: Option<u32>,
    /// Decode workers (default, or 0: the available cores, shared among torchrun's
    /// LOCAL_WORLD_SIZE).
    #[arg(long, value_name = "W")]
    pub workers: Option<usize>,
    /// CPU backend threads (default, or 0: one per available core).
    #[arg(long, value_name = "T")]
    pub threads: Option<usize>,
    /// Pixel cache folder (default: the per-user cache folder).
    #[arg(long, value_name = "C")]
    pub cache_dir: Option<PathBuf>,
    /// Run folder for metrics.jsonl, report.png and checkpoints (default: runs/<model>-<n>;
    /// for lr-find, the sweep's lr_find.jsonl and lr_find.png, default runs/lr-find-<model>-<n>).
    #[arg(long, value_name = "RUN")]
    pub out: Option<PathBuf>,
    /// Seed of initialisation, data order and augmentation.
    #[arg(long, value_name = "S")]
    pub seed: Option<u64>,
    /// Continue the run saved in RUN exactly where it stopped.
    #[arg(long, value_name = "RUN")]
    pub resume: Option<PathBuf>,
    /// Training augmentation: pad-crop (shift by up to S/8 and mirror, the CIFAR recipe),
    /// resized-crop (torchvision's RandomResizedCrop of the stored image and mirror, the
    /// ImageNet recipe) or none.
    #[arg(long, value_name = "pad-crop|resized-crop|none")]
    pub augment: Option<String>,
    /// With --augment resized-crop: the least share of the image's area a crop covers
    /// (default 0.08, torchvision's).
    #[arg(long, value_name = "MIN")]
    pub crop_scale: Option<f32>,
    /// Validation sees the centred square covering this share of each image's side, scaled
    /// to the image size (timm's crop_pct; 0.875 is the ImageNet recipe's 224 of 256); eval
    /// and predict of the checkpoint take it too [default: 1, the whole image]
    #[arg(long, value_name = "F")]
    pub crop_pct: Option<f32>,
    /// Side of the squares the input engine caches, at least --image-size: the crops
    /// (--augment resized-crop, --crop-pct) are cut from this many pixels and scaled to the
    /// image size (ImageNet recipes store 256 for 224) [default: the image size]
    #[arg(long, value_name = "S")]
    pub store_size: Option<u32>,
    /// How each image becomes its stored square: direct (stretched to the square) or
    /// center-crop (the centred square of its shorter side, keeping the aspect ratio, as
    /// torchvision's Resize then CenterCrop) [default: direct]
    #[arg(long, value_name = "direct|center-crop")]
    pub resize_mode: Option<String>,
    /// Colour jitter of training images: brightness, contrast and saturation each scaled by a
    /// factor drawn from [max(0, 1−F), 1+F], in a random order (torchvision's ColorJitter(F,
    /// F, F), timm's --color-jitter; ImageNet recipes use 0.4) [default: 0, none]
    #[arg(long, value_name = "F")]
    pub color_jitter: Option<f32>,
    /// The hue part of the colour jitter: each training image's hue turned by a shift drawn
    /// from [−H, H] turns of the colour wheel, H ≤ 0.5, in a random order with the other
    /// three (torchvision's ColorJitter(…, hue=H)) [default: 0, none]
    #[arg(long, value_name = "H")]
    pub color_jitter_hue: Option<f32>,
    /// Automatic augmentation of training images, after the crop and before the colour
    /// jitter: ta_wide (torchvision's TrivialAugmentWide, one of 14 operations per image at a
    /// random strength; its ResNet-50 recipe's), ra (RandAugment, two operations at the
    /// --ra-magnitude strength), augmix (AugMix: the image blended with three chains of
    /// operations), imagenet, cifar10 or svhn (AutoAugment's learned policies) or none
    /// (torchvision's --auto-augment) [default: none]
    #[arg(long, value_name = "ta_wide|ra|augmix|imagenet|cifar10|svhn|none")]
    pub auto_augment: Option<String>,
    /// With --auto-augment ra: the strength of every operation, a bin from 0 to 30
    /// (torchvision's --ra-magnitude) [default: 9]
    #[arg(long, value_name = "M")]
    pub ra_magnitude: Option<u32>,
    /// With --auto-augment augmix: the operations' strength, 1 to 10 (torchvision's
    /// --augmix-severity) [default: 3]
    #[arg(long, value_name = "S")]
    pub augmix_severity: Option<u32>,
    /// Random erasing: this share of training images gets a random rectangle (2–33 % of its
    /// area, aspect 0.3–3.3) set to the mean colour, after the crop and mirror
    /// (torchvision's RandomErasing; its recipe uses 0.1, timm's --reprob 0.25) [default: 0]
    #[arg(long, value_name = "P")]
    pub random_erase: Option<f32>,
    /// Mixup of training batches: each image blended with another of its batch, λ·one +
    /// (1−λ)·other, and their labels likewise, λ drawn from Beta(A, A) per batch (timm's
    /// --mixup; ImageNet recipes use 0.1 to 0.8) [default: 0, off]
    #[arg(long, value_name = "A")]
    pub mixup: Option<f32>,
    /// CutMix of training batches: a box of another image of the batch pasted in, the labels
    /// weighted by area, λ drawn from Beta(A, A) per batch (timm's --cutmix; recipes use 1.0)
    /// [default: 0, off]
    #[arg(long, value_name = "A")]
    pub cutmix: Option<f32>,
    /// The share of training batches mixed by --mixup or --cutmix [default: 1]
    #[arg(long, value_name = "P")]
    pub mixup_prob: Option<f32>,
    /// With both --mixup and --cutmix, the share of mixed batches given CutMix [default: 0.5]
    #[arg(long, value_name = "P")]
    pub mixup_switch_prob: Option<f32>,
    /// Keep an exponential moving average of the weights, validate it after every epoch
    /// beside the weights themselves and store it in each checkpoint (model_ema.safetensors,
    /// for eval --ema and predict --ema); torchvision's --model-ema. A resumed run keeps it.
    #[arg(long)]
    pub model_ema: bool,
    /// Optimizer steps between updates of the moving average [default: 32]
    #[arg(long, value_name = "N")]
    pub model_ema_steps: Option<u32>,
    /// The moving average's decay, adjusted as torchvision does for the global batch,
    /// --model-ema-steps and --epochs: each update weighs the new weights by
    /// min(1, (1 − D) · global batch · steps / epochs) [default: 0.99998]
    #[arg(long, value_name = "D")]
    pub model_ema_decay: Option<f64>,
    /// Clip the averaged gradients of every step to this global L2 norm before the update
    /// (PyTorch's clip_grad_norm_; torchvision's --clip-grad-norm, timm's --clip-grad)
    /// [default: off]
    #[arg(long, value_name = "N")]
    pub clip_grad_norm: Option<f32>,
    /// No augmentation: the same as --augment none.
    #[arg(long)]
    pub no_augment: bool,
    /// Start from these weights (torchvision names); a new class head when the file's has
    /// another class count or it has none (a backbone alone), said at the start.
    #[arg(long, value_name = "FILE")]
    pub init_from: Option<PathBuf>,
    /// Start every residual block as the identity: the γ of its last batch norm at 0
    /// (torchvision's zero_init_residual; steadier first steps at large rates). Not with
    /// --init-from; a resumed run goes on from its own weights.
    #[arg(long)]
    pub zero_init_residual: bool,
    /// Flat layout (<class>/<images>): share of each class held out for validation.
    #[arg(long, value_name = "F")]
    pub valid_fraction: Option<f32>,
    /// The last incomplete batch: partial, drop or pad.
    #[arg(long, value_name = "partial|drop|pad")]
    pub last_batch: Option<String>,
    /// Training order: shuffle (every image once per epoch) or balanced (as many draws with
    /// replacement, every class equally likely: for imbalanced classes).
    #[arg(long, value_name = "shuffle|balanced")]
    pub sampler: Option<String>,
    /// A bad image file: skip (warn, count, report) or fail.
    #[arg(long, value_name = "skip|fail")]
    pub on_bad_image: Option<String>,
    /// Batch norm uses its running statistics while training (fine-tuning).
    #[arg(long)]
    pub freeze_bn: bool,
    /// No progress bars (epoch lines and the summary still print).
    #[arg(long)]
    pub quiet: bool,
    /// With --resume: if the training images changed since the checkpoint, restart the
    /// interrupted epoch on the new set instead of refusing.
    #[arg(long)]
    pub allow_data_change: bool,
    /// Replace the run already in --out instead of refusing: its files (checkpoint, weights,
    /// metrics, best/, report) are deleted, all at once, before the new run starts.
    #[arg(long)]
    pub overwrite: bool,
    /// Also save a checkpoint every N optimizer steps inside an epoch (a killed run loses at
    /// most N steps); 0 or absent: at epoch ends only.
    #[arg(long, value_name = "N")]
    pub save_every: Option<u64>,
    /// Stop when the monitored validation figure (--monitor) has not improved for E epochs
    /// (0: never). The best epoch's checkpoint is kept in RUN/best/ in any case.
    #[arg(long, value_name = "E")]
    pub early_stop: Option<u64>,
    /// The validation figure that picks the best epoch (RUN/best/) and that --early-stop
    /// watches: val_accuracy (default; ties go to the lower loss) or val_loss, or with
    /// --model-ema the moving average's val_ema_accuracy or val_ema_loss (timm's choice).
    #[arg(
        long,
        value_name = "val_accuracy|val_loss|val_ema_accuracy|val_ema_loss"
    )]
    pub monitor: Option<String>,
    /// The least improvement of the monitored figure that counts as one, for RUN/best/ and
    /// --early-stop [default: 0]
    #[arg(long, value_name = "D")]
    pub min_delta: Option<f64>,
    /// Stop after this many optimizer steps in total, saving a checkpoint as Ctrl-C does.
    #[arg(long, value_name = "N", hide = true)]
    pub stop_after_steps: Option<u64>,
}

fn parse<T: FromStr>(flag: &'static str, value: &str, hint: &str) -> Result<T, CliError> {
    value.parse().map_err(|_| CliError::BadValue {
        flag,
        value: value.to_string(),
        hint: hint.to_string(),
    })
}

/// Turns the flags (and, with `--resume`, the checkpoint's settings) into a [`TrainConfig`],
/// on the GPUs the driver lists and the launcher's variables.
///
/// With `--resume RUN`, every setting (model, image size, seed, batch, replicas, epochs,
/// optimizer and its hyper-parameters, schedule, augmentation…) defaults to the checkpoint's;
/// flags given again override them, except model, image size and resize mode, which must match.
pub fn to_config(args: &TrainArgs) -> Result<(TrainConfig, Option<String>), CliError> {
    let plan = super::launcher::plan(args, &launch::process_env, &launch::probe_gpus())?;
    config_for(args, &plan)
}

/// [`to_config`] for the launch `plan`; with `--dry-run`, neither the data nor the run folder
/// is looked at (a resumed run's checkpoint is read).
pub(crate) fn config_for(
    args: &TrainArgs,
    plan: &LaunchPlan,
) -> Result<(TrainConfig, Option<String>), CliError> {
    let data = args.data.clone().ok_or(CliError::Missing {
        flag: "--data DIR",
        hint: "point it at a dataset folder, or try `birdtrain demo`",
    })?;
    let look = !args.dry_run;
    if look {
        super::paths::expect_data(
            &data,
            "--data must be a folder with train/ and valid/ (or class folders with --valid-fraction), or a CSV file listing the images",
        )?;
    }
    if look && args.valid_fraction.is_some() && data.join("train").is_dir() {
        return Err(CliError::BadValue {
            flag: "--valid-fraction",
            value: args.valid_fraction.unwrap_or_default().to_string(),
            hint: format!(
                "{} has a train/ folder, so its valid/ split is used; --valid-fraction is for flat <class>/<images> folders",
                data.display()
            ),
        });
    }
    let resumed = match &args.resume {
        Some(run) => Some(CheckpointMeta::load(run).map_err(TrainError::from)?),
        None => None,
    };
    let resize_mode = match &args.resize_mode {
        Some(v) => Some(parse::<ResizeMode>(
            "--resize-mode",
            v,
            "expected direct or center-crop",
        )?),
        None => None,
    };
    let mut cfg = TrainConfig::new(&data);
    if let Some(meta) = &resumed {
        let resume_dir = args.resume.as_ref().expect("resumed implies --resume");
        cfg.arch = Arch::from_str(&meta.model).map_err(TrainError::from)?;
        cfg.image_size = meta.image_size;
        cfg.seed = meta.seed;
        cfg.batch_size = meta.batch_size;
        cfg.replicas = meta.replicas;
        cfg.epochs = meta.epochs;
        cfg.out = resume_dir.clone();
        let from_sidecar = |e| super::sidecar::sidecar_error(resume_dir, e);
        cfg.optimizer = meta.optimizer;
        cfg.apply_settings(&meta.settings);
        cfg.validate().map_err(from_sidecar)?;
        if let Some(model) = &args.model {
            let wanted = Arch::from_str(model).map_err(TrainError::from)?;
            if wanted != cfg.arch {
                return Err(TrainError::CheckpointMismatch {
                    path: resume_dir.clone(),
                    what: "model",
                    expected: wanted.name().into(),
                    found: meta.model.clone(),
                    hint: "resume with the checkpoint's --model, or start a new run",
                }
                .into());
            }
        }
        if let Some(size) = args.image_size {
            if size != meta.image_size {
                return Err(TrainError::CheckpointMismatch {
                    path: resume_dir.clone(),
                    what: "image size",
                    expected: size.to_string(),
                    found: meta.image_size.to_string(),
                    hint: "resume with the checkpoint's --image-size",
                }
                .into());
            }
        }
        if let Some(wanted) = resize_mode {
            if wanted != meta.settings.resize_mode {
                return Err(TrainError::CheckpointMismatch {
                    path: resume_dir.clone(),
                    what: "resize mode",
                    expected: wanted.as_str().into(),
                    found: meta.settings.resize_mode.as_str().into(),
                    hint: "resume with the checkpoint's --resize-mode (the images it learned from)",
                }
                .into());
            }
        }
    } else {
        if let Some(model) = &args.model {
            cfg.arch = Arch::from_str(model).map_err(TrainError::from)?;
        }
        // CIFAR-style models are for small images: default to 32×32 with them.
        cfg.image_size = args
            .image_size
            .unwrap_or(if cfg.arch.is_cifar() { 32 } else { 224 });
    }
    let device = DeviceChoice::of_plan(plan);
    let note = plan.cpu_fallback.clone();
    cfg.device = device;
    if let Some(v) = args.replicas {
        cfg.replicas = v;
    }
    if let DeviceChoice::Cuda(n) = device {
        cfg.replicas = n;
    }
    // A resumed run keeps the checkpoint's batch-norm mode; like --freeze-bn, the flag can
    // only turn it on.
    let saved_sync_bn = cfg.dist.sync_bn;
    cfg.dist = args.dist.to_settings();
    cfg.dist.sync_bn |= saved_sync_bn;
    if let Some(v) = args.epochs {
        cfg.epochs = v;
    }
    if let Some(BatchSize::Images(v)) = args.batch_size {
        cfg.batch_size = v;
    }
    if let Some(v) = args.seed {
        cfg.seed = v;
    }
    if let Some(v) = &args.optimizer {
        cfg.optimizer = parse::<OptimizerChoice>("--optimizer", v, "expected sgd, adam or adamw")?;
        if cfg.optimizer != OptimizerChoice::Sgd && args.lr.is_none() && resumed.is_none() {
            // Adam's usual 1e-3 at batch 32, expressed for the 256 reference batch.
            cfg.lr = 0.008;
        }
    }
    if let Some(v) = args.lr {
        cfg.lr = v;
    }
    if let Some(v) = args.momentum {
        cfg.momentum = v;
    }
    if let Some(v) = args.nesterov {
        cfg.nesterov = v;
    }
    if let Some(v) = args.weight_decay {
        cfg.weight_decay = v;
    }
    if let Some(v) = args.label_smoothing {
        cfg.label_smoothing = v;
    }
    if let Some(v) = args.warmup_epochs {
        cfg.warmup_epochs = v;
    }
    if let Some(v) = &args.schedule {
        // Naming a resumed plateau or step run's schedule again keeps its settings, as
        // leaving the flag out would; the --plateau-* and --step-* flags given override them
        // below.
        let plateau = match cfg.schedule {
            Decay::Plateau(p) => p,
            _ => Plateau::DEFAULT,
        };
        let (every, gamma) = match cfg.schedule {
            Decay::Step {
                every_epochs,
                gamma,
            } => (every_epochs, gamma),
            _ => (
                TrainConfig::DEFAULT_STEP_EVERY,
                TrainConfig::DEFAULT_STEP_GAMMA,
            ),
        };
        cfg.schedule = parse::<ScheduleChoice>(
            "--schedule",
            v,
            "expected cosine, step, constant or plateau",
        )?
        .decay(every, gamma, plateau);
    }
    set_plateau(&mut cfg.schedule, args)?;
    set_step(&mut cfg.schedule, args)?;
    if let Some(v) = args.workers.filter(|&w| w > 0) {
        cfg.workers = v;
    } else if plan.local_processes > 1 {
        cfg.workers = plan.default_workers(pipeline::limits::cores());
    }
    if let Some(v) = args.threads {
        cfg.threads = v;
    }
    cfg.cache_dir = args.cache_dir.clone();
    if args.valid_fraction.is_some() {
        cfg.valid_fraction = args.valid_fraction;
    }
    if let Some(v) = &args.last_batch {
        cfg.last_batch = parse::<LastBatch>("--last-batch", v, "expected partial, drop or pad")?;
    }
    if let Some(v) = &args.sampler {
        cfg.sampler = parse::<Sampling>("--sampler", v, "expected shuffle or balanced")?;
    }
    if let Some(v) = &args.on_bad_image {
        cfg.on_bad_image = parse::<OnBadImage>("--on-bad-image", v, "expected skip or fail")?;
    }
    if args.no_augment && args.augment.is_some() {
        return Err(CliError::BadValue {
            flag: "--no-augment",
            value: "true".into(),
            hint:
                "give either --no-augment or --augment, not both (--no-augment is --augment none)"
                    .into(),
        });
    }
    if let Some(v) = &args.augment {
        cfg.augment = Augmentation::parse(v).ok_or_else(|| CliError::BadValue {
            flag: "--augment",
            value: v.clone(),
            hint: format!("expected {}", Augmentation::CHOICES),
        })?;
    }
    if args.no_augment {
        cfg.augment = Augmentation::None;
    }
    if let Some(f) = args.crop_pct {
        cfg.crop_pct = f;
    }
    if let Some(side) = args.store_size {
        cfg.store_size = Some(side);
    }
    if let Some(h) = args.color_jitter_hue {
        cfg.color_jitter_hue = h;
    }
    if let Some(p) = args.random_erase {
        cfg.random_erase = p;
    }
    if let Some(a) = args.mixup {
        cfg.mix.mixup = a;
    }
    if let Some(a) = args.cutmix {
        cfg.mix.cutmix = a;
    }
    if let Some(p) = args.mixup_prob {
        cfg.mix.prob = p;
    }
    if let Some(p) = args.mixup_switch_prob {
        cfg.mix.switch_prob = p;
    }
    for (flag, given) in [
        ("--mixup-prob", args.mixup_prob),
        ("--mixup-switch-prob", args.mixup_switch_prob),
    ] {
        if let (Some(p), false) = (given, cfg.mix.is_on()) {
            return Err(CliError::BadValue {
                flag,
                value: p.to_string(),
                hint: "it shares out the batches of --mixup and --cutmix, and both are off: add --mixup A or --cutmix A".into(),
            });
        }
    }
    if let Some(n) = args.clip_grad_norm {
        cfg.clip_grad_norm = Some(n);
    }
    if args.model_ema {
        cfg.model_ema.get_or_insert(EmaRecipe::TORCHVISION);
    }
    for (flag, given) in [
        (
            "--model-ema-steps",
            args.model_ema_steps.map(|n| n.to_string()),
        ),
        (
            "--model-ema-decay",
            args.model_ema_decay.map(|d| d.to_string()),
        ),
    ] {
        if let (Some(value), None) = (given, &cfg.model_ema) {
            return Err(CliError::BadValue {
                flag,
                value,
                hint: "it tunes the moving average of the weights, which is off: add --model-ema"
                    .into(),
            });
        }
    }
    if let Some(ema) = &mut cfg.model_ema {
        if let Some(n) = args.model_ema_steps {
            ema.steps = n;
        }
        if let Some(d) = args.model_ema_decay {
            ema.decay = d;
        }
    }
    if let Some(mode) = resize_mode {
        cfg.resize_mode = mode;
    }
    if let Some(f) = args.color_jitter {
        cfg.color_jitter = f;
    }
    if let Some(word) = &args.auto_augment {
        let policy = parse_policy(word)?;
        // Naming a resumed run's own policy keeps its strength (--ra-magnitude,
        // --augmix-severity), as leaving the flag out would.
        let same = |p: &AutoAugment| Some(p.as_str()) == cfg.auto_augment.map(|r| r.as_str());
        if !policy.as_ref().is_some_and(same) {
            cfg.auto_augment = policy;
        }
    }
    set_policy_strength(
        &mut cfg.auto_augment,
        args.ra_magnitude,
        args.augmix_severity,
    )?;
    if let Some(min) = args.crop_scale {
        let Augmentation::ResizedCrop(crop) = &mut cfg.augment else {
            return Err(CliError::BadValue {
                flag: "--crop-scale",
                value: min.to_string(),
                hint: format!(
                    "it sets the resized crop, and this run's augmentation is {}: add --augment resized-crop",
                    cfg.augment.as_str()
                ),
            });
        };
        crop.scale.0 = min;
    }
    if args.freeze_bn {
        cfg.freeze_bn = true;
    }
    if let (Some(path), Some(run)) = (&args.init_from, &args.resume) {
        return Err(CliError::BadValue {
            flag: "--init-from",
            value: path.display().to_string(),
            hint: format!(
                "--resume {} continues from its own checkpoint's weights: give --init-from only to start a new run",
                run.display()
            ),
        });
    }
    if let (true, Some(path)) = (args.zero_init_residual, &args.init_from) {
        return Err(CliError::BadValue {
            flag: "--init-from",
            value: path.display().to_string(),
            hint: "these weights replace the fresh initialisation that --zero-init-residual changes: give one of the two".into(),
        });
    }
    // A resumed run goes on from its own weights; the flag only shapes a fresh start.
    cfg.zero_init_residual = args.zero_init_residual;
    cfg.init_from = args.init_from.clone();
    if let Some(path) = cfg.init_from.as_ref().filter(|_| look) {
        super::paths::expect_file(path, "--init-from takes a .safetensors weights file")?;
    }
    cfg.resume = args.resume.clone();
    cfg.allow_data_change = args.allow_data_change;
    cfg.overwrite = args.overwrite;
    cfg.stop_after_steps = args.stop_after_steps;
    if let Some(v) = args.save_every {
        cfg.save_every = v;
    }
    if let Some(v) = args.early_stop {
        cfg.early_stop = v;
    }
    if let Some(v) = &args.monitor {
        cfg.best_rule.monitor = parse::<Monitor>(
            "--monitor",
            v,
            "expected val_accuracy (or val_acc), val_loss, val_ema_accuracy or val_ema_loss",
        )?;
    }
    if let Some(v) = args.min_delta {
        cfg.best_rule.min_delta = v;
    }
    cfg.progress = !args.quiet;
    if let (Some(meta), Some(run), true) = (&resumed, &args.resume, look) {
        let changed = resume_overrides(meta, &cfg);
        if !changed.is_empty() {
            // As for another batch size: said once, and the values given are used.
            tracing::warn!(
                "resuming {} with {}: the values given win from here on (leave the flags out to keep the checkpoint's)",
                run.display(),
                changed.join(", ")
            );
        }
    }
    if resumed.is_none() {
        cfg.out = match &args.out {
            Some(out) => out.clone(),
            None => next_run_dir(Path::new("runs"), cfg.arch.name()),
        };
    } else if let Some(out) = &args.out {
        cfg.out = out.clone();
    }
    cfg.validate().map_err(CliError::Train)?;
    super::counts::check_train_counts(&cfg)?;
    if look {
        super::paths::check_train_paths(&cfg)?;
    }
    let mut note = note;
    if look && args.batch_size == Some(BatchSize::Auto) {
        let classes = match &resumed {
            Some(meta) => meta.classes.len(),
            None => pipeline::DatasetSource::at(&cfg.data, cfg.valid_fraction)
                .classes()
                .map_err(TrainError::from)?
                .len(),
        };
        let (batch, line) = train::largest_gpu_batch(&cfg, classes)?;
        cfg.batch_size = batch;
        // The measured batch meets the same checks as a given one (host memory included).
        cfg.validate().map_err(CliError::Train)?;
        super::counts::check_train_counts(&cfg)?;
        note = Some(match note {
            Some(n) => format!("{n}\n{line}"),
            None => line,
        });
    }
    Ok((cfg, note))
}

/// The settings of `cfg` that differ from the checkpoint `meta` a run resumes, as
/// "--lr 0.1 (the checkpoint's: 0.8)": the flags given again with other values.
fn resume_overrides(meta: &CheckpointMeta, cfg: &TrainConfig) -> Vec<String> {
    let mut saved = TrainConfig::new(&cfg.data);
    saved.apply_settings(&meta.settings);
    let mut changed = Vec::new();
    let mut differ = |flag: &str, now: String, then: String| {
        if now != then {
            changed.push(format!("{flag} {now} (the checkpoint's: {then})"));
        }
    };
    differ("--seed", cfg.seed.to_string(), meta.seed.to_string());
    differ("--lr", cfg.lr.to_string(), saved.lr.to_string());
    differ(
        "--augment",
        cfg.augment.as_str().to_string(),
        saved.augment.as_str().to_string(),
    );
    differ(
        "--mixup",
        cfg.mix.mixup.to_string(),
        saved.mix.mixup.to_string(),
    );
    differ(
        "--cutmix",
        cfg.mix.cutmix.to_string(),
        saved.mix.cutmix.to_string(),
    );
    differ(
        "--sampler",
        cfg.sampler.as_str().to_string(),
        saved.sampler.as_str().to_string(),
    );
    differ(
        "--label-smoothing",
        cfg.label_smoothing.to_string(),
        saved.label_smoothing.to_string(),
    );
    differ(
        "--freeze-bn",
        cfg.freeze_bn.to_string(),
        saved.freeze_bn.to_string(),
    );
    changed
}

/// `--batch-size`: images per replica, or `auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchSize {
    /// This many images per replica per step.
    Images(usize),
    /// The most every GPU of the run holds (measured on each).
    Auto,
}

fn batch_size_value(text: &str) -> Result<BatchSize, String> {
    let text = text.trim();
    if text.eq_ignore_ascii_case("auto") {
        return Ok(BatchSize::Auto);
    }
    text.parse().map(BatchSize::Images).map_err(|_| {
        "expected a number of images per GPU or replica, or auto (the most the GPUs hold)".into()
    })
}

/// `runs/<model>-<n>` with the first n not taken.
pub(crate) fn next_run_dir(root: &Path, model: &str) -> PathBuf {
    (1..)
        .map(|n| root.join(format!("{model}-{n}")))
        .find(|p| !p.exists())
        .expect("an unbounded range always has a free name")
}

/// Runs the training command. Ctrl-C or SIGTERM finishes the current step, saves a checkpoint
/// and exits with 128 + the signal's number (130 after Ctrl-C, 143 after SIGTERM).
pub fn run(args: TrainArgs) -> Result<ExitCode, CliError> {
    if args.dry_run {
        return super::dry_run::run(args);
    }
    let plan = super::launcher::plan(&args, &launch::process_env, &launch::probe_gpus())?;
    let (args, restart) = super::launcher::resume_restarted(args, &plan)?;
    let (cfg, note) = config_for(&args, &plan)?;
    for note in plan.overrides.iter().chain(&restart).chain(&note) {
        outln!("{note}");
    }
    let stop = install_stop_signals("saving a checkpoint")?;
    let outcome = train::train(&cfg, &stop.flag)?;
    match stop.signal() {
        Some(signal) if outcome.interrupted => Ok(ExitCode::from(128 + signal as u8)),
        _ => Ok(ExitCode::SUCCESS),
    }
}

/// Applies the `--plateau-*` flags given to the run's plateau schedule (the flag's, or a
/// resumed run's own); given with another schedule, they are an error naming the first.
fn set_plateau(schedule: &mut Decay, args: &TrainArgs) -> Result<(), CliError> {
    let Decay::Plateau(p) = &mut *schedule else {
        let given = [
            (
                "--plateau-patience",
                args.plateau_patience.map(|v| v.to_string()),
            ),
            (
                "--plateau-factor",
                args.plateau_factor.map(|v| v.to_string()),
            ),
            (
                "--plateau-cooldown",
                args.plateau_cooldown.map(|v| v.to_string()),
            ),
            (
                "--plateau-min-lr",
                args.plateau_min_lr.map(|v| v.to_string()),
            ),
        ];
        return refuse_tuning(schedule, "plateau", given);
    };
    if let Some(v) = args.plateau_patience {
        p.patience = v;
    }
    if let Some(v) = args.plateau_factor {
        p.factor = v;
    }
    if let Some(v) = args.plateau_cooldown {
        p.cooldown = v;
    }
    if let Some(v) = args.plateau_min_lr {
        p.min_lr = v;
    }
    Ok(())
}

/// The error for the first of `given` (flag, value if given) that tunes the schedule `wanted`
/// when the run's `schedule` is another; `Ok` when none was given.
fn refuse_tuning<const N: usize>(
    schedule: &Decay,
    wanted: &str,
    given: [(&'static str, Option<String>); N],
) -> Result<(), CliError> {
    match given.into_iter().find_map(|(f, v)| Some((f, v?))) {
        Some((flag, value)) => Err(CliError::BadValue {
            flag,
            value,
            hint: format!(
                "it tunes the {wanted} schedule, and this run's schedule is {}: add --schedule {wanted}",
                schedule.choice()
            ),
        }),
        None => Ok(()),
    }
}

/// Applies `--step-every` and `--step-gamma` to the run's step schedule (the flag's, or a
/// resumed run's own); given with another schedule, they are an error naming the first.
fn set_step(schedule: &mut Decay, args: &TrainArgs) -> Result<(), CliError> {
    let Decay::Step {
        every_epochs,
        gamma,
    } = &mut *schedule
    else {
        let given = [
            ("--step-every", args.step_every.map(|v| v.to_string())),
            ("--step-gamma", args.step_gamma.map(|v| v.to_string())),
        ];
        return refuse_tuning(schedule, "step", given);
    };
    if let Some(v) = args.step_every {
        *every_epochs = v;
    }
    if let Some(v) = args.step_gamma {
        *gamma = v;
    }
    Ok(())
}

/// The policy `--auto-augment` names (`None`: `none`).
pub(crate) fn parse_policy(word: &str) -> Result<Option<AutoAugment>, CliError> {
    AutoAugment::parse(word).ok_or_else(|| CliError::BadValue {
        flag: "--auto-augment",
        value: word.to_string(),
        hint: format!("expected {}", AutoAugment::CHOICES),
    })
}

/// Sets the strength of the policy (`--ra-magnitude` for RandAugment, `--augmix-severity`
/// for AugMix); either flag without its policy is an error naming it.
pub(crate) fn set_policy_strength(
    policy: &mut Option<AutoAugment>,
    ra_magnitude: Option<u32>,
    augmix_severity: Option<u32>,
) -> Result<(), CliError> {
    if let Some(m) = ra_magnitude {
        let Some(AutoAugment::RandAugment { magnitude }) = policy else {
            return Err(CliError::BadValue {
                flag: "--ra-magnitude",
                value: m.to_string(),
                hint: "it sets RandAugment's strength: add --auto-augment ra".into(),
            });
        };
        *magnitude = m;
    }
    if let Some(n) = augmix_severity {
        let Some(AutoAugment::AugMix { severity }) = policy else {
            return Err(CliError::BadValue {
                flag: "--augmix-severity",
                value: n.to_string(),
                hint: "it sets AugMix's strength: add --auto-augment augmix".into(),
            });
        };
        *severity = n;
    }
    Ok(())
}

/// Set by Ctrl-C (SIGINT) or SIGTERM: the run finishes its step, saves and stops.
pub(crate) struct StopSignals {
    /// Polled by the training loop after every step.
    pub(crate) flag: Arc<AtomicBool>,
    /// The first signal received (0: none).
    received: Arc<AtomicI32>,
}

impl StopSignals {
    /// The signal that asked to stop, if any.
    pub(crate) fn signal(&self) -> Option<i32> {
        match self.received.load(Ordering::SeqCst) {
            0 => None,
            s => Some(s),
        }
    }
}

/// Installs the handlers of SIGINT and SIGTERM (what Slurm, Kubernetes and systemd send before
/// they kill): the first one sets the stop flag, a second one exits at once. `finishing` says
/// what the command does before it exits ("saving a checkpoint"). A thread the OS refuses
/// is an error (the run would not stop cleanly).
pub(crate) fn install_stop_signals(finishing: &'static str) -> Result<StopSignals, CliError> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let stop = StopSignals {
        flag: Arc::new(AtomicBool::new(false)),
        received: Arc::new(AtomicI32::new(0)),
    };
    let (flag, received) = (stop.flag.clone(), stop.received.clone());
    match signal_hook::iterator::Signals::new([SIGINT, SIGTERM]) {
        Ok(mut signals) => {
            let started = pipeline::threads::spawn("stop-signals", move || {
                for signal in signals.forever() {
                    let name = if signal == SIGTERM {
                        "SIGTERM"
                    } else {
                        "Ctrl-C"
                    };
                    if flag.swap(true, Ordering::SeqCst) {
                        // A second signal: the user does not want to wait (a previous checkpoint
                        // stays intact: checkpoints commit atomically).
                        eprintln!("\n{name} again: exiting now");
                        std::process::exit(128 + signal);
                    }
                    received.store(signal, Ordering::SeqCst);
                    eprintln!("\n{name}: finishing this step, {finishing}, then exiting ({name} again to quit now)");
                }
            });
            if let Err(e) = started {
                return Err(TrainError::from(e).into());
            }
        }
        Err(e) => tracing::warn!(
            "signal handlers not installed ({e}); Ctrl-C and SIGTERM will stop at once, without {finishing}"
        ),
    }
    Ok(stop)
}
