//! Launch configuration: which GPUs this process drives and where it sits among the nodes.
//!
//! Sources, highest precedence first: command-line flags (`--gpus`, `--nodes`, `--node-rank`,
//! `--master`), then the variables torchrun sets (`WORLD_SIZE`, `RANK`, `MASTER_ADDR`,
//! `MASTER_PORT`, `LOCAL_RANK`), then single-node defaults. A flag that overrides a different
//! environment value wins and the override is listed in [`LaunchPlan::overrides`] so the CLI can
//! log it; combinations that cannot all hold (a node rank outside the world, a half-set master
//! address, `LOCAL_RANK` with several GPUs) are errors.
//!
//! A "node" here is one rendezvous participant, i.e. one birdtrain process. Normally that is one
//! machine driving all its GPUs; under `torchrun --nproc-per-node G` it is one process per GPU,
//! `WORLD_SIZE`/`RANK` count processes and `LOCAL_RANK` names the GPU the process drives.
//!
//! The device list is an input so every rule here is tested without a GPU.

use std::fmt;
use std::str::FromStr;

/// Errors from resolving the launch configuration.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LaunchError {
    /// `--gpus` is neither a number nor `all`.
    #[error("invalid --gpus value {value:?}: expected a GPU count such as 4, or `all`")]
    InvalidGpus {
        /// The value given.
        value: String,
    },
    /// An environment variable holds something unparsable.
    #[error("invalid environment variable {var}={value:?}: expected {expected}")]
    InvalidEnv {
        /// Variable name.
        var: &'static str,
        /// Its value.
        value: String,
        /// What was expected.
        expected: &'static str,
    },
    /// More GPUs were requested than exist.
    #[error("--gpus {requested} asks for more GPUs than this machine has ({present}): {listing}")]
    TooManyGpus {
        /// GPUs requested.
        requested: usize,
        /// GPUs present.
        present: usize,
        /// The devices present, one `ordinal: name` per entry.
        listing: String,
    },
    /// GPUs were requested but none exist.
    #[error("--gpus {requested} but no CUDA device was found (driver missing or no GPU); use --gpus 0 to train on the CPU")]
    NoDevices {
        /// What was requested.
        requested: String,
    },
    /// `--nodes 0` or `WORLD_SIZE=0`.
    #[error("the number of nodes must be at least 1 (from {source_name})")]
    ZeroNodes {
        /// Flag or variable that said 0.
        source_name: &'static str,
    },
    /// The node rank does not fit the world.
    #[error(
        "node rank {node_rank} (from {source_name}) is outside 0..{nodes}; node ranks count from 0"
    )]
    NodeRankOutOfRange {
        /// The node rank.
        node_rank: usize,
        /// The node count.
        nodes: usize,
        /// Flag or variable it came from.
        source_name: &'static str,
    },
    /// Several nodes but no rank for this one.
    #[error("{nodes} nodes but this node's rank is unknown: pass --node-rank (or set RANK)")]
    MissingNodeRank {
        /// The node count.
        nodes: usize,
    },
    /// Several nodes but no rendezvous address.
    #[error("{nodes} nodes need a rendezvous address: pass --master host:port (or set MASTER_ADDR and MASTER_PORT)")]
    MissingMaster {
        /// The node count.
        nodes: usize,
    },
    /// Only one of MASTER_ADDR / MASTER_PORT is set.
    #[error("{set} is set but {missing} is not; set both (or pass --master host:port)")]
    PartialMasterEnv {
        /// The variable that is set.
        set: &'static str,
        /// The one that is missing.
        missing: &'static str,
    },
    /// `--master` is not `host:port`.
    #[error("invalid rendezvous address {value:?} (from {source_name}): {reason}; expected host:port such as 10.0.0.1:29500")]
    InvalidMaster {
        /// The value.
        value: String,
        /// Flag or variables it came from.
        source_name: &'static str,
        /// What is wrong.
        reason: &'static str,
    },
    /// `LOCAL_RANK` (one process per GPU) together with `--gpus` above 1.
    #[error("LOCAL_RANK={local_rank} means one process per GPU (torchrun), but --gpus {gpus} asks this process to drive several; drop --gpus or use --gpus 1")]
    LocalRankConflict {
        /// The local rank.
        local_rank: usize,
        /// The `--gpus` value.
        gpus: String,
    },
    /// `LOCAL_RANK` names a GPU that does not exist.
    #[error("LOCAL_RANK={local_rank} but this machine has {present} GPU(s): {listing}")]
    LocalRankMissingDevice {
        /// The local rank.
        local_rank: usize,
        /// GPUs present.
        present: usize,
        /// The devices present.
        listing: String,
    },
    /// Several nodes with no GPU: the cross-node engine is NCCL.
    #[error("multi-node training ({nodes} nodes, from --nodes or WORLD_SIZE) runs on GPUs through NCCL; the CPU trains on one node only (hint: drop --nodes and the torchrun variables, and use --replicas R for data parallelism on this machine's CPU)")]
    CpuMultiNode {
        /// The node count.
        nodes: usize,
    },
}

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

/// A rendezvous address, `host:port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MasterAddr {
    /// Host name or IP address (IPv6 without brackets).
    pub host: String,
    /// TCP port.
    pub port: u16,
}

impl MasterAddr {
    /// Parses `host:port` or `[v6addr]:port`.
    pub fn parse(value: &str, source_name: &'static str) -> Result<Self, LaunchError> {
        let bad = |reason| LaunchError::InvalidMaster {
            value: value.to_string(),
            source_name,
            reason,
        };
        let (host, port) = value.rsplit_once(':').ok_or_else(|| bad("no port"))?;
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        if host.is_empty() {
            return Err(bad("empty host"));
        }
        let port: u16 = port
            .parse()
            .map_err(|_| bad("the port is not a number 1-65535"))?;
        if port == 0 {
            return Err(bad("port 0 cannot be connected to"));
        }
        Ok(MasterAddr {
            host: host.to_string(),
            port,
        })
    }
}

impl fmt::Display for MasterAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
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
    /// CUDA ordinals this process drives, one driver thread each; empty = CPU training.
    pub devices: Vec<usize>,
    /// Rendezvous participants (processes), at least 1.
    pub nodes: usize,
    /// This process's index among them; 0 serves the rendezvous.
    pub node_rank: usize,
    /// The rendezvous address; always set when `nodes > 1`.
    pub master: Option<MasterAddr>,
    /// Human-readable notes on environment values a flag overrode.
    pub overrides: Vec<String>,
}

impl LaunchPlan {
    /// True when more than one process takes part (a TCP rendezvous is needed).
    pub fn is_multi_node(&self) -> bool {
        self.nodes > 1
    }

    /// True for the process that serves the rendezvous and writes checkpoints.
    pub fn is_master(&self) -> bool {
        self.node_rank == 0
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

fn env_usize(
    env: &dyn Fn(&str) -> Option<String>,
    var: &'static str,
) -> Result<Option<usize>, LaunchError> {
    match env(var) {
        None => Ok(None),
        Some(v) if v.trim().is_empty() => Ok(None),
        Some(v) => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| LaunchError::InvalidEnv {
                var,
                value: v,
                expected: "a non-negative integer",
            }),
    }
}

/// Picks the flag when given, else the environment value, noting a disagreement.
fn pick<T: PartialEq + fmt::Display + Copy>(
    flag: Option<T>,
    flag_name: &'static str,
    env: Option<T>,
    var: &'static str,
    overrides: &mut Vec<String>,
) -> Option<(T, &'static str)> {
    match (flag, env) {
        (Some(f), Some(e)) => {
            if f != e {
                overrides.push(format!("{flag_name} {f} overrides {var}={e}"));
            }
            Some((f, flag_name))
        }
        (Some(f), None) => Some((f, flag_name)),
        (None, Some(e)) => Some((e, var)),
        (None, None) => None,
    }
}

/// Resolves flags, environment (`env` looks a variable up) and the devices present into a plan.
///
/// Defaults: one node; `--gpus` absent means one GPU when any is present (the one named by
/// `LOCAL_RANK` under torchrun), else the CPU.
pub fn resolve(
    flags: &LaunchFlags,
    env: &dyn Fn(&str) -> Option<String>,
    devices: &[Device],
) -> Result<LaunchPlan, LaunchError> {
    let mut overrides = Vec::new();

    let nodes = pick(
        flags.nodes,
        "--nodes",
        env_usize(env, "WORLD_SIZE")?,
        "WORLD_SIZE",
        &mut overrides,
    );
    let (nodes, nodes_source) = nodes.unwrap_or((1, "default"));
    if nodes == 0 {
        return Err(LaunchError::ZeroNodes {
            source_name: nodes_source,
        });
    }

    let node_rank = pick(
        flags.node_rank,
        "--node-rank",
        env_usize(env, "RANK")?,
        "RANK",
        &mut overrides,
    );
    let node_rank = match node_rank {
        Some((r, source_name)) => {
            if r >= nodes {
                return Err(LaunchError::NodeRankOutOfRange {
                    node_rank: r,
                    nodes,
                    source_name,
                });
            }
            r
        }
        None if nodes > 1 => return Err(LaunchError::MissingNodeRank { nodes }),
        None => 0,
    };

    let env_master = match (env("MASTER_ADDR"), env("MASTER_PORT")) {
        (Some(a), Some(p)) => Some(MasterAddr::parse(
            &format!("{a}:{p}"),
            "MASTER_ADDR/MASTER_PORT",
        )?),
        (Some(_), None) => {
            return Err(LaunchError::PartialMasterEnv {
                set: "MASTER_ADDR",
                missing: "MASTER_PORT",
            })
        }
        (None, Some(_)) => {
            return Err(LaunchError::PartialMasterEnv {
                set: "MASTER_PORT",
                missing: "MASTER_ADDR",
            })
        }
        (None, None) => None,
    };
    let flag_master = flags
        .master
        .as_deref()
        .map(|m| MasterAddr::parse(m, "--master"))
        .transpose()?;
    let master = match (flag_master, env_master) {
        (Some(f), Some(e)) => {
            if f != e {
                overrides.push(format!(
                    "--master {f} overrides MASTER_ADDR/MASTER_PORT {e}"
                ));
            }
            Some(f)
        }
        (f, e) => f.or(e),
    };
    if nodes > 1 && master.is_none() {
        return Err(LaunchError::MissingMaster { nodes });
    }

    let listing = || device_listing(devices);
    let local_rank = env_usize(env, "LOCAL_RANK")?;
    let chosen: Vec<usize> = match (flags.gpus, local_rank) {
        (Some(GpuCount::Count(0)), _) => Vec::new(),
        (Some(GpuCount::Count(1)) | None, Some(lr)) => {
            let dev = devices.iter().find(|d| d.ordinal == lr).ok_or_else(|| {
                LaunchError::LocalRankMissingDevice {
                    local_rank: lr,
                    present: devices.len(),
                    listing: listing(),
                }
            })?;
            vec![dev.ordinal]
        }
        (Some(g), Some(lr)) => {
            return Err(LaunchError::LocalRankConflict {
                local_rank: lr,
                gpus: g.to_string(),
            })
        }
        (None, None) => devices.iter().take(1).map(|d| d.ordinal).collect(),
        (Some(g), None) if devices.is_empty() => {
            return Err(LaunchError::NoDevices {
                requested: g.to_string(),
            })
        }
        (Some(GpuCount::All), None) => devices.iter().map(|d| d.ordinal).collect(),
        (Some(GpuCount::Count(n)), None) => {
            if n > devices.len() {
                return Err(LaunchError::TooManyGpus {
                    requested: n,
                    present: devices.len(),
                    listing: listing(),
                });
            }
            devices.iter().take(n).map(|d| d.ordinal).collect()
        }
    };
    if nodes > 1 && chosen.is_empty() {
        return Err(LaunchError::CpuMultiNode { nodes });
    }

    Ok(LaunchPlan {
        devices: chosen,
        nodes,
        node_rank,
        master,
        overrides,
    })
}

/// Looks a variable up in the process environment (the `env` argument of [`resolve`]).
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// The CUDA devices present, or an empty list when the driver library or any GPU is missing.
///
/// Never panics: the driver library is probed before any call into it.
pub fn detect_cuda_devices() -> Vec<Device> {
    use cudarc::driver::result;
    // SAFETY: probing only tries to dlopen the library; nothing is called through it.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Vec::new();
    }
    if result::init().is_err() {
        return Vec::new();
    }
    let count = result::device::get_count().unwrap_or(0).max(0) as usize;
    (0..count)
        .map(|ordinal| {
            let name = result::device::get(ordinal as i32)
                .and_then(result::device::get_name)
                .unwrap_or_else(|_| "unknown device".to_string());
            Device { ordinal, name }
        })
        .collect()
}
