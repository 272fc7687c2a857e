// conv_check.cpp: conv.cu's three implicit-GEMM kernels (forward, dgrad, split-K wgrad), run
// on the host emulator (emu.h), against a direct f64 convolution; odd shapes, the scalar
// (3-channel) and vector paths, 1×1 and strided convolutions, more than one 128-wide tile.
#include "emu.h"
#include "conv_x.cu"  // conv.cu with common.cuh expanded (written by the test)
#include <cstdio>
#include <random>

static float rb(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// The host's dispatch (src/cuda/backend.rs).
static void dgrad(const bf16* dy, const bf16* w, bf16* dx, ConvShape sh) {
    if (sh.c % 8 == 0 && sh.k % 8 == 0) conv_dgrad_vec(dy, w, dx, sh); else conv_dgrad_scalar(dy, w, dx, sh);
}

struct Case { int n, h, w, c, k, r, stride, pad; };

int run_case(Case cs, std::mt19937& rng) {
    ConvShape sh{};
    sh.n = cs.n; sh.h = cs.h; sh.w = cs.w; sh.c = cs.c; sh.k = cs.k; sh.r = cs.r; sh.s = cs.r;
    sh.stride = cs.stride; sh.pad = cs.pad;
    sh.p = (cs.h + 2 * cs.pad - cs.r) / cs.stride + 1; sh.q = (cs.w + 2 * cs.pad - cs.r) / cs.stride + 1;
    const int xl = sh.n * sh.h * sh.w * sh.c, yl = sh.n * sh.p * sh.q * sh.k, wl = sh.k * sh.r * sh.s * sh.c;
    std::uniform_real_distribution<float> U(-1, 1);
    std::vector<float> x(xl), w(wl), dy(yl);
    for (auto& v : x) v = rb(U(rng));
    for (auto& v : w) v = rb(U(rng) * 0.3f);
    for (auto& v : dy) v = rb(U(rng));
    auto tobf = [](const std::vector<float>& v) { std::vector<bf16> o(v.size()); for (size_t i = 0; i < v.size(); ++i) o[i] = __float2bfloat16_rn(v[i]); return o; };
    auto X = tobf(x), W = tobf(w), DY = tobf(dy);
    // reference
    std::vector<double> y_ref(yl, 0), dx_ref(xl, 0), dw_ref(wl, 0);
    for (int n = 0; n < sh.n; ++n) for (int p = 0; p < sh.p; ++p) for (int q = 0; q < sh.q; ++q) for (int k = 0; k < sh.k; ++k)
        for (int r = 0; r < sh.r; ++r) for (int s = 0; s < sh.s; ++s) {
            int hh = p * sh.stride - sh.pad + r, ww = q * sh.stride - sh.pad + s;
            if (hh < 0 || hh >= sh.h || ww < 0 || ww >= sh.w) continue;
            for (int c = 0; c < sh.c; ++c) {
                long xi = (((long)n * sh.h + hh) * sh.w + ww) * sh.c + c, wi = (((long)k * sh.r + r) * sh.s + s) * sh.c + c;
                long yi = (((long)n * sh.p + p) * sh.q + q) * sh.k + k;
                y_ref[yi] += (double)x[xi] * w[wi];
                dx_ref[xi] += (double)dy[yi] * w[wi];
                dw_ref[wi] += (double)dy[yi] * x[xi];
            }
        }
    std::vector<bf16> Y(yl), DX(xl), DXA(xl);
    std::vector<float> dx0(xl);
    for (auto& v : dx0) v = rb(U(rng));
    for (int i = 0; i < xl; ++i) DXA[i] = __float2bfloat16_rn(dx0[i]);
    std::vector<float> DW(wl, 0.0f);
    const int M = sh.n * sh.p * sh.q;
    emu_launch({(unsigned)((M + 127) / 128), (unsigned)((sh.k + 127) / 128), 1}, {256, 1, 1}, [&] { if (sh.c % 8 == 0) conv_fwd_vec(X.data(), W.data(), Y.data(), sh); else conv_fwd_scalar(X.data(), W.data(), Y.data(), sh); });
    const int Md = sh.n * sh.h * sh.w;
    emu_launch({(unsigned)((Md + 127) / 128), (unsigned)((sh.c + 127) / 128), 1}, {256, 1, 1}, [&] { dgrad(DY.data(), W.data(), DX.data(), sh); });
    ConvShape sa = sh; sa.accumulate = 1;
    emu_launch({(unsigned)((Md + 127) / 128), (unsigned)((sh.c + 127) / 128), 1}, {256, 1, 1}, [&] { dgrad(DY.data(), W.data(), DXA.data(), sa); });
    std::vector<double> dxa_ref(xl);
    for (int i = 0; i < xl; ++i) dxa_ref[i] = dx_ref[i] + dx0[i];
    ConvShape sw = sh; int red = M; int splits = 3; sw.k_chunk = ((red + splits - 1) / splits + 31) / 32 * 32; splits = (red + sw.k_chunk - 1) / sw.k_chunk;
    emu_launch({(unsigned)((sh.k + 127) / 128), (unsigned)((wl / sh.k + 127) / 128), (unsigned)splits}, {256, 1, 1}, [&] { if (sh.k % 8 == 0 && sh.c % 8 == 0) conv_wgrad_vec(DY.data(), X.data(), DW.data(), sw); else if (sh.k % 8 == 0) conv_wgrad_stem(DY.data(), X.data(), DW.data(), sw); else conv_wgrad_scalar(DY.data(), X.data(), DW.data(), sw); });
    auto check = [&](const char* what, auto get, const std::vector<double>& ref, float tol, float eps) {
        int bad = 0; double worst = 0;
        for (size_t i = 0; i < ref.size(); ++i) {
            double g = get(i), e = std::fabs(g - ref[i]) - (tol + std::fabs(ref[i]) * eps);
            if (e > 0) { if (bad < 3) printf("  %s[%zu]: got %f want %f\n", what, i, g, ref[i]); ++bad; }
            worst = std::max(worst, std::fabs(g - ref[i]));
        }
        printf("  %-6s %s (max abs err %.4g over %zu)\n", what, bad ? "FAIL" : "ok", worst, ref.size());
        return bad;
    };
    printf("case n=%d h=%d w=%d c=%d k=%d r=%d stride=%d pad=%d\n", cs.n, cs.h, cs.w, cs.c, cs.k, cs.r, cs.stride, cs.pad);
    int bad = 0;
    bad += check("fwd", [&](size_t i) { return (double)__bfloat162float(Y[i]); }, y_ref, 1e-2, 1.0 / 128);
    bad += check("dgrad", [&](size_t i) { return (double)__bfloat162float(DX[i]); }, dx_ref, 1e-2, 1.0 / 128);
    bad += check("dgrad+", [&](size_t i) { return (double)__bfloat162float(DXA[i]); }, dxa_ref, 1e-2, 1.0 / 128);
    bad += check("wgrad", [&](size_t i) { return (double)DW[i]; }, dw_ref, 1e-3, 1e-4);
    return bad;
}

int main() {
    std::mt19937 rng(1);
    Case cases[] = {
        {2, 9, 7, 3, 16, 7, 2, 3},   // stem-like scalar path
        {2, 6, 6, 16, 24, 3, 1, 1},  // vec path 3x3
        {1, 5, 5, 8, 136, 1, 2, 0},  // 1x1 stride 2, N > 128
        {1, 9, 11, 24, 40, 3, 2, 1}, // strided odd
        {1, 6, 6, 20, 12, 3, 1, 1},  // scalar path c%8 != 0
        {3, 12, 12, 8, 8, 1, 1, 0},  // 1x1, M > 128 rows
        {2, 7, 7, 8, 5, 3, 1, 1},    // odd output channels: unpaired epilogue stores
    };
    int bad = 0;
    for (auto c : cases) bad += run_case(c, rng);
    printf(bad ? "FAILED\n" : "ALL OK\n");
    return bad ? 1 : 0;
}
