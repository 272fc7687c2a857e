//! Test-only fault injection: record writes to a given cache file fail with ENOSPC after a
//! number of successes, as on a disk that fills up mid-epoch; opening it for writing fails as
//! on a read-only mount; mapping it fails as under a low `ulimit -v`.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

static PLANS: Mutex<Vec<(PathBuf, usize)>> = Mutex::new(Vec::new());

/// Lets `successes` more record writes to `path` through, then fails every one.
pub(crate) fn fill_disk_after(path: &Path, successes: usize) {
    let mut plans = PLANS.lock().unwrap_or_else(|p| p.into_inner());
    plans.retain(|(p, _)| p != path);
    plans.push((path.to_path_buf(), successes));
}

/// The disk has room again (and is writable again).
pub(crate) fn clear(path: &Path) {
    let mut plans = PLANS.lock().unwrap_or_else(|p| p.into_inner());
    plans.retain(|(p, _)| p != path);
    let mut read_only = READ_ONLY.lock().unwrap_or_else(|p| p.into_inner());
    read_only.retain(|p| p != path);
    let mut map_fails = MAP_FAILS.lock().unwrap_or_else(|p| p.into_inner());
    map_fails.retain(|(p, _)| p != path);
}

static READ_ONLY: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

static MAP_FAILS: Mutex<Vec<(PathBuf, i32)>> = Mutex::new(Vec::new());

/// Every memory map of the cache file `path` (or of the temporary file that becomes it)
/// fails with the OS error `errno`, as under a low `ulimit -v` (ENOMEM).
pub(crate) fn map_fails(path: &Path, errno: i32) {
    let mut fails = MAP_FAILS.lock().unwrap_or_else(|p| p.into_inner());
    fails.retain(|(p, _)| p != path);
    fails.push((path.to_path_buf(), errno));
}

pub(super) fn map_check(path: &Path) -> std::io::Result<()> {
    let fails = MAP_FAILS.lock().unwrap_or_else(|p| p.into_inner());
    match fails.iter().find(|(p, _)| p == path) {
        Some((_, errno)) => Err(std::io::Error::from_raw_os_error(*errno)),
        None => Ok(()),
    }
}

/// Opening `path` for writing fails with EROFS, as on a read-only mount (the tests run
/// as root, which chmod cannot stop).
pub(crate) fn read_only(path: &Path) {
    let mut read_only = READ_ONLY.lock().unwrap_or_else(|p| p.into_inner());
    read_only.push(path.to_path_buf());
}

pub(super) fn deny_write(
    path: &Path,
    opened: std::io::Result<std::fs::File>,
) -> std::io::Result<std::fs::File> {
    let read_only = READ_ONLY.lock().unwrap_or_else(|p| p.into_inner());
    if read_only.iter().any(|p| p == path) {
        return Err(std::io::Error::from_raw_os_error(libc::EROFS));
    }
    opened
}

pub(super) fn check(path: &Path) -> std::io::Result<()> {
    let mut plans = PLANS.lock().unwrap_or_else(|p| p.into_inner());
    match plans.iter_mut().find(|(p, _)| p == path) {
        Some((_, 0)) => Err(std::io::Error::from_raw_os_error(libc::ENOSPC)),
        Some((_, left)) => {
            *left -= 1;
            Ok(())
        }
        None => Ok(()),
    }
}
