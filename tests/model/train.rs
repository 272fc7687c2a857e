//! Whole-network behaviour on the CPU backend: a tiny network overfits, runs are bit-exact,
//! eval probabilities are a distribution, and replicas with frozen BN match one big batch.

use birdtrain::backend::cpu::CpuBackend;
use birdtrain::model::{
    Arch, Augment, Graph, InputBatch, ModelState, Network, NetworkConfig, StepStats,
};
use birdtrain::optim::{Hyper, Optimizer, OptimizerKind};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Synthetic images whose class is visible: a bright square in a class-dependent corner.
fn synth(n: usize, s: usize, classes: usize, seed: u64) -> (Vec<u8>, Vec<u32>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut px = vec![0u8; n * s * s * 3];
    let mut labels = Vec::with_capacity(n);
    for i in 0..n {
        let label = (i % classes) as u32;
        labels.push(label);
        let img = &mut px[i * s * s * 3..(i + 1) * s * s * 3];
        for v in img.iter_mut() {
            *v = rng.random_range(0..80);
        }
        let (oy, ox) = ((label as usize / 2) * s / 2, (label as usize % 2) * s / 2);
        for y in oy..oy + s / 2 {
            for x in ox..ox + s / 2 {
                img[(y * s + x) * 3 + (label as usize % 3)] = 250;
            }
        }
    }
    (px, labels)
}

fn sgd(graph: &Graph) -> Optimizer {
    Optimizer::new(
        OptimizerKind::Sgd {
            momentum: 0.9,
            nesterov: false,
        },
        Hyper {
            weight_decay: 5e-4,
            ..Hyper::default()
        },
        graph.params(),
    )
}

fn train(
    net: &mut Network<CpuBackend>,
    opt: &mut Optimizer,
    batch: &InputBatch<'_>,
    steps: usize,
    lr: f32,
) -> Vec<f64> {
    let mut losses = Vec::new();
    let mut params = net.params_f32().unwrap();
    for _ in 0..steps {
        let stats = net.train_step(batch).unwrap();
        losses.push(stats.mean_loss());
        let grads = net.grads_f32().unwrap();
        opt.step(&mut params, &grads, lr).unwrap();
        net.set_params_f32(&params).unwrap();
    }
    losses
}

#[test]
fn resnet8_overfits_a_few_images() {
    let graph = Graph::new(Arch::ResNet8, 4);
    let (px, labels) = synth(8, 16, 4, 1);
    let mut net = Network::new(CpuBackend::new(2).unwrap(), &graph, 8, 16).unwrap();
    net.load_state(&ModelState::init(&graph, 7)).unwrap();
    let batch = InputBatch {
        pixels: &px,
        labels: &labels,
        len: 8,
        image_size: 16,
        augment: None,
        mix: None,
    };
    let mut opt = sgd(&graph);
    let losses = train(&mut net, &mut opt, &batch, 40, 0.05);
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(
        last < first * 0.1,
        "loss did not fall enough: {first} → {last}"
    );
    let (stats, probs) = net.eval_step(&batch).unwrap();
    assert_eq!(stats.correct_top1, 8, "eval after overfitting: {stats:?}");
    for row in probs.chunks(4) {
        let sum: f32 = row.iter().sum();
        assert!((sum - 1.0).abs() < 1e-5, "probabilities sum to {sum}");
    }
}

#[test]
fn two_runs_give_identical_bits() {
    let run = || {
        let graph = Graph::new(Arch::ResNet8, 3);
        let (px, labels) = synth(6, 16, 3, 5);
        let aug: Vec<Augment> = (0..6i32)
            .map(|i| Augment {
                dy: i % 3 - 1,
                dx: 1 - i % 2,
                flip: i % 2 == 0,
                erase: None,
            })
            .collect();
        let mut net = Network::new(CpuBackend::new(2).unwrap(), &graph, 6, 16).unwrap();
        net.load_state(&ModelState::init(&graph, 3)).unwrap();
        let batch = InputBatch {
            pixels: &px,
            labels: &labels,
            len: 6,
            image_size: 16,
            augment: Some(&aug),
            mix: None,
        };
        let mut opt = sgd(&graph);
        train(&mut net, &mut opt, &batch, 3, 0.1);
        net.state().unwrap()
    };
    let a = run();
    let b = run();
    let bits = |s: &ModelState| -> Vec<u32> {
        s.params
            .iter()
            .chain(&s.buffers)
            .flatten()
            .map(|v| v.to_bits())
            .collect()
    };
    assert_eq!(bits(&a), bits(&b));
}

#[test]
fn replicas_with_frozen_bn_match_one_big_batch() {
    let graph = Graph::new(Arch::ResNet8, 3);
    let (px, labels) = synth(8, 16, 3, 9);
    let state = ModelState::init(&graph, 11);
    let config = NetworkConfig {
        freeze_bn: true,
        ..NetworkConfig::default()
    };
    let img = 16 * 16 * 3;
    // One replica, batch 8.
    let mut big = Network::new(CpuBackend::new(2).unwrap(), &graph, 8, 16).unwrap();
    big.load_state(&state).unwrap();
    big.set_config(config);
    let full = InputBatch {
        pixels: &px,
        labels: &labels,
        len: 8,
        image_size: 16,
        augment: None,
        mix: None,
    };
    let big_stats = big.train_step(&full).unwrap();
    let big_grads = big.grads_f32().unwrap();
    // Two replicas, batch 4 each, gradients averaged weighted by count.
    let mut avg = vec![0.0f32; big_grads.len()];
    let mut loss = 0.0;
    for r in 0..2 {
        let mut net = Network::new(CpuBackend::new(1).unwrap(), &graph, 4, 16).unwrap();
        net.load_state(&state).unwrap();
        net.set_config(config);
        let part = InputBatch {
            pixels: &px[r * 4 * img..(r + 1) * 4 * img],
            labels: &labels[r * 4..(r + 1) * 4],
            len: 4,
            image_size: 16,
            augment: None,
            mix: None,
        };
        let stats = net.train_step(&part).unwrap();
        loss += stats.loss_sum;
        for (a, g) in avg.iter_mut().zip(net.grads_f32().unwrap()) {
            *a += g * 4.0 / 8.0;
        }
    }
    assert!((loss - big_stats.loss_sum).abs() < 1e-4 * big_stats.loss_sum.abs().max(1.0));
    let scale = big_grads.iter().fold(0.0f32, |m, g| m.max(g.abs()));
    for (i, (a, b)) in avg.iter().zip(&big_grads).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * scale + 1e-3 * b.abs(),
            "grad {i}: replicas {a} vs one batch {b}"
        );
    }
}

#[test]
fn imagenet_family_runs_and_resnet18_gradients_check() {
    // resnet50 (Bottleneck, stem with max pool) executes forward and backward at 32×32.
    let (px, labels) = synth(2, 32, 4, 3);
    let batch = InputBatch {
        pixels: &px,
        labels: &labels,
        len: 2,
        image_size: 32,
        augment: None,
        mix: None,
    };
    let g50 = Graph::new(Arch::ResNet50, 4);
    let mut net = Network::new(CpuBackend::new(2).unwrap(), &g50, 2, 32).unwrap();
    let stats = net.train_step(&batch).unwrap();
    assert!(stats.loss_sum.is_finite());
    let grads = net.grads_f32().unwrap();
    assert_eq!(grads.len(), g50.param_count());
    assert!(grads.iter().all(|g| g.is_finite()) && grads.iter().any(|g| *g != 0.0));
    // resnet18 with frozen BN (smooth in the parameters apart from ReLU/max-pool kinks):
    // a few entries of the stem and of layer4 against central differences.
    let g18 = Graph::new(Arch::ResNet18, 4);
    let mut net = Network::new(CpuBackend::new(2).unwrap(), &g18, 2, 32).unwrap();
    net.set_config(NetworkConfig {
        freeze_bn: true,
        ..NetworkConfig::default()
    });
    let params = net.params_f32().unwrap();
    net.train_step(&batch).unwrap();
    let grads = net.grads_f32().unwrap();
    let (offsets, _) = g18.param_offsets();
    for name in [
        "conv1.weight",
        "layer1.0.conv1.weight",
        "layer4.1.conv2.weight",
        "fc.weight",
    ] {
        let i = g18.param_index(name).unwrap();
        let seg = &grads[offsets[i]..offsets[i] + g18.params()[i].numel()];
        let j = (0..seg.len())
            .max_by(|&a, &b| seg[a].abs().total_cmp(&seg[b].abs()))
            .unwrap();
        let k = offsets[i] + j;
        let h = 1e-3f32;
        let mut p = params.clone();
        p[k] += h;
        net.set_params_f32(&p).unwrap();
        let lp = net.train_step(&batch).unwrap().mean_loss();
        p[k] -= 2.0 * h;
        net.set_params_f32(&p).unwrap();
        let lm = net.train_step(&batch).unwrap().mean_loss();
        let num = (lp - lm) / (2.0 * f64::from(h));
        let a = f64::from(grads[k]);
        assert!(
            (a - num).abs() <= 4e-3 + 5e-2 * num.abs(),
            "{name}[{j}]: analytic {a} vs numeric {num}"
        );
    }
}

#[test]
fn tensor_accessors_expose_backend_layout() {
    let graph = Graph::new(Arch::ResNet8, 3);
    let (px, labels) = synth(3, 8, 3, 4);
    let mut net = Network::new(CpuBackend::new(1).unwrap(), &graph, 3, 8).unwrap();
    let batch = InputBatch {
        pixels: &px,
        labels: &labels,
        len: 3,
        image_size: 8,
        augment: None,
        mix: None,
    };
    net.train_step(&batch).unwrap();
    let flat = net.grads_f32().unwrap();
    let (offsets, _) = graph.param_offsets();
    // fc.weight is stored as in torch; conv weights are OHWI in the backend.
    let fc = graph.param_index("fc.weight").unwrap();
    let tensors: Vec<Vec<f32>> = net.grad_tensors().into_iter().cloned().collect();
    assert_eq!(tensors[fc], flat[offsets[fc]..offsets[fc] + 3 * 64]);
    let conv = graph.param_index("layer1.0.conv1.weight").unwrap(); // [16,16,3,3]
    let (o, i, ky, kx) = (5, 7, 2, 1);
    let oihw = flat[offsets[conv] + ((o * 16 + i) * 3 + ky) * 3 + kx];
    assert_eq!(tensors[conv][((o * 3 + ky) * 3 + kx) * 16 + i], oihw);
    // halve every gradient in place, as an all-reduce would average them
    for g in net.grad_tensors_mut() {
        g.iter_mut().for_each(|v| *v *= 0.5);
    }
    let halved = net.grads_f32().unwrap();
    assert!(halved.iter().zip(&flat).all(|(h, f)| *h == f * 0.5));
    // a device-style update writes parameters in place
    let before = net.params_f32().unwrap();
    let (grads, params) = net.grads_and_params_mut();
    for (p, g) in params.into_iter().zip(grads) {
        p.iter_mut().zip(g).for_each(|(p, g)| *p -= g);
    }
    let after = net.params_f32().unwrap();
    assert!(after
        .iter()
        .zip(&before)
        .zip(&halved)
        .all(|((a, b), g)| *a == b - g));
}

#[test]
fn gradient_buffers_are_shared() {
    // One buffer per live gradient, not per value: well under twice the activations.
    let graph = Graph::new(Arch::ResNet50, 10);
    let net = Network::new(CpuBackend::new(1).unwrap(), &graph, 1, 64).unwrap();
    let acts = graph.activation_elements(64);
    let total = net.elements_per_image();
    eprintln!(
        "resnet50 at 64: {acts} activation + {} gradient elements per image",
        total - acts
    );
    assert!(
        total > acts && total < acts * 3 / 2,
        "{total} elements for {acts} activations"
    );
}

/// `eval_step_mirrored` averages the probabilities of the images as stored and mirrored
/// (checked against mirroring the pixels by hand), and its statistics are those of the
/// averaged probabilities; `of_probabilities` gives the backend's loss from its own
/// probabilities, label smoothing included (tolerance 1e-4 relative: f32 probabilities).
#[test]
fn test_time_mirroring_averages_both_views() {
    let (s, n, classes) = (16usize, 6usize, 4usize);
    let graph = Graph::new(Arch::ResNet8, classes);
    let (px, labels) = synth(n, s, classes, 3);
    let mut net = Network::new(CpuBackend::new(2).unwrap(), &graph, n, s as u32).unwrap();
    net.load_state(&ModelState::init(&graph, 11)).unwrap();
    net.set_config(NetworkConfig {
        label_smoothing: 0.1,
        ..net.config()
    });
    let batch = InputBatch {
        pixels: &px,
        labels: &labels,
        len: n,
        image_size: s as u32,
        augment: None,
        mix: None,
    };
    let (plain_stats, plain) = net.eval_step(&batch).unwrap();
    let again = StepStats::of_probabilities(&plain, &labels, classes, 0.1);
    assert!(
        (again.loss_sum - plain_stats.loss_sum).abs() <= 1e-4 * plain_stats.loss_sum.abs(),
        "{} vs {}",
        again.loss_sum,
        plain_stats.loss_sum
    );
    assert_eq!(
        (again.correct_top1, again.correct_top5),
        (plain_stats.correct_top1, plain_stats.correct_top5)
    );
    let mut mirrored_px = px.clone();
    for row in mirrored_px.chunks_exact_mut(s * 3) {
        let pixels: Vec<[u8; 3]> = row
            .chunks_exact(3)
            .rev()
            .map(|p| [p[0], p[1], p[2]])
            .collect();
        row.copy_from_slice(&pixels.concat());
    }
    let (_, by_hand) = net
        .eval_step(&InputBatch {
            pixels: &mirrored_px,
            ..batch
        })
        .unwrap();
    let (stats, both) = net.eval_step_mirrored(&batch).unwrap();
    for ((a, b), m) in plain.iter().zip(&by_hand).zip(&both) {
        assert!((0.5 * (a + b) - m).abs() < 1e-6, "{a} {b} {m}");
    }
    assert!(plain != both, "the mirrored view changed the answer");
    assert_eq!(
        stats,
        StepStats::of_probabilities(&both, &labels, classes, 0.1)
    );
    assert_eq!(stats.count, n);
    // A batch that is augmented already is refused rather than flipped twice.
    let aug = vec![Augment::default(); n];
    let err = net
        .eval_step_mirrored(&InputBatch {
            augment: Some(&aug),
            ..batch
        })
        .unwrap_err();
    assert!(err.to_string().contains("augmentation"), "{err}");
}

/// A step replayed from a CUDA graph keeps the host's record as the step itself does: the
/// batch counters advance (not with frozen batch norm), the running statistics are the
/// kernels' (here: untouched), and the gradients are there to read.
#[test]
fn a_replayed_step_counts_like_a_step() {
    let graph = Graph::new(Arch::ResNet8, 4);
    let (px, labels) = synth(4, 16, 4, 3);
    let input = InputBatch {
        pixels: &px,
        labels: &labels,
        len: 4,
        image_size: 16,
        augment: None,
        mix: None,
    };
    for freeze_bn in [false, true] {
        let config = NetworkConfig {
            freeze_bn,
            ..NetworkConfig::default()
        };
        let make = || {
            let mut net = Network::new(CpuBackend::new(1).unwrap(), &graph, 4, 16).unwrap();
            net.load_state(&ModelState::init(&graph, 1)).unwrap();
            net.set_config(config);
            net
        };
        let (mut stepped, mut replayed) = (make(), make());
        let before = replayed.buffers().unwrap();
        stepped.train_step(&input).unwrap();
        replayed.replayed_train_step(4);
        let counters = |net: &Network<CpuBackend>| -> Vec<f32> {
            let buffers = net.buffers().unwrap();
            graph
                .buffers()
                .iter()
                .zip(&buffers)
                .filter(|(spec, _)| spec.name.ends_with("num_batches_tracked"))
                .map(|(_, b)| b[0])
                .collect()
        };
        let want = if freeze_bn { 0.0 } else { 1.0 };
        assert!(counters(&stepped).iter().all(|&c| c == want));
        assert_eq!(
            counters(&replayed),
            counters(&stepped),
            "freeze_bn {freeze_bn}"
        );
        // Only the counters moved on the host.
        let after = replayed.buffers().unwrap();
        for ((spec, b), a) in graph.buffers().iter().zip(&before).zip(&after) {
            if !spec.name.ends_with("num_batches_tracked") {
                assert_eq!(b, a, "{}", spec.name);
            }
        }
        assert!(replayed.grads_f32().is_ok(), "the gradients are readable");
    }
}
