//! The layer graphs: torchvision names, shapes, counts, order; model names; FLOPs.

use birdtrain::model::{Arch, BufferKind, Graph, ParamKind};

#[test]
fn resnet18_matches_torchvision_state_dict() {
    let g = Graph::new(Arch::ResNet18, 1000);
    assert_eq!(g.param_count(), 11_689_512);
    let names: Vec<&str> = g.params().iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        &names[..12],
        &[
            "conv1.weight",
            "bn1.weight",
            "bn1.bias",
            "layer1.0.conv1.weight",
            "layer1.0.bn1.weight",
            "layer1.0.bn1.bias",
            "layer1.0.conv2.weight",
            "layer1.0.bn2.weight",
            "layer1.0.bn2.bias",
            "layer1.1.conv1.weight",
            "layer1.1.bn1.weight",
            "layer1.1.bn1.bias",
        ]
    );
    let i = g.param_index("layer2.0.bn2.bias").unwrap();
    assert_eq!(names[i + 1], "layer2.0.downsample.0.weight");
    assert_eq!(names[i + 2], "layer2.0.downsample.1.weight");
    assert_eq!(names[i + 3], "layer2.0.downsample.1.bias");
    assert_eq!(names[i + 4], "layer2.1.conv1.weight");
    assert_eq!(&names[names.len() - 2..], &["fc.weight", "fc.bias"]);
    let shape = |n: &str| g.params()[g.param_index(n).unwrap()].shape.clone();
    assert_eq!(shape("conv1.weight"), vec![64, 3, 7, 7]);
    assert_eq!(shape("layer2.0.conv1.weight"), vec![128, 64, 3, 3]);
    assert_eq!(shape("layer2.0.downsample.0.weight"), vec![128, 64, 1, 1]);
    assert_eq!(shape("layer4.1.conv2.weight"), vec![512, 512, 3, 3]);
    assert_eq!(shape("fc.weight"), vec![1000, 512]);
    assert_eq!(g.params().len(), 62);
    // buffers: three per BN, torchvision order
    assert_eq!(g.buffers().len(), 20 * 3);
    assert_eq!(g.buffers()[0].name, "bn1.running_mean");
    assert_eq!(g.buffers()[1].name, "bn1.running_var");
    assert_eq!(g.buffers()[2].name, "bn1.num_batches_tracked");
    assert_eq!(g.buffers()[2].kind, BufferKind::NumBatchesTracked);
    assert!(g.buffers()[2].shape.is_empty());
    let ds = g
        .buffers()
        .iter()
        .position(|b| b.name == "layer2.0.downsample.1.running_mean")
        .unwrap();
    assert_eq!(g.buffers()[ds - 3].name, "layer2.0.bn2.running_mean");
}

#[test]
fn resnet50_matches_torchvision_state_dict() {
    let g = Graph::new(Arch::ResNet50, 1000);
    assert_eq!(g.param_count(), 25_557_032);
    let shape = |n: &str| g.params()[g.param_index(n).unwrap()].shape.clone();
    // v1.5: the stride sits in the 3×3 conv2 of the first block of a stage
    assert_eq!(shape("layer2.0.conv1.weight"), vec![128, 256, 1, 1]);
    assert_eq!(shape("layer2.0.conv2.weight"), vec![128, 128, 3, 3]);
    assert_eq!(shape("layer2.0.conv3.weight"), vec![512, 128, 1, 1]);
    assert_eq!(shape("layer1.0.downsample.0.weight"), vec![256, 64, 1, 1]);
    assert_eq!(shape("fc.weight"), vec![1000, 2048]);
    let names: Vec<&str> = g.params().iter().map(|p| p.name.as_str()).collect();
    let i = names
        .iter()
        .position(|n| *n == "layer1.0.bn3.bias")
        .unwrap();
    assert_eq!(names[i + 1], "layer1.0.downsample.0.weight");
    assert_eq!(g.params().len(), 161);
}

#[test]
fn other_torchvision_counts() {
    assert_eq!(Graph::new(Arch::ResNet34, 1000).param_count(), 21_797_672);
    assert_eq!(Graph::new(Arch::ResNet101, 1000).param_count(), 44_549_160);
    assert_eq!(Graph::new(Arch::ResNet152, 1000).param_count(), 60_192_808);
}

#[test]
fn cifar_family_layout() {
    let g = Graph::new(Arch::ResNet20, 10);
    let shape = |n: &str| g.params()[g.param_index(n).unwrap()].shape.clone();
    assert_eq!(shape("conv1.weight"), vec![16, 3, 3, 3]);
    assert_eq!(shape("layer3.2.conv2.weight"), vec![64, 64, 3, 3]);
    assert_eq!(shape("layer2.0.downsample.0.weight"), vec![32, 16, 1, 1]);
    assert!(g.param_index("layer1.0.downsample.0.weight").is_none());
    assert!(g.param_index("layer4.0.conv1.weight").is_none());
    assert_eq!(shape("fc.weight"), vec![10, 64]);
    let blocks = |a: Arch| {
        Graph::new(a, 10)
            .params()
            .iter()
            .filter(|p| p.name.ends_with("conv1.weight") && p.name.starts_with("layer"))
            .count()
    };
    assert_eq!(
        (
            blocks(Arch::ResNet8),
            blocks(Arch::ResNet20),
            blocks(Arch::ResNet56)
        ),
        (3, 9, 27)
    );
    // conv1/bn1: 2 values of 32·32·16; each block: conv, bn, conv, bn (4 values) and, where the
    // shape changes, a downsample conv + bn (2 more); then pool (64) and logits (10).
    let per_block = |hw: usize, c: usize| 4 * hw * c;
    let want = 32 * 32 * 3
        + 2 * 32 * 32 * 16
        + 3 * per_block(32 * 32, 16)
        + 3 * per_block(16 * 16, 32)
        + 2 * 16 * 16 * 32
        + 3 * per_block(8 * 8, 64)
        + 2 * 8 * 8 * 64
        + 64
        + 10;
    assert_eq!(g.activation_elements(32), want);
    let dims = g.value_dims(32);
    let last = dims[dims.len() - 1];
    assert_eq!((last.h, last.w, last.c), (1, 1, 10));
}

#[test]
fn decay_only_on_conv_and_linear_weights() {
    for p in Graph::new(Arch::ResNet18, 10).params() {
        let want = matches!(p.kind, ParamKind::ConvWeight | ParamKind::LinearWeight);
        assert_eq!(p.decay, want, "{}", p.name);
    }
}

#[test]
fn arch_names_parse_and_unknown_lists_valid() {
    for a in Arch::ALL {
        assert_eq!(a.name().parse::<Arch>().unwrap(), a);
    }
    assert_eq!("ResNet-50".parse::<Arch>().unwrap(), Arch::ResNet50);
    let err = "resnet19".parse::<Arch>().unwrap_err().to_string();
    assert!(
        err.contains("resnet19") && err.contains("resnet18, resnet34"),
        "{err}"
    );
}

#[test]
fn forward_flops_match_known_figures() {
    // torchvision quotes 1.81 / 4.09 GMACs at 224×224.
    let r18 = Arch::ResNet18.forward_flops(224, 1000) / 2e9;
    let r50 = Arch::ResNet50.forward_flops(224, 1000) / 2e9;
    assert!((r18 - 1.81).abs() < 0.02, "resnet18 {r18} GMACs");
    assert!((r50 - 4.09).abs() < 0.03, "resnet50 {r50} GMACs");
}
