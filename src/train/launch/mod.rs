//! Launchers: what starts a run's ranks on their device and hands back their reports
//! ([`Launched`]). [`cpu`] runs `--replicas R` CPU ranks on threads of this process; [`cuda`]
//! one driver thread per GPU joined by NCCL (with the rendezvous across nodes), or with the
//! rehearsal's test switch [`rehearsal`] several GPU ranks on one GPU. Each builds its ranks
//! with the per-step device code below ([`crate::train::rank`]) and runs them through
//! [`crate::train::epochs::run_rank`]; [`auto_batch`] measures `--batch-size auto` on the
//! GPUs a launch would use.

pub(crate) mod auto_batch;
pub(crate) mod cpu;
pub(crate) mod cuda;
mod plan;
mod rank_threads;
mod rehearsal;

use std::path::PathBuf;

use crate::train::config::TrainConfig;
use crate::train::device::DeviceChoice;
use crate::train::folder::{CheckpointMeta, RunFolder};
use crate::train::report::{Launched, StopWish};
use crate::train::TrainError;

/// Starts the ranks of `cfg`'s device (resuming `resumed` when given) and runs them to the end.
pub(crate) fn launch(
    cfg: &TrainConfig,
    folder: &RunFolder,
    resumed: Option<&(PathBuf, CheckpointMeta)>,
    stop: &StopWish<'_>,
) -> Result<Launched, TrainError> {
    match cfg.device {
        DeviceChoice::Cpu => cpu::launch(cfg, folder, resumed, stop),
        DeviceChoice::Cuda(n) => cuda::launch(cfg, n, folder, resumed, stop),
    }
}
