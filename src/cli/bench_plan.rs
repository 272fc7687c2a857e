//! `birdtrain bench step --plan`: the step model of the v2 convolutions (and, with
//! `BIRDTRAIN_CONV=v3`, of the Hopper kernels where they take a pass), without a GPU.
//!
//! For every convolution of the model and each of its passes (forward, dgrad, wgrad; the stem
//! has no dgrad: the image needs no gradient) it prints the GEMM the pass is, its FLOPs and
//! bytes, and what src/cuda/conv.rs would launch on an H100: kernel, tile, blocks, waves, the
//! fill of the last wave and the tile area spent on padding. The summary's efficiency is the
//! useful FLOPs over the FLOPs of every launched wave (whole tiles, whole waves), so wave
//! tails and padded tiles show as the step time they cost.

use serde::Serialize;

use crate::backend::ConvShape;
use crate::cuda::conv::{self, ConvVersion, GpuLimits, Pass};
use crate::cuda::{conv3, GpuArch};
use crate::model::{Arch, Graph, Node};

/// One pass of one convolution in the plan.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PlanRow {
    /// The weight's torchvision name, without `.weight`.
    pub layer: String,
    /// fwd, dgrad or wgrad.
    pub pass: &'static str,
    /// The v3 kernel (`BIRDTRAIN_CONV=v3`, where it takes the pass), the v2 kernel, or
    /// `v1:<why>` where v2 does not take the shape.
    pub kernel: String,
    /// GEMM (M, N, reduction).
    pub gemm: (usize, usize, usize),
    /// Useful FLOPs (2 × multiply-adds).
    pub flops: f64,
    /// Bytes the pass must move at least (bf16 tensors, f32 weight gradient).
    pub bytes: f64,
    /// Blocks launched.
    pub blocks: usize,
    /// Waves (blocks over resident slots).
    pub waves: f64,
    /// Fraction of the tile area that is padding.
    pub padded: f64,
    /// FLOPs of the whole waves launched (tiles × blocks per SM × SMs × waves rounded up).
    pub launched_flops: f64,
}

/// Every convolution pass of `arch` at `batch` images of `image_size` pixels on `gpu` (a
/// Hopper GPU: the v3 kernels take their passes with `version` v3).
pub fn conv_plan(
    arch: Arch,
    batch: usize,
    image_size: u32,
    gpu: &GpuLimits,
    version: ConvVersion,
) -> Vec<PlanRow> {
    let graph = Graph::new(arch, 1000);
    let dims = graph.value_dims(image_size);
    let mut rows = Vec::new();
    for node in graph.nodes() {
        let (Some(s), Node::Conv { input, weight, .. }) =
            (graph.conv_shape(node, &dims, batch), node)
        else {
            continue;
        };
        let layer = graph.params()[*weight]
            .name
            .trim_end_matches(".weight")
            .to_string();
        for pass in [Pass::Forward, Pass::Dgrad, Pass::Wgrad] {
            if pass == Pass::Dgrad && *input == 0 {
                continue;
            }
            let v3 = (version == ConvVersion::V3)
                .then(|| v3_row(&layer, pass, &s, gpu))
                .flatten();
            rows.push(v3.unwrap_or_else(|| row(&layer, pass, &s, gpu)));
        }
    }
    rows
}

fn row(layer: &str, pass: Pass, s: &ConvShape, gpu: &GpuLimits) -> PlanRow {
    let bytes = pass_bytes(pass, s);
    match conv::plan(pass, s, gpu) {
        Ok(l) => {
            let (bm, bn) = l.tile.dims();
            let slots = l.blocks_per_sm * gpu.sms;
            // dgrad: the phases' mean reduction (R·S·K / stride² taps·channels); a phase
            // with fewer taps ends sooner and frees its slots.
            let red = match pass {
                Pass::Wgrad => l.args.k_chunk as f64,
                Pass::Dgrad => {
                    (s.kernel * s.kernel * s.c_out) as f64 / (s.stride * s.stride) as f64
                }
                Pass::Forward => l.gemm.2 as f64,
            };
            let launched =
                (l.blocks().div_ceil(slots) * slots) as f64 * 2.0 * (bm * bn) as f64 * red;
            PlanRow {
                layer: layer.to_string(),
                pass: pass.name(),
                kernel: l.kernel.to_string(),
                gemm: l.gemm,
                flops: s.flops(),
                bytes,
                blocks: l.blocks(),
                waves: l.waves(gpu),
                padded: l.padded_fraction(),
                launched_flops: launched,
            }
        }
        Err(why) => PlanRow {
            layer: layer.to_string(),
            pass: pass.name(),
            kernel: format!("v1: {why}"),
            gemm: (0, 0, 0),
            flops: s.flops(),
            bytes,
            blocks: 0,
            waves: 0.0,
            padded: 0.0,
            launched_flops: s.flops(),
        },
    }
}

/// The bytes a pass must move at least (bf16 tensors, the f32 weight gradient).
fn pass_bytes(pass: Pass, s: &ConvShape) -> f64 {
    match pass {
        Pass::Forward | Pass::Dgrad => 2.0 * (s.x_len() + s.w_len() + s.y_len()) as f64,
        Pass::Wgrad => 2.0 * (s.x_len() + s.y_len()) as f64 + 4.0 * s.w_len() as f64,
    }
}

/// The pass as the v3 kernels run it on a Hopper GPU (one block of 128 × 128 per SM, or two of
/// 128 × 64 where the GEMM's N is at most 64, or two of 64 × 128 where a weight gradient's M is
/// at most 64), or `None` where they do not take it.
fn v3_row(layer: &str, pass: Pass, s: &ConvShape, gpu: &GpuLimits) -> Option<PlanRow> {
    let hopper = GpuArch::new(9, 0);
    let one = s.kernel == 1;
    let (args, slices, kernel) = match pass {
        Pass::Forward if conv3::takes_forward(s, hopper) => {
            // A strided 1×1 takes the 4-D path (one tap), as conv3_forward launches it.
            match conv3::forward_4d_args(s, hopper) {
                Some(a) => (a, 1, conv3::FWD_3X3_KERNEL),
                None => (conv3::forward_args(s)?, 1, conv3::FWD_KERNEL),
            }
        }
        Pass::Dgrad if conv3::takes_dgrad(s, hopper) => {
            let a = if one {
                conv3::dgrad_args(s, false)?
            } else {
                conv3::dgrad_3x3_args(s, hopper, false)?
            };
            let k = if one {
                conv3::DGRAD_KERNEL
            } else {
                conv3::DGRAD_3X3_KERNEL
            };
            (a, 1, k)
        }
        Pass::Wgrad if conv3::takes_wgrad(s, hopper) => {
            // A strided 1×1 takes the 4-D path (one tap), as conv3_backward_weight launches it.
            if one && s.stride == 1 {
                let (a, slices) = conv3::wgrad_args(s, gpu.sms)?;
                (a, slices, conv3::WGRAD_KERNEL)
            } else {
                let (a, slices, _) = conv3::wgrad_4d_args(s, hopper, gpu.sms)?;
                (a, slices, conv3::WGRAD_3X3_KERNEL)
            }
        }
        _ => return None,
    };
    // The short tiles: 64 columns where N ≤ 64; the weight gradient's 64 rows where M ≤ 64.
    let kernel = if pass == Pass::Wgrad {
        conv3::wgrad_kernel(kernel, &args)
    } else {
        conv3::with_tile(kernel, conv3::tile_n(&args))
    };
    let (tm, tn) = conv3::kernel_tile(kernel);
    let (gx, gy) = (
        (args.m as usize).div_ceil(tm),
        (args.n as usize).div_ceil(tn),
    );
    // A stride-2 3×3 data gradient: four phases of blocks (gridDim.z).
    let phases = if conv3::is_phased(&args) {
        conv3::DGRAD_PHASES
    } else {
        1
    };
    let blocks = gx * gy * slices * phases;
    // The short tiles run two blocks an SM.
    let slots = gpu.sms
        * if (tm, tn) == (conv3::TILE_M, conv3::TILE_N) {
            1
        } else {
            2
        };
    let tile = (tm * tn) as f64;
    // The phases' mean reduction: 1, 2, 2 and 4 taps of K (9 of 16 taps of the weight's rows).
    let red = if pass == Pass::Wgrad {
        args.k_chunk as f64
    } else if phases > 1 {
        9.0 * args.k_chunk as f64 / phases as f64
    } else {
        args.k as f64
    };
    let (m, n) = (args.m as usize, args.n as usize);
    Some(PlanRow {
        layer: layer.to_string(),
        pass: pass.name(),
        kernel: kernel.to_string(),
        gemm: (m, n, args.k as usize),
        flops: s.flops(),
        bytes: pass_bytes(pass, s),
        blocks,
        waves: blocks as f64 / slots as f64,
        padded: 1.0 - (m * n) as f64 / (gx as f64 * gy as f64 * tile),
        launched_flops: (blocks.div_ceil(slots) * slots) as f64 * 2.0 * tile * red,
    })
}

/// Prints the plan as a table with a summary line.
pub fn print(model: &str, batch: usize, image_size: u32, version: ConvVersion, rows: &[PlanRow]) {
    let gpu = GpuLimits::H100;
    let kernels = match version {
        ConvVersion::V3 => "v3 (Hopper, where they take a pass) and v2",
        _ => "v2",
    };
    outln!(
        "{model} batch {batch} at {image_size}px, {kernels} convolutions modelled on an H100 ({} SMs, {} KiB shared memory each)",
        gpu.sms,
        gpu.smem_per_sm / 1024
    );
    outln!(
        "{:<22} {:<5} {:<24} {:>19} {:>8} {:>8} {:>7} {:>6} {:>6} {:>5}",
        "layer",
        "pass",
        "kernel",
        "GEMM M×N×K",
        "GFLOP",
        "MB",
        "blocks",
        "waves",
        "pad%",
        "eff%"
    );
    for r in rows {
        outln!(
            "{:<22} {:<5} {:<24} {:>19} {:>8.2} {:>8.1} {:>7} {:>6.2} {:>6.1} {:>5.1}",
            r.layer,
            r.pass,
            r.kernel,
            format!("{}×{}×{}", r.gemm.0, r.gemm.1, r.gemm.2),
            r.flops / 1e9,
            r.bytes / 1e6,
            r.blocks,
            r.waves,
            100.0 * r.padded,
            100.0 * r.flops / r.launched_flops
        );
    }
    let useful: f64 = rows.iter().map(|r| r.flops).sum();
    let launched: f64 = rows.iter().map(|r| r.launched_flops).sum();
    let bytes: f64 = rows.iter().map(|r| r.bytes).sum();
    outln!(
        "total: {} launches, {:.1} GFLOP useful of {:.1} GFLOP launched in whole waves ({:.1}% efficiency), {:.2} GB moved at least",
        rows.len(),
        useful / 1e9,
        launched / 1e9,
        100.0 * useful / launched,
        bytes / 1e9
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resnet50_plan_covers_every_pass_with_v2() {
        let rows = conv_plan(Arch::ResNet50, 256, 224, &GpuLimits::H100, ConvVersion::V2);
        // 53 convolutions × 3 passes, less the stem's dgrad.
        assert_eq!(rows.len(), 53 * 3 - 1);
        assert!(
            rows.iter().all(|r| r.kernel.starts_with("conv2_")),
            "{rows:?}"
        );
        let stem: Vec<_> = rows.iter().filter(|r| r.layer == "conv1").collect();
        assert_eq!(stem.len(), 2);
        assert_eq!(stem[1].kernel, "conv2_wgrad_c8_64x128");
        // The stem reads pixel pairs: a reduction of 7·4·8 = 224 (147 real) instead of
        // 7·7·8 = 392 (kernels/conv2.cu, "The stem"); 65 % and 57 % of its launched work
        // useful, where 8 padded channels gave 37 % and 29 %.
        assert_eq!(stem[0].gemm, (256 * 112 * 112, 64, 224));
        assert_eq!(stem[1].gemm, (64, 224, 256 * 112 * 112));
        let useful = |r: &PlanRow| r.flops / r.launched_flops;
        assert!((0.64..0.66).contains(&useful(stem[0])), "{:?}", stem[0]);
        assert!((0.56..0.58).contains(&useful(stem[1])), "{:?}", stem[1]);
        // The useful work is 3 × the forward convolutions' less the stem's dgrad.
        let graph = Graph::new(Arch::ResNet50, 1000);
        let dims = graph.value_dims(224);
        let fwd: f64 = graph
            .nodes()
            .iter()
            .filter_map(|n| graph.conv_shape(n, &dims, 256))
            .map(|s| s.flops())
            .sum();
        let total: f64 = rows.iter().map(|r| r.flops).sum();
        assert!((total - (3.0 * fwd - stem[0].flops)).abs() < 1.0);
        for r in &rows {
            assert!(r.launched_flops >= r.flops * 0.999, "{r:?}");
            assert!(r.waves > 0.0 && (0.0..1.0).contains(&r.padded), "{r:?}");
        }
    }

    #[test]
    fn resnet50_plan_with_v3_takes_every_pass_but_the_stem() {
        let (v2, v3) = [ConvVersion::V2, ConvVersion::V3]
            .map(|v| conv_plan(Arch::ResNet50, 256, 224, &GpuLimits::H100, v))
            .into();
        assert_eq!(v2.len(), v3.len());
        let taken: f64 = v3
            .iter()
            .filter(|r| r.kernel.starts_with("conv3_"))
            .map(|r| r.flops)
            .sum();
        let total: f64 = v3.iter().map(|r| r.flops).sum();
        // Every pass but the stem's: 98.1 % of the work.
        assert!((0.98..0.99).contains(&(taken / total)), "{}", taken / total);
        assert!(v3
            .iter()
            .all(|r| r.kernel.starts_with("conv3_") == (r.layer != "conv1")));
        for (a, b) in v2.iter().zip(&v3) {
            assert_eq!((&a.layer, a.pass, a.flops), (&b.layer, b.pass, b.flops));
            if b.kernel.starts_with("conv3_") {
                assert!(b.launched_flops >= b.flops * 0.999, "{b:?}");
                assert!(b.waves > 0.0 && (0.0..1.0).contains(&b.padded), "{b:?}");
            } else {
                assert_eq!(a, b, "v2 keeps the layers v3 does not take");
            }
        }
        // The stem stays v2; a 3×3 (its stride-2 data gradient in four phases) and a stride-2
        // 1×1 (the data gradient scattered to every other pixel) take all three passes.
        let by = |layer: &str| -> Vec<&str> {
            v3.iter()
                .filter(|r| r.layer == layer)
                .map(|r| r.kernel.as_str())
                .collect()
        };
        assert!(by("conv1").iter().all(|k| k.starts_with("conv2_")));
        assert_eq!(
            by("layer2.0.conv2"),
            [
                conv3::FWD_3X3_KERNEL,
                conv3::DGRAD_3X3_KERNEL,
                conv3::WGRAD_3X3_KERNEL
            ]
        );
        // layer1's 64-channel 3×3: the 64-column tiles for its forward and data gradient
        // (N = 64), the 64-row ones for its weight gradient (M = 64, N = 9 × 64); its 1×1 of
        // 256 → 64 channels likewise.
        assert_eq!(
            by("layer1.0.conv2"),
            [
                "conv3_fwd_3x3_n64",
                "conv3_dgrad_3x3_n64",
                conv3::WGRAD_3X3_M64_KERNEL
            ]
        );
        assert_eq!(by("layer1.1.conv1")[2], conv3::WGRAD_M64_KERNEL);
        for layer in [
            "layer2.0.downsample.0",
            "layer3.0.downsample.0",
            "layer4.0.downsample.0",
        ] {
            assert_eq!(
                by(layer),
                [
                    conv3::FWD_3X3_KERNEL,
                    conv3::DGRAD_KERNEL,
                    conv3::WGRAD_3X3_KERNEL
                ],
                "{layer}"
            );
        }
        let scattered = v3
            .iter()
            .find(|r| r.layer == "layer2.0.downsample.0" && r.pass == "dgrad")
            .unwrap();
        assert_eq!(scattered.gemm, (256 * 28 * 28, 256, 512), "dy's pixels");
        let phased = v3
            .iter()
            .find(|r| r.layer == "layer2.0.conv2" && r.pass == "dgrad")
            .unwrap();
        assert_eq!(
            phased.blocks,
            4 * 256 * 28 * 28 / 128,
            "four phases of dy's pixels"
        );
        let m64: Vec<_> = v3.iter().filter(|r| r.kernel.ends_with("_m64")).collect();
        assert_eq!(m64.len(), 5, "layer1's three 3×3 and two 256 → 64 1×1");
        for r in m64 {
            assert_eq!(r.gemm.0, 64, "{r:?}");
            assert!(r.flops / r.launched_flops > 0.85, "{r:?}");
        }
        assert_eq!(
            by("layer3.1.conv2"),
            [
                conv3::FWD_3X3_KERNEL,
                conv3::DGRAD_3X3_KERNEL,
                conv3::WGRAD_3X3_KERNEL
            ]
        );
    }
}
