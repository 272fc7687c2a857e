// emu.h: a host-side CUDA emulator for birdtrain's kernels (verification without a GPU).
//
// g++ compiles a kernel file (common.cuh expanded, BT_EMULATE defined) with this header first.
// Every CUDA thread of a block is a fiber (its own stack) on one OS thread, switched
// cooperatively: __syncthreads is a block-wide barrier, warp shuffles, `ldmatrix` and the
// m16n8k16 bf16 `mma.sync` are warp-collective exchanges that follow the PTX ISA fragment
// layouts. A fiber runs until it must wait, then the next one in round-robin order runs, so an
// execution is deterministic, and a barrier that can never complete (a __syncthreads in
// divergent code) is reported as a deadlock instead of hanging.
//
// cp.async (16-byte global → shared copies with zero fill) is emulated with its weakest legal
// timing: a copy lands only when its thread's `cp.async.wait_group` retires its group (or
// `wait_all`), never at issue. A kernel that reads a pipeline stage before waiting for it reads
// stale shared memory and fails its reference check; a thread that exits with copies still in
// flight aborts the run.
//
// __shared__ arrays are function statics (one block runs at a time); dynamic shared memory is a
// static buffer of BT_EMU_DYN_SMEM bytes. Slow next to a GPU, so the checks use small shapes;
// tests/gpu/cuda_emulation.rs builds and runs conv_check.cpp, conv2_check.cpp, conv3_check.cpp
// and ops_check.cpp. hopper.h adds the sm_90a instructions (mbarrier, TMA, wgmma): a check of
// Hopper kernels includes it after this file.
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>
#if !defined(__x86_64__) || defined(BT_EMU_UCONTEXT)
#include <ucontext.h>
#define BT_EMU_USE_UCONTEXT 1
#endif

struct dim3e { unsigned x = 0, y = 0, z = 0; };
// The running fiber's coordinates (set at every switch; one OS thread runs all fibers).
inline dim3e threadIdx, blockIdx;
inline dim3e blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define BT_EMULATE 1
#define BT_EMU_DYN_SMEM (160 * 1024)

using std::min; using std::max; using std::isfinite;

// ---- fibers ------------------------------------------------------------------------------

#ifndef BT_EMU_USE_UCONTEXT
// Saves the callee-saved registers on the current stack, stores the stack pointer in *from,
// switches to `to` and restores its registers (the System V x86-64 ABI; no syscall).
extern "C" void bt_emu_ctx_switch(void** from, void* to);
asm(R"(
    .text
    .globl bt_emu_ctx_switch
    .type bt_emu_ctx_switch,@function
bt_emu_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size bt_emu_ctx_switch, .-bt_emu_ctx_switch
)");
#endif

struct EmuCopy { void* dst; const void* src; int bytes; long group; };

struct EmuFiber {
    dim3e tid;
    int lin = 0;  // linear thread index (x fastest): lane = lin % 32, warp = lin / 32
    bool done = false;
    void* sp = nullptr;
#ifdef BT_EMU_USE_UCONTEXT
    ucontext_t uc;
#endif
    std::vector<EmuCopy> copies;  // cp.async in flight (group -1: not committed yet)
    long groups = 0;              // committed groups so far
};

inline constexpr size_t kEmuStack = 256 * 1024;
inline std::vector<EmuFiber> g_fibers;
inline std::vector<std::unique_ptr<char[]>> g_stacks;
inline int g_cur = 0, g_live = 0;
inline long g_spins = 0;  // consecutive waits without any barrier progress (deadlock detector)
inline void* g_main_sp = nullptr;
#ifdef BT_EMU_USE_UCONTEXT
inline ucontext_t g_main_uc;
#endif
inline std::function<void()> g_kernel;

[[noreturn]] inline void emu_fail(const char* what) {
    fprintf(stderr, "emulator: %s (block %u,%u,%u thread %u,%u,%u)\n", what, blockIdx.x, blockIdx.y,
            blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z);
    fflush(stdout);
    std::abort();
}

inline void emu_switch(int from, int to) {
    g_cur = to;
    threadIdx = g_fibers[to].tid;
#ifdef BT_EMU_USE_UCONTEXT
    swapcontext(&g_fibers[from].uc, &g_fibers[to].uc);
#else
    bt_emu_ctx_switch(&g_fibers[from].sp, g_fibers[to].sp);
#endif
}

// Runs the next live fiber (round robin); returns when this one is scheduled again.
inline void emu_yield() {
    const int n = (int)g_fibers.size();
    int next = g_cur;
    do next = (next + 1) % n; while (g_fibers[next].done);
    if (next != g_cur) emu_switch(g_cur, next);
}

struct EmuBarrier {
    int expected = 0, arrived = 0;
    unsigned gen = 0;
    void arrive_and_wait() {
        const unsigned g = gen;
        if (++arrived >= expected) { arrived = 0; ++gen; g_spins = 0; return; }
        while (gen == g) {
            if (++g_spins > 4L * (long)g_fibers.size() + 64) emu_fail("deadlock: a barrier that no thread can complete");
            emu_yield();
        }
    }
    // A thread exited: barriers count only live threads.
    void leave() {
        --expected;
        if (arrived > 0 && arrived >= expected) { arrived = 0; ++gen; g_spins = 0; }
    }
};

inline EmuBarrier g_block_barrier;
inline std::vector<EmuBarrier> g_warp_barriers;

// Lane and warp of the running thread (warps are formed from the linear thread index).
inline int emu_lane() { return g_fibers[g_cur].lin % 32; }
inline int emu_warp() { return g_fibers[g_cur].lin / 32; }

inline void __syncthreads() { g_block_barrier.arrive_and_wait(); }

// bar.sync id, count: named barrier `id` (1..15; 0 is __syncthreads') completes when `count`
// threads have arrived, whichever they are; a block starts with all of them empty.
inline std::array<EmuBarrier, 16> g_named_barriers;
inline void bt_emu_bar_sync(unsigned id, int count) {
    if (id == 0 || id >= g_named_barriers.size()) emu_fail("bar.sync with a barrier id outside 1..15");
    if (count <= 0 || count % 32) emu_fail("bar.sync with a thread count that is not a multiple of 32");
    EmuBarrier& b = g_named_barriers[id];
    if (b.arrived > 0 && b.expected != count) emu_fail("bar.sync: threads of one phase named different counts");
    b.expected = count;
    b.arrive_and_wait();
}

// ---- cp.async ----------------------------------------------------------------------------

inline void emu_copy_now(const EmuCopy& c) {
    if (c.bytes > 0) memcpy(c.dst, c.src, (size_t)c.bytes);
    memset(static_cast<char*>(c.dst) + c.bytes, 0, (size_t)(16 - c.bytes));
}

// cp.async.cg.shared.global [dst], [src], 16, src_bytes: src_bytes < 16 fills the rest with
// zeros (0: nothing is read, `src` may point anywhere).
inline void bt_emu_cp_async(void* dst, const void* src, int src_bytes) {
    if ((reinterpret_cast<uintptr_t>(dst) | (src_bytes ? reinterpret_cast<uintptr_t>(src) : 0)) % 16)
        emu_fail("cp.async with a misaligned 16-byte address");
    g_fibers[g_cur].copies.push_back({dst, src, src_bytes, -1});
}

inline void bt_emu_cp_async_commit() {
    EmuFiber& f = g_fibers[g_cur];
    for (auto& c : f.copies) if (c.group < 0) c.group = f.groups;
    ++f.groups;
}

// cp.async.wait_group n: every committed group but the newest n has landed.
inline void bt_emu_cp_async_wait(int n) {
    EmuFiber& f = g_fibers[g_cur];
    std::vector<EmuCopy> keep;
    for (auto& c : f.copies) {
        if (c.group >= 0 && c.group < f.groups - n) emu_copy_now(c);
        else keep.push_back(c);
    }
    f.copies.swap(keep);
}

// ---- arithmetic and warp collectives -----------------------------------------------------

inline float atomicAdd(float* p, float v) { float o = *p; *p += v; return o; }

// The alignment a vector memory instruction demands; the hardware stops the kernel otherwise.
inline void bt_emu_check_aligned(const void* p, uintptr_t bytes, const char* what) {
    if (reinterpret_cast<uintptr_t>(p) % bytes) emu_fail(what);
}

struct uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
struct alignas(8) float2 { float x, y; };
inline float2 make_float2(float a, float b) { return {a, b}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
struct alignas(8) int2 { int x, y; };
inline int2 make_int2(int a, int b) { return {a, b}; }

struct __nv_bfloat16 { uint16_t bits; };
inline float __bfloat162float(__nv_bfloat16 v) { uint32_t u = (uint32_t)v.bits << 16; float f; memcpy(&f, &u, 4); return f; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    uint32_t lsb = (u >> 16) & 1; u += 0x7fff + lsb;
    return __nv_bfloat16{(uint16_t)(u >> 16)};
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 v) { return v.bits; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
// Round-to-nearest arithmetic intrinsics (x86-64 SSE arithmetic is IEEE round-to-nearest; the
// emulator is built without FMA contraction, so these are the device's exact operations).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }

// Warp-collective m16n8k16 emulation using the PTX fragment layout.
struct WarpMma { unsigned a[32][4]; unsigned b[32][2]; };
inline std::vector<WarpMma> g_warp_mma;
inline float bf_lo(unsigned w) { return __bfloat162float(__nv_bfloat16{(uint16_t)(w & 0xffff)}); }
inline float bf_hi(unsigned w) { return __bfloat162float(__nv_bfloat16{(uint16_t)(w >> 16)}); }
inline void bt_emu_mma(float* d, const unsigned* a, const unsigned* b) {
    const int lane = emu_lane(), warp = emu_warp();
    WarpMma& s = g_warp_mma[warp];
    for (int i = 0; i < 4; ++i) s.a[lane][i] = a[i];
    for (int i = 0; i < 2; ++i) s.b[lane][i] = b[i];
    g_warp_barriers[warp].arrive_and_wait();
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
    g_warp_barriers[warp].arrive_and_wait();
}

inline std::vector<std::array<float, 32>> g_shfl_f;
inline std::vector<std::array<int, 32>> g_shfl_i;
inline float __shfl_xor_sync(unsigned, float v, int off) {
    const int lane = emu_lane(), warp = emu_warp();
    g_shfl_f[warp][lane] = v; g_warp_barriers[warp].arrive_and_wait();
    float r = g_shfl_f[warp][lane ^ off]; g_warp_barriers[warp].arrive_and_wait(); return r;
}
inline int __shfl_xor_sync(unsigned, int v, int off) {
    const int lane = emu_lane(), warp = emu_warp();
    g_shfl_i[warp][lane] = v; g_warp_barriers[warp].arrive_and_wait();
    int r = g_shfl_i[warp][lane ^ off]; g_warp_barriers[warp].arrive_and_wait(); return r;
}

// Warp-collective ldmatrix.x4 (optionally .trans) on 16-bit elements.
inline std::vector<std::array<const uint16_t*, 32>> g_ldsm;
inline void bt_emu_ldmatrix(unsigned* r, const void* p, bool trans) {
    const int lane = emu_lane(), warp = emu_warp();
    if (reinterpret_cast<uintptr_t>(p) % 16) emu_fail("ldmatrix row address not 16-byte aligned");
    g_ldsm[warp][lane] = static_cast<const uint16_t*>(p);
    g_warp_barriers[warp].arrive_and_wait();
    const int g = lane / 4, t = lane % 4;
    for (int m = 0; m < 4; ++m) {
        uint16_t lo, hi;
        if (!trans) { const uint16_t* row = g_ldsm[warp][m * 8 + g]; lo = row[2 * t]; hi = row[2 * t + 1]; }
        else { lo = g_ldsm[warp][m * 8 + 2 * t][g]; hi = g_ldsm[warp][m * 8 + 2 * t + 1][g]; }
        r[m] = (unsigned)lo | ((unsigned)hi << 16);
    }
    g_warp_barriers[warp].arrive_and_wait();
}

// Extensions of the per-block state (hopper.h: mbarriers, TMA, wgmma) hook in here, so this
// file needs none of them: called when a block starts (with its thread count) and when one of
// its threads exits.
inline void (*g_emu_block_start_hook)(unsigned nthreads) = nullptr;
inline void (*g_emu_thread_exit_hook)() = nullptr;

// ---- launching ---------------------------------------------------------------------------

inline void emu_fiber_exit() {
    EmuFiber& f = g_fibers[g_cur];
    if (!f.copies.empty()) emu_fail("thread exited with cp.async copies in flight");
    if (g_emu_thread_exit_hook) g_emu_thread_exit_hook();
    f.done = true;
    --g_live;
    g_block_barrier.leave();
    g_warp_barriers[f.lin / 32].leave();
}

inline void emu_fiber_entry() {
    g_kernel();
    emu_fiber_exit();
    const int me = g_cur;
    if (g_live == 0) {
#ifdef BT_EMU_USE_UCONTEXT
        swapcontext(&g_fibers[me].uc, &g_main_uc);
#else
        bt_emu_ctx_switch(&g_fibers[me].sp, g_main_sp);
#endif
    } else {
        emu_yield();
    }
    emu_fail("a finished thread was resumed");
}

// The order emu_launch runs a grid's blocks in: 0 is row-major (x fastest); any other value
// seeds a pseudo-random permutation, so a check can run a kernel twice in different orders and
// demand the same bits (a GPU gives no order: a result that depends on it is not deterministic).
inline unsigned g_emu_block_order = 0;

// Runs kernel() over the grid: every thread of a block a fiber, block after block.
template <class F>
void emu_launch(dim3e grid, dim3e block, F kernel) {
    gridDim = grid; blockDim = block;
    const unsigned nthreads = block.x * block.y * block.z;
    g_kernel = kernel;
    while (g_stacks.size() < nthreads) g_stacks.emplace_back(new char[kEmuStack]);
    const unsigned nwarps = (nthreads + 31) / 32;
    std::vector<dim3e> order;
    for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) order.push_back({bx, by, bz});
    if (g_emu_block_order != 0) {
        unsigned long long r = g_emu_block_order;
        for (size_t i = order.size(); i > 1; --i) {  // Fisher-Yates with a 64-bit LCG
            r = r * 6364136223846793005ULL + 1442695040888963407ULL;
            std::swap(order[i - 1], order[(size_t)((r >> 33) % i)]);
        }
    }
    for (const dim3e& b : order) {
        blockIdx = b;
        g_fibers.assign(nthreads, EmuFiber{});
        g_block_barrier = EmuBarrier{(int)nthreads, 0, 0};
        g_named_barriers.fill(EmuBarrier{});
        g_warp_barriers.assign(nwarps, EmuBarrier{});
        for (unsigned w = 0; w < nwarps; ++w) g_warp_barriers[w].expected = (int)std::min(32u, nthreads - 32 * w);
        g_warp_mma.assign(nwarps, WarpMma{});
        g_shfl_f.assign(nwarps, {});
        g_shfl_i.assign(nwarps, {});
        g_ldsm.assign(nwarps, {});
        if (g_emu_block_start_hook) g_emu_block_start_hook(nthreads);
        unsigned i = 0;
        for (unsigned tz = 0; tz < block.z; ++tz)
        for (unsigned ty = 0; ty < block.y; ++ty)
        for (unsigned tx = 0; tx < block.x; ++tx, ++i) {
            EmuFiber& f = g_fibers[i];
            f.tid = {tx, ty, tz};
            f.lin = (int)i;
            char* top = g_stacks[i].get() + kEmuStack;
#ifdef BT_EMU_USE_UCONTEXT
            getcontext(&f.uc);
            f.uc.uc_stack.ss_sp = g_stacks[i].get();
            f.uc.uc_stack.ss_size = kEmuStack;
            f.uc.uc_link = nullptr;
            makecontext(&f.uc, emu_fiber_entry, 0);
            (void)top;
#else
            // A fresh stack that "returns" into emu_fiber_entry: six zeroed callee-saved
            // registers, then the entry address; the ABI wants rsp % 16 == 8 at entry.
            auto* sp = reinterpret_cast<uintptr_t*>(reinterpret_cast<uintptr_t>(top) & ~uintptr_t(15));
            *--sp = 0;                                                     // fake return address
            *--sp = reinterpret_cast<uintptr_t>(&emu_fiber_entry);
            for (int r = 0; r < 6; ++r) *--sp = 0;
            f.sp = sp;
#endif
        }
        g_live = (int)nthreads;
        g_cur = 0;
        threadIdx = g_fibers[0].tid;
        g_spins = 0;
#ifdef BT_EMU_USE_UCONTEXT
        swapcontext(&g_main_uc, &g_fibers[0].uc);
#else
        bt_emu_ctx_switch(&g_main_sp, g_fibers[0].sp);
#endif
    }
}
