//! Optimizer updates against hand-computed values, decay masks, state round trip, schedules.

use birdtrain::model::{ParamKind, ParamSpec};
use birdtrain::optim::{scaled_lr, Decay, Hyper, Optimizer, OptimizerKind, Schedule};

/// One decayed weight of 2 values and one non-decayed BN bias of 1 value.
fn specs() -> Vec<ParamSpec> {
    vec![
        ParamSpec {
            name: "conv.weight".into(),
            shape: vec![2],
            kind: ParamKind::ConvWeight,
            decay: true,
        },
        ParamSpec {
            name: "bn.bias".into(),
            shape: vec![1],
            kind: ParamKind::BnBias,
            decay: false,
        },
    ]
}

fn close(a: &[f32], b: &[f32]) {
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() < 1e-6, "{a:?} vs {b:?}");
    }
}

#[test]
fn sgd_momentum_with_decay_only_on_weights() {
    let kind = OptimizerKind::Sgd {
        momentum: 0.9,
        nesterov: false,
    };
    let hyper = Hyper {
        weight_decay: 0.1,
        ..Hyper::default()
    };
    let mut opt = Optimizer::new(kind, hyper, &specs());
    let mut p = vec![1.0, -2.0, 3.0];
    let g = [0.5, 0.5, 0.5];
    opt.step(&mut p, &g, 0.1).unwrap();
    // step 1: d = g + wd·p (weights only): [0.6, 0.3, 0.5]; buf = d; p -= 0.1·d
    close(&p, &[0.94, -2.03, 2.95]);
    opt.step(&mut p, &g, 0.1).unwrap();
    // step 2: d = [0.5+0.094, 0.5-0.203, 0.5] = [0.594, 0.297, 0.5];
    // buf = 0.9·[0.6,0.3,0.5] + d = [1.134, 0.567, 0.95]
    close(&p, &[0.94 - 0.1134, -2.03 - 0.0567, 2.95 - 0.095]);
}

#[test]
fn sgd_nesterov() {
    let kind = OptimizerKind::Sgd {
        momentum: 0.5,
        nesterov: true,
    };
    let mut opt = Optimizer::new(kind, Hyper::default(), &specs());
    let mut p = vec![0.0; 3];
    opt.step(&mut p, &[1.0, 2.0, -1.0], 1.0).unwrap();
    // buf = g; step = g + 0.5·buf = 1.5·g
    close(&p, &[-1.5, -3.0, 1.5]);
    opt.step(&mut p, &[1.0, 2.0, -1.0], 1.0).unwrap();
    // buf = 0.5·g + g = 1.5·g; step = g + 0.75·g = 1.75·g
    close(&p, &[-3.25, -6.5, 3.25]);
}

#[test]
fn adamw_decouples_decay_and_adam_adds_it_to_the_gradient() {
    let hyper = Hyper {
        weight_decay: 0.5,
        ..Hyper::default()
    };
    let g = [0.2f32, -0.4, 0.3];
    // AdamW step 1: p ← p(1 − lr·wd) on weights, then p −= lr·m̂/(√v̂+ε) with m̂ = g, v̂ = g².
    let mut opt = Optimizer::new(OptimizerKind::AdamW, hyper, &specs());
    let mut p = vec![1.0f32, 1.0, 1.0];
    let lr = 0.01f32;
    opt.step(&mut p, &g, lr).unwrap();
    let adam = |gi: f32| gi / (gi.abs() + 1e-8);
    close(
        &p,
        &[
            1.0 * (1.0 - lr * 0.5) - lr * adam(0.2),
            1.0 * (1.0 - lr * 0.5) - lr * adam(-0.4),
            1.0 - lr * adam(0.3),
        ],
    );
    // Adam step 1: decay enters the gradient: g' = g + wd·p = [0.7, 0.1, 0.3] (bias: no decay)
    let mut opt = Optimizer::new(OptimizerKind::Adam, hyper, &specs());
    let mut p = vec![1.0f32, 1.0, 1.0];
    opt.step(&mut p, &g, lr).unwrap();
    close(
        &p,
        &[
            1.0 - lr * adam(0.7),
            1.0 - lr * adam(0.1),
            1.0 - lr * adam(0.3),
        ],
    );
    // step 2 with bias correction, computed by hand for one element (no decay)
    let mut opt = Optimizer::new(OptimizerKind::Adam, Hyper::default(), &specs());
    let mut p = vec![0.0f32; 3];
    opt.step(&mut p, &[1.0, 1.0, 1.0], 1.0).unwrap();
    opt.step(&mut p, &[0.0, 0.0, 0.5], 1.0).unwrap();
    let m = 0.9 * 0.1 + 0.1 * 0.5;
    let v = 0.999 * 0.001 + 0.001 * 0.25;
    let mhat = m / (1.0 - 0.81);
    let vhat = v / (1.0 - 0.999f64 * 0.999);
    let want = -1.0 - mhat / (vhat.sqrt() + 1e-8);
    assert!((f64::from(p[2]) - want).abs() < 1e-5, "{} vs {want}", p[2]);
}

#[test]
fn wrong_lengths_are_errors() {
    let mut opt = Optimizer::new(OptimizerKind::Adam, Hyper::default(), &specs());
    let err = opt.step(&mut [0.0; 2], &[0.0; 3], 0.1).unwrap_err();
    assert!(err.to_string().contains("params has 2 values"), "{err}");
    assert!(opt.step(&mut [0.0; 3], &[0.0; 4], 0.1).is_err());
    assert_eq!(opt.steps(), 0);
}

#[test]
fn state_round_trip_continues_identically() {
    let mut a = Optimizer::new(OptimizerKind::AdamW, Hyper::default(), &specs());
    let mut p = vec![0.3f32, -0.2, 0.1];
    a.step(&mut p, &[0.1, 0.2, 0.3], 0.01).unwrap();
    let bytes = a.to_safetensors_bytes();
    let mut b = Optimizer::new(OptimizerKind::AdamW, Hyper::default(), &specs());
    b.load_safetensors_bytes(&bytes, std::path::Path::new("opt.safetensors"))
        .unwrap();
    assert_eq!(a, b);
    let mut pa = p.clone();
    let mut pb = p;
    a.step(&mut pa, &[0.3, 0.1, -0.2], 0.01).unwrap();
    b.step(&mut pb, &[0.3, 0.1, -0.2], 0.01).unwrap();
    assert_eq!(pa, pb);
    let mut sgd = Optimizer::new(
        OptimizerKind::Sgd {
            momentum: 0.9,
            nesterov: false,
        },
        Hyper::default(),
        &specs(),
    );
    let err = sgd
        .load_safetensors_bytes(&bytes, std::path::Path::new("opt.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("adamw") && err.contains("opt.safetensors"),
        "{err}"
    );
}

#[test]
fn optimizer_names_parse() {
    assert_eq!(
        "adamw".parse::<OptimizerKind>().unwrap(),
        OptimizerKind::AdamW
    );
    assert!(matches!(
        "SGD".parse::<OptimizerKind>().unwrap(),
        OptimizerKind::Sgd { .. }
    ));
    let err = "lion".parse::<OptimizerKind>().unwrap_err().to_string();
    assert!(err.contains("lion") && err.contains("adamw"), "{err}");
}

#[test]
fn schedules_warm_up_then_decay() {
    let s = Schedule {
        base_lr: 0.4,
        steps_per_epoch: 10,
        warmup_epochs: 1,
        total_epochs: 5,
        decay: Decay::Cosine,
    };
    assert!((s.lr_at(0) - 0.04).abs() < 1e-7);
    assert!((s.lr_at(4) - 0.2).abs() < 1e-7);
    assert!((s.lr_at(9) - 0.4).abs() < 1e-7);
    assert!((s.lr_at(10) - 0.4).abs() < 1e-7);
    assert!(
        (s.lr_at(30) - 0.2).abs() < 1e-6,
        "cosine midpoint {}",
        s.lr_at(30)
    );
    assert!(s.lr_at(50).abs() < 1e-7);
    let st = Schedule {
        decay: Decay::Step {
            every_epochs: 2,
            gamma: 0.1,
        },
        warmup_epochs: 0,
        ..s
    };
    assert!((st.lr_at(0) - 0.4).abs() < 1e-7);
    assert!((st.lr_at(19) - 0.4).abs() < 1e-7);
    assert!((st.lr_at(20) - 0.04).abs() < 1e-7);
    assert!((st.lr_at(45) - 0.004).abs() < 1e-7);
    assert!((scaled_lr(0.1, 512) - 0.2).abs() < 1e-7);
}

#[test]
fn identical_states_serialise_to_identical_bytes() {
    // safetensors' metadata is a HashMap whose iteration order differs between instances;
    // without a canonical header, 20 serialisations would almost surely not all agree.
    let graph = birdtrain::model::Graph::new(birdtrain::model::Arch::ResNet8, 3);
    let mut opt = birdtrain::optim::Optimizer::new(
        birdtrain::optim::OptimizerKind::Sgd {
            momentum: 0.9,
            nesterov: false,
        },
        birdtrain::optim::Hyper::default(),
        graph.params(),
    );
    let n = graph.param_count();
    let mut params = vec![0.5f32; n];
    opt.step(&mut params, &vec![0.25f32; n], 0.1).unwrap();
    let first = opt.to_safetensors_bytes();
    for _ in 0..20 {
        assert_eq!(opt.to_safetensors_bytes(), first);
    }
    let mut again = birdtrain::optim::Optimizer::new(
        birdtrain::optim::OptimizerKind::Sgd {
            momentum: 0.9,
            nesterov: false,
        },
        birdtrain::optim::Hyper::default(),
        graph.params(),
    );
    again
        .load_safetensors_bytes(&first, std::path::Path::new("optimizer.safetensors"))
        .unwrap();
    assert_eq!(
        again.to_safetensors_bytes(),
        first,
        "round trip keeps the bytes"
    );
}

#[test]
fn adams_bias_correction_is_formed_in_f64_as_pytorchs() {
    // Step 1 from zero state: m̂ = g and v̂ = g² exactly when 1 − β₂ is formed in f64 (in
    // f32, 1 − 0.999 is 1.0000467e-3 and the step comes out 2.3e-6 too long).
    let mut opt = Optimizer::new(OptimizerKind::Adam, Hyper::default(), &specs());
    let mut p = vec![0.0f32; 3];
    opt.step(&mut p, &[0.5, 0.5, 0.5], 0.1).unwrap();
    let want = -0.1 * 0.5 / (0.5 + 1e-8);
    for x in p {
        assert!((f64::from(x) - want).abs() < 2e-8, "{x} vs {want}");
    }
}
