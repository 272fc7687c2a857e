//! The conformance harness the CUDA backend is checked with, run here on the fast CPU
//! backend (direct convolutions, vectorised batch norm) against the reference CPU backend
//! (im2col + GEMM, f64 batch-norm reductions), at the vector width this processor dispatches
//! to and at the portable fallback (the same generic code the AVX-512 instantiation is).

use birdtrain::backend::conformance::{
    bn_fusion_shapes, check_bn_fusion, check_bn_fusion_repeatable, check_conv_bn,
    check_conv_bn_repeatable, check_convs, check_network, check_ops, check_pool_bn,
    check_pool_bn_repeatable, compare, conv_bn_shapes, pool_bn_shapes, Tolerance,
};
use birdtrain::backend::cpu::{CpuBackend, Kernels, SimdLevel};
use birdtrain::backend::{
    Backend, BackendError, BnBackward, BnForward, BnMode, BnShape, ConvShape,
};
use birdtrain::model::Arch;

/// The detected level and the portable fallback (once if they are the same).
fn levels() -> Vec<SimdLevel> {
    let mut v = vec![SimdLevel::best(), SimdLevel::Portable];
    v.dedup();
    v
}

fn fast(threads: usize, level: SimdLevel) -> CpuBackend {
    CpuBackend::with_options(threads, level, Kernels::Fast).unwrap()
}

#[test]
fn cpu_one_thread_conforms_op_by_op() {
    for level in levels() {
        let reports = check_ops(&fast(1, level), Tolerance::F32).unwrap();
        assert!(reports.len() > 50, "{} checks", reports.len());
        for r in &reports {
            eprintln!("{level}: {r}");
            assert!(r.worst_ratio <= 1.0);
        }
    }
}

#[test]
fn fused_batch_norm_ops_conform() {
    // The harness the GPU's fused kernels are held to (tests/gpu/cuda_kernels.rs), on the fast CPU
    // backend: its fused ops compose the separate ones, so they must agree to f32 rounding.
    let cpu = fast(2, SimdLevel::best());
    let reports = check_bn_fusion(&cpu, &bn_fusion_shapes(), Tolerance::F32).unwrap();
    assert_eq!(reports.len(), 8 * (4 + 3 * 3 + 3 + 3), "checks per shape");
    for r in &reports {
        eprintln!("{r}");
    }
    check_bn_fusion_repeatable(&cpu, &bn_fusion_shapes()).unwrap();
}

#[test]
fn the_max_pool_applying_a_batch_norm_conforms_to_the_bit() {
    // The harness the GPU's maxpool_bn kernels are held to, on the CPU's fast kernels at each
    // vector width and on its reference kernels: the output and the finished gradient to the
    // bit (the inputs make the batch norm exact), the two reductions to f32 rounding.
    let mut backends: Vec<(String, CpuBackend)> = levels()
        .into_iter()
        .map(|level| (format!("fast {level}"), fast(2, level)))
        .collect();
    backends.push(("reference".into(), CpuBackend::reference(2).unwrap()));
    for (name, cpu) in &backends {
        let reports = check_pool_bn(cpu, &pool_bn_shapes(), Tolerance::F32).unwrap();
        assert_eq!(
            reports.len(),
            pool_bn_shapes().len() * 2 * 4,
            "checks per shape"
        );
        for r in &reports {
            eprintln!("{name}: {r}");
        }
        check_pool_bn_repeatable(cpu, &pool_bn_shapes()).unwrap();
    }
}

#[test]
fn the_pool_check_catches_a_missing_mask() {
    let err = check_pool_bn(
        &Transposed(CpuBackend::new(1).unwrap(), Fault::NoMask),
        &pool_bn_shapes(),
        Tolerance::F32,
    )
    .unwrap_err();
    assert!(err.to_string().contains("maxpool_bn_backward g"), "{err}");
}

#[test]
fn convolutions_applying_a_batch_norm_match_the_separate_ops_to_the_bit_and_repeat() {
    let mut backends: Vec<(String, CpuBackend)> = levels()
        .into_iter()
        .map(|l| (format!("fast {l}"), fast(2, l)))
        .collect();
    backends.push(("reference".into(), CpuBackend::reference(2).unwrap()));
    for (name, cpu) in &backends {
        let reports = check_conv_bn(cpu, &conv_bn_shapes(), Tolerance::F32).unwrap();
        // Per ReLU setting: y (bits, reference), y and moments with moments, dw (bits,
        // reference), then dx, dγ, dβ plain and accumulating.
        assert_eq!(
            reports.len(),
            conv_bn_shapes().len() * 2 * 12,
            "checks per shape"
        );
        for r in &reports {
            eprintln!("{name}: {r}");
        }
        check_conv_bn_repeatable(cpu, &conv_bn_shapes()).unwrap();
    }
}

#[test]
fn the_applied_convolution_check_catches_a_lost_relu() {
    let err = check_conv_bn(
        &Transposed(CpuBackend::new(1).unwrap(), Fault::NoMask),
        &conv_bn_shapes(),
        Tolerance::F32,
    )
    .unwrap_err();
    assert!(err.to_string().contains("conv_forward_bn y"), "{err}");
}

#[test]
fn direct_convolutions_match_im2col_at_odd_shapes() {
    for level in levels() {
        let reports = check_convs(&fast(2, level), Tolerance::F32).unwrap();
        assert_eq!(reports.len(), 17 * 4, "four checks per shape");
        let worst = reports.iter().fold(0.0f32, |m, r| m.max(r.worst_ratio));
        for r in &reports {
            eprintln!("{level}: {r}");
        }
        eprintln!("{level}: worst err/tol {worst:.3}");
        assert!(worst <= 1.0);
    }
}

#[test]
fn the_checks_catch_a_wrong_convolution() {
    // A backend that is not the reference must fail the harness: feed it a shape whose
    // weights were transposed (OIHW read as OHWI) and expect a mismatch.
    let err = check_convs(
        &Transposed(CpuBackend::new(1).unwrap(), Fault::Weights),
        Tolerance::F32,
    )
    .unwrap_err();
    assert!(matches!(err, BackendError::Mismatch { .. }), "{err}");
    assert!(err.to_string().contains("conv_forward"), "{err}");
}

#[test]
fn the_fused_checks_catch_a_wrong_convolution_and_a_missing_mask() {
    let shapes = bn_fusion_shapes();
    let err = check_bn_fusion(
        &Transposed(CpuBackend::new(1).unwrap(), Fault::Weights),
        &shapes,
        Tolerance::F32,
    )
    .unwrap_err();
    assert!(err.to_string().contains("conv_forward_moments y"), "{err}");
    let err = check_bn_fusion(
        &Transposed(CpuBackend::new(1).unwrap(), Fault::NoMask),
        &shapes,
        Tolerance::F32,
    )
    .unwrap_err();
    assert!(err.to_string().contains("conv_backward_data_bn g"), "{err}");
}

/// What [`Transposed`] gets wrong.
#[derive(Clone, Copy, PartialEq)]
enum Fault {
    /// Its convolutions read OIHW weights as OHWI.
    Weights,
    /// Its fused data gradient (and fused max pool's gradient) forgets the ReLU mask, and its
    /// convolution that applies a batch norm forgets that batch norm's ReLU.
    NoMask,
}

/// The CPU backend with one deliberate fault, for the harness to catch.
struct Transposed(CpuBackend, Fault);

impl Backend for Transposed {
    type Tensor = Vec<f32>;
    type Sums = Vec<f64>;
    fn alloc_sums(&self, len: usize) -> Result<Vec<f64>, BackendError> {
        self.0.alloc_sums(len)
    }
    fn sums_mut<'a>(&self, sums: &'a mut Vec<f64>) -> birdtrain::backend::SumsMut<'a> {
        self.0.sums_mut(sums)
    }
    fn name(&self) -> String {
        "transposed".into()
    }
    fn alloc(
        &self,
        len: usize,
        role: birdtrain::backend::TensorRole,
    ) -> Result<Vec<f32>, BackendError> {
        self.0.alloc(len, role)
    }
    fn alloc_views(
        &self,
        total: usize,
        ranges: &[std::ops::Range<usize>],
        role: birdtrain::backend::TensorRole,
    ) -> Result<Option<birdtrain::backend::GradientViews<Vec<f32>>>, BackendError> {
        self.0.alloc_views(total, ranges, role)
    }
    fn keep_relu_signs(&self, y: &mut Vec<f32>) -> Result<(), BackendError> {
        self.0.keep_relu_signs(y)
    }
    fn len(&self, t: &Vec<f32>) -> usize {
        t.len()
    }
    fn upload(&self, src: &[f32], dst: &mut Vec<f32>) -> Result<(), BackendError> {
        self.0.upload(src, dst)
    }
    fn download(&self, src: &Vec<f32>) -> Result<Vec<f32>, BackendError> {
        self.0.download(src)
    }
    fn input(
        &self,
        b: &birdtrain::model::InputBatch<'_>,
        out: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.0.input(b, out)
    }
    fn conv_forward(
        &self,
        s: &ConvShape,
        x: &Vec<f32>,
        w: &Vec<f32>,
        y: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.0.conv_forward(s, x, &self.weights(s, w), y)
    }
    fn conv_backward_data(
        &self,
        s: &ConvShape,
        dy: &Vec<f32>,
        w: &Vec<f32>,
        dx: &mut Vec<f32>,
        acc: bool,
    ) -> Result<(), BackendError> {
        self.0.conv_backward_data(s, dy, w, dx, acc)
    }
    fn bn_fusion(&self) -> bool {
        self.0.bn_fusion()
    }
    fn conv_applies_bn(&self) -> bool {
        self.0.conv_applies_bn()
    }
    fn conv_forward_bn(
        &self,
        s: &ConvShape,
        z: &Vec<f32>,
        bn: &birdtrain::backend::AppliedBn<'_, Vec<f32>>,
        w: &Vec<f32>,
        y: &mut Vec<f32>,
        moments: Option<&mut Vec<f32>>,
    ) -> Result<(), BackendError> {
        let bn = birdtrain::backend::AppliedBn {
            relu: bn.relu && self.1 != Fault::NoMask,
            ..*bn
        };
        self.0
            .conv_forward_bn(s, z, &bn, &self.weights(s, w), y, moments)
    }
    fn conv_backward_weight_bn(
        &self,
        s: &ConvShape,
        z: &Vec<f32>,
        bn: &birdtrain::backend::AppliedBn<'_, Vec<f32>>,
        dy: &Vec<f32>,
        dw: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.0.conv_backward_weight_bn(s, z, bn, dy, dw)
    }
    fn conv_forward_moments(
        &self,
        s: &ConvShape,
        x: &Vec<f32>,
        w: &Vec<f32>,
        y: &mut Vec<f32>,
        moments: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.0
            .conv_forward_moments(s, x, &self.weights(s, w), y, moments)
    }
    fn conv_backward_data_bn(
        &self,
        s: &ConvShape,
        dy: &Vec<f32>,
        w: &Vec<f32>,
        dx: &mut Vec<f32>,
        acc: bool,
        bn: birdtrain::backend::BnGradEpilogue<'_, Vec<f32>>,
    ) -> Result<(), BackendError> {
        let relu = bn.relu && self.1 != Fault::NoMask;
        self.0.conv_backward_data_bn(
            s,
            dy,
            w,
            dx,
            acc,
            birdtrain::backend::BnGradEpilogue { relu, ..bn },
        )
    }
    fn conv_backward_weight(
        &self,
        s: &ConvShape,
        x: &Vec<f32>,
        dy: &Vec<f32>,
        dw: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.0.conv_backward_weight(s, x, dy, dw)
    }
    fn bn_forward(&self, a: BnForward<'_, Vec<f32>>) -> Result<(), BackendError> {
        self.0.bn_forward(a)
    }
    fn bn_backward(&self, a: BnBackward<'_, Vec<f32>>) -> Result<(), BackendError> {
        self.0.bn_backward(a)
    }
    fn maxpool_forward(
        &self,
        s: &birdtrain::backend::PoolShape,
        x: &Vec<f32>,
        y: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.0.maxpool_forward(s, x, y)
    }
    fn maxpool_backward(
        &self,
        s: &birdtrain::backend::PoolShape,
        x: &Vec<f32>,
        dy: &Vec<f32>,
        dx: &mut Vec<f32>,
        acc: bool,
    ) -> Result<(), BackendError> {
        self.0.maxpool_backward(s, x, dy, dx, acc)
    }
    fn maxpool_bn_forward(
        &self,
        s: &birdtrain::backend::PoolShape,
        z: &Vec<f32>,
        bn: &birdtrain::backend::AppliedBn<'_, Vec<f32>>,
        y: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.0.maxpool_bn_forward(s, z, bn, y)
    }
    fn maxpool_bn_backward(
        &self,
        s: &birdtrain::backend::PoolShape,
        z: &Vec<f32>,
        bn: &birdtrain::backend::AppliedBn<'_, Vec<f32>>,
        dy: &Vec<f32>,
        g: &mut Vec<f32>,
        dgamma: &mut Vec<f32>,
        dbeta: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        let bn = birdtrain::backend::AppliedBn {
            relu: bn.relu && self.1 != Fault::NoMask,
            ..*bn
        };
        self.0.maxpool_bn_backward(s, z, &bn, dy, g, dgamma, dbeta)
    }
    fn gap_forward(
        &self,
        n: usize,
        hw: usize,
        c: usize,
        x: &Vec<f32>,
        y: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.0.gap_forward(n, hw, c, x, y)
    }
    fn gap_backward(
        &self,
        n: usize,
        hw: usize,
        c: usize,
        dy: &Vec<f32>,
        dx: &mut Vec<f32>,
        acc: bool,
    ) -> Result<(), BackendError> {
        self.0.gap_backward(n, hw, c, dy, dx, acc)
    }
    fn linear_forward(
        &self,
        s: &birdtrain::backend::LinearShape,
        x: &Vec<f32>,
        w: &Vec<f32>,
        b: &Vec<f32>,
        y: &mut Vec<f32>,
    ) -> Result<(), BackendError> {
        self.0.linear_forward(s, x, w, b, y)
    }
    fn linear_backward(
        &self,
        s: &birdtrain::backend::LinearShape,
        x: &Vec<f32>,
        w: &Vec<f32>,
        dy: &Vec<f32>,
        dx: &mut Vec<f32>,
        dw: &mut Vec<f32>,
        db: &mut Vec<f32>,
        acc: bool,
    ) -> Result<(), BackendError> {
        self.0.linear_backward(s, x, w, dy, dx, dw, db, acc)
    }
    fn softmax_cross_entropy(
        &self,
        n: usize,
        classes: usize,
        logits: &Vec<f32>,
        targets: &birdtrain::backend::Targets<'_>,
        d: Option<&mut Vec<f32>>,
        p: Option<&mut Vec<f32>>,
    ) -> Result<birdtrain::backend::LossStats, BackendError> {
        self.0
            .softmax_cross_entropy(n, classes, logits, targets, d, p)
    }
}

impl Transposed {
    /// The weight its convolutions use: `w` itself, or transposed (OIHW read as OHWI).
    fn weights(&self, s: &ConvShape, w: &[f32]) -> Vec<f32> {
        let mut wt = w.to_vec();
        if self.1 == Fault::Weights {
            let k = s.kernel * s.kernel;
            for o in 0..s.c_out {
                for t in 0..k {
                    for c in 0..s.c_in {
                        wt[(o * k + t) * s.c_in + c] = w[(o * s.c_in + c) * k + t];
                    }
                }
            }
        }
        wt
    }
}

/// Runs every convolution pass and a batch norm forward/backward on `b`, returning all outputs.
fn op_outputs(b: &CpuBackend) -> Vec<Vec<f32>> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    let mut rand = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
    let mut out = Vec::new();
    for s in [
        ConvShape {
            n: 4,
            h: 32,
            w: 32,
            c_in: 16,
            c_out: 16,
            kernel: 3,
            stride: 1,
            padding: 1,
        },
        ConvShape {
            n: 3,
            h: 9,
            w: 9,
            c_in: 32,
            c_out: 64,
            kernel: 3,
            stride: 2,
            padding: 1,
        },
        ConvShape {
            n: 2,
            h: 16,
            w: 16,
            c_in: 3,
            c_out: 16,
            kernel: 7,
            stride: 2,
            padding: 3,
        },
    ] {
        let (x, w, dy) = (rand(s.x_len()), rand(s.w_len()), rand(s.y_len()));
        let mut y = vec![0.0; s.y_len()];
        b.conv_forward(&s, &x, &w, &mut y).unwrap();
        let mut dx = vec![0.0; s.x_len()];
        b.conv_backward_data(&s, &dy, &w, &mut dx, false).unwrap();
        let mut dw = vec![0.0; s.w_len()];
        b.conv_backward_weight(&s, &x, &dy, &mut dw).unwrap();
        out.extend([y, dx, dw]);
    }
    let (rows, c) = (3000, 24);
    let shape = BnShape { rows, channels: c };
    let (x, dy, res) = (rand(rows * c), rand(rows * c), rand(rows * c));
    let (gamma, beta) = (rand(c), rand(c));
    let (mut y, mut m, mut is, mut rm, mut rv) = (
        vec![0.0; rows * c],
        vec![0.0; c],
        vec![0.0; c],
        vec![0.0; c],
        vec![1.0; c],
    );
    b.bn_forward(BnForward {
        shape,
        x: &x,
        gamma: &gamma,
        beta: &beta,
        residual: Some(&res),
        relu: true,
        y: Some(&mut y),
        saved_mean: &mut m,
        saved_invstd: &mut is,
        running_mean: &mut rm,
        running_var: &mut rv,
        mode: BnMode::Train,
        momentum: 0.1,
        eps: 1e-5,
        moments: None,
    })
    .unwrap();
    let (mut dx, mut dres, mut dg, mut db) = (
        vec![0.0; rows * c],
        vec![0.0; rows * c],
        vec![0.0; c],
        vec![0.0; c],
    );
    b.bn_backward(BnBackward {
        shape,
        x: &x,
        y: Some(&y),
        gamma: &gamma,
        saved_mean: &m,
        saved_invstd: &is,
        batch_stats: true,
        relu: true,
        dy: &dy,
        dx: &mut dx,
        dresidual: Some((&mut dres, false)),
        dgamma: &mut dg,
        dbeta: &mut db,
        prepared: false,
    })
    .unwrap();
    out.extend([y, m, is, rm, rv, dx, dres, dg, db]);
    out
}

#[test]
fn fast_kernels_give_the_same_bits_for_any_thread_count_and_run() {
    for level in levels() {
        let one = op_outputs(&fast(1, level));
        assert_eq!(one, op_outputs(&fast(1, level)), "{level}: run to run");
        assert_eq!(one, op_outputs(&fast(3, level)), "{level}: 1 vs 3 threads");
    }
}

/// Whole training steps of the fast backend against the reference, on augmented batches.
///
/// Element-wise tolerances cannot hold for gradients here: two correct f32 implementations
/// round differently, and where a pre-activation lies within that rounding of zero the ReLU
/// mask differs, which changes that pixel's gradient outright (about one such element per
/// few hundred thousand activations; measured here: up to 2 % relative L2 error in the
/// tensor it lands in and 1.4 % over the whole model, against 1e-5 without one). So gradients
/// are compared by relative L2 error, per tensor (≤ 10 %) and over the whole model (≤ 5 %),
/// which still catches any wrong layer (errors of order 1); the op-by-op checks above are the
/// strict ones. The loss, the BN running
/// statistics and the evaluation probabilities, which a flipped mask cannot move, element-wise
/// at the f32 tolerance.
#[test]
fn fast_whole_steps_match_the_reference() {
    use birdtrain::model::{Augment, Graph, InputBatch, ModelState, Network, NetworkConfig};
    use rand::{Rng, SeedableRng};
    for level in levels() {
        for (arch, size, batch) in [(Arch::ResNet8, 16u32, 8usize), (Arch::ResNet18, 32, 8)] {
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
                    erase: None,
                })
                .collect();
            let input = InputBatch {
                pixels: &px,
                labels: &labels,
                len: batch,
                image_size: size,
                augment: Some(&aug),
                mix: None,
            };
            let config = NetworkConfig {
                label_smoothing: 0.1,
                ..NetworkConfig::default()
            };
            let mut nets = [CpuBackend::reference(2).unwrap(), fast(1, level)].map(|b| {
                let mut net = Network::new(b, &graph, batch, size).unwrap();
                net.load_state(&state).unwrap();
                net.set_config(config);
                net
            });
            let losses = nets
                .each_mut()
                .map(|n| n.train_step(&input).unwrap().mean_loss());
            let tag = format!("{level} {arch}");
            compare(
                &format!("{tag} loss"),
                &[losses[1] as f32],
                &[losses[0] as f32],
                Tolerance::F32,
            )
            .unwrap();
            let [want, got] = nets.each_ref().map(|n| n.grads_f32().unwrap());
            let (offsets, _) = graph.param_offsets();
            let l2 = |a: &[f32], b: &[f32]| -> f64 {
                let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
                let den: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum();
                (num / den.max(f64::MIN_POSITIVE)).sqrt()
            };
            for (i, spec) in graph.params().iter().enumerate() {
                let r = offsets[i]..offsets[i] + spec.numel();
                let e = l2(&want[r.clone()], &got[r]);
                assert!(
                    e <= 0.1,
                    "{tag} grad {}: relative L2 error {e:.3e}",
                    spec.name
                );
            }
            let global = l2(&want, &got);
            eprintln!(
                "{tag}: loss {:.6} vs {:.6}, gradients relative L2 {global:.2e}",
                losses[0], losses[1]
            );
            assert!(
                global <= 5e-2,
                "{tag}: gradients relative L2 error {global:.3e}"
            );
            let [ws, gs] = nets.each_ref().map(|n| n.state().unwrap());
            for ((spec, w), g) in graph.buffers().iter().zip(&ws.buffers).zip(&gs.buffers) {
                compare(&format!("{tag} buffer {}", spec.name), g, w, Tolerance::F32).unwrap();
            }
            let plain = InputBatch {
                augment: None,
                ..input
            };
            let [(_, wp), (_, gp)] = nets.each_mut().map(|n| n.eval_step(&plain).unwrap());
            compare(
                &format!("{tag} eval probabilities"),
                &gp,
                &wp,
                Tolerance::F32,
            )
            .unwrap();
        }
    }
}

#[test]
fn the_whole_step_harness_runs_on_the_cpu() {
    // check_network (what the GPU tests call) against the reference, at a tolerance that
    // covers f32 rounding through a small network.
    let tol = Tolerance {
        atol: 1e-3,
        rtol: 1e-3,
    };
    let reports = check_network(fast(1, SimdLevel::best()), Arch::ResNet8, 16, 4, tol).unwrap();
    assert!(reports.len() > graph_params(Arch::ResNet8));
}

fn graph_params(arch: Arch) -> usize {
    birdtrain::model::Graph::new(arch, 10).params().len()
}

#[test]
fn compare_reports_the_first_element_out_of_tolerance() {
    let tol = Tolerance {
        atol: 1e-3,
        rtol: 1e-2,
    };
    let ok = compare("x", &[1.0, 2.0], &[1.005, 2.0], tol).unwrap();
    assert!(ok.worst_ratio > 0.0 && ok.worst_ratio <= 1.0);
    let err = compare("conv_forward k3", &[1.0, 2.0], &[1.0, 2.1], tol).unwrap_err();
    assert!(matches!(err, BackendError::Mismatch { .. }));
    let msg = err.to_string();
    assert!(
        msg.contains("conv_forward k3") && msg.contains("element 1"),
        "{msg}"
    );
    assert!(compare("nan", &[f32::NAN], &[0.0], tol).is_err());
    assert!(compare("len", &[0.0], &[0.0, 1.0], tol).is_err());
}
