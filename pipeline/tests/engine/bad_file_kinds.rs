//! Bad input files: every kind is skipped with a report (or fails when asked), and a worker
//! failure reaches the consumer as an error that keeps its cause.

use crate::common;

use std::path::Path;

use common::{collect, synth};
use pipeline::{BadFileKind, OnBadImage, PipelineError};

fn valid_png(w: u32, h: u32) -> Vec<u8> {
    let img = image::RgbImage::from_pixel(w, h, image::Rgb([10, 200, 30]));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

fn valid_jpeg(w: u32, h: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8 * 3, y as u8 * 5, 90]));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Jpeg).unwrap();
    out.into_inner()
}

/// Adds one bad file of each kind to `class_dir`.
fn add_bad_files(class_dir: &Path) {
    // Corrupt: a PNG signature followed by garbage.
    let mut corrupt = b"\x89PNG\r\n\x1a\n".to_vec();
    corrupt.extend((0..200u32).map(|i| (i * 37 % 251) as u8));
    std::fs::write(class_dir.join("corrupt.png"), corrupt).unwrap();
    // Truncated: the first half of a valid PNG, and of a valid JPEG (which the decoder
    // would happily finish with grey rows).
    let png = valid_png(40, 40);
    std::fs::write(class_dir.join("truncated.png"), &png[..png.len() / 2]).unwrap();
    let jpg = valid_jpeg(64, 48);
    std::fs::write(class_dir.join("truncated.jpg"), &jpg[..jpg.len() / 2]).unwrap();
    std::fs::write(class_dir.join("empty.jpg"), b"").unwrap();
    // Unreadable (tests run as root, so no chmod): a directory and a dangling link named like images.
    std::fs::create_dir(class_dir.join("folder.jpg")).unwrap();
    std::os::unix::fs::symlink(
        class_dir.join("missing-target"),
        class_dir.join("dangling.jpg"),
    )
    .unwrap();
    std::fs::write(
        class_dir.join("notes.jpg"),
        b"these are field notes, not a picture",
    )
    .unwrap();
    // Hidden files are ignored, not bad.
    std::fs::write(class_dir.join(".DS_Store"), b"junk").unwrap();
}

#[test]
fn every_bad_file_kind_is_skipped_counted_and_reported() {
    let fx = synth(2, 4, 0);
    add_bad_files(&fx.root().join("train/class_00"));
    let report = fx.cache.path().join("bad.jsonl");
    let p = fx
        .builder()
        .batch_size(3)
        .bad_files_report(&report)
        .build()
        .unwrap();
    assert_eq!(
        p.len(),
        4 + 4 + 4,
        "zero-byte and unreadable entries are dropped at scan time"
    );
    let batches = collect(&p, 0, 0, 0);
    let images: usize = batches.iter().map(|b| b.ids.len()).sum();
    assert_eq!(images, 8, "only the good images are served");
    let mut kinds: Vec<(String, BadFileKind)> = p
        .bad_files()
        .into_iter()
        .map(|b| {
            (
                b.path.file_name().unwrap().to_string_lossy().into_owned(),
                b.kind,
            )
        })
        .collect();
    kinds.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        kinds,
        vec![
            ("corrupt.png".to_string(), BadFileKind::Corrupt),
            ("dangling.jpg".to_string(), BadFileKind::Unreadable),
            ("empty.jpg".to_string(), BadFileKind::Empty),
            ("folder.jpg".to_string(), BadFileKind::Unreadable),
            ("notes.jpg".to_string(), BadFileKind::NotAnImage),
            ("truncated.jpg".to_string(), BadFileKind::Truncated),
            ("truncated.png".to_string(), BadFileKind::Truncated),
        ]
    );
    assert_eq!(p.stats().bad_files, 7);
    let lines = std::fs::read_to_string(&report).unwrap();
    assert_eq!(lines.lines().count(), 7);
    assert!(lines.contains("notes.jpg") && lines.contains("not-an-image"));
    assert!(lines.contains(r#""kind":"truncated""#), "{lines}");
    // The second epoch neither decodes nor re-reads the bad files, and still skips them.
    let second = collect(&p, 1, 0, 0);
    assert_eq!(second.iter().map(|b| b.ids.len()).sum::<usize>(), 8);
    assert_eq!(p.stats().decoded, 8);
    assert_eq!(p.stats().bad_files, 7, "each bad file is counted once");
    drop(p);
    // A later pipeline on the same cache knows them from the start, each with its kind.
    let again = fx.builder().batch_size(3).build().unwrap();
    let mut kinds_again: Vec<(String, BadFileKind)> = again
        .bad_files()
        .into_iter()
        .map(|b| {
            (
                b.path.file_name().unwrap().to_string_lossy().into_owned(),
                b.kind,
            )
        })
        .collect();
    kinds_again.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(kinds_again, kinds);
    let third = collect(&again, 2, 0, 0);
    assert_eq!(third.iter().map(|b| b.ids.len()).sum::<usize>(), 8);
    assert_eq!(again.stats().decoded, 0, "everything came from the cache");
}

#[test]
fn on_bad_image_fail_stops_at_scan_time_bad_files() {
    let fx = synth(2, 3, 0);
    std::fs::write(fx.root().join("train/class_01/empty.png"), b"").unwrap();
    let err = fx
        .builder()
        .on_bad_image(OnBadImage::Fail)
        .build()
        .unwrap_err();
    match &err {
        PipelineError::BadImage { path, kind, .. } => {
            assert!(path.ends_with("empty.png"));
            assert_eq!(*kind, BadFileKind::Empty);
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(
        err.to_string().contains("--on-bad-image skip"),
        "the message gives a hint"
    );
}

#[test]
fn on_bad_image_fail_reaches_the_consumer_with_the_decoder_error() {
    let fx = synth(2, 3, 0);
    let png = valid_png(20, 20);
    std::fs::write(
        fx.root().join("train/class_01/zz_truncated.png"),
        &png[..png.len() / 2],
    )
    .unwrap();
    let p = fx
        .builder()
        .batch_size(2)
        .on_bad_image(OnBadImage::Fail)
        .build()
        .unwrap();
    let results: Vec<_> = p.epoch(0, 0, 0).unwrap().collect();
    let errors: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert_eq!(errors.len(), 1, "the epoch ends at the first error");
    assert!(results.last().unwrap().is_err());
    match errors[0] {
        PipelineError::BadImage { path, kind, source } => {
            assert!(path.ends_with("zz_truncated.png"));
            assert_eq!(*kind, BadFileKind::Truncated);
            let source = source.as_ref().expect("the decoder's error is kept");
            assert!(
                source.downcast_ref::<image::ImageError>().is_some(),
                "{source:?}"
            );
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn a_worker_failure_reaches_the_consumer_as_an_error_keeping_its_cause() {
    let fx = synth(2, 3, 0);
    let p = fx
        .builder()
        .batch_size(2)
        .on_bad_image(OnBadImage::Fail)
        .build()
        .unwrap();
    // The file vanishes after the scan: the worker's read fails with an I/O error.
    let victim = fx.root().join("train/class_00/train_00001.png");
    std::fs::remove_file(&victim).unwrap();
    let err = p
        .epoch(0, 0, 0)
        .unwrap()
        .find_map(|r| r.err())
        .expect("an error reaches the consumer");
    let PipelineError::BadImage { path, kind, .. } = &err else {
        panic!("unexpected {err:?}")
    };
    assert_eq!(path, &victim);
    assert_eq!(*kind, BadFileKind::Unreadable);
    let io = std::error::Error::source(&err)
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .expect("the io::Error is the source");
    assert_eq!(io.kind(), std::io::ErrorKind::NotFound);
}

#[test]
fn a_failing_allocator_reaches_the_consumer() {
    struct Broken;
    impl pipeline::BatchAllocator for Broken {
        fn allocate(&self, _: usize) -> Result<Box<dyn pipeline::HostBuffer>, PipelineError> {
            Ok(Box::new(vec![0u8; 3])) // far too small
        }
    }
    let fx = synth(2, 2, 0);
    let p = fx
        .builder()
        .allocator(std::sync::Arc::new(Broken))
        .build()
        .unwrap();
    let first = p.epoch(0, 0, 0).unwrap().next().unwrap();
    assert!(
        matches!(first, Err(PipelineError::Allocator { .. })),
        "{first:?}"
    );
}

/// The status-change time and inode of `path`, which the cache key covers.
fn identity(path: &Path) -> (i64, i64, u64) {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).unwrap();
    (m.ctime(), m.ctime_nsec(), m.ino())
}

#[test]
fn a_file_that_could_not_be_read_is_not_kept_bad_in_the_cache() {
    // Five images in a folder, the sixth in a subfolder that a plain file stands in for a
    // while: its open fails with ENOTDIR (as on EACCES or EIO, which root cannot provoke; a
    // folder simply gone is a dataset that disappeared, which stops the epoch), and neither
    // the file's size, mtime, ctime nor inode change when the folder comes back.
    let dir = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let hold = dir.path().join("hold");
    std::fs::create_dir(&hold).unwrap();
    let mut files = Vec::new();
    for i in 0..6u32 {
        let folder = if i == 5 {
            hold.clone()
        } else {
            dir.path().to_path_buf()
        };
        let path = folder.join(format!("img{i}.png"));
        std::fs::write(&path, valid_png(20 + i, 18)).unwrap();
        files.push((path, i % 2));
    }
    let victim = files[5].0.clone();
    let source = pipeline::DatasetSource::list(vec!["a".into(), "b".into()], files);
    let report = cache.path().join("bad.jsonl");
    let builder = || {
        pipeline::PipelineBuilder::new(source.clone())
            .image_size(16)
            .batch_size(6)
            .cache_dir(cache.path())
            .workers(2)
            .bad_files_report(&report)
    };
    let served =
        |p: &pipeline::Pipeline| -> usize { collect(p, 0, 0, 0).iter().map(|b| b.ids.len()).sum() };
    let p = builder().build().unwrap();
    let identity_before = identity(&victim);
    let away = dir.path().join("hold.away");
    std::fs::rename(&hold, &away).unwrap();
    std::fs::write(&hold, b"a file where the folder was").unwrap();
    assert_eq!(served(&p), 5, "the unreadable file is skipped");
    assert_eq!(served(&p), 5, "and skipped again in the same run");
    let bad = p.bad_files();
    assert_eq!(bad.len(), 1, "reported once: {bad:?}");
    assert_eq!(
        (&bad[0].path, bad[0].kind),
        (&victim, BadFileKind::Unreadable)
    );
    assert_eq!(p.stats().bad_files, 1);
    let listed = std::fs::read_to_string(&report).unwrap();
    assert!(listed.contains("img5.png"), "{listed}");
    drop(p);
    // Readable again, and the file itself untouched: the same cache key.
    std::fs::remove_file(&hold).unwrap();
    std::fs::rename(&away, &hold).unwrap();
    assert_eq!(identity(&victim), identity_before);
    let p2 = builder().build().unwrap();
    assert!(p2.bad_files().is_empty(), "{:?}", p2.bad_files());
    assert_eq!(served(&p2), 6, "the next run reads it again and serves it");
    let s = p2.stats();
    assert_eq!((s.decoded, s.cache_hits, s.bad_files), (1, 5, 0), "{s:?}");
    // Nothing is bad now, so nothing is written: the earlier report is left as it was
    // (the trainer removes it once a whole run has read the split again).
    assert!(std::fs::read_to_string(&report)
        .unwrap()
        .contains("img5.png"));
    drop(p2);
    let p3 = builder().build().unwrap();
    assert_eq!(served(&p3), 6);
    assert_eq!(p3.stats().decoded, 0, "now it is cached");
}

#[test]
fn an_unreadable_file_still_fails_the_run_when_asked_and_the_next_run_reads_it() {
    let fx = synth(2, 3, 0);
    let builder = || fx.builder().batch_size(6).on_bad_image(OnBadImage::Fail);
    let p = builder().build().unwrap();
    // After the scan a plain file stands in for the class folder (its images fail to open
    // with ENOTDIR), then the folder comes back untouched.
    let class = fx.root().join("train/class_01");
    let away = fx.root().join("class_01.away");
    std::fs::rename(&class, &away).unwrap();
    std::fs::write(&class, b"a file where the folder was").unwrap();
    let err = p
        .epoch(0, 0, 0)
        .unwrap()
        .find_map(|r| r.err())
        .expect("an error reaches the consumer");
    assert!(
        matches!(
            err,
            PipelineError::BadImage {
                kind: BadFileKind::Unreadable,
                ..
            }
        ),
        "{err:?}"
    );
    drop(p);
    std::fs::remove_file(&class).unwrap();
    std::fs::rename(&away, &class).unwrap();
    let p2 = builder().build().unwrap();
    let served: usize = collect(&p2, 0, 0, 0).iter().map(|b| b.ids.len()).sum();
    assert_eq!(served, 6);
}
