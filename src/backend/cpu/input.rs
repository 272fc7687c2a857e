//! u8 NHWC batch → normalised f32 input, with pad-and-crop shift and mirror.

use rayon::prelude::*;

use crate::model::{InputBatch, IMAGENET_MEAN, IMAGENET_STD};

pub(super) fn normalise(batch: &InputBatch<'_>, out: &mut [f32]) {
    let s = batch.image_size as usize;
    let img = s * s * 3;
    let scale: [f32; 3] = std::array::from_fn(|c| 1.0 / (255.0 * IMAGENET_STD[c]));
    let shift: [f32; 3] = std::array::from_fn(|c| -IMAGENET_MEAN[c] / IMAGENET_STD[c]);
    out[..batch.len * img]
        .par_chunks_mut(img)
        .enumerate()
        .for_each(|(n, o)| {
            let px = &batch.pixels[n * img..(n + 1) * img];
            let aug = batch.augment.map(|a| a[n]).unwrap_or_default();
            for y in 0..s {
                for x in 0..s {
                    let xs = if aug.flip { s - 1 - x } else { x };
                    let sy = y as i64 + i64::from(aug.dy);
                    let sx = xs as i64 + i64::from(aug.dx);
                    let dst = &mut o[(y * s + x) * 3..(y * s + x + 1) * 3];
                    if sy < 0 || sx < 0 || sy >= s as i64 || sx >= s as i64 {
                        dst.fill(0.0);
                    } else {
                        let src = (sy as usize * s + sx as usize) * 3;
                        for c in 0..3 {
                            dst[c] = f32::from(px[src + c]) * scale[c] + shift[c];
                        }
                    }
                }
            }
        });
}
