//! `DatasetSource::list` and `DatasetSource::files`: image files named one by one (a
//! CSV-labelled dataset, files to classify) are read in the given order, with the same
//! pixels as the folder layout gives them, and missing or broken entries are bad files.

use crate::common;

use std::collections::HashMap;
use std::path::PathBuf;

use common::{collect, files_under, synth, Fixture};
use pipeline::{BadFileKind, DatasetSource, OnBadImage, PipelineBuilder, PipelineError, Split};

fn list_builder(fx: &Fixture, source: DatasetSource) -> PipelineBuilder {
    PipelineBuilder::new(source)
        .image_size(16)
        .cache_dir(fx.cache.path())
        .workers(2)
        .batch_size(3)
        .shuffle(false)
}

/// Pixel hash of every training file as the folder layout serves it.
fn folder_pixels(fx: &Fixture) -> HashMap<PathBuf, u64> {
    let p = fx.builder().batch_size(1).shuffle(false).build().unwrap();
    let mut out = HashMap::new();
    for b in p.epoch(0, 0, 0).unwrap() {
        let b = b.unwrap();
        let path = p.sample_path(b.sample_ids[0]).unwrap().to_path_buf();
        out.insert(path, xxhash_rust::xxh3::xxh3_64(b.pixels()));
    }
    out
}

#[test]
fn a_list_is_read_in_its_order_with_its_labels_and_the_folder_pixels() {
    let fx = synth(3, 3, 0);
    let expected = folder_pixels(&fx);
    let mut files = files_under(&fx.root().join("train"));
    files.reverse();
    // A repeated file is two samples; labels are the caller's, not the folder's.
    files.push(files[0].clone());
    let samples: Vec<(PathBuf, u32)> = files
        .iter()
        .enumerate()
        .map(|(i, f)| (f.clone(), (i % 2) as u32))
        .collect();
    let classes = vec!["even".to_string(), "odd".to_string()];
    let p = list_builder(&fx, DatasetSource::list(classes.clone(), samples.clone()))
        .split(Split::Valid)
        .build()
        .unwrap();
    assert_eq!(p.classes(), classes.as_slice());
    assert_eq!(p.len(), files.len());
    let batches = collect(&p, 0, 0, 0);
    let ids: Vec<u64> = batches.iter().flat_map(|b| b.ids.clone()).collect();
    assert_eq!(ids, (0..files.len() as u64).collect::<Vec<_>>());
    let labels: Vec<u32> = batches.iter().flat_map(|b| b.labels.clone()).collect();
    assert_eq!(labels, samples.iter().map(|s| s.1).collect::<Vec<_>>());
    for b in p.epoch(0, 0, 0).unwrap() {
        let b = b.unwrap();
        let record = 16 * 16 * 3;
        for (i, &id) in b.sample_ids.iter().enumerate() {
            let path = p.sample_path(id).unwrap();
            assert_eq!(path, files[id as usize]);
            let hash = xxhash_rust::xxh3::xxh3_64(&b.pixels()[i * record..(i + 1) * record]);
            assert_eq!(hash, expected[path], "{}", path.display());
        }
    }
    // The second epoch, and a second pipeline on the same list, read the cache.
    let before = p.stats().decoded;
    collect(&p, 1, 0, 0);
    assert_eq!(p.stats().decoded, before);
    drop(p);
    let again = list_builder(&fx, DatasetSource::list(classes, samples))
        .split(Split::Valid)
        .build()
        .unwrap();
    collect(&again, 0, 0, 0);
    assert_eq!(again.stats().decoded, 0, "{:?}", again.stats());
}

#[test]
fn missing_and_broken_files_are_bad_files_of_the_list() {
    let fx = synth(2, 2, 0);
    let good = files_under(&fx.root().join("train"));
    let missing = fx.root().join("no-such-image.png");
    let not_image = fx.root().join("notes.jpg");
    std::fs::write(&not_image, b"field notes, not a picture").unwrap();
    let mut paths = good.clone();
    paths.insert(1, missing.clone());
    paths.insert(3, not_image.clone());

    let p = list_builder(&fx, DatasetSource::files(paths.clone()))
        .build()
        .unwrap();
    assert_eq!(p.classes(), ["unlabelled".to_string()]);
    let seen: Vec<PathBuf> = collect(&p, 0, 0, 0)
        .iter()
        .flat_map(|b| b.ids.clone())
        .map(|id| p.sample_path(id).unwrap().to_path_buf())
        .collect();
    assert_eq!(seen, good, "the good files, in list order");
    let bad = p.bad_files();
    let kind_of = |path: &PathBuf| bad.iter().find(|b| &b.path == path).map(|b| b.kind);
    assert_eq!(kind_of(&missing), Some(BadFileKind::Unreadable), "{bad:?}");
    assert!(kind_of(&not_image).is_some(), "{bad:?}");
    assert_eq!(bad.len(), 2, "{bad:?}");

    // With `fail`, the first bad file of the list stops it, named.
    let err = list_builder(&fx, DatasetSource::files(paths))
        .on_bad_image(OnBadImage::Fail)
        .build()
        .and_then(|p| p.epoch(0, 0, 0)?.collect::<Result<Vec<_>, _>>().map(|_| ()))
        .unwrap_err();
    assert!(
        err.to_string().contains("no-such-image.png"),
        "the error names the file: {err}"
    );
}

#[test]
fn lists_that_cannot_work_are_refused_with_the_reason() {
    let fx = synth(2, 1, 0);
    let good = files_under(&fx.root().join("train"));

    let err = list_builder(&fx, DatasetSource::files(Vec::new()))
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("at least one image"), "{err}");

    let err = list_builder(
        &fx,
        DatasetSource::list(vec!["a".into()], vec![(good[0].clone(), 1)]),
    )
    .build()
    .unwrap_err();
    assert!(
        matches!(
            err,
            PipelineError::ListLabel {
                label: 1,
                classes: 1,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains(&*good[0].to_string_lossy()),
        "{err}"
    );

    // Nothing readable: refused at build time (missing files) or at the first batch
    // (files that do not decode), naming the first bad file either way.
    let missing = fx.root().join("gone.png");
    let err = list_builder(&fx, DatasetSource::files(vec![missing]))
        .build()
        .unwrap_err();
    assert!(
        matches!(err, PipelineError::ListAllBad { bad: 1, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("gone.png"), "{err}");
    let junk = fx.root().join("junk.png");
    std::fs::write(&junk, b"not a picture at all").unwrap();
    let p = list_builder(&fx, DatasetSource::files(vec![junk.clone(), junk]))
        .build()
        .unwrap();
    let err = p
        .epoch(0, 0, 0)
        .unwrap()
        .find_map(Result::err)
        .expect("an all-bad list fails");
    assert!(
        matches!(err, PipelineError::ListAllBad { bad: 2, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("junk.png"), "{err}");
}

/// `Sampling::Balanced` through the builder: 9 files of class 0 and 1 of class 1, epochs of
/// 10 draws with replacement in which the lone class-1 file comes up about half the time;
/// the pixels of a redrawn file are the same each time, and a resumed step sees the draws
/// of the uninterrupted epoch.
#[test]
fn balanced_sampling_draws_the_small_class_as_often_as_the_large_one() {
    let fx = synth(2, 9, 0);
    let big = files_under(&fx.root().join("train").join("class_00"));
    let small = files_under(&fx.root().join("train").join("class_01"))[0].clone();
    let mut list: Vec<(PathBuf, u32)> = big.into_iter().map(|p| (p, 0)).collect();
    list.push((small, 1));
    let classes = vec!["big".to_string(), "small".to_string()];
    let p = list_builder(&fx, DatasetSource::list(classes, list))
        .sampling(pipeline::Sampling::Balanced)
        .batch_size(1)
        .seed(3)
        .build()
        .unwrap();
    let mut small_draws = 0;
    let mut pixels_of = HashMap::new();
    for epoch in 0..20 {
        let batches = collect(&p, epoch, 0, 0);
        assert_eq!(batches.iter().map(|b| b.ids.len()).sum::<usize>(), 10);
        for b in &batches {
            small_draws += b.labels.iter().filter(|&&l| l == 1).count();
            let old = pixels_of.insert(b.ids[0], b.pixels_hash);
            assert!(old.is_none_or(|h| h == b.pixels_hash), "a redrawn file");
        }
        assert_eq!(collect(&p, epoch, 0, 7), batches[7..], "resumed at step 7");
    }
    // 200 fair-coin draws: 100 ± 30 is over 4 standard deviations.
    assert!((70..=130).contains(&small_draws), "{small_draws} of 200");
}
