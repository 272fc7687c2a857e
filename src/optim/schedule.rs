//! Learning-rate schedules.

use serde::{Deserialize, Serialize};

use super::OptimError;

/// The decay family (`--schedule`), as a typed setting; [`ScheduleChoice::decay`] adds the
/// step schedule's period and factor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleChoice {
    /// Half-cosine to 0.
    Cosine,
    /// Constant after warmup.
    Constant,
    /// Step decay (`--step-every`, `--step-gamma`).
    Step,
    /// Constant, cut by a factor whenever validation stops improving
    /// (`--plateau-patience`, `--plateau-factor`; Keras' `ReduceLROnPlateau`).
    Plateau,
}

impl ScheduleChoice {
    /// Every choice, in the order `--help` lists them.
    pub const ALL: [ScheduleChoice; 4] = [Self::Cosine, Self::Step, Self::Constant, Self::Plateau];

    /// The command-line spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::Cosine => "cosine",
            Self::Constant => "constant",
            Self::Step => "step",
            Self::Plateau => "plateau",
        }
    }

    /// The decay, with the step schedule's period (epochs) and factor, and the plateau
    /// schedule's settings.
    pub fn decay(self, every_epochs: u32, gamma: f32, plateau: Plateau) -> Decay {
        match self {
            Self::Cosine => Decay::Cosine,
            Self::Constant => Decay::Constant,
            Self::Step => Decay::Step {
                every_epochs,
                gamma,
            },
            Self::Plateau => Decay::Plateau(plateau),
        }
    }
}

impl std::fmt::Display for ScheduleChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ScheduleChoice {
    type Err = OptimError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim().to_ascii_lowercase();
        Self::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or(OptimError::UnknownSchedule(s))
    }
}

/// The decay after warmup.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Decay {
    /// Constant learning rate.
    Constant,
    /// Half-cosine from the base rate to 0 at the last step.
    Cosine,
    /// Multiply by `gamma` every `every_epochs` epochs (counted from the start, warmup
    /// included, as torch's StepLR).
    Step {
        /// Period in epochs.
        every_epochs: u32,
        /// Factor per period.
        gamma: f32,
    },
    /// Constant; the trainer multiplies the rate by `factor` after every `patience` epochs
    /// without a better validation epoch ([`Plateau::cut`]).
    Plateau(Plateau),
}

/// Keras' `ReduceLROnPlateau`: the learning rate is multiplied by `factor` whenever
/// `patience` epochs in a row bring no better validation epoch (by the run's `--monitor` and
/// `--min-delta`); the count starts again after each cut, the `cooldown` epochs after a cut
/// are not counted, and the rate never goes below `min_lr` (in `--lr`'s units: for a global
/// batch of 256).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Plateau {
    /// Epochs without improvement before a cut.
    pub patience: u32,
    /// The cut, in (0, 1).
    pub factor: f32,
    /// Epochs after a cut that are not counted.
    pub cooldown: u32,
    /// The lowest rate a cut goes to, in `--lr`'s units (0: none).
    pub min_lr: f32,
}

impl Plateau {
    /// Keras' defaults: a cut to a tenth after 10 epochs without improvement, no cooldown,
    /// no floor.
    pub const DEFAULT: Plateau = Plateau {
        patience: 10,
        factor: 0.1,
        cooldown: 0,
        min_lr: 0.0,
    };

    /// The epochs without improvement counted once `epochs_done` epochs have run: since the
    /// best epoch (1-based), or since the end of the cooldown of the last cut, whichever
    /// came later.
    pub fn epochs_counted(&self, epochs_done: u64, best_epoch: u64, last_cut: Option<u64>) -> u64 {
        let cooled = last_cut.map_or(0, |cut| cut + u64::from(self.cooldown));
        epochs_done.saturating_sub(best_epoch.max(cooled))
    }

    /// The rate scale after epoch `epochs_done` when a cut is due then: `scale × factor`,
    /// not below `min_lr / lr`; `None` when none is due (fewer than `patience`, `2·patience`,
    /// … epochs counted, or the rate is at its floor already). `last_cut` is the epoch of
    /// the last cut, when known: without it (a checkpoint from before the cooldown existed)
    /// the count runs from the best epoch, which is the same for a run without cooldown.
    pub fn cut(
        &self,
        epochs_done: u64,
        best_epoch: u64,
        last_cut: Option<u64>,
        scale: f32,
        lr: f32,
    ) -> Option<f32> {
        let counted = self.epochs_counted(epochs_done, best_epoch, last_cut);
        let due = self.patience > 0 && counted > 0 && counted % u64::from(self.patience) == 0;
        let floor = self.min_lr / lr;
        (due && scale > floor).then(|| (scale * self.factor).max(floor))
    }
}

/// Linear warmup from `base_lr / warmup_steps` to `base_lr` over `warmup_epochs`, then
/// [`Decay`] until `total_epochs`. Steps are optimizer steps (global batches).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Schedule {
    /// Peak learning rate (already scaled for the global batch, see [`scaled_lr`]).
    pub base_lr: f32,
    /// Optimizer steps per epoch (at least 1).
    pub steps_per_epoch: u64,
    /// Warmup length in epochs (0 = none).
    pub warmup_epochs: u32,
    /// Training length in epochs.
    pub total_epochs: u32,
    /// Decay after warmup.
    pub decay: Decay,
}

impl Decay {
    /// The family of this decay.
    pub fn choice(&self) -> ScheduleChoice {
        match self {
            Decay::Cosine => ScheduleChoice::Cosine,
            Decay::Constant => ScheduleChoice::Constant,
            Decay::Step { .. } => ScheduleChoice::Step,
            Decay::Plateau(_) => ScheduleChoice::Plateau,
        }
    }
}

impl Schedule {
    /// The learning rate for optimizer step `step` (0-based).
    pub fn lr_at(&self, step: u64) -> f32 {
        let spe = self.steps_per_epoch.max(1);
        let warm = u64::from(self.warmup_epochs) * spe;
        let total = (u64::from(self.total_epochs) * spe).max(1);
        if step < warm {
            return self.base_lr * (step + 1) as f32 / warm as f32;
        }
        match self.decay {
            Decay::Constant | Decay::Plateau(_) => self.base_lr,
            Decay::Cosine => {
                let span = total.saturating_sub(warm).max(1);
                let p = ((step - warm) as f64 / span as f64).min(1.0);
                (f64::from(self.base_lr) * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())) as f32
            }
            Decay::Step {
                every_epochs,
                gamma,
            } => {
                let period = u64::from(every_epochs.max(1)) * spe;
                self.base_lr * gamma.powi((step / period) as i32)
            }
        }
    }
}

/// Goyal et al.'s linear scaling rule: `lr` is given for a global batch of 256.
pub fn scaled_lr(lr: f32, global_batch: usize) -> f32 {
    lr * global_batch as f32 / 256.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plateau_cuts_every_patience_epochs_without_improvement() {
        let p = Plateau {
            patience: 3,
            factor: 0.5,
            ..Plateau::DEFAULT
        };
        // Best at epoch 2: cuts 3, 6, 9 epochs later, whether or not the last cut is known.
        let mut last = None;
        let mut scale = 1.0;
        let mut cuts = Vec::new();
        for done in 1..=12 {
            assert_eq!(
                p.cut(done, 2, None, scale, 0.1).is_some(),
                p.cut(done, 2, last, scale, 0.1).is_some(),
                "epoch {done}"
            );
            if let Some(s) = p.cut(done, 2, last, scale, 0.1) {
                cuts.push(done);
                (scale, last) = (s, Some(done));
            }
        }
        assert_eq!(cuts, [5, 8, 11]);
        assert_eq!(scale, 0.125);
        assert_eq!(p.cut(2, 2, None, 1.0, 0.1), None, "the best epoch itself");
        let schedule = Schedule {
            base_lr: 0.4,
            steps_per_epoch: 10,
            warmup_epochs: 1,
            total_epochs: 5,
            decay: Decay::Plateau(p),
        };
        assert_eq!(schedule.lr_at(4), 0.2, "warmup");
        assert_eq!(
            schedule.lr_at(10),
            0.4,
            "then constant: the trainer applies the cuts"
        );
        assert_eq!(schedule.lr_at(49), 0.4);
        assert_eq!(
            "plateau".parse::<ScheduleChoice>().unwrap(),
            ScheduleChoice::Plateau
        );
        assert_eq!(
            ScheduleChoice::Plateau.decay(30, 0.1, p).choice(),
            ScheduleChoice::Plateau
        );
    }

    #[test]
    fn a_plateau_cooldown_skips_epochs_and_a_floor_stops_the_cuts() {
        let p = Plateau {
            patience: 2,
            factor: 0.1,
            cooldown: 3,
            min_lr: 0.0004,
        };
        // lr 0.2, floor 0.0004: scales 1 → 0.1 → 0.01 → 0.002 (the floor), then no more.
        let (mut scale, mut last, mut cuts) = (1.0f32, None, Vec::new());
        for done in 1..=30 {
            if let Some(s) = p.cut(done, 1, last, scale, 0.2) {
                cuts.push((done, s));
                (scale, last) = (s, Some(done));
            }
        }
        // Best at epoch 1: the first cut after 2 epochs; then 3 cooled and 2 counted.
        let epochs: Vec<u64> = cuts.iter().map(|c| c.0).collect();
        assert_eq!(epochs, [3, 8, 13]);
        assert!(
            (cuts[1].1 - 0.01).abs() < 1e-7 && (cuts[2].1 - 0.002).abs() < 1e-7,
            "{cuts:?}"
        );
        // A better epoch inside the cooldown: counting starts when the cooldown ends.
        assert_eq!(p.epochs_counted(9, 5, Some(3)), 3);
        assert_eq!(p.epochs_counted(9, 7, Some(3)), 2);
        assert_eq!(p.epochs_counted(5, 4, Some(3)), 0);
    }
}
