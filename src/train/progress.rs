//! Progress bars: one per epoch phase, with images/s, loss, accuracy, the share of time spent
//! waiting for data, and ETA. indicatif hides them when stderr is not a terminal.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A bar over the steps of one epoch's training or validation.
pub(crate) struct EpochBar {
    bar: ProgressBar,
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
        bar.enable_steady_tick(Duration::from_millis(250));
        Self { bar }
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
