//! The Hopper convolution kernels (kernels/conv3.cu, `BIRDTRAIN_CONV=v3`): which layers they
//! take, their launch geometry, and the TMA tensor maps that feed them.
//!
//! conv3.cu computes 1×1 convolutions at stride 1 without padding as `wgmma` GEMMs whose
//! operands the Tensor Memory Accelerator loads; every other layer (and every layer on a GPU
//! other than compute capability 9.0) keeps the v2 kernels. The file is compiled for the
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

/// The forward kernel: `y = x · wᵀ`.
pub const FWD_KERNEL: &str = "conv3_fwd_1x1";
/// The forward kernel whose epilogue writes per-tile (mean, M2) records of y, in conv2.cu's
/// record layout (`[2][tiles][channels]`), which bn.cu's merges read.
pub const FWD_STATS_KERNEL: &str = "conv3_fwd_stats_1x1";
/// The data gradient: `dx = dy · wt ᵀ` with the transposed weight (+ dx when accumulating).
pub const DGRAD_KERNEL: &str = "conv3_dgrad_1x1";
/// The data gradient finishing the gradient of the batch norm before the convolution
/// (residual gradient, ReLU mask, per-tile Σg and Σg·x̂ records): conv2_dgrad_bn_*'s contract.
pub const DGRAD_BN_KERNEL: &str = "conv3_dgrad_bn_1x1";
/// The weight gradient: f32 planes of `dyᵀ · x` per reduction slice (MN-major operands), summed
/// in slice order by conv2.cu's `conv2_wgrad_reduce`.
pub const WGRAD_KERNEL: &str = "conv3_wgrad_1x1";
/// The weight transpose the data gradient reads (`[K][C]` → `[C][K]`, K-major for wgmma).
pub const TRANSPOSE_KERNEL: &str = "conv3_transpose_weights";

/// Kernel-side mirror of `struct Conv3Args` in kernels/conv3.cu (4 ints, C layout).
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
}

// SAFETY: repr(C) plain integers, matching the kernel's struct.
unsafe impl DeviceRepr for Conv3Args {}

/// Whether the v3 kernels take a layer on a device of architecture `arch`: Hopper
/// (compute capability 9.0, whose `sm_90a` image has `wgmma`), a 1×1 filter at stride 1 without
/// padding, channel counts the tensor maps' 16-byte row pitches allow (multiples of 8), and
/// extents that fit the kernel's 32-bit indices.
pub fn takes(s: &ConvShape, arch: GpuArch) -> bool {
    (arch.major, arch.minor) == (9, 0)
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
    })
}

/// The GEMM of a 1×1 data gradient: M = pixels, N = input channels, K = output channels.
pub fn dgrad_args(s: &ConvShape, accumulate: bool) -> Option<Conv3Args> {
    let f = forward_args(s)?;
    Some(Conv3Args {
        n: f.k,
        k: f.n,
        accumulate: i32::from(accumulate),
        k_chunk: f.n,
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
    let tiles = m.div_ceil(TILE_M) * n.div_ceil(TILE_N);
    let (_, chunk) = super::conv::wgrad_splits(tiles, pixels, sms);
    let chunk = chunk.div_ceil(TILE_K) * TILE_K;
    let slices = pixels.div_ceil(chunk);
    Some((
        Conv3Args {
            m: f.n,
            n: f.k,
            k: f.m,
            accumulate: 0,
            k_chunk: i32::try_from(chunk).ok()?,
        },
        slices,
    ))
}

/// conv3_transpose_weights' launch over a `[rows][cols]` weight: blocks of 32 × 8 threads,
/// one per 32 × 32 tile.
pub fn transpose_launch(rows: usize, cols: usize) -> ((u32, u32, u32), (u32, u32, u32)) {
    (
        (cols.div_ceil(32) as u32, rows.div_ceil(32) as u32, 1),
        (32, 8, 1),
    )
}

/// The grid of a GEMM: one block per 128 × 128 output tile.
pub fn grid(a: &Conv3Args) -> (u32, u32, u32) {
    (
        (a.m as usize).div_ceil(TILE_M) as u32,
        (a.n as usize).div_ceil(TILE_N) as u32,
        1,
    )
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
        let geometry = MapGeometry::bf16_matrix(rows, cols, box_rows)?;
        if ptr % 16 != 0 {
            return Err(CudaError::Unsupported {
                what: format!("a TMA tensor map of a matrix at {ptr:#x}: needs 16-byte alignment"),
            });
        }
        let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
        // SAFETY: every array has the rank's length (2); the driver writes the 128-byte map.
        let result = unsafe {
            sys::cuTensorMapEncodeTiled(
                map.as_mut_ptr(),
                sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                2,
                ptr as *mut std::ffi::c_void,
                geometry.dims.as_ptr(),
                geometry.strides.as_ptr(),
                geometry.boxes.as_ptr(),
                [1u32, 1].as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        result.result().map_err(CudaError::driver(format!(
            "cuTensorMapEncodeTiled for a {rows}×{cols} bf16 matrix"
        )))?;
        // SAFETY: the call succeeded, so the driver wrote the map.
        Ok(TensorMap(unsafe { map.assume_init() }))
    }
}

/// The extents cuTensorMapEncodeTiled is given for a row-major bf16 matrix (innermost
/// dimension first), checked against the driver's rules without a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapGeometry {
    /// Extents: columns, rows.
    pub dims: [u64; 2],
    /// Bytes between consecutive rows (the driver takes the strides of dimensions 1..).
    pub strides: [u64; 1],
    /// Box extents: `TILE_K` columns (128 bytes, the swizzle span), `box_rows` rows.
    pub boxes: [u32; 2],
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
            dims: [cols as u64, rows as u64],
            strides: [pitch],
            boxes: [TILE_K as u32, box_rows as u32],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::KernelFile;

    fn shape(c_in: usize, c_out: usize, kernel: usize, stride: usize) -> ConvShape {
        ConvShape {
            n: 2,
            h: 14,
            w: 14,
            c_in,
            c_out,
            kernel,
            stride,
            padding: if kernel == 3 { 1 } else { 0 },
        }
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
        assert_eq!(
            names,
            [
                FWD_KERNEL,
                FWD_STATS_KERNEL,
                DGRAD_KERNEL,
                DGRAD_BN_KERNEL,
                WGRAD_KERNEL,
                TRANSPOSE_KERNEL
            ]
        );
        assert_eq!(std::mem::size_of::<Conv3Args>(), 20);
        let fields: Vec<&str> = text
            .split("struct Conv3Args {")
            .nth(1)
            .unwrap()
            .split("};")
            .next()
            .unwrap()
            .lines()
            .filter_map(|l| l.trim().strip_prefix("int "))
            .map(|l| l.split(';').next().unwrap())
            .collect();
        assert_eq!(fields, ["m", "n", "k", "accumulate", "k_chunk"]);
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
        assert!(!takes(&shape(64, 256, 1, 1), GpuArch::new(10, 0)));
        let a = forward_args(&shape(64, 256, 1, 1)).unwrap();
        assert_eq!(
            a,
            Conv3Args {
                m: 392,
                n: 256,
                k: 64,
                accumulate: 0,
                k_chunk: 64
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
    }
}
