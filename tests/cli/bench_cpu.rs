//! `bench step --gpus 0` end to end through the binary: the CPU per-op breakdown, and the
//! vector-width override (`BIRDTRAIN_CPU_SIMD`) forcing the portable kernels or refusing a
//! bad value with one line that names it.

use std::process::{Command, Output};

use crate::cli_support;
use cli_support::{assert_one_line_error, birdtrain_output};

fn bench_step(simd: &str, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_birdtrain"))
        .env("BIRDTRAIN_CPU_SIMD", simd)
        .args([
            "bench",
            "step",
            "--gpus",
            "0",
            "--model",
            "resnet8",
            "--classes",
            "5",
            "--batch-size",
            "4",
            "--image-size",
            "16",
            "--warmup",
            "1",
            "--steps",
            "2",
            "--json",
        ])
        .args(extra)
        .output()
        .expect("the birdtrain binary runs")
}

#[test]
fn cpu_breakdown_lists_every_op_with_its_share() {
    let out = bench_step("portable", &["--breakdown"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(text.trim()).expect("one JSON line");
    // The CPU runs batch norm in its own passes (the fused sequence is a test reference there).
    assert_eq!(report["batch_norm"], "separate", "{report}");
    assert_eq!(report["convolutions"], "cpu", "{report}");
    assert!(report["conv3_tiles"].is_null(), "{report}");
    assert!(report["bn_mask"].is_null(), "{report}");
    let rows = report["breakdown"].as_array().expect("a breakdown");
    let row = |name: &str| {
        rows.iter()
            .find(|r| r["kernel"] == name)
            .unwrap_or_else(|| panic!("no {name} row in {rows:?}"))
    };
    // resnet8 at 16 px: 3×3 convolutions (some strided), batch norm, the head, the update.
    for name in [
        "input",
        "conv_fwd 3x3",
        "conv_fwd 3x3/2",
        "conv_dgrad 3x3",
        "conv_wgrad 3x3",
        "bn_fwd",
        "bn_bwd",
        "linear_fwd",
        "softmax_ce",
        "optimizer",
    ] {
        let r = row(name);
        assert!(r["calls_per_step"].as_f64().unwrap() >= 1.0, "{r}");
        assert!(r["ms_per_step"].as_f64().unwrap() >= 0.0, "{r}");
    }
    assert!(row("conv_fwd 3x3")["tflops"].as_f64().unwrap() > 0.0);
    let total: f64 = rows.iter().map(|r| r["percent"].as_f64().unwrap()).sum();
    assert!((total - 100.0).abs() < 0.1, "shares sum to {total}");
    let ms: Vec<f64> = rows
        .iter()
        .map(|r| r["ms_per_step"].as_f64().unwrap())
        .collect();
    assert!(ms.windows(2).all(|w| w[0] >= w[1]), "slowest first: {ms:?}");
}

#[test]
fn a_bad_simd_override_is_one_clear_line() {
    for value in ["sse9", "avx1024", "foo"] {
        let out = bench_step(value, &[]);
        assert!(!out.status.success(), "{value} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("BIRDTRAIN_CPU_SIMD") && err.contains(value) && err.contains("hint"),
            "{err}"
        );
        assert!(!err.contains("panicked"), "{err}");
        // One line, the variable and the value named once, the valid levels listed.
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert_eq!(err.matches("BIRDTRAIN_CPU_SIMD").count(), 1, "{err}");
        assert_eq!(err.matches(value).count(), 1, "{err}");
        assert!(!err.contains("CpuBackend::new"), "{err}");
        assert!(
            err.contains("portable") && err.contains("avx2") && err.contains("avx512"),
            "{err}"
        );
    }
}

#[test]
fn bench_values_that_cannot_work_are_one_line_usage_errors() {
    let step = [
        "bench",
        "step",
        "--gpus",
        "0",
        "--model",
        "resnet8",
        "--batch-size",
        "8",
        "--image-size",
        "32",
    ];
    let scaling = [
        "bench",
        "scaling",
        "--model",
        "resnet50",
        "--skip-allreduce",
    ];
    // (base, extra flags, the flag named, the value named)
    let cases: &[(&[&str], &[&str], &str, &str)] = &[
        (&step, &["--classes", "0"], "--classes", "0"),
        (&step, &["--steps", "0"], "--steps", "0"),
        (
            &step,
            &["--classes", "100000000000"],
            "--classes",
            "100000000000",
        ),
        (
            &scaling,
            &["--step-ms", "100", "--classes", "0"],
            "--classes",
            "0",
        ),
        (
            &scaling,
            &["--step-ms", "100", "--image-size", "0"],
            "--image-size",
            "0",
        ),
        (
            &scaling,
            &["--step-ms", "100", "--batch-size", "0"],
            "--batch-size",
            "0",
        ),
        (
            &scaling,
            &["--step-ms", "100", "--gpus", "1,0"],
            "--gpus",
            "0",
        ),
        (
            &scaling,
            &["--step-ms", "100", "--bucket-mb", "NaN"],
            "--bucket-mb",
            "NaN",
        ),
        (&scaling, &["--step-ms", "0"], "--step-ms", "0"),
        (
            &scaling,
            &["--step-ms", "100", "--backward-share", "2"],
            "--backward-share",
            "2",
        ),
        (
            &scaling,
            &["--step-ms", "100", "--pcie-gbps", "0"],
            "--pcie-gbps",
            "0",
        ),
        (&scaling, &["--measure-steps", "0"], "--measure-steps", "0"),
        (
            &scaling,
            &["--step-ms", "100", "--allreduce-steps", "0"],
            "--allreduce-steps",
            "0",
        ),
    ];
    for (base, extra, flag, value) in cases {
        let args: Vec<&str> = base.iter().chain(extra.iter()).copied().collect();
        let out = birdtrain_output(&args);
        assert_one_line_error(&out, &[&format!("invalid value `{value}` for {flag}")]);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
    }
}
