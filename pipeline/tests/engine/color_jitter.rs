//! `PipelineBuilder::color_jitter`: every image handed out is its unjittered image (after the
//! crop, if any) with the draw of `(seed, epoch, sample id)` applied, whatever the workers,
//! replicas or cache; the cache keeps the colours as decoded; the time spent after the cache
//! is counted.

use crate::common;
use common::pixels_by_id;

use pipeline::{ColorJitter, PipelineBuilder, RandomResizedCrop};

use common::Listed;

const SIDE: u32 = 24;
const SEED: u64 = 12;

fn images(count: usize) -> Listed {
    common::colourful(count, SIDE)
}

fn builder(im: &Listed) -> PipelineBuilder {
    im.train_builder(SIDE, SEED)
}

#[test]
fn each_image_is_its_plain_image_with_its_draw_applied() {
    let im = images(10);
    for (jitter, crop) in [
        (ColorJitter::uniform(0.4), None),
        (
            ColorJitter::uniform(0.4),
            Some(RandomResizedCrop::with_min_scale(0.3)),
        ),
        (ColorJitter::uniform(0.4).with_hue(0.1), None),
        (ColorJitter::uniform(0.0).with_hue(0.3), None),
    ] {
        let plain = builder(&im).random_resized_crop(crop).build().unwrap();
        let jittered = builder(&im)
            .random_resized_crop(crop)
            .color_jitter(Some(jitter))
            .build()
            .unwrap();
        for epoch in 0..2 {
            let before = pixels_by_id(&plain, epoch, 0, 0);
            let after = pixels_by_id(&jittered, epoch, 0, 0);
            assert_eq!(after.len(), 10);
            let mut changed = 0;
            for (id, px) in &after {
                let mut want = before[id].clone();
                jitter.draw(SEED, epoch, *id).apply(&mut want);
                assert_eq!(
                    *px, want,
                    "sample {id} epoch {epoch} crop {crop:?} {jitter:?}"
                );
                changed += usize::from(*px != before[id]);
            }
            assert!(changed >= 9, "only {changed} of 10 images changed");
        }
    }
}

#[test]
fn the_jitter_depends_on_seed_epoch_and_sample_only() {
    let im = images(8);
    let jitter = Some(ColorJitter::uniform(0.5));
    let one = builder(&im).color_jitter(jitter).build().unwrap();
    let reference = pixels_by_id(&one, 2, 0, 0);
    let other_epoch = pixels_by_id(&one, 3, 0, 0);
    assert!(reference.iter().all(|(id, px)| other_epoch[id] != *px));
    let two = builder(&im)
        .color_jitter(jitter)
        .replicas(2)
        .batch_size(2)
        .workers(1)
        .build()
        .unwrap();
    let mut split = pixels_by_id(&two, 2, 0, 0);
    split.extend(pixels_by_id(&two, 2, 1, 0));
    assert_eq!(split, reference);
    let uncached = builder(&im)
        .color_jitter(jitter)
        .cache(false)
        .build()
        .unwrap();
    assert_eq!(pixels_by_id(&uncached, 2, 0, 0), reference);
}

#[test]
fn the_cache_keeps_the_decoded_colours_and_the_work_after_it_is_counted() {
    let im = images(6);
    let jittered = builder(&im)
        .color_jitter(Some(ColorJitter::uniform(0.4)))
        .build()
        .unwrap();
    pixels_by_id(&jittered, 0, 0, 0);
    pixels_by_id(&jittered, 1, 0, 0);
    let stats = jittered.stats();
    assert_eq!((stats.decoded, stats.cache_hits), (6, 6), "{stats:?}");
    assert!(stats.transform_seconds > 0.0, "{stats:?}");
    drop(jittered);
    let plain = builder(&im).build().unwrap();
    for (id, px) in pixels_by_id(&plain, 0, 0, 0) {
        let path = &im.files[id as usize].0;
        let want = image::open(path).unwrap().to_rgb8().into_raw();
        assert_eq!(px, want, "sample {id}: the cache holds the file's colours");
    }
    let stats = plain.stats();
    assert_eq!(stats.decoded, 0, "{stats:?}");
    assert_eq!(stats.transform_seconds, 0.0, "a copy is no work: {stats:?}");
}

#[test]
fn an_impossible_jitter_is_refused_naming_the_flag() {
    let im = images(2);
    let err = builder(&im)
        .color_jitter(Some(ColorJitter::uniform(-0.2)))
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("--color-jitter"), "{err}");
}
