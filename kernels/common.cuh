// common.cuh: shared helpers for every birdtrain kernel file.
//
// birdtrain compiles each kernels/*.cu at run time with NVRTC; the loader replaces the line
// that includes this header with the header's text, so every kernel file stays one translation
// unit and no include path is needed for our own headers (cuda_bf16.h still comes from the
// CUDA include folder that src/cuda/nvrtc.rs finds).
//
// Conventions used by all kernels:
// - Activations and weights are bf16 (`bf16` below), accumulation is f32, master weights,
//   gradients of parameters, optimizer state and batch-norm statistics are f32.
// - Tensors are NHWC: element (n, h, w, c) of an N×H×W×C tensor sits at ((n*H + h)*W + w)*C + c.
// - Convolution weights are KRSC: (k, r, s, c) at ((k*R + r)*S + s)*C + c, so one output
//   channel's filter is one contiguous row of a GEMM operand.
// - Every kernel is `extern "C"` (no name mangling) so the host loads it by its plain name.
#pragma once
// BT_EMULATE: a host-side emulation build (tools, never NVRTC) brings its own bf16 type.
#ifndef BT_EMULATE
#include <cuda_bf16.h>
#endif

typedef __nv_bfloat16 bf16;
typedef unsigned char u8;

#define BT_WARP 32
// -infinity without <math.h> (NVRTC has no standard headers).
#define BT_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bt_to_f32(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ bf16 bt_to_bf16(float v) { return __float2bfloat16_rn(v); }

// Sum of `v` over the 32 lanes of a warp; every lane receives the result.
__device__ __forceinline__ float bt_warp_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// Maximum of `v` over the 32 lanes of a warp; every lane receives the result.
__device__ __forceinline__ float bt_warp_max(float v) {
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

// Sum over a whole block (blockDim.x a multiple of 32, at most 1024). `scratch` holds 32
// floats of shared memory. Every thread receives the result.
__device__ __forceinline__ float bt_block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % BT_WARP, warp = threadIdx.x / BT_WARP;
    const int warps = (blockDim.x + BT_WARP - 1) / BT_WARP;
    v = bt_warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    return bt_warp_sum(v);
}

// Maximum over a whole block, same contract as bt_block_sum.
__device__ __forceinline__ float bt_block_max(float v, float* scratch) {
    const int lane = threadIdx.x % BT_WARP, warp = threadIdx.x / BT_WARP;
    const int warps = (blockDim.x + BT_WARP - 1) / BT_WARP;
    v = bt_warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : BT_NEG_INF;
    return bt_warp_max(v);
}

// ---- tensor-core helpers (conv.cu, conv2.cu) ---------------------------------------------

// ldmatrix.x4: four 8×8 b16 matrices from shared memory; lane l gives the address of row l % 8
// of matrix l / 8 and receives, per matrix, row lane / 4, columns 2·(lane % 4) and + 1 (the
// .trans form: the same of the transposed matrix). sm_75+.
__device__ __forceinline__ void ldsm_x4(unsigned* r, const bf16* p) {
#ifdef BT_EMULATE
    bt_emu_ldmatrix(r, p, false);
#else
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
#endif
}

__device__ __forceinline__ void ldsm_x4_trans(unsigned* r, const bf16* p) {
#ifdef BT_EMULATE
    bt_emu_ldmatrix(r, p, true);
#else
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
#endif
}

// D = A·B + D for one m16n8k16 tile (bf16 inputs, f32 accumulators), PTX ISA 7.0+, sm_80+.
__device__ __forceinline__ void mma_bf16_16816(float* d, const unsigned* a, const unsigned* b) {
#ifdef BT_EMULATE
    bt_emu_mma(d, a, b);  // host-side emulation build (the warp-collective PTX semantics)
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// A shared-memory address as the tensor-core and copy instructions take it: 32 bits of the
// shared window on the GPU (computed once per kernel, then plain integer arithmetic), the host
// address in the emulator.
#ifdef BT_EMULATE
typedef unsigned long bt_saddr;
__device__ __forceinline__ bt_saddr bt_shared_addr(const void* p) { return (bt_saddr)p; }
#else
typedef unsigned bt_saddr;
// (asm volatile: computed once, where it is written, instead of rematerialised in a loop)
__device__ __forceinline__ bt_saddr bt_shared_addr(const void* p) {
    unsigned a;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }\n" : "=r"(a) : "l"(p));
    return a;
}
#endif

// ldmatrix.x4 (.trans) from a shared address (see ldsm_x4).
__device__ __forceinline__ void ldsm_x4_at(unsigned* r, bt_saddr a) {
#ifdef BT_EMULATE
    bt_emu_ldmatrix(r, (const void*)a, false);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
#endif
}

__device__ __forceinline__ void ldsm_x4_trans_at(unsigned* r, bt_saddr a) {
#ifdef BT_EMULATE
    bt_emu_ldmatrix(r, (const void*)a, true);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
#endif
}

// cp.async.cg: a 16-byte global → shared copy that bypasses L1 and the registers (sm_80+).
// `src_bytes` < 16 fills the rest of the 16 bytes with zeros; 0 reads nothing, so an
// out-of-range source needs no valid address. Copies complete in commit groups.
__device__ __forceinline__ void bt_cp_async16(bt_saddr dst, const void* gmem, int src_bytes) {
#ifdef BT_EMULATE
    bt_emu_cp_async((void*)dst, gmem, src_bytes);
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
#endif
}

// Closes the group of this thread's cp.async issued since the last commit.
__device__ __forceinline__ void bt_cp_async_commit() {
#ifdef BT_EMULATE
    bt_emu_cp_async_commit();
#else
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void bt_cp_async_wait() {
#ifdef BT_EMULATE
    bt_emu_cp_async_wait(N);
#else
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// ---- bf16x8 epilogue arithmetic (conv2.cu, conv3.cu) ----------------------------------------

// Eight bf16 sums of two 16-byte chunks, each in f32 and rounded once (round to nearest even).
__device__ __forceinline__ uint4 add_bf16x8(uint4 a, uint4 b) {
    const unsigned* pa = reinterpret_cast<const unsigned*>(&a);
    const unsigned* pb = reinterpret_cast<const unsigned*>(&b);
    unsigned sum[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const float s0 = __uint_as_float(pa[e] << 16) + __uint_as_float(pb[e] << 16);
        const float s1 = __uint_as_float(pa[e] & 0xffff0000u) + __uint_as_float(pb[e] & 0xffff0000u);
        sum[e] = (unsigned)__bfloat16_as_ushort(bt_to_bf16(s0)) | ((unsigned)__bfloat16_as_ushort(bt_to_bf16(s1)) << 16);
    }
    return make_uint4(sum[0], sum[1], sum[2], sum[3]);
}

// Each bf16 of the pair `v` where the matching bf16 of `y` is not > 0 becomes +0 (the ReLU's
// backward).
__device__ __forceinline__ unsigned relu_mask_bf16x2(unsigned v, unsigned y) {
    const unsigned lo = __uint_as_float(y << 16) > 0.0f ? 0x0000ffffu : 0u;
    const unsigned hi = __uint_as_float(y & 0xffff0000u) > 0.0f ? 0xffff0000u : 0u;
    return v & (lo | hi);
}

// relu_mask_bf16x2 over 8 bf16.
__device__ __forceinline__ uint4 relu_mask_bf16x8(uint4 v, uint4 y) {
    return make_uint4(relu_mask_bf16x2(v.x, y.x), relu_mask_bf16x2(v.y, y.y), relu_mask_bf16x2(v.z, y.z),
                      relu_mask_bf16x2(v.w, y.w));
}

// v's 8 bf16 where bit e of `signs` is set (bit e: element e of the chunk is positive, as
// bn_apply_signs_vec packs a ReLU output's signs), zero elsewhere.
__device__ __forceinline__ uint4 relu_mask_bits_bf16x8(uint4 v, unsigned signs) {
    unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k)
        w[k] &= ((signs >> (2 * k)) & 1u ? 0x0000ffffu : 0u) | ((signs >> (2 * k + 1)) & 1u ? 0xffff0000u : 0u);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// Two floats rounded to bf16 (round to nearest even, as bt_to_bf16) and packed, lo in the low
// half: one cvt.rn.bf16x2 instead of two conversions and a merge.
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
#ifdef BT_EMULATE
    return (unsigned)__bfloat16_as_ushort(bt_to_bf16(lo)) | ((unsigned)__bfloat16_as_ushort(bt_to_bf16(hi)) << 16);
#else
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#endif
}

// The batch norm's output (bn_apply_vec's expression, no residual) of the 2 bf16 in word `w`,
// channels with parameters (m, is, g, b).{x, y}.
__device__ __forceinline__ unsigned applied_bn2(unsigned w, float2 m, float2 is, float2 g, float2 b, int relu) {
    float v0 = (__uint_as_float(w << 16) - m.x) * is.x * g.x + b.x;
    float v1 = (__uint_as_float(w & 0xffff0000u) - m.y) * is.y * g.y + b.y;
    if (relu) {
        v0 = fmaxf(v0, 0.0f);
        v1 = fmaxf(v1, 0.0f);
    }
    return pack_bf16x2(v0, v1);
}

// The global operands of a thread's COUNT epilogue chunks (16 bytes each), all loaded before
// any chunk is stored: loads after a store to the output may not be moved above it (the
// pointers may alias), so a chunk-at-a-time loop waits one global latency per chunk. Per chunk:
// the output's prior value (accumulating), a residual gradient, and the ReLU mask's source (the
// batch norm's stored output y); a null source loads nothing.
template <int COUNT_>
struct EpilogueInputs {
    static constexpr int COUNT = COUNT_;
    uint4 prior[COUNT], residual[COUNT], mask[COUNT];

    __device__ __forceinline__ void load(int i, bool live, long o, const bf16* prior_src, const bf16* residual_src,
                                         const bf16* mask_src) {
        const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
        prior[i] = live && prior_src != nullptr ? *reinterpret_cast<const uint4*>(prior_src + o) : zero;
        residual[i] = live && residual_src != nullptr ? *reinterpret_cast<const uint4*>(residual_src + o) : zero;
        mask[i] = live && mask_src != nullptr ? *reinterpret_cast<const uint4*>(mask_src + o) : zero;
    }

    // Chunk i finished from the GEMM's staged value v: the prior value added when
    // accumulating, then for a batch norm's backward (`bn_grad`, `ep` its BnEpilogue or
    // Conv3Epilogue) the residual gradient added and the ReLU's mask of the stored y applied.
    // Without a stored y the caller recomputes the mask from x in its sums, where the
    // parameters of its column pair are in registers (per chunk: 32 scalar loads).
    template <typename Ep>
    __device__ __forceinline__ uint4 finish(int i, uint4 v, bool accumulate, bool bn_grad, const Ep& ep) const {
        if (accumulate) v = add_bf16x8(v, prior[i]);
        if (!bn_grad) return v;
        if (ep.residual != nullptr) v = add_bf16x8(v, residual[i]);
        if (ep.bn_y != nullptr) return relu_mask_bf16x8(v, mask[i]);
        return v;
    }
};

// Stores a pair of floats at an 8-byte-aligned address in one 8-byte store. The emulator
// checks the alignment the hardware demands (a misaligned pair stops the kernel with
// CUDA_ERROR_MISALIGNED_ADDRESS).
__device__ __forceinline__ void bt_store2_f32(float* o, float a, float b) {
#ifdef BT_EMULATE
    bt_emu_check_aligned(o, 8, "an 8-byte store to a misaligned address");
    o[0] = a;
    o[1] = b;
#else
    *reinterpret_cast<float2*>(o) = make_float2(a, b);
#endif
}
