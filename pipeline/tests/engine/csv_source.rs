//! `DatasetSource::csv`: a CSV file listing the images (the Kaggle birds CSV shape) gives the
//! same samples, classes and pixels as the folder layout it describes; bad CSVs are refused
//! naming the file and line.

use crate::common;

use std::path::Path;

use common::{collect, files_under, synth, Fixture};
use pipeline::{DatasetSource, PipelineBuilder, PipelineError, Split};

/// `filepaths,labels,data set` rows for every file of the fixture, relative to its root,
/// in reverse order (the CSV's order must not matter for classes), with extra columns.
fn kaggle_csv(fx: &Fixture) -> std::path::PathBuf {
    let mut text = String::from("class id,filepaths,labels,data set,scientific name\n");
    let mut files = files_under(fx.root());
    files.reverse();
    for f in files {
        let rel = f.strip_prefix(fx.root()).unwrap();
        let split = rel.iter().next().unwrap().to_str().unwrap();
        let class = rel.parent().unwrap().file_name().unwrap().to_str().unwrap();
        text += &format!("7,{},\"{class}\",{split},\"Aves, sp.\"\n", rel.display());
    }
    let csv = fx.root().join("birds.csv");
    std::fs::write(&csv, text).unwrap();
    csv
}

fn builder(fx: &Fixture, source: DatasetSource, split: Split) -> PipelineBuilder {
    PipelineBuilder::new(source)
        .split(split)
        .image_size(16)
        .cache_dir(fx.cache.path())
        .workers(2)
        .seed(42)
        .batch_size(4)
        .shuffle(false)
}

#[test]
fn a_kaggle_style_csv_is_the_folder_layout_it_lists() {
    let fx = synth(3, 4, 2);
    let csv = kaggle_csv(&fx);
    for split in [Split::Train, Split::Valid] {
        let folder = builder(&fx, DatasetSource::folder(fx.root()), split)
            .build()
            .unwrap();
        let listed = builder(&fx, DatasetSource::csv(&csv, None), split)
            .build()
            .unwrap();
        assert_eq!(listed.classes(), folder.classes());
        assert_eq!(listed.len(), folder.len());
        let mut a: Vec<_> = (0..folder.len() as u64)
            .map(|i| folder.sample_path(i).unwrap().to_path_buf())
            .collect();
        let mut b: Vec<_> = (0..listed.len() as u64)
            .map(|i| listed.sample_path(i).unwrap().to_path_buf())
            .collect();
        a.sort();
        b.sort();
        assert_eq!(a, b, "{split:?}: the same files");
        // Same file, same label and pixels (the CSV lists them in another order).
        let by_path = |p: &pipeline::Pipeline| {
            let mut out = std::collections::HashMap::new();
            for batch in collect(p, 0, 0, 0) {
                for (i, id) in batch.ids.iter().enumerate() {
                    out.insert(p.sample_path(*id).unwrap().to_path_buf(), batch.labels[i]);
                }
            }
            out
        };
        assert_eq!(by_path(&listed), by_path(&folder), "{split:?}: labels");
    }
}

#[test]
fn without_a_split_column_valid_fraction_holds_rows_out() {
    let fx = synth(2, 10, 0);
    let mut text = String::from("Path,Label\n");
    for f in files_under(&fx.root().join("train")) {
        let class = f.parent().unwrap().file_name().unwrap().to_str().unwrap();
        // Absolute paths are taken as they are.
        text += &format!("{},{class}\n", f.display());
    }
    let csv = fx.root().join("list.csv");
    std::fs::write(&csv, text).unwrap();
    let train = builder(&fx, DatasetSource::csv(&csv, Some(0.3)), Split::Train)
        .build()
        .unwrap();
    let valid = builder(&fx, DatasetSource::csv(&csv, Some(0.3)), Split::Valid)
        .build()
        .unwrap();
    assert_eq!(train.len() + valid.len(), 20);
    assert_eq!(valid.len(), 6, "3 of each class's 10 rows");
    assert_eq!(train.classes(), ["class_00", "class_01"]);
    // Without the fraction every row is training data, and there is no valid split.
    let err = builder(&fx, DatasetSource::csv(&csv, None), Split::Valid)
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("--valid-fraction"), "{err}");
}

fn csv_error(dir: &Path, text: &str) -> String {
    let csv = dir.join("t.csv");
    std::fs::write(&csv, text).unwrap();
    let fx_cache = tempfile::tempdir().unwrap();
    PipelineBuilder::new(DatasetSource::csv(&csv, None))
        .cache_dir(fx_cache.path())
        .build()
        .unwrap_err()
        .to_string()
}

#[test]
fn csvs_that_cannot_work_are_refused_naming_file_and_line() {
    let fx = synth(2, 1, 1);
    let img = files_under(&fx.root().join("train"))[0].clone();
    let img = img.to_str().unwrap();
    let dir = fx.root();
    let e = csv_error(dir, "name,kind\nx.png,a\n");
    assert!(
        e.contains("t.csv line 1") && e.contains("a path column"),
        "{e}"
    );
    let e = csv_error(
        dir,
        &format!("path,label,split\n{img},a,train\n{img},a,holdout\n"),
    );
    assert!(e.contains("t.csv line 3") && e.contains("holdout"), "{e}");
    let e = csv_error(dir, &format!("path,label\n{img},a\n{img}\n"));
    assert!(e.contains("t.csv line 3"), "a short row: {e}");
    let e = csv_error(dir, &format!("path,label\n{img},\n"));
    assert!(e.contains("line 2") && e.contains("empty"), "{e}");
    let e = csv_error(dir, "path,label\nno-such.png,a\n");
    assert!(e.contains("no-such.png"), "{e}");
    // A valid row whose class the train rows never name.
    let csv = dir.join("u.csv");
    std::fs::write(
        &csv,
        format!("path,label,split\n{img},a,train\n{img},b,valid\n"),
    )
    .unwrap();
    let err = PipelineBuilder::new(DatasetSource::csv(&csv, None))
        .split(Split::Valid)
        .cache_dir(fx.cache.path())
        .build()
        .unwrap_err();
    assert!(matches!(err, PipelineError::UnknownClass { .. }), "{err}");
    // A split column and a fraction contradict each other.
    let err = PipelineBuilder::new(DatasetSource::csv(&csv, Some(0.2)))
        .cache_dir(fx.cache.path())
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("--valid-fraction"), "{err}");
}

/// A CSV of split `train`: every train file of class `a`, and `b_rows` for class `b`.
fn csv_with_class_b(fx: &Fixture, b_rows: &[std::path::PathBuf]) -> std::path::PathBuf {
    let mut text = String::from("path,label\n");
    for f in files_under(&fx.root().join("train").join("class_00")) {
        text += &format!("{},a\n", f.display());
    }
    for f in b_rows {
        text += &format!("{},b\n", f.display());
    }
    let csv = fx.root().join("two.csv");
    std::fs::write(&csv, text).unwrap();
    csv
}

#[test]
fn a_csv_class_with_no_readable_image_is_refused_naming_it() {
    let fx = synth(1, 3, 0);
    // Missing files are known at build time.
    let gone = [fx.root().join("gone1.png"), fx.root().join("gone2.png")];
    let csv = csv_with_class_b(&fx, &gone);
    let err = builder(&fx, DatasetSource::csv(&csv, None), Split::Train)
        .build()
        .unwrap_err();
    assert!(
        matches!(&err, PipelineError::CsvClassWithoutImages { class, bad: 2, .. } if class == "b"),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.contains("two.csv") && text.contains("gone1.png") && text.contains("`train`"),
        "{text}"
    );
    // Files that exist but do not decode are found while the epoch runs.
    let junk = [fx.root().join("junk1.png"), fx.root().join("junk2.png")];
    for j in &junk {
        std::fs::write(j, b"not a picture at all").unwrap();
    }
    let csv = csv_with_class_b(&fx, &junk);
    let p = builder(&fx, DatasetSource::csv(&csv, None), Split::Train)
        .build()
        .unwrap();
    let err = p
        .epoch(0, 0, 0)
        .unwrap()
        .find_map(Result::err)
        .expect("a class with no readable image stops the epoch");
    assert!(
        matches!(&err, PipelineError::CsvClassWithoutImages { class, bad: 2, .. } if class == "b"),
        "{err}"
    );
    assert!(err.to_string().contains("junk"), "{err}");
    // One good file keeps the class: its bad neighbour is only skipped.
    let mixed = [
        junk[0].clone(),
        files_under(&fx.root().join("train").join("class_00"))[0].clone(),
    ];
    let csv = csv_with_class_b(&fx, &mixed);
    let p = builder(&fx, DatasetSource::csv(&csv, None), Split::Train)
        .build()
        .unwrap();
    let seen: usize = collect(&p, 0, 0, 0).iter().map(|b| b.ids.len()).sum();
    assert_eq!(seen, 4, "three of a and one of b");
}

#[test]
fn a_source_names_the_classes_its_engine_numbers_without_building_one() {
    let fx = synth(3, 4, 2);
    let csv = kaggle_csv(&fx);
    for source in [
        DatasetSource::folder(fx.root()),
        DatasetSource::csv(&csv, None),
    ] {
        let engine = builder(&fx, source.clone(), Split::Train).build().unwrap();
        assert_eq!(source.classes().unwrap(), engine.classes());
        // The listing counts what the engine serves in an epoch: 3 classes × 4 images.
        let (classes, images) = source.train_listing().unwrap();
        assert_eq!(classes, engine.classes());
        assert_eq!(images, 12);
    }
    let missing = DatasetSource::folder(fx.root().join("nowhere")).classes();
    assert!(
        matches!(missing, Err(PipelineError::MissingDir { .. })),
        "{missing:?}"
    );
}
