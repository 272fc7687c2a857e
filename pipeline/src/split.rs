//! How a validation share (`--valid-fraction`) is held out of a flat `<class>/` folder, or of
//! a CSV file without a split column.
//!
//! Two rules, told apart by a version number that a trainer records with its run, so that a
//! run evaluates and resumes on the split it trained with:
//!
//! - version 1, [`SplitRule::PerFileDraw`]: each file on its own, held out when a seeded hash
//!   of its path falls below the share. A class's held-out count then varies with the seed
//!   (a share of 0.2 held out 15–30 %, a small class none at all).
//! - version 2, [`SplitRule::PerClass`]: round(F × n) of each class's n files (half rounds
//!   up; at least one when n ≥ 2 and F > 0), the files whose seeded path hash is lowest. A
//!   file added to a class moves at most one other file between the splits.
//!
//! Both decide from the seed and the paths alone (relative to the dataset root), never from
//! file contents or times, so copies of a dataset split alike.

use std::path::Path;

/// How a validation share is held out (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SplitRule {
    /// Version 1: each file held out on its own by a seeded draw (the split of runs made
    /// before version 2; kept so that they evaluate and resume on their own split).
    PerFileDraw,
    /// Version 2: round(F × n) of each class's n files, those of lowest seeded path hash.
    #[default]
    PerClass,
}

impl SplitRule {
    /// The rule new runs use.
    pub const CURRENT: SplitRule = SplitRule::PerClass;

    /// The rule's version number, as a checkpoint records it.
    pub fn version(self) -> u32 {
        match self {
            Self::PerFileDraw => 1,
            Self::PerClass => 2,
        }
    }

    /// The rule of version `version` (`None`: a version this build does not know).
    pub fn from_version(version: u32) -> Option<Self> {
        match version {
            1 => Some(Self::PerFileDraw),
            2 => Some(Self::PerClass),
            _ => None,
        }
    }

    /// The rule in words, for a start line.
    pub fn words(self) -> &'static str {
        match self {
            Self::PerFileDraw => "each file drawn on its own (split version 1, the checkpoint's)",
            Self::PerClass => "round(F × n) of each class's n images",
        }
    }
}

/// How many of a class's `n` files the per-class rule holds out at share `fraction`:
/// round(F × n), half rounding up, at least one when n ≥ 2 (and F > 0), at most n. F is
/// taken as the decimal number it was written as (0.7 × 5 is 3.5, which rounds to 4, though
/// the nearest f32 to 0.7 is a little below it).
pub fn held_out(fraction: f32, n: usize) -> usize {
    if n == 0 || fraction <= 0.0 || !fraction.is_finite() {
        return 0;
    }
    let decimal: f64 = fraction.to_string().parse().unwrap_or(f64::from(fraction));
    let exact = decimal * n as f64;
    // The tolerance keeps 0.35 × 10 = 3.4999999999999996 from rounding down.
    let rounded = (exact + 0.5 + 1e-9).floor() as usize;
    let least = usize::from(n >= 2);
    rounded.max(least).min(n)
}

/// The seeded hash of a file's path relative to the dataset root: the per-class rule holds
/// out the files of lowest key.
fn path_key(seed: u64, relative: &Path) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(relative.as_os_str().as_encoded_bytes(), seed)
}

/// A uniform number in `[0, 1)` from the seed and the file's path relative to the root (the
/// per-file draw of version 1).
fn draw(seed: u64, relative: &Path) -> f64 {
    (path_key(seed, relative) >> 11) as f64 / (1u64 << 53) as f64
}

/// Which of one class's files (`relative` paths, any order, a path possibly listed twice)
/// are held out under `rule` at share `fraction`: one flag per entry, in their order. A path
/// listed twice is held out or kept as one file.
pub(crate) fn held_out_mask(
    rule: SplitRule,
    fraction: f32,
    seed: u64,
    relative: &[&Path],
) -> Vec<bool> {
    match rule {
        SplitRule::PerFileDraw => relative
            .iter()
            .map(|p| draw(seed, p) < f64::from(fraction))
            .collect(),
        SplitRule::PerClass => {
            let mut unique: Vec<(u64, &Path)> =
                relative.iter().map(|p| (path_key(seed, p), *p)).collect();
            unique.sort();
            unique.dedup();
            let k = held_out(fraction, unique.len());
            let held: std::collections::HashSet<&Path> =
                unique[..k].iter().map(|(_, p)| *p).collect();
            relative.iter().map(|p| held.contains(p)).collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    #[test]
    fn the_held_out_count_is_the_rounded_share_and_at_least_one_of_two() {
        // (F, n, held out)
        let cases = [
            (0.2, 10, 2),
            (0.2, 5, 1),
            (0.2, 7, 1),  // 1.4
            (0.2, 8, 2),  // 1.6
            (0.25, 2, 1), // 0.5 rounds up
            (0.1, 2, 1),  // 0.2, but at least one of two
            (0.1, 1, 0),  // a single file stays for training
            (0.6, 1, 1),  // … unless the share rounds it away
            (0.7, 5, 4),  // 3.5 as written, though 0.7f32 × 5 is 3.4999999
            (0.35, 10, 4),
            (0.3, 15, 5), // 4.5
            (0.5, 3, 2),  // 1.5
            (0.9, 2, 2),
            (0.0, 10, 0),
            (0.2, 0, 0),
            (0.33, 100, 33),
        ];
        for (f, n, want) in cases {
            assert_eq!(held_out(f, n), want, "F {f}, n {n}");
        }
    }

    fn paths(n: usize) -> Vec<PathBuf> {
        (0..n)
            .map(|i| PathBuf::from(format!("c/{i:04}.png")))
            .collect()
    }

    #[test]
    fn the_per_class_rule_holds_out_exactly_its_count_and_a_new_file_moves_at_most_one() {
        for n in 1..40 {
            for &f in &[0.1f32, 0.2, 0.25, 0.5] {
                for seed in 0..4 {
                    let files = paths(n);
                    let refs: Vec<&Path> = files.iter().map(|p| p.as_path()).collect();
                    let mask = held_out_mask(SplitRule::PerClass, f, seed, &refs);
                    assert_eq!(mask.iter().filter(|h| **h).count(), held_out(f, n));
                    // One more file: of the files there before, at most one changes split.
                    let mut more = files.clone();
                    more.push(PathBuf::from("c/new.png"));
                    let refs: Vec<&Path> = more.iter().map(|p| p.as_path()).collect();
                    let after = held_out_mask(SplitRule::PerClass, f, seed, &refs);
                    let moved = (0..n).filter(|&i| mask[i] != after[i]).count();
                    assert!(moved <= 1, "n {n}, F {f}, seed {seed}: {moved} moved");
                }
            }
        }
    }

    #[test]
    fn a_path_listed_twice_is_held_out_or_kept_as_one_file() {
        let files = paths(9);
        let mut refs: Vec<&Path> = files.iter().map(|p| p.as_path()).collect();
        refs.push(files[3].as_path());
        let mask = held_out_mask(SplitRule::PerClass, 0.5, 1, &refs);
        assert_eq!(mask[3], mask[9]);
        // 9 distinct files: 5 held out (4.5 rounds up), the twice-listed one counted once.
        let distinct = (0..9).filter(|&i| mask[i]).count();
        assert_eq!(distinct, 5);
    }

    #[test]
    fn version_one_is_the_per_file_draw_it_always_was() {
        // The draw of version 1 for seed 1: pinned, so an older run's split never moves.
        let files = paths(200);
        let refs: Vec<&Path> = files.iter().map(|p| p.as_path()).collect();
        let mask = held_out_mask(SplitRule::PerFileDraw, 0.2, 1, &refs);
        let expect: Vec<bool> = refs
            .iter()
            .map(|p| {
                let h = xxhash_rust::xxh3::xxh3_64_with_seed(p.as_os_str().as_encoded_bytes(), 1);
                ((h >> 11) as f64 / (1u64 << 53) as f64) < f64::from(0.2f32)
            })
            .collect();
        assert_eq!(mask, expect);
        assert_eq!(SplitRule::from_version(1), Some(SplitRule::PerFileDraw));
        assert_eq!(SplitRule::from_version(2), Some(SplitRule::CURRENT));
        assert_eq!(SplitRule::from_version(3), None);
    }
}
