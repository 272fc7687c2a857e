//! [`Pipeline`]: the running engine, and the per-epoch iterator and stream it hands out.
//!
//! Stages of one epoch iterator, all async tasks on the pipeline's tokio runtime except the
//! decode pool (OS threads), joined by bounded flume channels:
//!
//! ```text
//! planner ─(Job per image, bounded)→ decode pool ─(done per image)→ assembler
//! planner ─(pending batch, bounded by prefetch)→ assembler ─(Batch, bounded by prefetch)→ consumer
//! ```

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use crate::bad::BadFile;
use crate::batch::Batch;
use crate::buffer::BufferPool;
use crate::cache::{Cache, CacheKey};
use crate::order::{epoch_order, micro_batch_len, steps_per_epoch, EpochPlan};
use crate::stats::{CacheHealth, Counters, EngineStats};
use crate::worker::{spawn_pool, BadLog, BufferHolder, Job, Origin, Outcome, Shared};
use crate::{LastBatch, OnBadImage, PipelineBuilder, PipelineError};

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

/// Fingerprint of the split's files (relative paths, sizes, labels), class names and resize
/// settings; with `mtimes`, each file's modification time, status-change time and inode
/// number too (the cache key: an edited file that kept its size, even with its mtime set
/// back, still invalidates). Without them it is equal on nodes holding copies of the data.
fn fingerprint(
    b: &PipelineBuilder,
    classes: &[String],
    samples: &[crate::scan::Sample],
    mtimes: bool,
) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(b"birdtrain-pipeline-v1");
    h.update(b.split.as_str().as_bytes());
    // The cache key's side is its records' (images of any size are cut from them); the
    // data fingerprint's is the images the model sees, which a checkpoint compares.
    let side = if mtimes {
        b.stored_side()
    } else {
        b.image_size
    };
    h.update(&side.to_le_bytes());
    h.update(b.resize_mode.as_str().as_bytes());
    for class in classes {
        h.update(class.as_bytes());
        h.update(&[0]);
    }
    let root = b.source.root();
    for s in samples {
        let rel = root.map_or(&*s.path, |root| {
            s.path.strip_prefix(root).unwrap_or(&s.path)
        });
        h.update(rel.as_os_str().as_encoded_bytes());
        h.update(&[0]);
        h.update(&s.size.to_le_bytes());
        if mtimes {
            h.update(&s.mtime_ns.to_le_bytes());
            h.update(&s.identity.ctime_ns.to_le_bytes());
            h.update(&s.identity.inode.to_le_bytes());
        }
        h.update(&s.label.to_le_bytes());
    }
    h.digest()
}

/// The cache file for this dataset root, split and resize setting (contents are checked by
/// the fingerprint in the header, so an edited dataset reuses, and rebuilds, the same file).
fn cache_path(b: &PipelineBuilder) -> PathBuf {
    let dir = b.cache_dir.clone().unwrap_or_else(|| {
        dirs::cache_dir()
            .unwrap_or_else(std::env::temp_dir)
            .join("birdtrain")
    });
    let (root, layout) = match &b.source {
        crate::DatasetSource::List { samples, .. } => {
            // A list is its own dataset: keyed by its files (absolute) and labels, in order.
            let mut h = xxhash_rust::xxh3::Xxh3::new();
            h.update(b"list");
            for (path, label) in samples {
                let absolute = std::path::absolute(path).unwrap_or_else(|_| path.clone());
                h.update(absolute.as_os_str().as_encoded_bytes());
                h.update(&[0]);
                h.update(&label.to_le_bytes());
            }
            let hash = h.digest();
            return dir.join(format!(
                "list-{}-{}-{}-{hash:016x}.bcache",
                b.split,
                b.stored_side(),
                b.resize_mode
            ));
        }
        crate::DatasetSource::Folder { root } => (root, "folder".to_string()),
        crate::DatasetSource::Flat {
            root,
            valid_fraction,
            rule,
        } => (
            root,
            format!("flat-{valid_fraction}-{}{}", b.seed, rule_key(*rule)),
        ),
        crate::DatasetSource::Csv {
            file,
            base,
            valid_fraction,
            rule,
        } => (
            base,
            format!(
                "csv-{}-{valid_fraction:?}-{}{}",
                file.file_name().unwrap_or_default().to_string_lossy(),
                b.seed,
                rule_key(*rule)
            ),
        ),
    };
    let canonical = std::fs::canonicalize(root).unwrap_or_else(|_| root.to_path_buf());
    let key = format!("{}|{layout}", canonical.display());
    let hash = xxhash_rust::xxh3::xxh3_64(key.as_bytes());
    let name: String = root
        .file_name()
        .map(|n| {
            n.to_string_lossy()
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
                .collect()
        })
        .unwrap_or_default();
    dir.join(format!(
        "{name}-{}-{}-{}-{hash:016x}.bcache",
        b.split,
        b.stored_side(),
        b.resize_mode
    ))
}

/// The bad-files report and a cache folder given by the caller must lie outside the dataset
/// (a list of files to classify is no dataset folder: anything may lie beside them).
fn refuse_writes_into_dataset(b: &PipelineBuilder) -> Result<(), PipelineError> {
    if matches!(b.source, crate::DatasetSource::List { .. }) {
        return Ok(());
    }
    let places = [
        (
            "the bad-files report",
            b.bad_files_report.as_deref(),
            "write it outside the dataset; a trainer writes it into its run folder, so give --out a folder outside --data",
        ),
        (
            "the cache folder",
            b.cache_dir.as_deref(),
            "give --cache-dir a folder outside --data",
        ),
    ];
    for (what, path, hint) in places {
        let Some(path) = path else { continue };
        if let Some(data) = b.source.folder_holding(path)? {
            return Err(PipelineError::WritesIntoDataset {
                what,
                path: path.to_path_buf(),
                data,
                hint,
            });
        }
    }
    Ok(())
}

/// The split rule's part of a cache file's key: none for version 1, so the caches made
/// before version 2 keep their names.
fn rule_key(rule: crate::SplitRule) -> String {
    match rule {
        crate::SplitRule::PerFileDraw => String::new(),
        rule => format!("-split{}", rule.version()),
    }
}

/// Checks the counts that depend on the dataset and the machine; returns the bytes of one
/// batch buffer. A micro-batch never holds more images than the split (except with `pad`,
/// which repeats images to fill it), so buffers are sized for what can really come.
fn check_counts(b: &PipelineBuilder, images: usize) -> Result<usize, PipelineError> {
    // Training replicas each need an image per step; evaluation (partial batches) may leave
    // some replicas empty, which the consumer already handles.
    if b.split == crate::Split::Train && b.replicas > images {
        return Err(PipelineError::Limit {
            name: "replicas",
            value: b.replicas.to_string(),
            limit: format!("the split `{}` has {images} images", b.split),
            hint: format!(
                "every replica needs at least one image per step; use at most {images} replicas"
            ),
        });
    }
    if b.replicas.checked_mul(b.batch_size).is_none() {
        return Err(PipelineError::Limit {
            name: "batch_size",
            value: b.batch_size.to_string(),
            limit: format!(
                "{} replicas × {} images overflows",
                b.replicas, b.batch_size
            ),
            hint: "use a smaller batch size".into(),
        });
    }
    let per_batch = match b.last_batch {
        LastBatch::Pad => b.batch_size,
        LastBatch::Partial | LastBatch::Drop => b.batch_size.min(images),
    };
    let record = b.image_size as usize * b.image_size as usize * 3;
    // Buffers alive per epoch iterator: pending and ready batches (prefetch each), the one
    // being assembled and the one the consumer holds. At most half the available memory,
    // so the consumer (a model) keeps the rest.
    let in_flight = b.prefetch.saturating_mul(2).saturating_add(2);
    let bytes = per_batch.checked_mul(record);
    let need = bytes.map(|bytes| (bytes as u64).saturating_mul(in_flight as u64));
    let budget = crate::limits::available_memory().map(|m| m / 2);
    match (bytes, need, budget) {
        (Some(bytes), Some(need), Some(budget)) if need <= budget => Ok(bytes),
        (Some(bytes), Some(_), None) => Ok(bytes),
        (_, need, budget) => {
            let need = need.map_or("more bytes than exist".into(), crate::limits::human_bytes);
            let budget = budget.map_or("unknown".into(), crate::limits::human_bytes);
            let (name, value) = if b.prefetch > 64 && per_batch <= 4096 {
                ("prefetch", b.prefetch.to_string())
            } else {
                ("batch_size", b.batch_size.to_string())
            };
            Err(PipelineError::Limit {
                name,
                value,
                limit: format!(
                    "{in_flight} batch buffers of {per_batch} images of {s}×{s} need {need}, and \
                     batch buffers may take half the available memory ({budget})",
                    s = b.image_size
                ),
                hint: format!("use a smaller {name}"),
            })
        }
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
            crate::bad::write_report(path, &log.files)?;
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

    /// Batches of `replica` for `epoch`, from `start_step` on, as a blocking iterator.
    pub fn epoch(
        &self,
        epoch: u64,
        replica: usize,
        start_step: usize,
    ) -> Result<EpochIter, PipelineError> {
        let (rx, expected) = self.launch(epoch, replica, start_step)?;
        Ok(EpochIter {
            rx,
            remaining: expected,
            shared: Arc::clone(&self.inner.shared),
            _inner: Arc::clone(&self.inner),
        })
    }

    /// The same batches as [`Pipeline::epoch`], as an async stream.
    pub fn epoch_stream(
        &self,
        epoch: u64,
        replica: usize,
        start_step: usize,
    ) -> Result<EpochStream, PipelineError> {
        let (rx, expected) = self.launch(epoch, replica, start_step)?;
        Ok(EpochStream {
            rx: rx.into_stream(),
            remaining: expected,
            shared: Arc::clone(&self.inner.shared),
            _inner: Arc::clone(&self.inner),
        })
    }

    /// Starts the planner and assembler tasks of one epoch iterator.
    fn launch(
        &self,
        epoch: u64,
        replica: usize,
        start_step: usize,
    ) -> Result<(flume::Receiver<Result<Batch, PipelineError>>, usize), PipelineError> {
        let i = &self.inner;
        if replica >= i.replicas {
            return Err(PipelineError::InvalidSetting {
                name: "replica",
                value: replica.to_string(),
                hint: "must be below the pipeline's replica count",
            });
        }
        let steps = self.steps_per_epoch();
        if start_step > steps {
            return Err(PipelineError::StepOutOfRange {
                step: start_step,
                steps,
            });
        }
        if let Some(fatal) = i.shared.fatal() {
            return Err(i.shared.fatal_error(fatal));
        }
        let order = epoch_order(
            i.shared.samples.iter().map(|s| s.label),
            i.sampling,
            i.shuffle,
            i.seed,
            epoch,
        );
        let plan = EpochPlan::new(order, i.replicas, i.batch_size, i.last_batch);
        let (out_tx, out_rx) = flume::bounded(i.prefetch);
        let (pending_tx, pending_rx) = flume::bounded(i.prefetch);
        let cancel = Arc::new(AtomicBool::new(false));
        i.shared
            .counters
            .ready_capacity
            .fetch_add(i.prefetch, Ordering::Relaxed);
        let planner = Planner {
            shared: Arc::clone(&i.shared),
            plan,
            epoch,
            replica,
            jobs: i.jobs.clone(),
            pool_free: i.pool.returner(),
            cancel: Arc::clone(&cancel),
        };
        let pool = i.pool.clone();
        let runtime = &i
            .orchestrator
            .as_ref()
            .expect("the orchestrator lives as long as Inner")
            .handle;
        let planned = runtime.spawn(planner.run(start_step, steps, pool, pending_tx));
        let assembler = Assembler {
            shared: Arc::clone(&i.shared),
            cancel,
            prefetch: i.prefetch,
            returner: i.pool.returner(),
        };
        let errors = out_tx.clone();
        let supervised = Arc::clone(&i.shared);
        let assembled = runtime.spawn(assembler.run(pending_rx, out_tx));
        // A panicking stage must reach the consumer as an error with its message, not as a
        // silently short epoch: the supervisor holds a sender until both stages are done.
        runtime.spawn(async move {
            for (stage, handle) in [("planner", planned), ("assembler", assembled)] {
                if let Err(e) = handle.await {
                    let message = match e.try_into_panic() {
                        Ok(payload) => crate::worker::panic_message(payload.as_ref()),
                        Err(e) => e.to_string(),
                    };
                    // Counted as a ready item, as the consumer uncounts every item it takes.
                    let counters = &supervised.counters;
                    counters.ready_batches.fetch_add(1, Ordering::Relaxed);
                    let error = PipelineError::StagePanicked { stage, message };
                    if errors.send_async(Err(error)).await.is_err() {
                        counters.ready_batches.fetch_sub(1, Ordering::Relaxed);
                    }
                    return;
                }
            }
        });
        Ok((out_rx, steps - start_step))
    }
}

/// A planned micro-batch whose images are being produced.
struct Pending {
    epoch: u64,
    step: usize,
    replica: usize,
    indices: Vec<u32>,
    holder: Arc<BufferHolder>,
    done: flume::Receiver<(usize, Result<Outcome, PipelineError>)>,
}

struct Planner {
    shared: Arc<Shared>,
    plan: EpochPlan,
    epoch: u64,
    replica: usize,
    jobs: flume::Sender<Job>,
    pool_free: flume::Sender<crate::buffer::Slot>,
    cancel: Arc<AtomicBool>,
}

impl Planner {
    async fn run(
        self,
        start_step: usize,
        steps: usize,
        pool: BufferPool,
        pending_tx: flume::Sender<Result<Pending, PipelineError>>,
    ) {
        let record = self.shared.image_bytes();
        // The planner holds the pool, never the pipeline: the runtime is not kept alive (or
        // dropped) from inside its own tasks.
        for step in start_step..steps {
            let slot = match pool.take_async().await {
                Ok(slot) => slot,
                Err(e) => {
                    let _ = pending_tx.send_async(Err(e)).await;
                    return;
                }
            };
            let indices = self.plan.micro_batch(step, self.replica);
            let holder = Arc::new(BufferHolder {
                slot: Mutex::new(Some(slot)),
                returner: self.pool_free.clone(),
            });
            let (done_tx, done_rx) = flume::bounded(indices.len().max(1));
            let dests = holder.dests(indices.len(), record);
            for (position, (&index, dest)) in indices.iter().zip(dests).enumerate() {
                let job = Job {
                    shared: Arc::clone(&self.shared),
                    index,
                    epoch: self.epoch,
                    position,
                    dest,
                    holder: Arc::clone(&holder),
                    cancel: Arc::clone(&self.cancel),
                    done: done_tx.clone(),
                };
                if self.jobs.send_async(job).await.is_err() {
                    return; // The pipeline is shutting down.
                }
            }
            let pending = Pending {
                epoch: self.epoch,
                step,
                replica: self.replica,
                indices,
                holder,
                done: done_rx,
            };
            if pending_tx.send_async(Ok(pending)).await.is_err() {
                self.cancel.store(true, Ordering::Relaxed);
                return;
            }
        }
    }
}

impl BufferPool {
    /// A slot without blocking the orchestrator: allocation (possibly pinned memory, slow)
    /// runs on a thread of its own (a pool allocates at most `2 × prefetch + 2` buffers, so
    /// few such threads ever start; tokio's blocking pool would panic where the OS refuses
    /// one).
    async fn take_async(&self) -> Result<crate::buffer::Slot, PipelineError> {
        if self.free() > 0 {
            return self.take();
        }
        let (tx, rx) = flume::bounded(1);
        let this = self.clone();
        crate::threads::spawn("pipeline-alloc", move || {
            let _ = tx.send(this.take());
        })?;
        rx.recv_async()
            .await
            .map_err(|_| PipelineError::Allocator {
                message: "the allocation task ended without a result".into(),
                source: None,
            })?
    }
}

struct Assembler {
    shared: Arc<Shared>,
    cancel: Arc<AtomicBool>,
    prefetch: usize,
    returner: flume::Sender<crate::buffer::Slot>,
}

impl Assembler {
    async fn run(
        self,
        pending_rx: flume::Receiver<Result<Pending, PipelineError>>,
        out_tx: flume::Sender<Result<Batch, PipelineError>>,
    ) {
        let counters = &self.shared.counters;
        while let Ok(pending) = pending_rx.recv_async().await {
            let result = match pending {
                Ok(pending) => self.assemble(pending).await,
                Err(e) => Err(e),
            };
            let failed = result.is_err();
            let result = match result {
                Ok(batch) => match self.shared.fatal() {
                    Some(fatal) => Err(self.shared.fatal_error(fatal)),
                    None => Ok(batch),
                },
                Err(e) => Err(e),
            };
            let failed = failed || result.is_err();
            counters.ready_batches.fetch_add(1, Ordering::Relaxed);
            let delivered = out_tx.send_async(result).await.is_ok();
            if !delivered {
                counters.ready_batches.fetch_sub(1, Ordering::Relaxed);
            }
            if !delivered || failed {
                // Nothing more comes from this epoch: stop queued jobs from doing work.
                self.cancel.store(true, Ordering::Relaxed);
                break;
            }
        }
        counters
            .ready_capacity
            .fetch_sub(self.prefetch, Ordering::Relaxed);
    }

    async fn assemble(&self, p: Pending) -> Result<Batch, PipelineError> {
        let n = p.indices.len();
        let mut outcomes = vec![Outcome::Cancelled; n];
        for _ in 0..n {
            match p.done.recv_async().await {
                Ok((pos, Ok(outcome))) => outcomes[pos] = outcome,
                Ok((_, Err(e))) => return Err(e),
                Err(_) => {
                    return Err(PipelineError::Stopped {
                        reason:
                            "a decode job was dropped without a result (pipeline shutting down)"
                                .into(),
                    })
                }
            }
        }
        let mut slot = p
            .holder
            .slot
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .expect("every job has reported, so the slot is back (programmer error otherwise)");
        let record = self.shared.image_bytes();
        let pixels = slot.pixels.as_mut_slice();
        slot.labels.clear();
        slot.ids.clear();
        // Keep plan order; close the gaps of skipped bad files.
        for (pos, &index) in p.indices.iter().enumerate() {
            if outcomes[pos] == Outcome::Skipped {
                continue;
            }
            let to = slot.labels.len();
            if to != pos {
                pixels.copy_within(pos * record..(pos + 1) * record, to * record);
            }
            slot.labels.push(self.shared.samples[index as usize].label);
            slot.ids.push(u64::from(index));
        }
        self.shared.counters.batches.fetch_add(1, Ordering::Relaxed);
        let sample_ids = std::mem::take(&mut slot.ids);
        Ok(Batch {
            epoch: p.epoch,
            step: p.step,
            replica: p.replica,
            len: sample_ids.len(),
            image_size: self.shared.image_size,
            sample_ids,
            slot: Some(slot),
            returner: self.returner.clone(),
        })
    }
}

/// One replica's batches of one epoch, blocking. Ends after the last step or the first error.
pub struct EpochIter {
    rx: flume::Receiver<Result<Batch, PipelineError>>,
    remaining: usize,
    shared: Arc<Shared>,
    _inner: Arc<Inner>,
}

impl std::fmt::Debug for EpochIter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EpochIter")
            .field("remaining", &self.remaining)
            .finish_non_exhaustive()
    }
}

/// Turns one received item into the iterator's next value, ending after an error and
/// reporting an early end (a crashed stage) as an error rather than a short epoch.
fn next_item(
    remaining: &mut usize,
    shared: &Shared,
    item: Option<Result<Batch, PipelineError>>,
) -> Option<Result<Batch, PipelineError>> {
    if *remaining == 0 {
        return None;
    }
    match item {
        Some(Ok(batch)) => {
            shared
                .counters
                .ready_batches
                .fetch_sub(1, Ordering::Relaxed);
            *remaining -= 1;
            Some(Ok(batch))
        }
        Some(Err(e)) => {
            shared
                .counters
                .ready_batches
                .fetch_sub(1, Ordering::Relaxed);
            *remaining = 0;
            Some(Err(e))
        }
        None => {
            let left = std::mem::take(remaining);
            Some(Err(PipelineError::Stopped {
                reason: format!("the engine's stages ended with {left} steps of the epoch left"),
            }))
        }
    }
}

impl Iterator for EpochIter {
    type Item = Result<Batch, PipelineError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.remaining == 0 {
            return None;
        }
        let started = Instant::now();
        let item = self.rx.recv().ok();
        Counters::add_nanos(&self.shared.counters.wait_nanos, started);
        next_item(&mut self.remaining, &self.shared, item)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(self.remaining))
    }
}

/// One replica's batches of one epoch as an async stream; the same items as [`EpochIter`].
pub struct EpochStream {
    rx: flume::r#async::RecvStream<'static, Result<Batch, PipelineError>>,
    remaining: usize,
    shared: Arc<Shared>,
    _inner: Arc<Inner>,
}

impl std::fmt::Debug for EpochStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EpochStream")
            .field("remaining", &self.remaining)
            .finish_non_exhaustive()
    }
}

impl futures_core::Stream for EpochStream {
    type Item = Result<Batch, PipelineError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.remaining == 0 {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.rx).poll_next(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(item) => Poll::Ready(next_item(&mut this.remaining, &this.shared, item)),
        }
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

    #[test]
    fn the_default_cache_lives_in_the_per_user_cache_directory() {
        let b = PipelineBuilder::new(crate::DatasetSource::folder("/data/285birds")).image_size(96);
        let path = cache_path(&b);
        let expected = dirs::cache_dir()
            .unwrap_or_else(std::env::temp_dir)
            .join("birdtrain");
        assert!(path.starts_with(&expected), "{}", path.display());
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("285birds-train-96-direct-"), "{name}");
        // Another split or resize setting is another file.
        assert_ne!(cache_path(&b.clone().split(crate::Split::Valid)), path);
        assert_ne!(
            cache_path(
                &b.clone()
                    .resize_mode(crate::ResizeMode::ShorterSideCenterCrop)
            ),
            path
        );
        assert_eq!(
            cache_path(&b.clone().cache_dir("/x")).parent().unwrap(),
            std::path::Path::new("/x")
        );
    }
}
