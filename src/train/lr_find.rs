//! The learning-rate range test (`birdtrain lr-find`): the run's own training steps with the
//! rate raised geometrically from `start` to `end` over `steps` steps, the loss of each step
//! recorded, stopped once it has clearly diverged, and the rate where the loss fell fastest
//! suggested (the rule of PyTorch Lightning's `lr_find`, after Smith's range test).
//!
//! - Rate of step `i`: `start · (end / start)^(i / (steps − 1))`, in `--lr`'s units (for a
//!   global batch of 256; the trainer scales it to the real batch as it scales `--lr`).
//! - Smoothed loss: an exponential average with β = 0.98, bias-corrected
//!   (`avg / (1 − β^(i+1))`), so the first steps are not pulled toward 0.
//! - Divergence: a non-finite loss, or a smoothed loss above 4× the lowest so far.
//! - Suggestion: leaving out the first 10 points and the last, the point where the smoothed
//!   loss has its steepest descent (`numpy.gradient`'s differences: central inside, one-sided
//!   at the ends).
//!
//! The sweep runs through the training loop itself (every device, rank count, augmentation
//! and optimizer of a run), with no validation and no checkpoint; the points go to
//! `RUN/lr_find.jsonl` and `RUN/lr_find.png`.

use serde::{Deserialize, Serialize};

use super::TrainError;

/// The swept range.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrRange {
    /// The first step's rate (`--start-lr`).
    pub start: f32,
    /// The last step's rate (`--end-lr`).
    pub end: f32,
    /// Steps in the sweep (`--num-steps`).
    pub steps: u64,
}

impl LrRange {
    /// The rate of step `step` (0-based), in `--lr`'s units.
    pub fn lr_at(&self, step: u64) -> f32 {
        let last = self.steps.saturating_sub(1).max(1) as f64;
        let r = (step.min(self.steps.saturating_sub(1)) as f64) / last;
        (f64::from(self.start) * (f64::from(self.end) / f64::from(self.start)).powf(r)) as f32
    }

    /// Checks the three values, naming the flag of a bad one.
    pub fn validate(&self) -> Result<(), TrainError> {
        let bad = |flag: &'static str, value: String, hint: &str| {
            Err(TrainError::InvalidConfig {
                flag,
                value,
                hint: hint.into(),
            })
        };
        if !(self.start > 0.0 && self.start.is_finite()) {
            return bad("--start-lr", self.start.to_string(), "a rate above 0");
        }
        if !(self.end > self.start && self.end.is_finite()) {
            return bad(
                "--end-lr",
                self.end.to_string(),
                &format!("a rate above --start-lr {}", self.start),
            );
        }
        if self.steps < 2 {
            return bad(
                "--num-steps",
                self.steps.to_string(),
                "at least 2 steps (100 is usual)",
            );
        }
        Ok(())
    }
}

/// One step of the sweep.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LrPoint {
    /// Global step (0-based).
    pub step: u64,
    /// Its rate, in `--lr`'s units.
    pub lr: f32,
    /// The step's mean training loss.
    pub loss: f64,
    /// The smoothed loss (see the module documentation).
    pub smoothed: f64,
}

/// Smoothing of the recorded losses.
const BETA: f64 = 0.98;
/// A smoothed loss this many times the lowest one ends the sweep.
const DIVERGED: f64 = 4.0;
/// Points left out at the start and at the end when suggesting.
const SKIP: (usize, usize) = (10, 1);

/// The sweep so far, on every rank (each sees the same step totals, so all stop together).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LrTrace {
    /// The recorded steps, in order.
    pub points: Vec<LrPoint>,
    average: f64,
    lowest: f64,
    /// Why the sweep ended early, when it did.
    pub diverged: Option<String>,
}

impl LrTrace {
    /// Records the loss of step `step` at rate `lr`; a diverged sweep records nothing more.
    pub fn add(&mut self, step: u64, lr: f32, loss: f64) {
        if self.diverged.is_some() {
            return;
        }
        if !loss.is_finite() {
            self.diverged = Some(format!("the loss was {loss} at lr {lr:.3e}"));
            return;
        }
        let n = self.points.len() as i32 + 1;
        self.average = BETA * self.average + (1.0 - BETA) * loss;
        let smoothed = self.average / (1.0 - BETA.powi(n));
        if self.points.is_empty() || smoothed < self.lowest {
            self.lowest = smoothed;
        }
        self.points.push(LrPoint {
            step,
            lr,
            loss,
            smoothed,
        });
        if n > 1 && smoothed > DIVERGED * self.lowest {
            self.diverged = Some(format!(
                "the smoothed loss {smoothed:.4} passed {DIVERGED}× its lowest, {:.4}, at lr {lr:.3e}",
                self.lowest
            ));
        }
    }

    /// Whether the sweep should stop.
    pub fn is_over(&self) -> bool {
        self.diverged.is_some()
    }

    /// The points the suggestion looks at: all but the first 10 and the last.
    fn kept(points: &[LrPoint]) -> &[LrPoint] {
        let end = points.len().saturating_sub(SKIP.1);
        points.get(SKIP.0..end).unwrap_or(&[])
    }

    /// Whether the smoothed loss of `kept` never falls by a thousandth of where it starts (a
    /// one-class dataset's loss is 0 at every rate): no rate is better than another.
    fn flat(kept: &[LrPoint]) -> bool {
        let Some(first) = kept.first() else {
            return false;
        };
        let lowest = kept
            .iter()
            .map(|p| p.smoothed)
            .fold(f64::INFINITY, f64::min);
        first.smoothed - lowest <= 1e-3 * first.smoothed.abs().max(1e-12)
    }

    /// Why [`LrTrace::suggestion`] gives none for `points`, in words, with what to change.
    pub fn no_suggestion(points: &[LrPoint]) -> String {
        let kept = Self::kept(points);
        if kept.len() < 2 {
            let n = points.len();
            return format!(
                "{n} point{} too few (the first 10 and the last are left out); lower --start-lr or --end-lr (the loss diverged early), or raise --num-steps",
                if n == 1 { " is" } else { "s are" }
            );
        }
        if kept.iter().all(|p| p.smoothed.abs() <= 1e-6) {
            return "the loss is 0 at every rate: with a single class every prediction is right, so no rate is better than another (add a class)".into();
        }
        format!(
            "the smoothed loss never falls over the rates swept (from {:.4} at lr {:.3e}), so no rate stands out; lower --start-lr, or check that the labels fit the images",
            kept[0].smoothed, kept[0].lr
        )
    }

    /// The point of steepest descent of the smoothed loss: none with fewer than 2 points
    /// once the first 10 and the last are left out, nor when the loss never falls
    /// ([`LrTrace::no_suggestion`] says why).
    pub fn suggestion(points: &[LrPoint]) -> Option<LrPoint> {
        let kept = Self::kept(points);
        if kept.len() < 2 || Self::flat(kept) {
            return None;
        }
        let y: Vec<f64> = kept.iter().map(|p| p.smoothed).collect();
        let last = y.len() - 1;
        let slope = |i: usize| match i {
            0 => y[1] - y[0],
            i if i == last => y[last] - y[last - 1],
            i => (y[i + 1] - y[i - 1]) / 2.0,
        };
        let steepest = (0..y.len()).min_by(|&a, &b| slope(a).total_cmp(&slope(b)))?;
        Some(kept[steepest])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_rises_geometrically_from_start_to_end() {
        let r = LrRange {
            start: 1e-4,
            end: 1.0,
            steps: 5,
        };
        let lrs: Vec<f32> = (0..5).map(|i| r.lr_at(i)).collect();
        for (got, want) in lrs.iter().zip([1e-4, 1e-3, 1e-2, 1e-1, 1.0]) {
            assert!((got / want - 1.0).abs() < 1e-5, "{lrs:?}");
        }
        assert_eq!(
            r.lr_at(9),
            r.lr_at(4),
            "past the sweep the rate stays at its end"
        );
    }

    #[test]
    fn smoothing_is_bias_corrected_and_divergence_ends_the_sweep() {
        let mut t = LrTrace::default();
        t.add(0, 1e-3, 2.0);
        assert!(
            (t.points[0].smoothed - 2.0).abs() < 1e-12,
            "the first point is its loss"
        );
        t.add(1, 2e-3, 1.0);
        // (0.98·0.02·2 + 0.02·1) / (1 − 0.98²)
        let want = (0.98 * 0.02 * 2.0 + 0.02 * 1.0) / (1.0 - 0.98f64.powi(2));
        assert!((t.points[1].smoothed - want).abs() < 1e-12);
        assert!(!t.is_over());
        let mut i = 2;
        while !t.is_over() {
            t.add(i, 1e-3 * i as f32, 1e3);
            i += 1;
            assert!(i < 100, "a loss of 1000 never counted as diverged");
        }
        let n = t.points.len();
        t.add(i, 1.0, 1.0);
        assert_eq!(t.points.len(), n, "nothing is recorded after divergence");
        let mut nan = LrTrace::default();
        nan.add(0, 1.0, f64::NAN);
        assert!(nan.is_over() && nan.points.is_empty());
        assert!(nan.diverged.unwrap().contains("NaN"));
    }

    #[test]
    fn the_suggestion_is_the_steepest_descent_after_the_first_ten_points() {
        let point = |i: usize, smoothed: f64| LrPoint {
            step: i as u64,
            lr: i as f32,
            loss: smoothed,
            smoothed,
        };
        // Flat, then a fall steepest between points 16 and 18, then a rise; a steeper drop
        // among the first ten points is left out, as is the last point.
        let mut y = vec![5.0, 1.0];
        y.extend(std::iter::repeat_n(1.0, 13));
        y.extend([0.9, 0.8, 0.4, 0.1, 0.05, 0.04, 0.5, -9.0]);
        let points: Vec<LrPoint> = y.iter().enumerate().map(|(i, &v)| point(i, v)).collect();
        assert_eq!(LrTrace::suggestion(&points).map(|p| p.step), Some(17));
        assert_eq!(LrTrace::suggestion(&points[..12]), None);
        assert!(LrTrace::no_suggestion(&points[..12]).starts_with("12 points are too few"));
        assert!(LrTrace::no_suggestion(&points[..1]).starts_with("1 point is too few"));
    }

    #[test]
    fn a_loss_that_never_falls_suggests_nothing_and_says_why() {
        let curve = |f: fn(usize) -> f64| -> Vec<LrPoint> {
            (0..30)
                .map(|i| LrPoint {
                    step: i as u64,
                    lr: 1e-4 * 1.3f32.powi(i as i32),
                    loss: f(i),
                    smoothed: f(i),
                })
                .collect()
        };
        // One class: the loss is 0 at every rate (before: a "suggestion" out of rounding).
        let zero = curve(|_| 0.0);
        assert_eq!(LrTrace::suggestion(&zero), None);
        assert!(LrTrace::no_suggestion(&zero).contains("single class"));
        // A loss that only rises.
        let rising = curve(|i| 1.0 + i as f64 * 0.1);
        assert_eq!(LrTrace::suggestion(&rising), None);
        assert!(LrTrace::no_suggestion(&rising).contains("never falls"));
    }

    #[test]
    fn bad_ranges_name_their_flag() {
        for (r, flag) in [
            ((0.0, 1.0, 10), "--start-lr"),
            ((1.0, 1.0, 10), "--end-lr"),
            ((1e-3, f32::INFINITY, 10), "--end-lr"),
            ((1e-3, 1.0, 1), "--num-steps"),
        ] {
            let range = LrRange {
                start: r.0,
                end: r.1,
                steps: r.2,
            };
            let e = range.validate().unwrap_err().to_string();
            assert!(e.contains(flag), "{e}");
        }
    }
}
