//! `bench step` on the CPU backend (`--gpus 0`), and the device lookups behind MFU.

use birdtrain::cli::bench_step::{bench, bf16_peak_tflops, BenchStepArgs};

fn args(model: &str, gpus: usize) -> BenchStepArgs {
    BenchStepArgs {
        model: model.into(),
        batch_size: 4,
        image_size: 32,
        classes: 10,
        gpus,
        warmup: 1,
        steps: 2,
        json: true,
        breakdown: false,
        plan: false,
    }
}

#[test]
fn cpu_bench_reports_a_full_json_line() {
    let report = bench(&args("resnet8", 0)).unwrap();
    assert_eq!(report.model, "resnet8");
    assert_eq!(
        (report.batch_size, report.image_size, report.steps),
        (4, 32, 2)
    );
    assert!(report.images_per_sec > 0.0 && report.ms_per_step > 0.0);
    assert!(report.fwd_bwd_ms_per_step > 0.0 && report.fwd_bwd_ms_per_step <= report.ms_per_step);
    assert!(report.final_loss.is_finite() && report.final_loss > 0.0);
    assert!(report.device.starts_with("cpu"), "{}", report.device);
    assert_eq!(report.mfu, None, "no bf16 peak is claimed for a CPU");
    assert!(report.update_ms_per_step > 0.0);
    assert_eq!(report.convolutions, "cpu");
    assert_eq!(report.conv3_tiles, None);
    assert_eq!(report.bn_mask, None);
    assert!(report.fwd_bwd_ms_per_step + report.update_ms_per_step <= report.ms_per_step * 1.01);
    assert!(
        report.optimizer.starts_with("fused in-place CPU"),
        "{}",
        report.optimizer
    );
    let json: serde_json::Value =
        serde_json::from_str(&serde_json::to_string(&report).unwrap()).unwrap();
    for key in [
        "model",
        "batch_size",
        "images_per_sec",
        "ms_per_step",
        "mfu",
    ] {
        assert!(json.get(key).is_some(), "{key} missing from {json}");
    }
    // images/s and ms/step describe the same measurement.
    let implied = 4.0 * 1000.0 / report.ms_per_step;
    assert!((implied - report.images_per_sec).abs() / implied < 1e-6);
}

#[test]
fn bad_arguments_are_errors() {
    assert!(bench(&args("resnet9000", 0)).is_err());
    let err = bench(&args("resnet8", 3)).unwrap_err().to_string();
    assert!(
        err.contains("--gpus 0") && err.contains("bench scaling"),
        "{err}"
    );
    let mut zero = args("resnet8", 0);
    zero.batch_size = 0;
    assert!(bench(&zero).is_err());
}

#[test]
fn without_a_driver_gpu_bench_says_use_gpus_0() {
    if birdtrain::cuda::library::require_driver().is_ok() {
        eprintln!("skipped: a CUDA driver is present on this machine");
        return;
    }
    let err = bench(&args("resnet8", 1)).unwrap_err().to_string();
    assert!(
        err.contains("no CUDA driver found (libcuda.so") && err.contains("use --gpus 0"),
        "{err}"
    );
}

#[test]
fn peaks_are_known_for_datacenter_gpus() {
    assert_eq!(bf16_peak_tflops("NVIDIA H100 80GB HBM3"), Some(989.4));
    assert_eq!(bf16_peak_tflops("NVIDIA H100 PCIe"), Some(756.5));
    assert_eq!(bf16_peak_tflops("NVIDIA H200"), Some(989.4));
    assert_eq!(bf16_peak_tflops("NVIDIA A100-SXM4-80GB"), Some(312.0));
    assert_eq!(bf16_peak_tflops("Some Future GPU"), None);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_bench_reports_breakdown_and_device_update() {
    let mut a = args("resnet18", 1);
    a.image_size = 64;
    a.batch_size = 16;
    a.breakdown = true;
    let report = bench(&a).unwrap();
    assert!(report.device.starts_with("cuda:0"), "{}", report.device);
    assert!(report.images_per_sec > 0.0 && report.final_loss.is_finite());
    assert!(
        report.optimizer.starts_with("fused device update"),
        "{}",
        report.optimizer
    );
    assert!(report.update_ms_per_step > 0.0);
    // The generation that ran: the default, v3 on Hopper and v2 on other GPUs.
    let hopper = report.device.contains("(sm_90");
    assert_eq!(report.convolutions, if hopper { "v3" } else { "v2" });
    // v3's tile schedule, the default (`BIRDTRAIN_CONV3_TILES` unset), where v3 ran.
    assert_eq!(report.conv3_tiles.as_deref(), hopper.then_some("blocks"));
    // And where the data gradients take the ReLU's mask from (`BIRDTRAIN_BN_MASK` unset).
    assert_eq!(report.bn_mask.as_deref(), Some("stored"));
    let rows = report.breakdown.expect("--breakdown");
    // The forward convolution of any generation (conv_fwd_vec, conv2_fwd_128x64, conv3_fwd…).
    let conv = rows
        .iter()
        .filter(|r| {
            ["conv_fwd", "conv2_fwd", "conv3_fwd"]
                .iter()
                .any(|p| r.kernel.starts_with(p))
        })
        .max_by(|a, b| a.calls_per_step.total_cmp(&b.calls_per_step))
        .unwrap_or_else(|| panic!("no forward convolution timed: {rows:?}"));
    assert!(conv.tflops.unwrap() > 0.0 && conv.calls_per_step > 1.0);
    assert!(rows
        .iter()
        .any(|r| r.kernel.starts_with("bn_") && r.gb_per_s.is_some()));
    // Each GEMM carries its own FLOPs: every convolution kernel has a rate, none above the
    // device's peak (a first H100 run showed the split weight gradient's FLOPs on its reduce
    // kernel, at 2 233 TFLOP/s, and none on the GEMM).
    let peak = bf16_peak_tflops(report.device.split_once(' ').map_or("", |d| d.1)).unwrap_or(1e4);
    for r in rows.iter().filter(|r| r.kernel.starts_with("conv")) {
        // The copies that rearrange weights or pixels for a GEMM (v3 the default on Hopper
        // since 2026-11-27: its data gradients' weight layouts) carry no FLOPs.
        let gemm = !matches!(
            r.kernel.as_str(),
            "conv2_wgrad_reduce"
                | "conv2_pad_channels"
                | "conv2_pair_pixels"
                | "conv2_dgrad_weights"
                | "conv3_dgrad_weights_3x3"
                | "conv3_dgrad_weights_s2"
                | "conv3_transpose_weights"
        );
        assert_eq!(r.tflops.is_some(), gemm, "{r:?}");
        assert!(
            r.tflops.unwrap_or(0.0) < peak,
            "{r:?} above the peak {peak}"
        );
    }
    let total: f64 = rows.iter().map(|r| r.percent).sum();
    assert!((total - 100.0).abs() < 1e-6);
}
