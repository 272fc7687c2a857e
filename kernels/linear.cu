// linear.cu: the classifier head (fully connected layer), forward and backward.
//
// Algorithm. y = x · Wᵀ + b, dx (+)= dy · W, dW = dyᵀ · x, db = Σ_rows dy. The head is < 1% of a
// ResNet step's FLOPs, so one classic 16×16 shared-memory tiled GEMM (bf16 operands converted
// to f32 on load, f32 accumulation) serves all three products; operand strides let it read
// either operand transposed.
//
// Data layout. x, dx: bf16 [N,IN] row-major; W: bf16 [OUT,IN] (PyTorch's layout); b: bf16 [OUT];
// y, dy: bf16 [N,OUT]; dW: f32 [OUT,IN]; db: f32 [OUT] (gradients overwritten).
//
// Launch configuration. 16×16 threads, one output element each; grid (ceil(cols/16),
// ceil(rows/16)). linear_bias_grad: one thread per output feature, 256 per block.
#include "common.cuh"

#define TS 16

// C(i,j) = Σ_k A(i,k)·B(k,j) with A(i,k) = a[i*a_ri + k*a_ki], B(k,j) = b[k*b_ki + j*b_ji].
// Returns the accumulator of this thread's (i, j); out-of-range threads get 0.
__device__ float gemm_tile(const bf16* __restrict__ a, long a_ri, long a_ki, const bf16* __restrict__ b,
                           long b_ki, long b_ji, int rows, int cols, int inner) {
    __shared__ float sa[TS][TS + 1], sb[TS][TS + 1];
    const int i = blockIdx.y * TS + threadIdx.y, j = blockIdx.x * TS + threadIdx.x;
    float acc = 0.0f;
    for (int k0 = 0; k0 < inner; k0 += TS) {
        const int ka = k0 + threadIdx.x, kb = k0 + threadIdx.y;
        sa[threadIdx.y][threadIdx.x] = (i < rows && ka < inner) ? bt_to_f32(a[i * a_ri + ka * a_ki]) : 0.0f;
        sb[threadIdx.y][threadIdx.x] = (kb < inner && j < cols) ? bt_to_f32(b[kb * b_ki + j * b_ji]) : 0.0f;
        __syncthreads();
        for (int k = 0; k < TS; ++k) acc += sa[threadIdx.y][k] * sb[k][threadIdx.x];
        __syncthreads();
    }
    return acc;
}

// y[N][OUT] = x[N][IN] · W[OUT][IN]ᵀ + b
extern "C" __global__ void linear_fwd(const bf16* x, const bf16* w, const bf16* b, bf16* y, int n,
                                      int in, int out) {
    const float acc = gemm_tile(x, in, 1, w, 1, in, n, out, in);
    const int i = blockIdx.y * TS + threadIdx.y, j = blockIdx.x * TS + threadIdx.x;
    if (i < n && j < out) y[(long)i * out + j] = bt_to_bf16(acc + bt_to_f32(b[j]));
}

// dx[N][IN] (+)= dy[N][OUT] · W[OUT][IN]
extern "C" __global__ void linear_bwd_data(const bf16* dy, const bf16* w, bf16* dx, int n, int in,
                                           int out, int accumulate) {
    const float acc = gemm_tile(dy, out, 1, w, in, 1, n, in, out);
    const int i = blockIdx.y * TS + threadIdx.y, j = blockIdx.x * TS + threadIdx.x;
    if (i < n && j < in) {
        bf16* o = dx + (long)i * in + j;
        *o = bt_to_bf16(accumulate ? acc + bt_to_f32(*o) : acc);
    }
}

// dW[OUT][IN] = dy[N][OUT]ᵀ · x[N][IN]
extern "C" __global__ void linear_bwd_weight(const bf16* dy, const bf16* x, float* dw, int n, int in,
                                             int out) {
    const float acc = gemm_tile(dy, 1, out, x, in, 1, out, in, n);
    const int i = blockIdx.y * TS + threadIdx.y, j = blockIdx.x * TS + threadIdx.x;
    if (i < out && j < in) dw[(long)i * in + j] = acc;
}

// db[OUT] = Σ_n dy[n][o]
extern "C" __global__ void linear_bias_grad(const bf16* __restrict__ dy, float* __restrict__ db, int n,
                                            int out) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= out) return;
    float acc = 0.0f;
    for (int i = 0; i < n; ++i) acc += bt_to_f32(dy[(long)i * out + j]);
    db[j] = acc;
}
