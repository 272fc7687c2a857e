//! Which launcher started this process, and what its variables say.
//!
//! Precedence, highest first (each launcher's variables are read only when it is the one):
//! - **torchrun**: `TORCHELASTIC_RUN_ID` or `TORCHELASTIC_USE_AGENT_STORE` is set, or
//!   `LOCAL_WORLD_SIZE` with `RANK` or `WORLD_SIZE`. It wins over Slurm's variables, which are
//!   present too when torchrun runs inside an sbatch job. `WORLD_SIZE`, `RANK`, `LOCAL_RANK`,
//!   `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `TORCHELASTIC_RESTART_COUNT`; torchrun's
//!   agent holds `MASTER_PORT`, so birdtrain's rendezvous listens on `MASTER_PORT + 1`.
//! - **Slurm** (`srun`): `SLURM_PROCID` is set. `SLURM_NTASKS` processes, this one
//!   `SLURM_PROCID`, on `SLURM_NNODES` machines; one task per machine drives several GPUs, more
//!   tasks than machines drive the GPU of `SLURM_LOCALID` each. The master is `MASTER_ADDR`
//!   (else the first host of `SLURM_STEP_NODELIST`, else of `SLURM_JOB_NODELIST`) at
//!   `MASTER_PORT` (else [`SLURM_DEFAULT_PORT`]); Slurm's per-task values win over
//!   `WORLD_SIZE` and `RANK`, which a job script can only export alike to every task.
//! - **env**: any of `WORLD_SIZE`, `RANK`, `MASTER_ADDR`, `MASTER_PORT`, `LOCAL_RANK` (a
//!   Kubeflow PyTorchJob pod, or a hand-made launch).
//! - **flags**: none of these; the command line and the defaults alone.

use super::hostlist;
use super::{LaunchError, MasterAddr};

/// The port of birdtrain's rendezvous under Slurm when neither `--master` nor `MASTER_PORT`
/// names one (the port torchrun and PyTorch use by default).
pub const SLURM_DEFAULT_PORT: u16 = 29500;

/// Looks a variable up (the process environment, or a test's map).
pub type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// What started this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// No launcher variables: the command line and the defaults.
    Flags,
    /// `torchrun` (torch.distributed.run), one process per GPU.
    Torchrun,
    /// Slurm's `srun`.
    Slurm,
    /// `WORLD_SIZE`, `RANK`, `MASTER_ADDR`, `MASTER_PORT` set otherwise (Kubeflow's
    /// PyTorchJob, a hand-made launch).
    Env,
}

impl Launcher {
    /// The name `--dry-run --json` prints: `flags`, `torchrun`, `slurm` or `env`.
    pub fn as_str(self) -> &'static str {
        match self {
            Launcher::Flags => "flags",
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "slurm",
            Launcher::Env => "env",
        }
    }
}

/// A value and the variable it came from (for notes and errors).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FromVar<T> {
    /// The value.
    pub value: T,
    /// The variable's name.
    pub var: &'static str,
}

/// The one GPU a launcher that starts one process per GPU gives this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalGpu {
    /// Its index among the GPUs of the machine (`LOCAL_RANK`, `SLURM_LOCALID`).
    pub index: FromVar<usize>,
    /// Why one process per GPU, for errors: "one process per GPU (torchrun)".
    pub mode: String,
    /// What to change when the GPU is not there.
    pub hint: &'static str,
}

/// The launcher's view of this process, before the flags are applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LauncherEnv {
    /// Which launcher it is.
    pub launcher: Launcher,
    /// Rendezvous participants (`WORLD_SIZE`, `SLURM_NTASKS`).
    pub nodes: Option<FromVar<usize>>,
    /// This process among them (`RANK`, `SLURM_PROCID`).
    pub node_rank: Option<FromVar<usize>>,
    /// The master as the launcher names it, and where that came from.
    pub master: Option<(MasterAddr, &'static str)>,
    /// What is added to the master's port for birdtrain's rendezvous: 1 under torchrun, whose
    /// agent already listens on `MASTER_PORT`.
    pub rendezvous_port_offset: u16,
    /// The one GPU of a one-process-per-GPU launch (`None`: the process drives `--gpus`).
    pub local_gpu: Option<LocalGpu>,
    /// Processes of this run on this machine (`LOCAL_WORLD_SIZE`), sharing its cores.
    pub local_processes: Option<FromVar<usize>>,
    /// torchrun's restarts of this worker so far (`TORCHELASTIC_RESTART_COUNT`).
    pub restart_count: u64,
    /// This machine among the job's (`SLURM_NODEID`, `SLURM_NNODES`).
    pub machine: Option<(usize, usize)>,
    /// Variables of another launcher that this one's win over, in words (logged).
    pub ignored: Vec<String>,
    /// Why `nodes > 1` has no master, when the launcher would have given one.
    pub missing_master_hint: &'static str,
}

fn set(env: Env<'_>, var: &str) -> bool {
    env(var).is_some_and(|v| !v.trim().is_empty())
}

/// A non-negative integer variable; `None` when unset or empty.
pub(crate) fn env_usize(env: Env<'_>, var: &'static str) -> Result<Option<usize>, LaunchError> {
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

fn from_var(env: Env<'_>, var: &'static str) -> Result<Option<FromVar<usize>>, LaunchError> {
    Ok(env_usize(env, var)?.map(|value| FromVar { value, var }))
}

/// The first of `vars` that is set.
fn first_of(env: Env<'_>, vars: &[&'static str]) -> Result<Option<FromVar<usize>>, LaunchError> {
    for &var in vars {
        if let Some(v) = from_var(env, var)? {
            return Ok(Some(v));
        }
    }
    Ok(None)
}

/// Which launcher the variables show ([the module's](self) precedence).
pub fn detect(env: Env<'_>) -> Launcher {
    let torchrun = set(env, "TORCHELASTIC_RUN_ID")
        || set(env, "TORCHELASTIC_USE_AGENT_STORE")
        || (set(env, "LOCAL_WORLD_SIZE") && (set(env, "RANK") || set(env, "WORLD_SIZE")));
    if torchrun {
        Launcher::Torchrun
    } else if set(env, "SLURM_PROCID") {
        Launcher::Slurm
    } else if [
        "WORLD_SIZE",
        "RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "LOCAL_RANK",
    ]
    .iter()
    .any(|v| set(env, v))
    {
        Launcher::Env
    } else {
        Launcher::Flags
    }
}

/// Reads the variables of the launcher that started this process.
pub fn read(env: Env<'_>) -> Result<LauncherEnv, LaunchError> {
    let launcher = detect(env);
    let mut seen = LauncherEnv {
        launcher,
        nodes: None,
        node_rank: None,
        master: None,
        rendezvous_port_offset: 0,
        local_gpu: None,
        local_processes: None,
        restart_count: 0,
        machine: None,
        ignored: Vec::new(),
        missing_master_hint: "pass --master host:port (or set MASTER_ADDR and MASTER_PORT)",
    };
    match launcher {
        Launcher::Flags => {}
        Launcher::Env | Launcher::Torchrun => read_torch_style(env, &mut seen)?,
        Launcher::Slurm => read_slurm(env, &mut seen)?,
    }
    Ok(seen)
}

/// The node rank the launcher gives this process, if any (`RANK`, `SLURM_PROCID`); `None`
/// also when the variables are invalid (the launch itself then refuses them).
pub fn node_rank(env: Env<'_>) -> Option<usize> {
    read(env).ok()?.node_rank.map(|r| r.value)
}

/// `MASTER_ADDR` and `MASTER_PORT`, both or neither.
fn torch_master(env: Env<'_>) -> Result<Option<MasterAddr>, LaunchError> {
    let (addr, port) = (env("MASTER_ADDR"), env("MASTER_PORT"));
    match (addr, port) {
        (Some(a), Some(p)) => Ok(Some(MasterAddr::parse(
            &format!("{}:{}", a.trim(), p.trim()),
            "MASTER_ADDR/MASTER_PORT",
        )?)),
        (Some(_), None) => Err(LaunchError::PartialMasterEnv {
            set: "MASTER_ADDR",
            missing: "MASTER_PORT",
        }),
        (None, Some(_)) => Err(LaunchError::PartialMasterEnv {
            set: "MASTER_PORT",
            missing: "MASTER_ADDR",
        }),
        (None, None) => Ok(None),
    }
}

/// torchrun's variables, and the same names set by hand or by a PyTorchJob.
fn read_torch_style(env: Env<'_>, seen: &mut LauncherEnv) -> Result<(), LaunchError> {
    let torchrun = seen.launcher == Launcher::Torchrun;
    seen.nodes = from_var(env, "WORLD_SIZE")?;
    seen.node_rank = from_var(env, "RANK")?;
    seen.master = torch_master(env)?.map(|m| (m, "MASTER_ADDR/MASTER_PORT"));
    let local_rank = from_var(env, "LOCAL_RANK")?;
    if torchrun {
        seen.rendezvous_port_offset = 1;
        seen.local_processes = from_var(env, "LOCAL_WORLD_SIZE")?;
        seen.restart_count = env_usize(env, "TORCHELASTIC_RESTART_COUNT")?.unwrap_or(0) as u64;
        if let Some(lws) = seen.local_processes {
            if lws.value == 0 {
                return Err(LaunchError::InvalidEnv {
                    var: "LOCAL_WORLD_SIZE",
                    value: "0".into(),
                    expected: "at least 1 process on this machine",
                });
            }
            if let Some(lr) = local_rank.filter(|lr| lr.value >= lws.value) {
                return Err(LaunchError::Inconsistent {
                    what: format!(
                        "LOCAL_RANK={} is outside 0..LOCAL_WORLD_SIZE={}",
                        lr.value, lws.value
                    ),
                    hint: "torchrun sets both; was one of them set by hand?",
                });
            }
        }
        if set(env, "SLURM_PROCID") {
            seen.ignored.push(format!(
                "torchrun's variables win over Slurm's (SLURM_PROCID={})",
                env("SLURM_PROCID").unwrap_or_default().trim()
            ));
        }
    }
    seen.local_gpu = local_rank.map(|index| LocalGpu {
        index,
        mode: if torchrun {
            "one process per GPU (torchrun)".into()
        } else {
            "one process per GPU".into()
        },
        hint: "start no more processes per machine than it has GPUs (torchrun --nproc-per-node), or give each process its GPU with CUDA_VISIBLE_DEVICES",
    });
    Ok(())
}

/// `srun`'s variables.
fn read_slurm(env: Env<'_>, seen: &mut LauncherEnv) -> Result<(), LaunchError> {
    let required = |vars: &[&'static str]| -> Result<FromVar<usize>, LaunchError> {
        first_of(env, vars)?.ok_or(LaunchError::MissingEnv {
            var: vars[0],
            because: "SLURM_PROCID is set",
            hint: "start birdtrain through srun, which sets both",
        })
    };
    let tasks = required(&["SLURM_NTASKS", "SLURM_NPROCS"])?;
    let machines = required(&["SLURM_NNODES", "SLURM_JOB_NUM_NODES"])?;
    let rank = required(&["SLURM_PROCID"])?;
    if machines.value == 0 || tasks.value < machines.value {
        return Err(LaunchError::Inconsistent {
            what: format!(
                "{}={} but {}={}",
                tasks.var, tasks.value, machines.var, machines.value
            ),
            hint: "every machine of the step needs a task: srun --ntasks-per-node 1 (one task driving every GPU of its machine) or --ntasks-per-node G (one per GPU)",
        });
    }
    if let Some(id) = from_var(env, "SLURM_NODEID")? {
        if id.value >= machines.value {
            return Err(LaunchError::Inconsistent {
                what: format!(
                    "SLURM_NODEID={} is outside 0..{}={}",
                    id.value, machines.var, machines.value
                ),
                hint: "srun sets both; was one of them set by hand?",
            });
        }
        seen.machine = Some((id.value, machines.value));
    }
    seen.nodes = Some(tasks);
    seen.node_rank = Some(rank);
    if tasks.value > machines.value {
        let index = from_var(env, "SLURM_LOCALID")?.ok_or(LaunchError::MissingEnv {
            var: "SLURM_LOCALID",
            because: "there are more tasks than machines (one task per GPU)",
            hint: "start birdtrain through srun, which sets it",
        })?;
        seen.local_gpu = Some(LocalGpu {
            index,
            mode: format!(
                "one task per GPU ({}={} > {}={})",
                tasks.var, tasks.value, machines.var, machines.value
            ),
            hint: "ask for a GPU per task (srun --gpus-per-task 1) and no more tasks per machine than GPUs, or one task per machine driving them all (--ntasks-per-node 1)",
        });
    }
    // A job script may export WORLD_SIZE (alike for every task); only a different value is news.
    for (var, slurm) in [("WORLD_SIZE", tasks), ("RANK", rank)] {
        if let Some(v) = env(var).filter(|v| v.trim() != slurm.value.to_string()) {
            seen.ignored.push(format!(
                "{}={} wins over {var}={}",
                slurm.var,
                slurm.value,
                v.trim()
            ));
        }
    }
    seen.master = slurm_master(env)?;
    seen.missing_master_hint = "srun sets SLURM_JOB_NODELIST, whose first host serves the rendezvous; or pass --master host:port";
    Ok(())
}

/// `MASTER_ADDR` or the first host of the step's (else the job's) node list, at `MASTER_PORT`
/// or [`SLURM_DEFAULT_PORT`]; `None` when no host is named.
fn slurm_master(env: Env<'_>) -> Result<Option<(MasterAddr, &'static str)>, LaunchError> {
    let port = match env("MASTER_PORT").filter(|p| !p.trim().is_empty()) {
        Some(p) => {
            p.trim()
                .parse::<u16>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or(LaunchError::InvalidEnv {
                    var: "MASTER_PORT",
                    value: p,
                    expected: "a TCP port 1-65535",
                })?
        }
        None => SLURM_DEFAULT_PORT,
    };
    if let Some(host) = env("MASTER_ADDR").filter(|h| !h.trim().is_empty()) {
        let addr = MasterAddr::parse(&format!("{}:{port}", host.trim()), "MASTER_ADDR")?;
        return Ok(Some((addr, "MASTER_ADDR")));
    }
    for var in [
        "SLURM_STEP_NODELIST",
        "SLURM_JOB_NODELIST",
        "SLURM_NODELIST",
    ] {
        let Some(list) = env(var).filter(|l| !l.trim().is_empty()) else {
            continue;
        };
        let hosts = hostlist::expand(&list).map_err(|reason| LaunchError::InvalidHostlist {
            var,
            value: list.clone(),
            reason,
        })?;
        let first = &hosts[0];
        let addr = MasterAddr {
            host: first.clone(),
            port,
        };
        return Ok(Some((addr, var)));
    }
    Ok(None)
}
