// conv2_check.cpp: every kernel of conv2.cu (forward, phased dgrad, split wgrad, each in its
// general and 1×1 forms and in every tile shape, plus the weight rearrangement and channel
// padding helpers) run on the host emulator (emu.h, cp.async pipeline included) against a
// direct f64 convolution. Shapes are small and odd: tails in every GEMM dimension, channel
// counts that do not divide the 32-wide k-step (a k-step then spans several filter taps),
// stride 2 and 3 (4 and 9 dgrad phases, some without taps), the padded 3-channel stem.
#include "emu.h"
#include "conv2_x.cu"  // conv2.cu with common.cuh expanded (written by the test)
#include <cstdio>
#include <random>
#include <string>

static float rb(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
static int failures = 0;

struct Case { int n, h, w, c, k, r, stride, pad; };

typedef void (*FwdFn)(const bf16*, const bf16*, bf16*, Conv2Args);
typedef void (*WgradFn)(const bf16*, const bf16*, float*, Conv2Args);
struct Kernel { const char* name; int bm, bn, threads; };

template <class F>
static void run(const Kernel& k, dim3e grid, F body) { emu_launch(grid, {(unsigned)k.threads, 1, 1}, body); }

static int check(const std::string& what, const std::vector<double>& got, const std::vector<double>& ref, double tol, double eps) {
    int bad = 0; double worst = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
        const double e = std::fabs(got[i] - ref[i]) - (tol + std::fabs(ref[i]) * eps);
        if (e > 0 || std::isnan(got[i])) { if (bad < 3) printf("    %s[%zu]: got %f want %f\n", what.c_str(), i, got[i], ref[i]); ++bad; }
        worst = std::max(worst, std::fabs(got[i] - ref[i]));
    }
    printf("  %-34s %s (max abs err %.3g over %zu)\n", what.c_str(), bad ? "FAIL" : "ok", worst, ref.size());
    failures += bad > 0;
    return bad;
}

static std::vector<double> widen(const std::vector<bf16>& v) {
    std::vector<double> o(v.size());
    for (size_t i = 0; i < v.size(); ++i) o[i] = __bfloat162float(v[i]);
    return o;
}

// The phase-ordered dgrad weight has as many elements as the weight itself.
static void run_case(Case cs, std::mt19937& rng) {
    const int cp = (cs.c + 7) / 8 * 8;  // channels as stored (the stem pads 3 to 8)
    Conv2Args a{};
    a.n = cs.n; a.h = cs.h; a.w = cs.w; a.c = cp; a.k = cs.k; a.r = cs.r; a.s = cs.r;
    a.stride = cs.stride; a.pad = cs.pad; a.c_real = cs.c;
    a.p = (cs.h + 2 * cs.pad - cs.r) / cs.stride + 1; a.q = (cs.w + 2 * cs.pad - cs.r) / cs.stride + 1;
    printf("case n=%d h=%d w=%d c=%d k=%d r=%d stride=%d pad=%d\n", cs.n, cs.h, cs.w, cs.c, cs.k, cs.r, cs.stride, cs.pad);
    const long pixels_in = (long)a.n * a.h * a.w, pixels_out = (long)a.n * a.p * a.q;
    const long xl = pixels_in * cs.c, yl = pixels_out * a.k, wl = (long)a.k * a.r * a.s * cs.c;
    std::uniform_real_distribution<float> U(-1, 1);
    std::vector<float> x(xl), w(wl), dy(yl), dx0(pixels_in * cp);
    for (auto& v : x) v = rb(U(rng));
    for (auto& v : w) v = rb(U(rng) * 0.3f);
    for (auto& v : dy) v = rb(U(rng));
    for (auto& v : dx0) v = rb(U(rng));
    auto tobf = [](const std::vector<float>& v) { std::vector<bf16> o(v.size()); for (size_t i = 0; i < v.size(); ++i) o[i] = __float2bfloat16_rn(v[i]); return o; };
    auto X3 = tobf(x), W3 = tobf(w), DY = tobf(dy);

    // f64 references on the real channels
    std::vector<double> y_ref(yl, 0), dx_ref(xl, 0), dw_ref(wl, 0);
    for (int n = 0; n < a.n; ++n) for (int p = 0; p < a.p; ++p) for (int q = 0; q < a.q; ++q) for (int k = 0; k < a.k; ++k)
        for (int r = 0; r < a.r; ++r) for (int s = 0; s < a.s; ++s) {
            const int hh = p * a.stride - a.pad + r, ww = q * a.stride - a.pad + s;
            if (hh < 0 || hh >= a.h || ww < 0 || ww >= a.w) continue;
            for (int c = 0; c < cs.c; ++c) {
                const long xi = (((long)n * a.h + hh) * a.w + ww) * cs.c + c, wi = (((long)k * a.r + r) * a.s + s) * cs.c + c;
                const long yi = (((long)n * a.p + p) * a.q + q) * a.k + k;
                y_ref[yi] += (double)x[xi] * w[wi];
                dx_ref[xi] += (double)dy[yi] * w[wi];
                dw_ref[wi] += (double)dy[yi] * x[xi];
            }
        }

    // Inputs as the kernels see them: channels padded to a multiple of 8 by conv2_pad_channels.
    std::vector<bf16> X = X3, W = W3;
    if (cp != cs.c) {
        X.assign(pixels_in * cp, bf16{});
        W.assign((long)a.k * a.r * a.s * cp, bf16{0x7fc0});  // NaN: every element must be written
        std::fill(X.begin(), X.end(), bf16{0x7fc0});
        long rows_x = pixels_in, rows_w = (long)a.k * a.r * a.s;
        emu_launch({2, 1, 1}, {64, 1, 1}, [&] { conv2_pad_channels(X3.data(), X.data(), rows_x, cs.c, cp); });
        emu_launch({2, 1, 1}, {64, 1, 1}, [&] { conv2_pad_channels(W3.data(), W.data(), rows_w, cs.c, cp); });
        std::vector<double> xr(pixels_in * cp), xg = widen(X);
        for (long i = 0; i < pixels_in; ++i) for (int c = 0; c < cp; ++c) xr[i * cp + c] = c < cs.c ? x[i * cs.c + c] : 0.0;
        check("pad_channels x", xg, xr, 0, 0);
    }
    const bool unit = a.r == 1 && a.pad == 0;

    // forward
    const int M = (int)pixels_out;
    const Kernel fwd[] = {{"conv2_fwd_128x128", 128, 128, 256}, {"conv2_fwd_128x64", 128, 64, 128},
                          {"conv2_fwd_1x1_128x128", 128, 128, 256}, {"conv2_fwd_1x1_128x64", 128, 64, 128}};
    const FwdFn fwd_fn[] = {conv2_fwd_128x128, conv2_fwd_128x64, conv2_fwd_1x1_128x128, conv2_fwd_1x1_128x64};
    for (int v = 0; v < 4; ++v) {
        if (v >= 2 && !unit) continue;
        std::vector<bf16> Y(yl, bf16{0x7fc0});
        run(fwd[v], {(unsigned)((M + fwd[v].bm - 1) / fwd[v].bm), (unsigned)((a.k + fwd[v].bn - 1) / fwd[v].bn), 1},
            [&] { fwd_fn[v](X.data(), W.data(), Y.data(), a); });
        check(fwd[v].name, widen(Y), y_ref, 1e-2, 1.0 / 128);
    }

    // dgrad (the stem never needs it: the image has no gradient)
    if (cp == cs.c) {
        std::vector<bf16> WT(wl);
        emu_launch({3, 1, 1}, {64, 1, 1}, [&] { conv2_dgrad_weights(W.data(), WT.data(), a); });
        const int hn = (a.h + a.stride - 1) / a.stride, wn = (a.w + a.stride - 1) / a.stride;
        const int Md = a.n * hn * wn, phases = a.stride * a.stride;
        const Kernel dg[] = {{"conv2_dgrad_128x128", 128, 128, 256}, {"conv2_dgrad_128x64", 128, 64, 128},
                             {"conv2_dgrad_1x1_128x128", 128, 128, 256}, {"conv2_dgrad_1x1_128x64", 128, 64, 128}};
        const FwdFn dg_fn[] = {conv2_dgrad_128x128, conv2_dgrad_128x64, conv2_dgrad_1x1_128x128, conv2_dgrad_1x1_128x64};
        for (int v = 0; v < 4; ++v) {
            if (v >= 2 && !unit) continue;
            const bf16* wsrc = v >= 2 ? W.data() : WT.data();
            for (int acc = 0; acc < 2; ++acc) {
                Conv2Args aa = a; aa.accumulate = acc;
                std::vector<bf16> DX(xl, bf16{0x7fc0});
                std::vector<double> ref = dx_ref;
                if (acc) { DX = tobf(std::vector<float>(dx0.begin(), dx0.begin() + xl)); for (long i = 0; i < xl; ++i) ref[i] += dx0[i]; }
                run(dg[v], {(unsigned)((Md + dg[v].bm - 1) / dg[v].bm), (unsigned)((a.c + dg[v].bn - 1) / dg[v].bn), (unsigned)phases},
                    [&] { dg_fn[v](DY.data(), wsrc, DX.data(), aa); });
                check(std::string(dg[v].name) + (acc ? " +=" : ""), widen(DX), ref, 1e-2, 1.0 / 128);
            }
        }
    }

    // wgrad, its reduction split in three slices
    const int red = (int)pixels_out;
    Conv2Args sw = a;
    int splits = 3;
    sw.k_chunk = ((red + splits - 1) / splits + 31) / 32 * 32;
    splits = (red + sw.k_chunk - 1) / sw.k_chunk;
    const int Nw = a.r * a.s * cp;
    const Kernel wg[] = {{"conv2_wgrad_c8_64x128", 64, 128, 128},
                         {"conv2_wgrad_128x128", 128, 128, 256}, {"conv2_wgrad_64x128", 64, 128, 128},
                         {"conv2_wgrad_1x1_128x128", 128, 128, 256}, {"conv2_wgrad_1x1_64x128", 64, 128, 128}};
    const WgradFn wg_fn[] = {conv2_wgrad_c8_64x128, conv2_wgrad_128x128, conv2_wgrad_64x128,
                             conv2_wgrad_1x1_128x128, conv2_wgrad_1x1_64x128};
    for (int v = 0; v < 5; ++v) {
        if (v >= 1 && v < 3 && cp % 32 != 0) continue;
        if (v >= 3 && !(unit && a.stride == 1)) continue;
        // One plane per slice, poisoned: every element must be stored by its slice.
        std::vector<float> planes((size_t)splits * wl, NAN), DW(wl, NAN);
        run(wg[v], {(unsigned)((a.k + wg[v].bm - 1) / wg[v].bm), (unsigned)((Nw + wg[v].bn - 1) / wg[v].bn), (unsigned)splits},
            [&] { wg_fn[v](DY.data(), X.data(), planes.data(), sw); });
        emu_launch({4, 1, 1}, {64, 1, 1}, [&] { conv2_wgrad_reduce(planes.data(), DW.data(), wl, splits); });
        check(wg[v].name, std::vector<double>(DW.begin(), DW.end()), dw_ref, 1e-3, 1e-4);
    }
}

// conv2_wgrad_reduce alone: planes summed in slice order, on the 16-byte path and the
// element path (a length that is not a multiple of 4).
static void reduce_case(long len, int slices, std::mt19937& rng) {
    std::uniform_real_distribution<float> U(-1, 1);
    std::vector<float> planes((size_t)slices * len), dw(len, NAN);
    for (auto& v : planes) v = U(rng);
    std::vector<double> ref(len);
    for (long i = 0; i < len; ++i) {
        float sum = planes[i];
        for (int z = 1; z < slices; ++z) sum += planes[z * len + i];
        ref[i] = sum;
    }
    emu_launch({3, 1, 1}, {32, 1, 1}, [&] { conv2_wgrad_reduce(planes.data(), dw.data(), len, slices); });
    // The same order as the reference: bit-identical.
    check("conv2_wgrad_reduce len " + std::to_string(len), std::vector<double>(dw.begin(), dw.end()), ref, 0.0, 0.0);
}

int main() {
    std::mt19937 rng(1);
    const Case cases[] = {
        {2, 9, 7, 3, 16, 7, 2, 3},    // the stem: 3 channels padded to 8, 7×7 stride 2
        {2, 16, 16, 3, 64, 7, 2, 3},  // the stem at 64 filters, wgrad slices of several k-steps
        {2, 6, 5, 16, 24, 3, 1, 1},   // 16 channels: a k-step spans two taps
        {1, 9, 11, 24, 40, 3, 2, 1},  // stride 2: four phases of 1, 2, 2, 4 taps; odd sizes
        {1, 5, 5, 8, 136, 1, 2, 0},   // 1×1 stride 2: strided rows, three tapless phases, N > 128
        {3, 12, 12, 40, 8, 1, 1, 0},  // 1×1 stride 1: plain GEMM, M > 128, 40 = 32 + 8 channels
        {1, 10, 13, 72, 72, 3, 1, 1}, // 72 channels: taps change inside a k-step, N tails
        {2, 7, 6, 64, 24, 3, 2, 1},   // 64 channels (wgrad's shared-tap gather), stride 2
        {1, 6, 7, 32, 16, 1, 2, 0},   // 1×1 stride 2 wgrad on the general gather, C = 32
        {1, 11, 8, 8, 16, 5, 3, 2},   // stride 3: nine phases, 8 channels (four taps per k-step)
        {1, 9, 9, 16, 64, 7, 2, 3},   // 7×7 stride 2 on 16 channels, phases of 16, 12, 12, 9 taps
    };
    for (auto c : cases) run_case(c, rng);
    reduce_case(1000, 3, rng);
    reduce_case(999, 5, rng);
    reduce_case(8, 1, rng);
    printf(failures ? "FAILED (%d checks)\n" : "ALL OK\n", failures);
    return failures ? 1 : 0;
}
