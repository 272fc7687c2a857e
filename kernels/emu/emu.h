// emu.h: a host-side CUDA emulator for birdtrain's kernels (verification without a GPU).
//
// g++ compiles a kernel file (common.cuh expanded, BT_EMULATE defined) with this header first:
// every CUDA thread of a block runs as a std::thread, __syncthreads is a block-wide
// std::barrier, warp shuffles and the m16n8k16 bf16 `mma.sync` are warp-collective exchanges
// that follow the PTX ISA fragment layouts, __shared__ arrays are function statics (one block
// runs at a time), atomics take a mutex. Slow (thousands of threads per launch), so the checks
// use small shapes; tests/cuda_emulation.rs builds and runs conv_check.cpp and ops_check.cpp.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>
#include <functional>
#include <algorithm>
#include <memory>
#include <array>

struct dim3e { unsigned x = 0, y = 0, z = 0; };
inline thread_local dim3e threadIdx, blockIdx;
inline dim3e blockDim, gridDim;
inline std::unique_ptr<std::barrier<>> g_block_barrier;
inline std::vector<std::unique_ptr<std::barrier<>>> g_warp_barriers;
inline std::mutex g_atomic_mutex;

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define BT_EMULATE 1

inline void __syncthreads() { g_block_barrier->arrive_and_wait(); }
inline float atomicAdd(float* p, float v) { std::lock_guard<std::mutex> l(g_atomic_mutex); float o = *p; *p += v; return o; }
using std::min; using std::max; using std::isfinite;

struct uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }

struct __nv_bfloat16 { uint16_t bits; };
inline float __bfloat162float(__nv_bfloat16 v) { uint32_t u = (uint32_t)v.bits << 16; float f; memcpy(&f, &u, 4); return f; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    uint32_t lsb = (u >> 16) & 1; u += 0x7fff + lsb;
    return __nv_bfloat16{(uint16_t)(u >> 16)};
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 v) { return v.bits; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }

// Warp-collective m16n8k16 emulation using the PTX fragment layout.
struct WarpMma { unsigned a[32][4]; unsigned b[32][2]; };
inline std::vector<WarpMma> g_warp_mma;
inline float bf_lo(unsigned w) { return __bfloat162float(__nv_bfloat16{(uint16_t)(w & 0xffff)}); }
inline float bf_hi(unsigned w) { return __bfloat162float(__nv_bfloat16{(uint16_t)(w >> 16)}); }
inline void bt_emu_mma(float* d, const unsigned* a, const unsigned* b) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    WarpMma& s = g_warp_mma[warp];
    for (int i = 0; i < 4; ++i) s.a[lane][i] = a[i];
    for (int i = 0; i < 2; ++i) s.b[lane][i] = b[i];
    g_warp_barriers[warp]->arrive_and_wait();
    auto A = [&](int row, int col) {  // row 0..15, col 0..15
        const int g = row % 8, t = (col % 8) / 2, reg = (row >= 8 ? 1 : 0) + (col >= 8 ? 2 : 0);
        const unsigned w = s.a[g * 4 + t][reg];
        return (col % 2) ? bf_hi(w) : bf_lo(w);
    };
    auto B = [&](int k, int n) {  // k 0..15, n 0..7
        const int g = n, t = (k % 8) / 2, reg = k >= 8 ? 1 : 0;
        const unsigned w = s.b[g * 4 + t][reg];
        return (k % 2) ? bf_hi(w) : bf_lo(w);
    };
    const int g = lane >> 2, t = lane & 3;
    for (int e = 0; e < 4; ++e) {
        const int row = g + (e >= 2 ? 8 : 0), col = 2 * t + (e & 1);
        float acc = 0;
        for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
        d[e] += acc;
    }
    g_warp_barriers[warp]->arrive_and_wait();
}

inline std::vector<std::array<float, 32>> g_shfl_f;
inline std::vector<std::array<int, 32>> g_shfl_i;
inline float __shfl_xor_sync(unsigned, float v, int off) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    g_shfl_f[warp][lane] = v; g_warp_barriers[warp]->arrive_and_wait();
    float r = g_shfl_f[warp][lane ^ off]; g_warp_barriers[warp]->arrive_and_wait(); return r;
}
inline int __shfl_xor_sync(unsigned, int v, int off) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    g_shfl_i[warp][lane] = v; g_warp_barriers[warp]->arrive_and_wait();
    int r = g_shfl_i[warp][lane ^ off]; g_warp_barriers[warp]->arrive_and_wait(); return r;
}
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }

// Warp-collective ldmatrix.x4 (optionally .trans) on 16-bit elements.
inline std::vector<std::array<const uint16_t*, 32>> g_ldsm;
inline void bt_emu_ldmatrix(unsigned* r, const void* p, bool trans) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    g_ldsm[warp][lane] = static_cast<const uint16_t*>(p);
    g_warp_barriers[warp]->arrive_and_wait();
    const int g = lane / 4, t = lane % 4;
    for (int m = 0; m < 4; ++m) {
        uint16_t lo, hi;
        if (!trans) { const uint16_t* row = g_ldsm[warp][m * 8 + g]; lo = row[2 * t]; hi = row[2 * t + 1]; }
        else { lo = g_ldsm[warp][m * 8 + 2 * t][g]; hi = g_ldsm[warp][m * 8 + 2 * t + 1][g]; }
        r[m] = (unsigned)lo | ((unsigned)hi << 16);
    }
    g_warp_barriers[warp]->arrive_and_wait();
}

// Runs kernel(args...) over the grid, one std::thread per CUDA thread, block by block.
template <class F>
void emu_launch(dim3e grid, dim3e block, F kernel) {
    gridDim = grid; blockDim = block;
    const unsigned nthreads = block.x * block.y * block.z;
    for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) {
        g_block_barrier = std::make_unique<std::barrier<>>(nthreads);
        g_warp_barriers.clear();
        for (unsigned w = 0; w < (nthreads + 31) / 32; ++w) g_warp_barriers.push_back(std::make_unique<std::barrier<>>(std::min(32u, nthreads - 32 * w)));
        g_warp_mma.assign((nthreads + 31) / 32, WarpMma{});
        g_shfl_f.assign((nthreads + 31) / 32, {});
        g_shfl_i.assign((nthreads + 31) / 32, {});
        g_ldsm.assign((nthreads + 31) / 32, {});
        std::vector<std::thread> ts;
        for (unsigned tz = 0; tz < block.z; ++tz)
        for (unsigned ty = 0; ty < block.y; ++ty)
        for (unsigned tx = 0; tx < block.x; ++tx)
            ts.emplace_back([=] { threadIdx = {tx, ty, tz}; blockIdx = {bx, by, bz}; kernel(); });
        for (auto& t : ts) t.join();
    }
}
