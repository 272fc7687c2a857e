//! Training augmentation (`--augment`) and its per-sample parameters, drawn from
//! `(seed, epoch, sample id)`.
//!
//! Two kinds: the CIFAR-style pad-and-crop with a mirror, both applied by the model's input
//! op on the device; and the ImageNet-style random resized crop, cut by the input engine's
//! decode workers ([`pipeline::RandomResizedCrop`]), with the mirror still on the device.
//!
//! Drawing per sample (not from a running generator) makes the parameters independent of
//! batch composition, replica count and resume point, which the resume-exactness and
//! replica-equivalence tests rely on, and gives every backend the same inputs.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use pipeline::RandomResizedCrop;

use super::folder::RunSettings;
use crate::model::{Augment, PixelBox};

/// What training does to each image (`--augment`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Augmentation {
    /// Images as stored (`none`, `--no-augment`).
    None,
    /// Shift by up to S/8 with zero padding, and mirror half the images (`pad-crop`, the
    /// default): the CIFAR recipe, on the device.
    PadCrop,
    /// torchvision's `RandomResizedCrop` of the stored square by the input engine, and
    /// mirror half the images on the device (`resized-crop`): the ImageNet recipe.
    ResizedCrop(RandomResizedCrop),
}

impl Augmentation {
    /// The `--augment` words.
    pub const CHOICES: &'static str = "pad-crop, resized-crop or none";

    /// The command-line word.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::None => "none",
            Self::PadCrop => "pad-crop",
            Self::ResizedCrop(_) => "resized-crop",
        }
    }

    /// The kind named by `word`, a resized crop with torchvision's ranges.
    pub fn parse(word: &str) -> Option<Self> {
        match word.trim().to_ascii_lowercase().as_str() {
            "none" => Some(Self::None),
            "pad-crop" => Some(Self::PadCrop),
            "resized-crop" | "random-resized-crop" => {
                Some(Self::ResizedCrop(RandomResizedCrop::DEFAULT))
            }
            _ => None,
        }
    }

    /// The kind a checkpoint records: whether training augments, and the resized crop's
    /// area-share range when it is that kind (absent in older checkpoints: pad-and-crop).
    pub fn recorded(augment: bool, crop_scale: Option<[f32; 2]>) -> Self {
        match (augment, crop_scale) {
            (false, _) => Self::None,
            (true, None) => Self::PadCrop,
            (true, Some([min, max])) => Self::ResizedCrop(RandomResizedCrop {
                scale: (min, max),
                ..RandomResizedCrop::DEFAULT
            }),
        }
    }

    /// The area-share range a checkpoint records (`None` unless a resized crop).
    pub fn recorded_crop_scale(&self) -> Option<[f32; 2]> {
        self.engine_crop().map(|c| [c.scale.0, c.scale.1])
    }

    /// The crop the input engine cuts, if any.
    pub fn engine_crop(&self) -> Option<RandomResizedCrop> {
        match self {
            Self::ResizedCrop(crop) => Some(*crop),
            _ => None,
        }
    }

    /// Which training images the device mirrors, by `(epoch, sample id)`, for the input
    /// engine's augmentation policies ([`pipeline::PipelineBuilder::mirrored_later`]); `None`
    /// when none is mirrored.
    pub fn mirrored_later(&self, seed: u64, image_size: u32) -> Option<pipeline::MirroredLater> {
        match self {
            Self::None => None,
            Self::PadCrop | Self::ResizedCrop(_) => Some(std::sync::Arc::new(move |epoch, id| {
                augment_for(seed, epoch, id, image_size).flip
            })),
        }
    }

    /// The device's part for a micro-batch, in sample order (`None`: images as they come),
    /// with each image erased with probability `random_erase` ([`erase_for`]).
    pub fn device_augments(
        &self,
        random_erase: f32,
        seed: u64,
        epoch: u64,
        sample_ids: &[u64],
        image_size: u32,
    ) -> Option<Vec<Augment>> {
        let mut augments = match self {
            Self::None if random_erase > 0.0 => vec![Augment::default(); sample_ids.len()],
            Self::None => return None,
            Self::PadCrop => augments_for(seed, epoch, sample_ids, image_size),
            // The mirror alone: the engine has cropped already.
            Self::ResizedCrop(_) => augments_for(seed, epoch, sample_ids, image_size)
                .into_iter()
                .map(|a| Augment { dy: 0, dx: 0, ..a })
                .collect(),
        };
        if random_erase > 0.0 {
            for (a, &id) in augments.iter_mut().zip(sample_ids) {
                a.erase = erase_for(random_erase, seed, epoch, id, image_size);
            }
        }
        Some(augments)
    }
}

/// The shift range of the pad-and-crop augmentation: S/8 pixels each way (4 at 32×32), as
/// the model's input op accepts it.
pub fn max_shift(image_size: u32) -> i32 {
    Augment::max_shift(image_size)
}

/// The generator of one sample's draws in one epoch for the stream named `tag` (the shift and
/// mirror's is unnamed, as it always was): seeded from `(tag, seed, epoch, sample id)` alone.
fn sample_rng(tag: &[u8], seed: u64, epoch: u64, sample_id: u64) -> ChaCha8Rng {
    let mut key = Vec::with_capacity(tag.len() + 24);
    key.extend_from_slice(tag);
    key.extend_from_slice(&seed.to_le_bytes());
    key.extend_from_slice(&epoch.to_le_bytes());
    key.extend_from_slice(&sample_id.to_le_bytes());
    ChaCha8Rng::seed_from_u64(xxhash_rust::xxh3::xxh3_64(&key))
}

/// The augmentation of one training sample.
pub fn augment_for(seed: u64, epoch: u64, sample_id: u64, image_size: u32) -> Augment {
    let mut rng = sample_rng(b"", seed, epoch, sample_id);
    let shift = max_shift(image_size);
    Augment {
        dy: rng.random_range(-shift..=shift),
        dx: rng.random_range(-shift..=shift),
        flip: rng.random_bool(0.5),
        erase: None,
    }
}

/// torchvision's `RandomErasing(p, scale=(0.02, 0.33), ratio=(0.3, 3.3), value=0)` of one
/// training sample: with probability `p` a rectangle of area share uniform in the scale range
/// and aspect ratio (height / width) log-uniform in the ratio range, placed uniformly, is
/// erased (to 0 after normalisation: the mean colour); torchvision's ten tries for a
/// rectangle that fits, none erased when all ten fail. Drawn from its own stream of
/// (seed, epoch, sample id), so the shift and mirror draws are those of a run without it.
pub fn erase_for(
    p: f32,
    seed: u64,
    epoch: u64,
    sample_id: u64,
    image_size: u32,
) -> Option<PixelBox> {
    let mut rng = sample_rng(b"rerase\0\0", seed, epoch, sample_id);
    if !(p > 0.0 && rng.random::<f32>() < p) {
        return None;
    }
    let side = f64::from(image_size);
    let area = side * side;
    let (log_lo, log_hi) = (0.3f64.ln(), 3.3f64.ln());
    for _ in 0..10 {
        let erase_area = area * rng.random_range(0.02..1.0 / 3.0);
        let aspect = rng.random_range(log_lo..log_hi).exp();
        let h = (erase_area * aspect).sqrt().round() as u32;
        let w = (erase_area / aspect).sqrt().round() as u32;
        if h >= image_size || w >= image_size {
            continue;
        }
        let y0 = rng.random_range(0..=image_size - h);
        let x0 = rng.random_range(0..=image_size - w);
        return Some(PixelBox {
            y0,
            y1: y0 + h,
            x0,
            x1: x0 + w,
        });
    }
    None
}

/// The augmentations of a micro-batch, in sample order.
pub fn augments_for(seed: u64, epoch: u64, sample_ids: &[u64], image_size: u32) -> Vec<Augment> {
    sample_ids
        .iter()
        .map(|&id| augment_for(seed, epoch, id, image_size))
        .collect()
}

/// The recorded augmentation as the training uses it.
impl RunSettings {
    /// What training does to each image (`augment` and `crop_scale`).
    pub fn augmentation(&self) -> Augmentation {
        Augmentation::recorded(self.augment, self.crop_scale)
    }

    /// Records `augmentation` (`--augment`, `--crop-scale`).
    pub fn set_augmentation(&mut self, augmentation: Augmentation) {
        self.augment = augmentation != Augmentation::None;
        self.crop_scale = augmentation.recorded_crop_scale();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_inputs_same_draw_and_in_range() {
        let mut flips = 0;
        for id in 0..200 {
            let a = augment_for(1, 2, id, 32);
            let b = augment_for(1, 2, id, 32);
            assert_eq!((a.dy, a.dx, a.flip), (b.dy, b.dx, b.flip));
            assert!(a.dy.abs() <= 4 && a.dx.abs() <= 4);
            flips += a.flip as usize;
        }
        assert!(
            (60..140).contains(&flips),
            "flip share looks wrong: {flips}/200"
        );
    }

    #[test]
    fn the_resized_crop_leaves_the_device_the_mirror_alone() {
        let ids: Vec<u64> = (0..100).collect();
        let crop = Augmentation::parse("resized-crop").unwrap();
        let pad = Augmentation::PadCrop
            .device_augments(0.0, 3, 1, &ids, 64)
            .unwrap();
        let mirror = crop.device_augments(0.0, 3, 1, &ids, 64).unwrap();
        assert!(mirror.iter().all(|a| a.dy == 0 && a.dx == 0));
        assert!(pad.iter().any(|a| a.dy != 0 || a.dx != 0));
        let flips = |v: &[Augment]| v.iter().map(|a| a.flip).collect::<Vec<_>>();
        assert_eq!(flips(&mirror), flips(&pad));
        assert!(Augmentation::None
            .device_augments(0.0, 3, 1, &ids, 64)
            .is_none());
        assert_eq!(crop.engine_crop(), Some(RandomResizedCrop::DEFAULT));
        for a in [Augmentation::None, Augmentation::PadCrop, crop] {
            assert_eq!(Augmentation::parse(a.as_str()), Some(a));
            let recorded = (a != Augmentation::None, a.recorded_crop_scale());
            assert_eq!(Augmentation::recorded(recorded.0, recorded.1), a);
        }
        let narrow = Augmentation::recorded(true, Some([0.25, 1.0]));
        assert_eq!(
            narrow,
            Augmentation::ResizedCrop(RandomResizedCrop::with_min_scale(0.25))
        );
        assert_eq!(Augmentation::parse("crop"), None);
    }

    #[test]
    fn epoch_changes_the_draw() {
        let differ = (0..50)
            .filter(|&id| {
                let a = augment_for(1, 0, id, 32);
                let b = augment_for(1, 1, id, 32);
                (a.dy, a.dx, a.flip) != (b.dy, b.dx, b.flip)
            })
            .count();
        assert!(differ > 30);
    }

    /// The erasing follows torchvision's draw: about p of the images, rectangles inside the
    /// image with area shares in [0.02, 1/3] (up to rounding) and aspect ratios in
    /// [0.3, 3.3]; the shift and mirror draws are those of a run without erasing.
    #[test]
    fn random_erasing_draws_like_torchvision() {
        let ids: Vec<u64> = (0..4000).collect();
        let plain = Augmentation::PadCrop
            .device_augments(0.0, 5, 2, &ids, 32)
            .unwrap();
        let erased = Augmentation::PadCrop
            .device_augments(0.25, 5, 2, &ids, 32)
            .unwrap();
        let without = |v: &[Augment]| v.iter().map(|a| (a.dy, a.dx, a.flip)).collect::<Vec<_>>();
        assert_eq!(without(&plain), without(&erased));
        assert!(plain.iter().all(|a| a.erase.is_none()));
        let boxes: Vec<PixelBox> = erased.iter().filter_map(|a| a.erase).collect();
        assert!(
            (900..1100).contains(&boxes.len()),
            "{} of 4000",
            boxes.len()
        );
        for b in &boxes {
            assert!(b.fits(32) && b.y1 < 32 + 1 && b.x1 <= 32, "{b:?}");
            let (h, w) = (f64::from(b.y1 - b.y0), f64::from(b.x1 - b.x0));
            let share = h * w / 1024.0;
            assert!((0.01..0.4).contains(&share), "{b:?}: share {share}");
            assert!((0.2..5.0).contains(&(h / w)), "{b:?}: aspect {}", h / w);
        }
        let mean = boxes.iter().map(|b| b.area() as f64 / 1024.0).sum::<f64>() / boxes.len() as f64;
        assert!((0.12..0.2).contains(&mean), "mean erased share {mean}");
        // Without any augmentation of its own, erasing still reaches the device.
        let alone = Augmentation::None
            .device_augments(1.0, 5, 2, &ids[..10], 32)
            .unwrap();
        assert!(alone.iter().all(|a| a.dy == 0 && a.dx == 0 && !a.flip));
        assert!(alone.iter().filter(|a| a.erase.is_some()).count() >= 9);
    }
}
