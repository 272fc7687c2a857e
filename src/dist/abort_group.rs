//! The process's abort fan-out: when one local rank fails, every communicator of the process
//! is aborted at once.
//!
//! Each local GPU rank has its own communicator and watchdog. A rank that fails (an error, a
//! panic, a failed `ncclCommInitRank`, a GPU out of memory) would otherwise abort only its own
//! communicator, and the other local ranks would spin in their pending collectives until their
//! own watchdogs fire, `--collective-timeout` later (600 s by default). The driver threads of
//! [`super::ranks`] share one [`AbortGroup`]: every rank's communicator joins it, and the first
//! failure aborts every member and is remembered, so the error that reaches the user is that
//! rank's, not a secondary "aborted" error of another rank.
//!
//! Members are [`Abortable`]s (for NCCL, the guarded communicator, whose abort never frees it
//! under a call in flight), so the fan-out is tested on the CPU with fakes.

use std::sync::{Arc, Mutex, MutexGuard};

use super::watchdog::Abortable;

/// The first failure of the group: which rank, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankFailure {
    /// The global rank that failed first.
    pub rank: usize,
    /// Its error, as text.
    pub reason: String,
}

#[derive(Default)]
struct State {
    members: Vec<(usize, Arc<dyn Abortable>)>,
    failure: Option<RankFailure>,
}

/// The communicators of one process's ranks, aborted together. Cheap to clone (shared).
#[derive(Clone, Default)]
pub struct AbortGroup {
    state: Arc<Mutex<State>>,
}

impl std::fmt::Debug for AbortGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.lock();
        f.debug_struct("AbortGroup")
            .field("members", &state.members.len())
            .field("failure", &state.failure)
            .finish()
    }
}

impl AbortGroup {
    /// An empty group.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Only a list and an option live here, never left half-updated.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds rank `rank`'s communicator. If the group has failed already it is aborted at once,
    /// so a rank that finishes joining after another failed does not wait either.
    pub fn join(&self, rank: usize, member: Arc<dyn Abortable>) {
        let mut state = self.lock();
        if state.failure.is_some() {
            drop(state);
            abort_member(rank, &*member);
            return;
        }
        state.members.push((rank, member));
    }

    /// Records that `rank` failed with `reason` and aborts every member. The first failure is
    /// kept (later ones are mostly the aborts this one caused); returns whether this was it.
    pub fn fail(&self, rank: usize, reason: &str) -> bool {
        let mut state = self.lock();
        if state.failure.is_some() {
            return false;
        }
        state.failure = Some(RankFailure {
            rank,
            reason: reason.to_string(),
        });
        let members = state.members.clone();
        // Abort outside the lock: an abort may take a while, and ranks keep asking.
        drop(state);
        tracing::error!(
            "rank {rank} failed; aborting every communicator of this process: {reason}"
        );
        for (member_rank, member) in &members {
            abort_member(*member_rank, &**member);
        }
        true
    }

    /// The first failure, if any rank failed.
    pub fn failure(&self) -> Option<RankFailure> {
        self.lock().failure.clone()
    }

    /// Whether a rank failed (a rank still setting up stops instead of joining).
    pub fn has_failed(&self) -> bool {
        self.lock().failure.is_some()
    }
}

fn abort_member(rank: usize, member: &dyn Abortable) {
    if let Err(e) = member.abort() {
        tracing::warn!("rank {rank}: aborting its communicator: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[derive(Default)]
    struct Counted(AtomicUsize);

    impl Abortable for Counted {
        fn abort(&self) -> Result<(), String> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        fn async_error(&self) -> Option<String> {
            None
        }
    }

    #[test]
    fn the_first_failure_aborts_every_member_once_and_is_the_one_kept() {
        let group = AbortGroup::new();
        let members: Vec<Arc<Counted>> = (0..4).map(|_| Arc::default()).collect();
        for (rank, m) in members.iter().enumerate().take(3) {
            group.join(rank, m.clone());
        }
        assert!(!group.has_failed());
        assert!(group.fail(2, "CUDA_ERROR_ILLEGAL_ADDRESS"));
        assert!(!group.fail(0, "stopped because the group was aborted"));
        assert_eq!(
            group.failure(),
            Some(RankFailure {
                rank: 2,
                reason: "CUDA_ERROR_ILLEGAL_ADDRESS".into()
            })
        );
        // A late member is aborted as it joins.
        group.join(3, members[3].clone());
        for m in &members {
            assert_eq!(m.0.load(Ordering::SeqCst), 1);
        }
    }
}
