//! Scanning a dataset folder into a sorted list of samples with class labels.
//!
//! Two layouts: the Kaggle "285 birds" `<root>/{train,valid,test}/<class>/<file>` and a flat
//! `<root>/<class>/<file>` whose valid share is held out of each class by a seeded hash of the
//! paths ([`crate::split`]), so the split is stable for a seed and moves at most one file when
//! a file is added. The class index is always the sorted folder names of the train split
//! (flat: of the root).

use std::fs;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use crate::bad::{BadFile, BadFileKind};
use crate::split::{held_out_mask, SplitRule};
use crate::{PipelineError, Split};

/// Where a dataset lives and how it is laid out.
#[derive(Debug, Clone, PartialEq)]
pub enum DatasetSource {
    /// `<root>/{train,valid,test}/<class>/<file>`.
    Folder {
        /// The dataset root.
        root: PathBuf,
    },
    /// `<root>/<class>/<file>`; a `valid_fraction` of each class goes to the valid split.
    Flat {
        /// The dataset root.
        root: PathBuf,
        /// Share of files in the valid split, in `[0, 1)`.
        valid_fraction: f32,
        /// How the share is held out.
        rule: SplitRule,
    },
    /// A CSV file listing the images: a header naming a path column (`path`, `filepath(s)`,
    /// `file`, `filename` or `image`), a label column (`label(s)` or `class`) and,
    /// optionally, a split column (`split`, `data set`, `dataset` or `subset`, holding
    /// `train`, `valid`/`val`/`validation` or `test`), in any order and case, other columns
    /// ignored (the Kaggle birds CSV has this shape). Relative paths are relative to the CSV's
    /// folder. Classes are the sorted labels of the train rows. Without a split column,
    /// `valid_fraction` splits the rows as the flat layout does (a class is then every label
    /// the rows name, and one left with no training row is an error). A class whose rows in
    /// the split name no readable image is an error, as an empty class folder is.
    Csv {
        /// The CSV file.
        file: PathBuf,
        /// The folder relative paths start from (the CSV's).
        base: PathBuf,
        /// Without a split column: the share of rows in the valid split.
        valid_fraction: Option<f32>,
        /// How the share is held out.
        rule: SplitRule,
    },
    /// A list of image files with their labels, in the given order (a CSV-labelled dataset,
    /// or files to classify). The split only names the cache; every split is the whole list.
    List {
        /// Class names; a label indexes this list.
        classes: Vec<String>,
        /// The files and their labels, in order (a file may appear more than once).
        samples: Vec<(PathBuf, u32)>,
    },
}

impl DatasetSource {
    /// A dataset in the `train/valid/test` folder layout.
    pub fn folder(root: impl Into<PathBuf>) -> Self {
        Self::Folder { root: root.into() }
    }

    /// A flat `<root>/<class>/<file>` dataset, `valid_fraction` of each class held out by
    /// the current rule ([`SplitRule::CURRENT`]; [`DatasetSource::with_split_rule`] picks
    /// another).
    pub fn flat(root: impl Into<PathBuf>, valid_fraction: f32) -> Self {
        Self::Flat {
            root: root.into(),
            valid_fraction,
            rule: SplitRule::CURRENT,
        }
    }

    /// The same source with the validation share held out by `rule` (a run keeps the rule
    /// it trained with); no change for sources that hold no share out.
    pub fn with_split_rule(mut self, rule: SplitRule) -> Self {
        if let Self::Flat { rule: r, .. } | Self::Csv { rule: r, .. } = &mut self {
            *r = rule;
        }
        self
    }

    /// How the validation share is held out, for a source that holds one out by a share.
    pub fn split_rule(&self) -> Option<SplitRule> {
        match self {
            Self::Flat { rule, .. } => Some(*rule),
            Self::Csv {
                rule,
                valid_fraction: Some(_),
                ..
            } => Some(*rule),
            _ => None,
        }
    }

    /// The dataset `path` names, as `--data` reads it: a file is a CSV listing the images; a
    /// folder is the flat layout split by `valid_fraction` when one is given, else the
    /// `train/valid/test` folder layout.
    pub fn at(path: impl Into<PathBuf>, valid_fraction: Option<f32>) -> Self {
        let path = path.into();
        if path.is_file() {
            return Self::csv(path, valid_fraction);
        }
        match valid_fraction {
            Some(f) => Self::flat(path, f),
            None => Self::folder(path),
        }
    }

    /// A dataset listed in a CSV file (see [`DatasetSource::Csv`]).
    pub fn csv(file: impl Into<PathBuf>, valid_fraction: Option<f32>) -> Self {
        let file = file.into();
        let base = match file.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        Self::Csv {
            file,
            base,
            valid_fraction,
            rule: SplitRule::CURRENT,
        }
    }

    /// A labelled list of image files, read in the given order. Files that are missing or
    /// unreadable are bad files (skipped or failed as [`OnBadImage`](crate::OnBadImage)
    /// says); a label outside `classes` is refused when the pipeline is built.
    pub fn list(classes: Vec<String>, samples: Vec<(PathBuf, u32)>) -> Self {
        Self::List { classes, samples }
    }

    /// Image files to classify, unlabelled: one class named `unlabelled`, every label 0.
    pub fn files(paths: impl IntoIterator<Item = PathBuf>) -> Self {
        Self::list(
            vec!["unlabelled".into()],
            paths.into_iter().map(|p| (p, 0)).collect(),
        )
    }

    /// The dataset root; `None` for a list of files.
    pub fn root(&self) -> Option<&Path> {
        match self {
            Self::Folder { root } | Self::Flat { root, .. } => Some(root),
            Self::Csv { base, .. } => Some(base),
            Self::List { .. } => None,
        }
    }

    /// The class names, as a training engine on this source would number them (the train
    /// split's, sorted), without building one: a scan of the train split's listing.
    pub fn classes(&self) -> Result<Vec<String>, PipelineError> {
        scan(self, Split::Train, 0, None).map(|s| s.classes)
    }

    /// The class names as [`DatasetSource::classes`] gives them, and how many image files the
    /// train split lists (files rejected by the scan itself, such as empty ones, not counted):
    /// one scan of the listing, no engine built.
    pub fn train_listing(&self) -> Result<(Vec<String>, usize), PipelineError> {
        scan(self, Split::Train, 0, None).map(|s| (s.classes, s.samples.len()))
    }
}

/// One image file of a split.
#[derive(Debug, Clone)]
pub(crate) struct Sample {
    pub(crate) path: PathBuf,
    pub(crate) label: u32,
    pub(crate) size: u64,
    pub(crate) mtime_ns: u128,
    /// The file's identity on its filesystem: status-change time (ns since the epoch) and
    /// inode number, part of the cache key only. Tools that restore an mtime (`cp -p`,
    /// `rsync -t`, `tar x`) cannot set a ctime back, and a file replaced by another one has
    /// another inode, so a rewritten file is never served from the old cache.
    pub(crate) identity: FileIdentity,
}

/// What tells one version of a file from another beyond its size and mtime (see
/// [`Sample::identity`]); zero where the platform has no such notion.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct FileIdentity {
    /// Status-change time, nanoseconds since the epoch (may be negative on odd clocks).
    pub(crate) ctime_ns: i128,
    /// Inode number.
    pub(crate) inode: u64,
}

impl FileIdentity {
    #[cfg(unix)]
    fn of(meta: &fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        Self {
            ctime_ns: i128::from(meta.ctime()) * 1_000_000_000 + i128::from(meta.ctime_nsec()),
            inode: meta.ino(),
        }
    }

    #[cfg(not(unix))]
    fn of(_meta: &fs::Metadata) -> Self {
        Self::default()
    }
}

/// The result of scanning one split.
#[derive(Debug)]
pub(crate) struct ScannedSplit {
    pub(crate) classes: Vec<String>,
    pub(crate) samples: Vec<Sample>,
    /// Entries rejected at scan time (zero-byte, directories or dangling links named like files).
    pub(crate) bad: Vec<BadFile>,
}

fn is_hidden(name: &std::ffi::OsStr) -> bool {
    name.to_string_lossy().starts_with('.')
}

/// A class folder: its name as shown (non-UTF-8 bytes replaced by U+FFFD) and as stored.
#[derive(Debug, Clone)]
struct ClassDir {
    name: String,
    folder: std::ffi::OsString,
}

/// Sorted, non-hidden subdirectory names of `dir`. A name that is not UTF-8 is supported: it
/// is shown with its invalid bytes replaced, and the folder is still read by its real name;
/// two folders whose shown names would be equal are refused.
fn class_dirs(dir: &Path) -> Result<Vec<ClassDir>, PipelineError> {
    let entries = fs::read_dir(dir).map_err(|source| PipelineError::ReadDir {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| PipelineError::ReadDir {
            path: dir.to_path_buf(),
            source,
        })?;
        if is_hidden(&entry.file_name()) {
            continue;
        }
        // Follow symlinks: a linked class folder is still a class folder.
        if fs::metadata(entry.path())
            .map(|m| m.is_dir())
            .unwrap_or(false)
        {
            let folder = entry.file_name();
            names.push(ClassDir {
                name: folder.to_string_lossy().into_owned(),
                folder,
            });
        }
    }
    names.sort_by(|a, b| a.name.cmp(&b.name).then_with(|| a.folder.cmp(&b.folder)));
    if let Some(pair) = names.windows(2).find(|w| w[0].name == w[1].name) {
        return Err(PipelineError::ClassNameClash {
            dir: dir.to_path_buf(),
            first: pair[0].folder.clone(),
            second: pair[1].folder.clone(),
        });
    }
    Ok(names)
}

fn names(dirs: &[ClassDir]) -> Vec<String> {
    dirs.iter().map(|d| d.name.clone()).collect()
}

/// Files of one class folder, sorted by name; unusable entries go to `bad`.
fn class_files(
    dir: &Path,
    label: u32,
    out: &mut Vec<Sample>,
    bad: &mut Vec<BadFile>,
) -> Result<(), PipelineError> {
    let entries = fs::read_dir(dir).map_err(|source| PipelineError::ReadDir {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut paths: Vec<PathBuf> = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| PipelineError::ReadDir {
            path: dir.to_path_buf(),
            source,
        })?;
        if !is_hidden(&entry.file_name()) {
            paths.push(entry.path());
        }
    }
    paths.sort();
    for path in paths {
        push_file(path, label, out, bad);
    }
    Ok(())
}

/// One file of a split: a sample if it is a non-empty regular file, else a bad file.
fn push_file(path: PathBuf, label: u32, out: &mut Vec<Sample>, bad: &mut Vec<BadFile>) {
    match fs::metadata(&path) {
        Err(e) => bad.push(BadFile::new(path, BadFileKind::Unreadable, e.to_string())),
        Ok(meta) if !meta.is_file() => bad.push(BadFile::new(
            path,
            BadFileKind::Unreadable,
            "not a regular file".into(),
        )),
        Ok(meta) if meta.len() == 0 => {
            bad.push(BadFile::new(path, BadFileKind::Empty, "zero bytes".into()))
        }
        Ok(meta) => {
            let mtime_ns = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            out.push(Sample {
                path,
                label,
                size: meta.len(),
                mtime_ns,
                identity: FileIdentity::of(&meta),
            });
        }
    }
}

fn require_dir(path: &Path, hint: &'static str) -> Result<(), PipelineError> {
    if path.is_dir() {
        Ok(())
    } else {
        Err(PipelineError::MissingDir {
            path: path.to_path_buf(),
            hint,
        })
    }
}

/// Scans `split` of `source`. `seed` only matters for the flat layout's valid selection;
/// `known` numbers the classes where the source has no training split (see
/// [`PipelineBuilder::known_classes`](crate::PipelineBuilder::known_classes)).
pub(crate) fn scan(
    source: &DatasetSource,
    split: Split,
    seed: u64,
    known: Option<&[String]>,
) -> Result<ScannedSplit, PipelineError> {
    if let Some(root) = source.root() {
        require_dir(root, "pass the dataset root with --data")?;
    }
    match source {
        DatasetSource::Folder { root } => scan_folder(root, split, known),
        DatasetSource::Flat {
            root,
            valid_fraction,
            rule,
        } => scan_flat(root, split, *valid_fraction, *rule, seed),
        DatasetSource::Csv {
            file,
            base,
            valid_fraction,
            rule,
        } => scan_csv(file, base, split, *valid_fraction, *rule, seed, known),
        DatasetSource::List { classes, samples } => scan_list(classes, samples),
    }
}

/// One row of a dataset CSV.
struct CsvRow {
    path: PathBuf,
    label: String,
    split: Option<Split>,
    /// Its line in the file (the header is line 1).
    line: u64,
}

/// The image paths a dataset CSV lists, every split (relative ones joined to `base`).
pub(crate) fn listed_paths(file: &Path, base: &Path) -> Result<Vec<PathBuf>, PipelineError> {
    Ok(read_csv(file, base)?
        .0
        .into_iter()
        .map(|r| r.path)
        .collect())
}

/// The column of `headers` named by one of `names` (compared trimmed, in lower case).
fn column(headers: &csv::StringRecord, names: &[&str]) -> Option<usize> {
    headers
        .iter()
        .position(|h| names.contains(&h.trim().to_ascii_lowercase().as_str()))
}

/// The rows of a dataset CSV, and whether it has a split column.
fn read_csv(file: &Path, base: &Path) -> Result<(Vec<CsvRow>, bool), PipelineError> {
    let bad = |line: u64, reason: String| PipelineError::BadCsv {
        file: file.to_path_buf(),
        line,
        reason,
    };
    let mut reader = csv::ReaderBuilder::new()
        .flexible(false)
        .from_path(file)
        .map_err(|e| bad(0, e.to_string()))?;
    let headers = reader.headers().map_err(|e| bad(1, e.to_string()))?.clone();
    let path_col = column(
        &headers,
        &["path", "filepath", "filepaths", "file", "filename", "image"],
    );
    let label_col = column(&headers, &["label", "labels", "class"]);
    let (Some(path_col), Some(label_col)) = (path_col, label_col) else {
        let found: Vec<&str> = headers.iter().collect();
        return Err(bad(
            1,
            format!(
                "the header needs a path column (path, filepaths, file, filename or image) and \
                 a label column (label, labels or class); it has {found:?}"
            ),
        ));
    };
    let split_col = column(&headers, &["split", "data set", "dataset", "subset"]);
    let mut rows = Vec::new();
    for record in reader.records() {
        let record = record.map_err(|e| {
            let line = e.position().map_or(0, |p| p.line());
            bad(line, e.to_string())
        })?;
        let line = record.position().map_or(0, |p| p.line());
        let field = |i: usize| record.get(i).unwrap_or("").trim();
        let (path, label) = (field(path_col), field(label_col));
        if path.is_empty() || label.is_empty() {
            return Err(bad(line, "an empty path or label".into()));
        }
        let split = match split_col.map(field) {
            None => None,
            Some(text) => Some(match text.to_ascii_lowercase().as_str() {
                "train" | "training" => Split::Train,
                "valid" | "val" | "validation" => Split::Valid,
                "test" => Split::Test,
                _ => {
                    return Err(bad(
                        line,
                        format!("split `{text}` is not train, valid (val, validation) or test"),
                    ))
                }
            }),
        };
        rows.push(CsvRow {
            // `base.join` would write "./x.png" for a CSV in the working folder.
            path: if base == Path::new(".") {
                PathBuf::from(path)
            } else {
                base.join(path)
            },
            label: label.to_string(),
            split,
            line,
        });
    }
    Ok((rows, split_col.is_some()))
}

/// The repeated rows of a dataset CSV warned about at most this many times (then one count).
const WARNED_REPEATS: usize = 10;

/// Warns, once per process and file, about every file a dataset CSV lists more than once:
/// under two labels (the same image teaches two classes), in two splits (the validation
/// scores a training image), or twice alike (it counts twice an epoch); each with its lines.
/// The rows are used as written.
fn warn_about_repeated_rows(file: &Path, rows: &[CsvRow], splits: &[Split]) {
    static WARNED: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());
    let mut by_path: std::collections::HashMap<&Path, Vec<usize>> = Default::default();
    for (i, row) in rows.iter().enumerate() {
        by_path.entry(row.path.as_path()).or_default().push(i);
    }
    let mut repeated: Vec<&Vec<usize>> = by_path.values().filter(|r| r.len() > 1).collect();
    if repeated.is_empty() {
        return;
    }
    {
        let mut warned = WARNED.lock().unwrap_or_else(|p| p.into_inner());
        if warned.iter().any(|f| f == file) {
            return;
        }
        warned.push(file.to_path_buf());
    }
    repeated.sort_by_key(|r| r[0]);
    for group in repeated.iter().take(WARNED_REPEATS) {
        let first = &rows[group[0]];
        let lines = |show: &dyn Fn(&CsvRow, Split) -> String| {
            group
                .iter()
                .map(|&i| show(&rows[i], splits[i]))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let (what, listed) = if group.iter().any(|&i| rows[i].label != first.label) {
            (
                "under more than one label (the same image teaches each class)",
                lines(&|r, _| format!("`{}` line {}", r.label, r.line)),
            )
        } else if group.iter().any(|&i| splits[i] != splits[group[0]]) {
            (
                "in more than one split (the validation scores a training image)",
                lines(&|r, s| format!("{s} line {}", r.line)),
            )
        } else {
            (
                "more than once (the image counts that many times an epoch)",
                lines(&|r, _| format!("line {}", r.line)),
            )
        };
        tracing::warn!(
            "{} lists {} {what}: {listed}",
            file.display(),
            first.path.display()
        );
    }
    if repeated.len() > WARNED_REPEATS {
        tracing::warn!(
            "{} lists {} more files more than once (each row is used as written)",
            file.display(),
            repeated.len() - WARNED_REPEATS
        );
    }
}

fn scan_csv(
    file: &Path,
    base: &Path,
    split: Split,
    valid_fraction: Option<f32>,
    rule: SplitRule,
    seed: u64,
    known: Option<&[String]>,
) -> Result<ScannedSplit, PipelineError> {
    if !file.is_file() {
        return Err(PipelineError::MissingDir {
            path: file.to_path_buf(),
            hint: "the CSV file listing the images",
        });
    }
    let (rows, has_split_column) = read_csv(file, base)?;
    if let Some(f) = valid_fraction {
        if has_split_column {
            return Err(PipelineError::InvalidSetting {
                name: "--valid-fraction",
                value: f.to_string(),
                hint: "the CSV has a split column, whose rows say their split: leave --valid-fraction out (it splits a CSV without one)",
            });
        }
        if !(0.0..1.0).contains(&f) {
            return Err(PipelineError::InvalidSetting {
                name: "--valid-fraction",
                value: f.to_string(),
                hint: "a fraction in [0, 1)",
            });
        }
    }
    let splits = csv_splits(&rows, base, valid_fraction, rule, seed);
    warn_about_repeated_rows(file, &rows, &splits);
    // Held out per class, every label the rows name is a class (one left without a training
    // row is refused below); otherwise the train rows' labels are.
    let per_class = valid_fraction.is_some() && rule == SplitRule::PerClass;
    let mut classes: Vec<String> = rows
        .iter()
        .zip(&splits)
        .filter(|(_, s)| per_class || **s == Split::Train)
        .map(|(r, _)| r.label.clone())
        .collect();
    classes.sort();
    classes.dedup();
    // A split evaluated alone (no train rows) takes the trained model's classes.
    if let (Some(known), true) = (known, split != Split::Train && classes.is_empty()) {
        classes = known.to_vec();
    }
    if let (Some(fraction), true) = (valid_fraction, split == Split::Train) {
        for class in &classes {
            let of_class = || rows.iter().zip(&splits).filter(|(r, _)| &r.label == class);
            if !of_class().any(|(_, s)| *s == Split::Train) {
                let files = of_class().count();
                return Err(PipelineError::ClassWithoutTrainingImages {
                    class: class.clone(),
                    fraction,
                    held: files,
                    files,
                    path: file.to_path_buf(),
                });
            }
        }
    }
    let mut samples = Vec::new();
    let mut bad = Vec::new();
    // Per class: rows in this split, and the label of each bad file.
    let mut rows_per_class = vec![0usize; classes.len()];
    let mut bad_labels = Vec::new();
    for (row, _) in rows.iter().zip(&splits).filter(|(_, s)| **s == split) {
        let label = classes
            .binary_search(&row.label)
            .map_err(|_| PipelineError::UnknownClass {
                class: row.label.clone(),
                split: split.to_string(),
            })?;
        rows_per_class[label] += 1;
        push_file(row.path.clone(), label as u32, &mut samples, &mut bad);
        bad_labels.resize(bad.len(), label);
    }
    if samples.is_empty() && !bad.is_empty() {
        return Err(PipelineError::list_all_bad(&bad));
    }
    // A class whose every row names a missing or empty file would train as if it had no
    // images, the way an empty class folder is refused.
    let mut good_per_class = vec![0usize; classes.len()];
    for s in &samples {
        good_per_class[s.label as usize] += 1;
    }
    if let Some(class) =
        (0..classes.len()).find(|&c| rows_per_class[c] > 0 && good_per_class[c] == 0)
    {
        let class_bad: Vec<&BadFile> = bad
            .iter()
            .zip(&bad_labels)
            .filter(|(_, &l)| l == class)
            .map(|(f, _)| f)
            .collect();
        return Err(PipelineError::csv_class_all_bad(
            &classes[class],
            file,
            split.as_str(),
            &class_bad,
        ));
    }
    if samples.is_empty() {
        // What to add, for the file as it is: never what was given already.
        let hint = if rows.is_empty() {
            "the file lists no image, only its header: add one row per image".to_string()
        } else if has_split_column {
            format!("add rows whose split is `{split}`")
        } else if split == Split::Test {
            "a CSV without a split column has no test rows: add a split column".to_string()
        } else if let Some(f) = valid_fraction {
            format!(
                "--valid-fraction {f} holds out round(F × n) of a label's n rows, at least one of two: every label here has one row or F is too small; a larger --valid-fraction, or more rows"
            )
        } else {
            "add a split column, or give --valid-fraction F to hold out a share of each label's rows".to_string()
        };
        return Err(PipelineError::CsvSplitEmpty {
            file: file.to_path_buf(),
            split: split.to_string(),
            hint,
        });
    }
    Ok(ScannedSplit {
        classes,
        samples,
        bad,
    })
}

/// The files of a list, in its order; missing and empty files go to `bad`.
fn scan_list(classes: &[String], list: &[(PathBuf, u32)]) -> Result<ScannedSplit, PipelineError> {
    if list.is_empty() {
        return Err(PipelineError::InvalidSetting {
            name: "list",
            value: "0 files".into(),
            hint: "give at least one image file",
        });
    }
    if let Some((path, label)) = list.iter().find(|(_, l)| *l as usize >= classes.len()) {
        return Err(PipelineError::ListLabel {
            path: path.clone(),
            label: *label,
            classes: classes.len(),
        });
    }
    let mut samples = Vec::with_capacity(list.len());
    let mut bad = Vec::new();
    for (path, label) in list {
        push_file(path.clone(), *label, &mut samples, &mut bad);
    }
    if samples.is_empty() && !bad.is_empty() {
        return Err(PipelineError::list_all_bad(&bad));
    }
    Ok(ScannedSplit {
        classes: classes.to_vec(),
        samples,
        bad,
    })
}

fn scan_folder(
    root: &Path,
    split: Split,
    known: Option<&[String]>,
) -> Result<ScannedSplit, PipelineError> {
    let train_dir = root.join(Split::Train.as_str());
    let split_dir = root.join(split.as_str());
    // A split evaluated alone takes the trained model's classes.
    let alone = split != Split::Train && !train_dir.is_dir() && split_dir.is_dir();
    let (classes, split_classes) = match known {
        Some(known) if alone => (known.to_vec(), class_dirs(&split_dir)?),
        _ => {
            require_dir(
                &train_dir,
                "the folder layout needs <root>/train/<class>/ (the class index comes from it); a flat <root>/<class>/ folder needs a validation share: --valid-fraction F",
            )?;
            let train_classes = class_dirs(&train_dir)?;
            let classes = names(&train_classes);
            require_dir(&split_dir, "expected <root>/{train,valid,test}/<class>/")?;
            let split_classes = if split == Split::Train {
                train_classes
            } else {
                class_dirs(&split_dir)?
            };
            (classes, split_classes)
        }
    };
    if split_classes.is_empty() {
        return Err(PipelineError::EmptySplit {
            root: root.to_path_buf(),
            split: split.to_string(),
            what: "no class folder with images",
            hint: format!("expected <root>/{split}/<class>/<image files>"),
        });
    }
    let mut samples = Vec::new();
    let mut bad = Vec::new();
    for class in &split_classes {
        let label =
            classes
                .binary_search(&class.name)
                .map_err(|_| PipelineError::UnknownClass {
                    class: class.name.clone(),
                    split: split.to_string(),
                })?;
        let dir = split_dir.join(&class.folder);
        let before = samples.len();
        class_files(&dir, label as u32, &mut samples, &mut bad)?;
        if samples.len() == before {
            return Err(PipelineError::ClassWithoutImages {
                class: class.name.clone(),
                path: dir,
            });
        }
    }
    Ok(ScannedSplit {
        classes,
        samples,
        bad,
    })
}

/// Each row's split: its own column, else held out by `rule` at `valid_fraction` among the
/// rows of its label (paths relative to `base`), else train.
fn csv_splits(
    rows: &[CsvRow],
    base: &Path,
    valid_fraction: Option<f32>,
    rule: SplitRule,
    seed: u64,
) -> Vec<Split> {
    let mut splits: Vec<Split> = rows
        .iter()
        .map(|r| r.split.unwrap_or(Split::Train))
        .collect();
    let Some(fraction) = valid_fraction else {
        return splits;
    };
    let mut by_label: std::collections::BTreeMap<&str, Vec<usize>> = Default::default();
    for (i, row) in rows.iter().enumerate() {
        if row.split.is_none() {
            by_label.entry(&row.label).or_default().push(i);
        }
    }
    for indices in by_label.values() {
        let relative: Vec<&Path> = indices
            .iter()
            .map(|&i| rows[i].path.strip_prefix(base).unwrap_or(&rows[i].path))
            .collect();
        let held = held_out_mask(rule, fraction, seed, &relative);
        for (&i, held) in indices.iter().zip(held) {
            if held {
                splits[i] = Split::Valid;
            }
        }
    }
    splits
}

fn scan_flat(
    root: &Path,
    split: Split,
    valid_fraction: f32,
    rule: SplitRule,
    seed: u64,
) -> Result<ScannedSplit, PipelineError> {
    if !(0.0..1.0).contains(&valid_fraction) {
        return Err(PipelineError::InvalidSetting {
            name: "--valid-fraction",
            value: valid_fraction.to_string(),
            hint: "expected a fraction in [0, 1)",
        });
    }
    if split == Split::Test {
        return Err(PipelineError::InvalidSetting {
            name: "--split",
            value: "test".into(),
            hint: "the flat layout has only train and valid splits",
        });
    }
    let class_folders = class_dirs(root)?;
    let classes = names(&class_folders);
    if classes.is_empty() {
        return Err(PipelineError::EmptySplit {
            root: root.to_path_buf(),
            split: split.to_string(),
            what: "no class folder with images",
            hint: "a flat dataset (--valid-fraction) is <root>/<class>/<image files>: one folder per class; images straight in the root have no class".into(),
        });
    }
    let want_valid = split == Split::Valid;
    let mut samples = Vec::new();
    let mut bad = Vec::new();
    for (label, class) in class_folders.iter().enumerate() {
        let dir = root.join(&class.folder);
        let mut good = Vec::new();
        let mut unusable = Vec::new();
        class_files(&dir, label as u32, &mut good, &mut unusable)?;
        if good.is_empty() {
            return Err(PipelineError::ClassWithoutImages {
                class: class.name.clone(),
                path: dir,
            });
        }
        // Every file of the class takes part, readable or not: the split depends on the
        // names alone, so a file that becomes readable moves no other file.
        let relative: Vec<&Path> = good
            .iter()
            .map(|s| s.path.as_path())
            .chain(unusable.iter().map(|b| b.path.as_path()))
            .map(|p| p.strip_prefix(root).unwrap_or(p))
            .collect();
        let held = held_out_mask(rule, valid_fraction, seed, &relative);
        let (good_held, bad_held) = held.split_at(good.len());
        if split == Split::Train && good_held.iter().all(|h| *h) {
            return Err(PipelineError::ClassWithoutTrainingImages {
                class: class.name.clone(),
                fraction: valid_fraction,
                held: held.iter().filter(|h| **h).count(),
                files: held.len(),
                path: dir,
            });
        }
        samples.extend(
            good.into_iter()
                .zip(good_held)
                .filter(|(_, h)| **h == want_valid)
                .map(|(s, _)| s),
        );
        bad.extend(
            unusable
                .into_iter()
                .zip(bad_held)
                .filter(|(_, h)| **h == want_valid)
                .map(|(b, _)| b),
        );
    }
    if samples.is_empty() {
        return Err(PipelineError::EmptySplit {
            root: root.to_path_buf(),
            split: split.to_string(),
            what: "no image held out",
            hint: format!(
                "--valid-fraction {valid_fraction} holds out round(F × n) of a class's n files, at least one of two: every class here has one file or F is too small; a larger --valid-fraction, or more images"
            ),
        });
    }
    Ok(ScannedSplit {
        classes,
        samples,
        bad,
    })
}
