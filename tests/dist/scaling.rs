//! Scaling arithmetic against hand-computed cases, and the `bench scaling` report.

use birdtrain::cli::bench_scaling::{compute, render, BenchScalingArgs, StepSource};
use birdtrain::dist::buckets::{BucketPlan, BucketSettings, ParamSpec};
use birdtrain::dist::scaling::{
    project, ring_allreduce_s, Interconnect, ModelCost, ScalingError, StepProfile, NVLINK,
};
use birdtrain::model::{Arch, Graph};
use clap::Parser;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1.0)
}

/// Two 400-byte parameters, one per bucket: bucket 0 = p1 (last layer), bucket 1 = p0.
fn two_buckets() -> BucketPlan {
    let params = [
        ParamSpec {
            name: "p0".into(),
            bytes: 400,
        },
        ParamSpec {
            name: "p1".into(),
            bytes: 400,
        },
    ];
    let settings = BucketSettings {
        target_bytes: 400,
        element_bytes: 4,
        align_bytes: 4,
    };
    BucketPlan::new(&params, settings).unwrap()
}

fn link(bus: f64) -> Interconnect {
    Interconnect {
        name: "test",
        bus_bytes_per_s: bus,
        latency_s: 0.0,
    }
}

const PROFILE: StepProfile = StepProfile {
    step_s: 10.0,
    backward_share: 0.5,
    batch_per_gpu: 8,
};

#[test]
fn ring_allreduce_time_is_two_n_minus_one_over_n_bytes_over_busbw() {
    assert_eq!(ring_allreduce_s(1, 1e9, &NVLINK), 0.0);
    // 2·(2−1)/2 · 400 B / 400 B/s = 1 s
    assert!(close(ring_allreduce_s(2, 400.0, &link(400.0)), 1.0));
    // 2·3/4 · 400 / 400 = 1.5 s
    assert!(close(ring_allreduce_s(4, 400.0, &link(400.0)), 1.5));
    // 100 MB over 8 NVLink GPUs: 10 µs + 1.75 · 1e8 / 370e9 s
    assert!(close(
        ring_allreduce_s(8, 1e8, &NVLINK),
        10e-6 + 1.75e8 / 370e9
    ));
}

#[test]
fn overlap_hides_all_but_the_last_bucket_when_the_link_keeps_up() {
    let plan = two_buckets();
    // Equal backward weights: bucket 0 ready at 2.5 s (half of the 5 s backward), bucket 1 at
    // 5 s. Two GPUs: 1 s per bucket. Bucket 0 runs 2.5–3.5, bucket 1 5–6: 1 s exposed.
    let p = project(&plan, &[1.0, 1.0], &PROFILE, 2, &link(400.0)).unwrap();
    assert!(close(p.comm_s, 2.0));
    assert!(close(p.exposed_s, 1.0));
    assert!(close(p.hidden_s, 1.0));
    assert!(close(p.step_s, 11.0));
    assert!(close(p.efficiency, 10.0 / 11.0));
    assert!(close(p.images_per_s, 16.0 / 11.0));
    // Four GPUs: 1.5 s per bucket, bucket 1 5–6.5.
    let p = project(&plan, &[1.0, 1.0], &PROFILE, 4, &link(400.0)).unwrap();
    assert!(close(p.exposed_s, 1.5) && close(p.hidden_s, 1.5));
    assert!(close(p.efficiency, 10.0 / 11.5));
}

#[test]
fn a_slow_link_backs_the_buckets_up() {
    let plan = two_buckets();
    // p0 does 3/4 of backward: bucket 0 (p1) is ready at 1.25 s. At 100 B/s a bucket takes
    // 4 s: bucket 0 runs 1.25–5.25; bucket 1 is ready at 5 s but starts at 5.25, ends 9.25.
    let p = project(&plan, &[3.0, 1.0], &PROFILE, 2, &link(100.0)).unwrap();
    assert!(close(p.comm_s, 8.0));
    assert!(close(p.exposed_s, 4.25));
    assert!(close(p.hidden_s, 3.75));
    assert!(close(p.step_s, 14.25));
}

#[test]
fn one_gpu_has_nothing_to_hide_and_latency_counts_per_bucket() {
    let plan = two_buckets();
    let p = project(&plan, &[1.0, 1.0], &PROFILE, 1, &NVLINK).unwrap();
    assert_eq!((p.comm_s, p.exposed_s, p.efficiency), (0.0, 0.0, 1.0));
    let slow = Interconnect {
        name: "lat",
        bus_bytes_per_s: 400.0,
        latency_s: 0.25,
    };
    let p = project(&plan, &[1.0, 1.0], &PROFILE, 2, &slow).unwrap();
    assert!(close(p.comm_s, 2.5));
    assert!(close(p.exposed_s, 1.25));
}

#[test]
fn bad_inputs_are_errors() {
    let plan = two_buckets();
    let bad_share = StepProfile {
        backward_share: 1.5,
        ..PROFILE
    };
    assert!(matches!(
        project(&plan, &[1.0, 1.0], &bad_share, 2, &NVLINK),
        Err(ScalingError::Invalid { .. })
    ));
    assert!(matches!(
        project(&plan, &[1.0], &PROFILE, 2, &NVLINK),
        Err(ScalingError::WeightCount {
            expected: 2,
            got: 1
        })
    ));
    assert!(project(&plan, &[1.0, 1.0], &PROFILE, 2, &link(0.0)).is_err());
}

#[test]
fn model_cost_covers_every_parameter_of_the_graph() {
    let graph = Graph::new(Arch::ResNet18, 10);
    let cost = ModelCost::from_graph(&graph, 64, 4);
    let numel: usize = graph.params().iter().map(|p| p.numel()).sum();
    assert_eq!(cost.gradient_bytes(), 4 * numel);
    assert_eq!(cost.params.len(), graph.params().len());
    assert_eq!(cost.backward_weights.len(), graph.params().len());
    assert!(
        cost.backward_weights.iter().all(|&w| w > 0.0),
        "every parameter costs something"
    );
    // Convolutions dominate: the first conv alone outweighs all batch-norm parameters.
    let conv1 = graph.param_index("conv1.weight").unwrap();
    let bn1 = graph.param_index("bn1.weight").unwrap();
    assert!(cost.backward_weights[conv1] > 10.0 * cost.backward_weights[bn1]);
}

#[derive(Parser)]
struct Wrapper {
    #[command(flatten)]
    args: BenchScalingArgs,
}

fn args(line: &[&str]) -> BenchScalingArgs {
    Wrapper::parse_from(std::iter::once("bench").chain(line.iter().copied())).args
}

#[test]
fn report_with_a_given_step_time() {
    let a = args(&[
        "--model",
        "resnet50",
        "--classes",
        "285",
        "--step-ms",
        "200",
        "--gpus",
        "1,4,8",
    ]);
    let r = compute(&a).unwrap();
    assert_eq!(r.step_source, StepSource::Given);
    assert!(close(r.step_s, 0.2));
    // ResNet-50 with a 285-class head: ~24.1 M parameters, ~96 MB of f32 gradients.
    assert!(
        (23_000_000..25_000_000).contains(&r.parameters),
        "{}",
        r.parameters
    );
    assert_eq!(r.gradient_bytes, 4 * r.parameters);
    assert!(r.buckets >= 4);
    assert_eq!(r.projections.len(), 6, "3 GPU counts x 2 links");
    let nvlink4 = r
        .projections
        .iter()
        .find(|p| p.link == "NVLink" && p.gpus == 4)
        .unwrap();
    let pcie4 = r
        .projections
        .iter()
        .find(|p| p.link == "PCIe" && p.gpus == 4)
        .unwrap();
    assert!(nvlink4.efficiency > pcie4.efficiency);
    assert!(nvlink4.efficiency >= 0.97, "{nvlink4:?}");
    // Without a GPU and NCCL nothing is measured, and the report says why.
    assert!(!r.measured_allreduce.is_empty() || r.allreduce_note.is_some());
    let text = render(&a, &r);
    assert!(text.contains("measured"), "{text}");
    assert!(text.contains("at 4 GPUs"), "{text}");
    assert!(text.contains("given with --step-ms"), "{text}");
}

#[test]
fn report_measures_the_cpu_step_without_step_ms() {
    let a = args(&[
        "--model",
        "resnet8",
        "--classes",
        "4",
        "--image-size",
        "8",
        "--batch-size",
        "2",
        "--measure-steps",
        "1",
        "--gpus",
        "2",
        "--skip-allreduce",
    ]);
    let r = compute(&a).unwrap();
    assert_eq!(r.step_source, StepSource::MeasuredCpu { steps: 1 });
    assert!(r.step_s > 0.0);
    assert!(r.measured_allreduce.is_empty());
    assert_eq!(
        r.allreduce_note.as_deref(),
        Some("skipped (--skip-allreduce)")
    );
}

#[test]
fn bad_flags_are_errors() {
    assert!(compute(&args(&["--gpus", "0", "--step-ms", "1"])).is_err());
    assert!(compute(&args(&["--step-ms=-3"])).is_err());
    let err = compute(&args(&["--model", "vgg16", "--step-ms", "1"])).unwrap_err();
    assert!(format!("{err:#}").contains("vgg16"), "{err:#}");
}
