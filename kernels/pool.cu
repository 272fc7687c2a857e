// pool.cu: max pooling and global average pooling, forward and backward.
//
// Algorithm. Max pool (ResNet's 3×3, stride 2, padding 1 stem pool; any square window): the
// forward takes the maximum over the window clipped to the image (padding never wins). The
// backward is a gather, not a scatter: every input pixel re-scans the (at most
// ceil(win/stride)² ) windows that cover it, finds each window's first maximum in row-major
// order (the CPU reference's tie rule) and sums the gradients of the windows it wins. No
// atomics, no saved indices, deterministic. Global average pool: forward averages each channel
// over H·W (f32 accumulation); backward spreads dy/(H·W) back.
//
// Data layout. x, dx: NHWC bf16 [N,H,W,C]; y, dy: NHWC bf16 [N,P,Q,C]; GAP: x [N,HW,C] → y [N,C].
// Every backward can add into its destination (`accumulate` = 1) or overwrite it.
//
// 16-byte variants (C % 8 == 0, every ResNet stem): a thread owns 8 consecutive channels and
// moves them as one uint4 (same tie rule, same f32 sums in the same order: bit-identical to the
// scalar kernels). maxpool_fwd_vec: one thread per (output pixel, channel group).
// maxpool_bwd_vec computes every window's argmax once instead of once per covered pixel. An
// output (op, oq) owns the input cell [op·stride − pad, +stride) × [oq·stride − pad, +stride)
// (the last output row / column also owns the input tail after it); with win ≤ 2·stride
// (ResNet's 3×3/2; the host falls back to maxpool_bwd otherwise) only windows op−1..op ×
// oq−1..oq cover that cell. A block takes a tile of 7×7 outputs × 8 channel groups: phase 1
// scans the tile's windows plus the halo row / column before it (8×8 windows) and keeps each
// window's argmax (a byte per channel: win ≤ 15) and dy in shared memory; phase 2 writes every
// owned pixel: the old dx (accumulate) plus the dy of each covering window it wins, windows in
// (op, oq) order. ~1.3 window scans per output instead of 9 per 4 pixels (the scalar gather's
// 2.25 per pixel), and 16-byte loads instead of 2-byte ones.
// The maxpool_bn_* kernels (batch norm fused, ResNet's stem; the section at the end) are these
// max pools over the batch norm's output of their input, computed per element as they read it
// (bn_apply's arithmetic, so the bits of the separate passes), the backward ending in the batch
// norm's ReLU mask: the batch norm's output is never written.
//
// Launch configuration. One thread per output element (max pool forward, GAP backward) or per
// input element (max pool backward), 256 threads, grid-stride loops. maxpool_fwd_vec: one thread
// per (output pixel, 8-channel group), 256 threads; maxpool_bwd_vec: 256 threads per block, one
// block per tile (grid-stride over N·⌈P/7⌉·⌈Q/7⌉·⌈C/64⌉ tiles). GAP forward: one thread per
// (n, c) pair, a warp on consecutive channels so each step of the H·W loop reads 64 bytes.
#include "common.cuh"

// The batch norm a fused max pool applies to its input (maxpool_bn_*; see the end of this
// file): its saved statistics and affine parameters, channel-indexed.
struct PoolBn {
    const float* mean;
    const float* invstd;
    const bf16* gamma;
    const bf16* beta;
    int relu;
};

// bn_apply's value of z in a channel (mean, invstd, gamma, beta of that channel), the same
// expression term for term, rounded to bf16 and widened back: what the unfused y holds.
__device__ __forceinline__ float pool_bn_value(float z, float mean, float invstd, float gamma,
                                               float beta, int relu) {
    float v = (z - mean) * invstd * gamma + beta;
    if (relu) v = fmaxf(v, 0.0f);
    return bt_to_f32(bt_to_bf16(v));
}

// Element (b, ih, iw, ch) of the pool's input as the scan sees it: x itself, or with BN the
// batch norm's output of it.
template <bool BN>
__device__ __forceinline__ float pool_value(const bf16* x, long at, int ch, const PoolBn* bn) {
    const float v = bt_to_f32(x[at]);
    if (!BN) return v;
    return pool_bn_value(v, bn->mean[ch], bn->invstd[ch], bt_to_f32(bn->gamma[ch]),
                         bt_to_f32(bn->beta[ch]), bn->relu);
}

// First maximum (row-major) of window (op, oq), as r·win + s.
template <bool BN>
__device__ __forceinline__ int window_argmax(const bf16* x, int b, int h, int w, int c, int ch,
                                             int op, int oq, int win, int stride, int pad,
                                             const PoolBn* bn) {
    float best = BT_NEG_INF;
    int best_at = -1;
    for (int r = 0; r < win; ++r) {
        const int ih = op * stride - pad + r;
        if (ih < 0 || ih >= h) continue;
        for (int s = 0; s < win; ++s) {
            const int iw = oq * stride - pad + s;
            if (iw < 0 || iw >= w) continue;
            const float v = pool_value<BN>(x, (((long)b * h + ih) * w + iw) * c + ch, ch, bn);
            if (best_at < 0 || v > best) { best = v; best_at = r * win + s; }
        }
    }
    return best_at;
}

// Output element i of the scalar forward: the window's first maximum as the scan sees it (x,
// or with BN the batch norm's output of it).
template <bool BN>
__device__ __forceinline__ void maxpool_fwd1(const bf16* x, bf16* y, long i, int h, int w, int c,
                                             int p, int q, int win, int stride, int pad,
                                             const PoolBn* bn) {
    const int ch = (int)(i % c);
    long rest = i / c;
    const int oq = (int)(rest % q); rest /= q;
    const int op = (int)(rest % p);
    const int b = (int)(rest / p);
    const int at = window_argmax<BN>(x, b, h, w, c, ch, op, oq, win, stride, pad, bn);
    const int ih = op * stride - pad + at / win, iw = oq * stride - pad + at % win;
    const long from = (((long)b * h + ih) * w + iw) * c + ch;
    y[i] = BN ? bt_to_bf16(pool_value<true>(x, from, ch, bn)) : x[from];
}

// Input element i of the scalar backward: `acc` plus, in window order, the gradient of every
// window whose first maximum it is.
template <bool BN>
__device__ __forceinline__ float maxpool_gather1(const bf16* x, const bf16* dy, long i, int h, int w,
                                                 int c, int p, int q, int win, int stride, int pad,
                                                 const PoolBn* bn, float acc) {
    const int ch = (int)(i % c);
    long rest = i / c;
    const int iw = (int)(rest % w); rest /= w;
    const int ih = (int)(rest % h);
    const int b = (int)(rest / h);
    // Windows covering ih: op·stride − pad ≤ ih ≤ op·stride − pad + win − 1.
    const int p_lo = max(0, (ih + pad - win + stride) / stride), p_hi = min(p - 1, (ih + pad) / stride);
    const int q_lo = max(0, (iw + pad - win + stride) / stride), q_hi = min(q - 1, (iw + pad) / stride);
    for (int op = p_lo; op <= p_hi; ++op) {
        const int r = ih - (op * stride - pad);
        if (r < 0 || r >= win) continue;
        for (int oq = q_lo; oq <= q_hi; ++oq) {
            const int s = iw - (oq * stride - pad);
            if (s < 0 || s >= win) continue;
            if (window_argmax<BN>(x, b, h, w, c, ch, op, oq, win, stride, pad, bn) == r * win + s)
                acc += bt_to_f32(dy[(((long)b * p + op) * q + oq) * c + ch]);
        }
    }
    return acc;
}

extern "C" __global__ void maxpool_fwd(const bf16* __restrict__ x, bf16* __restrict__ y, int n,
                                       int h, int w, int c, int p, int q, int win, int stride,
                                       int pad) {
    const long total = (long)n * p * q * c;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x)
        maxpool_fwd1<false>(x, y, i, h, w, c, p, q, win, stride, pad, nullptr);
}

extern "C" __global__ void maxpool_bwd(const bf16* __restrict__ x, const bf16* __restrict__ dy,
                                       bf16* __restrict__ dx, int n, int h, int w, int c, int p,
                                       int q, int win, int stride, int pad, int accumulate) {
    const long total = (long)n * h * w * c;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const float acc = accumulate ? bt_to_f32(dx[i]) : 0.0f;
        dx[i] = bt_to_bf16(maxpool_gather1<false>(x, dy, i, h, w, c, p, q, win, stride, pad, nullptr, acc));
    }
}

// ---- 16-byte variants (C % 8 == 0) ----------------------------------------------------------

// The 8 bf16 of a 16-byte load as f32 bit patterns (exact): element e of word e / 2, the low
// half for even e, the high half for odd e.
__device__ __forceinline__ void pool_split8(uint4 v, unsigned* f) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) { f[2 * j] = w[j] << 16; f[2 * j + 1] = w[j] & 0xffff0000u; }
}

__device__ __forceinline__ uint4 pool_load16(const bf16* p) { return *reinterpret_cast<const uint4*>(p); }

// One element of the scan: position `pos` with f32 bits `v` takes over where strictly greater.
__device__ __forceinline__ void pool_take8(const unsigned* v, int pos, unsigned* best, int* at) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const bool wins = __uint_as_float(v[e]) > __uint_as_float(best[e]);
        best[e] = wins ? v[e] : best[e];
        at[e] = wins ? pos : at[e];
    }
}

// A fused pool's batch-norm parameters for 8 consecutive channels, in registers.
struct PoolBn8 {
    float mean[8], invstd[8], gamma[8], beta[8];
    int relu;
};

__device__ __forceinline__ void pool_bn_load8(PoolBn8& p, const PoolBn& bn, int ch0) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        p.mean[e] = bn.mean[ch0 + e];
        p.invstd[e] = bn.invstd[ch0 + e];
        p.gamma[e] = bt_to_f32(bn.gamma[ch0 + e]);
        p.beta[e] = bt_to_f32(bn.beta[ch0 + e]);
    }
    p.relu = bn.relu;
}

// The 8 f32 bit patterns of pool_split8 replaced by their batch norm's output (bf16-exact).
__device__ __forceinline__ void pool_bn8(unsigned* v, const PoolBn8& p) {
#pragma unroll
    for (int e = 0; e < 8; ++e)
        v[e] = __float_as_uint(pool_bn_value(__uint_as_float(v[e]), p.mean[e], p.invstd[e], p.gamma[e], p.beta[e], p.relu));
}

// First maximum (row-major, strict >) of window (op, oq) for channels ch0..ch0+7: `best` its f32
// bits, `at` its position r·win + s, window_argmax's rule: the clipped window's first element
// starts the scan, so padding never wins and a NaN there stays. WIN > 0 (the window size at
// compile time) gives windows inside the image a straight-line path, all loads issued first;
// border windows and WIN = 0 (any size) take the loop. BN: the scan runs over the batch norm's
// output of x (`bn`, these 8 channels), each value as the separate bn_apply pass writes it.
template <int WIN, bool BN>
__device__ __forceinline__ void window_argmax8(const bf16* x, int b, int h, int w, int c, int ch0,
                                               int op, int oq, int win, int stride, int pad,
                                               const PoolBn8* bn, unsigned* best, int* at) {
    const int wn = WIN > 0 ? WIN : win;
    const int ih0 = op * stride - pad, iw0 = oq * stride - pad;
    const int r_lo = max(0, -ih0), r_hi = min(wn, h - ih0);
    const int s_lo = max(0, -iw0), s_hi = min(wn, w - iw0);
    const int rs = w * c;  // element (r, s) sits at first + (r − r_lo)·rs + (s − s_lo)·c
    const bf16* first = x + (((long)b * h + ih0 + r_lo) * w + iw0 + s_lo) * c + ch0;
    pool_split8(pool_load16(first), best);
    if (BN) pool_bn8(best, *bn);
#pragma unroll
    for (int e = 0; e < 8; ++e) at[e] = r_lo * wn + s_lo;
    if (WIN > 0 && r_lo == 0 && s_lo == 0 && r_hi == WIN && s_hi == WIN) {
        uint4 raw[WIN > 0 ? WIN * WIN : 1];
#pragma unroll
        for (int j = 1; j < WIN * WIN; ++j) raw[j] = pool_load16(first + (j / wn) * rs + (j % wn) * c);
#pragma unroll
        for (int j = 1; j < WIN * WIN; ++j) {
            unsigned v[8];
            pool_split8(raw[j], v);
            if (BN) pool_bn8(v, *bn);
            pool_take8(v, j, best, at);
        }
        return;
    }
    for (int r = r_lo; r < r_hi; ++r) {
        for (int s = s_lo; s < s_hi; ++s) {
            unsigned v[8];
            pool_split8(pool_load16(first + (r - r_lo) * rs + (s - s_lo) * c), v);
            if (BN) pool_bn8(v, *bn);
            pool_take8(v, r * wn + s, best, at);  // the first element against itself: no change
        }
    }
}

// One (output pixel, channel group) `i` of maxpool_fwd_vec (BN: maxpool_bn_fwd_vec, `bn` its
// batch norm).
template <int WIN, bool BN>
__device__ __forceinline__ void maxpool_fwd8(const bf16* x, bf16* y, long i, int h, int w, int c,
                                             int p, int q, int win, int stride, int pad,
                                             const PoolBn* bn) {
    const int groups = c / 8;
    const int g = (int)(i % groups);
    long rest = i / groups;
    const int oq = (int)(rest % q); rest /= q;
    const int op = (int)(rest % p);
    const int b = (int)(rest / p);
    unsigned best[8];
    int at[8];
    PoolBn8 p8;
    if (BN) pool_bn_load8(p8, *bn, g * 8);
    window_argmax8<WIN, BN>(x, b, h, w, c, g * 8, op, oq, win, stride, pad, &p8, best, at);
    *reinterpret_cast<uint4*>(y + i * 8) =
        make_uint4((best[0] >> 16) | best[1], (best[2] >> 16) | best[3], (best[4] >> 16) | best[5],
                   (best[6] >> 16) | best[7]);
}

extern "C" __global__ void maxpool_fwd_vec(const bf16* __restrict__ x, bf16* __restrict__ y, int n,
                                           int h, int w, int c, int p, int q, int win, int stride,
                                           int pad) {
    const long total = (long)n * p * q * (c / 8);
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        if (win == 3) maxpool_fwd8<3, false>(x, y, i, h, w, c, p, q, win, stride, pad, nullptr);
        else maxpool_fwd8<0, false>(x, y, i, h, w, c, p, q, win, stride, pad, nullptr);
    }
}

// maxpool_bwd_vec tiles: POOL_TP × POOL_TQ outputs × POOL_GB channel groups per block and step.
#define POOL_TP 7
#define POOL_TQ 7
#define POOL_GB 8

// Phase 1 of a tile: the argmax (one byte per channel, 0xff: no window) and dy of window
// (p0 − 1 + wr, q0 − 1 + wc), group g0 + gl, into shared memory (BN: over the batch norm's
// output of x).
template <int WIN, bool BN>
__device__ __forceinline__ void maxpool_bwd_windows(const bf16* x, const bf16* dy, int b, int p0,
                                                    int q0, int g0, int h, int w, int c, int p,
                                                    int q, int win, int stride, int pad,
                                                    const PoolBn* bn,
                                                    unsigned (*s_at)[POOL_TQ + 1][POOL_GB][2],
                                                    uint4 (*s_dy)[POOL_TQ + 1][POOL_GB]) {
    const int groups = c / 8, halo = (win - 1) / stride;  // halo: 0 or 1 window before the tile
    for (int it = threadIdx.x; it < (POOL_TP + 1) * (POOL_TQ + 1) * POOL_GB; it += blockDim.x) {
        const int gl = it % POOL_GB, wc = it / POOL_GB % (POOL_TQ + 1), wr = it / (POOL_GB * (POOL_TQ + 1));
        const int wp = p0 - 1 + wr, wq = q0 - 1 + wc, g = g0 + gl;
        unsigned a0 = 0xffffffffu, a1 = 0xffffffffu;
        uint4 d = make_uint4(0u, 0u, 0u, 0u);
        if (wp >= 0 && wq >= 0 && wp < p && wq < q && g < groups && wr + halo > 0 && wc + halo > 0) {
            unsigned best[8];
            int at[8];
            PoolBn8 p8;
            if (BN) pool_bn_load8(p8, *bn, g * 8);
            window_argmax8<WIN, BN>(x, b, h, w, c, g * 8, wp, wq, win, stride, pad, &p8, best, at);
            a0 = (unsigned)at[0] | (unsigned)at[1] << 8 | (unsigned)at[2] << 16 | (unsigned)at[3] << 24;
            a1 = (unsigned)at[4] | (unsigned)at[5] << 8 | (unsigned)at[6] << 16 | (unsigned)at[7] << 24;
            d = pool_load16(dy + (((long)b * p + wp) * q + wq) * c + g * 8);
        }
        s_at[wr][wc][gl][0] = a0;
        s_at[wr][wc][gl][1] = a1;
        s_dy[wr][wc][gl] = d;
    }
}

// The tiles of maxpool_bwd_vec (BN: maxpool_bn_bwd_vec, whose dx is the batch norm's g: the
// ReLU's mask at the pixel itself applied to the sum, never accumulated; and each tile's Σg,
// Σg·x̂ per channel over the pixels it owns, g as stored, into record
// (b·tiles_p + tp)·tiles_q + tq of part_b, part_g [records][C]: a thread's 8 channels
// (its group is threadIdx.x % POOL_GB on every pass, 256 being a multiple of POOL_GB) summed
// in registers, then the 32 threads of a group in a fixed order in shared memory. 256 threads.)
template <bool BN>
__device__ __forceinline__ void maxpool_bwd_tiles(const bf16* __restrict__ x, const bf16* __restrict__ dy,
                                                  bf16* __restrict__ dx, int n, int h, int w, int c,
                                                  int p, int q, int win,
                                                  int stride, int pad, int accumulate,
                                                  const PoolBn* bn, float* __restrict__ part_b,
                                                  float* __restrict__ part_g) {
    __shared__ unsigned s_at[POOL_TP + 1][POOL_TQ + 1][POOL_GB][2];
    __shared__ uint4 s_dy[POOL_TP + 1][POOL_TQ + 1][POOL_GB];
    __shared__ float s_sum[BN ? 2 : 1][BN ? 256 / POOL_GB : 1][BN ? POOL_GB * 8 : 1];
    const int groups = c / 8;
    const int tiles_q = (q + POOL_TQ - 1) / POOL_TQ, tiles_p = (p + POOL_TP - 1) / POOL_TP;
    const int chunks = (groups + POOL_GB - 1) / POOL_GB;
    const long tiles = (long)n * tiles_p * tiles_q * chunks;
    for (long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int gc = (int)(tile % chunks);
        long rest = tile / chunks;
        const int tq = (int)(rest % tiles_q); rest /= tiles_q;
        const int tp = (int)(rest % tiles_p);
        const int b = (int)(rest / tiles_p);
        const int p0 = tp * POOL_TP, q0 = tq * POOL_TQ, g0 = gc * POOL_GB;
        if (win == 3) maxpool_bwd_windows<3, BN>(x, dy, b, p0, q0, g0, h, w, c, p, q, win, stride, pad, bn, s_at, s_dy);
        else maxpool_bwd_windows<0, BN>(x, dy, b, p0, q0, g0, h, w, c, p, q, win, stride, pad, bn, s_at, s_dy);
        __syncthreads();
        // Phase 2: output (op, oq) owns its input cell and reads windows op − 1 + kp, oq − 1 + kq
        // (kp, kq ∈ {0, 1}) from shared memory at [tr + kp][tc + kq].
        float sb[8], sg[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) sb[e] = sg[e] = 0.0f;
        for (int it = threadIdx.x; it < POOL_TP * POOL_TQ * POOL_GB; it += blockDim.x) {
            const int gl = it % POOL_GB, tc = it / POOL_GB % POOL_TQ, tr = it / (POOL_GB * POOL_TQ);
            const int op = p0 + tr, oq = q0 + tc, g = g0 + gl;
            if (op >= p || oq >= q || g >= groups) continue;
            // The owned cell, clipped to the image; the last output row / column owns the tail.
            const int ih_lo = max(0, op * stride - pad), iw_lo = max(0, oq * stride - pad);
            const int ih_hi = op == p - 1 ? h : min(h, op * stride - pad + stride);
            const int iw_hi = oq == q - 1 ? w : min(w, oq * stride - pad + stride);
            PoolBn8 p8;
            if (BN) pool_bn_load8(p8, *bn, g * 8);
            for (int ih = ih_lo; ih < ih_hi; ++ih) {
                for (int iw = iw_lo; iw < iw_hi; ++iw) {
                    bf16* dst = dx + (((long)b * h + ih) * w + iw) * c + g * 8;
                    float acc[8];
                    if (accumulate) {
                        unsigned old[8];
                        pool_split8(pool_load16(dst), old);
#pragma unroll
                        for (int e = 0; e < 8; ++e) acc[e] = __uint_as_float(old[e]);
                    } else {
#pragma unroll
                        for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
                    }
#pragma unroll
                    for (int kp = 0; kp < 2; ++kp) {
                        const int r = ih - ((op - 1 + kp) * stride - pad);
#pragma unroll
                        for (int kq = 0; kq < 2; ++kq) {
                            const int s = iw - ((oq - 1 + kq) * stride - pad);
                            if (r < 0 || r >= win || s < 0 || s >= win) continue;
                            const unsigned pos4 = (unsigned)(r * win + s) * 0x01010101u;  // every byte
                            const unsigned a[2] = {s_at[tr + kp][tc + kq][gl][0], s_at[tr + kp][tc + kq][gl][1]};
                            unsigned d[8];
                            pool_split8(s_dy[tr + kp][tc + kq][gl], d);
#pragma unroll
                            for (int e = 0; e < 8; ++e)
                                if (((a[e / 4] ^ pos4) & (0xffu << 8 * (e % 4))) == 0u) acc[e] += __uint_as_float(d[e]);
                        }
                    }
                    unsigned zb[8];
                    if (BN) pool_split8(pool_load16(x + (((long)b * h + ih) * w + iw) * c + g * 8), zb);
                    if (BN && p8.relu) {
                        // The mask: [bn(x) > 0] at this pixel, as bn_bwd_apply reads it from y.
                        unsigned t[8];
#pragma unroll
                        for (int e = 0; e < 8; ++e) t[e] = zb[e];
                        pool_bn8(t, p8);
#pragma unroll
                        for (int e = 0; e < 8; ++e)
                            if (!(__uint_as_float(t[e]) > 0.0f)) acc[e] = 0.0f;
                    }
                    union { uint4 v; bf16 e[8]; } out;
#pragma unroll
                    for (int e = 0; e < 8; ++e) out.e[e] = bt_to_bf16(acc[e]);
                    *reinterpret_cast<uint4*>(dst) = out.v;
                    if (BN) {
#pragma unroll
                        for (int e = 0; e < 8; ++e) {
                            const float gv = bt_to_f32(out.e[e]);
                            sb[e] += gv;
                            sg[e] += gv * (__uint_as_float(zb[e]) - p8.mean[e]) * p8.invstd[e];
                        }
                    }
                }
            }
        }
        if (BN) {
            // The tile's record: lane l = threadIdx.x / POOL_GB of group gl, then lanes summed in order.
            const int lane = threadIdx.x / POOL_GB, gl = threadIdx.x % POOL_GB;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                s_sum[0][lane][gl * 8 + e] = sb[e];
                s_sum[1][lane][gl * 8 + e] = sg[e];
            }
            __syncthreads();
            if (threadIdx.x < 2 * POOL_GB * 8) {
                const int which = threadIdx.x / (POOL_GB * 8), slot = threadIdx.x % (POOL_GB * 8);
                float total = 0.0f;
                for (int l = 0; l < 256 / POOL_GB; ++l) total += s_sum[which][l][slot];
                const int ch = g0 * 8 + slot;
                const long record = ((long)b * tiles_p + tp) * tiles_q + tq;
                if (ch < c) (which ? part_g : part_b)[record * c + ch] = total;
            }
        }
        __syncthreads();
    }
}

extern "C" __global__ void maxpool_bwd_vec(const bf16* __restrict__ x, const bf16* __restrict__ dy,
                                           bf16* __restrict__ dx, int n, int h, int w, int c, int p,
                                           int q, int win, int stride, int pad, int accumulate) {
    maxpool_bwd_tiles<false>(x, dy, dx, n, h, w, c, p, q, win, stride, pad, accumulate, nullptr, nullptr,
                             nullptr);
}

// ---- the max pool that applies the batch norm before it (maxpool_bn_*) -----------------------
// With batch norm fused (BIRDTRAIN_BN_FUSION), the stem's batch norm output y = ReLU(BN(z)) is
// never written: the pool reads z and applies the batch norm to every element it scans, with
// bn_apply's arithmetic term for term (pool_bn_value, rounded to bf16), so the scans compare
// exactly the values the separate y would hold: the same maxima, the same argmax (first
// maximum, strict >), the same bits. Padding is skipped as before (it never becomes a
// transformed zero, which would win where every value is negative without a ReLU). Every
// element is transformed, not just each window's largest or smallest z: a few FMAs per load in
// a memory-bound kernel, and no argument about the sign of γ or ties made by the rounding.
// The backward is maxpool_bwd(_vec)'s gather over the transformed windows; the pixel's own
// transformed value gives the ReLU's mask, so the output is the batch norm's finished incoming
// gradient g = [y > 0]·Σ dy (overwritten: the pool is y's only reader). maxpool_bn_bwd_vec
// also reduces Σg and Σg·x̂ per tile into records that bn_sums_merge sums in a fixed order (g
// and z are not read again); after the scalar maxpool_bn_bwd the host reduces them with
// bn_bwd_partial (mask off). The batch norm's backward is then its prepared apply pass.
// z, y, dy, g: NHWC bf16 as x, y, dy, dx above; mean, invstd: f32 [C]; gamma, beta: bf16 [C].
// Launch configuration: that of the unfused kernel of the same name without `_bn`.

extern "C" __global__ void maxpool_bn_fwd(const bf16* __restrict__ z, const float* __restrict__ mean,
                                          const float* __restrict__ invstd, const bf16* __restrict__ gamma,
                                          const bf16* __restrict__ beta, int relu, bf16* __restrict__ y,
                                          int n, int h, int w, int c, int p, int q, int win,
                                          int stride, int pad) {
    const PoolBn bn{mean, invstd, gamma, beta, relu};
    const long total = (long)n * p * q * c;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x)
        maxpool_fwd1<true>(z, y, i, h, w, c, p, q, win, stride, pad, &bn);
}

extern "C" __global__ void maxpool_bn_bwd(const bf16* __restrict__ z, const float* __restrict__ mean,
                                          const float* __restrict__ invstd, const bf16* __restrict__ gamma,
                                          const bf16* __restrict__ beta, int relu,
                                          const bf16* __restrict__ dy, bf16* __restrict__ g, int n,
                                          int h, int w, int c, int p, int q, int win, int stride,
                                          int pad) {
    const PoolBn bn{mean, invstd, gamma, beta, relu};
    const long total = (long)n * h * w * c;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        float acc = maxpool_gather1<true>(z, dy, i, h, w, c, p, q, win, stride, pad, &bn, 0.0f);
        if (relu && !(pool_value<true>(z, i, (int)(i % c), &bn) > 0.0f)) acc = 0.0f;
        g[i] = bt_to_bf16(acc);
    }
}

extern "C" __global__ void maxpool_bn_fwd_vec(const bf16* __restrict__ z, const float* __restrict__ mean,
                                              const float* __restrict__ invstd, const bf16* __restrict__ gamma,
                                              const bf16* __restrict__ beta, int relu, bf16* __restrict__ y,
                                              int n, int h, int w, int c, int p, int q, int win,
                                              int stride, int pad) {
    const PoolBn bn{mean, invstd, gamma, beta, relu};
    const long total = (long)n * p * q * (c / 8);
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        if (win == 3) maxpool_fwd8<3, true>(z, y, i, h, w, c, p, q, win, stride, pad, &bn);
        else maxpool_fwd8<0, true>(z, y, i, h, w, c, p, q, win, stride, pad, &bn);
    }
}

// Also each tile's Σg, Σg·x̂ (see maxpool_bwd_tiles): part_b, part_g [N·⌈P/7⌉·⌈Q/7⌉][C].
extern "C" __global__ void maxpool_bn_bwd_vec(const bf16* __restrict__ z, const float* __restrict__ mean,
                                              const float* __restrict__ invstd, const bf16* __restrict__ gamma,
                                              const bf16* __restrict__ beta, int relu,
                                              const bf16* __restrict__ dy, bf16* __restrict__ g, int n,
                                              int h, int w, int c, int p, int q, int win, int stride,
                                              int pad, float* __restrict__ part_b,
                                              float* __restrict__ part_g) {
    const PoolBn bn{mean, invstd, gamma, beta, relu};
    maxpool_bwd_tiles<true>(z, dy, g, n, h, w, c, p, q, win, stride, pad, 0, &bn, part_b, part_g);
}

extern "C" __global__ void gap_fwd(const bf16* __restrict__ x, bf16* __restrict__ y, int n, int hw,
                                   int c) {
    const long total = (long)n * c;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const int ch = (int)(i % c);
        const long b = i / c;
        const bf16* base = x + b * hw * c + ch;
        float acc = 0.0f;
        for (int j = 0; j < hw; ++j) acc += bt_to_f32(base[(long)j * c]);
        y[i] = bt_to_bf16(acc / (float)hw);
    }
}

extern "C" __global__ void gap_bwd(const bf16* __restrict__ dy, bf16* __restrict__ dx, int n, int hw,
                                   int c, int accumulate) {
    const long total = (long)n * hw * c;
    const float scale = 1.0f / (float)hw;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const int ch = (int)(i % c);
        const long b = i / ((long)hw * c);
        const float v = bt_to_f32(dy[b * c + ch]) * scale;
        dx[i] = bt_to_bf16(accumulate ? v + bt_to_f32(dx[i]) : v);
    }
}
