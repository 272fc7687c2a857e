//! The pixel cache on a place that cannot take it: a full disk gives one warning for the whole
//! run (not one per image per epoch) and every image is still served; a complete cache on a
//! read-only file system is read as it is. Both need a real small or read-only file system, so
//! they mount a tmpfs (root, as on the project's machines) and skip with a line elsewhere.

use crate::cli_support;

use std::path::Path;
use std::process::Output;

use cli_support::{birdtrain, birdtrain_output, s, Tmpfs};

/// 2 classes × 10 training images of 40×30 px.
fn dataset(dir: &Path) {
    birdtrain(&[
        "synth",
        "--out",
        s(dir),
        "--classes",
        "2",
        "--train-per-class",
        "10",
        "--valid-per-class",
        "0",
        "--test-per-class",
        "0",
        "--size",
        "40x30",
        "--format",
        "png",
        "--seed",
        "3",
    ]);
}

/// `bench pipeline` over `data` with its cache in `cache`: 32 px records of 3 KiB each.
fn bench(data: &Path, cache: &Path, epochs: &str) -> Output {
    birdtrain_output(&[
        "bench",
        "pipeline",
        "--data",
        s(data),
        "--cache-dir",
        s(cache),
        "--epochs",
        epochs,
        "--image-size",
        "32",
        "--batch-size",
        "4",
        "--workers",
        "2",
        "--json",
    ])
}

/// (images, decoded) of each epoch line.
fn epochs(out: &Output) -> Vec<(u64, u64)> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).expect("a JSON epoch line");
            (
                v["images"].as_u64().unwrap(),
                v["decoded"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn stderr_lines_naming_the_cache(out: &Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| l.contains("cache"))
        .map(str::to_owned)
        .collect()
}

#[test]
fn a_full_cache_disk_gives_one_warning_and_every_image_is_still_served() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    dataset(&data);
    // 16 KiB cannot hold 20 records of 3 KiB plus the header.
    let Some(disk) = Tmpfs::mount(&tmp.path().join("full"), 16 * 1024) else {
        return;
    };
    let out = bench(&data, disk.path(), "3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let seen = epochs(&out);
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(seen.iter().all(|&(images, _)| images == 20), "{seen:?}");
    // What could not be cached is decoded again: never served from a half-written record.
    assert!(
        seen[1..].iter().all(|&(_, decoded)| decoded > 0),
        "{seen:?}"
    );
    let warnings = stderr_lines_naming_the_cache(&out);
    assert_eq!(warnings.len(), 1, "one warning for the run: {warnings:#?}");
    assert!(
        warnings[0].contains(s(disk.path())),
        "names the cache file: {}",
        warnings[0]
    );
    assert!(warnings[0].contains("hint"), "{}", warnings[0]);
}

#[test]
fn a_complete_cache_on_a_read_only_disk_is_read_as_it_is() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    dataset(&data);
    let Some(disk) = Tmpfs::mount(&tmp.path().join("ro"), 8 << 20) else {
        return;
    };
    let first = bench(&data, disk.path(), "1");
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    assert_eq!(epochs(&first), vec![(20, 20)]);
    disk.remount_read_only();
    assert!(
        std::fs::write(disk.path().join("probe"), b"x").is_err(),
        "the cache folder is really read-only"
    );
    let out = bench(&data, disk.path(), "2");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        epochs(&out),
        vec![(20, 0), (20, 0)],
        "served from the cache"
    );
    let warnings = stderr_lines_naming_the_cache(&out);
    assert!(
        warnings.is_empty(),
        "a complete cache needs no warning: {warnings:#?}"
    );
}
