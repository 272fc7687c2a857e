//! `birdtrain eval` and `birdtrain predict` for scripts and whole folders: eval's `--json`,
//! `--predictions` and `--confusion` agree with each other and with its table, and
//! `predict` over folders (`--json`, `--batch-size`, `--on-bad-image`) gives the answers eval
//! gave for the same files.

use std::path::{Path, PathBuf};
use std::process::Output;

use crate::cli_support;
use cli_support::small_run::{dataset, ok, run_with, text, train_args};
use cli_support::{assert_one_line_error, birdtrain_output, s};

fn json_lines(out: &Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// A trained run on 3 classes (2 validation images each).
fn trained(tmp: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let data = dataset(&tmp.join("d"), 3, 6);
    let cache = tmp.join("c");
    let run = tmp.join("run");
    ok(run_with(&train_args(&data, &cache, &run, 2), &[]));
    (data, cache, run)
}

#[test]
fn eval_outputs_agree_and_predict_gives_evals_answers() {
    let tmp = tempfile::tempdir().unwrap();
    let (data, cache, run) = trained(tmp.path());
    let predictions = tmp.path().join("p.jsonl");
    let confusion = tmp.path().join("cm.csv");
    let eval = ok(birdtrain_output(&[
        "eval",
        "--checkpoint",
        s(&run),
        "--data",
        s(&data),
        "--cache-dir",
        s(&cache),
        "--batch-size",
        "4",
        "--json",
        "--predictions",
        s(&predictions),
        "--confusion",
        s(&confusion),
    ]));
    let summary = &json_lines(&eval)[0];
    // The files are renamed into place whole: no temporary file is left, and they are as
    // readable as a plain write makes them.
    let leftovers: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    use std::os::unix::fs::PermissionsExt;
    let plain = tmp.path().join("plain");
    std::fs::write(&plain, b"x").unwrap();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(
        mode(&confusion),
        mode(&plain),
        "the mode a plain write gives"
    );
    assert_eq!(mode(&predictions), mode(&plain));
    assert_eq!(summary["images"], 6, "{summary}");
    let per_image: Vec<serde_json::Value> = std::fs::read_to_string(&predictions)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(per_image.len(), 6);
    let correct = per_image.iter().filter(|p| p["correct"] == true).count();
    let accuracy = summary["accuracy"].as_f64().unwrap();
    assert!((accuracy - correct as f64 / 6.0).abs() < 1e-9, "{summary}");
    for p in &per_image {
        assert_eq!(p["correct"], p["label"] == p["predicted"], "{p}");
        let path = PathBuf::from(p["path"].as_str().unwrap());
        let class = path.parent().unwrap().file_name().unwrap();
        assert_eq!(p["label"].as_str().unwrap(), class.to_str().unwrap(), "{p}");
    }

    // The confusion matrix: a row per true class; its diagonal is per_class accuracy.
    let mut rows = csv::Reader::from_path(&confusion).unwrap();
    let header: Vec<String> = rows.headers().unwrap().iter().map(String::from).collect();
    assert_eq!(header[1..], ["class_00", "class_01", "class_02"]);
    let mut total = 0;
    for (i, row) in rows.records().enumerate() {
        let row = row.unwrap();
        let counts: Vec<u64> = row.iter().skip(1).map(|c| c.parse().unwrap()).collect();
        let images: u64 = counts.iter().sum();
        let class = &summary["per_class"][i];
        assert_eq!(class["class"].as_str(), row.get(0), "{summary}");
        assert_eq!(class["images"], images, "{summary}");
        let acc = class["accuracy"].as_f64().unwrap();
        assert!(
            (acc - counts[i] as f64 / images as f64).abs() < 1e-9,
            "{summary}"
        );
        total += images;
    }
    assert_eq!(total, 6);

    // predict over the valid folder: one answer per file, in sorted order, each the class
    // and probability eval gave the same file. With batches of 4 as in eval, the same
    // arithmetic: equal bits. With batches of 5, equal up to summation order.
    for (batch, tol) in [("4", 0.0), ("5", 1e-5)] {
        let out = ok(birdtrain_output(&[
            "predict",
            "--checkpoint",
            s(&run),
            "--json",
            "--top-k",
            "3",
            "--batch-size",
            batch,
            s(&data.join("valid")),
        ]));
        let answers = json_lines(&out);
        assert_eq!(answers.len(), 6, "{}", text(&out));
        for (answer, expected) in answers.iter().zip(&per_image) {
            assert_eq!(answer["path"], expected["path"]);
            let top = answer["top"].as_array().unwrap();
            assert_eq!(top.len(), 3);
            assert_eq!(top[0]["class"], expected["predicted"], "{answer}");
            let (p, q) = (
                top[0]["probability"].as_f64().unwrap(),
                expected["probability"].as_f64().unwrap(),
            );
            assert!((p - q).abs() <= tol, "batch {batch}: {p} vs {q}");
            let sum: f64 = top.iter().map(|c| c["probability"].as_f64().unwrap()).sum();
            assert!(
                (sum - 1.0).abs() < 1e-4,
                "all classes' probabilities sum to 1: {sum}"
            );
        }
    }
}

/// Class → probability for each image of a `predict --json` answer, in order.
fn probabilities(out: &Output) -> Vec<(String, std::collections::HashMap<String, f64>)> {
    json_lines(out)
        .iter()
        .map(|a| {
            let path = a["path"].as_str().unwrap().to_string();
            let top = a["top"].as_array().unwrap();
            let by_class = top
                .iter()
                .map(|c| {
                    let class = c["class"].as_str().unwrap().to_string();
                    (class, c["probability"].as_f64().unwrap())
                })
                .collect();
            (path, by_class)
        })
        .collect()
}

/// `--tta`: each image's probabilities are the mean of the image's and of its mirror
/// image's (checked against predicting on mirrored copies of the files, tolerance 1e-5 for
/// f32 sums), and eval's figures with `--tta` are those of these answers.
#[test]
fn tta_averages_each_image_with_its_mirror_image() {
    let tmp = tempfile::tempdir().unwrap();
    let (data, cache, run) = trained(tmp.path());
    let valid = data.join("valid");
    let mirrored = tmp.path().join("mirrored");
    let mut files = Vec::new();
    for class in std::fs::read_dir(&valid).unwrap() {
        for f in std::fs::read_dir(class.unwrap().path()).unwrap() {
            files.push(f.unwrap().path());
        }
    }
    files.sort();
    for f in &files {
        let to = mirrored.join(f.strip_prefix(&valid).unwrap());
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        image::open(f).unwrap().fliph().save(&to).unwrap();
    }
    let predict = |dir: &Path, tta: bool| {
        let mut args = vec!["predict", "--checkpoint", s(&run), "--json", "--top-k", "3"];
        if tta {
            args.push("--tta");
        }
        args.push(s(dir));
        probabilities(&ok(birdtrain_output(&args)))
    };
    let plain = predict(&valid, false);
    let flipped = predict(&mirrored, false);
    let both = predict(&valid, true);
    assert_eq!(both.len(), files.len());
    let mut differs = false;
    for ((a, b), m) in plain.iter().zip(&flipped).zip(&both) {
        assert_eq!(a.0, m.0);
        for (class, p) in &m.1 {
            let want = 0.5 * (a.1[class] + b.1[class]);
            assert!((p - want).abs() < 1e-5, "{}: {class} {p} vs {want}", m.0);
            differs |= (p - a.1[class]).abs() > 1e-6;
        }
    }
    assert!(differs, "mirroring changed some answer");

    let eval = ok(birdtrain_output(&[
        "eval",
        "--checkpoint",
        s(&run),
        "--data",
        s(&data),
        "--cache-dir",
        s(&cache),
        "--json",
        "--tta",
    ]));
    let summary = &json_lines(&eval)[0];
    assert_eq!(summary["tta"], true, "{summary}");
    let correct = both
        .iter()
        .filter(|(path, by_class)| {
            let class = Path::new(path).parent().unwrap().file_name().unwrap();
            let best = by_class.iter().max_by(|x, y| x.1.total_cmp(y.1)).unwrap().0;
            best == class.to_str().unwrap()
        })
        .count();
    let accuracy = summary["accuracy"].as_f64().unwrap();
    assert!(
        (accuracy - correct as f64 / files.len() as f64).abs() < 1e-9,
        "{summary}"
    );
    let text_out = ok(birdtrain_output(&[
        "eval",
        "--checkpoint",
        s(&run),
        "--data",
        s(&data),
        "--cache-dir",
        s(&cache),
        "--tta",
    ]));
    assert!(
        String::from_utf8_lossy(&text_out.stdout).contains("with mirror TTA"),
        "{}",
        text(&text_out)
    );
}

/// The last line of a run's `metrics.jsonl`.
fn last_metrics(run: &Path) -> serde_json::Value {
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    serde_json::from_str(metrics.lines().last().unwrap()).unwrap()
}

/// `eval --json` of `run` on `data` with `extra` flags: its summary object.
fn eval_json(run: &Path, data: &Path, cache: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "eval",
        "--checkpoint",
        s(run),
        "--data",
        s(data),
        "--cache-dir",
        s(cache),
        "--json",
    ];
    args.extend_from_slice(extra);
    json_lines(&ok(birdtrain_output(&args)))[0].clone()
}

/// `eval` of `run` on `data` as a table (its output).
fn eval_text(run: &Path, data: &Path, cache: &Path) -> Output {
    ok(birdtrain_output(&[
        "eval",
        "--checkpoint",
        s(run),
        "--data",
        s(data),
        "--cache-dir",
        s(cache),
    ]))
}

/// `--crop-pct`: a run trained with it validates on the centred crop, and `eval` and
/// `predict` of its checkpoint take the crop from the checkpoint (the same figures as the
/// run's last validation line), unless told another share.
#[test]
fn the_checkpoints_centre_crop_serves_validation_eval_and_predict() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 3, 6);
    let cache = tmp.path().join("c");
    let run = tmp.path().join("run");
    let mut args = train_args(&data, &cache, &run, 2);
    args.extend(["--crop-pct".to_string(), "0.75".to_string()]);
    ok(run_with(&args, &[]));
    let last = last_metrics(&run);
    assert_eq!(last["split"], "valid");
    let eval = |extra: &[&str]| eval_json(&run, &data, &cache, extra);
    let as_trained = eval(&[]);
    assert_eq!(as_trained["crop_pct"], 0.75, "{as_trained}");
    let loss = as_trained["loss"].as_f64().unwrap();
    let valid_loss = last["loss"].as_f64().unwrap();
    assert!(
        (loss - valid_loss).abs() < 1e-5,
        "eval {loss} vs validation {valid_loss}"
    );
    let whole = eval(&["--crop-pct", "1"]);
    assert_eq!(whole["crop_pct"], 1.0);
    assert!(
        (whole["loss"].as_f64().unwrap() - loss).abs() > 1e-4,
        "the crop changed nothing: {whole} vs {as_trained}"
    );
    let valid = data.join("valid");
    let predict = |extra: &[&str]| {
        let mut args = vec!["predict", "--checkpoint", s(&run), "--json", "--top-k", "3"];
        args.extend_from_slice(extra);
        args.push(s(&valid));
        probabilities(&ok(birdtrain_output(&args)))
    };
    let default = predict(&[]);
    assert_eq!(default, predict(&["--crop-pct", "0.75"]));
    assert_ne!(default, predict(&["--crop-pct", "1"]));
    let text_out = eval_text(&run, &data, &cache);
    assert!(
        text(&text_out).contains("(centre crop 0.75)"),
        "{}",
        text(&text_out)
    );
}

/// `--store-size`: a run that caches larger squares than it trains on validates on crops of
/// them, records the store in its checkpoint, and `eval` and `predict` cut their images from
/// the same store (eval's loss is the run's last validation loss; predict's top answer has
/// eval's probability, image by image). The run's colour jitter and augmentation policy stay
/// out of validation.
#[test]
fn the_checkpoints_store_size_serves_validation_eval_and_predict() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 3, 6);
    let cache = tmp.path().join("c");
    let run = tmp.path().join("run");
    let mut args = train_args(&data, &cache, &run, 2);
    // The centred 0.8 of a 20-pixel store is the 16-pixel image itself, at scale 1.
    // The colour jitter and the policy are for training images only: validation, and so
    // eval, see neither.
    for flag in [
        "--store-size",
        "20",
        "--crop-pct",
        "0.8",
        "--color-jitter",
        "0.4",
        "--auto-augment",
        "ta_wide",
    ] {
        args.push(flag.to_string());
    }
    let trained = ok(run_with(&args, &[]));
    assert!(
        text(&trained).contains("caches 20×20 squares"),
        "{}",
        text(&trained)
    );
    let sidecar: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("checkpoint.json")).unwrap())
            .unwrap();
    assert_eq!(sidecar["settings"]["store_size"], 20, "{sidecar}");
    let caches: Vec<String> = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".bcache"))
        .collect();
    assert!(
        !caches.is_empty() && caches.iter().all(|n| n.contains("-20-")),
        "{caches:?}"
    );
    eval_and_predict_agree_with_validation(&run, &data, &cache);
}

/// `--resize-mode center-crop`: wide images keep their aspect ratio (the centred square is
/// stored, not the stretched image); the mode is recorded in the checkpoint, `eval` and
/// `predict` store the images the same way, and a resume asking for the other mode is
/// refused in one line naming the flag.
#[test]
fn the_checkpoints_resize_mode_serves_validation_eval_and_predict() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d");
    pipeline::synth::write_dataset(&pipeline::synth::SynthConfig {
        out: data.clone(),
        classes: 3,
        train_per_class: 6,
        valid_per_class: 2,
        test_per_class: 0,
        width: 40,
        height: 16,
        format: pipeline::synth::ImageFormatKind::Png,
        seed: 4,
    })
    .unwrap();
    let cache = tmp.path().join("c");
    let run = tmp.path().join("run");
    let mut args = train_args(&data, &cache, &run, 2);
    args.extend(["--resize-mode".to_string(), "center-crop".to_string()]);
    let trained = ok(run_with(&args, &[]));
    assert!(
        text(&trained).contains("keeps its aspect ratio"),
        "{}",
        text(&trained)
    );
    let sidecar: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("checkpoint.json")).unwrap())
            .unwrap();
    assert_eq!(
        sidecar["settings"]["resize_mode"], "center-crop",
        "{sidecar}"
    );
    eval_and_predict_agree_with_validation(&run, &data, &cache);

    let mut resume = vec!["--resume".to_string(), s(&run).to_string()];
    resume.extend(["--data", s(&data), "--epochs", "3", "--quiet"].map(String::from));
    resume.extend(["--resize-mode".to_string(), "direct".to_string()]);
    assert_one_line_error(
        &run_with(&resume, &[]),
        &["resize mode", "--resize-mode", "center-crop"],
    );
}

/// Eval's loss of the validation split is the run's last validation loss, and predict's top
/// answer for each validation file has eval's probability: both saw the images validation
/// saw.
fn eval_and_predict_agree_with_validation(run: &Path, data: &Path, cache: &Path) {
    let last = last_metrics(run);
    let predictions = run.with_file_name("p.jsonl");
    let summary = &eval_json(run, data, cache, &["--predictions", s(&predictions)]);
    let (loss, valid_loss) = (
        summary["loss"].as_f64().unwrap(),
        last["loss"].as_f64().unwrap(),
    );
    assert!(
        (loss - valid_loss).abs() < 1e-5,
        "eval {loss} vs validation {valid_loss}"
    );
    let evals: std::collections::HashMap<String, f64> = std::fs::read_to_string(&predictions)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["path"].as_str().unwrap().to_string(),
                v["probability"].as_f64().unwrap(),
            )
        })
        .collect();
    let valid = data.join("valid");
    let predicted = probabilities(&ok(birdtrain_output(&[
        "predict",
        "--checkpoint",
        s(run),
        "--json",
        "--top-k",
        "1",
        s(&valid),
    ])));
    assert_eq!(predicted.len(), evals.len());
    for (path, top) in predicted {
        let p = top.values().next().copied().unwrap();
        let key = evals
            .keys()
            .find(|k| Path::new(&path).ends_with(k) || Path::new(k.as_str()).ends_with(&path))
            .unwrap_or_else(|| panic!("{path} not in eval's predictions {evals:?}"));
        assert!(
            (p - evals[key]).abs() < 1e-5,
            "{path}: predict {p} vs eval {}",
            evals[key]
        );
    }
}

#[test]
fn predict_skips_or_fails_on_bad_files_as_asked() {
    let tmp = tempfile::tempdir().unwrap();
    let (data, _cache, run) = trained(tmp.path());
    let photos = tmp.path().join("photos");
    let nested = photos.join("day2");
    std::fs::create_dir_all(&nested).unwrap();
    let valid = data.join("valid/class_01");
    let image = std::fs::read_dir(&valid)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    std::fs::copy(&image, photos.join("a.png")).unwrap();
    std::fs::copy(&image, nested.join("c.png")).unwrap();
    std::fs::write(photos.join("b.png"), b"a shopping list, not a picture").unwrap();
    std::fs::write(photos.join(".thumbs"), b"hidden: never read").unwrap();

    let predict = |extra: &[&str]| {
        let mut args = vec!["predict", "--checkpoint", s(&run), "--json"];
        args.extend_from_slice(extra);
        birdtrain_output(&args)
    };
    // The default: the first bad file stops it, named, with the way out.
    let out = predict(&[s(&photos)]);
    assert_one_line_error(&out, &["b.png", "not an image", "--on-bad-image skip"]);
    assert!(out.stdout.is_empty(), "{}", text(&out));

    // skip: every file has its line, in the walk's name order (a.png, b.png, day2/c.png); the bad one
    // says why; the image named twice is answered twice, identically.
    let out = ok(predict(&[
        "--on-bad-image",
        "skip",
        s(&photos),
        s(&image),
        s(&image),
    ]));
    let lines = json_lines(&out);
    let paths: Vec<&str> = lines.iter().map(|l| l["path"].as_str().unwrap()).collect();
    let expect = [
        photos.join("a.png"),
        photos.join("b.png"),
        nested.join("c.png"),
        image.clone(),
        image.clone(),
    ];
    assert_eq!(
        paths,
        expect.iter().map(|p| s(p)).collect::<Vec<_>>(),
        "{}",
        text(&out)
    );
    assert!(
        lines[1]["error"].as_str().unwrap().contains("not an image"),
        "{}",
        lines[1]
    );
    assert!(lines[1].get("top").is_none());
    assert_eq!(
        lines[0]["top"], lines[2]["top"],
        "the same pixels, the same answer"
    );
    assert_eq!(lines[3]["top"], lines[4]["top"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("1 of 5 files skipped"), "{stderr}");

    // Each file is read once: nothing is written, neither a pixel cache nor a scratch copy.
    let xdg = tmp.path().join("xdg-cache");
    let scratch = tmp.path().join("tmpdir");
    std::fs::create_dir_all(&scratch).unwrap();
    let args: Vec<String> = [
        "predict",
        "--checkpoint",
        s(&run),
        s(&photos),
        "--on-bad-image",
        "skip",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    ok(run_with(
        &args,
        &[("XDG_CACHE_HOME", s(&xdg)), ("TMPDIR", s(&scratch))],
    ));
    assert!(!xdg.exists(), "no pixel cache in the user's cache folder");
    assert_eq!(
        std::fs::read_dir(&scratch).unwrap().count(),
        0,
        "no scratch files"
    );

    // Only bad files: nothing to classify is an error, naming the first.
    let out = predict(&["--on-bad-image", "skip", s(&photos.join("b.png"))]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("b.png"),
        "{}",
        text(&out)
    );

    // A broken link in a folder is a bad file like any other: skip reports it and classifies
    // the rest, fail stops naming it.
    let links = tmp.path().join("slinks");
    std::fs::create_dir(&links).unwrap();
    std::fs::copy(&image, links.join("a.png")).unwrap();
    std::os::unix::fs::symlink(tmp.path().join("gone.png"), links.join("broken.png")).unwrap();
    std::fs::copy(&image, links.join("c.png")).unwrap();
    let out = ok(predict(&["--on-bad-image", "skip", s(&links)]));
    let lines = json_lines(&out);
    let paths: Vec<&str> = lines.iter().map(|l| l["path"].as_str().unwrap()).collect();
    let broken = links.join("broken.png");
    assert_eq!(
        paths,
        [s(&links.join("a.png")), s(&broken), s(&links.join("c.png"))],
        "{}",
        text(&out)
    );
    assert!(lines[1]["error"].is_string() && lines[1].get("top").is_none());
    assert!(lines[0]["top"].is_array() && lines[2]["top"].is_array());
    let out = predict(&[s(&links)]);
    assert_one_line_error(&out, &["broken.png"]);
    assert!(out.stdout.is_empty(), "{}", text(&out));
    // Named on the command line it is the same bad file, not a mistyped path.
    let out = ok(predict(&[
        "--on-bad-image",
        "skip",
        s(&broken),
        s(&links.join("a.png")),
    ]));
    let lines = json_lines(&out);
    assert_eq!(lines[0]["path"], s(&broken), "{}", text(&out));
    assert!(
        lines[0]["error"].is_string() && lines[1]["top"].is_array(),
        "{}",
        text(&out)
    );
    let out = predict(&[s(&tmp.path().join("typo.png"))]);
    assert_one_line_error(&out, &["typo.png", "does not exist"]);
}

#[test]
fn inference_flags_that_cannot_work_are_one_line_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let (data, _cache, run) = trained(tmp.path());
    let image = data
        .join("valid/class_00")
        .read_dir()
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let predict = |extra: &[&str]| {
        let mut args = vec!["predict", "--checkpoint", s(&run)];
        args.extend_from_slice(extra);
        birdtrain_output(&args)
    };
    assert_one_line_error(
        &predict(&["--on-bad-image", "maybe", s(&image)]),
        &["--on-bad-image", "maybe"],
    );
    assert_one_line_error(
        &predict(&["--batch-size", "0", s(&image)]),
        &["--batch-size"],
    );
    assert_one_line_error(
        &predict(&["--crop-pct", "1.5", s(&image)]),
        &["--crop-pct", "(0, 1]"],
    );
    let empty = tmp.path().join("nothing-here");
    std::fs::create_dir(&empty).unwrap();
    assert_one_line_error(&predict(&[s(&empty)]), &["nothing-here", "no files"]);
    assert_one_line_error(
        &predict(&[s(&tmp.path().join("gone.png"))]),
        &["gone.png", "does not exist"],
    );

    let eval = |extra: &[&str]| {
        let mut args = vec!["eval", "--checkpoint", s(&run), "--data", s(&data)];
        args.extend_from_slice(extra);
        birdtrain_output(&args)
    };
    let missing = tmp.path().join("no-folder/cm.csv");
    assert_one_line_error(
        &eval(&["--confusion", s(&missing)]),
        &["no-folder", "--confusion"],
    );
    assert_one_line_error(
        &eval(&["--predictions", s(tmp.path())]),
        &["is a folder", "--predictions"],
    );
    assert_one_line_error(&eval(&["--crop-pct", "0"]), &["--crop-pct", "(0, 1]"]);
    assert!(!missing.parent().unwrap().exists());
    // Two outputs naming one file: refused before the work, nothing written.
    let same = tmp.path().join("same.txt");
    let dotted = tmp.path().join(".").join("same.txt");
    assert_one_line_error(
        &eval(&["--predictions", s(&same), "--confusion", s(&dotted)]),
        &["--confusion", "--predictions", "same file"],
    );
    assert!(!same.exists(), "a refused eval wrote {}", same.display());
    // Class folders without train/ (the flat layout), and this run knows no validation share.
    assert_one_line_error(
        &birdtrain_output(&[
            "eval",
            "--checkpoint",
            s(&run),
            "--data",
            s(&data.join("train")),
        ]),
        &["train", "does not exist", "--valid-fraction"],
    );
}

/// A run trained on the flat layout: eval splits the folder with the checkpoint's share and
/// seed (training's validation images), and says so when told other ones.
#[test]
fn eval_of_a_flat_run_uses_the_checkpoints_split() {
    let tmp = tempfile::tempdir().unwrap();
    let flat = dataset(&tmp.path().join("d"), 3, 8).join("train");
    let cache = tmp.path().join("c");
    let run = tmp.path().join("run");
    let mut args = train_args(&flat, &cache, &run, 1);
    args.extend(["--valid-fraction", "0.25"].map(String::from));
    ok(run_with(&args, &[]));
    let eval = |extra: &[&str]| {
        let mut args = vec![
            "eval",
            "--checkpoint",
            s(&run),
            "--data",
            s(&flat),
            "--cache-dir",
            s(&cache),
            "--json",
        ];
        args.extend_from_slice(extra);
        ok(birdtrain_output(&args))
    };
    let stderr = |out: &Output| String::from_utf8_lossy(&out.stderr).into_owned();
    let default = eval(&[]);
    assert!(!stderr(&default).contains("warning"), "{}", text(&default));
    let same = eval(&["--valid-fraction", "0.25", "--seed", "3"]);
    assert!(!stderr(&same).contains("warning"), "{}", text(&same));
    let (default, same) = (&json_lines(&default)[0], &json_lines(&same)[0]);
    for key in ["images", "loss", "per_class"] {
        assert_eq!(default[key], same[key], "{key}");
    }
    // The images training validated on: its last validation line's figures.
    let last = last_metrics(&run);
    assert_eq!(last["split"], "valid", "{last}");
    assert!(
        (default["loss"].as_f64().unwrap() - last["loss"].as_f64().unwrap()).abs() < 1e-5,
        "eval {default} vs validation {last}"
    );
    for (flag, value) in [("--valid-fraction", "0.5"), ("--seed", "4")] {
        let other = eval(&[flag, value]);
        let warned = stderr(&other);
        assert_eq!(warned.lines().count(), 1, "{warned}");
        assert!(
            warned.starts_with("warning: ")
                && warned.contains(&format!("{flag} {value}"))
                && warned.contains("training images"),
            "{warned}"
        );
    }
}

/// With label smoothing the validation lines report the smoothed loss (the training
/// criterion, as Keras and torchvision's reference script validate); `eval` of the same
/// weights reports the same figure and says which smoothing it used.
#[test]
fn eval_reports_the_loss_the_run_validated_with() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("d"), 3, 6);
    let cache = tmp.path().join("c");
    let run = tmp.path().join("run");
    let mut args = train_args(&data, &cache, &run, 1);
    args.extend(["--label-smoothing", "0.3"].map(String::from));
    ok(run_with(&args, &[]));
    let report = &eval_json(&run, &data, &cache, &[]);
    // As given, not the f32 widened (0.30000001192092896).
    assert_eq!(report["label_smoothing"].as_f64(), Some(0.3));
    let last = last_metrics(&run);
    assert_eq!(last["split"], "valid", "{last}");
    assert!(
        (report["loss"].as_f64().unwrap() - last["loss"].as_f64().unwrap()).abs() < 1e-5,
        "eval {report} vs validation {last}"
    );
    let text = eval_text(&run, &data, &cache);
    assert!(
        String::from_utf8_lossy(&text.stdout).contains("(label smoothing 0.3)"),
        "{}",
        String::from_utf8_lossy(&text.stdout)
    );
}

#[test]
fn predict_hands_out_each_answer_while_the_list_is_still_being_read() {
    use birdtrain::train::{load_weights_for_inference, predict_each, PredictOptions, Weights};
    let tmp = tempfile::tempdir().unwrap();
    let (data, _, run) = trained(tmp.path());
    // 160 distinct copies of one image, classified one at a time with one decode worker.
    let image = std::fs::read_dir(data.join("valid").join("class_00"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let list = tmp.path().join("list");
    std::fs::create_dir(&list).unwrap();
    let images: Vec<PathBuf> = (0..160)
        .map(|i| {
            let p = list.join(format!("{i:03}.png"));
            std::fs::copy(&image, &p).unwrap();
            p
        })
        .collect();
    let mut model = load_weights_for_inference(&run, 1, Weights::Trained).unwrap();
    let opts = PredictOptions {
        top_k: 1,
        workers: Some(1),
        on_bad_image: pipeline::OnBadImage::Skip,
        views: Default::default(),
        crop_pct: 1.0,
    };
    // At the first answer the last 40 files are removed: the engine reads a few batches
    // ahead, not 120 images, so an answer handed out as soon as it is known leaves those
    // files unread; answers collected until the end would all have been read already.
    let mut answers = Vec::new();
    let outcome = predict_each(&mut model, &images, &opts, |p| {
        if answers.is_empty() {
            for f in &images[120..] {
                std::fs::remove_file(f).unwrap();
            }
        }
        answers.push(p);
    });
    assert!(answers[0].top.is_ok(), "{:?}", answers[0]);
    assert!(answers.len() >= 100, "{} answers", answers.len());
    let read_after_removal = match outcome {
        // The removed files are reported as skipped, in the order given.
        Ok(()) => {
            assert_eq!(answers.len(), 160);
            answers[120..].iter().filter(|p| p.top.is_ok()).count()
        }
        // Or their absence stops the list (a file gone from under the engine).
        Err(_) => answers.iter().skip(120).filter(|p| p.top.is_ok()).count(),
    };
    assert_eq!(
        read_after_removal, 0,
        "removed files were classified: read before the first answer"
    );
    for (p, path) in answers.iter().zip(&images) {
        assert_eq!(&p.path, path, "answers in the order given");
    }
}

/// `eval --valid-fraction` on a train/valid/test folder is refused (it read the folder as a
/// flat one, its split folders as classes); a test set alone, a folder without `train/` or a
/// CSV of test rows, is evaluated with the checkpoint's classes, as the whole dataset is.
#[test]
fn eval_takes_the_layout_as_it_is_and_a_test_set_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let (data, cache, run) = trained(tmp.path());
    let out = birdtrain_output(&[
        "eval",
        "--checkpoint",
        s(&run),
        "--data",
        s(&data),
        "--valid-fraction",
        "0.2",
    ]);
    assert_one_line_error(&out, &["--valid-fraction", "train/ folder", "flat"]);
    // The validation images as a test set of their own: the same figures.
    let whole = eval_json(&run, &data, &cache, &[]);
    let alone = tmp.path().join("alone");
    std::fs::create_dir(&alone).unwrap();
    std::os::unix::fs::symlink(data.join("valid"), alone.join("test")).unwrap();
    let folder = eval_json(&run, &alone, &cache, &["--split", "test"]);
    assert_eq!(folder["images"], whole["images"], "{folder}");
    assert_eq!(folder["accuracy"], whole["accuracy"], "{folder}");
    let mut rows = String::from("path,label,split\n");
    for class in ["class_00", "class_01", "class_02"] {
        for entry in std::fs::read_dir(data.join("valid").join(class)).unwrap() {
            rows += &format!("{},{class},test\n", entry.unwrap().path().display());
        }
    }
    let list = tmp.path().join("test.csv");
    std::fs::write(&list, rows).unwrap();
    let listed = eval_json(&run, &list, &cache, &["--split", "test"]);
    assert_eq!(listed["images"], whole["images"], "{listed}");
    assert_eq!(listed["accuracy"], whole["accuracy"], "{listed}");
    // A class the checkpoint does not know is still refused.
    let stranger = tmp.path().join("stranger");
    std::fs::create_dir_all(stranger.join("test")).unwrap();
    std::os::unix::fs::symlink(data.join("valid/class_00"), stranger.join("test/zebra")).unwrap();
    let out = birdtrain_output(&[
        "eval",
        "--checkpoint",
        s(&run),
        "--data",
        s(&stranger),
        "--split",
        "test",
    ]);
    assert_one_line_error(&out, &["zebra"]);
}

/// `predict --on-bad-image skip` passes over a link loop in a folder as training does (it
/// stopped there), and when every file is bad, each still gets its line before the error.
#[test]
fn predict_skip_reports_a_link_loop_and_every_bad_file() {
    let tmp = tempfile::tempdir().unwrap();
    let (data, _cache, run) = trained(tmp.path());
    let photos = tmp.path().join("photos");
    std::fs::create_dir_all(photos.join("sub")).unwrap();
    let image = data.join("valid/class_01");
    let first = std::fs::read_dir(&image)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    std::fs::copy(&first, photos.join("a.png")).unwrap();
    std::os::unix::fs::symlink(&photos, photos.join("sub/up")).unwrap();
    let predict = |extra: &[&str]| {
        let mut args = vec!["predict", "--checkpoint", s(&run), "--json"];
        args.extend_from_slice(extra);
        birdtrain_output(&args)
    };
    let out = ok(predict(&["--on-bad-image", "skip", s(&photos)]));
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 2, "{}", text(&out));
    assert!(lines[0]["top"].is_array(), "{}", text(&out));
    assert!(
        lines[1]["path"].as_str().unwrap().ends_with("sub/up")
            && lines[1]["error"].as_str().unwrap().contains("link loop"),
        "{}",
        text(&out)
    );
    // Without skip, the loop is an error with the way out.
    let out = predict(&[s(&photos)]);
    assert_one_line_error(&out, &["sub/up", "loop", "--on-bad-image skip"]);
    // Every file bad: a line for each on stdout, then one error.
    let bad = tmp.path().join("bad");
    std::fs::create_dir(&bad).unwrap();
    std::fs::write(bad.join("x.png"), b"not a picture").unwrap();
    std::fs::write(bad.join("y.jpg"), b"nor this").unwrap();
    let out = predict(&["--on-bad-image", "skip", s(&bad)]);
    assert!(!out.status.success(), "{}", text(&out));
    let lines = json_lines(&out);
    let paths: Vec<&str> = lines.iter().map(|l| l["path"].as_str().unwrap()).collect();
    assert_eq!(
        paths,
        [s(&bad.join("x.png")), s(&bad.join("y.jpg"))],
        "{}",
        text(&out)
    );
    assert!(
        lines.iter().all(|l| l["error"].is_string()),
        "{}",
        text(&out)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr.lines().filter(|l| l.starts_with("error:")).count(),
        1,
        "{stderr}"
    );
}

/// `eval --json` prints the settings as given (`0.9`, not `0.8999999761581421`), and
/// `--workers 0` means the default, as its help says.
#[test]
fn eval_json_prints_settings_as_given_and_workers_0_is_the_default() {
    let tmp = tempfile::tempdir().unwrap();
    let (data, cache, run) = trained(tmp.path());
    let out = ok(birdtrain_output(&[
        "eval",
        "--checkpoint",
        s(&run),
        "--data",
        s(&data),
        "--cache-dir",
        s(&cache),
        "--crop-pct",
        "0.9",
        "--workers",
        "0",
        "--json",
    ]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("\"crop_pct\":0.9,"), "{stdout}");
    assert!(stdout.contains("\"label_smoothing\":0.0,"), "{stdout}");
}

/// A cache file cut short is rebuilt with the warning "What survives what" promises, naming
/// it (it was rebuilt in silence).
#[test]
fn a_cache_file_cut_short_is_rebuilt_with_a_warning() {
    let tmp = tempfile::tempdir().unwrap();
    let (data, cache, run) = trained(tmp.path());
    let eval = || {
        ok(birdtrain_output(&[
            "eval",
            "--checkpoint",
            s(&run),
            "--data",
            s(&data),
            "--cache-dir",
            s(&cache),
            "--json",
        ]))
    };
    let before = json_lines(&eval())[0].clone();
    let files: Vec<PathBuf> = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().contains("valid"))
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let len = std::fs::metadata(&files[0]).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&files[0])
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let out = eval();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let name = files[0].file_name().unwrap().to_string_lossy();
    assert!(
        stderr.contains(&*name) && stderr.contains("cut short") && stderr.contains("rebuilding"),
        "{stderr}"
    );
    assert_eq!(json_lines(&out)[0]["accuracy"], before["accuracy"]);
    // Rebuilt whole: the next run reads it without a word.
    let out = eval();
    assert!(out.stderr.is_empty(), "{}", text(&out));
}
