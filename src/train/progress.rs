//! Progress bars: one per epoch phase, with images/s, loss, accuracy, the share of time spent
//! waiting for data, and ETA. indicatif hides them when stderr is not a terminal.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A bar over the steps of one epoch's training or validation.
pub(crate) struct EpochBar {
    bar: ProgressBar,
    /// Redraws a shown bar between steps (its ETA, its elapsed time).
    _ticker: Option<Ticker>,
}

/// A thread that ticks a bar every 250 ms until dropped. indicatif's own steady tick starts
/// its thread with `std::thread::spawn`, which panics where the OS refuses a thread (and
/// starts one even for a hidden bar); this one starts only for a shown bar, and a refused
/// thread only means a bar redrawn at each step instead.
struct Ticker {
    stop: Option<flume::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Ticker {
    fn start(bar: &ProgressBar) -> Option<Self> {
        let bar = bar.clone();
        let (stop, stopped) = flume::bounded::<()>(0);
        let thread = pipeline::threads::spawn("progress-tick", move || {
            while let Err(flume::RecvTimeoutError::Timeout) =
                stopped.recv_timeout(Duration::from_millis(250))
            {
                bar.tick();
            }
        })
        .ok()?;
        Some(Self {
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl EpochBar {
    /// A bar for `steps` steps starting at `start` (a resumed epoch starts part-way).
    pub(crate) fn new(enabled: bool, label: String, steps: usize, start: usize) -> Self {
        let bar = if enabled {
            ProgressBar::with_draw_target(Some(steps as u64), ProgressDrawTarget::stderr())
        } else {
            ProgressBar::hidden()
        };
        bar.set_style(
            ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg} eta {eta}")
                .expect("the template is valid")
                .progress_chars("=> "),
        );
        bar.set_prefix(label);
        bar.set_position(start as u64);
        let ticker = if enabled { Ticker::start(&bar) } else { None };
        Self {
            bar,
            _ticker: ticker,
        }
    }

    /// Moves to `step` (1-based steps done) and shows the running figures.
    pub(crate) fn update(&self, step: usize, images_per_sec: f64, loss: f64, acc: f64, wait: f64) {
        self.bar.set_position(step as u64);
        self.bar.set_message(format!(
            "{images_per_sec:.0} img/s loss {loss:.3} acc {acc:.3} data-wait {:.0}%",
            wait * 100.0
        ));
    }

    /// Removes the bar (the caller prints the epoch line).
    pub(crate) fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
