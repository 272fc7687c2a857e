// conv.cu: 2-D convolution forward, data gradient and weight gradient as implicit GEMMs on the
// tensor cores (bf16 inputs, f32 accumulation).
//
// Algorithm. No im2col buffer is materialised: each kernel is a tiled GEMM C = A·B whose
// operand tiles are gathered straight from the NHWC activations while they are loaded into
// shared memory ("implicit GEMM"). The three passes are three views of one GEMM:
//   forward  y[m][k]  = sum_(r,s,c) x[n, p*st-pad+r, q*st-pad+s, c] · w[k][r][s][c]
//            M = N·P·Q output pixels, N = K output channels, Kd = R·S·C
//   dgrad    dx[m][c] = sum_(r,s,k) dy[n, p, q, k] · w[k][r][s][c]  with p·st = h+pad-r
//            M = N·H·W input pixels, N = C input channels, Kd = R·S·K (taps with a
//            fractional or out-of-range p or q contribute zero)
//   wgrad    dw[k][(r,s,c)] = sum_(n,p,q) dy[n,p,q,k] · x[n, p*st-pad+r, q*st-pad+s, c]
//            M = K, N = R·S·C, Kd = N·P·Q, split over gridDim.z with f32 atomics (the
//            reduction dimension is huge, the output small).
// A 1×1 stride-1 convolution degenerates into a plain GEMM over the NHWC matrix: the gather
// becomes a contiguous row read, so 1×1 layers need no separate kernel.
//
// Data layout. x, y, dx, dy: NHWC bf16. w: KRSC bf16 (one output channel's filter is one
// contiguous row). dw: KRSC f32, accumulated into (+=): the caller zeroes the gradient buffer
// once per step. dgrad can also accumulate into dx (bf16) when a tensor feeds two branches.
//
// Launch configuration. Seven kernels: {fwd, dgrad, wgrad} × {vec, scalar}, plus wgrad_stem.
// 256 threads (8 warps, 2 along M × 4 along N), block tile BM×BN×BK = 128×128×32; each warp
// owns a 64×32 sub-tile = 4×4 tiles of the m16n8k16 bf16 `mma.sync` instruction (inline PTX:
// NVRTC without the nvcc headers has no <mma.h>). grid = (ceil(M/128), ceil(N/128), splits),
// splits = 1 except for wgrad. Operand tiles are 512 chunks of 8 consecutive bf16 (16 bytes):
// every thread loads 2 chunks of A and 2 of B per BK step into registers while the tensor cores
// work on the previous tile (register double buffering); fragments come out of shared memory
// with ldmatrix.x4 (.trans for tiles stored reduction-outer; the +8-element row padding keeps
// both layouts free of bank conflicts). The *_vec kernels need C % 8 == 0
// (and K % 8 == 0 for dgrad and wgrad: every ResNet layer but the 3-channel stem); the others
// gather element by element (the stem's forward with two divisions per element).
#include "common.cuh"

// Shape of one convolution; mirrors `ConvArgs` in src/cuda/backend.rs (repr(C), 13 ints).
struct ConvShape {
    int n, h, w, c;   // input batch, height, width, channels
    int k, r, s;      // output channels, filter height, filter width
    int p, q;         // output height, width
    int stride, pad;  // same in both spatial dimensions
    int k_chunk;      // wgrad: reduction length per gridDim.z slice
    int accumulate;   // dgrad: add into dx instead of overwriting
};

#define BM 128
#define BN 128
#define BK 32
#define THREADS 256
#define LD_MK (BK + 8)   // leading dimension of a tile stored with the reduction dim inner
#define LD_KM (BM + 8)   // leading dimension of a tile stored with the reduction dim outer

enum { MODE_FWD = 0, MODE_DGRAD = 1, MODE_WGRAD = 2 };


__device__ __forceinline__ uint4 zero4() { return make_uint4(0u, 0u, 0u, 0u); }

// ---- element gathers (scalar path and address of a vector chunk) -------------------------

// Forward A[m][kk]: input pixel for output pixel m and filter tap kk = (r, s, c).
__device__ __forceinline__ long fwd_a_index(const ConvShape& sh, int m, int kk) {
    const int c = kk % sh.c, rs = kk / sh.c, r = rs / sh.s, s = rs % sh.s;
    const int q = m % sh.q, np = m / sh.q, p = np % sh.p, n = np / sh.p;
    const int h = p * sh.stride - sh.pad + r, w = q * sh.stride - sh.pad + s;
    if (h < 0 || h >= sh.h || w < 0 || w >= sh.w) return -1;
    return (((long)n * sh.h + h) * sh.w + w) * sh.c + c;
}

// Dgrad A[m][kk]: output-gradient element feeding input pixel m through tap kk = (r, s, k).
__device__ __forceinline__ long dgrad_a_index(const ConvShape& sh, int m, int kk) {
    const int k = kk % sh.k, rs = kk / sh.k, r = rs / sh.s, s = rs % sh.s;
    const int w = m % sh.w, nh = m / sh.w, h = nh % sh.h, n = nh / sh.h;
    const int ph = h + sh.pad - r, qw = w + sh.pad - s;
    if (ph < 0 || qw < 0 || ph % sh.stride != 0 || qw % sh.stride != 0) return -1;
    const int p = ph / sh.stride, q = qw / sh.stride;
    if (p >= sh.p || q >= sh.q) return -1;
    return (((long)n * sh.p + p) * sh.q + q) * sh.k + k;
}

// Dgrad B[kk][c] = w[k][r][s][c] with kk = (r, s, k).
__device__ __forceinline__ long dgrad_b_index(const ConvShape& sh, int kk, int c) {
    const int k = kk % sh.k, rs = kk / sh.k;
    return ((long)k * sh.r * sh.s + rs) * sh.c + c;
}

// Wgrad B[pix][(r,s,c)]: input pixel under output pixel `pix` and tap (r, s, c).
__device__ __forceinline__ long wgrad_b_index(const ConvShape& sh, int pix, int rsc) {
    return fwd_a_index(sh, pix, rsc);
}

template <int MODE>
__device__ __forceinline__ bf16 load_a_scalar(const bf16* a, const ConvShape& sh, int row, int col,
                                              int M, int KD) {
    // row/col in GEMM coordinates: row = m, col = kk.
    if (row >= M || col >= KD) return bt_to_bf16(0.0f);
    long idx;
    if (MODE == MODE_FWD) idx = fwd_a_index(sh, row, col);
    else if (MODE == MODE_DGRAD) idx = dgrad_a_index(sh, row, col);
    else idx = (long)col * sh.k + row;  // wgrad: A[m=k][kk=pix] = dy[pix][k]
    return idx < 0 ? bt_to_bf16(0.0f) : a[idx];
}

template <int MODE>
__device__ __forceinline__ bf16 load_b_scalar(const bf16* b, const ConvShape& sh, int kk, int col,
                                              int N, int KD) {
    if (kk >= KD || col >= N) return bt_to_bf16(0.0f);
    long idx;
    if (MODE == MODE_FWD) idx = (long)col * KD + kk;  // w[k=col][kk]
    else if (MODE == MODE_DGRAD) idx = dgrad_b_index(sh, kk, col);
    else idx = wgrad_b_index(sh, kk, col);
    return idx < 0 ? bt_to_bf16(0.0f) : b[idx];
}

// Loads the 8-element chunk starting at (outer, inner) of an operand tile, where `inner` is
// the operand's contiguous dimension. Returns zeros outside the tensor.
template <int MODE, bool IS_A, bool VEC>
__device__ __forceinline__ uint4 load_chunk(const bf16* ptr, const ConvShape& sh, int outer,
                                            int inner, int M, int N, int KD) {
    // Map (outer, inner) back to GEMM (row, col) of the operand.
    // A: FWD/DGRAD store m-major (outer = m, inner = kk); WGRAD stores kk-major (outer = kk,
    //    inner = m). B: FWD stores n-major (outer = n, inner = kk); DGRAD/WGRAD kk-major.
    if (VEC) {
        long idx = -1;
        if (IS_A) {
            if (MODE == MODE_FWD) {
                if (outer < M && inner < KD) idx = fwd_a_index(sh, outer, inner);
            } else if (MODE == MODE_DGRAD) {
                if (outer < M && inner < KD) idx = dgrad_a_index(sh, outer, inner);
            } else {
                if (outer < KD && inner < M) idx = (long)outer * sh.k + inner;
            }
        } else {
            if (MODE == MODE_FWD) {
                if (outer < N && inner < KD) idx = (long)outer * KD + inner;
            } else if (MODE == MODE_DGRAD) {
                if (outer < KD && inner < N) idx = dgrad_b_index(sh, outer, inner);
            } else {
                if (outer < KD && inner < N) idx = wgrad_b_index(sh, outer, inner);
            }
        }
        return idx < 0 ? zero4() : *reinterpret_cast<const uint4*>(ptr + idx);
    } else {
        union { uint4 v; bf16 e[8]; } u;
        for (int i = 0; i < 8; ++i) {
            bf16 v;
            if (IS_A) {
                if (MODE == MODE_WGRAD) v = load_a_scalar<MODE>(ptr, sh, inner + i, outer, M, KD);
                else v = load_a_scalar<MODE>(ptr, sh, outer, inner + i, M, KD);
            } else {
                if (MODE == MODE_FWD) v = load_b_scalar<MODE>(ptr, sh, inner + i, outer, N, KD);
                else v = load_b_scalar<MODE>(ptr, sh, outer, inner + i, N, KD);
            }
            u.e[i] = v;
        }
        return u.v;
    }
}

// Geometry of one operand tile in shared memory. "Reduction inner" tiles are [128][BK]
// (ld LD_MK); "reduction outer" tiles are [BK][128] (ld LD_KM). Both hold 512 chunks.
template <bool RED_INNER>
__device__ __forceinline__ void chunk_coords(int chunk, int& outer, int& inner) {
    if (RED_INNER) { outer = chunk / (BK / 8); inner = (chunk % (BK / 8)) * 8; }
    else { outer = chunk / (BM / 8); inner = (chunk % (BM / 8)) * 8; }
}

// Elements of one operand tile in shared memory (the larger of the two tile geometries).
#define TILE (BM * LD_MK > BK * LD_KM ? BM * LD_MK : BK * LD_KM)

// VEC_A / VEC_B: the operand's contiguous dimension is a multiple of 8, so it loads in aligned
// 16-byte chunks; otherwise element by element. `As`/`Bs`: TILE elements of shared memory each,
// declared once per kernel (not per instantiation) to stay within the static 48 KiB.
template <int MODE, bool VEC_A, bool VEC_B>
__device__ void conv_gemm(const bf16* __restrict__ a_ptr, const bf16* __restrict__ b_ptr,
                          void* out, const ConvShape sh, int M, int N, int KD, int kd_begin,
                          int kd_end, bf16* As, bf16* Bs) {
    // A tile stored reduction-inner for FWD/DGRAD, reduction-outer for WGRAD;
    // B tile stored reduction-inner for FWD only.
    constexpr bool A_RED_INNER = MODE != MODE_WGRAD;
    constexpr bool B_RED_INNER = MODE == MODE_FWD;
    constexpr int LDA = A_RED_INNER ? LD_MK : LD_KM;
    constexpr int LDB = B_RED_INNER ? LD_MK : LD_KM;

    const int tid = threadIdx.x, warp = tid / BT_WARP, lane = tid % BT_WARP;
    const int g = lane >> 2, t = lane & 3;  // accumulator fragment coordinates
    const int warp_m = (warp / 4) * 64, warp_n = (warp % 4) * 32;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

    uint4 ra[2], rb[2];

    // Vector path: the output rows this thread gathers for A (FWD/DGRAD) and the filter column
    // it gathers for B (WGRAD) are fixed for the whole reduction, so their integer divisions
    // happen once here instead of on every BK step.
    long row_base[2] = {0, 0};
    int row_y[2] = {0, 0}, row_x[2] = {0, 0};
    bool row_ok[2] = {false, false};
    int col_c = 0, col_r = 0, col_s = 0;
    bool col_ok = false;
    if (A_RED_INNER) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int m = m0 + (tid + i * THREADS) / (BK / 8);
            row_ok[i] = m < M;
            if (MODE == MODE_FWD) {
                const int q = m % sh.q, np = m / sh.q, p = np % sh.p, n = np / sh.p;
                row_base[i] = (long)n * sh.h * sh.w * sh.c;
                row_y[i] = p * sh.stride - sh.pad;
                row_x[i] = q * sh.stride - sh.pad;
            } else {
                const int w = m % sh.w, nh = m / sh.w, h = nh % sh.h, n = nh / sh.h;
                row_base[i] = (long)n * sh.p * sh.q * sh.k;
                row_y[i] = h + sh.pad;
                row_x[i] = w + sh.pad;
            }
        }
    }
    if (VEC_B && MODE == MODE_WGRAD) {
        const int rsc = n0 + (tid % (BN / 8)) * 8;
        col_ok = rsc < N;
        col_c = rsc % sh.c;
        const int rs = rsc / sh.c;
        col_r = rs / sh.s;
        col_s = rs % sh.s;
    }

    auto fetch = [&](int k0) {
        if (VEC_A && A_RED_INNER) {
            // Both A chunks of this thread share the reduction column kk.
            const int kk = k0 + (tid % (BK / 8)) * 8;
            const bool kk_ok = kk < kd_end;
            const int inner_ch = MODE == MODE_FWD ? sh.c : sh.k;
            const int ch = kk % inner_ch, rs = kk / inner_ch, r = rs / sh.s, s = rs - r * sh.s;
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                long idx = -1;
                if (kk_ok && row_ok[i]) {
                    if (MODE == MODE_FWD) {
                        const int h = row_y[i] + r, w = row_x[i] + s;
                        if (h >= 0 && h < sh.h && w >= 0 && w < sh.w) idx = row_base[i] + ((long)h * sh.w + w) * sh.c + ch;
                    } else {
                        const int ph = row_y[i] - r, qw = row_x[i] - s;
                        if (ph >= 0 && qw >= 0 && ph % sh.stride == 0 && qw % sh.stride == 0) {
                            const int p = ph / sh.stride, q = qw / sh.stride;
                            if (p < sh.p && q < sh.q) idx = row_base[i] + ((long)p * sh.q + q) * sh.k + ch;
                        }
                    }
                }
                ra[i] = idx < 0 ? zero4() : *reinterpret_cast<const uint4*>(a_ptr + idx);
            }
        } else if (MODE == MODE_FWD) {
            // The stem (3 channels): for a fixed filter row r the taps (s, c) are contiguous in
            // NHWC memory, so an element needs two divisions, not the generic six.
            const int kk0 = k0 + (tid % (BK / 8)) * 8;
            const int sc = sh.s * sh.c;
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                union { uint4 v; bf16 e[8]; } u;
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    const int kk = kk0 + e;
                    const int r = kk / sc, j = kk - r * sc;
                    const int h = row_y[i] + r, w = row_x[i] + j / sh.c;
                    const bool ok = row_ok[i] && kk < kd_end && h >= 0 && h < sh.h && w >= 0 && w < sh.w;
                    u.e[e] = ok ? a_ptr[row_base[i] + ((long)h * sh.w + row_x[i]) * sh.c + j] : bt_to_bf16(0.0f);
                }
                ra[i] = u.v;
            }
        } else {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                int outer, inner, chunk = tid + i * THREADS;
                chunk_coords<A_RED_INNER>(chunk, outer, inner);
                if (A_RED_INNER) ra[i] = load_chunk<MODE, true, VEC_A>(a_ptr, sh, m0 + outer, k0 + inner, M, N, kd_end);
                else ra[i] = load_chunk<MODE, true, VEC_A>(a_ptr, sh, k0 + outer, m0 + inner, M, N, kd_end);
            }
        }
        if (VEC_B && MODE == MODE_WGRAD) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int pix = k0 + (tid + i * THREADS) / (BN / 8);
                long idx = -1;
                if (col_ok && pix < kd_end) {
                    const int q = pix % sh.q, np = pix / sh.q, p = np % sh.p, n = np / sh.p;
                    const int h = p * sh.stride - sh.pad + col_r, w = q * sh.stride - sh.pad + col_s;
                    if (h >= 0 && h < sh.h && w >= 0 && w < sh.w) idx = (((long)n * sh.h + h) * sh.w + w) * sh.c + col_c;
                }
                rb[i] = idx < 0 ? zero4() : *reinterpret_cast<const uint4*>(b_ptr + idx);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                int outer, inner, chunk = tid + i * THREADS;
                chunk_coords<B_RED_INNER>(chunk, outer, inner);
                if (B_RED_INNER) rb[i] = load_chunk<MODE, false, VEC_B>(b_ptr, sh, n0 + outer, k0 + inner, M, N, kd_end);
                else rb[i] = load_chunk<MODE, false, VEC_B>(b_ptr, sh, k0 + outer, n0 + inner, M, N, kd_end);
            }
        }
    };
    auto stash = [&]() {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            int outer, inner, chunk = tid + i * THREADS;
            chunk_coords<A_RED_INNER>(chunk, outer, inner);
            *reinterpret_cast<uint4*>(As + outer * LDA + inner) = ra[i];
            chunk_coords<B_RED_INNER>(chunk, outer, inner);
            *reinterpret_cast<uint4*>(Bs + outer * LDB + inner) = rb[i];
        }
    };

    if (kd_begin < kd_end) fetch(kd_begin);
    for (int k0 = kd_begin; k0 < kd_end; k0 += BK) {
        __syncthreads();  // every warp is done with the previous tile
        stash();
        __syncthreads();
        if (k0 + BK < kd_end) fetch(k0 + BK);  // global loads overlap the mma below
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            // Fragments straight from shared memory with ldmatrix: one instruction loads four
            // 8×8 matrices (a whole 16×16 A tile, or two 16×8 B tiles); the .trans form serves
            // tiles stored with the reduction dimension outermost. Lane l addresses one 8-element
            // row of matrix q = l / 8.
            unsigned fa[4][4], fb[4][2];
            const int q = lane / 8, row8 = lane % 8;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int mb = warp_m + i * 16;
                // matrices: (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15)
                if (A_RED_INNER) ldsm_x4(fa[i], As + (mb + (q % 2) * 8 + row8) * LDA + kk + (q / 2) * 8);
                else ldsm_x4_trans(fa[i], As + (kk + (q / 2) * 8 + row8) * LDA + mb + (q % 2) * 8);
            }
#pragma unroll
            for (int jj = 0; jj < 2; ++jj) {
                const int nb = warp_n + jj * 16;
                unsigned r[4];
                // matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
                if (B_RED_INNER) ldsm_x4(r, Bs + (nb + (q / 2) * 8 + row8) * LDB + kk + (q % 2) * 8);
                else ldsm_x4_trans(r, Bs + (kk + (q % 2) * 8 + row8) * LDB + nb + (q / 2) * 8);
                fb[2 * jj][0] = r[0];
                fb[2 * jj][1] = r[1];
                fb[2 * jj + 1][0] = r[2];
                fb[2 * jj + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) mma_bf16_16816(acc[i][j], fa[i], fb[j]);
        }
    }

    // Epilogue straight from the accumulator registers: elements (e, e+1) of tile (i, j) sit at
    // row g (+8 for e = 2), columns 2t and 2t+1. M and N need not be multiples of 16; when N is
    // even the pair is one aligned 32-bit bf16x2 store.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int e = 0; e < 4; e += 2) {
                const int m = m0 + warp_m + i * 16 + g + (e >= 2 ? 8 : 0);
                const int n = n0 + warp_n + j * 8 + 2 * t;
                if (m >= M || n >= N) continue;
                const long o = (long)m * N + n;
                const float v0 = acc[i][j][e], v1 = acc[i][j][e + 1];
                const bool pair = n + 1 < N;
                if (MODE == MODE_WGRAD) {
                    float* dw = reinterpret_cast<float*>(out);
                    atomicAdd(dw + o, v0);
                    if (pair) atomicAdd(dw + o + 1, v1);
                } else {
                    bf16* y = reinterpret_cast<bf16*>(out);
                    const bool acc_in = MODE == MODE_DGRAD && sh.accumulate;
                    const float w0 = acc_in ? v0 + bt_to_f32(y[o]) : v0;
                    if (pair && N % 2 == 0) {
                        const float w1 = acc_in ? v1 + bt_to_f32(y[o + 1]) : v1;
                        const unsigned lo = __bfloat16_as_ushort(bt_to_bf16(w0)), hi = __bfloat16_as_ushort(bt_to_bf16(w1));
                        *reinterpret_cast<unsigned*>(y + o) = lo | (hi << 16);
                    } else {
                        y[o] = bt_to_bf16(w0);
                        if (pair) y[o + 1] = bt_to_bf16(acc_in ? v1 + bt_to_f32(y[o + 1]) : v1);
                    }
                }
            }
        }
    }
}

// Shapes of the three GEMM views, the wgrad split, and this kernel's shared memory (one
// instantiation per kernel, so 20 KiB each).
template <int MODE, bool VEC_A, bool VEC_B>
__device__ __forceinline__ void conv_entry(const bf16* a, const bf16* b, void* out, const ConvShape& sh) {
    __shared__ __align__(16) bf16 smem[2 * TILE];
    int M, N, KD, begin = 0;
    if (MODE == MODE_FWD) { M = sh.n * sh.p * sh.q; N = sh.k; KD = sh.r * sh.s * sh.c; }
    else if (MODE == MODE_DGRAD) { M = sh.n * sh.h * sh.w; N = sh.c; KD = sh.r * sh.s * sh.k; }
    else { M = sh.k; N = sh.r * sh.s * sh.c; KD = sh.n * sh.p * sh.q; }
    int end = KD;
    if (MODE == MODE_WGRAD) { begin = blockIdx.z * sh.k_chunk; end = min(KD, begin + sh.k_chunk); }
    conv_gemm<MODE, VEC_A, VEC_B>(a, b, out, sh, M, N, KD, begin, end, smem, smem + TILE);
}

// One kernel per (pass, load path): each gets its own register allocation, so the element-wise
// paths (the 3-channel stem, odd channel counts) cost the vector paths nothing. The host picks
// by channel counts: *_vec needs C % 8 == 0 (and K % 8 == 0 for dgrad and wgrad).

// y = conv(x, w)
extern "C" __global__ void __launch_bounds__(THREADS, 2)
conv_fwd_vec(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* y, ConvShape sh) {
    conv_entry<MODE_FWD, true, true>(x, w, y, sh);
}

extern "C" __global__ void __launch_bounds__(THREADS, 2)
conv_fwd_scalar(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* y, ConvShape sh) {
    conv_entry<MODE_FWD, false, false>(x, w, y, sh);
}

// dx = dgrad(dy, w), or dx += dgrad(dy, w) with sh.accumulate
extern "C" __global__ void __launch_bounds__(THREADS, 2)
conv_dgrad_vec(const bf16* __restrict__ dy, const bf16* __restrict__ w, bf16* dx, ConvShape sh) {
    conv_entry<MODE_DGRAD, true, true>(dy, w, dx, sh);
}

extern "C" __global__ void __launch_bounds__(THREADS, 2)
conv_dgrad_scalar(const bf16* __restrict__ dy, const bf16* __restrict__ w, bf16* dx, ConvShape sh) {
    conv_entry<MODE_DGRAD, false, false>(dy, w, dx, sh);
}

// dw += wgrad(dy, x) (f32, split over gridDim.z); the stem variant keeps 16-byte dy loads.
extern "C" __global__ void __launch_bounds__(THREADS, 2)
conv_wgrad_vec(const bf16* __restrict__ dy, const bf16* __restrict__ x, float* dw, ConvShape sh) {
    conv_entry<MODE_WGRAD, true, true>(dy, x, dw, sh);
}

extern "C" __global__ void __launch_bounds__(THREADS, 2)
conv_wgrad_stem(const bf16* __restrict__ dy, const bf16* __restrict__ x, float* dw, ConvShape sh) {
    conv_entry<MODE_WGRAD, true, false>(dy, x, dw, sh);
}

extern "C" __global__ void __launch_bounds__(THREADS, 2)
conv_wgrad_scalar(const bf16* __restrict__ dy, const bf16* __restrict__ x, float* dw, ConvShape sh) {
    conv_entry<MODE_WGRAD, false, false>(dy, x, dw, sh);
}
