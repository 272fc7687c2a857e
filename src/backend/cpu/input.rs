//! u8 NHWC batch → normalised f32 input, with pad-and-crop shift, mirror and random
//! erasing, then the batch's mixup or CutMix.

use rayon::prelude::*;

use crate::model::{Augment, InputBatch, Mix, IMAGENET_MEAN, IMAGENET_STD};

pub(super) fn normalise(batch: &InputBatch<'_>, out: &mut [f32]) {
    let s = batch.image_size as usize;
    let img = s * s * 3;
    let scale: [f32; 3] = std::array::from_fn(|c| 1.0 / (255.0 * IMAGENET_STD[c]));
    let shift: [f32; 3] = std::array::from_fn(|c| -IMAGENET_MEAN[c] / IMAGENET_STD[c]);
    // Image b's normalised value at output (y, x, c), after its own augmentation.
    let value = |b: usize, y: usize, x: usize, c: usize| -> f32 {
        let aug = batch.augment.map(|a| a[b]).unwrap_or_default();
        let Augment {
            dy,
            dx,
            flip,
            erase,
        } = aug;
        if erase.is_some_and(|e| e.contains(y, x)) {
            return 0.0;
        }
        let xs = if flip { s - 1 - x } else { x };
        let sy = y as i64 + i64::from(dy);
        let sx = xs as i64 + i64::from(dx);
        if sy < 0 || sx < 0 || sy >= s as i64 || sx >= s as i64 {
            0.0
        } else {
            let src = b * img + (sy as usize * s + sx as usize) * 3 + c;
            f32::from(batch.pixels[src]) * scale[c] + shift[c]
        }
    };
    let n = batch.len;
    out[..n * img]
        .par_chunks_mut(img)
        .enumerate()
        .for_each(|(b, o)| {
            let partner = Mix::partner(b, n);
            for y in 0..s {
                for x in 0..s {
                    for c in 0..3 {
                        o[(y * s + x) * 3 + c] = match batch.mix {
                            None => value(b, y, x, c),
                            Some(Mix::Blend { lambda }) => {
                                lambda * value(b, y, x, c)
                                    + (1.0 - lambda) * value(partner, y, x, c)
                            }
                            Some(mix) if mix.pastes(y, x) => value(partner, y, x, c),
                            Some(_) => value(b, y, x, c),
                        };
                    }
                }
            }
        });
}
