// collective.cu: the reductions of the one-GPU rehearsal of N ranks (src/dist/device_group.rs).
//
// Algorithm. N ranks of one process train on one GPU, each with its own buffers in the device's
// one context; the rehearsal's collective joins them without NCCL (which refuses two ranks on
// one device). Once every rank has issued its part of a round (the host checks that), one
// launch reduces element i of every rank's buffer, in rank order, and writes the result into
// every rank's buffer:
//   rank_average_f32: acc = s_0·g_0, then acc = acc + s_r·g_r for r = 1 … N−1, each product
//     rounded to f32 first (what scale_f32 does to a bucket before NCCL averages it); the
//     average is acc / N. The same arithmetic as the CPU ranks' LocalCollective (scale, sum in
//     rank order, divide), bit for bit, and as NCCL's ncclAvg for N a power of two (which
//     multiplies every term by 1/N in f32 before summing: exact then), up to NCCL's own order
//     of the sum. Explicit round-to-nearest intrinsics: no fused multiply-add, so the bits do
//     not depend on what the compiler contracts.
//   rank_sum_f64: v_0 + v_1 + … + v_{N−1} in f64, rank order (the step totals: loss sum, hits,
//     images, stop wishes).
// Each thread reads element i of every rank before it writes element i of every rank: no
// thread touches another's elements, no atomics, the same bits on every run.
//
// Data layout. RankBuffersF32 / RankBuffersF64: one device address per rank, in rank order (up
// to BT_MAX_RANKS; the host refuses more), and for the average each rank's scale (its share of
// the step's images × N, 1 for an even split); passed by value as a kernel parameter. Entries
// from `ranks` on are unused.
//
// Launch configuration. A grid-stride loop over the n elements, 256 threads, at most 1024
// blocks (as scale_f32).
#include "common.cuh"

#define BT_MAX_RANKS 8

struct RankBuffersF32 {
    float* ptr[BT_MAX_RANKS];
    float scale[BT_MAX_RANKS];
};

struct RankBuffersF64 {
    double* ptr[BT_MAX_RANKS];
};

extern "C" __global__ void rank_average_f32(RankBuffersF32 b, int ranks, long n) {
    const float count = (float)ranks;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x) {
        float acc = __fmul_rn(b.scale[0], b.ptr[0][i]);
        for (int r = 1; r < ranks; ++r) acc = __fadd_rn(acc, __fmul_rn(b.scale[r], b.ptr[r][i]));
        const float mean = __fdiv_rn(acc, count);
        for (int r = 0; r < ranks; ++r) b.ptr[r][i] = mean;
    }
}

extern "C" __global__ void rank_sum_f64(RankBuffersF64 b, int ranks, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x) {
        double acc = b.ptr[0][i];
        for (int r = 1; r < ranks; ++r) acc = __dadd_rn(acc, b.ptr[r][i]);
        for (int r = 0; r < ranks; ++r) b.ptr[r][i] = acc;
    }
}
