//! Colour jitter of training images: torchvision's `ColorJitter` without hue (timm's
//! `--color-jitter F` is `ColorJitter(F, F, F)`), applied by the decode worker to each image
//! after its crop, before the batch is handed on.
//!
//! Each of brightness, contrast and saturation gets a factor uniform in
//! `[max(0, 1 − s), 1 + s]` (`s` its strength), and the three are applied in a random order,
//! as torchvision draws them. Each adjustment blends the image with a reference and
//! truncates to `u8`, as torchvision's tensor functions do on `uint8` images:
//! - brightness: `f·p` (the reference is black);
//! - contrast: `f·p + (1 − f)·m`, `m` the mean of the image's grey levels;
//! - saturation: `f·p + (1 − f)·g`, `g` the pixel's own grey level;
//!
//! with grey = `0.2989 R + 0.587 G + 0.114 B`, truncated. The draw comes from
//! `(seed, epoch, sample id)` alone, like the crop's window, so workers, replicas, the resume
//! point and the cache do not change a pixel.

use rand::seq::SliceRandom;
use rand::Rng;

use crate::PipelineError;

/// The strengths of the three adjustments (0: that one is off).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ColorJitter {
    /// Brightness factor range `[max(0, 1 − b), 1 + b]`.
    pub brightness: f32,
    /// Contrast factor range `[max(0, 1 − c), 1 + c]`.
    pub contrast: f32,
    /// Saturation factor range `[max(0, 1 − s), 1 + s]`.
    pub saturation: f32,
}

/// One adjustment of [`ColorJitter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Adjust {
    /// Scale towards or away from black.
    Brightness,
    /// Scale towards or away from the image's mean grey.
    Contrast,
    /// Scale towards or away from each pixel's grey.
    Saturation,
}

/// The factors and order drawn for one image.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JitterDraw {
    /// The order the adjustments are applied in.
    pub order: [Adjust; 3],
    /// Brightness factor (1: unchanged).
    pub brightness: f32,
    /// Contrast factor (1: unchanged).
    pub contrast: f32,
    /// Saturation factor (1: unchanged).
    pub saturation: f32,
}

impl ColorJitter {
    /// The same strength for all three (timm's `--color-jitter F`).
    pub fn uniform(strength: f32) -> Self {
        Self {
            brightness: strength,
            contrast: strength,
            saturation: strength,
        }
    }

    /// Rejects strengths that cannot be drawn from (negative, NaN or infinite).
    pub fn validate(&self) -> Result<(), PipelineError> {
        for s in [self.brightness, self.contrast, self.saturation] {
            if !(s >= 0.0 && s.is_finite()) {
                return Err(PipelineError::InvalidSetting {
                    name: "--color-jitter",
                    value: s.to_string(),
                    hint: "a strength ≥ 0: each factor is drawn from [max(0, 1 − F), 1 + F] (ImageNet recipes use 0.4)",
                });
            }
        }
        Ok(())
    }

    /// The draw of sample `sample_id` in `epoch`.
    pub fn draw(&self, seed: u64, epoch: u64, sample_id: u64) -> JitterDraw {
        let mut rng = crate::crop::sample_rng(b"cjitter\0", seed, epoch, sample_id);
        let mut order = [Adjust::Brightness, Adjust::Contrast, Adjust::Saturation];
        order.shuffle(&mut rng);
        let mut factor = |strength: f32| {
            let (lo, hi) = ((1.0 - strength).max(0.0), 1.0 + strength);
            lo + (hi - lo) * rng.random::<f32>()
        };
        JitterDraw {
            order,
            brightness: factor(self.brightness),
            contrast: factor(self.contrast),
            saturation: factor(self.saturation),
        }
    }
}

impl JitterDraw {
    /// Applies the draw to `rgb` (packed RGB8 pixels) in place.
    pub fn apply(&self, rgb: &mut [u8]) {
        for adjust in self.order {
            match adjust {
                Adjust::Brightness => brightness(rgb, self.brightness),
                Adjust::Contrast => contrast(rgb, self.contrast),
                Adjust::Saturation => saturation(rgb, self.saturation),
            }
        }
    }
}

/// The grey weights' products with every byte value, so a pixel's grey level is three
/// lookups and two additions (the same `f32` sum as computing the products in place).
struct GreyTables([[f32; 256]; 3]);

static GREY: std::sync::LazyLock<GreyTables> = std::sync::LazyLock::new(|| {
    let table = |w: f32| std::array::from_fn(|v| w * v as f32);
    GreyTables([table(0.2989), table(0.587), table(0.114)])
});

/// The grey level of one pixel, truncated as torchvision's `rgb_to_grayscale` of a `uint8`
/// image (the sum is never negative, so the cast truncates; `f32::trunc` can be a library
/// call on the baseline x86-64 target).
#[inline]
fn grey(t: &GreyTables, p: &[u8]) -> u32 {
    (t.0[0][usize::from(p[0])] + t.0[1][usize::from(p[1])] + t.0[2][usize::from(p[2])]) as u32
}

/// `f·v + offset`, clamped to the byte range and truncated.
#[inline]
fn blend(v: u8, f: f32, offset: f32) -> u8 {
    (f * f32::from(v) + offset).clamp(0.0, 255.0) as u8
}

/// Maps every byte through `blend(·, f, offset)`: one table of 256 entries per image.
fn map_bytes(rgb: &mut [u8], f: f32, offset: f32) {
    let table: [u8; 256] = std::array::from_fn(|v| blend(v as u8, f, offset));
    rgb.iter_mut().for_each(|v| *v = table[usize::from(*v)]);
}

fn brightness(rgb: &mut [u8], f: f32) {
    if f != 1.0 {
        map_bytes(rgb, f, 0.0);
    }
}

fn contrast(rgb: &mut [u8], f: f32) {
    if f == 1.0 || rgb.is_empty() {
        return;
    }
    let t = &*GREY;
    let pixels = rgb.len() / 3;
    // Whole grey levels: the integer sum is exact.
    let sum: u64 = rgb.chunks_exact(3).map(|p| u64::from(grey(t, p))).sum();
    map_bytes(rgb, f, (1.0 - f) * (sum as f64 / pixels as f64) as f32);
}

fn saturation(rgb: &mut [u8], f: f32) {
    if f == 1.0 {
        return;
    }
    // Every pixel's grey level is a whole number in 0..=255: its offset is a table too.
    let t = &*GREY;
    let offsets: [f32; 256] = std::array::from_fn(|g| (1.0 - f) * g as f32);
    // Blocks of pixels: the offsets are spread over the block's bytes first, so the blend
    // runs over contiguous bytes, which the compiler vectorises (stride-3 loops it does not).
    const PIXELS: usize = 16;
    let mut blocks = rgb.chunks_exact_mut(3 * PIXELS);
    for block in &mut blocks {
        let mut spread = [0f32; 3 * PIXELS];
        for (p, o) in block.chunks_exact(3).zip(spread.chunks_exact_mut(3)) {
            o.fill(offsets[grey(t, p) as usize]);
        }
        for (v, o) in block.iter_mut().zip(spread) {
            *v = blend(*v, f, o);
        }
    }
    for p in blocks.into_remainder().chunks_exact_mut(3) {
        let offset = offsets[grey(t, p) as usize];
        p.iter_mut().for_each(|v| *v = blend(*v, f, offset));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn each_adjustment_blends_with_its_reference() {
        let px = [200u8, 100, 50, 10, 20, 30];
        // Brightness ½, applied once: halves and truncates.
        let mut b = px;
        brightness(&mut b, 0.5);
        assert_eq!(b, [100, 50, 25, 5, 10, 15]);
        // Brightness 2 saturates at 255.
        let mut b = px;
        brightness(&mut b, 2.0);
        assert_eq!(b, [255, 200, 100, 20, 40, 60]);
        // Contrast 0: every channel becomes the mean grey (truncated greys 124 and 18).
        let mut c = px;
        contrast(&mut c, 0.0);
        assert_eq!(c, [71; 6]);
        // Saturation 0: each pixel becomes its own grey.
        let mut s = px;
        saturation(&mut s, 0.0);
        assert_eq!(s, [124, 124, 124, 18, 18, 18]);
        // Saturation 2 pushes channels away from the grey: 2·200 − 124 = 276 → 255.
        let mut s = px;
        saturation(&mut s, 2.0);
        assert_eq!(s, [255, 76, 0, 2, 22, 42]);
        // A factor of 1 changes nothing, whatever the order.
        let mut same = px;
        let identity = JitterDraw {
            order: [Adjust::Contrast, Adjust::Saturation, Adjust::Brightness],
            brightness: 1.0,
            contrast: 1.0,
            saturation: 1.0,
        };
        identity.apply(&mut same);
        assert_eq!(same, px);
    }

    /// The definitions, pixel by pixel in plain `f32`, as the module's header states them.
    fn reference(rgb: &mut [u8], adjust: Adjust, f: f32) {
        let grey = |p: &[u8]| {
            (0.2989 * f32::from(p[0]) + 0.587 * f32::from(p[1]) + 0.114 * f32::from(p[2])).trunc()
        };
        let blend = |v: u8, offset: f32| (f * f32::from(v) + offset).clamp(0.0, 255.0) as u8;
        match adjust {
            Adjust::Brightness => rgb.iter_mut().for_each(|v| *v = blend(*v, 0.0)),
            Adjust::Contrast => {
                let mean = rgb.chunks_exact(3).map(|p| f64::from(grey(p))).sum::<f64>()
                    / (rgb.len() / 3) as f64;
                let offset = (1.0 - f) * mean as f32;
                rgb.iter_mut().for_each(|v| *v = blend(*v, offset));
            }
            Adjust::Saturation => {
                for p in rgb.chunks_exact_mut(3) {
                    let offset = (1.0 - f) * grey(p);
                    p.iter_mut().for_each(|v| *v = blend(*v, offset));
                }
            }
        }
    }

    #[test]
    fn the_tabled_and_blocked_adjustments_equal_the_definitions() {
        // 185 pixels: eleven blocks of 16 and a remainder of 9.
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let image: Vec<u8> = (0..185 * 3).map(|_| rng.random()).collect();
        for f in [0.0, 0.37, 0.6, 0.999, 1.0, 1.23, 1.4, 2.5] {
            for adjust in [Adjust::Brightness, Adjust::Contrast, Adjust::Saturation] {
                let (mut fast, mut want) = (image.clone(), image.clone());
                match adjust {
                    Adjust::Brightness => brightness(&mut fast, f),
                    Adjust::Contrast => contrast(&mut fast, f),
                    Adjust::Saturation => saturation(&mut fast, f),
                }
                reference(&mut want, adjust, f);
                assert_eq!(fast, want, "{adjust:?} {f}");
            }
        }
    }

    #[test]
    fn the_order_matters_and_is_applied_as_drawn() {
        let px = [250u8, 10, 10, 10, 10, 250];
        let draw = |order| JitterDraw {
            order,
            brightness: 1.5,
            contrast: 1.0,
            saturation: 0.0,
        };
        let mut a = px;
        draw([Adjust::Brightness, Adjust::Saturation, Adjust::Contrast]).apply(&mut a);
        let mut b = px;
        draw([Adjust::Saturation, Adjust::Brightness, Adjust::Contrast]).apply(&mut b);
        // Brightening first clips red at 255 before the grey is taken.
        let mut want_a = px;
        brightness(&mut want_a, 1.5);
        saturation(&mut want_a, 0.0);
        let mut want_b = px;
        saturation(&mut want_b, 0.0);
        brightness(&mut want_b, 1.5);
        assert_eq!((a, b), (want_a, want_b));
        assert_ne!(a, b);
    }

    #[test]
    fn draws_follow_the_ranges_and_depend_on_seed_epoch_and_sample() {
        let jitter = ColorJitter::uniform(0.4);
        let mut orders = std::collections::HashSet::new();
        let (mut lo, mut hi) = (f32::MAX, f32::MIN);
        for id in 0..600 {
            let d = jitter.draw(3, 1, id);
            for f in [d.brightness, d.contrast, d.saturation] {
                assert!((0.6..=1.4).contains(&f), "{d:?}");
                lo = lo.min(f);
                hi = hi.max(f);
            }
            let mut sorted = d.order;
            sorted.sort_by_key(|a| *a as u8);
            assert_eq!(
                sorted,
                [Adjust::Brightness, Adjust::Contrast, Adjust::Saturation]
            );
            orders.insert(d.order);
            assert_eq!(d, jitter.draw(3, 1, id), "the same key draws the same");
        }
        assert_eq!(orders.len(), 6, "every order of the three appears");
        assert!(lo < 0.65 && hi > 1.35, "the range is covered: {lo}..{hi}");
        let d = jitter.draw(3, 1, 7);
        assert_ne!(d, jitter.draw(4, 1, 7));
        assert_ne!(d, jitter.draw(3, 2, 7));
        assert_ne!(d, jitter.draw(3, 1, 8));
        // Strengths beyond 1 reach down to 0 (max(0, 1 − s)), as torchvision's.
        let strong = ColorJitter::uniform(2.0);
        assert!((0..200).all(|id| strong.draw(0, 0, id).contrast >= 0.0));
    }

    #[test]
    fn impossible_strengths_name_the_flag() {
        for s in [-0.1, f32::NAN, f32::INFINITY] {
            let err = ColorJitter::uniform(s).validate().unwrap_err();
            assert!(err.to_string().contains("--color-jitter"), "{err}");
        }
        ColorJitter::uniform(0.0).validate().unwrap();
        ColorJitter::uniform(3.0).validate().unwrap();
    }
}
