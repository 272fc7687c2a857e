//! Crops of the stored `S×S` square, cut out and scaled back to `S×S` by the decode worker
//! before the batch is handed on: the random resized crop (torchvision's `RandomResizedCrop`,
//! the ImageNet training crop) and the centre crop (the evaluation crop, timm's `crop_pct`).
//!
//! The window is drawn as torchvision draws it: up to ten tries of an area share uniform in
//! `scale` and an aspect ratio log-uniform in `ratio`, rounded to whole pixels, kept when it
//! fits; otherwise the whole square (whose ratio, 1, is inside any valid `ratio`). Each
//! window comes from `(seed, epoch, sample id)` alone, not from a running generator, so it
//! does not depend on which worker, replica count or resume point produced the image.

use rand::{Rng, SeedableRng};

use crate::PipelineError;

/// The crop's area share and aspect-ratio ranges.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RandomResizedCrop {
    /// Least and greatest share of the square's area the window covers, in `(0, 1]`.
    pub scale: (f32, f32),
    /// Least and greatest width / height of the window, positive.
    pub ratio: (f32, f32),
}

/// A window of the stored square, in whole pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CropWindow {
    /// Left column.
    pub x: u32,
    /// Top row.
    pub y: u32,
    /// Columns.
    pub width: u32,
    /// Rows.
    pub height: u32,
}

impl CropWindow {
    /// The centred square covering `fraction` of the side (at least one pixel).
    pub fn centered(side: u32, fraction: f32) -> Self {
        let width = ((f64::from(side) * f64::from(fraction)).round() as u32).clamp(1, side);
        let x = center_offset(side, width);
        Self {
            x,
            y: x,
            width,
            height: width,
        }
    }

    /// The whole `side × side` square.
    pub fn full(side: u32) -> Self {
        Self {
            x: 0,
            y: 0,
            width: side,
            height: side,
        }
    }
}

/// Where torchvision's `CenterCrop` puts an `inner` span inside an `outer` one (`inner` ≤
/// `outer`): `int(round((outer - inner) / 2))`, Python's `round`, halves to even. So a span
/// 3 shorter starts at 2, where halving down would start it at 1.
pub(crate) fn center_offset(outer: u32, inner: u32) -> u32 {
    let d = outer.saturating_sub(inner);
    let half = d / 2;
    // d odd: the half is k + 0.5, which rounds to the even one of k and k + 1.
    if d % 2 == 1 && half % 2 == 1 {
        half + 1
    } else {
        half
    }
}

/// Tries torchvision makes before it falls back to the whole image.
const TRIES: usize = 10;

impl RandomResizedCrop {
    /// torchvision's defaults: 8 % to 100 % of the area, aspect ratio 3/4 to 4/3.
    pub const DEFAULT: Self = Self {
        scale: (0.08, 1.0),
        ratio: (3.0 / 4.0, 4.0 / 3.0),
    };

    /// The defaults with the least area share `min` (`--crop-scale`).
    pub fn with_min_scale(min: f32) -> Self {
        Self {
            scale: (min, 1.0),
            ..Self::DEFAULT
        }
    }

    /// Rejects ranges that cannot be drawn from.
    pub fn validate(&self) -> Result<(), PipelineError> {
        let (lo, hi) = self.scale;
        if !(lo > 0.0 && lo <= hi && hi <= 1.0) {
            return Err(PipelineError::InvalidSetting {
                name: "--crop-scale",
                value: format!("{lo},{hi}"),
                hint: "the crop's area share must satisfy 0 < min <= max <= 1 (torchvision: 0.08 to 1)",
            });
        }
        let (lo, hi) = self.ratio;
        if !(lo > 0.0 && lo <= hi && hi.is_finite()) {
            return Err(PipelineError::InvalidSetting {
                name: "crop ratio",
                value: format!("{lo},{hi}"),
                hint:
                    "the aspect-ratio range must satisfy 0 < min <= max (torchvision: 3/4 to 4/3)",
            });
        }
        Ok(())
    }

    /// The window of sample `sample_id` in `epoch` on a `side × side` square.
    pub fn window(&self, seed: u64, epoch: u64, sample_id: u64, side: u32) -> CropWindow {
        let mut rng = sample_rng(b"rrcrop\0\0", seed, epoch, sample_id);
        let area = f64::from(side) * f64::from(side);
        let (log_lo, log_hi) = (f64::from(self.ratio.0).ln(), f64::from(self.ratio.1).ln());
        for _ in 0..TRIES {
            let share = uniform(&mut rng, self.scale.0.into(), self.scale.1.into());
            let aspect = uniform(&mut rng, log_lo, log_hi).exp();
            let width = (area * share * aspect).sqrt().round();
            let height = (area * share / aspect).sqrt().round();
            if width >= 1.0
                && height >= 1.0
                && width <= f64::from(side)
                && height <= f64::from(side)
            {
                let (width, height) = (width as u32, height as u32);
                return CropWindow {
                    x: rng.random_range(0..=side - width),
                    y: rng.random_range(0..=side - height),
                    width,
                    height,
                };
            }
        }
        CropWindow::full(side)
    }
}

/// What the decode worker cuts out of each stored square.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Cut {
    /// A random resized crop, its windows drawn from this seed.
    Random(RandomResizedCrop, u64),
    /// The same centred window of every image.
    Center(CropWindow),
}

impl Cut {
    /// The window of sample `sample_id` in `epoch`.
    pub(crate) fn window(&self, epoch: u64, sample_id: u64, side: u32) -> CropWindow {
        match self {
            Cut::Random(crop, seed) => crop.window(*seed, epoch, sample_id, side),
            Cut::Center(window) => *window,
        }
    }
}

/// Checks a centre-crop share of the side (`--crop-pct`): in (0, 1].
pub fn check_crop_pct(fraction: f32) -> Result<(), PipelineError> {
    if fraction > 0.0 && fraction <= 1.0 {
        Ok(())
    } else {
        Err(PipelineError::InvalidSetting {
            name: "--crop-pct",
            value: fraction.to_string(),
            hint: "the centre crop's share of the side, in (0, 1] (timm's ImageNet default: 0.875)",
        })
    }
}

/// Uniform in `[lo, hi]` (`lo` itself when the range is empty).
fn uniform(rng: &mut impl Rng, lo: f64, hi: f64) -> f64 {
    lo + (hi - lo) * rng.random::<f64>()
}

/// The generator of one sample's draws in one epoch for the stream named `stream` (the crop's
/// and the colour jitter's are apart from each other and from the epoch order's): seeded from
/// `(stream, seed, epoch, sample id)` alone, so no worker, replica or resume point shares it.
pub(crate) fn sample_rng(
    stream: &[u8; 8],
    seed: u64,
    epoch: u64,
    sample_id: u64,
) -> rand_chacha::ChaCha8Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(stream);
    key[8..16].copy_from_slice(&seed.to_le_bytes());
    key[16..24].copy_from_slice(&epoch.to_le_bytes());
    key[24..].copy_from_slice(&sample_id.to_le_bytes());
    rand_chacha::ChaCha8Rng::seed_from_u64(xxhash_rust::xxh3::xxh3_64(&key))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_centre_offset_rounds_halves_to_even_as_python() {
        // Python: int(round(d / 2)) for d = 0..8 is 0 0 1 2 2 2 3 4 4.
        let offsets: Vec<u32> = (0..9).map(|d| center_offset(32 + d, 32)).collect();
        assert_eq!(offsets, [0, 0, 1, 2, 2, 2, 3, 4, 4]);
        assert_eq!(CropWindow::centered(35, 32.0 / 35.0).x, 2);
    }

    use super::*;

    #[test]
    fn windows_fit_and_follow_the_ranges() {
        let crop = RandomResizedCrop::DEFAULT;
        let side = 64u32;
        let (mut full, mut total_share) = (0, 0.0);
        for id in 0..2000 {
            let w = crop.window(7, 3, id, side);
            assert!(w.width >= 1 && w.height >= 1, "{w:?}");
            assert!(w.x + w.width <= side && w.y + w.height <= side, "{w:?}");
            if w == CropWindow::full(side) {
                full += 1;
                continue;
            }
            // Rounding to whole pixels moves the share and ratio by at most a pixel's worth.
            let share = f64::from(w.width * w.height) / f64::from(side * side);
            assert!((0.08 - 0.02..=1.0).contains(&share), "{w:?}: share {share}");
            let ratio = f64::from(w.width) / f64::from(w.height);
            let slack = 1.0 + 2.0 / f64::from(w.height.min(w.width));
            assert!(
                ratio >= 0.75 / slack && ratio <= 4.0 / 3.0 * slack,
                "{w:?}: ratio {ratio}"
            );
            total_share += share;
        }
        // Uniform area share in [0.08, 1] has mean 0.54; windows that did not fit (large share
        // with an extreme ratio) fall back to the whole square, so the drawn ones lean small.
        let mean = total_share / f64::from(2000 - full);
        assert!((0.40..0.56).contains(&mean), "mean share {mean}");
        assert!(full < 200, "{full} fallbacks of 2000");
    }

    #[test]
    fn a_window_depends_on_seed_epoch_and_sample_only() {
        let crop = RandomResizedCrop::with_min_scale(0.25);
        let a = crop.window(1, 2, 3, 96);
        assert_eq!(a, crop.window(1, 2, 3, 96));
        let others = [
            crop.window(2, 2, 3, 96),
            crop.window(1, 3, 3, 96),
            crop.window(1, 2, 4, 96),
        ];
        assert!(others.iter().all(|o| *o != a), "{a:?} vs {others:?}");
    }

    #[test]
    fn a_whole_area_share_with_ratio_one_is_the_whole_square() {
        let crop = RandomResizedCrop {
            scale: (1.0, 1.0),
            ratio: (1.0, 1.0),
        };
        for id in 0..50 {
            assert_eq!(crop.window(0, 0, id, 32), CropWindow::full(32));
        }
    }

    #[test]
    fn a_centred_window_is_centred_and_never_empty() {
        assert_eq!(
            CropWindow::centered(224, 0.875),
            CropWindow {
                x: 14,
                y: 14,
                width: 196,
                height: 196
            }
        );
        assert_eq!(CropWindow::centered(32, 1.0), CropWindow::full(32));
        assert_eq!(CropWindow::centered(8, 0.01).width, 1);
        for bad in [0.0, -0.5, 1.01, f32::NAN] {
            let e = check_crop_pct(bad).unwrap_err();
            assert!(e.to_string().contains("--crop-pct"), "{e}");
        }
    }

    #[test]
    fn bad_ranges_name_the_flag() {
        for scale in [(0.0, 1.0), (0.5, 0.4), (0.1, 1.5), (f32::NAN, 1.0)] {
            let e = RandomResizedCrop {
                scale,
                ..RandomResizedCrop::DEFAULT
            }
            .validate()
            .unwrap_err();
            assert!(e.to_string().contains("--crop-scale"), "{e}");
        }
        let e = RandomResizedCrop {
            ratio: (2.0, 1.0),
            ..RandomResizedCrop::DEFAULT
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("ratio"), "{e}");
        RandomResizedCrop::DEFAULT.validate().unwrap();
    }
}
