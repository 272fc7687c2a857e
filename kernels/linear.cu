// linear.cu: the classifier head (fully connected layer), forward and backward, in f32.
//
// Algorithm. logits = feat · Wᵀ + b, dfeat = dlogits · W, dW += dlogitsᵀ · feat, db += Σ dlogits.
// The head is < 1% of a ResNet step's FLOPs, so one classic 16×16 shared-memory tiled GEMM
// serves all three products (f32 throughout: the weight is read from the f32 master copy, which
// keeps the logits and the loss at full precision).
//
// Data layout. feat, dfeat: f32 [N,C] row-major; W, dW: f32 [K,C] (PyTorch's [out, in]);
// b, db: f32 [K]; logits, dlogits: f32 [N,K].
//
// Launch configuration. 16×16 threads, one output element each; grid (ceil(cols/16),
// ceil(rows/16)). linear_bias_grad: one thread per class, 256 per block.
#include "common.cuh"

#define TS 16

// out[i][j] (+)= Σ_k A(i,k)·B(k,j), where A(i,k) = a[i*a_ri + k*a_ki] and B(k,j) = b[k*b_ki + j*b_ji]
// (strides let one kernel read either operand transposed). `bias` (may be null) is added per j.
__device__ void gemm_tile(const float* __restrict__ a, long a_ri, long a_ki, const float* __restrict__ b,
                          long b_ki, long b_ji, const float* __restrict__ bias, float* __restrict__ out,
                          int rows, int cols, int inner, int accumulate) {
    __shared__ float sa[TS][TS + 1], sb[TS][TS + 1];
    const int i = blockIdx.y * TS + threadIdx.y, j = blockIdx.x * TS + threadIdx.x;
    float acc = 0.0f;
    for (int k0 = 0; k0 < inner; k0 += TS) {
        const int ka = k0 + threadIdx.x, kb = k0 + threadIdx.y;
        sa[threadIdx.y][threadIdx.x] = (i < rows && ka < inner) ? a[i * a_ri + ka * a_ki] : 0.0f;
        sb[threadIdx.y][threadIdx.x] = (kb < inner && j < cols) ? b[kb * b_ki + j * b_ji] : 0.0f;
        __syncthreads();
        for (int k = 0; k < TS; ++k) acc += sa[threadIdx.y][k] * sb[k][threadIdx.x];
        __syncthreads();
    }
    if (i < rows && j < cols) {
        if (bias != nullptr) acc += bias[j];
        float* o = out + (long)i * cols + j;
        *o = accumulate ? *o + acc : acc;
    }
}

// logits[N][K] = feat[N][C] · W[K][C]ᵀ + b
extern "C" __global__ void linear_fwd(const float* feat, const float* w, const float* b,
                                      float* logits, int n, int c, int k) {
    gemm_tile(feat, c, 1, w, 1, c, b, logits, n, k, c, 0);
}

// dfeat[N][C] = dlogits[N][K] · W[K][C]
extern "C" __global__ void linear_bwd_data(const float* dlogits, const float* w, float* dfeat,
                                           int n, int c, int k) {
    gemm_tile(dlogits, k, 1, w, c, 1, nullptr, dfeat, n, c, k, 0);
}

// dW[K][C] += dlogits[N][K]ᵀ · feat[N][C]
extern "C" __global__ void linear_bwd_weight(const float* dlogits, const float* feat, float* dw,
                                             int n, int c, int k) {
    gemm_tile(dlogits, 1, k, feat, c, 1, nullptr, dw, k, c, n, 1);
}

// db[K] += Σ_n dlogits[n][k]
extern "C" __global__ void linear_bias_grad(const float* __restrict__ dlogits, float* __restrict__ db,
                                            int n, int k) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= k) return;
    float acc = 0.0f;
    for (int i = 0; i < n; ++i) acc += dlogits[(long)i * k + j];
    db[j] += acc;
}
