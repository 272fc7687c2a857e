use birdtrain::backend::cpu::{CpuBackend, Kernels, SimdLevel};
use birdtrain::model::{Arch, Augment, Graph, InputBatch, ModelState, Network};
use rand::{Rng, SeedableRng};
#[test]
fn probe() {
    for (arch, size) in [(Arch::ResNet8, 16u32), (Arch::ResNet18, 32)] {
        for batch in [3usize, 8, 12] {
            for level in [SimdLevel::best(), SimdLevel::Portable] {
                let graph = Graph::new(arch, 10);
                let state = ModelState::init(&graph, 1);
                let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
                let s = size as usize;
                let px: Vec<u8> = (0..batch * s * s * 3).map(|_| rng.random()).collect();
                let labels: Vec<u32> = (0..batch as u32).map(|i| i % 10).collect();
                let m = Augment::max_shift(size);
                let aug: Vec<Augment> = (0..batch)
                    .map(|_| Augment {
                        dy: rng.random_range(-m..=m),
                        dx: rng.random_range(-m..=m),
                        flip: rng.random(),
                    })
                    .collect();
                let input = InputBatch {
                    pixels: &px,
                    labels: &labels,
                    len: batch,
                    image_size: size,
                    augment: Some(&aug),
                };
                let mut r =
                    Network::new(CpuBackend::reference(2).unwrap(), &graph, batch, size).unwrap();
                r.set_config(birdtrain::model::NetworkConfig {
                    label_smoothing: 0.1,
                    ..Default::default()
                });
                let mut t = Network::new(
                    CpuBackend::with_options(1, level, Kernels::Fast).unwrap(),
                    &graph,
                    batch,
                    size,
                )
                .unwrap();
                r.load_state(&state).unwrap();
                t.load_state(&state).unwrap();
                t.set_config(r.config());
                let a = r.train_step(&input).unwrap();
                let b = t.train_step(&input).unwrap();
                let (gr, gt) = (r.grads_f32().unwrap(), t.grads_f32().unwrap());
                let (offsets, _) = graph.param_offsets();
                let mut worst = (0.0f64, String::new());
                for (i, spec) in graph.params().iter().enumerate() {
                    let rr = &gr[offsets[i]..offsets[i] + spec.numel()];
                    let tt = &gt[offsets[i]..offsets[i] + spec.numel()];
                    let num: f64 = rr
                        .iter()
                        .zip(tt)
                        .map(|(a, b)| ((a - b) as f64).powi(2))
                        .sum();
                    let den: f64 = rr.iter().map(|a| (*a as f64).powi(2)).sum();
                    let rel = (num / den.max(1e-30)).sqrt();
                    if rel > worst.0 {
                        worst = (rel, spec.name.clone());
                    }
                }
                eprintln!(
                    "{arch} b{batch} {level}: loss {} vs {}, worst rel L2 {:.3e} {}",
                    a.mean_loss(),
                    b.mean_loss(),
                    worst.0,
                    worst.1
                );
            }
        }
    }
}
