//! Colour jitter of training images: torchvision's `ColorJitter` (timm's `--color-jitter F`
//! is `ColorJitter(F, F, F)`, without hue), applied by the decode worker to each image after
//! its crop, before the batch is handed on.
//!
//! Each of brightness, contrast and saturation gets a factor uniform in
//! `[max(0, 1 − s), 1 + s]` (`s` its strength), the hue a shift uniform in `[−h, h]` turns
//! of the colour wheel, and they are applied in a random order, as torchvision draws them. Each adjustment blends the image with a reference and
//! truncates to `u8`, as torchvision's tensor functions do on `uint8` images:
//! - brightness: `f·p` (the reference is black);
//! - contrast: `f·p + (1 − f)·m`, `m` the mean of the image's grey levels;
//! - saturation: `f·p + (1 − f)·g`, `g` the pixel's own grey level;
//!
//! with grey = `0.2989 R + 0.587 G + 0.114 B`, truncated. The hue shift is torchvision's
//! tensor `adjust_hue`: each pixel to `f32` HSV (`/255`), `h ← (h + shift) mod 1`, back to
//! RGB, and to `u8` by `×(256 − 0.001)`, truncated. With no hue strength the draw is the one
//! of three adjustments it always was, so older runs resume with the same pixels. The draw comes from
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
    /// Hue shift range `[−h, h]` turns, h ≤ 0.5.
    pub hue: f32,
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
    /// Turn the colour wheel.
    Hue,
}

/// The factors and order drawn for one image.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct JitterDraw {
    /// The order the adjustments are applied in.
    pub order: [Adjust; 4],
    /// Brightness factor (1: unchanged).
    pub brightness: f32,
    /// Contrast factor (1: unchanged).
    pub contrast: f32,
    /// Saturation factor (1: unchanged).
    pub saturation: f32,
    /// Hue shift in turns (0: unchanged).
    pub hue: f32,
}

impl ColorJitter {
    /// The same strength for brightness, contrast and saturation, no hue (timm's
    /// `--color-jitter F`).
    pub fn uniform(strength: f32) -> Self {
        Self {
            brightness: strength,
            contrast: strength,
            saturation: strength,
            hue: 0.0,
        }
    }

    /// The same with a hue strength (torchvision's `ColorJitter(F, F, F, hue)`).
    pub fn with_hue(self, hue: f32) -> Self {
        Self { hue, ..self }
    }

    /// Whether any adjustment can change a pixel.
    pub fn is_on(&self) -> bool {
        self.brightness > 0.0 || self.contrast > 0.0 || self.saturation > 0.0 || self.hue > 0.0
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
        if !(0.0..=0.5).contains(&self.hue) {
            return Err(PipelineError::InvalidSetting {
                name: "--color-jitter-hue",
                value: self.hue.to_string(),
                hint: "a shift range in turns of the colour wheel, from 0 to 0.5 (recipes use 0.1)",
            });
        }
        Ok(())
    }

    /// The draw of sample `sample_id` in `epoch`.
    pub fn draw(&self, seed: u64, epoch: u64, sample_id: u64) -> JitterDraw {
        let mut rng = crate::crop::sample_rng(b"cjitter\0", seed, epoch, sample_id);
        let mut order = [
            Adjust::Brightness,
            Adjust::Contrast,
            Adjust::Saturation,
            Adjust::Hue,
        ];
        // Without hue, the three others are shuffled alone (the draws before hue existed).
        let shuffled = if self.hue > 0.0 { 4 } else { 3 };
        order[..shuffled].shuffle(&mut rng);
        let mut factor = |strength: f32| {
            let (lo, hi) = ((1.0 - strength).max(0.0), 1.0 + strength);
            lo + (hi - lo) * rng.random::<f32>()
        };
        let (brightness, contrast, saturation) = (
            factor(self.brightness),
            factor(self.contrast),
            factor(self.saturation),
        );
        let hue = if self.hue > 0.0 {
            self.hue * (2.0 * rng.random::<f32>() - 1.0)
        } else {
            0.0
        };
        JitterDraw {
            order,
            brightness,
            contrast,
            saturation,
            hue,
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
                Adjust::Hue => hue(rgb, self.hue),
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

pub(crate) fn brightness(rgb: &mut [u8], f: f32) {
    if f != 1.0 {
        map_bytes(rgb, f, 0.0);
    }
}

fn contrast(rgb: &mut [u8], f: f32) {
    contrast_weighted(rgb, f, 1.0 - f);
}

/// Contrast with the weights `f` of the image and `rest` of its mean grey (`1 − f`, given
/// apart where the caller rounds it from a wider factor, as torchvision does).
pub(crate) fn contrast_weighted(rgb: &mut [u8], f: f32, rest: f32) {
    if f == 1.0 || rgb.is_empty() {
        return;
    }
    let t = &*GREY;
    let pixels = rgb.len() / 3;
    // Whole grey levels: the integer sum is exact.
    let sum: u64 = rgb.chunks_exact(3).map(|p| u64::from(grey(t, p))).sum();
    map_bytes(rgb, f, rest * (sum as f64 / pixels as f64) as f32);
}

fn saturation(rgb: &mut [u8], f: f32) {
    saturation_weighted(rgb, f, 1.0 - f);
}

/// Saturation with the weights `f` of the pixel and `rest` of its grey (see
/// [`contrast_weighted`]).
pub(crate) fn saturation_weighted(rgb: &mut [u8], f: f32, rest: f32) {
    if f == 1.0 {
        return;
    }
    // Every pixel's grey level is a whole number in 0..=255: its offset is a table too.
    let t = &*GREY;
    let offsets: [f32; 256] = std::array::from_fn(|g| rest * g as f32);
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

/// Turns every pixel's hue by `shift` (torchvision's `adjust_hue` of a `uint8` tensor: the
/// float HSV round trip of `_rgb2hsv` and `_hsv2rgb`, in `f32`).
fn hue(rgb: &mut [u8], shift: f32) {
    if shift == 0.0 {
        return;
    }
    // Blocks of pixels, deinterleaved, with the per-pixel branches written as selects: the
    // compiler vectorises the lanes (divisions included, with the same IEEE results).
    const PIXELS: usize = 16;
    let mut blocks = rgb.chunks_exact_mut(3 * PIXELS);
    for block in &mut blocks {
        hue_block::<PIXELS>(block, shift);
    }
    for p in blocks.into_remainder().chunks_exact_mut(3) {
        hue_block::<1>(p, shift);
    }
}

/// [`hue`] of `N` packed RGB8 pixels.
#[inline(always)]
fn hue_block<const N: usize>(px: &mut [u8], shift: f32) {
    let channel =
        |c: usize| -> [f32; N] { std::array::from_fn(|i| f32::from(px[3 * i + c]) / 255.0) };
    let (r, g, b) = (channel(0), channel(1), channel(2));
    let mut out = [[0f32; N]; 3];
    for i in 0..N {
        let (h, s, v) = rgb_to_hsv(r[i], g[i], b[i]);
        // torch's `% 1.0` of a value in [−0.5, 1.5): one exact subtraction or rounded addition.
        let turned = h + shift;
        let h = if turned >= 1.0 {
            turned - 1.0
        } else if turned < 0.0 {
            turned + 1.0
        } else {
            turned
        };
        let [o0, o1, o2] = hsv_to_rgb(h, s, v);
        out[0][i] = o0;
        out[1][i] = o1;
        out[2][i] = o2;
    }
    for (i, p) in px.chunks_exact_mut(3).enumerate() {
        for (c, dst) in p.iter_mut().enumerate() {
            // torchvision's float → uint8: × (255 + 1 − 1e-3), truncated.
            *dst = (out[c][i] * (256.0 - 1e-3)) as u8;
        }
    }
}

/// torchvision's `_rgb2hsv` of one pixel in [0, 1]: (h in [0, 1), s, v).
#[inline(always)]
fn rgb_to_hsv(r: f32, g: f32, b: f32) -> (f32, f32, f32) {
    let maxc = r.max(g).max(b);
    let minc = r.min(g).min(b);
    let equal = maxc == minc;
    let cr = maxc - minc;
    let s = cr / if equal { 1.0 } else { maxc };
    let divisor = if equal { 1.0 } else { cr };
    let (rc, gc, bc) = (
        (maxc - r) / divisor,
        (maxc - g) / divisor,
        (maxc - b) / divisor,
    );
    let (hr, hg, hb) = (bc - gc, 2.0 + rc - bc, 4.0 + gc - rc);
    let h = if maxc == r {
        hr
    } else if maxc == g {
        hg
    } else {
        hb
    };
    // torch's fmod(x, 1) of x = h/6 + 1 in [5/6, 11/6]: x − 1 is exact there (Sterbenz), and
    // spares the library call.
    let x = h / 6.0 + 1.0;
    (if x >= 1.0 { x - 1.0 } else { x }, s, maxc)
}

/// torchvision's `_hsv2rgb` of one pixel (its sector table as selects).
#[inline(always)]
fn hsv_to_rgb(h: f32, s: f32, v: f32) -> [f32; 3] {
    // h ≥ 0, so truncation is torch's floor (and needs no library call).
    let i = (h * 6.0) as i32;
    let f = h * 6.0 - i as f32;
    let p = (v * (1.0 - s)).clamp(0.0, 1.0);
    let q = (v * (1.0 - s * f)).clamp(0.0, 1.0);
    let t = (v * (1.0 - s * (1.0 - f))).clamp(0.0, 1.0);
    let i = i % 6;
    let r = if i == 0 || i == 5 {
        v
    } else if i == 1 {
        q
    } else if i == 4 {
        t
    } else {
        p
    };
    let g = if i == 0 {
        t
    } else if i == 1 || i == 2 {
        v
    } else if i == 3 {
        q
    } else {
        p
    };
    let b = if i == 0 || i == 1 {
        p
    } else if i == 2 {
        t
    } else if i == 5 {
        q
    } else {
        v
    };
    [r, g, b]
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
            order: [
                Adjust::Contrast,
                Adjust::Hue,
                Adjust::Saturation,
                Adjust::Brightness,
            ],
            brightness: 1.0,
            contrast: 1.0,
            saturation: 1.0,
            hue: 0.0,
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
            Adjust::Hue => hue(rgb, f),
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
                    Adjust::Hue => unreachable!("not a tabled adjustment"),
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
            hue: 0.0,
        };
        let mut a = px;
        draw([
            Adjust::Brightness,
            Adjust::Saturation,
            Adjust::Hue,
            Adjust::Contrast,
        ])
        .apply(&mut a);
        let mut b = px;
        draw([
            Adjust::Saturation,
            Adjust::Brightness,
            Adjust::Contrast,
            Adjust::Hue,
        ])
        .apply(&mut b);
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
            assert_eq!(
                d.order[3],
                Adjust::Hue,
                "no hue: the three are shuffled alone"
            );
            assert_eq!(d.hue, 0.0);
            let mut sorted = d.order;
            sorted.sort_by_key(|a| *a as u8);
            assert_eq!(
                sorted,
                [
                    Adjust::Brightness,
                    Adjust::Contrast,
                    Adjust::Saturation,
                    Adjust::Hue
                ]
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
        for h in [-0.1, 0.6, f32::NAN] {
            let err = ColorJitter::uniform(0.4)
                .with_hue(h)
                .validate()
                .unwrap_err();
            assert!(err.to_string().contains("--color-jitter-hue"), "{err}");
        }
        ColorJitter::uniform(0.0).with_hue(0.5).validate().unwrap();
    }

    /// Hue draws: shifts in [−h, h] covering the range, all four adjustments shuffled; the
    /// brightness, contrast and saturation factors stay in their ranges.
    #[test]
    fn hue_draws_shift_within_the_range_in_any_order() {
        let jitter = ColorJitter::uniform(0.4).with_hue(0.1);
        let mut last = std::collections::HashSet::new();
        let (mut lo, mut hi) = (f32::MAX, f32::MIN);
        for id in 0..600 {
            let d = jitter.draw(3, 1, id);
            assert!((-0.1..=0.1).contains(&d.hue), "{d:?}");
            assert!((0.6..=1.4).contains(&d.contrast), "{d:?}");
            lo = lo.min(d.hue);
            hi = hi.max(d.hue);
            last.insert(d.order[3]);
        }
        assert!(lo < -0.09 && hi > 0.09, "{lo}..{hi}");
        assert_eq!(last.len(), 4, "every adjustment comes last sometimes");
    }

    /// The hue turn: primaries move a third of the wheel to the next primary, greys stay,
    /// half a turn gives the complementary colour, and a turn forth and back returns each
    /// byte within 1 (the float round trip, truncated).
    #[test]
    fn hue_turns_the_colour_wheel() {
        let mut px = [255u8, 0, 0, 0, 255, 0, 0, 0, 255, 90, 90, 90];
        hue(&mut px, 1.0 / 3.0);
        assert_eq!(px, [0, 255, 0, 0, 0, 255, 255, 0, 0, 90, 90, 90]);
        let mut px = [200u8, 100, 50];
        hue(&mut px, 0.5);
        // (h 20° → 200°): the complementary colour keeps value and saturation (torchvision
        // gives the same bytes; its versions before the ×(256 − 0.001) rounding gave 149).
        assert_eq!(px, [50, 150, 200]);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        let image: Vec<u8> = (0..300 * 3).map(|_| rng.random()).collect();
        let mut turned = image.clone();
        hue(&mut turned, 0.137);
        hue(&mut turned, -0.137);
        for (a, b) in image.iter().zip(&turned) {
            assert!(a.abs_diff(*b) <= 1, "{a} → {b}");
        }
        assert_ne!(
            {
                let mut t = image.clone();
                hue(&mut t, 0.05);
                t
            },
            image
        );
    }

    /// Bytes torchvision's tensor `adjust_hue` gave for 16 random pixels (its `_rgb2hsv` and
    /// `_hsv2rgb`, then `× (256 − 0.001)` to `uint8`, as its current `to_dtype` rounds): the
    /// turn reproduces them exactly. (4,096 random pixels at four shifts matched too when the
    /// code was written.)
    #[test]
    fn hue_matches_torchvisions_bytes() {
        let input: [u8; 48] = [
            172, 4, 119, 47, 251, 41, 117, 79, 130, 192, 127, 32, 67, 21, 214, 251, 121, 124, 195,
            115, 10, 103, 102, 222, 9, 10, 136, 211, 16, 21, 21, 2, 119, 242, 46, 57, 36, 189, 45,
            87, 174, 67, 70, 110, 197, 216, 32, 27,
        ];
        let plus: [u8; 48] = [
            172, 4, 18, 41, 251, 161, 130, 79, 112, 161, 192, 32, 183, 21, 214, 251, 196, 121, 164,
            195, 10, 175, 102, 222, 84, 9, 136, 211, 128, 16, 91, 2, 119, 242, 153, 46, 36, 189,
            137, 67, 174, 111, 106, 70, 197, 216, 145, 27,
        ];
        let minus: [u8; 48] = [
            4, 14, 172, 251, 165, 41, 79, 111, 130, 192, 32, 158, 21, 214, 187, 199, 121, 251, 195,
            10, 160, 102, 222, 178, 9, 136, 87, 132, 16, 211, 2, 119, 93, 157, 46, 242, 189, 140,
            36, 174, 113, 67, 70, 197, 109, 149, 27, 216,
        ];
        for (shift, want) in [(0.1, plus), (-0.23, minus)] {
            let mut got = input;
            hue(&mut got, shift);
            assert_eq!(got, want, "shift {shift}");
        }
        // A whole block of 16 and the one-pixel path agree on a longer image too.
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let image: Vec<u8> = (0..37 * 3).map(|_| rng.random()).collect();
        let mut blocked = image.clone();
        hue(&mut blocked, 0.31);
        let mut single = image;
        single
            .chunks_exact_mut(3)
            .for_each(|p| hue_block::<1>(p, 0.31));
        assert_eq!(blocked, single);
    }
}
