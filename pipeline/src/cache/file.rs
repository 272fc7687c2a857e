//! The file system side of the cache: its error values, the errors that mean "no cache
//! here", the mapping check and the fillers' locks.

use std::fs::File;
use std::path::Path;

use crate::PipelineError;

#[cfg(test)]
use super::faults;

pub(super) fn io_err<'a>(
    path: &'a Path,
    what: &'static str,
) -> impl FnOnce(std::io::Error) -> PipelineError + 'a {
    move |source| PipelineError::CacheIo {
        path: path.to_path_buf(),
        what,
        source,
    }
}

/// Errors that say "this place cannot hold a cache" (as opposed to a bug or a broken disk):
/// the engine goes on without the cache instead of stopping.
pub(super) fn is_unwritable(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOSPC | libc::EDQUOT | libc::EROFS | libc::EACCES | libc::EPERM | libc::EFBIG)
    )
}

/// What [`Cache::disabled`] says failed when the file cannot be memory-mapped.
pub(super) const MAPPING: &str = "mapping";

/// The check before every memory map of the cache file `path`: always fine, except where a
/// test makes it fail (`faults::map_fails`).
pub(super) fn mapping_allowed(path: &Path) -> std::io::Result<()> {
    #[cfg(test)]
    faults::map_check(path)?;
    let _ = path;
    Ok(())
}

/// Takes an exclusive advisory lock without waiting: `Ok(false)` when someone else holds a
/// lock on the file (a filler's shared one, or another process's exclusive one).
/// flock(2) locks belong to the open file description, so a second handle in the same
/// process counts as someone else, as another process does. A failed attempt may drop a
/// shared lock this handle held (Linux converts a lock by removing it first).
#[cfg(unix)]
pub(super) fn try_lock_exclusive(file: &File) -> std::io::Result<bool> {
    match flock(file, libc::LOCK_EX | libc::LOCK_NB) {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Takes (or converts this handle's exclusive lock into) a shared lock, waiting while another
/// process holds the file alone (opening, rebuilding or sealing it: short moments).
#[cfg(unix)]
pub(super) fn lock_shared(file: &File) -> std::io::Result<()> {
    flock(file, libc::LOCK_SH)
}

/// [`lock_shared`], waiting at most `patience`: `Ok(false)` when another process held the file
/// alone all that time (an engine of an older cache format holds its file alone for its whole
/// life; waiting for it would hang this one).
#[cfg(unix)]
pub(super) fn lock_shared_within(
    file: &File,
    patience: std::time::Duration,
) -> std::io::Result<bool> {
    let start = std::time::Instant::now();
    let mut pause = std::time::Duration::from_millis(1);
    loop {
        match flock(file, libc::LOCK_SH | libc::LOCK_NB) {
            Ok(()) => return Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => {}
            Err(e) => return Err(e),
        }
        if start.elapsed() >= patience {
            return Ok(false);
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(std::time::Duration::from_millis(50));
    }
}

/// Releases this handle's lock.
#[cfg(unix)]
pub(super) fn unlock(file: &File) -> std::io::Result<()> {
    flock(file, libc::LOCK_UN)
}

#[cfg(unix)]
fn flock(file: &File, operation: libc::c_int) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    loop {
        // SAFETY: flock on a valid, open descriptor owned by `file`; no memory is passed.
        if unsafe { libc::flock(file.as_raw_fd(), operation) } == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Whether `file` is still the file at `path` (a rebuild renames a new file over the old one
/// between another process's open and its lock).
#[cfg(unix)]
pub(super) fn still_at(file: &File, path: &Path) -> std::io::Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let (open, named) = (file.metadata()?, std::fs::metadata(path));
    match named {
        Ok(named) => Ok(open.dev() == named.dev() && open.ino() == named.ino()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// Without flock every pipeline fills the file alone; concurrent fillers of one file are then
/// the caller's responsibility (birdtrain targets Linux).
#[cfg(not(unix))]
pub(super) fn try_lock_exclusive(_file: &File) -> std::io::Result<bool> {
    Ok(true)
}

#[cfg(not(unix))]
pub(super) fn lock_shared(_file: &File) -> std::io::Result<()> {
    Ok(())
}

#[cfg(not(unix))]
pub(super) fn lock_shared_within(
    _file: &File,
    _patience: std::time::Duration,
) -> std::io::Result<bool> {
    Ok(true)
}

#[cfg(not(unix))]
pub(super) fn unlock(_file: &File) -> std::io::Result<()> {
    Ok(())
}

#[cfg(not(unix))]
pub(super) fn still_at(_file: &File, _path: &Path) -> std::io::Result<bool> {
    Ok(true)
}
