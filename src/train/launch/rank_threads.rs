//! The threads of a launch's ranks, joined: what each rank's thread ended with, as the rank's
//! report or error, and the launch's one error when some failed.

use std::thread::ScopedJoinHandle;

use pipeline::threads::ThreadStartError;

use crate::dist::ranks::panic_text;
use crate::train::report::{first_cause, RankReport};
use crate::train::TrainError;

/// A rank's thread as it was started: its handle, or why the OS refused it.
pub(crate) type RankThread<'scope> =
    Result<ScopedJoinHandle<'scope, Result<RankReport, TrainError>>, ThreadStartError>;

/// Joins the ranks' threads (`threads[r]` is rank r's) and returns their reports in rank
/// order, or the first cause among their errors ([`first_cause`]). A thread that panicked
/// fails its rank with the panic's message; one the OS refused is [`TrainError::Thread`] (its
/// name, `rank-N` or `gpu-O-rank-N`, says which rank). With several ranks the user learns
/// which one failed: each error names its rank and `device(rank)`.
pub(crate) fn join_ranks(
    threads: Vec<RankThread<'_>>,
    device: &dyn Fn(usize) -> String,
) -> Result<Vec<RankReport>, TrainError> {
    let world = threads.len();
    let mut reports = Vec::with_capacity(world);
    let mut errors = Vec::new();
    for (rank, thread) in threads.into_iter().enumerate() {
        let result = match thread {
            Ok(h) => h.join().unwrap_or_else(|panic| {
                Err(TrainError::Internal(format!(
                    "its thread panicked: {}",
                    panic_text(&*panic)
                )))
            }),
            Err(e) => Err(TrainError::Thread(e)),
        };
        match result {
            Ok(report) => reports.push(report),
            Err(e) if world == 1 => errors.push(e),
            Err(e) => errors.push(e.on_rank(rank, device(rank))),
        }
    }
    match first_cause(errors) {
        Some(e) => Err(e),
        None => Ok(reports),
    }
}
