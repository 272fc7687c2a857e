//! Bad input files: what is wrong with them (the report that lists them: `bad_report`).

use std::fmt;
use std::path::PathBuf;

/// Why a file could not be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BadFileKind {
    /// Zero bytes long.
    Empty,
    /// Cannot be opened or read (permissions, a directory or dangling link named like a file).
    /// Not a verdict on the contents, so the cache never keeps it: the next run tries again.
    Unreadable,
    /// The bytes are not a known image format.
    NotAnImage,
    /// A known format, but the decoder failed (corrupt data).
    Corrupt,
    /// A known format whose data ends early (a partial download or copy): the decoder would
    /// fill the missing rows, so the file is refused instead.
    Truncated,
    /// More pixels than the decompression-bomb limit allows.
    TooLarge,
    /// A valid image in a form the decoder cannot read correctly (it would return wrong
    /// pixels without an error), so the file is refused instead.
    Unsupported,
}

impl BadFileKind {
    /// Every kind, in code order (the cache stores a bad record's kind as its index here).
    const ALL: [Self; 7] = [
        Self::Empty,
        Self::Unreadable,
        Self::NotAnImage,
        Self::Corrupt,
        Self::TooLarge,
        Self::Truncated,
        Self::Unsupported,
    ];

    /// A stable one-byte code (kept in the cache file; never reorder [`Self::ALL`]).
    pub(crate) fn code(self) -> u8 {
        Self::ALL
            .iter()
            .position(|k| *k == self)
            .expect("every kind is listed in ALL") as u8
    }

    /// The kind of a code written by [`BadFileKind::code`].
    pub(crate) fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get(usize::from(code)).copied()
    }
}

impl fmt::Display for BadFileKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Empty => "empty file",
            Self::Unreadable => "unreadable",
            Self::NotAnImage => "not an image",
            Self::Corrupt => "corrupt image",
            Self::Truncated => "truncated image (the file ends before the image data does)",
            Self::TooLarge => "too many pixels (decompression-bomb guard)",
            Self::Unsupported => "an image form the decoder cannot read correctly",
        })
    }
}

/// One bad file, as listed in the bad-files report.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct BadFile {
    /// The file.
    pub path: PathBuf,
    /// What is wrong.
    pub kind: BadFileKind,
    /// The decoder's or the OS's own words.
    pub detail: String,
}

impl BadFile {
    pub(crate) fn new(path: PathBuf, kind: BadFileKind, detail: String) -> Self {
        Self { path, kind, detail }
    }
}
