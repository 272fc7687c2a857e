//! A communicator handle that can be aborted from another thread without ever freeing it under
//! a call that is using it.
//!
//! A rank's driver thread calls NCCL on its communicator while its watchdog (or the abort of
//! the whole process, [`super::abort_group::AbortGroup`]) may abort it from another thread, and
//! `ncclCommAbort` frees the communicator. Handing out the raw handle and aborting it from
//! elsewhere is a use-after-free: a crash instead of an error. [`CommGuard`] counts the calls
//! in flight: every use of the raw handle runs inside [`CommGuard::with`], and an abort marks
//! the communicator aborted at once (no new call starts: they fail with
//! [`CommGuardError::UseAfterAbort`]) but frees it only when no call is in flight; if one is,
//! the last call to leave performs the abort.
//!
//! Why deferred instead of waiting: the calls made inside the guard are NCCL's enqueue calls
//! (`ncclAllReduce`, `ncclBroadcast`) and `ncclCommGetAsyncError`. They return at once, except
//! that in NCCL's blocking mode an enqueue that sets up a connection lazily waits for the
//! peers to reach it; what unblocks that wait is the peers' abort (their sockets close) or
//! ours, and an abort that waited for the call would wait forever. Waits for a collective's
//! completion are on CUDA events, outside the guard, so an abort is never held up by them and
//! ends them (the aborted kernels return). A call that finds the communicator aborted after its
//! wait learns it from [`CommGuard::is_aborted`], so results of an aborted collective are never
//! taken for real ones.
//!
//! Generic over the raw handle ([`RawComm`]), so the locking is tested on the CPU with a fake
//! communicator that records any use after it was freed.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::watchdog::Abortable;

/// A raw communicator: what a [`CommGuard`] calls to end it. Each of `abort` and `destroy` is
/// called at most once, and only one of them, when no call is in flight.
pub trait RawComm: Clone + Send + Sync {
    /// Aborts pending operations and frees the communicator (`ncclCommAbort`).
    fn abort(&self) -> Result<(), String>;
    /// Frees the communicator after its pending operations (`ncclCommDestroy`).
    fn destroy(&self) -> Result<(), String>;
    /// An error raised asynchronously by pending operations (`ncclCommGetAsyncError`).
    fn async_error(&self) -> Option<String>;
}

/// Errors of [`CommGuard::with`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommGuardError {
    /// The communicator was aborted (or destroyed): no further call is possible.
    #[error("rank {rank}: the NCCL communicator was aborted; no further collectives are possible")]
    UseAfterAbort {
        /// The rank.
        rank: usize,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    Abort,
    Destroy,
}

#[derive(Debug)]
struct State<H> {
    /// The raw handle while it is live; taken by whoever ends it.
    handle: Option<H>,
    /// Calls inside [`CommGuard::with`] right now.
    in_flight: usize,
    /// Set once: how the communicator ends (no new call starts after this).
    ending: Option<Ending>,
}

/// A raw communicator shared by its owner's calls and an aborting thread. See the module docs.
pub struct CommGuard<H> {
    state: Mutex<State<H>>,
    idle: Condvar,
    rank: usize,
    /// Communicators made from this one (a side communicator for small sums): aborted with it,
    /// so whatever aborts this communicator (the watchdog, the abort group) reaches them too.
    dependents: Mutex<Vec<Arc<dyn Abortable>>>,
}

impl<H> std::fmt::Debug for CommGuard<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommGuard")
            .field("rank", &self.rank)
            .finish()
    }
}

impl<H: RawComm> CommGuard<H> {
    /// Guards `handle`, the communicator of `rank`.
    pub fn new(rank: usize, handle: H) -> Self {
        CommGuard {
            state: Mutex::new(State {
                handle: Some(handle),
                in_flight: 0,
                ending: None,
            }),
            idle: Condvar::new(),
            rank,
            dependents: Mutex::new(Vec::new()),
        }
    }

    /// Makes `dependent` end with this communicator: an abort of this one aborts it too (at
    /// once, if this one was aborted already).
    pub fn add_dependent(&self, dependent: Arc<dyn Abortable>) {
        if self.is_aborted() {
            let _ = dependent.abort();
            return;
        }
        self.dependents
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(dependent.clone());
        // An abort between the check and the push has already walked the list.
        if self.is_aborted() {
            let _ = dependent.abort();
        }
    }

    fn abort_dependents(&self) {
        let dependents = self
            .dependents
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for d in dependents {
            if let Err(e) = d.abort() {
                tracing::warn!("rank {}: aborting a dependent communicator: {e}", self.rank);
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<H>> {
        // Only counters and the handle live under the lock, never left half-updated by a
        // panic, so a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the live raw handle; the handle is not freed while `f` runs. Fails without
    /// calling `f` once the communicator was aborted or destroyed.
    pub fn with<R>(&self, f: impl FnOnce(&H) -> R) -> Result<R, CommGuardError> {
        let handle = {
            let mut state = self.lock();
            match (&state.handle, state.ending) {
                (Some(h), None) => {
                    let h = h.clone();
                    state.in_flight += 1;
                    h
                }
                _ => return Err(CommGuardError::UseAfterAbort { rank: self.rank }),
            }
        };
        // Decrements the count and performs a deferred ending even if `f` panics.
        struct Leave<'a, H: RawComm>(&'a CommGuard<H>);
        impl<H: RawComm> Drop for Leave<'_, H> {
            fn drop(&mut self) {
                self.0.leave();
            }
        }
        let _leave = Leave(self);
        Ok(f(&handle))
    }

    /// The end of a call: the last call out performs an ending that was asked for meanwhile.
    fn leave(&self) {
        let mut state = self.lock();
        state.in_flight -= 1;
        // Only an abort is left to the last call: a destroy waits for the calls itself.
        if state.in_flight == 0 && state.ending == Some(Ending::Abort) {
            if let Some(h) = state.handle.take() {
                drop(state);
                self.finish(Ending::Abort, &h);
                self.idle.notify_all();
                return;
            }
        }
        drop(state);
        self.idle.notify_all();
    }

    fn finish(&self, ending: Ending, h: &H) {
        let result = match ending {
            Ending::Abort => h.abort(),
            Ending::Destroy => h.destroy(),
        };
        if let Err(e) = result {
            tracing::warn!("rank {}: ending the communicator: {e}", self.rank);
        }
    }

    /// Aborts the communicator: no call starts after this returns; the raw abort runs now if
    /// no call is in flight, else when the last one leaves. Idempotent: a second abort, or an
    /// abort after the destroy, does nothing.
    pub fn abort(&self) -> AbortOutcome {
        let mut state = self.lock();
        if state.ending.is_some() {
            return AbortOutcome::AlreadyEnded;
        }
        state.ending = Some(Ending::Abort);
        drop(state);
        self.abort_dependents();
        let mut state = self.lock();
        if state.in_flight > 0 {
            return AbortOutcome::Deferred {
                in_flight: state.in_flight,
            };
        }
        let Some(h) = state.handle.take() else {
            return AbortOutcome::AlreadyEnded;
        };
        drop(state);
        let result = h.abort();
        self.idle.notify_all();
        AbortOutcome::Done(result)
    }

    /// Destroys the communicator (its owner's normal end): waits for calls in flight (only
    /// short ones can be: the owner is the one destroying), then frees it. Nothing to do if it
    /// was aborted.
    pub fn destroy(&self) {
        let mut state = self.lock();
        if state.ending.is_some() {
            return;
        }
        state.ending = Some(Ending::Destroy);
        while state.in_flight > 0 {
            state = self.idle.wait(state).unwrap_or_else(|p| p.into_inner());
        }
        // No abort was asked for before ours, so no call has ended the communicator.
        if let Some(h) = state.handle.take() {
            drop(state);
            self.finish(Ending::Destroy, &h);
        }
    }

    /// Whether the communicator was aborted (even if the raw abort is still deferred): what a
    /// collective's host wait checks before taking its result for real.
    pub fn is_aborted(&self) -> bool {
        self.lock().ending == Some(Ending::Abort)
    }

    /// The rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
}

/// What [`CommGuard::abort`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AbortOutcome {
    /// The raw abort ran, with this result.
    Done(Result<(), String>),
    /// Calls were in flight: the last of them runs the raw abort as it leaves.
    Deferred {
        /// Calls in flight when the abort was asked for.
        in_flight: usize,
    },
    /// The communicator had already been aborted or destroyed.
    AlreadyEnded,
}

impl<H: RawComm> Abortable for CommGuard<H> {
    fn abort(&self) -> Result<(), String> {
        match CommGuard::abort(self) {
            AbortOutcome::Done(result) => result,
            AbortOutcome::Deferred { in_flight } => {
                tracing::warn!(
                    "rank {}: {in_flight} NCCL call(s) in flight; the communicator is aborted \
                     as soon as they return",
                    self.rank
                );
                Ok(())
            }
            AbortOutcome::AlreadyEnded => Ok(()),
        }
    }

    fn async_error(&self) -> Option<String> {
        self.with(|h| h.async_error()).ok().flatten().or_else(|| {
            let dependents = self
                .dependents
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            dependents.iter().find_map(|d| d.async_error())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Barrier};

    /// A fake communicator that records every use after it was freed.
    #[derive(Default)]
    struct Fake {
        freed: AtomicBool,
        uses_after_free: AtomicUsize,
        aborts: AtomicUsize,
        destroys: AtomicUsize,
        uses: AtomicUsize,
    }

    #[derive(Clone)]
    struct FakeHandle(Arc<Fake>);

    impl FakeHandle {
        /// A call that touches the communicator at its start and its end, with room for
        /// another thread to run in between.
        fn call(&self) {
            self.touch();
            self.0.uses.fetch_add(1, Ordering::SeqCst);
        }

        /// Touches the communicator (as `call`, without counting a use).
        fn touch(&self) {
            let f = &self.0;
            if f.freed.load(Ordering::SeqCst) {
                f.uses_after_free.fetch_add(1, Ordering::SeqCst);
            }
            for _ in 0..20 {
                std::hint::spin_loop();
            }
            std::thread::yield_now();
            if f.freed.load(Ordering::SeqCst) {
                f.uses_after_free.fetch_add(1, Ordering::SeqCst);
            }
        }

        fn free(&self) {
            if self.0.freed.swap(true, Ordering::SeqCst) {
                // Freed twice: as bad as a use after free.
                self.0.uses_after_free.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    impl RawComm for FakeHandle {
        fn abort(&self) -> Result<(), String> {
            self.0.aborts.fetch_add(1, Ordering::SeqCst);
            self.free();
            Ok(())
        }
        fn destroy(&self) -> Result<(), String> {
            self.0.destroys.fetch_add(1, Ordering::SeqCst);
            self.free();
            Ok(())
        }
        fn async_error(&self) -> Option<String> {
            self.touch();
            None
        }
    }

    fn guarded() -> (Arc<Fake>, Arc<CommGuard<FakeHandle>>) {
        let fake = Arc::new(Fake::default());
        let guard = Arc::new(CommGuard::new(3, FakeHandle(fake.clone())));
        (fake, guard)
    }

    #[test]
    fn an_abort_racing_a_thousand_uses_never_frees_a_communicator_in_use() {
        for round in 0..20 {
            let (fake, guard) = guarded();
            let users = 4;
            let start = Arc::new(Barrier::new(users + 2));
            let outcomes: Vec<Vec<bool>> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..users)
                    .map(|_| {
                        let (guard, start) = (guard.clone(), start.clone());
                        s.spawn(move || {
                            start.wait();
                            // Uses until the abort stops them, and a few more after it.
                            let mut outcomes: Vec<bool> = Vec::new();
                            while outcomes.iter().filter(|ok| !**ok).count() < 3 {
                                outcomes.push(match guard.with(FakeHandle::call) {
                                    Ok(()) => true,
                                    Err(CommGuardError::UseAfterAbort { rank }) => {
                                        assert_eq!(rank, 3);
                                        false
                                    }
                                });
                            }
                            outcomes
                        })
                    })
                    .collect();
                // The watchdog's poll of the asynchronous error races too.
                let poller = {
                    let (guard, start) = (guard.clone(), start.clone());
                    s.spawn(move || {
                        start.wait();
                        while !guard.is_aborted() {
                            let _ = Abortable::async_error(&*guard);
                        }
                    })
                };
                start.wait();
                // Abort somewhere in the middle of the uses: after 50 to 1000 of them.
                while fake.uses.load(Ordering::SeqCst) < 50 * (round + 1) {
                    std::thread::yield_now();
                }
                Abortable::abort(&*guard).unwrap();
                poller.join().unwrap();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            assert_eq!(
                fake.uses_after_free.load(Ordering::SeqCst),
                0,
                "round {round}: a freed communicator was used"
            );
            assert_eq!(fake.aborts.load(Ordering::SeqCst), 1, "round {round}");
            assert!(fake.freed.load(Ordering::SeqCst), "round {round}");
            for per_thread in &outcomes {
                // Once a thread sees the abort, every later call fails too.
                let first_err = per_thread.iter().position(|ok| !ok);
                if let Some(i) = first_err {
                    assert!(per_thread[i..].iter().all(|ok| !ok), "round {round}");
                }
            }
            let succeeded = outcomes.iter().flatten().filter(|ok| **ok).count();
            assert!(succeeded >= 50 * (round + 1), "round {round}");
            assert_eq!(
                guard.with(|_| ()),
                Err(CommGuardError::UseAfterAbort { rank: 3 })
            );
            guard.destroy();
            assert_eq!(fake.destroys.load(Ordering::SeqCst), 0);
        }
    }

    #[test]
    fn an_abort_during_a_call_is_deferred_to_the_end_of_that_call() {
        let (fake, guard) = guarded();
        let (entered, release) = (Arc::new(Barrier::new(2)), Arc::new(Barrier::new(2)));
        let user = {
            let (guard, entered, release) = (guard.clone(), entered.clone(), release.clone());
            std::thread::spawn(move || {
                guard.with(|h| {
                    h.call();
                    entered.wait();
                    // Stuck inside the call until the abort has been asked for.
                    release.wait();
                    h.call();
                })
            })
        };
        entered.wait();
        assert_eq!(guard.abort(), AbortOutcome::Deferred { in_flight: 1 });
        assert!(guard.is_aborted());
        assert!(!fake.freed.load(Ordering::SeqCst), "freed under a call");
        assert!(guard.with(|_| ()).is_err(), "no call starts after an abort");
        release.wait();
        user.join().unwrap().unwrap();
        assert!(
            fake.freed.load(Ordering::SeqCst),
            "the leaving call aborted it"
        );
        assert_eq!(fake.aborts.load(Ordering::SeqCst), 1);
        assert_eq!(fake.uses_after_free.load(Ordering::SeqCst), 0);
        assert_eq!(guard.abort(), AbortOutcome::AlreadyEnded);
    }

    #[test]
    fn destroy_and_abort_end_the_communicator_exactly_once() {
        let (fake, guard) = guarded();
        guard.with(FakeHandle::call).unwrap();
        guard.destroy();
        assert_eq!(guard.abort(), AbortOutcome::AlreadyEnded);
        assert!(!guard.is_aborted());
        assert_eq!(fake.destroys.load(Ordering::SeqCst), 1);
        assert_eq!(fake.aborts.load(Ordering::SeqCst), 0);

        let (fake, guard) = guarded();
        assert_eq!(guard.abort(), AbortOutcome::Done(Ok(())));
        guard.destroy();
        assert_eq!(fake.aborts.load(Ordering::SeqCst), 1);
        assert_eq!(fake.destroys.load(Ordering::SeqCst), 0);
        assert!(Abortable::async_error(&*guard).is_none());
        assert_eq!(fake.uses_after_free.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn aborting_a_communicator_aborts_its_dependents_even_when_added_late() {
        let (parent_fake, parent) = guarded();
        let (side_fake, side) = guarded();
        parent.add_dependent(side.clone());
        assert!(Abortable::async_error(&*parent).is_none());
        Abortable::abort(&*parent).unwrap();
        assert_eq!(parent_fake.aborts.load(Ordering::SeqCst), 1);
        assert_eq!(side_fake.aborts.load(Ordering::SeqCst), 1);
        assert!(side.with(|_| ()).is_err());
        // A dependent made after the abort is aborted as it is added.
        let (late_fake, late) = guarded();
        parent.add_dependent(late);
        assert_eq!(late_fake.aborts.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_panicking_call_still_leaves_the_guard() {
        let (fake, guard) = guarded();
        let g = guard.clone();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            g.with(|_| panic!("inside a call")).unwrap();
        }));
        assert!(r.is_err());
        assert_eq!(guard.abort(), AbortOutcome::Done(Ok(())));
        assert_eq!(fake.aborts.load(Ordering::SeqCst), 1);
    }
}
