//! The collective watchdog, with a fake communicator: a stuck collective or an asynchronous
//! error aborts exactly once and names the rank; completed collectives never do.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use birdtrain::dist::watchdog::{Abortable, FaultKind, Watchdog, WatchdogError};

#[derive(Default)]
struct FakeComm {
    aborts: AtomicUsize,
    error: Mutex<Option<String>>,
}

impl Abortable for FakeComm {
    fn abort(&self) -> Result<(), String> {
        self.aborts.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn async_error(&self) -> Option<String> {
        self.error.lock().unwrap().clone()
    }
}

/// Generous bound for the watchdog thread to act (a hang guard, not a timing assertion).
const PATIENCE: Duration = Duration::from_secs(30);

#[test]
fn a_stuck_collective_aborts_the_communicator_and_names_the_rank() {
    let comm = Arc::new(FakeComm::default());
    let dog = Watchdog::start(
        3,
        Duration::from_millis(50),
        Duration::from_millis(5),
        comm.clone(),
    );
    dog.watch("all-reduce of bucket 7 in step 12", || Ok(false))
        .unwrap();
    let err = dog.wait_idle(PATIENCE).unwrap_err();
    let WatchdogError::Aborted(fault) = &err else {
        panic!("expected an abort, got {err}");
    };
    assert_eq!(fault.rank, 3);
    assert_eq!(fault.label, "all-reduce of bucket 7 in step 12");
    assert!(matches!(fault.kind, FaultKind::Timeout { .. }));
    let text = err.to_string();
    assert!(
        text.starts_with("rank 3:") && text.contains("bucket 7"),
        "{text}"
    );
    assert_eq!(comm.aborts.load(Ordering::SeqCst), 1);
    // Later use fails fast instead of queueing more work on a dead communicator.
    assert!(dog.watch("next", || Ok(true)).is_err());
    assert!(dog.check().is_err());
    drop(dog);
    assert_eq!(
        comm.aborts.load(Ordering::SeqCst),
        1,
        "aborted exactly once"
    );
}

#[test]
fn completed_collectives_never_abort() {
    let comm = Arc::new(FakeComm::default());
    let dog = Watchdog::start(
        0,
        Duration::from_secs(60),
        Duration::from_millis(2),
        comm.clone(),
    );
    let flags: Vec<Arc<AtomicBool>> = (0..5).map(|_| Arc::new(AtomicBool::new(false))).collect();
    for (i, f) in flags.iter().enumerate() {
        let f = f.clone();
        dog.watch(format!("bucket {i}"), move || Ok(f.load(Ordering::SeqCst)))
            .unwrap();
    }
    assert!(matches!(
        dog.wait_idle(Duration::from_millis(30)),
        Err(WatchdogError::StillPending { pending: 5, .. })
    ));
    flags.iter().for_each(|f| f.store(true, Ordering::SeqCst));
    dog.wait_idle(PATIENCE).unwrap();
    assert_eq!(dog.pending(), 0);
    assert!(dog.fault().is_none());
    assert_eq!(comm.aborts.load(Ordering::SeqCst), 0);
}

#[test]
fn an_asynchronous_error_aborts_even_without_a_timeout() {
    let comm = Arc::new(FakeComm::default());
    let dog = Watchdog::start(
        1,
        Duration::from_secs(3600),
        Duration::from_millis(2),
        comm.clone(),
    );
    dog.watch("broadcast of initial weights", || Ok(false))
        .unwrap();
    *comm.error.lock().unwrap() = Some("ncclRemoteError".into());
    let err = dog.wait_idle(PATIENCE).unwrap_err();
    assert!(err.to_string().contains("ncclRemoteError"), "{err}");
    assert!(
        err.to_string().contains("broadcast of initial weights"),
        "{err}"
    );
    assert_eq!(comm.aborts.load(Ordering::SeqCst), 1);
}

#[test]
fn a_failing_probe_aborts() {
    let comm = Arc::new(FakeComm::default());
    let dog = Watchdog::start(
        2,
        Duration::from_secs(3600),
        Duration::from_millis(2),
        comm.clone(),
    );
    dog.watch("all-reduce of bucket 0 in step 1", || {
        Err("CUDA_ERROR_LAUNCH_FAILED".into())
    })
    .unwrap();
    let err = dog.wait_idle(PATIENCE).unwrap_err();
    assert!(
        err.to_string().contains("CUDA_ERROR_LAUNCH_FAILED"),
        "{err}"
    );
    assert_eq!(comm.aborts.load(Ordering::SeqCst), 1);
}

#[test]
fn a_collective_with_a_timeout_of_its_own_outlives_the_watchdogs_and_times_out_at_its_own() {
    let comm = Arc::new(FakeComm::default());
    let dog = Watchdog::start(
        4,
        Duration::from_millis(50),
        Duration::from_millis(2),
        comm.clone(),
    );
    // The wait for the writer: far longer than the collective timeout.
    dog.watch_within("wait for rank 0", Duration::from_secs(3600), || Ok(false))
        .unwrap();
    assert!(matches!(
        dog.wait_idle(Duration::from_millis(400)),
        Err(WatchdogError::StillPending { pending: 1, .. })
    ));
    assert_eq!(comm.aborts.load(Ordering::SeqCst), 0);
    // Its own timeout, when it is the shorter one, is the one that fires.
    dog.watch_within("short wait", Duration::from_millis(20), || Ok(false))
        .unwrap();
    let err = dog.wait_idle(PATIENCE).unwrap_err();
    let WatchdogError::Aborted(fault) = &err else {
        panic!("expected an abort, got {err}");
    };
    assert_eq!(fault.label, "short wait");
    assert_eq!(
        fault.kind,
        FaultKind::Timeout {
            timeout: Duration::from_millis(20)
        }
    );
    assert_eq!(comm.aborts.load(Ordering::SeqCst), 1);
}
