//! `--model-ema` through the CLI: the moving average of the weights is validated after every
//! epoch (its own metrics line), stored beside the weights in every checkpoint and in
//! `best/`, served by `eval --ema` and `predict --ema` with the figures validation printed,
//! continued exactly by `--resume`, and bad values are one line naming the flag.
//! The update rule itself is unit-tested in `src/train/ema.rs`.

use crate::cli_support;
use cli_support::small_run::{
    average, dataset, ok, resume_args, run_with, text, train_args, weights,
};
use cli_support::{assert_one_line_error, s};

use birdtrain::train::CheckpointMeta;
use serde_json::Value;

/// The flags of the runs here: an update every 2 steps, with a weight big enough to move.
const EMA: [&str; 5] = [
    "--model-ema",
    "--model-ema-steps",
    "2",
    "--model-ema-decay",
    "0.95",
];

fn lines_of(run: &std::path::Path, split: &str) -> Vec<Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["split"] == split)
        .collect()
}

fn eval_json(run: &std::path::Path, data: &std::path::Path, ema: bool) -> Value {
    let mut args = vec![
        "eval",
        "--checkpoint",
        s(run),
        "--data",
        s(data),
        "--workers",
        "1",
        "--json",
    ];
    if ema {
        args.push("--ema");
    }
    let args: Vec<String> = args.into_iter().map(String::from).collect();
    let out = ok(run_with(&args, &[]));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn the_average_is_validated_stored_and_served_to_eval_and_predict() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 3, 8);
    let cache = tmp.path().join("c");
    let run = tmp.path().join("run");
    let mut args = train_args(&data, &cache, &run, 3);
    args.extend(EMA.iter().map(|a| a.to_string()));
    let out = ok(run_with(&args, &[]));
    let said = text(&out);
    // Global batch 4, 2 steps, 3 epochs: (1 − 0.95) · 4 · 2 / 3.
    assert!(
        said.contains("moving average of the weights: updated every 2 steps with weight 0.133333"),
        "{said}"
    );
    assert_eq!(
        said.matches("moving average · valid loss").count(),
        3,
        "{said}"
    );

    // The average watches training, it does not change it.
    let plain = tmp.path().join("plain");
    ok(run_with(&train_args(&data, &cache, &plain, 3), &[]));
    assert!(
        weights(&plain) == weights(&run),
        "--model-ema changed the weights training reached"
    );
    let figures = |run: &std::path::Path| -> Vec<(f64, f64)> {
        lines_of(run, "valid")
            .iter()
            .map(|v| (v["loss"].as_f64().unwrap(), v["accuracy"].as_f64().unwrap()))
            .collect()
    };
    assert_eq!(figures(&plain), figures(&run));

    let valid = lines_of(&run, "valid");
    let valid_ema = lines_of(&run, "valid_ema");
    assert_eq!(valid_ema.len(), 3, "a line per epoch");
    let meta = CheckpointMeta::load(&run).unwrap();
    let file = meta.model_ema_file.clone().unwrap();
    assert_ne!(
        std::fs::read(run.join(&file)).unwrap(),
        std::fs::read(run.join(&meta.model_file)).unwrap(),
        "the average is not the weights"
    );
    assert_eq!(
        std::fs::read(run.join("model_ema.safetensors")).unwrap(),
        std::fs::read(run.join(&file)).unwrap()
    );
    let best = CheckpointMeta::load(&run.join("best")).unwrap();
    assert!(
        best.model_ema_file.is_some(),
        "best/ keeps its epoch's average"
    );

    // eval reproduces what validation printed, for the weights and for their average.
    for (ema, line) in [
        (false, valid.last().unwrap()),
        (true, valid_ema.last().unwrap()),
    ] {
        let report = eval_json(&run, &data, ema);
        assert_eq!(report["ema"], ema);
        for key in ["loss", "accuracy", "top5"] {
            let (got, want) = (report[key].as_f64().unwrap(), line[key].as_f64().unwrap());
            assert!(
                (got - want).abs() < 1e-5,
                "{key}: eval {got}, training {want} (ema {ema})"
            );
        }
    }

    // predict: the average answers differently from the weights.
    let image = std::fs::read_dir(data.join("valid").join("class_00"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let predict = |ema: bool| {
        let mut a = vec!["predict", "--checkpoint", s(&run), "--json", s(&image)];
        if ema {
            a.push("--ema");
        }
        let a: Vec<String> = a.into_iter().map(String::from).collect();
        String::from_utf8(ok(run_with(&a, &[])).stdout).unwrap()
    };
    assert_ne!(predict(false), predict(true));
}

#[test]
fn the_best_epoch_can_follow_the_average() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 3, 8);
    let cache = tmp.path().join("c");
    let run = tmp.path().join("run");
    let mut args = train_args(&data, &cache, &run, 4);
    args.extend(EMA.iter().map(|a| a.to_string()));
    args.extend(["--monitor", "val_ema_loss", "--warmup-epochs", "0"].map(String::from));
    let out = ok(run_with(&args, &[]));
    let losses: Vec<f64> = lines_of(&run, "valid_ema")
        .iter()
        .map(|v| v["loss"].as_f64().unwrap())
        .collect();
    let lowest = (0..losses.len())
        .min_by(|&a, &b| losses[a].total_cmp(&losses[b]))
        .unwrap() as u64
        + 1;
    let best = CheckpointMeta::load(&run.join("best")).unwrap();
    assert_eq!(best.best.map(|b| b.epoch), Some(lowest), "{losses:?}");
    assert_eq!(best.epoch, lowest);
    let said = text(&out);
    assert!(
        said.contains(&format!(
            "lowest loss of the moving average {:.4} at epoch {lowest}",
            losses[lowest as usize - 1]
        )),
        "{said}"
    );
    // The weights' own figures would have picked by another rule: the record is the average's.
    let valid = lines_of(&run, "valid");
    let own = valid[lowest as usize - 1]["loss"].as_f64().unwrap();
    assert_eq!(best.best.unwrap().loss, losses[lowest as usize - 1]);
    assert_ne!(best.best.unwrap().loss, own);
}

#[test]
fn a_resume_that_changes_the_monitored_figure_starts_a_new_best() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 3, 8);
    let cache = tmp.path().join("c");
    let run = tmp.path().join("run");
    ok(run_with(&train_args(&data, &cache, &run, 1), &[]));
    assert_eq!(
        CheckpointMeta::load(&run).unwrap().best.map(|b| b.epoch),
        Some(1)
    );
    let mut resumed = resume_args(&run, &data);
    resumed.extend(EMA.iter().map(|a| a.to_string()));
    resumed.extend(["--epochs", "2", "--monitor", "val_ema_loss"].map(String::from));
    let out = ok(run_with(&resumed, &[]));
    let said = text(&out);
    assert!(
        said.contains("was picked by val_accuracy; with --monitor val_ema_loss the next epoch starts a new best"),
        "{said}"
    );
    // Epoch 2 is the first the average's loss judged, so it is the best: by that figure.
    let best = CheckpointMeta::load(&run.join("best")).unwrap();
    let ema_loss = lines_of(&run, "valid_ema")[0]["loss"].as_f64().unwrap();
    assert_eq!(best.best.map(|b| (b.epoch, b.loss)), Some((2, ema_loss)));
}

#[test]
fn a_resumed_run_averages_exactly_as_the_uninterrupted_one() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 3, 8);
    let cache = tmp.path().join("c");
    let with = |run: &std::path::Path, extra: &[&str]| {
        let mut args = train_args(&data, &cache, run, 2);
        args.extend(EMA.iter().chain(extra).map(|a| a.to_string()));
        args
    };
    let whole = tmp.path().join("whole");
    ok(run_with(&with(&whole, &[]), &[]));
    // 6 steps an epoch: stopped inside the first, then inside the second, then to the end.
    let parts = tmp.path().join("parts");
    ok(run_with(&with(&parts, &["--stop-after-steps", "3"]), &[]));
    let mut again = resume_args(&parts, &data);
    again.extend(["--stop-after-steps", "8"].map(String::from));
    ok(run_with(&again, &[]));
    assert_eq!(
        CheckpointMeta::load(&parts)
            .unwrap()
            .data_position
            .global_step,
        8
    );
    ok(run_with(&resume_args(&parts, &data), &[]));
    assert!(
        average(&whole) == average(&parts),
        "the resumed average differs"
    );
    assert_eq!(
        lines_of(&whole, "valid_ema")[1]["loss"],
        lines_of(&parts, "valid_ema")[1]["loss"]
    );

    // A run trained without one gets an average from its checkpoint's weights on.
    let plain = tmp.path().join("plain");
    let mut args = train_args(&data, &cache, &plain, 2);
    args.extend(["--stop-after-steps", "6"].map(String::from));
    ok(run_with(&args, &[]));
    assert_eq!(CheckpointMeta::load(&plain).unwrap().model_ema_file, None);
    let mut resumed = resume_args(&plain, &data);
    resumed.push("--model-ema".into());
    let out = ok(run_with(&resumed, &[]));
    assert!(
        text(&out).contains("the resumed checkpoint had none, so it starts from its weights"),
        "{}",
        text(&out)
    );
    assert_eq!(lines_of(&plain, "valid_ema").len(), 1, "the second epoch's");
    let meta = CheckpointMeta::load(&plain).unwrap();
    assert_eq!(
        meta.settings.model_ema.map(|r| (r.steps, r.decay)),
        Some((32, 0.99998))
    );
}

#[test]
fn bad_average_values_are_one_line_naming_the_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 2, 4);
    let cache = tmp.path().join("c");
    for (extra, flag) in [
        (
            vec!["--model-ema", "--model-ema-steps", "0"],
            "--model-ema-steps",
        ),
        (
            vec!["--model-ema", "--model-ema-decay", "1"],
            "--model-ema-decay",
        ),
        (
            vec!["--model-ema", "--model-ema-decay", "NaN"],
            "--model-ema-decay",
        ),
        (vec!["--model-ema-steps", "8"], "--model-ema"),
        (vec!["--model-ema-decay", "0.999"], "--model-ema"),
        (vec!["--monitor", "val_ema_accuracy"], "--model-ema"),
    ] {
        let run = tmp.path().join("run");
        let mut args = train_args(&data, &cache, &run, 1);
        args.extend(extra.iter().map(|a| a.to_string()));
        let out = run_with(&args, &[]);
        assert_one_line_error(&out, &[flag]);
        assert!(
            !run.join("checkpoint.json").exists(),
            "{extra:?} wrote a run"
        );
    }
    // eval --ema of a run that kept no average.
    let run = tmp.path().join("plain");
    ok(run_with(&train_args(&data, &cache, &run, 1), &[]));
    let args: Vec<String> = ["eval", "--checkpoint", s(&run), "--data", s(&data), "--ema"]
        .iter()
        .map(|a| a.to_string())
        .collect();
    assert_one_line_error(&run_with(&args, &[]), &["no moving average", "--model-ema"]);
}
