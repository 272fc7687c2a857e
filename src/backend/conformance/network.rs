//! Whole networks: a training step and an eval step of one architecture against the CPU
//! reference.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{compare, compare_scaled, CheckReport, Tolerance};
use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::model::{
    Arch, Augment, Graph, InputBatch, ModelError, ModelState, Network, NetworkConfig,
};

/// One whole training step (loss, every parameter gradient, BN running statistics) and one
/// eval step (probabilities) of `arch` on `backend` against the CPU reference, on a random
/// augmented batch of `batch` images of side `image_size`. Gradients use a per-tensor scale:
/// `|got − ref| ≤ atol·max|ref| + rtol·|ref|`.
pub fn check_network<B: Backend>(
    backend: B,
    arch: Arch,
    image_size: u32,
    batch: usize,
    tol: Tolerance,
) -> Result<Vec<CheckReport>, ModelError> {
    let classes = 10;
    let graph = Graph::new(arch, classes);
    let state = ModelState::init(&graph, 1);
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let s = image_size as usize;
    let px: Vec<u8> = (0..batch * s * s * 3).map(|_| rng.random()).collect();
    let labels: Vec<u32> = (0..batch as u32).map(|i| i % classes as u32).collect();
    let m = Augment::max_shift(image_size);
    let aug: Vec<Augment> = (0..batch)
        .map(|_| Augment {
            dy: rng.random_range(-m..=m),
            dx: rng.random_range(-m..=m),
            flip: rng.random(),
            erase: None,
        })
        .collect();
    let input = InputBatch {
        pixels: &px,
        labels: &labels,
        len: batch,
        image_size,
        augment: Some(&aug),
        mix: None,
    };
    let config = NetworkConfig {
        label_smoothing: 0.1,
        ..NetworkConfig::default()
    };
    let mut reference = Network::new(CpuBackend::reference(2)?, &graph, batch, image_size)?;
    let mut test = Network::new(backend, &graph, batch, image_size)?;
    let mut reports = Vec::new();
    reference.load_state(&state)?;
    reference.set_config(config);
    test.load_state(&state)?;
    test.set_config(config);
    let want = reference.train_step(&input)?;
    let got = test.train_step(&input)?;
    reports.push(compare(
        &format!("{arch} train loss"),
        &[got.mean_loss() as f32],
        &[want.mean_loss() as f32],
        tol,
    )?);
    let (wg, gg) = (reference.grads_f32()?, test.grads_f32()?);
    let (offsets, _) = graph.param_offsets();
    for (i, spec) in graph.params().iter().enumerate() {
        let r = offsets[i]..offsets[i] + spec.numel();
        let scale = wg[r.clone()].iter().fold(0.0f32, |a, v| a.max(v.abs()));
        reports.push(compare_scaled(
            &format!("{arch} grad {}", spec.name),
            &gg[r.clone()],
            &wg[r],
            tol,
            scale.max(f32::MIN_POSITIVE),
        )?);
    }
    let (ws, gs) = (reference.state()?, test.state()?);
    for ((spec, w), g) in graph.buffers().iter().zip(&ws.buffers).zip(&gs.buffers) {
        reports.push(compare(&format!("{arch} buffer {}", spec.name), g, w, tol)?);
    }
    let plain = InputBatch {
        augment: None,
        ..input
    };
    let (_, wp) = reference.eval_step(&plain)?;
    let (_, gp) = test.eval_step(&plain)?;
    reports.push(compare(
        &format!("{arch} eval probabilities"),
        &gp,
        &wp,
        tol,
    )?);
    Ok(reports)
}
