//! What an existing cache file's header says: served, resumed, rebuilt or damaged.

use std::fs::File;

use super::format::*;
use super::key::CacheKey;

/// How an existing file's header relates to what we need.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    Complete,
    Resumable,
    /// Another dataset, setting or boot: rebuilt without a word (that is what caches do).
    Rebuild,
    /// A cache file of another format version (an older engine's): rebuilt with one warning,
    /// since every record is decoded again.
    OtherVersion(u32),
    /// The file contradicts its own checksums: rebuilt with a warning saying what failed.
    Damaged(&'static str),
}

pub(super) fn judge(bytes: &[u8], key: &CacheKey, layout: &Layout, file_len: u64) -> Verdict {
    if bytes.len() < HEADER_BYTES || &bytes[0..8] != MAGIC {
        return Verdict::Rebuild;
    }
    if read_u32(bytes, 8) != VERSION {
        return Verdict::OtherVersion(read_u32(bytes, 8));
    }
    // The header is checked against its own layout first, so damage is told apart from a
    // cache of another dataset.
    let Some(own) = Layout::of_header(bytes, file_len) else {
        return Verdict::Damaged("its header describes a file of another size");
    };
    if read_u64(bytes, OFF_HEADER_SUM) != header_sum(bytes, &own) {
        return Verdict::Damaged("its header or labels do not match their checksum");
    }
    let same = own == *layout
        && read_u32(bytes, 16) == key.image_size
        && read_u32(bytes, 20) == 3
        && read_u64(bytes, 32) == key.fingerprint;
    if !same {
        return Verdict::Rebuild;
    }
    match read_u32(bytes, OFF_STATE) {
        state @ (STATE_COMPLETE | STATE_SYNCED) => {
            if read_u64(bytes, OFF_MAP_SUM) != map_sum(bytes, layout) {
                Verdict::Damaged("its record bitmaps or checks do not match their checksum")
            } else if state == STATE_COMPLETE {
                Verdict::Complete
            } else {
                Verdict::Resumable
            }
        }
        STATE_FILLING => {
            let same_boot =
                current_boot_id().is_some_and(|id| bytes[OFF_BOOT..OFF_BOOT + BOOT_LEN] == id[..]);
            if same_boot {
                Verdict::Resumable
            } else {
                Verdict::Rebuild
            }
        }
        _ => Verdict::Damaged("its state word is not a known state"),
    }
}

/// Why a cache file of `len` bytes where `layout` needs another size is this dataset's
/// file cut short (or padded): empty, shorter than its header, or a header of this version
/// that names this dataset. `None` for a cache of another dataset or format (an edited
/// dataset reuses the file name: its rebuild is no damage).
pub(super) fn cut_short(file: &File, len: u64, key: &CacheKey, layout: &Layout) -> Option<String> {
    use std::os::unix::fs::FileExt;
    let size = format!("{len} bytes where {} are needed", layout.total);
    if len == 0 {
        return Some(format!("it is empty ({size})"));
    }
    let mut header = vec![0u8; HEADER_BYTES.min(len as usize)];
    file.read_exact_at(&mut header, 0).ok()?;
    let ours = header.starts_with(&MAGIC[..header.len().min(MAGIC.len())]);
    if !ours {
        return None;
    }
    if header.len() < 48 {
        return Some(format!("it is cut short inside its header ({size})"));
    }
    let same_dataset = read_u32(&header, 8) == VERSION
        && read_u32(&header, 16) == key.image_size
        && read_u64(&header, 24) == key.count as u64
        && read_u64(&header, 32) == key.fingerprint;
    same_dataset.then(|| format!("it is cut short ({size})"))
}
