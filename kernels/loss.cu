// loss.cu: softmax cross-entropy with label smoothing, forward and backward fused in one pass.
//
// Algorithm. Per row z (K logits), with ε the label smoothing: m = max z,
// lse = m + log Σ exp(z − m), loss = lse − (1−ε)·z[label] − ε·mean(z) (PyTorch's definition,
// target = (1−ε)·onehot + ε/K), dz = (softmax(z) − target) / N (gradient of the batch mean).
// A mixed batch (mixup, CutMix) gives row r the target w·t(label_r) + (1 − w)·t(label_{N−1−r})
// with w = *own_weight_at (1: no mixing; N = gridDim.x), so the loss uses w·z[label_r] +
// (1 − w)·z[label_partner] where it used z[label]; the rank stays that of the row's own label.
// `rank` counts the logits strictly greater than z[label] (0 = top-1 correct, < 5 = top-5), the
// CPU reference's rule; a row holding a NaN or infinite logit gets rank INT_MAX (never correct,
// not even top-5 with fewer than 5 classes). Softmax probabilities are written when `probs` is not null, the
// gradient when `dlogits` is not null. Labels are validated on the host before the launch.
//
// Data layout. logits, dlogits: bf16 [N,K]; labels: i32 [N]; loss: f32 [N]; rank: i32 [N];
// probs: f32 [N,K]. The per-step values (own_weight_at, stop) are device values uploaded before
// the step, so that a captured CUDA graph replays with each step's own.
//
// Launch configuration. One block of 128 threads per row (grid N); block-wide max and sum
// reductions through warp shuffles, f32 throughout.
//
// loss_totals turns the per-row outputs into the step's figures without leaving the device:
// totals = [Σ loss, rows with rank 0 (top-1 hits), rows with rank < 5 (top-5 hits), N, stop],
// f64, where `*stop` (0 or 1) is this rank's wish to stop after the step;
// with N = 0 (a rank without images) the loss and rank pointers are not read. With `add` set
// (the second and later micro-batches of a --grad-accum-steps step) the first four figures are
// added to what `totals` holds, so the step's figures are the sum over its micro-batches.
// One block of 256 threads: each thread sums a strided share of the rows in f64, then a
// shared-memory tree halves the partial sums (a fixed order: the same bits every run). The
// trainer all-reduces `totals` on the device and reads it one step later, so a training step
// needs no host synchronisation.
#include "common.cuh"

extern "C" __global__ void softmax_xent(const bf16* __restrict__ logits, const int* __restrict__ labels,
                                        int k, float smoothing, const float* __restrict__ own_weight_at, float grad_scale,
                                        float* __restrict__ loss, int* __restrict__ rank,
                                        bf16* __restrict__ dlogits, float* __restrict__ probs) {
    __shared__ float scratch[32];
    const float own_weight = *own_weight_at;
    const long row = blockIdx.x;
    const bf16* z = logits + row * k;
    const int label = labels[row];
    const int partner = labels[gridDim.x - 1 - row];
    const float z_label = bt_to_f32(z[label]);
    // Unmixed rows read no other logit (0·inf would turn an infinite row's loss into NaN).
    const float z_target = own_weight == 1.0f ? z_label : own_weight * z_label + (1.0f - own_weight) * bt_to_f32(z[partner]);

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
            const float hot = (j == label ? own_weight : 0.0f) + (j == partner ? 1.0f - own_weight : 0.0f);
            const float target = smoothing / (float)k + (1.0f - smoothing) * hot;
            dlogits[row * k + j] = bt_to_bf16((p - target) * grad_scale);
        }
    }
    if (threadIdx.x == 0) {
        loss[row] = lse - (1.0f - smoothing) * z_target - smoothing * total / (float)k;
        rank[row] = nonfinite > 0.0f ? 0x7fffffff : (int)above;
    }
}

#define BT_TOTALS_THREADS 256

extern "C" __global__ void loss_totals(const float* __restrict__ loss, const int* __restrict__ rank,
                                       int n, const int* __restrict__ stop, int add, double* __restrict__ totals) {
    __shared__ double part[3][BT_TOTALS_THREADS];
    double l = 0.0, top1 = 0.0, top5 = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        l += (double)loss[i];
        top1 += rank[i] == 0 ? 1.0 : 0.0;
        top5 += rank[i] < 5 ? 1.0 : 0.0;
    }
    part[0][threadIdx.x] = l;
    part[1][threadIdx.x] = top1;
    part[2][threadIdx.x] = top5;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) {
            for (int k = 0; k < 3; ++k) part[k][threadIdx.x] += part[k][threadIdx.x + half];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        if (add) {
            totals[0] += part[0][0];
            totals[1] += part[1][0];
            totals[2] += part[2][0];
            totals[3] += (double)n;
        } else {
            totals[0] = part[0][0];
            totals[1] = part[1][0];
            totals[2] = part[2][0];
            totals[3] = (double)n;
        }
        totals[4] = (double)*stop;
    }
}
