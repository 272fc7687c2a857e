//! `birdtrain … --dry-run [--json]`: what a launch resolves to, so that a cluster user can
//! check it on a login node before queueing it.
//!
//! It resolves what a run resolves before it starts (the flags, the launcher's variables,
//! the checkpoint of a resumed run) through the same code, and stops there: no data is read,
//! no run folder touched and no GPU driver asked. The GPUs are the ones asked for: the
//! entries of `CUDA_VISIBLE_DEVICES` when it is set (what the driver will list), else those a
//! count or a local rank names (`--gpus 4` is 0..4, `LOCAL_RANK=3` is 3); "every GPU" (`--gpus
//! all`, or no `--gpus` outside one-process-per-GPU launches) needs `CUDA_VISIBLE_DEVICES`.
//! Figures that need the dataset (its classes and images) are not part of it: `lr` is `--lr`
//! scaled to the global batch, which a run caps at the training set's size.

use std::process::ExitCode;

use pipeline::limits;
use serde::Serialize;

use super::train_args::{BatchSize, TrainArgs};
use super::train_config::config_for;
use super::CliError;
use crate::dist::launch::{self, Env, VisibleGpus};
use crate::train::DeviceChoice;

/// The resolved launch, with the field names of `--dry-run --json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct DryRun {
    /// Processes that meet at the rendezvous (`WORLD_SIZE` under torchrun).
    pub nodes: usize,
    /// This process among them.
    pub node_rank: usize,
    /// `host:port` of the master, as the flag or the launcher names it (none: one node).
    pub master: Option<String>,
    /// The port node 0's rendezvous listens on at the master's host (none: one node).
    pub rendezvous_port: Option<u16>,
    /// GPU ranks this process drives (0 on the CPU).
    pub local_ranks: usize,
    /// CUDA ordinals asked for.
    pub devices: Vec<usize>,
    /// Images per step over every rank of every node, as if each node drives as many GPUs as
    /// this one (none: `--batch-size auto`, measured by the run).
    pub global_batch: Option<usize>,
    /// `--lr` scaled linearly from a batch of 256 to the global batch.
    pub lr: Option<f32>,
    /// Decode workers of this process.
    pub workers: usize,
    /// `flags`, `torchrun`, `slurm` or `env`.
    pub launcher: &'static str,
    /// Whether the run continues a checkpoint (`--resume`, or a restarted torchrun worker).
    pub resume: bool,
    /// Lines a text report adds: where the devices came from, overrides, the restart.
    #[serde(skip)]
    pub notes: Vec<String>,
}

/// Resolves the launch of `args` in the environment `env`.
pub(crate) fn resolve(args: TrainArgs, env: Env<'_>) -> Result<DryRun, CliError> {
    let visible = VisibleGpus::from_cuda_visible_devices(env);
    let plan = super::launcher::plan(&args, env, &visible)?;
    let (args, restart) = super::launcher::resume_restarted(args, &plan)?;
    let (mut cfg, cpu_note) = config_for(&args, &plan)?;
    // As the run's setup does once the rendezvous has counted the GPUs of every node.
    if let DeviceChoice::Cuda(local) = cfg.device {
        cfg.replicas = plan.nodes * local;
    }
    let measured = args.batch_size == Some(BatchSize::Auto);
    if measured {
        crate::train::check_auto_batch(&plan)?;
    }
    let mut notes = vec![format!("devices from {}", plan.devices_source)];
    notes.extend(plan.overrides.iter().cloned());
    notes.extend(restart.into_iter().chain(cpu_note));
    Ok(DryRun {
        nodes: plan.nodes,
        node_rank: plan.node_rank,
        master: plan.master.as_ref().map(ToString::to_string),
        rendezvous_port: plan.rendezvous_port,
        local_ranks: plan.devices.len(),
        devices: plan.devices.clone(),
        global_batch: (!measured).then(|| cfg.global_batch()),
        lr: (!measured).then(|| cfg.scaled_lr()),
        workers: match cfg.workers {
            0 => limits::cores(),
            w => w,
        },
        launcher: plan.launcher.as_str(),
        resume: cfg.resume.is_some(),
        notes,
    })
}

/// Prints the launch of `args` (one JSON line with `--json`) and exits 0.
pub(crate) fn run(args: TrainArgs) -> Result<ExitCode, CliError> {
    let json = args.json;
    let report = resolve(args, &launch::process_env)?;
    if json {
        let line = serde_json::to_string(&report)
            .map_err(|e| CliError::Other(anyhow::anyhow!("cannot write the dry run: {e}")))?;
        outln!("{line}");
    } else {
        print_text(&report);
    }
    Ok(ExitCode::SUCCESS)
}

fn print_text(r: &DryRun) {
    let or_none = |v: Option<String>| v.unwrap_or_else(|| "none (one node)".into());
    outln!("launcher         {}", r.launcher);
    outln!(
        "nodes            {} (this is node {})",
        r.nodes,
        r.node_rank
    );
    outln!("master           {}", or_none(r.master.clone()));
    outln!(
        "rendezvous port  {}",
        or_none(r.rendezvous_port.map(|p| p.to_string()))
    );
    match r.local_ranks {
        0 => outln!("devices          the CPU"),
        n => outln!(
            "devices          {:?} ({n} GPU rank(s) in this process)",
            r.devices
        ),
    }
    match (r.global_batch, r.lr) {
        (Some(batch), Some(lr)) => {
            outln!("global batch     {batch}");
            outln!("lr               {lr} (--lr scaled from a batch of 256)");
        }
        _ => outln!("global batch     measured by the run (--batch-size auto)"),
    }
    outln!("workers          {}", r.workers);
    outln!("resume           {}", if r.resume { "yes" } else { "no" });
    for note in &r.notes {
        outln!("note             {note}");
    }
}
