//! Writing a run folder's files so that a crash never leaves half a file: a temporary name in
//! the same folder, synced, then renamed over the final name.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use super::FolderError;

/// xxh3-64 of a file's bytes as 16 hex digits.
pub fn file_checksum(path: &Path) -> std::io::Result<String> {
    let bytes = fs::read(path)?;
    Ok(bytes_checksum(&bytes))
}

/// xxh3-64 of `bytes` as 16 hex digits.
pub fn bytes_checksum(bytes: &[u8]) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))
}

/// A temporary sibling of `path` (same folder, so the rename is atomic).
pub fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp{}", std::process::id()));
    path.with_file_name(name)
}

/// Writes `bytes` to `path` through a synced temporary file and a rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), FolderError> {
    let tmp = write_temp(path, bytes)?;
    commit_temp(&tmp, path)
}

/// Writes `bytes` to a synced temporary sibling of `path` and returns its name (removed
/// again on failure, so a full disk leaves nothing behind).
pub fn write_temp(path: &Path, bytes: &[u8]) -> Result<PathBuf, FolderError> {
    let tmp = temp_path(path);
    let result = (|| {
        let mut file = File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()
    })();
    match result {
        Ok(()) => Ok(tmp),
        Err(source) => {
            let _ = fs::remove_file(&tmp);
            Err(FolderError::Io {
                path: path.to_path_buf(),
                what: "write",
                source,
            })
        }
    }
}

/// Makes the renames in `dir` durable (best effort: not every file system syncs folders).
pub fn sync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Renames a finished temporary file onto its final name.
pub fn commit_temp(tmp: &Path, path: &Path) -> Result<(), FolderError> {
    fs::rename(tmp, path).map_err(|source| {
        let _ = fs::remove_file(tmp);
        FolderError::Io {
            path: path.to_path_buf(),
            what: "rename into place",
            source,
        }
    })
}

/// Syncs a file written by someone else before it is renamed.
pub fn sync_file(path: &Path) -> Result<(), FolderError> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|source| FolderError::Io {
            path: path.to_path_buf(),
            what: "sync",
            source,
        })
}
