//! Synchronised batch norm on CPU replicas: R replicas (threads, one network each) with
//! `train_step_synced` and an in-process `LocalBnGroup` compute what one network computes on
//! the whole global batch — the same loss, running statistics, and (image-weighted average
//! of the replicas') gradients — also when the images are split unevenly. Without
//! synchronisation they do not, which shows the test can fail. The same holds with batch norm
//! fused into the convolutions (`CpuBackend::set_bn_fusion`: the CPU runs the fused sequence
//! the GPU runs with `BIRDTRAIN_BN_FUSION=1`), whose local sums come from the convolutions'
//! moments.

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

/// Records the reducer's calls into a shared log (one replica: sums are the identity).
struct Recorder<'a>(&'a std::cell::RefCell<Vec<SyncEvent>>);

impl BnAllReduce for Recorder<'_> {
    fn sum_in_place(&mut self, values: &mut [f64]) -> Result<(), GradHookError> {
        let mut log = self.0.borrow_mut();
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
        Ok(())
    }
}

#[test]
fn the_announced_event_sequence_is_what_a_synced_step_issues() {
    // An empty replica replays `synced_step_events` instead of stepping: it must match the
    // real order exactly or NCCL collectives would pair up wrongly.
    // Fused networks too: their backward reduces a batch norm's sums in the convolution after
    // it, and must still report them, and every gradient, in the announced order.
    for (arch, fused) in [
        (Arch::ResNet8, false),
        (Arch::ResNet18, false),
        (Arch::ResNet8, true),
        (Arch::ResNet18, true),
    ] {
        let graph = Graph::new(arch, 3);
        let size = if arch.is_cifar() { SIZE } else { 32 };
        let mut backend = CpuBackend::new(2).unwrap();
        backend.set_bn_fusion(fused);
        let mut net = Network::new(backend, &graph, 2, size).unwrap();
        let log = std::cell::RefCell::new(Vec::new());
        let pixels = vec![100u8; 2 * (size * size * 3) as usize];
        let batch = InputBatch {
            pixels: &pixels,
            labels: &[0, 2],
            len: 2,
            image_size: size,
            augment: None,
            mix: None,
        };
        let mut rec = Recorder(&log);
        net.train_step_synced(
            &batch,
            &mut |p, _| {
                log.borrow_mut().push(SyncEvent::GradReady(p));
                Ok(())
            },
            Some(&mut rec),
        )
        .unwrap();
        let expected = net.synced_step_events();
        assert_eq!(log.into_inner(), expected, "{arch} fused {fused}");
        assert!(expected
            .iter()
            .any(|e| matches!(e, SyncEvent::BnBackward { .. })));
    }
}
