//! What the trainer hands a network each step, and what it gets back.

use super::ModelError;

/// torchvision's ImageNet channel means (RGB), applied after scaling pixels to [0, 1].
pub const IMAGENET_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
/// torchvision's ImageNet channel standard deviations (RGB).
pub const IMAGENET_STD: [f32; 3] = [0.229, 0.224, 0.225];

/// Per-image training augmentation, drawn by the trainer from (seed, epoch, sample id) so
/// every backend and replica count sees identical inputs.
///
/// The output pixel `(y, x)` is the input pixel `(y + dy, x + dx)` (zero where that falls
/// outside: CIFAR-style pad-and-crop at the stored size with padding `S/8`), then the row is
/// mirrored when `flip`; last, the output pixels inside `erase` are set to zero, in
/// normalised space (torchvision's `RandomErasing` with `value=0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Augment {
    /// Vertical shift, |dy| ≤ S/8.
    pub dy: i32,
    /// Horizontal shift, |dx| ≤ S/8.
    pub dx: i32,
    /// Horizontal mirror.
    pub flip: bool,
    /// The erased rectangle, in output coordinates (`--random-erase`).
    pub erase: Option<PixelBox>,
}

/// A rectangle of an `S×S` image: rows `y0..y1`, columns `x0..x1` (ends excluded).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PixelBox {
    /// First row.
    pub y0: u32,
    /// Row after the last.
    pub y1: u32,
    /// First column.
    pub x0: u32,
    /// Column after the last.
    pub x1: u32,
}

impl PixelBox {
    /// Whether pixel `(y, x)` is inside.
    pub fn contains(&self, y: usize, x: usize) -> bool {
        (self.y0 as usize..self.y1 as usize).contains(&y)
            && (self.x0 as usize..self.x1 as usize).contains(&x)
    }

    /// Pixels inside.
    pub fn area(&self) -> u64 {
        u64::from(self.y1.saturating_sub(self.y0)) * u64::from(self.x1.saturating_sub(self.x0))
    }

    /// Whether it is ordered and inside an image of side `image_size`.
    pub fn fits(&self, image_size: u32) -> bool {
        self.y0 <= self.y1 && self.x0 <= self.x1 && self.y1 <= image_size && self.x1 <= image_size
    }
}

impl Augment {
    /// The largest shift allowed for images of side `image_size` (S/8, at least 1).
    pub fn max_shift(image_size: u32) -> i32 {
        (image_size / 8).max(1) as i32
    }
}

/// Mixing of a training micro-batch (timm's mixup and CutMix, batch mode): image `i` of `n`
/// is combined with its partner `n − 1 − i` (the batch reversed), each after its own
/// [`Augment`], in normalised space; the loss's target mixes the two labels by
/// [`Mix::own_weight`]. Drawn by the trainer per micro-batch (`--mixup`, `--cutmix`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mix {
    /// Mixup: every value is `λ·own + (1 − λ)·partner`.
    Blend {
        /// λ, the own image's weight, in [0, 1].
        lambda: f32,
    },
    /// CutMix: the box (output coordinates) comes from the partner, the rest from the image
    /// itself.
    Paste(PixelBox),
}

impl Mix {
    /// The partner of image `i` in a batch of `n`.
    pub fn partner(i: usize, n: usize) -> usize {
        n - 1 - i
    }

    /// The weight of each image's own label in its target (λ; for CutMix the share of the
    /// image left outside the box); the partner's label has the rest.
    pub fn own_weight(&self, image_size: u32) -> f32 {
        match *self {
            Self::Blend { lambda } => lambda,
            Self::Paste(b) => {
                let area = b.area() as f64;
                (1.0 - area / (f64::from(image_size) * f64::from(image_size))) as f32
            }
        }
    }

    /// Whether output pixel `(y, x)` is the partner's alone (inside the CutMix box).
    pub fn pastes(&self, y: usize, x: usize) -> bool {
        match *self {
            Self::Blend { .. } => false,
            Self::Paste(b) => b.contains(y, x),
        }
    }

    fn check(&self, image_size: u32) -> Result<(), ModelError> {
        match *self {
            Self::Blend { lambda } if !(0.0..=1.0).contains(&lambda) => Err(ModelError::BadBatch(
                format!("mixup weight {lambda} is outside [0, 1]"),
            )),
            Self::Paste(b) if !b.fits(image_size) => Err(ModelError::BadBatch(format!(
                "CutMix box {b:?} is not inside {image_size}x{image_size}"
            ))),
            _ => Ok(()),
        }
    }
}

/// One micro-batch of u8 NHWC images with labels.
#[derive(Debug, Clone, Copy)]
pub struct InputBatch<'a> {
    /// `len × S × S × 3` bytes, RGB, row-major NHWC (at least that many).
    pub pixels: &'a [u8],
    /// One label per image (at least `len`).
    pub labels: &'a [u32],
    /// Images in the batch.
    pub len: usize,
    /// S.
    pub image_size: u32,
    /// Training augmentation per image (`None`: images as stored).
    pub augment: Option<&'a [Augment]>,
    /// Mixing of the batch's images and labels (`None`: none).
    pub mix: Option<Mix>,
}

impl<'a> InputBatch<'a> {
    /// Checks buffer lengths, augment ranges and that the batch fits a network built for
    /// `max_batch` images of side `image_size`.
    pub fn validate(&self, max_batch: usize, image_size: u32) -> Result<(), ModelError> {
        let s = self.image_size as usize;
        if self.image_size != image_size {
            return Err(ModelError::BadBatch(format!(
                "images are {0}x{0}, the network was built for {1}x{1}",
                self.image_size, image_size
            )));
        }
        if self.len == 0 || self.len > max_batch {
            return Err(ModelError::BadBatch(format!(
                "{} images, the network takes 1..={max_batch}",
                self.len
            )));
        }
        if self.pixels.len() < self.len * s * s * 3 {
            return Err(ModelError::BadBatch(format!(
                "{} pixel bytes for {} images of {s}x{s}x3",
                self.pixels.len(),
                self.len
            )));
        }
        if self.labels.len() < self.len {
            return Err(ModelError::BadBatch(format!(
                "{} labels for {} images",
                self.labels.len(),
                self.len
            )));
        }
        if let Some(aug) = self.augment {
            if aug.len() < self.len {
                return Err(ModelError::BadBatch(format!(
                    "{} augment entries for {} images",
                    aug.len(),
                    self.len
                )));
            }
            let m = Augment::max_shift(self.image_size);
            if let Some(a) = aug[..self.len]
                .iter()
                .find(|a| a.dy.abs() > m || a.dx.abs() > m)
            {
                return Err(ModelError::BadBatch(format!(
                    "augment shift ({}, {}) exceeds the padding {m}",
                    a.dy, a.dx
                )));
            }
            if let Some(b) = aug[..self.len]
                .iter()
                .filter_map(|a| a.erase)
                .find(|b| !b.fits(self.image_size))
            {
                return Err(ModelError::BadBatch(format!(
                    "erased box {b:?} is not inside {0}x{0}",
                    self.image_size
                )));
            }
        }
        if let Some(mix) = &self.mix {
            mix.check(self.image_size)?;
        }
        Ok(())
    }
}

/// Loss and accuracy counts of one step (sums, so replicas and batches add up).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepStats {
    /// Sum of per-image losses.
    pub loss_sum: f64,
    /// Correct top-1 predictions.
    pub correct_top1: usize,
    /// Labels within the top five.
    pub correct_top5: usize,
    /// Images.
    pub count: usize,
}

impl StepStats {
    /// Loss and top-1/top-5 hit sums of class probabilities (`labels.len() × classes`): the
    /// cross-entropy with label smoothing ε, `-(1-ε)·ln p_y - ε·mean_k ln p_k`, the loss the
    /// backends compute from logits. A probability of 0 counts as the smallest positive f32; a row
    /// with a NaN, or a label not below `classes`, is never correct.
    pub fn of_probabilities(probs: &[f32], labels: &[u32], classes: usize, smoothing: f32) -> Self {
        let eps = f64::from(smoothing);
        let ln = |p: f32| f64::from(p.max(f32::MIN_POSITIVE)).ln();
        let mut stats = Self {
            loss_sum: 0.0,
            correct_top1: 0,
            correct_top5: 0,
            count: labels.len(),
        };
        for (row, &label) in probs.chunks_exact(classes).zip(labels) {
            let Some(&p_y) = row.get(label as usize) else {
                stats.loss_sum -= ln(0.0);
                continue;
            };
            let mean_ln = row.iter().map(|&p| ln(p)).sum::<f64>() / classes as f64;
            stats.loss_sum -= (1.0 - eps) * ln(p_y) + eps * mean_ln;
            let above = if row.iter().all(|p| p.is_finite()) {
                row.iter().filter(|&&p| p > p_y).count()
            } else {
                usize::MAX
            };
            stats.correct_top1 += usize::from(above == 0);
            stats.correct_top5 += usize::from(above < 5);
        }
        stats
    }

    /// Adds another step's counts.
    pub fn merge(&mut self, other: &StepStats) {
        self.loss_sum += other.loss_sum;
        self.correct_top1 += other.correct_top1;
        self.correct_top5 += other.correct_top5;
        self.count += other.count;
    }

    /// Mean loss per image (0 for an empty count).
    pub fn mean_loss(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.loss_sum / self.count as f64
        }
    }

    /// Top-1 accuracy.
    pub fn accuracy(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.correct_top1 as f64 / self.count as f64
        }
    }

    /// Top-5 accuracy.
    pub fn top5(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.correct_top5 as f64 / self.count as f64
        }
    }
}
