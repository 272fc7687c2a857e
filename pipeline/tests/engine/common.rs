//! Helpers shared by the pipeline's integration tests: tiny synthetic datasets.
#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};

use pipeline::synth::{write_dataset, ImageFormatKind, SynthConfig};
use pipeline::{Batch, DatasetSource, Pipeline, PipelineBuilder};

/// Every image that replica `replica`'s epoch `epoch` of `p` hands out from batch `start` on,
/// by sample id.
pub fn pixels_by_id(
    p: &Pipeline,
    epoch: u64,
    replica: usize,
    start: usize,
) -> std::collections::HashMap<u64, Vec<u8>> {
    let record = p.image_size() as usize * p.image_size() as usize * 3;
    let mut out = std::collections::HashMap::new();
    for b in p.epoch(epoch, replica, start).unwrap() {
        let b = b.unwrap();
        assert_eq!(b.pixels().len(), b.len * record);
        for (i, &id) in b.sample_ids.iter().enumerate() {
            out.insert(id, b.pixels()[i * record..(i + 1) * record].to_vec());
        }
    }
    out
}

/// A temporary dataset plus a temporary cache directory.
pub struct Fixture {
    pub data: tempfile::TempDir,
    pub cache: tempfile::TempDir,
}

impl Fixture {
    pub fn root(&self) -> &Path {
        self.data.path()
    }
    pub fn builder(&self) -> PipelineBuilder {
        PipelineBuilder::new(DatasetSource::folder(self.root()))
            .image_size(16)
            .cache_dir(self.cache.path())
            .workers(2)
            .seed(42)
    }
}

/// `classes` classes, `train` / `valid` images each, 24×20 PNG (lossless, fast).
pub fn synth(classes: usize, train: usize, valid: usize) -> Fixture {
    let data = tempfile::tempdir().expect("tempdir");
    let cache = tempfile::tempdir().expect("tempdir");
    let cfg = SynthConfig {
        out: data.path().to_path_buf(),
        classes,
        train_per_class: train,
        valid_per_class: valid,
        test_per_class: 0,
        width: 24,
        height: 20,
        format: ImageFormatKind::Png,
        seed: 5,
    };
    write_dataset(&cfg).expect("synth");
    Fixture { data, cache }
}

/// What a batch holds, comparable across runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub step: usize,
    pub replica: usize,
    pub ids: Vec<u64>,
    pub labels: Vec<u32>,
    pub pixels_hash: u64,
}

pub fn seen(b: &Batch) -> Seen {
    assert_eq!(b.labels().len(), b.len);
    assert_eq!(b.sample_ids.len(), b.len);
    Seen {
        step: b.step,
        replica: b.replica,
        ids: b.sample_ids.clone(),
        labels: b.labels().to_vec(),
        pixels_hash: xxhash_rust::xxh3::xxh3_64(b.pixels()),
    }
}

/// Every batch of one replica's epoch, panicking on an error.
pub fn collect(p: &Pipeline, epoch: u64, replica: usize, start: usize) -> Vec<Seen> {
    p.epoch(epoch, replica, start)
        .expect("epoch")
        .map(|b| seen(&b.expect("batch")))
        .collect()
}

pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).expect("read_dir") {
        let p = e.expect("entry").path();
        if p.is_dir() {
            out.extend(files_under(&p));
        } else {
            out.push(p);
        }
    }
    out.sort();
    out
}

/// Offsets of the documented cache file layout (see the pipeline's `cache.rs`) for `count`
/// records of `size`×`size` pixels.
#[derive(Debug, Clone, Copy)]
pub struct CacheLayout {
    pub labels: usize,
    pub filled: usize,
    pub bad: usize,
    pub checks: usize,
    pub sources: usize,
    pub claims: usize,
    pub records: usize,
    pub record_bytes: usize,
}

impl CacheLayout {
    pub fn new(count: usize, size: usize) -> Self {
        let words = count.div_ceil(64);
        let labels = 4096;
        let filled = (labels + 4 * count).next_multiple_of(8);
        let bad = filled + 8 * words;
        let checks = bad + 8 * words;
        let sources = checks + 8 * count;
        let claims = sources + 8 * count;
        let records = (claims + 8 * words).next_multiple_of(4096);
        Self {
            labels,
            filled,
            bad,
            checks,
            sources,
            claims,
            records,
            record_bytes: size * size * 3,
        }
    }
}

/// Images given to the engine as a list (`DatasetSource::list`), written as lossless PNGs,
/// plus a temporary cache directory.
pub struct Listed {
    pub dir: tempfile::TempDir,
    pub cache: tempfile::TempDir,
    pub files: Vec<(PathBuf, u32)>,
    pub classes: usize,
}

impl Listed {
    /// The list, with classes named `a`, `b`, … .
    pub fn source(&self) -> DatasetSource {
        let names = (0..self.classes)
            .map(|k| char::from(b'a' + k as u8).to_string())
            .collect();
        DatasetSource::list(names, self.files.clone())
    }
}

/// `count` images of `side`×`side` whose pixel `(x, y)` of image `i` is `pixel(i, x, y)`,
/// image `i` labelled `i % classes`.
pub fn listed(
    count: usize,
    side: u32,
    classes: usize,
    pixel: impl Fn(usize, u32, u32) -> image::Rgb<u8>,
) -> Listed {
    let dir = tempfile::tempdir().expect("tempdir");
    let files = (0..count)
        .map(|i| {
            let img = image::RgbImage::from_fn(side, side, |x, y| pixel(i, x, y));
            let path = dir.path().join(format!("img{i:02}.png"));
            img.save(&path).expect("write a png");
            (path, (i % classes) as u32)
        })
        .collect();
    Listed {
        dir,
        cache: tempfile::tempdir().expect("tempdir"),
        files,
        classes,
    }
}

/// `count` colourful `side`×`side` images: each channel a different wave over the square,
/// shifted per image (for the tests of colour and augmentation).
pub fn colourful(count: usize, side: u32) -> Listed {
    listed(count, side, 3, |i, x, y| {
        let k = i as u32;
        image::Rgb([
            ((x * 9 + k * 17) % 256) as u8,
            ((y * 7 + x * 3 + k * 29) % 256) as u8,
            ((x * y + k * 41) % 256) as u8,
        ])
    })
}

impl Listed {
    /// A training pipeline over the images at `side` px, seeded: 2 workers, batches of 4.
    pub fn train_builder(&self, side: u32, seed: u64) -> PipelineBuilder {
        PipelineBuilder::new(self.source())
            .split(pipeline::Split::Train)
            .image_size(side)
            .cache_dir(self.cache.path())
            .workers(2)
            .batch_size(4)
            .seed(seed)
    }
}

/// The variable that tells a child of this test binary which test [`in_own_process`] runs.
const OWN_PROCESS: &str = "PIPELINE_TEST_OWN_PROCESS";

/// Runs `body` in a child process of this test binary that runs the test `name` (its full
/// path, `module::test`) alone. For a test that changes what the whole process shares (a
/// resource limit, the global tracing subscriber): the other tests of this binary run on
/// other threads of the same process and must not see it. In the parent, the child must
/// pass with exactly that one test run.
pub fn in_own_process(name: &str, body: impl FnOnce()) {
    if std::env::var(OWN_PROCESS).as_deref() == Ok(name) {
        body();
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(OWN_PROCESS, name)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{name}, in its own process:\n{text}");
    assert!(
        text.contains("1 passed"),
        "{name} did not run in its own process:\n{text}"
    );
}

/// Every warning or error message [`Catcher`] saw.
pub static WARNINGS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// A tracing subscriber that keeps the message of every warning or error in [`WARNINGS`]
/// (set as the global default in a test run [`in_own_process`]).
pub struct Catcher;

struct Message(String);

impl tracing::field::Visit for Message {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

impl tracing::Subscriber for Catcher {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        *metadata.level() <= tracing::Level::WARN
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let mut message = Message(String::new());
        event.record(&mut message);
        WARNINGS.lock().unwrap().push(message.0);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// The command that runs one `#[ignore]`d test of this binary in a child process, its output
/// piped: `module` is the calling module's `module_path!()`, `test` the test's name there; the
/// caller adds the variables that give the child its role.
pub fn child_test(module: &str, test: &str) -> std::process::Command {
    // The test's full name in this binary: its module, then its name.
    let test = format!("{}::{test}", module.split_once("::").unwrap().1);
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--ignored",
        "--exact",
        &test,
        "--nocapture",
        "--test-threads=1",
    ])
    .stdout(std::process::Stdio::piped());
    cmd
}
