//! torchvision's initialisation scheme, from a seed.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::graph::{BufferKind, BufferSpec, ParamKind, ParamSpec};

/// A deterministic random source for one parameter: seeded from (seed, parameter name), so a
/// head re-initialised alone gets the same values as in a full init.
pub(crate) fn param_rng(seed: u64, name: &str) -> ChaCha8Rng {
    let h = xxhash_rust::xxh3::xxh3_64_with_seed(name.as_bytes(), seed);
    ChaCha8Rng::seed_from_u64(h)
}

/// Standard normal by Box–Muller (no extra crate needed).
fn normal(rng: &mut ChaCha8Rng) -> f32 {
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random::<f64>();
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

/// Initial values of one parameter as torchvision's `ResNet.__init__` sets them:
/// convolutions kaiming-normal (fan_out, ReLU gain), BN γ=1 β=0, the classifier as
/// `nn.Linear` (uniform ±1/√fan_in for weight and bias).
/// `linear_fan_in` is the classifier's input width (used for `fc.weight` and `fc.bias`).
pub(crate) fn init_param(spec: &ParamSpec, seed: u64, linear_fan_in: usize) -> Vec<f32> {
    let n = spec.numel();
    let mut rng = param_rng(seed, &spec.name);
    match spec.kind {
        ParamKind::ConvWeight => {
            let fan_out = spec.shape[0] * spec.shape[2] * spec.shape[3];
            let std = (2.0 / fan_out as f32).sqrt();
            (0..n).map(|_| normal(&mut rng) * std).collect()
        }
        ParamKind::BnWeight => vec![1.0; n],
        ParamKind::BnBias => vec![0.0; n],
        ParamKind::LinearWeight | ParamKind::LinearBias => {
            let bound = 1.0 / (linear_fan_in.max(1) as f32).sqrt();
            (0..n).map(|_| rng.random_range(-bound..=bound)).collect()
        }
    }
}

/// Initial values of a buffer: running mean 0, running var 1, batch count 0.
pub(crate) fn init_buffer(spec: &BufferSpec) -> Vec<f32> {
    let v = match spec.kind {
        BufferKind::RunningMean | BufferKind::NumBatchesTracked => 0.0,
        BufferKind::RunningVar => 1.0,
    };
    vec![v; spec.numel()]
}
