// input.cu: the input transform, u8 NHWC batch from the input engine → normalised bf16 NHWC,
// with the training augmentation (pad-and-crop shift, horizontal flip) done on the GPU.
//
// Algorithm. Exactly the CPU backend's rule (model::Augment): output pixel (y, x) of image n
// reads source pixel (y + dy_n, x' + dx_n) with x' = flip_n ? S − 1 − x : x; a source outside
// the image gives 0 in normalised space (PyTorch pads the normalised tensor), and so does an
// output pixel inside the image's erased box (torchvision's RandomErasing, value 0). Values are
// normalised v = u8/255·(1/std_c) − mean_c/std_c with the ImageNet statistics (torchvision) and
// stored as bf16. The host draws no randomness here: (dy, dx, flip) arrive per image from the
// trainer, which draws them from (seed, epoch, sample), so every backend sees identical crops.
// A mixed batch (timm's mixup and CutMix, batch mode) then combines image b with its partner
// n − 1 − b, each augmented: mixup writes λ·v_b + (1 − λ)·v_partner everywhere, CutMix takes
// the partner's value inside the box and b's outside; λ and the box come from the trainer.
//
// Data layout. src: u8 [N,S,S,3]; aug: i32 [N][7] = (dy, dx, flip, ey0, ey1, ex0, ex1); scale, shift: f32 [3]
// (1/(255·std_c) and −mean_c/std_c); mix: one InputMix in device memory
// (uploaded before the step, so that a captured CUDA graph replays with each step's own); dst: bf16 [N,S,S,3].
//
// input_transform_pairs does the same (without mixing) and also writes the copy of the batch that the v2
// stem convolution reads with 16-byte copies (kernels/conv2.cu, "The stem"): pairs of pixels of 4
// channels. (The host makes that copy with conv2_pair_pixels today.)
//
// Launch configuration. input_transform: one thread per output element, 256 threads,
// grid-stride loop; adjacent threads write adjacent channels and pixels (coalesced stores,
// mostly coalesced u8 reads). input_transform_pairs: one thread per pixel pair, 256 threads,
// grid-stride; each writes its pixels' 3 channels and one 16-byte pair.
#include "common.cuh"

// The batch's mixing (model::Mix), read from device memory: kind BT_MIX_NONE, BT_MIX_BLEND (mixup,
// weight lambda) or BT_MIX_PASTE (CutMix, box rows y0..y1, columns x0..x1, ends excluded).
// Ints per image in `aug`: dy, dx, flip, then the erased box ey0, ey1, ex0, ex1 (empty: 0s).
#define BT_AUG_INTS 7
#define BT_MIX_NONE 0
#define BT_MIX_BLEND 1
#define BT_MIX_PASTE 2
struct InputMix {
    int kind;
    float lambda;
    int y0, y1, x0, x1;
};

// One image's normalised value at output (y, x, c), after its own shift and mirror.
__device__ __forceinline__ float bt_input_value(const u8* __restrict__ src, const int* __restrict__ aug,
                                                int use_aug, const float* __restrict__ scale,
                                                const float* __restrict__ shift, int b, int y, int x,
                                                int c, int size) {
    int dy = 0, dx = 0, flip = 0;
    if (use_aug) {
        const int* a = aug + b * BT_AUG_INTS;
        dy = a[0]; dx = a[1]; flip = a[2];
        if (y >= a[3] && y < a[4] && x >= a[5] && x < a[6]) return 0.0f;  // erased
    }
    const int sy = y + dy, sx = (flip ? size - 1 - x : x) + dx;
    if (sy < 0 || sy >= size || sx < 0 || sx >= size) return 0.0f;
    return (float)src[(((long)b * size + sy) * size + sx) * 3 + c] * scale[c] + shift[c];
}

extern "C" __global__ void input_transform(const u8* __restrict__ src, const int* __restrict__ aug,
                                           int use_aug, const float* __restrict__ scale,
                                           const float* __restrict__ shift, const InputMix* __restrict__ mix_at,
                                           bf16* __restrict__ dst, int n, int size) {
    const InputMix mix = *mix_at;
    const long total = (long)n * size * size * 3;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const int c = (int)(i % 3);
        long rest = i / 3;
        const int x = (int)(rest % size); rest /= size;
        const int y = (int)(rest % size);
        const int b = (int)(rest / size);
        const int partner = n - 1 - b;
        float v;
        if (mix.kind == BT_MIX_PASTE && y >= mix.y0 && y < mix.y1 && x >= mix.x0 && x < mix.x1) {
            v = bt_input_value(src, aug, use_aug, scale, shift, partner, y, x, c, size);
        } else {
            v = bt_input_value(src, aug, use_aug, scale, shift, b, y, x, c, size);
            if (mix.kind == BT_MIX_BLEND)
                v = mix.lambda * v + (1.0f - mix.lambda) * bt_input_value(src, aug, use_aug, scale, shift, partner, y, x, c, size);
        }
        dst[i] = bt_to_bf16(v);
    }
}

// dst as input_transform; dst_pairs: bf16 [N,S,⌈S/2⌉,8], the same values as pairs of horizontally
// adjacent pixels of 4 channels (pixels 2j and 2j+1 of a row, channel 3 zero, and an odd S's
// pixel S zero): the paired stem's input (kernels/conv2.cu, "The stem"; conv2_pair_pixels's layout).
extern "C" __global__ void input_transform_pairs(const u8* __restrict__ src, const int* __restrict__ aug,
                                                 int use_aug, const float* __restrict__ scale,
                                                 const float* __restrict__ shift, bf16* __restrict__ dst,
                                                 bf16* __restrict__ dst_pairs, int n, int size) {
    const int pairs_w = (size + 1) / 2;
    const long pairs = (long)n * size * pairs_w;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < pairs; i += (long)gridDim.x * blockDim.x) {
        const int j = (int)(i % pairs_w);
        const long rest = i / pairs_w;
        const int y = (int)(rest % size);
        const int b = (int)(rest / size);
        int dy = 0, dx = 0, flip = 0, ey0 = 0, ey1 = 0, ex0 = 0, ex1 = 0;
        if (use_aug) {
            const int* a = aug + b * BT_AUG_INTS;
            dy = a[0]; dx = a[1]; flip = a[2]; ey0 = a[3]; ey1 = a[4]; ex0 = a[5]; ex1 = a[6];
        }
        union { uint4 v; bf16 e[8]; } u;
#pragma unroll
        for (int c = 0; c < 8; ++c) u.e[c] = bt_to_bf16(0.0f);
#pragma unroll
        for (int px = 0; px < 2; ++px) {
            const int x = 2 * j + px;
            if (x >= size) break;  // an odd row's last pair: its second pixel stays zero
            const bool erased = y >= ey0 && y < ey1 && x >= ex0 && x < ex1;
            const int sy = y + dy, sx = (flip ? size - 1 - x : x) + dx;
            const bool inside = !erased && sy >= 0 && sy < size && sx >= 0 && sx < size;
            const long from = (((long)b * size + sy) * size + sx) * 3, to = (((long)b * size + y) * size + x) * 3;
#pragma unroll
            for (int c = 0; c < 3; ++c) {
                const bf16 v = bt_to_bf16(inside ? (float)src[from + c] * scale[c] + shift[c] : 0.0f);
                dst[to + c] = v;
                u.e[4 * px + c] = v;
            }
        }
        *reinterpret_cast<uint4*>(dst_pairs + i * 8) = u.v;
    }
}
