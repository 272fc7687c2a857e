//! The horizontal flip (torchvision's `RandomHorizontalFlip`, after the crop): drawn from
//! `(seed, epoch, sample id)` alone, so it does not depend on workers or batch boundaries,
//! and applied in place to the engine's batch.

use pipeline::{Batch, MirroredLater};

/// Whether sample `id` is mirrored in `epoch`: one fair coin per `(seed, epoch, id)`.
pub(crate) fn mirrored(seed: u64, epoch: u64, id: u64) -> bool {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(b"py-hflip");
    key[8..16].copy_from_slice(&seed.to_le_bytes());
    key[16..24].copy_from_slice(&epoch.to_le_bytes());
    key[24..].copy_from_slice(&id.to_le_bytes());
    xxhash_rust::xxh3::xxh3_64(&key) & 1 == 1
}

/// The engine's view of the flip: an automatic augmentation policy is applied as it looks in
/// the mirror to the images mirrored after it, so the result is torchvision's order
/// (flip, then policy).
pub(crate) fn mirrored_later(seed: u64) -> MirroredLater {
    std::sync::Arc::new(move |epoch, id| mirrored(seed, epoch, id))
}

/// Mirrors the drawn images of `batch` left to right, in place.
pub(crate) fn mirror_batch(batch: &mut Batch, seed: u64) {
    let side = batch.image_size as usize;
    let epoch = batch.epoch;
    let flips: Vec<bool> = batch
        .sample_ids
        .iter()
        .take(batch.len)
        .map(|&id| mirrored(seed, epoch, id))
        .collect();
    let image_bytes = side * side * 3;
    for (image, flip) in batch.pixels_mut().chunks_exact_mut(image_bytes).zip(flips) {
        if flip {
            for row in image.chunks_exact_mut(side * 3) {
                mirror_row(row);
            }
        }
    }
}

/// Reverses the order of the RGB pixels of one row: the left half's pixels swapped with the
/// right half's from the end, whole pixels at a time (half the time of byte swaps by index,
/// on the thread that finishes every batch).
fn mirror_row(row: &mut [u8]) {
    let half = row.len() / 6 * 3;
    let (left, right) = row.split_at_mut(half);
    for (a, b) in left.chunks_exact_mut(3).zip(right.rchunks_exact_mut(3)) {
        a.swap_with_slice(b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_is_mirrored_pixel_by_pixel() {
        let mut row = vec![1, 2, 3, 4, 5, 6, 7, 8, 9];
        mirror_row(&mut row);
        assert_eq!(row, vec![7, 8, 9, 4, 5, 6, 1, 2, 3]);
        let mut even = vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];
        mirror_row(&mut even);
        assert_eq!(even, vec![10, 11, 12, 7, 8, 9, 4, 5, 6, 1, 2, 3]);
    }

    #[test]
    fn about_half_the_samples_are_mirrored_and_the_draw_is_fixed() {
        let n = (0..1000).filter(|&id| mirrored(3, 1, id)).count();
        assert!((400..600).contains(&n), "{n} of 1000 mirrored");
        assert_eq!(mirrored(3, 1, 17), mirrored(3, 1, 17));
        let other_epoch = (0..1000).filter(|&id| mirrored(3, 1, id) != mirrored(3, 2, id));
        assert!(other_epoch.count() > 300);
    }
}
