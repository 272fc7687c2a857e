//! The file system side of the cache: its error values, the errors that mean "no cache
//! here", the mapping check and the writer's lock.

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

/// Takes an exclusive advisory lock without waiting: `Ok(false)` when someone else holds it.
/// flock(2) locks belong to the open file description, so a second handle in the same
/// process is refused too, which is what keeps two pipelines from writing one file.
#[cfg(unix)]
pub(super) fn try_lock(file: &File) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a valid, open descriptor owned by `file`; no memory is passed.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(true);
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(err)
    }
}

/// Without flock every pipeline is a writer; concurrent writers of one file are then the
/// caller's responsibility (birdtrain targets Linux).
#[cfg(not(unix))]
pub(super) fn try_lock(_file: &File) -> std::io::Result<bool> {
    Ok(true)
}
