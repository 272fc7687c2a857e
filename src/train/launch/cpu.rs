//! The launcher of CPU ranks: R threads in this process, each building its rank
//! ([`cpu_rank`]) and running it ([`run_rank`]), joined by the in-process collective
//! ([`LocalCollective`]).

use std::path::PathBuf;

use pipeline::Split;

use super::rank_threads::join_ranks;
use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::dist::collective::{Collective, CollectiveError};
use crate::dist::launch;
use crate::dist::local::{HostGrads, LocalCollective, LocalGroup};
use crate::dist::start_gate::StartGate;
use crate::train::config::TrainConfig;
use crate::train::epochs::run_rank;
use crate::train::folder::{CheckpointMeta, RunFolder};
use crate::train::rank::cpu::cpu_rank;
use crate::train::report::{Launched, RankReport, StopWish};
use crate::train::setup::{pipeline_for, Shared};
use crate::train::TrainError;

/// Runs `shared`'s ranks on threads, one per collective of `comms`, on one CPU thread pool.
pub(crate) fn run_cpu_ranks<C: Collective<Buffer = HostGrads>>(
    shared: &Shared,
    comms: Vec<C>,
    stop: &StopWish<'_>,
) -> Result<Vec<RankReport>, TrainError> {
    let cpu = CpuBackend::new(shared.cfg.threads)?;
    let world = comms.len();
    // The ranks start together or not at all: one whose thread the OS refuses would leave
    // the others waiting in their first collective until its timeout.
    let gate = StartGate::new(world);
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let backend = cpu.clone();
                let rank = comm.rank();
                let gate = &gate;
                pipeline::threads::spawn_scoped(s, format!("rank-{rank}"), move || {
                    if !gate.arrive() {
                        return Err(TrainError::Collective(Box::new(CollectiveError::Aborted {
                            rank,
                            reason: "another rank's thread could not start".into(),
                        })));
                    }
                    let mut r = cpu_rank(shared, backend, comm)?;
                    run_rank(shared, &mut r, &|step| stop(rank, step))
                })
            })
            .collect();
        if handles.iter().any(Result::is_err) {
            gate.call_off();
        }
        join_ranks(handles, &|_| "CPU".to_string())
    })
}

/// The shared state of a CPU run of `cfg.replicas` ranks.
pub(crate) fn shared_for_cpu(
    cfg: &TrainConfig,
    folder: &RunFolder,
    resumed: Option<&(PathBuf, CheckpointMeta)>,
) -> Result<Shared, TrainError> {
    let ranks = cfg.replicas;
    let train = pipeline_for(cfg, folder, Split::Train, ranks, None)?;
    let valid = pipeline_for(cfg, folder, Split::Valid, ranks, None)?;
    Shared::new(cfg, ranks, resumed, train, valid, folder.clone(), true)
}

/// Checks the launch flags and torchrun variables of a CPU run (`env` looks a variable up):
/// the same validation as a GPU launch, so a bad `--master` or `WORLD_SIZE` is one error line,
/// and a multi-node request is refused rather than each process training alone (the CPU
/// ranks of a run share one process; nodes meet through NCCL).
pub(crate) fn check_single_node(
    cfg: &TrainConfig,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(), TrainError> {
    let flags = cfg.dist.launch_flags(Some("0"))?;
    let plan = launch::resolve(&flags, env, &launch::VisibleGpus::Listed(Vec::new()))?;
    for note in &plan.overrides {
        tracing::info!("{note}");
    }
    Ok(())
}

/// Trains on the CPU: `cfg.replicas` ranks on threads, the in-process collective.
pub(crate) fn launch(
    cfg: &TrainConfig,
    folder: &RunFolder,
    resumed: Option<&(PathBuf, CheckpointMeta)>,
    stop: &StopWish<'_>,
) -> Result<Launched, TrainError> {
    check_single_node(cfg, &launch::process_env)?;
    let shared = shared_for_cpu(cfg, folder, resumed)?;
    let ranks = shared.ranks();
    let devices = format!(
        "{} × {ranks} rank{}",
        CpuBackend::new(cfg.threads)?.name(),
        if ranks == 1 { "" } else { "s" }
    );
    shared.say_start(&devices, resumed);
    let comms: Vec<LocalCollective> =
        LocalGroup::ranks(ranks, shared.cfg.dist.collective_timeout());
    let reports = run_cpu_ranks(&shared, comms, stop)?;
    Ok(Launched {
        shared: std::sync::Arc::new(shared),
        reports,
        devices,
        notes: Vec::new(),
        writer: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::launch::LaunchError;

    fn check(
        nodes: Option<usize>,
        node_rank: Option<usize>,
        master: Option<&str>,
        vars: &[(&str, &str)],
    ) -> Result<(), TrainError> {
        let mut cfg = TrainConfig::new("data");
        cfg.dist.nodes = nodes;
        cfg.dist.node_rank = node_rank;
        cfg.dist.master = master.map(str::to_string);
        let env = |name: &str| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        };
        check_single_node(&cfg, &env)
    }

    #[test]
    fn one_node_with_or_without_torchrun_variables_passes() {
        check(None, None, None, &[]).unwrap();
        check(Some(1), Some(0), None, &[]).unwrap();
        let one = [
            ("WORLD_SIZE", "1"),
            ("RANK", "0"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ];
        check(None, None, None, &one).unwrap();
    }

    #[test]
    fn several_nodes_on_the_cpu_are_refused_not_trained_alone() {
        let e = check(Some(2), Some(0), Some("127.0.0.1:29500"), &[]).unwrap_err();
        assert!(
            matches!(
                e,
                TrainError::Launch(LaunchError::CpuMultiNode { nodes: 2 })
            ),
            "{e}"
        );
        assert!(e.to_string().contains("--replicas"), "{e}");
        let torchrun = [
            ("WORLD_SIZE", "2"),
            ("RANK", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ];
        let e = check(None, None, None, &torchrun).unwrap_err();
        assert!(
            matches!(e, TrainError::Launch(LaunchError::CpuMultiNode { .. })),
            "{e}"
        );
    }

    #[test]
    fn bad_launch_values_name_the_flag_or_variable() {
        let cases: [(Result<(), TrainError>, &str); 5] = [
            (
                check(None, None, None, &[("WORLD_SIZE", "abc")]),
                "WORLD_SIZE",
            ),
            (check(Some(2), Some(2), Some("h:1"), &[]), "--node-rank"),
            (check(Some(0), None, None, &[]), "--nodes"),
            (check(None, None, Some("127.0.0.1:abc"), &[]), "--master"),
            (
                check(None, None, None, &[("MASTER_ADDR", "h")]),
                "MASTER_PORT",
            ),
        ];
        for (result, named) in cases {
            let e = result.unwrap_err();
            assert!(matches!(e, TrainError::Launch(_)), "{e}");
            assert!(e.to_string().contains(named), "{named}: {e}");
        }
    }
}
