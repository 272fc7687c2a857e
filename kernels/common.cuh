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
