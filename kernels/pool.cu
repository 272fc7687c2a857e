// pool.cu: max pooling and global average pooling, forward and backward.
//
// Algorithm. Max pool (ResNet's 3×3, stride 2, padding 1 stem pool, any window in general):
// forward takes the maximum over the window (padding never wins) and records the winner's
// position inside the window in one byte; backward is a gather, not a scatter: every input
// pixel sums the gradients of the outputs whose recorded winner it is, so there are no atomics
// and the result is deterministic. Global average pool: forward averages each channel over
// H·W into f32 features (the head runs in f32); backward spreads dfeat/(H·W) back, bf16.
//
// Data layout. x, dx: NHWC bf16 [N,H,W,C]; y, dy: NHWC bf16 [N,P,Q,C]; argmax: u8 [N,P,Q,C]
// (window index r·S + s, so windows up to 16×16). feat, dfeat: f32 [N,C].
//
// Launch configuration. One thread per output element (max pool forward, GAP backward) or
// per input element (max pool backward), 256 threads, grid-stride loops. GAP forward: one
// thread per (n, c) pair, threads of a warp on consecutive channels so every read of the
// H·W loop is coalesced.
#include "common.cuh"

extern "C" __global__ void maxpool_fwd(const bf16* __restrict__ x, bf16* __restrict__ y,
                                       u8* __restrict__ argmax, int n, int h, int w, int c,
                                       int p, int q, int win, int stride, int pad) {
    const long total = (long)n * p * q * c;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const int ch = (int)(i % c);
        long rest = i / c;
        const int oq = (int)(rest % q); rest /= q;
        const int op = (int)(rest % p);
        const int b = (int)(rest / p);
        float best = BT_NEG_INF;
        int best_at = 0;
        for (int r = 0; r < win; ++r) {
            const int ih = op * stride - pad + r;
            if (ih < 0 || ih >= h) continue;
            for (int s = 0; s < win; ++s) {
                const int iw = oq * stride - pad + s;
                if (iw < 0 || iw >= w) continue;
                const float v = bt_to_f32(x[(((long)b * h + ih) * w + iw) * c + ch]);
                if (v > best) { best = v; best_at = r * win + s; }
            }
        }
        y[i] = bt_to_bf16(best);
        argmax[i] = (u8)best_at;
    }
}

extern "C" __global__ void maxpool_bwd(const bf16* __restrict__ dy, const u8* __restrict__ argmax,
                                       bf16* __restrict__ dx, int n, int h, int w, int c, int p,
                                       int q, int win, int stride, int pad) {
    const long total = (long)n * h * w * c;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const int ch = (int)(i % c);
        long rest = i / c;
        const int iw = (int)(rest % w); rest /= w;
        const int ih = (int)(rest % h);
        const int b = (int)(rest / h);
        // Outputs whose window covers (ih, iw): op·stride − pad ≤ ih ≤ op·stride − pad + win − 1.
        const int p_lo = max(0, (ih + pad - win + stride) / stride), p_hi = min(p - 1, (ih + pad) / stride);
        const int q_lo = max(0, (iw + pad - win + stride) / stride), q_hi = min(q - 1, (iw + pad) / stride);
        float acc = 0.0f;
        for (int op = p_lo; op <= p_hi; ++op) {
            const int r = ih - (op * stride - pad);
            if (r < 0 || r >= win) continue;
            for (int oq = q_lo; oq <= q_hi; ++oq) {
                const int s = iw - (oq * stride - pad);
                if (s < 0 || s >= win) continue;
                const long o = (((long)b * p + op) * q + oq) * c + ch;
                if (argmax[o] == r * win + s) acc += bt_to_f32(dy[o]);
            }
        }
        dx[i] = bt_to_bf16(acc);
    }
}

extern "C" __global__ void gap_fwd(const bf16* __restrict__ x, float* __restrict__ feat, int n,
                                   int hw, int c) {
    const long total = (long)n * c;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const int ch = (int)(i % c);
        const long b = i / c;
        const bf16* base = x + b * hw * c + ch;
        float acc = 0.0f;
        for (int j = 0; j < hw; ++j) acc += bt_to_f32(base[(long)j * c]);
        feat[i] = acc / (float)hw;
    }
}

extern "C" __global__ void gap_bwd(const float* __restrict__ dfeat, bf16* __restrict__ dx, int n,
                                   int hw, int c) {
    const long total = (long)n * hw * c;
    const float scale = 1.0f / (float)hw;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const int ch = (int)(i % c);
        const long b = i / ((long)hw * c);
        dx[i] = bt_to_bf16(dfeat[b * c + ch] * scale);
    }
}
