// optim.cu: fused multi-tensor optimizer updates and parameter casts.
//
// Algorithm. All parameters of the model live in one flat f32 master buffer (and one flat f32
// gradient buffer, one or two flat f32 state buffers). A host-built chunk table splits every
// parameter tensor into chunks of at most CHUNK elements and records, per chunk, its start,
// its length and the tensor's weight-decay factor (0 for tensors exempt from decay). One launch
// then updates every parameter of the model: block b walks chunk b. After the f32 update the
// kernel writes the bf16 working copy the forward pass reads, so no separate cast is launched.
//   SGD (PyTorch semantics): g = grad·grad_scale + wd·w; buf = momentum·buf + g (buf starts at
//     0, so the first step is g); step = nesterov ? g + momentum·buf : buf; w −= lr·step.
//   Adam / AdamW: g = grad·grad_scale (+ wd·w for Adam's L2 decay); AdamW first decays
//     w ← w·(1 − lr·wd) (decoupled); m = β1·m + (1−β1)·g; v = β2·v + (1−β2)·g²;
//     w −= lr·(m/(1−β1^t)) / (sqrt(v/(1−β2^t)) + ε).
// `grad_scale` folds the 1/world averaging of data parallelism into the update.
//
// Data layout. master, grad, buf, m, v: f32 flat; working: bf16 flat with the same offsets;
// chunk table: three arrays [chunks] of i64 start, i32 length, f32 weight decay.
//
// Launch configuration. grid = number of chunks, 256 threads; each thread strides over its
// chunk (CHUNK = 65536 on the host side, so a ResNet-50 update is ~400 blocks, one launch).
#include "common.cuh"

extern "C" __global__ void sgd_update(float* __restrict__ master, const float* __restrict__ grad,
                                      float* __restrict__ buf, bf16* __restrict__ working,
                                      const long* __restrict__ chunk_start,
                                      const int* __restrict__ chunk_len,
                                      const float* __restrict__ chunk_wd, float lr, float momentum,
                                      float grad_scale, int nesterov) {
    const long start = chunk_start[blockIdx.x];
    const int len = chunk_len[blockIdx.x];
    const float wd = chunk_wd[blockIdx.x];
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        const long i = start + j;
        float w = master[i];
        const float g = grad[i] * grad_scale + wd * w;
        const float b = momentum * buf[i] + g;
        buf[i] = b;
        w -= lr * (nesterov ? g + momentum * b : b);
        master[i] = w;
        if (working != nullptr) working[i] = bt_to_bf16(w);
    }
}

extern "C" __global__ void adam_update(float* __restrict__ master, const float* __restrict__ grad,
                                        float* __restrict__ m, float* __restrict__ v,
                                        bf16* __restrict__ working,
                                        const long* __restrict__ chunk_start,
                                        const int* __restrict__ chunk_len,
                                        const float* __restrict__ chunk_wd, float lr, float beta1,
                                        float beta2, float eps, float grad_scale, float bias_c1,
                                        float bias_c2, int decoupled) {
    // bias_c1 = 1 − β1^t and bias_c2 = 1 − β2^t, computed on the host in f64.
    const long start = chunk_start[blockIdx.x];
    const int len = chunk_len[blockIdx.x];
    const float wd = chunk_wd[blockIdx.x];
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        const long i = start + j;
        float w = master[i];
        const float g = grad[i] * grad_scale + (decoupled ? 0.0f : wd * w);
        if (decoupled) w *= 1.0f - lr * wd;
        const float mi = beta1 * m[i] + (1.0f - beta1) * g;
        const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        w -= lr * (mi / bias_c1) / (sqrtf(vi / bias_c2) + eps);
        master[i] = w;
        if (working != nullptr) working[i] = bt_to_bf16(w);
    }
}

// working[i] = bf16(master[i]) for the whole flat buffer (after loading a checkpoint).
extern "C" __global__ void cast_f32_bf16(const float* __restrict__ src, bf16* __restrict__ dst, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        dst[i] = bt_to_bf16(src[i]);
}

// dst[i] = f32(src[i]) (reading bf16 activations or gradients back for checks and reports).
extern "C" __global__ void cast_bf16_f32(const bf16* __restrict__ src, float* __restrict__ dst, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        dst[i] = bt_to_f32(src[i]);
}

// Σ g² over a flat f32 buffer into *out (+=, atomics; for gradient-norm reports and clipping).
extern "C" __global__ void sum_squares(const float* __restrict__ src, long n, float* __restrict__ out) {
    __shared__ float scratch[32];
    float acc = 0.0f;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        acc += src[i] * src[i];
    acc = bt_block_sum(acc, scratch);
    if (threadIdx.x == 0) atomicAdd(out, acc);
}
