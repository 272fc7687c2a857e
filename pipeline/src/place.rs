//! Where a path really is, and whether it lies inside a dataset: what keeps a run folder, a
//! cache or a report from being written among the images (where a flat layout would take a
//! run folder for a class, and a report could land in a class folder).

use std::path::{Component, Path, PathBuf};

use crate::{DatasetSource, PipelineError};

/// The absolute path `path` names on disk, symbolic links resolved: the longest part of it
/// that exists is canonicalised, the rest (not yet created) appended with `.` and `..` taken
/// lexically. So `out/x`, `./out/x` and a link to `out` followed by `/x` resolve alike before
/// anything exists there.
pub fn resolve(path: &Path) -> PathBuf {
    let Ok(absolute) = std::path::absolute(path) else {
        return path.to_path_buf();
    };
    let mut out = PathBuf::new();
    let mut exists = true;
    for component in absolute.components() {
        match component {
            // `out` is canonical while it exists, so its parent is the real one.
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
        if exists {
            match std::fs::canonicalize(&out) {
                Ok(real) => out = real,
                Err(_) => exists = false,
            }
        }
    }
    out
}

impl DatasetSource {
    /// The dataset folder that `path` would be written into, if any: for a folder layout its
    /// root; for a CSV file the CSV itself, an image it lists, or a folder holding an image
    /// it lists (of any split); for a list of files, one of them or a folder holding one.
    /// `None` when `path` lies outside all of them, or in a hidden folder (or is a hidden
    /// file) inside them, which no scan reads (`--data D --cache-dir D/.cache` is fine).
    /// Paths are compared resolved ([`resolve`]), so links and `..` do not hide a folder.
    pub fn folder_holding(&self, path: &Path) -> Result<Option<PathBuf>, PipelineError> {
        let target = resolve(path);
        match self {
            Self::Folder { root } | Self::Flat { root, .. } => {
                Ok(inside(&target, root).then(|| root.clone()))
            }
            Self::Csv { file, base, .. } => {
                if resolve(file) == target {
                    return Ok(Some(file.clone()));
                }
                let listed = crate::scan::listed_paths(file, base)?;
                Ok(first_folder_holding(
                    &target,
                    listed.iter().map(|p| p.as_path()),
                ))
            }
            Self::List { samples, .. } => Ok(first_folder_holding(
                &target,
                samples.iter().map(|(p, _)| p.as_path()),
            )),
        }
    }
}

/// Whether `target` (resolved) lies in `folder` and in no hidden folder below it (nor is a
/// hidden file there).
fn inside(target: &Path, folder: &Path) -> bool {
    target.strip_prefix(resolve(folder)).is_ok_and(|rest| {
        !rest
            .components()
            .any(|c| c.as_os_str().as_encoded_bytes().first() == Some(&b'.'))
    })
}

/// The first folder holding one of `files` that `target` (resolved) is one of, or lies in.
fn first_folder_holding<'a>(
    target: &Path,
    files: impl Iterator<Item = &'a Path>,
) -> Option<PathBuf> {
    let mut by_folder: std::collections::BTreeMap<&Path, Vec<&std::ffi::OsStr>> =
        Default::default();
    for file in files {
        let folder = match file.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let names = by_folder.entry(folder).or_default();
        names.extend(file.file_name());
    }
    by_folder.into_iter().find_map(|(folder, names)| {
        let real = resolve(folder);
        let listed = target.parent() == Some(real.as_path())
            && target.file_name().is_some_and(|n| names.contains(&n));
        (listed || inside(target, &real)).then(|| folder.to_path_buf())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_resolve_through_links_and_dots_before_they_exist() {
        let tmp = tempfile::tempdir().unwrap();
        let real = resolve(tmp.path());
        std::fs::create_dir(real.join("data")).unwrap();
        std::os::unix::fs::symlink(real.join("data"), real.join("link")).unwrap();
        assert_eq!(resolve(&real.join("link/new/x")), real.join("data/new/x"));
        assert_eq!(resolve(&real.join("data/new/../y")), real.join("data/y"));
        assert_eq!(resolve(&real.join("link/../z")), real.join("z"));
        assert_eq!(resolve(&real.join("data/./w")), real.join("data/w"));
    }

    #[test]
    fn a_path_is_inside_a_folder_dataset_or_beside_a_csvs_images() {
        let tmp = tempfile::tempdir().unwrap();
        let root = resolve(tmp.path());
        let data = root.join("data");
        std::fs::create_dir_all(data.join("a")).unwrap();
        std::fs::write(data.join("a/1.png"), b"x").unwrap();
        std::os::unix::fs::symlink(&data, root.join("link")).unwrap();
        let folder = DatasetSource::flat(&data, 0.2);
        assert_eq!(
            folder.folder_holding(&root.join("link/run")).unwrap(),
            Some(data.clone())
        );
        assert_eq!(folder.folder_holding(&root.join("run")).unwrap(), None);
        // A CSV beside the data: the folders of its images are the dataset.
        let csv = root.join("list.csv");
        std::fs::write(&csv, "path,label\ndata/a/1.png,a\n").unwrap();
        let listed = DatasetSource::csv(&csv, None);
        assert_eq!(
            listed.folder_holding(&data.join("a/run")).unwrap(),
            Some(root.join("data/a"))
        );
        assert_eq!(listed.folder_holding(&csv).unwrap(), Some(csv.clone()));
        // The CSV's own folder holds no image: a run folder beside the CSV is fine.
        assert_eq!(listed.folder_holding(&root.join("run")).unwrap(), None);
        assert_eq!(listed.folder_holding(&data.join("run")).unwrap(), None);
        // A hidden folder inside the data is read by no scan; a listed hidden image still is
        // the dataset's.
        assert_eq!(folder.folder_holding(&data.join(".cache/x")).unwrap(), None);
        assert_eq!(
            folder.folder_holding(&data.join("a/.trace.json")).unwrap(),
            None
        );
        std::fs::write(data.join("a/.2.png"), b"x").unwrap();
        std::fs::write(&csv, "path,label\ndata/a/.2.png,a\n").unwrap();
        assert_eq!(
            listed.folder_holding(&data.join("a/.2.png")).unwrap(),
            Some(root.join("data/a"))
        );
    }
}
