//! `birdtrain bench scaling --gpus 1,2,4,8`: data-parallel scaling, measured where it can be
//! and projected where it cannot.
//!
//! It reports the single-GPU step time (given with `--step-ms`, or measured), the gradient bytes
//! every rank all-reduces per step, the bucket plan, and per GPU count and interconnect the
//! ring all-reduce time, the part hidden behind backward, the exposed part and the projected
//! efficiency and images/s; the arithmetic is documented in [`crate::dist::scaling`].

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::dist::buckets::{BucketPlan, BucketSettings};
use crate::dist::launch::detect_cuda_devices;
use crate::dist::scaling::{
    project, Interconnect, ModelCost, Projection, StepProfile, NVLINK, PCIE,
};
use crate::model::{Arch, Graph, InputBatch, Network};

/// Flags of `birdtrain bench scaling`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchScalingArgs {
    /// GPU counts to report, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    pub gpus: Vec<usize>,
    /// Model architecture (resnet18/34/50/101/152, resnet8/20/56).
    #[arg(long, default_value = "resnet50")]
    pub model: String,
    /// Number of classes of the classifier.
    #[arg(long, default_value_t = 285)]
    pub classes: usize,
    /// Image side in pixels.
    #[arg(long, default_value_t = 224)]
    pub image_size: u32,
    /// Images per GPU per step.
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    /// Gradient bucket size in MiB.
    #[arg(long, default_value_t = 25.0)]
    pub bucket_mb: f64,
    /// Single-GPU step time in milliseconds (skips the measurement).
    #[arg(long)]
    pub step_ms: Option<f64>,
    /// Steps to time when measuring (after one warm-up step).
    #[arg(long, default_value_t = 3)]
    pub measure_steps: usize,
    /// Fraction of the step spent in backward (backward is about twice forward).
    #[arg(long, default_value_t = 0.62)]
    pub backward_share: f64,
    /// NVLink all-reduce bus bandwidth in GB/s (nccl-tests busbw).
    #[arg(long, default_value_t = 370.0)]
    pub nvlink_gbps: f64,
    /// PCIe all-reduce bus bandwidth in GB/s.
    #[arg(long, default_value_t = 25.0)]
    pub pcie_gbps: f64,
    /// Skip timing the bucketed NCCL all-reduce on the GPUs present.
    #[arg(long)]
    pub skip_allreduce: bool,
    /// All-reduce steps to time per GPU count (after one warm-up step).
    #[arg(long, default_value_t = 20)]
    pub allreduce_steps: usize,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// How the single-GPU step time was obtained.
#[derive(Debug, Clone, PartialEq)]
pub enum StepSource {
    /// `--step-ms`.
    Given,
    /// Timed on the CPU reference backend (no GPU backend in this path).
    MeasuredCpu {
        /// Steps timed.
        steps: usize,
    },
}

/// Everything the benchmark computed.
#[derive(Debug, Clone)]
pub struct ScalingReport {
    /// Single-GPU step time in seconds.
    pub step_s: f64,
    /// Where it came from.
    pub step_source: StepSource,
    /// Parameters of the model.
    pub parameters: usize,
    /// Gradient bytes all-reduced per step per rank.
    pub gradient_bytes: usize,
    /// Bucket count of the plan.
    pub buckets: usize,
    /// One projection per (interconnect, GPU count).
    pub projections: Vec<Projection>,
    /// Measured bucketed all-reduce time per step, per GPU count present (seconds).
    pub measured_allreduce: Vec<(usize, f64)>,
    /// Why nothing was measured, when nothing was.
    pub allreduce_note: Option<String>,
}

/// Times `steps` training steps of `net` on a synthetic batch (after one warm-up step).
pub fn measure_step<B: Backend>(
    net: &mut Network<B>,
    batch_size: usize,
    steps: usize,
) -> anyhow::Result<Duration> {
    let s = net.image_size() as usize;
    let pixels: Vec<u8> = (0..batch_size * s * s * 3)
        .map(|i| (i * 7 % 251) as u8)
        .collect();
    let labels: Vec<u32> = (0..batch_size as u32).collect();
    let classes = net.graph().num_classes() as u32;
    let labels: Vec<u32> = labels.iter().map(|l| l % classes).collect();
    let batch = InputBatch {
        pixels: &pixels,
        labels: &labels,
        len: batch_size,
        image_size: net.image_size(),
        augment: None,
        mix: None,
    };
    net.train_step(&batch).context("warm-up step")?;
    let start = Instant::now();
    for _ in 0..steps.max(1) {
        net.train_step(&batch).context("timed step")?;
    }
    Ok(start.elapsed() / steps.max(1) as u32)
}

fn links(args: &BenchScalingArgs) -> [Interconnect; 2] {
    [
        Interconnect {
            bus_bytes_per_s: args.nvlink_gbps * 1e9,
            ..NVLINK
        },
        Interconnect {
            bus_bytes_per_s: args.pcie_gbps * 1e9,
            ..PCIE
        },
    ]
}

/// Checks the numeric flags before any work: a bad one is a [`super::CliError::BadValue`]
/// naming it (usage error, exit code 2).
pub fn check(args: &BenchScalingArgs) -> Result<(), super::CliError> {
    use super::counts::{check_bench_classes, check_bench_image_size, check_positive, check_range};
    let zero = args.gpus.iter().find(|&&n| n == 0).map(ToString::to_string);
    if let Some(value) = zero.or_else(|| args.gpus.is_empty().then(String::new)) {
        return Err(super::CliError::BadValue {
            flag: "--gpus",
            value,
            hint: "GPU counts of at least 1, comma-separated, e.g. --gpus 1,2,4,8".into(),
        });
    }
    check_bench_classes(args.classes)?;
    check_bench_image_size(args.image_size)?;
    check_range(
        "--batch-size",
        args.batch_size,
        1,
        usize::MAX,
        "images per GPU per step",
    )?;
    check_positive(
        "--bucket-mb",
        args.bucket_mb,
        "the gradient bucket size in MiB, e.g. 25",
    )?;
    if let Some(ms) = args.step_ms {
        check_positive("--step-ms", ms, "the single-GPU step time in milliseconds")?;
    }
    check_range(
        "--measure-steps",
        args.measure_steps,
        1,
        usize::MAX,
        "steps to time",
    )?;
    if !(0.0..=1.0).contains(&args.backward_share) {
        return Err(super::CliError::BadValue {
            flag: "--backward-share",
            value: args.backward_share.to_string(),
            hint: "the fraction of the step spent in backward, from 0 to 1 (about 0.62)".into(),
        });
    }
    check_positive(
        "--nvlink-gbps",
        args.nvlink_gbps,
        "all-reduce bus bandwidth in GB/s",
    )?;
    check_positive(
        "--pcie-gbps",
        args.pcie_gbps,
        "all-reduce bus bandwidth in GB/s",
    )?;
    check_range(
        "--allreduce-steps",
        args.allreduce_steps,
        1,
        usize::MAX,
        "all-reduce steps to time",
    )?;
    Ok(())
}

/// Computes the report (measuring the step on the CPU backend when `--step-ms` is absent).
pub fn compute(args: &BenchScalingArgs) -> anyhow::Result<ScalingReport> {
    check(args)?;
    let arch: Arch = args
        .model
        .parse()
        .with_context(|| format!("unknown --model {:?}", args.model))?;
    let graph = Graph::new(arch, args.classes);
    let cost = ModelCost::from_graph(&graph, args.image_size, 4);
    let plan = BucketPlan::new(&cost.params, BucketSettings::f32_mb(args.bucket_mb))
        .context("planning gradient buckets (check --bucket-mb)")?;

    let (step_s, step_source) = match args.step_ms {
        Some(ms) if ms > 0.0 && ms.is_finite() => (ms / 1000.0, StepSource::Given),
        Some(ms) => bail!("--step-ms {ms} must be a positive number of milliseconds"),
        None => {
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            let backend = CpuBackend::new(threads).context("starting the CPU backend")?;
            let mut net = Network::new(backend, &graph, args.batch_size, args.image_size)
                .context("building the network for the measurement")?;
            let t = measure_step(&mut net, args.batch_size, args.measure_steps)?;
            (
                t.as_secs_f64(),
                StepSource::MeasuredCpu {
                    steps: args.measure_steps.max(1),
                },
            )
        }
    };
    let profile = StepProfile {
        step_s,
        backward_share: args.backward_share,
        batch_per_gpu: args.batch_size,
    };
    let mut projections = Vec::new();
    for link in links(args) {
        for &n in &args.gpus {
            projections.push(
                project(&plan, &cost.backward_weights, &profile, n, &link)
                    .context("projecting the step (check --backward-share and bandwidths)")?,
            );
        }
    }
    let (measured_allreduce, allreduce_note) = if args.skip_allreduce {
        (Vec::new(), Some("skipped (--skip-allreduce)".to_string()))
    } else {
        measure_allreduce_counts(&plan, &args.gpus, args.allreduce_steps)
    };
    Ok(ScalingReport {
        measured_allreduce,
        allreduce_note,
        step_s,
        step_source,
        parameters: graph.params().iter().map(|p| p.numel()).sum(),
        gradient_bytes: cost.gradient_bytes(),
        buckets: plan.buckets().len(),
        projections,
    })
}

/// The report as the table the command prints.
pub fn render(args: &BenchScalingArgs, r: &ScalingReport) -> String {
    let mut out = String::new();
    let source = match &r.step_source {
        StepSource::Given => "given with --step-ms".to_string(),
        StepSource::MeasuredCpu { steps } => format!(
            "measured on the CPU backend over {steps} steps; pass --step-ms with a GPU step time for GPU projections"
        ),
    };
    let _ = writeln!(
        out,
        "{} ({} classes, {} px), batch {} per GPU",
        args.model, args.classes, args.image_size, args.batch_size
    );
    let _ = writeln!(out, "step time, 1 GPU: {:.2} ms ({source})", r.step_s * 1e3);
    let _ = writeln!(
        out,
        "gradients: {:.2} M parameters, {:.1} MB per step (f32), {} bucket(s) of ~{} MiB",
        r.parameters as f64 / 1e6,
        r.gradient_bytes as f64 / 1e6,
        r.buckets,
        args.bucket_mb
    );
    let _ = writeln!(
        out,
        "backward window: {:.0}% of the step = {:.2} ms",
        args.backward_share * 100.0,
        r.step_s * args.backward_share * 1e3
    );
    let _ = writeln!(
        out,
        "\n{:<7} {:>5} {:>14} {:>11} {:>12} {:>11} {:>11} {:>10}",
        "link",
        "GPUs",
        "all-reduce ms",
        "hidden ms",
        "exposed ms",
        "step ms",
        "efficiency",
        "images/s"
    );
    for p in &r.projections {
        let _ = writeln!(
            out,
            "{:<7} {:>5} {:>14.3} {:>11.3} {:>12.3} {:>11.2} {:>10.1}% {:>10.0}",
            p.link,
            p.gpus,
            p.comm_s * 1e3,
            p.hidden_s * 1e3,
            p.exposed_s * 1e3,
            p.step_s * 1e3,
            p.efficiency * 100.0,
            p.images_per_s
        );
    }
    match (&r.allreduce_note, r.measured_allreduce.is_empty()) {
        (Some(note), true) => {
            let _ = writeln!(out, "\nmeasured all-reduce: none ({note})");
        }
        _ => {
            let _ = writeln!(
                out,
                "\nmeasured bucketed all-reduce per step (NCCL, this machine):"
            );
            for &(n, t) in &r.measured_allreduce {
                let bus = if n > 1 {
                    2.0 * (n as f64 - 1.0) / n as f64 * r.gradient_bytes as f64 / t / 1e9
                } else {
                    0.0
                };
                let _ = writeln!(
                    out,
                    "  {n} GPU(s): {:.3} ms{}",
                    t * 1e3,
                    if n > 1 {
                        format!(" (bus bandwidth {bus:.1} GB/s)")
                    } else {
                        " (one rank: the fixed cost of the collective path)".to_string()
                    }
                );
            }
        }
    }
    for p in r.projections.iter().filter(|p| p.gpus == 4) {
        let verdict = if p.efficiency >= 0.97 {
            "meets"
        } else {
            "misses"
        };
        let _ = writeln!(
            out,
            "{}: {:.1}% at 4 GPUs {verdict} the 97% goal",
            p.link,
            p.efficiency * 100.0
        );
    }
    out
}

fn to_json(r: &ScalingReport) -> serde_json::Value {
    serde_json::json!({
        "step_ms": r.step_s * 1e3,
        "step_source": format!("{:?}", r.step_source),
        "parameters": r.parameters,
        "gradient_bytes": r.gradient_bytes,
        "buckets": r.buckets,
        "measured_allreduce_ms": r.measured_allreduce.iter()
            .map(|&(n, t)| serde_json::json!({"gpus": n, "ms": t * 1e3}))
            .collect::<Vec<_>>(),
        "projections": r.projections.iter().map(|p| serde_json::json!({
            "link": p.link, "gpus": p.gpus, "allreduce_ms": p.comm_s * 1e3,
            "hidden_ms": p.hidden_s * 1e3, "exposed_ms": p.exposed_s * 1e3,
            "step_ms": p.step_s * 1e3, "efficiency": p.efficiency, "images_per_s": p.images_per_s,
        })).collect::<Vec<_>>(),
    })
}

/// Times the bucketed all-reduce for every requested GPU count the machine has; returns the
/// timings, or a note on why none could be taken.
fn measure_allreduce_counts(
    plan: &BucketPlan,
    counts: &[usize],
    steps: usize,
) -> (Vec<(usize, f64)>, Option<String>) {
    if let Err(e) = crate::dist::nccl::ensure_available() {
        return (Vec::new(), Some(e.to_string()));
    }
    let present = detect_cuda_devices().len();
    let mut out = Vec::new();
    let mut note = None;
    for &n in counts.iter().filter(|&&n| n <= present) {
        match measure_allreduce(plan, n, steps) {
            Ok(t) => out.push((n, t.as_secs_f64())),
            Err(e) => {
                note = Some(format!("{n} GPU(s): {e:#}"));
                break;
            }
        }
    }
    if out.is_empty() && note.is_none() {
        note = Some(format!(
            "no requested GPU count fits the {present} GPU(s) present"
        ));
    }
    (out, note)
}

/// Times `steps` steps of bucketed gradient all-reduce (every bucket of `plan`, in backward
/// order, as during training but without the backward compute) over the first `gpus` GPUs;
/// returns the slowest rank's mean time per step.
pub fn measure_allreduce(plan: &BucketPlan, gpus: usize, steps: usize) -> anyhow::Result<Duration> {
    use crate::cuda::GpuDevice;
    use crate::dist::buckets::GradientSync;
    use crate::dist::collective::{Collective, CollectiveError};
    use crate::dist::launch::LaunchPlan;
    use crate::dist::nccl::{new_unique_id, DeviceGrads, NcclCollective};
    use crate::dist::ranks::run_local_ranks;
    use crate::dist::rendezvous::{rendezvous, NodeInfo, StartPoint};
    use cudarc::driver::DevicePtr;

    let launch = LaunchPlan::single_node((0..gpus).collect());
    let me = NodeInfo {
        nodes: 1,
        node_rank: 0,
        local_gpus: gpus,
        fingerprint: 0,
        model: String::new(),
        start: StartPoint::Fresh,
    };
    let assignment = rendezvous(None, &me, Duration::from_secs(60), || {
        new_unique_id().map_err(|e| e.to_string())
    })?;
    let plan = plan.clone();
    let steps = steps.max(1);
    let times = run_local_ranks(
        &launch,
        &assignment,
        Duration::from_secs(120),
        move |rank| {
            let device = GpuDevice::open(rank.ordinal)?;
            let stream = device.stream().clone();
            let grads = stream.alloc_zeros::<f32>(plan.total_elements())?;
            let ptr = {
                let (p, _record) = grads.device_ptr(&stream);
                p
            };
            let mut buffer = DeviceGrads {
                ptr,
                len: plan.total_elements(),
            };
            let mut comm = NcclCollective::new(rank.comm, device.clone(), Duration::from_secs(120));
            let mut sync = GradientSync::new(plan.clone());
            let mut one_step = |comm: &mut NcclCollective| -> Result<(), CollectiveError> {
                sync.begin_step(1.0);
                for p in (0..plan.param_count()).rev() {
                    sync.grad_ready(comm, &mut buffer, p)?;
                }
                sync.finish_step(comm, &mut buffer)
            };
            one_step(&mut comm)?;
            stream.synchronize()?;
            let start = Instant::now();
            for _ in 0..steps {
                one_step(&mut comm)?;
            }
            stream.synchronize()?;
            comm.check()?;
            drop(grads);
            Ok(start.elapsed() / steps as u32)
        },
    )?;
    Ok(times.into_iter().max().unwrap_or_default())
}

/// Runs `birdtrain bench scaling`.
pub fn run(args: BenchScalingArgs) -> anyhow::Result<()> {
    if let Some(path) = &args.json {
        // Checked before the measurement: never a run folder's own file or a best/ folder.
        super::paths::Guarded {
            runs: Vec::new(),
            data: None,
        }
        .check_file("--json", path)?;
    }
    let devices = detect_cuda_devices();
    if devices.len() > 1 {
        eprintln!(
            "note: {} GPUs present; measured multi-GPU runs need the NCCL training path, which this \
             command does not drive yet, so the rows below are projections",
            devices.len()
        );
    }
    let report = compute(&args)?;
    // The file first: a reader that stops early (`| head`) ends the command at the table.
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&to_json(&report))?;
        std::fs::write(path, text).with_context(|| format!("writing --json {}", path.display()))?;
    }
    out!("{}", render(&args, &report));
    Ok(())
}
