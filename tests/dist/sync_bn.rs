//! Synchronised batch norm on CPU replicas: R replicas (threads, one network each) with
//! `train_step_synced` and an in-process `LocalBnGroup` compute what one network computes on
//! the whole global batch — the same loss, running statistics, and (image-weighted average
//! of the replicas') gradients — also when the images are split unevenly. Without
//! synchronisation they do not, which shows the test can fail. The same holds with batch norm
//! fused into the convolutions (`CpuBackend::set_bn_fusion`: the CPU runs the fused sequence
//! the GPU runs with `BIRDTRAIN_BN_FUSION=1`), whose local sums come from the convolutions'
//! moments forward and from the dgrad epilogues backward. And one replica with it is plain
//! batch norm, one value per channel included.

use std::time::Duration;

use birdtrain::backend::cpu::CpuBackend;
use birdtrain::dist::sync_bn::LocalBnGroup;
use birdtrain::model::{
    Arch, BnAllReduce, GradHookError, Graph, InputBatch, ModelState, Network, NetworkConfig,
    StepStats, SyncEvent,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const SIZE: u32 = 8;
const PX: usize = (SIZE * SIZE * 3) as usize;

struct Outcome {
    stats: StepStats,
    grads: Vec<f32>,
    state: ModelState,
}

fn network(graph: &Graph, max_batch: usize) -> Network<CpuBackend> {
    network_fused(graph, max_batch, false)
}

/// [`network`] with batch norm fused into the convolutions (`fused`) or not.
fn network_fused(graph: &Graph, max_batch: usize, fused: bool) -> Network<CpuBackend> {
    let mut backend = CpuBackend::new(1).unwrap();
    backend.set_bn_fusion(fused);
    let mut net = Network::new(backend, graph, max_batch, SIZE).unwrap();
    net.set_config(NetworkConfig {
        label_smoothing: 0.1,
        ..NetworkConfig::default()
    });
    // Non-trivial BN parameters and running statistics, so every term matters.
    let mut state = ModelState::init(graph, 9);
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    for (p, spec) in state.params.iter_mut().zip(graph.params()) {
        if spec.name.contains("bn") || spec.name.contains("downsample.1") {
            for v in p.iter_mut() {
                *v += rng.random_range(-0.3..0.3);
            }
        }
    }
    net.load_state(&state).unwrap();
    net
}

fn step(
    net: &mut Network<CpuBackend>,
    pixels: &[u8],
    labels: &[u32],
    sync: Option<&mut dyn BnAllReduce>,
) -> Outcome {
    let batch = InputBatch {
        pixels,
        labels,
        len: labels.len(),
        image_size: SIZE,
        augment: None,
        mix: None,
    };
    let stats = net
        .train_step_synced(&batch, &mut |_, _| Ok(()), sync)
        .unwrap();
    Outcome {
        stats,
        grads: net.grads_f32().unwrap(),
        state: net.state().unwrap(),
    }
}

/// Replicas on threads, replica r taking `split[r]` consecutive images.
fn replicas(
    graph: &Graph,
    pixels: &[u8],
    labels: &[u32],
    split: &[usize],
    sync: bool,
    fused: bool,
) -> Vec<Outcome> {
    let mut group = LocalBnGroup::new(split.len(), Duration::from_secs(60)).into_iter();
    std::thread::scope(|s| {
        let mut start = 0;
        let handles: Vec<_> = split
            .iter()
            .map(|&n| {
                let (px, lb) = (
                    &pixels[start * PX..(start + n) * PX],
                    &labels[start..start + n],
                );
                start += n;
                let mut reducer = group.next().unwrap();
                s.spawn(move || {
                    let mut net = network_fused(graph, n, fused);
                    let r: Option<&mut dyn BnAllReduce> =
                        if sync { Some(&mut reducer) } else { None };
                    step(&mut net, px, lb, r)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn close(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}");
    let mut worst = 0.0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        assert!(
            err <= atol + rtol * w.abs(),
            "{what}[{i}]: replicas {g} vs whole batch {w}"
        );
        worst = worst.max(err / (atol + rtol * w.abs()));
    }
    worst
}

/// Replicas (fused or not) of `split` against one unfused network on the whole batch.
fn check(split: &[usize], fused: bool) {
    let graph = Graph::new(Arch::ResNet8, 3);
    let total: usize = split.iter().sum();
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let pixels: Vec<u8> = (0..total * PX).map(|_| rng.random()).collect();
    let labels: Vec<u32> = (0..total).map(|_| rng.random_range(0..3)).collect();
    let mut whole_net = network(&graph, total);
    let whole = step(&mut whole_net, &pixels, &labels, None);
    let parts = replicas(&graph, &pixels, &labels, split, true, fused);

    // Forward: the same normalisation, hence the same per-image losses.
    let loss: f64 = parts.iter().map(|p| p.stats.loss_sum).sum();
    assert!(
        (loss - whole.stats.loss_sum).abs() < 1e-4 * whole.stats.loss_sum.abs(),
        "loss {loss} vs {}",
        whole.stats.loss_sum
    );
    // Running statistics: every replica advanced them with the global batch's.
    for p in &parts {
        for (b, (got, want)) in p.state.buffers.iter().zip(&whole.state.buffers).enumerate() {
            close(&format!("buffer {b}"), got, want, 1e-5, 1e-4);
        }
    }
    // Gradients: each replica's is of its own mean loss; weighting them by image share gives
    // the gradient of the global mean loss (what the NCCL path computes).
    let mut avg = vec![0.0f32; whole.grads.len()];
    for (p, &n) in parts.iter().zip(split) {
        let w = n as f32 / total as f32;
        for (a, g) in avg.iter_mut().zip(&p.grads) {
            *a += w * g;
        }
    }
    let worst = close("gradient", &avg, &whole.grads, 2e-5, 2e-3);
    println!("split {split:?} fused {fused}: worst gradient error {worst:.3} of tolerance");
}

#[test]
fn two_replicas_with_sync_bn_equal_one_network_on_the_global_batch() {
    check(&[3, 3], false);
}

#[test]
fn an_uneven_split_over_three_replicas_is_weighted_by_image_count() {
    check(&[1, 2, 4], false);
}

#[test]
fn fused_replicas_with_sync_bn_equal_one_network_on_the_global_batch() {
    // The statistics of the global batch, summed from each replica's convolution moments.
    check(&[3, 3], true);
    check(&[1, 2, 4], true);
}

#[test]
fn without_sync_bn_the_replicas_differ_from_the_global_batch() {
    let graph = Graph::new(Arch::ResNet8, 3);
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let pixels: Vec<u8> = (0..6 * PX).map(|_| rng.random()).collect();
    let labels: Vec<u32> = (0..6).map(|_| rng.random_range(0..3)).collect();
    let mut whole_net = network(&graph, 6);
    let whole = step(&mut whole_net, &pixels, &labels, None);
    let parts = replicas(&graph, &pixels, &labels, &[3, 3], false, false);
    let loss: f64 = parts.iter().map(|p| p.stats.loss_sum).sum();
    let mut avg = vec![0.0f32; whole.grads.len()];
    for p in &parts {
        for (a, g) in avg.iter_mut().zip(&p.grads) {
            *a += 0.5 * g;
        }
    }
    let worst = avg
        .iter()
        .zip(&whole.grads)
        .map(|(a, w)| (a - w).abs() / (2e-5 + 2e-3 * w.abs()))
        .fold(0.0f32, f32::max);
    assert!(
        worst > 10.0 || (loss - whole.stats.loss_sum).abs() > 1e-3,
        "per-replica BN should not match the global batch (worst {worst})"
    );
}

#[test]
fn frozen_bn_ignores_the_reducer() {
    // Frozen statistics need no synchronisation: the reducer is never called, so a group of
    // two with only one member cannot block.
    let graph = Graph::new(Arch::ResNet8, 3);
    let mut net = network(&graph, 2);
    net.set_config(NetworkConfig {
        freeze_bn: true,
        ..net.config()
    });
    let mut group = LocalBnGroup::new(2, Duration::from_millis(10));
    let pixels = vec![7u8; 2 * PX];
    let out = step(&mut net, &pixels, &[0, 1], Some(&mut group[0]));
    assert_eq!(out.stats.count, 2);
}

/// Records the reducer's calls into a log and passes them on to `inner`, when there is one
/// (without: one replica, sums are the identity).
struct Recorder<'a> {
    log: &'a std::cell::RefCell<Vec<SyncEvent>>,
    inner: Option<LocalBnGroup>,
}

impl BnAllReduce for Recorder<'_> {
    fn sum_in_place(&mut self, values: &mut [f64]) -> Result<(), GradHookError> {
        {
            let mut log = self.log.borrow_mut();
            let backward = log
                .iter()
                .any(|e| matches!(e, SyncEvent::GradReady(_) | SyncEvent::BnBackward { .. }));
            // Forward sends 2c+1 values (Σx, Σx², rows), backward 2c (Σdz·x̂, Σdz).
            log.push(if backward || values.len() % 2 == 0 {
                SyncEvent::BnBackward {
                    channels: values.len() / 2,
                }
            } else {
                SyncEvent::BnForward {
                    channels: values.len() / 2,
                }
            });
        }
        match &mut self.inner {
            Some(group) => group.sum_in_place(values),
            None => Ok(()),
        }
    }
}

/// The calls of one synchronised step, recorded: `Some(pixels)` steps on two images,
/// `None` is a replica with no image ([`Network::step_without_images`]).
fn recorded_step(
    arch: Arch,
    fused: bool,
    pixels: Option<&[u8]>,
    group: Option<LocalBnGroup>,
) -> (Vec<SyncEvent>, Vec<SyncEvent>, Vec<Vec<f32>>) {
    let graph = Graph::new(arch, 3);
    let size = if arch.is_cifar() { SIZE } else { 32 };
    let mut backend = CpuBackend::new(1).unwrap();
    backend.set_bn_fusion(fused);
    let mut net = Network::new(backend, &graph, 2, size).unwrap();
    let log = std::cell::RefCell::new(Vec::new());
    let mut rec = Recorder {
        log: &log,
        inner: group,
    };
    match pixels {
        Some(pixels) => {
            let batch = InputBatch {
                pixels,
                labels: &[0, 2],
                len: 2,
                image_size: size,
                augment: None,
                mix: None,
            };
            net.train_step_synced(
                &batch,
                &mut |p, _| {
                    log.borrow_mut().push(SyncEvent::GradReady(p));
                    Ok(())
                },
                Some(&mut rec),
            )
            .map(|_| ())
        }
        None => net.step_without_images(
            &mut |p| {
                log.borrow_mut().push(SyncEvent::GradReady(p));
                Ok(())
            },
            Some(&mut rec),
        ),
    }
    .unwrap();
    let expected = net.synced_step_events();
    (log.into_inner(), expected, net.state().unwrap().buffers)
}

#[test]
fn the_announced_event_sequence_is_what_a_synced_step_issues() {
    // An empty replica replays `synced_step_events` instead of stepping
    // (`step_without_images`): both must match the real order exactly or NCCL collectives
    // would pair up wrongly. Fused networks too: their backward reduces a batch norm's sums in
    // the convolution after it, and must still report them, and every gradient, in the
    // announced order.
    for (arch, fused) in [
        (Arch::ResNet8, false),
        (Arch::ResNet18, false),
        (Arch::ResNet8, true),
        (Arch::ResNet18, true),
    ] {
        let size = if arch.is_cifar() { SIZE } else { 32 };
        let pixels = vec![100u8; 2 * (size * size * 3) as usize];
        let (log, expected, _) = recorded_step(arch, fused, Some(&pixels), None);
        assert_eq!(log, expected, "{arch} fused {fused}");
        assert!(expected
            .iter()
            .any(|e| matches!(e, SyncEvent::BnBackward { .. })));

        // Two replicas, one of them empty: each issues the announced sequence, paired call
        // by call (a mismatch fails on its length or times out), and the empty one's running
        // statistics advance with the global batch's, as the stepping one's.
        let mut group = LocalBnGroup::new(2, Duration::from_secs(20)).into_iter();
        let (stepping, empty) = (group.next(), group.next());
        let ((log, expected, stepped), (empty_log, _, replayed)) = std::thread::scope(|s| {
            let pixels = &pixels;
            let a = s.spawn(move || recorded_step(arch, fused, Some(pixels), stepping));
            let b = s.spawn(move || recorded_step(arch, fused, None, empty));
            (a.join().unwrap(), b.join().unwrap())
        });
        assert_eq!(log, expected, "{arch} fused {fused}, stepping");
        assert_eq!(empty_log, expected, "{arch} fused {fused}, empty");
        assert_eq!(stepped, replayed, "{arch} fused {fused}: BN buffers");
    }
}

/// What one step left: the loss, the gradients by parameter name, the BN buffers.
type StepResult = (f64, Vec<(String, Vec<f32>)>, Vec<Vec<f32>>);

/// One replica's step with and without synchronised batch norm (a group of one: the sums are
/// its own) on `images` random images of side `size`.
fn one_replica_both_ways(arch: Arch, size: u32, images: usize) -> [StepResult; 2] {
    let graph = Graph::new(arch, 3);
    let px = (size * size * 3) as usize;
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let pixels: Vec<u8> = (0..images * px).map(|_| rng.random()).collect();
    let labels: Vec<u32> = (0..images).map(|_| rng.random_range(0..3)).collect();
    let batch = InputBatch {
        pixels: &pixels,
        labels: &labels,
        len: images,
        image_size: size,
        augment: None,
        mix: None,
    };
    let run = |sync: bool| {
        let mut net = Network::new(CpuBackend::new(1).unwrap(), &graph, images, size).unwrap();
        net.set_config(NetworkConfig {
            label_smoothing: 0.1,
            ..NetworkConfig::default()
        });
        let mut state = ModelState::init(&graph, 9);
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        for (p, spec) in state.params.iter_mut().zip(graph.params()) {
            if spec.name.contains("bn") || spec.name.contains("downsample.1") {
                for v in p.iter_mut() {
                    *v += rng.random_range(-0.3..0.3);
                }
            }
        }
        net.load_state(&state).unwrap();
        let mut group = LocalBnGroup::new(1, Duration::from_secs(60));
        let reducer: Option<&mut dyn BnAllReduce> = if sync { Some(&mut group[0]) } else { None };
        let stats = net
            .train_step_synced(&batch, &mut |_, _| Ok(()), reducer)
            .unwrap();
        let flat = net.grads_f32().unwrap();
        let mut at = 0;
        let grads = graph
            .params()
            .iter()
            .map(|p| {
                let g = flat[at..at + p.numel()].to_vec();
                at += p.numel();
                (p.name.clone(), g)
            })
            .collect();
        (stats.loss_sum, grads, net.state().unwrap().buffers)
    };
    [run(false), run(true)]
}

/// Synchronised batch norm over one replica is plain batch norm: the same loss, gradients and
/// running statistics up to rounding. Tolerances: the synchronised path normalises with the
/// statistics its f64 sums give back (the fused op's mean exactly, its variance through f32),
/// so each BN layer's invstd may differ by an ulp; 1e-6 of the loss, 1e-4 of a gradient
/// tensor's largest value and 1e-5 of a running statistic cover that with a margin of 10 or
/// more. With one value per channel (resnet8 on 4-pixel images: its last stage is 1×1 for one
/// image; resnet18 on 32 pixels likewise) the exact input gradient of such a layer is 0 and
/// its output β, whatever its input: every gradient that only flows through those layers is
/// exactly 0 on both paths, not rounding residue that differs between them (which made
/// upstream gradients and BN biases differ by their whole size before).
#[test]
fn one_replica_with_sync_bn_is_plain_batch_norm() {
    for (arch, size, images, one_value) in [
        (Arch::ResNet8, 8, 3, false),
        (Arch::ResNet8, 4, 1, true),
        (Arch::ResNet18, 32, 1, true),
    ] {
        let case = format!("{arch} on {images} image(s) of {size} px");
        let [plain, synced] = one_replica_both_ways(arch, size, images);
        assert!(
            (plain.0 - synced.0).abs() <= 1e-6 * plain.0.abs(),
            "{case}: loss {} plain, {} synchronised",
            plain.0,
            synced.0
        );
        for ((name, want), (_, got)) in plain.1.iter().zip(&synced.1) {
            let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let worst = want
                .iter()
                .zip(got)
                .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                worst <= 1e-4 * scale,
                "{case}: gradient of {name} differs by {worst} (largest value {scale})"
            );
            if one_value {
                // Only the classifier and the β of the one-value layers (the last stage's BN
                // biases) see a gradient; everything before the last stage gets exactly 0.
                let last_stage = if arch == Arch::ResNet8 {
                    "layer3."
                } else {
                    "layer4."
                };
                let live = name.starts_with("fc.")
                    || (name.starts_with(last_stage) && name.ends_with(".bias"));
                if !live {
                    assert!(
                        want.iter().chain(got).all(|&v| v == 0.0),
                        "{case}: gradient of {name} should be exactly 0 (largest {scale})"
                    );
                }
            }
        }
        for (b, (want, got)) in plain.2.iter().zip(&synced.2).enumerate() {
            close(&format!("{case}: buffer {b}"), got, want, 1e-5, 1e-5);
        }
    }
}
