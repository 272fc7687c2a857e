//! Standard output that a closed reader cannot crash.
//!
//! `println!` panics when stdout is a pipe whose reader has gone (`birdtrain … | head -1`):
//! Rust ignores SIGPIPE, so the write fails with `EPIPE`. Every command prints through
//! `out!` and `outln!` (defined in `cli/mod.rs`) instead, which end in [`write`]:
//!
//! - a command whose output is its result (`predict`, `eval`, `env`, `bench`, `synth`,
//!   `kernels`) stops and exits quietly with code 0 once nobody reads it, as Unix tools do;
//! - a command that works for a long time and records its progress in files too (`train`,
//!   `lr-find`, `demo`: see [`keep_running_when_closed`]) drops the rest of its output
//!   silently and goes on.
//!
//! Any other write error (a full disk behind a redirection) ends an output command with one
//! `error:` line and exit code 1; a training run drops its output as for a closed pipe.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

/// Set by [`keep_running_when_closed`].
static KEEP_RUNNING: AtomicBool = AtomicBool::new(false);
/// Set once stdout failed and further output is dropped.
static CLOSED: AtomicBool = AtomicBool::new(false);

/// A closed stdout no longer stops this process: further output is dropped silently (for
/// the commands that train, whose progress is in the run folder as well).
pub(crate) fn keep_running_when_closed() {
    KEEP_RUNNING.store(true, Ordering::SeqCst);
}

/// What to do about a failed write to stdout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    /// Drop this and every later write, and go on.
    Drop,
    /// Exit now with this code (after an `error:` line when it is not 0).
    Exit(u8),
}

/// The action for a write error of `kind`.
fn action(kind: std::io::ErrorKind, keep_running: bool) -> Action {
    match (keep_running, kind) {
        (true, _) => Action::Drop,
        (false, std::io::ErrorKind::BrokenPipe) => Action::Exit(0),
        (false, _) => Action::Exit(1),
    }
}

/// Writes `args` to stdout; see the module documentation for a closed or failing stdout.
pub(crate) fn write(args: std::fmt::Arguments<'_>) {
    if CLOSED.load(Ordering::Relaxed) {
        return;
    }
    let mut stdout = std::io::stdout().lock();
    let Err(e) = stdout.write_fmt(args) else {
        return;
    };
    CLOSED.store(true, Ordering::SeqCst);
    match action(e.kind(), KEEP_RUNNING.load(Ordering::SeqCst)) {
        Action::Drop => {}
        Action::Exit(code) => {
            drop(stdout);
            if code != 0 {
                let _ = writeln!(std::io::stderr(), "error: writing to standard output: {e}");
            }
            std::process::exit(i32::from(code));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::ErrorKind;

    #[test]
    fn a_closed_pipe_exits_quietly_or_is_dropped_while_training() {
        assert_eq!(action(ErrorKind::BrokenPipe, false), Action::Exit(0));
        assert_eq!(action(ErrorKind::StorageFull, false), Action::Exit(1));
        assert_eq!(action(ErrorKind::BrokenPipe, true), Action::Drop);
        assert_eq!(action(ErrorKind::StorageFull, true), Action::Drop);
    }
}
