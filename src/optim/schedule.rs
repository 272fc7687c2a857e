//! Learning-rate schedules.

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
            Decay::Constant => self.base_lr,
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
