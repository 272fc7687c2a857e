//! CUDA graphs of the training step (`BIRDTRAIN_CUDA_GRAPH=1`, off by default): a GPU rank's
//! steady-state step (input transform, forward, loss, backward, optimizer: some 560 launches
//! for resnet50) captured once on the compute stream and replayed as one launch.
//!
//! A step can be replayed because nothing it reads changes between steps except device memory
//! written before the replay: the per-step values (augmentation, mixing, labels, the loss's
//! mixing weight, the stop wish, the lr and Adam's bias corrections) come from device buffers
//! of fixed address (`backend/step_values.rs`, `optim.rs`), uploaded before the step. Two
//! addresses do change: the staging slot the batch was uploaded to and the step-totals slot
//! the loss writes; a graph is captured per pair of them ([`GraphKey`]), a handful in all
//! (`--prefetch-depth` slots × 2 totals slots).
//!
//! Which steps replay is [`GraphPolicy`]'s decision, a pure function of what it is told (unit
//! tested): only full batches of one GPU alone (no NCCL, no rehearsal), without
//! `--grad-accum-steps`, `--sync-bn` or `--trace`, and only after one eager step of the same
//! shape with no allocation since (a capture must not allocate, and a graph holds the
//! addresses of the buffers it was captured with: when the backend grows a buffer, e.g. for
//! validation's larger loss scratch, every graph is dropped and the next step warms up
//! again). Every other step runs eagerly, saying nothing.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaStream};

use super::error::CudaError;

/// The switch: `BIRDTRAIN_CUDA_GRAPH=1` captures and replays the training step.
pub const CUDA_GRAPH_ENV: &str = "BIRDTRAIN_CUDA_GRAPH";

/// Parses the value of `BIRDTRAIN_CUDA_GRAPH` (unset, empty or `0`: off; `1`: on).
pub fn parse_cuda_graph(value: Option<&str>) -> Result<bool, CudaError> {
    match value.map(str::trim) {
        None | Some("") | Some("0") => Ok(false),
        Some("1") => Ok(true),
        Some(other) => Err(CudaError::Unsupported {
            what: format!(
                "{CUDA_GRAPH_ENV}={other:?}: expected 1 (capture the training step as a CUDA \
                 graph and replay it) or 0 (launch every kernel); unset means 0"
            ),
        }),
    }
}

/// Graph launches in this process so far (captured steps' first launches and replays).
static LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// How many steps this process has run as CUDA graphs so far: what a test reads to know
/// that the switch took effect.
pub fn graph_launches() -> u64 {
    LAUNCHES.load(Ordering::Relaxed)
}

/// Whether the environment asks for CUDA graphs.
pub fn cuda_graph_from_env() -> Result<bool, CudaError> {
    parse_cuda_graph(std::env::var(CUDA_GRAPH_ENV).ok().as_deref())
}

/// What differs between the graphs of one run: the device addresses of the staged batch and
/// of the step-totals slot, which the step's kernels take by value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GraphKey {
    /// The staging slot the batch's pixels are in.
    pub input: u64,
    /// The five f64 the loss writes the step's figures to.
    pub totals: u64,
}

/// One step as [`GraphPolicy::decide`] sees it.
#[derive(Debug, Clone, Copy)]
pub struct StepCase {
    /// The step may run as a graph at all: one GPU alone, one micro-batch, a full batch, no
    /// `--sync-bn`, no `--trace`.
    pub eligible: bool,
    /// Its addresses.
    pub key: GraphKey,
    /// Bytes the backend allocated so far ([`super::GpuDevice::allocated_bytes`]): a change
    /// since the graphs were captured means a buffer they read may have moved.
    pub allocated: u64,
}

/// How one step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GraphAction {
    /// Launch by launch, as without the switch.
    Eager,
    /// Launch by launch inside a stream capture, then the captured graph (new key).
    Capture,
    /// The graph captured for the key.
    Replay,
}

/// Which steps capture, replay or run eagerly (see the module docs).
#[derive(Debug, Default)]
pub struct GraphPolicy {
    enabled: bool,
    /// The allocation count before the last warm-up (an eager eligible step): a later
    /// eligible step that finds it unchanged allocates nothing new, so it may be captured.
    warm_at: Option<u64>,
    /// Keys captured since the warm-up.
    captured: std::collections::HashSet<GraphKey>,
}

impl GraphPolicy {
    /// A policy; `enabled` false: every step eager.
    pub fn new(enabled: bool) -> Self {
        GraphPolicy {
            enabled,
            ..GraphPolicy::default()
        }
    }

    /// Whether graphs are on at all.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// How `step` runs. After [`GraphAction::Capture`], call [`GraphPolicy::captured`] once
    /// the graph exists.
    pub fn decide(&mut self, step: StepCase) -> GraphAction {
        if !self.enabled || !step.eligible {
            return GraphAction::Eager;
        }
        if self.warm_at != Some(step.allocated) {
            // First eligible step, or something was allocated since: warm up (again).
            self.captured.clear();
            self.warm_at = Some(step.allocated);
            return GraphAction::Eager;
        }
        if self.captured.contains(&step.key) {
            GraphAction::Replay
        } else {
            GraphAction::Capture
        }
    }

    /// The graph of `key` was captured (with no allocation: `allocated` unchanged).
    pub fn captured(&mut self, key: GraphKey) {
        self.captured.insert(key);
    }

    /// Whether graphs captured so far are still valid at allocation count `allocated` (else
    /// the caller drops them).
    pub fn valid_at(&self, allocated: u64) -> bool {
        self.warm_at == Some(allocated)
    }
}

/// The graphs of one GPU rank and the policy that chooses them.
pub struct StepGraphs {
    policy: GraphPolicy,
    graphs: HashMap<GraphKey, CudaGraph>,
    stream: Arc<CudaStream>,
}

impl std::fmt::Debug for StepGraphs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepGraphs")
            .field("policy", &self.policy)
            .field("graphs", &self.graphs.len())
            .finish_non_exhaustive()
    }
}

fn graph_error(what: &str, e: impl std::fmt::Display) -> CudaError {
    CudaError::Unsupported {
        what: format!(
            "CUDA graph of the training step: {what}: {e} (unset {CUDA_GRAPH_ENV} to launch \
             every kernel instead)"
        ),
    }
}

impl StepGraphs {
    /// Graphs on `stream` (the compute stream), captured and replayed when `enabled`.
    pub fn new(stream: Arc<CudaStream>, enabled: bool) -> Self {
        StepGraphs {
            policy: GraphPolicy::new(enabled),
            graphs: HashMap::new(),
            stream,
        }
    }

    /// Whether graphs are on at all.
    pub fn enabled(&self) -> bool {
        self.policy.enabled()
    }

    /// How `step` runs (graphs captured before an allocation are dropped here, once the
    /// stream has finished their last launch).
    pub fn decide(&mut self, step: StepCase) -> Result<GraphAction, CudaError> {
        let action = self.policy.decide(step);
        let warm_up = action == GraphAction::Eager && step.eligible && self.policy.enabled();
        if warm_up && !self.graphs.is_empty() {
            // The graphs captured before it may read buffers since moved.
            self.stream
                .synchronize()
                .map_err(|e| graph_error("waiting for the last replay", e))?;
            self.graphs.clear();
        }
        Ok(action)
    }

    /// Starts capturing the compute stream (this thread's work on it only).
    pub fn begin_capture(&self) -> Result<(), CudaError> {
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| graph_error("beginning the capture", e))
    }

    /// Ends the capture begun by [`StepGraphs::begin_capture`]: with `keep`, instantiates the
    /// graph as `key`'s (the step's work is not run yet: [`StepGraphs::replay`] runs it);
    /// without (the step failed while capturing), discards it.
    pub fn end_capture(&mut self, key: GraphKey, keep: bool) -> Result<(), CudaError> {
        let flags = CUgraphInstantiate_flags(0);
        let graph = self.stream.end_capture(flags);
        if !keep {
            return Ok(());
        }
        let graph = graph
            .map_err(|e| graph_error("ending the capture", e))?
            .ok_or_else(|| graph_error("ending the capture", "no graph was captured"))?;
        self.graphs.insert(key, graph);
        self.policy.captured(key);
        Ok(())
    }

    /// Launches `key`'s graph on the compute stream.
    pub fn replay(&self, key: GraphKey) -> Result<(), CudaError> {
        let graph = self
            .graphs
            .get(&key)
            .ok_or_else(|| graph_error("replaying", "no graph was captured for this step"))?;
        graph.launch().map_err(|e| graph_error("launching", e))?;
        LAUNCHES.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case(eligible: bool, input: u64, totals: u64, allocated: u64) -> StepCase {
        StepCase {
            eligible,
            key: GraphKey { input, totals },
            allocated,
        }
    }

    #[test]
    fn the_switch_is_off_unless_set_to_one() {
        assert!(!parse_cuda_graph(None).unwrap());
        assert!(!parse_cuda_graph(Some("")).unwrap());
        assert!(!parse_cuda_graph(Some("0")).unwrap());
        assert!(parse_cuda_graph(Some("1")).unwrap());
        assert!(parse_cuda_graph(Some(" 1 ")).unwrap());
        let e = parse_cuda_graph(Some("yes")).unwrap_err().to_string();
        assert!(e.contains(CUDA_GRAPH_ENV) && e.contains("\"yes\""), "{e}");
        assert_eq!(e.lines().count(), 1, "{e}");
    }

    #[test]
    fn off_every_step_is_eager() {
        let mut p = GraphPolicy::new(false);
        for _ in 0..4 {
            assert_eq!(p.decide(case(true, 1, 2, 10)), GraphAction::Eager);
        }
    }

    #[test]
    fn a_warm_up_step_then_one_capture_per_key_then_replays() {
        let mut p = GraphPolicy::new(true);
        // Two staging slots × two totals slots, in the order a run visits them.
        let keys = [(1, 10), (2, 20), (1, 20), (2, 10)];
        assert_eq!(
            p.decide(case(true, 1, 10, 5)),
            GraphAction::Eager,
            "warm-up"
        );
        for &(i, t) in &keys {
            assert_eq!(p.decide(case(true, i, t, 5)), GraphAction::Capture);
            p.captured(GraphKey {
                input: i,
                totals: t,
            });
        }
        for _ in 0..3 {
            for &(i, t) in &keys {
                assert_eq!(p.decide(case(true, i, t, 5)), GraphAction::Replay);
            }
        }
    }

    #[test]
    fn an_ineligible_step_is_eager_and_keeps_the_graphs() {
        let mut p = GraphPolicy::new(true);
        assert_eq!(p.decide(case(true, 1, 10, 5)), GraphAction::Eager);
        assert_eq!(p.decide(case(true, 1, 10, 5)), GraphAction::Capture);
        p.captured(GraphKey {
            input: 1,
            totals: 10,
        });
        // The last partial batch of an epoch (or a step with --trace): eager, silently.
        assert_eq!(p.decide(case(false, 2, 10, 5)), GraphAction::Eager);
        assert_eq!(p.decide(case(true, 1, 10, 5)), GraphAction::Replay);
    }

    #[test]
    fn an_allocation_drops_the_graphs_and_warms_up_again() {
        let mut p = GraphPolicy::new(true);
        assert_eq!(p.decide(case(true, 1, 10, 5)), GraphAction::Eager);
        assert_eq!(p.decide(case(true, 1, 10, 5)), GraphAction::Capture);
        p.captured(GraphKey {
            input: 1,
            totals: 10,
        });
        assert!(p.valid_at(5));
        // Validation grew a buffer (allocated 5 → 9): eager once, then capture anew.
        assert!(!p.valid_at(9));
        assert_eq!(p.decide(case(true, 1, 10, 9)), GraphAction::Eager);
        assert_eq!(p.decide(case(true, 1, 10, 9)), GraphAction::Capture);
    }
}
