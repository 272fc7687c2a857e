//! The run folder's one-writer lock: the OS's advisory lock on [`LOCK_FILE`], taken by the
//! process that writes the folder, and probed by those that only read it.

use std::path::Path;

use super::FolderError;

/// The file a writing process holds an exclusive lock on ([`super::RunFolder::lock`]).
pub const LOCK_FILE: &str = ".birdtrain.lock";

/// An exclusive hold on a run folder, released when dropped (or when the process dies, by
/// the kernel: a killed run leaves no stale lock behind).
#[derive(Debug)]
pub struct RunLock {
    _file: std::fs::File,
}

impl RunLock {
    /// Takes the lock of the run folder `root` ([`super::RunFolder::lock`] says why).
    pub(super) fn take(root: &Path) -> Result<RunLock, FolderError> {
        let path = root.join(LOCK_FILE);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|source| FolderError::Io {
                path: path.clone(),
                what: "open the run folder's lock file",
                source,
            })?;
        // A lock released a moment ago may still be held for an instant: a child process that
        // another thread of this process is starting shares every open file (ours are
        // close-on-exec) from its fork until its exec. So a folder is in use only when the
        // lock stays taken for a while; a run in another process holds it for its whole life.
        let deadline = std::time::Instant::now() + IN_USE_AFTER;
        loop {
            match file.try_lock() {
                Ok(()) => return Ok(RunLock { _file: file }),
                Err(std::fs::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                Err(std::fs::TryLockError::WouldBlock) => {
                    return Err(FolderError::InUse {
                        path: root.to_path_buf(),
                    })
                }
                Err(std::fs::TryLockError::Error(source)) => {
                    return Err(FolderError::Io {
                        path,
                        what: "lock",
                        source,
                    })
                }
            }
        }
    }
}

/// How long the lock must stay taken before the folder counts as in use.
const IN_USE_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// Whether a process holds `dir`'s run-folder lock now (a run, resume or `lr-find` writing
/// into it). Probed with a shared lock taken and dropped at once, so a run starting at that
/// very moment may see the folder in use once: only an error path asks.
pub fn is_in_use(dir: &Path) -> bool {
    let Ok(file) = std::fs::File::open(dir.join(LOCK_FILE)) else {
        return false;
    };
    matches!(
        file.try_lock_shared(),
        Err(std::fs::TryLockError::WouldBlock)
    )
}
