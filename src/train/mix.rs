//! Mixup and CutMix of training batches (`--mixup`, `--cutmix`): timm's `Mixup` in its
//! default batch mode, one draw per micro-batch.
//!
//! With probability `prob` a micro-batch is mixed: by CutMix with probability `switch_prob`
//! when both are on (otherwise by whichever is on), else not at all. Mixup draws
//! λ ~ Beta(α, α) and blends every image with its partner; CutMix draws λ the same way
//! (with its own α) and pastes the partner's box of side `S·√(1−λ)` centred on a uniform
//! point and clipped to the image, so the labels' weights follow the box's real area (timm's
//! `rand_bbox` with `correct_lam`). The model's input op applies the [`Mix`] and the loss
//! mixes the targets ([`crate::backend::Targets`]).
//!
//! The draw comes from (seed, epoch, the micro-batch's sample ids), so a resumed run mixes
//! exactly as the uninterrupted one did and every backend sees the same batches.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Beta, Distribution};

use super::TrainError;
use crate::model::{Mix, PixelBox};

/// How training batches are mixed; off when both strengths are 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MixRecipe {
    /// Mixup's α (`--mixup`; 0: off).
    pub mixup: f32,
    /// CutMix's α (`--cutmix`; 0: off).
    pub cutmix: f32,
    /// The share of batches mixed (`--mixup-prob`).
    pub prob: f32,
    /// With both on, the share of mixed batches cut and pasted (`--mixup-switch-prob`).
    pub switch_prob: f32,
}

impl Default for MixRecipe {
    fn default() -> Self {
        Self::OFF
    }
}

impl MixRecipe {
    /// No mixing, with timm's defaults for the shares.
    pub const OFF: Self = Self {
        mixup: 0.0,
        cutmix: 0.0,
        prob: 1.0,
        switch_prob: 0.5,
    };

    /// Whether any batch is mixed.
    pub fn is_on(&self) -> bool {
        self.mixup > 0.0 || self.cutmix > 0.0
    }

    /// Checks the four values, naming the flag of a bad one.
    pub fn validate(&self) -> Result<(), TrainError> {
        let bad = |flag: &'static str, value: f32, hint: &str| TrainError::InvalidConfig {
            flag,
            value: value.to_string(),
            hint: hint.into(),
        };
        for (flag, alpha) in [("--mixup", self.mixup), ("--cutmix", self.cutmix)] {
            if !(0.0..=100.0).contains(&alpha) {
                return Err(bad(
                    flag,
                    alpha,
                    "the Beta distribution's α, from 0 (off) to 100; timm's recipes use 0.1 to 1",
                ));
            }
        }
        for (flag, p) in [
            ("--mixup-prob", self.prob),
            ("--mixup-switch-prob", self.switch_prob),
        ] {
            if !(0.0..=1.0).contains(&p) {
                return Err(bad(flag, p, "a probability, from 0 to 1"));
            }
        }
        Ok(())
    }

    /// The mixing of the micro-batch of `sample_ids` in `epoch`, if any.
    pub fn draw(&self, seed: u64, epoch: u64, sample_ids: &[u64], image_size: u32) -> Option<Mix> {
        if !self.is_on() || sample_ids.len() < 2 {
            return None;
        }
        let mut key = Vec::with_capacity(24 + 8 * sample_ids.len());
        key.extend_from_slice(b"mixbatch");
        key.extend_from_slice(&seed.to_le_bytes());
        key.extend_from_slice(&epoch.to_le_bytes());
        for id in sample_ids {
            key.extend_from_slice(&id.to_le_bytes());
        }
        let mut rng = ChaCha8Rng::seed_from_u64(xxhash_rust::xxh3::xxh3_64(&key));
        if !rng.random_bool(f64::from(self.prob)) {
            return None;
        }
        let cut = self.cutmix > 0.0
            && (self.mixup == 0.0 || rng.random_bool(f64::from(self.switch_prob)));
        let alpha = if cut { self.cutmix } else { self.mixup };
        // An α outside Beta's domain (a recipe that skipped `validate`) mixes nothing.
        let lambda = Beta::new(f64::from(alpha), f64::from(alpha))
            .ok()?
            .sample(&mut rng);
        if !cut {
            return Some(Mix::Blend {
                lambda: lambda as f32,
            });
        }
        let s = i64::from(image_size);
        let cut_side = (s as f64 * (1.0 - lambda).sqrt()) as i64;
        let (cy, cx) = (rng.random_range(0..s), rng.random_range(0..s));
        let span = |c: i64| {
            (
                (c - cut_side / 2).clamp(0, s) as u32,
                (c + cut_side / 2).clamp(0, s) as u32,
            )
        };
        let ((y0, y1), (x0, x1)) = (span(cy), span(cx));
        Some(Mix::Paste(PixelBox { y0, y1, x0, x1 }))
    }
}

/// The recorded mixing as the training uses it.
impl super::folder::RunSettings {
    /// Mixup and CutMix of training batches (`--mixup`, `--cutmix`, `--mixup-prob`,
    /// `--mixup-switch-prob`).
    pub fn mix(&self) -> MixRecipe {
        MixRecipe {
            mixup: self.mixup,
            cutmix: self.cutmix,
            prob: self.mixup_prob,
            switch_prob: self.mixup_switch_prob,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(first: u64) -> Vec<u64> {
        (first..first + 8).collect()
    }

    #[test]
    fn off_draws_nothing_and_a_single_image_is_not_mixed() {
        assert_eq!(MixRecipe::OFF.draw(1, 0, &ids(0), 32), None);
        let on = MixRecipe {
            mixup: 0.2,
            ..MixRecipe::OFF
        };
        assert_eq!(on.draw(1, 0, &[5], 32), None);
    }

    #[test]
    fn draws_repeat_for_the_same_batch_and_change_with_it() {
        let r = MixRecipe {
            mixup: 0.8,
            cutmix: 1.0,
            ..MixRecipe::OFF
        };
        assert_eq!(r.draw(7, 2, &ids(10), 32), r.draw(7, 2, &ids(10), 32));
        let differ = (0..20)
            .filter(|&b| r.draw(7, 2, &ids(10 * b), 32) != r.draw(7, 3, &ids(10 * b), 32))
            .count();
        assert!(
            differ >= 18,
            "only {differ} of 20 batches changed with the epoch"
        );
    }

    /// Mixup's λ follows Beta(α, α): mean 1/2, variance 1/(4(2α+1)); CutMix's boxes are
    /// inside the image, their area share 1−λ has mean 1/2 before clipping (less after),
    /// and with both on, half the mixed batches are cut.
    #[test]
    fn the_draws_follow_timms_distributions() {
        let blend = MixRecipe {
            mixup: 0.4,
            ..MixRecipe::OFF
        };
        let lambdas: Vec<f64> = (0..4000)
            .map(|b| match blend.draw(3, 0, &ids(8 * b), 32) {
                Some(Mix::Blend { lambda }) => f64::from(lambda),
                other => panic!("{other:?}"),
            })
            .collect();
        let mean = lambdas.iter().sum::<f64>() / lambdas.len() as f64;
        let var = lambdas.iter().map(|l| (l - mean).powi(2)).sum::<f64>() / lambdas.len() as f64;
        assert!((mean - 0.5).abs() < 0.02, "mean {mean}");
        let want = 1.0 / (4.0 * (2.0 * 0.4 + 1.0));
        assert!((var - want).abs() < 0.01, "variance {var} vs {want}");

        let both = MixRecipe {
            mixup: 0.8,
            cutmix: 1.0,
            prob: 0.5,
            ..MixRecipe::OFF
        };
        let (mut none, mut cut, mut area) = (0, 0, 0.0);
        for b in 0..4000 {
            match both.draw(3, 1, &ids(8 * b), 32) {
                None => none += 1,
                Some(Mix::Blend { lambda }) => assert!((0.0..=1.0).contains(&lambda)),
                Some(m @ Mix::Paste(PixelBox { y0, y1, x0, x1 })) => {
                    assert!(y0 <= y1 && y1 <= 32 && x0 <= x1 && x1 <= 32, "{m:?}");
                    cut += 1;
                    area += 1.0 - f64::from(m.own_weight(32));
                }
            }
        }
        assert!((1800..2200).contains(&none), "{none} of 4000 unmixed");
        assert!(
            (800..1200).contains(&cut),
            "{cut} of ~2000 mixed batches cut"
        );
        let mean_area = area / f64::from(cut);
        assert!(
            (0.25..0.5).contains(&mean_area),
            "mean pasted share {mean_area}"
        );
    }

    #[test]
    fn bad_values_name_their_flag() {
        for (recipe, flag) in [
            (
                MixRecipe {
                    mixup: -0.1,
                    ..MixRecipe::OFF
                },
                "--mixup",
            ),
            (
                MixRecipe {
                    cutmix: f32::NAN,
                    ..MixRecipe::OFF
                },
                "--cutmix",
            ),
            (
                MixRecipe {
                    prob: 1.5,
                    ..MixRecipe::OFF
                },
                "--mixup-prob",
            ),
            (
                MixRecipe {
                    switch_prob: -1.0,
                    ..MixRecipe::OFF
                },
                "--mixup-switch-prob",
            ),
        ] {
            match recipe.validate() {
                Err(TrainError::InvalidConfig { flag: f, .. }) => assert_eq!(f, flag),
                other => panic!("{recipe:?}: {other:?}"),
            }
        }
    }
}
