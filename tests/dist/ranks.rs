//! Checks of the per-GPU thread launcher that need no GPU (they fail before any CUDA call).

use birdtrain::dist::launch::LaunchPlan;
use birdtrain::dist::ranks::{run_local_ranks, RanksError};
use birdtrain::dist::rendezvous::Assignment;

const T: std::time::Duration = std::time::Duration::from_secs(5);

fn plan(devices: Vec<usize>) -> LaunchPlan {
    LaunchPlan {
        nodes: 2,
        node_rank: 1,
        ..LaunchPlan::single_node(devices)
    }
}

fn assignment(node_gpus: Vec<usize>) -> Assignment {
    Assignment {
        rank_offset: node_gpus[0],
        world_size: node_gpus.iter().sum(),
        node_gpus,
        unique_id: vec![0; 128],
    }
}

#[test]
fn a_cpu_plan_has_no_driver_threads() {
    let err = run_local_ranks(&plan(vec![]), &assignment(vec![1, 1]), T, |_| Ok(())).unwrap_err();
    assert!(matches!(err, RanksError::NoDevices), "{err}");
}

#[test]
fn the_rendezvous_and_the_plan_must_agree_on_this_nodes_gpus() {
    let err =
        run_local_ranks(&plan(vec![0, 1]), &assignment(vec![2, 3]), T, |_| Ok(())).unwrap_err();
    assert!(
        matches!(
            err,
            RanksError::Mismatch {
                assigned: 3,
                local: 2
            }
        ),
        "{err}"
    );
}

// ---- The driver threads' failure handling, with fake devices and communicators ----------

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use birdtrain::dist::ranks::{run_ranks_with, CommSetup, RankLimits, RankSlot};
use birdtrain::dist::watchdog::Abortable;

/// How long a fake collective or a fake init waits before it calls itself timed out: standing
/// for `--collective-timeout` and the rendezvous timeout. A rank that reports "timed out" was
/// not aborted; no test here should ever see one.
const PATIENCE: Duration = Duration::from_secs(30);

/// A fake communicator whose "collectives" block until it is aborted.
#[derive(Default)]
struct FakeComm {
    aborted: Mutex<bool>,
    wake: Condvar,
    aborts: AtomicUsize,
}

impl Abortable for FakeComm {
    fn abort(&self) -> Result<(), String> {
        self.aborts.fetch_add(1, Ordering::SeqCst);
        *self.aborted.lock().unwrap() = true;
        self.wake.notify_all();
        Ok(())
    }
    fn async_error(&self) -> Option<String> {
        None
    }
}

impl FakeComm {
    /// A collective the other ranks never complete: returns when the communicator is
    /// aborted, or after `PATIENCE` (the watchdog's timeout in a real run).
    fn stuck_collective(&self) -> Result<(), String> {
        let guard = self.aborted.lock().unwrap();
        let (guard, _) = self
            .wake
            .wait_timeout_while(guard, PATIENCE, |aborted| !*aborted)
            .unwrap();
        if *guard {
            Err("collective aborted".into())
        } else {
            Err("collective timed out".into())
        }
    }
}

/// Where each fake step happened, per global rank.
type Log = Arc<Mutex<Vec<String>>>;

/// A fake device: ranks join a fake communicator that, like NCCL's init, completes only when
/// every local rank has joined.
#[derive(Default)]
struct FakeSetup {
    fail_connect: Option<usize>,
    fail_barrier: Option<usize>,
    joined: Arc<(Mutex<usize>, Condvar)>,
    local: usize,
    comms: Arc<Mutex<Vec<Arc<FakeComm>>>>,
    log: Log,
}

impl FakeSetup {
    fn new(local: usize) -> Self {
        FakeSetup {
            local,
            ..FakeSetup::default()
        }
    }

    fn note(&self, what: String) {
        self.log.lock().unwrap().push(what);
    }
}

impl CommSetup for FakeSetup {
    type Prepared = ();
    type Comm = Arc<FakeComm>;

    fn prepare(&self, rank: usize, _ordinal: usize) -> Result<(), RanksError> {
        self.note(format!("prepare {rank}"));
        Ok(())
    }

    fn connect(
        &self,
        _prepared: &(),
        rank: usize,
        _world_size: usize,
        _unique_id: &[u8],
        _timeout: Duration,
        abandon: &dyn Fn() -> bool,
    ) -> Result<Arc<FakeComm>, RanksError> {
        self.note(format!("connect {rank}"));
        if self.fail_connect == Some(rank) {
            std::thread::sleep(Duration::from_millis(50));
            return Err(RanksError::Failed {
                rank,
                reason: "ncclCommInitRank failed: ncclSystemError".into(),
            });
        }
        let (count, cv) = &*self.joined;
        let mut joined = count.lock().unwrap();
        *joined += 1;
        cv.notify_all();
        let start = Instant::now();
        while *joined < self.local {
            if abandon() {
                self.note(format!("abandoned {rank}"));
                return Err(RanksError::PeerFailed { rank });
            }
            if start.elapsed() > PATIENCE {
                self.note(format!("init timed out {rank}"));
                return Err(RanksError::Failed {
                    rank,
                    reason: "init timed out".into(),
                });
            }
            joined = cv
                .wait_timeout(joined, Duration::from_millis(20))
                .unwrap()
                .0;
        }
        let comm = Arc::new(FakeComm::default());
        self.comms.lock().unwrap().push(comm.clone());
        Ok(comm)
    }

    fn abort_target(&self, comm: &Arc<FakeComm>) -> Arc<dyn Abortable> {
        comm.clone()
    }

    fn barrier(
        &self,
        _comm: &Arc<FakeComm>,
        rank: usize,
        _timeout: Duration,
    ) -> Result<(), RanksError> {
        self.note(format!("barrier {rank}"));
        if self.fail_barrier == Some(rank) {
            return Err(RanksError::Failed {
                rank,
                reason: "barrier: ncclRemoteError".into(),
            });
        }
        Ok(())
    }
}

/// Node 1 of two with four GPUs each: global ranks 4..8.
fn node_one() -> (LaunchPlan, Assignment) {
    (plan(vec![0, 1, 2, 3]), assignment(vec![4, 4]))
}

fn limits() -> RankLimits {
    RankLimits {
        init_timeout: PATIENCE,
        stop_grace: PATIENCE,
    }
}

/// What a run of four fake ranks left: the error, each blocked rank's collective outcome,
/// the communicators made, the log of steps.
type FourRanks = (RanksError, Vec<(usize, String)>, Vec<Arc<FakeComm>>, Log);

/// Runs four fake ranks; `fail(rank)` says what rank `rank`'s body does instead of a
/// collective that never completes.
fn run_four(
    setup: FakeSetup,
    fail: impl Fn(usize) -> Option<Result<(), String>> + Send + Sync + 'static,
) -> FourRanks {
    let (plan, assignment) = node_one();
    let outcomes: Arc<Mutex<Vec<(usize, String)>>> = Arc::default();
    let (comms, log) = (setup.comms.clone(), setup.log.clone());
    let seen = outcomes.clone();
    let err = run_ranks_with(
        setup,
        &plan,
        &assignment,
        limits(),
        move |slot: RankSlot<(), Arc<FakeComm>>| {
            if let Some(r) = fail(slot.rank) {
                return r.map_err(Into::into);
            }
            let outcome = slot.comm.stuck_collective();
            seen.lock()
                .unwrap()
                .push((slot.rank, outcome.clone().unwrap_err()));
            outcome.map_err(|e| format!("rank {}: {e}", slot.rank).into())
        },
    )
    .unwrap_err();
    let outcomes = outcomes.lock().unwrap().clone();
    let comms = comms.lock().unwrap().clone();
    (err, outcomes, comms, log)
}

fn assert_others_were_aborted(outcomes: &[(usize, String)], failing: usize) {
    assert_eq!(outcomes.len(), 3, "{outcomes:?}");
    for (rank, outcome) in outcomes {
        assert_ne!(*rank, failing);
        assert_eq!(outcome, "collective aborted", "rank {rank}");
    }
}

#[test]
fn one_failing_rank_aborts_every_communicator_and_its_own_error_is_returned() {
    let (err, outcomes, comms, _) = run_four(FakeSetup::new(4), |rank| {
        (rank == 6).then(|| {
            std::thread::sleep(Duration::from_millis(100));
            Err("CUDA_ERROR_ILLEGAL_ADDRESS in conv2_fprop".into())
        })
    });
    let RanksError::Body { rank, source } = &err else {
        panic!("expected rank 6's own error, got {err}");
    };
    assert_eq!(*rank, 6);
    assert!(source.to_string().contains("ILLEGAL_ADDRESS"), "{err}");
    assert!(err.to_string().starts_with("rank 6:"), "{err}");
    assert_others_were_aborted(&outcomes, 6);
    assert_eq!(comms.len(), 4);
    for c in &comms {
        assert!(c.aborts.load(Ordering::SeqCst) >= 1);
    }
}

#[test]
fn a_panicking_rank_aborts_every_communicator_and_is_named() {
    let (err, outcomes, _, _) = run_four(FakeSetup::new(4), |rank| {
        if rank == 5 {
            std::thread::sleep(Duration::from_millis(100));
            panic!("index out of bounds in the staging ring");
        }
        None
    });
    let RanksError::Panicked { rank, message } = &err else {
        panic!("expected rank 5's panic, got {err}");
    };
    assert_eq!(*rank, 5);
    assert!(message.contains("staging ring"), "{err}");
    assert_others_were_aborted(&outcomes, 5);
}

#[test]
fn a_failed_init_of_rank_2_of_4_stops_the_others_joining_and_is_named() {
    let setup = FakeSetup {
        fail_connect: Some(6),
        ..FakeSetup::new(4)
    };
    let (err, outcomes, comms, log) = run_four(setup, |_| None);
    assert!(
        matches!(&err, RanksError::Failed { rank: 6, reason } if reason.contains("ncclCommInitRank")),
        "expected rank 6's init error, got {err}"
    );
    // Nobody got a communicator, so no body ran; the others gave up joining instead of
    // waiting out the init's timeout.
    assert!(outcomes.is_empty(), "{outcomes:?}");
    assert!(comms.is_empty());
    let mut abandoned: Vec<String> = log
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.starts_with("abandoned") || l.starts_with("init timed out"))
        .cloned()
        .collect();
    abandoned.sort();
    assert_eq!(abandoned, ["abandoned 4", "abandoned 5", "abandoned 7"]);
}

#[test]
fn every_rank_passes_the_barrier_after_joining_and_before_its_body() {
    let setup = FakeSetup::new(4);
    let log = setup.log.clone();
    let body_log = log.clone();
    let (plan, assignment) = node_one();
    let ranks = run_ranks_with(setup, &plan, &assignment, limits(), move |slot| {
        body_log.lock().unwrap().push(format!("body {}", slot.rank));
        Ok((slot.rank, slot.local_index))
    })
    .unwrap();
    assert_eq!(ranks, vec![(4, 0), (5, 1), (6, 2), (7, 3)]);
    let log = log.lock().unwrap().clone();
    for rank in 4..8 {
        let at = |what: &str| {
            log.iter()
                .position(|l| *l == format!("{what} {rank}"))
                .unwrap_or_else(|| panic!("no {what} for rank {rank}: {log:?}"))
        };
        assert!(at("connect") < at("barrier"), "{log:?}");
        assert!(at("barrier") < at("body"), "{log:?}");
    }
}

#[test]
fn a_failed_barrier_aborts_the_ranks_already_past_it() {
    let setup = FakeSetup {
        fail_barrier: Some(7),
        ..FakeSetup::new(4)
    };
    let (err, outcomes, _, _) = run_four(setup, |_| None);
    assert!(
        matches!(&err, RanksError::Failed { rank: 7, reason } if reason.contains("barrier")),
        "{err}"
    );
    assert_others_were_aborted(&outcomes, 7);
}

#[test]
fn a_rank_that_ignores_the_abort_is_left_behind_after_the_grace() {
    let (plan, assignment) = node_one();
    let stuck_ended = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let ended = stuck_ended.clone();
    let err = run_ranks_with(
        FakeSetup::new(4),
        &plan,
        &assignment,
        RankLimits {
            init_timeout: PATIENCE,
            stop_grace: Duration::from_millis(200),
        },
        move |slot: RankSlot<(), Arc<FakeComm>>| match slot.rank {
            4 => Err("out of memory allocating the gradient buffer".into()),
            // Stuck somewhere no abort reaches (for the test: a long sleep).
            7 => {
                std::thread::sleep(10 * PATIENCE);
                ended.store(true, Ordering::SeqCst);
                Ok(())
            }
            _ => slot.comm.stuck_collective().map_err(Into::into),
        },
    )
    .unwrap_err();
    assert!(
        matches!(&err, RanksError::Body { rank: 4, .. }),
        "expected rank 4's error, got {err}"
    );
    assert!(
        !stuck_ended.load(Ordering::SeqCst),
        "the call waited for the rank that ignored the abort"
    );
}

/// With `BIRDTRAIN_FAULT=thread:gpu-2` (set by the test below for a child run of this one),
/// the OS refuses the third driver thread: the two started wait at the start gate and are
/// released at once, none connects, and the error names rank 6 and its thread. Without the
/// fault, all four start and finish.
#[test]
fn a_driver_thread_the_os_refuses_calls_the_start_off() {
    let refused = std::env::var("BIRDTRAIN_FAULT").as_deref() == Ok("thread:gpu-2");
    let (plan, assignment) = node_one();
    let setup = FakeSetup::new(4);
    let log = setup.log.clone();
    let started = std::time::Instant::now();
    let outcome = run_ranks_with(
        setup,
        &plan,
        &assignment,
        limits(),
        |_: RankSlot<(), Arc<FakeComm>>| Ok(()),
    );
    if refused {
        let err = outcome.unwrap_err();
        assert!(matches!(err, RanksError::Spawn { rank: 6, .. }), "{err}");
        let text = err.to_string();
        assert!(
            text.contains("rank 6") && text.contains("gpu-2") && text.contains("hint"),
            "{text}"
        );
        let steps = log.lock().unwrap().clone();
        assert!(
            !steps.iter().any(|s| s.contains("connect")),
            "a rank connected although the start was called off: {steps:?}"
        );
        assert!(started.elapsed() < PATIENCE, "the started ranks waited");
    } else {
        assert_eq!(outcome.unwrap().len(), 4);
    }
}

#[test]
fn a_refused_driver_thread_is_an_error_not_a_wait() {
    // The fault hook is read once per process: run the test above in a child with it armed.
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new(exe)
        .args([
            "--exact",
            "ranks::a_driver_thread_the_os_refuses_calls_the_start_off",
            "--nocapture",
        ])
        .env("BIRDTRAIN_FAULT", "thread:gpu-2")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1 passed"), "{text}");
}
