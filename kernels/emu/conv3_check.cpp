// conv3_check.cpp: the Hopper kernels of conv3.cu (wgmma fed by TMA through mbarrier-guarded
// stages) run on the host emulator (emu.h + hopper.h) against f64 references: the output of
// every 1×1 GEMM and the per-tile statistics records. Shapes have tails in every GEMM
// dimension (M, N and K not multiples of the 128 × 128 × 64 tile) and reductions long enough
// to wrap the 4-stage ring more than once. Every case runs twice, first with TMA loads landing
// as late as allowed and the blocks in row-major order, then landing at issue and the blocks
// shuffled: both must give the same bits (a missing wait changes one of them).
#include "emu.h"
#include "conv3_x.cu"  // conv3.cu with common.cuh expanded (written by the test)
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

static int failures = 0;
static bool first_only = false;

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

struct Gemm { int m, n, k; };

struct Result { std::vector<bf16> y; std::vector<float> part; };

// One launch of conv3_fwd_1x1 (stats = false) or conv3_fwd_stats_1x1.
static Result run(const Gemm& g, const std::vector<bf16>& x, const std::vector<bf16>& w, bool stats) {
    const unsigned gx = (unsigned)((g.m + C3_BM - 1) / C3_BM), gy = (unsigned)((g.n + C3_BN - 1) / C3_BN);
    Result r;
    r.y.assign((size_t)g.m * g.n, __float2bfloat16_rn(NAN));
    r.part.assign(stats ? 2 * (size_t)gx * g.n : 0, NAN);
    const BtTmaMap map_x = emu_tma_encode_2d(x.data(), (unsigned long long)g.k, (unsigned long long)g.m,
                                             (unsigned long long)g.k * 2, C3_BK, C3_BM, true);
    const BtTmaMap map_w = emu_tma_encode_2d(w.data(), (unsigned long long)g.k, (unsigned long long)g.n,
                                             (unsigned long long)g.k * 2, C3_BK, C3_BN, true);
    const Conv3Args args{g.m, g.n, g.k};
    bf16* y = r.y.data();
    float* part = r.part.data();
    if (stats)
        emu_launch({gx, gy, 1}, {C3_THREADS, 1, 1}, [&] { conv3_fwd_stats_1x1(map_x, map_w, y, args, part); });
    else
        emu_launch({gx, gy, 1}, {C3_THREADS, 1, 1}, [&] { conv3_fwd_1x1(map_x, map_w, y, args); });
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
}

int main(int argc, char** argv) {
    for (int i = 1; i < argc; ++i) first_only |= std::string(argv[i]) == "--first";
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
    printf(failures ? "FAILED: %d checks\n" : "ALL OK\n", failures);
    return failures ? 1 : 0;
}
