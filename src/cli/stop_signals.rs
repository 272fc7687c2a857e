//! Ctrl-C and SIGTERM: the first one asks the command to finish its step and save, a
//! second one exits at once.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;

use super::CliError;
use crate::train::TrainError;

/// Set by Ctrl-C (SIGINT) or SIGTERM: the run finishes its step, saves and stops.
pub(crate) struct StopSignals {
    /// Polled by the training loop after every step.
    pub(crate) flag: Arc<AtomicBool>,
    /// The first signal received (0: none).
    received: Arc<AtomicI32>,
}

impl StopSignals {
    /// The signal that asked to stop, if any.
    pub(crate) fn signal(&self) -> Option<i32> {
        match self.received.load(Ordering::SeqCst) {
            0 => None,
            s => Some(s),
        }
    }
}

/// Installs the handlers of SIGINT and SIGTERM (what Slurm, Kubernetes and systemd send before
/// they kill): the first one sets the stop flag, a second one exits at once. `finishing` says
/// what the command does before it exits ("saving a checkpoint"). A thread the OS refuses
/// is an error (the run would not stop cleanly).
pub(crate) fn install_stop_signals(finishing: &'static str) -> Result<StopSignals, CliError> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let stop = StopSignals {
        flag: Arc::new(AtomicBool::new(false)),
        received: Arc::new(AtomicI32::new(0)),
    };
    let (flag, received) = (stop.flag.clone(), stop.received.clone());
    match signal_hook::iterator::Signals::new([SIGINT, SIGTERM]) {
        Ok(mut signals) => {
            let started = pipeline::threads::spawn("stop-signals", move || {
                for signal in signals.forever() {
                    let name = if signal == SIGTERM {
                        "SIGTERM"
                    } else {
                        "Ctrl-C"
                    };
                    if flag.swap(true, Ordering::SeqCst) {
                        // A second signal: the user does not want to wait (a previous checkpoint
                        // stays intact: checkpoints commit atomically).
                        eprintln!("\n{name} again: exiting now");
                        std::process::exit(128 + signal);
                    }
                    received.store(signal, Ordering::SeqCst);
                    eprintln!("\n{name}: finishing this step, {finishing}, then exiting ({name} again to quit now)");
                }
            });
            if let Err(e) = started {
                return Err(TrainError::from(e).into());
            }
        }
        Err(e) => tracing::warn!(
            "signal handlers not installed ({e}); Ctrl-C and SIGTERM will stop at once, without {finishing}"
        ),
    }
    Ok(stop)
}
