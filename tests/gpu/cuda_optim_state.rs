//! The device optimizer's state against the host optimizer's checkpoint file.
//!
//! CPU tests: a host state saved after some steps, read back from its file and converted to
//! the device layout ([`DeviceState::from_host`]), continues *bit-identically* when the same
//! update rules run in that layout (the device kernel's rules are the host's, checked by the
//! GPU tests of cuda_kernels.rs), and converts back to the host run's exact state.
//! GPU test (`#[ignore]`): the same through a real `DeviceOptimizer`.

use birdtrain::backend::{Backend, TensorRole};
use birdtrain::cuda::optim::{
    from_backend_layout, to_backend_layout, DeviceOptimizer, DeviceState,
};
use birdtrain::cuda::CudaBackend;
use birdtrain::model::{Arch, Graph, ParamSpec};
use birdtrain::optim::{Hyper, Optimizer, OptimizerKind};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const KINDS: [OptimizerKind; 3] = [
    OptimizerKind::Sgd {
        momentum: 0.9,
        nesterov: true,
    },
    OptimizerKind::Adam,
    OptimizerKind::AdamW,
];

fn hyper() -> Hyper {
    Hyper {
        weight_decay: 0.01,
        ..Hyper::default()
    }
}

fn data(rng: &mut ChaCha8Rng, len: usize, scale: f32) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-scale..scale)).collect()
}

/// A host optimizer after three steps, saved to a file and read back (as a resume does).
fn saved_and_loaded(
    kind: OptimizerKind,
    graph: &Graph,
    rng: &mut ChaCha8Rng,
    dir: &std::path::Path,
) -> (Optimizer, Vec<f32>, Optimizer) {
    let n = graph.param_count();
    let mut params = data(rng, n, 0.5);
    let mut host = Optimizer::new(kind, hyper(), graph.params());
    for _ in 0..3 {
        host.step(&mut params, &data(rng, n, 1.0), 0.05).unwrap();
    }
    let file = dir.join(format!("{}.safetensors", kind.name()));
    host.save(&file).unwrap();
    let mut loaded = Optimizer::new(kind, hyper(), graph.params());
    loaded.load(&file).unwrap();
    (host, params, loaded)
}

#[test]
fn a_saved_host_state_continues_identically_in_the_device_layout() {
    let graph = Graph::new(Arch::ResNet8, 4);
    let specs: &[ParamSpec] = graph.params();
    let n = graph.param_count();
    let dir = tempfile::tempdir().unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for kind in KINDS {
        let (mut host, mut params, loaded) = saved_and_loaded(kind, &graph, &mut rng, dir.path());
        let device = DeviceState::from_host(specs, &loaded);
        assert_eq!(device.steps, 3);
        assert_ne!(
            device.m,
            loaded.moments().0,
            "{kind:?}: the conversion must permute convolution state"
        );
        // "The device": the same rules over parameters, gradients and state in its layout.
        let mut dev = Optimizer::new(kind, hyper(), specs);
        dev.set_state(device.m.clone(), device.v.clone(), device.steps)
            .unwrap();
        let mut dev_params = to_backend_layout(specs, &params);
        for _ in 0..2 {
            let g = data(&mut rng, n, 1.0);
            host.step(&mut params, &g, 0.05).unwrap();
            dev.step(&mut dev_params, &to_backend_layout(specs, &g), 0.05)
                .unwrap();
        }
        assert_eq!(from_backend_layout(specs, &dev_params), params, "{kind:?}");
        // Back to a checkpoint file: the same optimizer the host run holds, through its file.
        let (m, v) = dev.moments();
        let back = DeviceState {
            m: m.to_vec(),
            v: v.to_vec(),
            steps: dev.steps(),
        }
        .to_host(kind, hyper(), specs)
        .unwrap();
        assert_eq!(back, host, "{kind:?}");
        let mut reread = Optimizer::new(kind, hyper(), specs);
        reread
            .load_safetensors_bytes(&back.to_safetensors_bytes(), std::path::Path::new("mem"))
            .unwrap();
        assert_eq!(reread, host, "{kind:?}");
    }
}

#[test]
fn a_state_of_another_model_or_optimizer_is_refused() {
    let small = Graph::new(Arch::ResNet8, 4);
    let other = Graph::new(Arch::ResNet8, 7);
    let sgd = Optimizer::new(KINDS[0], hyper(), small.params());
    let state = DeviceState::from_host(small.params(), &sgd);
    let e = state
        .to_host(KINDS[0], hyper(), other.params())
        .unwrap_err();
    assert!(e.to_string().contains("device optimizer state"), "{e}");
    // An SGD state (no second moment) is not an Adam state.
    let e = state
        .to_host(OptimizerKind::Adam, hyper(), small.params())
        .unwrap_err();
    assert!(e.to_string().contains("second moment"), "{e}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_device_optimizer_loads_saves_and_continues_a_host_state() {
    let gb = CudaBackend::new(0).expect("a CUDA device (this test is for the GPU machine)");
    let graph = Graph::new(Arch::ResNet8, 4);
    let specs = graph.params();
    let n = graph.param_count();
    let dir = tempfile::tempdir().unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let split = |flat: &[f32]| -> Vec<Vec<f32>> {
        let mut off = 0;
        specs
            .iter()
            .map(|p| {
                off += p.numel();
                flat[off - p.numel()..off].to_vec()
            })
            .collect()
    };
    for kind in KINDS {
        let (mut host, mut params, loaded) = saved_and_loaded(kind, &graph, &mut rng, dir.path());
        let state = DeviceState::from_host(specs, &loaded);
        let mut opt = DeviceOptimizer::new(
            &gb,
            kind,
            hyper(),
            specs,
            &to_backend_layout(specs, &params),
        )
        .unwrap();
        opt.load_state(&state).unwrap();
        assert_eq!(opt.state().unwrap(), state, "{kind:?}: upload/download");
        let mut working: Vec<_> = specs
            .iter()
            .map(|p| gb.alloc(p.numel(), TensorRole::Weight).unwrap())
            .collect();
        for _ in 0..2 {
            let g = data(&mut rng, n, 1.0);
            host.step(&mut params, &g, 0.05).unwrap();
            let grads: Vec<_> = split(&to_backend_layout(specs, &g))
                .iter()
                .map(|v| {
                    let mut t = gb.alloc(v.len(), TensorRole::WeightGrad).unwrap();
                    gb.upload(v, &mut t).unwrap();
                    t
                })
                .collect();
            let g_refs: Vec<_> = grads.iter().collect();
            let mut w_refs: Vec<_> = working.iter_mut().collect();
            opt.step(&g_refs, &mut w_refs, 0.05, 1.0).unwrap();
        }
        let master = from_backend_layout(specs, &opt.master().unwrap());
        let saved = opt.state().unwrap().to_host(kind, hyper(), specs).unwrap();
        assert_eq!(saved.steps(), 5);
        for (name, got, want) in [
            ("master", &master[..], &params[..]),
            ("m", saved.moments().0, host.moments().0),
            ("v", saved.moments().1, host.moments().1),
        ] {
            for (i, (a, b)) in got.iter().zip(want).enumerate() {
                // f32 on both sides; the GPU may fuse multiply-adds differently.
                assert!(
                    (a - b).abs() <= 1e-6 + 1e-5 * b.abs(),
                    "{kind:?} {name}[{i}]: gpu {a} cpu {b}"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_device_optimizer_clips_to_the_global_norm_like_the_host_one() {
    let gb = CudaBackend::new(0).expect("a CUDA device (this test is for the GPU machine)");
    let graph = Graph::new(Arch::ResNet8, 4);
    let specs = graph.params();
    let n = graph.param_count();
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    for kind in KINDS {
        let mut params = data(&mut rng, n, 0.5);
        let mut host = Optimizer::new(kind, hyper(), specs);
        let mut opt = DeviceOptimizer::new(
            &gb,
            kind,
            hyper(),
            specs,
            &to_backend_layout(specs, &params),
        )
        .unwrap();
        let g = data(&mut rng, n, 1.0);
        let norm = g.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
        // A bound of a third of the norm: PyTorch's clip_grad_norm_ by hand on the host.
        let max_norm = (norm / 3.0) as f32;
        opt.set_max_grad_norm(Some(max_norm));
        let coef = f64::from(max_norm) / (norm + 1e-6);
        let clipped: Vec<f32> = g.iter().map(|&v| (f64::from(v) * coef) as f32).collect();
        host.step(&mut params, &clipped, 0.05).unwrap();
        let mut off = 0;
        let grads: Vec<_> = specs
            .iter()
            .map(|p| {
                off += p.numel();
                let v = to_backend_layout(std::slice::from_ref(p), &g[off - p.numel()..off]);
                let mut t = gb.alloc(v.len(), TensorRole::WeightGrad).unwrap();
                gb.upload(&v, &mut t).unwrap();
                t
            })
            .collect();
        let mut working: Vec<_> = specs
            .iter()
            .map(|p| gb.alloc(p.numel(), TensorRole::Weight).unwrap())
            .collect();
        let g_refs: Vec<_> = grads.iter().collect();
        let mut w_refs: Vec<_> = working.iter_mut().collect();
        opt.step(&g_refs, &mut w_refs, 0.05, 1.0).unwrap();
        let master = from_backend_layout(specs, &opt.master().unwrap());
        for (i, (a, b)) in master.iter().zip(&params).enumerate() {
            // f32 on both sides; the GPU sums the norm in another (fixed) order, in f64.
            assert!(
                (a - b).abs() <= 1e-6 + 1e-5 * b.abs(),
                "{kind:?} [{i}]: gpu {a} cpu {b}"
            );
        }
    }
}
