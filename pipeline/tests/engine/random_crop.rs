//! `PipelineBuilder::random_resized_crop`: every image handed out is the drawn window of its
//! stored square scaled back to the square, the window depends on `(seed, epoch, sample id)`
//! only (workers, replicas, resume point and cache state do not change a pixel), and the
//! cache keeps the whole squares. `PipelineBuilder::center_crop`: every image is the same
//! centred window, from the cache or straight from the file.

use crate::common;
use common::pixels_by_id;

use pipeline::{CropWindow, PipelineBuilder, RandomResizedCrop, Split};

use common::Listed;

const SIDE: u32 = 32;
const SEED: u64 = 9;

/// Images whose red channel is 8·x and green 8·y: a linear ramp, which bilinear scaling
/// keeps linear, so every output pixel says where in the source it was sampled.
fn ramps(count: usize) -> Listed {
    common::listed(count, SIDE, 2, |i, x, y| {
        image::Rgb([(8 * x) as u8, (8 * y) as u8, (i * 10) as u8])
    })
}

fn builder(r: &Listed, crop: Option<RandomResizedCrop>) -> PipelineBuilder {
    PipelineBuilder::new(r.source())
        .split(Split::Train)
        .image_size(SIDE)
        .cache_dir(r.cache.path())
        .workers(2)
        .batch_size(4)
        .seed(SEED)
        .random_resized_crop(crop)
}

/// Each sample's pixels in one replica's epoch, from `start`.
/// Checks that `px` is window `w` of a ramp scaled to the square; returns the pixels checked.
fn assert_window(px: &[u8], w: CropWindow, what: &str) -> usize {
    let mut checked = 0;
    let (sx, sy) = (
        f64::from(w.width) / f64::from(SIDE),
        f64::from(w.height) / f64::from(SIDE),
    );
    for v in 0..SIDE as usize {
        for u in 0..SIDE as usize {
            // The source point this output pixel centre maps to; bilinear is exact on
            // a ramp away from the borders, where the filter's support is clamped.
            let x = f64::from(w.x) + (u as f64 + 0.5) * sx - 0.5;
            let y = f64::from(w.y) + (v as f64 + 0.5) * sy - 0.5;
            if !(0.0..=f64::from(SIDE - 1)).contains(&x)
                || !(0.0..=f64::from(SIDE - 1)).contains(&y)
            {
                continue;
            }
            let at = (v * SIDE as usize + u) * 3;
            let (red, green) = (f64::from(px[at]), f64::from(px[at + 1]));
            // Tolerance: 8 levels per source pixel, so 2.5 levels is a third of a
            // pixel (rounding of the u8 result and of the filter's fixed point).
            assert!(
                (red - 8.0 * x).abs() <= 2.5 && (green - 8.0 * y).abs() <= 2.5,
                "{what} window {w:?} pixel ({u},{v}): \
                         got ({red},{green}), expected ({:.1},{:.1})",
                8.0 * x,
                8.0 * y
            );
            checked += 1;
        }
    }
    checked
}

#[test]
fn each_image_is_its_drawn_window_scaled_to_the_square() {
    let r = ramps(12);
    let crop = RandomResizedCrop::with_min_scale(0.2);
    let p = builder(&r, Some(crop)).build().unwrap();
    let mut checked = 0;
    for epoch in 0..2 {
        for (id, px) in pixels_by_id(&p, epoch, 0, 0) {
            let w = crop.window(SEED, epoch, id, SIDE);
            assert_ne!(w, CropWindow::full(SIDE), "sample {id} epoch {epoch}");
            checked += assert_window(&px, w, &format!("sample {id} epoch {epoch}"));
            assert_eq!(px[2], (id * 10) as u8, "blue is constant per image");
        }
    }
    assert!(checked > 12 * 2 * 400, "only {checked} pixels checked");
}

#[test]
fn windows_depend_on_seed_epoch_and_sample_only() {
    let r = ramps(10);
    let crop = Some(RandomResizedCrop::DEFAULT);
    let one = builder(&r, crop).build().unwrap();
    let reference = pixels_by_id(&one, 3, 0, 0);
    assert_eq!(reference.len(), 10);
    // A second epoch crops differently.
    let next = pixels_by_id(&one, 4, 0, 0);
    let same = reference.iter().filter(|(id, px)| next[id] == **px).count();
    assert!(same <= 2, "{same} of 10 images cropped alike in two epochs");
    // Two replicas, another worker count, a resumed epoch and no cache at all: the same
    // pixels for every sample.
    let two = builder(&r, crop)
        .replicas(2)
        .batch_size(2)
        .workers(1)
        .build()
        .unwrap();
    let mut split = pixels_by_id(&two, 3, 0, 0);
    split.extend(pixels_by_id(&two, 3, 1, 0));
    assert_eq!(split, reference);
    let resumed = pixels_by_id(&one, 3, 0, 1);
    assert_eq!(resumed.len(), 6);
    assert!(resumed.iter().all(|(id, px)| reference[id] == *px));
    let uncached = builder(&r, crop).cache(false).build().unwrap();
    assert_eq!(pixels_by_id(&uncached, 3, 0, 0), reference);
}

#[test]
fn the_cache_keeps_the_whole_squares() {
    let r = ramps(6);
    let cropped = builder(&r, Some(RandomResizedCrop::DEFAULT))
        .build()
        .unwrap();
    pixels_by_id(&cropped, 0, 0, 0);
    assert_eq!(cropped.stats().decoded, 6);
    drop(cropped);
    let plain = builder(&r, None).build().unwrap();
    let stored = pixels_by_id(&plain, 0, 0, 0);
    assert_eq!(plain.stats().decoded, 0, "{:?}", plain.stats());
    for (id, px) in stored {
        let want = image::RgbImage::from_fn(SIDE, SIDE, |x, y| {
            image::Rgb([(8 * x) as u8, (8 * y) as u8, (id * 10) as u8])
        });
        assert_eq!(px, want.into_raw(), "sample {id}");
    }
}

#[test]
fn a_centre_crop_is_the_same_window_of_every_image_cached_or_not() {
    let r = ramps(5);
    let window = CropWindow::centered(SIDE, 0.75);
    for cached in [true, false] {
        let p = builder(&r, None)
            .center_crop(Some(0.75))
            .cache(cached)
            .shuffle(false)
            .build()
            .unwrap();
        for epoch in 0..2 {
            for (id, px) in pixels_by_id(&p, epoch, 0, 0) {
                let what = format!("sample {id} epoch {epoch} cached {cached}");
                assert!(assert_window(&px, window, &what) > 400, "{what}");
            }
        }
    }
    let err = builder(&r, Some(RandomResizedCrop::DEFAULT))
        .center_crop(Some(0.875))
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("one crop"), "{err}");
    let err = builder(&r, None)
        .center_crop(Some(0.0))
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("--crop-pct"), "{err}");
}

#[test]
fn an_impossible_crop_is_refused_naming_the_flag() {
    let r = ramps(2);
    let err = builder(&r, Some(RandomResizedCrop::with_min_scale(0.0)))
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("--crop-scale"), "{err}");
}
