//! Launch configuration: which GPUs this process drives and where it sits among the nodes.
//!
//! Sources, highest precedence first: command-line flags (`--gpus`, `--nodes`, `--node-rank`,
//! `--master`), then the variables of the launcher that started the process ([`launcher`]:
//! torchrun, Slurm's `srun`, or `WORLD_SIZE`/`RANK`/`MASTER_ADDR`/`MASTER_PORT` set otherwise,
//! as a Kubeflow PyTorchJob does), then single-node defaults. A flag that overrides a different
//! launcher value wins and the override is listed in [`LaunchPlan::overrides`] so the CLI can
//! log it; combinations that cannot all hold (a node rank outside the world, a half-set master
//! address, one process per GPU asked to drive several) are errors naming the variables.
//!
//! A "node" here is one rendezvous participant, i.e. one birdtrain process. Normally that is one
//! machine driving all its GPUs; under `torchrun --nproc-per-node G` (or `srun` with a task per
//! GPU) it is one process per GPU, `WORLD_SIZE`/`RANK` (`SLURM_NTASKS`/`SLURM_PROCID`) count
//! processes and `LOCAL_RANK` (`SLURM_LOCALID`) names the GPU the process drives.
//!
//! The environment and the GPUs visible are inputs ([`VisibleGpus`]: the driver's list, the
//! entries of `CUDA_VISIBLE_DEVICES`, or unknown), so every rule here is tested without a GPU
//! and `--dry-run` resolves a launch without asking the driver.

mod error;
pub mod hostlist;
pub mod launcher;
mod master;

use std::fmt;
use std::str::FromStr;

pub use error::LaunchError;
pub use launcher::{Env, FromVar, Launcher, LauncherEnv, LocalGpu};
pub use master::MasterAddr;

/// The `--gpus` flag: a count or every device present.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuCount {
    /// Exactly this many GPUs (0 = train on the CPU).
    Count(usize),
    /// Every GPU present.
    All,
}

impl FromStr for GpuCount {
    type Err = LaunchError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("all") {
            return Ok(GpuCount::All);
        }
        t.parse::<usize>()
            .map(GpuCount::Count)
            .map_err(|_| LaunchError::InvalidGpus {
                value: s.to_string(),
            })
    }
}

impl fmt::Display for GpuCount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuCount::Count(n) => write!(f, "{n}"),
            GpuCount::All => f.write_str("all"),
        }
    }
}

/// One GPU as the driver reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    /// CUDA ordinal.
    pub ordinal: usize,
    /// Marketing name, e.g. "NVIDIA H100 80GB HBM3".
    pub name: String,
}

/// The GPUs the launch may use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VisibleGpus {
    /// The devices the driver lists (a run), or the entries of `CUDA_VISIBLE_DEVICES` (a dry
    /// run: what the driver will list); ordinals 0, 1, … in order.
    Listed(Vec<Device>),
    /// No usable driver, and why (the CPU trains unless GPUs were asked for).
    Missing(String),
    /// A dry run without `CUDA_VISIBLE_DEVICES`: the GPUs a count or a local rank asks for are
    /// taken as present; "every GPU" has no count.
    Unknown,
}

impl VisibleGpus {
    /// What `--dry-run` assumes, without the driver: the entries of `CUDA_VISIBLE_DEVICES` up
    /// to the first one CUDA would reject (an index, or a `GPU-`/`MIG-` UUID), else unknown.
    pub fn from_cuda_visible_devices(env: Env<'_>) -> VisibleGpus {
        let Some(list) = env("CUDA_VISIBLE_DEVICES") else {
            return VisibleGpus::Unknown;
        };
        let devices = list
            .split(',')
            .map(str::trim)
            .take_while(|e| {
                e.parse::<u32>().is_ok() || e.starts_with("GPU-") || e.starts_with("MIG-")
            })
            .enumerate()
            .map(|(ordinal, entry)| Device {
                ordinal,
                name: format!("CUDA_VISIBLE_DEVICES entry {entry}"),
            })
            .collect();
        VisibleGpus::Listed(devices)
    }

    /// How many, when known (none without a driver).
    fn count(&self) -> Option<usize> {
        match self {
            VisibleGpus::Listed(d) => Some(d.len()),
            VisibleGpus::Missing(_) => Some(0),
            VisibleGpus::Unknown => None,
        }
    }

    /// The devices as `0: name, 1: name`, or `none` and why.
    fn listing(&self) -> String {
        match self {
            VisibleGpus::Listed(d) if d.is_empty() => "none".into(),
            VisibleGpus::Listed(d) => device_listing(d),
            VisibleGpus::Missing(why) => format!("none ({why})"),
            VisibleGpus::Unknown => "not known without the driver".into(),
        }
    }

    /// Why there is no device (for the errors and the CPU note).
    fn why_none(&self) -> String {
        match self {
            VisibleGpus::Missing(why) => why.clone(),
            _ => "no GPU is visible".into(),
        }
    }
}

/// The launch flags as the CLI parsed them (`None` = not given).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LaunchFlags {
    /// `--gpus N|all`.
    pub gpus: Option<GpuCount>,
    /// `--nodes`.
    pub nodes: Option<usize>,
    /// `--node-rank`.
    pub node_rank: Option<usize>,
    /// `--master host:port`.
    pub master: Option<String>,
}

/// Where this process sits and what it drives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchPlan {
    /// The launcher whose variables were read.
    pub launcher: Launcher,
    /// CUDA ordinals this process drives, one driver thread each; empty = CPU training.
    pub devices: Vec<usize>,
    /// Where the devices came from, in words (`--gpus 4`, `LOCAL_RANK=3`, …).
    pub devices_source: String,
    /// Rendezvous participants (processes), at least 1.
    pub nodes: usize,
    /// This process's index among them; 0 serves the rendezvous.
    pub node_rank: usize,
    /// The master as the flag or the launcher names it; `None` for a single node.
    pub master: Option<MasterAddr>,
    /// The port node 0's rendezvous listens on at the master's host: the master's own, or
    /// under torchrun (without `--master`) `MASTER_PORT + 1`; `None` for a single node.
    pub rendezvous_port: Option<u16>,
    /// Processes of this run on this machine (`LOCAL_WORLD_SIZE`, else 1).
    pub local_processes: usize,
    /// torchrun's restarts of this worker so far (`TORCHELASTIC_RESTART_COUNT`, else 0).
    pub restart_count: u64,
    /// Human-readable notes on launcher values a flag (or another launcher) overrode.
    pub overrides: Vec<String>,
    /// Why the CPU trains although `--gpus` was left out ("no GPU found …").
    pub cpu_fallback: Option<String>,
}

impl LaunchPlan {
    /// One process alone, driving `devices` (benchmarks and tests).
    pub fn single_node(devices: Vec<usize>) -> LaunchPlan {
        LaunchPlan {
            launcher: Launcher::Flags,
            devices_source: format!("{} GPU(s)", devices.len()),
            devices,
            nodes: 1,
            node_rank: 0,
            master: None,
            rendezvous_port: None,
            local_processes: 1,
            restart_count: 0,
            overrides: Vec::new(),
            cpu_fallback: None,
        }
    }

    /// True when more than one process takes part (a TCP rendezvous is needed).
    pub fn is_multi_node(&self) -> bool {
        self.nodes > 1
    }

    /// True for the process that serves the rendezvous and writes checkpoints.
    pub fn is_master(&self) -> bool {
        self.node_rank == 0
    }

    /// The address node 0 listens on and the others connect to: the master's host at
    /// [`Self::rendezvous_port`].
    pub fn rendezvous_addr(&self) -> Option<MasterAddr> {
        Some(MasterAddr {
            host: self.master.as_ref()?.host.clone(),
            port: self.rendezvous_port?,
        })
    }

    /// The decode workers of a run that left `--workers` out, on `cores` cores: the cores
    /// shared among this machine's processes of the run, at least 1 each.
    pub fn default_workers(&self, cores: usize) -> usize {
        (cores / self.local_processes.max(1)).max(1)
    }
}

/// Formats a device list as `0: name, 1: name`, or `none` when empty.
pub fn device_listing(devices: &[Device]) -> String {
    if devices.is_empty() {
        return "none".to_string();
    }
    devices
        .iter()
        .map(|d| format!("{}: {}", d.ordinal, d.name))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Picks the flag when given, else the launcher's value, noting a disagreement.
fn pick<T: PartialEq + fmt::Display + Copy>(
    flag: Option<T>,
    flag_name: &'static str,
    env: Option<FromVar<T>>,
    overrides: &mut Vec<String>,
) -> Option<(T, &'static str)> {
    match (flag, env) {
        (Some(f), Some(e)) => {
            if f != e.value {
                overrides.push(format!("{flag_name} {f} overrides {}={}", e.var, e.value));
            }
            Some((f, flag_name))
        }
        (Some(f), None) => Some((f, flag_name)),
        (None, Some(e)) => Some((e.value, e.var)),
        (None, None) => None,
    }
}

/// Resolves flags, the launcher's variables (`env` looks a variable up) and the GPUs visible
/// into a plan.
///
/// Devices: `--gpus 0` is the CPU. A launcher that starts one process per GPU (`LOCAL_RANK`,
/// or Slurm with more tasks than machines: `SLURM_LOCALID`) gives the process that one GPU
/// when `--gpus` is left out or 1; with a single visible device and `CUDA_VISIBLE_DEVICES`
/// set (one GPU handed to each process), that device whatever the index. Otherwise `--gpus N`
/// is the first N, and `all` or no flag every visible GPU (no flag and none visible: the CPU).
pub fn resolve(
    flags: &LaunchFlags,
    env: Env<'_>,
    visible: &VisibleGpus,
) -> Result<LaunchPlan, LaunchError> {
    let seen = launcher::read(env)?;
    let mut overrides = seen.ignored.clone();

    let nodes = pick(flags.nodes, "--nodes", seen.nodes, &mut overrides);
    let (nodes, nodes_source) = nodes.unwrap_or((1, "default"));
    if nodes == 0 {
        return Err(LaunchError::ZeroNodes {
            source_name: nodes_source,
        });
    }

    let node_rank = pick(
        flags.node_rank,
        "--node-rank",
        seen.node_rank,
        &mut overrides,
    );
    let node_rank = match node_rank {
        Some((r, source_name)) => {
            if r >= nodes {
                return Err(LaunchError::NodeRankOutOfRange {
                    node_rank: r,
                    nodes,
                    source_name,
                    nodes_source,
                });
            }
            r
        }
        None if nodes > 1 => return Err(LaunchError::MissingNodeRank { nodes }),
        None => 0,
    };

    let (master, rendezvous_port) = rendezvous(flags, &seen, nodes, &mut overrides)?;

    let (devices, devices_source) = local_devices(flags.gpus, &seen, env, visible)?;
    if nodes > 1 && devices.is_empty() {
        return Err(LaunchError::CpuMultiNode { nodes });
    }
    let cpu_fallback = (flags.gpus.is_none() && devices.is_empty()).then(|| {
        format!(
            "no GPU found; {}: training on the CPU (--gpus 0)",
            visible.why_none()
        )
    });

    Ok(LaunchPlan {
        launcher: seen.launcher,
        devices,
        devices_source,
        nodes,
        node_rank,
        master,
        rendezvous_port,
        local_processes: seen.local_processes.map_or(1, |l| l.value),
        restart_count: seen.restart_count,
        overrides,
        cpu_fallback,
    })
}

/// The master and the rendezvous port (both `None` for a single node).
fn rendezvous(
    flags: &LaunchFlags,
    seen: &LauncherEnv,
    nodes: usize,
    overrides: &mut Vec<String>,
) -> Result<(Option<MasterAddr>, Option<u16>), LaunchError> {
    let flag_master = flags
        .master
        .as_deref()
        .map(|m| MasterAddr::parse(m, "--master"))
        .transpose()?;
    if nodes == 1 {
        return Ok((None, None));
    }
    match (flag_master, &seen.master) {
        // `--master` names the rendezvous itself, also under torchrun.
        (Some(f), env) => {
            if let Some((e, source)) = env.as_ref().filter(|(e, _)| *e != f) {
                overrides.push(format!("--master {f} overrides {source} {e}"));
            }
            let port = f.port;
            Ok((Some(f), Some(port)))
        }
        (None, Some((e, _))) => {
            let port = e
                .port
                .checked_add(seen.rendezvous_port_offset)
                .ok_or(LaunchError::RendezvousPortOverflow { port: e.port })?;
            Ok((Some(e.clone()), Some(port)))
        }
        (None, None) => Err(LaunchError::MissingMaster {
            nodes,
            hint: seen.missing_master_hint,
        }),
    }
}

/// The ordinals this process drives, and where they came from.
fn local_devices(
    gpus: Option<GpuCount>,
    seen: &LauncherEnv,
    env: Env<'_>,
    visible: &VisibleGpus,
) -> Result<(Vec<usize>, String), LaunchError> {
    let every = |asked: String| -> Result<(Vec<usize>, String), LaunchError> {
        match visible {
            VisibleGpus::Listed(d) => Ok((
                d.iter().map(|d| d.ordinal).collect(),
                format!("every visible GPU ({asked})"),
            )),
            VisibleGpus::Missing(_) => Ok((Vec::new(), format!("no GPU visible ({asked})"))),
            VisibleGpus::Unknown => Err(LaunchError::GpuCountUnknown { asked }),
        }
    };
    match (gpus, &seen.local_gpu) {
        (Some(GpuCount::Count(0)), _) => Ok((Vec::new(), "--gpus 0".into())),
        (Some(GpuCount::Count(1)) | None, Some(local)) => {
            let ordinal = local_gpu(local, env, visible)?;
            Ok((
                vec![ordinal],
                format!("{}={}", local.index.var, local.index.value),
            ))
        }
        (Some(g), Some(local)) => Err(LaunchError::LocalGpuConflict {
            var: local.index.var,
            index: local.index.value,
            mode: local.mode.clone(),
            gpus: g.to_string(),
        }),
        (None, None) => every("--gpus left out".into()),
        (Some(GpuCount::All), None) => {
            let (devices, source) = every("--gpus all".into())?;
            if devices.is_empty() {
                return Err(LaunchError::NoDevices {
                    requested: "all".into(),
                    reason: visible.why_none(),
                });
            }
            Ok((devices, source))
        }
        (Some(GpuCount::Count(n)), None) => {
            let source = format!("--gpus {n}");
            match visible {
                VisibleGpus::Unknown => Ok(((0..n).collect(), source)),
                _ if visible.count() == Some(0) => Err(LaunchError::NoDevices {
                    requested: n.to_string(),
                    reason: visible.why_none(),
                }),
                VisibleGpus::Listed(d) if n <= d.len() => {
                    Ok((d.iter().take(n).map(|d| d.ordinal).collect(), source))
                }
                _ => Err(LaunchError::TooManyGpus {
                    requested: n,
                    present: visible.count().unwrap_or(0),
                    listing: visible.listing(),
                }),
            }
        }
    }
}

/// The one GPU of a one-process-per-GPU launch.
fn local_gpu(local: &LocalGpu, env: Env<'_>, visible: &VisibleGpus) -> Result<usize, LaunchError> {
    let index = local.index.value;
    let missing = || LaunchError::LocalGpuMissing {
        var: local.index.var,
        index,
        mode: local.mode.clone(),
        present: visible.count().unwrap_or(0),
        listing: visible.listing(),
        hint: match visible.count() {
            Some(0) => "--gpus 0 trains on the CPU",
            _ => local.hint,
        },
    };
    let VisibleGpus::Listed(devices) = visible else {
        return match visible {
            VisibleGpus::Unknown => Ok(index),
            _ => Err(missing()),
        };
    };
    if let Some(d) = devices.iter().find(|d| d.ordinal == index) {
        return Ok(d.ordinal);
    }
    // One device handed to this process alone: it is this process's GPU, whatever the index.
    let handed_one = env("CUDA_VISIBLE_DEVICES").is_some_and(|v| !v.trim().is_empty());
    match devices.as_slice() {
        [only] if handed_one => Ok(only.ordinal),
        _ => Err(missing()),
    }
}

/// Looks a variable up in the process environment (the `env` argument of [`resolve`]).
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// The CUDA devices the driver lists, or why there are none (no driver library, a driver
/// error). Never panics: the driver library is probed before any call into it.
pub fn probe_gpus() -> VisibleGpus {
    use crate::cuda::{device, CudaError};
    let count = match crate::panics::catch_expected(device::device_count) {
        Ok(Ok(n)) => n,
        Ok(Err(CudaError::DriverMissing { tried })) => {
            return VisibleGpus::Missing(format!("no CUDA driver library (tried {tried})"))
        }
        Ok(Err(e)) => return VisibleGpus::Missing(e.to_string()),
        Err(_) => return VisibleGpus::Missing("the CUDA driver library could not be used".into()),
    };
    let name = |ordinal: usize| {
        use cudarc::driver::result;
        let read = || result::device::get(ordinal as i32).and_then(result::device::get_name);
        match crate::panics::catch_expected(read) {
            Ok(Ok(name)) => name,
            _ => "unknown device".to_string(),
        }
    };
    VisibleGpus::Listed(
        (0..count)
            .map(|ordinal| Device {
                ordinal,
                name: name(ordinal),
            })
            .collect(),
    )
}

/// The CUDA devices present, or an empty list when the driver library or any GPU is missing.
pub fn detect_cuda_devices() -> Vec<Device> {
    match probe_gpus() {
        VisibleGpus::Listed(devices) => devices,
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn gpus(n: usize) -> VisibleGpus {
        VisibleGpus::Listed(
            (0..n)
                .map(|ordinal| Device {
                    ordinal,
                    name: format!("Fake GPU {ordinal}"),
                })
                .collect(),
        )
    }

    fn plan(
        flags: &LaunchFlags,
        env: &[(&str, &str)],
        visible: &VisibleGpus,
    ) -> Result<LaunchPlan, LaunchError> {
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        resolve(flags, &|k| env.get(k).cloned(), visible)
    }

    fn flag_gpus(g: &str) -> LaunchFlags {
        LaunchFlags {
            gpus: Some(g.parse().unwrap()),
            ..LaunchFlags::default()
        }
    }

    const NONE: LaunchFlags = LaunchFlags {
        gpus: None,
        nodes: None,
        node_rank: None,
        master: None,
    };

    /// What torchrun hands worker 5 of `--nnodes 2 --nproc-per-node 4` (the second machine).
    const TORCHRUN: [(&str, &str); 10] = [
        ("TORCHELASTIC_RUN_ID", "job7"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ("TORCHELASTIC_RESTART_COUNT", "0"),
        ("WORLD_SIZE", "8"),
        ("RANK", "5"),
        ("GROUP_RANK", "1"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("MASTER_ADDR", "head"),
        ("MASTER_PORT", "29500"),
    ];

    fn with(
        base: &[(&'static str, &'static str)],
        extra: &[(&'static str, &'static str)],
    ) -> Vec<(&'static str, &'static str)> {
        let mut env: Vec<_> = base
            .iter()
            .filter(|(k, _)| !extra.iter().any(|(e, _)| e == k))
            .copied()
            .collect();
        env.extend_from_slice(extra);
        env
    }

    #[test]
    fn a_torchrun_worker_drives_its_local_rank_and_meets_above_torchruns_port() {
        let p = plan(&NONE, &TORCHRUN, &gpus(4)).unwrap();
        assert_eq!(p.launcher, Launcher::Torchrun);
        assert_eq!(
            p.devices,
            vec![1],
            "LOCAL_RANK picks the GPU without --gpus"
        );
        assert_eq!(p.devices_source, "LOCAL_RANK=1");
        assert_eq!((p.nodes, p.node_rank), (8, 5));
        assert_eq!(p.master.as_ref().unwrap().to_string(), "head:29500");
        assert_eq!(
            p.rendezvous_port,
            Some(29501),
            "torchrun's agent holds 29500"
        );
        assert_eq!(p.rendezvous_addr().unwrap().to_string(), "head:29501");
        assert_eq!(p.local_processes, 4);
        assert_eq!(p.default_workers(16), 4);
        assert_eq!(p.default_workers(2), 1, "at least one worker each");
        assert!(p.overrides.is_empty(), "{:?}", p.overrides);
        // --gpus 1 says the same; --gpus 0 trains on the CPU (refused on several nodes).
        assert_eq!(
            plan(&flag_gpus("1"), &TORCHRUN, &gpus(4)).unwrap().devices,
            vec![1]
        );
        assert!(matches!(
            plan(&flag_gpus("0"), &TORCHRUN, &gpus(4)),
            Err(LaunchError::CpuMultiNode { nodes: 8 })
        ));
    }

    #[test]
    fn torchrun_without_gpus_is_not_every_gpu_and_several_name_the_flag() {
        // The CLI used to turn a missing --gpus into "every GPU" and then refused it, telling
        // the user to drop a flag they never gave.
        let p = plan(&NONE, &TORCHRUN, &gpus(8)).unwrap();
        assert_eq!(p.devices, vec![1]);
        let e = plan(&flag_gpus("4"), &TORCHRUN, &gpus(8)).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("LOCAL_RANK=1") && text.contains("--gpus 4") && text.contains("torchrun"),
            "{text}"
        );
        assert!(matches!(
            plan(&flag_gpus("all"), &TORCHRUN, &gpus(8)),
            Err(LaunchError::LocalGpuConflict { .. })
        ));
    }

    #[test]
    fn the_rendezvous_port_of_torchrun_and_its_override() {
        let master = LaunchFlags {
            master: Some("head:4000".into()),
            ..NONE
        };
        let p = plan(&master, &TORCHRUN, &gpus(4)).unwrap();
        assert_eq!(
            p.rendezvous_port,
            Some(4000),
            "--master names the rendezvous itself"
        );
        assert_eq!(
            p.overrides,
            ["--master head:4000 overrides MASTER_ADDR/MASTER_PORT head:29500"]
        );
        let top = with(&TORCHRUN, &[("MASTER_PORT", "65535")]);
        let e = plan(&NONE, &top, &gpus(4)).unwrap_err();
        assert_eq!(e, LaunchError::RendezvousPortOverflow { port: 65535 });
        assert!(e.to_string().contains("MASTER_PORT + 1"), "{e}");
        assert_eq!(
            plan(&master, &top, &gpus(4)).unwrap().rendezvous_port,
            Some(4000)
        );
        // A standalone single worker has no rendezvous at all.
        let alone = with(
            &TORCHRUN,
            &[
                ("WORLD_SIZE", "1"),
                ("RANK", "0"),
                ("LOCAL_RANK", "0"),
                ("LOCAL_WORLD_SIZE", "1"),
            ],
        );
        let p = plan(&NONE, &alone, &gpus(1)).unwrap();
        assert_eq!(
            (p.nodes, p.master.clone(), p.rendezvous_port),
            (1, None, None)
        );
        assert_eq!(p.devices, vec![0]);
    }

    #[test]
    fn one_device_handed_to_each_process_is_its_gpu_whatever_the_index() {
        let handed = with(
            &TORCHRUN,
            &[("LOCAL_RANK", "3"), ("CUDA_VISIBLE_DEVICES", "3")],
        );
        assert_eq!(plan(&NONE, &handed, &gpus(1)).unwrap().devices, vec![0]);
        // One GPU in the machine and no CUDA_VISIBLE_DEVICES: four workers cannot share it.
        let shared = with(&TORCHRUN, &[("LOCAL_RANK", "3")]);
        let e = plan(&NONE, &shared, &gpus(1)).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("LOCAL_RANK=3")
                && text.contains("1 GPU(s) visible")
                && text.contains("0: Fake GPU 0"),
            "{text}"
        );
        // No GPU at all: the hint is the CPU.
        let e = plan(
            &NONE,
            &shared,
            &VisibleGpus::Missing("no CUDA driver library".into()),
        )
        .unwrap_err();
        assert!(e.to_string().contains("--gpus 0 trains on the CPU"), "{e}");
        assert!(e.to_string().contains("no CUDA driver library"), "{e}");
    }

    #[test]
    fn local_world_size_and_restarts_are_checked() {
        let p = plan(
            &NONE,
            &with(&TORCHRUN, &[("TORCHELASTIC_RESTART_COUNT", "2")]),
            &gpus(4),
        )
        .unwrap();
        assert_eq!(p.restart_count, 2);
        let e = plan(&NONE, &with(&TORCHRUN, &[("LOCAL_RANK", "4")]), &gpus(8)).unwrap_err();
        assert!(
            e.to_string()
                .contains("LOCAL_RANK=4 is outside 0..LOCAL_WORLD_SIZE=4"),
            "{e}"
        );
        let e = plan(
            &NONE,
            &with(&TORCHRUN, &[("LOCAL_WORLD_SIZE", "0")]),
            &gpus(8),
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                LaunchError::InvalidEnv {
                    var: "LOCAL_WORLD_SIZE",
                    ..
                }
            ),
            "{e}"
        );
        let e = plan(
            &NONE,
            &with(&TORCHRUN, &[("TORCHELASTIC_RESTART_COUNT", "x")]),
            &gpus(8),
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                LaunchError::InvalidEnv {
                    var: "TORCHELASTIC_RESTART_COUNT",
                    ..
                }
            ),
            "{e}"
        );
        // Without torchrun's markers, LOCAL_WORLD_SIZE alone is no torchrun.
        assert_eq!(
            launcher::detect(&|k| (k == "LOCAL_WORLD_SIZE").then(|| "4".into())),
            Launcher::Flags
        );
    }

    /// What `srun` hands task `procid` of an sbatch job with `tasks` tasks on gpu[07-08].
    fn slurm(
        tasks: &'static str,
        procid: &'static str,
        localid: &'static str,
        nodeid: &'static str,
    ) -> Vec<(&'static str, &'static str)> {
        vec![
            ("SLURM_JOB_ID", "4242"),
            ("SLURM_JOB_NODELIST", "gpu[07-08]"),
            ("SLURM_NNODES", "2"),
            ("SLURM_NTASKS", tasks),
            ("SLURM_PROCID", procid),
            ("SLURM_LOCALID", localid),
            ("SLURM_NODEID", nodeid),
        ]
    }

    #[test]
    fn one_slurm_task_per_machine_drives_every_gpu_or_gpus_n() {
        let env = slurm("2", "1", "0", "1");
        let p = plan(&NONE, &env, &gpus(4)).unwrap();
        assert_eq!(p.launcher, Launcher::Slurm);
        assert_eq!(p.devices, vec![0, 1, 2, 3]);
        assert_eq!((p.nodes, p.node_rank), (2, 1));
        assert_eq!(p.master.as_ref().unwrap().to_string(), "gpu07:29500");
        assert_eq!(p.rendezvous_port, Some(launcher::SLURM_DEFAULT_PORT));
        assert_eq!(
            plan(&flag_gpus("2"), &env, &gpus(4)).unwrap().devices,
            vec![0, 1]
        );
        // The step's own list wins over the job's (a step on part of the allocation).
        let step = with(&env, &[("SLURM_STEP_NODELIST", "gpu[08],gpu07")]);
        assert_eq!(
            plan(&NONE, &step, &gpus(4)).unwrap().master.unwrap().host,
            "gpu08"
        );
        // MASTER_ADDR and MASTER_PORT each replace their half.
        let port = with(&env, &[("MASTER_PORT", "6000")]);
        assert_eq!(
            plan(&NONE, &port, &gpus(4))
                .unwrap()
                .rendezvous_addr()
                .unwrap()
                .to_string(),
            "gpu07:6000"
        );
        let addr = with(&env, &[("MASTER_ADDR", "10.0.0.9")]);
        assert_eq!(
            plan(&NONE, &addr, &gpus(4))
                .unwrap()
                .rendezvous_addr()
                .unwrap()
                .to_string(),
            "10.0.0.9:29500"
        );
    }

    #[test]
    fn one_slurm_task_per_gpu_drives_the_gpu_of_its_local_id() {
        let env = slurm("8", "5", "1", "1");
        let p = plan(&NONE, &env, &gpus(4)).unwrap();
        assert_eq!(p.devices, vec![1]);
        assert_eq!(p.devices_source, "SLURM_LOCALID=1");
        assert_eq!((p.nodes, p.node_rank), (8, 5));
        let e = plan(&NONE, &slurm("8", "5", "5", "1"), &gpus(4)).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("SLURM_LOCALID=5") && text.contains("4 GPU(s) visible"),
            "{text}"
        );
        let e = plan(&flag_gpus("4"), &env, &gpus(4)).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("SLURM_LOCALID=1")
                && text.contains("SLURM_NTASKS=8 > SLURM_NNODES=2")
                && text.contains("--gpus 4"),
            "{text}"
        );
        // --gpus-per-task 1: Slurm hands each task its one GPU.
        let handed = with(&slurm("8", "7", "3", "1"), &[("CUDA_VISIBLE_DEVICES", "3")]);
        assert_eq!(plan(&NONE, &handed, &gpus(1)).unwrap().devices, vec![0]);
    }

    #[test]
    fn flags_win_over_slurm_and_say_so() {
        let flags = LaunchFlags {
            gpus: None,
            nodes: Some(4),
            node_rank: Some(3),
            master: Some("login1:7000".into()),
        };
        let p = plan(&flags, &slurm("8", "5", "1", "1"), &gpus(4)).unwrap();
        assert_eq!(
            (p.nodes, p.node_rank, p.rendezvous_port),
            (4, 3, Some(7000))
        );
        assert_eq!(
            p.overrides,
            [
                "--nodes 4 overrides SLURM_NTASKS=8",
                "--node-rank 3 overrides SLURM_PROCID=5",
                "--master login1:7000 overrides SLURM_JOB_NODELIST gpu07:29500",
            ]
        );
    }

    #[test]
    fn inconsistent_slurm_variables_are_one_line_each() {
        let drop = |var: &str| -> Vec<(&'static str, &'static str)> {
            slurm("8", "5", "1", "1")
                .into_iter()
                .filter(|(k, _)| *k != var)
                .collect()
        };
        for (env, says) in [
            (
                drop("SLURM_NTASKS"),
                "SLURM_NTASKS is not set but SLURM_PROCID is set",
            ),
            (drop("SLURM_NNODES"), "SLURM_NNODES is not set"),
            (
                drop("SLURM_LOCALID"),
                "SLURM_LOCALID is not set but there are more tasks than machines",
            ),
            (drop("SLURM_JOB_NODELIST"), "srun sets SLURM_JOB_NODELIST"),
            (
                slurm("1", "0", "0", "0"),
                "SLURM_NTASKS=1 but SLURM_NNODES=2",
            ),
            (
                slurm("8", "5", "1", "2"),
                "SLURM_NODEID=2 is outside 0..SLURM_NNODES=2",
            ),
            (
                slurm("8", "9", "1", "1"),
                "node rank 9 (from SLURM_PROCID) is outside 0..8 (from SLURM_NTASKS)",
            ),
            (
                with(
                    &slurm("8", "5", "1", "1"),
                    &[("SLURM_JOB_NODELIST", "gpu[08-07]")],
                ),
                "SLURM_JOB_NODELIST=\"gpu[08-07]\"",
            ),
            (
                with(&slurm("8", "5", "1", "1"), &[("MASTER_PORT", "0")]),
                "MASTER_PORT",
            ),
            (with(&slurm("8", "x", "1", "1"), &[]), "SLURM_PROCID=\"x\""),
        ] {
            let e = plan(&NONE, &env, &gpus(4)).unwrap_err().to_string();
            assert!(e.contains(says), "{says}: {e}");
            assert!(!e.contains('\n'), "{e}");
        }
    }

    #[test]
    fn torchrun_inside_an_sbatch_job_wins_over_slurm() {
        let env = with(&TORCHRUN, &slurm("2", "1", "0", "1"));
        let p = plan(&NONE, &env, &gpus(4)).unwrap();
        assert_eq!(p.launcher, Launcher::Torchrun);
        assert_eq!((p.nodes, p.node_rank, p.devices.clone()), (8, 5, vec![1]));
        assert_eq!(
            p.overrides,
            ["torchrun's variables win over Slurm's (SLURM_PROCID=1)"]
        );
        // Slurm's per-task values win over a WORLD_SIZE/RANK the job script exported.
        let env = with(
            &slurm("2", "1", "0", "1"),
            &[("WORLD_SIZE", "2"), ("RANK", "0")],
        );
        let p = plan(&NONE, &env, &gpus(4)).unwrap();
        assert_eq!((p.launcher, p.node_rank), (Launcher::Slurm, 1));
        assert_eq!(p.overrides, ["SLURM_PROCID=1 wins over RANK=0"]);
    }

    #[test]
    fn a_pytorchjob_pod_drives_every_gpu_of_the_pod() {
        // PyTorchJob: WORLD_SIZE = pods, RANK = pod index, no LOCAL_RANK.
        let env = [
            ("WORLD_SIZE", "3"),
            ("RANK", "2"),
            ("MASTER_ADDR", "birds-master-0"),
            ("MASTER_PORT", "23456"),
        ];
        let p = plan(&NONE, &env, &gpus(8)).unwrap();
        assert_eq!(p.launcher, Launcher::Env);
        assert_eq!(p.devices, (0..8).collect::<Vec<_>>());
        assert_eq!(
            p.rendezvous_addr().unwrap().to_string(),
            "birds-master-0:23456"
        );
        assert_eq!(p.local_processes, 1);
    }

    #[test]
    fn without_a_launcher_every_gpu_or_the_cpu_with_the_reason() {
        let p = plan(&NONE, &[], &gpus(4)).unwrap();
        assert_eq!(
            (p.launcher, p.devices.clone()),
            (Launcher::Flags, vec![0, 1, 2, 3])
        );
        assert!(p.cpu_fallback.is_none());
        let p = plan(
            &NONE,
            &[],
            &VisibleGpus::Missing("no CUDA driver library".into()),
        )
        .unwrap();
        assert!(p.devices.is_empty());
        assert_eq!(
            p.cpu_fallback.as_deref(),
            Some("no GPU found; no CUDA driver library: training on the CPU (--gpus 0)")
        );
        let e = plan(
            &flag_gpus("2"),
            &[],
            &VisibleGpus::Missing("no CUDA driver library".into()),
        )
        .unwrap_err();
        assert!(e.to_string().contains("no CUDA driver library"), "{e}");
    }

    #[test]
    fn a_dry_run_takes_the_gpus_asked_for_without_the_driver() {
        let unknown = VisibleGpus::Unknown;
        assert_eq!(
            plan(&flag_gpus("4"), &[], &unknown).unwrap().devices,
            vec![0, 1, 2, 3]
        );
        assert_eq!(
            plan(&NONE, &with(&TORCHRUN, &[("LOCAL_RANK", "3")]), &unknown)
                .unwrap()
                .devices,
            vec![3]
        );
        assert_eq!(
            plan(&NONE, &slurm("8", "5", "3", "1"), &unknown)
                .unwrap()
                .devices,
            vec![3]
        );
        for (flags, env) in [
            (flag_gpus("all"), vec![]),
            (NONE, vec![]),
            (NONE, slurm("2", "1", "0", "1")),
        ] {
            let e = plan(&flags, &env, &unknown).unwrap_err();
            assert!(matches!(e, LaunchError::GpuCountUnknown { .. }), "{e}");
            assert!(e.to_string().contains("CUDA_VISIBLE_DEVICES"), "{e}");
        }
        // CUDA_VISIBLE_DEVICES is what the driver will list, up to its first bad entry.
        let cvd = |v: &'static str| {
            VisibleGpus::from_cuda_visible_devices(&move |k| {
                (k == "CUDA_VISIBLE_DEVICES").then(|| v.to_string())
            })
        };
        assert_eq!(cvd("4,5, GPU-8f2a,-1,6").count(), Some(3));
        assert_eq!(cvd("").count(), Some(0));
        assert_eq!(
            VisibleGpus::from_cuda_visible_devices(&|_| None),
            VisibleGpus::Unknown
        );
        assert_eq!(plan(&NONE, &[], &cvd("2,3")).unwrap().devices, vec![0, 1]);
        let e = plan(&flag_gpus("4"), &[], &cvd("2,3"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--gpus 4") && e.contains("CUDA_VISIBLE_DEVICES entry 3"),
            "{e}"
        );
    }

    #[test]
    fn resolving_again_with_the_gpu_count_found_gives_the_same_plan() {
        // The CLI resolves the plan from the user's flags; the GPU launcher resolves it again
        // from the count it was handed (`--gpus n`). Both must drive the same devices.
        type Case = (LaunchFlags, Vec<(&'static str, &'static str)>, VisibleGpus);
        let cases: Vec<Case> = vec![
            (NONE, vec![], gpus(4)),
            (flag_gpus("all"), vec![], gpus(3)),
            (NONE, TORCHRUN.to_vec(), gpus(4)),
            (
                NONE,
                with(
                    &TORCHRUN,
                    &[("LOCAL_RANK", "3"), ("CUDA_VISIBLE_DEVICES", "3")],
                ),
                gpus(1),
            ),
            (NONE, slurm("2", "1", "0", "1"), gpus(4)),
            (NONE, slurm("8", "5", "1", "1"), gpus(4)),
        ];
        for (flags, env, visible) in cases {
            let first = plan(&flags, &env, &visible).unwrap();
            let again = LaunchFlags {
                gpus: Some(GpuCount::Count(first.devices.len())),
                ..flags.clone()
            };
            let second = plan(&again, &env, &visible).unwrap();
            assert_eq!(first.devices, second.devices, "{flags:?} {env:?}");
            assert_eq!(first.rendezvous_addr(), second.rendezvous_addr());
        }
    }

    #[test]
    fn the_node_rank_follows_the_launcher() {
        let rank = |env: &[(&str, &str)]| {
            let env: HashMap<&str, &str> = env.iter().copied().collect();
            launcher::node_rank(&|k| env.get(k).map(|v| v.to_string()))
        };
        assert_eq!(rank(&TORCHRUN), Some(5));
        assert_eq!(rank(&slurm("8", "5", "1", "1")), Some(5));
        assert_eq!(
            rank(&with(&slurm("8", "5", "1", "1"), &[("RANK", "0")])),
            Some(5)
        );
        assert_eq!(rank(&[("RANK", "2"), ("WORLD_SIZE", "3")]), Some(2));
        assert_eq!(rank(&[]), None);
    }
}
