//! The training step as a CUDA graph (`birdtrain::cuda::graph`, `BIRDTRAIN_CUDA_GRAPH=1` in
//! the trainer), driven here at the library's level as a GPU rank drives it: the step's
//! values uploaded first (`preload_step`), the step's launches captured once per staging
//! address and replayed. GPU only (`#[ignore]`d):
//! `cargo test --release --test gpu -- --ignored --test-threads=1 --nocapture cuda_graph::`.
//!
//! - Replayed steps give the eager steps' bits (master weights after every step's update),
//!   with each step's own augmentation, mixing and lr (device values, not captured ones).
//! - The time of a resnet50 step at batch 256, 224 px, eager and replayed (a measurement,
//!   printed; `scripts/gpu-run.sh graphs` reads the `graph-timing` line).

use std::time::Instant;

use birdtrain::cuda::graph::{GraphAction, GraphKey, StepCase, StepGraphs};
use birdtrain::cuda::optim::{to_backend_layout, DeviceOptimizer};
use birdtrain::cuda::staged::StagedBackend;
use birdtrain::cuda::{CudaBackend, DeviceTotalsAt};
use birdtrain::model::{Arch, Augment, Graph, InputBatch, Mix, ModelState, Network, PixelBox};
use birdtrain::optim::{Hyper, OptimizerKind};
use cudarc::driver::DevicePtr;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// What a run of steps ends with.
struct Ran {
    /// The master weights after the last step (backend layout).
    master: Vec<f32>,
    /// Milliseconds a step over the timed steps.
    ms_per_step: f64,
    /// Steps that ran as graphs (captured or replayed).
    graph_steps: usize,
}

/// Step `k`'s mixing: none, mixup or CutMix in turn, with a weight and box of its own.
fn mix_of(k: usize, size: u32) -> Option<Mix> {
    let s = size;
    match k % 3 {
        0 => None,
        1 => Some(Mix::Blend {
            lambda: 0.3 + 0.05 * k as f32,
        }),
        _ => Some(Mix::Paste(PixelBox {
            y0: (k as u32 * 3) % (s / 2),
            y1: s / 2 + (k as u32 * 5) % (s / 2),
            x0: (k as u32 * 7) % (s / 2),
            x1: s / 2 + (k as u32) % (s / 2),
        })),
    }
}

/// Step `k`'s augmentation of image `i` (shifts, mirror, an erased box on some).
fn augment_of(k: usize, i: usize, size: u32) -> Augment {
    let r = (size / 8) as i32;
    Augment {
        dy: ((k + i) as i32 % (2 * r + 1)) - r,
        dx: r - ((k * 3 + i) as i32 % (2 * r + 1)),
        flip: (k + i) % 2 == 0,
        erase: ((k + i) % 3 == 0).then_some(PixelBox {
            y0: 1,
            y1: size / 3,
            x0: 2,
            x1: size / 4,
        }),
    }
}

/// `warm + timed` AdamW steps of `arch` on one synthetic batch staged on the device, each
/// with its own augmentation, mixing and lr; with `graphs`, as a GPU rank runs them with the
/// switch on (a warm-up step, a capture, replays).
fn run(arch: Arch, batch: usize, size: u32, warm: usize, timed: usize, graphs: bool) -> Ran {
    let backend = CudaBackend::new(0).unwrap();
    let dev = backend.device().clone();
    let stream = dev.stream().clone();
    let graph = Graph::new(arch, 100);
    let state = ModelState::init(&graph, 3);
    let mut net = Network::new(StagedBackend::new(backend.clone()), &graph, batch, size).unwrap();
    net.load_state(&state).unwrap();
    let flat = to_backend_layout(graph.params(), &state.flat_params());
    let hyper = Hyper {
        weight_decay: 0.05,
        ..Hyper::default()
    };
    let mut opt =
        DeviceOptimizer::new(&backend, OptimizerKind::AdamW, hyper, graph.params(), &flat).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let bytes = batch * (size as usize).pow(2) * 3;
    let pixels: Vec<u8> = (0..bytes).map(|_| rng.random()).collect();
    let labels: Vec<u32> = (0..batch).map(|_| rng.random_range(0..100)).collect();
    let staged = stream.clone_htod(&pixels).unwrap();
    let staged_at = staged.device_ptr(&stream).0;
    let totals = stream.alloc_zeros::<f64>(5).unwrap();
    let totals_at = totals.device_ptr(&stream).0;
    let mut steps = StepGraphs::new(stream.clone(), graphs);
    let mut graph_steps = 0;
    let mut started = Instant::now();
    for k in 0..warm + timed {
        if k == warm {
            stream.synchronize().unwrap();
            started = Instant::now();
        }
        let augments: Vec<Augment> = (0..batch).map(|i| augment_of(k, i, size)).collect();
        let input = InputBatch {
            pixels: &pixels,
            labels: &labels,
            len: batch,
            image_size: size,
            augment: Some(&augments),
            mix: mix_of(k, size),
        };
        let lr = 1e-3 * (1.0 + 0.1 * k as f32);
        let key = GraphKey {
            input: staged_at,
            totals: totals_at,
        };
        // SAFETY: `staged` holds the batch and `totals` five f64, both alive to the end.
        unsafe {
            net.backend().set_staged(staged_at, bytes);
            net.backend().defer_loss(DeviceTotalsAt {
                addr: totals_at,
                stop: false,
                add: false,
            });
        }
        let action = steps
            .decide(StepCase {
                eligible: true,
                key,
                allocated: dev.allocated_bytes(),
            })
            .unwrap();
        if action != GraphAction::Eager {
            net.backend().preload_step(&input, 0.1, false).unwrap();
            opt.preload_step(lr).unwrap();
            graph_steps += 1;
        }
        match action {
            GraphAction::Eager | GraphAction::Capture => {
                if action == GraphAction::Capture {
                    steps.begin_capture().unwrap();
                }
                net.train_step(&input).unwrap();
                let (grads, mut params) = net.grads_and_params_mut();
                opt.step(&grads, &mut params, lr, 1.0).unwrap();
                if action == GraphAction::Capture {
                    steps.end_capture(key, true).unwrap();
                    steps.replay(key).unwrap();
                }
            }
            GraphAction::Replay => {
                steps.replay(key).unwrap();
                net.replayed_train_step(batch);
                opt.replayed_step();
            }
        }
        net.backend().end_preload();
        net.backend().clear_staged();
    }
    stream.synchronize().unwrap();
    let ms_per_step = started.elapsed().as_secs_f64() * 1e3 / timed.max(1) as f64;
    Ran {
        master: opt.master().unwrap(),
        ms_per_step,
        graph_steps,
    }
}

fn bits_differing(a: &[f32], b: &[f32]) -> usize {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn replayed_steps_give_the_eager_steps_bits() {
    let eager = run(Arch::ResNet18, 24, 64, 0, 8, false);
    let graph = run(Arch::ResNet18, 24, 64, 0, 8, true);
    // Two warm-up steps (the first allocates, the second shows it allocates nothing), one
    // capture, five replays.
    assert_eq!((eager.graph_steps, graph.graph_steps), (0, 6));
    let differ = bits_differing(&eager.master, &graph.master);
    assert_eq!(
        differ,
        0,
        "{differ} of {} master weights differ",
        eager.master.len()
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn resnet50_b256_step_time_with_and_without_the_graph() {
    // Warm-up: the first eager step allocates, the second confirms, the third captures.
    let (warm, timed) = (3, 10);
    let eager = run(Arch::ResNet50, 256, 224, warm, timed, false);
    let graph = run(Arch::ResNet50, 256, 224, warm, timed, true);
    let differ = bits_differing(&eager.master, &graph.master);
    println!(
        "graph-timing resnet50 b256 224px: eager {:.2} ms/step, graph {:.2} ms/step ({:+.2} ms), \
         {} of {} master weights differ",
        eager.ms_per_step,
        graph.ms_per_step,
        graph.ms_per_step - eager.ms_per_step,
        differ,
        eager.master.len()
    );
    assert_eq!(graph.graph_steps, timed + warm - 2);
    assert_eq!(differ, 0);
}
