//! `birdtrain bench step --plan`: the step model of the v2 convolutions, without a GPU.
//!
//! For every convolution of the model and each of its passes (forward, dgrad, wgrad; the stem
//! has no dgrad: the image needs no gradient) it prints the GEMM the pass is, its FLOPs and
//! bytes, and what src/cuda/conv.rs would launch on an H100: kernel, tile, blocks, waves, the
//! fill of the last wave and the tile area spent on padding. The summary's efficiency is the
//! useful FLOPs over the FLOPs of every launched wave (whole tiles, whole waves), so wave
//! tails and padded tiles show as the step time they cost.

use serde::Serialize;

use crate::backend::ConvShape;
use crate::cuda::conv::{self, GpuLimits, Pass};
use crate::model::{Arch, Graph, Node};

/// One pass of one convolution in the plan.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PlanRow {
    /// The weight's torchvision name, without `.weight`.
    pub layer: String,
    /// fwd, dgrad or wgrad.
    pub pass: &'static str,
    /// The v2 kernel, or `v1:<why>` where v2 does not take the shape.
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

/// Every convolution pass of `arch` at `batch` images of `image_size` pixels on `gpu`.
pub fn conv_plan(arch: Arch, batch: usize, image_size: u32, gpu: &GpuLimits) -> Vec<PlanRow> {
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
            rows.push(row(&layer, pass, &s, gpu));
        }
    }
    rows
}

fn row(layer: &str, pass: Pass, s: &ConvShape, gpu: &GpuLimits) -> PlanRow {
    let bf16 = 2.0;
    let bytes = match pass {
        Pass::Forward | Pass::Dgrad => bf16 * (s.x_len() + s.w_len() + s.y_len()) as f64,
        Pass::Wgrad => bf16 * (s.x_len() + s.y_len()) as f64 + 4.0 * s.w_len() as f64,
    };
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

/// Prints the plan as a table with a summary line.
pub fn print(model: &str, batch: usize, image_size: u32, rows: &[PlanRow]) {
    let gpu = GpuLimits::H100;
    outln!(
        "{model} batch {batch} at {image_size}px, v2 convolutions modelled on an H100 ({} SMs, {} KiB shared memory each)",
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
        let rows = conv_plan(Arch::ResNet50, 256, 224, &GpuLimits::H100);
        // 53 convolutions × 3 passes, less the stem's dgrad.
        assert_eq!(rows.len(), 53 * 3 - 1);
        assert!(
            rows.iter().all(|r| r.kernel.starts_with("conv2_")),
            "{rows:?}"
        );
        let stem: Vec<_> = rows.iter().filter(|r| r.layer == "conv1").collect();
        assert_eq!(stem.len(), 2);
        assert_eq!(stem[1].kernel, "conv2_wgrad_c8_64x128");
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
}
