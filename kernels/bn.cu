// bn.cu: batch normalisation (training and inference) fused with the residual add and ReLU,
// forward and backward.
//
// Algorithm. Training forward is three launches:
//   1. bn_stats_partial: every block reduces a slab of rows to per-channel (mean, M2) with
//      Welford's update in f32 (numerically safe over ~10^6 values, unlike sum/sum-of-squares);
//   2. bn_stats_finalize: a block per 32 channels combines the slabs in two passes, the batch
//      mean = Σ n_b·mean_b / n, then M2 = Σ (M2_b + n_b·(mean_b − mean)²) (the exact parallel
//      combination; every term ≥ 0), each pass FIN_Y lanes per channel summing slabs lane,
//      lane + FIN_Y, ... followed by a fixed tree in shared memory (deterministic; a few µs,
//      where one thread per channel chaining ~500 Chan merges took ~115 µs), writes
//      the saved mean and 1/sqrt(var + eps) (biased variance, as PyTorch normalises with) and
//      updates the running statistics with the unbiased variance and `momentum` (PyTorch's
//      convention: running = (1 - momentum)·running + momentum·batch);
//   3. bn_apply: y = [relu]((x - mean)·invstd·gamma + beta [+ residual]) (bn_apply_signs_vec
//      also packs y's signs a bit per element, for a data gradient that reads its mask).
// Frozen statistics and inference use bn_eval_prepare (running stats → saved mean, invstd)
// followed by bn_apply.
// Backward mirrors it: bn_bwd_partial reduces dbeta = Σ g and dgamma = Σ g·x̂ per slab, where
// g = dy·[y > 0] when the forward had a ReLU (the mask is read back from the saved output);
// bn_bwd_finalize sums the slabs into dgamma and dbeta (f32, overwritten; the finalize's strided
// lanes and fixed tree); bn_bwd_apply writes
//   dx = gamma·invstd·(g − dbeta/M − x̂·dgamma/M)   (batch statistics), or
//   dx = gamma·invstd·g                             (frozen statistics: a fixed affine map),
// and, for a residual block, dres = g (overwritten or accumulated).
// Fused into the convolutions (BIRDTRAIN_BN_FUSION, the end of this file), the statistics and
// the backward reductions come from the convolutions' epilogues as per-tile records instead:
// bn_stats_merge / bn_sums_merge merge them, bn_moments_finalize replaces bn_stats_finalize,
// and bn_bwd_apply runs with the mask off on the finished gradient.
// Synchronised batch norm (--sync-bn) runs the frozen-statistics backward with the global
// statistics (dgamma, dbeta and dres), then bn_bwd_apply with batch statistics again, its
// dbeta and dgamma replaced by the global ones on this replica's scale: dx is the global
// backward in one evaluation, rounded once (over one replica: plain BN's dx, bit for bit).
// The arithmetic around the replicas' sums stays on the device (the bn_sync_* kernels, one
// thread per channel): bn_sync_moments packs Σx = rows·mean and Σx² = (rows−1)·var + rows·mean²
// and the rows; after the sum, bn_sync_statistics writes the global mean and biased variance
// (for the frozen-statistics forward) and advances the running statistics; backward,
// bn_sync_grad_sums packs dgamma and dbeta times rows / global rows, and after the sum
// bn_sync_reductions rounds the totals to f32 for bn_bwd_apply. They follow
// src/backend/bn_sync.rs (the CPU's arithmetic) operation for operation in f64, with explicitly
// rounded operations (__dmul_rn, __dadd_rn, ...) so that no multiply-add is contracted into an
// FMA: the same bits as the host.
//
// Data layout. x, y, residual, dy, dx, dres: NHWC bf16 viewed as an M×C matrix (M = N·H·W),
// channels innermost. gamma, beta: bf16 [C] (the working copy of the weights); mean, invstd,
// running stats, dgamma, dbeta: f32 [C].
// Partial buffers: f32 [slabs][C]. Synchronised-BN sums: f64, [Σx | Σx² | rows] (2C + 1)
// forward, [Σdgamma | Σdbeta] (2C) backward.
//
// Launch configuration. Reductions: block (32, 8): threadIdx.x walks 32 consecutive channels
// (coalesced 64-byte rows), threadIdx.y strides over the slab's rows; grid (ceil(C/32), slabs)
// with `rows_per_slab` rows per slab (the host picks slabs ≈ 4 per SM); the *_vec reductions
// (C % 8 == 0, C ≤ 2048) use 256 threads on 16-byte channel groups instead (see below). Finalize:
// block (32, FIN_Y = 32), grid ceil(C/32): threadIdx.x the channel (coalesced 128-byte rows of a
// slab), threadIdx.y the slab lane. bn_eval_prepare and the bn_sync_* kernels: one thread per
// channel, 128 per block.
// Element-wise kernels: grid-stride loops, 256 threads; the *_vec variants (C % 8 == 0, every
// ResNet layer) move 16 bytes per thread and access, on one wave of blocks (as many as fit the
// SMs) whose stride is a multiple of C / 8 (each thread keeps its channels' parameters in
// registers, see below).
#include "common.cuh"

#define RED_Y 8
#define FIN_Y 32  // slab lanes per channel in the finalize kernels (blockDim.y)

// Merges Welford state (nb, mb, m2b) into (na, ma, m2a).
__device__ __forceinline__ void chan_merge(float& na, float& ma, float& m2a, float nb, float mb, float m2b) {
    if (nb == 0.0f) return;
    const float n = na + nb, delta = mb - ma;
    ma += delta * (nb / n);
    m2a += m2b + delta * delta * (na * nb / n);
    na = n;
}

extern "C" __global__ void bn_stats_partial(const bf16* __restrict__ x, int rows, int channels,
                                            int rows_per_slab, float* __restrict__ part_mean,
                                            float* __restrict__ part_m2) {
    __shared__ float s_n[RED_Y][32], s_mean[RED_Y][32], s_m2[RED_Y][32];
    const int c = blockIdx.x * 32 + threadIdx.x;
    const int begin = blockIdx.y * rows_per_slab;
    const int end = min(rows, begin + rows_per_slab);
    float n = 0.0f, mean = 0.0f, m2 = 0.0f;
    if (c < channels) {
        for (int row = begin + threadIdx.y; row < end; row += RED_Y) {
            const float v = bt_to_f32(x[(long)row * channels + c]);
            n += 1.0f;
            const float d = v - mean;
            mean += d / n;
            m2 += d * (v - mean);
        }
    }
    s_n[threadIdx.y][threadIdx.x] = n;
    s_mean[threadIdx.y][threadIdx.x] = mean;
    s_m2[threadIdx.y][threadIdx.x] = m2;
    __syncthreads();
    if (threadIdx.y == 0 && c < channels) {
        for (int y = 1; y < RED_Y; ++y)
            chan_merge(n, mean, m2, s_n[y][threadIdx.x], s_mean[y][threadIdx.x], s_m2[y][threadIdx.x]);
        part_mean[(long)blockIdx.y * channels + c] = mean;
        part_m2[(long)blockIdx.y * channels + c] = m2;
    }
}

// Sum of `v` over the FIN_Y lanes (threadIdx.y) of each channel (threadIdx.x), a fixed tree
// (lane l adds lane l + half); every thread receives its channel's sum. `s`: FIN_Y × 32 floats
// of shared memory. Called by every thread of the block.
__device__ __forceinline__ float fin_lane_sum(float v, float (*s)[32]) {
    const int tx = threadIdx.x, ty = threadIdx.y;
    s[ty][tx] = v;
    for (int half = FIN_Y / 2; half > 0; half >>= 1) {
        __syncthreads();
        if (ty < half) {
            v += s[ty + half][tx];
            s[ty][tx] = v;
        }
    }
    __syncthreads();
    v = s[0][tx];
    __syncthreads();  // `s` is free again
    return v;
}

// Block (32, FIN_Y): threadIdx.x the channel blockIdx.x·32 + threadIdx.x, threadIdx.y the lane.
extern "C" __global__ void bn_stats_finalize(const float* __restrict__ part_mean,
                                             const float* __restrict__ part_m2, int slabs,
                                             int rows, int channels, int rows_per_slab, float eps,
                                             float momentum, float* __restrict__ mean_out,
                                             float* __restrict__ invstd_out,
                                             float* __restrict__ running_mean,
                                             float* __restrict__ running_var) {
    __shared__ float s_sum[FIN_Y][32];
    const int ty = threadIdx.y;
    const int c = blockIdx.x * 32 + threadIdx.x;
    const bool live = c < channels;
    // Pass 1: n (exact: integers below 2^24) and Σ n_b·mean_b.
    float n = 0.0f, sum = 0.0f;
    if (live) {
#pragma unroll 4
        for (int b = ty; b < slabs; b += FIN_Y) {
            const float nb = (float)max(0, min(rows, (b + 1) * rows_per_slab) - b * rows_per_slab);
            n += nb;
            sum = fmaf(nb, part_mean[(long)b * channels + c], sum);
        }
    }
    n = fin_lane_sum(n, s_sum);
    sum = fin_lane_sum(sum, s_sum);
    const float mean = n > 0.0f ? sum / n : 0.0f;
    // Pass 2: M2 around the batch mean.
    float m2 = 0.0f;
    if (live) {
#pragma unroll 4
        for (int b = ty; b < slabs; b += FIN_Y) {
            const float nb = (float)max(0, min(rows, (b + 1) * rows_per_slab) - b * rows_per_slab);
            const float d = part_mean[(long)b * channels + c] - mean;
            m2 += fmaf(nb * d, d, part_m2[(long)b * channels + c]);
        }
    }
    m2 = fin_lane_sum(m2, s_sum);
    if (ty != 0 || !live) return;
    const float var = n > 0.0f ? m2 / n : 0.0f;
    mean_out[c] = mean;
    invstd_out[c] = rsqrtf(var + eps);
    if (running_mean != nullptr) {
        const float unbiased = n > 1.0f ? m2 / (n - 1.0f) : var;
        running_mean[c] = (1.0f - momentum) * running_mean[c] + momentum * mean;
        running_var[c] = (1.0f - momentum) * running_var[c] + momentum * unbiased;
    }
}

extern "C" __global__ void bn_eval_prepare(const float* __restrict__ running_mean,
                                           const float* __restrict__ running_var, int channels,
                                           float eps, float* __restrict__ mean_out,
                                           float* __restrict__ invstd_out) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    mean_out[c] = running_mean[c];
    invstd_out[c] = rsqrtf(running_var[c] + eps);
}

// `residual` may be null; `relu` is 0 or 1.
extern "C" __global__ void bn_apply(const bf16* __restrict__ x, const float* __restrict__ mean,
                                    const float* __restrict__ invstd, const bf16* __restrict__ gamma,
                                    const bf16* __restrict__ beta, const bf16* __restrict__ residual,
                                    bf16* __restrict__ y, long total, int channels, int relu) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const int c = (int)(i % channels);
        float v = (bt_to_f32(x[i]) - mean[c]) * invstd[c] * bt_to_f32(gamma[c]) + bt_to_f32(beta[c]);
        if (residual != nullptr) v += bt_to_f32(residual[i]);
        if (relu) v = fmaxf(v, 0.0f);
        y[i] = bt_to_bf16(v);
    }
}

// Synchronised BN, forward, before the replicas' sum: sums = [rows·mean | (rows−1)⁺·var +
// rows·mean² | rows] from this replica's batch mean and unbiased variance.
extern "C" __global__ void bn_sync_moments(const float* __restrict__ mean, const float* __restrict__ var,
                                           double rows, int channels, double* __restrict__ sums) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c == 0) sums[2 * channels] = rows;
    if (c >= channels) return;
    const double m = (double)mean[c];
    sums[c] = __dmul_rn(rows, m);
    const double scale = fmax(__dsub_rn(rows, 1.0), 0.0);
    sums[channels + c] = __dadd_rn(__dmul_rn(scale, (double)var[c]), __dmul_rn(__dmul_rn(rows, m), m));
}

// Synchronised BN, forward, after the sum: the global mean and biased variance into mean and
// var (f32, for the frozen-statistics forward), and the running statistics advanced with the
// global mean and unbiased variance. A sum of no rows (no step has one; the host reports it)
// leaves every output untouched.
extern "C" __global__ void bn_sync_statistics(const double* __restrict__ sums, int channels, float momentum,
                                              float* __restrict__ mean, float* __restrict__ var,
                                              float* __restrict__ running_mean,
                                              float* __restrict__ running_var) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const double rows = sums[2 * channels];
    if (c >= channels || !(rows >= 1.0)) return;
    const double m = __ddiv_rn(sums[c], rows);
    const double v = fmax(__dsub_rn(__ddiv_rn(sums[channels + c], rows), __dmul_rn(m, m)), 0.0);
    mean[c] = (float)m;
    var[c] = (float)v;
    const double unbias = rows > 1.0 ? __ddiv_rn(rows, __dsub_rn(rows, 1.0)) : 1.0;
    const double mo = (double)momentum, keep = __dsub_rn(1.0, mo);
    running_mean[c] = (float)__dadd_rn(__dmul_rn(keep, (double)running_mean[c]), __dmul_rn(mo, m));
    running_var[c] = (float)__dadd_rn(__dmul_rn(keep, (double)running_var[c]), __dmul_rn(__dmul_rn(mo, v), unbias));
}

// Synchronised BN, backward, before the sum: sums = [dgamma·share | dbeta·share], share = this
// replica's rows / the global rows (moments[2C], from the same layer's summed forward).
extern "C" __global__ void bn_sync_grad_sums(const float* __restrict__ dgamma, const float* __restrict__ dbeta,
                                             const double* __restrict__ moments, double rows, int channels,
                                             double* __restrict__ sums) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    const double share = __ddiv_rn(rows, moments[2 * channels]);
    sums[c] = __dmul_rn((double)dgamma[c], share);
    sums[channels + c] = __dmul_rn((double)dbeta[c], share);
}

// Synchronised BN, backward, after the sum: the global Σdz·x̂ and Σdz on this replica's scale
// (sums = [Σdgamma | Σdbeta]) rounded to f32, for bn_bwd_apply in place of its own dgamma,
// dbeta (divided by this replica's rows there: the global means).
extern "C" __global__ void bn_sync_reductions(const double* __restrict__ sums, int channels,
                                              float* __restrict__ dgamma, float* __restrict__ dbeta) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    dgamma[c] = (float)sums[c];
    dbeta[c] = (float)sums[channels + c];
}

// The gradient reaching the batch norm itself: dy masked by the ReLU (y > 0) when present.
__device__ __forceinline__ float bn_grad_in(const bf16* dy, const bf16* y, long i, int relu) {
    const float g = bt_to_f32(dy[i]);
    return relu && !(bt_to_f32(y[i]) > 0.0f) ? 0.0f : g;
}

extern "C" __global__ void bn_bwd_partial(const bf16* __restrict__ dy, const bf16* __restrict__ y,
                                          const bf16* __restrict__ x, const float* __restrict__ mean,
                                          const float* __restrict__ invstd, int rows, int channels,
                                          int rows_per_slab, int relu, float* __restrict__ part_dbeta,
                                          float* __restrict__ part_dgamma) {
    __shared__ float s_b[RED_Y][32], s_g[RED_Y][32];
    const int c = blockIdx.x * 32 + threadIdx.x;
    const int begin = blockIdx.y * rows_per_slab;
    const int end = min(rows, begin + rows_per_slab);
    float sb = 0.0f, sg = 0.0f;
    if (c < channels) {
        const float mu = mean[c], is = invstd[c];
        for (int row = begin + threadIdx.y; row < end; row += RED_Y) {
            const long i = (long)row * channels + c;
            const float g = bn_grad_in(dy, y, i, relu);
            sb += g;
            sg += g * (bt_to_f32(x[i]) - mu) * is;
        }
    }
    s_b[threadIdx.y][threadIdx.x] = sb;
    s_g[threadIdx.y][threadIdx.x] = sg;
    __syncthreads();
    if (threadIdx.y == 0 && c < channels) {
        for (int k = 1; k < RED_Y; ++k) { sb += s_b[k][threadIdx.x]; sg += s_g[k][threadIdx.x]; }
        part_dbeta[(long)blockIdx.y * channels + c] = sb;
        part_dgamma[(long)blockIdx.y * channels + c] = sg;
    }
}

// Block (32, FIN_Y), as bn_stats_finalize: strided per-lane sums, then the fixed tree.
extern "C" __global__ void bn_bwd_finalize(const float* __restrict__ part_dbeta,
                                           const float* __restrict__ part_dgamma, int slabs,
                                           int channels, float* __restrict__ dbeta,
                                           float* __restrict__ dgamma) {
    __shared__ float s_sum[FIN_Y][32];
    const int ty = threadIdx.y;
    const int c = blockIdx.x * 32 + threadIdx.x;
    float sb = 0.0f, sg = 0.0f;
    if (c < channels) {
#pragma unroll 4
        for (int b = ty; b < slabs; b += FIN_Y) {
            sb += part_dbeta[(long)b * channels + c];
            sg += part_dgamma[(long)b * channels + c];
        }
    }
    sb = fin_lane_sum(sb, s_sum);
    sg = fin_lane_sum(sg, s_sum);
    if (ty != 0 || c >= channels) return;
    dbeta[c] = sb;
    dgamma[c] = sg;
}

// `dres` may be null (no residual input); when `accumulate_res` is 1 it is added into.
// `batch_stats` is 0 when the forward normalised with fixed (running) statistics.
extern "C" __global__ void bn_bwd_apply(const bf16* __restrict__ dy, const bf16* __restrict__ y,
                                        const bf16* __restrict__ x, const float* __restrict__ mean,
                                        const float* __restrict__ invstd, const bf16* __restrict__ gamma,
                                        const float* __restrict__ dbeta,
                                        const float* __restrict__ dgamma, long total,
                                        int channels, int relu, int batch_stats, bf16* __restrict__ dx,
                                        bf16* __restrict__ dres, int accumulate_res) {
    const float inv_rows = (float)channels / (float)total;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const int c = (int)(i % channels);
        const float g = bn_grad_in(dy, y, i, relu);
        const float k = bt_to_f32(gamma[c]) * invstd[c];
        float d = g;
        if (batch_stats) {
            const float xhat = (bt_to_f32(x[i]) - mean[c]) * invstd[c];
            d = g - (dbeta[c] + xhat * dgamma[c]) * inv_rows;
        }
        dx[i] = bt_to_bf16(k * d);
        if (dres != nullptr) dres[i] = bt_to_bf16(accumulate_res ? g + bt_to_f32(dres[i]) : g);
    }
}

// ---- 16-byte variants (C % 8 == 0): each thread handles 8 consecutive channels of one row ----

union Bf16x8 {
    uint4 v;
    bf16 e[8];
};

__device__ __forceinline__ Bf16x8 load8(const bf16* p) {
    Bf16x8 u;
    u.v = *reinterpret_cast<const uint4*>(p);
    return u;
}

// The element-wise passes read x (and dy, y, the residual) once, but each element also needs
// its channel's mean, invstd, gamma, beta (dbeta, dgamma): read per element, those scalar loads
// made the kernels L1-bound on an H100 (memory pipe 95-99 %, DRAM 30-46 %, half the stalls
// waiting on the L1 queue). So a thread keeps its 8 channels' parameters in registers and
// reloads them only when its channel group changes: the host launches one wave of blocks (as
// many as fit the SMs) with a stride that is a multiple of C / 8, so a thread's group never
// changes and it walks many rows. The arithmetic is the scalar kernels' own, term for term: the same bits.
struct ApplyParams {
    float mean[8], invstd[8], gamma[8], beta[8];
};

__device__ __forceinline__ void load_params(ApplyParams& p, const float* __restrict__ mean,
                                            const float* __restrict__ invstd,
                                            const bf16* __restrict__ gamma,
                                            const float* __restrict__ beta_f32,
                                            const bf16* __restrict__ beta_bf16, int c0) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        p.mean[e] = mean[c0 + e];
        p.invstd[e] = invstd[c0 + e];
        p.gamma[e] = bt_to_f32(gamma[c0 + e]);
        p.beta[e] = beta_f32 != nullptr ? beta_f32[c0 + e] : bt_to_f32(beta_bf16[c0 + e]);
    }
}

// bn_apply's output for C % 8 == 0, 16 bytes a thread; with SIGNS, also the output's signs
// packed a bit per element (bn_apply_signs_vec).
template <bool SIGNS>
__device__ __forceinline__ void bn_apply_vec_body(const bf16* __restrict__ x, const float* __restrict__ mean,
                                                  const float* __restrict__ invstd, const bf16* __restrict__ gamma,
                                                  const bf16* __restrict__ beta, const bf16* __restrict__ residual,
                                                  bf16* __restrict__ y, unsigned char* __restrict__ signs, long total,
                                                  int channels, int relu) {
    const long groups = total / 8, cg = channels / 8, step = (long)gridDim.x * blockDim.x;
    ApplyParams p;
    int loaded = -1;
    for (long gi = blockIdx.x * (long)blockDim.x + threadIdx.x; gi < groups; gi += step) {
        const long i = gi * 8;
        const int c0 = (int)(gi % cg) * 8;
        if (c0 != loaded) {
            load_params(p, mean, invstd, gamma, nullptr, beta, c0);
            loaded = c0;
        }
        const Bf16x8 xv = load8(x + i);
        Bf16x8 rv, out;
        if (residual != nullptr) rv = load8(residual + i);
        unsigned bits = 0;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            float v = (bt_to_f32(xv.e[e]) - p.mean[e]) * p.invstd[e] * p.gamma[e] + p.beta[e];
            if (residual != nullptr) v += bt_to_f32(rv.e[e]);
            if (relu) v = fmaxf(v, 0.0f);
            out.e[e] = bt_to_bf16(v);
            // The stored value's sign, as a reader of y tests it (y > 0 after the rounding).
            if (SIGNS && bt_to_f32(out.e[e]) > 0.0f) bits |= 1u << e;
        }
        *reinterpret_cast<uint4*>(y + i) = out.v;
        if (SIGNS) signs[gi] = (unsigned char)bits;
    }
}

extern "C" __global__ void bn_apply_vec(const bf16* __restrict__ x, const float* __restrict__ mean,
                                        const float* __restrict__ invstd, const bf16* __restrict__ gamma,
                                        const bf16* __restrict__ beta, const bf16* __restrict__ residual,
                                        bf16* __restrict__ y, long total, int channels, int relu) {
    bn_apply_vec_body<false>(x, mean, invstd, gamma, beta, residual, y, nullptr, total, channels, relu);
}

// bn_apply_vec that also writes y's signs packed a bit per element: bit e of signs[i / 8] is
// [y[i] > 0] for i = 8·(i / 8) + e (total / 8 bytes). A data gradient whose epilogue takes the
// ReLU's mask from them reads 1/16 of the bytes of y (BIRDTRAIN_BN_MASK=packed: the outputs of
// the batch norms with a residual, whose mask cannot be recomputed from their input alone).
extern "C" __global__ void bn_apply_signs_vec(const bf16* __restrict__ x, const float* __restrict__ mean,
                                              const float* __restrict__ invstd, const bf16* __restrict__ gamma,
                                              const bf16* __restrict__ beta, const bf16* __restrict__ residual,
                                              bf16* __restrict__ y, unsigned char* __restrict__ signs, long total,
                                              int channels, int relu) {
    bn_apply_vec_body<true>(x, mean, invstd, gamma, beta, residual, y, signs, total, channels, relu);
}

// Parameters as in bn_apply_vec; `beta` holds dbeta here and the fourth set dgamma.
extern "C" __global__ void bn_bwd_apply_vec(const bf16* __restrict__ dy, const bf16* __restrict__ y,
                                            const bf16* __restrict__ x, const float* __restrict__ mean,
                                            const float* __restrict__ invstd, const bf16* __restrict__ gamma,
                                            const float* __restrict__ dbeta,
                                            const float* __restrict__ dgamma, long total,
                                            int channels, int relu, int batch_stats, bf16* __restrict__ dx,
                                            bf16* __restrict__ dres, int accumulate_res) {
    const float inv_rows = (float)channels / (float)total;
    const long groups = total / 8, cg = channels / 8, step = (long)gridDim.x * blockDim.x;
    ApplyParams p;
    float dg[8];
    int loaded = -1;
    for (long gi = blockIdx.x * (long)blockDim.x + threadIdx.x; gi < groups; gi += step) {
        const long i = gi * 8;
        const int c0 = (int)(gi % cg) * 8;
        if (c0 != loaded) {
            load_params(p, mean, invstd, gamma, dbeta, nullptr, c0);
#pragma unroll
            for (int e = 0; e < 8; ++e) dg[e] = dgamma[c0 + e];
            loaded = c0;
        }
        const Bf16x8 dyv = load8(dy + i), xv = load8(x + i);
        Bf16x8 yv, dxo, dro, dri;
        if (relu) yv = load8(y + i);
        if (dres != nullptr && accumulate_res) dri = load8(dres + i);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            float g = bt_to_f32(dyv.e[e]);
            if (relu && !(bt_to_f32(yv.e[e]) > 0.0f)) g = 0.0f;
            const float k = p.gamma[e] * p.invstd[e];
            float d = g;
            if (batch_stats) {
                const float xhat = (bt_to_f32(xv.e[e]) - p.mean[e]) * p.invstd[e];
                d = g - (p.beta[e] + xhat * dg[e]) * inv_rows;
            }
            dxo.e[e] = bt_to_bf16(k * d);
            dro.e[e] = bt_to_bf16(dres != nullptr && accumulate_res ? g + bt_to_f32(dri.e[e]) : g);
        }
        *reinterpret_cast<uint4*>(dx + i) = dxo.v;
        if (dres != nullptr) *reinterpret_cast<uint4*>(dres + i) = dro.v;
    }
}

// Per-slab reductions for C % 8 == 0 and C ≤ 2048: a 1-D block of 256 threads; thread t owns
// channel group t % G (G = C / 8, 8 channels read as one 16-byte load) and walks rows
// t / G, t / G + R, ... with R = 256 / G rows in flight per step; the R partial states of a
// group are then merged in shared memory by its first thread. Launch: grid (1, slabs), 256.
#define RED_THREADS 256

extern "C" __global__ void bn_stats_partial_vec(const bf16* __restrict__ x, int rows, int channels,
                                                int rows_per_slab, float* __restrict__ part_mean,
                                                float* __restrict__ part_m2) {
    __shared__ float s_mean[RED_THREADS][8], s_m2[RED_THREADS][8], s_n[RED_THREADS];
    const int groups = channels / 8, lanes = RED_THREADS / groups;
    const int t = threadIdx.x, grp = t % groups, lane = t / groups;
    const int begin = blockIdx.y * rows_per_slab;
    const int end = min(rows, begin + rows_per_slab);
    float n = 0.0f, mean[8], m2[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) { mean[e] = 0.0f; m2[e] = 0.0f; }
    if (lane < lanes) {
        for (int row = begin + lane; row < end; row += lanes) {
            const Bf16x8 v = load8(x + (long)row * channels + grp * 8);
            n += 1.0f;
            const float inv = 1.0f / n;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float xv = bt_to_f32(v.e[e]), d = xv - mean[e];
                mean[e] += d * inv;
                m2[e] += d * (xv - mean[e]);
            }
        }
    }
    s_n[t] = n;
#pragma unroll
    for (int e = 0; e < 8; ++e) { s_mean[t][e] = mean[e]; s_m2[t][e] = m2[e]; }
    __syncthreads();
    if (lane == 0) {
        for (int l = 1; l < lanes; ++l) {
            const int o = l * groups + grp;
            float na = n;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                float nn = na;
                chan_merge(nn, mean[e], m2[e], s_n[o], s_mean[o][e], s_m2[o][e]);
            }
            n = na + s_n[o];
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            part_mean[(long)blockIdx.y * channels + grp * 8 + e] = mean[e];
            part_m2[(long)blockIdx.y * channels + grp * 8 + e] = m2[e];
        }
    }
}

extern "C" __global__ void bn_bwd_partial_vec(const bf16* __restrict__ dy, const bf16* __restrict__ y,
                                              const bf16* __restrict__ x, const float* __restrict__ mean,
                                              const float* __restrict__ invstd, int rows, int channels,
                                              int rows_per_slab, int relu, float* __restrict__ part_dbeta,
                                              float* __restrict__ part_dgamma) {
    __shared__ float s_b[RED_THREADS][8], s_g[RED_THREADS][8];
    const int groups = channels / 8, lanes = RED_THREADS / groups;
    const int t = threadIdx.x, grp = t % groups, lane = t / groups;
    const int begin = blockIdx.y * rows_per_slab;
    const int end = min(rows, begin + rows_per_slab);
    float sb[8], sg[8], mu[8], is[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        sb[e] = 0.0f;
        sg[e] = 0.0f;
        mu[e] = mean[grp * 8 + e];
        is[e] = invstd[grp * 8 + e];
    }
    if (lane < lanes) {
        for (int row = begin + lane; row < end; row += lanes) {
            const long i = (long)row * channels + grp * 8;
            const Bf16x8 dyv = load8(dy + i), xv = load8(x + i);
            Bf16x8 yv;
            if (relu) yv = load8(y + i);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                float g = bt_to_f32(dyv.e[e]);
                if (relu && !(bt_to_f32(yv.e[e]) > 0.0f)) g = 0.0f;
                sb[e] += g;
                sg[e] += g * (bt_to_f32(xv.e[e]) - mu[e]) * is[e];
            }
        }
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) { s_b[t][e] = sb[e]; s_g[t][e] = sg[e]; }
    __syncthreads();
    if (lane == 0) {
        for (int l = 1; l < lanes; ++l) {
            const int o = l * groups + grp;
#pragma unroll
            for (int e = 0; e < 8; ++e) { sb[e] += s_b[o][e]; sg[e] += s_g[o][e]; }
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            part_dbeta[(long)blockIdx.y * channels + grp * 8 + e] = sb[e];
            part_dgamma[(long)blockIdx.y * channels + grp * 8 + e] = sg[e];
        }
    }
}

// ---- the fused path (BIRDTRAIN_BN_FUSION): merges of per-tile partial records -------------
// With the fusion on, the batch statistics of a convolution's output come from the forward
// GEMM's epilogue (conv2.cu, EPI_STATS: per 128-row tile, each channel's mean and M2) and the
// backward sums Σg, Σg·x̂ from the dgrad GEMM's epilogue (EPI_BN_GRAD); where no fused GEMM
// applies, bn_stats_partial / bn_bwd_partial write records of the same form. The records are
// merged here in a fixed order (strided lanes and the fixed tree, as the finalize kernels
// above): no atomics, the same bits every run, whatever order the blocks ran in. Many records
// (one per tile of a large layer) are merged in two launches: groups of `per_group` records
// each, then the groups.
//
// The forward's merge ends in the layer's moments, f32 [3][C]: mean, M2 = Σ(x − mean)², and
// the row count. They are the one interface between the statistics and the normalisation:
// bn_moments_finalize turns them into the saved mean, 1/sqrt(var + eps) and the running
// statistics, so a cross-rank merge of moments (synchronised batch norm) fits in between.

// Rows of record b when record b holds rows [b·per, min(rows, (b + 1)·per)).
__device__ __forceinline__ float record_rows(int b, int rows, long per) {
    return (float)max(0L, min((long)rows, (b + 1) * per) - b * per);
}

// Block (32, FIN_Y), grid (ceil(C/32), groups): group g merges records
// [g·per_group, min(records, (g + 1)·per_group)) of (mean, M2) pairs (planes [records][C]),
// record b holding rows [b·rows_per_record, ...) of `rows`, into (mean, M2[, count]) at row g of
// the out planes (out_count may be null). Chan's combination in its two-pass form:
// mean = Σ n_b·mean_b / n, then M2 = Σ (M2_b + n_b·(mean_b − mean)²), every term ≥ 0.
extern "C" __global__ void bn_stats_merge(const float* __restrict__ part_mean,
                                          const float* __restrict__ part_m2, int records, int rows,
                                          int channels, long rows_per_record, int per_group,
                                          float* __restrict__ out_mean, float* __restrict__ out_m2,
                                          float* __restrict__ out_count) {
    __shared__ float s_sum[FIN_Y][32];
    const int ty = threadIdx.y;
    const int c = blockIdx.x * 32 + threadIdx.x;
    const bool live = c < channels;
    const int b0 = blockIdx.y * per_group, b1 = min(records, b0 + per_group);
    float n = 0.0f, sum = 0.0f;
    if (live) {
#pragma unroll 4
        for (int b = b0 + ty; b < b1; b += FIN_Y) {
            const float nb = record_rows(b, rows, rows_per_record);
            n += nb;
            sum = fmaf(nb, part_mean[(long)b * channels + c], sum);
        }
    }
    n = fin_lane_sum(n, s_sum);
    sum = fin_lane_sum(sum, s_sum);
    const float mean = n > 0.0f ? sum / n : 0.0f;
    float m2 = 0.0f;
    if (live) {
#pragma unroll 4
        for (int b = b0 + ty; b < b1; b += FIN_Y) {
            const float nb = record_rows(b, rows, rows_per_record);
            const float d = part_mean[(long)b * channels + c] - mean;
            m2 += fmaf(nb * d, d, part_m2[(long)b * channels + c]);
        }
    }
    m2 = fin_lane_sum(m2, s_sum);
    if (ty != 0 || !live) return;
    const long at = (long)blockIdx.y * channels + c;
    out_mean[at] = mean;
    out_m2[at] = m2;
    if (out_count != nullptr) out_count[at] = n;
}

// moments [3][C] (mean, M2, count) → the saved mean and 1/sqrt(var + eps) (biased variance)
// and, when running_mean is not null, the running statistics with the unbiased variance and
// `momentum`: bn_stats_finalize's formulas. One thread per channel, 128 per block.
extern "C" __global__ void bn_moments_finalize(const float* __restrict__ moments, int channels,
                                               float eps, float momentum,
                                               float* __restrict__ mean_out,
                                               float* __restrict__ invstd_out,
                                               float* __restrict__ running_mean,
                                               float* __restrict__ running_var) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    const float mean = moments[c], m2 = moments[channels + c], n = moments[2 * channels + c];
    const float var = n > 0.0f ? m2 / n : 0.0f;
    mean_out[c] = mean;
    invstd_out[c] = rsqrtf(var + eps);
    if (running_mean != nullptr) {
        const float unbiased = n > 1.0f ? m2 / (n - 1.0f) : var;
        running_mean[c] = (1.0f - momentum) * running_mean[c] + momentum * mean;
        running_var[c] = (1.0f - momentum) * running_var[c] + momentum * unbiased;
    }
}

// Block (32, FIN_Y), grid (ceil(C/32), groups): group g sums records
// [g·per_group, min(records, (g + 1)·per_group)) of the two planes (Σg, Σg·x̂: [records][C])
// into row g of out_b and out_g (strided lanes, then the fixed tree).
extern "C" __global__ void bn_sums_merge(const float* __restrict__ part_b,
                                         const float* __restrict__ part_g, int records,
                                         int channels, int per_group, float* __restrict__ out_b,
                                         float* __restrict__ out_g) {
    __shared__ float s_sum[FIN_Y][32];
    const int ty = threadIdx.y;
    const int c = blockIdx.x * 32 + threadIdx.x;
    const int b0 = blockIdx.y * per_group, b1 = min(records, b0 + per_group);
    float sb = 0.0f, sg = 0.0f;
    if (c < channels) {
#pragma unroll 4
        for (int b = b0 + ty; b < b1; b += FIN_Y) {
            sb += part_b[(long)b * channels + c];
            sg += part_g[(long)b * channels + c];
        }
    }
    sb = fin_lane_sum(sb, s_sum);
    sg = fin_lane_sum(sg, s_sum);
    if (ty != 0 || c >= channels) return;
    out_b[(long)blockIdx.y * channels + c] = sb;
    out_g[(long)blockIdx.y * channels + c] = sg;
}

// g[i] = [y[i] > 0]·(g[i] + residual[i]) in place (bf16 rounding of the sum first; residual
// and y may be null: no residual, no ReLU): what the fused dgrad epilogue does to dx, for a
// convolution no fused GEMM takes (v1 kernels). Grid-stride, 256 threads.
extern "C" __global__ void bn_grad_finish(bf16* __restrict__ g, const bf16* __restrict__ residual,
                                          const bf16* __restrict__ y, long total) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        float v = bt_to_f32(g[i]);
        if (residual != nullptr) v = bt_to_f32(bt_to_bf16(v + bt_to_f32(residual[i])));
        if (y != nullptr && !(bt_to_f32(y[i]) > 0.0f)) v = 0.0f;
        g[i] = bt_to_bf16(v);
    }
}
