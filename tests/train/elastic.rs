//! Elastic resume (`--resume RUN` on another rank count, no `--batch-size`): the checkpoint's
//! global batch is kept, split over the new ranks with `--grad-accum-steps` where needed, so
//! the learning rate, the schedule and the data position go on unchanged; a rank count that
//! does not split it is refused with a hint.

use std::path::{Path, PathBuf};

use birdtrain::train::load_checkpoint_for_inference;

use crate::cli_support::small_run::{dataset, ok, resume_args, run_with, text, train_args};
use crate::cli_support::{assert_one_line_error, s};

/// As tests/train/grad_accum.rs: another summation order of the same images' gradients
/// differs by f32 roundings (measured there at 1.2e-7), two orders of magnitude below this.
const BOUND: f32 = 1e-5;

/// 4 classes × 16 = 64 training images: 2 steps an epoch at a global batch of 32 (the small
/// runs' flags with 8 images per replica, frozen batch norm, 2 epochs).
fn args(data: &Path, cache: &Path, out: &Path, replicas: usize) -> Vec<String> {
    let mut a = train_args(data, cache, out, 2);
    let at = a.iter().position(|f| f == "--batch-size").unwrap();
    a[at + 1] = "8".into();
    a.extend(["--replicas", &replicas.to_string(), "--freeze-bn"].map(String::from));
    a
}

/// `--resume RUN` with `--replicas R` and nothing else that changes the batch.
fn resume(run: &Path, data: &Path, replicas: usize) -> Vec<String> {
    let mut a = resume_args(run, data);
    a.extend(["--replicas".to_string(), replicas.to_string()]);
    a
}

fn weights(run: &Path) -> Vec<f32> {
    load_checkpoint_for_inference(run, 4)
        .unwrap()
        .net
        .params_f32()
        .unwrap()
}

/// The start line's learning rate: "… → 0.100000 scaled …".
fn scaled_lr(stdout: &str) -> String {
    let after = stdout
        .split(" → ")
        .nth(1)
        .unwrap_or_else(|| panic!("no scaled lr in {stdout}"));
    after.split(' ').next().unwrap().to_string()
}

struct Set {
    _tmp: tempfile::TempDir,
    data: PathBuf,
    cache: PathBuf,
    root: PathBuf,
}

fn set() -> Set {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 4, 16);
    let (cache, root) = (tmp.path().join("cache"), tmp.path().to_path_buf());
    Set {
        _tmp: tmp,
        data,
        cache,
        root,
    }
}

/// A 4-replica run of 8 stopped after its first epoch (2 steps).
fn stopped_after_one_epoch(set: &Set, name: &str) -> PathBuf {
    let out = set.root.join(name);
    let mut a = args(&set.data, &set.cache, &out, 4);
    a.extend(["--stop-after-steps".into(), "2".into()]);
    ok(run_with(&a, &[]));
    out
}

#[test]
fn four_replicas_resumed_on_two_keep_the_global_batch_and_end_as_the_uninterrupted_run() {
    let set = set();
    let straight = set.root.join("straight");
    let first = ok(run_with(&args(&set.data, &set.cache, &straight, 4), &[]));
    let first = String::from_utf8_lossy(&first.stdout).to_string();
    assert!(first.contains("global batch 32 (8 per rank)"), "{first}");

    let run = stopped_after_one_epoch(&set, "elastic");
    let resumed = ok(run_with(&resume(&run, &set.data, 2), &[]));
    let stdout = String::from_utf8_lossy(&resumed.stdout).to_string();
    assert!(
        stdout.contains("global batch 32 (8 per rank × 2 accumulated)"),
        "{}",
        text(&resumed)
    );
    assert!(
        stdout.contains("its global batch of 32 kept as 8 per rank × 2 accumulated"),
        "{stdout}"
    );
    assert_eq!(
        scaled_lr(&stdout),
        scaled_lr(&first),
        "the same learning rate"
    );
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(run.join("checkpoint.json")).unwrap()).unwrap();
    assert_eq!(
        (&meta["replicas"], &meta["global_batch"], &meta["step"]),
        (
            &serde_json::json!(2),
            &serde_json::json!(32),
            &serde_json::json!(4)
        ),
        "{meta}"
    );
    assert_eq!(meta["settings"]["grad_accum_steps"], 2, "{meta}");
    let (a, b) = (weights(&straight), weights(&run));
    let d = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    println!("4 replicas straight against 4 then 2 × 2 accumulated: largest difference {d:.3e}");
    assert!(
        d < BOUND,
        "the elastic run ends {d} from the uninterrupted one"
    );
}

#[test]
fn more_ranks_take_smaller_batches_and_a_rank_count_that_does_not_divide_is_refused() {
    let set = set();
    let run = stopped_after_one_epoch(&set, "run");
    // 8 ranks: 4 each, nothing accumulated.
    let more = set.root.join("more");
    let mut a = resume(&run, &set.data, 8);
    a.extend(["--out".into(), s(&more).into()]);
    let out = ok(run_with(&a, &[]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("global batch 32 (4 per rank)"), "{stdout}");
    // 3 ranks: 32 does not split; one line naming the flag, with the counts that would.
    let refused = run_with(&resume(&run, &set.data, 3), &[]);
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused));
    assert_one_line_error(&refused, &["--replicas", "3", "1, 2, 4, 8, 16, 32"]);
    // Given explicitly, --batch-size wins (with the resume's warnings), as before.
    let chosen = set.root.join("chosen");
    let mut c = resume(&run, &set.data, 3);
    c.extend(["--batch-size", "4", "--out", s(&chosen)].map(String::from));
    let out = ok(run_with(&c, &[]));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("global batch 12 (4 per rank)"),
        "{}",
        text(&out)
    );
}
