//! The CI accuracy test of issue 3: on the synthetic 10-class set (64×64 PNG, 100 train /
//! 20 valid per class), `birdtrain --data D --gpus 0 --model resnet8 --image-size 32
//! --epochs 5` reaches at least 0.90 validation accuracy in metrics.jsonl; so does the same
//! run with the ImageNet recipe's augmentation, `--augment resized-crop --store-size 40
//! --color-jitter 0.4 --random-erase 0.25 --mixup 0.2 --cutmix 1.0`.

use crate::cli_support;
use cli_support::{birdtrain, s};

#[test]
fn resnet8_reaches_90_percent_valid_accuracy_in_5_epochs() {
    reaches_90_percent(&[]);
}

#[test]
fn resnet8_with_the_imagenet_augmentation_reaches_90_percent_too() {
    let stdout = reaches_90_percent(&[
        "--augment",
        "resized-crop",
        "--store-size",
        "40",
        "--color-jitter",
        "0.4",
        "--random-erase",
        "0.25",
        "--mixup",
        "0.2",
        "--cutmix",
        "1.0",
    ]);
    for line in [
        "random resized crop: 8–100 % of each stored image's area",
        "colour jitter: brightness, contrast and saturation each ×0.60–1.40",
        "caches 40×40 squares",
        "random erasing: 25 % of training images",
        "100 % of training batches get mixup (α 0.2) or CutMix (α 1, 50 % of them)",
    ] {
        assert!(stdout.contains(line), "no line {line:?}:\n{stdout}");
    }
}

/// Trains the CI accuracy run with `extra` flags, checks its run folder and returns stdout.
fn reaches_90_percent(extra: &[&str]) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let run = tmp.path().join("run");
    let cache = tmp.path().join("cache");
    birdtrain(&[
        "synth",
        "--out",
        s(&data),
        "--classes",
        "10",
        "--train-per-class",
        "100",
        "--valid-per-class",
        "20",
        "--size",
        "64x64",
        "--format",
        "png",
    ]);
    let mut args = vec![
        "--data",
        s(&data),
        "--gpus",
        "0",
        "--model",
        "resnet8",
        "--image-size",
        "32",
        "--epochs",
        "5",
        "--out",
        s(&run),
        "--cache-dir",
        s(&cache),
    ];
    args.extend_from_slice(extra);
    let out = birdtrain(&args);
    let stdout = String::from_utf8_lossy(&out.stdout);

    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("every metrics line is JSON"))
        .collect();
    assert_eq!(
        lines.len(),
        10,
        "a train and a valid line per epoch:\n{text}"
    );
    for (i, line) in lines.iter().enumerate() {
        let keys: Vec<&str> = line
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        for key in [
            "epoch",
            "split",
            "loss",
            "accuracy",
            "top5",
            "images_per_sec",
            "seconds",
        ] {
            assert!(keys.contains(&key), "line {i} lacks {key}: {line}");
        }
        assert_eq!(line["epoch"], (i / 2 + 1) as u64);
        assert_eq!(line["split"], if i % 2 == 0 { "train" } else { "valid" });
    }
    let last_valid = &lines[9];
    let acc = last_valid["accuracy"].as_f64().unwrap();
    assert!(acc >= 0.90, "valid accuracy {acc} < 0.90\n{text}\n{stdout}");

    // The rest of the run folder, and the summary's throughput figure.
    for file in [
        "model.safetensors",
        "optimizer.safetensors",
        "checkpoint.json",
        "report.png",
    ] {
        assert!(run.join(file).is_file(), "{file} missing");
    }
    assert!(
        stdout.contains("images/s"),
        "summary without images/s:\n{stdout}"
    );
    assert!(stdout.contains("valid accuracy"), "no summary:\n{stdout}");
    stdout.into_owned()
}
