//! Paths given on the command line checked before use: for their kind (a folder where a
//! file is expected, or a device, a pipe, a socket, is named as such, instead of a later
//! "Is a directory" or "No such file or directory" from deep inside a command), and, for
//! every file or folder a command writes, for its place ([`Guarded`]): never one of a run
//! folder's own files, never inside a `best/` folder, never inside the dataset.

use std::path::{Path, PathBuf};

use super::CliError;
use crate::train::folder::{best_folder_owner, is_run_file_name, is_run_folder};

/// What is at `path`, for a message: "a folder", "a character device", … (`None`: nothing).
pub(crate) fn kind_of(path: &Path) -> Option<&'static str> {
    use std::os::unix::fs::FileTypeExt;
    let meta = std::fs::metadata(path).ok()?;
    let t = meta.file_type();
    Some(if t.is_dir() {
        "a folder"
    } else if t.is_file() {
        "a file"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_fifo() {
        "a named pipe"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    })
}

/// `path` must be a regular file (symbolic links followed); `hint` says what was expected.
pub(crate) fn expect_file(path: &Path, hint: &'static str) -> Result<(), CliError> {
    match kind_of(path) {
        Some("a file") => Ok(()),
        None => Err(CliError::MissingPath {
            path: path.to_path_buf(),
            hint,
        }),
        Some(kind) => Err(CliError::WrongKind {
            path: path.to_path_buf(),
            kind,
            expected: "a file",
            hint,
        }),
    }
}

/// `path` must be a folder (symbolic links followed); `hint` says what was expected.
pub(crate) fn expect_dir(path: &Path, hint: &'static str) -> Result<(), CliError> {
    match kind_of(path) {
        Some("a folder") => Ok(()),
        None => Err(CliError::MissingPath {
            path: path.to_path_buf(),
            hint,
        }),
        Some(kind) => Err(CliError::WrongKind {
            path: path.to_path_buf(),
            kind,
            expected: "a folder",
            hint,
        }),
    }
}

pub(crate) use crate::train::printable;

/// `--cache-dir`, when given and present, is a folder (it is created when missing).
pub(crate) fn check_cache_dir(dir: Option<&Path>) -> Result<(), CliError> {
    match dir {
        Some(dir) if kind_of(dir).is_some() => expect_dir(
            dir,
            "--cache-dir takes a folder for the pixel cache (created when missing)",
        ),
        _ => Ok(()),
    }
}

/// The training paths: `--cache-dir` and `--out` must be folders when they exist, and
/// nothing the run writes (its run folder, its cache, `--trace`) may land in a place
/// [`Guarded`] keeps, or on a file the run reads (`--init-from`, a CSV `--data`).
pub(crate) fn check_train_paths(cfg: &crate::train::TrainConfig) -> Result<(), CliError> {
    check_cache_dir(cfg.cache_dir.as_deref())?;
    if kind_of(&cfg.out).is_some() {
        expect_dir(&cfg.out, "--out takes a run folder (created when missing)")?;
    }
    let mut runs: Vec<(&'static str, &Path)> = cfg
        .resume
        .iter()
        .map(|r| ("--resume", r.as_path()))
        .collect();
    runs.push(("--out", cfg.out.as_path()));
    let guard = Guarded {
        runs,
        data: Some(&cfg.data),
    };
    guard.check_run_folder(&cfg.out, cfg.resume.as_deref())?;
    if let Some(dir) = &cfg.cache_dir {
        guard.check_folder("--cache-dir", dir)?;
    }
    if let Some(trace) = &cfg.dist.trace {
        guard.check_file("--trace", trace)?;
        let mut files = vec![("--trace", trace.as_path())];
        files.extend(cfg.init_from.as_deref().map(|p| ("--init-from", p)));
        if cfg.data.is_file() {
            files.push(("--data", cfg.data.as_path()));
        }
        check_distinct_files(&files)?;
    }
    Ok(())
}

/// What a command's writes must leave alone: the run folders it names (`--checkpoint`,
/// `--resume`, `--out`: their own files and `best/`), every other run folder's own files and
/// `best/` folders (found on disk), and the dataset (`--data`: its folder; for a CSV, the CSV
/// and every folder holding an image it lists). Paths are compared resolved
/// ([`pipeline::resolve`]): through symbolic links, `.` and `..`, and through the folder of
/// a file that does not exist yet.
pub(crate) struct Guarded<'a> {
    /// Run folders named on the command line, with their flags.
    pub(crate) runs: Vec<(&'static str, &'a Path)>,
    /// `--data`, when the command reads a dataset.
    pub(crate) data: Option<&'a Path>,
}

impl Guarded<'_> {
    /// A file the command writes (`flag` names it): refused when it is a run folder's own file
    /// (a file a run writes, in a folder holding a run or named as one), or lies inside a
    /// `best/` folder or the dataset.
    pub(crate) fn check_file(&self, flag: &'static str, path: &Path) -> Result<(), CliError> {
        let target = pipeline::resolve(path);
        if let (Some(folder), Some(name)) = (target.parent(), target.file_name()) {
            let named = self
                .runs
                .iter()
                .find(|(_, run)| pipeline::resolve(run) == folder);
            let is_run = named.is_some() || is_run_folder(folder);
            if is_run && is_run_file_name(&name.to_string_lossy()) {
                let whose = named.map_or(String::new(), |(f, _)| format!(" ({f})"));
                return Err(refused(
                    flag,
                    path,
                    format!(
                        "is {}, a file of the run folder {}{whose}: writing it would replace the run's own",
                        name.to_string_lossy(),
                        folder.display()
                    ),
                    format!("give {flag} a file of another name or outside the run folder"),
                ));
            }
        }
        self.check_place(flag, path, &target)
    }

    /// A folder the command writes into (`--cache-dir`): refused inside a `best/` folder or
    /// the dataset.
    pub(crate) fn check_folder(&self, flag: &'static str, dir: &Path) -> Result<(), CliError> {
        self.check_place(flag, dir, &pipeline::resolve(dir))
    }

    /// `--out`: refused inside the dataset (it would become a class, and its reports land
    /// among the images), as a `best/` folder or inside one (`--resume RUN/best` continues
    /// into a new folder), and when it holds the run `--resume` names (the resumed run's
    /// files would be replaced while it is read).
    pub(crate) fn check_run_folder(
        &self,
        out: &Path,
        resume: Option<&Path>,
    ) -> Result<(), CliError> {
        let target = pipeline::resolve(out);
        if let Some(resume) = resume {
            let resumed = pipeline::resolve(resume);
            if let Some(owner) = best_folder_owner(&resumed).filter(|_| resumed == target) {
                return Err(refused(
                    "--resume",
                    resume,
                    format!(
                        "is the best-epoch folder of the run {}: training there would replace that epoch's checkpoint",
                        owner.display()
                    ),
                    format!(
                        "continue from it into a new run folder: --resume {} --out NEW starts there from its checkpoint and leaves it as it is",
                        resume.display()
                    ),
                ));
            }
            if resumed != target && resumed.starts_with(&target) {
                return Err(refused(
                    "--out",
                    out,
                    format!(
                        "holds the run --resume {} continues, whose files the new run would replace",
                        resume.display()
                    ),
                    "give --out a folder outside it (a new folder starts from the resumed checkpoint)".into(),
                ));
            }
        }
        self.check_place("--out", out, &target)
    }

    /// Inside a `best/` folder, or inside the dataset.
    fn check_place(&self, flag: &'static str, path: &Path, target: &Path) -> Result<(), CliError> {
        if let Some((best, owner)) = target
            .ancestors()
            .find_map(|a| best_folder_owner(a).map(|owner| (a.to_path_buf(), owner)))
        {
            let place = if best == target {
                "is".to_string()
            } else {
                format!("is inside {},", best.display())
            };
            return Err(refused(
                flag,
                path,
                format!(
                    "{place} the best-epoch folder of the run {}, which only that run writes",
                    owner.display()
                ),
                format!("give {flag} a place outside it"),
            ));
        }
        if let Some(data) = self.data {
            let source = pipeline::DatasetSource::at(data, None);
            if let Some(folder) = source.folder_holding(path)? {
                let what = if folder == data {
                    format!("the dataset {} (--data)", data.display())
                } else {
                    format!(
                        "{}, which holds images of the dataset --data {} lists",
                        folder.display(),
                        data.display()
                    )
                };
                return Err(refused(
                    flag,
                    path,
                    format!("is inside {what}: what is written there would mix with the images"),
                    format!("give {flag} a place outside the dataset"),
                ));
            }
        }
        Ok(())
    }
}

/// The refusal of a path a command would write (`clash`: what is there, `hint`: what to do).
fn refused(flag: &'static str, path: &Path, clash: String, hint: String) -> CliError {
    CliError::WouldOverwrite {
        flag,
        path: PathBuf::from(path),
        clash,
        hint,
    }
}

/// `--data`: a dataset folder, or a regular file (a CSV listing the images).
pub(crate) fn expect_data(path: &Path, hint: &'static str) -> Result<(), CliError> {
    match kind_of(path) {
        Some("a file") => Ok(()),
        _ => expect_dir(path, hint),
    }
}

/// A file a command will write: its folder must exist, and the path, when present, must be a
/// file it may replace (checked before the work, so a long evaluation is not lost to a typo).
pub(crate) fn check_output_file(path: &Path, hint: &'static str) -> Result<(), CliError> {
    if kind_of(path).is_some() {
        return expect_file(path, hint);
    }
    match path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(parent) => expect_dir(parent, hint),
        None => Ok(()),
    }
}

/// What `path` names on disk, for comparing two paths: the canonical path when it exists,
/// else its folder's canonical path joined with its name (so `out.csv` and `./out.csv` are
/// one file before either is written), else the path as given.
fn identity(path: &Path) -> std::path::PathBuf {
    if let Ok(p) = std::fs::canonicalize(path) {
        return p;
    }
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    match (std::fs::canonicalize(parent), path.file_name()) {
        (Ok(dir), Some(name)) => dir.join(name),
        _ => path.to_path_buf(),
    }
}

/// The files one command writes (and the files it reads, which it must not overwrite) are
/// all different: two flags naming the same file are refused, naming both, before any work.
pub(crate) fn check_distinct_files(files: &[(&'static str, &Path)]) -> Result<(), CliError> {
    for (i, (flag, path)) in files.iter().enumerate() {
        let id = identity(path);
        if let Some((earlier, _)) = files[..i].iter().find(|(_, p)| identity(p) == id) {
            return Err(CliError::BadValue {
                flag,
                value: path.display().to_string(),
                hint: format!(
                    "{earlier} names the same file, and one would overwrite the other: give each its own file"
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        assert!(expect_file(&file, "h").is_ok());
        assert!(expect_dir(dir.path(), "h").is_ok());
        let e = expect_file(dir.path(), "h").unwrap_err().to_string();
        assert!(e.contains("is a folder, not a file"), "{e}");
        let e = expect_dir(&file, "h").unwrap_err().to_string();
        assert!(e.contains("is a file, not a folder"), "{e}");
        let e = expect_file(Path::new("/dev/null"), "h")
            .unwrap_err()
            .to_string();
        assert!(e.contains("character device"), "{e}");
        let e = expect_file(&dir.path().join("nope"), "h")
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not exist"), "{e}");
        assert!(check_output_file(&file, "h").is_ok());
        assert!(check_output_file(&dir.path().join("new.csv"), "h").is_ok());
        assert!(check_output_file(Path::new("relative.csv"), "h").is_ok());
        let e = check_output_file(dir.path(), "h").unwrap_err().to_string();
        assert!(e.contains("is a folder, not a file"), "{e}");
        let e = check_output_file(&dir.path().join("nope/x.csv"), "h")
            .unwrap_err()
            .to_string();
        assert!(e.contains("nope") && e.contains("does not exist"), "{e}");
    }

    #[test]
    fn two_flags_naming_one_file_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.txt");
        let b = dir.path().join("b.txt");
        let same = dir.path().join(".").join("a.txt");
        assert!(check_distinct_files(&[("--predictions", &a), ("--confusion", &b)]).is_ok());
        let e = check_distinct_files(&[("--predictions", &a), ("--confusion", &same)])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--confusion") && e.contains("--predictions") && e.contains("same file"),
            "{e}"
        );
        std::fs::write(&b, b"x").unwrap();
        let link = dir.path().join("link.txt");
        std::os::unix::fs::symlink(&b, &link).unwrap();
        assert!(check_distinct_files(&[("--data", &b), ("--predictions", &link)]).is_err());
    }

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(printable("plain name"), "plain name");
        assert_eq!(printable("two\nlines\t"), "two\\nlines\\t");
    }
}
