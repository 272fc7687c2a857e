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
    /// without a better validation epoch ([`Plateau::cuts_after`]).
    Plateau(Plateau),
}

/// Keras' `ReduceLROnPlateau` (without cooldown or floor): the learning rate is multiplied
/// by `factor` whenever `patience` epochs in a row bring no better validation epoch (by the
/// run's `--monitor` and `--min-delta`); the count starts again after each cut.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Plateau {
    /// Epochs without improvement before a cut.
    pub patience: u32,
    /// The cut, in (0, 1).
    pub factor: f32,
}

impl Plateau {
    /// Keras' defaults: a cut to a tenth after 10 epochs without improvement.
    pub const DEFAULT: Plateau = Plateau {
        patience: 10,
        factor: 0.1,
    };

    /// Whether the rate is cut once `epochs_done` epochs have run and the best so far is
    /// epoch `best_epoch` (1-based): after `patience`, `2·patience`, … epochs without
    /// improvement, which is Keras' count that restarts at every cut.
    pub fn cuts_after(&self, epochs_done: u64, best_epoch: u64) -> bool {
        let since = epochs_done.saturating_sub(best_epoch);
        self.patience > 0 && since > 0 && since % u64::from(self.patience) == 0
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
        };
        let cuts: Vec<u64> = (1..=12).filter(|&done| p.cuts_after(done, 2)).collect();
        assert_eq!(
            cuts,
            [5, 8, 11],
            "best at epoch 2: cuts 3, 6, 9 epochs later"
        );
        assert!(!p.cuts_after(2, 2), "the best epoch itself");
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
}
