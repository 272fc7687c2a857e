//! The CPU backend's fused in-place optimizer against the host optimizer (`optim::Optimizer`):
//! the same rules in the same arithmetic order, so the same bits, while it updates the
//! network's own tensors (OHWI convolutions) and the host one flat torchvision-layout copies.

use birdtrain::backend::cpu::{CpuBackend, CpuOptimizer, Kernels, SimdLevel, UpdateRule};
use birdtrain::backend::BackendError;
use birdtrain::cuda::optim::to_backend_layout;
use birdtrain::model::{Arch, Graph, InputBatch, Network};
use birdtrain::optim::{Hyper, Optimizer, OptimizerKind};

/// The host optimizer's kind as the backend's rule (what the training loop will do).
fn rule(kind: OptimizerKind, h: Hyper) -> UpdateRule {
    match kind {
        OptimizerKind::Sgd { momentum, nesterov } => UpdateRule::Sgd { momentum, nesterov },
        OptimizerKind::Adam | OptimizerKind::AdamW => UpdateRule::Adam {
            beta1: h.beta1,
            beta2: h.beta2,
            eps: h.eps,
            decoupled: kind == OptimizerKind::AdamW,
        },
    }
}

fn fused_for(graph: &Graph, kind: OptimizerKind, h: Hyper) -> CpuOptimizer {
    CpuOptimizer::new(
        rule(kind, h),
        graph.params().iter().map(|p| p.numel()).collect(),
        graph
            .params()
            .iter()
            .map(|p| if p.decay { h.weight_decay } else { 0.0 })
            .collect(),
    )
    .unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn levels() -> Vec<SimdLevel> {
    let mut v = vec![SimdLevel::best(), SimdLevel::Portable];
    v.dedup();
    v
}

/// `n` deterministic images of `size`² pixels (a pattern set by `mul` and `modulus`) and labels.
fn images(n: usize, size: u32, mul: usize, modulus: usize) -> (Vec<u8>, Vec<u32>) {
    let px = (0..n * (size as usize).pow(2) * 3)
        .map(|i| (i * mul % modulus) as u8)
        .collect();
    (px, (0..n as u32).collect())
}

#[test]
fn fused_updates_equal_the_host_optimizer_bit_for_bit() {
    let graph = Graph::new(Arch::ResNet8, 10);
    let (n, size) = (4usize, 16u32);
    let (px, labels) = images(n, size, 37, 251);
    let batch = InputBatch {
        pixels: &px,
        labels: &labels,
        len: n,
        image_size: size,
        augment: None,
        mix: None,
    };
    let hyper = Hyper {
        weight_decay: 1e-2,
        ..Hyper::default()
    };
    for level in levels() {
        for kind in [
            OptimizerKind::Sgd {
                momentum: 0.9,
                nesterov: false,
            },
            OptimizerKind::Sgd {
                momentum: 0.9,
                nesterov: true,
            },
            OptimizerKind::Sgd {
                momentum: 0.0,
                nesterov: false,
            },
            OptimizerKind::Adam,
            OptimizerKind::AdamW,
        ] {
            let backend = CpuBackend::with_options(2, level, Kernels::Fast).unwrap();
            let mut net = Network::new(backend.clone(), &graph, n, size).unwrap();
            let mut host = Optimizer::new(kind, hyper, graph.params());
            let mut master = net.params_f32().unwrap();
            let mut fused = fused_for(&graph, kind, hyper);
            for step in 0..3 {
                let lr = 0.05 / (step + 1) as f32;
                net.train_step(&batch).unwrap();
                host.step(&mut master, &net.grads_f32().unwrap(), lr)
                    .unwrap();
                let (grads, mut params) = net.grads_and_params_mut();
                fused.step(&backend, &mut params, &grads, lr, 1.0).unwrap();
                assert_eq!(
                    bits(&net.params_f32().unwrap()),
                    bits(&master),
                    "{level} {kind:?} step {step}"
                );
            }
            let (m, v, steps) = fused.state();
            let (hm, hv) = host.moments();
            assert_eq!(steps, host.steps());
            assert_eq!(bits(m), bits(&to_backend_layout(graph.params(), hm)));
            if hv.is_empty() {
                assert!(v.is_empty());
            } else {
                assert_eq!(bits(v), bits(&to_backend_layout(graph.params(), hv)));
            }
        }
    }
}

#[test]
fn gradient_scale_and_decay_rules_apply_per_tensor() {
    // Two tensors, one with decay: scale 0.5 on doubled gradients equals the host on the
    // plain ones, and the tensor without decay ignores the weight decay.
    let backend = CpuBackend::new(2).unwrap();
    let sizes = vec![37usize, 70_001];
    let mut fused = CpuOptimizer::new(
        UpdateRule::Sgd {
            momentum: 0.9,
            nesterov: true,
        },
        sizes.clone(),
        vec![0.0, 0.1],
    )
    .unwrap();
    let p0: Vec<Vec<f32>> = sizes
        .iter()
        .map(|&n| (0..n).map(|i| (i as f32 * 0.37).sin()).collect())
        .collect();
    let g: Vec<Vec<f32>> = sizes
        .iter()
        .map(|&n| (0..n).map(|i| (i as f32 * 0.11).cos()).collect())
        .collect();
    let doubled: Vec<Vec<f32>> = g
        .iter()
        .map(|t| t.iter().map(|x| x * 2.0).collect())
        .collect();
    let mut p = p0.clone();
    let mut refs: Vec<&mut Vec<f32>> = p.iter_mut().collect();
    let grefs: Vec<&Vec<f32>> = doubled.iter().collect();
    fused.step(&backend, &mut refs, &grefs, 0.1, 0.5).unwrap();
    for (t, wd) in [(0, 0.0f32), (1, 0.1)] {
        for i in [0, 5, sizes[t] - 1] {
            let gi = g[t][i] + wd * p0[t][i];
            let m = gi; // first step: the buffer starts at zero
            let want = p0[t][i] - 0.1 * (gi + 0.9 * m);
            assert_eq!(p[t][i].to_bits(), want.to_bits(), "tensor {t} element {i}");
        }
    }
}

#[test]
fn bad_calls_are_errors_that_name_the_problem() {
    let backend = CpuBackend::new(1).unwrap();
    let rule = UpdateRule::Adam {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        decoupled: true,
    };
    let err = CpuOptimizer::new(rule, vec![3, 4], vec![0.0]).unwrap_err();
    assert!(err.to_string().contains("weight-decay"), "{err}");
    let mut opt = CpuOptimizer::new(rule, vec![3, 4], vec![0.0, 0.1]).unwrap();
    let mut a = vec![0.0f32; 3];
    let mut b = vec![0.0f32; 5];
    let (ga, gb) = (vec![1.0f32; 3], vec![1.0f32; 5]);
    let err = opt
        .step(&backend, &mut [&mut a, &mut b], &[&ga, &gb], 0.1, 1.0)
        .unwrap_err();
    assert!(matches!(err, BackendError::Shape { .. }));
    assert!(err.to_string().contains("tensor 1"), "{err}");
    let err = opt
        .step(&backend, &mut [&mut a], &[&ga], 0.1, 1.0)
        .unwrap_err();
    assert!(err.to_string().contains("1 parameter"), "{err}");
    let mut b = vec![0.0f32; 4];
    let gb = vec![1.0f32; 4];
    let err = opt
        .step(&backend, &mut [&mut a, &mut b], &[&ga, &gb], f32::NAN, 1.0)
        .unwrap_err();
    assert!(err.to_string().contains("learning rate"), "{err}");
    assert_eq!(opt.steps(), 0, "a refused step changes nothing");
    assert!(a.iter().chain(&b).all(|&x| x == 0.0));
    let err = opt.set_state(vec![0.0; 7], vec![0.0; 6], 3).unwrap_err();
    assert!(err.to_string().contains("set_state"), "{err}");
    opt.set_state(vec![0.0; 7], vec![0.0; 7], 3).unwrap();
    assert_eq!(opt.steps(), 3);
}

/// The CPU rank's optimizer (what every CPU rank of the training loop uses): it steps the
/// network's own tensors from the averaged flat gradient buffer (parameters at their bucket
/// ranges, with gaps), equals the host optimizer bit for bit, and its state survives the
/// checkpoint format (to_host → load_host) exactly.
#[test]
fn the_cpu_rank_optimizer_steps_in_place_from_the_flat_buffer_and_round_trips_its_state() {
    use birdtrain::optim::{ConvOrder, CpuRankOptimizer, ParamLayout, RankOptimizer};
    let graph = Graph::new(Arch::ResNet8, 10);
    let (n, size) = (4usize, 16u32);
    let (px, labels) = images(n, size, 53, 241);
    let batch = InputBatch {
        pixels: &px,
        labels: &labels,
        len: n,
        image_size: size,
        augment: None,
        mix: None,
    };
    // Offsets with gaps, as a bucket plan lays them out.
    let mut offsets = Vec::new();
    let mut len = 0;
    for p in graph.params() {
        len += 3;
        offsets.push(len);
        len += p.numel();
    }
    let layout = ParamLayout::with_offsets(graph.params(), offsets, len, ConvOrder::Backend);
    let hyper = Hyper {
        weight_decay: 1e-2,
        ..Hyper::default()
    };
    for kind in [
        OptimizerKind::Sgd {
            momentum: 0.9,
            nesterov: true,
        },
        OptimizerKind::AdamW,
    ] {
        let backend = CpuBackend::new(2).unwrap();
        let mut net = Network::new(backend.clone(), &graph, n, size).unwrap();
        let mut host = Optimizer::new(kind, hyper, graph.params());
        let mut master = net.params_f32().unwrap();
        let mut opt =
            CpuRankOptimizer::new(kind, hyper, graph.params(), layout.clone(), backend.clone())
                .unwrap();
        let flat_grads = |net: &Network<CpuBackend>| {
            let mut flat = vec![0.0f32; len];
            for (i, g) in net.grad_tensors().into_iter().enumerate() {
                flat[layout.range(i)].copy_from_slice(g);
            }
            flat
        };
        for step in 0..3 {
            let lr = 0.05 / (step + 1) as f32;
            net.train_step(&batch).unwrap();
            host.step(&mut master, &net.grads_f32().unwrap(), lr)
                .unwrap();
            let grads = flat_grads(&net);
            opt.step(&mut net, Some(&grads), lr).unwrap();
            assert_eq!(
                bits(&opt.master(&net).unwrap()),
                bits(&master),
                "{kind:?} {step}"
            );
            assert_eq!(bits(&net.params_f32().unwrap()), bits(&master));
        }
        // The checkpoint's state, loaded into a fresh optimizer, continues identically.
        let saved = opt.to_host().unwrap();
        assert_eq!(saved.steps(), host.steps());
        assert_eq!(bits(saved.moments().0), bits(host.moments().0));
        let mut fresh =
            CpuRankOptimizer::new(kind, hyper, graph.params(), layout.clone(), backend.clone())
                .unwrap();
        fresh.load_host(&saved).unwrap();
        let mut twin = Network::new(backend.clone(), &graph, n, size).unwrap();
        twin.load_state(&net.state().unwrap()).unwrap();
        net.train_step(&batch).unwrap();
        twin.train_step(&batch).unwrap();
        let grads = flat_grads(&net);
        opt.step(&mut net, Some(&grads), 0.01).unwrap();
        fresh.step(&mut twin, Some(&grads), 0.01).unwrap();
        assert_eq!(
            bits(&net.params_f32().unwrap()),
            bits(&twin.params_f32().unwrap())
        );
        // A gradient buffer of the wrong length is an error, not a panic.
        assert!(opt.step(&mut net, Some(&grads[1..]), 0.01).is_err());
    }
}

/// `--clip-grad-norm`: the CPU rank optimizer scales the averaged gradients by PyTorch's
/// coefficient min(1, max_norm / (‖g‖ + 1e-6)) over all of them, before momentum and decay;
/// a bound above the norm changes nothing.
#[test]
fn clipping_scales_every_gradient_by_the_global_norms_coefficient() {
    use birdtrain::optim::{ConvOrder, CpuRankOptimizer, ParamLayout, RankOptimizer};
    let graph = Graph::new(Arch::ResNet8, 10);
    let (n, size) = (4usize, 16u32);
    let (px, labels) = images(n, size, 29, 211);
    let batch = InputBatch {
        pixels: &px,
        labels: &labels,
        len: n,
        image_size: size,
        augment: None,
        mix: None,
    };
    let layout = ParamLayout::graph(graph.params(), ConvOrder::Backend);
    let kind = OptimizerKind::Sgd {
        momentum: 0.9,
        nesterov: false,
    };
    let hyper = Hyper {
        weight_decay: 1e-2,
        ..Hyper::default()
    };
    let backend = CpuBackend::new(2).unwrap();
    let run = |max_norm: Option<f32>, prescale: f64| {
        let mut net = Network::new(backend.clone(), &graph, n, size).unwrap();
        let mut opt =
            CpuRankOptimizer::new(kind, hyper, graph.params(), layout.clone(), backend.clone())
                .unwrap();
        opt.set_max_grad_norm(max_norm);
        net.train_step(&batch).unwrap();
        let mut flat = vec![0.0f32; layout.len()];
        for (i, g) in net.grad_tensors().into_iter().enumerate() {
            flat[layout.range(i)].copy_from_slice(g);
        }
        let norm = flat
            .iter()
            .map(|&g| f64::from(g).powi(2))
            .sum::<f64>()
            .sqrt();
        flat.iter_mut()
            .for_each(|g| *g = (f64::from(*g) * prescale) as f32);
        opt.step(&mut net, Some(&flat), 0.1).unwrap();
        (opt.master(&net).unwrap(), norm)
    };
    let (plain, norm) = run(None, 1.0);
    assert!(norm > 0.1, "the gradients have a norm to clip ({norm})");
    let (loose, _) = run(Some((2.0 * norm) as f32), 1.0);
    assert_eq!(
        bits(&loose),
        bits(&plain),
        "a bound above the norm clips nothing"
    );
    let max_norm = (norm / 4.0) as f32;
    let coef = f64::from(max_norm) / (norm + 1e-6);
    let (clipped, _) = run(Some(max_norm), 1.0);
    let (by_hand, _) = run(None, coef);
    assert_ne!(bits(&clipped), bits(&plain));
    // Within f32 rounding: the fused update scales inside its multiply-add, the hand-made
    // gradients were rounded to f32 after scaling.
    for (a, b) in clipped.iter().zip(&by_hand) {
        assert!((a - b).abs() <= 1e-6 + 1e-5 * b.abs(), "{a} vs {b}");
    }
}
