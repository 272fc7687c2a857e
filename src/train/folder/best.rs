//! The best epoch: the figure that picks it (`--monitor`), the rule that compares two
//! (`--min-delta`) and the record of the best so far.

use serde::{Deserialize, Serialize};

use super::metrics::EpochMetrics;

/// The validation figure that picks the best epoch and drives `--early-stop` (`--monitor`,
/// named as Keras names it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Monitor {
    /// Top-1 accuracy, higher is better; a tie goes to the lower loss.
    #[default]
    #[serde(rename = "val_accuracy")]
    ValAccuracy,
    /// Loss, lower is better; a tie goes to the higher accuracy.
    #[serde(rename = "val_loss")]
    ValLoss,
    /// The moving average's top-1 accuracy (`--model-ema`), as timm picks its best epoch.
    #[serde(rename = "val_ema_accuracy")]
    ValEmaAccuracy,
    /// The moving average's loss (`--model-ema`).
    #[serde(rename = "val_ema_loss")]
    ValEmaLoss,
}

impl Monitor {
    /// The command-line spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::ValAccuracy => "val_accuracy",
            Self::ValLoss => "val_loss",
            Self::ValEmaAccuracy => "val_ema_accuracy",
            Self::ValEmaLoss => "val_ema_loss",
        }
    }

    /// Whether the figure is the moving average's (the `valid_ema` metrics line).
    pub fn follows_average(self) -> bool {
        matches!(self, Self::ValEmaAccuracy | Self::ValEmaLoss)
    }

    /// Whether the figure is a loss (lower is better).
    pub fn is_loss(self) -> bool {
        matches!(self, Self::ValLoss | Self::ValEmaLoss)
    }

    /// The figure in words, for messages.
    pub fn words(self) -> &'static str {
        match self {
            Self::ValAccuracy => "validation accuracy",
            Self::ValLoss => "validation loss",
            Self::ValEmaAccuracy => "the moving average's validation accuracy",
            Self::ValEmaLoss => "the moving average's validation loss",
        }
    }
}

impl std::str::FromStr for Monitor {
    type Err = ();

    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "val_accuracy" | "val_acc" => Ok(Self::ValAccuracy),
            "val_loss" => Ok(Self::ValLoss),
            "val_ema_accuracy" | "val_ema_acc" => Ok(Self::ValEmaAccuracy),
            "val_ema_loss" => Ok(Self::ValEmaLoss),
            _ => Err(()),
        }
    }
}

/// When a validation epoch beats the best so far (`--monitor`, `--min-delta`).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BestRule {
    /// The figure compared.
    pub monitor: Monitor,
    /// How much it must improve by to count (0: any improvement; an exact tie then goes to
    /// the other figure).
    pub min_delta: f64,
}

impl BestRule {
    /// Whether `accuracy` and `loss` beat `best`. NaN never does.
    pub fn improves(&self, best: &BestEpoch, accuracy: f64, loss: f64) -> bool {
        let tie_breaks = self.min_delta == 0.0;
        if self.monitor.is_loss() {
            loss < best.loss - self.min_delta
                || (tie_breaks && loss == best.loss && accuracy > best.accuracy)
        } else {
            accuracy > best.accuracy + self.min_delta
                || (tie_breaks && accuracy == best.accuracy && loss < best.loss)
        }
    }
}

/// The epoch with the best validation figures so far, by the run's [`BestRule`] (the
/// moving average's figures when it monitors them). Its checkpoint is kept in `RUN/best/`
/// ([`super::names::BEST_DIR`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BestEpoch {
    /// The epoch (1-based, as the metrics count).
    pub epoch: u64,
    /// Its validation top-1 accuracy.
    pub accuracy: f64,
    /// Its validation loss.
    pub loss: f64,
}

impl BestEpoch {
    /// The record of a validation line.
    pub fn of(valid: &EpochMetrics) -> Self {
        Self {
            epoch: valid.epoch,
            accuracy: valid.accuracy,
            loss: valid.loss,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_better_epoch_has_a_higher_accuracy_or_the_same_with_a_lower_loss() {
        let best = BestEpoch {
            epoch: 3,
            accuracy: 0.8,
            loss: 0.5,
        };
        let rule = BestRule::default();
        assert!(rule.improves(&best, 0.81, 2.0));
        assert!(rule.improves(&best, 0.8, 0.4));
        assert!(!rule.improves(&best, 0.8, 0.5));
        assert!(!rule.improves(&best, 0.79, 0.1));
        assert!(!rule.improves(&best, f64::NAN, 0.1));
    }

    #[test]
    fn monitored_loss_and_min_delta_decide_what_counts_as_better() {
        let best = BestEpoch {
            epoch: 3,
            accuracy: 0.8,
            loss: 0.5,
        };
        let loss = BestRule {
            monitor: Monitor::ValLoss,
            min_delta: 0.0,
        };
        assert!(loss.improves(&best, 0.1, 0.49));
        assert!(loss.improves(&best, 0.81, 0.5), "a tie goes to accuracy");
        assert!(!loss.improves(&best, 0.99, 0.51));
        assert!(!loss.improves(&best, 0.99, f64::NAN));
        let loss_by = BestRule {
            min_delta: 0.05,
            ..loss
        };
        assert!(!loss_by.improves(&best, 0.9, 0.46), "not by more than 0.05");
        assert!(loss_by.improves(&best, 0.1, 0.44));
        assert!(
            !loss_by.improves(&best, 0.9, 0.5),
            "no tie-break with a delta"
        );
        let acc_by = BestRule {
            monitor: Monitor::ValAccuracy,
            min_delta: 0.02,
        };
        assert!(!acc_by.improves(&best, 0.815, 0.1));
        assert!(acc_by.improves(&best, 0.83, 9.0));
        for (word, m) in [
            ("val_accuracy", Monitor::ValAccuracy),
            ("val_acc", Monitor::ValAccuracy),
            ("val_loss", Monitor::ValLoss),
            ("val_ema_accuracy", Monitor::ValEmaAccuracy),
            ("val_ema_acc", Monitor::ValEmaAccuracy),
            ("val_ema_loss", Monitor::ValEmaLoss),
        ] {
            assert_eq!(word.parse::<Monitor>(), Ok(m));
            let named = serde_json::to_string(&m).unwrap();
            assert_eq!(named, format!("\"{}\"", m.name()));
            assert_eq!(serde_json::from_str::<Monitor>(&named).unwrap(), m);
        }
        // The average's figures follow the same rules as the weights' own.
        let ema_loss = BestRule {
            monitor: Monitor::ValEmaLoss,
            min_delta: 0.0,
        };
        assert!(ema_loss.improves(&best, 0.1, 0.49) && !ema_loss.improves(&best, 0.99, 0.51));
        assert!(Monitor::ValEmaAccuracy.follows_average() && !Monitor::ValLoss.follows_average());
        assert!("loss".parse::<Monitor>().is_err());
    }
}
