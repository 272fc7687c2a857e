// conv3.cu: the third generation of the convolution kernels, for Hopper (sm_90a): 1×1
// convolutions as GEMMs on the warpgroup tensor-core instruction (`wgmma.mma_async`), fed by
// the Tensor Memory Accelerator (TMA) through a ring of shared-memory stages guarded by
// mbarriers, with one producer warpgroup and two consumer warpgroups (warp specialisation).
// Only the `sm_90a` target compiles the Hopper code (NVRTC rejects `wgmma` for plain sm_90);
// for any other target every kernel here is a stub that traps, and the host launches these
// kernels only on a compute capability 9.0 device with the sm_90a image
// (`BIRDTRAIN_CONV=v3`, src/cuda/conv3.rs). conv2.cu stays the default until this file has
// been measured faster on a GPU.
//
// Algorithm. A 1×1 convolution at stride 1 without padding is the GEMM
//   y[M][N] = x[M][K] · w[N][K]ᵀ,  M = batch·height·width pixels, K = input channels,
//                                  N = output channels (NHWC activations, KRSC = [N][K] weights),
// both operands K-major (the reduction dimension contiguous), f32 accumulation, bf16 output.
// The block's 128×128 output tile is split by rows between the two consumer warpgroups (64
// rows each, one m64n128k16 wgmma per 16 of K). The k-loop walks K in BK = 64 slices: the
// producer's elected thread waits until the consumers have released stage s (its "empty"
// mbarrier), announces the stage's bytes on its "full" mbarrier (arrive.expect_tx) and issues
// two TMA box loads (A: 64 channels × 128 pixels, B: 64 channels × 128 output channels),
// whose completion the TMA unit reports to that mbarrier. Each consumer warpgroup waits on
// the full mbarrier, issues four wgmma (k = 0, 16, 32, 48 of the slice: the descriptor's start
// address advanced by 32 bytes inside the swizzle atom), commits them as one group, waits for
// the previous slice's group (`wgmma.wait_group 1`: one group stays in flight) and then
// releases that previous slice's stage. Everything outside the tensors (the M, N and K tails)
// is filled with zeros by the TMA unit, so no thread tests a bound in the k-loop. The first
// wgmma of the tile overwrites the accumulators (scale-d = 0) instead of zeroing them first.
// 3×3 convolutions at stride 1 take the same loop (TAPS): the block's 128 output rows are a
// tile of whole images × rows × columns of the output (powers of two that divide the batch,
// height and width, chosen by the host), the reduction runs over (tap, channel) with the
// weight as [K][9·C], and the A box of each k-step is the input's 4-D tile (64 channels × the
// tile's columns × rows × images) shifted by the tap, which TMA fills with zeros where it
// leaves the image: the padding costs nothing and no thread computes an address. Strided
// layers (3×3 and 1×1 at stride 2; args.stride) take it too, forward and weight gradient
// (conv3_wgrad_3x3, x's boxes strided): the input's tensor map
// has traversal strides of 2 over rows and columns, so the box of a tile's tap starts at
// (output pixel × 2 − pad + tap) and lands densely like the stride-1 one; a strided 1×1 is the
// one-tap case (taps = 1, pad 0). The data gradient of a strided 1×1 is the stride-1 dgrad
// GEMM over dy's pixels with a scattered epilogue (args.stride > 1: row (n, p, q) to dx's
// pixel (n, 2p, 2q), zeros to the rest of each 2 × 2 cell unless accumulating); the strided
// 3×3's data gradient (pad 1, even extents) runs conv2.cu's stride² phases on the same loop:
// grid.z = 4 parities of dx, each a stride-1 correlation of dy with its 1, 2 or 4 taps, its
// tiles' pixels scattered to dx's (2h + ph, 2w + pw) (PHASES). The stem stays on v2.
// Epilogue (all 384 threads): the accumulators are rounded to bf16 and staged in shared
// memory, written as whole 16-byte chunks, and (conv3_fwd_stats_1x1) each output channel's
// tile statistics (mean, M2 over the tile's rows, two passes over the staged bf16 tile,
// summed in a fixed order) are written as per-tile records in conv2.cu's layout, which bn.cu
// merges (bn_stats_merge): the same bits every run, in any block order. The data gradients'
// batch-norm epilogue (BN_GRAD) takes the ReLU's mask from the batch norm's stored output y, or,
// given none (null bn_y: BIRDTRAIN_BN_MASK=recomputed, or an output never stored), recomputes
// it from x in the sums of Σg·x̂, which hold the column pair's x, statistics, γ and β in
// registers; it then writes g after them (per chunk, the recomputation would cost a 16-byte
// load of x and 32 scalar loads of the parameters). Given y's signs packed a bit per element
// (bn_signs, from bn_apply_signs_vec: the batch norms with a residual, whose mask x alone does
// not give) instead of y, it reads a byte of them per 16-byte chunk: 1/16 of y's bytes. In a
// one-tile block the producer warpgroup's idle threads prefetch those operands into L2 while
// the tile's loads and GEMM run (c3_prefetch_epilogue).
//
// Data layout. x: NHWC bf16 viewed as [M][K]; w: [N][K] bf16; y: [M][N] bf16; K % 8 == 0 and
// N % 8 == 0 (the tensor maps need 16-byte row pitches). Shared memory, from a 1024-byte
// aligned base: STAGES × (A tile 128 rows × 128 bytes, B tile 128 rows × 128 bytes), each row
// holding 64 channels in the 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8),
// the pattern both TMA and wgmma apply to address bits), then the STAGES full and STAGES empty
// mbarriers. The epilogue reuses the stages for the staged tile ([128][128 + 8] bf16) and its
// reduction scratch. part ([2][gridDim.x][N]: tile means, then M2) as conv2_fwd_stats_*.
//
// Launch configuration. grid = (ceil(M/128), ceil(N/128), reduction slices or the 4 phases), 384 threads (warpgroup 0 the
// producer, 1 and 2 the consumers), dynamic shared memory CONV3_SMEM_BYTES (4 stages of
// 32 KiB, the barriers and 1 KiB of alignment slack: 132 KiB, one block per SM), the tensor
// maps as `__grid_constant__` parameters (src/cuda/conv3.rs encodes them with
// cuTensorMapEncodeTiled: bf16, 2-D, box 64 × 128, 128-byte swizzle, zero fill). The `_n64`
// twins (64-column tiles) and the weight gradients' `_m64` twins (64-row tiles, the consumers
// splitting the columns) have stages of 24 KiB and run two blocks an SM.
#include "common.cuh"

// The GEMM's shape; mirrors `Conv3Args` in src/cuda/conv3.rs (repr(C), 13 ints).
struct Conv3Args {
    int m;           // rows: pixels
    int n;           // columns: output channels (dgrad: input channels), % 8 == 0
    int k;           // reduction: input channels (dgrad: output channels), % 8 == 0
    int accumulate;  // dgrad: add into the output instead of overwriting it
    int k_chunk;     // reduction per gridDim.z slice (a multiple of C3_BK; wgrad splits, else k)
    // 4-D path (TAPS): the output's height and width, the tile's height and width in pixels
    // (tile_h · tile_w divides 128; the rest of the 128 rows are whole images), the padding
    // and the filter size (3, or 1 for a strided 1×1); 0 for the 2-D 1×1 kernels, except that
    // the strided 1×1's data gradient (2-D, stride > 1) takes dx's height and width here.
    int height, width, tile_h, tile_w, pad, taps;
    // 3×3 dgrad: the input box shifted by pad − tap instead of tap − pad; with stride 2 the
    // four phases (PHASES: height × width = dy's extents, k = 4·K, k_chunk = K)
    int flip;
    // TAPS: the convolution's stride (1 or 2): output pixel (h, w) reads input row h·stride +
    // tap row − pad. The input's tensor map walks the box with the same traversal stride
    // (cuTensorMapEncodeTiled's elementStrides), so a box still lands as tile_w × tile_h ×
    // images rows of 64 channels and the k-loop is the stride-1 one. The 2-D dgrad at
    // stride > 1: the epilogue's scatter of dy's pixels to every stride-th pixel of dx.
    int stride;
};

// The batch-norm epilogues' operands (conv2.cu's BnEpilogue, the same records and the same mask:
// from bn_y, or recomputed from bn_x, γ, β when the batch norm's output is not stored).
struct Conv3Epilogue {
    float* part;           // the per-tile records
    const bf16* bn_y;      // BN_GRAD: the batch norm's output (this convolution's input); may be null
    const bf16* bn_x;      // BN_GRAD: the batch norm's input
    const float* mean;     // BN_GRAD: its saved mean and 1/sqrt(var + eps)
    const float* invstd;
    const bf16* residual;  // BN_GRAD: a gradient added before the mask; may be null
    const bf16* gamma;     // BN_GRAD with relu and no bn_y: its scale and shift, to recompute y
    const bf16* beta;
    int relu;              // BN_GRAD: mask with [y > 0], y = bn_y, or recomputed from bn_x if null
    // BN_GRAD: y's signs packed a bit per element (bn_apply_signs_vec), read for the mask
    // instead of y (bn_y null); may be null
    const unsigned char* bn_signs;
};

#define C3_BM 128
#define C3_BN 128
#define C3_BK 64
#define C3_STAGES 4
#define C3_THREADS 384
#define C3_TILE_BYTES (C3_BM * C3_BK * 2)        // A and B tiles alike: 16 KiB
#define C3_STAGE_BYTES (2 * C3_TILE_BYTES)
#define C3_BOX_BYTES (64 * C3_BK * 2)             // an MN-major box: 64 MN × 64 k, 8 KiB
#define C3_BARRIERS (C3_STAGES * C3_STAGE_BYTES)  // offset of the mbarriers from the base
#define CONV3_SMEM_BYTES (C3_BARRIERS + 2 * C3_STAGES * 8 + 1024)
// The _n64 kernels' stages hold a B tile of 64 rows; the _m64 ones an A tile of 64 rows (24 KiB alike).
#define CONV3_N64_SMEM_BYTES (C3_STAGES * (C3_TILE_BYTES + 64 * C3_BK * 2) + 2 * C3_STAGES * 8 + 1024)
#define C3_LDC (C3_BN + 8)  // row pitch of the staged output tile, in elements

#if defined(BT_EMULATE) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define C3_HOPPER 1
#endif

#ifndef BT_EMULATE
// The driver's CUtensorMap (cuda.h): 128 opaque bytes, 64-byte aligned (the emulator has its
// own, kernels/emu/hopper.h).
struct __align__(64) CUtensorMap {
    unsigned long long opaque[16];
};
#endif

#ifdef C3_HOPPER
// ---- Hopper instructions (PTX ISA 8.0, sm_90a) --------------------------------------------

// The offset of a shared-memory pointer in the block's shared window.
__device__ __forceinline__ unsigned c3_shared(const void* p) {
#ifdef BT_EMULATE
    return emu_shared_offset(p);
#else
    return (unsigned)__cvta_generic_to_shared(p);
#endif
}

__device__ __forceinline__ void c3_mbar_init(unsigned bar, unsigned count) {
#ifdef BT_EMULATE
    bt_emu_mbar_init(bar, (int)count);
#else
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#endif
}

// Makes the barriers' initialisation visible to the other threads and to the TMA unit.
__device__ __forceinline__ void c3_fence_barrier_init() {
#ifndef BT_EMULATE
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void c3_mbar_arrive(unsigned bar) {
#ifdef BT_EMULATE
    bt_emu_mbar_arrive(bar);
#else
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
#endif
}

// One arrival that also announces `bytes` of TMA transactions to complete the phase.
__device__ __forceinline__ void c3_mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
#ifdef BT_EMULATE
    bt_emu_mbar_arrive_expect_tx(bar, bytes);
#else
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
#endif
}

// Waits until the phase of parity `parity` of the barrier has completed.
__device__ __forceinline__ void c3_mbar_wait(unsigned bar, unsigned parity) {
#ifdef BT_EMULATE
    while (!bt_emu_mbar_try_wait(bar, parity)) {
    }
#else
    unsigned done = 0;
    do {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
#endif
}

// TMA: the box at (c0, c1) of the tensor `map` into shared memory at `dst`, completing
// its bytes on the mbarrier `bar`.
__device__ __forceinline__ void c3_tma_load(unsigned dst, const CUtensorMap* map, int c0, int c1, unsigned bar) {
#ifdef BT_EMULATE
    bt_emu_tma_load_2d(dst, map, c0, c1, bar);
#else
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
#endif
}

// TMA: the 4-D box at (c0, c1, c2, c3) (channels, column, row, image of an NHWC tensor);
// coordinates outside the tensor (the padding) read as zeros.
__device__ __forceinline__ void c3_tma_load_4d(unsigned dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                               unsigned bar) {
#ifdef BT_EMULATE
    bt_emu_tma_load_4d(dst, map, c0, c1, c2, c3, bar);
#else
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
        "[%6];\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
#endif
}

// The descriptor of a K-major bf16 operand in the 128-byte swizzle: rows of 128 bytes, 8-row
// atoms 1024 bytes apart (the stride-dimension offset), the leading-dimension offset unused.
__device__ __forceinline__ unsigned long long c3_desc(unsigned addr) {
    return (unsigned long long)((addr & 0x3ffffu) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
           (1ull << 62);
}

// The descriptor of an MN-major bf16 operand in the 128-byte swizzle, as TMA boxes of 64 MN
// elements (128 bytes) × 64 k lay it out: element (mn, k) at (mn % 64)·2 + (k % 8)·128 bytes
// in 8-k atoms 1024 bytes apart (the stride-dimension offset), the next 64 MN elements one box
// (C3_BOX_BYTES) further (the leading-dimension offset); PTX ISA's canonical layout
// ((8,8,m),(8,k)):((1,8,LBO),(64,SBO)) in elements.
__device__ __forceinline__ unsigned long long c3_desc_mn(unsigned addr) {
    return (unsigned long long)((addr & 0x3ffffu) >> 4) | ((unsigned long long)(C3_BOX_BYTES >> 4) << 16) |
           ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void c3_wgmma_fence() {
#ifdef BT_EMULATE
    bt_emu_wgmma_fence();
#else
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void c3_wgmma_commit() {
#ifdef BT_EMULATE
    bt_emu_wgmma_commit();
#else
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void c3_wgmma_wait(float* d) {
#ifdef BT_EMULATE
    (void)d;
    bt_emu_wgmma_wait(N);
#else
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// d (64 f32 per thread, the m64n128 accumulator fragment) = A·Bᵀ (+ d when scale_d).
// TA / TB: 1 when A / B is MN-major (the instruction's imm-trans-a / imm-trans-b).
template <int TA, int TB>
__device__ __forceinline__ void c3_wgmma_m64n128k16(float* d, unsigned long long desc_a, unsigned long long desc_b,
                                                    int scale_d) {
#ifdef BT_EMULATE
    bt_emu_wgmma(d, 128, desc_a, desc_b, scale_d != 0, TA != 0, TB != 0);
#else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, %67, %68;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TA), "n"(TB)
        : "memory");
#endif
}

// d (32 f32 per thread, the m64n64 accumulator fragment) = A·Bᵀ (+ d when scale_d).
template <int TA, int TB>
__device__ __forceinline__ void c3_wgmma_m64n64k16(float* d, unsigned long long desc_a, unsigned long long desc_b,
                                                   int scale_d) {
#ifdef BT_EMULATE
    bt_emu_wgmma(d, 64, desc_a, desc_b, scale_d != 0, TA != 0, TB != 0);
#else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1, %35, %36;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TA), "n"(TB)
        : "memory");
#endif
}

// The wgmma of a BN-wide tile (128 or 64 columns).
template <int BN, int TA, int TB>
__device__ __forceinline__ void c3_wgmma(float* d, unsigned long long desc_a, unsigned long long desc_b, int scale_d) {
    if (BN == 128) c3_wgmma_m64n128k16<TA, TB>(d, desc_a, desc_b, scale_d);
    else c3_wgmma_m64n64k16<TA, TB>(d, desc_a, desc_b, scale_d);
}

// Keeps the compiler from moving accesses of the accumulators across a wgmma fence or wait
// (the tensor cores write them asynchronously).
template <int N>
__device__ __forceinline__ void c3_fence_acc(float* d) {
#ifndef BT_EMULATE
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
#else
    (void)d;
#endif
}

// setmaxnreg (PTX ISA 8.0, sm_90a): the warpgroup gives registers back to the block's pool
// (dec) or takes them from it (inc), so a persistent block's producer, one thread issuing
// TMA loads, runs on few registers and its consumers, which hold the accumulators and the
// epilogue's operands, on more: one block an SM (168 a thread at launch): 24, the least the
// instruction takes and enough for the producer's loop, and 240 (128·24 + 256·240 = 64 512 =
// 384·168), which the 128-column data gradients' consumers need to hold a whole tile's
// epilogue operands beside the accumulators (C3EpiOperands); two (80 at launch): 32 and 104
// (128·32 + 256·104 = 30 720 = 384·80). An inc beyond what the decs freed would wait forever.
// Every thread of the warpgroup executes it.
template <int REGS>
__device__ __forceinline__ void c3_setmaxnreg_dec() {
#ifndef BT_EMULATE
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
#endif
}

template <int REGS>
__device__ __forceinline__ void c3_setmaxnreg_inc() {
#ifndef BT_EMULATE
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
#endif
}
#endif  // C3_HOPPER

enum { C3_EPI_NONE = 0, C3_EPI_STATS = 1, C3_EPI_BN_GRAD = 2, C3_EPI_WGRAD = 3 };

#ifdef BT_EMULATE
#define C3_SMEM(name) unsigned char* name = g_emu_shared
#else
#define C3_SMEM(name) extern __shared__ __align__(1024) unsigned char name[]
#endif

// One output tile: its first row and column, its reduction slice or phase z, its record
// (z · the row tiles + its row tile: the per-tile statistics' index), the k-steps it runs and,
// on the 4-D forward and data-gradient path, its first image, row and column of the output.
struct C3Tile {
    int m0, n0, z, record;
    int k_begin, kt_count;
    int img0, h0, w0, slices;
    // PHASES: the stride-2 3×3's data gradient (pad 1), as conv2.cu's phases: z = (ph, pw) is
    // the parity of dx's rows and columns, a stride-1 correlation of dy with the taps
    // r ≡ ph + 1 (mod 2) (1 + ph of them; tc = 1 + pw along the columns), a.height × a.width =
    // dy's extents = the phase's (dx's halved), the reduction tr·tc·K (a.k_chunk = K) over the
    // phase's rows of wt ([4 phases][C][4·K], conv3_dgrad_weights_s2).
    int ph, pw, tc;
    bool phases;
};

// The tile of row tile mt, column tile nt and slice (or phase) z of a GEMM of m_tiles row tiles.
template <int MN, int TAPS, int BM, int BN>
__device__ __forceinline__ C3Tile c3_tile(const Conv3Args& a, int mt, int nt, int z, int m_tiles) {
    C3Tile t;
    t.m0 = mt * BM;
    t.n0 = nt * BN;
    t.z = z;
    t.record = z * m_tiles + mt;
    t.phases = TAPS && !MN && a.flip && a.stride > 1;
    t.ph = t.phases ? z / 2 : 0;
    t.pw = t.phases ? z % 2 : 0;
    t.tc = 1 + t.pw;
    t.k_begin = t.phases ? 0 : z * a.k_chunk;
    const int k_end = t.phases ? (1 + t.ph) * t.tc * a.k_chunk : min(a.k, t.k_begin + a.k_chunk);
    t.kt_count = (k_end - t.k_begin + C3_BK - 1) / C3_BK;
    t.img0 = 0, t.h0 = 0, t.w0 = 0, t.slices = 1;
    if (TAPS && !MN) {
        // The tile's first image, row and column, and the channel slices of one tap.
        const int wb = a.width / a.tile_w, hb = a.height / a.tile_h;
        t.w0 = (mt % wb) * a.tile_w;
        t.h0 = (mt / wb) % hb * a.tile_h;
        t.img0 = mt / (wb * hb) * (C3_BM / (a.tile_h * a.tile_w));
        t.slices = t.phases ? a.k_chunk / C3_BK : a.k / (a.taps * a.taps * C3_BK);
    }
    return t;
}

// The output pixel of tile row `row` (TAPS: the tile is whole, every row is a pixel). SCATTER:
// the data gradient of a strided 1×1 (the plain dgrad GEMM over dy's pixels, a.stride > 1,
// a.height × a.width = dx's extents): GEMM row m = (image, p, q) of dy lands on dx's pixel
// (image, p·stride, q·stride), P = ceil(height / stride) rows of dy.
template <int TAPS>
__device__ __forceinline__ long c3_pixel(const Conv3Args& a, const C3Tile& t, bool scatter, int row) {
    const int m0 = t.m0, img0 = t.img0, h0 = t.h0, w0 = t.w0;
    if (!TAPS && scatter) {
        const int dy_h = (a.height + a.stride - 1) / a.stride, dy_w = (a.width + a.stride - 1) / a.stride;
        const int m = m0 + row, img = m / (dy_h * dy_w), p = m / dy_w % dy_h, q = m % dy_w;
        return ((long)img * a.height + (long)p * a.stride) * a.width + (long)q * a.stride;
    }
    if (!TAPS) return (long)m0 + row;
    const int per_image = a.tile_h * a.tile_w;
    const int img = img0 + row / per_image, h = h0 + row % per_image / a.tile_w, w = w0 + row % a.tile_w;
    if (t.phases) return ((long)img * 2 * a.height + 2 * h + t.ph) * (2 * a.width) + 2 * w + t.pw;
    return ((long)img * a.height + h) * a.width + w;
}

#ifdef C3_HOPPER
// The producer's elected thread: the output tile's k-steps into the ring of STAGES stages, `ring`
// counting the stages filled so far by this block (a persistent block's ring runs on from tile
// to tile).
template <int MN, int TAPS, int BM, int BN, int STAGES = C3_STAGES>
__device__ __forceinline__ void c3_produce(const CUtensorMap* map_a, const CUtensorMap* map_b, const Conv3Args& a,
                                           const C3Tile& out_tile, unsigned base, unsigned full0, unsigned empty0, int& ring) {
    constexpr int A_BYTES = BM * C3_BK * 2, STAGE = A_BYTES + BN * C3_BK * 2;
    // (`t` below is a filter tap's column, as in the kernel file's other 3×3 code.)
    const int m0 = out_tile.m0, n0 = out_tile.n0, img0 = out_tile.img0, h0 = out_tile.h0, w0 = out_tile.w0;
    const int slices = out_tile.slices, ph = out_tile.ph, pw = out_tile.pw, tc = out_tile.tc;
    const bool phases = out_tile.phases;
    for (int kt = 0; kt < out_tile.kt_count; ++kt, ++ring) {
        const int s = ring % STAGES, round = ring / STAGES, k0 = out_tile.k_begin + kt * C3_BK;
        if (round > 0) c3_mbar_wait(empty0 + 8 * s, (unsigned)(round - 1) & 1u);
        const unsigned stage = base + s * STAGE, full = full0 + 8 * s;
        c3_mbar_arrive_expect_tx(full, STAGE);
        if (TAPS && MN) {
            // The 3×3 weight gradient: k-step = a whole tile of 64 pixels (images ×
            // rows × columns); A = dy's channels m0.., B = the input's channels of the
            // tile's two 64-column halves, each shifted by its own tap.
            const int tile = k0 / C3_BK, per_image = a.tile_h * a.tile_w;
            const int wb = a.width / a.tile_w, hb = a.height / a.tile_h;
            const int tw0 = tile % wb * a.tile_w, th0 = tile / wb % hb * a.tile_h;
            const int ti0 = tile / (wb * hb) * (C3_BK / per_image);
            const int channels = a.n / (a.taps * a.taps);
            c3_tma_load_4d(stage, map_a, m0, tw0, th0, ti0, full);
            if (BM == 128) c3_tma_load_4d(stage + C3_BOX_BYTES, map_a, m0 + 64, tw0, th0, ti0, full);
#pragma unroll
            for (int j = 0; j < BN / 64; ++j) {
                const int col = n0 + 64 * j, tap = col / channels, c0 = col % channels;
                const int r = tap / a.taps, t = tap % a.taps;
                // x's box at the tile's input pixels (a strided map at stride 2)
                c3_tma_load_4d(stage + A_BYTES + j * C3_BOX_BYTES, map_b, c0, tw0 * a.stride + t - a.pad,
                               th0 * a.stride + r - a.pad, ti0, full);
            }
        } else if (TAPS && phases) {
            // The phase's tap (ri, ti): filter row r = 2·ri (ph = 1) or 1 reads dy's
            // row h + (ph + 1 − r) / 2, i.e. the box shifted by 1 − ri or 0.
            const int tap = kt / slices, c0 = kt % slices * C3_BK, ri = tap / tc, ti = tap % tc;
            c3_tma_load_4d(stage, map_a, c0, w0 + (pw ? 1 - ti : 0), h0 + (ph ? 1 - ri : 0), img0, full);
            c3_tma_load(stage + A_BYTES, map_b, k0, out_tile.z * a.n + n0, full);
        } else if (TAPS) {
            const int tap = kt / slices, c0 = kt % slices * C3_BK;
            const int r = tap / a.taps, t = tap % a.taps;
            const int dr = a.flip ? a.pad - r : r - a.pad, dt = a.flip ? a.pad - t : t - a.pad;
            c3_tma_load_4d(stage, map_a, c0, w0 * a.stride + dt, h0 * a.stride + dr, img0, full);
            c3_tma_load(stage + A_BYTES, map_b, k0, n0, full);
        } else if (MN) {
            c3_tma_load(stage, map_a, m0, k0, full);
            if (BM == 128) c3_tma_load(stage + C3_BOX_BYTES, map_a, m0 + 64, k0, full);
            c3_tma_load(stage + A_BYTES, map_b, n0, k0, full);
            if (BN == 128) c3_tma_load(stage + A_BYTES + C3_BOX_BYTES, map_b, n0 + 64, k0, full);
        } else {
            c3_tma_load(stage, map_a, k0, m0, full);
            c3_tma_load(stage + A_BYTES, map_b, k0, n0, full);
        }
    }
}

// Consumer warpgroup c: k-step kt of tile t (the stage `ring` counts to) into its accumulators
// (rows 64c .. 64c + 63 of the tile; SPLIT_N: its columns 64c .. 64c + 63), once the stage has
// landed: four wgmma committed as one group, not waited for.
template <int MN, int BM, int BN, int STAGES = C3_STAGES>
__device__ __forceinline__ void c3_issue_kstep(float* acc, int kt, int ring, unsigned base, unsigned full0, int c) {
    constexpr int A_BYTES = BM * C3_BK * 2, STAGE = A_BYTES + BN * C3_BK * 2;
    constexpr int SPLIT_N = BM == 64, CN = SPLIT_N ? BN / 2 : BN;
    const int s = ring % STAGES;
    c3_mbar_wait(full0 + 8 * s, (unsigned)(ring / STAGES) & 1u);
    const unsigned stage = base + s * STAGE;
    // K-major: 64 rows of 128 bytes per warpgroup, k advances 32 bytes inside the
    // swizzle atom; MN-major: one box per warpgroup, k advances 16 rows of 128 bytes.
    // SPLIT_N: the one A box for both, B's box c for each.
    const unsigned a_rows = stage + (SPLIT_N ? 0 : c * (MN ? C3_BOX_BYTES : 64 * 128));
    const unsigned b_rows = stage + A_BYTES + (SPLIT_N ? c * C3_BOX_BYTES : 0);
    c3_wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < C3_BK / 16; ++kk) {
        if (MN)
            c3_wgmma<CN, 1, 1>(acc, c3_desc_mn(a_rows + kk * 2048), c3_desc_mn(b_rows + kk * 2048), kt > 0 || kk > 0);
        else
            c3_wgmma<CN, 0, 0>(acc, c3_desc(a_rows + kk * 32), c3_desc(b_rows + kk * 32), kt > 0 || kk > 0);
    }
    c3_wgmma_commit();
}

// A persistent consumer's head start on tile t: its first k-steps (at most `most`) issued while
// the previous tile's epilogue runs from shared memory, so the tensor cores work through it.
// Returns how many; c3_consume goes on from there.
template <int MN, int BM, int BN, int STAGES = C3_STAGES>
__device__ __forceinline__ int c3_consume_head(float* acc, const C3Tile& t, unsigned base, unsigned full0, int c,
                                               int& ring, int most) {
    constexpr int ACC = (BM == 64 ? BN / 2 : BN) / 2;
    c3_fence_acc<ACC>(acc);
    const int issued = min(most, t.kt_count);
    for (int kt = 0; kt < issued; ++kt, ++ring) c3_issue_kstep<MN, BM, BN, STAGES>(acc, kt, ring, base, full0, c);
    return issued;
}

// Consumer warpgroup c: tile t's accumulators, from k-step `issued` on (the ones before it
// issued by c3_consume_head), `ring` counting the stages consumed so far by this block. Each
// stage is released once its wgmma are done; the tile's last one here when `release_last`
// (a persistent block's producer refills it for the next tile; a one-tile block has no next).
template <int MN, int BM, int BN, int STAGES = C3_STAGES>
__device__ __forceinline__ void c3_consume(float* acc, const C3Tile& t, unsigned base, unsigned full0, unsigned empty0,
                                           int c, int tid, int& ring, bool release_last, int issued = 0) {
    constexpr int ACC = (BM == 64 ? BN / 2 : BN) / 2;
    c3_fence_acc<ACC>(acc);
    // The k-steps issued and not yet released, before the current one.
    int pending = issued;
    for (int kt = issued; kt < t.kt_count; ++kt, ++ring) {
        c3_issue_kstep<MN, BM, BN, STAGES>(acc, kt, ring, base, full0, c);
        // Every k-step before this one is done: their stages may be refilled.
        c3_wgmma_wait<1>(acc);
        if (tid % 128 == 0)
            for (int j = pending; j > 0; --j) c3_mbar_arrive(empty0 + 8 * ((ring - j) % STAGES));
        pending = 1;
    }
    c3_wgmma_wait<0>(acc);
    c3_fence_acc<ACC>(acc);
    if (release_last && tid % 128 == 0)
        for (int j = pending; j > 0; --j) c3_mbar_arrive(empty0 + 8 * ((ring - j) % STAGES));
    if (t.kt_count == 0) {
#pragma unroll
        for (int i = 0; i < ACC; ++i) acc[i] = 0.0f;  // an empty slice: zeros
    }
}

// The epilogue's barrier: the whole block's, or (PERSIST) the two consumer warpgroups' alone
// (named barrier 1 of 256 threads), as a persistent block's producer is loading the next tile.
template <int PERSIST>
__device__ __forceinline__ void c3_epi_sync() {
    if (!PERSIST) {
        __syncthreads();
        return;
    }
#ifdef BT_EMULATE
    bt_emu_bar_sync(1, 256);
#else
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
#endif
}

// The epilogue's division of work among ETHREADS threads (the consumer warpgroups are the last
// 256 of them). The per-tile records (conv2.cu's, by the first 256 threads): a thread owns a
// column pair and a span of SPAN rows; the TPC spans of a pair are added in span order by span 0.
// The chunks: 16 bytes of a row each, chunk ch to thread ch % ETHREADS, their global operands
// loaded in ROUNDS rounds of PER_ROUND chunks a thread (at most MOST: the registers that hold
// them; 2 where two persistent blocks share an SM's registers; all at once when EARLY).
template <int BN, int PERSIST, int EARLY = 0>
struct C3EpiShape {
    static constexpr int ETHREADS = PERSIST ? 256 : C3_THREADS;
    static constexpr int PAIRS = BN / 2, TPC = 256 / PAIRS, SPAN = C3_BM / TPC;
    static constexpr int CHUNKS_PER_ROW = BN / 8, CHUNKS = C3_BM * CHUNKS_PER_ROW;
    static constexpr int PER_THREAD = (CHUNKS + ETHREADS - 1) / ETHREADS;
    static constexpr int MOST = EARLY ? PER_THREAD : PERSIST && BN == 64 ? 2 : 6;
    static constexpr int ROUNDS = (PER_THREAD + MOST - 1) / MOST, PER_ROUND = (PER_THREAD + ROUNDS - 1) / ROUNDS;
};

// What a thread's share of tile t's epilogue reads from memory: its chunks' prior value (when
// accumulating), residual gradient and mask (y, or its packed signs), one round at a time, and
// (BN_GRAD) its span's x for Σg·x̂, every load in flight at once. The epilogue loads them itself
// (EARLY = 0) or finds them loaded: a persistent block's 128-column consumers, which hold 240
// registers a thread, load the whole tile's before its mainloop (conv3_gemm_p), so that they
// arrive while the tensor cores run instead of while the epilogue waits.
template <int EPI, int TAPS, int BN, int PERSIST, int EARLY = 0>
struct C3EpiOperands {
    using S = C3EpiShape<BN, PERSIST, EARLY>;
    static constexpr bool BN_GRAD = EPI == C3_EPI_BN_GRAD;
    EpilogueInputs<S::PER_ROUND> in;
    unsigned xs[BN_GRAD ? S::SPAN : 1];

    // BN_GRAD: the rows r0 .. r1 − 1 of the column pair cn of thread etid's span.
    __device__ __forceinline__ void load_x(const Conv3Args& a, const Conv3Epilogue& ep, const C3Tile& t, int etid) {
        const int col = (etid % S::PAIRS) * 2, span = (etid / S::PAIRS) % S::TPC, cn = t.n0 + col, N = a.n;
        const int rows = TAPS ? C3_BM : min(C3_BM, a.m - t.m0), r0 = span * S::SPAN, r1 = min(rows, r0 + S::SPAN);
        const bool reducer = etid < 256;
#pragma unroll
        for (int i = 0; i < S::SPAN; ++i)
            xs[i] = reducer && cn < N && r0 + i < r1
                        ? *reinterpret_cast<const unsigned*>(ep.bn_x + c3_pixel<TAPS>(a, t, false, r0 + i) * N + cn)
                        : 0u;
    }

    // BN_GRAD with packed signs (y not stored, a ReLU): a byte of them a chunk (its 8 elements'
    // offset is a multiple of 8: N % 8 == 0), 1/16 of the bytes of y; null otherwise.
    static __device__ __forceinline__ const unsigned char* signs_of(const Conv3Epilogue& ep) {
        return BN_GRAD && ep.bn_y == nullptr && ep.relu ? ep.bn_signs : nullptr;
    }

    // The chunks of round `round` (dx's prior value read from `y`, the output, when accumulating;
    // PRIOR = 2: that alone, PRIOR = 0: all but that).
    template <int PRIOR = 1>
    __device__ __forceinline__ void load_chunks(const Conv3Args& a, const Conv3Epilogue& ep, const C3Tile& t,
                                                const bf16* y, int etid, int round) {
        const bool scatter = EPI == C3_EPI_NONE && !TAPS && a.stride > 1;
        const bf16* mask_src = BN_GRAD ? ep.bn_y : nullptr;
        const unsigned char* signs_src = signs_of(ep);
#pragma unroll
        for (int i = 0; i < in.COUNT; ++i) {
            const int ch = etid + (round * S::PER_ROUND + i) * S::ETHREADS, row = ch / S::CHUNKS_PER_ROW;
            const int n = t.n0 + (ch % S::CHUNKS_PER_ROW) * 8;
            const bool live = ch < S::CHUNKS && (TAPS || t.m0 + row < a.m) && n < a.n;
            const long o = live ? c3_pixel<TAPS>(a, t, scatter, row) * a.n + n : 0;
            if (PRIOR == 2) {
                in.prior[i] = live ? *reinterpret_cast<const uint4*>(y + o) : make_uint4(0u, 0u, 0u, 0u);
                continue;
            }
            in.load(i, live, o, PRIOR && a.accumulate ? y : nullptr, BN_GRAD ? ep.residual : nullptr, mask_src);
            // Packed signs take the place of y's chunk (the registers of mask[i], whose .x holds
            // the byte): the two never come together.
            if (signs_src != nullptr) in.mask[i].x = live ? (unsigned)signs_src[o >> 3] : 0u;
        }
    }

    // What the epilogue reads before the tile's mainloop (EARLY: a single round), but dx's
    // prior value: 32 registers more than the consumers have, and read only when a layer's data
    // gradient adds to another's, so the epilogue loads it (load_chunks<2>).
    __device__ __forceinline__ void load_early(const Conv3Args& a, const Conv3Epilogue& ep, const C3Tile& t, int etid) {
        static_assert(S::ROUNDS == 1, "loaded early: every chunk in one round");
        if (BN_GRAD) load_x(a, ep, t, etid);
        load_chunks<0>(a, ep, t, nullptr, etid, 0);
    }
};

// Tile t's epilogue (every epilogue but the weight gradient's) by ETHREADS threads, `etid` this
// thread's index among them (the consumer warpgroups are the last 256 of them): the
// accumulators (wg > 0) rounded to bf16 and staged in `epi` ([128][BN + 8] bf16, then the
// reduction scratch), written to y in whole 16-byte chunks with what the epilogue adds, and
// the per-tile records. The caller has made the staging area free (the barrier before it).
// `ops` holds the global operands when EARLY (C3EpiOperands::load_early), and is the epilogue's
// own otherwise. PART 1 stages the accumulators and returns, PART 2 does the rest (a persistent
// consumer issues the next tile's first k-steps between the two), PART 0 both.
template <int EPI, int TAPS, int BN, int PERSIST, int EARLY = 0, int PART = 0>
__device__ __forceinline__ void c3_epilogue(const Conv3Args& a, const Conv3Epilogue& ep, const C3Tile& t, int records,
                                            bf16* y, unsigned char* epi, const float* acc, int etid, int wg,
                                            C3EpiOperands<EPI, TAPS, BN, PERSIST, EARLY>& ops) {
    using S = C3EpiShape<BN, PERSIST, EARLY>;
    constexpr int ETHREADS = S::ETHREADS, LDC = BN + 8;
    const int m0 = t.m0, n0 = t.n0, M = a.m, N = a.n;
    const bool scatter = EPI == C3_EPI_NONE && !TAPS && a.stride > 1;
    bf16* Cs = reinterpret_cast<bf16*>(epi);
    constexpr int PAIRS = S::PAIRS, TPC = S::TPC, SPAN = S::SPAN;
    const bool reducer = etid < 256;
    const int col = (etid % PAIRS) * 2, span = (etid / PAIRS) % TPC;
    const int rows = TAPS ? C3_BM : min(C3_BM, M - m0);
    const int r0 = span * SPAN, r1 = min(rows, r0 + SPAN);
    const int cn = n0 + col;  // N % 8 == 0: both columns of a pair are in range, or neither
    // BN_GRAD: the span's x. Blocks of 128 columns, one an SM, load it first, so that it arrives
    // during the staging and the chunks instead of after them (a latency less per tile; the
    // registers are there: a one-tile block's 384 threads may take 168 each, a persistent
    // block's consumers 240 through setmaxnreg); 64-column blocks, two an SM on 80 registers a
    // thread (104 a persistent consumer), would spill, and load it after the chunks.
    constexpr bool X_FIRST = BN == 128;
    if (EPI == C3_EPI_BN_GRAD && X_FIRST && !EARLY && PART != 2) ops.load_x(a, ep, t, etid);
    if (wg > 0 && PART != 2) {
        const int tid = (int)threadIdx.x, warp = (tid / 32) % 4, lane = tid % 32, row_base = (wg - 1) * 64 + warp * 16 + lane / 4;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = row_base + 8 * h, col = 8 * j + 2 * (lane % 4);
                const unsigned lo = __bfloat16_as_ushort(bt_to_bf16(acc[4 * j + 2 * h]));
                const unsigned hi = __bfloat16_as_ushort(bt_to_bf16(acc[4 * j + 2 * h + 1]));
                *reinterpret_cast<unsigned*>(Cs + row * LDC + col) = lo | (hi << 16);
            }
    }
    if (PART == 1) return;
    c3_epi_sync<PERSIST>();
    constexpr int CHUNKS_PER_ROW = S::CHUNKS_PER_ROW, CHUNKS = S::CHUNKS;
    // Every chunk's global operands loaded before any chunk is stored (EpilogueInputs).
    constexpr int ROUNDS = S::ROUNDS, PER_ROUND = S::PER_ROUND;
    const bool bn_grad = EPI == C3_EPI_BN_GRAD;
    // BN_GRAD whose batch norm's output is not read (null bn_y, a ReLU): the mask is recomputed
    // in the sums below from the span's x, which they load anyway, and g goes out after them.
    // Per chunk it would cost a 16-byte load of x and 32 scalar loads of the parameters.
    const bool mask_late = bn_grad && ep.bn_y == nullptr && ep.bn_signs == nullptr && ep.relu;
    const bool packed_signs = ops.signs_of(ep) != nullptr;
#pragma unroll
    for (int round = 0; round < ROUNDS; ++round) {
        if (!EARLY) ops.load_chunks(a, ep, t, y, etid, round);
        else if (a.accumulate) ops.template load_chunks<2>(a, ep, t, y, etid, round);
        const auto& in = ops.in;
#pragma unroll
        for (int i = 0; i < in.COUNT; ++i) {
            const int ch = etid + (round * PER_ROUND + i) * ETHREADS;
            const int row = ch / CHUNKS_PER_ROW, col = (ch % CHUNKS_PER_ROW) * 8;
            const int n = n0 + col;
            if (ch >= CHUNKS || (!TAPS && m0 + row >= M) || n >= N) continue;
            const long o = c3_pixel<TAPS>(a, t, scatter, row) * N + n;
            uint4 v = in.finish(i, *reinterpret_cast<const uint4*>(Cs + row * LDC + col), a.accumulate, bn_grad, ep);
            if (packed_signs) v = relu_mask_bits_bf16x8(v, in.mask[i].x);
            if (bn_grad) *reinterpret_cast<uint4*>(Cs + row * LDC + col) = v;  // the final g, for the sums below
            if (mask_late) continue;  // stored after the sums have masked it
            *reinterpret_cast<uint4*>(y + o) = v;
            if (scatter && !a.accumulate) {
                // The stride × stride cell's other pixels get zeros here (accumulating: left as
                // they are). Zeros from the epilogue write each byte of dx once; a zero-fill of dx
                // before the launch would write it all and then the GEMM's 1/stride² of it again
                // (1.25× the bytes at stride 2, and a launch more).
                const long px = o / N;
                const int h = (int)(px / a.width % a.height), w = (int)(px % a.width);
                for (int dh = 0; dh < a.stride && h + dh < a.height; ++dh)
                    for (int dw = dh == 0 ? 1 : 0; dw < a.stride && w + dw < a.width; ++dw)
                        *reinterpret_cast<uint4*>(y + o + ((long)dh * a.width + dw) * N) = make_uint4(0u, 0u, 0u, 0u);
            }
        }
    }
    if (EPI == C3_EPI_NONE) return;

    // ---- per-tile records ---------------------------------------------------------------------
    // Record t.record of `records`: gridDim.z is 1 but for the phases (each phase's tiles
    // cover a quarter of dx, every pixel once).
    float* red_a = reinterpret_cast<float*>(epi + C3_BM * LDC * 2);  // [TPC][BN]
    float* red_b = red_a + TPC * BN;
    unsigned* cs_pair = reinterpret_cast<unsigned*>(Cs + col);
    const long plane = (long)records * N, at = (long)t.record * N + cn;
    if (EPI == C3_EPI_BN_GRAD) {
        // Σg and Σg·x̂ of the staged final g (x̂ from the batch norm's input and statistics).
        if (!X_FIRST && !EARLY) ops.load_x(a, ep, t, etid);
        c3_epi_sync<PERSIST>();  // every g is staged
        float b0 = 0.0f, b1 = 0.0f, g0 = 0.0f, g1 = 0.0f;
        if (reducer && cn < N) {
            const float mu0 = ep.mean[cn], mu1 = ep.mean[cn + 1], is0 = ep.invstd[cn], is1 = ep.invstd[cn + 1];
            float2 ga = make_float2(0.0f, 0.0f), be = ga;
            if (mask_late) {
                ga = make_float2(bt_to_f32(ep.gamma[cn]), bt_to_f32(ep.gamma[cn + 1]));
                be = make_float2(bt_to_f32(ep.beta[cn]), bt_to_f32(ep.beta[cn + 1]));
            }
            // The sums in row order (the same bits whenever x was loaded).
#pragma unroll
            for (int i = 0; i < SPAN; ++i) {
                const int r = r0 + i;
                if (r >= r1) break;
                unsigned v = cs_pair[r * (LDC / 2)];
                const unsigned x = ops.xs[i];
                if (mask_late) {
                    // y as bn_apply wrote it (applied_bn2: bn_apply_vec's expression and rounding), its
                    // sign the mask; the masked g staged again for the store below.
                    v = relu_mask_bf16x2(v, applied_bn2(x, make_float2(mu0, mu1), make_float2(is0, is1), ga, be, 1));
                    cs_pair[r * (LDC / 2)] = v;
                }
                const float v0 = __uint_as_float(v << 16), v1 = __uint_as_float(v & 0xffff0000u);
                b0 += v0;
                b1 += v1;
                g0 += v0 * (__uint_as_float(x << 16) - mu0) * is0;
                g1 += v1 * (__uint_as_float(x & 0xffff0000u) - mu1) * is1;
            }
        }
        if (reducer) {
            red_a[span * BN + col] = b0;
            red_a[span * BN + col + 1] = b1;
            red_b[span * BN + col] = g0;
            red_b[span * BN + col + 1] = g1;
        }
        c3_epi_sync<PERSIST>();
        if (mask_late) {
            // The masked g, staged by the sums above, in whole 16-byte chunks.
            for (int ch = etid; ch < CHUNKS; ch += ETHREADS) {
                const int row = ch / CHUNKS_PER_ROW, c8 = (ch % CHUNKS_PER_ROW) * 8, n = n0 + c8;
                if ((!TAPS && m0 + row >= M) || n >= N) continue;
                *reinterpret_cast<uint4*>(y + c3_pixel<TAPS>(a, t, false, row) * N + n) =
                    *reinterpret_cast<const uint4*>(Cs + row * LDC + c8);
            }
        }
        if (reducer && span == 0 && cn < N) {
#pragma unroll
            for (int p = 1; p < TPC; ++p) {
                b0 += red_a[p * BN + col];
                b1 += red_a[p * BN + col + 1];
                g0 += red_b[p * BN + col];
                g1 += red_b[p * BN + col + 1];
            }
            bt_store2_f32(ep.part + at, b0, b1);
            bt_store2_f32(ep.part + plane + at, g0, g1);
        }
        return;
    }
    float mean0 = 0.0f, mean1 = 0.0f;
    if (reducer) {
        float s0 = 0.0f, s1 = 0.0f;
        for (int r = r0; r < r1; ++r) {
            const unsigned v = cs_pair[r * (LDC / 2)];
            s0 += __uint_as_float(v << 16);
            s1 += __uint_as_float(v & 0xffff0000u);
        }
        red_a[span * BN + col] = s0;
        red_a[span * BN + col + 1] = s1;
    }
    c3_epi_sync<PERSIST>();
    if (reducer) {
        float t0 = 0.0f, t1 = 0.0f;
#pragma unroll
        for (int p = 0; p < TPC; ++p) {
            t0 += red_a[p * BN + col];
            t1 += red_a[p * BN + col + 1];
        }
        mean0 = t0 / (float)rows;
        mean1 = t1 / (float)rows;
        float q0 = 0.0f, q1 = 0.0f;
        for (int r = r0; r < r1; ++r) {
            const unsigned v = cs_pair[r * (LDC / 2)];
            const float d0 = __uint_as_float(v << 16) - mean0, d1 = __uint_as_float(v & 0xffff0000u) - mean1;
            q0 = fmaf(d0, d0, q0);
            q1 = fmaf(d1, d1, q1);
        }
        red_b[span * BN + col] = q0;
        red_b[span * BN + col + 1] = q1;
    }
    c3_epi_sync<PERSIST>();
    if (reducer && span == 0 && cn < N) {
        float q0 = 0.0f, q1 = 0.0f;
#pragma unroll
        for (int p = 0; p < TPC; ++p) {
            q0 += red_b[p * BN + col];
            q1 += red_b[p * BN + col + 1];
        }
        bt_store2_f32(ep.part + at, mean0, mean1);
        bt_store2_f32(ep.part + plane + at, q0, q1);
    }
}
#endif  // C3_HOPPER

// A hint to the memory system: the 128-byte line at p into L2 (no value changes and nothing
// faults; the emulator, which has no caches, skips it).
__device__ __forceinline__ void c3_prefetch_l2(const void* p) {
#ifdef BT_EMULATE
    (void)p;
#else
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
#endif
}

// BN_GRAD, a one-tile block: the producer warpgroup's threads but the TMA issuer (`lane` of
// `lanes`) ask L2 for what tile t's epilogue will read from memory (x; the residual's gradient,
// y or its packed signs, and dx's prior value, each where given), row by row, while the
// block's TMA loads and GEMM run: its loads then meet L2 instead of memory, and the requests
// reach memory a mainloop earlier. The rows are the epilogue's own (c3_pixel).
template <int TAPS, int BN>
__device__ __forceinline__ void c3_prefetch_epilogue(const Conv3Args& a, const Conv3Epilogue& ep, const C3Tile& t,
                                                     const bf16* dx, int lane, int lanes) {
    const int rows = TAPS ? C3_BM : min(C3_BM, a.m - t.m0), bytes = 2 * min(BN, a.n - t.n0);
    if (bytes <= 0) return;
    const bf16* spans[4] = {ep.bn_x, ep.residual, ep.bn_y, a.accumulate ? dx : nullptr};
    for (int r = lane; r < rows; r += lanes) {
        const long o = c3_pixel<TAPS>(a, t, false, r) * a.n + t.n0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            if (spans[k] == nullptr) continue;
            const char* row = reinterpret_cast<const char*>(spans[k] + o);
            for (int b = 0; b < bytes; b += 128) c3_prefetch_l2(row + b);
            c3_prefetch_l2(row + bytes - 1);  // the last line, where the row starts mid-line
        }
        if (ep.bn_signs != nullptr && ep.bn_y == nullptr) c3_prefetch_l2(ep.bn_signs + (o >> 3));
    }
}

// out[M][N] = A[M][K] · B[N][K]ᵀ with its epilogue; A and B through their tensor maps, both
// K-major (MN = 0: forward, dgrad; one box of 64 k × 128 rows per operand and stage) or both
// MN-major (MN = 1: wgrad, whose reduction runs over pixels; two boxes of 64 MN × 64 k per
// operand and stage). The reduction covers [z·k_chunk, min(k, (z + 1)·k_chunk)), z = blockIdx.z.
// TAPS = 1: the 3×3 forward, whose 128 rows are a tile of tile_n images × tile_h rows ×
// tile_w columns of the output, A a 4-D box of the input shifted by the k-step's tap (the
// padding read as zeros), k = (tap, channel) with 64 channels of one tap per k-step; at
// a.stride 2 the box starts at the tile's first output pixel × 2 (a strided map).
// BM = 64 (the weight gradients' `_m64` twins, for M ≤ 64): a tile of 64 rows × 128 columns
// split by COLUMNS between the consumers: one A box per stage, which both read, and consumer c
// multiplies it by B's box c (columns 64c .. 64c + 63) with m64n64k16.
// One block per tile (grid = row tiles × column tiles × slices or phases); the epilogue by all
// 384 threads in the stages' memory, after the last k-step. Persistent blocks: conv3_gemm_p.
template <int EPI, int MN, int TAPS = 0, int BN = C3_BN, int BM = C3_BM>
__device__ __forceinline__ void conv3_gemm(const CUtensorMap* map_a, const CUtensorMap* map_b, void* out,
                                               const Conv3Args& a, const Conv3Epilogue& ep) {
#ifdef C3_HOPPER
    static_assert(BN == 128 || BN == 64, "tiles of 128 or 64 columns");
    static_assert(BM == C3_BM || (BM == 64 && BN == 128 && MN && EPI == C3_EPI_WGRAD),
                  "64-row tiles: the MN-major weight gradients' column split");
    // A stage: the A tile (BM rows × 64 k), then the B tile (BN rows × 64 k). CN: the columns
    // of each consumer's accumulator (the whole tile's, or half of them when split by columns).
    constexpr int A_BYTES = BM * C3_BK * 2, STAGE = A_BYTES + BN * C3_BK * 2;
    constexpr int SPLIT_N = BM == 64, CN = SPLIT_N ? BN / 2 : BN, ACC = CN / 2;
    C3_SMEM(smem_raw);
    // The stages need 1024-byte alignment (the swizzle atoms); the host adds 1 KiB of slack.
    const unsigned raw = c3_shared(smem_raw);
    const unsigned base = (raw + 1023u) & ~1023u;
    unsigned char* smem = smem_raw + (base - raw);
    const unsigned full0 = base + C3_STAGES * STAGE, empty0 = full0 + 8 * C3_STAGES;
    const int tid = threadIdx.x, wg = tid / 128;
    const C3Tile t = c3_tile<MN, TAPS, BM, BN>(a, (int)blockIdx.x, (int)blockIdx.y, (int)blockIdx.z, (int)gridDim.x);

    if (tid == 0) {
        for (int s = 0; s < C3_STAGES; ++s) {
            c3_mbar_init(full0 + 8 * s, 1);   // the producer's arrive.expect_tx
            c3_mbar_init(empty0 + 8 * s, 2);  // one arrival per consumer warpgroup
        }
        c3_fence_barrier_init();
    }
    __syncthreads();

    float acc[ACC];
    int ring = 0;
    if (wg == 0) {
        // Producer: one elected thread keeps the ring full; the others prefetch the epilogue's
        // operands.
        if (tid == 0) c3_produce<MN, TAPS, BM, BN>(map_a, map_b, a, t, base, full0, empty0, ring);
        else if (EPI == C3_EPI_BN_GRAD)
            c3_prefetch_epilogue<TAPS, BN>(a, ep, t, reinterpret_cast<const bf16*>(out), tid - 1, 127);
    } else {
        const int c = wg - 1;
        c3_consume<MN, BM, BN>(acc, t, base, full0, empty0, c, tid, ring, false);
        if (EPI == C3_EPI_WGRAD) {
            // f32 partial sums of this reduction slice into its own plane (each element by one
            // thread: no atomics); conv2_wgrad_reduce adds the planes in slice order.
            float* dw = reinterpret_cast<float*>(out) + (long)blockIdx.z * a.m * a.n;
            const int warp = (tid / 32) % 4, lane = tid % 32, m0 = t.m0, n0 = t.n0;
            const int row_base = m0 + (SPLIT_N ? 0 : c * 64) + warp * 16 + lane / 4, col_base = n0 + (SPLIT_N ? c * 64 : 0);
#pragma unroll
            for (int j = 0; j < CN / 8; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int m = row_base + 8 * h, n = col_base + 8 * j + 2 * (lane % 4);
                    if (m < a.m && n < a.n) bt_store2_f32(dw + (long)m * a.n + n, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
                }
        }
    }
    if (EPI == C3_EPI_WGRAD) return;
    // Every wgmma has read its stage and every TMA load has landed (each was waited for):
    // the stages become the epilogue's staging area.
    __syncthreads();
    C3EpiOperands<EPI, TAPS, BN, 0> ops;
    c3_epilogue<EPI, TAPS, BN, 0>(a, ep, t, (int)(gridDim.x * gridDim.z), reinterpret_cast<bf16*>(out), smem, acc,
                                  tid, wg, ops);
#else
    __trap();  // compiled for a target without wgmma: the host never launches this
#endif
}

// The same GEMMs (forward and data gradient; tiles of 128 rows × BN = 128 or 64 columns) by
// persistent blocks: grid.x blocks (the host launches one per SM, two for BN = 64, or one per
// tile) walk the tiles t = blockIdx.x, blockIdx.x + gridDim.x, … in the order (phase z, row
// tile, column tile), the column tiles innermost, so the blocks that run at once share their
// rows of A (the activations, read from memory once instead of once per column tile; B, the
// weights, stays in L2). The producer runs on into the next tile's stages while the consumers
// finish this one: the epilogue has its own shared memory (after the stages and barriers) and
// runs on the two consumer warpgroups alone, synchronised by named barrier 1, so the next
// tile's loads overlap it. Each tile computes what conv3_gemm's block for it computes, in the
// same order: the same bits. BN = 128: 4 stages, 167 KiB (CONV3_P_SMEM_BYTES), one block an
// SM; BN = 64: 3 stages of 24 KiB, 95 KiB (CONV3_N64_P_SMEM_BYTES), two blocks an SM. Either
// way the producer warpgroup gives its registers to the consumers (setmaxnreg).
#define C3_P_STAGES(BN) ((BN) == 128 ? 4 : 3)
#define C3_P_EPI(BN) (C3_P_STAGES(BN) * (C3_TILE_BYTES + (BN) * C3_BK * 2) + 128)  // the epilogue's offset
#define C3_P_SMEM(BN) (C3_P_EPI(BN) + C3_BM * ((BN) + 8) * 2 + 2 * (256 / ((BN) / 2)) * (BN) * 4 + 1024)
#define CONV3_P_SMEM_BYTES C3_P_SMEM(128)
#define CONV3_N64_P_SMEM_BYTES C3_P_SMEM(64)

// Tile i of a persistent block's walk: the phase z outermost, then the row tile, the column
// tile innermost.
template <int TAPS, int BN>
__device__ __forceinline__ C3Tile c3_tile_p(const Conv3Args& a, int i, int m_tiles, int n_tiles) {
    const int z = i / (m_tiles * n_tiles), mt = i / n_tiles % m_tiles, nt = i % n_tiles;
    return c3_tile<0, TAPS, C3_BM, BN>(a, mt, nt, z, m_tiles);
}

template <int EPI, int TAPS, int BN = C3_BN>
__device__ __forceinline__ void conv3_gemm_p(const CUtensorMap* map_a, const CUtensorMap* map_b, bf16* out,
                                             const Conv3Args& a, const Conv3Epilogue& ep) {
#ifdef C3_HOPPER
    static_assert(EPI != C3_EPI_WGRAD, "persistent blocks: the forward and data-gradient GEMMs");
    static_assert(BN == 128 || BN == 64, "tiles of 128 or 64 columns");
    constexpr int STAGES = C3_P_STAGES(BN), STAGE = C3_TILE_BYTES + BN * C3_BK * 2;
    C3_SMEM(smem_raw);
    const unsigned raw = c3_shared(smem_raw);
    const unsigned base = (raw + 1023u) & ~1023u;
    unsigned char* smem = smem_raw + (base - raw);
    const unsigned full0 = base + STAGES * STAGE, empty0 = full0 + 8 * STAGES;
    const int tid = threadIdx.x, wg = tid / 128;
    const bool phases = TAPS && a.flip && a.stride > 1;
    const int m_tiles = (a.m + C3_BM - 1) / C3_BM, n_tiles = (a.n + BN - 1) / BN, z_count = phases ? 4 : 1;
    const int tiles = m_tiles * n_tiles * z_count;

    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            c3_mbar_init(full0 + 8 * s, 1);
            c3_mbar_init(empty0 + 8 * s, 2);
        }
        c3_fence_barrier_init();
    }
    __syncthreads();
    // From here on the producer and the consumers go their own ways: no __syncthreads.
    int ring = 0;
    if (wg == 0) {
        c3_setmaxnreg_dec<BN == 128 ? 24 : 32>();
        if (tid != 0) return;
        for (int i = blockIdx.x; i < tiles; i += gridDim.x)
            c3_produce<0, TAPS, C3_BM, BN, STAGES>(map_a, map_b, a, c3_tile_p<TAPS, BN>(a, i, m_tiles, n_tiles), base,
                                                   full0, empty0, ring);
        return;
    }
    c3_setmaxnreg_inc<BN == 128 ? 240 : 104>();
    float acc[BN / 2];
    const int records = m_tiles * z_count, etid = tid - 128;
    unsigned char* epi = smem + C3_P_EPI(BN);
    if constexpr (EPI == C3_EPI_BN_GRAD) {
        // The data gradients with the batch-norm epilogue, a tile a pass. The 128-column ones
        // load its operands before the tile's mainloop (the consumers' 240 registers hold them
        // beside the accumulators); the 64-column ones, on 104, load them in the epilogue.
        // Either way those registers are not there for a head start (below).
        constexpr int EARLY = BN == 128;
        for (int i = blockIdx.x; i < tiles; i += gridDim.x) {
            const C3Tile t = c3_tile_p<TAPS, BN>(a, i, m_tiles, n_tiles);
            C3EpiOperands<EPI, TAPS, BN, 1, EARLY> ops;
            if constexpr (EARLY) ops.load_early(a, ep, t, etid);
            c3_consume<0, C3_BM, BN, STAGES>(acc, t, base, full0, empty0, wg - 1, tid, ring, true);
            // The previous tile's epilogue is done with the staging area.
            c3_epi_sync<1>();
            c3_epilogue<EPI, TAPS, BN, 1, EARLY>(a, ep, t, records, out, epi, acc, etid, wg, ops);
        }
        return;
    }
    // The others give the next tile's first HEAD k-steps a head start: issued once this tile's
    // accumulators are staged (c3_epilogue's PART 1), they run on the tensor cores while the rest
    // of its epilogue (PART 2) runs from shared memory; the producer filled their stages during
    // this tile's last k-steps. A pass of the loop issues the wgmma and waits for them (split
    // across passes, the compiler waits for them at once, or serialises every wgmma).
    constexpr int HEAD = 2;
    int i = blockIdx.x;
    if (i >= tiles) return;
    C3Tile t = c3_tile_p<TAPS, BN>(a, i, m_tiles, n_tiles);
    C3EpiOperands<EPI, TAPS, BN, 1> ops;
    c3_consume<0, C3_BM, BN, STAGES>(acc, t, base, full0, empty0, wg - 1, tid, ring, true);
    c3_epilogue<EPI, TAPS, BN, 1, 0, 1>(a, ep, t, records, out, epi, acc, etid, wg, ops);
    for (;;) {
        const int next = i + (int)gridDim.x;
        const C3Tile tn = c3_tile_p<TAPS, BN>(a, next < tiles ? next : i, m_tiles, n_tiles);
        const int issued =
            c3_consume_head<0, C3_BM, BN, STAGES>(acc, tn, base, full0, wg - 1, ring, next < tiles ? HEAD : 0);
        c3_epilogue<EPI, TAPS, BN, 1, 0, 2>(a, ep, t, records, out, epi, acc, etid, wg, ops);
        if (next >= tiles) {
            c3_wgmma_wait<0>(acc);  // nothing in flight, which the compiler cannot tell
            break;
        }
        c3_consume<0, C3_BM, BN, STAGES>(acc, tn, base, full0, empty0, wg - 1, tid, ring, true, issued);
        // This tile's epilogue is done with the staging area.
        c3_epi_sync<1>();
        c3_epilogue<EPI, TAPS, BN, 1, 0, 1>(a, ep, tn, records, out, epi, acc, etid, wg, ops);
        i = next;
        t = tn;
    }
#else
    __trap();  // compiled for a target without wgmma: the host never launches this
#endif
}

// ---- kernels ---------------------------------------------------------------------------------
// Names: conv3_{fwd,dgrad}[_stats|_bn]_1x1 (the 128×128 tile of 384 threads; the host,
// src/cuda/conv3.rs, passes CONV3_SMEM_BYTES of dynamic shared memory) and the dgrad's weight
// transpose conv3_transpose_weights.

// y = conv1x1(x, w); map_x: x as [M][K], map_w: w as [N][K]
extern "C" __global__ void __launch_bounds__(C3_THREADS, 1)
conv3_fwd_1x1(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w, bf16* y, Conv3Args args) {
    conv3_gemm<C3_EPI_NONE, 0>(&map_x, &map_w, y, args, Conv3Epilogue{});
}

// y = conv1x1(x, w) and the tile statistics of y in part ([2][gridDim.x][N]: means, then M2)
extern "C" __global__ void __launch_bounds__(C3_THREADS, 1)
conv3_fwd_stats_1x1(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w, bf16* y,
                    Conv3Args args, float* part) {
    Conv3Epilogue ep{};
    ep.part = part;
    conv3_gemm<C3_EPI_STATS, 0>(&map_x, &map_w, y, args, ep);
}

// dx = dgrad1x1(dy, w) (+ dx with args.accumulate): the GEMM dx[M][C] = dy[M][K] · wt[C][K]ᵀ;
// map_dy: dy as [M][K], map_wt: the transposed weight wt = wᵀ as [C][K] (conv3_transpose_weights).
// At args.stride > 1 (a strided 1×1, no padding; args.height × args.width = dx's extents) the
// M rows are dy's pixels (n, p, q), each written to dx's (n, p·stride, q·stride), and without
// args.accumulate the cell's other pixels to zero.
extern "C" __global__ void __launch_bounds__(C3_THREADS, 1)
conv3_dgrad_1x1(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_wt, bf16* dx,
                Conv3Args args) {
    conv3_gemm<C3_EPI_NONE, 0>(&map_dy, &map_wt, dx, args, Conv3Epilogue{});
}

// dgrad finishing the gradient of the batch norm that produced x (conv2_dgrad_bn_*'s contract):
// dx = [y > 0]·(dgrad1x1(dy, w) [+ dx with args.accumulate] [+ residual]) (residual may be
// null; y = bn_y, or with bn_y null and relu set recomputed from bn_x, γ, β; neither: no
// mask; bn_signs, when given with bn_y null: y's packed signs, bit e of byte i / 8 for element
// i = 8·(i / 8) + e), and the tile sums Σdx and Σdx·(bn_x − mean)·invstd in part ([2][gridDim.x][C])
extern "C" __global__ void __launch_bounds__(C3_THREADS, 1)
conv3_dgrad_bn_1x1(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_wt, bf16* dx,
                   Conv3Args args, float* part, const bf16* __restrict__ bn_y, const bf16* __restrict__ bn_x,
                   const float* __restrict__ mean, const float* __restrict__ invstd, const bf16* __restrict__ residual, const bf16* __restrict__ gamma,
                   const bf16* __restrict__ beta, int relu,
                   const unsigned char* __restrict__ bn_signs) {
    const Conv3Epilogue ep{part, bn_y, bn_x, mean, invstd, residual, gamma, beta, relu, bn_signs};
    conv3_gemm<C3_EPI_BN_GRAD, 0>(&map_dy, &map_wt, dx, args, ep);
}

// y = conv3x3(x, w) at stride args.stride (1 or 2; padding args.pad), or a strided 1×1
// (args.taps = 1): map_x: x as a 4-D NHWC tensor in boxes of 64 channels × tile_w × tile_h ×
// (128 / (tile_h·tile_w)) images (traversal strides args.stride over columns and rows),
// map_w: w as [K][taps²·C]
extern "C" __global__ void __launch_bounds__(C3_THREADS, 1)
conv3_fwd_3x3(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w, bf16* y,
              Conv3Args args) {
    conv3_gemm<C3_EPI_NONE, 0, 1>(&map_x, &map_w, y, args, Conv3Epilogue{});
}

// The same with the tile statistics of y in part ([2][gridDim.x][K]; every tile is whole)
extern "C" __global__ void __launch_bounds__(C3_THREADS, 1)
conv3_fwd_stats_3x3(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w, bf16* y,
                    Conv3Args args, float* part) {
    Conv3Epilogue ep{};
    ep.part = part;
    conv3_gemm<C3_EPI_STATS, 0, 1>(&map_x, &map_w, y, args, ep);
}

// dx = dgrad3x3(dy, w) at stride 1 (+ dx with args.accumulate): the forward's loop over the
// taps with the input box of dy shifted by pad − tap (args.flip) and wt = the weight as
// [C][9·K] (conv3_dgrad_weights_3x3): dx[p][c] = Σ_(tap,k) dy[p + pad − tap][k]·w[k][tap][c].
// At args.stride 2 (pad 1; dx's extents twice dy's) the phases: grid.z = 4 parities of dx's
// rows and columns, each over tiles of dy's extents with its 1, 2 or 4 taps and its rows of wt
// as [4][C][4·K] (conv3_dgrad_weights_s2), its pixels scattered to (2h + ph, 2w + pw).
extern "C" __global__ void __launch_bounds__(C3_THREADS, 1)
conv3_dgrad_3x3(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_wt, bf16* dx,
                Conv3Args args) {
    conv3_gemm<C3_EPI_NONE, 0, 1>(&map_dy, &map_wt, dx, args, Conv3Epilogue{});
}

// The same finishing the gradient of the batch norm that produced x (conv3_dgrad_bn_1x1's
// contract; every tile is whole)
extern "C" __global__ void __launch_bounds__(C3_THREADS, 1)
conv3_dgrad_bn_3x3(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_wt, bf16* dx,
                   Conv3Args args, float* part, const bf16* __restrict__ bn_y, const bf16* __restrict__ bn_x,
                   const float* __restrict__ mean, const float* __restrict__ invstd, const bf16* __restrict__ residual, const bf16* __restrict__ gamma,
                   const bf16* __restrict__ beta, int relu,
                   const unsigned char* __restrict__ bn_signs) {
    const Conv3Epilogue ep{part, bn_y, bn_x, mean, invstd, residual, gamma, beta, relu, bn_signs};
    conv3_gemm<C3_EPI_BN_GRAD, 0, 1>(&map_dy, &map_wt, dx, args, ep);
}

// dw[z] = wgrad1x1(dy, x) over reduction slice z (f32 [K][C] planes, then conv2_wgrad_reduce;
// one slice writes dw itself): the GEMM dw[K][C] = dyᵀ · x over the pixels, both operands
// MN-major; map_dy: dy as [P][K] in boxes of 64 channels × 64 pixels, map_x: x as [P][C] alike
extern "C" __global__ void __launch_bounds__(C3_THREADS, 1)
conv3_wgrad_1x1(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_x, float* dw,
                Conv3Args args) {
    conv3_gemm<C3_EPI_WGRAD, 1>(&map_dy, &map_x, dw, args, Conv3Epilogue{});
}

// dw[z] = wgrad3x3(dy, x) over reduction slice z (f32 [K][9·C] planes, then
// conv2_wgrad_reduce): dw[k][(tap, c)] = Σ_p dy[p][k]·x[p·stride + tap − pad][c], the pixels
// (of dy) in whole tiles of 64 (args.tile_h × tile_w × the rest in images), both operands
// MN-major 4-D boxes: map_dy: dy's 64 channels × the tile, map_x: x's 64 channels × the tile
// shifted by the tap (traversal strides args.stride over its columns and rows)
extern "C" __global__ void __launch_bounds__(C3_THREADS, 1)
conv3_wgrad_3x3(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_x, float* dw,
                Conv3Args args) {
    conv3_gemm<C3_EPI_WGRAD, 1, 1>(&map_dy, &map_x, dw, args, Conv3Epilogue{});
}

// The same GEMMs with 64-column tiles (`_n64`: one m64n64k16 wgmma per 16 of k, B tiles of 64
// rows, CONV3_N64_SMEM_BYTES: 4 stages of 24 KiB and the slack, two blocks per SM): the host
// picks them where the GEMM's N is at most 64 (a 128-column tile would be half padding; the 4-D
// weight gradient's N is 64 only for a strided 1×1 of 64 input channels).
extern "C" __global__ void __launch_bounds__(C3_THREADS, 2)
conv3_fwd_1x1_n64(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w, bf16* y, Conv3Args args) {
    conv3_gemm<C3_EPI_NONE, 0, 0, 64>(&map_x, &map_w, y, args, Conv3Epilogue{});
}

extern "C" __global__ void __launch_bounds__(C3_THREADS, 2)
conv3_fwd_stats_1x1_n64(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w, bf16* y,
                    Conv3Args args, float* part) {
    Conv3Epilogue ep{};
    ep.part = part;
    conv3_gemm<C3_EPI_STATS, 0, 0, 64>(&map_x, &map_w, y, args, ep);
}

extern "C" __global__ void __launch_bounds__(C3_THREADS, 2)
conv3_dgrad_1x1_n64(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_wt, bf16* dx,
                Conv3Args args) {
    conv3_gemm<C3_EPI_NONE, 0, 0, 64>(&map_dy, &map_wt, dx, args, Conv3Epilogue{});
}

extern "C" __global__ void __launch_bounds__(C3_THREADS, 2)
conv3_dgrad_bn_1x1_n64(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_wt, bf16* dx,
                   Conv3Args args, float* part, const bf16* __restrict__ bn_y, const bf16* __restrict__ bn_x,
                   const float* __restrict__ mean, const float* __restrict__ invstd, const bf16* __restrict__ residual, const bf16* __restrict__ gamma,
                   const bf16* __restrict__ beta, int relu,
                   const unsigned char* __restrict__ bn_signs) {
    const Conv3Epilogue ep{part, bn_y, bn_x, mean, invstd, residual, gamma, beta, relu, bn_signs};
    conv3_gemm<C3_EPI_BN_GRAD, 0, 0, 64>(&map_dy, &map_wt, dx, args, ep);
}

extern "C" __global__ void __launch_bounds__(C3_THREADS, 2)
conv3_fwd_3x3_n64(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w, bf16* y,
              Conv3Args args) {
    conv3_gemm<C3_EPI_NONE, 0, 1, 64>(&map_x, &map_w, y, args, Conv3Epilogue{});
}

extern "C" __global__ void __launch_bounds__(C3_THREADS, 2)
conv3_fwd_stats_3x3_n64(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w, bf16* y,
                    Conv3Args args, float* part) {
    Conv3Epilogue ep{};
    ep.part = part;
    conv3_gemm<C3_EPI_STATS, 0, 1, 64>(&map_x, &map_w, y, args, ep);
}

extern "C" __global__ void __launch_bounds__(C3_THREADS, 2)
conv3_dgrad_3x3_n64(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_wt, bf16* dx,
                Conv3Args args) {
    conv3_gemm<C3_EPI_NONE, 0, 1, 64>(&map_dy, &map_wt, dx, args, Conv3Epilogue{});
}

extern "C" __global__ void __launch_bounds__(C3_THREADS, 2)
conv3_dgrad_bn_3x3_n64(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_wt, bf16* dx,
                   Conv3Args args, float* part, const bf16* __restrict__ bn_y, const bf16* __restrict__ bn_x,
                   const float* __restrict__ mean, const float* __restrict__ invstd, const bf16* __restrict__ residual, const bf16* __restrict__ gamma,
                   const bf16* __restrict__ beta, int relu,
                   const unsigned char* __restrict__ bn_signs) {
    const Conv3Epilogue ep{part, bn_y, bn_x, mean, invstd, residual, gamma, beta, relu, bn_signs};
    conv3_gemm<C3_EPI_BN_GRAD, 0, 1, 64>(&map_dy, &map_wt, dx, args, ep);
}

extern "C" __global__ void __launch_bounds__(C3_THREADS, 2)
conv3_wgrad_1x1_n64(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_x, float* dw,
                Conv3Args args) {
    conv3_gemm<C3_EPI_WGRAD, 1, 0, 64>(&map_dy, &map_x, dw, args, Conv3Epilogue{});
}

// (N = taps·C ≤ 64: the strided 1×1 weight gradient of 64 input channels, one tap)
extern "C" __global__ void __launch_bounds__(C3_THREADS, 2)
conv3_wgrad_3x3_n64(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_x, float* dw,
                Conv3Args args) {
    conv3_gemm<C3_EPI_WGRAD, 1, 1, 64>(&map_dy, &map_x, dw, args, Conv3Epilogue{});
}

// The weight gradients with 64-row tiles (`_m64`: 64 output channels × 128 columns, the
// consumers splitting the columns, each one m64n64k16 per 16 of k on the stage's one A box;
// CONV3_N64_SMEM_BYTES, as the A box and B's two are 24 KiB a stage; two blocks per SM): the
// host picks them where the GEMM's M (output channels) is at most 64 and N is over 64 (a
// 128-row tile would leave one consumer multiplying zeros).
extern "C" __global__ void __launch_bounds__(C3_THREADS, 2)
conv3_wgrad_1x1_m64(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_x, float* dw,
                    Conv3Args args) {
    conv3_gemm<C3_EPI_WGRAD, 1, 0, 128, 64>(&map_dy, &map_x, dw, args, Conv3Epilogue{});
}

extern "C" __global__ void __launch_bounds__(C3_THREADS, 2)
conv3_wgrad_3x3_m64(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_x, float* dw,
                    Conv3Args args) {
    conv3_gemm<C3_EPI_WGRAD, 1, 1, 128, 64>(&map_dy, &map_x, dw, args, Conv3Epilogue{});
}


// The forward and data-gradient kernels of 128 × 128 tiles by persistent blocks (`_p`,
// conv3_gemm_p: the same arguments and results as their one-tile-per-block originals; grid
// (blocks, 1, 1), CONV3_P_SMEM_BYTES of dynamic shared memory, one block per SM).
extern "C" __global__ void __launch_bounds__(C3_THREADS, 1)
conv3_fwd_1x1_p(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w, bf16* y,
                Conv3Args args) {
    conv3_gemm_p<C3_EPI_NONE, 0>(&map_x, &map_w, y, args, Conv3Epilogue{});
}

extern "C" __global__ void __launch_bounds__(C3_THREADS, 1)
conv3_fwd_stats_1x1_p(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w, bf16* y,
                      Conv3Args args, float* part) {
    Conv3Epilogue ep{};
    ep.part = part;
    conv3_gemm_p<C3_EPI_STATS, 0>(&map_x, &map_w, y, args, ep);
}

extern "C" __global__ void __launch_bounds__(C3_THREADS, 1)
conv3_dgrad_1x1_p(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_wt, bf16* dx,
                  Conv3Args args) {
    conv3_gemm_p<C3_EPI_NONE, 0>(&map_dy, &map_wt, dx, args, Conv3Epilogue{});
}

extern "C" __global__ void __launch_bounds__(C3_THREADS, 1)
conv3_dgrad_bn_1x1_p(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_wt, bf16* dx,
                     Conv3Args args, float* part, const bf16* __restrict__ bn_y, const bf16* __restrict__ bn_x,
                     const float* __restrict__ mean, const float* __restrict__ invstd,
                     const bf16* __restrict__ residual, const bf16* __restrict__ gamma,
                     const bf16* __restrict__ beta, int relu,
                     const unsigned char* __restrict__ bn_signs) {
    const Conv3Epilogue ep{part, bn_y, bn_x, mean, invstd, residual, gamma, beta, relu, bn_signs};
    conv3_gemm_p<C3_EPI_BN_GRAD, 0>(&map_dy, &map_wt, dx, args, ep);
}

extern "C" __global__ void __launch_bounds__(C3_THREADS, 1)
conv3_fwd_3x3_p(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w, bf16* y,
                Conv3Args args) {
    conv3_gemm_p<C3_EPI_NONE, 1>(&map_x, &map_w, y, args, Conv3Epilogue{});
}

extern "C" __global__ void __launch_bounds__(C3_THREADS, 1)
conv3_fwd_stats_3x3_p(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w, bf16* y,
                      Conv3Args args, float* part) {
    Conv3Epilogue ep{};
    ep.part = part;
    conv3_gemm_p<C3_EPI_STATS, 1>(&map_x, &map_w, y, args, ep);
}

extern "C" __global__ void __launch_bounds__(C3_THREADS, 1)
conv3_dgrad_3x3_p(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_wt, bf16* dx,
                  Conv3Args args) {
    conv3_gemm_p<C3_EPI_NONE, 1>(&map_dy, &map_wt, dx, args, Conv3Epilogue{});
}

extern "C" __global__ void __launch_bounds__(C3_THREADS, 1)
conv3_dgrad_bn_3x3_p(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_wt, bf16* dx,
                     Conv3Args args, float* part, const bf16* __restrict__ bn_y, const bf16* __restrict__ bn_x,
                     const float* __restrict__ mean, const float* __restrict__ invstd,
                     const bf16* __restrict__ residual, const bf16* __restrict__ gamma,
                     const bf16* __restrict__ beta, int relu,
                     const unsigned char* __restrict__ bn_signs) {
    const Conv3Epilogue ep{part, bn_y, bn_x, mean, invstd, residual, gamma, beta, relu, bn_signs};
    conv3_gemm_p<C3_EPI_BN_GRAD, 1>(&map_dy, &map_wt, dx, args, ep);
}

// The persistent twins of the 64-column kernels (`_n64_p`: conv3_gemm_p with BN = 64,
// CONV3_N64_P_SMEM_BYTES, two blocks an SM).
extern "C" __global__ void __launch_bounds__(C3_THREADS, 2)
conv3_fwd_1x1_n64_p(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w, bf16* y, Conv3Args args) {
    conv3_gemm_p<C3_EPI_NONE, 0, 64>(&map_x, &map_w, y, args, Conv3Epilogue{});
}

extern "C" __global__ void __launch_bounds__(C3_THREADS, 2)
conv3_fwd_stats_1x1_n64_p(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w, bf16* y,
    Conv3Args args, float* part) {
    Conv3Epilogue ep{};
    ep.part = part;
    conv3_gemm_p<C3_EPI_STATS, 0, 64>(&map_x, &map_w, y, args, ep);
}

extern "C" __global__ void __launch_bounds__(C3_THREADS, 2)
conv3_dgrad_1x1_n64_p(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_wt, bf16* dx,
    Conv3Args args) {
    conv3_gemm_p<C3_EPI_NONE, 0, 64>(&map_dy, &map_wt, dx, args, Conv3Epilogue{});
}

extern "C" __global__ void __launch_bounds__(C3_THREADS, 2)
conv3_dgrad_bn_1x1_n64_p(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_wt, bf16* dx,
    Conv3Args args, float* part, const bf16* __restrict__ bn_y, const bf16* __restrict__ bn_x,
    const float* __restrict__ mean, const float* __restrict__ invstd, const bf16* __restrict__ residual,
    const bf16* __restrict__ gamma, const bf16* __restrict__ beta, int relu,
    const unsigned char* __restrict__ bn_signs) {
    const Conv3Epilogue ep{part, bn_y, bn_x, mean, invstd, residual, gamma, beta, relu, bn_signs};
    conv3_gemm_p<C3_EPI_BN_GRAD, 0, 64>(&map_dy, &map_wt, dx, args, ep);
}

extern "C" __global__ void __launch_bounds__(C3_THREADS, 2)
conv3_fwd_3x3_n64_p(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w, bf16* y, Conv3Args args) {
    conv3_gemm_p<C3_EPI_NONE, 1, 64>(&map_x, &map_w, y, args, Conv3Epilogue{});
}

extern "C" __global__ void __launch_bounds__(C3_THREADS, 2)
conv3_fwd_stats_3x3_n64_p(const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w, bf16* y,
    Conv3Args args, float* part) {
    Conv3Epilogue ep{};
    ep.part = part;
    conv3_gemm_p<C3_EPI_STATS, 1, 64>(&map_x, &map_w, y, args, ep);
}

extern "C" __global__ void __launch_bounds__(C3_THREADS, 2)
conv3_dgrad_3x3_n64_p(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_wt, bf16* dx,
    Conv3Args args) {
    conv3_gemm_p<C3_EPI_NONE, 1, 64>(&map_dy, &map_wt, dx, args, Conv3Epilogue{});
}

extern "C" __global__ void __launch_bounds__(C3_THREADS, 2)
conv3_dgrad_bn_3x3_n64_p(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_wt, bf16* dx,
    Conv3Args args, float* part, const bf16* __restrict__ bn_y, const bf16* __restrict__ bn_x,
    const float* __restrict__ mean, const float* __restrict__ invstd, const bf16* __restrict__ residual,
    const bf16* __restrict__ gamma, const bf16* __restrict__ beta, int relu,
    const unsigned char* __restrict__ bn_signs) {
    const Conv3Epilogue ep{part, bn_y, bn_x, mean, invstd, residual, gamma, beta, relu, bn_signs};
    conv3_gemm_p<C3_EPI_BN_GRAD, 1, 64>(&map_dy, &map_wt, dx, args, ep);
}

// wt[c][tap·K + k] = w[k][tap][c] (w: KRSC with `taps` = R·S filter positions): the 3×3
// data gradient's B operand, K-major over (tap, k). One thread per element; grid-stride over
// K·taps·C (a small tensor: the weights).
extern "C" __global__ void conv3_dgrad_weights_3x3(const bf16* __restrict__ w, bf16* __restrict__ wt, int k_out,
                                                   int taps, int c_in) {
    const long total = (long)k_out * taps * c_in;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const int c = (int)(i % c_in), tap = (int)(i / c_in % taps), k = (int)(i / ((long)c_in * taps));
        wt[(long)c * taps * k_out + (long)tap * k_out + k] = w[i];
    }
}

// The stride-2 3×3 data gradient's B operand (PHASES): wt[((z·C + c)·4 + tap)·K + k] =
// w[k][r][t][c] for phase z = (ph, pw) and its tap (ri, ti) = (tap / (1 + pw), tap % (1 + pw)),
// r = ph ? 2·ri : 1, t = pw ? 2·ti : 1; a phase's unused taps zero (never read). One thread
// per element of the 16·C·K; grid-stride (a small tensor: the weights).
extern "C" __global__ void conv3_dgrad_weights_s2(const bf16* __restrict__ w, bf16* __restrict__ wt, int k_out,
                                                  int c_in) {
    const long total = 16L * c_in * k_out;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const int k = (int)(i % k_out), tap = (int)(i / k_out % 4), c = (int)(i / (4L * k_out) % c_in);
        const int z = (int)(i / (4L * k_out * c_in)), ph = z / 2, pw = z % 2, ri = tap / (1 + pw), ti = tap % (1 + pw);
        wt[i] = ri <= ph ? w[((long)k * 9 + (ph ? 2 * ri : 1) * 3 + (pw ? 2 * ti : 1)) * c_in + c] : bt_to_bf16(0.0f);
    }
}

// wt[c][k] = w[k][c] (w: [rows = K][cols = C] bf16): the dgrad's B operand, K-major. 32×32
// tiles through shared memory (coalesced reads and writes); block (32, 8), grid
// (ceil(C/32), ceil(K/32)). Any target (plain loads and stores).
extern "C" __global__ void conv3_transpose_weights(const bf16* __restrict__ w, bf16* __restrict__ wt, int rows,
                                                   int cols) {
    __shared__ bf16 tile[32][33];
    const int c0 = blockIdx.x * 32, r0 = blockIdx.y * 32;
    for (int i = threadIdx.y; i < 32; i += 8) {
        const int r = r0 + i, c = c0 + threadIdx.x;
        if (r < rows && c < cols) tile[i][threadIdx.x] = w[(long)r * cols + c];
    }
    __syncthreads();
    for (int i = threadIdx.y; i < 32; i += 8) {
        const int c = c0 + i, r = r0 + threadIdx.x;
        if (r < rows && c < cols) wt[(long)c * rows + r] = tile[threadIdx.x][i];
    }
}
