//! Scanning: clear errors for unusable datasets, class mapping across splits, the flat
//! layout's seeded valid split.

use crate::common;

use std::collections::HashSet;

use common::{collect, synth};
use pipeline::{DatasetSource, PipelineBuilder, PipelineError, Split};

#[test]
fn a_missing_data_directory_is_a_clear_error() {
    let cache = tempfile::tempdir().unwrap();
    let err = PipelineBuilder::new(DatasetSource::folder("/definitely/not/here"))
        .cache_dir(cache.path())
        .build()
        .unwrap_err();
    assert!(
        matches!(&err, PipelineError::MissingDir { path, .. } if path.ends_with("here")),
        "{err:?}"
    );
    assert!(err.to_string().contains("/definitely/not/here"));
}

#[test]
fn a_missing_split_is_a_clear_error() {
    let fx = synth(2, 2, 0); // no test split
    let err = fx.builder().split(Split::Test).build().unwrap_err();
    assert!(
        matches!(&err, PipelineError::MissingDir { path, .. } if path.ends_with("test")),
        "{err:?}"
    );
}

#[test]
fn an_empty_split_is_a_clear_error() {
    let fx = synth(2, 2, 0);
    std::fs::create_dir_all(fx.root().join("test")).unwrap();
    let err = fx.builder().split(Split::Test).build().unwrap_err();
    assert!(
        matches!(&err, PipelineError::EmptySplit { split, .. } if split == "test"),
        "{err:?}"
    );
}

#[test]
fn a_class_folder_without_files_is_a_clear_error() {
    let fx = synth(2, 2, 0);
    let dir = fx.root().join("train/class_02");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("empty.jpg"), b"").unwrap();
    std::fs::write(dir.join(".hidden.jpg"), b"x").unwrap();
    let err = fx.builder().build().unwrap_err();
    assert!(
        matches!(&err, PipelineError::ClassWithoutImages { class, .. } if class == "class_02"),
        "{err:?}"
    );
}

#[test]
fn a_class_whose_files_all_fail_to_decode_is_a_clear_error() {
    let fx = synth(2, 3, 0);
    let dir = fx.root().join("train/class_02");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("a.jpg"), b"not an image at all").unwrap();
    std::fs::write(dir.join("b.jpg"), b"\xff\xd8\xff garbage").unwrap();
    let p = fx.builder().batch_size(4).build().unwrap();
    let err = p
        .epoch(0, 0, 0)
        .unwrap()
        .find_map(|r| r.err())
        .expect("an error");
    assert!(
        matches!(&err, PipelineError::ClassWithoutImages { class, .. } if class == "class_02"),
        "{err:?}"
    );
    // Later epochs refuse to start.
    assert!(p.epoch(1, 0, 0).is_err());
}

#[test]
fn a_dataset_where_every_image_is_bad_is_a_clear_error() {
    let data = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    // One class, so "the class has no readable image" and "no image is readable" coincide
    // and the error is deterministic: it names the whole dataset.
    let dir = data.path().join("train").join("a");
    std::fs::create_dir_all(&dir).unwrap();
    for i in 0..6 {
        std::fs::write(dir.join(format!("{i}.jpg")), format!("junk {i}")).unwrap();
    }
    let p = PipelineBuilder::new(DatasetSource::folder(data.path()))
        .cache_dir(cache.path())
        .image_size(8)
        .batch_size(2)
        .build()
        .unwrap();
    let results: Vec<_> = p.epoch(0, 0, 0).unwrap().collect();
    assert!(results[..results.len() - 1]
        .iter()
        .all(|r| r.as_ref().is_ok_and(|b| b.len == 0)));
    let err = results
        .into_iter()
        .last()
        .unwrap()
        .expect_err("the epoch ends with an error");
    assert!(
        matches!(err, PipelineError::AllImagesBad { bad: 6, .. }),
        "{err:?}"
    );
    // The next epoch refuses to start, and so does a new pipeline on the same cache.
    let err = p.epoch(1, 0, 0).unwrap_err();
    assert!(
        matches!(err, PipelineError::AllImagesBad { bad: 6, .. }),
        "{err:?}"
    );
    drop(p);
    let p2 = PipelineBuilder::new(DatasetSource::folder(data.path()))
        .cache_dir(cache.path())
        .image_size(8)
        .build()
        .unwrap();
    assert!(matches!(
        p2.epoch(0, 0, 0),
        Err(PipelineError::AllImagesBad { bad: 6, .. })
    ));
}

#[test]
fn a_valid_class_missing_from_train_is_an_error_naming_it() {
    let fx = synth(2, 2, 2);
    let src = fx.root().join("valid/class_01");
    let dst = fx.root().join("valid/class_zz");
    std::fs::create_dir_all(&dst).unwrap();
    for f in common::files_under(&src) {
        std::fs::copy(&f, dst.join(f.file_name().unwrap())).unwrap();
    }
    let err = fx.builder().split(Split::Valid).build().unwrap_err();
    assert!(
        matches!(&err, PipelineError::UnknownClass { class, .. } if class == "class_zz"),
        "{err:?}"
    );
    assert!(err.to_string().contains("class_zz"));
}

#[test]
fn valid_uses_the_class_index_of_train() {
    let fx = synth(3, 2, 2);
    // valid lacks class_00: class_01 must keep label 1.
    std::fs::remove_dir_all(fx.root().join("valid/class_00")).unwrap();
    let p = fx
        .builder()
        .split(Split::Valid)
        .shuffle(false)
        .batch_size(8)
        .build()
        .unwrap();
    assert_eq!(p.classes(), ["class_00", "class_01", "class_02"]);
    let labels: Vec<u32> = collect(&p, 0, 0, 0)
        .into_iter()
        .flat_map(|b| b.labels)
        .collect();
    assert_eq!(labels, vec![1, 1, 2, 2]);
}

fn flat_fixture() -> (tempfile::TempDir, tempfile::TempDir) {
    let fx = synth(3, 20, 0);
    // Move train/<class> up to <root>/<class>: the flat layout.
    let flat = tempfile::tempdir().unwrap();
    for class in ["class_00", "class_01", "class_02"] {
        std::fs::rename(fx.root().join("train").join(class), flat.path().join(class)).unwrap();
    }
    (flat, fx.cache)
}

#[test]
fn the_flat_layout_split_is_stable_for_a_seed_and_partitions_the_files() {
    let (flat, cache) = flat_fixture();
    let build = |split, seed| {
        PipelineBuilder::new(DatasetSource::flat(flat.path(), 0.25))
            .split(split)
            .seed(seed)
            .image_size(8)
            .cache_dir(cache.path())
            .build()
            .unwrap()
    };
    let files = |p: &pipeline::Pipeline| -> HashSet<std::path::PathBuf> {
        (0..p.len() as u64)
            .map(|i| p.sample_path(i).unwrap().to_path_buf())
            .collect()
    };
    let train = files(&build(Split::Train, 1));
    let valid = files(&build(Split::Valid, 1));
    assert!(train.is_disjoint(&valid));
    assert_eq!(
        train.len() + valid.len(),
        60,
        "the splits partition the files"
    );
    assert_eq!(valid.len(), 15, "a quarter of each class's 20 files");
    // Stable: the same seed gives the same split, another seed another one.
    assert_eq!(files(&build(Split::Valid, 1)), valid);
    assert_ne!(files(&build(Split::Valid, 2)), valid);
    // Adding a file moves at most one other file between the splits.
    std::fs::copy(
        flat.path().join("class_00/train_00000.png"),
        flat.path().join("class_00/zz_new.png"),
    )
    .unwrap();
    let after = files(&build(Split::Valid, 1));
    assert!(valid.difference(&after).count() <= 1 && after.len() <= valid.len() + 1);
    assert!(matches!(
        build_err(flat.path(), cache.path()),
        PipelineError::InvalidSetting { .. }
    ));
}

fn build_err(root: &std::path::Path, cache: &std::path::Path) -> PipelineError {
    PipelineBuilder::new(DatasetSource::flat(root, 0.25))
        .split(Split::Test)
        .cache_dir(cache)
        .build()
        .unwrap_err()
}

/// `caf\xE9` (Latin-1 "café"): a folder name that is not UTF-8.
fn latin1_name() -> std::ffi::OsString {
    use std::os::unix::ffi::OsStringExt;
    std::ffi::OsString::from_vec(b"caf\xE9".to_vec())
}

#[test]
fn a_class_folder_whose_name_is_not_utf8_is_read() {
    let fx = synth(2, 3, 2);
    for split in ["train", "valid"] {
        let dir = fx.root().join(split);
        std::fs::rename(dir.join("class_01"), dir.join(latin1_name())).unwrap();
    }
    // A file name that is not UTF-8 inside it, too.
    let class_dir = fx.root().join("train").join(latin1_name());
    use std::os::unix::ffi::OsStringExt;
    std::fs::rename(
        class_dir.join("train_00002.png"),
        class_dir.join(std::ffi::OsString::from_vec(b"p\xF6\xF6.png".to_vec())),
    )
    .unwrap();
    for (split, images) in [(Split::Train, 6), (Split::Valid, 4)] {
        let p = fx
            .builder()
            .split(split)
            .shuffle(false)
            .batch_size(8)
            .build()
            .unwrap();
        assert_eq!(p.classes(), ["caf\u{FFFD}", "class_00"]);
        let batches = collect(&p, 0, 0, 0);
        let labels: Vec<u32> = batches.iter().flat_map(|b| b.labels.clone()).collect();
        assert_eq!(labels.len(), images, "{split}: every image is served");
        assert_eq!(labels.iter().filter(|&&l| l == 0).count(), images / 2);
        assert!(p.bad_files().is_empty(), "{:?}", p.bad_files());
    }
}

#[test]
fn two_class_folders_equal_but_for_non_utf8_bytes_are_refused() {
    use std::os::unix::ffi::OsStringExt;
    let fx = synth(2, 2, 0);
    let train = fx.root().join("train");
    std::fs::rename(train.join("class_00"), train.join(latin1_name())).unwrap();
    std::fs::rename(
        train.join("class_01"),
        train.join(std::ffi::OsString::from_vec(b"caf\xE8".to_vec())),
    )
    .unwrap();
    let err = fx.builder().build().unwrap_err();
    assert!(
        matches!(&err, PipelineError::ClassNameClash { .. }),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains("caf\\xE9") && text.contains("caf\\xE8") && text.contains("rename"),
        "{text}"
    );
}

#[test]
fn a_flat_dataset_with_a_non_utf8_class_folder_is_read() {
    let (flat, cache) = flat_fixture();
    std::fs::rename(
        flat.path().join("class_02"),
        flat.path().join(latin1_name()),
    )
    .unwrap();
    let p = PipelineBuilder::new(DatasetSource::flat(flat.path(), 0.25))
        .image_size(8)
        .cache_dir(cache.path())
        .build()
        .unwrap();
    assert_eq!(p.classes(), ["caf\u{FFFD}", "class_00", "class_01"]);
    let served: usize = collect(&p, 0, 0, 0).iter().map(|b| b.ids.len()).sum();
    assert_eq!(served, p.len());
}
