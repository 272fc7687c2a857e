// conv2.cu: the second generation of the convolution kernels: implicit GEMMs on the tensor
// cores fed by a multi-stage cp.async pipeline, with the gather precomputed so that the main
// loop does no division, and tile shapes chosen per layer. conv.cu (v1) stays selectable
// (BIRDTRAIN_CONV=v1) until this file has been measured faster on a GPU.
//
// Algorithm. The three passes are GEMMs C[M][N] = Σ_kd A[M][kd] · B[kd][N] (bf16 operands,
// f32 accumulation in m16n8k16 `mma.sync`), with the reduction ordered filter taps outer,
// channels inner, so a 16-byte chunk (8 channels) never straddles a tap:
//   forward  M = N·P·Q output pixels, N = K, kd = (r, s, c): A = x gathered, B = w (KRSC rows)
//   dgrad    split into stride² phases: input pixels (h, w) with h ≡ ph, w ≡ pw (mod stride)
//            only meet taps r ≡ ph + pad, s ≡ pw + pad (mod stride), so each phase is a
//            stride-1 correlation of dy with its own sub-filter: M = N·Hφ·Wφ, N = C,
//            kd = (i, j, k) over the phase's taps. No mma is spent on structural zeros (the
//            stride-2 layers would otherwise spend 3/4 of it there); a phase with no tap (the
//            1×1 stride-2 shortcut has three) writes zeros. B is the weight rearranged per
//            phase into [tap][k][c] rows by conv2_dgrad_weights (1×1: the weight itself).
//   wgrad    M = K, N = R·S·C, kd = N·P·Q pixels split over gridDim.z; A = dy rows, B = x
//            gathered per pixel. Every slice stores its f32 partial sums (no atomics) into
//            its own K×RSC plane, which conv2_wgrad_reduce then adds in slice order: the
//            gradient is bit-reproducible (one slice writes dw itself).
// The gather is precomputed. In the prologue (the only place with divisions) every thread
// resolves the output rows it loads into a base offset and two validity masks (the filter
// rows, and the filter columns, that stay inside the image). In the k-loop it keeps its
// reduction column as (r, s, channel) plus a running offset, advanced by BK with a compare and
// additions; the predicates are recomputed from the masks only when the tap changes. The
// wgrad gather of x tracks each thread's pixel (image, p, q) with constant-time carries.
// 1×1 convolutions take plain GEMM paths: forward and dgrad move a pointer along the
// channels (stride 2: the row bases are strided, the loop is the same; dgrad writes strided
// rows); wgrad at stride 1 walks both operands as contiguous rows.
// The stem (≤ 4 input channels, stride 2: resnet's 7×7 on RGB) reads its input as pixel pairs,
// so that a 16-byte chunk holds real data: the host copies x into [N][H][⌈W/2⌉][8] (pair j of a
// row = pixels 2j, 2j+1 of 4 channels, channel 3 and an odd width's last pixel zero) and the
// weight into [K][R][S'][8] with lead = pad % 2 (pair j holds filter columns 2j − lead,
// 2j + 1 − lead; zeros outside 0..S−1), both by conv2_pair_pixels. Output column q reads input
// columns 2q − pad + s = 2(q − pad_w + j) + e for s = 2j + e − lead, pad_w = (pad + lead) / 2:
// the GEMMs see a convolution over ⌈W/2⌉ pair-columns of 8 channels with an R × S' filter,
// S' = (S + lead + 1) / 2, stride (2, 1) and padding (pad, pad_w) (a pair outside the row holds
// only pixels outside the image). resnet's 7×7: reduction 7·4·8 = 224 instead of 7·7·8 = 392
// with 8 padded channels (useful 147: 66 % instead of 38 %). The wgrad epilogue maps each
// column back to its (r, s, c) of the real K×R×S×3 f32 gradient (c_real, s_real, pair_lead)
// and drops the slots outside it. A 3-channel stem at stride 1 (the CIFAR resnets) is padded
// to 8 channels instead (conv2_pad_channels), c_real = 3. The stem has no dgrad.
// Batch-norm epilogues (BIRDTRAIN_BN_FUSION; conv2_fwd_stats_*, conv2_dgrad_bn_*: the same
// GEMMs, see BnEpilogue): while the bf16 output tile is staged in shared memory, the forward
// reduces each output channel's tile statistics (mean, M2) and the dgrad finishes the gradient
// of the batch norm that produced its input (residual gradient, ReLU mask) and reduces Σg,
// Σg·x̂, each into its own per-tile record; bn.cu merges the records in a fixed order.
// Applied batch norm (conv2_fwd_apply_*, conv2_fwd_stats_apply_*, conv2_wgrad_apply_*: the same
// GEMMs, see AppliedBn): a convolution whose input is an inner batch norm's output
// y = bf16(ReLU?((z − mean)·invstd·γ + β)) reads z instead, so y is never written. The gathered
// operand (forward A, wgrad B) is copied from z as usual, and each thread, after its
// cp.async.wait_group and before the k-step's barrier, rewrites the chunks it copied itself in
// place with bn_apply's expression (so the GEMM sees y's bits, and no barrier is added). Zero
// fills (padding, tails, rows past M) must stay 0, not become ReLU(BN(0)): the copy loop
// records per stage, in the thread's own word of a ring in shared memory behind the stages
// (the plain 8-warp tiles have no register to spare), one bit per chunk that was a real load
// and, in the forward, the chunks' first channel (a thread's A chunks share one reduction
// column, so one channel; wgrad's B columns, hence channels, are fixed per chunk). The
// prologue copies the parameters into shared memory too, four f32 planes [4][C] (so any C,
// and 4 channels of a plane in one load); the rewrite reads them two or four channels at a
// time, as registers allow. The data gradient's batch-norm epilogue likewise takes γ, β and
// a relu flag, to recompute the ReLU mask [y > 0] from the bn_x it reads for x̂ when y is not
// stored.
//
// Pipeline. STAGES shared-memory stages, each holding one BK = 32 slice of A and B. Stages
// 0..STAGES-2 are issued before the loop; iteration kt waits for its stage
// (cp.async.wait_group STAGES-2), crosses the one barrier of the k-step (which also tells
// every warp that the stage read in iteration kt-1 is free), issues the copies of k-step
// kt+STAGES-1 into that free stage, then runs 2 × 16 mma per warp fragment pair with
// fragments from ldmatrix. Copies are 16-byte cp.async.cg with zero fill for everything outside
// the tensors (padding, tails), so no thread ever branches around a load.
//
// Data layout. x, y, dx, dy: NHWC bf16, C % 8 == 0 and K % 8 == 0 (the stem's input and weight
// are paired or padded copies, see "The stem"; its wgrad writes only the real filter back).
// w: KRSC bf16. dw: KRSC f32 with s_real × c_real columns per filter row, overwritten: plane z
// (z = blockIdx.z) of dw holds slice z's partial sums,
// so dw has gridDim.z planes (a workspace) when the reduction is split. Shared memory rows are padded by 8
// elements (16 bytes), so ldmatrix rows and cp.async chunks are free of bank conflicts in both
// tile orientations (reduction inner [rows][BK+8], reduction outer [BK][cols+8]).
//
// Launch configuration. Every warp owns a 64×32 sub-tile (4×4 mma tiles, 32 mma per k-step).
// Tile shapes, by kernel suffix (threads, stages, shared memory, blocks per SM by design):
//   _128x128  8 warps (2×4), 4 stages, 80 KiB, 2 per SM
//   _128x64   4 warps (2×2), 4 stages, 58-60 KiB, 3 per SM (forward, dgrad)
//   _64x128   4 warps (1×4), 4 stages, 52 KiB, 3 per SM    (wgrad, whose M is K)
// Shared memory is dynamic (> 48 KiB: the host raises the function's limit). The rule that
// picks a shape per layer lives in src/cuda/conv.rs (`choose_tile`), and is: the 64-wide
// shapes whenever the GEMM's N (forward, dgrad) or M (wgrad) is at most 64 (a 64-channel
// layer wastes half of every 128-wide tile: 64 of the 53 resnet50 launches per pass are such
// layers or their neighbours), otherwise the shape with the smaller modelled time
// ceil(blocks / (blocks per SM × SMs)) × blocks per SM × tile work, so a launch whose 128×128 grid would leave
// a mostly empty last wave (resnet50's 7×7 stage: 392 tiles over 264 slots) takes the
// half-size tiles instead (784 tiles over 396 slots: 1.98 waves). wgrad splits its reduction over gridDim.z
// so that the blocks fill whole waves (the same time model; src/cuda/conv.rs, `wgrad_splits`).
// grid = (ceil(M/BM), ceil(N/BN), splits or phases).
#include "common.cuh"

// Shape of one convolution; mirrors `Conv2Args` in src/cuda/conv.rs (repr(C), 18 ints).
// The GEMM's view: for the paired stem (see "The stem" above) w, c, s, stride_w and pad_w
// describe the pixel pairs, and c_real, s_real, pair_lead how dw's real filter maps onto them.
struct Conv2Args {
    int n, h, w, c;       // input batch, height, width, channels as stored (C % 8 == 0)
    int k, r, s;          // output channels (K % 8 == 0), filter height, filter width (≤ 16)
    int p, q;             // output height, width
    int stride, pad;      // along the rows (and the columns, unless paired; dgrad: both)
    int stride_w, pad_w;  // along the columns (forward and wgrad)
    int c_real;           // wgrad: channels of dw (the stem: 3 of 8 stored); c otherwise
    int s_real;           // wgrad: filter width of dw (the paired stem: 7 for s = 4 pairs); s otherwise
    int pair_lead;        // wgrad, paired stem: pixel slots before filter column 0 (pad % 2); -1 unpaired
    int k_chunk;          // wgrad: reduction pixels per gridDim.z slice (a multiple of BK)
    int accumulate;       // dgrad: add into dx instead of overwriting
};

#define BK 32
#define SKEW 8  // row padding of every shared-memory tile, in elements

enum { FWD = 0, DGRAD = 1, WGRAD = 2 };
// Gathers: GENERAL (any filter), UNIT (1×1 without padding: plain GEMM rows), and for wgrad
// SMALL_C (C % 8 == 0 but not % 32: a thread's columns may lie in different taps).
enum { GENERAL = 0, UNIT = 1, SMALL_C = 2 };

// Dynamic shared memory (the emulator has no `extern __shared__`).
#ifdef BT_EMULATE
#define CONV2_SMEM(name) static unsigned char name[BT_EMU_DYN_SMEM] __attribute__((aligned(16)))
#else
#define CONV2_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

template <int BM_, int BN_, int WARPS_M_, int WARPS_N_, int STAGES_>
struct Tile {
    static constexpr int BM = BM_, BN = BN_, WARPS_M = WARPS_M_, WARPS_N = WARPS_N_;
    static constexpr int STAGES = STAGES_;
    static constexpr int THREADS = 32 * WARPS_M * WARPS_N;
    static constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;  // 64 × 32 per warp
    static constexpr int MI = WM / 16, NI = WN / 8;
};
typedef Tile<128, 128, 2, 4, 4> T128x128;
typedef Tile<128, 64, 2, 2, 4> T128x64;
typedef Tile<64, 128, 1, 4, 4> T64x128;

// Operand tile geometry per pass: A is stored reduction-inner ([BM][BK+SKEW]) for forward and
// dgrad, reduction-outer ([BK][BM+SKEW]) for wgrad; B reduction-inner for forward only.
template <int MODE, class T>
struct Geometry {
    static constexpr bool A_INNER = MODE != WGRAD, B_INNER = MODE == FWD;
    static constexpr int LDA = A_INNER ? BK + SKEW : T::BM + SKEW;
    static constexpr int LDB = B_INNER ? BK + SKEW : T::BN + SKEW;
    static constexpr int A_ELEMS = A_INNER ? T::BM * LDA : BK * LDA;
    static constexpr int B_ELEMS = B_INNER ? T::BN * LDB : BK * LDB;
    static constexpr int STAGE_ELEMS = A_ELEMS + B_ELEMS;
    // 16-byte chunks each thread copies per k-step.
    static constexpr int CA = T::BM * BK / 8 / T::THREADS;
    static constexpr int CB = T::BN * BK / 8 / T::THREADS;
};

// Bits max(lo, 0)..hi-1 set (empty when hi <= lo); hi ≤ 15, the filter extent.
__device__ __forceinline__ unsigned bit_range(int lo, int hi) {
    lo = max(lo, 0);
    return hi > lo ? ((1u << hi) - 1u) & ~((1u << lo) - 1u) : 0u;
}

// Geometry of dgrad phase `phase` (= ph·stride + pw): its taps r = r0 + stride·i (i < rn),
// its output rows p = hh + oh - i for input rows h = ph + stride·hh (hh < hn), the same along
// the width, and where its weights start in the rearranged [phase][tap][k][c] buffer.
struct Phase {
    int ph, pw, r0, s0, rn, sn, oh, ow, hn, wn;
    long w_offset;
};

__device__ __forceinline__ int phase_taps(int first, int extent, int stride) {
    return first < extent ? (extent - first + stride - 1) / stride : 0;
}

__device__ __forceinline__ Phase dgrad_phase(const Conv2Args& a, int phase) {
    Phase f;
    f.ph = phase / a.stride;
    f.pw = phase - f.ph * a.stride;
    f.r0 = (f.ph + a.pad) % a.stride;
    f.s0 = (f.pw + a.pad) % a.stride;
    f.rn = phase_taps(f.r0, a.r, a.stride);
    f.sn = phase_taps(f.s0, a.s, a.stride);
    f.oh = (f.ph + a.pad - f.r0) / a.stride;
    f.ow = (f.pw + a.pad - f.s0) / a.stride;
    f.hn = f.ph < a.h ? (a.h - f.ph + a.stride - 1) / a.stride : 0;
    f.wn = f.pw < a.w ? (a.w - f.pw + a.stride - 1) / a.stride : 0;
    f.w_offset = 0;
    for (int e = 0; e < phase; ++e) {
        const int eh = e / a.stride, ew = e - eh * a.stride;
        f.w_offset += (long)phase_taps((eh + a.pad) % a.stride, a.r, a.stride) *
                      phase_taps((ew + a.pad) % a.stride, a.s, a.stride) * a.k * a.c;
    }
    return f;
}

// Taps of a GENERAL gather, one entry per filter position t = r·S + s (forward; in dgrad the
// phase's own taps): the element offset r·dr + s·ds from a row's base, with (ds, dr) = (C, W·C)
// forward and (-K, -Q·K) in dgrad (its taps walk dy backwards), and the tap as one bit among
// the filter rows (bits 0-15) and one among the filter columns (bits 16-31). Entries past the
// filter, which the pipeline's look-ahead reaches (at most STAGES + 1 k-steps of up to BK/8
// taps), hold bit 15: a row that no mask has (R ≤ 15), so they read nothing.
#define TAP_TABLE 128
#define MAX_TAPS (TAP_TABLE - (4 + 1) * BK / 8)

// The reduction column of one thread: tap index t and channel ch. A k-step moves it by
// BK = dt·C + dc taps and channels, with one carry (no division, no branch).
struct TapCursor {
    int ch, t, channels, dc, dt;
    __device__ __forceinline__ void init(int channels_, int start) {
        channels = channels_;
        dc = BK % channels;
        dt = BK / channels;
        ch = start % channels;
        t = start / channels;
    }
    __device__ __forceinline__ void step() {
        ch += dc;
        const int cc = ch >= channels;
        ch -= cc ? channels : 0;
        t += dt + cc;
    }
    // Whether a row whose mask (rows inside the image | columns inside << 16) holds both bits
    // of the tap reads inside the tensor: one logic instruction per row.
    static __device__ __forceinline__ int valid(unsigned mask, unsigned onehot) { return (~mask & onehot) == 0u; }
};

// The pixel a wgrad thread gathers for: output (p, q) of some image, its top-left input
// coordinates hy = p·stride - pad, wx = q·stride_w - pad_w, and `base`, the offset of input pixel
// (image, hy, wx). A k-step moves it by BK pixels = (dn, dp, dq) in mixed radix (N, P, Q):
// the digits carry once each, and base moves by a constant plus one correction per carry.
// OWN_COLUMNS: whether the column stride and padding are stride_w, pad_w (the small-C gather,
// which takes the paired stem) or stride, pad (the other gathers, whose layers have the same
// in both dimensions: their loop keeps one stride and one padding in registers).
template <bool OWN_COLUMNS>
struct PixelCursor {
    int p, q, hy, wx, base;
    int dp, dq, inc, inc_q, inc_p;
    static __device__ __forceinline__ int stride_w(const Conv2Args& a) { return OWN_COLUMNS ? a.stride_w : a.stride; }
    static __device__ __forceinline__ int pad_w(const Conv2Args& a) { return OWN_COLUMNS ? a.pad_w : a.pad; }
    __device__ __forceinline__ void init(const Conv2Args& a, int pixel) {
        q = pixel % a.q;
        const int np = pixel / a.q;
        p = np % a.p;
        const int n = np / a.p;
        hy = p * a.stride - a.pad;
        wx = q * stride_w(a) - pad_w(a);
        base = ((n * a.h + hy) * a.w + wx) * a.c;
        const int pq = a.p * a.q, dn = BK / pq, rem = BK - dn * pq;
        dp = rem / a.q;
        dq = rem - dp * a.q;
        inc = ((dn * a.h + dp * a.stride) * a.w + dq * stride_w(a)) * a.c;
        inc_q = (a.stride * a.w - a.q * stride_w(a)) * a.c;     // q wrapped: next row
        inc_p = (a.h * a.w - a.p * a.stride * a.w) * a.c;      // p wrapped: next image
    }
    __device__ __forceinline__ void step(const Conv2Args& a) {
        q += dq;
        const int cq = q >= a.q;
        q -= cq ? a.q : 0;
        p += dp + cq;
        const int cp = p >= a.p;
        p -= cp ? a.p : 0;
        base += inc + (cq ? inc_q : 0) + (cp ? inc_p : 0);
        hy = p * a.stride - a.pad;
        wx = q * stride_w(a) - pad_w(a);
    }
};

// Batch-norm work a forward or dgrad GEMM takes into its epilogue (BIRDTRAIN_BN_FUSION; the
// kernels named conv2_fwd_stats_* and conv2_dgrad_bn_*). EPI_NONE is the plain epilogue.
//   EPI_STATS (forward): besides y, the tile's (mean, M2 = Σ(y − mean)²) of every output
//     channel over the tile's valid rows, two-pass in f32 from the bf16 values stored in y
//     (what the batch norm reads), into record blockIdx.x of part: planes [2][gridDim.x][K].
//     The tile's row count min(BM, M − m0) is implied by the record index (bn_stats_merge
//     derives it), so it is not stored.
//   EPI_BN_GRAD (dgrad): dx becomes the gradient g at the output of the normalisation of the
//     batch norm that produced this convolution's input: g = [y > 0]·(dgrad [+ dx] [+
//     residual]) (bf16 roundings in that order, as the unfused kernels round them; y = bn_y,
//     or with bn_y null and relu set recomputed from bn_x, γ, β as bn_apply writes it; neither:
//     no mask), and the
//     tile's Σg and Σg·x̂ (x̂ = (bn_x − mean)·invstd) of every input channel go to record
//     blockIdx.z·gridDim.x + blockIdx.x of part: planes [2][gridDim.z·gridDim.x][C]. A block
//     past its phase's rows writes a zero record, so every record is written.
// Per channel, TPC = THREADS / BN threads each sum a fixed span of rows of the staged tile,
// and thread 0 of the column adds their sums in a fixed order: no atomics, the same bits
// every run; the partial records are merged in a fixed order by bn.cu (bn_stats_merge,
// bn_sums_merge).
enum { EPI_NONE = 0, EPI_STATS = 1, EPI_BN_GRAD = 2 };

struct BnEpilogue {
    float* part;           // the partial records (see above)
    const bf16* bn_y;      // BN_GRAD: the batch norm's output (this convolution's input); may be null
    const bf16* bn_x;      // BN_GRAD: the batch norm's input
    const float* mean;     // BN_GRAD: its saved mean and 1/sqrt(var + eps)
    const float* invstd;
    const bf16* residual;  // BN_GRAD: a gradient added before the mask; may be null
    const bf16* gamma;     // BN_GRAD with relu and no bn_y: its scale and shift, to recompute y
    const bf16* beta;
    int relu;              // BN_GRAD: mask with [y > 0], y = bn_y, or recomputed from bn_x if null
};

// The batch norm an APPLY kernel (conv2_fwd_apply_*, conv2_fwd_stats_apply_*,
// conv2_wgrad_apply_*) applies to its input z as it loads it: per input channel c,
// y = bf16(ReLU?((z − mean[c])·invstd[c]·γ[c] + β[c])), bn_apply_vec's expression (bn.cu)
// term for term, so the GEMM sees the bits the separate bn_apply pass would have written.
struct AppliedBn {
    const float* mean;
    const float* invstd;
    const bf16* gamma;
    const bf16* beta;
    int relu;
};

// 4 consecutive channels (words w0, w1) with parameters (m, is, g, b).{x, y, z, w}.
__device__ __forceinline__ void applied_bn4(unsigned& w0, unsigned& w1, float4 m, float4 is, float4 g, float4 b,
                                            int relu) {
    float v0 = (__uint_as_float(w0 << 16) - m.x) * is.x * g.x + b.x;
    float v1 = (__uint_as_float(w0 & 0xffff0000u) - m.y) * is.y * g.y + b.y;
    float v2 = (__uint_as_float(w1 << 16) - m.z) * is.z * g.z + b.z;
    float v3 = (__uint_as_float(w1 & 0xffff0000u) - m.w) * is.w * g.w + b.w;
    if (relu) {
        v0 = fmaxf(v0, 0.0f);
        v1 = fmaxf(v1, 0.0f);
        v2 = fmaxf(v2, 0.0f);
        v3 = fmaxf(v3, 0.0f);
    }
    w0 = pack_bf16x2(v0, v1);
    w1 = pack_bf16x2(v2, v3);
}

// Shared-memory loads and stores at a 32-bit shared address (bt_saddr), as the pipeline
// computes them: no 64-bit generic pointers in the k-loop.
__device__ __forceinline__ unsigned lds_u32(bt_saddr a) {
#ifdef BT_EMULATE
    return *reinterpret_cast<const unsigned*>(a);
#else
    unsigned v;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(a));
    return v;
#endif
}
__device__ __forceinline__ void sts_u32(bt_saddr a, unsigned v) {
#ifdef BT_EMULATE
    *reinterpret_cast<unsigned*>(a) = v;
#else
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(a), "r"(v) : "memory");
#endif
}
__device__ __forceinline__ uint4 lds_u32x4(bt_saddr a) {
#ifdef BT_EMULATE
    return *reinterpret_cast<const uint4*>(a);
#else
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
#endif
}
__device__ __forceinline__ void sts_u32x4(bt_saddr a, uint4 v) {
#ifdef BT_EMULATE
    *reinterpret_cast<uint4*>(a) = v;
#else
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
#endif
}
__device__ __forceinline__ float4 lds_f32x4(bt_saddr a) {
#ifdef BT_EMULATE
    return *reinterpret_cast<const float4*>(a);
#else
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a));
    return v;
#endif
}
__device__ __forceinline__ float2 lds_f32x2(bt_saddr a) {
#ifdef BT_EMULATE
    return *reinterpret_cast<const float2*>(a);
#else
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0,%1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(a));
    return v;
#endif
}

// `n` chunks (16 bytes, channels c0..c0+7 each) at shared addresses chunk0 + i·chunk_step, where
// bit i of `live` is set,
// replaced by the batch norm's output. The parameters come from `table`, the APPLY kernels'
// copy in shared memory behind the pipeline stages (planes [4][C] of f32: mean, invstd, γ, β),
// 8 / PARTS channels at a time (one 16- or 8-byte load per plane), so that only 32 / PARTS
// registers of them are live (PARTS = 4 where registers are tight, else 2).
template <int n, int PARTS>
__device__ __forceinline__ void applied_bn_chunks(bt_saddr chunk0, int chunk_step, unsigned live, bt_saddr table,
                                                  int channels, int c0, int relu) {
    uint4 v[n];
#pragma unroll
    for (int i = 0; i < n; ++i) v[i] = lds_u32x4(chunk0 + i * chunk_step);
    const bt_saddr at = table + 4 * c0, plane = 4 * channels;
    if (PARTS == 2) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float4 m = lds_f32x4(at + 16 * h), is = lds_f32x4(at + plane + 16 * h);
            const float4 g = lds_f32x4(at + 2 * plane + 16 * h), b = lds_f32x4(at + 3 * plane + 16 * h);
#pragma unroll
            for (int i = 0; i < n; ++i) {
                if (h == 0) applied_bn4(v[i].x, v[i].y, m, is, g, b, relu);
                else applied_bn4(v[i].z, v[i].w, m, is, g, b, relu);
            }
        }
    } else {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const float2 m = lds_f32x2(at + 8 * q), is = lds_f32x2(at + plane + 8 * q);
            const float2 g = lds_f32x2(at + 2 * plane + 8 * q), b = lds_f32x2(at + 3 * plane + 8 * q);
#pragma unroll
            for (int i = 0; i < n; ++i) {
                unsigned& w = q == 0 ? v[i].x : q == 1 ? v[i].y : q == 2 ? v[i].z : v[i].w;
                w = applied_bn2(w, m, is, g, b, relu);
            }
        }
    }
    // Zero fills are stored back as zeros (branch-free: no divergence, fewer registers).
#pragma unroll
    for (int i = 0; i < n; ++i) {
        const bool keep = live >> i & 1u;
        sts_u32x4(chunk0 + i * chunk_step, keep ? v[i] : make_uint4(0u, 0u, 0u, 0u));
    }
}


// Hides a pointer's origin from the optimiser, so that `p + offset` in the loop stays one
// wide multiply-add on a fixed register pair instead of being re-derived from its parts.
template <class P>
__device__ __forceinline__ P opaque(P p) {
#ifndef BT_EMULATE
    asm("" : "+l"(p));
#endif
    return p;
}

// The GEMM with its gathers, pipeline and epilogue. One instantiation per extern "C" kernel.
// APPLY: the gathered input x (forward: A, wgrad: B) is a batch norm's input z, applied on load
// (`bn`; see "Applied batch norm" above).
template <int MODE, int GATHER, class T, int EPI = EPI_NONE, bool APPLY = false>
__device__ __forceinline__ void conv2_gemm(const bf16* __restrict__ a_src, const bf16* __restrict__ b_src,
                                           void* out, const Conv2Args& a, const BnEpilogue& ep = BnEpilogue{},
                                           const AppliedBn& bn = AppliedBn{}) {
    static_assert(EPI == EPI_NONE || (EPI == EPI_STATS && MODE == FWD) || (EPI == EPI_BN_GRAD && MODE == DGRAD),
                  "forward epilogues take statistics, dgrad ones the batch norm's gradient");
    static_assert(!APPLY || MODE != DGRAD, "the data gradient reads dy, which no batch norm produced");
    typedef Geometry<MODE, T> G;
    CONV2_SMEM(smem_raw);
    __shared__ int row_out[T::BM];  // dgrad: dx offset of each tile row (phases scatter rows)
    __shared__ int2 taps[TAP_TABLE];  // GENERAL forward/dgrad: (offset, one-hot) per tap

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int m0 = blockIdx.x * T::BM, n0 = blockIdx.y * T::BN;

    // ---- the GEMM view of this block -----------------------------------------------------
    int M, N, KD, kd_begin = 0;
    Phase f;
    if (MODE == FWD) {
        M = a.n * a.p * a.q; N = a.k; KD = a.r * a.s * a.c;
    } else if (MODE == DGRAD) {
        f = dgrad_phase(a, blockIdx.z);
        M = a.n * f.hn * f.wn; N = a.c; KD = f.rn * f.sn * a.k;
        if (m0 >= M) {                        // this phase has fewer rows than the largest one
            if (EPI == EPI_BN_GRAD) {
                // ... but its record is summed with the others: zeros.
                const long rec = (long)blockIdx.z * gridDim.x + blockIdx.x, plane = (long)gridDim.z * gridDim.x * N;
                for (int col = tid; col < T::BN; col += T::THREADS)
                    if (n0 + col < N) ep.part[rec * N + n0 + col] = ep.part[plane + rec * N + n0 + col] = 0.0f;
            }
            return;
        }
        // A phase without taps adds nothing (the BN epilogue still masks and sums dx).
        if (KD == 0 && a.accumulate && EPI == EPI_NONE) return;
    } else {
        M = a.k; N = a.r * a.s * a.c;
        kd_begin = blockIdx.z * a.k_chunk;
        KD = min(a.n * a.p * a.q, kd_begin + a.k_chunk);  // end of this slice
    }
    const int ksteps = (KD - kd_begin + BK - 1) / BK;

    if (MODE == DGRAD) {
        // Where each tile row goes in dx (phase rows are strided), for the epilogue; made here
        // so that the phase geometry need not stay in registers through the main loop.
        for (int row = tid; row < T::BM; row += T::THREADS) {
            const int m = m0 + row;
            int o = -1;
            if (m < M) {
                const int x = m % f.wn, t = m / f.wn, y = t % f.hn, n_ = t / f.hn;
                o = ((n_ * a.h + f.ph + a.stride * y) * a.w + f.pw + a.stride * x) * a.c;
            }
            row_out[row] = o;
        }
    }

    // ---- where this thread's 16-byte chunks come from and land ----------------------------
    // A, reduction inner (forward, dgrad): chunk i is tile row a_row0 + i·A_STEP, reduction
    //   columns a_col..+7. A, reduction outer (wgrad): reduction row (pixel) a_row0 + i·A_STEP,
    //   output channels a_col..+7.
    // B, forward: weight row (output channel) b_row0 + j·B_STEP, reduction columns b_col.
    //   dgrad: reduction row b_row0 + j·B_STEP, input channels b_col. wgrad: one pixel row
    //   b_row0 per thread, columns (r, s, c) at b_col + j·B_TPR·8.
    constexpr int A_TPR = G::A_INNER ? BK / 8 : T::BM / 8;  // threads per tile row
    constexpr int A_STEP = T::THREADS / A_TPR;
    constexpr int B_TPR = MODE == FWD ? BK / 8 : MODE == DGRAD ? T::BN / 8 : T::THREADS / BK;
    constexpr int B_STEP = MODE == WGRAD ? 0 : T::THREADS / B_TPR;
    const int a_row0 = tid / A_TPR, a_col = (tid % A_TPR) * 8;  // (a_col: A's first reduction column)
    // wgrad: a thread's CB chunks are consecutive columns, so with C % 32 == 0 they share a tap.
    const int b_row0 = tid / B_TPR, b_col = (tid % B_TPR) * 8 * (MODE == WGRAD ? G::CB : 1);
    const bt_saddr s_base = bt_shared_addr(smem_raw);
    const bt_saddr a_dst = s_base + (a_row0 * G::LDA + a_col) * 2;
    const bt_saddr b_dst = s_base + G::A_ELEMS * 2 + (b_row0 * G::LDB + b_col) * 2;
    // Byte distance between a thread's consecutive chunks in a stage.
    constexpr int A_DST_STEP = A_STEP * G::LDA * 2;
    constexpr int B_DST_STEP = MODE == WGRAD ? 8 * 2 : B_STEP * G::LDB * 2;

    // Sources: a fixed pointer per chunk (its row) plus one running element offset shared by
    // all chunks of an operand, so each copy's address is a single wide multiply-add.
    const bf16* a_ptr[G::CA];
    const bf16* b_ptr[G::CB];
    int a_ok[G::CA], b_ok[G::CB];
    int a_run = 0, b_run = 0;  // running offsets (elements) of A and B
    // GENERAL forward/dgrad: validity masks of each row, and the shared tap cursor.
    unsigned a_mask[G::CA];
    TapCursor cur;
    int2 tap = make_int2(0, 0);  // the table entry of the cursor's tap
    // wgrad GENERAL: the (r, s) of each column; b_ptr[j] then points at the column's offset.
    int b_tap_r[G::CB], b_tap_s[G::CB];
    PixelCursor<GATHER == SMALL_C> pc;
    // APPLY: shared memory behind the stages holds (1) per pipeline stage, what each thread
    // copied into it, in its own word of a ring [STAGES][THREADS] (registers have no room to
    // spare: the plain 8-warp tiles already hold 128 a thread): one bit per chunk that was a
    // real load (not a zero fill), and in the forward the chunks' first channel above them;
    // (2) wgrad: [CB][THREADS] words, the small-C gather's chunk channels (below); (3) the
    // parameter table ([4][C] f32, see applied_bn_chunks). Host: `Conv2Launch::apply_smem_bytes`.
    constexpr int RING_CHUNKS = MODE == FWD ? G::CA : G::CB;
    const bt_saddr ring = s_base + T::STAGES * G::STAGE_ELEMS * 2 + tid * 4;
    constexpr int APPLY_CHANS = MODE == WGRAD ? G::CB * T::THREADS * 4 : 0;  // bytes of b_chans
    const bt_saddr bn_table = s_base + T::STAGES * G::STAGE_ELEMS * 2 + T::STAGES * T::THREADS * 4 + APPLY_CHANS;
    // wgrad APPLY: the channel of B chunk 0; chunk j's is 8·j further (general, unit gathers:
    // the thread's columns are consecutive channels of one tap). The small-C gather's columns
    // may cross taps: chunk j's channel is in the thread's word of row j of [CB][THREADS]
    // words behind the ring (and the table behind those).
    int b_chan0 = 0;
    const bt_saddr b_chans = s_base + T::STAGES * G::STAGE_ELEMS * 2 + T::STAGES * T::THREADS * 4 + tid * 4;

    if (MODE != WGRAD) {
#pragma unroll
        for (int i = 0; i < G::CA; ++i) {
            const int m = m0 + a_row0 + i * A_STEP;
            const bool ok = m < M;
            int base;
            if (MODE == FWD) {
                const int x = m % a.q, t = m / a.q, y = t % a.p, n_ = t / a.p;
                const int hy = y * a.stride - a.pad, wx = x * a.stride_w - a.pad_w;
                base = ((n_ * a.h + hy) * a.w + wx) * a.c;
                a_mask[i] = ok ? bit_range(-hy, min(a.r, a.h - hy)) | bit_range(-wx, min(a.s, a.w - wx)) << 16 : 0u;
            } else {
                // Input row h = ph + stride·y meets dy row p = y + oh - i for its tap i: inside
                // for i in (y + oh - P, y + oh].
                const int x = m % f.wn, t = m / f.wn, y = t % f.hn, n_ = t / f.hn;
                const int hy = y + f.oh, wx = x + f.ow;
                base = ((n_ * a.p + hy) * a.q + wx) * a.k;
                a_mask[i] = ok ? bit_range(hy - a.p + 1, min(f.rn, hy + 1)) | bit_range(wx - a.q + 1, min(f.sn, wx + 1)) << 16
                               : 0u;
            }
            // (an out-of-range row keeps a pointer it never reads through)
            a_ptr[i] = opaque(a_src + base);
            a_ok[i] = ok;
        }
        if (GATHER == GENERAL) {
            const int taps_r = MODE == FWD ? a.r : f.rn, taps_s = MODE == FWD ? a.s : max(f.sn, 1);
            const int ds = MODE == FWD ? a.c : -a.k, dr = MODE == FWD ? a.w * a.c : -a.q * a.k;
            for (int t = tid; t < TAP_TABLE; t += T::THREADS) {
                const int r = t / taps_s, s_ = t - r * taps_s;
                taps[t] = r < taps_r ? make_int2(r * dr + s_ * ds, (int)((1u << r) | (0x10000u << s_)))
                                     : make_int2(0, (int)(1u << 15));
            }
            cur.init(MODE == FWD ? a.c : a.k, a_col);
            __syncthreads();  // the table is complete before the first copy
            tap = taps[cur.t];
        } else {
            a_run = a_col;
        }
    } else {
#pragma unroll
        for (int i = 0; i < G::CA; ++i) {
            a_ptr[i] = opaque(a_src + (long)(kd_begin + a_row0 + i * A_STEP) * a.k + m0 + a_col);
            a_ok[i] = m0 + a_col < M;
        }
    }

    if (MODE == FWD) {
#pragma unroll
        for (int j = 0; j < G::CB; ++j) {
            const int n = n0 + b_row0 + j * B_STEP;
            b_ok[j] = n < N;
            b_ptr[j] = opaque(b_src + (long)n * KD + b_col);
        }
    } else if (MODE == DGRAD) {
#pragma unroll
        for (int j = 0; j < G::CB; ++j) {
            b_ok[j] = n0 + b_col < N;
            b_ptr[j] = opaque(b_src + (GATHER == GENERAL ? f.w_offset : 0) + (long)(b_row0 + j * B_STEP) * a.c + n0 + b_col);
        }
    } else {
        if (GATHER != UNIT) pc.init(a, kd_begin + b_row0);
#pragma unroll
        for (int j = 0; j < G::CB; ++j) {
            const int n = n0 + b_col + j * 8;  // column (r, s, c)
            b_ok[j] = n < N;
            const int c = n % a.c, rs = n / a.c, r = rs / a.s, s = rs - r * a.s;
            b_tap_r[j] = r;
            b_tap_s[j] = s;
            if (j == 0) b_chan0 = c;
            if (APPLY && GATHER == SMALL_C) sts_u32(b_chans + j * (T::THREADS * 4), (unsigned)c);
            // GENERAL, SMALL_C: the column's offset from a pixel's base. UNIT (1×1, stride 1,
            // no padding): x's pixel rows are the GEMM's rows.
            b_ptr[j] = opaque(GATHER != UNIT ? b_src + (r * a.w + s) * a.c + c : b_src + (long)(kd_begin + b_row0) * a.c + n);
        }
    }

    // ---- the copies of one k-step ----------------------------------------------------------
    // Past the end of the reduction every predicate below is false (the cursor's masks have no
    // bit beyond the filter, `left` is ≤ 0), so the last STAGES-1 iterations issue zero fills
    // into stages nobody reads, and the loop needs no branch around its loads.
    int left = KD - kd_begin;  // reduction elements from the next k-step to load on
    auto load = [&](int stage) {
        const bt_saddr ad = a_dst + stage * (G::STAGE_ELEMS * 2);
        const bt_saddr bd = b_dst + stage * (G::STAGE_ELEMS * 2);
        const int a_off = GATHER == GENERAL && MODE != WGRAD ? tap.x + cur.ch : a_run;
        unsigned loaded = 0;  // APPLY: the chunks that are real loads
#pragma unroll
        for (int i = 0; i < G::CA; ++i) {
            int ok;
            if (MODE == WGRAD) ok = a_ok[i] & (a_row0 + i * A_STEP < left);
            else if (GATHER == GENERAL) ok = TapCursor::valid(a_mask[i], (unsigned)tap.y);
            else ok = a_ok[i] & (a_col < left);
            bt_cp_async16(ad + i * A_DST_STEP, a_ptr[i] + a_off, ok ? 16 : 0);
            loaded |= (ok ? 1u : 0u) << i;
        }
        // (a stage's ring entry: chunk bits, forward: the channel above them)
        auto ring_put = [&](unsigned entry) { sts_u32(ring + stage * (T::THREADS * 4), entry); };
        if (APPLY && MODE == FWD) ring_put((unsigned)(GATHER == GENERAL ? cur.ch : a_run) << RING_CHUNKS | loaded);
        loaded = 0;
        // wgrad GENERAL: the thread's chunks share chunk 0's tap and its N bound (C % 32 == 0).
        const int pixel_ok = MODE == WGRAD && GATHER == GENERAL
                                 ? (b_row0 < left) & ((unsigned)(pc.hy + b_tap_r[0]) < (unsigned)a.h) &
                                       ((unsigned)(pc.wx + b_tap_s[0]) < (unsigned)a.w)
                                 : 0;
#pragma unroll
        for (int j = 0; j < G::CB; ++j) {
            int ok;
            if (MODE == FWD) ok = b_ok[j] & (b_col < left);
            else if (MODE == DGRAD) ok = b_ok[j] & (b_row0 + j * B_STEP < left);
            else if (GATHER == UNIT) ok = b_ok[j] & (b_row0 < left);
            else if (GATHER == GENERAL) ok = b_ok[0] & pixel_ok;  // N % 32 == 0: one test for all
            else
                ok = b_ok[j] & (b_row0 < left) & ((unsigned)(pc.hy + b_tap_r[j]) < (unsigned)a.h) &
                     ((unsigned)(pc.wx + b_tap_s[j]) < (unsigned)a.w);
            bt_cp_async16(bd + j * B_DST_STEP, b_ptr[j] + (MODE == WGRAD && GATHER != UNIT ? pc.base : b_run), ok ? 16 : 0);
            loaded |= (ok ? 1u : 0u) << j;
        }
        if (APPLY && MODE == WGRAD) ring_put(loaded);
    };
    // APPLY: the batch norm applied to this thread's own chunks of `stage` once they have landed
    // (after its cp.async.wait_group, before the k-step's barrier publishes them); zero fills
    // stay zero. Forward: A's chunks, all at one channel; wgrad: B's, each at its own.
    auto apply_stage = [&](int stage) {
        const unsigned rec = lds_u32(ring + stage * (T::THREADS * 4));
        if (MODE == FWD) {
            // (past the reduction the channel is out of range: clamped, every chunk is a zero fill)
            const int c0 = min((int)(rec >> RING_CHUNKS), a.c - 8);
            // Parameters two channels at a time (fewer registers), except in the 4-warp general
            // gather, which has room for four (fewer loads) without spilling.
            applied_bn_chunks<G::CA, GATHER == GENERAL && T::THREADS == 128 ? 2 : 4>(
                a_dst + stage * (G::STAGE_ELEMS * 2), A_DST_STEP, rec, bn_table, a.c, c0, bn.relu);
        } else {
#pragma unroll
            for (int j = 0; j < G::CB; ++j)
                applied_bn_chunks<1, T::THREADS == 256 ? 4 : 2>(b_dst + stage * (G::STAGE_ELEMS * 2) + j * B_DST_STEP, 0,
                                                                rec >> j, bn_table, a.c,
                                                                GATHER == SMALL_C ? (int)lds_u32(b_chans + j * (T::THREADS * 4))
                                                                                  : b_chan0 + 8 * j,
                                                                bn.relu);
        }
    };
    // Moves every source to the next k-step.
    auto advance = [&]() {
        left -= BK;
        if (MODE != WGRAD && GATHER == GENERAL) {
            cur.step();
            tap = taps[cur.t];
        } else {
            a_run += MODE == WGRAD ? BK * a.k : BK;
        }
        if (MODE == WGRAD && GATHER != UNIT) {
            pc.step(a);
        } else {
            b_run += MODE == FWD ? BK : BK * a.c;
        }
    };

    // ---- accumulators and fragment addresses -----------------------------------------------
    const int warp_m = (warp / T::WARPS_N) * T::WM, warp_n = (warp % T::WARPS_N) * T::WN;
    float acc[T::MI][T::NI][4];
#pragma unroll
    for (int i = 0; i < T::MI; ++i)
#pragma unroll
        for (int j = 0; j < T::NI; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
    // ldmatrix: lane l addresses row l % 8 of matrix l / 8. A matrices: (m 0-7, k 0-7),
    // (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15); B: (n 0-7, k 0-7), (n 0-7, k 8-15),
    // (n 8-15, k 0-7), (n 8-15, k 8-15). Per mma tile and k half only an immediate changes.
    const int lq = lane / 8, row8 = lane % 8;
    const bt_saddr a_frag = s_base + 2 * (G::A_INNER ? (warp_m + (lq % 2) * 8 + row8) * G::LDA + (lq / 2) * 8
                                                    : ((lq / 2) * 8 + row8) * G::LDA + warp_m + (lq % 2) * 8);
    const bt_saddr b_frag = s_base + 2 * (G::A_ELEMS + (G::B_INNER ? (warp_n + (lq / 2) * 8 + row8) * G::LDB + (lq % 2) * 8
                                                                  : ((lq % 2) * 8 + row8) * G::LDB + warp_n + (lq / 2) * 8));

    // ---- the pipeline ---------------------------------------------------------------------
    if (APPLY) {
        // The batch norm's parameters into shared memory, complete before the first transform.
        float* table = reinterpret_cast<float*>(smem_raw + T::STAGES * G::STAGE_ELEMS * 2 + T::STAGES * T::THREADS * 4 + APPLY_CHANS);
        for (int c = tid; c < a.c; c += T::THREADS) {
            table[c] = bn.mean[c];
            table[a.c + c] = bn.invstd[c];
            table[2 * a.c + c] = bt_to_f32(bn.gamma[c]);
            table[3 * a.c + c] = bt_to_f32(bn.beta[c]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int st = 0; st < T::STAGES - 1; ++st) {
        load(st);
        advance();
        bt_cp_async_commit();
    }
    // Unrolled by STAGES so that every stage offset is an immediate; one exit test per k-step.
    for (int k0 = 0; k0 < ksteps; k0 += T::STAGES) {
#pragma unroll
        for (int u = 0; u < T::STAGES; ++u) {
            if (k0 + u >= ksteps) break;
            bt_cp_async_wait<T::STAGES - 2>();
            if (APPLY) apply_stage(u);
            __syncthreads();  // stage k has landed for every thread; stage k-1 is free
            load((u + T::STAGES - 1) % T::STAGES);
            advance();
            bt_cp_async_commit();
            const bt_saddr fa_base = a_frag + u * (G::STAGE_ELEMS * 2), fb_base = b_frag + u * (G::STAGE_ELEMS * 2);
#pragma unroll
            for (int kk = 0; kk < BK; kk += 16) {
                unsigned fa[T::MI][4], fb[T::NI][2];
#pragma unroll
                for (int i = 0; i < T::MI; ++i) {
                    if (G::A_INNER) ldsm_x4_at(fa[i], fa_base + 2 * (i * 16 * G::LDA + kk));
                    else ldsm_x4_trans_at(fa[i], fa_base + 2 * (kk * G::LDA + i * 16));
                }
#pragma unroll
                for (int jj = 0; jj < T::NI / 2; ++jj) {
                    unsigned r[4];
                    if (G::B_INNER) ldsm_x4_at(r, fb_base + 2 * (jj * 16 * G::LDB + kk));
                    else ldsm_x4_trans_at(r, fb_base + 2 * (kk * G::LDB + jj * 16));
                    fb[2 * jj][0] = r[0];
                    fb[2 * jj][1] = r[1];
                    fb[2 * jj + 1][0] = r[2];
                    fb[2 * jj + 1][1] = r[3];
                }
#pragma unroll
                for (int i = 0; i < T::MI; ++i)
#pragma unroll
                    for (int j = 0; j < T::NI; ++j) mma_bf16_16816(acc[i][j], fa[i], fb[j]);
            }
        }
    }
    bt_cp_async_wait<0>();

    // ---- epilogue ---------------------------------------------------------------------------
    const int g = lane >> 2, t4 = lane & 3;
    if (MODE == WGRAD) {
        // f32 partial sums of this reduction slice, stored into its own plane of dw (each
        // element by exactly one thread: no atomics, the same bits every run). The stem keeps
        // only its real filter: padded, column (r, s, ch) → (r, s, ch) of c_real channels;
        // paired, column (r, j, 4e + ch) → (r, 2j + e − pair_lead, ch) of s_real × c_real.
        const int n_out = a.r * a.s_real * a.c_real;
        float* dw = reinterpret_cast<float*>(out) + (long)blockIdx.z * a.k * n_out;
#pragma unroll
        for (int i = 0; i < T::MI; ++i)
#pragma unroll
            for (int j = 0; j < T::NI; ++j)
#pragma unroll
                for (int e = 0; e < 4; e += 2) {
                    const int m = m0 + warp_m + i * 16 + g + (e >= 2 ? 8 : 0);
                    const int n = n0 + warp_n + j * 8 + 2 * t4;
                    if (m >= M || n >= N) continue;
                    if (a.c_real != a.c) {
                        // The stem: c_real may be odd (3 channels), so the pair's two
                        // columns may land in different taps and its address on 4 bytes
                        // only, which a paired store refuses (misaligned address): each
                        // column goes alone. Slots outside the real filter (the paired
                        // stem's first pixel, padded channels) are not stored.
                        const int pix_c = a.pair_lead >= 0 ? a.c / 2 : a.c;  // channels of one pixel
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const int rs = (n + h) / a.c, cs = n + h - rs * a.c;
                            const int r = rs / a.s, t = rs - r * a.s, px = cs / pix_c, c = cs - px * pix_c;
                            const int s = a.pair_lead >= 0 ? 2 * t + px - a.pair_lead : t;
                            if (c < a.c_real && (unsigned)s < (unsigned)a.s_real)
                                dw[(long)m * n_out + (r * a.s_real + s) * a.c_real + c] = acc[i][j][e + h];
                        }
                        continue;
                    }
                    // c % 8 == 0 here: n_out and n are even, so the pair is 8-byte aligned.
                    bt_store2_f32(dw + (long)m * n_out + n, acc[i][j][e], acc[i][j][e + 1]);
                }
        return;
    }

    // forward / dgrad: stage the bf16 tile in shared memory, then write whole 16-byte chunks
    // (coalesced rows; dgrad rows go to their phase's pixels through row_out).
    __syncthreads();  // every warp is done with the pipeline stages
    constexpr int LDC = T::BN + SKEW;
    bf16* Cs = reinterpret_cast<bf16*>(smem_raw);
#pragma unroll
    for (int i = 0; i < T::MI; ++i)
#pragma unroll
        for (int j = 0; j < T::NI; ++j)
#pragma unroll
            for (int e = 0; e < 4; e += 2) {
                const int row = warp_m + i * 16 + g + (e >= 2 ? 8 : 0), col = warp_n + j * 8 + 2 * t4;
                const unsigned lo = __bfloat16_as_ushort(bt_to_bf16(acc[i][j][e]));
                const unsigned hi = __bfloat16_as_ushort(bt_to_bf16(acc[i][j][e + 1]));
                *reinterpret_cast<unsigned*>(Cs + row * LDC + col) = lo | (hi << 16);
            }
    __syncthreads();
    bf16* y = reinterpret_cast<bf16*>(out);
    constexpr int CHUNKS_PER_ROW = T::BN / 8;
    constexpr int CHUNKS = T::BM * CHUNKS_PER_ROW;
    // BN_GRAD whose batch norm's output is not read (null bn_y, a ReLU): the mask is recomputed
    // in the sums below from the span's x, which they load anyway, and g goes out after them
    // (per chunk it would cost a 16-byte load of x and 32 scalar loads of the parameters).
    const bool mask_late = EPI == EPI_BN_GRAD && ep.bn_y == nullptr && ep.relu;
    if (MODE == FWD) {
        // The forward reads nothing but the staged tile: its chunk loop stays rolled (unrolled,
        // the plain 128×128 forward spilled 8 bytes on sm_90a).
        for (int ch = tid; ch < CHUNKS; ch += T::THREADS) {
            const int row = ch / CHUNKS_PER_ROW, col = (ch % CHUNKS_PER_ROW) * 8;
            const int m = m0 + row, n = n0 + col;
            if (m >= M || n >= N) continue;
            *reinterpret_cast<uint4*>(y + (long)m * N + n) = *reinterpret_cast<const uint4*>(Cs + row * LDC + col);
        }
    } else {
        // The data gradient's global operands, a batch of chunks at a time, loaded before any of
        // the batch is stored (EpilogueInputs; batches of 4 keep the 8-warp tiles within their
        // registers).
        constexpr int PER_THREAD = (CHUNKS + T::THREADS - 1) / T::THREADS;
        constexpr int BATCH = PER_THREAD < 4 ? PER_THREAD : 4;
        const bf16* mask_src = EPI == EPI_BN_GRAD ? ep.bn_y : nullptr;
#pragma unroll
        for (int b = 0; b < PER_THREAD; b += BATCH) {
            EpilogueInputs<BATCH> in;
#pragma unroll
            for (int i = 0; i < BATCH; ++i) {
                const int ch = tid + (b + i) * T::THREADS, row = ch / CHUNKS_PER_ROW;
                const int m = m0 + row, n = n0 + (ch % CHUNKS_PER_ROW) * 8;
                const bool live = b + i < PER_THREAD && ch < CHUNKS && m < M && n < N;
                const long o = live ? (long)row_out[row] + n : 0;
                in.load(i, live, o, a.accumulate ? y : nullptr, EPI == EPI_BN_GRAD ? ep.residual : nullptr, mask_src);
            }
#pragma unroll
            for (int i = 0; i < BATCH; ++i) {
                const int ch = tid + (b + i) * T::THREADS;
                const int row = ch / CHUNKS_PER_ROW, col = (ch % CHUNKS_PER_ROW) * 8;
                const int m = m0 + row, n = n0 + col;
                if (b + i >= PER_THREAD || ch >= CHUNKS || m >= M || n >= N) continue;
                const long o = (long)row_out[row] + n;
                const uint4 v = in.finish(i, *reinterpret_cast<const uint4*>(Cs + row * LDC + col), a.accumulate,
                                          EPI == EPI_BN_GRAD, ep);
                if (EPI == EPI_BN_GRAD) *reinterpret_cast<uint4*>(Cs + row * LDC + col) = v;  // the final g, for the sums below
                if (mask_late) continue;  // stored after the sums have masked it
                *reinterpret_cast<uint4*>(y + o) = v;
            }
        }
    }
    if (EPI == EPI_NONE) return;

    // ---- batch-norm partial records (see BnEpilogue) ---------------------------------------
    // A thread owns a column pair (one 4-byte bf16x2 load per row: two independent sums) and a
    // span of SPAN rows; the TPC spans of a pair are added in span order by span 0.
    constexpr int PAIRS = T::BN / 2, TPC = T::THREADS / PAIRS, SPAN = T::BM / TPC;
    static_assert(T::THREADS % PAIRS == 0 && T::BM % TPC == 0, "whole row spans per column pair");
    static_assert(T::BM * LDC * 2 + 2 * TPC * T::BN * 4 <= T::STAGES * G::STAGE_ELEMS * 2,
                  "the reduction scratch fits behind the staged tile");
    float* red_a = reinterpret_cast<float*>(smem_raw + T::BM * LDC * 2);  // [TPC][BN]
    float* red_b = red_a + TPC * T::BN;
    const int col = (tid % PAIRS) * 2, span = tid / PAIRS;
    const int rows = min(T::BM, M - m0);
    const int r0 = span * SPAN, r1 = min(rows, r0 + SPAN);
    const int c = n0 + col;  // N % 8 == 0: both columns of a pair are in range, or neither
    unsigned* cs_pair = reinterpret_cast<unsigned*>(Cs + col);  // row r at [r * LDC / 2]
    if (EPI == EPI_STATS) {
        // Two passes over the staged bf16 tile: the tile mean, then Σ(v − mean)².
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll 2
        for (int r = r0; r < r1; ++r) {
            const unsigned v = cs_pair[r * (LDC / 2)];
            s0 += __uint_as_float(v << 16);
            s1 += __uint_as_float(v & 0xffff0000u);
        }
        red_a[span * T::BN + col] = s0;
        red_a[span * T::BN + col + 1] = s1;
        __syncthreads();
        float t0 = 0.0f, t1 = 0.0f;
#pragma unroll
        for (int p = 0; p < TPC; ++p) {
            t0 += red_a[p * T::BN + col];
            t1 += red_a[p * T::BN + col + 1];
        }
        const float mean0 = t0 / (float)rows, mean1 = t1 / (float)rows;
        float q0 = 0.0f, q1 = 0.0f;
#pragma unroll 2
        for (int r = r0; r < r1; ++r) {
            const unsigned v = cs_pair[r * (LDC / 2)];
            const float d0 = __uint_as_float(v << 16) - mean0, d1 = __uint_as_float(v & 0xffff0000u) - mean1;
            q0 = fmaf(d0, d0, q0);
            q1 = fmaf(d1, d1, q1);
        }
        red_b[span * T::BN + col] = q0;
        red_b[span * T::BN + col + 1] = q1;
        __syncthreads();
        if (span == 0 && c < N) {
            q0 = 0.0f;
            q1 = 0.0f;
#pragma unroll
            for (int p = 0; p < TPC; ++p) {
                q0 += red_b[p * T::BN + col];
                q1 += red_b[p * T::BN + col + 1];
            }
            const long plane = (long)gridDim.x * N, at = (long)blockIdx.x * N + c;
            bt_store2_f32(ep.part + at, mean0, mean1);
            bt_store2_f32(ep.part + plane + at, q0, q1);
        }
    } else {
        __syncthreads();  // every g is staged
        float b0 = 0.0f, b1 = 0.0f, g0 = 0.0f, g1 = 0.0f;
        if (c < N) {
            const float mu0 = ep.mean[c], mu1 = ep.mean[c + 1], is0 = ep.invstd[c], is1 = ep.invstd[c + 1];
            // The span's x first, every load in flight at once, then the sums in row order (the
            // same bits): one load at a time, a tile waited SPAN global latencies here.
            unsigned xs[SPAN];
#pragma unroll
            for (int i = 0; i < SPAN; ++i)
                xs[i] = r0 + i < r1 ? *reinterpret_cast<const unsigned*>(ep.bn_x + row_out[r0 + i] + c) : 0u;
            float2 ga = make_float2(0.0f, 0.0f), be = ga;
            if (mask_late) {
                ga = make_float2(bt_to_f32(ep.gamma[c]), bt_to_f32(ep.gamma[c + 1]));
                be = make_float2(bt_to_f32(ep.beta[c]), bt_to_f32(ep.beta[c + 1]));
            }
#pragma unroll
            for (int i = 0; i < SPAN; ++i) {
                const int r = r0 + i;
                if (r >= r1) break;
                unsigned v = cs_pair[r * (LDC / 2)];
                const unsigned x = xs[i];
                if (mask_late) {
                    // y as bn_apply wrote it (applied_bn2), its sign the mask; the masked g
                    // staged again for the store below.
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
        red_a[span * T::BN + col] = b0;
        red_a[span * T::BN + col + 1] = b1;
        red_b[span * T::BN + col] = g0;
        red_b[span * T::BN + col + 1] = g1;
        __syncthreads();
        if (mask_late) {
            // The masked g, staged by the sums above, in whole 16-byte chunks.
            for (int ch = tid; ch < CHUNKS; ch += T::THREADS) {
                const int row = ch / CHUNKS_PER_ROW, c8 = (ch % CHUNKS_PER_ROW) * 8;
                const int m = m0 + row, n = n0 + c8;
                if (m >= M || n >= N) continue;
                *reinterpret_cast<uint4*>(y + (long)row_out[row] + n) = *reinterpret_cast<const uint4*>(Cs + row * LDC + c8);
            }
        }
        if (span == 0 && c < N) {
#pragma unroll
            for (int p = 1; p < TPC; ++p) {
                b0 += red_a[p * T::BN + col];
                b1 += red_a[p * T::BN + col + 1];
                g0 += red_b[p * T::BN + col];
                g1 += red_b[p * T::BN + col + 1];
            }
            const long plane = (long)gridDim.z * gridDim.x * N;
            const long at = ((long)blockIdx.z * gridDim.x + blockIdx.x) * N + c;
            bt_store2_f32(ep.part + at, b0, b1);
            bt_store2_f32(ep.part + plane + at, g0, g1);
        }
    }
}

// ---- kernels ---------------------------------------------------------------------------------
// Names: conv2_{fwd,dgrad,wgrad}[_1x1]_{tile}, and with a batch-norm epilogue
// conv2_fwd_stats[_1x1]_{tile}, conv2_dgrad_bn[_1x1]_{tile}; applying a batch norm to the
// input, conv2_fwd[_stats]_apply[_1x1]_{tile}, conv2_wgrad_apply[_1x1,_c8]_{tile}. The host (src/cuda/conv.rs) picks
// one per layer; dynamic shared memory = STAGES × stage bytes (`Conv2Tile::smem_bytes` there).

// y = conv(x, w)
extern "C" __global__ void __launch_bounds__(T128x128::THREADS, 2)
conv2_fwd_128x128(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* y, Conv2Args args) {
    conv2_gemm<FWD, GENERAL, T128x128>(x, w, y, args);
}

extern "C" __global__ void __launch_bounds__(T128x64::THREADS, 3)
conv2_fwd_128x64(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* y, Conv2Args args) {
    conv2_gemm<FWD, GENERAL, T128x64>(x, w, y, args);
}

extern "C" __global__ void __launch_bounds__(T128x128::THREADS, 2)
conv2_fwd_1x1_128x128(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* y, Conv2Args args) {
    conv2_gemm<FWD, UNIT, T128x128>(x, w, y, args);
}

extern "C" __global__ void __launch_bounds__(T128x64::THREADS, 3)
conv2_fwd_1x1_128x64(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* y, Conv2Args args) {
    conv2_gemm<FWD, UNIT, T128x64>(x, w, y, args);
}

// dx = dgrad(dy, wt) (+ dx with args.accumulate); wt: the phase-ordered weight (1×1: w
// itself); grid.z = stride² phases
extern "C" __global__ void __launch_bounds__(T128x128::THREADS, 2)
conv2_dgrad_128x128(const bf16* __restrict__ dy, const bf16* __restrict__ wt, bf16* dx, Conv2Args args) {
    conv2_gemm<DGRAD, GENERAL, T128x128>(dy, wt, dx, args);
}

extern "C" __global__ void __launch_bounds__(T128x64::THREADS, 3)
conv2_dgrad_128x64(const bf16* __restrict__ dy, const bf16* __restrict__ wt, bf16* dx, Conv2Args args) {
    conv2_gemm<DGRAD, GENERAL, T128x64>(dy, wt, dx, args);
}

extern "C" __global__ void __launch_bounds__(T128x128::THREADS, 2)
conv2_dgrad_1x1_128x128(const bf16* __restrict__ dy, const bf16* __restrict__ wt, bf16* dx, Conv2Args args) {
    conv2_gemm<DGRAD, UNIT, T128x128>(dy, wt, dx, args);
}

extern "C" __global__ void __launch_bounds__(T128x64::THREADS, 3)
conv2_dgrad_1x1_128x64(const bf16* __restrict__ dy, const bf16* __restrict__ wt, bf16* dx, Conv2Args args) {
    conv2_gemm<DGRAD, UNIT, T128x64>(dy, wt, dx, args);
}

// The same GEMMs with the batch-norm epilogues (BnEpilogue). Forward: y = conv(x, w) and the
// tile statistics of y in part ([2][gridDim.x][K]: means, then M2).
extern "C" __global__ void __launch_bounds__(T128x128::THREADS, 2)
conv2_fwd_stats_128x128(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* y, Conv2Args args, float* part) {
    BnEpilogue ep{};
    ep.part = part;
    conv2_gemm<FWD, GENERAL, T128x128, EPI_STATS>(x, w, y, args, ep);
}

extern "C" __global__ void __launch_bounds__(T128x64::THREADS, 3)
conv2_fwd_stats_128x64(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* y, Conv2Args args, float* part) {
    BnEpilogue ep{};
    ep.part = part;
    conv2_gemm<FWD, GENERAL, T128x64, EPI_STATS>(x, w, y, args, ep);
}

extern "C" __global__ void __launch_bounds__(T128x128::THREADS, 2)
conv2_fwd_stats_1x1_128x128(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* y, Conv2Args args, float* part) {
    BnEpilogue ep{};
    ep.part = part;
    conv2_gemm<FWD, UNIT, T128x128, EPI_STATS>(x, w, y, args, ep);
}

extern "C" __global__ void __launch_bounds__(T128x64::THREADS, 3)
conv2_fwd_stats_1x1_128x64(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* y, Conv2Args args, float* part) {
    BnEpilogue ep{};
    ep.part = part;
    conv2_gemm<FWD, UNIT, T128x64, EPI_STATS>(x, w, y, args, ep);
}

// dgrad finishing the gradient of the batch norm that produced x: dx = [y > 0]·(dgrad(dy, wt)
// [+ dx with args.accumulate] [+ residual]) (residual may be null) and the tile sums Σdx and
// Σdx·(bn_x − mean)·invstd in part ([2][gridDim.z·gridDim.x][C]). The mask: with bn_y, y = bn_y;
// else with relu, y = bf16(ReLU((bn_x − mean)·invstd·γ + β)) recomputed (bn_apply's bits);
// else none (γ, β are read only in the second case and may be null otherwise).
extern "C" __global__ void __launch_bounds__(T128x128::THREADS, 2)
conv2_dgrad_bn_128x128(const bf16* __restrict__ dy, const bf16* __restrict__ wt, bf16* dx, Conv2Args args, float* part,
    const bf16* __restrict__ bn_y, const bf16* __restrict__ bn_x, const float* __restrict__ mean,
    const float* __restrict__ invstd, const bf16* __restrict__ residual, const bf16* __restrict__ gamma,
    const bf16* __restrict__ beta, int relu) {
    const BnEpilogue ep{part, bn_y, bn_x, mean, invstd, residual, gamma, beta, relu};
    conv2_gemm<DGRAD, GENERAL, T128x128, EPI_BN_GRAD>(dy, wt, dx, args, ep);
}

extern "C" __global__ void __launch_bounds__(T128x64::THREADS, 3)
conv2_dgrad_bn_128x64(const bf16* __restrict__ dy, const bf16* __restrict__ wt, bf16* dx, Conv2Args args, float* part,
    const bf16* __restrict__ bn_y, const bf16* __restrict__ bn_x, const float* __restrict__ mean,
    const float* __restrict__ invstd, const bf16* __restrict__ residual, const bf16* __restrict__ gamma,
    const bf16* __restrict__ beta, int relu) {
    const BnEpilogue ep{part, bn_y, bn_x, mean, invstd, residual, gamma, beta, relu};
    conv2_gemm<DGRAD, GENERAL, T128x64, EPI_BN_GRAD>(dy, wt, dx, args, ep);
}

extern "C" __global__ void __launch_bounds__(T128x128::THREADS, 2)
conv2_dgrad_bn_1x1_128x128(const bf16* __restrict__ dy, const bf16* __restrict__ wt, bf16* dx, Conv2Args args, float* part,
    const bf16* __restrict__ bn_y, const bf16* __restrict__ bn_x, const float* __restrict__ mean,
    const float* __restrict__ invstd, const bf16* __restrict__ residual, const bf16* __restrict__ gamma,
    const bf16* __restrict__ beta, int relu) {
    const BnEpilogue ep{part, bn_y, bn_x, mean, invstd, residual, gamma, beta, relu};
    conv2_gemm<DGRAD, UNIT, T128x128, EPI_BN_GRAD>(dy, wt, dx, args, ep);
}

extern "C" __global__ void __launch_bounds__(T128x64::THREADS, 3)
conv2_dgrad_bn_1x1_128x64(const bf16* __restrict__ dy, const bf16* __restrict__ wt, bf16* dx, Conv2Args args, float* part,
    const bf16* __restrict__ bn_y, const bf16* __restrict__ bn_x, const float* __restrict__ mean,
    const float* __restrict__ invstd, const bf16* __restrict__ residual, const bf16* __restrict__ gamma,
    const bf16* __restrict__ beta, int relu) {
    const BnEpilogue ep{part, bn_y, bn_x, mean, invstd, residual, gamma, beta, relu};
    conv2_gemm<DGRAD, UNIT, T128x64, EPI_BN_GRAD>(dy, wt, dx, args, ep);
}

// The same GEMMs applying a batch norm to the gathered input as they load it (AppliedBn; see
// "Applied batch norm" above): z is the batch norm's input, mean/invstd its saved statistics,
// gamma/beta its parameters, relu whether a ReLU follows it. Forward: y = conv(bn(z), w)
// (stats: and y's tile statistics in part, as conv2_fwd_stats_*).
extern "C" __global__ void __launch_bounds__(T128x128::THREADS, 2)
conv2_fwd_apply_128x128(const bf16* __restrict__ z, const bf16* __restrict__ w, bf16* y, Conv2Args args,
    const float* __restrict__ mean, const float* __restrict__ invstd, const bf16* __restrict__ gamma,
    const bf16* __restrict__ beta, int relu) {
    const AppliedBn bn{mean, invstd, gamma, beta, relu};
    conv2_gemm<FWD, GENERAL, T128x128, EPI_NONE, true>(z, w, y, args, BnEpilogue{}, bn);
}

extern "C" __global__ void __launch_bounds__(T128x64::THREADS, 3)
conv2_fwd_apply_128x64(const bf16* __restrict__ z, const bf16* __restrict__ w, bf16* y, Conv2Args args,
    const float* __restrict__ mean, const float* __restrict__ invstd, const bf16* __restrict__ gamma,
    const bf16* __restrict__ beta, int relu) {
    const AppliedBn bn{mean, invstd, gamma, beta, relu};
    conv2_gemm<FWD, GENERAL, T128x64, EPI_NONE, true>(z, w, y, args, BnEpilogue{}, bn);
}

extern "C" __global__ void __launch_bounds__(T128x128::THREADS, 2)
conv2_fwd_apply_1x1_128x128(const bf16* __restrict__ z, const bf16* __restrict__ w, bf16* y, Conv2Args args,
    const float* __restrict__ mean, const float* __restrict__ invstd, const bf16* __restrict__ gamma,
    const bf16* __restrict__ beta, int relu) {
    const AppliedBn bn{mean, invstd, gamma, beta, relu};
    conv2_gemm<FWD, UNIT, T128x128, EPI_NONE, true>(z, w, y, args, BnEpilogue{}, bn);
}

extern "C" __global__ void __launch_bounds__(T128x64::THREADS, 3)
conv2_fwd_apply_1x1_128x64(const bf16* __restrict__ z, const bf16* __restrict__ w, bf16* y, Conv2Args args,
    const float* __restrict__ mean, const float* __restrict__ invstd, const bf16* __restrict__ gamma,
    const bf16* __restrict__ beta, int relu) {
    const AppliedBn bn{mean, invstd, gamma, beta, relu};
    conv2_gemm<FWD, UNIT, T128x64, EPI_NONE, true>(z, w, y, args, BnEpilogue{}, bn);
}

extern "C" __global__ void __launch_bounds__(T128x128::THREADS, 2)
conv2_fwd_stats_apply_128x128(const bf16* __restrict__ z, const bf16* __restrict__ w, bf16* y, Conv2Args args,
    float* part, const float* __restrict__ mean, const float* __restrict__ invstd, const bf16* __restrict__ gamma,
    const bf16* __restrict__ beta, int relu) {
    BnEpilogue ep{};
    ep.part = part;
    const AppliedBn bn{mean, invstd, gamma, beta, relu};
    conv2_gemm<FWD, GENERAL, T128x128, EPI_STATS, true>(z, w, y, args, ep, bn);
}

extern "C" __global__ void __launch_bounds__(T128x64::THREADS, 3)
conv2_fwd_stats_apply_128x64(const bf16* __restrict__ z, const bf16* __restrict__ w, bf16* y, Conv2Args args,
    float* part, const float* __restrict__ mean, const float* __restrict__ invstd, const bf16* __restrict__ gamma,
    const bf16* __restrict__ beta, int relu) {
    BnEpilogue ep{};
    ep.part = part;
    const AppliedBn bn{mean, invstd, gamma, beta, relu};
    conv2_gemm<FWD, GENERAL, T128x64, EPI_STATS, true>(z, w, y, args, ep, bn);
}

extern "C" __global__ void __launch_bounds__(T128x128::THREADS, 2)
conv2_fwd_stats_apply_1x1_128x128(const bf16* __restrict__ z, const bf16* __restrict__ w, bf16* y, Conv2Args args,
    float* part, const float* __restrict__ mean, const float* __restrict__ invstd, const bf16* __restrict__ gamma,
    const bf16* __restrict__ beta, int relu) {
    BnEpilogue ep{};
    ep.part = part;
    const AppliedBn bn{mean, invstd, gamma, beta, relu};
    conv2_gemm<FWD, UNIT, T128x128, EPI_STATS, true>(z, w, y, args, ep, bn);
}

extern "C" __global__ void __launch_bounds__(T128x64::THREADS, 3)
conv2_fwd_stats_apply_1x1_128x64(const bf16* __restrict__ z, const bf16* __restrict__ w, bf16* y, Conv2Args args,
    float* part, const float* __restrict__ mean, const float* __restrict__ invstd, const bf16* __restrict__ gamma,
    const bf16* __restrict__ beta, int relu) {
    BnEpilogue ep{};
    ep.part = part;
    const AppliedBn bn{mean, invstd, gamma, beta, relu};
    conv2_gemm<FWD, UNIT, T128x64, EPI_STATS, true>(z, w, y, args, ep, bn);
}

// Weight gradient: dw[z] = wgrad(dy, bn(z)) over slice z (as conv2_wgrad_*).
extern "C" __global__ void __launch_bounds__(T128x128::THREADS, 2)
conv2_wgrad_apply_128x128(const bf16* __restrict__ dy, const bf16* __restrict__ z, float* dw, Conv2Args args,
    const float* __restrict__ mean, const float* __restrict__ invstd, const bf16* __restrict__ gamma,
    const bf16* __restrict__ beta, int relu) {
    const AppliedBn bn{mean, invstd, gamma, beta, relu};
    conv2_gemm<WGRAD, GENERAL, T128x128, EPI_NONE, true>(dy, z, dw, args, BnEpilogue{}, bn);
}

extern "C" __global__ void __launch_bounds__(T64x128::THREADS, 3)
conv2_wgrad_apply_64x128(const bf16* __restrict__ dy, const bf16* __restrict__ z, float* dw, Conv2Args args,
    const float* __restrict__ mean, const float* __restrict__ invstd, const bf16* __restrict__ gamma,
    const bf16* __restrict__ beta, int relu) {
    const AppliedBn bn{mean, invstd, gamma, beta, relu};
    conv2_gemm<WGRAD, GENERAL, T64x128, EPI_NONE, true>(dy, z, dw, args, BnEpilogue{}, bn);
}

extern "C" __global__ void __launch_bounds__(T64x128::THREADS, 3)
conv2_wgrad_apply_c8_64x128(const bf16* __restrict__ dy, const bf16* __restrict__ z, float* dw, Conv2Args args,
    const float* __restrict__ mean, const float* __restrict__ invstd, const bf16* __restrict__ gamma,
    const bf16* __restrict__ beta, int relu) {
    const AppliedBn bn{mean, invstd, gamma, beta, relu};
    conv2_gemm<WGRAD, SMALL_C, T64x128, EPI_NONE, true>(dy, z, dw, args, BnEpilogue{}, bn);
}

extern "C" __global__ void __launch_bounds__(T128x128::THREADS, 2)
conv2_wgrad_apply_1x1_128x128(const bf16* __restrict__ dy, const bf16* __restrict__ z, float* dw, Conv2Args args,
    const float* __restrict__ mean, const float* __restrict__ invstd, const bf16* __restrict__ gamma,
    const bf16* __restrict__ beta, int relu) {
    const AppliedBn bn{mean, invstd, gamma, beta, relu};
    conv2_gemm<WGRAD, UNIT, T128x128, EPI_NONE, true>(dy, z, dw, args, BnEpilogue{}, bn);
}

extern "C" __global__ void __launch_bounds__(T64x128::THREADS, 3)
conv2_wgrad_apply_1x1_64x128(const bf16* __restrict__ dy, const bf16* __restrict__ z, float* dw, Conv2Args args,
    const float* __restrict__ mean, const float* __restrict__ invstd, const bf16* __restrict__ gamma,
    const bf16* __restrict__ beta, int relu) {
    const AppliedBn bn{mean, invstd, gamma, beta, relu};
    conv2_gemm<WGRAD, UNIT, T64x128, EPI_NONE, true>(dy, z, dw, args, BnEpilogue{}, bn);
}

// dw[z] = wgrad(dy, x) over slice z (f32); grid.z = reduction slices of args.k_chunk pixels
// (dw: one K×RSC plane per slice, then conv2_wgrad_reduce); C % 32 == 0
extern "C" __global__ void __launch_bounds__(T128x128::THREADS, 2)
conv2_wgrad_128x128(const bf16* __restrict__ dy, const bf16* __restrict__ x, float* dw, Conv2Args args) {
    conv2_gemm<WGRAD, GENERAL, T128x128>(dy, x, dw, args);
}

extern "C" __global__ void __launch_bounds__(T64x128::THREADS, 3)
conv2_wgrad_64x128(const bf16* __restrict__ dy, const bf16* __restrict__ x, float* dw, Conv2Args args) {
    conv2_gemm<WGRAD, GENERAL, T64x128>(dy, x, dw, args);
}

// C % 8 == 0 only (the padded stem, 16-channel layers, whose K is at most 64 in every
// supported model; larger K takes more 64-row tiles): every column checks its own tap
extern "C" __global__ void __launch_bounds__(T64x128::THREADS, 3)
conv2_wgrad_c8_64x128(const bf16* __restrict__ dy, const bf16* __restrict__ x, float* dw, Conv2Args args) {
    conv2_gemm<WGRAD, SMALL_C, T64x128>(dy, x, dw, args);
}

extern "C" __global__ void __launch_bounds__(T128x128::THREADS, 2)
conv2_wgrad_1x1_128x128(const bf16* __restrict__ dy, const bf16* __restrict__ x, float* dw, Conv2Args args) {
    conv2_gemm<WGRAD, UNIT, T128x128>(dy, x, dw, args);
}

extern "C" __global__ void __launch_bounds__(T64x128::THREADS, 3)
conv2_wgrad_1x1_64x128(const bf16* __restrict__ dy, const bf16* __restrict__ x, float* dw, Conv2Args args) {
    conv2_gemm<WGRAD, UNIT, T64x128>(dy, x, dw, args);
}

// The dgrad weight, rearranged per phase: phase φ's block holds, for each of its taps (i, j)
// (filter position (r0 + stride·i, s0 + stride·j)), the K×C matrix w[k][r][s][c] with k as
// rows, so the GEMM's B rows are contiguous. One thread per 8-channel chunk of w; reads and
// writes 16 bytes. Launch: 256 threads, grid-stride over K·R·S·C/8 chunks.
extern "C" __global__ void conv2_dgrad_weights(const bf16* __restrict__ w, bf16* __restrict__ wt,
                                               Conv2Args a) {
    const long chunks = (long)a.k * a.r * a.s * a.c / 8;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < chunks; i += (long)gridDim.x * blockDim.x) {
        const int c = (int)(i % (a.c / 8)) * 8;
        long t = i / (a.c / 8);
        const int s = (int)(t % a.s); t /= a.s;
        const int r = (int)(t % a.r);
        const int k = (int)(t / a.r);
        // The phase whose taps include (r, s): r ≡ ph + pad (mod stride).
        const int ph = ((r - a.pad) % a.stride + a.stride) % a.stride;
        const int pw = ((s - a.pad) % a.stride + a.stride) % a.stride;
        const Phase f = dgrad_phase(a, ph * a.stride + pw);
        const int ti = r / a.stride, tj = s / a.stride;
        const long o = f.w_offset + ((long)(ti * f.sn + tj) * a.k + k) * a.c + c;
        *reinterpret_cast<uint4*>(wt + o) = *reinterpret_cast<const uint4*>(w + i * 8);
    }
}

// dw[i] = Σ_z planes[z][i], z = 0, 1, …, slices − 1 in that order (the split wgrad's partial
// sums, f32): a fixed order, so the same bits every run. One thread per 4 elements (16-byte
// loads and stores) when len % 4 == 0, else per element; grid-stride over len.
extern "C" __global__ void conv2_wgrad_reduce(const float* __restrict__ planes, float* __restrict__ dw,
                                              long len, int slices) {
    const long stride = (long)gridDim.x * blockDim.x;
    if (len % 4 == 0) {
        for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < len / 4; i += stride) {
            float4 sum = reinterpret_cast<const float4*>(planes)[i];
            for (int z = 1; z < slices; ++z) {
                const float4 v = reinterpret_cast<const float4*>(planes + z * len)[i];
                sum.x += v.x; sum.y += v.y; sum.z += v.z; sum.w += v.w;
            }
            reinterpret_cast<float4*>(dw)[i] = sum;
        }
        return;
    }
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < len; i += stride) {
        float sum = planes[i];
        for (int z = 1; z < slices; ++z) sum += planes[z * len + i];
        dw[i] = sum;
    }
}

// The paired stem's operands (see "The stem" above): dst[row][j] holds 8 bf16, pixels
// 2j − lead and 2j + 1 − lead of src[row] (`width` pixels of c ≤ 4 channels), each widened to
// 4 channels, zeros for a pixel outside 0..width−1. dst rows have (width + lead + 1) / 2 pairs.
// The input: rows = N·H image rows, lead 0 (an odd width gets one zero pixel at the end of each
// row). The weight: rows = K·R filter rows of width S, lead = pad % 2. One thread per pair,
// one 16-byte store; grid-stride over rows × pairs.
extern "C" __global__ void conv2_pair_pixels(const bf16* __restrict__ src, bf16* __restrict__ dst, long rows,
                                             int width, int c, int lead) {
    const int pairs = (width + lead + 1) / 2;
    const long total = rows * pairs;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const long row = i / pairs;
        const int j = (int)(i - row * pairs);
        union { uint4 v; bf16 e[8]; } u;
#pragma unroll
        for (int px = 0; px < 2; ++px) {
            const int s = 2 * j + px - lead;
            const bool inside = s >= 0 && s < width;
#pragma unroll
            for (int ch = 0; ch < 4; ++ch)
                u.e[4 * px + ch] = inside && ch < c ? src[(row * width + s) * c + ch] : bt_to_bf16(0.0f);
        }
        *reinterpret_cast<uint4*>(dst + i * 8) = u.v;
    }
}

// dst[row][0..c_to) = src[row][0..c_from) followed by zeros (c_to % 8 == 0): the input and
// weight of a stem that is not paired (fewer than 8 channels at stride 1) widened for the
// 16-byte paths. One thread per row, 16-byte stores; grid-stride over `rows`.
extern "C" __global__ void conv2_pad_channels(const bf16* __restrict__ src, bf16* __restrict__ dst,
                                              long rows, int c_from, int c_to) {
    for (long row = blockIdx.x * (long)blockDim.x + threadIdx.x; row < rows; row += (long)gridDim.x * blockDim.x) {
        for (int c0 = 0; c0 < c_to; c0 += 8) {
            union { uint4 v; bf16 e[8]; } u;
#pragma unroll
            for (int e = 0; e < 8; ++e)
                u.e[e] = c0 + e < c_from ? src[row * c_from + c0 + e] : bt_to_bf16(0.0f);
            *reinterpret_cast<uint4*>(dst + row * c_to + c0) = u.v;
        }
    }
}
