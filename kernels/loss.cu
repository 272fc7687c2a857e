// loss.cu: softmax cross-entropy, forward and backward fused in one pass.
//
// Algorithm. Per row: m = max(z), lse = m + log Σ exp(z − m), loss = lse − z[label],
// dlogits = (softmax(z) − onehot(label)) · scale, where scale = 1 / global batch size (the mean
// over the batch, split across replicas). The row's prediction (first arg max) is compared with
// the label for the accuracy count. A label outside [0, K) marks a padded sample: it gets zero
// loss, zero gradient and does not count.
//
// Data layout. logits, dlogits: f32 [N,K]; labels: i32 [N]; loss: f32 [N]; correct: i32 [N]
// (1 when the arg max equals the label).
//
// Launch configuration. One block of 128 threads per row (grid N); block-wide max and sum
// reductions through warp shuffles.
#include "common.cuh"

extern "C" __global__ void softmax_xent(const float* __restrict__ logits, const int* __restrict__ labels,
                                        float* __restrict__ loss, float* __restrict__ dlogits,
                                        int* __restrict__ correct, int k, float scale) {
    __shared__ float scratch[32];
    __shared__ int s_arg[32];
    const long row = blockIdx.x;
    const float* z = logits + row * k;
    float* dz = dlogits + row * k;
    const int label = labels[row];
    const bool valid = label >= 0 && label < k;

    float m = BT_NEG_INF;
    int arg = k;
    for (int j = threadIdx.x; j < k; j += blockDim.x)
        if (z[j] > m) { m = z[j]; arg = j; }
    const float row_max = bt_block_max(m, scratch);
    // First index reaching the maximum: min over candidates.
    int cand = (m == row_max) ? arg : k;
    for (int off = 16; off > 0; off >>= 1) cand = min(cand, __shfl_xor_sync(0xffffffffu, cand, off));
    if (threadIdx.x % BT_WARP == 0) s_arg[threadIdx.x / BT_WARP] = cand;
    __syncthreads();
    if (threadIdx.x == 0) {
        int best = k;
        for (int w = 0; w < (int)(blockDim.x + BT_WARP - 1) / BT_WARP; ++w) best = min(best, s_arg[w]);
        s_arg[0] = best;
    }
    float sum = 0.0f;
    for (int j = threadIdx.x; j < k; j += blockDim.x) sum += __expf(z[j] - row_max);
    sum = bt_block_sum(sum, scratch);  // its internal barriers also publish s_arg[0]
    const float inv = 1.0f / sum;
    for (int j = threadIdx.x; j < k; j += blockDim.x) {
        const float p = __expf(z[j] - row_max) * inv;
        dz[j] = valid ? (p - (j == label ? 1.0f : 0.0f)) * scale : 0.0f;
    }
    if (threadIdx.x == 0) {
        loss[row] = valid ? (row_max + __logf(sum)) - z[label] : 0.0f;
        correct[row] = valid && s_arg[0] == label ? 1 : 0;
    }
}
