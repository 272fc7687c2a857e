//! Whole-network gradient check: resnet8 at 8×8 on the CPU backend, BN in training mode,
//! label smoothing on; sampled parameters of every kind against central differences.
//!
//! Tolerance: the forward pass is f32, so the loss carries rounding noise of ~1e-7 relative
//! that changes with every perturbed weight, and ReLU kinks are crossed by some of the 256
//! pre-activations per channel; with h = 5e-4 that puts a few 1e-3 of absolute noise on the
//! numeric derivative, hence |a − n| ≤ 4e-3 + 5%·|n|. (A dropped term in any backward formula
//! is off by far more; the per-op checks in backend_gradcheck.rs are much tighter.)

use birdtrain::backend::cpu::CpuBackend;
use birdtrain::model::{Arch, Graph, InputBatch, ModelState, Network, NetworkConfig};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn run(freeze_bn: bool) {
    let graph = Graph::new(Arch::ResNet8, 3);
    let n = 4;
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let px: Vec<u8> = (0..n * 8 * 8 * 3).map(|_| rng.random()).collect();
    let labels = [0u32, 1, 2, 1];
    let mut net = Network::new(CpuBackend::new(2).unwrap(), &graph, n, 8).unwrap();
    let mut state = ModelState::init(&graph, 5);
    // Non-trivial BN parameters and running statistics, so every term matters.
    for (p, spec) in state.params.iter_mut().zip(graph.params()) {
        if spec.name.ends_with("bias") || spec.name.contains("bn") {
            for v in p.iter_mut() {
                *v += rng.random_range(-0.3..0.3);
            }
        }
    }
    for b in state.buffers.iter_mut() {
        for v in b.iter_mut() {
            *v += rng.random_range(0.0..0.5);
        }
    }
    net.load_state(&state).unwrap();
    net.set_config(NetworkConfig {
        label_smoothing: 0.1,
        freeze_bn,
        ..NetworkConfig::default()
    });
    let batch = InputBatch {
        pixels: &px,
        labels: &labels,
        len: n,
        image_size: 8,
        augment: None,
        mix: None,
    };
    let params = net.params_f32().unwrap();
    net.train_step(&batch).unwrap();
    let grads = net.grads_f32().unwrap();
    let (offsets, _) = graph.param_offsets();
    let mut loss = |p: &[f32]| {
        net.set_params_f32(p).unwrap();
        net.train_step(&batch).unwrap().mean_loss()
    };
    let mut checked = 0;
    let mut worst = 0.0f64;
    for (i, spec) in graph.params().iter().enumerate() {
        // two entries per tensor: the largest-gradient one and a random one
        let seg = &grads[offsets[i]..offsets[i] + spec.numel()];
        let big = (0..seg.len())
            .max_by(|&a, &b| seg[a].abs().total_cmp(&seg[b].abs()))
            .unwrap();
        for j in [big, rng.random_range(0..seg.len())] {
            let k = offsets[i] + j;
            let h = 5e-4f32;
            let mut p = params.clone();
            p[k] += h;
            let lp = loss(&p);
            p[k] -= 2.0 * h;
            let lm = loss(&p);
            let num = (lp - lm) / (2.0 * f64::from(h));
            let a = f64::from(grads[k]);
            let err = (a - num).abs();
            let tol = 4e-3 + 5e-2 * num.abs();
            worst = worst.max(err / tol);
            assert!(
                err <= tol,
                "{}[{j}]: analytic {a} vs numeric {num}",
                spec.name
            );
            checked += 1;
        }
    }
    eprintln!("freeze_bn={freeze_bn}: {checked} entries, worst error/tolerance {worst:.3}");
}

#[test]
fn resnet8_gradients_match_finite_differences() {
    run(false);
}

#[test]
fn resnet8_frozen_bn_gradients_match_finite_differences() {
    run(true);
}
