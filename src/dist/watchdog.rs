//! A watchdog that turns a stuck collective into an error instead of an endless hang.
//!
//! Collectives are asynchronous: the host enqueues them and moves on, and a rank that stops
//! answering makes the others' collectives spin forever on the GPU. Every collective in flight
//! is registered with a completion probe (for NCCL: a query of the event recorded after it);
//! a background thread polls the probes and the communicator's asynchronous error, and when a
//! collective exceeds the timeout or an error appears it aborts the communicator (for NCCL:
//! `ncclCommAbort`, which makes the pending kernels return) and records a [`Fault`] naming the
//! rank and the collective. The owner checks [`Watchdog::check`] at step boundaries.
//!
//! The abortable target is a small trait, so the timing logic is tested on CPU with a fake.

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Something the watchdog can abort: a communicator.
pub trait Abortable: Send + Sync {
    /// Aborts every pending operation; later operations fail. May be called more than once
    /// (the watchdog, the rank's own failure and the process's abort group may each ask);
    /// calls after the first do nothing.
    fn abort(&self) -> Result<(), String>;
    /// An error raised asynchronously by pending operations, if any.
    fn async_error(&self) -> Option<String>;
}

/// Why the watchdog aborted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FaultKind {
    /// The collective did not complete within the timeout.
    Timeout {
        /// The timeout that was exceeded.
        timeout: Duration,
    },
    /// The communicator or a completion probe reported an error.
    Error {
        /// The error text.
        message: String,
    },
}

/// A recorded abort.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    /// The global rank whose watchdog fired.
    pub rank: usize,
    /// The collective that was pending ("all-reduce bucket 3 of step 120").
    pub label: String,
    /// Why.
    pub kind: FaultKind,
    /// Whether the abort itself succeeded (its error text otherwise).
    pub abort_result: Result<(), String>,
}

/// Errors surfaced to the owner of the communicator.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WatchdogError {
    /// The communicator was aborted.
    #[error("rank {}: {} — communicator aborted{}", .0.rank, describe(.0), abort_note(.0))]
    Aborted(Fault),
    /// The watchdog's thread could not start: no collective may run unwatched (it could
    /// hang forever), so each one is refused with the reason.
    #[error("rank {rank}: {reason}")]
    NotStarted {
        /// The rank.
        rank: usize,
        /// Why (the refused thread, the limit and a hint).
        reason: String,
    },
    /// `wait_idle` ran out of time without a fault (only possible with a limit shorter than
    /// the watchdog's own timeout).
    #[error("rank {rank}: {pending} collective(s) still pending after {waited:?}")]
    StillPending {
        /// The rank.
        rank: usize,
        /// Collectives pending.
        pending: usize,
        /// Time waited.
        waited: Duration,
    },
}

fn describe(f: &Fault) -> String {
    match &f.kind {
        FaultKind::Timeout { timeout } => format!(
            "{} did not complete within {timeout:?} (a rank stopped answering, or the network failed)",
            f.label
        ),
        FaultKind::Error { message } => format!("{} failed: {message}", f.label),
    }
}

fn abort_note(f: &Fault) -> String {
    match &f.abort_result {
        Ok(()) => String::new(),
        Err(e) => format!(" (abort reported: {e})"),
    }
}

type Probe = Box<dyn FnMut() -> Result<bool, String> + Send>;

struct Pending {
    label: String,
    since: Instant,
    /// How long it may take: the watchdog's timeout, or the call's own.
    timeout: Duration,
    done: Probe,
}

struct State {
    pending: Vec<Pending>,
    fault: Option<Fault>,
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    rank: usize,
    timeout: Duration,
    target: Arc<dyn Abortable>,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The state stays consistent across a panic in a probe (entries are removed or kept
        // whole), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The watchdog of one rank's communicator; stops its thread on drop.
pub struct Watchdog {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// Why the thread could not start, when it could not.
    not_started: Option<String>,
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchdog")
            .field("rank", &self.shared.rank)
            .field("timeout", &self.shared.timeout)
            .finish()
    }
}

impl Watchdog {
    /// Starts the watchdog thread for `rank`, aborting `target` when a collective runs longer
    /// than `timeout`; probes run every `poll`. When the OS refuses the thread, every
    /// [`Watchdog::watch`] and [`Watchdog::check`] fails with [`WatchdogError::NotStarted`].
    pub fn start(
        rank: usize,
        timeout: Duration,
        poll: Duration,
        target: Arc<dyn Abortable>,
    ) -> Self {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                pending: Vec::new(),
                fault: None,
                stop: false,
            }),
            wake: Condvar::new(),
            rank,
            timeout,
            target,
        });
        let worker = Arc::clone(&shared);
        let poll = poll.max(Duration::from_millis(1));
        // A thread the OS refuses makes every collective an error (see
        // `WatchdogError::NotStarted`), never a run whose collectives cannot time out.
        let (thread, not_started) = match pipeline::threads::spawn(
            format!("watchdog-{rank}"),
            move || run(&worker, poll),
        ) {
            Ok(thread) => (Some(thread), None),
            Err(e) => (None, Some(e.to_string())),
        };
        Watchdog {
            shared,
            thread,
            not_started,
        }
    }

    fn started(&self) -> Result<(), WatchdogError> {
        match &self.not_started {
            Some(reason) => Err(WatchdogError::NotStarted {
                rank: self.shared.rank,
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Registers a collective in flight; `done` returns Ok(true) once it has completed.
    ///
    /// Fails when the communicator was already aborted.
    pub fn watch(
        &self,
        label: impl Into<String>,
        done: impl FnMut() -> Result<bool, String> + Send + 'static,
    ) -> Result<(), WatchdogError> {
        self.watch_within(label, self.shared.timeout, done)
    }

    /// [`Watchdog::watch`] with a timeout of its own for this collective (a wait for work
    /// done outside the collectives, which may take longer than any collective should).
    /// Asynchronous errors still abort at once, whatever the timeout.
    pub fn watch_within(
        &self,
        label: impl Into<String>,
        timeout: Duration,
        done: impl FnMut() -> Result<bool, String> + Send + 'static,
    ) -> Result<(), WatchdogError> {
        self.started()?;
        let mut state = self.shared.lock();
        if let Some(f) = &state.fault {
            return Err(WatchdogError::Aborted(f.clone()));
        }
        state.pending.push(Pending {
            label: label.into(),
            since: Instant::now(),
            timeout,
            done: Box::new(done),
        });
        Ok(())
    }

    /// Ok unless the communicator was aborted.
    pub fn check(&self) -> Result<(), WatchdogError> {
        self.started()?;
        match &self.shared.lock().fault {
            Some(f) => Err(WatchdogError::Aborted(f.clone())),
            None => Ok(()),
        }
    }

    /// The fault, if the watchdog fired.
    pub fn fault(&self) -> Option<Fault> {
        self.shared.lock().fault.clone()
    }

    /// Collectives registered and not yet seen complete.
    pub fn pending(&self) -> usize {
        self.shared.lock().pending.len()
    }

    /// Blocks until nothing is pending or the watchdog fires, at most `limit`.
    pub fn wait_idle(&self, limit: Duration) -> Result<(), WatchdogError> {
        let start = Instant::now();
        let mut state = self.shared.lock();
        loop {
            if let Some(f) = &state.fault {
                return Err(WatchdogError::Aborted(f.clone()));
            }
            if state.pending.is_empty() {
                return Ok(());
            }
            let left = limit.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(WatchdogError::StillPending {
                    rank: self.shared.rank,
                    pending: state.pending.len(),
                    waited: start.elapsed(),
                });
            }
            state = self
                .shared
                .wake
                .wait_timeout(state, left.min(Duration::from_millis(50)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The watchdog thread: poll, detect, abort once.
fn run(shared: &Shared, poll: Duration) {
    loop {
        let mut state = shared.lock();
        if state.stop {
            return;
        }
        if state.fault.is_none() {
            let mut fault = shared.target.async_error().map(|message| {
                let label = state
                    .pending
                    .first()
                    .map_or("the communicator".to_string(), |p| p.label.clone());
                (label, FaultKind::Error { message })
            });
            let mut i = 0;
            while fault.is_none() && i < state.pending.len() {
                let p = &mut state.pending[i];
                match (p.done)() {
                    Ok(true) => {
                        state.pending.swap_remove(i);
                    }
                    Ok(false) if p.since.elapsed() > p.timeout => {
                        fault = Some((p.label.clone(), FaultKind::Timeout { timeout: p.timeout }));
                    }
                    Ok(false) => i += 1,
                    Err(message) => fault = Some((p.label.clone(), FaultKind::Error { message })),
                }
            }
            if let Some((label, kind)) = fault {
                drop(state);
                // Abort outside the lock: it may take a while, and owners keep checking.
                let abort_result = shared.target.abort();
                tracing::error!("rank {}: aborting communicator ({label})", shared.rank);
                state = shared.lock();
                state.fault = Some(Fault {
                    rank: shared.rank,
                    label,
                    kind,
                    abort_result,
                });
            }
            shared.wake.notify_all();
        }
        let _ = shared
            .wake
            .wait_timeout(state, poll)
            .unwrap_or_else(|p| p.into_inner());
    }
}
