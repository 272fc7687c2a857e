//! The threads of a group of ranks start together or not at all.
//!
//! A rank thread that starts while a later one cannot (the OS refuses the thread) would wait
//! in its first collective for a rank that never exists, until the collective timeout. Each
//! thread of the group therefore arrives at a [`StartGate`] first and goes on only once every
//! thread has arrived; the starter calls the start off when a thread cannot be started, and
//! the threads already waiting return at once.

use std::sync::{Condvar, Mutex};

/// A barrier for `parties` threads that their starter can call off (see the module docs).
#[derive(Debug)]
pub struct StartGate {
    state: Mutex<Gate>,
    wake: Condvar,
    parties: usize,
}

#[derive(Debug, Default)]
struct Gate {
    arrived: usize,
    called_off: bool,
}

impl StartGate {
    /// A gate for `parties` threads.
    pub fn new(parties: usize) -> Self {
        Self {
            state: Mutex::default(),
            wake: Condvar::new(),
            parties,
        }
    }

    /// Waits until every party has arrived (`true`: go on) or the start is called off
    /// (`false`: return without touching the group).
    pub fn arrive(&self) -> bool {
        let mut gate = self.lock();
        gate.arrived += 1;
        if gate.arrived >= self.parties {
            self.wake.notify_all();
        }
        while gate.arrived < self.parties && !gate.called_off {
            gate = self.wake.wait(gate).unwrap_or_else(|p| p.into_inner());
        }
        !gate.called_off
    }

    /// Calls the start off: every thread waiting, or arriving later, is told not to go on.
    pub fn call_off(&self) {
        self.lock().called_off = true;
        self.wake.notify_all();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Gate> {
        // The two counters stay consistent whatever panicked while holding the lock.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn everyone_goes_on_once_all_arrived() {
        let gate = Arc::new(StartGate::new(3));
        let threads: Vec<_> = (0..3)
            .map(|_| {
                let gate = Arc::clone(&gate);
                std::thread::spawn(move || gate.arrive())
            })
            .collect();
        assert!(threads.into_iter().all(|t| t.join().unwrap()));
    }

    #[test]
    fn calling_off_releases_the_waiting_and_the_late() {
        let gate = Arc::new(StartGate::new(3));
        let waiting = {
            let gate = Arc::clone(&gate);
            std::thread::spawn(move || gate.arrive())
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        gate.call_off();
        assert!(!waiting.join().unwrap());
        assert!(!gate.arrive(), "a thread arriving after the call-off");
    }
}
