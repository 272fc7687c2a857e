// input.cu: the input transform, u8 NHWC batch from the input engine → normalised bf16 NHWC,
// with the training augmentation (random crop, horizontal flip) done on the GPU.
//
// Algorithm. For output pixel (n, y, x, c) of an O_h×O_w crop, the source pixel is
// (top_n + y, left_n + (flip_n ? O_w − 1 − x : x)) of the S_h×S_w stored image. A source pixel
// outside the image (a crop offset into padding) reads as 0, the same zero padding as the CPU
// backend's `Augment`. The value is normalised v = (u8/255 − mean_c) / std_c with the ImageNet
// statistics (torchvision convention) and stored as bf16. Output channels beyond the source's
// (padding the stem to a vector-friendly channel count) are written as zeros.
// The host draws (top, left, flip) per sample from the same seeded generator as the CPU backend,
// so both backends see identical crops.
//
// Data layout. src: u8 [N, S_h, S_w, C_in]; params: i32 [N][3] = (top, left, flip);
// mean, inv_std: f32 [C_in]; dst: bf16 [N, O_h, O_w, C_out] with C_out ≥ C_in.
//
// Launch configuration. One thread per output element, 256 threads, grid-stride loop; adjacent
// threads write adjacent channels and pixels, so stores are coalesced and the u8 reads mostly so.
#include "common.cuh"

extern "C" __global__ void input_transform(const u8* __restrict__ src, const int* __restrict__ params,
                                           const float* __restrict__ mean,
                                           const float* __restrict__ inv_std, bf16* __restrict__ dst,
                                           int n, int src_h, int src_w, int c_in, int out_h,
                                           int out_w, int c_out) {
    const long total = (long)n * out_h * out_w * c_out;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const int c = (int)(i % c_out);
        long rest = i / c_out;
        const int x = (int)(rest % out_w); rest /= out_w;
        const int y = (int)(rest % out_h);
        const int b = (int)(rest / out_h);
        float v = 0.0f;
        if (c < c_in) {
            const int top = params[b * 3], left = params[b * 3 + 1], flip = params[b * 3 + 2];
            const int sy = top + y, sx = left + (flip ? out_w - 1 - x : x);
            const float raw = (sy >= 0 && sy < src_h && sx >= 0 && sx < src_w)
                                  ? (float)src[(((long)b * src_h + sy) * src_w + sx) * c_in + c]
                                  : 0.0f;
            v = (raw * (1.0f / 255.0f) - mean[c]) * inv_std[c];
        }
        dst[i] = bt_to_bf16(v);
    }
}
