// conv3_check.cpp: the Hopper kernels of conv3.cu (wgmma fed by TMA through mbarrier-guarded
// stages) run on the host emulator (emu.h + hopper.h) against f64 references: the output of
// every 1×1 GEMM (forward, dgrad through the transposed weight, the strided 1×1's dgrad with
// its scattered epilogue, and the weight gradient's MN-major operands in reduction slices),
// the forward's per-tile
// statistics records and the dgrad's batch-norm gradient epilogue (accumulate, residual, ReLU
// mask, Σg and Σg·x̂ records). Shapes have tails in every GEMM
// dimension (M, N and K not multiples of the 128 × 128 × 64 tile) and reductions long enough
// to wrap the 4-stage ring more than once. Every case runs twice, first with TMA loads landing
// as late as allowed and the blocks in row-major order, then landing at issue and the blocks
// shuffled: both must give the same bits (a missing wait changes one of them). Every kernel
// runs in each of its tile shapes: 128 × 128, the 64-column `_n64` twins, and the weight
// gradients' 64-row `_m64` twins (the consumers splitting the columns). Every forward and
// data-gradient case runs again on the persistent twins (`_p`, `_n64_p`: fewer blocks than
// tiles, each walking several), which must give the same bits.
#include "emu.h"
#include "hopper.h"    // mbarrier, TMA and wgmma (sm_90a)
#include "conv3_x.cu"  // conv3.cu with common.cuh expanded (written by the test)
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

static int failures = 0;
static bool first_only = false;
// The tile width under test: 128 (conv3_*) or 64 (conv3_*_n64).
static int g_bn = 128;
// The weight gradients' tile height under test: 128, or 64 (conv3_wgrad_*_m64, split by columns).
static int g_bm = 128;

// 0: the one-tile-per-block kernels; else the persistent twins (`_p`, `_n64_p`) in that many
// blocks.
static unsigned g_persistent = 0;

// The grid of a launch over `tiles` (one block per tile), or the persistent blocks.
static dim3e grid_for(dim3e tiles) { return g_persistent ? dim3e{g_persistent, 1, 1} : tiles; }

static float rb(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

static int check(const std::string& what, const std::vector<double>& got, const std::vector<double>& ref, double tol,
                 double eps) {
    int bad = 0;
    double worst = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
        const double e = std::fabs(got[i] - ref[i]) - (tol + std::fabs(ref[i]) * eps);
        if (e > 0 || std::isnan(got[i])) {
            if (bad < 3) printf("    %s[%zu]: got %f want %f\n", what.c_str(), i, got[i], ref[i]);
            ++bad;
        }
        worst = std::max(worst, std::fabs(got[i] - ref[i]));
    }
    printf("  %-40s %s (max abs err %.3g over %zu)\n", what.c_str(), bad ? "FAIL" : "ok", worst, ref.size());
    failures += bad > 0;
    return bad;
}

static void check_bits(const std::string& what, bool same) {
    printf("  %-40s %s\n", what.c_str(), same ? "ok" : "FAIL (bits differ)");
    failures += !same;
}

// Runs a case again with the persistent twins (`_p`, `_n64_p`): 3 blocks with TMA landing
// lazily, then 2 blocks with TMA landing at issue (each block walks several tiles, its ring
// running on from tile to tile); `same` compares a run's result with the one-tile-per-block
// run's bits.
template <class Run, class Same>
static void check_persistent(const char* what, Run run, Same same) {
    for (int pass = 0; pass < 2; ++pass) {
        g_persistent = pass == 0 ? 3 : 2;
        g_emu_tma_eager = pass == 1;
        const bool ok = same(run());
        check_bits(std::string(pass == 0 ? "persistent, 3 blocks: same " : "persistent, 2 blocks, eager TMA: same ") + what, ok);
    }
    g_persistent = 0;
    g_emu_tma_eager = false;
}

struct Gemm { int m, n, k; };

struct Result { std::vector<bf16> y; std::vector<float> part; };

// One launch of conv3_fwd_1x1 (stats = false) or conv3_fwd_stats_1x1.
static Result run(const Gemm& g, const std::vector<bf16>& x, const std::vector<bf16>& w, bool stats) {
    const unsigned gx = (unsigned)((g.m + C3_BM - 1) / C3_BM), gy = (unsigned)((g.n + g_bn - 1) / g_bn);
    Result r;
    r.y.assign((size_t)g.m * g.n, __float2bfloat16_rn(NAN));
    r.part.assign(stats ? 2 * (size_t)gx * g.n : 0, NAN);
    const BtTmaMap map_x = emu_tma_encode_2d(x.data(), (unsigned long long)g.k, (unsigned long long)g.m,
                                             (unsigned long long)g.k * 2, C3_BK, C3_BM, true);
    const BtTmaMap map_w = emu_tma_encode_2d(w.data(), (unsigned long long)g.k, (unsigned long long)g.n,
                                             (unsigned long long)g.k * 2, C3_BK, (unsigned)g_bn, true);
    const Conv3Args args{g.m, g.n, g.k, 0, g.k};
    bf16* y = r.y.data();
    float* part = r.part.data();
    if (stats)
        emu_launch(grid_for({gx, gy, 1}), {C3_THREADS, 1, 1}, [&] { (g_persistent ? (g_bn == 64 ? conv3_fwd_stats_1x1_n64_p(map_x, map_w, y, args, part) : conv3_fwd_stats_1x1_p(map_x, map_w, y, args, part)) : g_bn == 64 ? conv3_fwd_stats_1x1_n64(map_x, map_w, y, args, part) : conv3_fwd_stats_1x1(map_x, map_w, y, args, part)); });
    else
        emu_launch(grid_for({gx, gy, 1}), {C3_THREADS, 1, 1}, [&] { (g_persistent ? (g_bn == 64 ? conv3_fwd_1x1_n64_p(map_x, map_w, y, args) : conv3_fwd_1x1_p(map_x, map_w, y, args)) : g_bn == 64 ? conv3_fwd_1x1_n64(map_x, map_w, y, args) : conv3_fwd_1x1(map_x, map_w, y, args)); });
    return r;
}

static void check_gemm(const Gemm& g, bool stats) {
    std::mt19937 rng(g.m * 131 + g.n * 7 + g.k + stats);
    std::uniform_real_distribution<float> U(-1.0f, 1.0f);
    std::vector<bf16> x((size_t)g.m * g.k), w((size_t)g.n * g.k);
    // Each channel of x gets its own offset, so the statistics' means are far from zero.
    for (int i = 0; i < g.m; ++i)
        for (int c = 0; c < g.k; ++c) x[(size_t)i * g.k + c] = __float2bfloat16_rn(U(rng) + 0.25f * (c % 5));
    for (auto& v : w) v = __float2bfloat16_rn(0.5f * U(rng));
    const std::string name = std::string(stats ? "conv3_fwd_stats_1x1" : "conv3_fwd_1x1") + " m" + std::to_string(g.m) +
                             " n" + std::to_string(g.n) + " k" + std::to_string(g.k);
    printf("%s\n", name.c_str());

    g_emu_tma_eager = false;
    g_emu_block_order = 0;
    const Result r = run(g, x, w, stats);

    // y: the f64 GEMM, rounded once to bf16 by the kernel (f32 accumulation in between).
    std::vector<double> got(r.y.size()), ref(r.y.size());
    for (int i = 0; i < g.m; ++i)
        for (int o = 0; o < g.n; ++o) {
            double s = 0;
            for (int c = 0; c < g.k; ++c)
                s += (double)__bfloat162float(x[(size_t)i * g.k + c]) * __bfloat162float(w[(size_t)o * g.k + c]);
            ref[(size_t)i * g.n + o] = s;
            got[(size_t)i * g.n + o] = __bfloat162float(r.y[(size_t)i * g.n + o]);
        }
    check("y", got, ref, 2e-5 * g.k, 1.0 / 256);

    if (stats) {
        // The records: each 128-row tile's mean and M2 of the bf16 y the kernel wrote.
        const int tiles = (g.m + C3_BM - 1) / C3_BM;
        std::vector<double> gm, rm, gq, rq;
        for (int t = 0; t < tiles; ++t) {
            const int rows = std::min(C3_BM, g.m - t * C3_BM);
            for (int o = 0; o < g.n; ++o) {
                double s = 0, q = 0;
                for (int i = 0; i < rows; ++i) s += __bfloat162float(r.y[(size_t)(t * C3_BM + i) * g.n + o]);
                const double mean = s / rows;
                for (int i = 0; i < rows; ++i) {
                    const double d = __bfloat162float(r.y[(size_t)(t * C3_BM + i) * g.n + o]) - mean;
                    q += d * d;
                }
                rm.push_back(mean);
                rq.push_back(q);
                gm.push_back(r.part[(size_t)t * g.n + o]);
                gq.push_back(r.part[(size_t)tiles * g.n + (size_t)t * g.n + o]);
            }
        }
        check("tile means", gm, rm, 1e-5, 1e-5);
        check("tile M2", gq, rq, 1e-4, 1e-5);
    }

    // The same launch with TMA landing at issue and the blocks in a shuffled order.
    g_emu_tma_eager = true;
    g_emu_block_order = 0x9e3779b9u;
    const Result again = run(g, x, w, stats);
    g_emu_tma_eager = false;
    g_emu_block_order = 0;
    check_bits("eager TMA, shuffled blocks: same y", memcmp(again.y.data(), r.y.data(), r.y.size() * 2) == 0);
    if (stats)
        check_bits("eager TMA, shuffled blocks: same records",
                   memcmp(again.part.data(), r.part.data(), r.part.size() * 4) == 0);
    check_persistent(stats ? "y and records" : "y", [&] { return run(g, x, w, stats); }, [&](const Result& p) {
        return memcmp(p.y.data(), r.y.data(), r.y.size() * 2) == 0 &&
               memcmp(p.part.data(), r.part.data(), r.part.size() * 4) == 0;
    });
}

// The dgrad: dx[M][C] = dy[M][K] · w[K][C] through wt = wᵀ, with or without the batch-norm
// epilogue; `accumulate` adds into a dx that holds values already, `residual` and `mask`
// exercise the epilogue's optional operands (the BN epilogue only).
struct Dgrad { int m, c, k; bool bn, accumulate, residual, mask; };

static std::vector<bf16> random_bf16(std::mt19937& rng, size_t n, float scale, float offset = 0) {
    std::uniform_real_distribution<float> U(-1.0f, 1.0f);
    std::vector<bf16> v(n);
    for (auto& e : v) e = __float2bfloat16_rn(scale * U(rng) + offset);
    return v;
}

struct DgradResult { std::vector<bf16> dx; std::vector<float> part; };

static DgradResult run_dgrad(const Dgrad& d, const std::vector<bf16>& dy, const std::vector<bf16>& wt,
                             const std::vector<bf16>& dx0, const std::vector<bf16>& bn_y, const std::vector<bf16>& bn_x,
                             const std::vector<float>& mean, const std::vector<float>& invstd,
                             const std::vector<bf16>& residual, const bf16* gamma = nullptr,
                             const bf16* beta = nullptr, const unsigned char* signs = nullptr) {
    // gamma given: the mask recomputed from bn_x; signs given: read from y's packed signs
    // (bn_y not passed either way)
    const bf16* y = d.mask && gamma == nullptr && signs == nullptr ? bn_y.data() : nullptr;
    const int relu = d.mask ? 1 : 0;
    const unsigned gx = (unsigned)((d.m + C3_BM - 1) / C3_BM), gy = (unsigned)((d.c + g_bn - 1) / g_bn);
    DgradResult r;
    r.dx = dx0;
    r.part.assign(d.bn ? 2 * (size_t)gx * d.c : 0, NAN);
    const BtTmaMap map_dy = emu_tma_encode_2d(dy.data(), (unsigned long long)d.k, (unsigned long long)d.m,
                                              (unsigned long long)d.k * 2, C3_BK, C3_BM, true);
    const BtTmaMap map_wt = emu_tma_encode_2d(wt.data(), (unsigned long long)d.k, (unsigned long long)d.c,
                                              (unsigned long long)d.k * 2, C3_BK, (unsigned)g_bn, true);
    const Conv3Args args{d.m, d.c, d.k, d.accumulate ? 1 : 0, d.k};
    bf16* dx = r.dx.data();
    float* part = r.part.data();
    if (d.bn)
        emu_launch(grid_for({gx, gy, 1}), {C3_THREADS, 1, 1}, [&] {
            (g_persistent ? (g_bn == 64 ? conv3_dgrad_bn_1x1_n64_p(map_dy, map_wt, dx, args, part, y, bn_x.data(), mean.data(),
                               invstd.data(), d.residual ? residual.data() : nullptr, gamma, beta, relu, signs) : conv3_dgrad_bn_1x1_p(map_dy, map_wt, dx, args, part, y, bn_x.data(), mean.data(),
                               invstd.data(), d.residual ? residual.data() : nullptr, gamma, beta, relu, signs))
             : g_bn == 64 ? conv3_dgrad_bn_1x1_n64(map_dy, map_wt, dx, args, part, y, bn_x.data(), mean.data(),
                               invstd.data(), d.residual ? residual.data() : nullptr, gamma, beta, relu, signs)
                        : conv3_dgrad_bn_1x1(map_dy, map_wt, dx, args, part, y, bn_x.data(), mean.data(),
                               invstd.data(), d.residual ? residual.data() : nullptr, gamma, beta, relu, signs));
        });
    else
        emu_launch(grid_for({gx, gy, 1}), {C3_THREADS, 1, 1}, [&] { (g_persistent ? (g_bn == 64 ? conv3_dgrad_1x1_n64_p(map_dy, map_wt, dx, args) : conv3_dgrad_1x1_p(map_dy, map_wt, dx, args)) : g_bn == 64 ? conv3_dgrad_1x1_n64(map_dy, map_wt, dx, args) : conv3_dgrad_1x1(map_dy, map_wt, dx, args)); });
    return r;
}

// γ and β of both signs and zero, and y = bn_apply's bits of ReLU(BN(x)) with them: what the
// data gradients recompute their mask from when no stored y is passed.
static void applied_output(const std::vector<bf16>& bn_x, const std::vector<float>& mean, const std::vector<float>& invstd,
                           int c_count, std::vector<bf16>& gamma, std::vector<bf16>& beta, std::vector<bf16>& y) {
    gamma.resize(c_count);
    beta.resize(c_count);
    y.resize(bn_x.size());
    for (int c = 0; c < c_count; ++c) {
        gamma[c] = __float2bfloat16_rn(c % 5 == 2 ? 0.0f : (c % 2 ? -0.75f : 1.5f) * (1 + c % 3));
        beta[c] = __float2bfloat16_rn(c % 5 == 2 ? 0.5f : 0.125f * (c % 4) - 0.25f);
    }
    for (size_t o = 0; o < y.size(); ++o) {
        const int c = (int)(o % c_count);
        float v = (__bfloat162float(bn_x[o]) - mean[c]) * invstd[c] * __bfloat162float(gamma[c]) + __bfloat162float(beta[c]);
        y[o] = __float2bfloat16_rn(fmaxf(v, 0.0f));
    }
}

// y's signs as bn_apply_signs_vec packs them: bit e of byte o / 8 is [y[o] > 0], o = 8·(o / 8) + e.
static std::vector<unsigned char> packed_signs(const std::vector<bf16>& y) {
    std::vector<unsigned char> bits(y.size() / 8, 0);
    for (size_t o = 0; o < y.size(); ++o)
        if (__bfloat162float(y[o]) > 0) bits[o / 8] |= (unsigned char)(1u << (o % 8));
    return bits;
}

static void check_dgrad(const Dgrad& d) {
    std::mt19937 rng(d.m * 977 + d.c * 13 + d.k + 2 * d.bn + 4 * d.accumulate + 8 * d.residual + 16 * d.mask);
    const std::string name = std::string(d.bn ? "conv3_dgrad_bn_1x1" : "conv3_dgrad_1x1") + " m" + std::to_string(d.m) +
                             " c" + std::to_string(d.c) + " k" + std::to_string(d.k) + (d.accumulate ? " +dx" : "") +
                             (d.residual ? " +residual" : "") + (d.mask ? " relu" : "");
    printf("%s\n", name.c_str());
    const auto dy = random_bf16(rng, (size_t)d.m * d.k, 1.0f);
    const auto w = random_bf16(rng, (size_t)d.k * d.c, 0.5f);  // the convolution's [K][C] weight
    // The transpose the dgrad reads: exact bits.
    std::vector<bf16> wt((size_t)d.c * d.k, __float2bfloat16_rn(NAN));
    const int rows = d.k, cols = d.c;
    emu_launch({(unsigned)((cols + 31) / 32), (unsigned)((rows + 31) / 32), 1}, {32, 8, 1},
               [&] { conv3_transpose_weights(w.data(), wt.data(), rows, cols); });
    bool same = true;
    for (int k = 0; k < d.k; ++k)
        for (int c = 0; c < d.c; ++c) same &= wt[(size_t)c * d.k + k].bits == w[(size_t)k * d.c + c].bits;
    check_bits("conv3_transpose_weights", same);

    const auto dx0 = d.accumulate ? random_bf16(rng, (size_t)d.m * d.c, 1.0f) : std::vector<bf16>((size_t)d.m * d.c, __float2bfloat16_rn(NAN));
    const auto residual = random_bf16(rng, (size_t)d.m * d.c, 1.0f);
    const auto bn_y = random_bf16(rng, (size_t)d.m * d.c, 1.0f);  // about half the mask open
    const auto bn_x = random_bf16(rng, (size_t)d.m * d.c, 2.0f, 0.5f);
    std::vector<float> mean(d.c), invstd(d.c);
    for (int c = 0; c < d.c; ++c) { mean[c] = 0.5f + 0.01f * (c % 7); invstd[c] = c % 3 == 0 ? -0.75f : 1.25f; }

    g_emu_tma_eager = false;
    g_emu_block_order = 0;
    const DgradResult r = run_dgrad(d, dy, wt, dx0, bn_y, bn_x, mean, invstd, residual);

    // dx: the f64 GEMM rounded to bf16, then each addition rounded to bf16, then the mask.
    std::vector<double> got(r.dx.size()), ref(r.dx.size());
    for (int i = 0; i < d.m; ++i)
        for (int c = 0; c < d.c; ++c) {
            double s = 0;
            for (int k = 0; k < d.k; ++k)
                s += (double)__bfloat162float(dy[(size_t)i * d.k + k]) * __bfloat162float(w[(size_t)k * d.c + c]);
            const size_t o = (size_t)i * d.c + c;
            double v = rb((float)s);
            if (d.accumulate) v = rb((float)(v + __bfloat162float(dx0[o])));
            if (d.bn && d.residual) v = rb((float)(v + __bfloat162float(residual[o])));
            if (d.bn && d.mask && !(__bfloat162float(bn_y[o]) > 0)) v = 0;
            ref[o] = v;
            got[o] = __bfloat162float(r.dx[o]);
        }
    check("dx", got, ref, 2e-5 * d.k, 1.0 / 64);

    if (d.bn) {
        // The records: each 128-row tile's Σg and Σg·x̂ of the dx the kernel wrote.
        const int tiles = (d.m + C3_BM - 1) / C3_BM;
        std::vector<double> gb, rb_, gg, rg;
        for (int t = 0; t < tiles; ++t) {
            const int rows_t = std::min(C3_BM, d.m - t * C3_BM);
            for (int c = 0; c < d.c; ++c) {
                double b = 0, g = 0;
                for (int i = 0; i < rows_t; ++i) {
                    const size_t o = (size_t)(t * C3_BM + i) * d.c + c;
                    const double v = __bfloat162float(r.dx[o]);
                    b += v;
                    g += v * (__bfloat162float(bn_x[o]) - mean[c]) * invstd[c];
                }
                rb_.push_back(b);
                rg.push_back(g);
                gb.push_back(r.part[(size_t)t * d.c + c]);
                gg.push_back(r.part[(size_t)tiles * d.c + (size_t)t * d.c + c]);
            }
        }
        check("tile sums of g", gb, rb_, 1e-4, 1e-5);
        check("tile sums of g·x-hat", gg, rg, 1e-3, 1e-5);
    }

    g_emu_tma_eager = true;
    g_emu_block_order = 0x85ebca6bu;
    const DgradResult again = run_dgrad(d, dy, wt, dx0, bn_y, bn_x, mean, invstd, residual);
    g_emu_tma_eager = false;
    g_emu_block_order = 0;
    check_bits("eager TMA, shuffled blocks: same dx", memcmp(again.dx.data(), r.dx.data(), r.dx.size() * 2) == 0);
    if (d.bn)
        check_bits("eager TMA, shuffled blocks: same records",
                   memcmp(again.part.data(), r.part.data(), r.part.size() * 4) == 0);
    check_persistent(d.bn ? "dx and records" : "dx",
                     [&] { return run_dgrad(d, dy, wt, dx0, bn_y, bn_x, mean, invstd, residual); },
                     [&](const DgradResult& p) {
                         return memcmp(p.dx.data(), r.dx.data(), r.dx.size() * 2) == 0 &&
                                memcmp(p.part.data(), r.part.data(), r.part.size() * 4) == 0;
                     });
    if (d.bn && d.mask) {
        // The mask read from y's packed signs (no stored y) against the mask read from y: the
        // same dx and records.
        const auto signs = packed_signs(bn_y);
        const DgradResult packed = run_dgrad(d, dy, wt, dx0, bn_y, bn_x, mean, invstd, residual, nullptr, nullptr, signs.data());
        check_bits("mask from packed signs: same dx", memcmp(packed.dx.data(), r.dx.data(), r.dx.size() * 2) == 0);
        check_bits("mask from packed signs: same records", memcmp(packed.part.data(), r.part.data(), r.part.size() * 4) == 0);
        check_persistent("dx and records, mask from packed signs",
                         [&] { return run_dgrad(d, dy, wt, dx0, bn_y, bn_x, mean, invstd, residual, nullptr, nullptr, signs.data()); },
                         [&](const DgradResult& p) {
                             return memcmp(p.dx.data(), r.dx.data(), r.dx.size() * 2) == 0 &&
                                    memcmp(p.part.data(), r.part.data(), r.part.size() * 4) == 0;
                         });
        // The mask recomputed from bn_x, γ, β (no stored y) against the mask read from y =
        // bn_apply's bits of the same (γ of both signs and zero): the same dx and records.
        std::vector<bf16> gamma, beta, y;
        applied_output(bn_x, mean, invstd, d.c, gamma, beta, y);
        const DgradResult stored = run_dgrad(d, dy, wt, dx0, y, bn_x, mean, invstd, residual);
        const DgradResult recomputed = run_dgrad(d, dy, wt, dx0, y, bn_x, mean, invstd, residual, gamma.data(), beta.data());
        check_bits("mask recomputed from x: same dx", memcmp(recomputed.dx.data(), stored.dx.data(), r.dx.size() * 2) == 0);
        check_bits("mask recomputed from x: same records",
                   memcmp(recomputed.part.data(), stored.part.data(), r.part.size() * 4) == 0);
        check_persistent("dx and records, mask recomputed from x",
                         [&] { return run_dgrad(d, dy, wt, dx0, y, bn_x, mean, invstd, residual, gamma.data(), beta.data()); },
                         [&](const DgradResult& p) {
                             return memcmp(p.dx.data(), stored.dx.data(), r.dx.size() * 2) == 0 &&
                                    memcmp(p.part.data(), stored.part.data(), r.part.size() * 4) == 0;
                         });
    }
}


// The data gradient of a strided 1×1 (stride 2, no padding): the dgrad GEMM over dy's
// n × P × Q pixels (P = ceil(h / 2), Q = ceil(w / 2)) whose epilogue scatters row (i, p, q) to
// dx's pixel (i, 2p, 2q) and, unless accumulating, zeros to the other pixels (dx starts as NaN
// then: every pixel must be written).
struct DgradS2 { int n, h, w, c, k; bool accumulate; };

static std::vector<bf16> run_dgrad_s2(const DgradS2& d, const std::vector<bf16>& dy, const std::vector<bf16>& wt,
                                      const std::vector<bf16>& dx0) {
    const int ph = (d.h + 1) / 2, pw = (d.w + 1) / 2, m = d.n * ph * pw;
    const unsigned gx = (unsigned)((m + C3_BM - 1) / C3_BM), gy = (unsigned)((d.c + g_bn - 1) / g_bn);
    std::vector<bf16> dx = dx0;
    const BtTmaMap map_dy = emu_tma_encode_2d(dy.data(), (unsigned long long)d.k, (unsigned long long)m,
                                              (unsigned long long)d.k * 2, C3_BK, C3_BM, true);
    const BtTmaMap map_wt = emu_tma_encode_2d(wt.data(), (unsigned long long)d.k, (unsigned long long)d.c,
                                              (unsigned long long)d.k * 2, C3_BK, (unsigned)g_bn, true);
    Conv3Args args{m, d.c, d.k, d.accumulate ? 1 : 0, d.k};
    args.height = d.h;
    args.width = d.w;
    args.stride = 2;
    bf16* out = dx.data();
    emu_launch(grid_for({gx, gy, 1}), {C3_THREADS, 1, 1}, [&] {
        (g_persistent ? (g_bn == 64 ? conv3_dgrad_1x1_n64_p(map_dy, map_wt, out, args) : conv3_dgrad_1x1_p(map_dy, map_wt, out, args))
         : g_bn == 64 ? conv3_dgrad_1x1_n64(map_dy, map_wt, out, args) : conv3_dgrad_1x1(map_dy, map_wt, out, args));
    });
    return dx;
}

static void check_dgrad_s2(const DgradS2& d) {
    std::mt19937 rng(d.n * 7919 + d.h * 131 + d.w * 17 + d.c * 3 + d.k + 5 * d.accumulate);
    const int ph = (d.h + 1) / 2, pw = (d.w + 1) / 2;
    printf("conv3_dgrad_1x1 stride 2: n%d %dx%d (dy %dx%d) c%d k%d%s\n", d.n, d.h, d.w, ph, pw, d.c, d.k,
           d.accumulate ? " +dx" : "");
    const auto dy = random_bf16(rng, (size_t)d.n * ph * pw * d.k, 1.0f);
    const auto w = random_bf16(rng, (size_t)d.k * d.c, 0.5f);  // [K][C]
    std::vector<bf16> wt((size_t)d.c * d.k);
    for (int k = 0; k < d.k; ++k)
        for (int c = 0; c < d.c; ++c) wt[(size_t)c * d.k + k] = w[(size_t)k * d.c + c];
    const size_t len = (size_t)d.n * d.h * d.w * d.c;
    const auto dx0 = d.accumulate ? random_bf16(rng, len, 1.0f) : std::vector<bf16>(len, __float2bfloat16_rn(NAN));

    g_emu_tma_eager = false;
    g_emu_block_order = 0;
    const auto dx = run_dgrad_s2(d, dy, wt, dx0);
    std::vector<double> got(len), ref(len);
    for (int i = 0; i < d.n; ++i)
        for (int h = 0; h < d.h; ++h)
            for (int x = 0; x < d.w; ++x)
                for (int c = 0; c < d.c; ++c) {
                    const size_t o = (((size_t)i * d.h + h) * d.w + x) * d.c + c;
                    double v = d.accumulate ? __bfloat162float(dx0[o]) : 0.0;
                    if (h % 2 == 0 && x % 2 == 0) {
                        const size_t row = ((size_t)i * ph + h / 2) * pw + x / 2;
                        double s = 0;
                        for (int k = 0; k < d.k; ++k)
                            s += (double)__bfloat162float(dy[row * d.k + k]) * __bfloat162float(w[(size_t)k * d.c + c]);
                        v = d.accumulate ? rb((float)(rb((float)s) + v)) : rb((float)s);
                    }
                    ref[o] = v;
                    got[o] = __bfloat162float(dx[o]);
                }
    check("dx", got, ref, 2e-5 * d.k, 1.0 / 64);

    g_emu_tma_eager = true;
    g_emu_block_order = 0x85ebca6bu;
    const auto again = run_dgrad_s2(d, dy, wt, dx0);
    g_emu_tma_eager = false;
    g_emu_block_order = 0;
    check_bits("eager TMA, shuffled blocks: same dx", memcmp(again.data(), dx.data(), len * 2) == 0);
    check_persistent("dx", [&] { return run_dgrad_s2(d, dy, wt, dx0); },
                     [&](const std::vector<bf16>& p) { return memcmp(p.data(), dx.data(), len * 2) == 0; });
}

// The weight gradient: dw[K][C] = Σ_p dy[p][K]·x[p][C] over P pixels in slices of `chunk`
// pixels (f32 planes, summed here in slice order as conv2_wgrad_reduce does).
struct Wgrad { int p, k, c, chunk; };

static std::vector<float> run_wgrad(const Wgrad& g, const std::vector<bf16>& dy, const std::vector<bf16>& x) {
    const int slices = (g.p + g.chunk - 1) / g.chunk;
    std::vector<float> planes((size_t)slices * g.k * g.c, NAN);
    const BtTmaMap map_dy = emu_tma_encode_2d(dy.data(), (unsigned long long)g.k, (unsigned long long)g.p,
                                              (unsigned long long)g.k * 2, 64, C3_BK, true);
    const BtTmaMap map_x = emu_tma_encode_2d(x.data(), (unsigned long long)g.c, (unsigned long long)g.p,
                                             (unsigned long long)g.c * 2, 64, C3_BK, true);
    const Conv3Args args{g.k, g.c, g.p, 0, g.chunk};
    float* dw = planes.data();
    decltype(&conv3_wgrad_1x1) const by_tile[] = {conv3_wgrad_1x1, conv3_wgrad_1x1_n64, conv3_wgrad_1x1_m64};
    auto* kernel = by_tile[g_bm == 64 ? 2 : g_bn == 64 ? 1 : 0];
    emu_launch({(unsigned)((g.k + g_bm - 1) / g_bm), (unsigned)((g.c + g_bn - 1) / g_bn), (unsigned)slices},
               {C3_THREADS, 1, 1}, [&] { kernel(map_dy, map_x, dw, args); });
    return planes;
}

static void check_wgrad(const Wgrad& g) {
    std::mt19937 rng(g.p * 31 + g.k * 17 + g.c * 3 + g.chunk);
    const int slices = (g.p + g.chunk - 1) / g.chunk;
    printf("conv3_wgrad_1x1%s p%d k%d c%d, %d slice(s) of %d\n", g_bm == 64 ? "_m64" : g_bn == 64 ? "_n64" : "", g.p, g.k,
           g.c, slices, g.chunk);
    const auto dy = random_bf16(rng, (size_t)g.p * g.k, 1.0f);
    const auto x = random_bf16(rng, (size_t)g.p * g.c, 1.0f, 0.25f);
    g_emu_tma_eager = false;
    g_emu_block_order = 0;
    const auto planes = run_wgrad(g, dy, x);
    const size_t plane = (size_t)g.k * g.c;
    std::vector<double> got(plane), ref(plane);
    for (size_t i = 0; i < plane; ++i) {
        float s = planes[i];
        for (int z = 1; z < slices; ++z) s += planes[z * plane + i];
        got[i] = s;
    }
    for (int o = 0; o < g.k; ++o)
        for (int c = 0; c < g.c; ++c) {
            double s = 0;
            for (int p = 0; p < g.p; ++p)
                s += (double)__bfloat162float(dy[(size_t)p * g.k + o]) * __bfloat162float(x[(size_t)p * g.c + c]);
            ref[(size_t)o * g.c + c] = s;
        }
    check("dw (planes summed in order)", got, ref, 2e-6 * g.p, 1e-5);
    g_emu_tma_eager = true;
    g_emu_block_order = 0x27d4eb2fu;
    const auto again = run_wgrad(g, dy, x);
    g_emu_tma_eager = false;
    g_emu_block_order = 0;
    check_bits("eager TMA, shuffled blocks: same planes", memcmp(again.data(), planes.data(), planes.size() * 4) == 0);
}

// The forward through the 4-D path: a 3×3 with padding 1 at stride 1 or 2, or a 1×1 at
// stride 2 (ks = 1: one tap, no padding): y[n][h][w][k] = Σ x[n][h·s+r−p][w·s+t−p][c]·w[k][r][t][c]
// over the input n × h × w (odd extents allowed), tiles of tile_n images × tile_h × tile_w
// output pixels chosen as src/cuda/conv3.rs does (powers of two dividing the output's extents,
// 128 pixels in all; none when the batch does not divide); at stride 2 the input's tensor map
// traverses its columns and rows with stride 2.
struct Conv3x3 { int n, h, w, c, k; bool stats; int ks = 3, stride = 1; };

static bool tile_3x3(int n, int h, int w, int& th, int& tw, int& tn, int pixels = C3_BM) {
    auto pow2 = [](int v, int cap) { int p = 1; while (p * 2 <= cap && v % (p * 2) == 0) p *= 2; return p; };
    tw = pow2(w, pixels);
    th = pow2(h, pixels / tw);
    tn = pixels / (tw * th);
    return n % tn == 0;
}

static void check_3x3(const Conv3x3& g) {
    const int pad = g.ks == 3 ? 1 : 0, taps = g.ks * g.ks, s = g.stride;
    const int ho = (g.h + 2 * pad - g.ks) / s + 1, wo = (g.w + 2 * pad - g.ks) / s + 1;
    int th, tw, tn;
    if (!tile_3x3(g.n, ho, wo, th, tw, tn)) { printf("  no whole tile for %d×%d×%d\n", g.n, ho, wo); ++failures; return; }
    std::mt19937 rng(g.n * 7 + g.h * 11 + g.w * 13 + g.c + g.k + 17 * g.ks + 19 * s);
    const auto x = random_bf16(rng, (size_t)g.n * g.h * g.w * g.c, 1.0f, 0.25f);
    const auto w = random_bf16(rng, (size_t)g.k * taps * g.c, 0.25f);
    const std::string name = std::string(g.stats ? "conv3_fwd_stats_3x3" : "conv3_fwd_3x3") + " n" + std::to_string(g.n) +
                             " " + std::to_string(g.h) + "x" + std::to_string(g.w) + " c" + std::to_string(g.c) + " k" +
                             std::to_string(g.k) + (g.ks == 1 ? " 1x1" : "") + (s > 1 ? " stride " + std::to_string(s) : "") +
                             ", tiles " + std::to_string(tn) + "x" + std::to_string(th) + "x" + std::to_string(tw);
    printf("%s\n", name.c_str());
    const int m = g.n * ho * wo, tiles = m / C3_BM;
    auto run3 = [&](std::vector<bf16>& y, std::vector<float>& part) {
        const unsigned long long dim[4] = {(unsigned long long)g.c, (unsigned long long)g.w, (unsigned long long)g.h,
                                           (unsigned long long)g.n};
        const unsigned long long stride[3] = {(unsigned long long)g.c * 2, (unsigned long long)g.w * g.c * 2,
                                              (unsigned long long)g.h * g.w * g.c * 2};
        // tile_w × tile_h output pixels: boxes of s·tile_w × s·tile_h input pixels traversed with stride s
        const unsigned box[4] = {C3_BK, (unsigned)(s * tw), (unsigned)(s * th), (unsigned)tn};
        const unsigned traversal[4] = {1, (unsigned)s, (unsigned)s, 1};
        const BtTmaMap map_x = emu_tma_encode(x.data(), 4, dim, stride, box, true, traversal);
        const BtTmaMap map_w = emu_tma_encode_2d(w.data(), (unsigned long long)taps * g.c, (unsigned long long)g.k,
                                                 (unsigned long long)taps * g.c * 2, C3_BK, (unsigned)g_bn, true);
        Conv3Args args{m, g.k, taps * g.c, 0, taps * g.c, ho, wo, th, tw, pad, g.ks, 0, s};
        bf16* yp = y.data();
        float* pp = part.data();
        const dim3e grid{(unsigned)tiles, (unsigned)((g.k + g_bn - 1) / g_bn), 1};
        if (g.stats) emu_launch(grid_for(grid), {C3_THREADS, 1, 1}, [&] { (g_persistent ? (g_bn == 64 ? conv3_fwd_stats_3x3_n64_p(map_x, map_w, yp, args, pp) : conv3_fwd_stats_3x3_p(map_x, map_w, yp, args, pp)) : g_bn == 64 ? conv3_fwd_stats_3x3_n64(map_x, map_w, yp, args, pp) : conv3_fwd_stats_3x3(map_x, map_w, yp, args, pp)); });
        else emu_launch(grid_for(grid), {C3_THREADS, 1, 1}, [&] { (g_persistent ? (g_bn == 64 ? conv3_fwd_3x3_n64_p(map_x, map_w, yp, args) : conv3_fwd_3x3_p(map_x, map_w, yp, args)) : g_bn == 64 ? conv3_fwd_3x3_n64(map_x, map_w, yp, args) : conv3_fwd_3x3(map_x, map_w, yp, args)); });
    };
    std::vector<bf16> y((size_t)m * g.k, __float2bfloat16_rn(NAN));
    std::vector<float> part(g.stats ? 2 * (size_t)tiles * g.k : 0, NAN);
    g_emu_tma_eager = false;
    g_emu_block_order = 0;
    run3(y, part);
    std::vector<double> got(y.size()), ref(y.size());
    for (int n = 0; n < g.n; ++n)
        for (int h = 0; h < ho; ++h)
            for (int q = 0; q < wo; ++q)
                for (int k = 0; k < g.k; ++k) {
                    double acc = 0;
                    for (int r = 0; r < g.ks; ++r)
                        for (int t = 0; t < g.ks; ++t) {
                            const int hh = h * s + r - pad, ww = q * s + t - pad;
                            if (hh < 0 || hh >= g.h || ww < 0 || ww >= g.w) continue;
                            for (int c = 0; c < g.c; ++c)
                                acc += (double)__bfloat162float(x[(((size_t)n * g.h + hh) * g.w + ww) * g.c + c]) *
                                       __bfloat162float(w[((size_t)k * taps + r * g.ks + t) * g.c + c]);
                        }
                    const size_t o = (((size_t)n * ho + h) * wo + q) * g.k + k;
                    ref[o] = acc;
                    got[o] = __bfloat162float(y[o]);
                }
    check("y", got, ref, 2e-5 * taps * g.c, 1.0 / 256);
    if (g.stats) {
        // Tile b's records: the mean and M2 over its 128 output pixels (tile_n images × tile_h × tile_w).
        const int wb = wo / tw, hb = ho / th;
        std::vector<double> gm, rm, gq, rq;
        for (int b = 0; b < tiles; ++b) {
            const int w0 = b % wb * tw, h0 = b / wb % hb * th, n0 = b / (wb * hb) * tn;
            for (int k = 0; k < g.k; ++k) {
                double sum = 0, q = 0;
                std::vector<double> v;
                for (int i = 0; i < tn; ++i)
                    for (int hh = 0; hh < th; ++hh)
                        for (int ww = 0; ww < tw; ++ww)
                            v.push_back(__bfloat162float(y[(((size_t)(n0 + i) * ho + h0 + hh) * wo + w0 + ww) * g.k + k]));
                for (double e : v) sum += e;
                const double mean = sum / v.size();
                for (double e : v) q += (e - mean) * (e - mean);
                rm.push_back(mean);
                rq.push_back(q);
                gm.push_back(part[(size_t)b * g.k + k]);
                gq.push_back(part[(size_t)tiles * g.k + (size_t)b * g.k + k]);
            }
        }
        check("tile means", gm, rm, 1e-5, 1e-5);
        check("tile M2", gq, rq, 1e-4, 1e-5);
    }
    std::vector<bf16> y2((size_t)m * g.k, __float2bfloat16_rn(NAN));
    std::vector<float> part2(part.size(), NAN);
    g_emu_tma_eager = true;
    g_emu_block_order = 0x165667b1u;
    run3(y2, part2);
    g_emu_tma_eager = false;
    g_emu_block_order = 0;
    check_bits("eager TMA, shuffled blocks: same y", memcmp(y2.data(), y.data(), y.size() * 2) == 0);
    if (g.stats) check_bits("eager TMA, shuffled blocks: same records", memcmp(part2.data(), part.data(), part.size() * 4) == 0);
    check_persistent(g.stats ? "y and records" : "y",
                     [&] {
                         std::pair<std::vector<bf16>, std::vector<float>> p{std::vector<bf16>(y.size(), __float2bfloat16_rn(NAN)),
                                                                            std::vector<float>(part.size(), NAN)};
                         run3(p.first, p.second);
                         return p;
                     },
                     [&](const std::pair<std::vector<bf16>, std::vector<float>>& p) {
                         return memcmp(p.first.data(), y.data(), y.size() * 2) == 0 &&
                                memcmp(p.second.data(), part.data(), part.size() * 4) == 0;
                     });
}

// The 3×3 data gradient at stride 1, padding 1: dx[n][h][w][c] = Σ dy[n][h+1−r][w+1−s][k]·w[k][r][s][c]
// through wt = conv3_dgrad_weights_3x3(w), with the batch-norm gradient epilogue when `bn`.
// At stride 2 (h and w even) the four phases (grid.z): each over tiles of dy's h/2 × w/2
// pixels with its 1, 2 or 4 taps, wt = conv3_dgrad_weights_s2(w), its rows scattered to dx's
// (2h + ph, 2w + pw); record z·tiles + b covers tile b of phase z.
struct Dgrad3x3 { int n, h, w, c, k; bool bn, accumulate; int stride = 1; };

static void check_dgrad_3x3(const Dgrad3x3& g) {
    int th, tw, tn;
    const int s = g.stride, dh = g.h / s, dw = g.w / s, phases = s * s;  // dy's extents
    if (!tile_3x3(g.n, dh, dw, th, tw, tn)) { printf("  no whole tile\n"); ++failures; return; }
    std::mt19937 rng(g.n * 5 + g.h * 3 + g.c * 7 + g.k + g.bn + 2 * g.accumulate);
    const size_t px = (size_t)g.n * g.h * g.w, dy_px = (size_t)g.n * dh * dw;
    const auto dy = random_bf16(rng, dy_px * g.k, 1.0f);
    const auto w = random_bf16(rng, (size_t)g.k * 9 * g.c, 0.25f);
    const auto dx0 = g.accumulate ? random_bf16(rng, px * g.c, 1.0f) : std::vector<bf16>(px * g.c, __float2bfloat16_rn(NAN));
    const auto residual = random_bf16(rng, px * g.c, 1.0f);
    const auto bn_y = random_bf16(rng, px * g.c, 1.0f);
    const auto bn_x = random_bf16(rng, px * g.c, 2.0f, 0.5f);
    std::vector<float> mean(g.c), invstd(g.c);
    for (int c = 0; c < g.c; ++c) { mean[c] = 0.25f + 0.01f * (c % 5); invstd[c] = c % 4 == 1 ? -1.5f : 0.75f; }
    printf("%s n%d %dx%d c%d k%d%s%s, tiles %dx%dx%d\n", g.bn ? "conv3_dgrad_bn_3x3" : "conv3_dgrad_3x3", g.n, g.h, g.w, g.c,
           g.k, g.accumulate ? " +dx" : "", s == 2 ? " stride 2 (4 phases)" : "", tn, th, tw);
    // wt: [C][9·K] at stride 1; [4 phases][C][4 taps·K] at stride 2.
    const int wt_cols = s == 2 ? 4 * g.k : 9 * g.k, wt_rows = phases * g.c;
    std::vector<bf16> wt((size_t)wt_rows * wt_cols, __float2bfloat16_rn(NAN));
    bool same = true;
    if (s == 2) {
        emu_launch({4, 1, 1}, {64, 1, 1}, [&] { conv3_dgrad_weights_s2(w.data(), wt.data(), g.k, g.c); });
        for (int z = 0; z < 4; ++z)
            for (int c = 0; c < g.c; ++c)
                for (int tap = 0; tap < 4; ++tap)
                    for (int k = 0; k < g.k; ++k) {
                        const int ph = z / 2, pw = z % 2, ri = tap / (1 + pw), ti = tap % (1 + pw);
                        const unsigned short want =
                            ri > ph ? 0 : w[((size_t)k * 9 + (ph ? 2 * ri : 1) * 3 + (pw ? 2 * ti : 1)) * g.c + c].bits;
                        same &= wt[(((size_t)z * g.c + c) * 4 + tap) * g.k + k].bits == want;
                    }
        check_bits("conv3_dgrad_weights_s2", same);
    } else {
        emu_launch({4, 1, 1}, {64, 1, 1}, [&] { conv3_dgrad_weights_3x3(w.data(), wt.data(), g.k, 9, g.c); });
        for (int k = 0; k < g.k; ++k)
            for (int t = 0; t < 9; ++t)
                for (int c = 0; c < g.c; ++c) same &= wt[((size_t)c * 9 + t) * g.k + k].bits == w[((size_t)k * 9 + t) * g.c + c].bits;
        check_bits("conv3_dgrad_weights_3x3", same);
    }
    const int m = (int)dy_px, tiles = m / C3_BM;
    // y_in: the stored output the mask is read from (bn_y if null); gamma, beta given: no stored
    // output, the mask recomputed from bn_x.
    auto run = [&](std::vector<bf16>& dx, std::vector<float>& part, const bf16* y_in = nullptr,
                   const bf16* gamma = nullptr, const bf16* beta = nullptr, const unsigned char* signs = nullptr) {
        const bf16* ys = gamma != nullptr || signs != nullptr ? nullptr : y_in != nullptr ? y_in : bn_y.data();
        const unsigned long long dim[4] = {(unsigned long long)g.k, (unsigned long long)dw, (unsigned long long)dh,
                                           (unsigned long long)g.n};
        const unsigned long long stride[3] = {(unsigned long long)g.k * 2, (unsigned long long)dw * g.k * 2,
                                              (unsigned long long)dh * dw * g.k * 2};
        const unsigned box[4] = {C3_BK, (unsigned)tw, (unsigned)th, (unsigned)tn};
        const BtTmaMap map_dy = emu_tma_encode(dy.data(), 4, dim, stride, box, true);
        const BtTmaMap map_wt = emu_tma_encode_2d(wt.data(), (unsigned long long)wt_cols, (unsigned long long)wt_rows,
                                                  (unsigned long long)wt_cols * 2, C3_BK, (unsigned)g_bn, true);
        const Conv3Args args = s == 2 ? Conv3Args{m, g.c, 4 * g.k, g.accumulate ? 1 : 0, g.k, dh, dw, th, tw, 1, 3, 1, 2}
                                      : Conv3Args{m, g.c, 9 * g.k, g.accumulate ? 1 : 0, 9 * g.k, g.h, g.w, th, tw, 1, 3, 1, 1};
        bf16* dxp = dx.data();
        float* pp = part.data();
        const dim3e grid{(unsigned)tiles, (unsigned)((g.c + g_bn - 1) / g_bn), (unsigned)phases};
        if (g.bn)
            emu_launch(grid_for(grid), {C3_THREADS, 1, 1}, [&] {
                (g_persistent ? (g_bn == 64 ? conv3_dgrad_bn_3x3_n64_p(map_dy, map_wt, dxp, args, pp, ys, bn_x.data(), mean.data(), invstd.data(),
                                   residual.data(), gamma, beta, 1, signs) : conv3_dgrad_bn_3x3_p(map_dy, map_wt, dxp, args, pp, ys, bn_x.data(), mean.data(), invstd.data(),
                                   residual.data(), gamma, beta, 1, signs))
                 : g_bn == 64 ? conv3_dgrad_bn_3x3_n64(map_dy, map_wt, dxp, args, pp, ys, bn_x.data(), mean.data(), invstd.data(),
                                   residual.data(), gamma, beta, 1, signs) : conv3_dgrad_bn_3x3(map_dy, map_wt, dxp, args, pp, ys, bn_x.data(), mean.data(), invstd.data(),
                                   residual.data(), gamma, beta, 1, signs));
            });
        else emu_launch(grid_for(grid), {C3_THREADS, 1, 1}, [&] { (g_persistent ? (g_bn == 64 ? conv3_dgrad_3x3_n64_p(map_dy, map_wt, dxp, args) : conv3_dgrad_3x3_p(map_dy, map_wt, dxp, args)) : g_bn == 64 ? conv3_dgrad_3x3_n64(map_dy, map_wt, dxp, args) : conv3_dgrad_3x3(map_dy, map_wt, dxp, args)); });
    };
    std::vector<bf16> dx = dx0;
    std::vector<float> part(g.bn ? 2 * (size_t)phases * tiles * g.c : 0, NAN);
    g_emu_tma_eager = false;
    g_emu_block_order = 0;
    run(dx, part);
    std::vector<double> got(dx.size()), ref(dx.size());
    for (int n = 0; n < g.n; ++n)
        for (int h = 0; h < g.h; ++h)
            for (int q = 0; q < g.w; ++q)
                for (int c = 0; c < g.c; ++c) {
                    double acc = 0;
                    for (int r = 0; r < 3; ++r)
                        for (int t = 0; t < 3; ++t) {
                            // dy's pixel whose tap (r, t) lands on (h, q): (h + 1 − r) / s
                            if ((h + 1 - r) % s != 0 || (q + 1 - t) % s != 0) continue;
                            const int hh = (h + 1 - r) / s, ww = (q + 1 - t) / s;
                            if (h + 1 - r < 0 || hh >= dh || q + 1 - t < 0 || ww >= dw) continue;
                            for (int k = 0; k < g.k; ++k)
                                acc += (double)__bfloat162float(dy[(((size_t)n * dh + hh) * dw + ww) * g.k + k]) *
                                       __bfloat162float(w[((size_t)k * 9 + r * 3 + t) * g.c + c]);
                        }
                    const size_t o = (((size_t)n * g.h + h) * g.w + q) * g.c + c;
                    double v = rb((float)acc);
                    if (g.accumulate) v = rb((float)(v + __bfloat162float(dx0[o])));
                    if (g.bn) {
                        v = rb((float)(v + __bfloat162float(residual[o])));
                        if (!(__bfloat162float(bn_y[o]) > 0)) v = 0;
                    }
                    ref[o] = v;
                    got[o] = __bfloat162float(dx[o]);
                }
    check("dx", got, ref, 2e-5 * 9 * g.k, 1.0 / 64);
    if (g.bn) {
        const int wb = dw / tw, hb = dh / th;
        std::vector<double> gb, rb_, gg, rg;
        for (int zb = 0; zb < phases * tiles; ++zb) {
            const int b = zb % tiles, ph = zb / tiles / s, pw = zb / tiles % s;
            const int w0 = b % wb * tw, h0 = b / wb % hb * th, n0 = b / (wb * hb) * tn;
            for (int c = 0; c < g.c; ++c) {
                double sb = 0, sg = 0;
                for (int i = 0; i < tn; ++i)
                    for (int hh = 0; hh < th; ++hh)
                        for (int ww = 0; ww < tw; ++ww) {
                            const size_t o = (((size_t)(n0 + i) * g.h + s * (h0 + hh) + ph) * g.w + s * (w0 + ww) + pw) * g.c + c;
                            const double v = __bfloat162float(dx[o]);
                            sb += v;
                            sg += v * (__bfloat162float(bn_x[o]) - mean[c]) * invstd[c];
                        }
                rb_.push_back(sb);
                rg.push_back(sg);
                gb.push_back(part[(size_t)zb * g.c + c]);
                gg.push_back(part[(size_t)phases * tiles * g.c + (size_t)zb * g.c + c]);
            }
        }
        check("tile sums of g", gb, rb_, 1e-4, 1e-5);
        check("tile sums of g·x-hat", gg, rg, 1e-3, 1e-5);
    }
    std::vector<bf16> dx2 = dx0;
    std::vector<float> part2(part.size(), NAN);
    g_emu_tma_eager = true;
    g_emu_block_order = 0xd3a2646cu;
    run(dx2, part2);
    g_emu_tma_eager = false;
    g_emu_block_order = 0;
    check_bits("eager TMA, shuffled blocks: same dx", memcmp(dx2.data(), dx.data(), dx.size() * 2) == 0);
    if (g.bn) check_bits("eager TMA, shuffled blocks: same records", memcmp(part2.data(), part.data(), part.size() * 4) == 0);
    check_persistent(g.bn ? "dx and records" : "dx",
                     [&] {
                         std::pair<std::vector<bf16>, std::vector<float>> p{dx0, std::vector<float>(part.size(), NAN)};
                         run(p.first, p.second);
                         return p;
                     },
                     [&](const std::pair<std::vector<bf16>, std::vector<float>>& p) {
                         return memcmp(p.first.data(), dx.data(), dx.size() * 2) == 0 &&
                                memcmp(p.second.data(), part.data(), part.size() * 4) == 0;
                     });
    if (!g.bn) return;
    // The mask read from y's packed signs (no stored y) against the mask read from y.
    const auto signs = packed_signs(bn_y);
    std::vector<bf16> dx_packed = dx0;
    std::vector<float> part_packed(part.size(), NAN);
    run(dx_packed, part_packed, nullptr, nullptr, nullptr, signs.data());
    check_bits("mask from packed signs: same dx", memcmp(dx_packed.data(), dx.data(), dx.size() * 2) == 0);
    check_bits("mask from packed signs: same records", memcmp(part_packed.data(), part.data(), part.size() * 4) == 0);
    check_persistent("dx and records, mask from packed signs",
                     [&] {
                         std::pair<std::vector<bf16>, std::vector<float>> p{dx0, std::vector<float>(part.size(), NAN)};
                         run(p.first, p.second, nullptr, nullptr, nullptr, signs.data());
                         return p;
                     },
                     [&](const std::pair<std::vector<bf16>, std::vector<float>>& p) {
                         return memcmp(p.first.data(), dx.data(), dx.size() * 2) == 0 &&
                                memcmp(p.second.data(), part.data(), part.size() * 4) == 0;
                     });
    // The mask recomputed from bn_x, γ, β (no stored y) against the mask read from bn_apply's y
    // of the same: the same dx and records, one tile a block and persistent.
    std::vector<bf16> gamma, beta, y;
    applied_output(bn_x, mean, invstd, g.c, gamma, beta, y);
    std::vector<bf16> dx_stored = dx0, dx_late = dx0;
    std::vector<float> part_stored(part.size(), NAN), part_late(part.size(), NAN);
    run(dx_stored, part_stored, y.data());
    run(dx_late, part_late, nullptr, gamma.data(), beta.data());
    check_bits("mask recomputed from x: same dx", memcmp(dx_late.data(), dx_stored.data(), dx.size() * 2) == 0);
    check_bits("mask recomputed from x: same records", memcmp(part_late.data(), part_stored.data(), part.size() * 4) == 0);
    check_persistent("dx and records, mask recomputed from x",
                     [&] {
                         std::pair<std::vector<bf16>, std::vector<float>> p{dx0, std::vector<float>(part.size(), NAN)};
                         run(p.first, p.second, nullptr, gamma.data(), beta.data());
                         return p;
                     },
                     [&](const std::pair<std::vector<bf16>, std::vector<float>>& p) {
                         return memcmp(p.first.data(), dx_stored.data(), dx.size() * 2) == 0 &&
                                memcmp(p.second.data(), part_stored.data(), part.size() * 4) == 0;
                     });
}

// The weight gradient through the 4-D path: a 3×3 with padding 1 at stride 1 or 2, or a 1×1 at
// stride 2 (ks = 1): dw[k][r][t][c] = Σ dy[n][h][w][k]·x[n][h·s+r−p][w·s+t−p][c] over the
// output's pixels in slices of `chunk` (whole 64-pixel tiles of the output), the planes summed
// in slice order; x's tensor map traverses its columns and rows with stride s.
struct Wgrad3x3 { int n, h, w, c, k, chunk; int ks = 3, stride = 1; };

static void check_wgrad_3x3(const Wgrad3x3& g) {
    const int pad = g.ks == 3 ? 1 : 0, taps = g.ks * g.ks, s = g.stride;
    const int ho = (g.h + 2 * pad - g.ks) / s + 1, wo = (g.w + 2 * pad - g.ks) / s + 1;
    int th, tw, tn;
    if (!tile_3x3(g.n, ho, wo, th, tw, tn, C3_BK)) { printf("  no whole 64-pixel tile\n"); ++failures; return; }
    std::mt19937 rng(g.n * 3 + g.h * 5 + g.c * 11 + g.k * 13 + g.chunk + 23 * g.ks + 29 * s);
    const size_t px = (size_t)g.n * ho * wo, in_px = (size_t)g.n * g.h * g.w;
    const auto dy = random_bf16(rng, px * g.k, 1.0f);
    const auto x = random_bf16(rng, in_px * g.c, 1.0f, 0.25f);
    const int slices = (int)((px + g.chunk - 1) / g.chunk);
    printf("conv3_wgrad_3x3%s n%d %dx%d c%d k%d%s%s, tiles %dx%dx%d, %d slice(s) of %d\n",
           g_bm == 64 ? "_m64" : g_bn == 64 ? "_n64" : "", g.n, g.h, g.w, g.c, g.k, g.ks == 1 ? " 1x1" : "",
           s > 1 ? " stride 2" : "", tn, th, tw, slices, g.chunk);
    const size_t plane = (size_t)g.k * taps * g.c;
    auto run = [&](std::vector<float>& planes) {
        auto map4 = [&](const std::vector<bf16>& t, int ch, int hh, int ww, int es) {
            const unsigned long long dim[4] = {(unsigned long long)ch, (unsigned long long)ww, (unsigned long long)hh,
                                               (unsigned long long)g.n};
            const unsigned long long stride[3] = {(unsigned long long)ch * 2, (unsigned long long)ww * ch * 2,
                                                  (unsigned long long)hh * ww * ch * 2};
            const unsigned box[4] = {64, (unsigned)(es * tw), (unsigned)(es * th), (unsigned)tn};
            const unsigned traversal[4] = {1, (unsigned)es, (unsigned)es, 1};
            return emu_tma_encode(t.data(), 4, dim, stride, box, true, traversal);
        };
        const BtTmaMap map_dy = map4(dy, g.k, ho, wo, 1), map_x = map4(x, g.c, g.h, g.w, s);
        const Conv3Args args{g.k, taps * g.c, (int)px, 0, g.chunk, ho, wo, th, tw, pad, g.ks, 0, s};
        float* dw = planes.data();
        decltype(&conv3_wgrad_3x3) const by_tile[] = {conv3_wgrad_3x3, conv3_wgrad_3x3_n64, conv3_wgrad_3x3_m64};
        auto* kernel = by_tile[g_bm == 64 ? 2 : g_bn == 64 ? 1 : 0];
        emu_launch({(unsigned)((g.k + g_bm - 1) / g_bm), (unsigned)((taps * g.c + g_bn - 1) / g_bn), (unsigned)slices},
                   {C3_THREADS, 1, 1}, [&] { kernel(map_dy, map_x, dw, args); });
    };
    std::vector<float> planes((size_t)slices * plane, NAN);
    g_emu_tma_eager = false;
    g_emu_block_order = 0;
    run(planes);
    std::vector<double> got(plane), ref(plane);
    for (size_t i = 0; i < plane; ++i) {
        float v = planes[i];
        for (int z = 1; z < slices; ++z) v += planes[z * plane + i];
        got[i] = v;
    }
    for (int k = 0; k < g.k; ++k)
        for (int r = 0; r < g.ks; ++r)
            for (int t = 0; t < g.ks; ++t)
                for (int c = 0; c < g.c; ++c) {
                    double acc = 0;
                    for (int n = 0; n < g.n; ++n)
                        for (int h = 0; h < ho; ++h)
                            for (int q = 0; q < wo; ++q) {
                                const int hh = h * s + r - pad, ww = q * s + t - pad;
                                if (hh < 0 || hh >= g.h || ww < 0 || ww >= g.w) continue;
                                acc += (double)__bfloat162float(dy[(((size_t)n * ho + h) * wo + q) * g.k + k]) *
                                       __bfloat162float(x[(((size_t)n * g.h + hh) * g.w + ww) * g.c + c]);
                            }
                    ref[((size_t)k * taps + r * g.ks + t) * g.c + c] = acc;
                }
    check("dw (planes summed in order)", got, ref, 2e-6 * px, 1e-5);
    std::vector<float> again(planes.size(), NAN);
    g_emu_tma_eager = true;
    g_emu_block_order = 0x2545f491u;
    run(again);
    g_emu_tma_eager = false;
    g_emu_block_order = 0;
    check_bits("eager TMA, shuffled blocks: same planes", memcmp(again.data(), planes.data(), planes.size() * 4) == 0);
}

// The weight gradient cases every tile shape runs.
static const Wgrad kWgrads[] = {
    {300, 136, 200, 320},  // one slice; tails in M (channels of dy), N and the pixels
    {520, 64, 72, 128},    // five slices, the last of 8 pixels; half-empty column tile
    {5, 8, 8, 64},         // almost all tail
    {1000, 256, 136, 320}, // two row tiles, two column tiles, four slices (the last 40)
};
static const Wgrad3x3 kWgrads3[] = {
    {4, 8, 8, 64, 72, 128},    // 64 channels: each 128-column tile spans two taps; two slices
    {2, 16, 16, 128, 64, 512}, // one slice; column tiles within a tap
    {64, 3, 3, 64, 8, 192},    // one-pixel tiles of 64 images, the padding on every tap
    // stride 2 (x's map strided): resnet50's 3×3 s2 and 1×1 s2 (downsample) layers
    {4, 16, 16, 64, 72, 128, 3, 2},  // 16 → 8: tiles of 8 × 8, two slices, a half-empty column tile
    {2, 15, 15, 64, 8, 64, 3, 2},    // odd 15 → 8: the last row and column pad; a row tail
    {2, 32, 32, 64, 8, 256, 3, 2},   // 32 → 16: tiles of 4 × 16 rows, boxes starting at input row 8, 16, 24
    {64, 7, 7, 64, 8, 192, 3, 2},    // odd 7 → 4: tiles of 4 images × 4 × 4, six slices
    {4, 16, 16, 128, 64, 128, 1, 2}, // 1×1 s2 16 → 8: one tap, two slices
    {2, 15, 31, 192, 72, 256, 1, 2}, // 1×1 s2 odd 15×31 → 8×16: tiles of 4 × 16, a column tail
    {4, 16, 16, 64, 128, 128, 1, 2}, // 1×1 s2 of 64 input channels (N = 64: the narrow twin's case)
};

int main(int argc, char** argv) {
    for (int i = 1; i < argc; ++i) first_only |= std::string(argv[i]) == "--first";
    for (int bn : {128, 64}) {
        g_bn = bn;
        printf("== tiles of %d columns (%s)\n", bn, bn == 64 ? "conv3_*_n64" : "conv3_*");
        const Gemm cases[] = {
            {128, 128, 64},   // one tile, one k-slice
            {300, 136, 200},  // tails in M, N and K (TMA zero fill)
            {200, 64, 520},   // 9 k-slices: the 4-stage ring wraps twice
            {5, 8, 8},        // a tile that is almost all tail
            {257, 256, 136},  // two column tiles, a one-row last row tile
        };
        for (const Gemm& g : cases) {
            for (bool stats : {false, true}) {
                check_gemm(g, stats);
                if (first_only && failures) break;
            }
            if (first_only && failures) break;
        }
        const Dgrad dgrads[] = {
            {300, 136, 200, false, false, false, false},  // tails everywhere
            {200, 64, 520, false, true, false, false},    // the ring wraps; added into dx
            {300, 136, 200, true, false, false, true},    // BN epilogue: mask only
            {257, 256, 136, true, true, true, true},      // every operand
            {5, 8, 8, true, false, true, false},          // residual, no mask (the ReLU-free input)
        };
        for (const Dgrad& d : dgrads) {
            if (first_only && failures) break;
            check_dgrad(d);
        }
        const DgradS2 dgrads_s2[] = {
            {2, 16, 16, 136, 200, false},  // even extents: 2 × 8 × 8 rows of dy, tails in C and K
            {3, 15, 13, 72, 520, false},   // odd 15 × 13 → 8 × 7: the last row and column of cells cut; the ring wraps
            {3, 15, 13, 136, 200, true},   // the same cells added into dx
            {1, 9, 31, 64, 64, true},      // one image, M = 5 × 16 = 80 (a tile that is mostly tail)
        };
        for (const DgradS2& d : dgrads_s2) {
            if (first_only && failures) break;
            check_dgrad_s2(d);
        }
        for (const Wgrad& g : kWgrads) {
            if (first_only && failures) break;
            check_wgrad(g);
        }
        const Conv3x3 convs[] = {
            {4, 8, 8, 64, 72, false},    // tiles of 2 images × 8 × 8, a column tail
            {2, 16, 16, 128, 136, true}, // tiles of 8 × 16 rows of one image, two taps' slices
            {8, 4, 4, 64, 64, true},     // 8 images × 4 × 4: padding on every side of every tile
            {128, 3, 3, 64, 8, true},    // 1 × 1 × 128 images: every tap but the centre pads
            // stride 2 (strided input maps): resnet50's 3×3 s2 and 1×1 s2 (downsample) layers
            {4, 16, 16, 64, 72, false, 3, 2},  // 16 → 8: tiles of 2 images × 8 × 8, the padding on top and left
            {2, 15, 15, 128, 64, true, 3, 2},  // odd input 15 → 8: the last row and column pad below and right
            {32, 7, 13, 64, 136, true, 3, 2},  // 7×13 → 4×7: tiles of 32 images × 4 × 1, a column tail in N
            {4, 16, 16, 128, 64, true, 1, 2},  // 1×1 s2: one tap, two channel slices, 16 → 8
            {2, 15, 31, 64, 136, false, 1, 2}, // 1×1 s2 on odd extents 15×31 → 8×16 (a box of 32 columns over 31)
        };
        for (const Conv3x3& g : convs) {
            if (first_only && failures) break;
            check_3x3(g);
        }
        const Dgrad3x3 dgrads3[] = {
            {4, 8, 8, 72, 64, false, false},   // an input-channel tail (72 = 64 + 8)
            {2, 16, 16, 64, 128, true, true},  // two slices per tap, added into dx, every epilogue operand
            {128, 3, 3, 8, 64, true, false},   // one-pixel tiles: every tap but the centre pads
            // stride 2, the four phases: dy 8 × 8 in tiles of 2 × 8 × 8, an input-channel tail
            {4, 16, 16, 72, 64, false, false, 2},
            // dy 4 × 4 (tiles of 8 images × 4 × 4), two slices per tap, added into dx, the BN epilogue
            {8, 8, 8, 64, 128, true, true, 2},
            // dy 8 × 16 of one image (tiles of 8 × 16 rows), the BN epilogue overwriting
            {1, 16, 32, 136, 64, true, false, 2},
        };
        for (const Dgrad3x3& g : dgrads3) {
            if (first_only && failures) break;
            check_dgrad_3x3(g);
        }
        // The 64-column twin of the 3×3 weight gradient serves the strided 1×1 of 64 input
        // channels (N = 64); it runs every case (N tiled by 64).
        for (const Wgrad3x3& g : kWgrads3) {
            if (first_only && failures) break;
            check_wgrad_3x3(g);
        }
        if (first_only && failures) break;
    }
    // The weight gradients' 64-row twins (the consumers split the 128 columns): every weight
    // gradient case (M tiled by 64), and the 64-channel layers they are for.
    g_bn = 128;
    g_bm = 64;
    printf("== weight gradients in tiles of 64 rows (conv3_wgrad_*_m64)\n");
    const Wgrad m64[] = {
        {1000, 64, 200, 320},  // M = 64 (resnet50's 64-output 1×1s), a column tail, four slices
        {130, 40, 256, 128},   // M = 40: a row tail inside the one A box; pixel tail, two slices
    };
    for (const Wgrad& g : kWgrads) {
        if (first_only && failures) break;
        check_wgrad(g);
    }
    for (const Wgrad& g : m64) {
        if (first_only && failures) break;
        check_wgrad(g);
    }
    const Wgrad3x3 m64_3x3[] = {
        {4, 8, 8, 64, 64, 128},        // resnet18's layer1 3×3 (M = 64, N = 576) in small: two slices
        {6, 16, 16, 64, 24, 256, 3, 2}, // M = 24 at stride 2, two slices (the last of two tiles)
    };
    for (const Wgrad3x3& g : kWgrads3) {
        if (first_only && failures) break;
        check_wgrad_3x3(g);
    }
    for (const Wgrad3x3& g : m64_3x3) {
        if (first_only && failures) break;
        check_wgrad_3x3(g);
    }
    printf(failures ? "FAILED: %d checks\n" : "ALL OK\n", failures);
    return failures ? 1 : 0;
}
