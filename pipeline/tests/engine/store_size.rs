//! `PipelineBuilder::store_size`: the cache keeps squares larger than the images handed out,
//! and every image is a window of its stored square (the whole square, the random resized
//! crop or the centre crop) scaled to the image size; the pixels do not depend on whether
//! they came from the cache or the file, and each store size has its own cache.

use crate::common;
use common::pixels_by_id;

use pipeline::{CropWindow, PipelineBuilder, RandomResizedCrop, Split};

use common::Listed;

/// The files' side, which is also the store's: the stored square is the file unchanged.
const STORED: u32 = 48;
/// The side of the images handed out.
const IMAGE: u32 = 24;
/// Levels per source pixel of the ramps (47 · 5 = 235 fits a byte).
const SLOPE: f64 = 5.0;
const SEED: u64 = 4;

/// Images whose red channel is 5·x and green 5·y (linear ramps, which bilinear scaling keeps
/// linear) and whose blue is the sample's own level.
fn ramps(count: usize) -> Listed {
    common::listed(count, STORED, 2, |i, x, y| {
        image::Rgb([(5 * x) as u8, (5 * y) as u8, (i * 20) as u8])
    })
}

fn builder(r: &Listed) -> PipelineBuilder {
    PipelineBuilder::new(r.source())
        .split(Split::Train)
        .image_size(IMAGE)
        .store_size(Some(STORED))
        .cache_dir(r.cache.path())
        .workers(2)
        .batch_size(4)
        .seed(SEED)
}

/// Checks that `px` (`IMAGE`² pixels) is window `w` of a `STORED`² ramp scaled to `IMAGE`;
/// returns how many pixels were checked.
fn assert_window(px: &[u8], w: CropWindow, what: &str) -> usize {
    let (sx, sy) = (
        f64::from(w.width) / f64::from(IMAGE),
        f64::from(w.height) / f64::from(IMAGE),
    );
    // A downscaling filter reaches `scale` source pixels to each side: keep that far from
    // the borders, where its support is clamped and the ramp is no longer exact.
    let margin = sx.max(sy).max(1.0);
    let inside = |c: f64| c >= margin - 1.0 && c <= f64::from(STORED) - margin;
    let mut checked = 0;
    for v in 0..IMAGE as usize {
        for u in 0..IMAGE as usize {
            let x = f64::from(w.x) + (u as f64 + 0.5) * sx - 0.5;
            let y = f64::from(w.y) + (v as f64 + 0.5) * sy - 0.5;
            if !inside(x) || !inside(y) {
                continue;
            }
            let at = (v * IMAGE as usize + u) * 3;
            let (red, green) = (f64::from(px[at]), f64::from(px[at + 1]));
            // Tolerance: 5 levels per source pixel, so 2 levels is 0.4 of a pixel (the u8
            // rounding and the filter's fixed point).
            assert!(
                (red - SLOPE * x).abs() <= 2.0 && (green - SLOPE * y).abs() <= 2.0,
                "{what} window {w:?} pixel ({u},{v}): got ({red},{green}), expected ({:.1},{:.1})",
                SLOPE * x,
                SLOPE * y
            );
            checked += 1;
        }
    }
    checked
}

#[test]
fn each_image_is_its_whole_stored_square_scaled_down() {
    let r = ramps(6);
    let p = builder(&r).build().unwrap();
    assert_eq!((p.image_size(), p.store_size()), (IMAGE, STORED));
    let first = pixels_by_id(&p, 0, 0, 0);
    assert_eq!(first.len(), 6);
    for (id, px) in &first {
        let checked = assert_window(px, CropWindow::full(STORED), &format!("sample {id}"));
        assert!(checked >= 20 * 20, "only {checked} pixels checked");
        assert_eq!(px[2], (*id * 20) as u8, "blue is the sample's own");
    }
    // The second epoch comes from the cache, which holds the 48-pixel squares themselves.
    let second = pixels_by_id(&p, 1, 0, 0);
    assert_eq!(p.stats().decoded, 6, "{:?}", p.stats());
    assert_eq!(second, first);
    drop(p);
    let stored = builder(&r).image_size(STORED).build().unwrap();
    assert_eq!(stored.store_size(), STORED);
    for (id, px) in pixels_by_id(&stored, 0, 0, 0) {
        let want = image::RgbImage::from_fn(STORED, STORED, |x, y| {
            image::Rgb([(5 * x) as u8, (5 * y) as u8, (id * 20) as u8])
        });
        assert_eq!(px, want.into_raw(), "sample {id}: the stored square");
    }
    assert_eq!(stored.stats().decoded, 0, "{:?}", stored.stats());
}

#[test]
fn the_random_crop_is_drawn_on_the_stored_square() {
    let r = ramps(8);
    let crop = RandomResizedCrop::with_min_scale(0.15);
    let mut checked = 0;
    let mut by_cache = Vec::new();
    for cached in [true, false] {
        let p = builder(&r)
            .random_resized_crop(Some(crop))
            .cache(cached)
            .build()
            .unwrap();
        for epoch in 0..2 {
            let pixels = pixels_by_id(&p, epoch, 0, 0);
            for (id, px) in &pixels {
                let w = crop.window(SEED, epoch, *id, STORED);
                let what = format!("sample {id} epoch {epoch} cached {cached}");
                checked += assert_window(px, w, &what);
            }
            by_cache.push(pixels);
        }
    }
    assert!(checked >= 2 * 2 * 8 * 250, "only {checked} pixels checked");
    assert_eq!(
        by_cache[0], by_cache[2],
        "epoch 0: cached and uncached differ"
    );
    assert_eq!(
        by_cache[1], by_cache[3],
        "epoch 1: cached and uncached differ"
    );
}

#[test]
fn the_centre_crop_is_a_share_of_the_stored_side() {
    let r = ramps(5);
    // torchvision's evaluation: the centred 24 of a 48 store is the image at scale 1.
    let window = CropWindow::centered(STORED, 0.5);
    assert_eq!(window.width, IMAGE);
    for cached in [true, false] {
        let p = builder(&r)
            .center_crop(Some(0.5))
            .cache(cached)
            .shuffle(false)
            .build()
            .unwrap();
        for epoch in 0..2 {
            for (id, px) in pixels_by_id(&p, epoch, 0, 0) {
                let what = format!("sample {id} epoch {epoch} cached {cached}");
                assert_eq!(
                    assert_window(&px, window, &what),
                    (IMAGE * IMAGE) as usize,
                    "{what}"
                );
            }
        }
    }
}

#[test]
fn each_store_size_has_its_own_cache() {
    let r = ramps(4);
    let large = builder(&r).build().unwrap();
    let from_large = pixels_by_id(&large, 0, 0, 0);
    drop(large);
    let small = builder(&r).store_size(None).build().unwrap();
    assert_eq!(small.store_size(), IMAGE);
    let from_small = pixels_by_id(&small, 0, 0, 0);
    assert_eq!(
        small.stats().decoded,
        4,
        "the 48-pixel records were not reused"
    );
    assert_eq!(from_small.len(), 4);
    // One 48 → 24 resize either way: from the file, or from the 48-pixel stored square.
    assert_eq!(from_small, from_large);
    let caches = std::fs::read_dir(r.cache.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "bcache"))
        .count();
    assert_eq!(caches, 2, "one cache file per store size");
    // Another image size cut from the same store reads the same records, and the data
    // fingerprint (which a checkpoint compares) follows the image size, not the store.
    let other = builder(&r).image_size(16).build().unwrap();
    pixels_by_id(&other, 0, 0, 0);
    assert_eq!(other.stats().decoded, 0, "{:?}", other.stats());
    let large = builder(&r).build().unwrap();
    assert_eq!(large.fingerprint(), small.fingerprint());
    assert_ne!(large.fingerprint(), other.fingerprint());
}

#[test]
fn a_store_smaller_than_the_image_is_refused_naming_the_flag() {
    let r = ramps(2);
    let err = builder(&r).store_size(Some(IMAGE - 1)).build().unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("--store-size") && text.contains("23"),
        "{text}"
    );
    let err = builder(&r).store_size(Some(9000)).build().unwrap_err();
    assert!(err.to_string().contains("--store-size"), "{err}");
}
