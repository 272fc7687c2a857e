//! [`Pipeline`]: the running engine, and the per-epoch iterator and stream it hands out.
//!
//! Stages of one epoch iterator, all async tasks on the pipeline's tokio runtime except the
//! decode pool (OS threads), joined by bounded flume channels:
//!
//! ```text
//! planner ─(Job per image, bounded)→ decode pool ─(done per image)→ assembler
//! planner ─(pending batch, bounded by prefetch)→ assembler ─(Batch, bounded by prefetch)→ consumer
//! ```

//!
//! By concept: what is worked out before the start (`setup`: fingerprint, cache place,
//! refusals), one epoch's stages and the iterator and stream (`epoch`); this file starts and
//! stops the engine and answers what it holds.

mod epoch;
mod setup;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use crate::bad::BadFile;
use crate::buffer::BufferPool;
use crate::cache::{Cache, CacheKey};
use crate::order::{micro_batch_len, steps_per_epoch};
use crate::stats::{CacheHealth, Counters, EngineStats};
use crate::worker::{spawn_pool, BadLog, Job, Origin, Shared};
use crate::{LastBatch, OnBadImage, PipelineBuilder, PipelineError};

pub use epoch::{EpochIter, EpochStream};
use setup::{cache_path, check_counts, fingerprint, refuse_writes_into_dataset};

/// The input engine for one split. Cheap to clone and share (`Arc` inside); `Send + Sync`.
#[derive(Clone)]
pub struct Pipeline {
    inner: Arc<Inner>,
}

struct Inner {
    shared: Arc<Shared>,
    seed: u64,
    replicas: usize,
    batch_size: usize,
    workers: usize,
    prefetch: usize,
    shuffle: bool,
    sampling: crate::Sampling,
    last_batch: LastBatch,
    fingerprint: u64,
    pool: BufferPool,
    jobs: flume::Sender<Job>,
    job_capacity: usize,
    orchestrator: Option<Orchestrator>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

/// How long dropping a pipeline waits for its runtime's tasks (see `Drop for Inner`).
const RUNTIME_SHUTDOWN_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The stage tasks' runtime: a current-thread tokio runtime driven by one OS thread of the
/// engine's own. Why not tokio's multi-thread runtime: it starts its worker inside `build()`
/// and panics when the OS refuses that thread; this one starts through
/// [`crate::threads::spawn`], so a refused thread is an error with a hint.
struct Orchestrator {
    /// Spawns the stage tasks (polled by the orchestrator thread).
    handle: tokio::runtime::Handle,
    /// Dropped to stop the thread, which then drops the runtime and its tasks.
    stop: Option<flume::Sender<()>>,
    /// Says that the runtime and every task are dropped.
    stopped: flume::Receiver<()>,
}

impl Orchestrator {
    fn start() -> Result<Self, PipelineError> {
        let (stop, stop_rx) = flume::bounded::<()>(1);
        let (stopped_tx, stopped) = flume::bounded(1);
        let (ready_tx, ready) = flume::bounded(1);
        // The runtime is built, run and dropped on its thread alone: a runtime dropped by a
        // caller inside someone's async context would panic (tokio forbids blocking there).
        crate::threads::spawn("pipeline-orchestrator", move || {
            let runtime = match tokio::runtime::Builder::new_current_thread().build() {
                Ok(runtime) => runtime,
                Err(source) => {
                    let _ = ready_tx.send(Err(source));
                    return;
                }
            };
            let _ = ready_tx.send(Ok(runtime.handle().clone()));
            runtime.block_on(async move {
                let _ = stop_rx.recv_async().await;
            });
            // The stage tasks go with the runtime, here, outside any async context.
            drop(runtime);
            let _ = stopped_tx.send(());
        })?;
        let handle = ready
            .recv()
            .map_err(|_| PipelineError::Runtime {
                source: std::io::Error::other(
                    "the orchestrator thread ended before its runtime started",
                ),
            })?
            .map_err(|source| PipelineError::Runtime { source })?;
        Ok(Self {
            handle,
            stop: Some(stop),
            stopped,
        })
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(mut orchestrator) = self.orchestrator.take() {
            drop(orchestrator.stop.take());
            // Inside someone's async context the caller must not block: the tasks wind down
            // alone and release the cache a moment later. Elsewhere, wait until the stage
            // tasks are dropped: they hold the mapped cache, and a caller may rewrite or
            // delete its file as soon as the pipeline is gone (a late header write into a
            // file cut meanwhile is a SIGBUS). The tasks never block, so this returns at
            // once; the bound only guards a stuck allocator.
            if tokio::runtime::Handle::try_current().is_err() {
                let _ = orchestrator.stopped.recv_timeout(RUNTIME_SHUTDOWN_WAIT);
            }
        }
        // Closing the job channel stops the workers once queued jobs are done.
        let (closed, _) = flume::bounded(0);
        self.jobs = closed;
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline")
            .field("split", &self.inner.shared.split)
            .field("samples", &self.len())
            .field("classes", &self.classes().len())
            .field("image_size", &self.image_size())
            .field("cache", &self.inner.shared.cache.path())
            .finish_non_exhaustive()
    }
}

// Defined here, beside `Pipeline::start`, so the builder never reaches the engine it starts.
impl PipelineBuilder {
    /// Scans the dataset, opens (or builds) the cache and starts the decode pool.
    pub fn build(self) -> Result<Pipeline, PipelineError> {
        self.validate()?;
        Pipeline::start(self)
    }
}

impl Pipeline {
    pub(crate) fn start(b: PipelineBuilder) -> Result<Self, PipelineError> {
        refuse_writes_into_dataset(&b)?;
        let scanned = crate::scan::scan(&b.source, b.split, b.seed, b.known_classes.as_deref())?;
        if b.on_bad_image == OnBadImage::Fail {
            if let Some(first) = scanned.bad.first() {
                return Err(PipelineError::BadImage {
                    path: first.path.clone(),
                    kind: first.kind,
                    source: Some(first.detail.clone().into()),
                });
            }
        }
        for file in scanned.bad.iter().take(crate::worker::WARNED_BAD_FILES) {
            tracing::warn!(
                "skipping bad file {}: {} ({})",
                file.path.display(),
                file.kind,
                file.detail
            );
        }
        if scanned.bad.len() > crate::worker::WARNED_BAD_FILES {
            crate::worker::warn_more_bad_files(b.split.as_str(), b.bad_files_report.as_deref());
        }
        let buffer_bytes = check_counts(&b, scanned.samples.len())?;
        let fp = fingerprint(&b, &scanned.classes, &scanned.samples, false);
        let cache_fp = fingerprint(&b, &scanned.classes, &scanned.samples, true);
        let labels: Vec<u32> = scanned.samples.iter().map(|s| s.label).collect();
        let key = CacheKey {
            image_size: b.stored_side(),
            count: scanned.samples.len(),
            fingerprint: cache_fp,
        };
        let cache = if b.cache {
            Cache::open(&cache_path(&b), key, &labels)?
        } else {
            Cache::off(&cache_path(&b), key)
        };
        let mut class_totals = vec![0usize; scanned.classes.len()];
        for &l in &labels {
            class_totals[l as usize] += 1;
        }
        let mut log = BadLog {
            files: scanned.bad.clone(),
            per_class: vec![0; scanned.classes.len()],
            class_totals,
            // Files found bad by the scan have had their warning lines (or the summary).
            warned: scanned.bad.len(),
            ..BadLog::default()
        };
        // Bad files found by an earlier pass over this cache count from the start.
        for (i, s) in scanned.samples.iter().enumerate() {
            if let Some(kind) = cache.bad_kind(i) {
                log.seen.insert(i as u32);
                log.per_class[s.label as usize] += 1;
                log.files.push(BadFile::new(
                    s.path.clone(),
                    kind,
                    crate::worker::FOUND_EARLIER.into(),
                ));
            }
        }
        if let Some(path) = &b.bad_files_report {
            crate::bad_report::write_report(path, &log.files)?;
        }
        let counters = Counters::new();
        counters
            .bad_files
            .store(log.files.len() as u64, Ordering::Relaxed);
        counters.ready_capacity.store(0, Ordering::Relaxed);
        let shared = Arc::new(Shared {
            origin: match &b.source {
                crate::DatasetSource::Folder { root } | crate::DatasetSource::Flat { root, .. } => {
                    Origin::Folders(root.clone())
                }
                crate::DatasetSource::Csv { file, .. } => Origin::Csv(file.clone()),
                crate::DatasetSource::List { .. } => Origin::List,
            },
            split: b.split.to_string(),
            samples: scanned.samples,
            class_names: scanned.classes,
            image_size: b.image_size,
            stored_side: b.stored_side(),
            resize_mode: b.resize_mode,
            crop: match (b.crop, b.center_crop) {
                (Some(crop), _) => Some(crate::crop::Cut::Random(crop, b.seed)),
                (None, Some(fraction)) => Some(crate::crop::Cut::Center(
                    crate::CropWindow::centered(b.stored_side(), fraction),
                )),
                (None, None) => None,
            },
            jitter: b.color_jitter.map(|jitter| (jitter, b.seed)),
            auto_augment: b.auto_augment.map(|policy| (policy, b.seed)),
            mirrored_later: b.mirrored_later.clone(),
            on_bad: b.on_bad_image,
            max_pixels: b.max_pixels,
            contents: crate::content::Contents::new(labels.len()),
            cache,
            counters,
            bad: Mutex::new(log),
            report: b.bad_files_report.clone(),
        });
        let job_capacity = (b.workers * 4).max(buffer_bytes / shared.image_bytes());
        let (jobs, job_rx) = flume::bounded(job_capacity);
        let threads = spawn_pool(b.workers, job_rx, b.stored_side(), b.resize_mode)?;
        let orchestrator = Orchestrator::start()?;
        Ok(Self {
            inner: Arc::new(Inner {
                shared,
                seed: b.seed,
                replicas: b.replicas,
                batch_size: b.batch_size,
                workers: b.workers,
                prefetch: b.prefetch,
                shuffle: b.shuffle,
                sampling: b.sampling,
                last_batch: b.last_batch,
                fingerprint: fp,
                pool: BufferPool::new(b.allocator, buffer_bytes),
                jobs,
                job_capacity,
                orchestrator: Some(orchestrator),
                threads,
            }),
        })
    }

    /// Class names; index = label.
    pub fn classes(&self) -> &[String] {
        &self.inner.shared.class_names
    }

    /// Samples in the split (files that passed the scan; bad files found later still count).
    pub fn len(&self) -> usize {
        self.inner.shared.samples.len()
    }

    /// Whether the split has no samples (never true for a built pipeline).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The file behind a sample id (`Batch::sample_ids`), if the id is in range.
    pub fn sample_path(&self, id: u64) -> Option<&std::path::Path> {
        let index = usize::try_from(id).ok()?;
        self.inner
            .shared
            .samples
            .get(index)
            .map(|s| s.path.as_path())
    }

    /// Steps per epoch, the same for every replica.
    pub fn steps_per_epoch(&self) -> usize {
        let i = &self.inner;
        steps_per_epoch(self.len(), i.replicas, i.batch_size, i.last_batch)
    }

    /// How many samples `replica`'s micro-batch at `step` holds by the data order (`None`
    /// past the last step), the same in every epoch: every replica can count a step's images
    /// without asking the others. (A batch may hold fewer when files turn out unreadable.)
    pub fn micro_batch_len(&self, step: usize, replica: usize) -> Option<usize> {
        let i = &self.inner;
        micro_batch_len(
            self.len(),
            i.replicas,
            i.batch_size,
            i.last_batch,
            step,
            replica,
        )
    }

    /// Side of the square images handed out.
    pub fn image_size(&self) -> u32 {
        self.inner.shared.image_size
    }

    /// Side of the squares the cache keeps (the image size unless
    /// [`PipelineBuilder::store_size`] made it larger).
    pub fn store_size(&self) -> u32 {
        self.inner.shared.stored_side
    }

    /// Images per replica per step.
    pub fn batch_size(&self) -> usize {
        self.inner.batch_size
    }

    /// Number of replicas.
    pub fn replicas(&self) -> usize {
        self.inner.replicas
    }

    /// Fingerprint of the dataset (relative paths, sizes, labels, classes) and the resize
    /// settings, for rendezvous checks: equal on every node holding a copy of the same data
    /// (modification and status-change times and inode numbers are left out; the cache's
    /// own key includes them).
    pub fn fingerprint(&self) -> u64 {
        self.inner.fingerprint
    }

    /// Every file of the split in sample order: its size and times at the scan, and its
    /// content hash where this engine has read its bytes or its cache holds the hash (a
    /// trainer records them with its checkpoints; see [`FileState`](crate::FileState)).
    pub fn files(&self) -> Vec<crate::FileState> {
        let shared = &self.inner.shared;
        shared
            .samples
            .iter()
            .enumerate()
            .map(|(i, s)| crate::FileState {
                size: s.size,
                mtime_ns: u64::try_from(s.mtime_ns).unwrap_or(u64::MAX),
                ctime_ns: i64::try_from(s.identity.ctime_ns).unwrap_or(0),
                inode: s.identity.inode,
                content: shared.contents.get(i).or_else(|| shared.cache.source(i)),
            })
            .collect()
    }

    /// Takes `hash` as sample `index`'s content hash where none is known yet: a trainer
    /// hands back what a resumed checkpoint recorded of files it found unchanged, so its
    /// next checkpoint records them too before this engine reads them again.
    pub fn assume_content(&self, index: usize, hash: u64) {
        if hash != 0 {
            self.inner.shared.contents.note(index, hash);
        }
    }

    /// The cache file in use.
    pub fn cache_path(&self) -> &std::path::Path {
        self.inner.shared.cache.path()
    }

    /// A snapshot of the engine's statistics.
    pub fn stats(&self) -> EngineStats {
        let i = &self.inner;
        let n = self.len().max(1);
        let fill = i.shared.cache.resolved() as f64 / n as f64;
        i.shared
            .counters
            .snapshot(i.workers, (i.jobs.len(), i.job_capacity), fill)
    }

    /// Damaged records and failed writes of the pixel cache so far in this process.
    pub fn cache_health(&self) -> CacheHealth {
        let cache = &self.inner.shared.cache;
        CacheHealth {
            damaged_records: cache.damaged(),
            write_failures: cache.write_failures(),
        }
    }

    /// Bad files met so far (scan time, and decode time as epochs run).
    pub fn bad_files(&self) -> Vec<BadFile> {
        let log = self
            .inner
            .shared
            .bad
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        log.files.clone()
    }

    /// Free batch buffers in the pool (buffers come back when batches are dropped).
    pub fn free_buffers(&self) -> usize {
        self.inner.pool.free()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny_dataset(root: &std::path::Path) {
        let mut cfg = crate::synth::SynthConfig::new(root);
        cfg.classes = 2;
        cfg.train_per_class = 6;
        cfg.valid_per_class = 0;
        cfg.test_per_class = 0;
        cfg.width = 20;
        cfg.height = 20;
        crate::synth::write_dataset(&cfg).unwrap();
    }

    /// The tiny dataset's engine: 16 px, one worker, batches of 4, its cache in `cache`.
    fn tiny_pipeline(data: &std::path::Path, cache: &std::path::Path) -> Pipeline {
        PipelineBuilder::new(crate::DatasetSource::folder(data))
            .image_size(16)
            .cache_dir(cache)
            .workers(1)
            .batch_size(4)
            .build()
            .unwrap()
    }

    fn served(p: &Pipeline, epoch: u64) -> usize {
        p.epoch(epoch, 0, 0).unwrap().map(|b| b.unwrap().len).sum()
    }

    #[test]
    fn a_full_cache_disk_serves_every_image_and_stops_trying_after_one_failure() {
        let data = tempfile::tempdir().unwrap();
        let cache = tempfile::tempdir().unwrap();
        tiny_dataset(data.path());
        let build = || tiny_pipeline(data.path(), cache.path());
        let p = build();
        let path = p.cache_path().to_path_buf();
        // Room for five records, then every write fails with ENOSPC.
        crate::cache::faults::fill_disk_after(&path, 5);
        assert_eq!(served(&p, 0), 12);
        assert_eq!(p.stats().decoded, 12);
        assert_eq!(
            p.cache_health().write_failures,
            1,
            "no write is tried after the first failure"
        );
        assert_eq!(served(&p, 1), 12, "later epochs still serve every image");
        assert_eq!(
            p.stats().decoded,
            12 + 7,
            "the five cached records are hits"
        );
        assert_eq!(p.cache_health().write_failures, 1);
        drop(p);
        // Space again: the next pipeline keeps the five and writes the rest.
        crate::cache::faults::clear(&path);
        let p = build();
        assert_eq!(served(&p, 0), 12);
        assert_eq!(p.stats().decoded, 7);
        assert_eq!(p.cache_health().write_failures, 0);
        drop(p);
        let p = build();
        assert_eq!(served(&p, 0), 12);
        assert_eq!(p.stats().decoded, 0);
    }

    #[test]
    fn a_cache_in_a_read_only_place_is_served_not_refused() {
        let data = tempfile::tempdir().unwrap();
        let cache = tempfile::tempdir().unwrap();
        tiny_dataset(data.path());
        let build = || tiny_pipeline(data.path(), cache.path());
        // Half a cache (a process stopped mid-epoch), then the place turns read-only.
        let p = build();
        let path = p.cache_path().to_path_buf();
        let half: usize = p
            .epoch(0, 0, 0)
            .unwrap()
            .take(2)
            .map(|b| b.unwrap().len)
            .sum();
        assert_eq!(half, 8);
        drop(p);
        crate::cache::faults::read_only(&path);
        let p = build();
        assert_eq!(served(&p, 0), 12, "every image is served");
        let decoded = p.stats().decoded;
        assert!(
            decoded < 12,
            "the cached records are read: {decoded} decoded"
        );
        assert_eq!(p.cache_health().write_failures, 0, "nothing is written");
        drop(p);
        // Complete it with write access, then read it read-only: nothing is decoded.
        crate::cache::faults::clear(&path);
        let p = build();
        assert_eq!(served(&p, 0), 12);
        drop(p);
        crate::cache::faults::read_only(&path);
        let p = build();
        assert_eq!(served(&p, 0), 12);
        assert_eq!(
            p.stats().decoded,
            0,
            "a complete read-only cache is read, not refused"
        );
        assert_eq!(served(&p, 1), 12);
        assert_eq!(p.stats().decoded, 0);
        drop(p);
        crate::cache::faults::clear(&path);
    }

    #[test]
    fn a_cache_that_cannot_be_mapped_is_disabled_and_every_image_is_still_served() {
        let data = tempfile::tempdir().unwrap();
        let cache = tempfile::tempdir().unwrap();
        tiny_dataset(data.path());
        let build = || tiny_pipeline(data.path(), cache.path());
        let path = cache_path(
            &PipelineBuilder::new(crate::DatasetSource::folder(data.path()))
                .image_size(16)
                .cache_dir(cache.path()),
        );
        // A fresh cache (as under a low `ulimit -v`): every epoch decodes every image.
        crate::cache::faults::map_fails(&path, libc::ENOMEM);
        let p = build();
        assert_eq!(p.cache_path(), path);
        assert_eq!(served(&p, 0), 12);
        assert_eq!(served(&p, 1), 12);
        assert_eq!(p.stats().decoded, 24, "nothing is cached");
        assert_eq!(p.cache_health().write_failures, 0);
        drop(p);
        // A complete cache made when mapping worked, then opened where it fails: as the
        // writer, as a second pipeline (a reader) and on a read-only place.
        crate::cache::faults::clear(&path);
        let writer = build();
        assert_eq!(served(&writer, 0), 12);
        crate::cache::faults::map_fails(&path, libc::ENOMEM);
        let reader = build();
        assert_eq!(served(&reader, 0), 12);
        assert_eq!(
            reader.stats().decoded,
            12,
            "the reader decodes without the cache"
        );
        drop(reader);
        drop(writer);
        crate::cache::faults::map_fails(&path, libc::EINVAL);
        let p = build();
        assert_eq!(served(&p, 0), 12);
        assert_eq!(p.stats().decoded, 12);
        drop(p);
        crate::cache::faults::read_only(&path);
        let p = build();
        assert_eq!(served(&p, 0), 12);
        assert_eq!(p.stats().decoded, 12);
        drop(p);
        // Mapping works again: the complete cache is still there and served.
        crate::cache::faults::clear(&path);
        let p = build();
        assert_eq!(served(&p, 0), 12);
        assert_eq!(p.stats().decoded, 0, "the cache survived being disabled");
    }
}
