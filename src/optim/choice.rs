//! The optimizer family a run asks for (`--optimizer`), as a typed setting.

use serde::{Deserialize, Serialize};

use super::{OptimError, OptimizerKind};

/// The optimizer family (`--optimizer`); the checkpoint stores it by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerChoice {
    /// SGD with momentum (`--momentum`, `--nesterov`).
    Sgd,
    /// Adam (L2 weight decay added to the gradient, as torch.optim.Adam).
    Adam,
    /// AdamW (decoupled weight decay).
    #[serde(rename = "adamw")]
    AdamW,
}

impl OptimizerChoice {
    /// Every choice, in the order `--help` lists them.
    pub const ALL: [OptimizerChoice; 3] = [Self::Sgd, Self::Adam, Self::AdamW];

    /// The command-line spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sgd => "sgd",
            Self::Adam => "adam",
            Self::AdamW => "adamw",
        }
    }

    /// The update rule, with SGD's momentum settings.
    pub fn kind(self, momentum: f32, nesterov: bool) -> OptimizerKind {
        match self {
            Self::Sgd => OptimizerKind::Sgd { momentum, nesterov },
            Self::Adam => OptimizerKind::Adam,
            Self::AdamW => OptimizerKind::AdamW,
        }
    }
}

impl std::fmt::Display for OptimizerChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for OptimizerChoice {
    type Err = OptimError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim().to_ascii_lowercase();
        Self::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or(OptimError::UnknownKind(s))
    }
}
