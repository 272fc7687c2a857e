//! Batch norm fused into the convolutions around it (`Backend::bn_fusion`), on the CPU backend
//! (`CpuBackend::set_bn_fusion`): a network built on a fusing backend hands the statistics to
//! the convolution before each batch norm and the backward reductions, the ReLU mask and the
//! residual gradients to the convolution after it, and keeps some gradient buffers alive
//! longer. Its steps must compute what the separate passes compute (loss, every gradient,
//! running statistics, the outputs after the step) in every mode: batch statistics, frozen
//! statistics, synchronised replicas, mixed and augmented batches, a batch smaller than the
//! network's maximum; on basic blocks (resnet8, resnet18) and bottlenecks (resnet50). The
//! CUDA backend runs the same sequence with its fused kernels (tests/gpu/cuda_step.rs).

use std::time::Duration;

use birdtrain::backend::cpu::CpuBackend;
use birdtrain::dist::sync_bn::LocalBnGroup;
use birdtrain::model::{
    Arch, Augment, BnAllReduce, FusionPlan, Graph, InputBatch, Mix, ModelState, Network,
    NetworkConfig, Node, StepStats,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The reference kernels (f64 batch-norm reductions, no vector-width dependence): the
/// separate passes and the fused sequence then differ by little more than the f32 storage of
/// the moments, so no ReLU mask flips between them (a flip, where an activation sits within
/// rounding of zero, changes a gradient element outright), on any processor.
fn backend(seq: Sequence) -> CpuBackend {
    let mut b = CpuBackend::reference(2).unwrap();
    b.set_bn_fusion(seq != Sequence::Separate);
    b.set_conv_applies_bn(seq == Sequence::Applied);
    b.set_recompute_masks(seq == Sequence::Recomputed);
    b
}

/// How a network runs its batch norms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sequence {
    /// Each in its own passes.
    Separate,
    /// Fused into the convolutions around it (`set_bn_fusion`).
    Fused,
    /// Fused, and applied by the convolution that alone reads its output
    /// (`set_conv_applies_bn`): that output never stored.
    Applied,
    /// Fused, the data gradients recomputing the ReLU's mask of the batch norms without a
    /// residual from their input (`set_recompute_masks`): their output stored, not read there.
    Recomputed,
}

/// A network with batch-norm parameters and running statistics moved off their defaults
/// (some γ negative), so every term of the normalisation matters.
fn network(graph: &Graph, fused: bool, max_batch: usize, size: u32) -> Network<CpuBackend> {
    let seq = if fused {
        Sequence::Fused
    } else {
        Sequence::Separate
    };
    network_in(graph, seq, max_batch, size)
}

/// [`network`] running `seq`.
fn network_in(graph: &Graph, seq: Sequence, max_batch: usize, size: u32) -> Network<CpuBackend> {
    let mut net = Network::new(backend(seq), graph, max_batch, size).unwrap();
    net.set_config(NetworkConfig {
        label_smoothing: 0.1,
        ..NetworkConfig::default()
    });
    let mut state = ModelState::init(graph, 5);
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for (p, spec) in state.params.iter_mut().zip(graph.params()) {
        if spec.name.contains("bn") || spec.name.contains("downsample.1") {
            for v in p.iter_mut() {
                *v += rng.random_range(-0.6..0.6);
            }
        }
    }
    for b in state.buffers.iter_mut() {
        for v in b.iter_mut() {
            *v += rng.random_range(0.0..0.5);
        }
    }
    net.load_state(&state).unwrap();
    net
}

fn images(n: usize, size: u32, seed: u64) -> (Vec<u8>, Vec<u32>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let px = (0..n * (size * size * 3) as usize)
        .map(|_| rng.random_range(0..=255u8))
        .collect();
    let labels = (0..n).map(|i| (i % 3) as u32).collect();
    (px, labels)
}

/// Everything a step leaves: loss sums, gradients, the state (running statistics included)
/// and the eval-mode probabilities right after.
struct Outcome {
    stats: StepStats,
    grads: Vec<f32>,
    state: ModelState,
    probs: Vec<f32>,
}

fn run(
    net: &mut Network<CpuBackend>,
    batch: &InputBatch<'_>,
    sync: Option<&mut dyn BnAllReduce>,
) -> Outcome {
    let stats = net
        .train_step_synced(batch, &mut |_, _| Ok(()), sync)
        .unwrap();
    let grads = net.grads_f32().unwrap();
    let state = net.state().unwrap();
    let plain = InputBatch {
        augment: None,
        mix: None,
        ..*batch
    };
    let (_, probs) = net.eval_step(&plain).unwrap();
    Outcome {
        stats,
        grads,
        state,
        probs,
    }
}

/// The relative L2 error ‖got − want‖ / ‖want‖ of one tensor.
fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        diff += (f64::from(g) - f64::from(w)).powi(2);
        norm += f64::from(w).powi(2);
    }
    diff.sqrt() / norm.sqrt().max(1e-30)
}

/// Compares two outcomes: the loss to 1e-4 relative, the running statistics to 1e-4, and
/// every parameter gradient and the eval probabilities by relative L2 error ≤ `rel`. Returns
/// the worst gradient error.
fn compare(graph: &Graph, fused: &Outcome, separate: &Outcome, rel: f64) -> f64 {
    let (a, b) = (fused.stats, separate.stats);
    assert!(
        (a.loss_sum - b.loss_sum).abs() <= 1e-4 * b.loss_sum.abs().max(1.0),
        "loss: fused {} vs separate {}",
        a.loss_sum,
        b.loss_sum
    );
    assert_eq!(a.count, b.count);
    for ((spec, f), s) in graph
        .buffers()
        .iter()
        .zip(&fused.state.buffers)
        .zip(&separate.state.buffers)
    {
        let e = rel_l2(f, s);
        assert!(e <= 1e-4, "{}: fused vs separate {e:.2e}", spec.name);
    }
    let (offsets, _) = graph.param_offsets();
    let mut worst = 0.0f64;
    for (spec, &at) in graph.params().iter().zip(&offsets) {
        let r = at..at + spec.numel();
        let e = rel_l2(&fused.grads[r.clone()], &separate.grads[r]);
        assert!(
            e <= rel,
            "gradient of {}: fused vs separate {e:.2e} > {rel:.0e}",
            spec.name
        );
        worst = worst.max(e);
    }
    let e = rel_l2(&fused.probs, &separate.probs);
    assert!(e <= rel, "eval probabilities: fused vs separate {e:.2e}");
    worst
}

/// One step of `arch` fused and separate on the same batch (`n` of `max_batch` images),
/// compared with gradient tolerance `rel`.
fn both(
    arch: Arch,
    size: u32,
    n: usize,
    max_batch: usize,
    config: impl Fn(&mut NetworkConfig),
    mixed: bool,
    rel: f64,
) {
    let graph = Graph::new(arch, 3);
    let (px, labels) = images(n, size, 11);
    let augment: Vec<Augment> = (0..n)
        .map(|i| Augment {
            dy: (i % 3) as i32 - 1,
            dx: 1 - (i % 2) as i32,
            flip: i % 2 == 0,
            ..Augment::default()
        })
        .collect();
    let batch = InputBatch {
        pixels: &px,
        labels: &labels,
        len: n,
        image_size: size,
        augment: mixed.then_some(&augment[..]),
        mix: mixed.then_some(Mix::Blend { lambda: 0.7 }),
    };
    let out = [true, false].map(|fused| {
        let mut net = network(&graph, fused, max_batch, size);
        let mut c = net.config();
        config(&mut c);
        net.set_config(c);
        run(&mut net, &batch, None)
    });
    let worst = compare(&graph, &out[0], &out[1], rel);
    eprintln!(
        "{arch} {size}px batch {n}/{max_batch} mixed={mixed}: worst gradient error {worst:.2e}"
    );
}

#[test]
fn fused_steps_match_separate_ones_on_basic_blocks() {
    // resnet8: identity and downsampling basic blocks, the stem's batch norm read by a block.
    both(Arch::ResNet8, 8, 4, 4, |_| {}, false, 1e-5);
    // A batch smaller than the network's, mixed and augmented.
    both(Arch::ResNet8, 8, 3, 5, |_| {}, true, 1e-5);
    // Frozen statistics: the forward takes no moments, the backward still fuses.
    both(Arch::ResNet8, 8, 4, 4, |c| c.freeze_bn = true, false, 1e-5);
    // resnet18: the max pool between the stem and the first block. (At least 4×4 pixels at
    // the last stage: a batch norm over a handful of rows is so ill-conditioned that f32
    // rounding differences grow through the layers.)
    both(Arch::ResNet18, 64, 3, 3, |_| {}, false, 1e-4);
}

#[test]
fn fused_steps_match_separate_ones_on_bottlenecks() {
    // 53 batch norms over few rows (48 at the 4×4 stage) amplify the rounding of the
    // moments on the way down: ~1e-2 in the first layers, as much as the fast kernels differ
    // from the reference ones there; a missed residual, mask or statistic is O(1).
    both(Arch::ResNet50, 64, 3, 4, |_| {}, true, 5e-2);
}

#[test]
fn the_fused_network_takes_the_fused_ops_and_the_separate_one_does_not() {
    // Without this, the comparisons above would pass with the fusion never taken.
    let graph = Graph::new(Arch::ResNet8, 3);
    let bns = graph
        .nodes()
        .iter()
        .filter(|n| matches!(n, Node::BatchNorm { .. }))
        .count();
    let (px, labels) = images(2, 8, 5);
    let batch = InputBatch {
        pixels: &px,
        labels: &labels,
        len: 2,
        image_size: 8,
        augment: None,
        mix: None,
    };
    let calls = |fused: bool| {
        let mut net = network(&graph, fused, 2, 8);
        net.backend().set_profiling(true);
        net.train_step(&batch).unwrap();
        let profile = net.backend().take_profile();
        let count = |name: &str| {
            profile
                .iter()
                .find(|o| o.name == name)
                .map_or(0, |o| o.calls)
        };
        (count("bn_moments"), count("bn_grad_finish"))
    };
    // Every batch norm gets its moments from its convolution; every block's convolutions but
    // the shortcuts' finish a batch norm's gradient (resnet8: 3 blocks × 2, less nothing: the
    // stem's batch norm is read by layer1.0.conv1).
    assert_eq!(calls(true), (bns as u64, 6));
    assert_eq!(calls(false), (0, 0));
}

#[test]
fn a_fused_step_is_bitwise_repeatable() {
    let graph = Graph::new(Arch::ResNet8, 3);
    let (px, labels) = images(3, 8, 2);
    let batch = InputBatch {
        pixels: &px,
        labels: &labels,
        len: 3,
        image_size: 8,
        augment: None,
        mix: None,
    };
    let a = run(&mut network(&graph, true, 3, 8), &batch, None);
    let b = run(&mut network(&graph, true, 3, 8), &batch, None);
    assert_eq!(a.stats, b.stats);
    assert!(a
        .grads
        .iter()
        .zip(&b.grads)
        .all(|(x, y)| x.to_bits() == y.to_bits()));
    assert_eq!(a.state, b.state);
}

/// One synchronised step of `arch` at `size` px on replicas of `split` images each, fused or
/// not: each replica's outcome.
fn synced_replicas(arch: Arch, size: u32, split: &[usize], fused: bool) -> Vec<Outcome> {
    let seq = if fused {
        Sequence::Fused
    } else {
        Sequence::Separate
    };
    synced_replicas_in(arch, size, split, seq)
}

/// [`synced_replicas`] running `seq`.
fn synced_replicas_in(arch: Arch, size: u32, split: &[usize], seq: Sequence) -> Vec<Outcome> {
    let graph = Graph::new(arch, 3);
    let (px, labels) = images(split.iter().sum(), size, 21);
    let per = (size * size * 3) as usize;
    let mut group = LocalBnGroup::new(split.len(), Duration::from_secs(60)).into_iter();
    std::thread::scope(|s| {
        let mut start = 0;
        let handles: Vec<_> = split
            .iter()
            .map(|&n| {
                let (p, l) = (
                    &px[start * per..(start + n) * per],
                    &labels[start..start + n],
                );
                start += n;
                let mut reducer = group.next().unwrap();
                let graph = &graph;
                s.spawn(move || {
                    let mut net = network_in(graph, seq, n, size);
                    let batch = InputBatch {
                        pixels: p,
                        labels: l,
                        len: n,
                        image_size: size,
                        augment: None,
                        mix: None,
                    };
                    run(&mut net, &batch, Some(&mut reducer))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn synchronised_replicas_fused_match_synchronised_replicas_separate() {
    // Two replicas of unequal share with synchronised batch norm: the moments from the
    // convolutions feed the cross-replica sums, the prepared backward (the dgrad epilogues'
    // local Σg·x̂, Σg) the global reductions its input gradient is written from. resnet18:
    // the stem's batch norm, applied by the max pool, normalises with the global statistics
    // and its prepared backward (the pool's Σg·x̂, Σg) is summed over the replicas too.
    for (arch, size, rel) in [(Arch::ResNet8, 8, 1e-4), (Arch::ResNet18, 64, 1e-4)] {
        let graph = Graph::new(arch, 3);
        let fused = synced_replicas(arch, size, &[3, 2], true);
        let separate = synced_replicas(arch, size, &[3, 2], false);
        for (f, s) in fused.iter().zip(&separate) {
            compare(&graph, f, s, rel);
        }
    }
}

#[test]
fn the_max_pool_applies_the_stem_batch_norm_in_every_mode() {
    // resnet18's stem batch norm is applied by the max pool: batch and frozen statistics in a
    // mixed, augmented batch smaller than the network's (the eval probabilities of `compare`:
    // eval mode). (Three images: with two, the last stage's batch norms over 8 rows amplify
    // the moments' rounding to ~1e-2 in conv1's gradient, with or without the pool fused.)
    both(Arch::ResNet18, 64, 3, 4, |_| {}, true, 1e-4);
    both(Arch::ResNet18, 64, 3, 4, |c| c.freeze_bn = true, true, 1e-4);
}

#[test]
fn the_stem_batch_norm_output_is_neither_stored_nor_written() {
    // Fused, the max pool reads the stem convolution's output and applies the batch norm
    // itself: the batch norm's forward only finalizes its statistics (no bytes of its own:
    // the moments come from the convolution), the pool ops are the fused ones, and the
    // network holds no buffer for the batch norm's output.
    let graph = Graph::new(Arch::ResNet18, 3);
    let (n, size) = (2usize, 32u32);
    let (px, labels) = images(n, size, 9);
    let batch = InputBatch {
        pixels: &px,
        labels: &labels,
        len: n,
        image_size: size,
        augment: None,
        mix: None,
    };
    let dims = graph.value_dims(size);
    let bn_elements = |k: usize| match graph.nodes()[k] {
        Node::BatchNorm {
            input, channels, ..
        } => n * dims[input].h * dims[input].w * channels,
        _ => unreachable!("a batch norm"),
    };
    let bns: Vec<usize> = (0..graph.nodes().len())
        .filter(|&k| matches!(graph.nodes()[k], Node::BatchNorm { .. }))
        .collect();
    let stem = bns[0];
    let stem_output = match graph.nodes()[stem] {
        Node::BatchNorm { output, .. } => dims[output].per_image(),
        _ => unreachable!("a batch norm"),
    };
    let step = |fused: bool| {
        let mut net = network(&graph, fused, n, size);
        net.backend().set_profiling(true);
        net.train_step(&batch).unwrap();
        let profile = net.backend().take_profile();
        let calls = |name: &str| {
            profile
                .iter()
                .find(|o| o.name == name)
                .map_or(0, |o| o.calls)
        };
        let pools = [
            "maxpool_fwd",
            "maxpool_bwd",
            "maxpool_bn_fwd",
            "maxpool_bn_bwd",
        ]
        .map(calls);
        let bn_fwd_bytes: f64 = profile
            .iter()
            .filter(|o| o.name == "bn_fwd")
            .map(|o| o.bytes)
            .sum();
        (pools, bn_fwd_bytes, net.elements_per_image())
    };
    let (fused, separate) = (step(true), step(false));
    assert_eq!(fused.0, [0, 0, 1, 1], "fused pool ops");
    assert_eq!(separate.0, [1, 1, 0, 0], "separate pool ops");
    // Separate, every batch norm reads its input once more for its statistics, and the
    // stem's reads its input and writes its output; fused, neither.
    let statistics: usize = bns.iter().map(|&k| bn_elements(k)).sum();
    let want = 4.0 * (statistics + 2 * bn_elements(stem)) as f64;
    assert_eq!(separate.1 - fused.1, want, "bn_fwd bytes");
    // The stem output's activation is gone (the gradient plan takes no more either).
    assert!(
        fused.2 + stem_output <= separate.2,
        "elements per image: fused {}, separate {}, the stem's output {stem_output}",
        fused.2,
        separate.2
    );
}

#[test]
fn a_synchronised_fused_step_takes_each_statistic_from_its_convolution() {
    // The synced step's local sums must come from the convolutions' moments (the statistics
    // pass over x leaves the synced step too), not from a second pass over x: the CPU's
    // profile counts x once more for every batch norm that reduces x itself. One replica
    // (its sum is its own values), fused and separate, every bn_fwd byte counted.
    let graph = Graph::new(Arch::ResNet8, 3);
    let (n, size) = (3usize, 8u32);
    let (px, labels) = images(n, size, 7);
    let batch = InputBatch {
        pixels: &px,
        labels: &labels,
        len: n,
        image_size: size,
        augment: None,
        mix: None,
    };
    let bn_fwd_bytes = |fused: bool| -> f64 {
        let mut net = network(&graph, fused, n, size);
        let mut reducer = LocalBnGroup::new(1, Duration::from_secs(60)).pop().unwrap();
        net.backend().set_profiling(true);
        net.train_step_synced(&batch, &mut |_, _| Ok(()), Some(&mut reducer))
            .unwrap();
        let profile = net.backend().take_profile();
        let calls = |name: &str| {
            profile
                .iter()
                .find(|o| o.name == name)
                .map_or(0, |o| o.calls)
        };
        let bns = graph
            .nodes()
            .iter()
            .filter(|node| matches!(node, Node::BatchNorm { .. }))
            .count() as u64;
        // Two forward ops per synchronised batch norm (the local statistics, then the
        // normalisation with the global ones); moments from every convolution before one.
        assert_eq!(calls("bn_fwd"), 2 * bns, "fused {fused}");
        assert_eq!(calls("bn_moments"), if fused { bns } else { 0 });
        profile
            .iter()
            .filter(|o| o.name == "bn_fwd")
            .map(|o| o.bytes)
            .sum()
    };
    // The statistics pass each fused batch norm leaves out: one read of its input.
    let dims = graph.value_dims(size);
    let plan = FusionPlan::of(&graph);
    let left_out: f64 = graph
        .nodes()
        .iter()
        .enumerate()
        .filter(|(k, _)| plan.stats_for.contains(&Some(*k)))
        .map(|(_, node)| match *node {
            Node::BatchNorm {
                input, channels, ..
            } => 4.0 * (n * dims[input].h * dims[input].w * channels) as f64,
            _ => unreachable!("statistics are for batch norms"),
        })
        .sum();
    assert!(left_out > 0.0);
    let (fused, separate) = (bn_fwd_bytes(true), bn_fwd_bytes(false));
    assert_eq!(
        separate - fused,
        left_out,
        "bn_fwd bytes: fused {fused}, separate {separate}"
    );
}

/// Requires two outcomes to have the same bits: loss sums, gradients, state, probabilities.
fn assert_same_bits(what: &str, a: &Outcome, b: &Outcome) {
    assert_eq!(a.stats, b.stats, "{what}: step statistics");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(bits(&a.grads) == bits(&b.grads), "{what}: gradients");
    assert_eq!(a.state, b.state, "{what}: state");
    assert!(
        bits(&a.probs) == bits(&b.probs),
        "{what}: eval probabilities"
    );
}

#[test]
fn convolutions_applying_the_inner_batch_norms_change_no_bit_in_any_mode() {
    // The applied sequence computes each inner batch norm's output as the convolution reads
    // it, with the separate pass's arithmetic, and recomputes its ReLU mask from its input:
    // on the CPU every result has the fused sequence's bits. Basic blocks (resnet8; resnet18
    // with the max pool), bottlenecks (resnet50); batch and frozen statistics; a mixed,
    // augmented batch smaller than the network's; eval mode (the probabilities).
    for (arch, size, n, max_batch, freeze, mixed) in [
        (Arch::ResNet8, 8, 4, 4, false, false),
        (Arch::ResNet8, 8, 3, 5, false, true),
        (Arch::ResNet8, 8, 4, 4, true, false),
        (Arch::ResNet18, 32, 3, 4, false, true),
        (Arch::ResNet50, 32, 2, 2, false, false),
    ] {
        let graph = Graph::new(arch, 3);
        let (px, labels) = images(n, size, 13);
        let augment: Vec<Augment> = (0..n)
            .map(|i| Augment {
                dy: (i % 3) as i32 - 1,
                flip: i % 2 == 0,
                ..Augment::default()
            })
            .collect();
        let batch = InputBatch {
            pixels: &px,
            labels: &labels,
            len: n,
            image_size: size,
            augment: mixed.then_some(&augment[..]),
            mix: mixed.then_some(Mix::Blend { lambda: 0.6 }),
        };
        let out = [Sequence::Applied, Sequence::Fused].map(|seq| {
            let mut net = network_in(&graph, seq, max_batch, size);
            let mut c = net.config();
            c.freeze_bn = freeze;
            net.set_config(c);
            run(&mut net, &batch, None)
        });
        assert_same_bits(
            &format!("{arch} freeze={freeze} mixed={mixed}"),
            &out[0],
            &out[1],
        );
    }
    // Synchronised replicas: the applied batch norms normalise with the global statistics.
    let applied = synced_replicas_in(Arch::ResNet8, 8, &[3, 2], Sequence::Applied);
    let fused = synced_replicas_in(Arch::ResNet8, 8, &[3, 2], Sequence::Fused);
    for (a, f) in applied.iter().zip(&fused) {
        assert_same_bits("synchronised resnet8", a, f);
    }
}

#[test]
fn recomputed_masks_change_no_bit_and_are_recomputed_only_without_a_residual() {
    // The data gradient after a batch norm recomputes its mask from x, γ and β where the
    // network marks the stored output recomputable (`y_recomputable`: no residual entered
    // it), with the separate pass's arithmetic: every result has the fused sequence's bits.
    // A residual batch norm marked recomputable would lose its residual from the mask.
    for (arch, size, n, max_batch, freeze, mixed) in [
        (Arch::ResNet8, 8, 3, 5, false, true),
        (Arch::ResNet8, 8, 4, 4, true, false),
        (Arch::ResNet50, 32, 2, 2, false, false),
    ] {
        let graph = Graph::new(arch, 3);
        let (px, labels) = images(n, size, 17);
        let batch = InputBatch {
            pixels: &px,
            labels: &labels,
            len: n,
            image_size: size,
            augment: None,
            mix: mixed.then_some(Mix::Blend { lambda: 0.6 }),
        };
        let out = [Sequence::Recomputed, Sequence::Fused].map(|seq| {
            let mut net = network_in(&graph, seq, max_batch, size);
            let mut c = net.config();
            c.freeze_bn = freeze;
            net.set_config(c);
            net.backend().set_profiling(true);
            let outcome = run(&mut net, &batch, None);
            let recomputations = net
                .backend()
                .take_profile()
                .iter()
                .find(|o| o.name == "bn_apply")
                .map_or(0, |o| o.calls);
            (outcome, recomputations)
        });
        assert_same_bits(
            &format!("{arch} freeze={freeze} mixed={mixed}"),
            &out[0].0,
            &out[1].0,
        );
        // One recomputation per batch norm without a residual that a data gradient finishes:
        // resnet8's basic blocks have one each (bn1) and its stem's is read by layer1.0.conv1;
        // resnet50's bottlenecks have two (bn1, bn2), its stem's is the max pool's.
        let inner = match arch {
            Arch::ResNet8 => 3 + 1,
            _ => 2 * 16,
        };
        assert_eq!(
            (out[0].1, out[1].1),
            (inner, 0),
            "{arch}: masks recomputed (recomputed, fused)"
        );
    }
}

#[test]
fn the_inner_batch_norm_outputs_are_neither_stored_nor_written() {
    // Applied, each inner batch norm's forward only finalizes its statistics (no output
    // written), its convolution applies it on each of its three reads (forward, weight
    // gradient, the data gradient's mask: `bn_apply`), and the network holds no buffer for
    // its output.
    let graph = Graph::new(Arch::ResNet8, 3);
    let (n, size) = (2usize, 8u32);
    let (px, labels) = images(n, size, 9);
    let batch = InputBatch {
        pixels: &px,
        labels: &labels,
        len: n,
        image_size: size,
        augment: None,
        mix: None,
    };
    let plan = FusionPlan::of(&graph).with_convs_applying(&graph);
    let inner: Vec<usize> = plan.conv_applies.iter().flatten().copied().collect();
    assert_eq!(inner.len(), 3, "one per basic block");
    let dims = graph.value_dims(size);
    let outputs: usize = inner
        .iter()
        .map(|&k| match graph.nodes()[k] {
            Node::BatchNorm { output, .. } => dims[output].per_image(),
            _ => unreachable!("a batch norm"),
        })
        .sum();
    let step = |seq: Sequence| {
        let mut net = network_in(&graph, seq, n, size);
        net.backend().set_profiling(true);
        net.train_step(&batch).unwrap();
        let profile = net.backend().take_profile();
        let calls = profile
            .iter()
            .find(|o| o.name == "bn_apply")
            .map_or(0, |o| o.calls);
        (calls, net.elements_per_image())
    };
    let (applied, fused) = (step(Sequence::Applied), step(Sequence::Fused));
    assert_eq!(
        applied.0,
        3 * inner.len() as u64,
        "applications of the inner batch norms"
    );
    assert_eq!(fused.0, 0, "the fused sequence stores them");
    assert!(
        applied.1 + outputs <= fused.1,
        "elements per image: applied {}, fused {}, the inner outputs {outputs}",
        applied.1,
        fused.1
    );
}
