//! `--valid-fraction` (issue 34): round(F × n) of each class's n files held out, the same for
//! a flat folder and a CSV file listing it; a class left without a training image is refused
//! naming it; the split of version 1 (each file drawn on its own) stays available for the
//! runs that trained with it. And what the engine records of each file's contents, and
//! where it refuses to write.

use crate::common;

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use common::{collect, files_under, synth};
use pipeline::{DatasetSource, PipelineBuilder, PipelineError, Split, SplitRule};

/// A flat `<root>/class_0k/` dataset whose classes hold `sizes[k]` PNGs each.
fn flat(sizes: &[usize]) -> (tempfile::TempDir, tempfile::TempDir) {
    let most = *sizes.iter().max().unwrap();
    let fx = synth(sizes.len(), most, 0);
    let flat = tempfile::tempdir().unwrap();
    for (k, &n) in sizes.iter().enumerate() {
        let class = format!("class_{k:02}");
        let dir = flat.path().join(&class);
        std::fs::rename(fx.root().join("train").join(&class), &dir).unwrap();
        for extra in files_under(&dir).into_iter().skip(n) {
            std::fs::remove_file(extra).unwrap();
        }
    }
    (flat, fx.cache)
}

fn build(source: DatasetSource, split: Split, cache: &Path) -> pipeline::Pipeline {
    PipelineBuilder::new(source)
        .split(split)
        .seed(11)
        .image_size(8)
        .cache_dir(cache)
        .workers(1)
        .build()
        .unwrap()
}

/// The split's files and how many of each class (by folder name).
fn split_files(p: &pipeline::Pipeline) -> (HashSet<PathBuf>, BTreeMap<String, usize>) {
    let mut files = HashSet::new();
    let mut per_class = BTreeMap::new();
    for i in 0..p.len() as u64 {
        let path = p.sample_path(i).unwrap().to_path_buf();
        let class = path.parent().unwrap().file_name().unwrap();
        *per_class
            .entry(class.to_string_lossy().into_owned())
            .or_insert(0) += 1;
        files.insert(path);
    }
    (files, per_class)
}

/// A CSV at the flat root listing every file of it (absolute paths, no split column).
fn csv_of(root: &Path) -> PathBuf {
    let mut text = String::from("filepaths,labels\n");
    for f in files_under(root) {
        let class = f.parent().unwrap().file_name().unwrap().to_str().unwrap();
        text += &format!("{},{class}\n", f.display());
    }
    let csv = root.join("list.csv");
    std::fs::write(&csv, text).unwrap();
    csv
}

#[test]
fn each_class_holds_out_the_rounded_share_of_its_files_in_a_folder_and_a_csv() {
    let sizes = [2, 3, 7, 13];
    let (root, cache) = flat(&sizes);
    let csv = csv_of(root.path());
    // (F, held out of each class): round(F × n), at least one of two or more.
    let cases: [(f32, [usize; 4]); 4] = [
        (0.1, [1, 1, 1, 1]),
        (0.2, [1, 1, 1, 3]),
        (0.25, [1, 1, 2, 3]),
        (0.5, [1, 2, 4, 7]),
    ];
    for (f, held) in cases {
        let (valid, per_class) = split_files(&build(
            DatasetSource::flat(root.path(), f),
            Split::Valid,
            cache.path(),
        ));
        let want: BTreeMap<String, usize> = held
            .iter()
            .enumerate()
            .map(|(k, &h)| (format!("class_{k:02}"), h))
            .collect();
        assert_eq!(per_class, want, "flat, F {f}");
        let (train, train_per_class) = split_files(&build(
            DatasetSource::flat(root.path(), f),
            Split::Train,
            cache.path(),
        ));
        assert!(train.is_disjoint(&valid), "F {f}");
        for (k, &n) in sizes.iter().enumerate() {
            assert_eq!(
                train_per_class[&format!("class_{k:02}")],
                n - held[k],
                "F {f}"
            );
        }
        // The CSV listing the same files (paths relative to the same folder) holds out the
        // same files.
        let (listed, listed_per_class) = split_files(&build(
            DatasetSource::csv(&csv, Some(f)),
            Split::Valid,
            cache.path(),
        ));
        assert_eq!(listed_per_class, want, "csv, F {f}");
        assert_eq!(listed, valid, "csv, F {f}");
    }
}

#[test]
fn a_file_added_to_a_class_moves_at_most_one_file_between_the_splits() {
    let (root, cache) = flat(&[9, 9]);
    for f in [0.2f32, 0.5] {
        let (before, _) = split_files(&build(
            DatasetSource::flat(root.path(), f),
            Split::Valid,
            cache.path(),
        ));
        let added = root.path().join(format!("class_00/added_{f}.png"));
        std::fs::copy(root.path().join("class_00/train_00000.png"), &added).unwrap();
        let (after, _) = split_files(&build(
            DatasetSource::flat(root.path(), f),
            Split::Valid,
            cache.path(),
        ));
        let left = before.difference(&after).count();
        let came: Vec<_> = after.difference(&before).filter(|p| **p != added).collect();
        assert!(left + came.len() <= 1, "F {f}: {left} left, {came:?} came");
    }
}

#[test]
fn version_one_still_draws_each_file_on_its_own() {
    let (root, cache) = flat(&[20, 20, 20]);
    let old = |seed| {
        let p = PipelineBuilder::new(
            DatasetSource::flat(root.path(), 0.2).with_split_rule(SplitRule::PerFileDraw),
        )
        .split(Split::Valid)
        .seed(seed)
        .image_size(8)
        .cache_dir(cache.path())
        .build()
        .unwrap();
        split_files(&p).1
    };
    // The coin: over a few seeds the counts are not all the rounded share (4 of 20).
    let counts: Vec<BTreeMap<String, usize>> = (0..6).map(old).collect();
    assert!(
        counts.iter().flat_map(|c| c.values()).any(|&n| n != 4),
        "{counts:?}"
    );
    let new = build(
        DatasetSource::flat(root.path(), 0.2),
        Split::Valid,
        cache.path(),
    );
    assert!(split_files(&new).1.values().all(|&n| n == 4));
}

#[test]
fn a_class_with_no_training_image_after_the_split_is_refused_naming_it() {
    let (root, cache) = flat(&[2, 5]);
    let csv = csv_of(root.path());
    for source in [
        DatasetSource::flat(root.path(), 0.9),
        DatasetSource::csv(&csv, Some(0.9)),
    ] {
        let err = PipelineBuilder::new(source.clone())
            .split(Split::Train)
            .image_size(8)
            .cache_dir(cache.path())
            .build()
            .unwrap_err();
        assert!(
            matches!(&err, PipelineError::ClassWithoutTrainingImages { class, held: 2, files: 2, .. } if class == "class_00"),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains("class_00") && text.contains("--valid-fraction 0.9"),
            "{text}"
        );
    }
    // With a share that leaves one, it trains.
    let p = build(
        DatasetSource::flat(root.path(), 0.4),
        Split::Train,
        cache.path(),
    );
    assert_eq!(split_files(&p).1["class_00"], 1);
}

#[test]
fn the_engine_knows_each_files_content_hash_once_read_and_from_a_warm_cache() {
    let fx = synth(2, 3, 0);
    let builder = || fx.builder().split(Split::Train).batch_size(2);
    let p = builder().build().unwrap();
    assert!(
        p.files().iter().all(|f| f.content.is_none()),
        "nothing read yet"
    );
    collect(&p, 0, 0, 0);
    let files = p.files();
    for (i, f) in files.iter().enumerate() {
        let path = p.sample_path(i as u64).unwrap();
        assert_eq!(f.content, Some(pipeline::hash_file(path).unwrap()));
        assert_eq!(f.size, std::fs::metadata(path).unwrap().len());
    }
    drop(p);
    // Another engine on the warm cache decodes nothing and still knows every hash.
    let warm = builder().build().unwrap();
    assert_eq!(warm.files(), files);
    collect(&warm, 1, 0, 0);
    assert_eq!(warm.stats().decoded, 0);
    assert_eq!(warm.files(), files);
}

#[test]
fn a_report_or_cache_folder_inside_the_dataset_is_refused_before_anything_is_written() {
    let (root, cache) = flat(&[3, 3]);
    let csv = csv_of(root.path());
    let inside = root.path().join("class_01").join("bad_files_train.txt");
    for source in [
        DatasetSource::flat(root.path(), 0.2),
        DatasetSource::csv(&csv, Some(0.2)),
    ] {
        let err = PipelineBuilder::new(source.clone())
            .image_size(8)
            .cache_dir(cache.path())
            .bad_files_report(&inside)
            .build()
            .unwrap_err();
        assert!(
            matches!(&err, PipelineError::WritesIntoDataset { .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("bad_files_train.txt"), "{err}");
        let err = PipelineBuilder::new(source)
            .image_size(8)
            .cache_dir(root.path().join("class_00/cache"))
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("cache folder"), "{err}");
    }
    assert!(!inside.exists());
    assert!(!root.path().join("class_00/cache").exists());
}
