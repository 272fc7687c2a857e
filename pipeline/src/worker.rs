//! The decode pool: plain OS threads that turn a sample index into `S×S×3` pixels in a batch
//! slot, from the cache when the record is there, else by read → decode → resize → cache.

use std::io::Read;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::bad::{BadFile, BadFileKind};
use crate::buffer::Slot;
use crate::cache::{Cache, Lookup};
use crate::crop::Cut;
use crate::decode::{decode_rgb8_into, Pixels};
use crate::resize::SquareResizer;
use crate::scan::Sample;
use crate::stats::Counters;
use crate::{
    AugmentDraw, AugmentScratch, AutoAugment, ColorJitter, CropWindow, JitterDraw, OnBadImage,
    PipelineError, ResizeMode,
};

/// The detail of a bad file known from an earlier pass over the cache.
pub(crate) const FOUND_EARLIER: &str = "found by an earlier pass (kept in the cache)";

/// Bad files of one split that get a warning line each; later ones are summed up in one line
/// (the bad-files report and [`Pipeline::bad_files`](crate::Pipeline::bad_files) list them
/// all), so a broken dataset cannot flood the log.
pub(crate) const WARNED_BAD_FILES: usize = 20;

/// Everything workers and assemblers share; owned through `Arc`.
pub(crate) struct Shared {
    /// Where the samples came from, for the errors that name it.
    pub(crate) origin: Origin,
    pub(crate) split: String,
    pub(crate) samples: Vec<Sample>,
    pub(crate) class_names: Vec<String>,
    /// Side of the images handed out.
    pub(crate) image_size: u32,
    /// Side of the squares the cache keeps (at least `image_size`).
    pub(crate) stored_side: u32,
    pub(crate) resize_mode: ResizeMode,
    /// The crop cut out of every stored square, when asked for.
    pub(crate) crop: Option<Cut>,
    /// The colour jitter of every image and the seed of its draws, when asked for.
    pub(crate) jitter: Option<(ColorJitter, u64)>,
    /// The automatic augmentation policy of every image and the seed of its draws.
    pub(crate) auto_augment: Option<(AutoAugment, u64)>,
    /// Which images the consumer mirrors afterwards.
    pub(crate) mirrored_later: Option<crate::builder::MirroredLater>,
    pub(crate) on_bad: OnBadImage,
    pub(crate) max_pixels: u64,
    pub(crate) cache: Cache,
    /// The content hash of each sample's file, once read (or found in the cache).
    pub(crate) contents: crate::content::Contents,
    pub(crate) counters: Counters,
    pub(crate) bad: Mutex<BadLog>,
    pub(crate) report: Option<std::path::PathBuf>,
}

/// Bad files met so far and the per-class tallies that detect a class with no good image.
#[derive(Debug, Default)]
pub(crate) struct BadLog {
    pub(crate) files: Vec<BadFile>,
    /// Sample indices already counted (decode-time bad files).
    pub(crate) seen: std::collections::HashSet<u32>,
    pub(crate) per_class: Vec<usize>,
    pub(crate) class_totals: Vec<usize>,
    /// Decode-time bad files logged so far (a warning line each up to [`WARNED_BAD_FILES`]).
    pub(crate) warned: usize,
}

/// Where a split's samples came from: it decides which dataset-level failures apply.
#[derive(Debug, Clone)]
pub(crate) enum Origin {
    /// Class folders under this dataset root (folder or flat layout).
    Folders(std::path::PathBuf),
    /// The rows of this dataset CSV.
    Csv(std::path::PathBuf),
    /// A caller's list, whose labels are the caller's business: a class may have no image.
    List,
}

/// A dataset-level failure discovered while decoding, re-created for each consumer.
#[derive(Debug, Clone)]
pub(crate) enum Fatal {
    AllBad(usize),
    Class(usize),
}

impl Shared {
    /// Bytes of one image handed out.
    pub(crate) fn image_bytes(&self) -> usize {
        self.image_size as usize * self.image_size as usize * 3
    }

    /// Bytes of one stored square.
    pub(crate) fn stored_bytes(&self) -> usize {
        self.stored_side as usize * self.stored_side as usize * 3
    }

    /// Counts a decode-time bad file once, logs it and rewrites the report.
    pub(crate) fn note_bad(&self, index: u32, file: BadFile) {
        let mut log = self.bad.lock().unwrap_or_else(|p| p.into_inner());
        if !log.seen.insert(index) {
            return;
        }
        if log.warned < WARNED_BAD_FILES {
            tracing::warn!(
                "skipping bad image {}: {} ({})",
                file.path.display(),
                file.kind,
                file.detail
            );
        } else if log.warned == WARNED_BAD_FILES {
            warn_more_bad_files(&self.split, self.report.as_deref());
        }
        log.warned += 1;
        let label = self.samples[index as usize].label as usize;
        log.per_class[label] += 1;
        log.files.push(file);
        self.counters.bad_files.fetch_add(1, Ordering::Relaxed);
        if let Some(path) = &self.report {
            if let Err(e) = crate::bad_report::write_report(path, &log.files) {
                tracing::warn!("{e}");
            }
        }
    }

    /// Whether bad files have made the dataset unusable.
    pub(crate) fn fatal(&self) -> Option<Fatal> {
        let log = self.bad.lock().unwrap_or_else(|p| p.into_inner());
        if log.seen.len() == self.samples.len() {
            return Some(Fatal::AllBad(log.files.len()));
        }
        if matches!(self.origin, Origin::List) {
            return None;
        }
        log.per_class
            .iter()
            .zip(&log.class_totals)
            .position(|(bad, total)| *total > 0 && bad == total)
            .map(Fatal::Class)
    }

    pub(crate) fn fatal_error(&self, fatal: Fatal) -> PipelineError {
        let log = self.bad.lock().unwrap_or_else(|p| p.into_inner());
        let root = match (&self.origin, &fatal) {
            (Origin::Folders(root), _) => root,
            (Origin::Csv(file), Fatal::Class(class)) => {
                let of_class: std::collections::HashSet<&std::path::Path> = self
                    .samples
                    .iter()
                    .filter(|s| s.label as usize == *class)
                    .map(|s| s.path.as_path())
                    .collect();
                let class_bad: Vec<&BadFile> = log
                    .files
                    .iter()
                    .filter(|f| of_class.contains(f.path.as_path()))
                    .collect();
                return PipelineError::csv_class_all_bad(
                    &self.class_names[*class],
                    file,
                    &self.split,
                    &class_bad,
                );
            }
            (Origin::Csv(_) | Origin::List, _) => return PipelineError::list_all_bad(&log.files),
        };
        match fatal {
            Fatal::AllBad(bad) => PipelineError::AllImagesBad {
                root: root.clone(),
                split: self.split.clone(),
                bad,
            },
            Fatal::Class(class) => PipelineError::ClassWithoutImages {
                class: self.class_names[class].clone(),
                path: root.join(&self.split).join(&self.class_names[class]),
            },
        }
    }
}

/// Where a job writes its pixels: one image's slot in a batch buffer.
pub(crate) struct Dest {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: each Dest covers a distinct range of a buffer that the job's `BufferHolder` keeps
// alive; no one else touches that range until the job reports completion over a channel.
unsafe impl Send for Dest {}

/// Keeps a batch buffer alive while jobs write into it; returns it to the pool if abandoned.
pub(crate) struct BufferHolder {
    pub(crate) slot: Mutex<Option<Slot>>,
    pub(crate) returner: flume::Sender<Slot>,
}

impl BufferHolder {
    /// Destination `j` of `count` in the held buffer.
    pub(crate) fn dests(&self, count: usize, record_bytes: usize) -> Vec<Dest> {
        let mut guard = self.slot.lock().unwrap_or_else(|p| p.into_inner());
        let slot = guard
            .as_mut()
            .expect("a fresh holder has its slot (programmer error)");
        let base = slot.pixels.as_mut_slice();
        assert!(base.len() >= count * record_bytes, "pool checked the size");
        let ptr = base.as_mut_ptr();
        (0..count)
            .map(|j| Dest {
                // SAFETY: j·record_bytes + record_bytes ≤ the buffer length (asserted above).
                ptr: unsafe { ptr.add(j * record_bytes) },
                len: record_bytes,
            })
            .collect()
    }
}

impl Drop for BufferHolder {
    fn drop(&mut self) {
        if let Some(slot) = self
            .slot
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            let _ = self.returner.send(slot);
        }
    }
}

/// How one image turned out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Hit,
    Decoded,
    Skipped,
    Cancelled,
}

/// One image to produce.
pub(crate) struct Job {
    pub(crate) shared: Arc<Shared>,
    pub(crate) index: u32,
    /// The epoch the image is for (it draws the crop window).
    pub(crate) epoch: u64,
    pub(crate) position: usize,
    pub(crate) dest: Dest,
    pub(crate) holder: Arc<BufferHolder>,
    pub(crate) cancel: Arc<AtomicBool>,
    pub(crate) done: flume::Sender<(usize, Result<Outcome, PipelineError>)>,
}

/// A worker's reusable state: its resizer, file buffer and decoded pixels.
struct Scratch {
    resizer: SquareResizer,
    bytes: Vec<u8>,
    /// The decoded image, reused from image to image.
    pixels: Pixels,
    /// One resized record, reused from image to image.
    record: Vec<u8>,
    /// One image being augmented or jittered, reused from image to image.
    image: Vec<u8>,
    /// The automatic augmentation's buffers, reused from image to image.
    augment: AugmentScratch,
}

/// Starts `workers` decode threads reading jobs from `jobs`.
pub(crate) fn spawn_pool(
    workers: usize,
    jobs: flume::Receiver<Job>,
    stored_side: u32,
    mode: ResizeMode,
) -> Result<Vec<std::thread::JoinHandle<()>>, PipelineError> {
    (0..workers)
        .map(|i| {
            let jobs = jobs.clone();
            crate::threads::spawn(format!("pipeline-decode-{i}"), move || {
                let mut scratch = Scratch {
                    resizer: SquareResizer::new(stored_side, mode),
                    bytes: Vec::new(),
                    pixels: Pixels::default(),
                    record: Vec::new(),
                    image: Vec::new(),
                    augment: AugmentScratch::default(),
                };
                while let Ok(job) = jobs.recv() {
                    run(job, &mut scratch);
                }
            })
            .map_err(PipelineError::from)
        })
        .collect()
}

pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic with a non-string payload".into())
}

fn run(job: Job, scratch: &mut Scratch) {
    let result = if job.cancel.load(Ordering::Relaxed) {
        Ok(Outcome::Cancelled)
    } else {
        // A panic must not kill the thread (queued jobs would wait forever): it becomes an
        // error value for the consumer, naming the file.
        catch_unwind(AssertUnwindSafe(|| produce(&job, scratch))).unwrap_or_else(|payload| {
            scratch.resizer = SquareResizer::new(job.shared.stored_side, job.shared.resize_mode);
            Err(PipelineError::WorkerDied {
                path: job.shared.samples[job.index as usize].path.clone(),
                message: panic_message(payload.as_ref()),
            })
        })
    };
    let _ = job.done.send((job.position, result));
    drop(job.holder);
}

fn produce(job: &Job, scratch: &mut Scratch) -> Result<Outcome, PipelineError> {
    let shared = &*job.shared;
    let i = job.index as usize;
    // SAFETY: see `Dest`; the holder in `job` keeps the buffer alive for this call.
    let dest = unsafe { std::slice::from_raw_parts_mut(job.dest.ptr, job.dest.len) };
    let sample = &shared.samples[i];
    let stored = shared.stored_side;
    // The window of the stored square that becomes the image; `None` when that is the
    // stored square itself, copied as it is.
    let window = shared.crop.map_or(CropWindow::full(stored), |cut| {
        cut.window(job.epoch, u64::from(job.index), stored)
    });
    let window =
        (window != CropWindow::full(stored) || stored != shared.image_size).then_some(window);
    let jitter = shared
        .jitter
        .map(|(jitter, seed)| jitter.draw(seed, job.epoch, u64::from(job.index)));
    let augment = shared.auto_augment.map(|(policy, seed)| {
        let draw = policy.draw(seed, job.epoch, u64::from(job.index), shared.image_size);
        match &shared.mirrored_later {
            Some(mirrored) if mirrored(job.epoch, u64::from(job.index)) => draw.mirrored(),
            _ => draw,
        }
    });
    let after = After {
        sides: (stored, shared.image_size),
        window,
        augment,
        jitter,
    };
    match shared.cache.lookup(i) {
        Lookup::Hit(record) => {
            if let Some(source) = shared.cache.source(i) {
                shared.contents.note(i, source);
            }
            after.apply(record, dest, scratch, shared, &sample.path)?;
            shared.counters.cache_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(Outcome::Hit);
        }
        Lookup::Bad(kind) => {
            let file = BadFile::new(sample.path.clone(), kind, FOUND_EARLIER.into());
            return bad(shared, job.index, file, None);
        }
        Lookup::Miss => {}
    }
    let started = Instant::now();
    let claim = shared.cache.claim(i);
    scratch.bytes.clear();
    let read =
        std::fs::File::open(&sample.path).and_then(|mut f| f.read_to_end(&mut scratch.bytes));
    if let Err(e) = read {
        // Not a verdict on the file's contents (a permission, EIO): reported for this run,
        // never kept in the cache, so the next run reads it again. Dropping the claim
        // releases the record. A limit of the process or the machine, or a dataset folder
        // gone, says nothing about the file: the epoch stops rather than skip good images.
        drop(claim);
        if let Some(error) = unreadable_is_fatal(&sample.path, &e) {
            return Err(error);
        }
        let file = BadFile::new(sample.path.clone(), BadFileKind::Unreadable, e.to_string());
        return bad(shared, job.index, file, Some(Box::new(e)));
    }
    // The bytes are here anyway: their hash is what a run records of this file's contents.
    let source = crate::content::content_hash(&scratch.bytes);
    let kind = if scratch.bytes.is_empty() {
        Some(BadFileKind::Empty)
    } else {
        None
    };
    let decoded = match kind {
        Some(kind) => Err(crate::decode::DecodeFailure {
            kind,
            source: "zero bytes".into(),
        }),
        None => decode_rgb8_into(&scratch.bytes, shared.max_pixels, &mut scratch.pixels),
    };
    if let Err(failure) = decoded {
        if let Some(claim) = claim {
            claim.mark_bad(failure.kind);
        }
        let file = BadFile::new(
            sample.path.clone(),
            failure.kind,
            failure.source.to_string(),
        );
        return bad(shared, job.index, file, Some(failure.source));
    }
    shared.contents.note(i, source);
    if claim.is_none() && after.is_copy() {
        resize(scratch, dest, &sample.path)?;
        Counters::add_nanos(&shared.counters.decode_nanos, started);
    } else {
        // The stored square goes to ordinary memory first, where the cache write and the
        // crop read it: `dest` may be write-combined pinned memory, very slow to read back.
        let mut record = std::mem::take(&mut scratch.record);
        record.resize(shared.stored_bytes(), 0);
        let resized = resize(scratch, &mut record, &sample.path);
        Counters::add_nanos(&shared.counters.decode_nanos, started);
        let placed =
            resized.and_then(|()| after.apply(&record, dest, scratch, shared, &sample.path));
        if let (Ok(()), Some(claim)) = (&placed, claim) {
            if let Err(e) = claim.write_and_commit(&record, source) {
                shared.cache.note_write_failure(&e);
            }
        }
        scratch.record = record;
        placed?;
    }
    shared.counters.decoded.fetch_add(1, Ordering::Relaxed);
    Ok(Outcome::Decoded)
}

/// The one line that stands for every bad file of `split` after the first
/// [`WARNED_BAD_FILES`], which get a line each.
pub(crate) fn warn_more_bad_files(split: &str, report: Option<&Path>) {
    let listed = match report {
        Some(report) => format!("the bad-files report {} lists", report.display()),
        None => "the stats count them and a bad-files report would list".into(),
    };
    tracing::warn!(
        "skipping more bad images of split `{split}` without a line each (more than \
         {WARNED_BAD_FILES}); {listed} them all"
    );
}

/// The error that stops the epoch when opening or reading `path` failed with `e` for a
/// reason that is not the file's (`None`: the file itself is unreadable, a bad file).
fn unreadable_is_fatal(path: &Path, e: &std::io::Error) -> Option<PipelineError> {
    if let Some((limit, hint)) = resource_limit(e) {
        return Some(PipelineError::OutOfResources {
            path: path.to_path_buf(),
            limit,
            hint,
            source: e.raw_os_error().map_or_else(
                || std::io::Error::new(e.kind(), e.to_string()),
                std::io::Error::from_raw_os_error,
            ),
        });
    }
    if e.kind() == std::io::ErrorKind::NotFound {
        return vanished_folder(path).map(|folder| PipelineError::DatasetVanished { path: folder });
    }
    None
}

/// Which limit an I/O error hit, with a hint, when it is one of the process or the machine
/// (too many open files, out of memory) rather than a fault of the file being read.
pub(crate) fn resource_limit(e: &std::io::Error) -> Option<(String, &'static str)> {
    match e.raw_os_error()? {
        libc::EMFILE => {
            let mut limit = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: getrlimit writes one `rlimit` into the struct we own.
            let known = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
            let value = if !known {
                "unknown".to_string()
            } else if limit.rlim_cur == libc::RLIM_INFINITY {
                "unlimited".to_string()
            } else {
                limit.rlim_cur.to_string()
            };
            Some((
                format!("too many open files (the process limit, `ulimit -n`, is {value})"),
                "raise it or use fewer workers",
            ))
        }
        libc::ENFILE => Some((
            "too many open files in the whole system (ENFILE)".into(),
            "close other programs or raise the system limit (sysctl fs.file-max), or use \
             fewer workers",
        )),
        libc::ENOMEM => Some((
            "out of memory (the kernel refused an allocation)".into(),
            "free memory or raise the memory limit (`ulimit -v`, a cgroup), or use fewer \
             workers",
        )),
        _ => None,
    }
}

/// The topmost folder above `file` that no longer exists, when the folder holding `file` is
/// gone. Every sample was a file when the dataset was scanned, so a missing folder above it
/// has disappeared during the run (renamed or deleted), not a bad file.
fn vanished_folder(file: &Path) -> Option<PathBuf> {
    let gone = |dir: &Path| {
        !dir.as_os_str().is_empty()
            && matches!(std::fs::metadata(dir), Err(e) if e.kind() == std::io::ErrorKind::NotFound)
    };
    let mut vanished = None;
    for dir in file.ancestors().skip(1) {
        if !gone(dir) {
            break;
        }
        vanished = Some(dir.to_path_buf());
    }
    vanished
}

/// What becomes of a stored square after the cache.
struct After {
    /// The stored square's side and the image's.
    sides: (u32, u32),
    /// The window scaled to the image (`None`: the stored square as it is).
    window: Option<CropWindow>,
    /// The automatic augmentation drawn for the image.
    augment: Option<AugmentDraw>,
    /// The colour jitter drawn for the image.
    jitter: Option<JitterDraw>,
}

impl After {
    /// Whether the image is the stored square unchanged.
    fn is_copy(&self) -> bool {
        self.window.is_none() && self.augment.is_none() && self.jitter.is_none()
    }

    /// Writes the image made from the stored square `record` into `dest`, counting the time
    /// spent beyond a copy.
    fn apply(
        &self,
        record: &[u8],
        dest: &mut [u8],
        scratch: &mut Scratch,
        shared: &Shared,
        path: &std::path::Path,
    ) -> Result<(), PipelineError> {
        let started = Instant::now();
        let result = if self.augment.is_none() && self.jitter.is_none() {
            place(record, self.sides, dest, self.window, scratch, path)
        } else {
            // Changed in ordinary memory: `dest` may be write-combined pinned memory, very
            // slow to read back.
            let mut image = std::mem::take(&mut scratch.image);
            image.resize(dest.len(), 0);
            let placed = place(record, self.sides, &mut image, self.window, scratch, path);
            if placed.is_ok() {
                if let Some(draw) = self.augment {
                    draw.apply(&mut image, self.sides.1, &mut scratch.augment);
                }
                if let Some(draw) = self.jitter {
                    draw.apply(&mut image);
                }
                dest.copy_from_slice(&image);
            }
            scratch.image = image;
            placed
        };
        if !self.is_copy() {
            Counters::add_nanos(&shared.counters.transform_nanos, started);
        }
        result
    }
}

/// Writes the stored square `record` into `dest`: as it is, or the crop `window` of it
/// scaled to the image size (`sides`: the stored square's and the image's).
fn place(
    record: &[u8],
    (stored, image): (u32, u32),
    dest: &mut [u8],
    window: Option<CropWindow>,
    scratch: &mut Scratch,
    path: &std::path::Path,
) -> Result<(), PipelineError> {
    match window {
        None => {
            dest.copy_from_slice(record);
            Ok(())
        }
        Some(window) => scratch
            .resizer
            .crop_into(record, stored, window, dest, image)
            .map_err(|source| PipelineError::Resize {
                path: path.to_path_buf(),
                source,
            }),
    }
}

/// Resizes the worker's decoded pixels into `out`.
fn resize(
    scratch: &mut Scratch,
    out: &mut [u8],
    path: &std::path::Path,
) -> Result<(), PipelineError> {
    let pixels = &scratch.pixels;
    scratch
        .resizer
        .resize_into((pixels.width, pixels.height), pixels.as_slice(), out)
        .map_err(|source| PipelineError::Resize {
            path: path.to_path_buf(),
            source,
        })
}

fn bad(
    shared: &Shared,
    index: u32,
    file: BadFile,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
) -> Result<Outcome, PipelineError> {
    match shared.on_bad {
        OnBadImage::Skip => {
            shared.note_bad(index, file);
            Ok(Outcome::Skipped)
        }
        OnBadImage::Fail => Err(PipelineError::BadImage {
            path: file.path,
            kind: file.kind,
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_of_the_process_or_machine_are_told_apart_from_faults_of_the_file() {
        let limit = |errno| resource_limit(&std::io::Error::from_raw_os_error(errno));
        let (what, hint) = limit(libc::EMFILE).unwrap();
        assert!(what.contains("`ulimit -n`, is "), "{what}");
        assert!(hint.contains("fewer workers"), "{hint}");
        assert!(limit(libc::ENFILE).unwrap().0.contains("whole system"));
        assert!(limit(libc::ENOMEM).unwrap().0.contains("out of memory"));
        for errno in [
            libc::ENOENT,
            libc::EACCES,
            libc::EIO,
            libc::EISDIR,
            libc::ELOOP,
        ] {
            assert_eq!(limit(errno), None, "errno {errno}");
        }
        let invalid = std::io::Error::new(std::io::ErrorKind::InvalidData, "bad bytes");
        assert_eq!(resource_limit(&invalid), None);
    }

    #[test]
    fn a_missing_file_in_a_folder_that_is_there_is_no_vanished_folder() {
        let dir = tempfile::tempdir().unwrap();
        let class = dir.path().join("train").join("robin");
        std::fs::create_dir_all(&class).unwrap();
        assert_eq!(vanished_folder(&class.join("gone.jpg")), None);
        std::fs::remove_dir_all(dir.path().join("train")).unwrap();
        assert_eq!(
            vanished_folder(&class.join("gone.jpg")),
            Some(dir.path().join("train"))
        );
        assert_eq!(vanished_folder(Path::new("relative.jpg")), None);
    }
}
