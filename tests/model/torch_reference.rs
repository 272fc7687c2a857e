//! One resnet18 training step on the CPU backend against PyTorch/torchvision in float64
//! (tests/model/torch_reference.py): weights go through safetensors into torchvision's own model
//! with `load_state_dict(strict=True)`, so names, shapes and layouts must match exactly; then
//! the loss, every gradient and the BN running statistics after the step are compared.
//!
//! Runs where `/usr/bin/python3` can import torch and torchvision (Debian's python3-torch and
//! python3-torchvision, which scripts/test.sh installs and then requires with
//! `BIRDTRAIN_REQUIRE_PEERS=1`); elsewhere it fails under that variable, and otherwise says so
//! on stderr and passes.

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

use birdtrain::backend::cpu::CpuBackend;
use birdtrain::model::{Arch, Graph, InputBatch, ModelState, Network, NetworkConfig};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

const PYTHON: &str = "/usr/bin/python3";

/// Whether the peer is there. Where the test command requires it (`BIRDTRAIN_REQUIRE_PEERS=1`,
/// set by scripts/test.sh after installing it) a missing peer fails the test instead.
fn torch_available() -> bool {
    let available = Command::new(PYTHON)
        .args(["-c", "import torch, torchvision, numpy"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        available || std::env::var_os("BIRDTRAIN_REQUIRE_PEERS").is_none_or(|v| v != "1"),
        "{PYTHON} cannot import torch, torchvision and numpy, which BIRDTRAIN_REQUIRE_PEERS=1 \
         requires: run scripts/install-test-peers.sh (Debian's python3-torch and \
         python3-torchvision)"
    );
    available
}

fn read_f32(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    let t = st
        .tensor(name)
        .unwrap_or_else(|_| panic!("reference lacks {name}"));
    t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn resnet18_step_matches_pytorch() {
    if !torch_available() {
        eprintln!("skipped: {PYTHON} cannot import torch and torchvision");
        return;
    }
    let (n, s, classes, smoothing) = (4usize, 64u32, 5usize, 0.1f32);
    let graph = Graph::new(Arch::ResNet18, classes);
    // Seed note: with seed 2 one pre-activation of layer2.0.bn1 sits within f32 rounding of
    // the ReLU kink, so f32 and f64 take different branches there and that channel's gradient
    // differs (seeds 3, 4, 5 agree to < 1e-4 everywhere); this seed avoids such a tie.
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let mut state = ModelState::init(&graph, 8);
    // Non-default BN parameters and running statistics, so every term is exercised.
    for (p, spec) in state.params.iter_mut().zip(graph.params()) {
        if spec.name.contains("bn") || spec.name.contains("downsample.1") {
            for v in p.iter_mut() {
                *v += rng.random_range(-0.2..0.2);
            }
        }
    }
    for b in state.buffers.iter_mut() {
        for v in b.iter_mut() {
            *v += rng.random_range(0.0..0.3);
        }
    }
    let px: Vec<u8> = (0..n * (s * s * 3) as usize)
        .map(|_| rng.random())
        .collect();
    let labels: Vec<u32> = (0..n as u32).map(|i| i % classes as u32).collect();

    let dir = std::env::temp_dir().join(format!("birdtrain-torch-ref-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let wpath = dir.join("w.safetensors");
    let ipath = dir.join("in.safetensors");
    let opath = dir.join("out.safetensors");
    state.save_safetensors(&graph, &wpath).unwrap();
    let lb: Vec<u8> = labels.iter().flat_map(|l| l.to_le_bytes()).collect();
    let shape = vec![n, s as usize, s as usize, 3];
    let input = safetensors::serialize(
        [
            ("pixels", TensorView::new(Dtype::U8, shape, &px).unwrap()),
            ("labels", TensorView::new(Dtype::U32, vec![n], &lb).unwrap()),
        ],
        None::<HashMap<String, String>>,
    )
    .unwrap();
    std::fs::write(&ipath, input).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/model/torch_reference.py");
    let out = Command::new(PYTHON)
        .arg(&script)
        .args(["resnet18", &classes.to_string(), &smoothing.to_string()])
        .args([&wpath, &ipath, &opath])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&opath).unwrap();
    let reference = SafeTensors::deserialize(&bytes).unwrap();

    let mut net = Network::new(CpuBackend::new(2).unwrap(), &graph, n, s).unwrap();
    net.load_state(&state).unwrap();
    net.set_config(NetworkConfig {
        label_smoothing: smoothing,
        ..NetworkConfig::default()
    });
    let batch = InputBatch {
        pixels: &px,
        labels: &labels,
        len: n,
        image_size: s,
        augment: None,
        mix: None,
    };
    let stats = net.train_step(&batch).unwrap();
    let want_loss = f64::from(read_f32(&reference, "loss")[0]);
    assert!(
        (stats.mean_loss() - want_loss).abs() < 1e-4 * want_loss.abs().max(1.0),
        "loss {} vs torch {want_loss}",
        stats.mean_loss()
    );

    let grads = net.grads_f32().unwrap();
    let (offsets, _) = graph.param_offsets();
    let mut worst = (0.0f64, String::new());
    for (i, spec) in graph.params().iter().enumerate() {
        let ours = &grads[offsets[i]..offsets[i] + spec.numel()];
        let theirs = read_f32(&reference, &format!("grad.{}", spec.name));
        let scale = theirs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (j, (a, t)) in ours.iter().zip(&theirs).enumerate() {
            let err = (a - t).abs();
            let tol = 2e-4 * scale + 2e-3 * t.abs() + 1e-7;
            if f64::from(err / tol) > worst.0 {
                worst = (f64::from(err / tol), spec.name.clone());
            }
            assert!(
                err <= tol,
                "{}[{j}]: ours {a} vs torch {t} (tensor max {scale})",
                spec.name
            );
        }
    }
    eprintln!(
        "gradients: worst error/tolerance {:.3} in {}",
        worst.0, worst.1
    );
    let after = net.state().unwrap();
    for ((b, spec), before) in after
        .buffers
        .iter()
        .zip(graph.buffers())
        .zip(&state.buffers)
    {
        if spec.name.ends_with("num_batches_tracked") {
            assert_eq!(b[0], before[0] + 1.0, "{}", spec.name);
            continue;
        }
        let theirs = read_f32(&reference, &format!("buffer.{}", spec.name));
        for (a, t) in b.iter().zip(&theirs) {
            assert!(
                (a - t).abs() <= 1e-4 * t.abs().max(1.0),
                "{}: ours {a} vs torch {t}",
                spec.name
            );
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
