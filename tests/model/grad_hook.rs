//! The gradient-ready hook of `Network::train_step_with`, on the CPU backend: it fires once
//! per parameter, in backward order (close enough to the bucket planner's order that buckets
//! launch while backward runs), and hands over each gradient in its final state.

use birdtrain::backend::cpu::CpuBackend;
use birdtrain::backend::Backend;
use birdtrain::cuda::optim::to_backend_layout;
use birdtrain::dist::buckets::{specs_from_numel, BucketPlan, BucketSettings, BucketTracker};
use birdtrain::model::{Arch, Graph, InputBatch, ModelError, Network, NetworkConfig};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

struct Setup {
    graph: Graph,
    net: Network<CpuBackend>,
    pixels: Vec<u8>,
    labels: Vec<u32>,
    size: u32,
}

fn setup(arch: Arch, size: u32, n: usize) -> Setup {
    let graph = Graph::new(arch, 5);
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let pixels: Vec<u8> = (0..n * (size * size) as usize * 3)
        .map(|_| rng.random())
        .collect();
    let labels: Vec<u32> = (0..n as u32).map(|i| i % 5).collect();
    let mut net = Network::new(CpuBackend::new(2).unwrap(), &graph, n, size).unwrap();
    net.set_config(NetworkConfig {
        label_smoothing: 0.1,
        ..NetworkConfig::default()
    });
    Setup {
        graph,
        net,
        pixels,
        labels,
        size,
    }
}

fn batch<'a>(pixels: &'a [u8], labels: &'a [u32], size: u32) -> InputBatch<'a> {
    InputBatch {
        pixels,
        labels,
        len: labels.len(),
        image_size: size,
        augment: None,
        mix: None,
    }
}

/// Runs one step, recording (param, gradient as the hook saw it) per call.
fn step_recording(s: &mut Setup) -> (f64, Vec<(usize, Vec<f32>)>) {
    // CPU tensors are plain vectors: a second backend reads them without touching the net.
    let reader = CpuBackend::new(1).unwrap();
    let mut seen = Vec::new();
    let batch = batch(&s.pixels, &s.labels, s.size);
    let stats = s
        .net
        .train_step_with(&batch, &mut |p, g| {
            seen.push((p, reader.download(g)?));
            Ok(())
        })
        .unwrap();
    (stats.loss_sum, seen)
}

fn check_once_each_and_final(arch: Arch, size: u32) {
    let mut s = setup(arch, size, 3);
    let (_, seen) = step_recording(&mut s);
    let count = s.graph.params().len();
    // Exactly once per parameter, in the documented order.
    let order: Vec<usize> = seen.iter().map(|(p, _)| *p).collect();
    assert_eq!(order, s.net.grad_ready_order());
    let mut sorted = order.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..count).collect::<Vec<_>>());
    // Each gradient the hook saw is bit-identical to the step's final gradient.
    let final_grads = to_backend_layout(s.graph.params(), &s.net.grads_f32().unwrap());
    let (offsets, _) = s.graph.param_offsets();
    let mut nonzero = 0;
    for (p, g) in &seen {
        let spec = &s.graph.params()[*p];
        let want = &final_grads[offsets[*p]..offsets[*p] + spec.numel()];
        assert_eq!(
            g.as_slice(),
            want,
            "gradient of {} changed after the hook",
            spec.name
        );
        nonzero += usize::from(g.iter().any(|&v| v != 0.0));
    }
    assert!(nonzero > count / 2, "gradients should mostly be non-zero");
}

#[test]
fn the_hook_sees_every_final_gradient_once_resnet8() {
    check_once_each_and_final(Arch::ResNet8, 8);
}

#[test]
fn the_hook_sees_every_final_gradient_once_resnet18() {
    check_once_each_and_final(Arch::ResNet18, 32);
}

#[test]
fn train_step_and_train_step_with_compute_the_same_step() {
    let mut a = setup(Arch::ResNet8, 8, 4);
    let mut b = setup(Arch::ResNet8, 8, 4);
    let la = a
        .net
        .train_step(&batch(&a.pixels, &a.labels, a.size))
        .unwrap()
        .loss_sum;
    let (lb, _) = step_recording(&mut b);
    assert_eq!(la, lb);
    assert_eq!(a.net.grads_f32().unwrap(), b.net.grads_f32().unwrap());
}

/// The hook order against the bucket planner: every bucket launches, the first ones long
/// before backward ends (the overlap), and none waits more than a few reports after its own
/// last parameter (the hook order is the planner's up to a downsampling block's shortcut).
fn check_bucket_overlap(arch: Arch, bucket_mb: f64, min_buckets: usize) {
    let s = setup(arch, if arch.is_cifar() { 8 } else { 32 }, 1);
    let order = s.net.grad_ready_order();
    let names: Vec<(String, usize)> = s
        .graph
        .params()
        .iter()
        .map(|p| (p.name.clone(), p.numel()))
        .collect();
    let plan = BucketPlan::new(
        &specs_from_numel(&names, 4),
        BucketSettings::f32_mb(bucket_mb),
    )
    .unwrap();
    let buckets = plan.buckets().len();
    assert!(buckets >= min_buckets, "{buckets} buckets");
    // Position of each parameter in the planner's order (reverse forward order).
    let plan_pos: Vec<usize> = (0..order.len()).map(|p| order.len() - 1 - p).collect();
    let max_shift = order
        .iter()
        .enumerate()
        .map(|(i, &p)| i.abs_diff(plan_pos[p]))
        .max()
        .unwrap();
    assert!(
        max_shift <= 4,
        "hook order strays {max_shift} places from the plan's"
    );
    let mut tracker = BucketTracker::new(&plan);
    let mut complete_at = vec![0usize; buckets];
    for (i, &p) in order.iter().enumerate() {
        complete_at[plan.bucket_of(p)] = i;
    }
    let mut launched_at = vec![usize::MAX; buckets];
    for (i, &p) in order.iter().enumerate() {
        for k in tracker.mark_ready(p).unwrap() {
            launched_at[k] = i;
        }
    }
    assert!(tracker.all_launched());
    for k in 0..buckets {
        assert!(launched_at[k] >= complete_at[k]);
        assert!(
            launched_at[k] - complete_at[k] <= 4,
            "bucket {k} complete at report {} but launched at {}",
            complete_at[k],
            launched_at[k]
        );
    }
    // All but the last bucket are on the wire before the last gradient is reported.
    let last = order.len() - 1;
    let early = launched_at.iter().filter(|&&i| i < last).count();
    assert_eq!(early, buckets - 1);
}

#[test]
fn buckets_launch_during_backward_resnet8() {
    check_bucket_overlap(Arch::ResNet8, 0.02, 4);
}

#[test]
fn buckets_launch_during_backward_resnet50_at_25_mb() {
    check_bucket_overlap(Arch::ResNet50, 25.0, 3);
}

#[test]
fn a_failing_hook_stops_backward_and_names_the_parameter() {
    let mut s = setup(Arch::ResNet8, 8, 2);
    let mut calls = 0;
    let batch = batch(&s.pixels, &s.labels, s.size);
    let e = s
        .net
        .train_step_with(&batch, &mut |_, _| {
            calls += 1;
            if calls == 3 {
                Err("all-reduce launch refused".into())
            } else {
                Ok(())
            }
        })
        .unwrap_err();
    assert_eq!(calls, 3, "backward went on after the hook failed");
    let third = s.net.grad_ready_order()[2];
    let name = s.graph.params()[third].name.clone();
    match &e {
        ModelError::GradHook { param, .. } => assert_eq!(param, &name),
        other => panic!("unexpected error {other}"),
    }
    assert!(e.to_string().contains("all-reduce launch refused"), "{e}");
    // No gradients are offered after a failed step.
    assert!(s.net.grads_f32().is_err());
}
