//! The training files as a checkpoint saw them: each file's size and times and the hash of
//! its bytes, in the training split's order, so that `--resume` can tell a file whose
//! contents changed (two same-sized images swapped between classes) from one only touched.
//!
//! The record is a side file of the checkpoint, `train_files-<xxh3>.bin`, written before the
//! sidecar that names it (with its checksum), under the commit protocol of the tensor files
//! ([`super::checkpoint::write_checkpoint`]). Its name is its checksum, so an unchanged record
//! (every epoch after the first) is not written again. Little endian: magic `BRDFILES`,
//! version (u32), count (u64), then per file its size (u64), mtime and status-change time
//! (ns since the epoch, u64 and i64), inode (u64) and content hash (u64, 0: not read yet).
//!
//! Only the content hash is the file's identity. Size and times say which files a resume
//! must read again; the status-change time and inode also catch a file replaced by a rename
//! (which keeps its mtime), and since a copy of the data elsewhere has other ones, a resume
//! there reads its files once and goes on when their contents are the same.

use std::path::Path;

use pipeline::FileState;
use serde::{Deserialize, Serialize};

use super::FolderError;

const MAGIC: &[u8; 8] = b"BRDFILES";
const VERSION: u32 = 1;
const HEADER: usize = 8 + 4 + 8;
const ENTRY: usize = 5 * 8;

/// The sidecar's reference to a checkpoint's record of its training files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainFilesRef {
    /// The side file, relative to the run folder.
    pub file: String,
    /// Its xxh3-64, hex.
    pub checksum: String,
}

/// What a checkpoint records of its training files (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainFiles {
    /// One entry per training file, in the training split's order.
    pub files: Vec<FileState>,
}

impl TrainFiles {
    /// The record of a training engine now: what it has read so far.
    pub fn of(train: &pipeline::Pipeline) -> Self {
        Self {
            files: train.files(),
        }
    }

    /// The side file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + ENTRY * self.files.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(self.files.len() as u64).to_le_bytes());
        for f in &self.files {
            out.extend_from_slice(&f.size.to_le_bytes());
            out.extend_from_slice(&f.mtime_ns.to_le_bytes());
            out.extend_from_slice(&f.ctime_ns.to_le_bytes());
            out.extend_from_slice(&f.inode.to_le_bytes());
            out.extend_from_slice(&f.content.unwrap_or(0).to_le_bytes());
        }
        out
    }

    /// Reads the side file's bytes (`path` names it in errors).
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self, FolderError> {
        let bad = |reason: String| FolderError::BadRunDir {
            path: path.to_path_buf(),
            reason,
        };
        let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        if bytes.len() < HEADER || &bytes[..8] != MAGIC {
            return Err(bad("it is not a record of training files".into()));
        }
        let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
        if version != VERSION {
            return Err(bad(format!(
                "record version {version} is not supported (expected {VERSION})"
            )));
        }
        let count = word(12);
        let expected = usize::try_from(count)
            .ok()
            .and_then(|n| n.checked_mul(ENTRY))
            .and_then(|n| n.checked_add(HEADER));
        if expected != Some(bytes.len()) {
            return Err(bad(format!(
                "{} bytes for {count} files (a damaged record)",
                bytes.len()
            )));
        }
        let files = (0..count as usize)
            .map(|i| {
                let at = HEADER + i * ENTRY;
                FileState {
                    size: word(at),
                    mtime_ns: word(at + 8),
                    ctime_ns: word(at + 16) as i64,
                    inode: word(at + 24),
                    content: Some(word(at + 32)).filter(|&h| h != 0),
                }
            })
            .collect();
        Ok(Self { files })
    }

    /// The record a checkpoint in `run` names, read and checked against its checksum;
    /// `None` when the checkpoint names none (older checkpoints, lr-find).
    pub fn load(
        run: &Path,
        reference: Option<&TrainFilesRef>,
    ) -> Result<Option<Self>, FolderError> {
        let Some(r) = reference else {
            return Ok(None);
        };
        let path = run.join(&r.file);
        let bytes = std::fs::read(&path).map_err(|e| FolderError::BadRunDir {
            path: run.to_path_buf(),
            reason: format!("cannot read {}: {e}", r.file),
        })?;
        if super::files::bytes_checksum(&bytes) != r.checksum {
            return Err(FolderError::BadRunDir {
                path: run.to_path_buf(),
                reason: format!(
                    "{} does not match the checksum in {} (torn or edited checkpoint)",
                    r.file,
                    super::names::SIDECAR_FILE
                ),
            });
        }
        Self::from_bytes(&bytes, &path).map(Some)
    }
}

/// The side file's name for bytes of checksum `sum`.
pub(crate) fn file_name(sum: &str) -> String {
    format!("{PREFIX}{sum}.bin")
}

/// How every side file's name starts.
pub(crate) const PREFIX: &str = "train_files-";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_back_as_written_and_a_damaged_one_is_refused() {
        let record = TrainFiles {
            files: vec![
                FileState {
                    size: 10,
                    mtime_ns: 1_700_000_000_000_000_001,
                    ctime_ns: -5,
                    inode: 42,
                    content: Some(7),
                },
                FileState {
                    size: 3,
                    mtime_ns: 0,
                    ctime_ns: 0,
                    inode: 0,
                    content: None,
                },
            ],
        };
        let bytes = record.to_bytes();
        let path = Path::new("train_files-x.bin");
        assert_eq!(TrainFiles::from_bytes(&bytes, path).unwrap(), record);
        let e = TrainFiles::from_bytes(&bytes[..bytes.len() - 1], path).unwrap_err();
        assert!(e.to_string().contains("damaged record"), "{e}");
        let e = TrainFiles::from_bytes(b"not a record at all", path).unwrap_err();
        assert!(e.to_string().contains("not a record"), "{e}");
    }
}
