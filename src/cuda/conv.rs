//! Convolution dispatch for the CUDA backend: which generation runs (v1, kernels/conv.cu, or
//! v2, kernels/conv2.cu, chosen by `BIRDTRAIN_CONV`), and for v2 which kernel, tile shape,
//! grid, reduction split and shared memory each layer gets, from a wave model of the GPU.
//!
//! Everything here is planning without a device, so the rule is unit-tested and
//! `birdtrain bench step --plan` prints the same choices the backend makes.
//!
//! The wave model: a launch of B blocks on S SMs holding b blocks each runs in
//! ceil(B / (b·S)) waves, each as long as b tiles' work (BM·BN per k-step: the resident blocks
//! share the SM's tensor cores). A shape is chosen
//! to minimise waves × tile work, so a grid that leaves most of its last wave empty takes the
//! smaller tiles; layers whose GEMM N (forward, dgrad) or M (wgrad) is at most 64 always take
//! the 64-wide tiles, since a 128-wide tile would be half padding.

use crate::backend::ConvShape;
use cudarc::driver::DeviceRepr;

use super::arch::GpuArch;
use super::CudaError;

/// The environment variable that selects the convolution kernels (`v1`, `v2` or `v3`).
pub const CONV_ENV: &str = "BIRDTRAIN_CONV";

/// Which generation of convolution kernels the backend launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConvVersion {
    /// kernels/conv.cu: register-blocked implicit GEMM, one barrier pair per k-step.
    V1,
    /// kernels/conv2.cu: cp.async pipeline, per-layer tiles, phased dgrad, split wgrad.
    V2,
    /// kernels/conv3.cu on Hopper (compute capability 9.0): 1×1 convolutions at stride 1 as
    /// `wgmma` GEMMs fed by TMA; every other layer (and every layer on another GPU) as v2.
    V3,
}

impl ConvVersion {
    /// The kernels a GPU of `arch` runs unless `BIRDTRAIN_CONV` says otherwise: v3 on Hopper,
    /// where resnet50's step took 53.46 ms against v2's 60.85 ms and resnet18's 17.90 against
    /// 22.95 (H100, 2026-11-27, docs/performance.md), and v2 elsewhere.
    pub fn default_for(arch: GpuArch) -> ConvVersion {
        if arch.is_hopper() {
            ConvVersion::V3
        } else {
            ConvVersion::V2
        }
    }

    /// Parses the value of `BIRDTRAIN_CONV` for a GPU of `arch` (unset:
    /// [`ConvVersion::default_for`]).
    pub fn parse(value: Option<&str>, arch: GpuArch) -> Result<ConvVersion, CudaError> {
        match value.map(str::trim) {
            None | Some("") => Ok(ConvVersion::default_for(arch)),
            Some("v1") => Ok(ConvVersion::V1),
            Some("v2") => Ok(ConvVersion::V2),
            Some("v3") => Ok(ConvVersion::V3),
            Some(other) => Err(CudaError::Unsupported {
                what: format!(
                    "{CONV_ENV}={other:?}: expected v1, v2 or v3 (unset means v3 on Hopper, v2 elsewhere)"
                ),
            }),
        }
    }

    /// The name `BIRDTRAIN_CONV` gives it: `v1`, `v2` or `v3`.
    pub fn name(self) -> &'static str {
        match self {
            ConvVersion::V1 => "v1",
            ConvVersion::V2 => "v2",
            ConvVersion::V3 => "v3",
        }
    }

    /// What runs on a GPU of `arch`: v3 where it runs at all (Hopper), v2 in its place
    /// elsewhere.
    pub fn on(self, arch: GpuArch) -> ConvVersion {
        if self == ConvVersion::V3 && !arch.is_hopper() {
            ConvVersion::V2
        } else {
            self
        }
    }

    /// The version the environment selects for a GPU of `arch`.
    pub fn from_env(arch: GpuArch) -> Result<ConvVersion, CudaError> {
        ConvVersion::parse(std::env::var(CONV_ENV).ok().as_deref(), arch)
    }
}

/// Kernel-side mirror of `struct Conv2Args` in kernels/conv2.cu (18 ints, C layout).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv2Args {
    /// Batch.
    pub n: i32,
    /// Input height.
    pub h: i32,
    /// Input width.
    pub w: i32,
    /// Input channels as stored (a multiple of 8).
    pub c: i32,
    /// Output channels (a multiple of 8).
    pub k: i32,
    /// Filter height.
    pub r: i32,
    /// Filter width.
    pub s: i32,
    /// Output height.
    pub p: i32,
    /// Output width.
    pub q: i32,
    /// Stride along the rows (and the columns, unless paired; dgrad: both).
    pub stride: i32,
    /// Padding along the rows (and the columns, unless paired; dgrad: both).
    pub pad: i32,
    /// Stride along the columns of the GEMM's pixels (the paired stem: 1 pair).
    pub stride_w: i32,
    /// Padding along the columns of the GEMM's pixels (the paired stem: in pairs).
    pub pad_w: i32,
    /// wgrad: channels of dw (3 for the stem), `c` otherwise.
    pub c_real: i32,
    /// wgrad: filter width of dw (the paired stem: 7 where `s` counts 4 pairs), `s` otherwise.
    pub s_real: i32,
    /// wgrad, the paired stem: pixel slots of the first pair before filter column 0
    /// (padding % 2); -1 when not paired.
    pub pair_lead: i32,
    /// wgrad: reduction pixels per gridDim.z slice (a multiple of 32).
    pub k_chunk: i32,
    /// dgrad: add into dx instead of overwriting.
    pub accumulate: i32,
}

// SAFETY: plain-old-data with the C layout the kernel declares.
unsafe impl DeviceRepr for Conv2Args {}

/// One of the three passes of a convolution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// y = conv(x, w).
    Forward,
    /// dx (= or +=) conv_transpose(dy, w), split into stride² phases.
    Dgrad,
    /// dw = Σ dy ⊗ x, the reduction split over gridDim.z.
    Wgrad,
}

impl Pass {
    /// Short name used in kernel names and plans.
    pub fn name(self) -> &'static str {
        match self {
            Pass::Forward => "fwd",
            Pass::Dgrad => "dgrad",
            Pass::Wgrad => "wgrad",
        }
    }
}

/// The v2 tile shapes (kernels/conv2.cu, `Tile<...>`): every warp owns 64×32 of the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Conv2Tile {
    /// 8 warps, 4 stages.
    T128x128,
    /// 4 warps, 4 stages (forward, dgrad with N ≤ 64 or a ragged last wave).
    T128x64,
    /// 4 warps, 4 stages (wgrad, whose M is K).
    T64x128,
}

/// Pipeline depth of every tile shape (`STAGES` in kernels/conv2.cu).
const STAGES: usize = 4;
/// Reduction columns per k-step (`BK`).
const BK: usize = 32;
/// Row padding of shared-memory tiles in elements (`SKEW`).
const SKEW: usize = 8;
/// Filter taps the kernel's tap table holds (`MAX_TAPS`).
const MAX_TAPS: usize = 128 - (4 + 1) * BK / 8;

impl Conv2Tile {
    /// (BM, BN).
    pub fn dims(self) -> (usize, usize) {
        match self {
            Conv2Tile::T128x128 => (128, 128),
            Conv2Tile::T128x64 => (128, 64),
            Conv2Tile::T64x128 => (64, 128),
        }
    }

    /// Threads per block.
    pub fn threads(self) -> u32 {
        match self {
            Conv2Tile::T128x128 => 256,
            _ => 128,
        }
    }

    /// Blocks per SM the kernel's `__launch_bounds__` asks for.
    fn min_blocks(self) -> usize {
        match self {
            Conv2Tile::T128x128 => 2,
            _ => 3,
        }
    }

    /// Kernel-name suffix.
    pub fn suffix(self) -> &'static str {
        match self {
            Conv2Tile::T128x128 => "128x128",
            Conv2Tile::T128x64 => "128x64",
            Conv2Tile::T64x128 => "64x128",
        }
    }

    /// Dynamic shared memory of `pass` with this tile: STAGES × (A + B tiles), or the bf16
    /// output staging of the epilogue and the batch-norm epilogues' reduction scratch behind
    /// it (four floats per thread) if larger (they reuse the same bytes).
    pub fn smem_bytes(self, pass: Pass) -> usize {
        let (bm, bn) = self.dims();
        let a = match pass {
            Pass::Wgrad => BK * (bm + SKEW),
            _ => bm * (BK + SKEW),
        };
        let b = match pass {
            Pass::Forward => bn * (BK + SKEW),
            _ => BK * (bn + SKEW),
        };
        let epilogue = match pass {
            Pass::Wgrad => 0,
            _ => bm * (bn + SKEW) * 2 + 4 * self.threads() as usize * 4,
        };
        (STAGES * (a + b) * 2).max(epilogue)
    }

    /// Bytes of the pipeline stages of `pass` (STAGES × (A + B tiles)): where the APPLY
    /// kernels' extra shared memory begins.
    fn stage_bytes(self, pass: Pass) -> usize {
        let (bm, bn) = self.dims();
        let a = match pass {
            Pass::Wgrad => BK * (bm + SKEW),
            _ => bm * (BK + SKEW),
        };
        let b = match pass {
            Pass::Forward => bn * (BK + SKEW),
            _ => BK * (bn + SKEW),
        };
        STAGES * (a + b) * 2
    }

    /// Dynamic shared memory of an APPLY kernel (kernels/conv2.cu, `AppliedBn`) of `pass` with
    /// this tile on `channels` input channels: the stages, then a word per stage and thread
    /// (what each thread copied), wgrad a word per B chunk and thread (the small-C gather's
    /// channels), then the batch norm's parameters as four f32 planes of `channels`.
    pub fn apply_smem_bytes(self, pass: Pass, channels: usize) -> usize {
        let threads = self.threads() as usize;
        let chans = match pass {
            Pass::Wgrad => self.dims().1 * BK / 8 * 4,
            _ => 0,
        };
        self.stage_bytes(pass) + STAGES * threads * 4 + chans + 16 * channels
    }

    /// Static shared memory (row table and tap table) plus the 1 KiB the driver reserves.
    fn static_smem(self) -> usize {
        self.dims().0 * 4 + 128 * 8 + 1024
    }

    /// Resident blocks per SM: the launch bound, or fewer where shared memory runs out.
    pub fn blocks_per_sm(self, pass: Pass, gpu: &GpuLimits) -> usize {
        let per_block = self.smem_bytes(pass) + self.static_smem();
        (gpu.smem_per_sm / per_block).clamp(1, self.min_blocks())
    }
}

/// The kernel family's gather (kernels/conv2.cu: GENERAL, UNIT, SMALL_C).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gather {
    /// Any filter, through the tap table.
    General,
    /// 1×1 without padding: plain GEMM rows (strided at stride 2).
    Unit,
    /// wgrad with C % 32 != 0 (the padded stem, 8- and 16-channel layers).
    SmallC,
}

/// How a v2 launch reads a stem's few input channels (kernels/conv2.cu, "The stem").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StemCopy {
    /// A multiple of 8 channels: x and w as they are.
    None,
    /// Fewer than 8 channels at a stride other than 2: x and w padded to 8 channels with
    /// zeros (`conv2_pad_channels`).
    PadChannels,
    /// At most 4 channels at stride 2 (resnet's 7×7 on RGB): x and w as pairs of
    /// horizontally adjacent pixels of 4 channels, 16 bytes a pair (`conv2_pair_pixels`).
    Pairs,
}

impl StemCopy {
    /// The copy a shape's input needs (whether or not v2 takes the shape).
    pub fn of(s: &ConvShape) -> StemCopy {
        if s.c_in % 8 == 0 {
            StemCopy::None
        } else if s.c_in <= 4 && s.stride == 2 {
            StemCopy::Pairs
        } else {
            StemCopy::PadChannels
        }
    }

    /// Pixel slots of a pair before filter column 0: the padding's parity (the first
    /// input column an output reads is then the second pixel of its pair).
    pub fn pair_lead(s: &ConvShape) -> usize {
        s.padding % 2
    }

    /// Pairs in a filter row: (S + lead + 1) / 2.
    pub fn filter_pairs(s: &ConvShape) -> usize {
        (s.kernel + Self::pair_lead(s)).div_ceil(2)
    }

    /// (width, channels, filter width) of the stored copy as the GEMM sees it.
    fn gemm_view(self, s: &ConvShape) -> (usize, usize, usize) {
        match self {
            StemCopy::None => (s.w, s.c_in, s.kernel),
            StemCopy::PadChannels => (s.w, 8, s.kernel),
            StemCopy::Pairs => (s.w.div_ceil(2), 8, Self::filter_pairs(s)),
        }
    }

    /// bf16 elements of the copy of x (0 when none is made).
    pub fn input_len(self, s: &ConvShape) -> usize {
        let (w, c, _) = self.gemm_view(s);
        match self {
            StemCopy::None => 0,
            _ => s.n * s.h * w * c,
        }
    }

    /// bf16 elements of the copy of the weight (0 when none is made).
    pub fn weight_len(self, s: &ConvShape) -> usize {
        let (_, c, taps) = self.gemm_view(s);
        match self {
            StemCopy::None => 0,
            _ => s.c_out * s.kernel * taps * c,
        }
    }
}

/// What a GPU offers the wave model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuLimits {
    /// Streaming multiprocessors.
    pub sms: usize,
    /// Shared memory per SM in bytes.
    pub smem_per_sm: usize,
}

impl GpuLimits {
    /// An H100 SXM: 132 SMs, 228 KiB of shared memory each.
    pub const H100: GpuLimits = GpuLimits {
        sms: 132,
        smem_per_sm: 228 * 1024,
    };
}

/// One v2 launch, as the backend issues it.
#[derive(Debug, Clone, PartialEq)]
pub struct Conv2Launch {
    /// The pass.
    pub pass: Pass,
    /// Kernel name in kernels/conv2.cu.
    pub kernel: &'static str,
    /// Tile shape.
    pub tile: Conv2Tile,
    /// Gather.
    pub gather: Gather,
    /// GEMM dimensions (M, N, reduction) of the whole pass (dgrad: of its largest phase for M).
    pub gemm: (usize, usize, usize),
    /// Grid (x, y, z): z = wgrad splits or dgrad phases.
    pub grid: (u32, u32, u32),
    /// Dynamic shared memory in bytes.
    pub smem_bytes: u32,
    /// The kernel arguments (k_chunk set; accumulate left 0).
    pub args: Conv2Args,
    /// How x and w must first be copied (the stem's few channels), if at all.
    pub stem: StemCopy,
    /// dgrad: whether the weight must be rearranged per phase first (all but 1×1).
    pub rearrange_weight: bool,
    /// Blocks per SM the tile allows.
    pub blocks_per_sm: usize,
}

impl Conv2Launch {
    /// Blocks in the grid.
    pub fn blocks(&self) -> usize {
        self.grid.0 as usize * self.grid.1 as usize * self.grid.2 as usize
    }

    /// Waves of the grid on `gpu` (fractional: 2.5 means the third wave is half full).
    pub fn waves(&self, gpu: &GpuLimits) -> f64 {
        self.blocks() as f64 / (self.blocks_per_sm * gpu.sms) as f64
    }

    /// Fraction of the tiles' GEMM area outside the real M×N (padding in the tails).
    pub fn padded_fraction(&self) -> f64 {
        let (bm, bn) = self.tile.dims();
        let (m, n, _) = self.gemm;
        let area = (m.div_ceil(bm) * bm * n.div_ceil(bn) * bn) as f64;
        1.0 - (m * n) as f64 / area
    }
}

/// Every GEMM kernel of kernels/conv2.cu the planner can name (all take `(a, b, out, args)`).
pub const V2_GEMM_KERNELS: &[&str] = &[
    "conv2_fwd_128x128",
    "conv2_fwd_128x64",
    "conv2_fwd_1x1_128x128",
    "conv2_fwd_1x1_128x64",
    "conv2_dgrad_128x128",
    "conv2_dgrad_128x64",
    "conv2_dgrad_1x1_128x128",
    "conv2_dgrad_1x1_128x64",
    "conv2_wgrad_128x128",
    "conv2_wgrad_64x128",
    "conv2_wgrad_c8_64x128",
    "conv2_wgrad_1x1_128x128",
    "conv2_wgrad_1x1_64x128",
];

/// The GEMM kernels of kernels/conv2.cu with a batch-norm epilogue (`BIRDTRAIN_BN_FUSION`):
/// forward ones that also write the tile statistics of y (`(x, w, y, args, part)`), dgrad ones
/// that finish the gradient of the batch norm before the convolution and write its tile sums
/// (`(dy, wt, dx, args, part, bn_y, bn_x, mean, invstd, residual)`). Same tiles and gathers as
/// the plain kernels, so [`Conv2Launch::bn_epilogue_kernel`] maps one onto the other.
pub const V2_BN_EPILOGUE_KERNELS: &[&str] = &[
    "conv2_fwd_stats_128x128",
    "conv2_fwd_stats_128x64",
    "conv2_fwd_stats_1x1_128x128",
    "conv2_fwd_stats_1x1_128x64",
    "conv2_dgrad_bn_128x128",
    "conv2_dgrad_bn_128x64",
    "conv2_dgrad_bn_1x1_128x128",
    "conv2_dgrad_bn_1x1_128x64",
];

/// The GEMM kernels of kernels/conv2.cu that apply a batch norm to the gathered input as they
/// load it (the input is the batch norm's input z; see `AppliedBn` there): forward ones
/// (`(z, w, y, args, mean, invstd, gamma, beta, relu)`), forward ones with the statistics
/// epilogue (`(z, w, y, args, part, mean, …)`) and weight-gradient ones
/// (`(dy, z, dw, args, mean, …)`). Same tiles and gathers as the plain kernels, so
/// [`Conv2Launch::apply_kernel`] maps one onto the other.
pub const V2_APPLY_KERNELS: &[&str] = &[
    "conv2_fwd_apply_128x128",
    "conv2_fwd_apply_128x64",
    "conv2_fwd_apply_1x1_128x128",
    "conv2_fwd_apply_1x1_128x64",
    "conv2_fwd_stats_apply_128x128",
    "conv2_fwd_stats_apply_128x64",
    "conv2_fwd_stats_apply_1x1_128x128",
    "conv2_fwd_stats_apply_1x1_128x64",
    "conv2_wgrad_apply_128x128",
    "conv2_wgrad_apply_64x128",
    "conv2_wgrad_apply_c8_64x128",
    "conv2_wgrad_apply_1x1_128x128",
    "conv2_wgrad_apply_1x1_64x128",
];

impl Conv2Launch {
    /// The kernel of this launch's tile and gather that applies a batch norm to its input as
    /// it loads it: forward `conv2_fwd_apply_*` (with `stats`: `conv2_fwd_stats_apply_*`),
    /// wgrad `conv2_wgrad_apply_*`; `None` for dgrad (its input dy is no batch norm's output),
    /// for wgrad with `stats`, and for the stem (its input is the image).
    pub fn apply_kernel(&self, stats: bool) -> Option<&'static str> {
        if self.stem != StemCopy::None {
            return None;
        }
        let (plain, infix) = match (self.pass, stats) {
            (Pass::Forward, false) => ("conv2_fwd_", "conv2_fwd_apply_"),
            (Pass::Forward, true) => ("conv2_fwd_", "conv2_fwd_stats_apply_"),
            (Pass::Wgrad, false) => ("conv2_wgrad_", "conv2_wgrad_apply_"),
            _ => return None,
        };
        let name = format!("{infix}{}", self.kernel.strip_prefix(plain)?);
        V2_APPLY_KERNELS.iter().copied().find(|k| *k == name)
    }

    /// Dynamic shared memory of this launch's [`Conv2Launch::apply_kernel`]
    /// ([`Conv2Tile::apply_smem_bytes`] on its input channels).
    pub fn apply_smem_bytes(&self) -> u32 {
        self.tile.apply_smem_bytes(self.pass, self.args.c as usize) as u32
    }

    /// The kernel with the batch-norm epilogue for this launch (forward: `conv2_fwd_stats_*`,
    /// dgrad: `conv2_dgrad_bn_*`, same tile and gather); `None` for wgrad, which has none.
    pub fn bn_epilogue_kernel(&self) -> Option<&'static str> {
        let (plain, infix) = match self.pass {
            Pass::Forward => ("conv2_fwd_", "conv2_fwd_stats_"),
            Pass::Dgrad => ("conv2_dgrad_", "conv2_dgrad_bn_"),
            Pass::Wgrad => return None,
        };
        let name = format!("{infix}{}", self.kernel.strip_prefix(plain)?);
        V2_BN_EPILOGUE_KERNELS.iter().copied().find(|k| *k == name)
    }
}

fn kernel_name(pass: Pass, gather: Gather, tile: Conv2Tile) -> &'static str {
    let infix = match gather {
        Gather::General => "",
        Gather::Unit => "1x1_",
        Gather::SmallC => "c8_",
    };
    let name = format!("conv2_{}_{infix}{}", pass.name(), tile.suffix());
    V2_GEMM_KERNELS
        .iter()
        .copied()
        .find(|k| *k == name)
        .expect("the planner names only kernels of conv2.cu")
}

/// Modelled time of `blocks` tiles of `work` each: whole waves × the work one SM does per
/// wave (its resident blocks share its tensor cores).
fn wave_cost(blocks: usize, per_sm: usize, gpu: &GpuLimits, work: usize) -> usize {
    blocks.div_ceil(per_sm * gpu.sms) * per_sm * work
}

/// wgrad's reduction split: the slice count (at most four waves' worth of blocks, slices of at
/// least 256 pixels unless the reduction is shorter) minimising waves × slice length, ties to
/// fewer slices (each slice stores an M×N f32 plane that conv2_wgrad_reduce reads back).
/// Returns (splits, k_chunk).
pub fn wgrad_splits(tiles: usize, reduction: usize, slots: usize) -> (usize, usize) {
    let tiles = tiles.max(1);
    let max = reduction
        .div_ceil(256)
        .min(4 * slots.div_ceil(tiles))
        .max(1);
    let mut best = (usize::MAX, 1, reduction.div_ceil(BK) * BK);
    for s in 1..=max {
        let chunk = reduction.div_ceil(s).div_ceil(BK) * BK;
        let splits = reduction.div_ceil(chunk);
        let cost = (tiles * splits).div_ceil(slots) * chunk;
        if cost < best.0 {
            best = (cost, splits, chunk);
        }
    }
    (best.1, best.2)
}

fn to_i32(v: usize, what: &str) -> Result<i32, String> {
    i32::try_from(v).map_err(|_| format!("{what} = {v} exceeds the kernels' 32-bit indices"))
}

/// The v2 launch of `pass` for shape `s`, or why v2 cannot take it (then v1 runs).
pub fn plan(pass: Pass, s: &ConvShape, gpu: &GpuLimits) -> Result<Conv2Launch, String> {
    if s.c_out % 8 != 0 {
        return Err(format!(
            "{} output channels (v2 needs a multiple of 8)",
            s.c_out
        ));
    }
    let stem = StemCopy::of(s);
    if stem != StemCopy::None && (pass == Pass::Dgrad || s.c_in > 8) {
        return Err(format!(
            "{} input channels (v2 pads only up to 8, and not in dgrad)",
            s.c_in
        ));
    }
    if s.kernel > 15 || s.kernel * s.kernel > MAX_TAPS || s.padding >= s.kernel {
        return Err(format!(
            "{}×{} filter with padding {}",
            s.kernel, s.kernel, s.padding
        ));
    }
    // The GEMM's view of x: the paired stem's pixels are pairs of 8 channels, its filter
    // columns pairs, its column stride one pair (kernels/conv2.cu, "The stem").
    let (w, c, taps_w) = stem.gemm_view(s);
    let (stride_w, pad_w, lead) = match stem {
        StemCopy::Pairs => {
            let lead = StemCopy::pair_lead(s);
            (1, (s.padding + lead) / 2, lead as i32)
        }
        _ => (s.stride, s.padding, -1),
    };
    let (p, q) = (s.out_h(), s.out_w());
    let x_elems = s.n * s.h * w * c;
    to_i32(x_elems, "input elements")?;
    to_i32(s.y_len(), "output elements")?;
    let unit = s.kernel == 1 && s.padding == 0;
    let args = Conv2Args {
        n: to_i32(s.n, "n")?,
        h: to_i32(s.h, "h")?,
        w: to_i32(w, "w")?,
        c: to_i32(c, "c")?,
        k: to_i32(s.c_out, "k")?,
        r: to_i32(s.kernel, "kernel")?,
        s: to_i32(taps_w, "kernel")?,
        p: to_i32(p, "p")?,
        q: to_i32(q, "q")?,
        stride: to_i32(s.stride, "stride")?,
        pad: to_i32(s.padding, "padding")?,
        stride_w: to_i32(stride_w, "stride")?,
        pad_w: to_i32(pad_w, "padding")?,
        c_real: to_i32(s.c_in, "c_in")?,
        s_real: to_i32(s.kernel, "kernel")?,
        pair_lead: lead,
        k_chunk: 0,
        accumulate: 0,
    };
    let pixels_out = s.n * p * q;
    let (m, n, red, z, gather) = match pass {
        Pass::Forward => (
            pixels_out,
            s.c_out,
            s.kernel * taps_w * c,
            1,
            if unit { Gather::Unit } else { Gather::General },
        ),
        Pass::Dgrad => {
            let (hn, wn) = (s.h.div_ceil(s.stride), s.w.div_ceil(s.stride));
            let taps = s.kernel.div_ceil(s.stride).pow(2);
            let gather = if unit { Gather::Unit } else { Gather::General };
            (
                s.n * hn * wn,
                c,
                taps * s.c_out,
                s.stride * s.stride,
                gather,
            )
        }
        Pass::Wgrad => {
            let gather = if c % 32 != 0 {
                Gather::SmallC
            } else if unit && s.stride == 1 {
                Gather::Unit
            } else {
                Gather::General
            };
            (s.c_out, s.kernel * taps_w * c, pixels_out, 1, gather)
        }
    };
    let (wide, narrow) = match pass {
        Pass::Wgrad => (Conv2Tile::T128x128, Conv2Tile::T64x128),
        _ => (Conv2Tile::T128x128, Conv2Tile::T128x64),
    };
    // The small-C wgrad exists only in the narrow shape.
    let narrow_dim = if pass == Pass::Wgrad { m } else { n };
    let candidates: &[Conv2Tile] = if narrow_dim <= 64 || gather == Gather::SmallC {
        &[narrow]
    } else {
        &[wide, narrow]
    };
    let mut best: Option<(usize, Conv2Launch)> = None;
    for &tile in candidates {
        let (bm, bn) = tile.dims();
        let per_sm = tile.blocks_per_sm(pass, gpu);
        let tiles = m.div_ceil(bm) * n.div_ceil(bn);
        let (z, chunk) = match pass {
            Pass::Wgrad => wgrad_splits(tiles, red, per_sm * gpu.sms),
            _ => (z, 0),
        };
        let k_steps = if pass == Pass::Wgrad { chunk } else { red }.div_ceil(BK);
        let cost = wave_cost(tiles * z, per_sm, gpu, bm * bn * k_steps.max(1));
        let launch = Conv2Launch {
            pass,
            kernel: kernel_name(pass, gather, tile),
            tile,
            gather,
            gemm: (m, n, red),
            grid: (
                to_i32(m.div_ceil(bm), "grid x")? as u32,
                to_i32(n.div_ceil(bn), "grid y")? as u32,
                to_i32(z, "grid z")? as u32,
            ),
            smem_bytes: tile.smem_bytes(pass) as u32,
            args: Conv2Args {
                k_chunk: to_i32(chunk, "k_chunk")?,
                ..args
            },
            stem,
            rearrange_weight: pass == Pass::Dgrad && !unit,
            blocks_per_sm: per_sm,
        };
        if best.as_ref().is_none_or(|(c, _)| cost < *c) {
            best = Some((cost, launch));
        }
    }
    Ok(best.expect("at least one candidate").1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::sources::KernelFile;

    fn shape(n: usize, hw: usize, c_in: usize, c_out: usize, k: usize, stride: usize) -> ConvShape {
        ConvShape {
            n,
            h: hw,
            w: hw,
            c_in,
            c_out,
            kernel: k,
            stride,
            padding: k / 2,
        }
    }

    #[test]
    fn version_parses_and_rejects_with_the_variable_named() {
        let (hopper, ampere) = (GpuArch::new(9, 0), GpuArch::new(8, 0));
        assert_eq!(ConvVersion::parse(None, hopper).unwrap(), ConvVersion::V3);
        assert_eq!(
            ConvVersion::parse(Some(""), hopper).unwrap(),
            ConvVersion::V3
        );
        assert_eq!(ConvVersion::parse(None, ampere).unwrap(), ConvVersion::V2);
        assert_eq!(
            ConvVersion::parse(None, GpuArch::new(10, 0)).unwrap(),
            ConvVersion::V2
        );
        for arch in [hopper, ampere] {
            assert_eq!(
                ConvVersion::parse(Some("v1"), arch).unwrap(),
                ConvVersion::V1
            );
            assert_eq!(
                ConvVersion::parse(Some(" v2 "), arch).unwrap(),
                ConvVersion::V2
            );
            assert_eq!(
                ConvVersion::parse(Some("v3"), arch).unwrap(),
                ConvVersion::V3
            );
        }
        assert_eq!(ConvVersion::V3.on(ampere), ConvVersion::V2);
        assert_eq!(ConvVersion::V3.on(hopper).name(), "v3");
        assert_eq!(ConvVersion::V1.on(ampere).name(), "v1");
        let e = ConvVersion::parse(Some("v4"), hopper)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("BIRDTRAIN_CONV=\"v4\"") && e.contains("v1, v2 or v3"),
            "{e}"
        );
    }

    /// Kernel `k`'s declaration in `text`, from its name to the closing parenthesis.
    fn signature<'a>(text: &'a str, k: &str) -> &'a str {
        let at = text.find(&format!("\n{k}(")).expect("kernel signature");
        &text[at..at + text[at..].find(')').unwrap()]
    }

    #[test]
    fn every_named_kernel_exists_and_takes_four_arguments() {
        let file = KernelFile::by_name("conv2.cu").unwrap();
        let names = file.kernel_names();
        for k in V2_GEMM_KERNELS {
            assert!(names.iter().any(|n| n == k), "{k} missing from conv2.cu");
            let sig = signature(file.text, k);
            assert_eq!(sig.split(',').count(), 4, "{sig}");
        }
    }

    #[test]
    fn every_bn_epilogue_kernel_exists_with_its_arguments_and_pairs_with_a_plain_one() {
        let file = KernelFile::by_name("conv2.cu").unwrap();
        let names = file.kernel_names();
        for k in V2_BN_EPILOGUE_KERNELS {
            assert!(names.iter().any(|n| n == k), "{k} missing from conv2.cu");
            let sig = signature(file.text, k);
            let want = if k.starts_with("conv2_fwd") { 5 } else { 13 };
            assert_eq!(sig.split(',').count(), want, "{sig}");
        }
        let gpu = GpuLimits::H100;
        let mut mapped = Vec::new();
        for (pass, s) in [
            (Pass::Forward, shape(256, 56, 64, 64, 3, 1)),
            (Pass::Forward, shape(256, 14, 256, 256, 3, 1)),
            (Pass::Dgrad, shape(256, 56, 64, 64, 3, 1)),
            (Pass::Dgrad, shape(256, 14, 256, 256, 3, 1)),
        ] {
            for s in [
                s,
                ConvShape {
                    kernel: 1,
                    padding: 0,
                    ..s
                },
            ] {
                let l = plan(pass, &s, &gpu).unwrap();
                let fused = l.bn_epilogue_kernel().unwrap();
                assert_eq!(
                    fused.replace("_stats", "").replace("_bn", ""),
                    l.kernel,
                    "{fused} is not {}'s epilogue form",
                    l.kernel
                );
                mapped.push(fused);
            }
        }
        mapped.sort();
        mapped.dedup();
        assert_eq!(mapped.len(), V2_BN_EPILOGUE_KERNELS.len(), "{mapped:?}");
        let w = plan(Pass::Wgrad, &shape(256, 56, 64, 64, 3, 1), &gpu).unwrap();
        assert_eq!(w.bn_epilogue_kernel(), None);
    }

    #[test]
    fn every_apply_kernel_exists_with_its_arguments_and_pairs_with_a_plain_one() {
        let file = KernelFile::by_name("conv2.cu").unwrap();
        let names = file.kernel_names();
        for k in V2_APPLY_KERNELS {
            assert!(names.iter().any(|n| n == k), "{k} missing from conv2.cu");
            let sig = signature(file.text, k);
            let want = if k.starts_with("conv2_fwd_stats") {
                10
            } else {
                9
            };
            assert_eq!(sig.split(',').count(), want, "{sig}");
        }
        let gpu = GpuLimits::H100;
        let mut mapped = Vec::new();
        // Forward: 3×3 and 1×1 in both tile widths; wgrad: every gather in both tile heights.
        let shapes = [
            shape(256, 56, 64, 64, 3, 1),
            shape(256, 14, 256, 256, 3, 1),
            shape(256, 56, 64, 256, 1, 1),
            shape(256, 28, 512, 128, 1, 1),
            shape(256, 28, 16, 32, 3, 1),
            shape(64, 14, 1024, 512, 1, 2),
            shape(64, 7, 512, 512, 3, 1),
            shape(256, 28, 128, 512, 3, 2),
            shape(8, 56, 64, 256, 3, 1),
        ];
        for s in shapes.iter().flat_map(|s| {
            [
                *s,
                ConvShape {
                    kernel: 1,
                    padding: 0,
                    ..*s
                },
            ]
        }) {
            for pass in [Pass::Forward, Pass::Wgrad] {
                let l = plan(pass, &s, &gpu).unwrap();
                for stats in [false, true] {
                    let Some(applied) = l.apply_kernel(stats) else {
                        assert!(pass == Pass::Wgrad && stats, "{l:?}");
                        continue;
                    };
                    assert_eq!(
                        applied.replace("_stats", "").replace("_apply", ""),
                        l.kernel,
                        "{applied} is not {}'s applying form",
                        l.kernel
                    );
                    mapped.push(applied);
                }
            }
            let d = plan(Pass::Dgrad, &s, &gpu).unwrap();
            assert_eq!(d.apply_kernel(false), None);
        }
        mapped.sort();
        mapped.dedup();
        assert_eq!(mapped.len(), V2_APPLY_KERNELS.len(), "{mapped:?}");
        // The stem reads the image: nothing to apply.
        let stem = plan(Pass::Forward, &shape(8, 32, 3, 64, 7, 2), &gpu).unwrap();
        assert_eq!(stem.apply_kernel(true), None);
    }

    #[test]
    fn shared_memory_matches_the_kernel_geometry() {
        // forward 128×128: (128·40 + 128·40) · 2 bytes · 4 stages
        assert_eq!(Conv2Tile::T128x128.smem_bytes(Pass::Forward), 81_920);
        // ... applying a batch norm on 64 channels: + 4 · 256 ring words + 64 · 16 parameters
        assert_eq!(
            Conv2Tile::T128x128.apply_smem_bytes(Pass::Forward, 64),
            81_920 + 4096 + 1024
        );
        // wgrad 64×128 on 16 channels: + 4 · 128 ring words + 4 · 128 channel words + 256
        assert_eq!(
            Conv2Tile::T64x128.apply_smem_bytes(Pass::Wgrad, 16),
            53_248 + 2048 + 2048 + 256
        );
        // dgrad 128×64: (128·40 + 32·72) · 2 · 4
        assert_eq!(Conv2Tile::T128x64.smem_bytes(Pass::Dgrad), 59_392);
        // wgrad 64×128: (32·72 + 32·136) · 2 · 4
        assert_eq!(Conv2Tile::T64x128.smem_bytes(Pass::Wgrad), 53_248);
        for t in [Conv2Tile::T128x128, Conv2Tile::T128x64, Conv2Tile::T64x128] {
            for p in [Pass::Forward, Pass::Dgrad, Pass::Wgrad] {
                assert!(t.smem_bytes(p) <= 227 * 1024);
                assert!(t.blocks_per_sm(p, &GpuLimits::H100) >= 2);
            }
        }
    }

    #[test]
    fn tiles_follow_the_layer() {
        let gpu = GpuLimits::H100;
        // 64 output channels: the 64-wide tile.
        let l = plan(Pass::Forward, &shape(256, 56, 64, 64, 3, 1), &gpu).unwrap();
        assert_eq!(l.kernel, "conv2_fwd_128x64");
        // 1×1 stride 2 shortcut: the strided-row GEMM, 4 dgrad phases.
        let s = ConvShape {
            padding: 0,
            ..shape(256, 56, 256, 512, 1, 2)
        };
        assert_eq!(
            plan(Pass::Forward, &s, &gpu).unwrap().kernel,
            "conv2_fwd_1x1_128x128"
        );
        let d = plan(Pass::Dgrad, &s, &gpu).unwrap();
        assert_eq!(
            (d.kernel, d.grid.2, d.rearrange_weight),
            ("conv2_dgrad_1x1_128x128", 4, false)
        );
        // 7×7 stage (M = 256·49 = 12544, N = 512): 128×128 gives 392 tiles on 264 slots (1.48
        // waves: 2 × 2 × 128² per SM); 128×64 gives 784 tiles on 396 slots (1.98 waves:
        // 2 × 3 × 128·64 per SM, a quarter less).
        let l = plan(Pass::Forward, &shape(256, 7, 512, 512, 3, 1), &gpu).unwrap();
        assert_eq!(l.tile, Conv2Tile::T128x64);
        // 14×14 stage: 784 tiles of 128×128 (2.97 waves) model as fast as 1568 of 128×64
        // (3.96 waves); ties keep the larger tile (more reuse per byte loaded).
        let l = plan(Pass::Forward, &shape(256, 14, 256, 256, 3, 1), &gpu).unwrap();
        assert_eq!(l.tile, Conv2Tile::T128x128);
        // A 3-channel stem at stride 1 (the CIFAR resnets): padded to 8 channels; wgrad on the
        // small-C gather.
        let cifar = shape(256, 32, 3, 16, 3, 1);
        let f = plan(Pass::Forward, &cifar, &gpu).unwrap();
        assert_eq!(f.stem, StemCopy::PadChannels);
        assert_eq!((f.args.c, f.args.c_real, f.args.pair_lead), (8, 3, -1));
        assert_eq!(f.gemm.2, 3 * 3 * 8);
        let w = plan(Pass::Wgrad, &cifar, &gpu).unwrap();
        assert_eq!(w.kernel, "conv2_wgrad_c8_64x128");
        assert!(plan(Pass::Dgrad, &cifar, &gpu).is_err());
        // Not a multiple of 8 output channels: v1 takes it.
        assert!(plan(Pass::Forward, &shape(2, 8, 8, 10, 3, 1), &gpu).is_err());
    }

    /// resnet's stem (7×7, stride 2, padding 3, 3 → 64 channels at 224 px) read as pixel pairs:
    /// 112 pair columns of 8 channels, a 7×4 filter at strides 2 × 1, padding 3 × 2; the
    /// reduction 7·4·8 = 224 of which 147 real (65.6 %), against 7·7·8 = 392 padded.
    #[test]
    fn the_stride_two_stem_reads_pixel_pairs() {
        let gpu = GpuLimits::H100;
        let stem = ConvShape {
            padding: 3,
            ..shape(256, 224, 3, 64, 7, 2)
        };
        assert_eq!(StemCopy::of(&stem), StemCopy::Pairs);
        let f = plan(Pass::Forward, &stem, &gpu).unwrap();
        assert_eq!(f.stem, StemCopy::Pairs);
        assert_eq!(f.kernel, "conv2_fwd_128x64");
        let a = f.args;
        assert_eq!((a.n, a.h, a.w, a.c), (256, 224, 112, 8));
        assert_eq!((a.k, a.r, a.s, a.p, a.q), (64, 7, 4, 112, 112));
        assert_eq!((a.stride, a.pad, a.stride_w, a.pad_w), (2, 3, 1, 2));
        assert_eq!((a.c_real, a.s_real, a.pair_lead), (3, 7, 1));
        assert_eq!(f.gemm, (256 * 112 * 112, 64, 224));
        let useful = (7 * 7 * 3) as f64 / f.gemm.2 as f64;
        assert!((useful - 0.656).abs() < 1e-3, "{useful}");
        // The forward's output width is the real one: q reads pairs q − 2 … q + 1.
        assert_eq!(a.q as usize, stem.out_w());
        let w = plan(Pass::Wgrad, &stem, &gpu).unwrap();
        assert_eq!(w.kernel, "conv2_wgrad_c8_64x128");
        assert_eq!((w.gemm.0, w.gemm.1), (64, 224));
        assert_eq!(
            w.grid.1, 2,
            "224 columns in two 128-wide tiles (was 392 in four)"
        );
        assert!(plan(Pass::Dgrad, &stem, &gpu).is_err());
        // The copies: the input as 112 pairs a row, the weight as 4 pairs a filter row.
        assert_eq!(StemCopy::Pairs.input_len(&stem), 256 * 224 * 112 * 8);
        assert_eq!(StemCopy::Pairs.weight_len(&stem), 64 * 7 * 4 * 8);
        // Odd widths: 113 pixels make 57 pairs (the last one's second pixel zero), and the
        // output width 57 = the pair columns.
        let odd = ConvShape { w: 113, ..stem };
        let o = plan(Pass::Forward, &odd, &gpu).unwrap();
        assert_eq!((o.args.w, o.args.q as usize), (57, odd.out_w()));
        assert_eq!(odd.out_w(), 57);
        // Even padding has no lead slot: a 5×5 filter at padding 2 is 3 pairs, padding 1 pair.
        let five = ConvShape {
            kernel: 5,
            padding: 2,
            ..stem
        };
        let l = plan(Pass::Forward, &five, &gpu).unwrap();
        assert_eq!((l.args.s, l.args.pad_w, l.args.pair_lead), (3, 1, 0));
        // A layer that is no stem keeps one stride and one padding for both dimensions.
        let l = plan(Pass::Forward, &shape(2, 9, 24, 40, 3, 2), &gpu).unwrap();
        assert_eq!(l.stem, StemCopy::None);
        let a = l.args;
        assert_eq!((a.stride_w, a.pad_w, a.s_real, a.pair_lead), (2, 1, 3, -1));
        assert_eq!((a.w, a.c, a.s, a.c_real), (9, 24, 3, 24));
    }

    /// Conv2Args has conv2.cu's fields in conv2.cu's order (the kernels read the struct by value).
    #[test]
    fn conv2_args_mirror_the_kernel_struct() {
        let text = KernelFile::by_name("conv2.cu").unwrap().text;
        let body = &text[text.find("struct Conv2Args {").unwrap()..];
        let body = &body[..body.find("};").unwrap()];
        let kernel_fields: Vec<&str> = body
            .lines()
            .skip(1)
            .filter_map(|l| l.trim().strip_prefix("int "))
            .flat_map(|l| l[..l.find(';').unwrap()].split(','))
            .map(str::trim)
            .collect();
        // Every field named once, in declaration order (a field added here and not there, or
        // moved, fails to compile or to match).
        let Conv2Args {
            n: _,
            h: _,
            w: _,
            c: _,
            k: _,
            r: _,
            s: _,
            p: _,
            q: _,
            stride: _,
            pad: _,
            stride_w: _,
            pad_w: _,
            c_real: _,
            s_real: _,
            pair_lead: _,
            k_chunk: _,
            accumulate: _,
        } = plan(Pass::Forward, &shape(1, 8, 8, 8, 3, 1), &GpuLimits::H100)
            .unwrap()
            .args;
        let host_fields = [
            "n",
            "h",
            "w",
            "c",
            "k",
            "r",
            "s",
            "p",
            "q",
            "stride",
            "pad",
            "stride_w",
            "pad_w",
            "c_real",
            "s_real",
            "pair_lead",
            "k_chunk",
            "accumulate",
        ];
        assert_eq!(kernel_fields, host_fields);
        assert_eq!(std::mem::size_of::<Conv2Args>(), 4 * host_fields.len());
    }

    #[test]
    fn wgrad_splits_fill_whole_waves() {
        // 8 tiles on 264 slots: the reduction is split until the waves are full.
        let (splits, chunk) = wgrad_splits(8, 200_704, 264);
        assert_eq!(splits * 8 % 264, 0, "{splits}");
        assert!(splits * chunk >= 200_704 && chunk % 32 == 0);
        // A short reduction is not split below 256 pixels a slice.
        assert_eq!(wgrad_splits(8, 300, 264).0, 2);
        assert_eq!(wgrad_splits(1, 40, 264), (1, 64));
        // The 2048-channel 1×1 of the last stage: 16·16 = 256 tiles, M = 2048.
        let s = ConvShape {
            padding: 0,
            ..shape(256, 7, 512, 2048, 1, 1)
        };
        let l = plan(Pass::Wgrad, &s, &GpuLimits::H100).unwrap();
        assert_eq!(l.kernel, "conv2_wgrad_1x1_128x128");
        assert!(l.waves(&GpuLimits::H100) > 0.9, "{l:?}");
    }
}
