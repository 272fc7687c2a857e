//! `bench step --gpus 0` end to end through the binary: the CPU per-op breakdown, and the
//! vector-width override (`BIRDTRAIN_CPU_SIMD`) forcing the portable kernels or refusing a
//! bad value with one line that names it.

use std::process::{Command, Output};

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
    for value in ["sse9", "avx1024"] {
        let out = bench_step(value, &[]);
        assert!(!out.status.success(), "{value} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("BIRDTRAIN_CPU_SIMD") && err.contains(value) && err.contains("hint"),
            "{err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
}
