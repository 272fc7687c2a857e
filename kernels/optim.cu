// optim.cu: fused multi-tensor optimizer updates and parameter casts.
//
// Algorithm. Multi-tensor apply: the f32 master weights and optimizer state are flat buffers
// (graph parameter order), while gradients and bf16 working copies stay in the model's own
// per-tensor buffers. A host-built chunk table splits every parameter tensor into chunks of at
// most CHUNK elements and records, per chunk, its flat start, its length, its tensor's weight
// decay (0 for tensors exempt from decay) and the device addresses of its gradient and working
// copy. One launch then updates every parameter of the model: block b walks chunk b. After the
// f32 update the kernel writes the bf16 working copy the forward pass reads (no separate cast).
//   SGD (PyTorch semantics): g = grad·grad_scale + wd·w; buf = momentum·buf + g (buf starts at
//     0, so the first step is g); step = nesterov ? g + momentum·buf : buf; w −= lr·step.
//   Adam / AdamW: g = grad·grad_scale (+ wd·w for Adam's L2 decay); AdamW first decays
//     w ← w·(1 − lr·wd) (decoupled); m = β1·m + (1−β1)·g; v = β2·v + (1−β2)·g²;
//     w −= lr·(m/(1−β1^t)) / (sqrt(v/(1−β2^t)) + ε).
// `grad_scale` folds the 1/world averaging of data parallelism into the update.
//   Clipping by global norm (`--clip-grad-norm`, PyTorch's clip_grad_norm_): when max_norm > 0,
//     grad_sumsq sums g² per chunk into partial[b] (f64), grad_sumsq_total adds the partials
//     into *sumsq, and the update multiplies grad_scale by min(1, max_norm / (‖g‖·grad_scale +
//     1e-6)), read from *sumsq by every thread: no host round trip between the launches.
//     Every sum is a fixed tree, never an atomic: ranks holding the same averaged gradients
//     must get the same factor to the last bit, or their replicas drift apart.
//   scale_f32: x ← alpha·x over a flat f32 range (a rank's gradient bucket times its share of
//     the step's images before the average, when a short last batch is split unevenly).
//   grad_accumulate (--grad-accum-steps K): the backward writes each micro-batch's gradient g
//     into the flat buffer, and the weighted sum of the micro-batches is carried in an f32
//     buffer acc beside it: mode 0 acc = w·g (the first micro-batch), 1 acc = acc + w·g, 2
//     g = acc + w·g (the rank's last micro-batch with images: the sum where the buckets read
//     it), 3 g = w·g (first and last). Products and sums are rounded separately (__fmul_rn,
//     __fadd_rn, never contracted into an FMA), the CPU ranks' arithmetic.
//
// Data layout. master, buf, m, v: f32 flat; gradients f32 and working copies bf16 wherever the
// tensors live; chunk table: arrays [chunks] of u64 gradient address, u64 working address (or
// 0), i64 flat start, i32 length, f32 weight decay.
//
// Launch configuration. grid = number of chunks, 256 threads; each thread strides over its
// chunk (CHUNK = 65536 on the host side, so a ResNet-50 update is ~400 blocks, one launch).
// scale_f32 and grad_accumulate: a grid-stride loop, 256 threads, at most 1024 blocks. grad_sumsq: the update's
// chunk grid, 256 threads, a shared-memory tree per block. grad_sumsq_total: one block of
// 256 threads, each summing a strided share of the partials in order, then a tree.
#include "common.cuh"

// Per-chunk addresses: grad_ptr[b] and work_ptr[b] point at the chunk's first gradient (f32)
// and working-copy (bf16) element; work_ptr[b] may be 0 (no working copy). Master and state are
// flat, indexed from chunk_start[b].
struct ChunkRef {
    const float* grad;
    bf16* work;
    long start;
    int len;
    float wd;
};

__device__ __forceinline__ ChunkRef chunk_ref(const unsigned long long* grad_ptr,
                                              const unsigned long long* work_ptr,
                                              const long* chunk_start, const int* chunk_len,
                                              const float* chunk_wd) {
    const int b = blockIdx.x;
    ChunkRef c;
    c.grad = reinterpret_cast<const float*>(grad_ptr[b]);
    c.work = reinterpret_cast<bf16*>(work_ptr[b]);
    c.start = chunk_start[b];
    c.len = chunk_len[b];
    c.wd = chunk_wd[b];
    return c;
}

// The gradient factor of an update: grad_scale, times the clipping coefficient when on.
__device__ __forceinline__ float clipped_scale(float grad_scale, float max_norm,
                                               const double* sumsq) {
    if (max_norm <= 0.0f) return grad_scale;
    const float norm = (float)sqrt(*sumsq) * grad_scale;
    return grad_scale * fminf(1.0f, max_norm / (norm + 1e-6f));
}

// The sum of the block's 256 values `acc` by a fixed tree (thread 0 gets it).
__device__ __forceinline__ double block_sum_256(double acc) {
    __shared__ double part[256];
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if ((int)threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
        __syncthreads();
    }
    return part[0];
}

extern "C" __global__ void grad_sumsq(const unsigned long long* __restrict__ grad_ptr,
                                      const int* __restrict__ chunk_len,
                                      double* __restrict__ partial) {
    const float* g = reinterpret_cast<const float*>(grad_ptr[blockIdx.x]);
    const int len = chunk_len[blockIdx.x];
    double acc = 0.0;
    for (int j = threadIdx.x; j < len; j += blockDim.x) acc += (double)g[j] * g[j];
    const double total = block_sum_256(acc);
    if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

extern "C" __global__ void grad_sumsq_total(const double* __restrict__ partial, int n,
                                            double* __restrict__ sumsq) {
    double acc = 0.0;
    for (int b = threadIdx.x; b < n; b += blockDim.x) acc += partial[b];
    const double total = block_sum_256(acc);
    if (threadIdx.x == 0) *sumsq = total;
}

extern "C" __global__ void sgd_update(float* __restrict__ master, float* __restrict__ buf,
                                      const unsigned long long* __restrict__ grad_ptr,
                                      const unsigned long long* __restrict__ work_ptr,
                                      const long* __restrict__ chunk_start,
                                      const int* __restrict__ chunk_len,
                                      const float* __restrict__ chunk_wd, const float* __restrict__ lr_at, float momentum,
                                      float grad_scale, int nesterov, float max_norm,
                                      const double* __restrict__ sumsq) {
    // The lr is a device value (uploaded before the step), so a captured CUDA graph replays
    // with each step's own.
    const float lr = *lr_at;
    const ChunkRef c = chunk_ref(grad_ptr, work_ptr, chunk_start, chunk_len, chunk_wd);
    grad_scale = clipped_scale(grad_scale, max_norm, sumsq);
    for (int j = threadIdx.x; j < c.len; j += blockDim.x) {
        const long i = c.start + j;
        float w = master[i];
        const float g = c.grad[j] * grad_scale + c.wd * w;
        const float b = momentum * buf[i] + g;
        buf[i] = b;
        w -= lr * (nesterov ? g + momentum * b : b);
        master[i] = w;
        if (c.work != nullptr) c.work[j] = bt_to_bf16(w);
    }
}

extern "C" __global__ void adam_update(float* __restrict__ master, float* __restrict__ m,
                                       float* __restrict__ v,
                                       const unsigned long long* __restrict__ grad_ptr,
                                       const unsigned long long* __restrict__ work_ptr,
                                       const long* __restrict__ chunk_start,
                                       const int* __restrict__ chunk_len,
                                       const float* __restrict__ chunk_wd, const float* __restrict__ lr_at, float beta1,
                                       float beta2, float eps, float grad_scale,
                                       const float* __restrict__ bias_c, int decoupled, float max_norm,
                                       const double* __restrict__ sumsq) {
    // bias_c = {1 − β1^t, 1 − β2^t}, computed on the host in f64 and uploaded with the lr before the
    // step (device values, so that a captured CUDA graph replays with each step's own).
    const float lr = *lr_at, bias_c1 = bias_c[0], bias_c2 = bias_c[1];
    const ChunkRef c = chunk_ref(grad_ptr, work_ptr, chunk_start, chunk_len, chunk_wd);
    grad_scale = clipped_scale(grad_scale, max_norm, sumsq);
    for (int j = threadIdx.x; j < c.len; j += blockDim.x) {
        const long i = c.start + j;
        float w = master[i];
        const float g = c.grad[j] * grad_scale + (decoupled ? 0.0f : c.wd * w);
        if (decoupled) w *= 1.0f - lr * c.wd;
        const float mi = beta1 * m[i] + (1.0f - beta1) * g;
        const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        w -= lr * (mi / bias_c1) / (sqrtf(vi / bias_c2) + eps);
        master[i] = w;
        if (c.work != nullptr) c.work[j] = bt_to_bf16(w);
    }
}

extern "C" __global__ void scale_f32(float* __restrict__ x, long n, float alpha) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x)
        x[i] *= alpha;
}

extern "C" __global__ void grad_accumulate(float* __restrict__ acc, float* __restrict__ g, long n,
                                           float w, int mode) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x) {
        const float wg = __fmul_rn(w, g[i]);
        switch (mode) {
            case 0: acc[i] = wg; break;
            case 1: acc[i] = __fadd_rn(acc[i], wg); break;
            case 2: g[i] = __fadd_rn(acc[i], wg); break;
            default: g[i] = wg; break;
        }
    }
}
