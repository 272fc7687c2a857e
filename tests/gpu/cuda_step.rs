//! Whole-network checks of the CUDA backend against the CPU reference (GPU only: `#[ignore]`d;
//! `cargo test --release --test gpu -- --ignored cuda_step::`):
//! - one resnet18 training step: the loss and every parameter gradient, with v1, with v2 and
//!   batch norm in its own passes (the default), and with v2 and batch norm fused into the
//!   convolutions (`BIRDTRAIN_BN_FUSION=1`; each test sets the sequence itself);
//! - the fused step twice on the same batch: the same bits;
//! - one resnet50 step with the Hopper convolutions (v3: its 1×1 layers), fused and separate;
//! - the resnet50 step under each v3 tile schedule (`BIRDTRAIN_CONV3_TILES`): the same bits;
//! - the resnet50 step with the inner batch norms' masks recomputed (`BIRDTRAIN_BN_MASK`): the
//!   same bits;
//! - training resnet8 on a synthetic 32×32 set to the CPU test's bar (0.90 valid accuracy).
//!
//! Tolerances. Each gradient tensor is compared as a whole (relative L2 error
//! ‖g − g_f32‖ / ‖g_f32‖) with the f32 CPU. Its bar is measured, not assumed: the CPU backend
//! storing in bf16 exactly what the GPU stores so (tests/common/bf16_cpu.rs) is itself 30-50 %
//! from f32 in the first layers at initialisation (2 % at the classifier), so the GPU may be
//! 1.5 × that floor + 0.02 away; a wrong kernel gives ≳ 1. The loss: |Δ| ≤ 0.01 + 1 % of the
//! bf16-storage CPU's.

use birdtrain::backend::cpu::CpuBackend;
use birdtrain::backend::Backend;
use birdtrain::cuda::bn_mask::MaskSource;
use birdtrain::cuda::conv::ConvVersion;
use birdtrain::cuda::conv3;
use birdtrain::cuda::conv3_schedule::TileSchedule;
use birdtrain::cuda::{CudaBackend, KernelTime};

use crate::bf16_cpu;
use bf16_cpu::Bf16Cpu;
use birdtrain::model::{Arch, Augment, Graph, InputBatch, Network};
use birdtrain::optim::{Hyper, Optimizer, OptimizerKind};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A synthetic set: class k has a bright square in a class-specific place and colour on noise.
fn synthetic(n: usize, size: usize, classes: usize, seed: u64) -> (Vec<u8>, Vec<u32>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut pixels = vec![0u8; n * size * size * 3];
    let mut labels = Vec::with_capacity(n);
    let side = size / 3;
    for i in 0..n {
        let k = rng.random_range(0..classes);
        labels.push(k as u32);
        let (oy, ox) = ((k / 2) % 2 * (size - side), k % 2 * (size - side));
        let img = &mut pixels[i * size * size * 3..(i + 1) * size * size * 3];
        for y in 0..size {
            for x in 0..size {
                for c in 0..3 {
                    let inside = y >= oy && y < oy + side && x >= ox && x < ox + side;
                    let base: u8 = if inside {
                        if c == k % 3 {
                            230
                        } else {
                            160
                        }
                    } else {
                        40
                    };
                    img[(y * size + x) * 3 + c] = base.saturating_add(rng.random_range(0..40));
                }
            }
        }
    }
    (pixels, labels)
}

fn rel_err(g: &[f32], c: &[f32]) -> (f64, f64) {
    let (mut diff, mut norm_c, mut norm_g, mut dot) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    for (&a, &b) in g.iter().zip(c) {
        let (a, b) = (f64::from(a), f64::from(b));
        diff += (a - b) * (a - b);
        norm_c += b * b;
        norm_g += a * a;
        dot += a * b;
    }
    let rel = diff.sqrt() / norm_c.sqrt().max(1e-12);
    let cos = dot / (norm_c.sqrt() * norm_g.sqrt()).max(1e-30);
    (rel, cos)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn resnet18_step_matches_cpu() {
    // Every gradient and statistic is compared and the whole table printed before any
    // assertion, once per convolution generation: a wrong kernel shows as the first layer (in
    // backward order) whose error jumps, and in the generation it belongs to.
    let mut failures = Vec::new();
    // v3 (the default on Hopper; v2's kernels elsewhere) with batch norm fused, the default.
    for (version, fusion) in [
        (ConvVersion::V1, false),
        (ConvVersion::V2, false),
        (ConvVersion::V2, true),
        (ConvVersion::V3, true),
    ] {
        failures.extend(
            resnet18_step_table(version, fusion)
                .into_iter()
                .map(|f| format!("{version:?} bn fusion {fusion}: {f}")),
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn resnet50_v3_step_matches_cpu() {
    // resnet50's bottlenecks hold the 1×1 layers the Hopper kernels take (conv1 and conv3 of
    // every block): the whole step with them, batch norm fused and separate, against the CPU.
    let backend = CudaBackend::new(0).unwrap();
    let arch = backend.device().arch();
    if (arch.major, arch.minor) != (9, 0) {
        eprintln!(
            "skipped resnet50_v3_step_matches_cpu: the v3 kernels need a Hopper GPU (compute capability 9.0), this is {arch}"
        );
        return;
    }
    let mut failures = Vec::new();
    for fusion in [true, false] {
        failures.extend(
            step_table(Arch::ResNet50, ConvVersion::V3, fusion)
                .into_iter()
                .map(|f| format!("V3 bn fusion {fusion}: {f}")),
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_resnet18_steps_repeat_bitwise() {
    // Two networks with batch norm fused, the same weights and batch: the loss, every gradient
    // and every running statistic to the bit (fixed-order merges, no atomics). The separate
    // passes' step beside it, for the table: the two sequences differ by summation order.
    let graph = Graph::new(Arch::ResNet18, 10);
    let (n, size) = (4, 64u32);
    let (pixels, labels, aug) = step_batch(n, size as usize);
    let batch = InputBatch {
        pixels: &pixels,
        labels: &labels,
        len: n,
        image_size: size,
        augment: Some(&aug),
        mix: None,
    };
    let step = |fusion: bool| {
        let mut backend = CudaBackend::new(0).unwrap();
        backend.set_conv_version(ConvVersion::V2);
        backend.set_bn_fusion(fusion);
        let mut net = Network::new(backend, &graph, n, size).unwrap();
        step_tensors(&mut net, &graph, &batch)
    };
    let (la, ta) = step(true);
    let (lb, tb) = step(true);
    let (lu, tu) = step(false);
    println!("loss fused {la} again {lb} separate {lu}");
    assert_eq!(la.to_bits(), lb.to_bits(), "loss {la} then {lb}");
    for ((name, a), ((_, b), (_, u))) in ta.iter().zip(tb.iter().zip(&tu)) {
        let (rel, _) = rel_err(a, u);
        println!("  {name:<34} fused vs separate {rel:>8.4}");
        if let Some(i) = a
            .iter()
            .zip(b)
            .position(|(x, y)| x.to_bits() != y.to_bits())
        {
            panic!("{name}[{i}]: {} then {}", a[i], b[i]);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn applied_batch_norm_steps_have_the_fused_bits() {
    // With `BIRDTRAIN_BN_PROLOGUE` (set_conv_applies_bn), the convolutions read each inner
    // batch norm's input and apply it themselves, and their data gradients recompute its
    // mask: the same arithmetic as the stored output's, so the same bits as the fused step
    // (loss, every gradient, every running statistic), on basic blocks and bottlenecks.
    for arch in [Arch::ResNet18, Arch::ResNet50] {
        let graph = Graph::new(arch, 10);
        let (n, size) = (4, 64u32);
        let (pixels, labels, aug) = step_batch(n, size as usize);
        let batch = InputBatch {
            pixels: &pixels,
            labels: &labels,
            len: n,
            image_size: size,
            augment: Some(&aug),
            mix: None,
        };
        let step = |applied: bool| {
            let mut backend = CudaBackend::new(0).unwrap();
            backend.set_conv_version(ConvVersion::V2);
            backend.set_bn_fusion(true);
            backend.set_conv_applies_bn(applied);
            let mut net = Network::new(backend, &graph, n, size).unwrap();
            let elements = net.elements_per_image();
            (step_tensors(&mut net, &graph, &batch), elements)
        };
        let (((la, ta), ea), ((lf, tf), ef)) = (step(true), step(false));
        println!("{arch:?}: loss applied {la} fused {lf}; elements per image {ea} vs {ef}");
        assert!(ea < ef, "{arch:?}: the inner outputs are still stored");
        assert_eq!(la.to_bits(), lf.to_bits(), "{arch:?}: loss {la} vs {lf}");
        for ((name, a), (_, f)) in ta.iter().zip(&tf) {
            if let Some(i) = a
                .iter()
                .zip(f)
                .position(|(x, y)| x.to_bits() != y.to_bits())
            {
                panic!("{arch:?} {name}[{i}]: applied {} fused {}", a[i], f[i]);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn conv3_tile_schedules_give_the_same_step_bits() {
    // The v3 forward and data-gradient GEMMs run one block per tile (`blocks`, conv3_gemm), in
    // the persistent kernels one block per tile (`raster`, the 128-column tiles) and one block
    // per SM walking several tiles each (`persistent`, two blocks an SM for 64 columns:
    // resnet50 at 8 × 224 px has 392 128-column tiles in its first 1×1 data gradients, three
    // a block on 132 SMs). Each tile is computed the same way under all three, so the step's
    // loss, gradients and running statistics have the same bits.
    if !CudaBackend::new(0).unwrap().device().arch().is_hopper() {
        eprintln!("skipped conv3_tile_schedules_give_the_same_step_bits: v3 needs a Hopper GPU");
        return;
    }
    let (first, blocks) = resnet50_step(ConvVersion::V3, TileSchedule::Blocks, MaskSource::Stored);
    assert!(
        !blocks.iter().any(|k| conv3::is_persistent(k.name)),
        "blocks ran a persistent kernel: {:?}",
        names(&blocks)
    );
    for schedule in [TileSchedule::Raster, TileSchedule::Persistent] {
        let (got, kernels) = resnet50_step(ConvVersion::V3, schedule, MaskSource::Stored);
        let kernels = names(&kernels);
        for k in [
            "conv3_fwd_stats_1x1_p",
            "conv3_dgrad_bn_1x1_p",
            "conv3_fwd_stats_3x3_p",
        ] {
            assert!(
                kernels.contains(&k),
                "{schedule:?}: {k} did not run: {kernels:?}"
            );
        }
        // The 64-column tiles (layer1's) run persistent under `persistent` alone.
        for k in ["conv3_fwd_stats_1x1_n64_p", "conv3_dgrad_bn_1x1_n64_p"] {
            assert_eq!(
                kernels.contains(&k),
                schedule == TileSchedule::Persistent,
                "{schedule:?}: {k}: {kernels:?}"
            );
        }
        assert_same_step_bits(&format!("{schedule:?}"), &got, &first);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn mask_sources_give_the_stored_masks_step_bits() {
    // `BIRDTRAIN_BN_MASK=recomputed`: the data gradients after an inner batch norm (no
    // residual) recompute its ReLU's mask from x, γ and β in their sums instead of reading y.
    // It is bn_apply's expression rounded as bn_apply rounds it, so the step keeps its bits:
    // v3 one tile a block and persistent, and v2; and the data gradients with a batch-norm
    // epilogue declare fewer bytes (y not read), which shows that the setting took.
    // `packed` (v3): besides, the blocks' outputs but the last keep their signs packed by
    // `bn_apply_signs_vec` (15 of resnet50's), which the data gradients read instead of y:
    // the same bits again, and fewer bytes still. v2 reads y there (no signs are packed).
    let hopper = CudaBackend::new(0).unwrap().device().arch().is_hopper();
    let mut cases = vec![(ConvVersion::V2, TileSchedule::Blocks)];
    if hopper {
        cases.push((ConvVersion::V3, TileSchedule::Blocks));
        cases.push((ConvVersion::V3, TileSchedule::Persistent));
    } else {
        eprintln!("mask_sources_give_the_stored_masks_step_bits: v2 only (v3 needs a Hopper GPU)");
    }
    for (conv, schedule) in cases {
        let prefix = format!(
            "{}_dgrad_bn_",
            if conv == ConvVersion::V3 {
                "conv3"
            } else {
                "conv2"
            }
        );
        let dgrad_bn_bytes = |kernels: &[KernelTime]| -> f64 {
            kernels
                .iter()
                .filter(|k| k.name.starts_with(&prefix))
                .map(|k| k.bytes)
                .sum()
        };
        let packing = |kernels: &[KernelTime]| -> usize {
            kernels
                .iter()
                .filter(|k| k.name == "bn_apply_signs_vec")
                .count()
        };
        let (stored, stored_kernels) = resnet50_step(conv, schedule, MaskSource::Stored);
        let (recomputed, kernels) = resnet50_step(conv, schedule, MaskSource::Recomputed);
        let (before, after) = (dgrad_bn_bytes(&stored_kernels), dgrad_bn_bytes(&kernels));
        let what = format!("{conv:?} {schedule:?}");
        println!("{what}: the data gradients with a batch-norm epilogue declare {after:.0} bytes, {before:.0} reading y");
        assert!(
            after < before,
            "{what}: recomputed masks declared {after} bytes, stored {before}"
        );
        assert_eq!(packing(&stored_kernels) + packing(&kernels), 0, "{what}");
        assert_same_step_bits(&format!("{what} recomputed"), &recomputed, &stored);
        let (packed, packed_kernels) = resnet50_step(conv, schedule, MaskSource::Packed);
        let packed_bytes = dgrad_bn_bytes(&packed_kernels);
        println!("{what}: {packed_bytes:.0} bytes with packed signs");
        if conv == ConvVersion::V3 {
            assert_eq!(
                packing(&packed_kernels),
                15,
                "{what}: {:?}",
                names(&packed_kernels)
            );
            assert!(
                packed_bytes < after,
                "{what}: packed signs declared {packed_bytes} bytes, recomputed {after}"
            );
        } else {
            assert_eq!(packing(&packed_kernels), 0, "{what}");
            assert_eq!(packed_bytes, after, "{what}");
        }
        assert_same_step_bits(&format!("{what} packed"), &packed, &stored);
    }
}

/// The loss, gradients and running statistics of one step.
type StepBits = (f64, Vec<(String, Vec<f32>)>);

/// One resnet50 step at 8 × 224 px with batch norm fused, on convolutions `conv` under a v3
/// tile schedule and a mask source: its results and the kernels it ran.
fn resnet50_step(
    conv: ConvVersion,
    schedule: TileSchedule,
    mask: MaskSource,
) -> (StepBits, Vec<KernelTime>) {
    let graph = Graph::new(Arch::ResNet50, 10);
    let (n, size) = (8, 224u32);
    let (pixels, labels, aug) = step_batch(n, size as usize);
    let batch = InputBatch {
        pixels: &pixels,
        labels: &labels,
        len: n,
        image_size: size,
        augment: Some(&aug),
        mix: None,
    };
    let mut backend = CudaBackend::new(0).unwrap();
    backend.set_conv_version(conv);
    backend.set_bn_fusion(true);
    backend.set_conv3_tiles(schedule);
    backend.set_bn_mask(mask);
    backend.set_profiling(true);
    let mut net = Network::new(backend, &graph, n, size).unwrap();
    let tensors = step_tensors(&mut net, &graph, &batch);
    (tensors, net.backend().take_profile().unwrap())
}

fn names(kernels: &[KernelTime]) -> Vec<&'static str> {
    kernels.iter().map(|k| k.name).collect()
}

/// Panics, naming `what` and the first tensor that differs, unless `got` has `want`'s bits.
fn assert_same_step_bits(what: &str, got: &StepBits, want: &StepBits) {
    let ((l, t), (lw, tw)) = (got, want);
    println!("{what}: loss {l} (against {lw})");
    assert_eq!(l.to_bits(), lw.to_bits(), "{what}: loss {l} vs {lw}");
    for ((name, a), (_, b)) in t.iter().zip(tw) {
        if let Some(i) = a
            .iter()
            .zip(b)
            .position(|(x, y)| x.to_bits() != y.to_bits())
        {
            panic!("{what} {name}[{i}]: {} vs {}", a[i], b[i]);
        }
    }
}

/// The batch of the resnet18 step checks: `n` synthetic `size`-px images, and per-image
/// shifts, flips and none (four kinds, in turn).
fn step_batch(n: usize, size: usize) -> (Vec<u8>, Vec<u32>, Vec<Augment>) {
    let (pixels, labels) = synthetic(n, size, 10, 11);
    let four = [
        Augment {
            dy: 3,
            dx: -2,
            flip: true,
            erase: None,
        },
        Augment::default(),
        Augment {
            dy: -8,
            dx: 8,
            flip: false,
            erase: None,
        },
        Augment {
            dy: 0,
            dx: 1,
            flip: true,
            erase: None,
        },
    ];
    let aug = (0..n).map(|i| four[i % 4]).collect();
    (pixels, labels, aug)
}

/// Per tensor (parameter gradients, then BN running statistics): its name and values.
fn step_tensors<B: Backend>(
    net: &mut Network<B>,
    graph: &Graph,
    batch: &InputBatch<'_>,
) -> (f64, Vec<(String, Vec<f32>)>) {
    let loss = net.train_step(batch).unwrap().loss_sum;
    let grads = net.grads_f32().unwrap();
    let (offsets, _) = graph.param_offsets();
    let mut out: Vec<(String, Vec<f32>)> = graph
        .params()
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let r = offsets[i]..offsets[i] + p.numel();
            (p.name.clone(), grads[r].to_vec())
        })
        .collect();
    let buffers = net.state().unwrap().buffers;
    for (spec, b) in graph.buffers().iter().zip(buffers) {
        out.push((format!("buffer {}", spec.name), b));
    }
    (loss, out)
}

/// One resnet18 step on the GPU (convolutions of `version`, batch norm fused into them with
/// `fusion` and v2), on the CPU storing in bf16 what the GPU stores so (the floor) and on the
/// f32 CPU (the reference), twice (without and with augmentation); prints every tensor's
/// error and returns the failures.
fn resnet18_step_table(version: ConvVersion, fusion: bool) -> Vec<String> {
    step_table(Arch::ResNet18, version, fusion)
}

/// [`resnet18_step_table`] for another network.
fn step_table(arch: Arch, version: ConvVersion, fusion: bool) -> Vec<String> {
    let graph = Graph::new(arch, 10);
    let (n, size) = (4, 64u32);
    let mut backend = CudaBackend::new(0).unwrap();
    backend.set_conv_version(version);
    backend.set_bn_fusion(fusion);
    let mut gpu = Network::new(backend, &graph, n, size).unwrap();
    let mut bf16 = Network::new(Bf16Cpu(CpuBackend::new(0).unwrap()), &graph, n, size).unwrap();
    let mut f32cpu = Network::new(CpuBackend::new(0).unwrap(), &graph, n, size).unwrap();
    let (pixels, labels, aug) = step_batch(n, size as usize);
    let mut failures = Vec::new();
    for augment in [None, Some(&aug[..])] {
        let pass = format!(
            "{} {version:?} bn fusion {fusion} augment={}",
            arch.name(),
            augment.is_some()
        );
        let batch = InputBatch {
            pixels: &pixels,
            labels: &labels,
            len: n,
            image_size: size,
            augment,
            mix: None,
        };
        let (lg, tg) = step_tensors(&mut gpu, &graph, &batch);
        let (lb, tb) = step_tensors(&mut bf16, &graph, &batch);
        let (lf, tf) = step_tensors(&mut f32cpu, &graph, &batch);
        println!("{pass}: loss GPU {lg} CPU bf16 storage {lb} CPU f32 {lf}");
        // The loss by the rule of the tensors below: from the f32 CPU, as far as bf16 storage
        // alone moves it with 50 % and 1 % of slack (resnet50's 53 layers move it by 0.08, and
        // two bf16 computations land on either side of the f32 loss: 2026-11-27, H100).
        if (lg - lf).abs() > 1.5 * (lb - lf).abs() + 0.01 + 0.01 * lf.abs() {
            failures.push(format!(
                "{pass}: loss {lg} vs {lf} (bf16 storage alone {lb})"
            ));
        }
        println!(
            "{pass}: tensor                 GPU vs bf16-CPU (rel, cos) | GPU vs f32 | bf16-CPU vs f32"
        );
        for ((name, g), ((_, b), (_, f))) in tg.iter().zip(tb.iter().zip(&tf)) {
            let (rel, cos) = rel_err(g, b);
            let (rel_f, _) = rel_err(g, f);
            let (floor, _) = rel_err(b, f);
            // Two bf16 computations differ from f32 (and from each other) by the error bf16
            // storage brings (`floor`, up to ~0.5 in the first layers, see
            // bf16_storage_alone_keeps_the_last_layers_and_moves_the_first): the GPU may be
            // that far from the f32 CPU, with 50 % and 0.02 of slack for summation order, but
            // a wrong kernel (error ≳ 1) is not. The running statistics by the same rule: in
            // resnet50's last stages bf16 storage alone moves them by up to 17 % (2026-11-27).
            let bad = rel_f > 1.5 * floor + 0.02;
            println!(
                "  {name:<34} {rel:>8.4} {cos:>8.5} | {rel_f:>8.4} | {floor:>8.4}{}",
                if bad { "  <-- off" } else { "" }
            );
            if bad {
                failures.push(format!(
                    "{pass}: {name}: {rel_f:.4} from the f32 CPU, bf16 storage alone {floor:.4}"
                ));
            }
        }
    }
    failures
}

#[test]
fn bf16_storage_alone_keeps_the_last_layers_and_moves_the_first() {
    // The floor of the GPU checks above, on the CPU: storing in bf16 where the GPU does leaves
    // the loss and the classifier's gradient at bf16 precision, while the first layers'
    // gradients move by 30-50 % (at initialisation they are small sums of large terms that
    // cancel; measured here, and the same at batch 8 and 128 px): the GPU is held to this
    // distance from the f32 CPU, not to bf16's 2^-8.
    let graph = Graph::new(Arch::ResNet18, 10);
    let (n, size) = (4, 64);
    let mut bf16 = Network::new(Bf16Cpu(CpuBackend::new(0).unwrap()), &graph, n, size).unwrap();
    let mut f32cpu = Network::new(CpuBackend::new(0).unwrap(), &graph, n, size).unwrap();
    let (pixels, labels, _) = step_batch(n, size as usize);
    let batch = InputBatch {
        pixels: &pixels,
        labels: &labels,
        len: n,
        image_size: size,
        augment: None,
        mix: None,
    };
    let (lb, tb) = step_tensors(&mut bf16, &graph, &batch);
    let (lf, tf) = step_tensors(&mut f32cpu, &graph, &batch);
    println!("loss bf16 storage {lb} f32 {lf}");
    for ((name, b), (_, f)) in tb.iter().zip(&tf) {
        let (rel, cos) = rel_err(b, f);
        println!("  {name:<34} {rel:>8.4} {cos:>8.5}");
    }
    assert!((lb - lf).abs() <= 0.01 * lf.abs(), "loss {lb} vs {lf}");
    let fc = tb.iter().position(|(n, _)| n == "fc.weight").unwrap();
    let (rel, _) = rel_err(&tb[fc].1, &tf[fc].1);
    assert!(rel < 0.05, "fc.weight moved by {rel}");
    // bf16 storage changes something: the first layer's gradient is not the f32 one.
    let (first, _) = rel_err(&tb[0].1, &tf[0].1);
    assert!(
        first > 1e-4,
        "conv1.weight identical to f32: is anything rounded?"
    );
}

/// SGD steps of batch 32 for the training tests (the CPU reaches 1.00 in 50 here).
const TRAIN_STEPS: usize = 50;

/// Trains `arch` on a synthetic 4-class 32×32 set and returns the validation accuracy.
/// The f32 master weights stay on the host (the optimizer's copy); the backend holds its own
/// working copy (bf16 on the GPU), refreshed after each update.
fn train_synthetic<B: Backend>(backend: B, arch: Arch, steps: usize) -> f64 {
    let graph = Graph::new(arch, 4);
    let (batch, size) = (32usize, 32u32);
    let mut net = Network::new(backend, &graph, batch, size).unwrap();
    let (train_x, train_y) = synthetic(1024, size as usize, 4, 21);
    let (valid_x, valid_y) = synthetic(256, size as usize, 4, 22);
    let mut opt = Optimizer::new(
        OptimizerKind::Sgd {
            momentum: 0.9,
            nesterov: false,
        },
        Hyper {
            weight_decay: 5e-4,
            ..Hyper::default()
        },
        graph.params(),
    );
    let mut master = net.params_f32().unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let img = (size * size * 3) as usize;
    let m = Augment::max_shift(size);
    for step in 0..steps {
        let start = (step * batch) % 1024;
        let aug: Vec<Augment> = (0..batch)
            .map(|_| Augment {
                dy: rng.random_range(-m..=m),
                dx: rng.random_range(-m..=m),
                flip: rng.random(),
                erase: None,
            })
            .collect();
        let input = InputBatch {
            pixels: &train_x[start * img..(start + batch) * img],
            labels: &train_y[start..start + batch],
            len: batch,
            image_size: size,
            augment: Some(&aug),
            mix: None,
        };
        net.train_step(&input).unwrap();
        let grads = net.grads_f32().unwrap();
        opt.step(&mut master, &grads, 0.05).unwrap();
        net.set_params_f32(&master).unwrap();
    }
    let mut correct = 0;
    for start in (0..256).step_by(batch) {
        let input = InputBatch {
            pixels: &valid_x[start * img..(start + batch) * img],
            labels: &valid_y[start..start + batch],
            len: batch,
            image_size: size,
            augment: None,
            mix: None,
        };
        correct += net.eval_step(&input).unwrap().0.correct_top1;
    }
    correct as f64 / 256.0
}

/// The same body on the CPU reference: proves the synthetic task and schedule reach the bar, so
/// a GPU failure points at the GPU backend.
#[test]
fn resnet8_trains_to_the_bar_on_the_cpu() {
    let acc = train_synthetic(CpuBackend::new(0).unwrap(), Arch::ResNet8, TRAIN_STEPS);
    eprintln!("cpu valid accuracy {acc:.3}");
    assert!(acc >= 0.90, "valid accuracy {acc:.3} < 0.90");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn resnet8_trains_to_the_cpu_bar_on_the_gpu() {
    let acc = train_synthetic(CudaBackend::new(0).unwrap(), Arch::ResNet8, TRAIN_STEPS);
    assert!(acc >= 0.90, "valid accuracy {acc:.3} < 0.90");
}
