// conv2_apply_check.cpp: the v2 kernels that apply a batch norm to their input as they load it
// (conv2_fwd_apply_*, conv2_fwd_stats_apply_*, conv2_wgrad_apply_*) and the data gradient's
// batch-norm epilogue with its ReLU mask recomputed from the batch norm's input
// (conv2_dgrad_bn_* with bn_y null and relu set), run on the host emulator against their
// composition: bn.cu's bn_apply_vec writing y, then the plain kernel reading y (or the epilogue
// reading y's mask), to the bit. conv2_check.cpp holds the plain kernels to f64 references, so
// the same bits here mean the same accuracy. Shapes are small and odd: 3×3 with padding 1 at
// strides 1 and 2 (the zero-filled halo must stay 0, not become ReLU(BN(0))), odd heights and
// widths, tails in M and N, channel counts that split a k-step over taps (16, 24, 40) and
// that fill it (64, 96); γ of both signs and zero (the ReLU zeroes part of y), with and without
// the ReLU. Every kernel runs twice, the second time with its blocks in another order.
#include "emu.h"
#include "conv2_x.cu"  // conv2.cu with common.cuh expanded (written by the test)
#include "bn_ns.cu"    // bn.cu in namespace k_bn: bn_apply_vec, the composition's first pass
#include <cstdio>
#include <cstring>
#include <random>
#include <string>

static int failures = 0;

struct Case { int n, h, w, c, k, r, stride, pad, relu; };
struct Kernel { const char* name; int bm, bn, threads; };

typedef void (*FwdFn)(const bf16*, const bf16*, bf16*, Conv2Args);
typedef void (*FwdApplyFn)(const bf16*, const bf16*, bf16*, Conv2Args, const float*, const float*, const bf16*,
                           const bf16*, int);
typedef void (*FwdStatsFn)(const bf16*, const bf16*, bf16*, Conv2Args, float*);
typedef void (*FwdStatsApplyFn)(const bf16*, const bf16*, bf16*, Conv2Args, float*, const float*, const float*,
                                const bf16*, const bf16*, int);
typedef void (*WgradFn)(const bf16*, const bf16*, float*, Conv2Args);
typedef void (*WgradApplyFn)(const bf16*, const bf16*, float*, Conv2Args, const float*, const float*, const bf16*,
                             const bf16*, int);
typedef void (*DgradBnFn)(const bf16*, const bf16*, bf16*, Conv2Args, float*, const bf16*, const bf16*,
                          const float*, const float*, const bf16*, const bf16*, const bf16*, int);

template <class F>
static void run(const Kernel& k, dim3e grid, F body) { emu_launch(grid, {(unsigned)k.threads, 1, 1}, body); }

static int check_bits(const std::string& what, const void* got, const void* want, size_t bytes) {
    const bool same = memcmp(got, want, bytes) == 0;
    printf("  %-44s %s\n", what.c_str(), same ? "ok" : "FAIL (bits differ)");
    failures += !same;
    return !same;
}

// Runs `body` twice (row-major, then another block order) on poisoned copies of `out`; both
// must give the reference's bits.
template <class V, class F>
static void twice(const std::string& what, const V& want, V& out, F body) {
    const V poison = out;
    for (int order = 0; order < 2; ++order) {
        out = poison;
        g_emu_block_order = order ? 0xa991 : 0;
        body();
        g_emu_block_order = 0;
        check_bits(what + (order ? " (other block order)" : ""), out.data(), want.data(),
                   want.size() * sizeof(want[0]));
    }
}

static Conv2Args args_of(const Case& cs) {
    Conv2Args a{};
    a.n = cs.n; a.h = cs.h; a.w = cs.w; a.c = cs.c; a.k = cs.k; a.r = cs.r; a.s = cs.r;
    a.stride = cs.stride; a.pad = cs.pad; a.stride_w = cs.stride; a.pad_w = cs.pad;
    a.c_real = cs.c; a.s_real = cs.r; a.pair_lead = -1;
    a.p = (cs.h + 2 * cs.pad - cs.r) / cs.stride + 1; a.q = (cs.w + 2 * cs.pad - cs.r) / cs.stride + 1;
    return a;
}

static std::vector<bf16> random_bf16(size_t n, float scale, float shift, std::mt19937& rng) {
    std::uniform_real_distribution<float> U(-1, 1);
    std::vector<bf16> v(n);
    for (auto& e : v) e = __float2bfloat16_rn(U(rng) * scale + shift);
    return v;
}

static void run_case(const Case& cs, std::mt19937& rng) {
    const Conv2Args a = args_of(cs);
    const int C = cs.c, K = cs.k;
    printf("case n=%d h=%d w=%d c=%d k=%d r=%d stride=%d pad=%d relu=%d\n", cs.n, cs.h, cs.w, C, K, cs.r, cs.stride,
           cs.pad, cs.relu);
    const long xl = (long)a.n * a.h * a.w * C, M = (long)a.n * a.p * a.q, yl = M * K, wl = (long)K * a.r * a.s * C;
    // z around its channel's mean; γ of both signs with some zeros, β both signs (β > 0 where γ
    // is 0: ReLU(BN(·)) is then positive everywhere, padding included, unless it stays 0).
    std::uniform_real_distribution<float> U(-1, 1);
    std::vector<float> mean(C), invstd(C);
    std::vector<bf16> G(C), B(C), Z(xl);
    for (int c = 0; c < C; ++c) {
        mean[c] = 0.3f * U(rng) + 0.05f * (c % 5);
        invstd[c] = 0.5f + std::fabs(U(rng));
        const float g = c % 7 == 3 ? 0.0f : U(rng);
        G[c] = __float2bfloat16_rn(g);
        B[c] = __float2bfloat16_rn(g == 0.0f ? 0.25f + 0.5f * std::fabs(U(rng)) : 0.5f * U(rng));
    }
    for (long i = 0; i < xl; ++i) Z[i] = __float2bfloat16_rn(mean[i % C] + U(rng) * 1.5f);
    const std::vector<bf16> W = random_bf16(wl, 0.3f, 0.0f, rng), DY = random_bf16(yl, 1.0f, 0.0f, rng);
    // The composition's first pass: y = bn_apply(z).
    std::vector<bf16> Y(xl, bf16{0x7fc0});
    emu_launch({3, 1, 1}, {256, 1, 1}, [&] { k_bn::bn_apply_vec(Z.data(), mean.data(), invstd.data(), G.data(), B.data(), nullptr, Y.data(), xl, C, cs.relu); });
    long zeros = 0, negative = 0;
    for (auto v : Y) { zeros += __bfloat162float(v) == 0.0f; negative += __bfloat162float(v) < 0.0f; }
    printf("  y = bn_apply(z): %ld of %ld zero, %ld negative\n", zeros, xl, negative);
    if (cs.relu ? zeros == 0 || zeros == xl : negative == 0) { printf("  FAIL: the case does not exercise the ReLU\n"); ++failures; }

    const bool unit = a.r == 1 && a.pad == 0;
    const Kernel fwd[] = {{"conv2_fwd_128x128", 128, 128, 256}, {"conv2_fwd_128x64", 128, 64, 128},
                          {"conv2_fwd_1x1_128x128", 128, 128, 256}, {"conv2_fwd_1x1_128x64", 128, 64, 128}};
    const FwdFn fwd_fn[] = {conv2_fwd_128x128, conv2_fwd_128x64, conv2_fwd_1x1_128x128, conv2_fwd_1x1_128x64};
    const FwdStatsFn stats_fn[] = {conv2_fwd_stats_128x128, conv2_fwd_stats_128x64, conv2_fwd_stats_1x1_128x128,
                                   conv2_fwd_stats_1x1_128x64};
    const char* apply_name[] = {"conv2_fwd_apply_128x128", "conv2_fwd_apply_128x64", "conv2_fwd_apply_1x1_128x128",
                                "conv2_fwd_apply_1x1_128x64"};
    const FwdApplyFn apply_fn[] = {conv2_fwd_apply_128x128, conv2_fwd_apply_128x64, conv2_fwd_apply_1x1_128x128,
                                   conv2_fwd_apply_1x1_128x64};
    const char* stats_apply_name[] = {"conv2_fwd_stats_apply_128x128", "conv2_fwd_stats_apply_128x64",
                                      "conv2_fwd_stats_apply_1x1_128x128", "conv2_fwd_stats_apply_1x1_128x64"};
    const FwdStatsApplyFn stats_apply_fn[] = {conv2_fwd_stats_apply_128x128, conv2_fwd_stats_apply_128x64,
                                              conv2_fwd_stats_apply_1x1_128x128, conv2_fwd_stats_apply_1x1_128x64};
    for (int v = 0; v < 4; ++v) {
        if ((v >= 2) != unit) continue;  // the planner gives 1×1 layers the unit gather
        const dim3e grid{(unsigned)((M + fwd[v].bm - 1) / fwd[v].bm), (unsigned)((K + fwd[v].bn - 1) / fwd[v].bn), 1};
        std::vector<bf16> want(yl, bf16{0x7fc0}), got(yl, bf16{0x7fc0});
        run(fwd[v], grid, [&] { fwd_fn[v](Y.data(), W.data(), want.data(), a); });
        twice(std::string(apply_name[v]) + " y", want, got, [&] {
            run(fwd[v], grid, [&] { apply_fn[v](Z.data(), W.data(), got.data(), a, mean.data(), invstd.data(), G.data(), B.data(), cs.relu); });
        });
        // With statistics: y and every tile record.
        const size_t records = 2 * (size_t)grid.x * K;
        std::vector<bf16> want_s(yl, bf16{0x7fc0}), got_s(yl, bf16{0x7fc0});
        std::vector<float> part_want(records, NAN), part(records, NAN);
        run(fwd[v], grid, [&] { stats_fn[v](Y.data(), W.data(), want_s.data(), a, part_want.data()); });
        for (int order = 0; order < 2; ++order) {
            std::fill(got_s.begin(), got_s.end(), bf16{0x7fc0});
            std::fill(part.begin(), part.end(), NAN);
            g_emu_block_order = order ? 0x5e1f : 0;
            run(fwd[v], grid, [&] { stats_apply_fn[v](Z.data(), W.data(), got_s.data(), a, part.data(), mean.data(), invstd.data(), G.data(), B.data(), cs.relu); });
            g_emu_block_order = 0;
            const std::string what = std::string(stats_apply_name[v]) + (order ? " (other block order)" : "");
            check_bits(what + " y", got_s.data(), want_s.data(), yl * sizeof(bf16));
            check_bits(what + " records", part.data(), part_want.data(), records * sizeof(float));
        }
    }

    // Weight gradient, the reduction split in three slices (one plane each).
    Conv2Args sw = a;
    sw.k_chunk = (int)(((M + 2) / 3 + 31) / 32 * 32);
    const int splits = (int)((M + sw.k_chunk - 1) / sw.k_chunk);
    const int Nw = a.r * a.s * C;
    const Kernel wg[] = {{"conv2_wgrad_c8_64x128", 64, 128, 128},
                         {"conv2_wgrad_128x128", 128, 128, 256}, {"conv2_wgrad_64x128", 64, 128, 128},
                         {"conv2_wgrad_1x1_128x128", 128, 128, 256}, {"conv2_wgrad_1x1_64x128", 64, 128, 128}};
    const WgradFn wg_fn[] = {conv2_wgrad_c8_64x128, conv2_wgrad_128x128, conv2_wgrad_64x128,
                             conv2_wgrad_1x1_128x128, conv2_wgrad_1x1_64x128};
    const char* wg_apply_name[] = {"conv2_wgrad_apply_c8_64x128", "conv2_wgrad_apply_128x128", "conv2_wgrad_apply_64x128",
                                   "conv2_wgrad_apply_1x1_128x128", "conv2_wgrad_apply_1x1_64x128"};
    const WgradApplyFn wg_apply_fn[] = {conv2_wgrad_apply_c8_64x128, conv2_wgrad_apply_128x128, conv2_wgrad_apply_64x128,
                                        conv2_wgrad_apply_1x1_128x128, conv2_wgrad_apply_1x1_64x128};
    for (int v = 0; v < 5; ++v) {
        // The planner's choice: small C → c8; 1×1 at stride 1 → unit; else general.
        const int gather = C % 32 != 0 ? 0 : unit && a.stride == 1 ? 2 : 1;
        if ((v == 0 ? 0 : v <= 2 ? 1 : 2) != gather) continue;
        const dim3e grid{(unsigned)((K + wg[v].bm - 1) / wg[v].bm), (unsigned)((Nw + wg[v].bn - 1) / wg[v].bn), (unsigned)splits};
        std::vector<float> want((size_t)splits * wl, NAN), got((size_t)splits * wl, NAN);
        run(wg[v], grid, [&] { wg_fn[v](DY.data(), Y.data(), want.data(), sw); });
        twice(std::string(wg_apply_name[v]) + " dw planes", want, got, [&] {
            run(wg[v], grid, [&] { wg_apply_fn[v](DY.data(), Z.data(), got.data(), sw, mean.data(), invstd.data(), G.data(), B.data(), cs.relu); });
        });
    }

    // The data gradient's batch-norm epilogue: the mask from y (bn_y) against the mask
    // recomputed from z (bn_y null, relu, γ, β), with and without a residual gradient. Only
    // where the batch norm has a ReLU (without one there is no mask to recompute).
    if (!cs.relu) return;
    std::vector<bf16> WT(wl);
    emu_launch({3, 1, 1}, {64, 1, 1}, [&] { conv2_dgrad_weights(W.data(), WT.data(), a); });
    const int hn = (a.h + a.stride - 1) / a.stride, wn = (a.w + a.stride - 1) / a.stride;
    const int Md = a.n * hn * wn, phases = a.stride * a.stride;
    const Kernel dg[] = {{"conv2_dgrad_bn_128x128", 128, 128, 256}, {"conv2_dgrad_bn_128x64", 128, 64, 128},
                         {"conv2_dgrad_bn_1x1_128x128", 128, 128, 256}, {"conv2_dgrad_bn_1x1_128x64", 128, 64, 128}};
    const DgradBnFn dg_fn[] = {conv2_dgrad_bn_128x128, conv2_dgrad_bn_128x64, conv2_dgrad_bn_1x1_128x128,
                               conv2_dgrad_bn_1x1_128x64};
    const std::vector<bf16> R = random_bf16(xl, 1.0f, 0.0f, rng);
    for (int v = 0; v < 4; ++v) {
        if ((v >= 2) != unit) continue;
        const bf16* wsrc = v >= 2 ? W.data() : WT.data();
        const dim3e grid{(unsigned)((Md + dg[v].bm - 1) / dg[v].bm), (unsigned)((C + dg[v].bn - 1) / dg[v].bn), (unsigned)phases};
        const size_t records = 2 * (size_t)grid.x * grid.z * C;
        for (int residual = 0; residual < 2; ++residual) {
            const bf16* res = residual ? R.data() : nullptr;
            std::vector<bf16> want(xl, bf16{0x7fc0}), got(xl, bf16{0x7fc0});
            std::vector<float> part_want(records, NAN), part(records, NAN);
            run(dg[v], grid, [&] { dg_fn[v](DY.data(), wsrc, want.data(), a, part_want.data(), Y.data(), Z.data(), mean.data(), invstd.data(), res, nullptr, nullptr, 1); });
            for (int order = 0; order < 2; ++order) {
                std::fill(got.begin(), got.end(), bf16{0x7fc0});
                std::fill(part.begin(), part.end(), NAN);
                g_emu_block_order = order ? 0xd6ad : 0;
                run(dg[v], grid, [&] { dg_fn[v](DY.data(), wsrc, got.data(), a, part.data(), nullptr, Z.data(), mean.data(), invstd.data(), res, G.data(), B.data(), 1); });
                g_emu_block_order = 0;
                const std::string what = std::string(dg[v].name) + " mask from z" + (residual ? " +res" : "") +
                                         (order ? " (other block order)" : "");
                check_bits(what + " g", got.data(), want.data(), xl * sizeof(bf16));
                check_bits(what + " sums", part.data(), part_want.data(), records * sizeof(float));
            }
        }
    }
}

// `--first`: stop after the first case with a failure (the test's deliberately broken copies).
int main(int argc, char** argv) {
    const bool first = argc > 1 && std::string(argv[1]) == "--first";
    std::mt19937 rng(7);
    const Case cases[] = {
        {2, 7, 9, 16, 24, 3, 1, 1, 1},    // 3×3 pad 1 stride 1, 16 channels (two taps per k-step), N tail
        {1, 9, 11, 24, 40, 3, 2, 1, 1},   // stride 2, odd sizes, 24 channels (a k-step over 2-3 taps)
        {2, 7, 6, 64, 72, 3, 1, 1, 1},    // 64 channels (the general wgrad gather), N = 72 over two tiles
        {1, 9, 7, 64, 16, 3, 2, 1, 0},    // stride 2 without the ReLU
        {1, 6, 5, 96, 32, 3, 1, 1, 1},    // 96 channels: three k-steps per tap
        {3, 12, 12, 40, 8, 1, 1, 0, 1},   // 1×1 stride 1, M = 432 > 128, 40 = 32 + 8 channels (a k-step tail)
        {2, 9, 9, 64, 136, 1, 1, 0, 1},   // 1×1 stride 1 on 64 channels (the unit wgrad gather), N > 128
        {1, 9, 9, 32, 24, 1, 2, 0, 0},    // 1×1 stride 2 (strided rows; wgrad on the general gather), no ReLU
    };
    for (const auto& c : cases) {
        run_case(c, rng);
        if (first && failures) break;
    }
    printf(failures ? "FAILED (%d checks)\n" : "ALL OK\n", failures);
    return failures ? 1 : 0;
}
