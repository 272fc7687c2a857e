//! A dataset folder that disappears during a run (renamed away, deleted) stops the epoch with
//! one error naming the folder; it never turns the remaining images into thousands of
//! skipped "unreadable" files and a misleading "class has no readable image" error.

use crate::common;

use std::path::{Path, PathBuf};

use common::synth;
use pipeline::PipelineError;

/// The first item of epoch 0, which must be an error.
fn first_error(p: &pipeline::Pipeline) -> PipelineError {
    match p.epoch(0, 0, 0).unwrap().next() {
        Some(Err(e)) => e,
        Some(Ok(batch)) => panic!("a batch of {} images was served", batch.len),
        None => panic!("the epoch ended without an item"),
    }
}

fn class_dirs(root: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root.join("train"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    dirs.sort();
    dirs
}

#[test]
fn a_dataset_root_renamed_away_stops_the_epoch_naming_it() {
    let fx = synth(3, 10, 0);
    let root = fx.root().join("birds");
    std::fs::create_dir(&root).unwrap();
    std::fs::rename(fx.root().join("train"), root.join("train")).unwrap();
    let p = pipeline::PipelineBuilder::new(pipeline::DatasetSource::folder(&root))
        .image_size(16)
        .cache_dir(fx.cache.path())
        .workers(2)
        .batch_size(4)
        .build()
        .unwrap();
    // Renamed away after the scan, before a single image is read.
    std::fs::rename(&root, fx.root().join("birds-moved")).unwrap();
    let error = first_error(&p);
    assert!(
        matches!(&error, PipelineError::DatasetVanished { path } if *path == root),
        "{error:?}"
    );
    let message = error.to_string();
    assert_eq!(
        message,
        format!(
            "the dataset folder {} disappeared during the run (hint: restore it; a --resume \
             continues)",
            root.display()
        )
    );
    assert!(p.bad_files().is_empty(), "{:?}", p.bad_files());
    // Restored: the same pipeline serves every image.
    std::fs::rename(fx.root().join("birds-moved"), &root).unwrap();
    let served: usize = p.epoch(0, 0, 0).unwrap().map(|b| b.unwrap().len).sum();
    assert_eq!(served, 30);
}

#[test]
fn a_class_folder_deleted_mid_epoch_stops_the_epoch_naming_it() {
    let fx = synth(3, 10, 0);
    let p = fx.builder().batch_size(4).build().unwrap();
    let gone = class_dirs(fx.root())[1].clone();
    std::fs::remove_dir_all(&gone).unwrap();
    // The first batches may hold only images of the other classes; the error comes by the
    // first image of the deleted class, and no image becomes a bad file.
    let errors: Vec<PipelineError> = p.epoch(0, 0, 0).unwrap().filter_map(Result::err).collect();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        matches!(&errors[0], PipelineError::DatasetVanished { path } if *path == gone),
        "{:?}",
        errors[0]
    );
    assert!(p.bad_files().is_empty(), "{:?}", p.bad_files());
}

#[test]
fn a_single_file_deleted_is_still_one_skipped_bad_file() {
    let fx = synth(2, 6, 0);
    let p = fx.builder().batch_size(4).build().unwrap();
    let class = class_dirs(fx.root())[0].clone();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&class)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    std::fs::remove_file(&files[0]).unwrap();
    let served: usize = p.epoch(0, 0, 0).unwrap().map(|b| b.unwrap().len).sum();
    assert_eq!(served, 11);
    let bad = p.bad_files();
    assert_eq!(bad.len(), 1);
    assert_eq!(bad[0].path, files[0]);
    assert_eq!(bad[0].kind, pipeline::BadFileKind::Unreadable);
}
