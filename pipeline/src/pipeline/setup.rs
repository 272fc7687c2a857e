//! What a pipeline works out before it starts: the split's fingerprint, where its cache
//! lives, and the checks that refuse a setting before any work (a cache inside the dataset,
//! image counts that make no batch).

use std::path::PathBuf;

use crate::{LastBatch, PipelineBuilder, PipelineError};

/// Fingerprint of the split's files (relative paths, sizes, labels), class names and resize
/// settings; with `mtimes`, each file's modification time, status-change time and inode
/// number too (the cache key: an edited file that kept its size, even with its mtime set
/// back, still invalidates). Without them it is equal on nodes holding copies of the data.
pub(super) fn fingerprint(
    b: &PipelineBuilder,
    classes: &[String],
    samples: &[crate::scan::Sample],
    mtimes: bool,
) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(b"birdtrain-pipeline-v1");
    h.update(b.split.as_str().as_bytes());
    // The cache key's side is its records' (images of any size are cut from them); the
    // data fingerprint's is the images the model sees, which a checkpoint compares.
    let side = if mtimes {
        b.stored_side()
    } else {
        b.image_size
    };
    h.update(&side.to_le_bytes());
    h.update(b.resize_mode.as_str().as_bytes());
    for class in classes {
        h.update(class.as_bytes());
        h.update(&[0]);
    }
    let root = b.source.root();
    for s in samples {
        let rel = root.map_or(&*s.path, |root| {
            s.path.strip_prefix(root).unwrap_or(&s.path)
        });
        h.update(rel.as_os_str().as_encoded_bytes());
        h.update(&[0]);
        h.update(&s.size.to_le_bytes());
        if mtimes {
            h.update(&s.mtime_ns.to_le_bytes());
            h.update(&s.identity.ctime_ns.to_le_bytes());
            h.update(&s.identity.inode.to_le_bytes());
        }
        h.update(&s.label.to_le_bytes());
    }
    h.digest()
}

/// The cache file for this dataset root, split and resize setting (contents are checked by
/// the fingerprint in the header, so an edited dataset reuses, and rebuilds, the same file).
pub(super) fn cache_path(b: &PipelineBuilder) -> PathBuf {
    let dir = b.cache_dir.clone().unwrap_or_else(|| {
        dirs::cache_dir()
            .unwrap_or_else(std::env::temp_dir)
            .join("birdtrain")
    });
    let (root, layout) = match &b.source {
        crate::DatasetSource::List { samples, .. } => {
            // A list is its own dataset: keyed by its files (absolute) and labels, in order.
            let mut h = xxhash_rust::xxh3::Xxh3::new();
            h.update(b"list");
            for (path, label) in samples {
                let absolute = std::path::absolute(path).unwrap_or_else(|_| path.clone());
                h.update(absolute.as_os_str().as_encoded_bytes());
                h.update(&[0]);
                h.update(&label.to_le_bytes());
            }
            let hash = h.digest();
            return dir.join(format!(
                "list-{}-{}-{}-{hash:016x}.bcache",
                b.split,
                b.stored_side(),
                b.resize_mode
            ));
        }
        crate::DatasetSource::Folder { root } => (root, "folder".to_string()),
        crate::DatasetSource::Flat {
            root,
            valid_fraction,
            rule,
        } => (
            root,
            format!("flat-{valid_fraction}-{}{}", b.seed, rule_key(*rule)),
        ),
        crate::DatasetSource::Csv {
            file,
            base,
            valid_fraction,
            rule,
        } => (
            base,
            format!(
                "csv-{}-{valid_fraction:?}-{}{}",
                file.file_name().unwrap_or_default().to_string_lossy(),
                b.seed,
                rule_key(*rule)
            ),
        ),
    };
    let canonical = std::fs::canonicalize(root).unwrap_or_else(|_| root.to_path_buf());
    let key = format!("{}|{layout}", canonical.display());
    let hash = xxhash_rust::xxh3::xxh3_64(key.as_bytes());
    let name: String = root
        .file_name()
        .map(|n| {
            n.to_string_lossy()
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
                .collect()
        })
        .unwrap_or_default();
    dir.join(format!(
        "{name}-{}-{}-{}-{hash:016x}.bcache",
        b.split,
        b.stored_side(),
        b.resize_mode
    ))
}

/// The bad-files report and a cache folder given by the caller must lie outside the dataset
/// (a list of files to classify is no dataset folder: anything may lie beside them).
pub(super) fn refuse_writes_into_dataset(b: &PipelineBuilder) -> Result<(), PipelineError> {
    if matches!(b.source, crate::DatasetSource::List { .. }) {
        return Ok(());
    }
    let places = [
        (
            "the bad-files report",
            b.bad_files_report.as_deref(),
            "write it outside the dataset; a trainer writes it into its run folder, so give --out a folder outside --data",
        ),
        (
            "the cache folder",
            b.cache_dir.as_deref(),
            "give --cache-dir a folder outside --data",
        ),
    ];
    for (what, path, hint) in places {
        let Some(path) = path else { continue };
        if let Some(data) = b.source.folder_holding(path)? {
            return Err(PipelineError::WritesIntoDataset {
                what,
                path: path.to_path_buf(),
                data,
                hint,
            });
        }
    }
    Ok(())
}

/// The split rule's part of a cache file's key: none for version 1, so the caches made
/// before version 2 keep their names.
fn rule_key(rule: crate::SplitRule) -> String {
    match rule {
        crate::SplitRule::PerFileDraw => String::new(),
        rule => format!("-split{}", rule.version()),
    }
}

/// Checks the counts that depend on the dataset and the machine; returns the bytes of one
/// batch buffer. A micro-batch never holds more images than the split (except with `pad`,
/// which repeats images to fill it), so buffers are sized for what can really come.
pub(super) fn check_counts(b: &PipelineBuilder, images: usize) -> Result<usize, PipelineError> {
    // Training replicas each need an image per step; evaluation (partial batches) may leave
    // some replicas empty, which the consumer already handles.
    if b.split == crate::Split::Train && b.replicas > images {
        return Err(PipelineError::Limit {
            name: "replicas",
            value: b.replicas.to_string(),
            limit: format!("the split `{}` has {images} images", b.split),
            hint: format!(
                "every replica needs at least one image per step; use at most {images} replicas"
            ),
        });
    }
    if b.replicas.checked_mul(b.batch_size).is_none() {
        return Err(PipelineError::Limit {
            name: "batch_size",
            value: b.batch_size.to_string(),
            limit: format!(
                "{} replicas × {} images overflows",
                b.replicas, b.batch_size
            ),
            hint: "use a smaller batch size".into(),
        });
    }
    let per_batch = match b.last_batch {
        LastBatch::Pad => b.batch_size,
        LastBatch::Partial | LastBatch::Drop => b.batch_size.min(images),
    };
    let record = b.image_size as usize * b.image_size as usize * 3;
    // Buffers alive per epoch iterator: pending and ready batches (prefetch each), the one
    // being assembled and the one the consumer holds. At most half the available memory,
    // so the consumer (a model) keeps the rest.
    let in_flight = b.prefetch.saturating_mul(2).saturating_add(2);
    let bytes = per_batch.checked_mul(record);
    let need = bytes.map(|bytes| (bytes as u64).saturating_mul(in_flight as u64));
    let budget = crate::limits::available_memory().map(|m| m / 2);
    match (bytes, need, budget) {
        (Some(bytes), Some(need), Some(budget)) if need <= budget => Ok(bytes),
        (Some(bytes), Some(_), None) => Ok(bytes),
        (_, need, budget) => {
            let need = need.map_or("more bytes than exist".into(), crate::limits::human_bytes);
            let budget = budget.map_or("unknown".into(), crate::limits::human_bytes);
            let (name, value) = if b.prefetch > 64 && per_batch <= 4096 {
                ("prefetch", b.prefetch.to_string())
            } else {
                ("batch_size", b.batch_size.to_string())
            };
            Err(PipelineError::Limit {
                name,
                value,
                limit: format!(
                    "{in_flight} batch buffers of {per_batch} images of {s}×{s} need {need}, and \
                     batch buffers may take half the available memory ({budget})",
                    s = b.image_size
                ),
                hint: format!("use a smaller {name}"),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_cache_lives_in_the_per_user_cache_directory() {
        let b = PipelineBuilder::new(crate::DatasetSource::folder("/data/285birds")).image_size(96);
        let path = cache_path(&b);
        let expected = dirs::cache_dir()
            .unwrap_or_else(std::env::temp_dir)
            .join("birdtrain");
        assert!(path.starts_with(&expected), "{}", path.display());
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("285birds-train-96-direct-"), "{name}");
        // Another split or resize setting is another file.
        assert_ne!(cache_path(&b.clone().split(crate::Split::Valid)), path);
        assert_ne!(
            cache_path(
                &b.clone()
                    .resize_mode(crate::ResizeMode::ShorterSideCenterCrop)
            ),
            path
        );
        assert_eq!(
            cache_path(&b.clone().cache_dir("/x")).parent().unwrap(),
            std::path::Path::new("/x")
        );
    }
}
