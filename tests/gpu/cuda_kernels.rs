//! Every CUDA kernel against the CPU reference backend (GPU only: `#[ignore]`d; run with
//! `cargo test --release --test gpu -- --ignored cuda_kernels::`).
//!
//! Rule (llm.c): |gpu − cpu| ≤ tol + |cpu|·eps per element. Inputs are rounded to bf16 on the
//! host first, so both backends see identical values and the tolerance only covers what the GPU
//! does differently: bf16 outputs (relative rounding 2⁻⁸ ≈ 0.0039) and f32 accumulation order.
//! Stated per kernel below; shapes include odd sizes and tiles that are not multiples of 16/128.

use birdtrain::backend::conformance::{
    bn_fusion_shapes, check_bn_fusion, check_bn_fusion_repeatable, check_conv_bn,
    check_conv_bn_repeatable, check_pool_bn, check_pool_bn_repeatable, conv_bn_shapes,
    pool_bn_shapes, Tolerance,
};
use birdtrain::backend::cpu::CpuBackend;
use birdtrain::backend::{
    Backend, BnBackward, BnForward, BnMode, BnShape, ConvShape, LinearShape, PoolShape, Targets,
    TensorRole,
};
use birdtrain::cuda::conv::ConvVersion;
use birdtrain::cuda::conv3;
use birdtrain::cuda::CudaBackend;
use birdtrain::model::{Augment, InputBatch, Mix, PixelBox};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::mismatch::{self, Findings};

/// bf16 output rounding (2 ulps) + f32 accumulation.
const EPS_BF16: f32 = 1.0 / 128.0;

fn gpu() -> CudaBackend {
    CudaBackend::new(0).expect("a CUDA device (these tests are for the GPU machine)")
}

/// The GPU backend once per convolution generation (v1 conv.cu, v2 conv2.cu), same tolerances.
fn gpu_per_conv_version() -> Vec<(ConvVersion, CudaBackend)> {
    let base = gpu();
    [ConvVersion::V1, ConvVersion::V2]
        .into_iter()
        .map(|v| {
            let mut b = base.clone();
            b.set_conv_version(v);
            (v, b)
        })
        .collect()
}

fn cpu() -> CpuBackend {
    CpuBackend::new(0).unwrap()
}

/// Uniform values in [-scale, scale], rounded to bf16.
fn data(rng: &mut ChaCha8Rng, len: usize, scale: f32) -> Vec<f32> {
    (0..len)
        .map(|_| half::bf16::from_f32(rng.random_range(-scale..scale)).to_f32())
        .collect()
}

/// Tensors on both backends holding the same values.
struct Pair {
    c: Vec<f32>,
    g: birdtrain::cuda::CudaTensor,
}

fn pair(gb: &CudaBackend, v: &[f32], role: TensorRole) -> Pair {
    let mut g = gb.alloc(v.len(), role).unwrap();
    gb.upload(v, &mut g).unwrap();
    Pair { c: v.to_vec(), g }
}

#[track_caller]
fn assert_close(what: &str, gpu: &[f32], cpu: &[f32], tol: f32, eps: f32) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: lengths");
    let mut worst = (0usize, 0.0f32);
    for (i, (&g, &c)) in gpu.iter().zip(cpu).enumerate() {
        let excess = (g - c).abs() - (tol + c.abs() * eps);
        if excess > worst.1 || !g.is_finite() {
            worst = (i, excess.max(f32::MIN_POSITIVE));
        }
    }
    let (i, excess) = worst;
    assert!(
        excess <= 0.0,
        "{what}: element {i}: gpu {} vs cpu {} exceeds tol {tol} + |cpu|·{eps}",
        gpu[i],
        cpu[i]
    );
}

fn conv_shapes() -> Vec<ConvShape> {
    let c = |n, h, w, c_in, c_out, kernel, stride, padding| ConvShape {
        n,
        h,
        w,
        c_in,
        c_out,
        kernel,
        stride,
        padding,
    };
    vec![
        // Stems: 3 channels (v1's scalar gather path; v2 reads pixel pairs at stride 2, odd
        // sizes giving a zero pixel at the end of each row, and pads to 8 channels at stride 1).
        c(2, 15, 13, 3, 16, 7, 2, 3),
        c(3, 11, 9, 3, 24, 5, 2, 2), // even padding: no lead slot in the paired weight
        c(2, 7, 6, 3, 16, 3, 1, 1),  // the CIFAR stem: padded to 8 channels
        c(3, 8, 8, 16, 32, 3, 1, 1), // 3×3, vector path
        c(2, 14, 14, 64, 64, 1, 1, 0), // 1×1 = plain GEMM
        c(2, 9, 11, 24, 40, 3, 2, 1), // strided 3×3, odd spatial sizes
        c(1, 5, 5, 8, 136, 1, 2, 0), // 1×1 stride 2, output channels > one 128 tile
        c(2, 6, 6, 20, 12, 3, 1, 1), // channels not multiples of 8 (scalar path)
        // v2 paths (kernels/conv2.cu): a k-step spanning taps, stride-3 phases, 1×1 GEMM rows
        // with a channel tail, the 7×7 filter on 16 channels, several waves of 128×128 tiles.
        c(1, 10, 13, 72, 72, 3, 1, 1),
        c(1, 11, 8, 8, 16, 5, 3, 2),
        c(3, 12, 12, 40, 8, 1, 1, 0),
        c(1, 9, 9, 16, 64, 7, 2, 3),
        c(4, 28, 28, 128, 256, 3, 1, 1),
        // The stem as a network runs it: 64 filters, 4096 output pixels (wgrad in slices of
        // many k-steps, several column tiles).
        c(4, 64, 64, 3, 64, 7, 2, 3),
    ]
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn conv_forward_matches_cpu() {
    let cb = cpu();
    for (version, gb) in gpu_per_conv_version() {
        gb.set_profiling(true);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for s in conv_shapes() {
            let x = pair(&gb, &data(&mut rng, s.x_len(), 1.0), TensorRole::Activation);
            let w = pair(&gb, &data(&mut rng, s.w_len(), 0.2), TensorRole::Weight);
            let mut yc = vec![0.0; s.y_len()];
            cb.conv_forward(&s, &x.c, &w.c, &mut yc).unwrap();
            let mut yg = gb.alloc(s.y_len(), TensorRole::Activation).unwrap();
            gb.conv_forward(&s, &x.g, &w.g, &mut yg).unwrap();
            // tol: f32 sums of up to 1k bf16 products, summed in another order.
            assert_close(
                &format!("conv_forward {version:?} {s:?}"),
                &gb.download(&yg).unwrap(),
                &yc,
                1e-2,
                EPS_BF16,
            );
        }
        // The selected generation is the one that ran.
        let ran: Vec<String> = gb
            .take_profile()
            .unwrap()
            .into_iter()
            .map(|k| k.name.to_string())
            .collect();
        gb.set_profiling(false);
        let v2 = ran.iter().any(|k| k.starts_with("conv2_fwd"));
        assert_eq!(v2, version == ConvVersion::V2, "{version:?} ran {ran:?}");
        // v2 took the stems: paired at stride 2, padded at stride 1.
        for copy in ["conv2_pair_pixels", "conv2_pad_channels"] {
            assert_eq!(
                ran.iter().any(|k| k == copy),
                version == ConvVersion::V2,
                "{version:?} ran {ran:?}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn conv_backward_data_matches_cpu() {
    let cb = cpu();
    for (version, gb) in gpu_per_conv_version() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        for s in conv_shapes() {
            for accumulate in [false, true] {
                let dy = pair(&gb, &data(&mut rng, s.y_len(), 1.0), TensorRole::Activation);
                let w = pair(&gb, &data(&mut rng, s.w_len(), 0.2), TensorRole::Weight);
                let dx0 = data(&mut rng, s.x_len(), 1.0);
                let mut dxc = dx0.clone();
                cb.conv_backward_data(&s, &dy.c, &w.c, &mut dxc, accumulate)
                    .unwrap();
                let mut dxg = pair(&gb, &dx0, TensorRole::Activation).g;
                gb.conv_backward_data(&s, &dy.g, &w.g, &mut dxg, accumulate)
                    .unwrap();
                assert_close(
                    &format!("conv_backward_data {version:?} {s:?} acc={accumulate}"),
                    &gb.download(&dxg).unwrap(),
                    &dxc,
                    1e-2,
                    EPS_BF16,
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn conv_backward_weight_matches_cpu() {
    let cb = cpu();
    for (version, gb) in gpu_per_conv_version() {
        gb.set_profiling(true);
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for s in conv_shapes() {
            let x = pair(&gb, &data(&mut rng, s.x_len(), 1.0), TensorRole::Activation);
            let dy = pair(&gb, &data(&mut rng, s.y_len(), 1.0), TensorRole::Activation);
            let mut dwc = vec![0.0; s.w_len()];
            cb.conv_backward_weight(&s, &x.c, &dy.c, &mut dwc).unwrap();
            // Garbage in the destination must be overwritten, not accumulated into.
            let mut dwg = pair(&gb, &vec![7.0; s.w_len()], TensorRole::WeightGrad).g;
            gb.conv_backward_weight(&s, &x.g, &dy.g, &mut dwg).unwrap();
            let first = gb.download(&dwg).unwrap();
            // f32 output: only the summation order differs (split reductions over ~1k terms).
            assert_close(
                &format!("conv_backward_weight {version:?} {s:?}"),
                &first,
                &dwc,
                2e-3,
                1e-4,
            );
            if version == ConvVersion::V2 {
                // v2 sums its reduction slices in a fixed order: the same bits again (what
                // makes a resumed GPU run continue exactly). v1 adds them with atomics.
                gb.conv_backward_weight(&s, &x.g, &dy.g, &mut dwg).unwrap();
                let again = gb.download(&dwg).unwrap();
                assert!(
                    first
                        .iter()
                        .zip(&again)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "conv_backward_weight {s:?} is not reproducible"
                );
            }
        }
        // v2's weight gradient of the stems ran on their copies (the paired one maps its
        // gradient back onto the 7×7×3 filter in the epilogue).
        let ran: Vec<&str> = gb.take_profile().unwrap().iter().map(|k| k.name).collect();
        gb.set_profiling(false);
        if version == ConvVersion::V2 {
            for kernel in [
                "conv2_pair_pixels",
                "conv2_pad_channels",
                "conv2_wgrad_c8_64x128",
            ] {
                assert!(ran.contains(&kernel), "{kernel} did not run: {ran:?}");
            }
        }
    }
}

struct BnCase {
    rows: usize,
    channels: usize,
    residual: bool,
    relu: bool,
    mode: BnMode,
}

fn bn_cases() -> Vec<BnCase> {
    vec![
        BnCase {
            rows: 2 * 7 * 9,
            channels: 16,
            residual: false,
            relu: true,
            mode: BnMode::Train,
        },
        BnCase {
            rows: 3 * 13 * 13,
            channels: 40,
            residual: true,
            relu: true,
            mode: BnMode::Train,
        },
        BnCase {
            rows: 1000,
            channels: 3,
            residual: true,
            relu: false,
            mode: BnMode::Train,
        },
        BnCase {
            rows: 4 * 5 * 5,
            channels: 72,
            residual: false,
            relu: true,
            mode: BnMode::Frozen,
        },
        BnCase {
            rows: 77,
            channels: 33,
            residual: true,
            relu: true,
            mode: BnMode::Eval,
        },
    ]
}

/// The fused batch-norm ops (`BIRDTRAIN_BN_FUSION`) against the CPU reference, once per
/// convolution generation: with v2 the epilogue kernels (`conv2_fwd_stats_*`,
/// `conv2_dgrad_bn_*`) and the fixed-order merges run (two launches for the 288-tile shape),
/// with v1, and where v2 declines a shape (the 3-channel stem's data gradient, 5 channels),
/// the plain kernels, `bn_grad_finish` and the slab reductions. Tolerance: 1 % of each
/// tensor's largest reference value + 1 % relative (bf16 outputs y and g, moments of the
/// stored bf16 y; inputs are bf16 already). Then every op twice: the same bits.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_batch_norm_ops_match_cpu_and_repeat_bitwise() {
    let tol = Tolerance {
        atol: 1e-2,
        rtol: 1e-2,
    };
    for (version, gb) in gpu_per_conv_version() {
        gb.set_profiling(true);
        let reports = check_bn_fusion(&gb, &bn_fusion_shapes(), tol)
            .unwrap_or_else(|e| panic!("{version:?}: {e}"));
        for r in &reports {
            println!("{version:?} {r}");
        }
        let kernels: Vec<&str> = gb.take_profile().unwrap().iter().map(|k| k.name).collect();
        // The fused kernels ran with v2 only; the fallback's with v1.
        let fused = kernels
            .iter()
            .any(|k| k.starts_with("conv2_fwd_stats_") || k.starts_with("conv2_dgrad_bn_"));
        assert_eq!(
            fused,
            version == ConvVersion::V2,
            "{version:?}: {kernels:?}"
        );
        // The 3-channel stride-2 stem's statistics came from the paired forward.
        assert_eq!(
            kernels.contains(&"conv2_pair_pixels"),
            version == ConvVersion::V2,
            "{version:?}: {kernels:?}"
        );
        assert!(kernels.contains(&"bn_grad_finish"), "{kernels:?}");
        assert!(kernels.contains(&"bn_moments_finalize"), "{kernels:?}");
        check_bn_fusion_repeatable(&gb, &bn_fusion_shapes())
            .unwrap_or_else(|e| panic!("{version:?}: {e}"));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bn_forward_and_backward_match_cpu() {
    let (gb, cb) = (gpu(), cpu());
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    for case in bn_cases() {
        let (r, c) = (case.rows, case.channels);
        let shape = BnShape {
            rows: r,
            channels: c,
        };
        // A channel offset makes the batch mean non-trivial (tests the Welford path).
        let xv: Vec<f32> = data(&mut rng, r * c, 1.0)
            .iter()
            .enumerate()
            .map(|(i, v)| half::bf16::from_f32(v + (i % c) as f32 * 0.25).to_f32())
            .collect();
        let x = pair(&gb, &xv, TensorRole::Activation);
        let gamma = pair(&gb, &data(&mut rng, c, 1.0), TensorRole::Weight);
        let beta = pair(&gb, &data(&mut rng, c, 0.5), TensorRole::Weight);
        let res = pair(&gb, &data(&mut rng, r * c, 1.0), TensorRole::Activation);
        let rm0 = data(&mut rng, c, 0.5);
        let rv0: Vec<f32> = (0..c).map(|_| rng.random_range(0.5..1.5)).collect();
        let mut rm = pair(&gb, &rm0, TensorRole::Statistic);
        let mut rv = pair(&gb, &rv0, TensorRole::Statistic);
        let mut sm = pair(&gb, &vec![0.0; c], TensorRole::Statistic);
        let mut si = pair(&gb, &vec![0.0; c], TensorRole::Statistic);
        let mut y = pair(&gb, &vec![0.0; r * c], TensorRole::Activation);
        cb.bn_forward(BnForward {
            shape,
            x: &x.c,
            gamma: &gamma.c,
            beta: &beta.c,
            residual: case.residual.then_some(&res.c),
            relu: case.relu,
            y: Some(&mut y.c),
            saved_mean: &mut sm.c,
            saved_invstd: &mut si.c,
            running_mean: &mut rm.c,
            running_var: &mut rv.c,
            mode: case.mode,
            momentum: 0.1,
            eps: 1e-5,
            moments: None,
        })
        .unwrap();
        gb.bn_forward(BnForward {
            shape,
            x: &x.g,
            gamma: &gamma.g,
            beta: &beta.g,
            residual: case.residual.then_some(&res.g),
            relu: case.relu,
            y: Some(&mut y.g),
            saved_mean: &mut sm.g,
            saved_invstd: &mut si.g,
            running_mean: &mut rm.g,
            running_var: &mut rv.g,
            mode: case.mode,
            momentum: 0.1,
            eps: 1e-5,
            moments: None,
        })
        .unwrap();
        let tag = format!(
            "bn rows={r} c={c} res={} relu={} {:?}",
            case.residual, case.relu, case.mode
        );
        // Statistics in f32 (Welford) vs f64 on the CPU.
        assert_close(
            &format!("{tag} saved_mean"),
            &gb.download(&sm.g).unwrap(),
            &sm.c,
            1e-4,
            1e-4,
        );
        assert_close(
            &format!("{tag} saved_invstd"),
            &gb.download(&si.g).unwrap(),
            &si.c,
            1e-4,
            1e-3,
        );
        assert_close(
            &format!("{tag} running_mean"),
            &gb.download(&rm.g).unwrap(),
            &rm.c,
            1e-4,
            1e-4,
        );
        assert_close(
            &format!("{tag} running_var"),
            &gb.download(&rv.g).unwrap(),
            &rv.c,
            1e-4,
            1e-3,
        );
        // y is bf16.
        let yg = gb.download(&y.g).unwrap();
        assert_close(&format!("{tag} y"), &yg, &y.c, 1e-2, EPS_BF16);

        // Backward from the GPU's own y (same ReLU mask on both sides).
        let yb = pair(&gb, &yg, TensorRole::Activation);
        let dy = pair(&gb, &data(&mut rng, r * c, 1.0), TensorRole::Activation);
        let dres0 = data(&mut rng, r * c, 1.0);
        for acc in [false, true] {
            let mut dx = pair(&gb, &vec![0.0; r * c], TensorRole::Activation);
            let mut dres = pair(&gb, &dres0, TensorRole::Activation);
            let mut dg = pair(&gb, &vec![3.0; c], TensorRole::WeightGrad);
            let mut db = pair(&gb, &vec![3.0; c], TensorRole::WeightGrad);
            let batch_stats = case.mode == BnMode::Train;
            cb.bn_backward(BnBackward {
                shape,
                x: &x.c,
                y: Some(&yb.c),
                gamma: &gamma.c,
                saved_mean: &sm.c,
                saved_invstd: &si.c,
                batch_stats,
                relu: case.relu,
                dy: &dy.c,
                dx: &mut dx.c,
                dresidual: case.residual.then_some((&mut dres.c, acc)),
                dgamma: &mut dg.c,
                dbeta: &mut db.c,
                prepared: false,
            })
            .unwrap();
            // The GPU uses its own saved statistics (compared above).
            gb.bn_backward(BnBackward {
                shape,
                x: &x.g,
                y: Some(&yb.g),
                gamma: &gamma.g,
                saved_mean: &sm.g,
                saved_invstd: &si.g,
                batch_stats,
                relu: case.relu,
                dy: &dy.g,
                dx: &mut dx.g,
                dresidual: case.residual.then_some((&mut dres.g, acc)),
                dgamma: &mut dg.g,
                dbeta: &mut db.g,
                prepared: false,
            })
            .unwrap();
            // dγ, dβ: f32 sums over `rows` terms; dx: bf16 with a cancellation (g − means).
            let scale = (r as f32).sqrt();
            assert_close(
                &format!("{tag} dgamma"),
                &gb.download(&dg.g).unwrap(),
                &dg.c,
                1e-3 * scale,
                1e-3,
            );
            assert_close(
                &format!("{tag} dbeta"),
                &gb.download(&db.g).unwrap(),
                &db.c,
                1e-3 * scale,
                1e-3,
            );
            assert_close(
                &format!("{tag} dx"),
                &gb.download(&dx.g).unwrap(),
                &dx.c,
                2e-2,
                2e-2,
            );
            if case.residual {
                assert_close(
                    &format!("{tag} dres acc={acc}"),
                    &gb.download(&dres.g).unwrap(),
                    &dres.c,
                    1e-2,
                    EPS_BF16,
                );
            }
        }
    }
}

/// The max pool that applies the stem's batch norm (`maxpool_bn_*` in pool.cu: the scalar and
/// 16-byte forward and backward, then the slab sums) against the CPU's separate ops: inputs on
/// grids that make the batch norm exact, so the pooled output and the finished gradient must
/// have the bits of bn_apply + maxpool + mask on the CPU (ties included, γ of both signs and
/// zero, with and without ReLU, every border window); Σg, Σg·x̂ within 1 % of the largest.
/// Then every op twice: the same bits.
#[test]
#[ignore = "needs a CUDA GPU"]
fn max_pool_applying_a_batch_norm_matches_cpu_to_the_bit_and_repeats() {
    let gb = gpu();
    gb.set_profiling(true);
    let tol = Tolerance {
        atol: 1e-2,
        rtol: 1e-2,
    };
    let reports =
        check_pool_bn(&gb, &pool_bn_shapes(), tol).unwrap_or_else(|e| panic!("maxpool_bn: {e}"));
    for r in &reports {
        println!("{r}");
    }
    let kernels: Vec<&str> = gb.take_profile().unwrap().iter().map(|k| k.name).collect();
    for k in [
        "maxpool_bn_fwd",
        "maxpool_bn_fwd_vec",
        "maxpool_bn_bwd",
        "maxpool_bn_bwd_vec",
    ] {
        assert!(kernels.contains(&k), "{k} never ran: {kernels:?}");
    }
    check_pool_bn_repeatable(&gb, &pool_bn_shapes()).unwrap_or_else(|e| panic!("{e}"));
}

/// The convolution that applies the batch norm before it (`conv_forward_bn`,
/// `conv_backward_weight_bn`, `conv_backward_data_bn` with no stored output) against the
/// GPU's own separate ops over the stored batch-norm output, to the bit (exact batch-norm
/// inputs, γ of both signs and zero, with and without ReLU, padding and tails), and within
/// 1 % of the largest value of the CPU reference; then twice: the same bits.
#[test]
#[ignore = "needs a CUDA GPU"]
fn convolutions_applying_a_batch_norm_match_the_separate_ops_to_the_bit_and_repeat() {
    let gb = gpu();
    let tol = Tolerance {
        atol: 1e-2,
        rtol: 1e-2,
    };
    let reports =
        check_conv_bn(&gb, &conv_bn_shapes(), tol).unwrap_or_else(|e| panic!("conv_bn: {e}"));
    for r in &reports {
        println!("{r}");
    }
    check_conv_bn_repeatable(&gb, &conv_bn_shapes()).unwrap_or_else(|e| panic!("{e}"));
}

/// The same check once per convolution generation, naming the kernels that ran: with v2 the
/// kernels that apply the batch norm as they load their input did the applied ops (the
/// forward, the forward with statistics, the weight gradient in its general, 1×1 and small-C
/// gathers, and the data gradient's epilogue recomputing the ReLU mask from x; bn_apply runs
/// for the separate ops the check compares with), to the bit against bn_apply followed by the
/// plain kernels and within 1 % of the CPU; with v1 none of them (the composition). Then twice:
/// the same bits.
#[test]
#[ignore = "needs a CUDA GPU"]
fn v2_kernels_applying_a_batch_norm_on_load_match_bn_apply_then_the_plain_kernels() {
    let tol = Tolerance {
        atol: 1e-2,
        rtol: 1e-2,
    };
    for (version, gb) in gpu_per_conv_version() {
        gb.set_profiling(true);
        let reports = check_conv_bn(&gb, &conv_bn_shapes(), tol)
            .unwrap_or_else(|e| panic!("{version:?} conv_bn: {e}"));
        for r in &reports {
            println!("{version:?} {r}");
        }
        let kernels: Vec<&str> = gb.take_profile().unwrap().iter().map(|k| k.name).collect();
        let v2 = version == ConvVersion::V2;
        for family in [
            "conv2_fwd_apply_",
            "conv2_fwd_apply_1x1_",
            "conv2_fwd_stats_apply_",
            "conv2_wgrad_apply_c8_",
            "conv2_wgrad_apply_1x1_",
        ] {
            assert_eq!(
                kernels.iter().any(|k| k.starts_with(family)),
                v2,
                "{version:?}, {family}*: {kernels:?}"
            );
        }
        // The general weight gradient (C % 32 == 0, not 1×1 at stride 1).
        assert_eq!(
            kernels.iter().any(|k| k.starts_with("conv2_wgrad_apply_")
                && !k.contains("_c8_")
                && !k.contains("_1x1_")),
            v2,
            "{version:?}: {kernels:?}"
        );
        assert_eq!(
            kernels.iter().any(|k| k.starts_with("conv2_dgrad_bn_")),
            v2,
            "{version:?}: {kernels:?}"
        );
        check_conv_bn_repeatable(&gb, &conv_bn_shapes())
            .unwrap_or_else(|e| panic!("{version:?}: {e}"));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pools_match_cpu() {
    let (gb, cb) = (gpu(), cpu());
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for s in [
        PoolShape {
            n: 2,
            h: 16,
            w: 16,
            c: 8,
            kernel: 3,
            stride: 2,
            padding: 1,
        },
        PoolShape {
            n: 3,
            h: 15,
            w: 9,
            c: 5,
            kernel: 3,
            stride: 2,
            padding: 1,
        },
        PoolShape {
            n: 1,
            h: 7,
            w: 7,
            c: 3,
            kernel: 2,
            stride: 2,
            padding: 0,
        },
        // The stem's pool as a 64-px network runs it.
        PoolShape {
            n: 4,
            h: 32,
            w: 32,
            c: 64,
            kernel: 3,
            stride: 2,
            padding: 1,
        },
    ] {
        let input = s.n * s.h * s.w * s.c;
        let out = s.n * s.out_h() * s.out_w() * s.c;
        // After a ReLU, as in the network: half the inputs are 0, so windows tie and the
        // first maximum (window order) must win on both backends.
        let relu: Vec<f32> = data(&mut rng, input, 1.0)
            .into_iter()
            .map(|v| v.max(0.0))
            .collect();
        let x = pair(&gb, &relu, TensorRole::Activation);
        let mut y = pair(&gb, &vec![0.0; out], TensorRole::Activation);
        cb.maxpool_forward(&s, &x.c, &mut y.c).unwrap();
        gb.maxpool_forward(&s, &x.g, &mut y.g).unwrap();
        // A max selects an input: exact.
        assert_close(
            &format!("maxpool_forward {s:?}"),
            &gb.download(&y.g).unwrap(),
            &y.c,
            0.0,
            0.0,
        );
        let dy = pair(&gb, &data(&mut rng, out, 1.0), TensorRole::Activation);
        for acc in [false, true] {
            let dx0 = data(&mut rng, input, 1.0);
            let mut dx = pair(&gb, &dx0, TensorRole::Activation);
            cb.maxpool_backward(&s, &x.c, &dy.c, &mut dx.c, acc)
                .unwrap();
            gb.maxpool_backward(&s, &x.g, &dy.g, &mut dx.g, acc)
                .unwrap();
            assert_close(
                &format!("maxpool_backward {s:?} acc={acc}"),
                &gb.download(&dx.g).unwrap(),
                &dx.c,
                1e-2,
                EPS_BF16,
            );
        }
    }
    for (n, hw, c) in [(2, 49, 64), (3, 1, 5), (1, 17, 130)] {
        let x = pair(
            &gb,
            &data(&mut rng, n * hw * c, 1.0),
            TensorRole::Activation,
        );
        let mut y = pair(&gb, &vec![0.0; n * c], TensorRole::Activation);
        cb.gap_forward(n, hw, c, &x.c, &mut y.c).unwrap();
        gb.gap_forward(n, hw, c, &x.g, &mut y.g).unwrap();
        assert_close(
            &format!("gap_forward {n}x{hw}x{c}"),
            &gb.download(&y.g).unwrap(),
            &y.c,
            1e-3,
            EPS_BF16,
        );
        let dy = pair(&gb, &data(&mut rng, n * c, 1.0), TensorRole::Activation);
        for acc in [false, true] {
            let mut dx = pair(
                &gb,
                &data(&mut rng, n * hw * c, 1.0),
                TensorRole::Activation,
            );
            cb.gap_backward(n, hw, c, &dy.c, &mut dx.c, acc).unwrap();
            gb.gap_backward(n, hw, c, &dy.g, &mut dx.g, acc).unwrap();
            assert_close(
                &format!("gap_backward {n}x{hw}x{c} acc={acc}"),
                &gb.download(&dx.g).unwrap(),
                &dx.c,
                1e-3,
                EPS_BF16,
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn linear_matches_cpu() {
    let (gb, cb) = (gpu(), cpu());
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    for s in [
        LinearShape {
            n: 4,
            inputs: 64,
            outputs: 10,
        },
        LinearShape {
            n: 33,
            inputs: 517,
            outputs: 285,
        },
    ] {
        let x = pair(
            &gb,
            &data(&mut rng, s.n * s.inputs, 1.0),
            TensorRole::Activation,
        );
        let w = pair(
            &gb,
            &data(&mut rng, s.outputs * s.inputs, 0.1),
            TensorRole::Weight,
        );
        let b = pair(&gb, &data(&mut rng, s.outputs, 0.1), TensorRole::Weight);
        let mut y = pair(&gb, &vec![0.0; s.n * s.outputs], TensorRole::Activation);
        cb.linear_forward(&s, &x.c, &w.c, &b.c, &mut y.c).unwrap();
        gb.linear_forward(&s, &x.g, &w.g, &b.g, &mut y.g).unwrap();
        assert_close(
            &format!("linear_forward {s:?}"),
            &gb.download(&y.g).unwrap(),
            &y.c,
            1e-2,
            EPS_BF16,
        );
        let dy = pair(
            &gb,
            &data(&mut rng, s.n * s.outputs, 1.0),
            TensorRole::Activation,
        );
        for acc in [false, true] {
            let mut dx = pair(
                &gb,
                &data(&mut rng, s.n * s.inputs, 1.0),
                TensorRole::Activation,
            );
            let mut dw = pair(
                &gb,
                &vec![5.0; s.outputs * s.inputs],
                TensorRole::WeightGrad,
            );
            let mut db = pair(&gb, &vec![5.0; s.outputs], TensorRole::WeightGrad);
            cb.linear_backward(&s, &x.c, &w.c, &dy.c, &mut dx.c, &mut dw.c, &mut db.c, acc)
                .unwrap();
            gb.linear_backward(&s, &x.g, &w.g, &dy.g, &mut dx.g, &mut dw.g, &mut db.g, acc)
                .unwrap();
            assert_close(
                &format!("linear dx {s:?} acc={acc}"),
                &gb.download(&dx.g).unwrap(),
                &dx.c,
                1e-2,
                EPS_BF16,
            );
            assert_close(
                &format!("linear dw {s:?}"),
                &gb.download(&dw.g).unwrap(),
                &dw.c,
                1e-4,
                1e-4,
            );
            assert_close(
                &format!("linear db {s:?}"),
                &gb.download(&db.g).unwrap(),
                &db.c,
                1e-4,
                1e-4,
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn softmax_cross_entropy_matches_cpu() {
    let (gb, cb) = (gpu(), cpu());
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for (n, classes, smoothing, own_weight) in [
        (5, 10, 0.0f32, 1.0f32),
        (37, 285, 0.1, 1.0),
        (3, 7, 0.2, 1.0),
        (37, 285, 0.1, 0.35),
        (6, 10, 0.0, 0.8),
    ] {
        let z = pair(
            &gb,
            &data(&mut rng, n * classes, 4.0),
            TensorRole::Activation,
        );
        let labels: Vec<u32> = (0..n)
            .map(|_| rng.random_range(0..classes as u32))
            .collect();
        let mut dz = pair(&gb, &vec![0.0; n * classes], TensorRole::Activation);
        let (mut pc, mut pg) = (Vec::new(), Vec::new());
        let targets = Targets {
            own_weight,
            ..Targets::labels(&labels, smoothing)
        };
        let sc = cb
            .softmax_cross_entropy(n, classes, &z.c, &targets, Some(&mut dz.c), Some(&mut pc))
            .unwrap();
        let sg = gb
            .softmax_cross_entropy(n, classes, &z.g, &targets, Some(&mut dz.g), Some(&mut pg))
            .unwrap();
        let tag = format!("softmax n={n} k={classes} eps={smoothing} own={own_weight}");
        assert!(
            (sg.loss_sum - sc.loss_sum).abs() <= 1e-4 + sc.loss_sum.abs() * 1e-5,
            "{tag}: loss {} vs {}",
            sg.loss_sum,
            sc.loss_sum
        );
        assert_eq!(
            (sg.correct_top1, sg.correct_top5),
            (sc.correct_top1, sc.correct_top5),
            "{tag}"
        );
        assert_close(&format!("{tag} probs"), &pg, &pc, 1e-6, 1e-5);
        assert_close(
            &format!("{tag} dlogits"),
            &gb.download(&dz.g).unwrap(),
            &dz.c,
            1e-6,
            EPS_BF16,
        );
    }
    // Bad input is an error value, not a kernel fault.
    let z = gb.alloc(10, TensorRole::Activation).unwrap();
    assert!(gb
        .softmax_cross_entropy(1, 10, &z, &Targets::labels(&[10], 0.0), None, None)
        .is_err());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn input_transform_matches_cpu() {
    let (gb, cb) = (gpu(), cpu());
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    for (n, size) in [(3usize, 32u32), (2, 17)] {
        let s = size as usize;
        let pixels: Vec<u8> = (0..n * s * s * 3).map(|_| rng.random()).collect();
        let labels = vec![0u32; n];
        let m = Augment::max_shift(size);
        // Image 1 erased (random erasing) on a box reaching the bottom-right corner.
        let aug: Vec<Augment> = (0..n as u32)
            .map(|i| Augment {
                dy: rng.random_range(-m..=m),
                dx: rng.random_range(-m..=m),
                flip: rng.random(),
                erase: (i == 1).then_some(PixelBox {
                    y0: size / 3,
                    y1: size,
                    x0: size / 2,
                    x1: size,
                }),
            })
            .collect();
        // Mixing pairs image b with n − 1 − b (n = 3: the middle one with itself); CutMix
        // with a box inside the image and one on its right and bottom edges.
        let mixes = [
            None,
            Some(Mix::Blend { lambda: 0.3 }),
            Some(Mix::Paste(PixelBox {
                y0: 3,
                y1: size / 2 + 3,
                x0: 2,
                x1: size / 2,
            })),
            Some(Mix::Paste(PixelBox {
                y0: size / 2,
                y1: size,
                x0: size / 3,
                x1: size,
            })),
        ];
        for (augment, mix) in [None, Some(&aug[..])]
            .into_iter()
            .flat_map(|a| mixes.map(|m| (a, m)))
        {
            let batch = InputBatch {
                pixels: &pixels,
                labels: &labels,
                len: n,
                image_size: size,
                augment,
                mix,
            };
            let mut xc = vec![0.0; n * s * s * 3];
            cb.input(&batch, &mut xc).unwrap();
            let mut xg = gb.alloc(xc.len(), TensorRole::Activation).unwrap();
            gb.input(&batch, &mut xg).unwrap();
            // Normalised values in about [-2.2, 2.7], rounded to bf16.
            assert_close(
                &format!("input n={n} s={s} aug={} mix={mix:?}", augment.is_some()),
                &gb.download(&xg).unwrap(),
                &xc,
                1e-5,
                1.0 / 256.0,
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_optimizer_matches_cpu_optimizer() {
    use birdtrain::cuda::optim::DeviceOptimizer;
    use birdtrain::model::{Arch, Graph};
    use birdtrain::optim::{Hyper, Optimizer, OptimizerKind};
    let gb = gpu();
    let graph = Graph::new(Arch::ResNet8, 10);
    let sizes: Vec<usize> = graph.params().iter().map(|p| p.numel()).collect();
    let n: usize = sizes.iter().sum();
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let hyper = Hyper {
        weight_decay: 0.01,
        ..Hyper::default()
    };
    // The update is element-wise, so one flat layout serves both sides.
    let split = |flat: &[f32]| -> Vec<Vec<f32>> {
        let mut off = 0;
        sizes
            .iter()
            .map(|&k| {
                off += k;
                flat[off - k..off].to_vec()
            })
            .collect()
    };
    for kind in [
        OptimizerKind::Sgd {
            momentum: 0.9,
            nesterov: false,
        },
        OptimizerKind::Sgd {
            momentum: 0.9,
            nesterov: true,
        },
        OptimizerKind::Sgd {
            momentum: 0.0,
            nesterov: false,
        },
        OptimizerKind::Adam,
        OptimizerKind::AdamW,
    ] {
        let init = data(&mut rng, n, 0.5);
        let mut cpu_params = init.clone();
        let mut cpu_opt = Optimizer::new(kind, hyper, graph.params());
        let mut dev_opt = DeviceOptimizer::new(&gb, kind, hyper, graph.params(), &init).unwrap();
        let mut working: Vec<_> = sizes
            .iter()
            .map(|&k| gb.alloc(k, TensorRole::Weight).unwrap())
            .collect();
        for step in 0..3 {
            let grads = data(&mut rng, n, 1.0);
            cpu_opt.step(&mut cpu_params, &grads, 0.05).unwrap();
            let g: Vec<_> = split(&grads)
                .iter()
                .map(|v| pair(&gb, v, TensorRole::WeightGrad).g)
                .collect();
            let g_refs: Vec<_> = g.iter().collect();
            let mut w_refs: Vec<_> = working.iter_mut().collect();
            dev_opt.step(&g_refs, &mut w_refs, 0.05, 1.0).unwrap();
            let tag = format!("{kind:?} step {step}");
            assert_close(
                &format!("{tag} master"),
                &dev_opt.master().unwrap(),
                &cpu_params,
                1e-6,
                1e-5,
            );
            let work: Vec<f32> = working
                .iter()
                .flat_map(|w| gb.download(w).unwrap())
                .collect();
            assert_close(
                &format!("{tag} working bf16"),
                &work,
                &cpu_params,
                1e-6,
                1.0 / 256.0,
            );
        }
    }
}

/// The GPU backend with the Hopper convolutions (`BIRDTRAIN_CONV=v3`), or `None` (saying so)
/// on a GPU without them (compute capability other than 9.0: v3 falls back to v2 there),
/// saying so for `test`.
fn hopper_v3(test: &str) -> Option<CudaBackend> {
    let mut gb = gpu();
    let arch = gb.device().arch();
    if (arch.major, arch.minor) != (9, 0) {
        eprintln!(
            "skipped {test}: the v3 kernels need a Hopper GPU (compute capability 9.0), this is {arch}"
        );
        return None;
    }
    gb.set_conv_version(ConvVersion::V3);
    Some(gb)
}

/// 1×1 layers at stride 1 (the ones v3 takes): tails in every GEMM dimension, rings that
/// wrap, a weight gradient split into several reduction slices, the smallest layer.
fn conv3_shapes() -> Vec<ConvShape> {
    let c = |n, h, w, c_in, c_out| ConvShape {
        n,
        h,
        w,
        c_in,
        c_out,
        kernel: 1,
        stride: 1,
        padding: 0,
    };
    vec![
        c(2, 7, 9, 64, 256),
        c(3, 13, 13, 136, 72),
        c(1, 5, 5, 8, 8),
        c(2, 16, 16, 520, 64),
        c(8, 28, 28, 256, 64),
    ]
}

/// 3×3 layers at stride 1 whose forward v3 takes (whole tiles of images × rows × columns):
/// tiles of 2 images × 8 × 8 with an output-channel tail, of 8 × 16 rows of one image with two
/// slices per tap, of 8 images × 4 × 4, and of 128 images × 1 × 1 (every tap but the centre
/// in the padding).
fn conv3_3x3_shapes() -> Vec<ConvShape> {
    let c = |n, hw, c_in, c_out| ConvShape {
        n,
        h: hw,
        w: hw,
        c_in,
        c_out,
        kernel: 3,
        stride: 1,
        padding: 1,
    };
    vec![
        c(4, 8, 64, 72),
        c(2, 16, 128, 136),
        c(8, 4, 64, 64),
        c(128, 3, 64, 8),
        c(2, 16, 64, 128),
        c(2, 8, 128, 64),
    ]
}

/// Strided layers whose forward and weight gradient v3 takes through 4-D boxes of the input
/// traversed with stride 2 (resnet50's first 3×3 of stages 2–4 and its downsampling 1×1
/// projections): 3×3 16 → 8 in
/// tiles of 2 images × 8 × 8 with an output-channel tail, odd 15 → 8 (the padding below and
/// right) with 64 output channels (the `_n64` forward, the `_m64` weight gradient), 13 → 7 in
/// one-pixel tiles of 128 images, and with even extents and output channels in 64s (the data
/// gradient's four phases on v3: 16 → 8 with 64 input channels, the `_n64` twin; 8 → 4 in
/// tiles of 8 images × 4 × 4 with two slices per tap); 1×1 16 → 8 with two channel slices,
/// odd 15 × 31 → 8 × 16 with a tail, and 64 input channels (the weight gradient's `_n64` twin).
fn conv3_strided_shapes() -> Vec<ConvShape> {
    let c = |n, h, w, c_in, c_out, kernel| ConvShape {
        n,
        h,
        w,
        c_in,
        c_out,
        kernel,
        stride: 2,
        padding: if kernel == 3 { 1 } else { 0 },
    };
    vec![
        c(4, 16, 16, 64, 72, 3),
        c(2, 15, 15, 128, 64, 3),
        c(128, 13, 13, 64, 128, 3),
        c(4, 16, 16, 64, 64, 3),
        c(8, 8, 8, 128, 128, 3),
        c(4, 16, 16, 128, 256, 1),
        c(2, 15, 31, 64, 136, 1),
        c(2, 16, 16, 64, 64, 1),
    ]
}

/// The bits of a GPU tensor, for the repeat checks.
fn bits(gb: &CudaBackend, t: &birdtrain::cuda::CudaTensor) -> Vec<u32> {
    gb.download(t)
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// The v3 ops against the CPU, each launch twice to the bit, kept going past a failure: every
/// op's result (with the kernels that ran it) goes into `findings`, so one GPU run shows
/// which kernels and shapes fail and how (tests/gpu/mismatch.rs), not only the first.
struct V3Check {
    gb: CudaBackend,
    cb: CpuBackend,
    findings: Findings,
    /// The kernels that ran since [`V3Check::take_ran`].
    ran: Vec<&'static str>,
}

impl V3Check {
    fn new(gb: CudaBackend) -> Self {
        gb.set_profiling(true);
        Self {
            gb,
            cb: cpu(),
            findings: Findings::default(),
            ran: Vec::new(),
        }
    }

    /// The kernels the last op ran, added to those of the phase.
    fn last_op_kernels(&mut self) -> Vec<&'static str> {
        let names: Vec<&'static str> = self
            .gb
            .take_profile()
            .unwrap()
            .iter()
            .map(|k| k.name)
            .collect();
        self.ran.extend(&names);
        names
    }

    /// The kernels that ran since the last call.
    fn take_ran(&mut self) -> Vec<&'static str> {
        std::mem::take(&mut self.ran)
    }

    /// Records that each of `kernels` ran in the phase whose kernels are `ran` (itself, or
    /// its persistent twin where `BIRDTRAIN_CONV3_TILES` chose those).
    fn expect_ran(&mut self, phase: &str, ran: &[&'static str], kernels: &[&str]) {
        for kernel in kernels {
            let result = if ran_or_twin(ran, kernel) {
                Ok(())
            } else {
                Err(format!("did not run: {ran:?}"))
            };
            self.findings
                .record(&format!("{phase}: {kernel} ran"), &[], result);
        }
    }

    /// Records whether the repeat gave the same bits.
    fn repeats(&mut self, what: &str, kernels: &[&str], first: &[u32], second: &[u32]) {
        let differing = first.iter().zip(second).filter(|(a, b)| a != b).count();
        let result = if differing == 0 {
            Ok(())
        } else {
            Err(format!("{differing} of {} elements differ", first.len()))
        };
        self.findings
            .record(&format!("{what} repeats"), kernels, result);
    }

    /// conv_forward of `s` (bf16 output: 1e-2 + 1/128 relative), then again to the bit.
    fn forward(&mut self, s: &ConvShape, x: &Pair, w: &Pair) {
        let gb = &self.gb;
        let mut yc = vec![0.0; s.y_len()];
        self.cb.conv_forward(s, &x.c, &w.c, &mut yc).unwrap();
        let mut yg = gb.alloc(s.y_len(), TensorRole::Activation).unwrap();
        gb.conv_forward(s, &x.g, &w.g, &mut yg).unwrap();
        let first = bits(gb, &yg);
        let got = gb.download(&yg).unwrap();
        let kernels = self.last_op_kernels();
        let what = format!("v3 conv_forward {s:?}");
        let result = mismatch::check(
            &got,
            &yc,
            (s.y_len() / s.c_out, s.c_out),
            (1e-2, EPS_BF16),
            None,
        );
        self.findings.record(&what, &kernels, result);
        self.gb.conv_forward(s, &x.g, &w.g, &mut yg).unwrap();
        let second = bits(&self.gb, &yg);
        let kernels = self.last_op_kernels();
        self.repeats(&what, &kernels, &first, &second);
    }

    /// conv_backward_data of `s`, overwriting and accumulating.
    fn data_gradient(&mut self, s: &ConvShape, dy: &Pair, w: &Pair, rng: &mut ChaCha8Rng) {
        for accumulate in [false, true] {
            let dx0 = data(rng, s.x_len(), 1.0);
            let mut dxc = dx0.clone();
            self.cb
                .conv_backward_data(s, &dy.c, &w.c, &mut dxc, accumulate)
                .unwrap();
            let mut dxg = pair(&self.gb, &dx0, TensorRole::Activation).g;
            self.gb
                .conv_backward_data(s, &dy.g, &w.g, &mut dxg, accumulate)
                .unwrap();
            let got = self.gb.download(&dxg).unwrap();
            let kernels = self.last_op_kernels();
            let result = mismatch::check(
                &got,
                &dxc,
                (s.x_len() / s.c_in, s.c_in),
                (1e-2, EPS_BF16),
                None,
            );
            self.findings.record(
                &format!("v3 conv_backward_data {s:?} acc={accumulate}"),
                &kernels,
                result,
            );
        }
    }

    /// conv_backward_weight of `s` (f32: 2e-3 + 1e-4 relative; garbage in the destination is
    /// overwritten), then again to the bit.
    fn weight_gradient(&mut self, s: &ConvShape, x: &Pair, dy: &Pair) {
        let mut dwc = vec![0.0; s.w_len()];
        self.cb
            .conv_backward_weight(s, &x.c, &dy.c, &mut dwc)
            .unwrap();
        let mut dwg = pair(&self.gb, &vec![7.0; s.w_len()], TensorRole::WeightGrad).g;
        self.gb
            .conv_backward_weight(s, &x.g, &dy.g, &mut dwg)
            .unwrap();
        let first = bits(&self.gb, &dwg);
        let got = self.gb.download(&dwg).unwrap();
        let kernels = self.last_op_kernels();
        let what = format!("v3 conv_backward_weight {s:?}");
        let result = mismatch::check(
            &got,
            &dwc,
            (s.c_out, s.w_len() / s.c_out),
            (2e-3, 1e-4),
            Some(7.0),
        );
        self.findings.record(&what, &kernels, result);
        self.gb
            .conv_backward_weight(s, &x.g, &dy.g, &mut dwg)
            .unwrap();
        let second = bits(&self.gb, &dwg);
        let kernels = self.last_op_kernels();
        self.repeats(&what, &kernels, &first, &second);
    }

    /// Random x, w (scaled by `w_scale`) and dy for `s`, then its forward, data gradient and
    /// weight gradient.
    fn every_pass(&mut self, s: &ConvShape, w_scale: f32, rng: &mut ChaCha8Rng) {
        let x = pair(&self.gb, &data(rng, s.x_len(), 1.0), TensorRole::Activation);
        let w = pair(&self.gb, &data(rng, s.w_len(), w_scale), TensorRole::Weight);
        let dy = pair(&self.gb, &data(rng, s.y_len(), 1.0), TensorRole::Activation);
        self.forward(s, &x, &w);
        self.data_gradient(s, &dy, &w, rng);
        self.weight_gradient(s, &x, &dy);
    }

    /// Records that none of `ran` is a v2 kernel `unwanted` picks.
    fn expect_none(&mut self, what: &str, ran: &[&'static str], unwanted: impl Fn(&str) -> bool) {
        let v2: Vec<&&str> = ran.iter().filter(|k| unwanted(k)).collect();
        let result = if v2.is_empty() {
            Ok(())
        } else {
            Err(format!("ran {v2:?}"))
        };
        self.findings.record(what, &[], result);
    }
}

/// Whether `kernel` ran, or its persistent twin did (`BIRDTRAIN_CONV3_TILES=raster` or
/// `persistent` runs the v3 tests on those).
fn ran_or_twin(ran: &[&str], kernel: &str) -> bool {
    ran.contains(&kernel) || conv3::persistent_twin(kernel).is_some_and(|twin| ran.contains(&twin))
}

/// Whether `kernel` is a v2 forward or weight gradient (not the reduction v3's weight
/// gradients share).
fn v2_forward_or_weight_gradient(kernel: &str) -> bool {
    kernel.starts_with("conv2_fwd")
        || (kernel.starts_with("conv2_wgrad") && kernel != "conv2_wgrad_reduce")
}

/// The v3 forward, data-gradient and weight-gradient kernels against the CPU (the v2 tests'
/// tolerances: bf16 outputs 1e-2 + 1/128 relative, the f32 weight gradient 2e-3 + 1e-4), each
/// launch twice to the bit, and the v3 kernels are the ones that ran: every pass of the 1×1
/// layers (strided ones too) and the forward and weight gradient of the 3×3 ones are v3's; a
/// 3×3 data gradient is v2's where the output channels do not split into 64 per tap, or at
/// stride 2 where the extents are odd. Every check runs and prints a PASS/FAIL line; the test fails at the end with all
/// the failures, each with the pattern of its wrong elements.
#[test]
#[ignore = "needs a CUDA GPU"]
fn conv3_ops_match_cpu_and_repeat_bitwise() {
    let Some(gb) = hopper_v3("conv3_ops_match_cpu_and_repeat_bitwise") else {
        return;
    };
    let mut v3 = V3Check::new(gb);
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    for s in conv3_shapes() {
        v3.every_pass(&s, 0.2, &mut rng);
    }
    let one_by_one = v3.take_ran();
    v3.expect_ran(
        "1×1",
        &one_by_one,
        &[
            "conv3_fwd_1x1",
            "conv3_dgrad_1x1",
            "conv3_transpose_weights",
            "conv3_wgrad_1x1",
            "conv3_fwd_1x1_n64",
            "conv3_dgrad_1x1_n64",
            "conv3_wgrad_1x1_n64",
            // 520 → 64 and 256 → 64 channels: 64-row tiles
            "conv3_wgrad_1x1_m64",
            "conv2_wgrad_reduce",
        ],
    );
    v3.expect_none("1×1: v2 ran no layer v3 takes", &one_by_one, |k| {
        v2_forward_or_weight_gradient(k) || k.starts_with("conv2_dgrad")
    });
    for s in conv3_3x3_shapes() {
        let x = pair(
            &v3.gb,
            &data(&mut rng, s.x_len(), 1.0),
            TensorRole::Activation,
        );
        let w = pair(&v3.gb, &data(&mut rng, s.w_len(), 0.1), TensorRole::Weight);
        let dy_w = pair(
            &v3.gb,
            &data(&mut rng, s.y_len(), 1.0),
            TensorRole::Activation,
        );
        v3.forward(&s, &x, &w);
        // The weight gradient (v3 in whole 64-pixel tiles), twice to the bit.
        v3.weight_gradient(&s, &x, &dy_w);
        // The data gradient (v3 where the output channels split into 64 per tap, else v2).
        let dy = pair(
            &v3.gb,
            &data(&mut rng, s.y_len(), 1.0),
            TensorRole::Activation,
        );
        v3.data_gradient(&s, &dy, &w, &mut rng);
    }
    let three_by_three = v3.take_ran();
    v3.expect_ran(
        "3×3",
        &three_by_three,
        &[
            "conv3_fwd_3x3",
            "conv3_dgrad_3x3",
            "conv3_dgrad_weights_3x3",
            "conv3_wgrad_3x3",
            "conv3_fwd_3x3_n64",
            "conv3_dgrad_3x3_n64",
            // the 64-, 8- and 64-output-channel layers' weight gradients: 64-row tiles
            "conv3_wgrad_3x3_m64",
        ],
    );
    v3.expect_none(
        "3×3: v2 ran no forward or weight gradient v3 takes",
        &three_by_three,
        v2_forward_or_weight_gradient,
    );
    // Strided layers: the forward and weight gradient on v3 (the 4-D kernels, a strided input
    // map; the weight gradient of 64 output channels in 64-row tiles, of the 1×1s with 64
    // input channels in 64-column tiles), the strided 1×1's data gradient on v3 (the 1×1 dgrad
    // GEMM with its scattered epilogue), the strided 3×3's on v3 in four phases where its
    // extents are even and its output channels in 64s, else on v2, each against the CPU.
    let (strided_3x3, strided_1x1): (Vec<ConvShape>, Vec<ConvShape>) = conv3_strided_shapes()
        .into_iter()
        .partition(|s| s.kernel == 3);
    for s in &strided_3x3 {
        v3.every_pass(s, 0.1, &mut rng);
    }
    let strided = v3.take_ran();
    v3.expect_ran(
        "strided 3×3",
        &strided,
        &[
            "conv3_fwd_3x3",
            "conv3_fwd_3x3_n64",
            "conv3_wgrad_3x3",
            "conv3_wgrad_3x3_m64",
            // the even shapes' data gradients: four phases each
            "conv3_dgrad_3x3",
            "conv3_dgrad_3x3_n64",
            "conv3_dgrad_weights_s2",
        ],
    );
    v3.expect_none(
        "strided 3×3: v2 ran no forward or weight gradient v3 takes",
        &strided,
        v2_forward_or_weight_gradient,
    );
    let v2_dgrad = strided.iter().any(|k| k.starts_with("conv2_dgrad"));
    v3.findings.record(
        "strided 3×3: the odd shapes' data gradients are v2's",
        &[],
        if v2_dgrad {
            Ok(())
        } else {
            Err(format!("no conv2_dgrad ran: {strided:?}"))
        },
    );
    for s in &strided_1x1 {
        v3.every_pass(s, 0.1, &mut rng);
    }
    let strided = v3.take_ran();
    v3.expect_ran(
        "strided 1×1",
        &strided,
        &[
            "conv3_fwd_3x3",
            "conv3_wgrad_3x3",
            "conv3_wgrad_3x3_n64",
            // 128 and 64 input channels: the scattered data gradient in both tile widths
            "conv3_dgrad_1x1",
            "conv3_dgrad_1x1_n64",
            "conv3_transpose_weights",
        ],
    );
    v3.expect_none(
        "strided 1×1: v2 ran none of the passes v3 takes (data gradients included)",
        &strided,
        |k| v2_forward_or_weight_gradient(k) || k.starts_with("conv2_dgrad"),
    );
    v3.gb.set_profiling(false);
    v3.findings.finish("conv3_ops_match_cpu_and_repeat_bitwise");
}

/// The fused batch-norm ops with v3 (its statistics and batch-norm gradient epilogues on the
/// 1×1 layers, its statistics epilogue on the 3×3 and strided forwards in whole tiles, v2 on
/// the rest)
/// against the CPU, with the v2 test's tolerance, then twice to
/// the bit.
#[test]
#[ignore = "needs a CUDA GPU"]
fn conv3_fused_batch_norm_ops_match_cpu_and_repeat_bitwise() {
    let Some(gb) = hopper_v3("conv3_fused_batch_norm_ops_match_cpu_and_repeat_bitwise") else {
        return;
    };
    let tol = Tolerance {
        atol: 1e-2,
        rtol: 1e-2,
    };
    let mut shapes = bn_fusion_shapes();
    shapes.extend(conv3_shapes());
    shapes.extend(conv3_3x3_shapes());
    shapes.extend(conv3_strided_shapes());
    gb.set_profiling(true);
    let reports = check_bn_fusion(&gb, &shapes, tol).unwrap_or_else(|e| panic!("v3: {e}"));
    for r in &reports {
        println!("V3 {r}");
    }
    let kernels: Vec<&str> = gb.take_profile().unwrap().iter().map(|k| k.name).collect();
    gb.set_profiling(false);
    for kernel in [
        "conv3_fwd_stats_1x1",
        "conv3_fwd_stats_3x3",
        "conv3_dgrad_bn_1x1",
        "conv3_dgrad_bn_3x3",
        "conv3_fwd_stats_1x1_n64",
        "conv3_dgrad_bn_1x1_n64",
        "conv2_fwd_stats_128x64",
        "conv2_dgrad_bn_128x64",
    ] {
        assert!(
            ran_or_twin(&kernels, kernel),
            "{kernel} did not run: {kernels:?}"
        );
    }
    check_bn_fusion_repeatable(&gb, &shapes).unwrap_or_else(|e| panic!("v3: {e}"));
}

/// With v3 selected on a Hopper GPU, the data gradient's v3 batch-norm epilogue recomputes the
/// ReLU mask from x, γ and β where the batch norm's output is not stored
/// (`conv_backward_data_bn` with no `y`): the applied ops against the separate ones to the
/// bit and within 1 % of the CPU on the layers v3 takes, then twice: the same bits.
#[test]
#[ignore = "needs a CUDA GPU"]
fn conv3_dgrad_recomputes_the_mask_of_an_unstored_batch_norm() {
    let Some(gb) = hopper_v3("conv3_dgrad_recomputes_the_mask_of_an_unstored_batch_norm") else {
        return;
    };
    let tol = Tolerance {
        atol: 1e-2,
        rtol: 1e-2,
    };
    let mut shapes = conv3_shapes();
    shapes.extend(conv3_3x3_shapes());
    gb.set_profiling(true);
    let reports = check_conv_bn(&gb, &shapes, tol).unwrap_or_else(|e| panic!("v3: {e}"));
    for r in &reports {
        println!("V3 {r}");
    }
    let kernels: Vec<&str> = gb.take_profile().unwrap().iter().map(|k| k.name).collect();
    gb.set_profiling(false);
    for family in ["conv3_dgrad_bn_1x1", "conv3_dgrad_bn_3x3"] {
        assert!(
            kernels.iter().any(|k| k.starts_with(family)),
            "{family}* did not run: {kernels:?}"
        );
    }
    check_conv_bn_repeatable(&gb, &shapes).unwrap_or_else(|e| panic!("v3: {e}"));
}

/// The bf16 model of the GPU's arithmetic (`Bf16Cpu`: each output rounded as the kernels round
/// it) passes the fused batch-norm checks at the GPU tests' tolerance: the checks leave room
/// for bf16 storage and no more, with no GPU needed to see it (an H100 gave the model's dβ to
/// the bit on 2026-11-27, where the check's sums first allowed too little).
#[test]
fn the_bf16_model_passes_the_fused_batch_norm_checks() {
    let model = crate::bf16_cpu::Bf16Cpu(birdtrain::backend::cpu::CpuBackend::new(0).unwrap());
    let tol = Tolerance {
        atol: 1e-2,
        rtol: 1e-2,
    };
    if let Err(e) = check_bn_fusion(&model, &bn_fusion_shapes(), tol) {
        panic!("{e}");
    }
}
