//! The Hopper convolution kernels (kernels/conv3.cu, `BIRDTRAIN_CONV=v3`): which layers they
//! take, their launch geometry, and the TMA tensor maps that feed them.
//!
//! conv3.cu computes 1×1 convolutions at stride 1 without padding as `wgmma` GEMMs whose
//! operands the Tensor Memory Accelerator loads, and 3×3 ones (stride 1 or 2, padding 1) and
//! strided 1×1 ones through 4-D boxes of the NHWC input, one per filter tap (at stride 2 the
//! input's tensor map traverses rows and columns with stride 2); the data gradient of a
//! strided 1×1 is the 1×1 dgrad GEMM over dy's pixels with a scattered epilogue, and that of a
//! strided 3×3 four phases of the 3×3 dgrad (conv2.cu's, on the 4-D path). Every other layer
//! or pass (the stem, strided 3×3 data gradients of odd extents, and every layer on a GPU other
//! than compute capability 9.0) keeps the v2 kernels. The file is compiled for the
//! architecture-specific target `sm_90a` on Hopper ([`KernelFile::target_for`]); for any other
//! target its kernels are stubs that trap, which the dispatch here never launches.
//!
//! [`KernelFile::target_for`]: super::KernelFile::target_for

use cudarc::driver::{sys, DeviceRepr};

use super::{CudaError, GpuArch};
use crate::backend::ConvShape;

/// The kernel file.
pub const FILE: &str = "conv3.cu";
/// Rows (pixels) of a block's output tile (`C3_BM`); also the rows of a statistics record.
pub const TILE_M: usize = 128;
/// Columns (output channels) of a block's output tile (`C3_BN`).
pub const TILE_N: usize = 128;
/// Channels of one k-slice, one TMA box row of 128 bytes (`C3_BK`).
pub const TILE_K: usize = 64;
/// Shared-memory stages of the TMA ring (`C3_STAGES`).
pub const STAGES: usize = 4;
/// Threads per block: a producer warpgroup and two consumer warpgroups (`C3_THREADS`).
pub const THREADS: u32 = 384;
/// Dynamic shared memory per block (`CONV3_SMEM_BYTES`): the stages (an A and a B tile of
/// `TILE_M × TILE_K` bf16 each), a full and an empty mbarrier per stage, and 1 KiB of slack
/// to align the stages to the 1024 bytes of the swizzle pattern.
pub const SMEM_BYTES: usize = STAGES * 2 * TILE_M * TILE_K * 2 + 2 * STAGES * 8 + 1024;
// Within the 227 KiB a Hopper block may use.
const _: () = assert!(SMEM_BYTES <= 227 * 1024);
/// Dynamic shared memory of a persistent kernel (`C3_P_SMEM` in conv3.cu, the twins of
/// [`persistent_twin`]) of `tile_n` columns: its ring of stages (4 for 128 columns, 3 for 64)
/// and their barriers (128 bytes), then the epilogue's own staged tile (`TILE_M × (tile_n + 8)`
/// bf16) and reduction scratch (2 × 4 × 128 f32 either way), and the alignment slack.
const fn p_smem_bytes(tile_n: usize) -> usize {
    let stages = if tile_n == TILE_N { 4 } else { 3 };
    stages * (TILE_M + tile_n) * TILE_K * 2
        + 128
        + TILE_M * (tile_n + 8) * 2
        + 2 * 4 * 128 * 4
        + 1024
}
/// Dynamic shared memory of the 128-column persistent kernels (`CONV3_P_SMEM_BYTES`): one
/// block an SM.
pub const P_SMEM_BYTES: usize = p_smem_bytes(TILE_N);
const _: () = assert!(P_SMEM_BYTES <= 227 * 1024);
/// Columns of the narrow tiles (`_n64` kernels), for GEMMs whose N is at most 64.
pub const TILE_N_NARROW: usize = 64;
/// Dynamic shared memory of the 64-column persistent kernels (`CONV3_N64_P_SMEM_BYTES`): two
/// blocks fit an SM.
pub const N64_P_SMEM_BYTES: usize = p_smem_bytes(TILE_N_NARROW);
const _: () = assert!(2 * (N64_P_SMEM_BYTES + 1024) <= 228 * 1024);
/// Dynamic shared memory of the `_n64` kernels (`CONV3_N64_SMEM_BYTES`): B tiles of 64 rows;
/// two blocks fit an SM. The `_m64` kernels' stages (an A tile of 64 rows, a B tile of 128)
/// are as large.
pub const N64_SMEM_BYTES: usize =
    STAGES * (TILE_M * TILE_K * 2 + TILE_N_NARROW * TILE_K * 2) + 2 * STAGES * 8 + 1024;
/// Rows of the weight gradients' short tiles (`_m64` kernels, the consumers splitting the 128
/// columns), for GEMMs whose M (output channels) is at most 64.
pub const TILE_M_NARROW: usize = 64;

/// The columns of a GEMM's tiles: 64 where its N is at most 64 (a 128-column tile would be
/// half padding), else 128.
pub fn tile_n(args: &Conv3Args) -> usize {
    if args.n as usize <= TILE_N_NARROW {
        TILE_N_NARROW
    } else {
        TILE_N
    }
}

/// The kernel that runs `kernel`'s GEMM with `tile_n` columns: itself, or its `_n64` twin.
pub fn with_tile(kernel: &'static str, tile_n: usize) -> &'static str {
    if tile_n != TILE_N_NARROW {
        return kernel;
    }
    match kernel {
        FWD_KERNEL => "conv3_fwd_1x1_n64",
        FWD_STATS_KERNEL => "conv3_fwd_stats_1x1_n64",
        DGRAD_KERNEL => "conv3_dgrad_1x1_n64",
        DGRAD_BN_KERNEL => "conv3_dgrad_bn_1x1_n64",
        FWD_3X3_KERNEL => "conv3_fwd_3x3_n64",
        FWD_STATS_3X3_KERNEL => "conv3_fwd_stats_3x3_n64",
        DGRAD_3X3_KERNEL => "conv3_dgrad_3x3_n64",
        DGRAD_BN_3X3_KERNEL => "conv3_dgrad_bn_3x3_n64",
        WGRAD_KERNEL => "conv3_wgrad_1x1_n64",
        WGRAD_3X3_KERNEL => "conv3_wgrad_3x3_n64",
        other => other,
    }
}

/// The output tile (rows, columns) of a weight gradient of `m` output channels × `n` columns:
/// 128 × 64 where N is at most 64 (the `_n64` twins), else 64 × 128 where M is at most 64
/// (the `_m64` twins: a 128-row tile would leave one consumer multiplying zeros), else
/// 128 × 128. (Where both are at most 64 either short tile is half padding: `_n64`.)
pub fn wgrad_tile(m: usize, n: usize) -> (usize, usize) {
    if n <= TILE_N_NARROW {
        (TILE_M, TILE_N_NARROW)
    } else if m <= TILE_M_NARROW {
        (TILE_M_NARROW, TILE_N)
    } else {
        (TILE_M, TILE_N)
    }
}

/// The kernel that runs the weight gradient `kernel` ([`WGRAD_KERNEL`] or
/// [`WGRAD_3X3_KERNEL`]) of `args` in its [`wgrad_tile`]: itself or its `_n64` or `_m64` twin.
pub fn wgrad_kernel(kernel: &'static str, args: &Conv3Args) -> &'static str {
    match wgrad_tile(args.m as usize, args.n as usize) {
        (_, TILE_N_NARROW) => with_tile(kernel, TILE_N_NARROW),
        (TILE_M_NARROW, _) => match kernel {
            WGRAD_KERNEL => WGRAD_M64_KERNEL,
            WGRAD_3X3_KERNEL => WGRAD_3X3_M64_KERNEL,
            other => other,
        },
        _ => kernel,
    }
}

/// The output tile (rows, columns) of a v3 GEMM kernel, by its name.
pub fn kernel_tile(kernel: &str) -> (usize, usize) {
    if kernel.ends_with("_n64") || kernel.ends_with("_n64_p") {
        (TILE_M, TILE_N_NARROW)
    } else if kernel.ends_with("_m64") {
        (TILE_M_NARROW, TILE_N)
    } else {
        (TILE_M, TILE_N)
    }
}

/// The grid of a weight gradient run by `kernel` ([`wgrad_kernel`]): one block per output tile
/// and reduction slice.
pub fn wgrad_grid(kernel: &str, args: &Conv3Args, slices: usize) -> (u32, u32, u32) {
    let (tm, tn) = kernel_tile(kernel);
    (
        (args.m as usize).div_ceil(tm) as u32,
        (args.n as usize).div_ceil(tn) as u32,
        slices as u32,
    )
}

/// The persistent twin (`_p`, `_n64_p`: `conv3_gemm_p`) of a forward or data-gradient kernel:
/// the same arguments and results, its tiles walked by fewer blocks (which schedule launches
/// which is `BIRDTRAIN_CONV3_TILES`'s, src/cuda/conv3_schedule.rs).
pub fn persistent_twin(kernel: &str) -> Option<&'static str> {
    Some(match kernel {
        FWD_KERNEL => "conv3_fwd_1x1_p",
        FWD_STATS_KERNEL => "conv3_fwd_stats_1x1_p",
        DGRAD_KERNEL => "conv3_dgrad_1x1_p",
        DGRAD_BN_KERNEL => "conv3_dgrad_bn_1x1_p",
        FWD_3X3_KERNEL => "conv3_fwd_3x3_p",
        FWD_STATS_3X3_KERNEL => "conv3_fwd_stats_3x3_p",
        DGRAD_3X3_KERNEL => "conv3_dgrad_3x3_p",
        DGRAD_BN_3X3_KERNEL => "conv3_dgrad_bn_3x3_p",
        "conv3_fwd_1x1_n64" => "conv3_fwd_1x1_n64_p",
        "conv3_fwd_stats_1x1_n64" => "conv3_fwd_stats_1x1_n64_p",
        "conv3_dgrad_1x1_n64" => "conv3_dgrad_1x1_n64_p",
        "conv3_dgrad_bn_1x1_n64" => "conv3_dgrad_bn_1x1_n64_p",
        "conv3_fwd_3x3_n64" => "conv3_fwd_3x3_n64_p",
        "conv3_fwd_stats_3x3_n64" => "conv3_fwd_stats_3x3_n64_p",
        "conv3_dgrad_3x3_n64" => "conv3_dgrad_3x3_n64_p",
        "conv3_dgrad_bn_3x3_n64" => "conv3_dgrad_bn_3x3_n64_p",
        _ => return None,
    })
}

/// Whether `kernel` is one of the persistent (`_p`) kernels.
pub fn is_persistent(kernel: &str) -> bool {
    kernel.starts_with("conv3_") && kernel.ends_with("_p")
}

/// Dynamic shared memory of a v3 GEMM kernel.
pub fn smem_bytes(kernel: &str) -> usize {
    if is_persistent(kernel) {
        p_smem_bytes(kernel_tile(kernel).1)
    } else if kernel_tile(kernel) == (TILE_M, TILE_N) {
        SMEM_BYTES
    } else {
        N64_SMEM_BYTES
    }
}

/// The forward kernel: `y = x · wᵀ`.
pub const FWD_KERNEL: &str = "conv3_fwd_1x1";
/// The forward kernel whose epilogue writes per-tile (mean, M2) records of y, in conv2.cu's
/// record layout (`[2][tiles][channels]`), which bn.cu's merges read.
pub const FWD_STATS_KERNEL: &str = "conv3_fwd_stats_1x1";
/// The forward through 4-D boxes: 3×3 at stride 1 or 2, and the strided 1×1 as its one-tap
/// case (tiles of whole images × rows × columns of the output, the taps as shifted 4-D TMA
/// boxes of the input).
pub const FWD_3X3_KERNEL: &str = "conv3_fwd_3x3";
/// The 3×3 forward with the batch-norm statistics epilogue.
pub const FWD_STATS_3X3_KERNEL: &str = "conv3_fwd_stats_3x3";
/// The 3×3 data gradient at stride 1 (the forward's tiles over dx, dy's boxes shifted by
/// pad − tap, the weight as `[C][9·K]`).
pub const DGRAD_3X3_KERNEL: &str = "conv3_dgrad_3x3";
/// The 3×3 data gradient with the batch-norm gradient epilogue.
pub const DGRAD_BN_3X3_KERNEL: &str = "conv3_dgrad_bn_3x3";
/// The weight gradient through 4-D boxes (3×3 at stride 1 or 2, strided 1×1 as one tap): f32
/// planes per reduction slice of whole 64-pixel tiles of the output.
pub const WGRAD_3X3_KERNEL: &str = "conv3_wgrad_3x3";
/// The weight rearranged for the 3×3 data gradient (`wt[c][tap·K + k] = w[k][tap][c]`).
pub const DGRAD_WEIGHTS_3X3_KERNEL: &str = "conv3_dgrad_weights_3x3";
/// The weight rearranged per phase for the stride-2 3×3 data gradient
/// (`[4 phases][C][4 taps·K]`, a phase's unused taps zero).
pub const DGRAD_WEIGHTS_S2_KERNEL: &str = "conv3_dgrad_weights_s2";
/// The phases of a stride-2 3×3 data gradient (`gridDim.z`): the parities of dx's rows and
/// columns.
pub const DGRAD_PHASES: usize = 4;
/// The data gradient: `dx = dy · wt ᵀ` with the transposed weight (+ dx when accumulating).
pub const DGRAD_KERNEL: &str = "conv3_dgrad_1x1";
/// The data gradient finishing the gradient of the batch norm before the convolution
/// (residual gradient, ReLU mask, per-tile Σg and Σg·x̂ records): conv2_dgrad_bn_*'s contract.
pub const DGRAD_BN_KERNEL: &str = "conv3_dgrad_bn_1x1";
/// The weight gradient: f32 planes of `dyᵀ · x` per reduction slice (MN-major operands), summed
/// in slice order by conv2.cu's `conv2_wgrad_reduce`.
pub const WGRAD_KERNEL: &str = "conv3_wgrad_1x1";
/// The 1×1 weight gradient in tiles of 64 rows × 128 columns, for 64 or fewer output channels.
pub const WGRAD_M64_KERNEL: &str = "conv3_wgrad_1x1_m64";
/// The 4-D weight gradient in tiles of 64 rows × 128 columns, for 64 or fewer output channels.
pub const WGRAD_3X3_M64_KERNEL: &str = "conv3_wgrad_3x3_m64";
/// The weight transpose the data gradient reads (`[K][C]` → `[C][K]`, K-major for wgmma).
pub const TRANSPOSE_KERNEL: &str = "conv3_transpose_weights";

/// Kernel-side mirror of `struct Conv3Args` in kernels/conv3.cu (13 ints, C layout).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv3Args {
    /// GEMM rows: pixels (batch × height × width).
    pub m: i32,
    /// GEMM columns: output channels (dgrad: input channels), a multiple of 8.
    pub n: i32,
    /// Reduction: input channels (dgrad: output channels), a multiple of 8.
    pub k: i32,
    /// Dgrad: 1 adds into the output instead of overwriting it.
    pub accumulate: i32,
    /// Reduction per `gridDim.z` slice (a multiple of [`TILE_K`] when the wgrad splits it;
    /// `k` otherwise).
    pub k_chunk: i32,
    /// 4-D path: the output's height; 0 for the 2-D 1×1 kernels.
    pub height: i32,
    /// 3×3: the output's width.
    pub width: i32,
    /// 3×3: the tile's rows.
    pub tile_h: i32,
    /// 3×3: the tile's columns.
    pub tile_w: i32,
    /// 3×3: the padding.
    pub pad: i32,
    /// 3×3: the filter size (3; 1 for a strided 1×1).
    pub taps: i32,
    /// 3×3 data gradient: 1 shifts the input boxes by pad − tap (a correlation with the
    /// flipped filter), 0 by tap − pad; with stride 2, the four phases ([`dgrad_s2_args`]).
    pub flip: i32,
    /// The convolution's stride (1 or 2): the 4-D path's box of output pixel (h, w) starts at
    /// input pixel (h, w) × stride − pad + tap, through a tensor map with that traversal stride.
    pub stride: i32,
}

// SAFETY: repr(C) plain integers, matching the kernel's struct.
unsafe impl DeviceRepr for Conv3Args {}

/// Whether the v3 kernels take a layer on a device of architecture `arch`: Hopper
/// (compute capability 9.0, whose `sm_90a` image has `wgmma`), a 1×1 filter at stride 1 without
/// padding, channel counts the tensor maps' 16-byte row pitches allow (multiples of 8), and
/// extents that fit the kernel's 32-bit indices.
pub fn takes(s: &ConvShape, arch: GpuArch) -> bool {
    runs_on(arch)
        && s.kernel == 1
        && s.stride == 1
        && s.padding == 0
        && s.c_in % 8 == 0
        && s.c_out % 8 == 0
        && forward_args(s).is_some()
}

/// The GEMM of a 1×1 forward convolution: M = pixels, N = output channels, K = input channels;
/// `None` when an extent exceeds the kernel's 32-bit indices.
pub fn forward_args(s: &ConvShape) -> Option<Conv3Args> {
    let m = s.n * s.out_h() * s.out_w();
    Some(Conv3Args {
        m: i32::try_from(m).ok()?,
        n: i32::try_from(s.c_out).ok()?,
        k: i32::try_from(s.c_in).ok()?,
        accumulate: 0,
        k_chunk: i32::try_from(s.c_in).ok()?,
        height: 0,
        width: 0,
        tile_h: 0,
        tile_w: 0,
        pad: 0,
        taps: 0,
        flip: 0,
        stride: 1,
    })
}

/// The tile of a 3×3 layer's output over `n` images of `h × w`: (images, rows, columns),
/// powers of two that divide the extents, 128 pixels in all, the widest rows first (longer
/// contiguous runs for TMA); `None` when the batch does not divide (every tile must be whole,
/// so that each statistics record covers 128 pixels).
pub fn tile_3x3(n: usize, h: usize, w: usize) -> Option<(usize, usize, usize)> {
    tile_of(n, h, w, TILE_M)
}

/// [`tile_3x3`] for tiles of `pixels` (a power of two).
fn tile_of(n: usize, h: usize, w: usize, pixels: usize) -> Option<(usize, usize, usize)> {
    let pow2 = |v: usize, cap: usize| {
        let mut p = 1;
        while p * 2 <= cap && v % (p * 2) == 0 {
            p *= 2;
        }
        p
    };
    let tw = pow2(w, pixels);
    let th = pow2(h, pixels / tw);
    let tn = pixels / (tw * th);
    (n % tn == 0).then_some((tn, th, tw))
}

/// Whether the forward or weight gradient of a layer fits the 4-D path on Hopper: a 3×3 with
/// padding 1 at stride 1 or 2, or a 1×1 without padding at stride 2 (the one-tap case; the
/// stride-1 1×1 is the plain GEMM of [`takes`]), input channels in whole 64-channel k-steps
/// per tap, output channels the tensor maps take (% 8).
fn fits_4d(s: &ConvShape, arch: GpuArch) -> bool {
    (arch.major, arch.minor) == (9, 0)
        && matches!((s.kernel, s.stride, s.padding), (3, 1 | 2, 1) | (1, 2, 0))
        && s.c_in % TILE_K == 0
        && s.c_out % 8 == 0
}

/// The GEMM of a forward through 4-D boxes on Hopper (a 3×3 with padding 1 at stride 1 or 2,
/// or a 1×1 at stride 2): M = output pixels in whole tiles, N = output channels, K = taps ×
/// input channels (64 of one tap per k-step: input channels a multiple of 64); `None` where v3
/// does not take the layer that way.
pub fn forward_4d_args(s: &ConvShape, arch: GpuArch) -> Option<Conv3Args> {
    if !fits_4d(s, arch) {
        return None;
    }
    let (oh, ow) = (s.out_h(), s.out_w());
    let (_, th, tw) = tile_3x3(s.n, oh, ow)?;
    // The input box spans stride × the tile's rows and columns: within TMA's 256.
    if s.stride * th.max(tw) > 256 {
        return None;
    }
    let taps = s.kernel * s.kernel;
    Some(Conv3Args {
        m: i32::try_from(s.n * oh * ow).ok()?,
        n: i32::try_from(s.c_out).ok()?,
        k: i32::try_from(taps * s.c_in).ok()?,
        accumulate: 0,
        k_chunk: i32::try_from(taps * s.c_in).ok()?,
        height: i32::try_from(oh).ok()?,
        width: i32::try_from(ow).ok()?,
        tile_h: th as i32,
        tile_w: tw as i32,
        pad: s.padding as i32,
        taps: s.kernel as i32,
        flip: 0,
        stride: s.stride as i32,
    })
}

/// The GEMM of a 3×3 data gradient with padding 1 on Hopper. At stride 1: M = input pixels in
/// whole tiles, N = input channels, K = 9 × output channels (a multiple of 64 per tap). At
/// stride 2 ([`dgrad_s2_args`]) the four phases.
pub fn dgrad_3x3_args(s: &ConvShape, arch: GpuArch, accumulate: bool) -> Option<Conv3Args> {
    if s.kernel == 3 && s.stride == 2 {
        return dgrad_s2_args(s, arch, accumulate);
    }
    if s.kernel != 3 || s.stride != 1 || s.c_out % TILE_K != 0 || s.c_in % 8 != 0 {
        return None;
    }
    // The forward's conditions with the channel roles swapped (dx has the input's extents).
    let swapped = ConvShape {
        c_in: s.c_out,
        c_out: s.c_in,
        ..*s
    };
    let f = forward_4d_args(&swapped, arch)?;
    Some(Conv3Args {
        accumulate: i32::from(accumulate),
        flip: 1,
        ..f
    })
}

/// The GEMM of a stride-2 3×3 data gradient (padding 1, even input extents) as conv2.cu's
/// phases: `gridDim.z` = [`DGRAD_PHASES`] parities (ph, pw) of dx's rows and columns, each a
/// stride-1 correlation of dy with the taps r ≡ ph + 1 (mod 2) (1 + ph of them, the same along
/// the columns) over tiles of dy's extents (each phase's pixels: dx's halved), scattered to dx's
/// (2h + ph, 2w + pw). M = dy's pixels in whole tiles, N = input channels, K = 4 × output
/// channels (the row of the phase's weight, `[4][C][4·K]`; a phase reduces 1, 2 or 4 taps of
/// `k_chunk` = K, a multiple of 64).
pub fn dgrad_s2_args(s: &ConvShape, arch: GpuArch, accumulate: bool) -> Option<Conv3Args> {
    if !runs_on(arch)
        || (s.kernel, s.stride, s.padding) != (3, 2, 1)
        || s.h % 2 != 0
        || s.w % 2 != 0
        || s.c_out % TILE_K != 0
        || s.c_in % 8 != 0
    {
        return None;
    }
    let (dh, dw) = (s.h / 2, s.w / 2);
    let (_, th, tw) = tile_3x3(s.n, dh, dw)?;
    Some(Conv3Args {
        m: i32::try_from(s.n * dh * dw).ok()?,
        n: i32::try_from(s.c_in).ok()?,
        k: i32::try_from(4 * s.c_out).ok()?,
        accumulate: i32::from(accumulate),
        k_chunk: i32::try_from(s.c_out).ok()?,
        height: i32::try_from(dh).ok()?,
        width: i32::try_from(dw).ok()?,
        tile_h: th as i32,
        tile_w: tw as i32,
        pad: 1,
        taps: 3,
        flip: 1,
        stride: 2,
    })
}

/// Whether `args` are a stride-2 3×3 data gradient's phases ([`dgrad_s2_args`]).
pub fn is_phased(args: &Conv3Args) -> bool {
    args.flip == 1 && args.stride > 1
}

/// The tile (images, rows, columns) of 64 output pixels of a weight gradient through 4-D
/// boxes ([`fits_4d`]); `None` where v3 does not take it.
fn wgrad_4d_tile(s: &ConvShape, arch: GpuArch) -> Option<(usize, usize, usize)> {
    if !fits_4d(s, arch) {
        return None;
    }
    tile_of(s.n, s.out_h(), s.out_w(), TILE_K)
}

/// The GEMM of a weight gradient through 4-D boxes on Hopper (a 3×3 with padding 1 at stride
/// 1 or 2, or a 1×1 at stride 2: M = output channels, N = taps × input channels (a multiple of
/// 64 per tap), K = output pixels in whole tiles of 64), its reduction split over `sms` SMs as
/// [`wgrad_args`] does, the number of slices, and the tile (images, rows, columns) of output
/// pixels of its TMA boxes (x's boxes span stride × its rows and columns).
pub fn wgrad_4d_args(
    s: &ConvShape,
    arch: GpuArch,
    sms: usize,
) -> Option<(Conv3Args, usize, (usize, usize, usize))> {
    let tile = wgrad_4d_tile(s, arch)?;
    let (oh, ow) = (s.out_h(), s.out_w());
    let pixels = s.n * oh * ow;
    let (m, n) = (s.c_out, s.kernel * s.kernel * s.c_in);
    let (tiles, slots) = wgrad_slots(m, n, sms);
    let (_, chunk) = super::conv::wgrad_splits(tiles, pixels, slots);
    let chunk = chunk.div_ceil(TILE_K) * TILE_K;
    let args = Conv3Args {
        m: i32::try_from(m).ok()?,
        n: i32::try_from(n).ok()?,
        k: i32::try_from(pixels).ok()?,
        accumulate: 0,
        k_chunk: i32::try_from(chunk).ok()?,
        height: i32::try_from(oh).ok()?,
        width: i32::try_from(ow).ok()?,
        tile_h: tile.1 as i32,
        tile_w: tile.2 as i32,
        pad: s.padding as i32,
        taps: s.kernel as i32,
        flip: 0,
        stride: s.stride as i32,
    };
    Some((args, pixels.div_ceil(chunk), tile))
}

/// Whether v3 takes the weight gradient of a layer: a 1×1 at stride 1 ([`takes`]), or through
/// 4-D boxes a 3×3 (stride 1 or 2) or a strided 1×1 with whole 64-pixel tiles of its output.
pub fn takes_wgrad(s: &ConvShape, arch: GpuArch) -> bool {
    takes(s, arch) || wgrad_4d_tile(s, arch).is_some()
}

/// Whether v3 takes the data gradient of a layer: a 1×1 at stride 1 ([`takes`]) or 2
/// ([`takes_strided_dgrad`]), or a 3×3 at stride 1 or 2 (even extents) with whole tiles.
pub fn takes_dgrad(s: &ConvShape, arch: GpuArch) -> bool {
    takes(s, arch) || takes_strided_dgrad(s, arch) || dgrad_3x3_args(s, arch, false).is_some()
}

/// Whether v3 takes the data gradient of a layer with the batch-norm gradient epilogue
/// (`conv_backward_data_bn`): [`takes_dgrad`] but the strided 1×1. Its scattered epilogue
/// writes the GEMM's pixels (every other row and column) and zeros elsewhere, while the batch
/// norm's gradient needs the residual, the mask and the records at every pixel of dx; and no
/// model fuses it: a downsampling projection is never the first reader of its input (the
/// block's conv1 is, src/model/bn_fusion.rs), so it stays on v2 there.
pub fn takes_dgrad_bn(s: &ConvShape, arch: GpuArch) -> bool {
    takes_dgrad(s, arch) && !takes_strided_dgrad(s, arch)
}

/// Whether v3 takes the data gradient of a strided 1×1 (stride 2, no padding, the
/// downsampling projection): the stride-1 dgrad GEMM over dy's pixels whose epilogue scatters
/// them to every other row and column of dx ([`dgrad_args`]).
pub fn takes_strided_dgrad(s: &ConvShape, arch: GpuArch) -> bool {
    runs_on(arch)
        && s.kernel == 1
        && s.stride == 2
        && s.padding == 0
        && s.c_in % 8 == 0
        && s.c_out % 8 == 0
        && dgrad_args(s, false).is_some()
}

/// Whether the v3 kernels run on a GPU of `arch`: compute capability 9.0 only, the one that
/// `sm_90a`'s `wgmma` and TMA instructions compile for.
pub fn runs_on(arch: GpuArch) -> bool {
    arch.is_hopper()
}

/// Whether v3 takes the forward pass of a layer: a 1×1 at stride 1 ([`takes`]), or through
/// 4-D boxes a 3×3 (stride 1 or 2) or a strided 1×1 with whole tiles of output pixels.
pub fn takes_forward(s: &ConvShape, arch: GpuArch) -> bool {
    takes(s, arch) || forward_4d_args(s, arch).is_some()
}

/// The GEMM of a 1×1 data gradient: M = pixels of dy, N = input channels, K = output
/// channels. At stride > 1 (no padding) the kernel scatters dy's pixel (n, p, q) to dx's
/// (n, p·stride, q·stride) and, without `accumulate`, writes zeros to the other pixels: the
/// arguments carry dx's height and width and the stride.
pub fn dgrad_args(s: &ConvShape, accumulate: bool) -> Option<Conv3Args> {
    let f = forward_args(s)?;
    let strided = s.stride > 1;
    // dx's elements are addressed with 64-bit offsets; its extents must fit the arguments.
    let (height, width) = if strided {
        (i32::try_from(s.h).ok()?, i32::try_from(s.w).ok()?)
    } else {
        (0, 0)
    };
    Some(Conv3Args {
        n: f.k,
        k: f.n,
        accumulate: i32::from(accumulate),
        k_chunk: f.n,
        height,
        width,
        stride: i32::try_from(s.stride).ok()?,
        ..f
    })
}

/// The GEMM of a 1×1 weight gradient (M = output channels, N = input channels, K = pixels) and
/// its reduction split over `sms` SMs (one block each): conv2's wave rule
/// ([`wgrad_splits`](super::conv::wgrad_splits)) with slices rounded up to whole 64-pixel
/// k-slices. Returns the arguments and the number of slices (`gridDim.z`, f32 planes).
pub fn wgrad_args(s: &ConvShape, sms: usize) -> Option<(Conv3Args, usize)> {
    let f = forward_args(s)?;
    let (m, n, pixels) = (s.c_out, s.c_in, f.m as usize);
    let (tiles, slots) = wgrad_slots(m, n, sms);
    let (_, chunk) = super::conv::wgrad_splits(tiles, pixels, slots);
    let chunk = chunk.div_ceil(TILE_K) * TILE_K;
    let slices = pixels.div_ceil(chunk);
    Some((
        Conv3Args {
            m: f.n,
            n: f.k,
            k: f.m,
            k_chunk: i32::try_from(chunk).ok()?,
            ..f
        },
        slices,
    ))
}

/// A weight gradient's output tiles (M × N in its [`wgrad_tile`]) and the blocks the GPU's
/// `sms` hold at once (two an SM with the short tiles).
fn wgrad_slots(m: usize, n: usize, sms: usize) -> (usize, usize) {
    let (tm, tn) = wgrad_tile(m, n);
    let per_sm = if (tm, tn) == (TILE_M, TILE_N) { 1 } else { 2 };
    (m.div_ceil(tm) * n.div_ceil(tn), per_sm * sms)
}

/// conv3_transpose_weights' launch over a `[rows][cols]` weight: blocks of 32 × 8 threads,
/// one per 32 × 32 tile.
pub fn transpose_launch(rows: usize, cols: usize) -> ((u32, u32, u32), (u32, u32, u32)) {
    (
        (cols.div_ceil(32) as u32, rows.div_ceil(32) as u32, 1),
        (32, 8, 1),
    )
}

/// The grid of a GEMM: one block per 128 × [`tile_n`] output tile (and per phase of a
/// stride-2 3×3 data gradient, [`is_phased`]).
pub fn grid(a: &Conv3Args) -> (u32, u32, u32) {
    (
        (a.m as usize).div_ceil(TILE_M) as u32,
        (a.n as usize).div_ceil(tile_n(a)) as u32,
        if is_phased(a) { DGRAD_PHASES as u32 } else { 1 },
    )
}

/// The per-tile records of a forward or data-gradient GEMM (`[2][records][N]`): one per row
/// tile and phase, whichever kernel and schedule runs it.
pub fn records(a: &Conv3Args) -> usize {
    let (m_tiles, _, phases) = grid(a);
    (m_tiles * phases) as usize
}

/// A `CUtensorMap`: the 128-byte description of a global tensor that a TMA load reads (64-byte
/// aligned, 128 in CUDA 13's headers), passed to the kernel by value (`__grid_constant__`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct TensorMap(sys::CUtensorMap);

// SAFETY: an opaque 128-byte value the kernel takes by value; the driver filled it.
unsafe impl DeviceRepr for TensorMap {}

impl std::fmt::Debug for TensorMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TensorMap")
    }
}

impl TensorMap {
    /// The map of a row-major `[rows][cols]` bf16 matrix at device address `ptr`, read in
    /// boxes of `TILE_K` columns × `box_rows` rows with the 128-byte swizzle, zeros outside the
    /// matrix (what conv3.cu's stages expect).
    pub fn bf16_matrix(
        ptr: sys::CUdeviceptr,
        rows: usize,
        cols: usize,
        box_rows: usize,
    ) -> Result<TensorMap, CudaError> {
        Self::encode(ptr, &MapGeometry::bf16_matrix(rows, cols, box_rows)?)
    }

    /// The map of an NHWC bf16 tensor at `ptr`, read in 4-D boxes of `TILE_K` channels ×
    /// `tile` = (images, rows, columns) taken every `stride`-th row and column, zeros outside
    /// it (the 3×3 forward's padding).
    pub fn bf16_nhwc(
        ptr: sys::CUdeviceptr,
        shape: (usize, usize, usize, usize),
        tile: (usize, usize, usize),
        stride: usize,
    ) -> Result<TensorMap, CudaError> {
        Self::encode(ptr, &MapGeometry::bf16_nhwc(shape, tile, stride)?)
    }

    fn encode(ptr: sys::CUdeviceptr, geometry: &MapGeometry) -> Result<TensorMap, CudaError> {
        let rank = geometry.dims.len();
        if ptr % 16 != 0 {
            return Err(CudaError::Unsupported {
                what: format!("a TMA tensor map of a tensor at {ptr:#x}: needs 16-byte alignment"),
            });
        }
        let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
        // SAFETY: dims, boxes and element strides have `rank` entries, strides `rank - 1`; the
        // driver writes the 128-byte map.
        let result = unsafe {
            sys::cuTensorMapEncodeTiled(
                map.as_mut_ptr(),
                sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                rank as u32,
                ptr as *mut std::ffi::c_void,
                geometry.dims.as_ptr(),
                geometry.strides.as_ptr(),
                geometry.boxes.as_ptr(),
                geometry.element_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        result.result().map_err(CudaError::driver(format!(
            "cuTensorMapEncodeTiled for a bf16 tensor of extents {:?}",
            geometry.dims
        )))?;
        // SAFETY: the call succeeded, so the driver wrote the map.
        Ok(TensorMap(unsafe { map.assume_init() }))
    }
}

/// The extents cuTensorMapEncodeTiled is given for a bf16 tensor (innermost dimension first),
/// checked against the driver's rules without a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapGeometry {
    /// Extents: a matrix's columns and rows; an NHWC tensor's channels, columns, rows, images.
    pub dims: Vec<u64>,
    /// Bytes between consecutive elements of dimensions 1.. (the driver takes no first one).
    pub strides: Vec<u64>,
    /// Box extents: `TILE_K` channels or columns (128 bytes, the swizzle span), then the rest
    /// (with a traversal stride, stride × the elements it loads).
    pub boxes: Vec<u32>,
    /// Traversal strides (`elementStrides`): every `element_strides[i]`-th element of
    /// dimension i; 1 for the innermost (the driver ignores it without interleave).
    pub element_strides: Vec<u32>,
}

impl MapGeometry {
    /// The geometry of a `[rows][cols]` bf16 matrix read in `TILE_K × box_rows` boxes.
    pub fn bf16_matrix(
        rows: usize,
        cols: usize,
        box_rows: usize,
    ) -> Result<MapGeometry, CudaError> {
        let pitch = cols as u64 * 2;
        let bad = |why: &str| CudaError::Unsupported {
            what: format!("a TMA tensor map of a {rows}×{cols} bf16 matrix: {why}"),
        };
        if rows == 0 || cols == 0 {
            return Err(bad("an empty matrix"));
        }
        if pitch % 16 != 0 {
            return Err(bad(
                "the row pitch must be a multiple of 16 bytes (columns % 8 == 0)",
            ));
        }
        if pitch >= 1 << 40 || rows as u64 >= 1 << 32 {
            return Err(bad("an extent beyond the tensor map's range"));
        }
        if box_rows == 0 || box_rows > 256 {
            return Err(bad("a box of 1 to 256 rows"));
        }
        Ok(MapGeometry {
            dims: vec![cols as u64, rows as u64],
            strides: vec![pitch],
            boxes: vec![TILE_K as u32, box_rows as u32],
            element_strides: vec![1, 1],
        })
    }

    /// The geometry of an NHWC bf16 tensor of `shape` = (images, rows, columns, channels) read
    /// in boxes of `TILE_K` channels × `tile` = (images, rows, columns), the rows and columns
    /// taken every `stride`-th (the input of a strided convolution).
    ///
    /// The driver's rules for traversal strides (CUDA Driver API, cuTensorMapEncodeTiled's
    /// `elementStrides`): each from 1 to 8, the innermost dimension's ignored without
    /// interleave, and a box of `boxDim` elements loads `ceil(boxDim / elementStrides)`, so a
    /// box of `tile × stride` loads the tile; `boxDim` stays within 1 to 256.
    pub fn bf16_nhwc(
        shape: (usize, usize, usize, usize),
        tile: (usize, usize, usize),
        stride: usize,
    ) -> Result<MapGeometry, CudaError> {
        let (n, h, w, c) = shape;
        let (tn, th, tw) = tile;
        let bad = |why: &str| CudaError::Unsupported {
            what: format!("a TMA tensor map of a {n}×{h}×{w}×{c} bf16 tensor: {why}"),
        };
        if n == 0 || h == 0 || w == 0 || c == 0 {
            return Err(bad("an empty tensor"));
        }
        if c % 8 != 0 {
            return Err(bad(
                "the pixel pitch must be a multiple of 16 bytes (channels % 8 == 0)",
            ));
        }
        if stride == 0 || stride > 8 {
            return Err(bad("a traversal stride of 1 to 8"));
        }
        let (bh, bw) = (th * stride, tw * stride);
        if [tn, bh, bw].iter().any(|&b| b == 0 || b > 256) {
            return Err(bad(
                "boxes of 1 to 256 images, rows and columns (stride × the tile's)",
            ));
        }
        let (pixel, row) = (c as u64 * 2, (w * c) as u64 * 2);
        let image = row * h as u64;
        if image * n as u64 >= 1 << 40 {
            return Err(bad("an extent beyond the tensor map's range"));
        }
        Ok(MapGeometry {
            dims: vec![c as u64, w as u64, h as u64, n as u64],
            strides: vec![pixel, row, image],
            boxes: vec![TILE_K as u32, bw as u32, bh as u32, tn as u32],
            element_strides: vec![1, stride as u32, stride as u32, 1],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::KernelFile;

    /// A layer of `n` square `hw × hw` images, padded as resnet's (1 for a 3×3, else 0).
    fn square(
        n: usize,
        hw: usize,
        c_in: usize,
        c_out: usize,
        kernel: usize,
        stride: usize,
    ) -> ConvShape {
        ConvShape {
            n,
            h: hw,
            w: hw,
            c_in,
            c_out,
            kernel,
            stride,
            padding: if kernel == 3 { 1 } else { 0 },
        }
    }

    fn shape(c_in: usize, c_out: usize, kernel: usize, stride: usize) -> ConvShape {
        square(2, 14, c_in, c_out, kernel, stride)
    }

    /// The constants mirror conv3.cu's macros, so the host's shared memory and grid fit the kernel.
    #[test]
    fn constants_mirror_the_kernel_file() {
        let text = KernelFile::by_name(FILE).unwrap().text;
        let define = |name: &str| -> usize {
            let line = text
                .lines()
                .find(|l| l.starts_with(&format!("#define {name} ")))
                .unwrap_or_else(|| panic!("conv3.cu defines {name}"));
            line.split_whitespace().nth(2).unwrap().parse().unwrap()
        };
        assert_eq!(define("C3_BM"), TILE_M);
        assert_eq!(define("C3_BN"), TILE_N);
        assert_eq!(define("C3_BK"), TILE_K);
        assert_eq!(define("C3_STAGES"), STAGES);
        assert_eq!(define("C3_THREADS"), THREADS as usize);
        assert!(text.contains("#define CONV3_SMEM_BYTES (C3_BARRIERS + 2 * C3_STAGES * 8 + 1024)"));
        assert!(text.contains("#define C3_BARRIERS (C3_STAGES * C3_STAGE_BYTES)"));
        assert!(text.contains("#define C3_STAGE_BYTES (2 * C3_TILE_BYTES)"));
        assert!(text.contains("#define C3_TILE_BYTES (C3_BM * C3_BK * 2)"));
        assert_eq!(SMEM_BYTES, 4 * 32768 + 64 + 1024);
        let names = KernelFile::by_name(FILE).unwrap().kernel_names();
        let gemms = [
            FWD_KERNEL,
            FWD_STATS_KERNEL,
            DGRAD_KERNEL,
            DGRAD_BN_KERNEL,
            FWD_3X3_KERNEL,
            FWD_STATS_3X3_KERNEL,
            DGRAD_3X3_KERNEL,
            DGRAD_BN_3X3_KERNEL,
            WGRAD_KERNEL,
            WGRAD_3X3_KERNEL,
        ];
        let narrow: Vec<&str> = gemms.iter().map(|k| with_tile(k, TILE_N_NARROW)).collect();
        let mut want: Vec<&str> = gemms.to_vec();
        want.extend(&narrow);
        want.extend([WGRAD_M64_KERNEL, WGRAD_3X3_M64_KERNEL]);
        want.extend(gemms.iter().filter_map(|k| persistent_twin(k)));
        want.extend(narrow.iter().filter_map(|k| persistent_twin(k)));
        want.extend([
            DGRAD_WEIGHTS_3X3_KERNEL,
            DGRAD_WEIGHTS_S2_KERNEL,
            TRANSPOSE_KERNEL,
        ]);
        assert_eq!(names, want);
        for k in gemms {
            assert_eq!(with_tile(k, TILE_N_NARROW), format!("{k}_n64"));
            assert_eq!(with_tile(k, TILE_N), k);
            assert_eq!(smem_bytes(with_tile(k, TILE_N_NARROW)), N64_SMEM_BYTES);
            assert_eq!(smem_bytes(k), SMEM_BYTES);
        }
        for k in [WGRAD_M64_KERNEL, WGRAD_3X3_M64_KERNEL] {
            assert_eq!(smem_bytes(k), N64_SMEM_BYTES);
            assert_eq!(kernel_tile(k), (64, 128));
        }
        assert!(text.contains(
            "#define CONV3_N64_SMEM_BYTES (C3_STAGES * (C3_TILE_BYTES + 64 * C3_BK * 2) + 2 * C3_STAGES * 8 + 1024)"
        ));
        assert_eq!(N64_SMEM_BYTES, 4 * 24576 + 64 + 1024);
        for line in [
            "#define C3_P_STAGES(BN) ((BN) == 128 ? 4 : 3)",
            "#define C3_P_EPI(BN) (C3_P_STAGES(BN) * (C3_TILE_BYTES + (BN) * C3_BK * 2) + 128)",
            "#define C3_P_SMEM(BN) (C3_P_EPI(BN) + C3_BM * ((BN) + 8) * 2 + 2 * (256 / ((BN) / 2)) * (BN) * 4 + 1024)",
            "#define CONV3_P_SMEM_BYTES C3_P_SMEM(128)",
            "#define CONV3_N64_P_SMEM_BYTES C3_P_SMEM(64)",
        ] {
            assert!(text.contains(line), "conv3.cu changed: {line}");
        }
        assert_eq!(P_SMEM_BYTES, 4 * 32768 + 128 + 128 * 136 * 2 + 4096 + 1024);
        assert_eq!(
            N64_P_SMEM_BYTES,
            3 * 24576 + 128 + 128 * 72 * 2 + 4096 + 1024
        );
        assert_eq!(std::mem::size_of::<Conv3Args>(), 52);
        let multi: Vec<&str> = text
            .split("struct Conv3Args {")
            .nth(1)
            .unwrap()
            .split("};")
            .next()
            .unwrap()
            .lines()
            .filter_map(|l| l.trim().strip_prefix("int "))
            .flat_map(|l| l.split(';').next().unwrap().split(','))
            .map(str::trim)
            .collect();
        assert_eq!(
            multi,
            [
                "m",
                "n",
                "k",
                "accumulate",
                "k_chunk",
                "height",
                "width",
                "tile_h",
                "tile_w",
                "pad",
                "taps",
                "flip",
                "stride"
            ]
        );
        assert_eq!(std::mem::size_of::<TensorMap>(), 128);
        assert!(std::mem::align_of::<TensorMap>() >= 64);
    }

    #[test]
    fn takes_hopper_one_by_one_layers_only() {
        let hopper = GpuArch::new(9, 0);
        assert!(takes(&shape(64, 256, 1, 1), hopper));
        assert!(takes(&shape(1024, 256, 1, 1), hopper));
        // 3×3, strided 1×1 (the downsampling shortcut), odd channels, other GPUs: v2.
        assert!(!takes(&shape(64, 64, 3, 1), hopper));
        assert!(!takes(&shape(256, 512, 1, 2), hopper));
        assert!(!takes(&shape(12, 64, 1, 1), hopper));
        assert!(!takes(&shape(64, 256, 1, 1), GpuArch::new(8, 0)));
        // Hopper only: not Ampere, nor a later architecture without sm_90a's instructions.
        assert!(runs_on(hopper) && !runs_on(GpuArch::new(8, 0)) && !runs_on(GpuArch::new(10, 0)));
        assert!(!takes(&shape(64, 256, 1, 1), GpuArch::new(10, 0)));
        let a = forward_args(&shape(64, 256, 1, 1)).unwrap();
        assert_eq!(
            a,
            Conv3Args {
                m: 392,
                n: 256,
                k: 64,
                accumulate: 0,
                k_chunk: 64,
                height: 0,
                width: 0,
                tile_h: 0,
                tile_w: 0,
                pad: 0,
                taps: 0,
                flip: 0,
                stride: 1
            }
        );
        assert_eq!(grid(&a), (4, 2, 1));
        let d = dgrad_args(&shape(64, 256, 1, 1), true).unwrap();
        assert_eq!(
            (d.m, d.n, d.k, d.accumulate, d.k_chunk),
            (392, 64, 256, 1, 256)
        );
        // resnet50's first 1×1 at batch 256 on 132 SMs: 64 × 64 channels over 802 816 pixels,
        // one tile, so the reduction is split into whole 64-pixel slices filling (nearly) a wave.
        let big = ConvShape {
            n: 256,
            h: 56,
            w: 56,
            c_in: 64,
            c_out: 64,
            kernel: 1,
            stride: 1,
            padding: 0,
        };
        let (w, slices) = wgrad_args(&big, 132).unwrap();
        assert_eq!((w.m, w.n, w.k), (64, 64, 802_816));
        assert_eq!(w.k_chunk % 64, 0);
        assert!(
            slices >= 120 && slices as i32 * w.k_chunk >= w.k,
            "{slices} × {}",
            w.k_chunk
        );
        assert!((slices as i32 - 1) * w.k_chunk < w.k, "no empty slice");
        assert_eq!(grid(&d), (4, 1, 1));
        assert_eq!(transpose_launch(256, 64), ((2, 8, 1), (32, 8, 1)));
    }

    #[test]
    fn three_by_three_tiles_are_whole() {
        let hopper = GpuArch::new(9, 0);
        // resnet50's stride-1 3×3 layers at batch 256: every tile whole.
        assert_eq!(tile_3x3(256, 56, 56), Some((2, 8, 8)));
        assert_eq!(tile_3x3(256, 28, 28), Some((8, 4, 4)));
        assert_eq!(tile_3x3(256, 14, 14), Some((32, 2, 2)));
        assert_eq!(tile_3x3(256, 7, 7), Some((128, 1, 1)));
        assert_eq!(tile_3x3(2, 16, 16), Some((1, 8, 16)));
        assert_eq!(
            tile_3x3(4, 7, 7),
            None,
            "4 images cannot fill 128 one-pixel tiles"
        );
        let s = |n, hw, c_in, c_out, stride| square(n, hw, c_in, c_out, 3, stride);
        let a = forward_4d_args(&s(256, 56, 64, 64, 1), hopper).unwrap();
        assert_eq!(
            (a.m, a.n, a.k, a.height, a.width, a.tile_h, a.tile_w, a.pad, a.taps, a.stride),
            (256 * 56 * 56, 64, 576, 56, 56, 8, 8, 1, 3, 1)
        );
        assert!(takes_forward(&s(256, 56, 64, 64, 1), hopper));
        // channels not a multiple of 64, other GPUs, no whole tile: v2.
        assert!(!takes_forward(&s(256, 56, 72, 64, 1), hopper));
        assert!(!takes_forward(&s(256, 56, 64, 64, 1), GpuArch::new(8, 0)));
        assert!(!takes_forward(&s(4, 7, 64, 64, 1), hopper));
        // Every pass of a stride-1 3×3 (takes() is the 1×1 rule).
        assert!(!takes(&s(256, 56, 64, 64, 1), hopper));
        assert!(takes_wgrad(&s(256, 56, 64, 64, 1), hopper));
        let (wa, slices, tile) = wgrad_4d_args(&s(256, 7, 512, 512, 1), hopper, 132).unwrap();
        assert_eq!(tile, (64, 1, 1));
        assert_eq!((wa.m, wa.n, wa.k), (512, 4608, 256 * 49));
        assert_eq!(wa.k_chunk % 64, 0);
        assert!(slices as i32 * wa.k_chunk >= wa.k && (slices as i32 - 1) * wa.k_chunk < wa.k);
        assert!(
            !takes_wgrad(&s(2, 7, 64, 64, 1), hopper),
            "2 images of 7×7: no 64-pixel tile"
        );
        assert!(takes_dgrad(&s(256, 56, 64, 64, 1), hopper));
        let d = dgrad_3x3_args(&s(256, 56, 128, 64, 1), hopper, true).unwrap();
        assert_eq!(
            (d.m, d.n, d.k, d.accumulate, d.flip, d.tile_h, d.tile_w),
            (256 * 56 * 56, 128, 576, 1, 1, 8, 8)
        );
        // The data gradient's reduction is over the output channels: 72 of them do not split
        // into whole 64-channel slices per tap.
        assert!(!takes_dgrad(&s(256, 56, 64, 72, 1), hopper));
        assert!(takes_forward(&s(256, 56, 64, 72, 1), hopper));
        let g = MapGeometry::bf16_nhwc((256, 56, 56, 64), (2, 8, 8), 1).unwrap();
        assert_eq!(g.dims, [64, 56, 56, 256]);
        assert_eq!(g.strides, [128, 56 * 128, 56 * 56 * 128]);
        assert_eq!(g.boxes, [64, 8, 8, 2]);
        assert_eq!(g.element_strides, [1, 1, 1, 1]);
        let e = MapGeometry::bf16_nhwc((2, 4, 4, 12), (1, 4, 4), 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("2×4×4×12") && e.contains("16 bytes"), "{e}");
    }

    #[test]
    fn strided_forwards_take_the_four_d_path() {
        let hopper = GpuArch::new(9, 0);
        let s = square;
        // resnet50's first 3×3 of stage 2 at batch 256: 56 → 28, tiles of 8 images × 4 × 4
        // output pixels, each input box 8 × 8 pixels traversed with stride 2.
        let a = forward_4d_args(&s(256, 56, 128, 128, 3, 2), hopper).unwrap();
        assert_eq!(
            (a.m, a.n, a.k, a.height, a.width, a.tile_h, a.tile_w),
            (256 * 28 * 28, 128, 9 * 128, 28, 28, 4, 4)
        );
        assert_eq!((a.pad, a.taps, a.stride, a.flip), (1, 3, 2, 0));
        // Its downsampling projection (1×1, stride 2, no padding): the one-tap case.
        let d = forward_4d_args(&s(256, 56, 256, 512, 1, 2), hopper).unwrap();
        assert_eq!(
            (d.m, d.n, d.k, d.height, d.width, d.pad, d.taps, d.stride),
            (256 * 28 * 28, 512, 256, 28, 28, 0, 1, 2)
        );
        assert!(takes_forward(&s(256, 56, 256, 512, 1, 2), hopper));
        assert!(takes_forward(&s(256, 14, 1024, 2048, 1, 2), hopper));
        assert!(takes_forward(&s(256, 14, 512, 512, 3, 2), hopper));
        // Odd input extents: 15 → 8 (3×3 pad 1) and 15 → 8 (1×1).
        let odd = forward_4d_args(&s(2, 15, 64, 64, 3, 2), hopper).unwrap();
        assert_eq!(
            (odd.height, odd.width, odd.tile_h, odd.tile_w),
            (8, 8, 8, 8)
        );
        assert!(forward_4d_args(&s(2, 15, 64, 64, 1, 2), hopper).is_some());
        // The stride-1 1×1 stays the plain GEMM; the stem (7×7, 3 channels), stride 3, a
        // strided 1×1 with padding, 64-channel tails and batches without a whole tile: not here.
        assert!(forward_4d_args(&s(256, 56, 64, 256, 1, 1), hopper).is_none());
        assert!(!takes_forward(&s(256, 224, 3, 64, 7, 2), hopper));
        assert!(!takes_forward(&s(256, 56, 64, 64, 3, 3), hopper));
        assert!(!takes_forward(
            &ConvShape {
                padding: 1,
                ..s(256, 56, 256, 512, 1, 2)
            },
            hopper
        ));
        assert!(!takes_forward(&s(256, 56, 72, 512, 1, 2), hopper));
        assert!(!takes_forward(&s(4, 13, 64, 64, 3, 2), hopper), "4 × 7 × 7");
        // The strided 3×3's data gradient: four phases over tiles of dy's 28 × 28 pixels, each
        // reducing its taps' rows of the [4][C][4·K] weight; with the batch-norm epilogue.
        let s3 = s(256, 56, 128, 128, 3, 2);
        assert!(takes_dgrad(&s3, hopper) && takes_dgrad_bn(&s3, hopper));
        let p = dgrad_3x3_args(&s3, hopper, false).unwrap();
        assert_eq!(p, dgrad_s2_args(&s3, hopper, false).unwrap());
        assert_eq!(
            (p.m, p.n, p.k, p.k_chunk, p.height, p.width, p.tile_h, p.tile_w),
            (256 * 28 * 28, 128, 512, 128, 28, 28, 4, 4)
        );
        assert_eq!((p.pad, p.taps, p.flip, p.stride), (1, 3, 1, 2));
        assert!(
            is_phased(&p)
                && !is_phased(&dgrad_3x3_args(&s(256, 56, 128, 128, 3, 1), hopper, false).unwrap())
        );
        assert_eq!(grid(&p), (256 * 28 * 28 / 128, 1, 4));
        // Odd extents (phases of different sizes), output channels not in 64s, no whole tile,
        // other GPUs: v2.
        assert!(!takes_dgrad(&s(2, 15, 128, 128, 3, 2), hopper));
        assert!(!takes_dgrad(&s(4, 16, 64, 72, 3, 2), hopper));
        assert!(!takes_dgrad(&s(4, 14, 64, 64, 3, 2), hopper), "4 × 7 × 7");
        assert!(!takes_dgrad(&s3, GpuArch::new(8, 0)));
        // The strided 1×1's: the dgrad GEMM over dy's 28 × 28 pixels, scattered to dx's
        // 56 × 56 (the extents and stride in the arguments); without the batch-norm epilogue.
        let down = s(256, 56, 256, 512, 1, 2);
        assert!(takes_dgrad(&down, hopper) && takes_strided_dgrad(&down, hopper));
        assert!(!takes_dgrad_bn(&down, hopper));
        let d = dgrad_args(&down, true).unwrap();
        assert_eq!(
            (d.m, d.n, d.k, d.accumulate, d.height, d.width, d.stride),
            (256 * 28 * 28, 256, 512, 1, 56, 56, 2)
        );
        assert_eq!((d.tile_h, d.tile_w, d.taps, d.pad, d.flip), (0, 0, 0, 0, 0));
        // Odd 15 × 15 → 8 × 8 pixels of dy; 64 input channels: the 64-column twin.
        let odd = dgrad_args(&s(2, 15, 64, 136, 1, 2), false).unwrap();
        assert_eq!(
            (odd.m, odd.n, odd.height, odd.stride),
            (2 * 8 * 8, 64, 15, 2)
        );
        assert_eq!(with_tile(DGRAD_KERNEL, tile_n(&odd)), "conv3_dgrad_1x1_n64");
        // Not Hopper, odd channels, padding: v2.
        assert!(!takes_dgrad(&down, GpuArch::new(8, 0)));
        assert!(!takes_dgrad(&s(256, 56, 256, 516, 1, 2), hopper));
        assert!(!takes_dgrad(&ConvShape { padding: 1, ..down }, hopper));
        // Stride-1 layers keep their epilogue (and their arguments: no scatter).
        assert!(takes_dgrad_bn(&s(256, 56, 256, 512, 1, 1), hopper));
        assert!(takes_dgrad_bn(&s(256, 56, 64, 64, 3, 1), hopper));
        assert_eq!(
            dgrad_args(&s(256, 56, 256, 512, 1, 1), false)
                .unwrap()
                .stride,
            1
        );
        // Weight gradients: 64-pixel tiles of the output, x's boxes at stride 2.
        let (w3, slices, tile) = wgrad_4d_args(&s(256, 56, 128, 128, 3, 2), hopper, 132).unwrap();
        assert_eq!(tile, (4, 4, 4));
        assert_eq!((w3.m, w3.n, w3.k), (128, 1152, 256 * 28 * 28));
        assert_eq!((w3.height, w3.width, w3.tile_h, w3.tile_w), (28, 28, 4, 4));
        assert_eq!((w3.pad, w3.taps, w3.stride), (1, 3, 2));
        assert!(slices as i32 * w3.k_chunk >= w3.k && (slices as i32 - 1) * w3.k_chunk < w3.k);
        let (w1, _, tile) = wgrad_4d_args(&s(256, 14, 1024, 2048, 1, 2), hopper, 132).unwrap();
        assert_eq!(tile, (64, 1, 1));
        assert_eq!((w1.m, w1.n, w1.k), (2048, 1024, 256 * 49));
        assert_eq!((w1.pad, w1.taps, w1.stride), (0, 1, 2));
        assert!(takes_wgrad(&s(256, 56, 256, 512, 1, 2), hopper));
        assert!(takes_wgrad(&s(256, 56, 128, 128, 3, 2), hopper));
        // A strided 1×1 with 64 input channels (resnet18's first downsampling projection):
        // N = 64, the 3×3 weight gradient's 64-column twin.
        assert!(takes_wgrad(&s(256, 56, 64, 128, 1, 2), hopper));
        let (wn, _, _) = wgrad_4d_args(&s(256, 56, 64, 128, 1, 2), hopper, 132).unwrap();
        assert_eq!((wn.m, wn.n, wn.taps), (128, 64, 1));
        assert_eq!(wgrad_kernel(WGRAD_3X3_KERNEL, &wn), "conv3_wgrad_3x3_n64");
        assert_eq!(wgrad_grid("conv3_wgrad_3x3_n64", &wn, 5), (1, 1, 5));
        assert!(takes_forward(&s(256, 56, 64, 512, 1, 2), hopper));
        // The stride-1 1×1 stays the plain GEMM.
        assert!(wgrad_4d_args(&s(256, 56, 256, 512, 1, 1), hopper, 132).is_none());
        // The input's map: boxes of stride × the tile's columns and rows, traversal strides 2.
        let g = MapGeometry::bf16_nhwc((256, 56, 56, 128), (8, 4, 4), 2).unwrap();
        assert_eq!(g.dims, [128, 56, 56, 256]);
        assert_eq!(g.boxes, [64, 8, 8, 8]);
        assert_eq!(g.element_strides, [1, 2, 2, 1]);
    }

    #[test]
    fn weight_gradients_of_64_output_channels_take_the_short_tiles() {
        let hopper = GpuArch::new(9, 0);
        let s = square;
        assert_eq!(wgrad_tile(64, 576), (64, 128));
        assert_eq!(wgrad_tile(40, 65), (64, 128));
        assert_eq!(
            wgrad_tile(64, 64),
            (128, 64),
            "both short: the 64-column twin"
        );
        assert_eq!(wgrad_tile(128, 576), (128, 128));
        assert_eq!(wgrad_tile(65, 576), (128, 128));
        // resnet18's layer1 3×3 at batch 256: M = 64, N = 576 in five 128-column tiles of 64
        // rows; two blocks an SM, so the reduction splits over 264 slots.
        let l1 = s(256, 56, 64, 64, 3, 1);
        let (a, slices, _) = wgrad_4d_args(&l1, hopper, 132).unwrap();
        assert_eq!((a.m, a.n, a.k), (64, 576, 256 * 56 * 56));
        let kernel = wgrad_kernel(WGRAD_3X3_KERNEL, &a);
        assert_eq!(kernel, WGRAD_3X3_M64_KERNEL);
        assert_eq!(wgrad_grid(kernel, &a, slices), (1, 5, slices as u32));
        let waves = (5 * slices) as f64 / 264.0;
        assert!(
            waves >= 1.0 && waves.ceil() - waves < 0.05,
            "{slices} slices"
        );
        assert!(slices as i32 * a.k_chunk >= a.k && (slices as i32 - 1) * a.k_chunk < a.k);
        // resnet50's 1×1 of 256 → 64 channels: the 1×1 twin.
        let (b, slices) = wgrad_args(&s(256, 56, 256, 64, 1, 1), 132).unwrap();
        assert_eq!((b.m, b.n), (64, 256));
        let kernel = wgrad_kernel(WGRAD_KERNEL, &b);
        assert_eq!(kernel, WGRAD_M64_KERNEL);
        assert_eq!(wgrad_grid(kernel, &b, slices), (1, 2, slices as u32));
        // 64 → 64 (N ≤ 64 too) keeps the 64-column twin; wider layers the 128 × 128 tiles.
        let (c, _) = wgrad_args(&s(256, 56, 64, 64, 1, 1), 132).unwrap();
        assert_eq!(wgrad_kernel(WGRAD_KERNEL, &c), "conv3_wgrad_1x1_n64");
        let (d, _, _) = wgrad_4d_args(&s(256, 28, 128, 128, 3, 1), hopper, 132).unwrap();
        assert_eq!(wgrad_kernel(WGRAD_3X3_KERNEL, &d), WGRAD_3X3_KERNEL);
        assert_eq!(wgrad_grid(WGRAD_3X3_KERNEL, &d, 3), (1, 9, 3));
    }

    #[test]
    fn map_geometry_follows_the_driver_rules() {
        let g = MapGeometry::bf16_matrix(392, 64, 128).unwrap();
        assert_eq!(g.dims, [64, 392]);
        assert_eq!(g.strides, [128]);
        assert_eq!(g.boxes, [64, 128]);
        for (rows, cols, box_rows, why) in [
            (10, 12, 128, "multiple of 16 bytes"),
            (0, 64, 128, "empty"),
            (10, 64, 0, "1 to 256 rows"),
            (10, 64, 257, "1 to 256 rows"),
        ] {
            let e = MapGeometry::bf16_matrix(rows, cols, box_rows)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(why) && e.contains(&format!("{rows}×{cols}")),
                "{e}"
            );
        }
        assert_eq!(g.element_strides, [1, 1]);
        // Traversal strides 1 to 8, and boxes (stride × the tile) of at most 256.
        for (tile, stride, why) in [
            ((1, 8, 8), 0, "traversal stride of 1 to 8"),
            ((1, 8, 8), 9, "traversal stride of 1 to 8"),
            ((1, 1, 128), 4, "1 to 256"),
        ] {
            let e = MapGeometry::bf16_nhwc((2, 16, 16, 64), tile, stride)
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{e}");
        }
        let wide = MapGeometry::bf16_nhwc((2, 16, 256, 64), (1, 1, 128), 2).unwrap();
        assert_eq!(wide.boxes, [64, 256, 2, 1]);
    }
}
