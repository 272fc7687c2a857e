//! CPU ranks: R threads in this process, each with its own replica on the shared CPU thread
//! pool, joined by the in-process collective ([`LocalCollective`]).
//!
//! A CPU rank's batches come straight from the engine; the backward hook copies each
//! finished gradient into its bucket's range of the rank's host gradient buffer, and the
//! collective's communication thread averages a bucket while backward computes the layers
//! before it. The optimizer ([`CpuRankOptimizer`]) updates the network's own parameters in
//! place from that buffer (the parameters are the master weights), with no copy or permutation.

use std::ops::Range;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use pipeline::{EpochIter, Pipeline, Split};

use super::{pack_totals, Device, Rank, TOTALS_LEN};
use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::cuda::staging::feed::HostBatch;
use crate::dist::collective::{Collective, CollectiveError};
use crate::dist::launch;
use crate::dist::local::{HostGrads, LocalCollective, LocalGroup};
use crate::dist::start_gate::StartGate;
use crate::model::{GradHookError, Network, NetworkConfig, StepStats};
use crate::optim::{ConvOrder, CpuRankOptimizer, ParamLayout};
use crate::train::config::TrainConfig;
use crate::train::folder::{CheckpointMeta, RunFolder};
use crate::train::run::{first_cause, run_rank, Launched, RankReport, StopWish};
use crate::train::setup::{pipeline_for, Shared};
use crate::train::TrainError;

/// The CPU side of a rank, over any collective of host gradient buffers.
pub(crate) struct CpuDevice<C> {
    batches: Option<EpochIter>,
    trace: crate::trace::TraceRecorder,
    pid: u32,
    _comm: std::marker::PhantomData<fn() -> C>,
}

impl<C> CpuDevice<C> {
    fn new(shared: &Shared, rank: usize) -> Self {
        if shared.trace.is_enabled() {
            shared
                .trace
                .name_process(rank as u32, &format!("CPU rank {rank}"));
            shared.trace.name_thread(rank as u32, 0, "rank thread");
        }
        CpuDevice {
            batches: None,
            trace: shared.trace.clone(),
            pid: rank as u32,
            _comm: std::marker::PhantomData,
        }
    }
}

impl<C: Collective<Buffer = HostGrads>> Device for CpuDevice<C> {
    type Backend = CpuBackend;
    type Comm = C;
    type Optim = CpuRankOptimizer;
    type Pending = [f64; TOTALS_LEN];
    type Mark = Instant;

    fn begin_epoch(
        &mut self,
        pipe: &Pipeline,
        epoch: u64,
        rank: usize,
        start_step: usize,
    ) -> Result<(), TrainError> {
        self.batches = Some(pipe.epoch(epoch, rank, start_step)?);
        Ok(())
    }

    fn next_batch(
        &mut self,
        _net: &Network<CpuBackend>,
        _comm: &mut C,
    ) -> Result<Option<(HostBatch, Duration)>, TrainError> {
        let t = Instant::now();
        let next = self.batches.as_mut().and_then(Iterator::next);
        match next {
            Some(batch) => Ok(Some((HostBatch::from_engine(batch?), t.elapsed()))),
            None => Ok(None),
        }
    }

    fn before_compute(
        &mut self,
        _net: &Network<CpuBackend>,
        _stop: bool,
    ) -> Result<(), TrainError> {
        Ok(())
    }

    fn after_compute(&mut self, _net: &Network<CpuBackend>) -> Result<(), TrainError> {
        Ok(())
    }

    fn place_gradient(
        grads: &mut HostGrads,
        range: Range<usize>,
        grad: &Vec<f32>,
    ) -> Result<(), GradHookError> {
        let n = range.len();
        let dst = grads.range_mut(range)?;
        let src = grad
            .get(..n)
            .ok_or_else(|| format!("a gradient of {} values for a range of {n}", grad.len()))?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn zero_gradients(&mut self, grads: &mut HostGrads) -> Result<(), TrainError> {
        grads.fill_zero().map_err(TrainError::Internal)
    }

    fn host_gradients(grads: &HostGrads) -> Result<Option<&[f32]>, TrainError> {
        grads.as_slice().map(Some).map_err(TrainError::Internal)
    }

    fn start_totals(
        &mut self,
        _net: &Network<CpuBackend>,
        comm: &mut C,
        local: &StepStats,
        stop: bool,
        _had_images: bool,
    ) -> Result<[f64; TOTALS_LEN], TrainError> {
        let mut v = pack_totals(local, stop);
        comm.sum(&mut v)?;
        Ok(v)
    }

    fn finish_totals(
        &mut self,
        _comm: &mut C,
        pending: [f64; TOTALS_LEN],
    ) -> Result<[f64; TOTALS_LEN], TrainError> {
        Ok(pending)
    }

    fn mark(&mut self, _comm: &mut C) -> Result<Instant, TrainError> {
        Ok(Instant::now())
    }

    fn span(&mut self, _comm: &mut C, start: Instant, name: &str) -> Result<(), TrainError> {
        self.trace.record_since(name, "compute", self.pid, 0, start);
        Ok(())
    }

    fn end_step(
        &mut self,
        _comm: &mut C,
        _waited: Duration,
        _total: Duration,
    ) -> Result<(), TrainError> {
        Ok(())
    }

    fn input_line(&self, _rank: usize) -> Option<String> {
        None
    }
}

/// Builds rank `rank` of a CPU run on `backend` with `comm` and runs it to the end.
pub(crate) fn run_cpu_rank<C: Collective<Buffer = HostGrads>>(
    shared: &Shared,
    backend: CpuBackend,
    comm: C,
    stop: &dyn Fn(u64) -> bool,
) -> Result<RankReport, TrainError> {
    let cfg = &shared.cfg;
    let rank = comm.rank();
    let mut net = match Network::new(
        backend,
        &shared.graph,
        shared.network_batch(),
        cfg.image_size,
    ) {
        Ok(net) => net,
        Err(e) => {
            comm.abort(&format!("rank {rank} failed: {e}"));
            return Err(e.into());
        }
    };
    net.set_config(network_config(cfg));
    let plan = &shared.bucket_plan;
    let layout = ParamLayout::with_offsets(
        shared.graph.params(),
        (0..plan.param_count())
            .map(|i| plan.param_elements(i).start)
            .collect(),
        plan.total_elements(),
        ConvOrder::Backend,
    );
    let grads = HostGrads::zeros(plan.total_elements());
    let device = CpuDevice::new(shared, rank);
    let threads = net.backend().clone();
    // The network already holds rank 0's weights (Rank::new loads them): they are the master.
    let mut r = Rank::new(shared, rank, rank, device, comm, grads, net, |_weights| {
        Ok(CpuRankOptimizer::new(
            shared.kind,
            shared.hyper,
            shared.graph.params(),
            layout,
            threads,
        )?)
    })?;
    run_rank(shared, &mut r, stop)
}

/// The options of the replica's network.
pub(crate) fn network_config(cfg: &TrainConfig) -> NetworkConfig {
    NetworkConfig {
        label_smoothing: cfg.label_smoothing,
        freeze_bn: cfg.freeze_bn,
        ..NetworkConfig::default()
    }
}

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
    let results: Vec<Result<RankReport, TrainError>> = std::thread::scope(|s| {
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
                    run_cpu_rank(shared, backend, comm, &|step| stop(rank, step))
                })
            })
            .collect();
        if handles.iter().any(Result::is_err) {
            gate.call_off();
        }
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                let result = match h {
                    Ok(h) => h.join().unwrap_or_else(|panic| {
                        Err(TrainError::Internal(format!(
                            "its thread panicked: {}",
                            panic_text(&panic)
                        )))
                    }),
                    // Its thread's name (`rank-N`) says which rank.
                    Err(e) => Err(TrainError::Thread(e)),
                };
                // Several ranks: the user learns which one failed.
                result.map_err(|e| match world {
                    1 => e,
                    _ => e.on_rank(rank, "CPU"),
                })
            })
            .collect()
    });
    let mut reports = Vec::with_capacity(results.len());
    let mut errors = Vec::new();
    for r in results {
        match r {
            Ok(report) => reports.push(report),
            Err(e) => errors.push(e),
        }
    }
    match first_cause(errors) {
        Some(e) => Err(e),
        None => Ok(reports),
    }
}

/// A panic's message.
pub(crate) fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string())
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
