//! Fine-tuning: `--init-from weights.safetensors` starts from given weights and replaces the
//! classifier head when the class count differs; here on a flat `<class>/<images>` folder
//! split by `--valid-fraction`.

use std::path::Path;

use safetensors::SafeTensors;

use crate::cli_support;
use cli_support::{birdtrain, s};

fn tensor(file: &Path, name: &str) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(file).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap();
    let values = t
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    (t.shape().to_vec(), values)
}

#[test]
fn init_from_replaces_the_head_and_keeps_the_rest() {
    let tmp = tempfile::tempdir().unwrap();
    let (d3, d2) = (tmp.path().join("three"), tmp.path().join("two"));
    let cache = tmp.path().join("cache");
    for (dir, classes) in [(&d3, "3"), (&d2, "2")] {
        birdtrain(&[
            "synth",
            "--out",
            s(dir),
            "--classes",
            classes,
            "--train-per-class",
            "10",
            "--valid-per-class",
            "2",
            "--size",
            "16x16",
            "--format",
            "png",
        ]);
    }
    // A flat layout: <root>/<class>/<images>, validation carved out by --valid-fraction.
    let flat = tmp.path().join("flat");
    std::fs::rename(d2.join("train"), &flat).unwrap();

    let base = tmp.path().join("base");
    birdtrain(&[
        "--data",
        s(&d3),
        "--gpus",
        "0",
        "--model",
        "resnet8",
        "--image-size",
        "16",
        "--epochs",
        "1",
        "--batch-size",
        "8",
        "--out",
        s(&base),
        "--cache-dir",
        s(&cache),
        "--quiet",
    ]);
    let tuned = tmp.path().join("tuned");
    // A vanishing learning rate: the result shows what the run started from.
    birdtrain(&[
        "--data",
        s(&flat),
        "--valid-fraction",
        "0.25",
        "--gpus",
        "0",
        "--model",
        "resnet8",
        "--image-size",
        "16",
        "--epochs",
        "1",
        "--batch-size",
        "8",
        "--lr=1e-9",
        "--init-from",
        s(&base.join("model.safetensors")),
        "--out",
        s(&tuned),
        "--cache-dir",
        s(&cache),
        "--quiet",
    ]);
    let (a, b) = (
        base.join("model.safetensors"),
        tuned.join("model.safetensors"),
    );
    assert_eq!(tensor(&a, "fc.weight").0, [3, 64]);
    assert_eq!(
        tensor(&b, "fc.weight").0,
        [2, 64],
        "the head follows the new classes"
    );
    let (_, wa) = tensor(&a, "conv1.weight");
    let (_, wb) = tensor(&b, "conv1.weight");
    let max_diff = wa
        .iter()
        .zip(&wb)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(
        max_diff < 1e-5,
        "the body was not taken from --init-from (|Δ| {max_diff})"
    );
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tuned.join("checkpoint.json")).unwrap())
            .unwrap();
    assert_eq!(meta["classes"].as_array().unwrap().len(), 2);
    let metrics = std::fs::read_to_string(tuned.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 2, "{metrics}");
}

#[test]
fn zero_init_residual_starts_training_from_identity_blocks() {
    // One step at a vanishing rate: the saved weights are the initialisation's, so the last
    // batch norm of every block has γ = 0 with the flag and γ = 1 without it.
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d");
    birdtrain(&[
        "synth",
        "--out",
        s(&data),
        "--classes",
        "2",
        "--train-per-class",
        "4",
        "--valid-per-class",
        "2",
        "--size",
        "16x16",
        "--format",
        "png",
    ]);
    for (flag, gamma) in [(true, 0.0f32), (false, 1.0)] {
        let run = tmp.path().join(format!("run-{flag}"));
        let mut args = vec![
            "--data",
            s(&data),
            "--gpus",
            "0",
            "--model",
            "resnet8",
            "--image-size",
            "16",
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--lr",
            "1e-12",
            "--weight-decay",
            "0",
            "--out",
            s(&run),
            "--quiet",
        ];
        if flag {
            args.push("--zero-init-residual");
        }
        birdtrain(&args);
        let file = run.join("model.safetensors");
        let (_, last) = tensor(&file, "layer1.0.bn2.weight");
        assert!(
            last.iter().all(|&g| (g - gamma).abs() < 1e-6),
            "{flag}: {last:?}"
        );
        let (_, first) = tensor(&file, "layer1.0.bn1.weight");
        assert!(
            first.iter().all(|&g| (g - 1.0).abs() < 1e-6),
            "{flag}: {first:?}"
        );
    }
}
