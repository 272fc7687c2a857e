//! `birdtrain._engine`: the input engine (`pipeline` crate) for the `birdtrain` Python
//! package. The Python side (`birdtrain/__init__.py`) validates the user's arguments and turns
//! the DLPack capsules handed out here into torch tensors.

mod dlpack;
mod errors;
mod mirror;
mod page_locked;

use std::collections::HashMap;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use pipeline::{
    AutoAugment, Batch, ColorJitter, DatasetSource, LastBatch, OnBadImage, Pipeline,
    PipelineBuilder, PipelineError, RandomResizedCrop, ResizeMode, Split,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::errors::to_py;
use crate::page_locked::{Driver, PageLockedAllocator, PageLocker};

/// How long a wait for a batch sleeps between looks at Python's signals (Ctrl-C).
const SIGNAL_POLL: Duration = Duration::from_millis(50);

/// Parses one of the engine's enums, naming the Python argument when the word is unknown.
fn parse<T: FromStr>(argument: &str, word: &str, expected: &str) -> PyResult<T> {
    word.parse()
        .map_err(|_| PyValueError::new_err(format!("{argument}={word:?}: expected {expected}")))
}

/// One split of a dataset, ready to hand out epochs of one rank.
#[pyclass(module = "birdtrain._engine", frozen)]
struct Engine {
    pipeline: Pipeline,
    rank: usize,
    seed: u64,
    flip: bool,
    pid: u32,
    page_locker: Option<Arc<PageLocker>>,
    page_lock_refused: Option<String>,
}

impl Engine {
    fn same_process(&self) -> PyResult<()> {
        if std::process::id() == self.pid {
            return Ok(());
        }
        Err(pyo3::exceptions::PyRuntimeError::new_err(
            "this birdtrain.Loader was built in another process (its decode threads did not survive fork): build the Loader in the process that iterates it",
        ))
    }
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (
        path, *, split, image_size, batch_size, seed, shuffle, crop_scale, flip, color_jitter,
        auto_augment, store_size, resize_mode, crop_pct, last_batch, rank, world_size, workers,
        prefetch, cache_dir, on_bad_image, valid_fraction, page_lock = None, page_lock_device = 0
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        split: &str,
        image_size: u32,
        batch_size: usize,
        seed: u64,
        shuffle: bool,
        crop_scale: Option<f32>,
        flip: bool,
        color_jitter: f32,
        auto_augment: Option<&str>,
        store_size: Option<u32>,
        resize_mode: &str,
        crop_pct: f32,
        last_batch: &str,
        rank: usize,
        world_size: usize,
        workers: Option<usize>,
        prefetch: usize,
        cache_dir: Option<PathBuf>,
        on_bad_image: &str,
        valid_fraction: Option<f32>,
        page_lock: Option<HashMap<String, usize>>,
        page_lock_device: i32,
    ) -> PyResult<Self> {
        let split: Split = parse("split", split, "'train', 'valid' or 'test'")?;
        let resize_mode: ResizeMode =
            parse("resize_mode", resize_mode, "'direct' or 'center-crop'")?;
        let last_batch: LastBatch = parse("last_batch", last_batch, "'partial', 'drop' or 'pad'")?;
        let on_bad_image: OnBadImage = parse("on_bad_image", on_bad_image, "'skip' or 'fail'")?;
        let auto_augment = match auto_augment {
            None => None,
            Some(word) => AutoAugment::parse(word).ok_or_else(|| {
                PyValueError::new_err(format!(
                    "auto_augment={word:?}: expected {}",
                    AutoAugment::CHOICES
                ))
            })?,
        };
        if rank >= world_size {
            return Err(PyValueError::new_err(format!(
                "rank={rank}: must be below world_size={world_size}"
            )));
        }
        let mut builder = PipelineBuilder::new(DatasetSource::at(path, valid_fraction))
            .split(split)
            .image_size(image_size)
            .batch_size(batch_size)
            .seed(seed)
            .shuffle(shuffle)
            .random_resized_crop(crop_scale.map(RandomResizedCrop::with_min_scale))
            .color_jitter((color_jitter > 0.0).then(|| ColorJitter::uniform(color_jitter)))
            .auto_augment(auto_augment)
            .store_size(store_size)
            .resize_mode(resize_mode)
            .center_crop((crop_pct != 1.0).then_some(crop_pct))
            .last_batch(last_batch)
            .replicas(world_size)
            .prefetch(prefetch)
            .on_bad_image(on_bad_image);
        if let Some(workers) = workers {
            builder = builder.workers(workers);
        }
        if let Some(dir) = cache_dir {
            builder = builder.cache_dir(dir);
        }
        if flip {
            builder = builder.mirrored_later(Some(mirror::mirrored_later(seed)));
        }
        // A driver that refuses leaves the buffers ordinary: pinning is an optimisation, and
        // the Python side warns with the message.
        let (page_locker, page_lock_refused) = match page_lock {
            None => (None, None),
            Some(addresses) => {
                // SAFETY: the Python side resolved these names in the CUDA driver torch loaded.
                match unsafe { Driver::from_addresses(&addresses) }
                    .and_then(|driver| PageLocker::new(driver, page_lock_device))
                {
                    Ok(locker) => (Some(Arc::new(locker)), None),
                    Err(e) => (None, Some(e)),
                }
            }
        };
        if let Some(locker) = &page_locker {
            builder = builder.allocator(Arc::new(PageLockedAllocator {
                locker: Arc::clone(locker),
            }));
        }
        let pipeline = py.allow_threads(|| builder.build()).map_err(to_py)?;
        Ok(Self {
            pipeline,
            rank,
            seed,
            flip,
            pid: std::process::id(),
            page_locker,
            page_lock_refused,
        })
    }

    /// Class names, sorted; index = label.
    #[getter]
    fn classes(&self) -> Vec<String> {
        self.pipeline.classes().to_vec()
    }

    /// Batches of each rank per epoch.
    fn steps_per_epoch(&self) -> usize {
        self.pipeline.steps_per_epoch()
    }

    /// Images in the split.
    fn samples(&self) -> usize {
        self.pipeline.len()
    }

    /// The dataset and resize settings' fingerprint (the same on every copy of the data).
    fn fingerprint(&self) -> u64 {
        self.pipeline.fingerprint()
    }

    /// Free batch buffers in the engine's pool.
    fn free_buffers(&self) -> usize {
        self.pipeline.free_buffers()
    }

    /// The engine's counters: decoded images, cache hits, bad files, batches, decode rate,
    /// the consumer's wait and the cache's fill.
    fn stats(&self, py: Python<'_>) -> PyResult<PyObject> {
        let s = self.pipeline.stats();
        let stats = pyo3::types::PyDict::new(py);
        stats.set_item("decoded", s.decoded)?;
        stats.set_item("cache_hits", s.cache_hits)?;
        stats.set_item("bad_files", s.bad_files)?;
        stats.set_item("batches", s.batches)?;
        stats.set_item("decode_images_per_sec", s.decode_images_per_sec)?;
        stats.set_item("consumer_wait_seconds", s.consumer_wait_seconds)?;
        stats.set_item("cache_fill", s.cache_fill)?;
        let (locked, failures, _) = self.page_lock_report();
        stats.set_item("page_locked_buffers", locked)?;
        stats.set_item("page_lock_failures", failures)?;
        Ok(stats.into_any().unbind())
    }

    /// Batch buffers page-locked now, buffers the driver refused to page-lock, and the first
    /// refusal's message (all zero and `None` when buffers are not page-locked).
    fn page_lock_report(&self) -> (usize, usize, Option<String>) {
        match (&self.page_locker, &self.page_lock_refused) {
            (Some(locker), _) => locker.report(),
            (None, refused) => (0, usize::from(refused.is_some()), refused.clone()),
        }
    }

    /// The names of the CUDA driver functions `page_lock` maps to their addresses.
    #[staticmethod]
    fn page_lock_functions() -> Vec<&'static str> {
        page_locked::DRIVER_FUNCTIONS.to_vec()
    }

    /// The pixel cache file.
    fn cache_path(&self) -> PathBuf {
        self.pipeline.cache_path().to_path_buf()
    }

    /// Bad files met so far: `(path, kind)`.
    fn bad_files(&self) -> Vec<(PathBuf, String)> {
        self.pipeline
            .bad_files()
            .into_iter()
            .map(|f| (f.path, errors::kind_word(f.kind)))
            .collect()
    }

    /// The batches of this rank in `epoch`, from `start_step` on.
    fn epoch(&self, py: Python<'_>, epoch: u64, start_step: usize) -> PyResult<EpochBatches> {
        self.same_process()?;
        let iter = py
            .allow_threads(|| self.pipeline.epoch(epoch, self.rank, start_step))
            .map_err(to_py)?;
        // A thread of its own finishes each batch (mirror, labels) while Python trains, and
        // lets the Python side wait in short slices that look at Ctrl-C.
        let (tx, rx) = flume::bounded(1);
        let flip = self.flip.then_some(self.seed);
        pipeline::threads::spawn("birdtrain-py-batches", move || {
            for item in iter {
                let item = item.map(|batch| Prepared::new(batch, flip));
                let failed = item.is_err();
                if tx.send(item).is_err() || failed {
                    break;
                }
            }
        })
        .map_err(|e| to_py(e.into()))?;
        Ok(EpochBatches { rx, pid: self.pid })
    }
}

/// A batch with its labels widened to int64, ready to be handed out.
struct Prepared {
    batch: Batch,
    labels: Vec<i64>,
}

impl Prepared {
    fn new(mut batch: Batch, flip_seed: Option<u64>) -> Self {
        if let Some(seed) = flip_seed {
            mirror::mirror_batch(&mut batch, seed);
        }
        let labels = batch.labels()[..batch.len]
            .iter()
            .map(|&l| i64::from(l))
            .collect();
        Self { batch, labels }
    }
}

/// One epoch's batches of one rank: each item is `(images, labels, step)`, the first two
/// DLPack capsules (uint8 `[B, S, S, 3]`, int64 `[B]`).
#[pyclass(module = "birdtrain._engine", frozen)]
struct EpochBatches {
    rx: flume::Receiver<Result<Prepared, PipelineError>>,
    pid: u32,
}

#[pymethods]
impl EpochBatches {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<(PyObject, PyObject, usize)>> {
        if std::process::id() != self.pid {
            return Err(pyo3::exceptions::PyRuntimeError::new_err(
                "this epoch was started in another process (fork)",
            ));
        }
        let item = loop {
            match py.allow_threads(|| self.rx.recv_timeout(SIGNAL_POLL)) {
                Ok(item) => break item,
                Err(flume::RecvTimeoutError::Timeout) => py.check_signals()?,
                Err(flume::RecvTimeoutError::Disconnected) => return Ok(None),
            }
        };
        let Prepared { mut batch, labels } = item.map_err(to_py)?;
        let side = i64::from(batch.image_size);
        let len = batch.len as i64;
        let step = batch.step;
        let pixels = batch.pixels_mut().as_mut_ptr();
        let mut labels = Box::new(labels);
        let label_data = labels.as_mut_ptr().cast::<u8>();
        // SAFETY: the pixels live in the batch's buffer, which the engine reuses only after
        // the batch is dropped, and the capsule owns the batch; likewise the labels' vector.
        let images = unsafe {
            dlpack::capsule(
                py,
                pixels,
                dlpack::Element::U8,
                &[len, side, side, 3],
                Box::new(batch),
            )?
        };
        let labels =
            unsafe { dlpack::capsule(py, label_data, dlpack::Element::I64, &[len], labels)? };
        Ok(Some((images, labels, step)))
    }
}

#[pymodule]
fn _engine(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Engine>()?;
    m.add_class::<EpochBatches>()?;
    errors::register(m)?;
    Ok(())
}
