//! `--data labels.csv`: training, `--resume` and `eval` on a dataset listed in a CSV file
//! (the Kaggle birds shape: `filepaths,labels,data set`), which must match the folder layout
//! it lists.

use std::path::Path;

use crate::cli_support;
use cli_support::s;
use cli_support::small_run::{dataset, ok, resume_args, run_with, text, train_args, weights};

/// A CSV listing every file under `root`'s train/ and valid/, paths relative to `root`.
fn write_csv(root: &Path) -> std::path::PathBuf {
    let mut text = String::from("filepaths,labels,data set\n");
    for split in ["train", "valid"] {
        for class in std::fs::read_dir(root.join(split)).unwrap() {
            let class = class.unwrap();
            for file in std::fs::read_dir(class.path()).unwrap() {
                let file = file.unwrap().path();
                let rel = file.strip_prefix(root).unwrap();
                let name = class.file_name();
                text += &format!("{},{},{split}\n", rel.display(), name.to_str().unwrap());
            }
        }
    }
    let csv = root.join("birds.csv");
    std::fs::write(&csv, text).unwrap();
    csv
}

fn eval_line(run: &Path, data: &Path, cache: &Path) -> String {
    let out = ok(run_with(
        &[
            "eval",
            "--checkpoint",
            s(run),
            "--data",
            s(data),
            "--cache-dir",
            s(cache),
        ]
        .map(String::from),
        &[],
    ));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap()
        .split(" · ")
        .filter(|part| !part.ends_with("images/s"))
        .collect::<Vec<_>>()
        .join(" · ")
}

#[test]
fn a_csv_dataset_trains_resumes_and_evaluates_like_its_folders() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 3, 6);
    let csv = write_csv(&data);
    let cache = tmp.path().join("c");

    // Two epochs straight, and one epoch resumed for a second: the same weights.
    let straight = tmp.path().join("straight");
    ok(run_with(&train_args(&csv, &cache, &straight, 2), &[]));
    let resumed = tmp.path().join("resumed");
    ok(run_with(&train_args(&csv, &cache, &resumed, 1), &[]));
    let mut args = resume_args(&resumed, &csv);
    args.extend(["--epochs".to_string(), "2".to_string()]);
    let out = ok(run_with(&args, &[]));
    assert_eq!(weights(&straight), weights(&resumed), "{}", text(&out));

    // The checkpoint evaluates the same through the CSV and through the folders.
    assert_eq!(
        eval_line(&straight, &csv, &cache),
        eval_line(&straight, &data, &cache)
    );
}
