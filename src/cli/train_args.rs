//! `birdtrain [train] --data DIR …`: the training command's flags. The recorded settings'
//! flags come from their table ([`RecipeArgs`], [`AugmentArgs`]); the command runs in
//! [`super::train_command`], its configuration is built in [`super::train_config`].

use std::path::PathBuf;

use clap::Args;

use super::augment_args::AugmentArgs;
use super::choice::choice;
use super::settings_args::RecipeArgs;
use crate::dist::DistSettings;
use crate::optim::OptimizerChoice;

/// Multi-GPU and multi-node flags (`--gpus` itself belongs to the training flags). Their
/// defaults are [`DistSettings::default`]'s: the settings own them, the flags only spell them.
#[derive(Debug, Clone, PartialEq, Args)]
pub struct DistArgs {
    /// Number of nodes (processes) in a multi-node run [default: WORLD_SIZE or
    /// SLURM_NTASKS, else 1].
    #[arg(long, help_heading = "Distributed")]
    pub nodes: Option<usize>,
    /// This node's rank, 0..nodes; node 0 serves the rendezvous [default: RANK or
    /// SLURM_PROCID, else 0].
    #[arg(long, help_heading = "Distributed")]
    pub node_rank: Option<usize>,
    /// Rendezvous address host:port of node 0 [default: MASTER_ADDR:MASTER_PORT, under
    /// torchrun MASTER_PORT + 1; under Slurm its first host:29500].
    #[arg(long, help_heading = "Distributed")]
    pub master: Option<String>,
    /// Seconds to wait for every node at the rendezvous.
    #[arg(long, help_heading = "Distributed", default_value_t = DistSettings::default().rendezvous_timeout)]
    pub rendezvous_timeout: u64,
    /// Seconds a collective may take before every rank aborts (a rank stopped answering).
    #[arg(long, help_heading = "Distributed", default_value_t = DistSettings::default().collective_timeout)]
    pub collective_timeout: u64,
    /// Seconds the ranks wait for each other at an epoch end or a checkpoint (validation of
    /// each rank's share, rank 0 writing the run folder), in place of --collective-timeout;
    /// a rank that fails there still stops the others at once.
    #[arg(long, help_heading = "Distributed", default_value_t = DistSettings::default().epoch_end_timeout)]
    pub epoch_end_timeout: u64,
    /// Gradient bucket size in MiB (one average per bucket, started during backward).
    #[arg(long, help_heading = "Distributed", default_value_t = DistSettings::default().bucket_mb)]
    pub bucket_mb: f64,
    /// Staging slots per GPU (batch k+1 uploads while batch k computes).
    #[arg(long, help_heading = "Distributed", default_value_t = DistSettings::default().prefetch_depth)]
    pub prefetch_depth: usize,
    /// Write a Chrome trace (open in Perfetto) of copies, compute, all-reduces and waits;
    /// node k > 0 of a multi-node run writes its own beside it (trace.node<k>.json for
    /// trace.json).
    #[arg(long, help_heading = "Distributed")]
    pub trace: Option<PathBuf>,
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
            ..DistSettings::default()
        }
    }
}

/// Training flags. `--lr` is for a global batch of 256 and scales linearly.
#[derive(Debug, Clone, Default, Args)]
pub struct TrainArgs {
    /// Dataset root: train/valid[/test]/<class>/<images>, or <class>/<images> with --valid-fraction, or a CSV file listing the images (path, label[, split] columns).
    #[arg(long, value_name = "DIR", help_heading = "Data")]
    pub data: Option<PathBuf>,
    /// Decode workers (default, or 0: the available cores, shared among torchrun's
    /// LOCAL_WORLD_SIZE).
    #[arg(long, value_name = "W", help_heading = "Data")]
    pub workers: Option<usize>,
    /// Pixel cache folder (default: the per-user cache folder).
    #[arg(long, value_name = "C", help_heading = "Data")]
    pub cache_dir: Option<PathBuf>,
    /// A bad image file: skip (warn, count, report) or fail
    #[arg(long, value_name = "POLICY", help_heading = "Data", value_parser = choice::<pipeline::OnBadImage>(), ignore_case = true)]
    pub on_bad_image: Option<pipeline::OnBadImage>,
    /// GPUs to use: a count (0 = CPU) or `all`. Default: every GPU, or the CPU when none;
    /// one process per GPU (torchrun, srun): the GPU of LOCAL_RANK or SLURM_LOCALID.
    #[arg(long, value_name = "N|all", help_heading = "Devices")]
    pub gpus: Option<String>,
    /// CPU data-parallel replicas (each gets its own micro-batch of --batch-size images).
    #[arg(long, value_name = "R", help_heading = "Devices")]
    pub replicas: Option<usize>,
    /// CPU backend threads (default, or 0: one per available core).
    #[arg(long, value_name = "T", help_heading = "Devices")]
    pub threads: Option<usize>,
    /// Multi-GPU and multi-node flags.
    #[command(flatten)]
    pub dist: DistArgs,
    /// Network: resnet8, resnet20, resnet56 (small images), resnet18/34/50/101/152 (default resnet50).
    #[arg(long, value_name = "M", help_heading = "Model")]
    pub model: Option<String>,
    /// Stored and training image size S (images become S×S) (default 224, 32 for the
    /// small-image models)
    #[arg(long, value_name = "S", help_heading = "Model")]
    pub image_size: Option<u32>,
    /// Start from these weights (torchvision names); a new class head when the file's has
    /// another class count or it has none (a backbone alone), said at the start.
    #[arg(long, value_name = "FILE", help_heading = "Model")]
    pub init_from: Option<PathBuf>,
    /// Start every residual block as the identity: the γ of its last batch norm at 0
    /// (torchvision's zero_init_residual; steadier first steps at large rates). Not with
    /// --init-from; a resumed run goes on from its own weights.
    #[arg(long, help_heading = "Model")]
    pub zero_init_residual: bool,
    /// Epochs to train in total.
    #[arg(long, value_name = "E", help_heading = "Training")]
    pub epochs: Option<u64>,
    /// Images per replica per step (the global batch is replicas × this); `auto` on GPUs:
    /// the most every GPU holds, measured on them (at most the training set's share).
    #[arg(long, value_name = "B|auto", value_parser = batch_size_value, help_heading = "Training")]
    pub batch_size: Option<BatchSize>,
    /// Seed of initialisation, data order and augmentation.
    #[arg(long, value_name = "S", help_heading = "Training")]
    pub seed: Option<u64>,
    /// Optimizer: sgd, adam or adamw.
    #[arg(long, value_name = "NAME", help_heading = "Optimizer", value_parser = choice::<OptimizerChoice>(), ignore_case = true)]
    pub optimizer: Option<OptimizerChoice>,
    /// The recorded training settings with a flag of their own (optimizer, schedule,
    /// mixing, data order, checkpoints).
    #[command(flatten)]
    pub recipe: RecipeArgs,
    /// The augmentation flags (shared with `bench pipeline`).
    #[command(flatten)]
    pub augment: AugmentArgs,
    /// No augmentation: the same as --augment none.
    #[arg(long, help_heading = "Augmentation")]
    pub no_augment: bool,
    /// Keep an exponential moving average of the weights, validate it after every epoch
    /// beside the weights themselves and store it in each checkpoint (model_ema.safetensors,
    /// for eval --ema and predict --ema); torchvision's --model-ema. A resumed run keeps it.
    #[arg(long, help_heading = "Moving average")]
    pub model_ema: bool,
    /// Optimizer steps between updates of the moving average [default: 32]
    #[arg(long, value_name = "N", help_heading = "Moving average")]
    pub model_ema_steps: Option<u32>,
    /// The moving average's decay, adjusted as torchvision does for the global batch,
    /// --model-ema-steps and --epochs: each update weighs the new weights by
    /// min(1, (1 − D) · global batch · steps / epochs) [default: 0.99998]
    #[arg(long, value_name = "D", help_heading = "Moving average")]
    pub model_ema_decay: Option<f64>,
    /// Run folder for metrics.jsonl, report.png and checkpoints (default: runs/<model>-<n>;
    /// for lr-find, the sweep's lr_find.jsonl and lr_find.png, default runs/lr-find-<model>-<n>).
    #[arg(long, value_name = "RUN", help_heading = "Run folder")]
    pub out: Option<PathBuf>,
    /// Continue the run saved in RUN exactly where it stopped.
    #[arg(long, value_name = "RUN", help_heading = "Run folder")]
    pub resume: Option<PathBuf>,
    /// With --resume: if the training images changed since the checkpoint, restart the
    /// interrupted epoch on the new set instead of refusing.
    #[arg(long, help_heading = "Run folder")]
    pub allow_data_change: bool,
    /// Replace the run already in --out instead of refusing: its files (checkpoint, weights,
    /// metrics, best/, report) are deleted, all at once, before the new run starts.
    #[arg(long, help_heading = "Run folder")]
    pub overwrite: bool,
    /// The price of one device for one hour (per GPU on GPUs, per machine on the CPU),
    /// recorded with this segment of the run (a resumed run may run elsewhere at another
    /// price); the summary and `birdtrain compare` print the cost [default:
    /// BIRDTRAIN_PRICE_PER_HOUR, else unknown]
    #[arg(long, value_name = "P", help_heading = "Run folder")]
    pub price_per_hour: Option<String>,
    /// Print what this launch resolves to (nodes, ranks, devices, batch, lr, workers) and
    /// exit: reads no data, writes nothing, asks no GPU driver.
    #[arg(long, help_heading = "Output")]
    pub dry_run: bool,
    /// With --dry-run: print it as one line of JSON.
    #[arg(long, requires = "dry_run", help_heading = "Output")]
    pub json: bool,
    /// No progress bars (epoch lines and the summary still print).
    #[arg(long, help_heading = "Output")]
    pub quiet: bool,
    /// Stop after this many optimizer steps in total, saving a checkpoint as Ctrl-C does.
    #[arg(long, value_name = "N", hide = true)]
    pub stop_after_steps: Option<u64>,
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
