//! Paths given on the command line checked for their kind before use: a folder where a file
//! is expected (or a device, a pipe, a socket) is named as such, instead of a later
//! "Is a directory" or "No such file or directory" from deep inside a command.

use std::path::Path;

use super::CliError;

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

/// The training paths that must be folders when they exist: `--cache-dir` and `--out`.
pub(crate) fn check_train_paths(cfg: &crate::train::TrainConfig) -> Result<(), CliError> {
    check_cache_dir(cfg.cache_dir.as_deref())?;
    if kind_of(&cfg.out).is_some() {
        expect_dir(&cfg.out, "--out takes a run folder (created when missing)")?;
    }
    Ok(())
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
