// loss.cu: softmax cross-entropy with label smoothing, forward and backward fused in one pass.
//
// Algorithm. Per row z (K logits), with ε the label smoothing: m = max z,
// lse = m + log Σ exp(z − m), loss = lse − (1−ε)·z[label] − ε·mean(z) (PyTorch's definition,
// target = (1−ε)·onehot + ε/K), dz = (softmax(z) − target) / N (gradient of the batch mean).
// `rank` counts the logits strictly greater than z[label] (0 = top-1 correct, < 5 = top-5), the
// CPU reference's rule; a row holding a NaN or infinite logit gets rank INT_MAX (never correct,
// not even top-5 with fewer than 5 classes). Softmax probabilities are written when `probs` is not null, the
// gradient when `dlogits` is not null. Labels are validated on the host before the launch.
//
// Data layout. logits, dlogits: bf16 [N,K]; labels: i32 [N]; loss: f32 [N]; rank: i32 [N];
// probs: f32 [N,K].
//
// Launch configuration. One block of 128 threads per row (grid N); block-wide max and sum
// reductions through warp shuffles, f32 throughout.
#include "common.cuh"

extern "C" __global__ void softmax_xent(const bf16* __restrict__ logits, const int* __restrict__ labels,
                                        int k, float smoothing, float grad_scale,
                                        float* __restrict__ loss, int* __restrict__ rank,
                                        bf16* __restrict__ dlogits, float* __restrict__ probs) {
    __shared__ float scratch[32];
    const long row = blockIdx.x;
    const bf16* z = logits + row * k;
    const int label = labels[row];
    const float z_label = bt_to_f32(z[label]);

    float m = BT_NEG_INF, total = 0.0f, above = 0.0f, nonfinite = 0.0f;
    for (int j = threadIdx.x; j < k; j += blockDim.x) {
        const float v = bt_to_f32(z[j]);
        m = fmaxf(m, v);
        total += v;
        above += v > z_label ? 1.0f : 0.0f;
        nonfinite += isfinite(v) ? 0.0f : 1.0f;
    }
    const float row_max = bt_block_max(m, scratch);
    total = bt_block_sum(total, scratch);
    above = bt_block_sum(above, scratch);
    nonfinite = bt_block_sum(nonfinite, scratch);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < k; j += blockDim.x) sum += expf(bt_to_f32(z[j]) - row_max);
    sum = bt_block_sum(sum, scratch);
    const float lse = row_max + logf(sum);
    for (int j = threadIdx.x; j < k; j += blockDim.x) {
        const float p = expf(bt_to_f32(z[j]) - lse);
        if (probs != nullptr) probs[row * k + j] = p;
        if (dlogits != nullptr) {
            const float target = smoothing / (float)k + (j == label ? 1.0f - smoothing : 0.0f);
            dlogits[row * k + j] = bt_to_bf16((p - target) * grad_scale);
        }
    }
    if (threadIdx.x == 0) {
        loss[row] = lse - (1.0f - smoothing) * z_label - smoothing * total / (float)k;
        rank[row] = nonfinite > 0.0f ? 0x7fffffff : (int)above;
    }
}
