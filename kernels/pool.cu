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
// Launch configuration. One thread per output element (max pool forward, GAP backward) or per
// input element (max pool backward), 256 threads, grid-stride loops. GAP forward: one thread per
// (n, c) pair, a warp on consecutive channels so each step of the H·W loop reads 64 bytes.
#include "common.cuh"

// First maximum (row-major) of window (op, oq), as r·win + s.
__device__ __forceinline__ int window_argmax(const bf16* x, int b, int h, int w, int c, int ch,
                                             int op, int oq, int win, int stride, int pad) {
    float best = BT_NEG_INF;
    int best_at = -1;
    for (int r = 0; r < win; ++r) {
        const int ih = op * stride - pad + r;
        if (ih < 0 || ih >= h) continue;
        for (int s = 0; s < win; ++s) {
            const int iw = oq * stride - pad + s;
            if (iw < 0 || iw >= w) continue;
            const float v = bt_to_f32(x[(((long)b * h + ih) * w + iw) * c + ch]);
            if (best_at < 0 || v > best) { best = v; best_at = r * win + s; }
        }
    }
    return best_at;
}

extern "C" __global__ void maxpool_fwd(const bf16* __restrict__ x, bf16* __restrict__ y, int n,
                                       int h, int w, int c, int p, int q, int win, int stride,
                                       int pad) {
    const long total = (long)n * p * q * c;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const int ch = (int)(i % c);
        long rest = i / c;
        const int oq = (int)(rest % q); rest /= q;
        const int op = (int)(rest % p);
        const int b = (int)(rest / p);
        const int at = window_argmax(x, b, h, w, c, ch, op, oq, win, stride, pad);
        const int ih = op * stride - pad + at / win, iw = oq * stride - pad + at % win;
        y[i] = x[(((long)b * h + ih) * w + iw) * c + ch];
    }
}

extern "C" __global__ void maxpool_bwd(const bf16* __restrict__ x, const bf16* __restrict__ dy,
                                       bf16* __restrict__ dx, int n, int h, int w, int c, int p,
                                       int q, int win, int stride, int pad, int accumulate) {
    const long total = (long)n * h * w * c;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const int ch = (int)(i % c);
        long rest = i / c;
        const int iw = (int)(rest % w); rest /= w;
        const int ih = (int)(rest % h);
        const int b = (int)(rest / h);
        // Windows covering ih: op·stride − pad ≤ ih ≤ op·stride − pad + win − 1.
        const int p_lo = max(0, (ih + pad - win + stride) / stride), p_hi = min(p - 1, (ih + pad) / stride);
        const int q_lo = max(0, (iw + pad - win + stride) / stride), q_hi = min(q - 1, (iw + pad) / stride);
        float acc = accumulate ? bt_to_f32(dx[i]) : 0.0f;
        for (int op = p_lo; op <= p_hi; ++op) {
            const int r = ih - (op * stride - pad);
            if (r < 0 || r >= win) continue;
            for (int oq = q_lo; oq <= q_hi; ++oq) {
                const int s = iw - (oq * stride - pad);
                if (s < 0 || s >= win) continue;
                if (window_argmax(x, b, h, w, c, ch, op, oq, win, stride, pad) == r * win + s)
                    acc += bt_to_f32(dy[(((long)b * p + op) * q + oq) * c + ch]);
            }
        }
        dx[i] = bt_to_bf16(acc);
    }
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
