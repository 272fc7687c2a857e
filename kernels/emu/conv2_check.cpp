// conv2_check.cpp: every kernel of conv2.cu (forward, phased dgrad, split wgrad, each in its
// general and 1×1 forms and in every tile shape, plus the weight rearrangement and channel
// padding helpers) run on the host emulator (emu.h, cp.async pipeline included) against a
// direct f64 convolution. Shapes are small and odd: tails in every GEMM dimension, channel
// counts that do not divide the 32-wide k-step (a k-step then spans several filter taps),
// stride 2 and 3 (4 and 9 dgrad phases, some without taps), the stem read as pixel pairs
// (stride 2) and padded to 8 channels (stride 1).
#include "emu.h"
#include "conv2_x.cu"  // conv2.cu with common.cuh expanded (written by the test)
#include "bn_ns.cu"    // bn.cu in namespace k_bn: the merges and finalize the fused epilogues feed
#include <cstdio>
#include <cstring>
#include <random>
#include <string>

static float rb(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
static int failures = 0;

struct Case { int n, h, w, c, k, r, stride, pad; };

typedef void (*FwdFn)(const bf16*, const bf16*, bf16*, Conv2Args);
typedef void (*WgradFn)(const bf16*, const bf16*, float*, Conv2Args);
typedef void (*FwdStatsFn)(const bf16*, const bf16*, bf16*, Conv2Args, float*);
typedef void (*DgradBnFn)(const bf16*, const bf16*, bf16*, Conv2Args, float*, const bf16*, const bf16*,
                          const float*, const float*, const bf16*, const bf16*, const bf16*, int);
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

static bool same_bits(const void* a, const void* b, size_t bytes) { return memcmp(a, b, bytes) == 0; }

static int check_bits(const std::string& what, bool same) {
    printf("  %-34s %s\n", what.c_str(), same ? "ok" : "FAIL (bits differ)");
    failures += !same;
    return !same;
}

// Merged moments ([mean | M2 | count] per channel) of `records` partial records (two planes,
// records of 128 rows) through bn.cu's bn_stats_merge, as src/cuda/bn_fused.rs launches it: one
// launch when records ≤ single, else groups of `group` records and then the groups.
static std::vector<float> merge_moments(const float* part, int records, int rows, int C, int single, int group) {
    std::vector<float> mom(3 * (size_t)C, NAN);
    const float *pm = part, *pv = part + (size_t)records * C;
    const unsigned cx = (unsigned)((C + 31) / 32);
    if (records <= single) {
        emu_launch({cx, 1, 1}, {32, 32, 1}, [&] { k_bn::bn_stats_merge(pm, pv, records, rows, C, 128L, records, mom.data(), mom.data() + C, mom.data() + 2 * C); });
        return mom;
    }
    const int groups = (records + group - 1) / group;
    std::vector<float> mid(2 * (size_t)groups * C, NAN);
    emu_launch({cx, (unsigned)groups, 1}, {32, 32, 1}, [&] { k_bn::bn_stats_merge(pm, pv, records, rows, C, 128L, group, mid.data(), mid.data() + (size_t)groups * C, nullptr); });
    emu_launch({cx, 1, 1}, {32, 32, 1}, [&] { k_bn::bn_stats_merge(mid.data(), mid.data() + (size_t)groups * C, groups, rows, C, 128L * group, groups, mom.data(), mom.data() + C, mom.data() + 2 * C); });
    return mom;
}

// Σg and Σg·x̂ per channel ([2][C]) of `records` records through bn_sums_merge, the same way.
static std::vector<float> merge_sums(const float* part, int records, int C, int single, int group) {
    std::vector<float> out(2 * (size_t)C, NAN);
    const float *pb = part, *pg = part + (size_t)records * C;
    const unsigned cx = (unsigned)((C + 31) / 32);
    if (records <= single) {
        emu_launch({cx, 1, 1}, {32, 32, 1}, [&] { k_bn::bn_sums_merge(pb, pg, records, C, records, out.data(), out.data() + C); });
        return out;
    }
    const int groups = (records + group - 1) / group;
    std::vector<float> mid(2 * (size_t)groups * C, NAN);
    emu_launch({cx, (unsigned)groups, 1}, {32, 32, 1}, [&] { k_bn::bn_sums_merge(pb, pg, records, C, group, mid.data(), mid.data() + (size_t)groups * C); });
    emu_launch({cx, 1, 1}, {32, 32, 1}, [&] { k_bn::bn_sums_merge(mid.data(), mid.data() + (size_t)groups * C, groups, C, groups, out.data(), out.data() + C); });
    return out;
}

// The forward statistics epilogue of kernel `name` against the plain kernel's output Y: y's bits
// unchanged, every tile record against f64 moments of its rows, the merged moments (one and two
// launches), the finalize and a normalisation with them (negative γ among the channels), and the
// same bits with the blocks run in another order.
static void check_fwd_stats(const char* name, const Kernel& kn, FwdStatsFn fn, const std::vector<bf16>& X,
                            const std::vector<bf16>& W, const std::vector<bf16>& Y, const Conv2Args& a, int M,
                            std::mt19937& rng) {
    const int K = a.k, tiles = (M + 127) / 128;
    const dim3e grid{(unsigned)tiles, (unsigned)((K + kn.bn - 1) / kn.bn), 1};
    std::vector<bf16> Y2(Y.size(), bf16{0x7fc0});
    std::vector<float> part(2 * (size_t)tiles * K, NAN);
    run(kn, grid, [&] { fn(X.data(), W.data(), Y2.data(), a, part.data()); });
    const std::string base = std::string(name);
    check_bits(base + " y", same_bits(Y.data(), Y2.data(), Y.size() * sizeof(bf16)));
    std::vector<double> yv = widen(Y), tile_mean((size_t)tiles * K), tile_m2((size_t)tiles * K);
    std::vector<double> mean(K, 0), m2(K, 0), count(K, (double)M);
    for (int t = 0; t < tiles; ++t) {
        const int r0 = t * 128, r1 = std::min(M, r0 + 128);
        for (int k = 0; k < K; ++k) {
            double s = 0, q = 0;
            for (int r = r0; r < r1; ++r) s += yv[(size_t)r * K + k];
            s /= (r1 - r0);
            for (int r = r0; r < r1; ++r) q += (yv[(size_t)r * K + k] - s) * (yv[(size_t)r * K + k] - s);
            tile_mean[(size_t)t * K + k] = s;
            tile_m2[(size_t)t * K + k] = q;
        }
    }
    for (int k = 0; k < K; ++k) {
        for (int r = 0; r < M; ++r) mean[k] += yv[(size_t)r * K + k];
        mean[k] /= M;
        for (int r = 0; r < M; ++r) m2[k] += (yv[(size_t)r * K + k] - mean[k]) * (yv[(size_t)r * K + k] - mean[k]);
    }
    check(base + " tile means", std::vector<double>(part.begin(), part.begin() + (size_t)tiles * K), tile_mean, 1e-5, 1e-5);
    check(base + " tile M2", std::vector<double>(part.begin() + (size_t)tiles * K, part.end()), tile_m2, 1e-4, 1e-4);
    std::vector<double> ref_mom(mean);
    ref_mom.insert(ref_mom.end(), m2.begin(), m2.end());
    ref_mom.insert(ref_mom.end(), count.begin(), count.end());
    const auto mom1 = merge_moments(part.data(), tiles, M, K, 256, 128);
    const auto mom2 = merge_moments(part.data(), tiles, M, K, 1, 2);  // two launches even for few tiles
    check(base + " moments", std::vector<double>(mom1.begin(), mom1.end()), ref_mom, 1e-5, 1e-4);
    check(base + " moments, 2 levels", std::vector<double>(mom2.begin(), mom2.end()), ref_mom, 1e-5, 1e-4);
    // finalize and normalise (γ of both signs)
    std::uniform_real_distribution<float> U(-1, 1);
    std::vector<float> gamma(K), beta(K), rm(K), rv(K), sm(K, NAN), si(K, NAN);
    for (int k = 0; k < K; ++k) { gamma[k] = rb(U(rng)); beta[k] = rb(U(rng) * 0.5f); rm[k] = U(rng) * 0.5f; rv[k] = 1.0f + std::fabs(U(rng)); }
    gamma[0] = -std::fabs(gamma[0]) - 0.25f;  // at least one negative scale
    std::vector<double> rm_ref(K), rv_ref(K), sm_ref(K), si_ref(K);
    for (int k = 0; k < K; ++k) {
        const double var = m2[k] / M;
        sm_ref[k] = mean[k];
        si_ref[k] = 1.0 / std::sqrt(var + 1e-5);
        rm_ref[k] = 0.9 * rm[k] + 0.1 * mean[k];
        rv_ref[k] = 0.9 * rv[k] + 0.1 * (M > 1 ? m2[k] / (M - 1) : var);
    }
    emu_launch({(unsigned)((K + 127) / 128), 1, 1}, {128, 1, 1}, [&] { k_bn::bn_moments_finalize(mom1.data(), K, 1e-5f, 0.1f, sm.data(), si.data(), rm.data(), rv.data()); });
    check(base + " saved mean", std::vector<double>(sm.begin(), sm.end()), sm_ref, 1e-5, 1e-5);
    check(base + " saved invstd", std::vector<double>(si.begin(), si.end()), si_ref, 1e-5, 1e-3);
    check(base + " running mean", std::vector<double>(rm.begin(), rm.end()), rm_ref, 1e-5, 1e-5);
    check(base + " running var", std::vector<double>(rv.begin(), rv.end()), rv_ref, 1e-5, 1e-4);
    std::vector<bf16> G(K), B(K), Z(Y.size(), bf16{0x7fc0});
    for (int k = 0; k < K; ++k) { G[k] = __float2bfloat16_rn(gamma[k]); B[k] = __float2bfloat16_rn(beta[k]); }
    const long total = (long)M * K;
    emu_launch({3, 1, 1}, {256, 1, 1}, [&] { k_bn::bn_apply_vec(Y.data(), sm.data(), si.data(), G.data(), B.data(), nullptr, Z.data(), total, K, 1); });
    std::vector<double> z_ref((size_t)total);
    for (long i = 0; i < total; ++i) { const int k = (int)(i % K); z_ref[i] = std::max(0.0, (yv[i] - sm_ref[k]) * si_ref[k] * gamma[k] + beta[k]); }
    check(base + " bn+relu with them", widen(Z), z_ref, 2e-2, 1.0 / 64);
    // Another block order: the same bits.
    std::vector<bf16> Y3(Y.size());
    std::vector<float> part3(part.size(), NAN);
    g_emu_block_order = 0x5eed;
    run(kn, grid, [&] { fn(X.data(), W.data(), Y3.data(), a, part3.data()); });
    const auto mom3 = merge_moments(part3.data(), tiles, M, K, 1, 2);
    g_emu_block_order = 0;
    check_bits(base + " other block order", same_bits(part.data(), part3.data(), part.size() * 4) &&
                                                same_bits(mom2.data(), mom3.data(), mom2.size() * 4));
}

// The dgrad BN epilogue of kernel `name` against the plain kernel's dx (DXP, already holding
// dgrad [+ dx0]): dx = [bn_y > 0]·(DXP + residual) bit for bit, and the merged Σg, Σg·x̂ against
// f64 sums of those values; also with the blocks in another order.
static void check_dgrad_bn(const std::string& name, const Kernel& kn, DgradBnFn fn, const std::vector<bf16>& DY,
                           const bf16* wsrc, const std::vector<bf16>& DX0, const std::vector<bf16>& DXP,
                           const Conv2Args& a, int Md, int phases, bool residual, bool relu, std::mt19937& rng) {
    const int C = a.c;
    const size_t xl = DXP.size();
    std::uniform_real_distribution<float> U(-1, 1);
    std::vector<bf16> R(xl), BY(xl), BX(xl);
    std::vector<float> mean(C), invstd(C);
    for (size_t i = 0; i < xl; ++i) {
        R[i] = __float2bfloat16_rn(U(rng));
        BY[i] = __float2bfloat16_rn(U(rng));           // about half the mask is off
        BX[i] = __float2bfloat16_rn(U(rng) + 0.25f * (float)(i % C));
    }
    for (int c = 0; c < C; ++c) { mean[c] = 0.25f * c + 0.1f * U(rng); invstd[c] = 0.5f + std::fabs(U(rng)); }
    // reference: the plain kernel's dx, then residual (one bf16 rounding) and mask
    std::vector<bf16> want(xl);
    std::vector<double> sb(C, 0), sg(C, 0);
    for (size_t i = 0; i < xl; ++i) {
        float v = __bfloat162float(DXP[i]);
        if (residual) v = rb(v + __bfloat162float(R[i]));
        if (relu && !(__bfloat162float(BY[i]) > 0.0f)) v = 0.0f;
        want[i] = __float2bfloat16_rn(v);
        const int c = (int)(i % C);
        sb[c] += v;
        sg[c] += (double)v * (__bfloat162float(BX[i]) - mean[c]) * invstd[c];
    }
    std::vector<double> ref(sb);
    ref.insert(ref.end(), sg.begin(), sg.end());
    const dim3e grid{(unsigned)((Md + kn.bm - 1) / kn.bm), (unsigned)((C + kn.bn - 1) / kn.bn), (unsigned)phases};
    const int records = (int)(grid.x * grid.z);
    const std::string what = name + (residual ? " +res" : "") + (relu ? " relu" : "");
    std::vector<bf16> got[2];
    std::vector<float> merged[2];
    for (int order = 0; order < 2; ++order) {
        std::vector<bf16> DX = DX0;
        std::vector<float> part(2 * (size_t)records * C, NAN);  // every record must be written
        g_emu_block_order = order ? 0xb10c : 0;
        run(kn, grid, [&] { fn(DY.data(), wsrc, DX.data(), a, part.data(), relu ? BY.data() : nullptr, BX.data(), mean.data(), invstd.data(), residual ? R.data() : nullptr, nullptr, nullptr, relu); });
        const auto sums1 = merge_sums(part.data(), records, C, 256, 128);
        const auto sums2 = merge_sums(part.data(), records, C, 1, 2);
        g_emu_block_order = 0;
        if (order == 0) {
            check_bits(what + " g", same_bits(DX.data(), want.data(), xl * sizeof(bf16)));
            check(what + " sums", std::vector<double>(sums1.begin(), sums1.end()), ref, 1e-3, 1e-4);
            check(what + " sums, 2 levels", std::vector<double>(sums2.begin(), sums2.end()), ref, 1e-3, 1e-4);
        }
        got[order] = DX;
        merged[order] = sums1;
        merged[order].insert(merged[order].end(), sums2.begin(), sums2.end());
    }
    check_bits(what + " other block order", same_bits(got[0].data(), got[1].data(), xl * sizeof(bf16)) &&
                                                same_bits(merged[0].data(), merged[1].data(), merged[0].size() * 4));
}

static std::vector<bf16> tobf(const std::vector<float>& v) {
    std::vector<bf16> o(v.size());
    for (size_t i = 0; i < v.size(); ++i) o[i] = __float2bfloat16_rn(v[i]);
    return o;
}

// The arguments of a case as the host plans a layer that is not paired (src/cuda/conv.rs):
// the same stride and padding along both dimensions, channels as given.
static Conv2Args unpaired_args(const Case& cs) {
    Conv2Args a{};
    a.n = cs.n; a.h = cs.h; a.w = cs.w; a.c = cs.c; a.k = cs.k; a.r = cs.r; a.s = cs.r;
    a.stride = cs.stride; a.pad = cs.pad; a.stride_w = cs.stride; a.pad_w = cs.pad;
    a.c_real = cs.c; a.s_real = cs.r; a.pair_lead = -1;
    a.p = (cs.h + 2 * cs.pad - cs.r) / cs.stride + 1; a.q = (cs.w + 2 * cs.pad - cs.r) / cs.stride + 1;
    return a;
}

// Random bf16-exact operands of a case (x, w, dy on the real channels) and the f64 references
// of the three passes (a direct convolution).
struct Operands {
    std::vector<float> x, w, dy;
    std::vector<bf16> X, W, DY;
    std::vector<double> y_ref, dx_ref, dw_ref;
};

static Operands operands(const Case& cs, const Conv2Args& a, std::mt19937& rng) {
    const long pixels_out = (long)a.n * a.p * a.q;
    const long xl = (long)cs.n * cs.h * cs.w * cs.c, yl = pixels_out * cs.k, wl = (long)cs.k * cs.r * cs.r * cs.c;
    Operands o;
    std::uniform_real_distribution<float> U(-1, 1);
    o.x.resize(xl); o.w.resize(wl); o.dy.resize(yl);
    for (auto& v : o.x) v = rb(U(rng));
    for (auto& v : o.w) v = rb(U(rng) * 0.3f);
    for (auto& v : o.dy) v = rb(U(rng));
    o.X = tobf(o.x); o.W = tobf(o.w); o.DY = tobf(o.dy);
    o.y_ref.assign(yl, 0); o.dx_ref.assign(xl, 0); o.dw_ref.assign(wl, 0);
    for (int n = 0; n < cs.n; ++n) for (int p = 0; p < a.p; ++p) for (int q = 0; q < a.q; ++q) for (int k = 0; k < cs.k; ++k)
        for (int r = 0; r < cs.r; ++r) for (int s = 0; s < cs.r; ++s) {
            const int hh = p * cs.stride - cs.pad + r, ww = q * cs.stride - cs.pad + s;
            if (hh < 0 || hh >= cs.h || ww < 0 || ww >= cs.w) continue;
            for (int c = 0; c < cs.c; ++c) {
                const long xi = (((long)n * cs.h + hh) * cs.w + ww) * cs.c + c, wi = (((long)k * cs.r + r) * cs.r + s) * cs.c + c;
                const long yi = (((long)n * a.p + p) * a.q + q) * cs.k + k;
                o.y_ref[yi] += (double)o.x[xi] * o.w[wi];
                o.dx_ref[xi] += (double)o.dy[yi] * o.w[wi];
                o.dw_ref[wi] += (double)o.dy[yi] * o.x[xi];
            }
        }
    return o;
}

// The phase-ordered dgrad weight has as many elements as the weight itself.
static void run_case(Case cs, std::mt19937& rng) {
    const int cp = (cs.c + 7) / 8 * 8;  // channels as stored (the stem pads 3 to 8)
    Conv2Args a = unpaired_args(cs);
    a.c = cp;
    printf("case n=%d h=%d w=%d c=%d k=%d r=%d stride=%d pad=%d\n", cs.n, cs.h, cs.w, cs.c, cs.k, cs.r, cs.stride, cs.pad);
    const long pixels_in = (long)a.n * a.h * a.w, pixels_out = (long)a.n * a.p * a.q;
    const long xl = pixels_in * cs.c, yl = pixels_out * a.k, wl = (long)a.k * a.r * a.s * cs.c;
    const Operands o = operands(cs, a, rng);
    std::uniform_real_distribution<float> U(-1, 1);
    std::vector<float> dx0(pixels_in * cp);
    for (auto& v : dx0) v = rb(U(rng));
    const std::vector<float>& x = o.x;
    const std::vector<bf16>&X3 = o.X, &W3 = o.W, &DY = o.DY;
    const std::vector<double>&y_ref = o.y_ref, &dx_ref = o.dx_ref, &dw_ref = o.dw_ref;

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
    const Kernel fwd_stats[] = {{"conv2_fwd_stats_128x128", 128, 128, 256}, {"conv2_fwd_stats_128x64", 128, 64, 128},
                                {"conv2_fwd_stats_1x1_128x128", 128, 128, 256}, {"conv2_fwd_stats_1x1_128x64", 128, 64, 128}};
    const FwdStatsFn fwd_stats_fn[] = {conv2_fwd_stats_128x128, conv2_fwd_stats_128x64, conv2_fwd_stats_1x1_128x128,
                                       conv2_fwd_stats_1x1_128x64};
    for (int v = 0; v < 4; ++v) {
        if (v >= 2 && !unit) continue;
        std::vector<bf16> Y(yl, bf16{0x7fc0});
        run(fwd[v], {(unsigned)((M + fwd[v].bm - 1) / fwd[v].bm), (unsigned)((a.k + fwd[v].bn - 1) / fwd[v].bn), 1},
            [&] { fwd_fn[v](X.data(), W.data(), Y.data(), a); });
        check(fwd[v].name, widen(Y), y_ref, 1e-2, 1.0 / 128);
        check_fwd_stats(fwd_stats[v].name, fwd_stats[v], fwd_stats_fn[v], X, W, Y, a, M, rng);
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
        const Kernel dg_bn[] = {{"conv2_dgrad_bn_128x128", 128, 128, 256}, {"conv2_dgrad_bn_128x64", 128, 64, 128},
                                {"conv2_dgrad_bn_1x1_128x128", 128, 128, 256}, {"conv2_dgrad_bn_1x1_128x64", 128, 64, 128}};
        const DgradBnFn dg_bn_fn[] = {conv2_dgrad_bn_128x128, conv2_dgrad_bn_128x64, conv2_dgrad_bn_1x1_128x128,
                                      conv2_dgrad_bn_1x1_128x64};
        for (int v = 0; v < 4; ++v) {
            if (v >= 2 && !unit) continue;
            const bf16* wsrc = v >= 2 ? W.data() : WT.data();
            for (int acc = 0; acc < 2; ++acc) {
                Conv2Args aa = a; aa.accumulate = acc;
                std::vector<bf16> DX(xl, bf16{0x7fc0});
                std::vector<double> ref = dx_ref;
                if (acc) { DX = tobf(std::vector<float>(dx0.begin(), dx0.begin() + xl)); for (long i = 0; i < xl; ++i) ref[i] += dx0[i]; }
                const std::vector<bf16> DX0 = DX;
                run(dg[v], {(unsigned)((Md + dg[v].bm - 1) / dg[v].bm), (unsigned)((a.c + dg[v].bn - 1) / dg[v].bn), (unsigned)phases},
                    [&] { dg_fn[v](DY.data(), wsrc, DX.data(), aa); });
                check(std::string(dg[v].name) + (acc ? " +=" : ""), widen(DX), ref, 1e-2, 1.0 / 128);
                // The BN epilogue on the same product: the accumulated gradient with a ReLU (a
                // block's first convolution), a residual's gradient with a ReLU, and (1×1
                // kernels) neither.
                const std::string bn_name = std::string(dg_bn[v].name) + (acc ? " +=" : "");
                if (!acc) {
                    std::vector<bf16> DXZ(xl, bf16{0x7fc0});  // overwritten: the poison never shows
                    check_dgrad_bn(bn_name, dg_bn[v], dg_bn_fn[v], DY, wsrc, DXZ, DX, aa, Md, phases, true, true, rng);
                    if (v >= 2) check_dgrad_bn(bn_name, dg_bn[v], dg_bn_fn[v], DY, wsrc, DXZ, DX, aa, Md, phases, false, false, rng);
                } else {
                    check_dgrad_bn(bn_name, dg_bn[v], dg_bn_fn[v], DY, wsrc, DX0, DX, aa, Md, phases, false, true, rng);
                }
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

// The stem read as pixel pairs (kernels/conv2.cu, "The stem"; src/cuda/conv.rs plans it for ≤ 4
// channels at stride 2): the input and weight paired by conv2_pair_pixels (checked element by
// element, an odd width's zero pixel and the weight's lead slot included), the forward in both
// tile widths with its statistics epilogue, and the weight gradient (small-C gather) mapped back
// onto the real filter, its reduction in one slice (dw written directly) and in three; every
// GEMM also in another block order, to the same bits.
static void stem_pairs_case(Case cs, std::mt19937& rng) {
    const int lead = cs.pad % 2, pairs_w = (cs.w + 1) / 2, taps = (cs.r + lead + 1) / 2;
    Conv2Args a = unpaired_args(cs);
    a.w = pairs_w; a.c = 8; a.s = taps; a.stride_w = 1; a.pad_w = (cs.pad + lead) / 2; a.pair_lead = lead;
    printf("paired stem n=%d h=%d w=%d c=%d k=%d r=%d stride=%d pad=%d (GEMM: %d pair columns, %dx%d filter)\n", cs.n,
           cs.h, cs.w, cs.c, cs.k, cs.r, cs.stride, cs.pad, pairs_w, cs.r, taps);
    const Operands o = operands(cs, a, rng);
    const long rows_x = (long)cs.n * cs.h, rows_w = (long)cs.k * cs.r;
    const long yl = (long)a.n * a.p * a.q * a.k, wl = (long)cs.k * cs.r * cs.r * cs.c;
    // The paired copies (poisoned: every element must be written) against the rule.
    std::vector<bf16> XP(rows_x * pairs_w * 8, bf16{0x7fc0}), WP(rows_w * taps * 8, bf16{0x7fc0});
    emu_launch({2, 1, 1}, {64, 1, 1}, [&] { conv2_pair_pixels(o.X.data(), XP.data(), rows_x, cs.w, cs.c, 0); });
    emu_launch({2, 1, 1}, {64, 1, 1}, [&] { conv2_pair_pixels(o.W.data(), WP.data(), rows_w, cs.r, cs.c, lead); });
    auto paired = [&](const std::vector<float>& src, long rows, int width, int ld, int pairs) {
        std::vector<double> r((size_t)rows * pairs * 8, 0.0);
        for (long row = 0; row < rows; ++row) for (int j = 0; j < pairs; ++j) for (int px = 0; px < 2; ++px)
            for (int ch = 0; ch < cs.c; ++ch) {
                const int s = 2 * j + px - ld;
                if (s >= 0 && s < width) r[((size_t)row * pairs + j) * 8 + 4 * px + ch] = src[((size_t)row * width + s) * cs.c + ch];
            }
        return r;
    };
    check("pair_pixels x", widen(XP), paired(o.x, rows_x, cs.w, 0, pairs_w), 0, 0);
    check("pair_pixels w", widen(WP), paired(o.w, rows_w, cs.r, lead, taps), 0, 0);

    const int M = a.n * a.p * a.q;
    const Kernel fwd[] = {{"conv2_fwd_128x128", 128, 128, 256}, {"conv2_fwd_128x64", 128, 64, 128}};
    const FwdFn fwd_fn[] = {conv2_fwd_128x128, conv2_fwd_128x64};
    const Kernel fwd_stats[] = {{"conv2_fwd_stats_128x128", 128, 128, 256}, {"conv2_fwd_stats_128x64", 128, 64, 128}};
    const FwdStatsFn fwd_stats_fn[] = {conv2_fwd_stats_128x128, conv2_fwd_stats_128x64};
    for (int v = 0; v < 2; ++v) {
        const dim3e grid{(unsigned)((M + fwd[v].bm - 1) / fwd[v].bm), (unsigned)((a.k + fwd[v].bn - 1) / fwd[v].bn), 1};
        std::vector<bf16> Y(yl, bf16{0x7fc0}), Y2(yl, bf16{0x7fc0});
        run(fwd[v], grid, [&] { fwd_fn[v](XP.data(), WP.data(), Y.data(), a); });
        const std::string name = std::string(fwd[v].name) + " paired";
        check(name, widen(Y), o.y_ref, 1e-2, 1.0 / 128);
        g_emu_block_order = 0x57e3;
        run(fwd[v], grid, [&] { fwd_fn[v](XP.data(), WP.data(), Y2.data(), a); });
        g_emu_block_order = 0;
        check_bits(name + " again, other order", same_bits(Y.data(), Y2.data(), yl * sizeof(bf16)));
        check_fwd_stats(fwd_stats[v].name, fwd_stats[v], fwd_stats_fn[v], XP, WP, Y, a, M, rng);
    }

    const int Nw = a.r * a.s * a.c;
    const Kernel wg{"conv2_wgrad_c8_64x128", 64, 128, 128};
    // Slices: the whole reduction (dw written directly), about a third, one k-step each.
    for (int chunk : {(M + 31) / 32 * 32, ((M + 2) / 3 + 31) / 32 * 32, 32}) {
        Conv2Args sw = a;
        sw.k_chunk = chunk;
        const int splits = (M + sw.k_chunk - 1) / sw.k_chunk;
        const dim3e grid{(unsigned)((a.k + wg.bm - 1) / wg.bm), (unsigned)((Nw + wg.bn - 1) / wg.bn), (unsigned)splits};
        std::vector<float> dw[2];
        for (int rep = 0; rep < 2; ++rep) {
            // Poisoned: every element of dw (one slice) or of every plane must be stored.
            std::vector<float> planes((size_t)splits * wl, NAN);
            dw[rep].assign(wl, NAN);
            float* out = splits == 1 ? dw[rep].data() : planes.data();
            g_emu_block_order = rep ? 0x57e3 : 0;
            run(wg, grid, [&] { conv2_wgrad_c8_64x128(o.DY.data(), XP.data(), out, sw); });
            g_emu_block_order = 0;
            if (splits > 1) emu_launch({4, 1, 1}, {64, 1, 1}, [&] { conv2_wgrad_reduce(planes.data(), dw[rep].data(), wl, splits); });
        }
        const std::string name = std::string(wg.name) + " paired, " + std::to_string(splits) + " slice(s)";
        check(name, std::vector<double>(dw[0].begin(), dw[0].end()), o.dw_ref, 1e-3, 1e-4);
        check_bits(name + " again, other order", same_bits(dw[0].data(), dw[1].data(), wl * sizeof(float)));
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

// `--first`: stop after the first case with a failure (the test's deliberately broken copies).
int main(int argc, char** argv) {
    const bool first = argc > 1 && std::string(argv[1]) == "--first";
    std::mt19937 rng(1);
    // The stem as pixel pairs first (the broken copies of its paths stop there).
    const Case stems[] = {
        {2, 9, 7, 3, 16, 7, 2, 3},    // resnet's stem scaled down: odd height and width, batch 2
        {2, 16, 16, 3, 64, 7, 2, 3},  // 64 filters: wgrad slices of several k-steps, N = 224 in two tiles
        {3, 11, 13, 3, 24, 7, 2, 3},  // batch 3, odd sizes, 24 filters (forward N tails)
        {2, 9, 10, 3, 16, 5, 2, 2},   // even padding: no lead slot, a 5×5 filter as 3 pairs
        {1, 8, 7, 1, 8, 7, 2, 3},     // one channel
        {1, 6, 9, 4, 8, 3, 2, 1},     // four channels (none padded), a 3×3 filter as 2 pairs
    };
    for (auto c : stems) {
        stem_pairs_case(c, rng);
        if (first && failures) break;
    }
    const Case cases[] = {
        {2, 7, 6, 3, 16, 3, 1, 1},    // a 3-channel stem at stride 1 (the CIFAR resnets): padded to 8
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
    for (auto c : cases) {
        if (first && failures) break;
        run_case(c, rng);
    }
    reduce_case(1000, 3, rng);
    reduce_case(999, 5, rng);
    reduce_case(8, 1, rng);
    printf(failures ? "FAILED (%d checks)\n" : "ALL OK\n", failures);
    return failures ? 1 : 0;
}
