//! The best epoch and early stopping, through the real binary (CPU, resnet8 on 16-pixel
//! images): `RUN/best/` holds the checkpoint of the epoch with the best validation figures
//! and evaluates to them; `--early-stop E` ends a run whose validation accuracy has not
//! improved for E epochs, a resumed run keeps that decision unless told otherwise, and a run
//! resumed into another folder takes its best epoch along.

use crate::cli_support;

use std::path::Path;

use birdtrain::train::CheckpointMeta;
use cli_support::small_run::{dataset, ok, resume_args, run_with, train_args, weights};
use cli_support::{birdtrain, s};

/// The `loss` and `top-1` figures `birdtrain eval` prints for `run` on the validation split.
fn eval(run: &Path, data: &Path, cache: &Path) -> (f64, f64) {
    let out = birdtrain(&[
        "eval",
        "--checkpoint",
        s(run),
        "--data",
        s(data),
        "--workers",
        "1",
        "--cache-dir",
        s(cache),
    ]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let figure = |key: &str| -> f64 {
        let at = text.find(key).unwrap_or_else(|| panic!("{key} in {text}")) + key.len();
        text[at..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    (figure("loss "), figure("top-1 "))
}

fn stdout(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).to_string()
}

fn with(mut args: Vec<String>, extra: &[&str]) -> Vec<String> {
    args.extend(extra.iter().map(|a| a.to_string()));
    args
}

/// On this set (seed 3) validation accuracy is 1.0 after epoch 1, 0.75 after epoch 2 and
/// 1.0 again, with a lower loss, from epoch 3 on: epoch 1 is the best until epoch 3.
#[test]
fn early_stop_keeps_the_best_epoch_and_a_resume_honours_or_lifts_it() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 6);
    let cache = tmp.path().join("cache");
    let full = tmp.path().join("full");
    ok(run_with(&train_args(&data, &cache, &full, 6), &[]));

    let run = tmp.path().join("run");
    let out = ok(run_with(
        &with(train_args(&data, &cache, &run, 6), &["--early-stop", "1"]),
        &[],
    ));
    let printed = stdout(&out);
    assert!(
        printed.contains(
            "early stop after epoch 2: validation accuracy has not improved for 1 epoch;"
        ),
        "{printed}"
    );
    assert!(printed.contains("best/ (epoch 1)"), "{printed}");
    let meta = CheckpointMeta::load(&run).unwrap();
    assert_eq!((meta.epoch, meta.settings.early_stop), (2, 1));
    let best = CheckpointMeta::load(&run.join("best")).unwrap();
    let record = best.best.expect("best/ records its epoch");
    assert_eq!((best.epoch, record.epoch), (1, 1));
    assert_eq!(meta.best, Some(record));
    // best/ is a checkpoint of its own: it evaluates to the figures it records, and differs
    // from the run's last weights (epoch 2 was worse).
    let (loss, top1) = eval(&run.join("best"), &data, &cache);
    assert_eq!(top1, 1.0);
    assert!((loss - record.loss).abs() < 1e-4, "{loss} vs {record:?}");
    assert_eq!(eval(&run, &data, &cache).1, 0.75);
    assert!(weights(&run.join("best")) != weights(&run));

    // Resumed as it is, the run stops again without training.
    let out = ok(run_with(&resume_args(&run, &data), &[]));
    assert!(
        stdout(&out).contains("it had stopped there before"),
        "{}",
        stdout(&out)
    );
    assert_eq!(CheckpointMeta::load(&run).unwrap().step, meta.step);
    // With --early-stop 0 it goes on, into another folder, and ends where an uninterrupted
    // run ends; that folder's best/ moves on from the copied epoch 1 to the later best.
    let more = tmp.path().join("more");
    ok(run_with(
        &with(
            resume_args(&run, &data),
            &["--early-stop", "0", "--out", s(&more)],
        ),
        &[],
    ));
    assert!(weights(&more) == weights(&full));
    assert!(weights(&more.join("best")) == weights(&full.join("best")));
    assert_eq!(
        CheckpointMeta::load(&more.join("best")).unwrap().best,
        CheckpointMeta::load(&full.join("best")).unwrap().best
    );
}

/// `--monitor val_loss --min-delta D`: the best epoch is the one with the lowest loss, an
/// epoch counts as better only when its loss is lower by more than D, and early stopping
/// watches that. Valid losses on this set (seed 3): 0.652, 0.490, 0.318, 0.249, 0.199, 0.175;
/// with D = 0.06, epoch 5 (0.050 lower) is the first that does not count.
#[test]
fn early_stop_can_watch_the_validation_loss_with_a_least_improvement() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 6);
    let cache = tmp.path().join("cache");
    let run = tmp.path().join("run");
    let flags = [
        "--early-stop",
        "1",
        "--monitor",
        "val_loss",
        "--min-delta",
        "0.06",
    ];
    let out = ok(run_with(
        &with(train_args(&data, &cache, &run, 6), &flags),
        &[],
    ));
    let printed = stdout(&out);
    assert!(
        printed.contains(
            "early stop after epoch 5: validation loss has not improved by more than 0.06 for 1 epoch;"
        ),
        "{printed}"
    );
    assert!(printed.contains("lowest loss 0.2"), "{printed}");
    assert!(printed.contains("at epoch 4"), "{printed}");
    let meta = CheckpointMeta::load(&run).unwrap();
    assert_eq!(meta.epoch, 5);
    assert_eq!(meta.settings.monitor, birdtrain::train::Monitor::ValLoss);
    assert_eq!(meta.settings.min_delta, 0.06);
    let best = CheckpointMeta::load(&run.join("best")).unwrap();
    assert_eq!(best.epoch, 4);
    let (loss, _) = eval(&run.join("best"), &data, &cache);
    assert!((loss - best.best.unwrap().loss).abs() < 1e-4, "{loss}");
    // Resumed as it is, it keeps the rule and stops again.
    let out = ok(run_with(&resume_args(&run, &data), &[]));
    assert!(stdout(&out).contains("it had stopped there before"));
}

/// `--schedule plateau`: with the best epoch 1 (`--min-delta 0.01` makes the later ties of
/// accuracy 1.0 no improvement) and patience 2, the rate is halved after epochs 3 and 5; a
/// run stopped at the cut's epoch boundary or inside the next epoch resumes with the cut
/// rate and ends bit-identical to the uninterrupted run.
#[test]
fn a_plateau_schedule_cuts_the_rate_and_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 6);
    let cache = tmp.path().join("cache");
    let flags = [
        "--schedule",
        "plateau",
        "--plateau-patience",
        "2",
        "--plateau-factor",
        "0.5",
        "--min-delta",
        "0.01",
    ];
    let full = tmp.path().join("full");
    let out = ok(run_with(
        &with(train_args(&data, &cache, &full, 6), &flags),
        &[],
    ));
    let printed = stdout(&out);
    let cuts: Vec<&str> = printed.lines().filter(|l| l.contains("lr cut")).collect();
    assert_eq!(cuts.len(), 2, "{printed}");
    assert!(
        cuts[0].starts_with("epoch 3/6 · lr cut ×0.5 to 0.006250"),
        "{printed}"
    );
    assert!(
        cuts[1].starts_with("epoch 5/6 · lr cut ×0.5 to 0.003125"),
        "{printed}"
    );
    let meta = CheckpointMeta::load(&full).unwrap();
    assert_eq!(meta.data_position.lr_scale, 0.25);
    assert_eq!(
        (meta.settings.plateau_patience, meta.settings.plateau_factor),
        (2, 0.5)
    );
    // 3 steps per epoch: step 9 ends epoch 3 (just cut), step 10 is inside epoch 4.
    for stop in ["9", "10"] {
        let run = tmp.path().join(format!("stopped-{stop}"));
        ok(run_with(
            &with(
                train_args(&data, &cache, &run, 6),
                &[&flags[..], &["--stop-after-steps", stop]].concat(),
            ),
            &[],
        ));
        assert_eq!(
            CheckpointMeta::load(&run).unwrap().data_position.lr_scale,
            0.5
        );
        let out = ok(run_with(&resume_args(&run, &data), &[]));
        assert!(
            stdout(&out).contains("lr 0.006250 after the plateau cuts"),
            "{}",
            stdout(&out)
        );
        assert!(weights(&run) == weights(&full), "stopped at step {stop}");
    }
    // Two replicas: rank 0 decides each cut and hands it on (the ranks' weight checksums,
    // compared at every epoch end, would part otherwise).
    let two = tmp.path().join("two");
    let out = ok(run_with(
        &with(
            train_args(&data, &cache, &two, 6),
            &[&flags[..], &["--replicas", "2"]].concat(),
        ),
        &[],
    ));
    let cuts = stdout(&out).matches("lr cut").count();
    assert!(cuts > 0, "{}", stdout(&out));
    let scale = CheckpointMeta::load(&two).unwrap().data_position.lr_scale;
    assert_eq!(scale, 0.5f32.powi(cuts as i32));
}

/// `--plateau-cooldown` and `--plateau-min-lr`: with the best epoch 1 and patience 1, the
/// rate is halved after epoch 2, epoch 3 is the cooldown, the cut after epoch 4 stops at the
/// floor (0.3 of the rate, not 0.25), and none follows; a run stopped right after the first
/// cut resumes inside the cooldown (which the checkpoint records) and ends bit-identical.
#[test]
fn a_plateau_cooldown_and_floor_hold_across_a_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 6);
    let cache = tmp.path().join("cache");
    let flags = [
        "--schedule",
        "plateau",
        "--plateau-patience",
        "1",
        "--plateau-factor",
        "0.5",
        "--plateau-cooldown",
        "1",
        "--plateau-min-lr",
        "0.24",
        "--min-delta",
        "0.01",
    ];
    let full = tmp.path().join("full");
    let out = ok(run_with(
        &with(train_args(&data, &cache, &full, 6), &flags),
        &[],
    ));
    let printed = stdout(&out);
    let cuts: Vec<&str> = printed.lines().filter(|l| l.contains("lr cut")).collect();
    assert_eq!(cuts.len(), 2, "{printed}");
    assert!(
        cuts[0].starts_with("epoch 2/6 · lr cut ×0.5 to 0.006250")
            && cuts[0].contains("the next epoch is not counted"),
        "{printed}"
    );
    assert!(
        cuts[1].starts_with("epoch 4/6 · lr cut to its floor to 0.003750"),
        "{printed}"
    );
    let meta = CheckpointMeta::load(&full).unwrap();
    assert!((meta.data_position.lr_scale - 0.3).abs() < 1e-6);
    assert_eq!(meta.data_position.plateau_last_cut, Some(4));
    assert_eq!(
        (meta.settings.plateau_cooldown, meta.settings.plateau_min_lr),
        (1, 0.24)
    );
    // 3 steps per epoch: step 6 ends epoch 2, just cut; epoch 3 must stay uncounted.
    let run = tmp.path().join("stopped");
    ok(run_with(
        &with(
            train_args(&data, &cache, &run, 6),
            &[&flags[..], &["--stop-after-steps", "6"]].concat(),
        ),
        &[],
    ));
    assert_eq!(
        CheckpointMeta::load(&run)
            .unwrap()
            .data_position
            .plateau_last_cut,
        Some(2)
    );
    let out = ok(run_with(&resume_args(&run, &data), &[]));
    assert_eq!(
        stdout(&out).matches("lr cut").count(),
        1,
        "{}",
        stdout(&out)
    );
    assert!(weights(&run) == weights(&full), "the resumed run differs");
}

/// A run stopped after epoch 1 and resumed into another folder for one more (worse) epoch
/// keeps epoch 1 as its best: best/ came along with the checkpoint.
#[test]
fn a_run_resumed_into_another_folder_takes_its_best_epoch_along() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 6);
    let cache = tmp.path().join("cache");
    let whole = tmp.path().join("whole");
    ok(run_with(&train_args(&data, &cache, &whole, 2), &[]));
    let first = tmp.path().join("first");
    ok(run_with(
        &with(
            train_args(&data, &cache, &first, 2),
            &["--stop-after-steps", "3"],
        ),
        &[],
    ));
    assert_eq!(CheckpointMeta::load(&first).unwrap().epoch, 1);
    let second = tmp.path().join("second");
    ok(run_with(
        &with(resume_args(&first, &data), &["--out", s(&second)]),
        &[],
    ));
    let best = CheckpointMeta::load(&second.join("best")).unwrap();
    assert_eq!(best.epoch, 1);
    assert!(weights(&second.join("best")) == weights(&whole.join("best")));
    assert!(weights(&second) == weights(&whole));
    // A fresh run with --overwrite in that folder does not inherit the old best/.
    let mut fresh_args = with(train_args(&data, &cache, &second, 1), &["--overwrite"]);
    let seed = fresh_args.iter().position(|a| a == "--seed").unwrap() + 1;
    fresh_args[seed] = "4".into();
    ok(run_with(&fresh_args, &[]));
    let fresh = CheckpointMeta::load(&second.join("best")).unwrap();
    assert_eq!((fresh.epoch, fresh.seed), (1, 4));
}

/// Two CPU replicas: every rank learns rank 0's early-stop decision (no rank waits in a
/// collective the others never join), and periodic checkpoints average the batch-norm
/// statistics of both ranks mid-epoch and resume exactly.
#[test]
fn replicas_agree_on_early_stop_and_checkpoint_inside_epochs() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 8);
    let cache = tmp.path().join("cache");
    let two = |out: &Path, extra: &[&str]| {
        with(
            with(train_args(&data, &cache, out, 8), &["--replicas", "2"]),
            extra,
        )
    };
    let whole = tmp.path().join("whole");
    ok(run_with(&two(&whole, &["--save-every", "1"]), &[]));
    let stopped = tmp.path().join("stopped");
    ok(run_with(
        &two(&stopped, &["--save-every", "1", "--stop-after-steps", "5"]),
        &[],
    ));
    let pos = CheckpointMeta::load(&stopped).unwrap().data_position;
    assert_eq!((pos.epoch, pos.step_in_epoch), (2, 1), "{pos:?}");
    ok(run_with(&resume_args(&stopped, &data), &[]));
    assert!(weights(&stopped) == weights(&whole));

    // A plateau: with a vanishing learning rate and frozen batch norm the weights do not
    // move, so every epoch validates exactly like the first and none beats it.
    let early = tmp.path().join("early");
    let out = ok(run_with(
        &two(
            &early,
            &["--early-stop", "1", "--lr", "1e-30", "--freeze-bn"],
        ),
        &[],
    ));
    let meta = CheckpointMeta::load(&early).unwrap();
    let best = meta.best.expect("a best epoch");
    assert_eq!((meta.epoch, best.epoch), (2, 1), "{}", stdout(&out));
    assert!(
        stdout(&out).contains("early stop after epoch 2"),
        "{}",
        stdout(&out)
    );
    assert_eq!(
        CheckpointMeta::load(&early.join("best")).unwrap().best,
        Some(best)
    );
}
