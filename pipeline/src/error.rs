//! The engine's error type: one enum, each variant carrying the file, flag or value involved
//! and, where it helps, a hint on how to fix it.

use std::path::PathBuf;

/// Everything that can go wrong while scanning, decoding, caching or batching.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PipelineError {
    /// The data directory (or one split inside it) does not exist.
    #[error("data directory {path} does not exist (hint: {hint})")]
    MissingDir {
        /// The directory that was looked for.
        path: PathBuf,
        /// What the engine expected there.
        hint: &'static str,
    },
    /// Listing a directory failed.
    #[error("cannot list {path}: {source}")]
    ReadDir {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The split holds no image at all.
    #[error("split `{split}` under {root} is empty: {what} (hint: {hint})")]
    EmptySplit {
        /// The dataset root.
        root: PathBuf,
        /// The split's name.
        split: String,
        /// What is missing ("no class folder with images").
        what: &'static str,
        /// What the layout in use expects.
        hint: String,
    },
    /// A class folder has no readable image.
    #[error(
        "class `{class}` ({path}) has no readable image (hint: remove the folder or add images)"
    )]
    ClassWithoutImages {
        /// The class name.
        class: String,
        /// Its folder.
        path: PathBuf,
    },
    /// After the validation share was held out, a class has no readable training image left
    /// (training on it would never see the class).
    #[error("class `{class}` has no readable training image after the validation split: --valid-fraction {fraction} holds out {held} of its {files} files in {path}{} (hint: a smaller --valid-fraction, or more images in the class)", if held < files { ", and the others are unreadable" } else { "" })]
    ClassWithoutTrainingImages {
        /// The class name.
        class: String,
        /// The validation share.
        fraction: f32,
        /// The class's files held out.
        held: usize,
        /// The class's files (or CSV rows).
        files: usize,
        /// Its folder, or the CSV file listing it.
        path: PathBuf,
    },
    /// A file the engine would write (its bad-files report, its cache) lies inside the
    /// dataset, where it would become part of the data or replace an image.
    #[error("{what} {path} is inside the dataset {data} (hint: {hint})")]
    WritesIntoDataset {
        /// What would be written ("the bad-files report", "the cache folder").
        what: &'static str,
        /// Where.
        path: PathBuf,
        /// The dataset folder (or the CSV's image folder) it lies in.
        data: PathBuf,
        /// What to do instead.
        hint: &'static str,
    },
    /// Every image of the split is unreadable.
    #[error("every image of split `{split}` under {root} is unreadable ({bad} bad files; see the bad-files report)")]
    AllImagesBad {
        /// The dataset root.
        root: PathBuf,
        /// The split's name.
        split: String,
        /// How many files were bad.
        bad: usize,
    },
    /// A dataset CSV lists no image of the split asked for.
    #[error("{file}: no image of split `{split}` (hint: {hint})")]
    CsvSplitEmpty {
        /// The CSV file.
        file: PathBuf,
        /// The split's name.
        split: String,
        /// What to add, for the file as it is (its split column or not, the share given).
        hint: String,
    },
    /// A dataset CSV that cannot be read as one.
    #[error("{file}{}: {reason} (hint: a header row with path and label columns, one row per image)", if *line > 0 { format!(" line {line}") } else { String::new() })]
    BadCsv {
        /// The CSV file.
        file: PathBuf,
        /// The line (1: the header; 0: the file as a whole).
        line: u64,
        /// What is wrong.
        reason: String,
    },
    /// A file of a list source has a label beyond its class list.
    #[error("label {label} of {path} is not a class: the list has {classes} classes (hint: labels index the class list, 0..{classes})")]
    ListLabel {
        /// The file.
        path: PathBuf,
        /// Its label.
        label: u32,
        /// How many classes the list has.
        classes: usize,
    },
    /// No file of a list source is a readable image.
    #[error("none of the {bad} listed files is a readable image; the first, {first}: {reason} (hint: check the paths)")]
    ListAllBad {
        /// How many files were bad.
        bad: usize,
        /// The first bad file.
        first: PathBuf,
        /// What is wrong with it.
        reason: String,
        /// Every bad file, with what is wrong with it (a caller that reports each file).
        files: Vec<crate::BadFile>,
    },
    /// A class of a dataset CSV none of whose files in the split is a readable image.
    #[error("class `{class}` of {file} has no readable image in split `{split}` ({bad} bad files; the first, {first}) (hint: fix those files or remove the class's rows)")]
    CsvClassWithoutImages {
        /// The class label.
        class: String,
        /// The CSV file.
        file: PathBuf,
        /// The split's name.
        split: String,
        /// How many of the class's files were bad.
        bad: usize,
        /// The first bad file and what is wrong with it.
        first: String,
    },
    /// Two class folders whose names differ only in bytes that are not UTF-8.
    #[error("class folders {first:?} and {second:?} in {dir} have the same name once their non-UTF-8 bytes are replaced (hint: rename one of them, e.g. to UTF-8)")]
    ClassNameClash {
        /// The folder holding both.
        dir: PathBuf,
        /// One folder name.
        first: std::ffi::OsString,
        /// The other.
        second: std::ffi::OsString,
    },
    /// A class folder in valid/test has no counterpart in train.
    #[error("class `{class}` of split `{split}` does not exist in the train split (hint: the class index comes from train's folders; add {class} to train or remove it)")]
    UnknownClass {
        /// The class name.
        class: String,
        /// The split where it was found.
        split: String,
    },
    /// A bad image while `--on-bad-image fail` is in force.
    #[error("bad image {path}: {kind} (hint: fix or remove the file, or use --on-bad-image skip)")]
    BadImage {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        kind: crate::BadFileKind,
        /// The underlying decoder or I/O error, when there is one.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// Opening or reading an image hit a limit of the process or the machine (too many open
    /// files, out of memory): not a fault of the file, so the epoch stops rather than skip
    /// good images as bad ones.
    #[error("cannot read {path}: {limit} (hint: {hint})")]
    OutOfResources {
        /// The image being opened or read.
        path: PathBuf,
        /// Which limit was hit, with its value where known.
        limit: String,
        /// What to do about it.
        hint: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A folder of the dataset (its root, a split or a class folder) disappeared while the
    /// engine was reading its images (renamed or deleted during the run).
    #[error("the dataset folder {path} disappeared during the run (hint: restore it; a --resume continues)")]
    DatasetVanished {
        /// The topmost folder that is gone.
        path: PathBuf,
    },
    /// An invalid builder or command-line setting.
    #[error("invalid setting {name} = {value}: {hint}")]
    InvalidSetting {
        /// The setting (builder method or flag).
        name: &'static str,
        /// The offending value.
        value: String,
        /// What would be valid.
        hint: &'static str,
    },
    /// A count larger than this machine or this dataset can serve.
    #[error("{name} = {value} is too large: {limit} (hint: {hint})")]
    Limit {
        /// The setting (builder method).
        name: &'static str,
        /// The value asked for.
        value: String,
        /// What it exceeds, with the numbers.
        limit: String,
        /// What to do instead.
        hint: String,
    },
    /// An I/O error on the cache file.
    #[error(
        "cache file {path}: {what}: {source} (hint: check --cache-dir is writable and has space)"
    )]
    CacheIo {
        /// The cache file or directory.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Writing the bad-files report failed.
    #[error("cannot write bad-files report {path}: {source}")]
    Report {
        /// The report file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The batch allocator failed or returned a buffer of the wrong size.
    #[error("batch allocator: {message}")]
    Allocator {
        /// What happened.
        message: String,
        /// The allocator's own error, if any.
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// A decode worker died (panicked or vanished) while holding a job.
    #[error("decode worker failed on {path}: {message}")]
    WorkerDied {
        /// The file it was working on.
        path: PathBuf,
        /// The panic message or the reason.
        message: String,
    },
    /// An engine stage (planner or assembler task) panicked; the epoch cannot go on.
    #[error("the engine's {stage} stage panicked: {message}")]
    StagePanicked {
        /// Which stage.
        stage: &'static str,
        /// The panic message.
        message: String,
    },
    /// Resizing failed (an internal invariant; the source says which).
    #[error("resizing {path} failed: {source}")]
    Resize {
        /// The file.
        path: PathBuf,
        /// The resizer's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A requested epoch step is out of range.
    #[error("start step {step} is past the end of the epoch ({steps} steps)")]
    StepOutOfRange {
        /// The requested step.
        step: usize,
        /// Steps in an epoch.
        steps: usize,
    },
    /// A thread of the engine (a decode worker, the orchestrator) could not start.
    #[error(transparent)]
    Thread(#[from] crate::threads::ThreadStartError),
    /// The engine's runtime could not start.
    #[error("cannot start the engine runtime: {source} (hint: the process may have hit a limit on memory or open files: see `ulimit -v` and `ulimit -n`)")]
    Runtime {
        /// The I/O error from tokio or the OS.
        #[source]
        source: std::io::Error,
    },
    /// The engine stopped before the epoch ended (the pipeline was shut down).
    #[error("the engine stopped before the epoch ended: {reason}")]
    Stopped {
        /// Why.
        reason: String,
    },
}

impl PipelineError {
    /// A list or CSV none of whose files is a readable image: how many, and the first.
    pub(crate) fn list_all_bad(bad: &[crate::BadFile]) -> Self {
        let first = bad.first();
        Self::ListAllBad {
            bad: bad.len(),
            first: first.map(|f| f.path.clone()).unwrap_or_default(),
            reason: first.map_or(String::new(), |f| format!("{} ({})", f.kind, f.detail)),
            files: bad.to_vec(),
        }
    }

    /// A CSV class with no readable image in `split`; `bad` holds that class's bad files.
    pub(crate) fn csv_class_all_bad(
        class: &str,
        file: &std::path::Path,
        split: &str,
        bad: &[&crate::BadFile],
    ) -> Self {
        let first = bad.first();
        Self::CsvClassWithoutImages {
            class: class.to_string(),
            file: file.to_path_buf(),
            split: split.to_string(),
            bad: bad.len(),
            first: first.map_or(String::new(), |f| {
                format!("{}: {} ({})", f.path.display(), f.kind, f.detail)
            }),
        }
    }
}
