//! Fault injection for the crash-safety tests of checkpoint writing.
//!
//! `BIRDTRAIN_FAULT=checkpoint:<stage>[@<n>][:enospc|:delay=<seconds>]` makes the n-th
//! checkpoint written by this process (1 when `@n` is absent) fail at `<stage>`;
//! `best:<stage>…` does the same to the n-th copy of the best epoch written into `RUN/best/`
//! (each kind counted on its own; see [`super::checkpoint::write_checkpoint`] for the stages):
//! by default the process kills itself with SIGKILL there (what `kill -9`, the OOM killer or a
//! power cut leave behind); with `:enospc` the write returns "No space left on device" instead,
//! as a full disk would; with `:delay=<seconds>` the write waits that long there and goes on,
//! as a slow disk or network file system would (the other ranks then wait for the writer).
//! The variable is read once; without it every call is a no-op.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// The environment variable that arms a fault (shared with the thread-start hook of
/// [`pipeline::threads`], `thread:<name>[@<n>]`).
pub const FAULT_ENV: &str = pipeline::threads::FAULT_ENV;

/// Which checkpoint a fault and a count refer to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultTarget {
    /// The run's checkpoint (`RUN/checkpoint.json`).
    Checkpoint,
    /// The best epoch's copy (`RUN/best/`).
    Best,
}

impl FaultTarget {
    fn index(self) -> usize {
        match self {
            FaultTarget::Checkpoint => 0,
            FaultTarget::Best => 1,
        }
    }
}

/// What happens at the armed stage.
#[derive(Debug, Clone, PartialEq)]
enum Effect {
    /// SIGKILL.
    Kill,
    /// The write fails with ENOSPC.
    Enospc,
    /// The write waits, then goes on.
    Delay(Duration),
}

#[derive(Debug, Clone, PartialEq)]
struct Fault {
    target: FaultTarget,
    stage: String,
    nth: u64,
    effect: Effect,
}

fn parse(spec: &str) -> Option<Fault> {
    let (target, rest) = match spec.strip_prefix("checkpoint:") {
        Some(rest) => (FaultTarget::Checkpoint, rest),
        None => (FaultTarget::Best, spec.strip_prefix("best:")?),
    };
    let (rest, effect) = match rest.strip_suffix(":enospc") {
        Some(r) => (r, Effect::Enospc),
        None => match rest.split_once(":delay=") {
            Some((r, secs)) => {
                let secs: f64 = secs.parse().ok()?;
                (r, Effect::Delay(Duration::try_from_secs_f64(secs).ok()?))
            }
            None => (rest, Effect::Kill),
        },
    };
    let (stage, nth) = match rest.split_once('@') {
        Some((stage, n)) => (stage, n.parse().ok()?),
        None => (rest, 1),
    };
    Some(Fault {
        target,
        stage: stage.to_string(),
        nth,
        effect,
    })
}

fn armed() -> Option<&'static Fault> {
    static FAULT: OnceLock<Option<Fault>> = OnceLock::new();
    FAULT
        .get_or_init(|| std::env::var(FAULT_ENV).ok().and_then(|s| parse(&s)))
        .as_ref()
}

/// Checkpoints of each [`FaultTarget`] begun by this process (counts from 1).
static CHECKPOINTS: [AtomicU64; 2] = [AtomicU64::new(0), AtomicU64::new(0)];

/// Marks the start of a checkpoint write; returns its number among those of `target` in this
/// process.
pub(crate) fn begin_checkpoint(target: FaultTarget) -> u64 {
    CHECKPOINTS[target.index()].fetch_add(1, Ordering::SeqCst) + 1
}

/// Called at each stage of checkpoint number `nth` of `target`: fails there if the armed
/// fault says so.
pub(crate) fn at(target: FaultTarget, stage: &str, nth: u64) -> std::io::Result<()> {
    let Some(fault) = armed() else {
        return Ok(());
    };
    if fault.target != target || fault.stage != stage || fault.nth != nth {
        return Ok(());
    }
    match fault.effect {
        Effect::Kill => {}
        Effect::Enospc => return Err(std::io::Error::from_raw_os_error(libc::ENOSPC)),
        Effect::Delay(d) => {
            std::thread::sleep(d);
            return Ok(());
        }
    }
    // SAFETY: kill(2) on our own pid with a valid signal number; it does not return.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
    unreachable!("SIGKILL cannot be caught")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse() {
        assert_eq!(
            parse("checkpoint:sidecar"),
            Some(Fault {
                target: FaultTarget::Checkpoint,
                stage: "sidecar".into(),
                nth: 1,
                effect: Effect::Kill
            })
        );
        assert_eq!(
            parse("checkpoint:model@3:enospc"),
            Some(Fault {
                target: FaultTarget::Checkpoint,
                stage: "model".into(),
                nth: 3,
                effect: Effect::Enospc
            })
        );
        assert_eq!(
            parse("best:links@2"),
            Some(Fault {
                target: FaultTarget::Best,
                stage: "links".into(),
                nth: 2,
                effect: Effect::Kill
            })
        );
        assert_eq!(
            parse("checkpoint:sidecar@1:delay=2.5"),
            Some(Fault {
                target: FaultTarget::Checkpoint,
                stage: "sidecar".into(),
                nth: 1,
                effect: Effect::Delay(Duration::from_millis(2500))
            })
        );
        assert_eq!(parse("checkpoint:sidecar:delay=soon"), None);
        assert_eq!(parse("checkpoint:sidecar:delay=-1"), None);
        assert_eq!(parse("model@3"), None);
        assert_eq!(parse("checkpoint:model@x"), None);
    }
}
