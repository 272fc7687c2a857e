//! The cache file's format: the header's fields, where each region lives ([`Layout`]) and
//! the checks and checksums that cover them (see the layout table in the module docs).

use crate::BadFileKind;

pub(super) const MAGIC: &[u8; 8] = b"BRDCACHE";
/// Version 2 added the record checks and the two checksums. Version 3: the fingerprint
/// also covers each file's status-change time and inode number, and a file that could not
/// be opened or read is no longer kept as bad (older files may hold such marks, so they
/// are rebuilt). Version 4: `--resize-mode center-crop` stores torchvision's `Resize` then
/// `CenterCrop` square exactly (its whole-pixel roundings), not the image's exact centre.
/// Version 5: a JPEG whose header declares more blocks than its data can code is a bad file
/// (older caches may hold its grey-filled pixels). Version 6: each filled record keeps the
/// content hash of the file it was decoded from (what a run records of its training files).
/// Version 7: several processes fill one file, each claiming a record in the file's claims
/// bitmap (after the sources) before it writes it.
pub(super) const VERSION: u32 = 7;
pub(super) const HEADER_BYTES: usize = 4096;
pub(super) const STATE_FILLING: u32 = 1;
pub(super) const STATE_COMPLETE: u32 = 2;
pub(super) const STATE_SYNCED: u32 = 3;
pub(super) const OFF_STATE: usize = 12;
pub(super) const OFF_BOOT: usize = 48;
pub(super) const BOOT_LEN: usize = 36;
pub(super) const OFF_HEADER_SUM: usize = 88;
pub(super) const OFF_MAP_SUM: usize = 96;
/// Seeds every checksum of the file, so a record of another file format never matches.
pub(super) const SUM_SEED: u64 = 0x6272_6463_6163_6865;

/// Where each region lives for a given record count and size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Layout {
    pub(super) count: usize,
    pub(super) record_bytes: usize,
    pub(super) labels: usize,
    pub(super) filled: usize,
    pub(super) bad: usize,
    pub(super) checks: usize,
    pub(super) sources: usize,
    /// The claims bitmap: a record's bit is set by the one process that writes it.
    pub(super) claims: usize,
    pub(super) records: usize,
    pub(super) total: usize,
}

impl Layout {
    pub(super) fn new(count: usize, record_bytes: usize) -> Self {
        let words = count.div_ceil(64);
        let labels = HEADER_BYTES;
        let filled = (labels + 4 * count).next_multiple_of(8);
        let bad = filled + 8 * words;
        let checks = bad + 8 * words;
        let sources = checks + 8 * count;
        let claims = sources + 8 * count;
        let records = (claims + 8 * words).next_multiple_of(4096);
        Self {
            count,
            record_bytes,
            labels,
            filled,
            bad,
            checks,
            sources,
            claims,
            records,
            total: records + count * record_bytes,
        }
    }

    /// The layout a header describes, if its sizes are possible for a file of `len` bytes.
    pub(super) fn of_header(bytes: &[u8], len: u64) -> Option<Self> {
        let count = usize::try_from(read_u64(bytes, 24)).ok()?;
        let record_bytes = usize::try_from(read_u64(bytes, 40)).ok()?;
        let records_bytes = count.checked_mul(record_bytes)?;
        if count.checked_mul(16)? > len as usize || records_bytes > len as usize {
            return None;
        }
        let layout = Self::new(count, record_bytes);
        (layout.total as u64 == len).then_some(layout)
    }

    /// The end of the sources (the map checksum covers `filled..map_end`; the claims after
    /// them change while a file is filled and mean nothing once its fillers are gone).
    pub(super) fn map_end(&self) -> usize {
        self.sources + 8 * self.count
    }
}

/// The check of a filled record: xxh3-64 of its pixels, seeded with its index and the
/// content hash of its source file (so the check covers that hash too).
pub(super) fn record_sum(pixels: &[u8], index: usize, source: u64) -> u64 {
    let seed = xxhash_rust::xxh3::xxh3_64_with_seed(&source.to_le_bytes(), SUM_SEED ^ index as u64);
    xxhash_rust::xxh3::xxh3_64_with_seed(pixels, seed)
}

/// The check of a bad record: a value only this index gives, with the kind in the low byte.
pub(super) fn bad_tag(index: usize, kind: BadFileKind) -> u64 {
    (xxhash_rust::xxh3::xxh3_64_with_seed(b"bad record", SUM_SEED ^ index as u64) & !0xFF)
        | u64::from(kind.code())
}

/// The kind a bad record's check names, if it is a valid tag for `index`.
pub(super) fn tag_kind(index: usize, tag: u64) -> Option<BadFileKind> {
    let expected = bad_tag(index, BadFileKind::Empty);
    if tag & !0xFF != expected & !0xFF {
        return None;
    }
    BadFileKind::from_code(tag as u8)
}

/// Checksum of the header fields (state and boot id excluded: they change) and the labels.
pub(super) fn header_sum(bytes: &[u8], layout: &Layout) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::with_seed(SUM_SEED);
    h.update(&bytes[0..OFF_STATE]);
    h.update(&bytes[OFF_STATE + 4..OFF_BOOT]);
    h.update(&bytes[layout.labels..layout.labels + 4 * layout.count]);
    h.digest()
}

/// Checksum of the bitmaps and the record checks.
pub(super) fn map_sum(bytes: &[u8], layout: &Layout) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(&bytes[layout.filled..layout.map_end()], SUM_SEED)
}

pub(super) fn current_boot_id() -> Option<[u8; BOOT_LEN]> {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    text.trim().as_bytes().try_into().ok()
}

pub(super) fn read_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

pub(super) fn read_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}
