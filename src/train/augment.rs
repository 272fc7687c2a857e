//! Training augmentation parameters, drawn from `(seed, epoch, sample id)`.
//!
//! Drawing per sample (not from a running generator) makes the parameters independent of
//! batch composition, replica count and resume point, which the resume-exactness and
//! replica-equivalence tests rely on, and gives every backend the same inputs.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::model::Augment;

/// The shift range of the pad-and-crop augmentation: S/8 pixels each way (4 at 32×32), as
/// the model's input op accepts it.
pub fn max_shift(image_size: u32) -> i32 {
    Augment::max_shift(image_size)
}

/// The augmentation of one training sample.
pub fn augment_for(seed: u64, epoch: u64, sample_id: u64, image_size: u32) -> Augment {
    let mut key = [0u8; 24];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&epoch.to_le_bytes());
    key[16..].copy_from_slice(&sample_id.to_le_bytes());
    let mut rng = ChaCha8Rng::seed_from_u64(xxhash_rust::xxh3::xxh3_64(&key));
    let shift = max_shift(image_size);
    Augment {
        dy: rng.random_range(-shift..=shift),
        dx: rng.random_range(-shift..=shift),
        flip: rng.random_bool(0.5),
    }
}

/// The augmentations of a micro-batch, in sample order.
pub fn augments_for(seed: u64, epoch: u64, sample_ids: &[u64], image_size: u32) -> Vec<Augment> {
    sample_ids
        .iter()
        .map(|&id| augment_for(seed, epoch, id, image_size))
        .collect()
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
}
