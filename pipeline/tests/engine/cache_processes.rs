//! Two processes on one cache file: a process killed mid-fill leaves a cache the next one
//! resumes without serving torn records; a second process serves what a live filler published
//! (`cache_fillers` has processes filling one file together).
//! The child processes are this test binary re-run on an `#[ignore]`d entry point.

use crate::common;

use std::io::{BufRead, BufReader};
use std::process::Command;

use common::{collect, synth};
use pipeline::{DatasetSource, PipelineBuilder};

const ROLE: &str = "PIPELINE_TEST_CHILD_ROLE";

fn child(role: &str, test: &str, data: &std::path::Path, cache: &std::path::Path) -> Command {
    let mut cmd = common::child_test(module_path!(), test);
    cmd.env(ROLE, role)
        .env("PIPELINE_TEST_DATA", data)
        .env("PIPELINE_TEST_CACHE", cache);
    cmd
}

fn child_pipeline() -> pipeline::Pipeline {
    let data = std::env::var("PIPELINE_TEST_DATA").unwrap();
    let cache = std::env::var("PIPELINE_TEST_CACHE").unwrap();
    PipelineBuilder::new(DatasetSource::folder(data))
        .image_size(16)
        .cache_dir(cache)
        .seed(42)
        .workers(1)
        .prefetch(1)
        .batch_size(1)
        .build()
        .unwrap()
}

/// Child entry: fills the cache slowly, announcing each step, until killed.
#[test]
#[ignore = "child process of a_process_killed_mid_fill_leaves_a_resumable_cache"]
fn child_fill_slowly() {
    if std::env::var(ROLE).as_deref() != Ok("fill") {
        return;
    }
    let p = child_pipeline();
    for (step, batch) in p.epoch(0, 0, 0).unwrap().enumerate() {
        batch.unwrap();
        println!("step {step}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    println!("finished");
}

/// Child entry: reads the whole epoch and reports what it decoded and a digest of the batches.
#[test]
#[ignore = "child process of a_second_process_reads_what_the_writer_published"]
fn child_read_all() {
    if std::env::var(ROLE).as_deref() != Ok("read") {
        return;
    }
    let p = child_pipeline();
    let digest = digest(&collect(&p, 0, 0, 0));
    println!("decoded={} digest={digest}", p.stats().decoded);
}

fn digest(batches: &[common::Seen]) -> u64 {
    let text = format!("{batches:?}");
    xxhash_rust::xxh3::xxh3_64(text.as_bytes())
}

fn parent_builder(fx: &common::Fixture) -> PipelineBuilder {
    fx.builder().workers(1).prefetch(1).batch_size(1)
}

#[test]
fn a_process_killed_mid_fill_leaves_a_resumable_cache() {
    let fx = synth(2, 10, 0); // 20 images
    let reference = {
        let other = tempfile::tempdir().unwrap();
        collect(
            &parent_builder(&fx).cache_dir(other.path()).build().unwrap(),
            0,
            0,
            0,
        )
    };
    let mut proc = child("fill", "child_fill_slowly", fx.root(), fx.cache.path())
        .spawn()
        .unwrap();
    let out = BufReader::new(proc.stdout.take().unwrap());
    for line in out.lines() {
        // libtest prints the test name first, possibly on the same line.
        if line.unwrap().ends_with("step 4") {
            break;
        }
    }
    proc.kill().unwrap(); // SIGKILL: no destructor, no flush, state stays `filling`
    proc.wait().unwrap();
    let p = parent_builder(&fx).build().unwrap();
    assert_eq!(
        collect(&p, 0, 0, 0),
        reference,
        "the resumed cache serves correct records"
    );
    let decoded = p.stats().decoded;
    assert!(
        decoded <= 15,
        "the child's records are reused (decoded {decoded} of 20)"
    );
    collect(&p, 1, 0, 0);
    assert_eq!(p.stats().decoded, decoded, "then the cache is complete");
}

#[test]
fn a_second_process_reads_what_the_writer_published() {
    let fx = synth(2, 5, 0);
    let writer = parent_builder(&fx).build().unwrap();
    let reference = collect(&writer, 0, 0, 0);
    // The writer is alive and holds its shared lock: the child joins it as a filler, and
    // finds every record there.
    let out = child("read", "child_read_all", fx.root(), fx.cache.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find_map(|l| l.find("decoded=").map(|at| &l[at..]))
        .unwrap_or_else(|| panic!("child said: {text}"));
    assert_eq!(line, format!("decoded=0 digest={}", digest(&reference)));
    drop(writer);
}
