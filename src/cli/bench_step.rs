//! `birdtrain bench step`: times whole training steps on synthetic input.
//!
//! Semantics follow the PyTorch peer (`shared/peers/torch_resnet_step.py`): a u8 NHWC batch in
//! pinned host memory (on the GPU path) is copied to the device every step, normalised there,
//! then forward, loss, backward and the SGD update (momentum 0.9, weight decay 5e-5, lr 0.1)
//! run; warm-up steps are excluded. `--gpus 0` times the CPU backend instead (the peer is
//! `benches/torch_cpu_step.py`), its update the backend's fused in-place optimizer. MFU is
//! `3 × forward FLOPs × images/s ÷ the device's dense bf16 peak` (looked up by device name).

use std::time::Instant;

use clap::Args;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::backend::cpu::{CpuBackend, CpuOptimizer, OpTime, UpdateRule};
use crate::backend::Backend;
use crate::cuda::conv::ConvVersion;
use crate::cuda::optim::{to_backend_layout, DeviceOptimizer};
use crate::cuda::{CudaBackend, KernelTime};
use crate::model::{Arch, Graph, InputBatch, Network};
use crate::optim::{Hyper, OptimizerKind};

/// Arguments of `birdtrain bench step`.
#[derive(Debug, Clone, Args)]
pub struct BenchStepArgs {
    /// Model architecture (resnet8/20/56, resnet18/34/50/101/152).
    #[arg(long, default_value = "resnet50")]
    pub model: String,
    /// Images per step.
    #[arg(long, default_value_t = 256)]
    pub batch_size: usize,
    /// Image side in pixels.
    #[arg(long, default_value_t = 224)]
    pub image_size: u32,
    /// Classes of the classifier head (the 285-birds set by default).
    #[arg(long, default_value_t = 285)]
    pub classes: usize,
    /// 0 = time the CPU backend; 1 = GPU 0 (multi-GPU scaling is `bench scaling`).
    #[arg(long, default_value_t = 1)]
    pub gpus: usize,
    /// Untimed steps first (kernel compilation, allocation, clocks).
    #[arg(long, default_value_t = 15)]
    pub warmup: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 50)]
    pub steps: usize,
    /// Print one JSON line instead of text.
    #[arg(long)]
    pub json: bool,
    /// Also time every kernel launch (CUDA events; on the CPU, every backend op) over a few
    /// extra steps and report the per-kernel breakdown.
    #[arg(long)]
    pub breakdown: bool,
    /// Print the step model of the v2 convolutions instead (per layer and pass: GEMM, FLOPs,
    /// bytes, kernel, blocks, waves, padding; modelled on an H100, no GPU needed) and exit.
    #[arg(long)]
    pub plan: bool,
}

/// One kernel's share of a step, for `--breakdown`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct KernelShare {
    /// Kernel name.
    pub kernel: String,
    /// Launches per step.
    pub calls_per_step: f64,
    /// Milliseconds per step.
    pub ms_per_step: f64,
    /// Share of the summed kernel time.
    pub percent: f64,
    /// Achieved TFLOP/s (the convolution kernels: 2 × multiply-adds of the GEMM).
    pub tflops: Option<f64>,
    /// Achieved DRAM bandwidth in GB/s (compulsory bytes: inputs once, outputs once).
    pub gb_per_s: Option<f64>,
}

/// The result of a step benchmark (the JSON line).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct StepReport {
    /// Architecture name.
    pub model: String,
    /// Images per step.
    pub batch_size: usize,
    /// Image side.
    pub image_size: u32,
    /// Timed steps.
    pub steps: usize,
    /// Throughput.
    pub images_per_sec: f64,
    /// Mean wall time of a whole step (input copy, forward, backward, update).
    pub ms_per_step: f64,
    /// Of which forward + loss + backward (the backend's kernels).
    pub fwd_bwd_ms_per_step: f64,
    /// Of which the optimizer update (on the GPU: one fused launch over every parameter,
    /// kernels/optim.cu; on the CPU: the fused in-place update every CPU rank uses).
    pub update_ms_per_step: f64,
    /// Model FLOPs utilisation against the device's dense bf16 peak (`null` when unknown).
    pub mfu: Option<f64>,
    /// The backend's description.
    pub device: String,
    /// How batch norm ran: `"separate"` (its own passes), `"fused"` (into the convolutions
    /// around it) or `"applied"` (fused, and each inner batch norm applied by the convolution
    /// that reads it: `BIRDTRAIN_BN_PROLOGUE=1`).
    pub batch_norm: String,
    /// Which convolution kernels ran: on a GPU `"v1"`, `"v2"` or `"v3"` (kernels/conv.cu,
    /// conv2.cu, conv3.cu: `BIRDTRAIN_CONV`, unset v3 on Hopper and v2 elsewhere; v3 asked of
    /// another GPU runs v2), on the CPU `"cpu"`.
    pub convolutions: String,
    /// How the v3 GEMMs of 128-column tiles walked their tiles (`BIRDTRAIN_CONV3_TILES`:
    /// `"blocks"`, `"raster"` or `"persistent"`); `null` where v3 did not run.
    pub conv3_tiles: Option<String>,
    /// Where the fused data gradients took an inner batch norm's ReLU mask from
    /// (`BIRDTRAIN_BN_MASK`: `"stored"` or `"recomputed"`); `null` on the CPU.
    pub bn_mask: Option<String>,
    /// Where the optimizer update ran.
    pub optimizer: String,
    /// Mean loss of the last timed step.
    pub final_loss: f64,
    /// Per-kernel breakdown (with `--breakdown`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub breakdown: Option<Vec<KernelShare>>,
}

/// Dense (no sparsity) bf16 tensor-core peak in TFLOP/s for a device name, when known.
pub fn bf16_peak_tflops(device_name: &str) -> Option<f64> {
    let name = device_name.to_ascii_uppercase();
    let table: [(&str, f64); 12] = [
        ("GH200", 989.4),
        ("H200", 989.4),
        ("H100 PCIE", 756.5),
        ("H100 NVL", 835.5),
        ("H100", 989.4),
        ("H800", 989.4),
        ("B200", 2250.0),
        ("A100", 312.0),
        ("A800", 312.0),
        ("L40S", 362.1),
        ("RTX 4090", 165.2),
        ("A10", 125.0),
    ];
    table
        .iter()
        .find(|(key, _)| name.contains(key))
        .map(|&(_, peak)| peak)
}

/// The peer's optimizer: SGD, momentum 0.9, learning rate 0.1, weight decay 5e-5.
const SGD: OptimizerKind = OptimizerKind::Sgd {
    momentum: 0.9,
    nesterov: false,
};
const LR: f32 = 0.1;

fn bench_hyper() -> Hyper {
    Hyper {
        weight_decay: 5e-5,
        ..Hyper::default()
    }
}

/// Checks the numeric flags before any work: a bad one is a [`super::CliError::BadValue`]
/// naming it (usage error, exit code 2).
pub fn check(args: &BenchStepArgs) -> Result<(), super::CliError> {
    use super::counts::{check_bench_classes, check_bench_image_size, check_range};
    check_range(
        "--batch-size",
        args.batch_size,
        1,
        usize::MAX,
        "images per step",
    )?;
    check_bench_image_size(args.image_size)?;
    if args.plan {
        return Ok(());
    }
    check_range(
        "--gpus",
        args.gpus,
        0,
        1,
        "--gpus 0 times the CPU backend, --gpus 1 GPU 0; several GPUs: `bench scaling`",
    )?;
    check_bench_classes(args.classes)?;
    check_range("--steps", args.steps, 1, usize::MAX, "timed steps")?;
    Ok(())
}

/// Runs the benchmark and returns the report (no printing).
pub fn bench(args: &BenchStepArgs) -> anyhow::Result<StepReport> {
    let arch: Arch = args.model.parse()?;
    check(args)?;
    match args.gpus {
        0 => {
            let backend = CpuBackend::new(0)?;
            let graph = Graph::new(arch, args.classes);
            // The peer's SGD, in place on the backend's tensors (no decay on BN and biases).
            let OptimizerKind::Sgd { momentum, nesterov } = SGD else {
                unreachable!("the bench optimizer is SGD")
            };
            let hyper = bench_hyper();
            let mut opt = CpuOptimizer::new(
                UpdateRule::Sgd { momentum, nesterov },
                graph.params().iter().map(|p| p.numel()).collect(),
                graph
                    .params()
                    .iter()
                    .map(|p| if p.decay { hyper.weight_decay } else { 0.0 })
                    .collect(),
            )?;
            let cpu = backend.clone();
            let mut update = |net: &mut Network<CpuBackend>| -> anyhow::Result<()> {
                let (grads, mut params) = net.grads_and_params_mut();
                opt.step(&cpu, &mut params, &grads, LR, 1.0)?;
                Ok(())
            };
            let label = "fused in-place CPU update (backend layout)";
            let profiler = backend.clone();
            run_steps(backend, arch, args, None, Some(profiler), &mut update, label)
        }
        1 => {
            let backend = CudaBackend::new(0)?;
            let graph = Graph::new(arch, args.classes);
            crate::cuda::memory::check_batch_fits(&backend, &graph, args.image_size, args.batch_size)?;
            let peak = bf16_peak_tflops(backend.device().name());
            let ctx = backend.device().context().clone();
            let bytes = args.batch_size * (args.image_size as usize).pow(2) * 3;
            // Pinned (page-locked) host memory, so the per-step copy is a real DMA as in the peer.
            // SAFETY: freed by PinnedHostSlice's Drop; written once before the first copy.
            let mut pinned = unsafe { ctx.alloc_pinned::<u8>(bytes) }
                .map_err(|e| anyhow::anyhow!("allocating {bytes} bytes of pinned host memory: {e}"))?;
            let mut rng = ChaCha8Rng::seed_from_u64(0);
            pinned.as_mut_slice()?.iter_mut().for_each(|b| *b = rng.random());
            let gpu = backend.clone();
            // f32 master weights and momentum live on the GPU; one fused launch updates every
            // parameter from the gradients in place, with no host round trip.
            let mut device: Option<DeviceOptimizer> = None;
            let mut update = |net: &mut Network<CudaBackend>| -> anyhow::Result<()> {
                if device.is_none() {
                    let initial = to_backend_layout(graph.params(), &net.params_f32()?);
                    device = Some(DeviceOptimizer::new(
                        &gpu,
                        SGD,
                        bench_hyper(),
                        graph.params(),
                        &initial,
                    )?);
                }
                let (grads, mut params) = net.grads_and_params_mut();
                let opt = device.as_mut().expect("initialised above");
                opt.step(&grads, &mut params, LR, 1.0)?;
                Ok(())
            };
            let label = "fused device update (f32 master weights on the GPU)";
            let side = GpuSide {
                pixels: pinned.as_slice()?,
                peak_tflops: peak,
                profiler: backend.clone(),
            };
            run_steps(backend, arch, args, Some(side), None, &mut update, label)
        }
        n => anyhow::bail!("bench step measures one device: use --gpus 0 (CPU) or --gpus 1, not {n} (multi-GPU: `bench scaling`)"),
    }
}

/// What the GPU path adds to a step benchmark.
struct GpuSide<'a> {
    /// The u8 batch in pinned host memory, copied to the device every step.
    pixels: &'a [u8],
    /// The device's dense bf16 peak, for MFU.
    peak_tflops: Option<f64>,
    /// The backend whose launches `--breakdown` times.
    profiler: CudaBackend,
}

fn run_steps<B: Backend>(
    backend: B,
    arch: Arch,
    args: &BenchStepArgs,
    gpu: Option<GpuSide<'_>>,
    cpu_profiler: Option<CpuBackend>,
    update: &mut dyn FnMut(&mut Network<B>) -> anyhow::Result<()>,
    optimizer: &str,
) -> anyhow::Result<StepReport> {
    let graph = Graph::new(arch, args.classes);
    let (n, size) = (args.batch_size, args.image_size);
    let mut net = Network::new(backend, &graph, n, size)?;
    let device = net.backend().name();
    let batch_norm = match (net.backend().bn_fusion(), net.backend().conv_applies_bn()) {
        (false, _) => "separate",
        (true, false) => "fused",
        (true, true) => "applied",
    };
    let convolutions = gpu.as_ref().map_or("cpu", |g| {
        g.profiler
            .conv_version()
            .on(g.profiler.device().arch())
            .name()
    });
    let conv3_tiles = gpu
        .as_ref()
        .filter(|_| convolutions == ConvVersion::V3.name())
        .map(|g| g.profiler.conv3_tiles().name().to_string());
    let bn_mask = gpu
        .as_ref()
        .map(|g| g.profiler.bn_mask().name().to_string());
    let host_pixels: Vec<u8>;
    let pixels = match gpu.as_ref().map(|g| g.pixels) {
        Some(p) => p,
        None => {
            let mut rng = ChaCha8Rng::seed_from_u64(0);
            host_pixels = (0..n * (size as usize).pow(2) * 3)
                .map(|_| rng.random())
                .collect();
            &host_pixels[..]
        }
    };
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let labels: Vec<u32> = (0..n)
        .map(|_| rng.random_range(0..args.classes as u32))
        .collect();
    let batch = InputBatch {
        pixels,
        labels: &labels,
        len: n,
        image_size: size,
        augment: None,
        mix: None,
    };

    // Wall time per phase; on a GPU the phases overlap the device's queue, so the split is
    // approximate while the total is exact (the last step's loss read synchronises).
    let mut step =
        |net: &mut Network<B>, fwd_bwd: &mut f64, upd: &mut f64| -> anyhow::Result<f64> {
            let t = Instant::now();
            let stats = net.train_step(&batch)?;
            let t_update = Instant::now();
            *fwd_bwd += (t_update - t).as_secs_f64();
            update(net)?;
            *upd += t_update.elapsed().as_secs_f64();
            Ok(stats.mean_loss())
        };
    let (mut scratch, mut scratch_update) = (0.0, 0.0);
    for _ in 0..args.warmup {
        step(&mut net, &mut scratch, &mut scratch_update)?;
    }
    let (mut fwd_bwd, mut update_s) = (0.0, 0.0);
    let mut loss = 0.0;
    let start = Instant::now();
    for _ in 0..args.steps {
        loss = step(&mut net, &mut fwd_bwd, &mut update_s)?;
    }
    let seconds = start.elapsed().as_secs_f64();
    let images_per_sec = (n * args.steps) as f64 / seconds;
    let flops = graph.forward_flops(size);
    let mfu = gpu
        .as_ref()
        .and_then(|g| g.peak_tflops)
        .map(|p| 3.0 * flops * images_per_sec / (p * 1e12));

    let profiled_steps = 3usize;
    let breakdown = match (gpu.as_ref(), cpu_profiler) {
        _ if !args.breakdown => None,
        (Some(GpuSide { profiler: p, .. }), _) => {
            p.set_profiling(true);
            for _ in 0..profiled_steps {
                step(&mut net, &mut scratch, &mut scratch_update)?;
            }
            let times = p.take_profile()?;
            p.set_profiling(false);
            Some(shares(&times, profiled_steps))
        }
        (None, Some(p)) => {
            p.take_profile();
            p.set_profiling(true);
            for _ in 0..profiled_steps {
                step(&mut net, &mut scratch, &mut scratch_update)?;
            }
            p.set_profiling(false);
            Some(cpu_shares(&p.take_profile(), profiled_steps))
        }
        (None, None) => None,
    };
    Ok(StepReport {
        model: arch.name().to_string(),
        batch_size: n,
        image_size: size,
        steps: args.steps,
        images_per_sec,
        ms_per_step: seconds * 1e3 / args.steps as f64,
        fwd_bwd_ms_per_step: fwd_bwd * 1e3 / args.steps as f64,
        update_ms_per_step: update_s * 1e3 / args.steps as f64,
        mfu,
        device,
        batch_norm: batch_norm.to_string(),
        convolutions: convolutions.to_string(),
        conv3_tiles,
        bn_mask,
        optimizer: optimizer.to_string(),
        final_loss: loss,
        breakdown,
    })
}

fn shares(times: &[KernelTime], steps: usize) -> Vec<KernelShare> {
    let total: f64 = times.iter().map(|k| k.ms).sum();
    times
        .iter()
        .map(|k| KernelShare {
            kernel: k.name.to_string(),
            calls_per_step: k.calls as f64 / steps as f64,
            ms_per_step: k.ms / steps as f64,
            percent: if total > 0.0 {
                100.0 * k.ms / total
            } else {
                0.0
            },
            tflops: k.tflops(),
            gb_per_s: k.gb_per_s(),
        })
        .collect()
}

/// The CPU backend's per-op times as breakdown rows, slowest first.
fn cpu_shares(times: &[OpTime], steps: usize) -> Vec<KernelShare> {
    let total: f64 = times.iter().map(|k| k.ms).sum();
    let mut rows: Vec<KernelShare> = times
        .iter()
        .map(|k| KernelShare {
            kernel: k.name.clone(),
            calls_per_step: k.calls as f64 / steps as f64,
            ms_per_step: k.ms / steps as f64,
            percent: if total > 0.0 {
                100.0 * k.ms / total
            } else {
                0.0
            },
            tflops: k.gflops().map(|g| g / 1e3),
            gb_per_s: k.gb_per_s(),
        })
        .collect();
    rows.sort_by(|a, b| b.ms_per_step.total_cmp(&a.ms_per_step));
    rows
}

/// Runs `birdtrain bench step ...` and prints the report.
pub fn run(args: BenchStepArgs) -> anyhow::Result<()> {
    if args.plan {
        let arch: Arch = args.model.parse()?;
        check(&args)?;
        let gpu = crate::cuda::conv::GpuLimits::H100;
        // The plan is an H100's (Hopper), so an unset BIRDTRAIN_CONV plans v3.
        let version =
            crate::cuda::conv::ConvVersion::from_env(crate::cuda::arch::GpuArch::new(9, 0))?;
        let rows =
            super::bench_plan::conv_plan(arch, args.batch_size, args.image_size, &gpu, version);
        if args.json {
            outln!("{}", serde_json::to_string(&rows)?);
        } else {
            let (batch, size) = (args.batch_size, args.image_size);
            super::bench_plan::print(&args.model, batch, size, version, &rows);
        }
        return Ok(());
    }
    let report = bench(&args)?;
    if args.json {
        outln!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    outln!(
        "{} batch {} at {}px on {}: {:.1} images/s, {:.2} ms/step ({:.2} ms forward+backward), MFU {}",
        report.model,
        report.batch_size,
        report.image_size,
        report.device,
        report.images_per_sec,
        report.ms_per_step,
        report.fwd_bwd_ms_per_step,
        report.mfu.map_or("n/a".to_string(), |m| format!("{:.1}%", m * 100.0)),
    );
    outln!(
        "optimizer: {} ({:.2} ms/step)",
        report.optimizer,
        report.update_ms_per_step
    );
    if let Some(rows) = &report.breakdown {
        outln!(
            "{:<22} {:>8} {:>10} {:>7} {:>9} {:>8}",
            "kernel",
            "calls",
            "ms/step",
            "%",
            "GFLOP/s",
            "GB/s"
        );
        for r in rows {
            outln!(
                "{:<22} {:>8.1} {:>10.3} {:>6.1}% {:>9} {:>8}",
                r.kernel,
                r.calls_per_step,
                r.ms_per_step,
                r.percent,
                r.tflops
                    .map_or(String::new(), |t| format!("{:.1}", t * 1e3)),
                r.gb_per_s.map_or(String::new(), |g| format!("{g:.1}"))
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn breakdown_rates_and_shares() {
        let times = [
            KernelTime {
                name: "conv_fwd_vec",
                calls: 6,
                ms: 3.0,
                bytes: 3e9,
                flops: 3e12,
            },
            KernelTime {
                name: "bn_apply_vec",
                calls: 6,
                ms: 1.0,
                bytes: 2e9,
                flops: 0.0,
            },
        ];
        let rows = shares(&times, 3);
        assert_eq!(rows[0].calls_per_step, 2.0);
        assert!((rows[0].ms_per_step - 1.0).abs() < 1e-12);
        assert!((rows[0].percent - 75.0).abs() < 1e-9 && (rows[1].percent - 25.0).abs() < 1e-9);
        // 3e12 FLOP in 3 ms = 1000 TFLOP/s; 2e9 B in 1 ms = 2000 GB/s.
        assert!((rows[0].tflops.unwrap() - 1000.0).abs() < 1e-6);
        assert!((rows[1].gb_per_s.unwrap() - 2000.0).abs() < 1e-6);
        assert_eq!(rows[1].tflops, None);
    }
}
