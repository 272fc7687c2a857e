//! ModelState: initialisation, safetensors round trip, head replacement, clear errors.

use std::collections::HashMap;

use birdtrain::model::{Arch, Graph, HeadPolicy, ModelError, ModelState};
use safetensors::tensor::TensorView;
use safetensors::Dtype;

#[test]
fn init_follows_torchvision_scheme() {
    let g = Graph::new(Arch::ResNet18, 10);
    let s = ModelState::init(&g, 1);
    assert_eq!(s, ModelState::init(&g, 1));
    assert_ne!(s.params[0], ModelState::init(&g, 2).params[0]);
    // conv1: kaiming normal, fan_out = 64·7·7 → std √(2/3136)
    let w = &s.params[0];
    let var = w.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / w.len() as f64;
    let want = 2.0 / 3136.0;
    assert!(
        (var / want - 1.0).abs() < 0.05,
        "conv1 variance {var} vs {want}"
    );
    let fc = &s.params[g.param_index("fc.weight").unwrap()];
    let bound = 1.0 / 512f32.sqrt();
    assert!(fc.iter().all(|v| v.abs() <= bound));
    assert!(s.params[1].iter().all(|&v| v == 1.0) && s.params[2].iter().all(|&v| v == 0.0));
    assert!(s.buffers[1].iter().all(|&v| v == 1.0));
}

#[test]
fn safetensors_round_trip_is_exact() {
    let g = Graph::new(Arch::ResNet8, 5);
    let mut s = ModelState::init(&g, 3);
    s.buffers[0][0] = 0.25;
    s.buffers[2][0] = 17.0; // num_batches_tracked
    let dir = std::env::temp_dir().join(format!("birdtrain-model-state-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("w.safetensors");
    s.save_safetensors(&g, &path).unwrap();
    let back = ModelState::load_safetensors(&g, &path, HeadPolicy::Strict).unwrap();
    assert_eq!(back, s);
    // torch-compatible dtypes: num_batches_tracked is an I64 scalar
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let nbt = st.tensor("bn1.num_batches_tracked").unwrap();
    assert_eq!(nbt.dtype(), Dtype::I64);
    assert_eq!(nbt.shape(), &[] as &[usize]);
    assert_eq!(st.tensor("conv1.weight").unwrap().shape(), &[16, 3, 3, 3]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn head_is_replaced_only_when_asked() {
    let g10 = Graph::new(Arch::ResNet8, 10);
    let g3 = Graph::new(Arch::ResNet8, 3);
    let s = ModelState::init(&g10, 4);
    let bytes = s.to_safetensors_bytes(&g10, None).unwrap();
    let p = std::path::Path::new("w10.safetensors");
    let err = ModelState::from_safetensors_bytes(&g3, &bytes, p, HeadPolicy::Strict).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, ModelError::TensorMismatch { .. }), "{msg}");
    assert!(
        msg.contains("fc.weight") && msg.contains("w10.safetensors"),
        "{msg}"
    );
    let t = ModelState::from_safetensors_bytes(
        &g3,
        &bytes,
        p,
        HeadPolicy::ReplaceMismatched { seed: 9 },
    )
    .unwrap();
    t.validate(&g3).unwrap();
    let fc = g3.param_index("fc.weight").unwrap();
    assert_eq!(t.params[fc].len(), 3 * 64);
    assert_eq!(t.params[fc], ModelState::init(&g3, 9).params[fc]);
    // everything but the head comes from the file
    assert_eq!(t.params[..fc], s.params[..fc]);
    assert_eq!(t.buffers, s.buffers);
}

#[test]
fn wrong_model_and_missing_tensor_are_clear_errors() {
    let g8 = Graph::new(Arch::ResNet8, 10);
    let g20 = Graph::new(Arch::ResNet20, 10);
    let bytes = ModelState::init(&g8, 1)
        .to_safetensors_bytes(&g8, None)
        .unwrap();
    let p = std::path::Path::new("r8.safetensors");
    let err = ModelState::from_safetensors_bytes(
        &g20,
        &bytes,
        p,
        HeadPolicy::ReplaceMismatched { seed: 0 },
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("missing tensor 'layer1.1.conv1.weight'") && err.contains("resnet20"),
        "{err}"
    );
    let g18 = Graph::new(Arch::ResNet18, 10);
    let err = ModelState::from_safetensors_bytes(&g18, &bytes, p, HeadPolicy::Strict)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("conv1.weight") && err.contains("another model"),
        "{err}"
    );
    let err =
        ModelState::from_safetensors_bytes(&g8, b"not a file", p, HeadPolicy::Strict).unwrap_err();
    assert!(matches!(err, ModelError::Safetensors { .. }));
    let err = ModelState::load_safetensors(
        &g8,
        std::path::Path::new("/nonexistent/w.safetensors"),
        HeadPolicy::Strict,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("/nonexistent/w.safetensors"), "{err}");
}

#[test]
fn loads_bf16_tensors_as_pytorch_may_write_them() {
    let g = Graph::new(Arch::ResNet8, 2);
    let s = ModelState::init(&g, 5);
    let mut blobs: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (v, spec) in s.params.iter().zip(g.params()) {
        let b: Vec<u8> = v
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect();
        blobs.push((spec.name.clone(), spec.shape.clone(), b));
    }
    for (v, spec) in s.buffers.iter().zip(g.buffers()) {
        let b: Vec<u8> = v
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect();
        blobs.push((spec.name.clone(), spec.shape.clone(), b));
    }
    let views: Vec<(String, TensorView<'_>)> = blobs
        .iter()
        .map(|(n, sh, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::BF16, sh.clone(), b).unwrap(),
            )
        })
        .collect();
    let bytes = safetensors::serialize(views, None::<HashMap<String, String>>).unwrap();
    let t = ModelState::from_safetensors_bytes(
        &g,
        &bytes,
        std::path::Path::new("bf16"),
        HeadPolicy::Strict,
    )
    .unwrap();
    for (a, b) in t.params.iter().flatten().zip(s.params.iter().flatten()) {
        assert!((a - b).abs() <= b.abs() / 128.0 + 1e-30);
    }
}

#[test]
fn zero_init_residual_zeroes_exactly_the_last_batch_norm_of_each_block() {
    // torchvision's zero_init_residual: bn3 of every Bottleneck, bn2 of every BasicBlock
    // (the CIFAR members' blocks too); nothing else changes.
    for (arch, last, blocks) in [
        (Arch::ResNet50, ".bn3.weight", 16),
        (Arch::ResNet18, ".bn2.weight", 8),
        (Arch::ResNet20, ".bn2.weight", 9),
    ] {
        let g = Graph::new(arch, 10);
        let plain = ModelState::init(&g, 5);
        let mut zeroed = plain.clone();
        zeroed.zero_residual_gammas(&g);
        let changed: Vec<&str> = g
            .params()
            .iter()
            .zip(plain.params.iter().zip(&zeroed.params))
            .filter(|(_, (a, b))| a != b)
            .map(|(p, _)| p.name.as_str())
            .collect();
        assert_eq!(changed.len(), blocks, "{arch}: {changed:?}");
        assert!(
            changed.iter().all(|n| n.ends_with(last)),
            "{arch}: {changed:?}"
        );
        for (p, v) in g.params().iter().zip(&zeroed.params) {
            if changed.contains(&p.name.as_str()) {
                assert!(v.iter().all(|&x| x == 0.0), "{}", p.name);
            }
        }
        assert_eq!(plain.buffers, zeroed.buffers);
    }
}
