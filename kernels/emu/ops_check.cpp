// ops_check.cpp: every other kernel file (bn, pool, linear, loss, input, optim, collective), run on the host
// emulator (emu.h), against f64 references that follow the CPU backend's rules.
#include "emu.h"
#include "rest_x.cu"  // the other kernel files, one namespace each (written by the test)
#include <cstdio>
#include <random>
#include <cstring>

static float rb(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
static std::mt19937 rng(7);
static std::vector<float> rnd(size_t n, float s) { std::uniform_real_distribution<float> U(-s, s); std::vector<float> v(n); for (auto& x : v) x = rb(U(rng)); return v; }
// Full-precision f32 values (no bf16 rounding): every product and sum of a reduction rounds.
static std::vector<float> rnd32(size_t n, float s) { std::uniform_real_distribution<float> U(-s, s); std::vector<float> v(n); for (auto& x : v) x = U(rng); return v; }
static std::vector<bf16> tobf(const std::vector<float>& v) { std::vector<bf16> o(v.size()); for (size_t i = 0; i < v.size(); ++i) o[i] = __float2bfloat16_rn(v[i]); return o; }
static void check_bits(const char* what, const std::vector<bf16>& got, const std::vector<bf16>& want);
static std::vector<float> fromb(const std::vector<bf16>& v) { std::vector<float> o(v.size()); for (size_t i = 0; i < v.size(); ++i) o[i] = __bfloat162float(v[i]); return o; }
static int fails = 0;
template <class G, class R>
void check(const char* what, const G& got, const R& ref, double tol, double eps) {
    int bad = 0; double worst = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
        double g = got[i], r = ref[i], e = std::fabs(g - r) - (tol + std::fabs(r) * eps);
        if (e > 0 || std::isnan(g)) { if (bad < 3) printf("    %s[%zu]: got %g want %g\n", what, i, g, r); ++bad; }
        worst = std::max(worst, std::fabs(g - r));
    }
    printf("  %-28s %s (max err %.3g, %zu)\n", what, bad ? "FAIL" : "ok", worst, ref.size());
    fails += bad > 0;
}
static dim3e ew(long total) { return {(unsigned)std::min<long>((total + 255) / 256, 8), 1, 1}; }

// `per`: rows per slab (many slabs: the finalize kernels' strided lanes and tree merge).
void test_bn(int rows, int C, bool residual, bool relu, bool train, int per = 37) {
    printf("bn rows=%d C=%d res=%d relu=%d train=%d rows/slab=%d\n", rows, C, residual, relu, train, per);
    auto x = rnd((size_t)rows * C, 1.0f);
    for (size_t i = 0; i < x.size(); ++i) x[i] = rb(x[i] + (i % C) * 0.5f);
    auto gamma = rnd(C, 1.0f), beta = rnd(C, 0.5f), res = rnd((size_t)rows * C, 1.0f);
    std::vector<float> rm = rnd(C, 0.5f), rv(C);
    for (auto& v : rv) v = 1.0f + std::fabs(rnd(1, 0.5f)[0]);
    // reference
    std::vector<double> mean(C, 0), var(C, 0);
    for (int r = 0; r < rows; ++r) for (int c = 0; c < C; ++c) mean[c] += x[(size_t)r * C + c];
    for (int c = 0; c < C; ++c) mean[c] /= rows;
    for (int r = 0; r < rows; ++r) for (int c = 0; c < C; ++c) { double d = x[(size_t)r * C + c] - mean[c]; var[c] += d * d; }
    std::vector<double> m_use(C), is_use(C), rm_ref(C), rv_ref(C);
    for (int c = 0; c < C; ++c) {
        double v = var[c] / rows;
        if (train) { m_use[c] = mean[c]; is_use[c] = 1.0 / std::sqrt(v + 1e-5); rm_ref[c] = 0.9 * rm[c] + 0.1 * mean[c]; rv_ref[c] = 0.9 * rv[c] + 0.1 * var[c] / (rows - 1); }
        else { m_use[c] = rm[c]; is_use[c] = 1.0 / std::sqrt(rv[c] + 1e-5); rm_ref[c] = rm[c]; rv_ref[c] = rv[c]; }
    }
    std::vector<double> y_ref((size_t)rows * C);
    for (size_t i = 0; i < y_ref.size(); ++i) { int c = i % C; double v = (x[i] - m_use[c]) * is_use[c] * gamma[c] + beta[c]; if (residual) v += res[i]; if (relu && v < 0) v = 0; y_ref[i] = v; }
    // device
    auto X = tobf(x), G = tobf(gamma), B = tobf(beta), R = tobf(res);
    std::vector<bf16> Y(x.size());
    std::vector<float> sm(C), si(C), drm = rm, drv = rv;
    int slabs = (rows + per - 1) / per;
    const dim3e fin_grid{(unsigned)((C + 31) / 32), 1, 1}, fin_block{32, 32, 1};  // finalize_cfg
    std::vector<float> pm((size_t)slabs * C), pv((size_t)slabs * C);
    float eps = 1e-5f, mom = 0.1f;
    if (train) {
        emu_launch({(unsigned)((C + 31) / 32), (unsigned)slabs, 1}, {32, 8, 1}, [&] { k_bn::bn_stats_partial(X.data(), rows, C, per, pm.data(), pv.data()); });
        if (C % 8 == 0) {
            // The 16-byte reduction must give the same statistics (its own finalize, copies of the
            // running stats).
            std::vector<float> pm2((size_t)slabs * C), pv2((size_t)slabs * C), sm2(C), si2(C), rm2 = rm, rv2 = rv;
            emu_launch({1, (unsigned)slabs, 1}, {256, 1, 1}, [&] { k_bn::bn_stats_partial_vec(X.data(), rows, C, per, pm2.data(), pv2.data()); });
            emu_launch(fin_grid, fin_block, [&] { k_bn::bn_stats_finalize(pm2.data(), pv2.data(), slabs, rows, C, per, eps, mom, sm2.data(), si2.data(), rm2.data(), rv2.data()); });
            check("saved_mean (vec)", sm2, m_use, 1e-5, 1e-4);
            check("saved_invstd (vec)", si2, is_use, 1e-5, 1e-3);
            check("running_var (vec)", rv2, rv_ref, 1e-5, 1e-3);
        }
        emu_launch(fin_grid, fin_block, [&] { k_bn::bn_stats_finalize(pm.data(), pv.data(), slabs, rows, C, per, eps, mom, sm.data(), si.data(), drm.data(), drv.data()); });
    } else {
        emu_launch({(unsigned)((C + 127) / 128), 1, 1}, {128, 1, 1}, [&] { k_bn::bn_eval_prepare(drm.data(), drv.data(), C, eps, sm.data(), si.data()); });
    }
    long total = (long)rows * C;
    emu_launch(ew(total), {256, 1, 1}, [&] { k_bn::bn_apply(X.data(), sm.data(), si.data(), G.data(), B.data(), residual ? R.data() : nullptr, Y.data(), total, C, relu); });
    if (C % 8 == 0) {
        std::vector<bf16> Yv(x.size());
        emu_launch(ew(total / 8), {256, 1, 1}, [&] { k_bn::bn_apply_vec(X.data(), sm.data(), si.data(), G.data(), B.data(), residual ? R.data() : nullptr, Yv.data(), total, C, relu); });
        check("y (vec)", fromb(Yv), y_ref, 1e-2, 1.0 / 128);
        // The scalar kernel's arithmetic, term for term; and with 2 blocks, whose threads walk
        // many rows on parameters kept in registers (reloaded where C / 8 does not divide the
        // stride).
        check_bits("y (vec) = scalar", Yv, Y);
        std::vector<bf16> Yl(x.size());
        emu_launch({2, 1, 1}, {256, 1, 1}, [&] { k_bn::bn_apply_vec(X.data(), sm.data(), si.data(), G.data(), B.data(), residual ? R.data() : nullptr, Yl.data(), total, C, relu); });
        check_bits("y (vec, 2 blocks) = scalar", Yl, Y);
        // bn_apply_signs_vec: the same y, and its signs packed a bit per element (bit e of
        // byte i / 8: y[8·(i / 8) + e] > 0), 2 blocks walking many rows.
        std::vector<bf16> Ys(x.size());
        std::vector<unsigned char> signs(total / 8, 0xa5);
        emu_launch({2, 1, 1}, {256, 1, 1}, [&] { k_bn::bn_apply_signs_vec(X.data(), sm.data(), si.data(), G.data(), B.data(), residual ? R.data() : nullptr, Ys.data(), signs.data(), total, C, relu); });
        check_bits("y (signs) = scalar", Ys, Y);
        bool packed = true;
        long positive = 0;
        for (long i = 0; i < total; ++i) {
            const bool bit = (signs[i / 8] >> (i % 8)) & 1u, pos = __bfloat162float(Y[i]) > 0.0f;
            packed &= bit == pos;
            positive += pos;
        }
        const bool ok = packed && positive > 0 && positive < total;
        printf("  %-28s %s (%ld of %ld positive)\n", "signs packed = [y > 0]", ok ? "ok" : "FAIL", positive, total);
        fails += !ok;
    }
    check("saved_mean", sm, m_use, 1e-5, 1e-4);
    check("saved_invstd", si, is_use, 1e-5, 1e-3);
    check("running_mean", drm, rm_ref, 1e-5, 1e-4);
    check("running_var", drv, rv_ref, 1e-5, 1e-3);
    auto yf = fromb(Y);
    check("y", yf, y_ref, 1e-2, 1.0 / 128);
    // backward from the device y
    auto dy = rnd(x.size(), 1.0f);
    auto dres0 = rnd(x.size(), 1.0f);
    for (int acc = 0; acc < 2; ++acc) {
        std::vector<double> g(x.size()), db(C, 0), dg(C, 0);
        for (size_t i = 0; i < g.size(); ++i) { int c = i % C; g[i] = (relu && !(yf[i] > 0)) ? 0 : dy[i]; db[c] += g[i]; dg[c] += g[i] * (x[i] - (double)sm[c]) * si[c]; }
        std::vector<double> dx_ref(x.size()), dres_ref(x.size());
        for (size_t i = 0; i < g.size(); ++i) {
            int c = i % C; double k = rb(gamma[c]) * (double)si[c];
            double xhat = (x[i] - (double)sm[c]) * si[c];
            dx_ref[i] = train ? k * (g[i] - db[c] / rows - xhat * dg[c] / rows) : k * g[i];
            dres_ref[i] = acc ? g[i] + dres0[i] : g[i];
        }
        auto DY = tobf(dy), DRES = tobf(dres0);
        std::vector<bf16> DX(x.size());
        std::vector<float> pb((size_t)slabs * C), pg((size_t)slabs * C), ddb(C, 9), ddg(C, 9);
        emu_launch({(unsigned)((C + 31) / 32), (unsigned)slabs, 1}, {32, 8, 1}, [&] { k_bn::bn_bwd_partial(DY.data(), Y.data(), X.data(), sm.data(), si.data(), rows, C, per, relu, pb.data(), pg.data()); });
        if (C % 8 == 0) {
            std::vector<float> pb2((size_t)slabs * C), pg2((size_t)slabs * C), db2(C), dg2(C);
            emu_launch({1, (unsigned)slabs, 1}, {256, 1, 1}, [&] { k_bn::bn_bwd_partial_vec(DY.data(), Y.data(), X.data(), sm.data(), si.data(), rows, C, per, relu, pb2.data(), pg2.data()); });
            emu_launch(fin_grid, fin_block, [&] { k_bn::bn_bwd_finalize(pb2.data(), pg2.data(), slabs, C, db2.data(), dg2.data()); });
            check("dbeta (vec)", db2, db, 1e-4, 1e-4);
            check("dgamma (vec)", dg2, dg, 1e-4, 1e-4);
        }
        emu_launch(fin_grid, fin_block, [&] { k_bn::bn_bwd_finalize(pb.data(), pg.data(), slabs, C, ddb.data(), ddg.data()); });
        emu_launch(ew(total), {256, 1, 1}, [&] { k_bn::bn_bwd_apply(DY.data(), Y.data(), X.data(), sm.data(), si.data(), G.data(), ddb.data(), ddg.data(), total, C, relu, train, DX.data(), residual ? DRES.data() : nullptr, acc); });
        if (C % 8 == 0) {
            auto DRESV = tobf(dres0);
            std::vector<bf16> DXV(x.size());
            emu_launch(ew(total / 8), {256, 1, 1}, [&] { k_bn::bn_bwd_apply_vec(DY.data(), Y.data(), X.data(), sm.data(), si.data(), G.data(), ddb.data(), ddg.data(), total, C, relu, train, DXV.data(), residual ? DRESV.data() : nullptr, acc); });
            check("dx (vec)", fromb(DXV), dx_ref, 1e-2, 1.0 / 64);
            if (residual) check("dres (vec)", fromb(DRESV), dres_ref, 1e-2, 1.0 / 128);
            auto DRESL = tobf(dres0);
            std::vector<bf16> DXL(x.size());
            emu_launch({3, 1, 1}, {256, 1, 1}, [&] { k_bn::bn_bwd_apply_vec(DY.data(), Y.data(), X.data(), sm.data(), si.data(), G.data(), ddb.data(), ddg.data(), total, C, relu, train, DXL.data(), residual ? DRESL.data() : nullptr, acc); });
            check_bits("dx (vec, 3 blocks) = vec", DXL, DXV);
            check_bits("dx (vec) = scalar", DXV, DX);
            if (residual) check_bits("dres (vec, 3 blocks) = vec", DRESL, DRESV);
        }
        check("dbeta", ddb, db, 1e-4, 1e-4);
        check("dgamma", ddg, dg, 1e-4, 1e-4);
        check("dx", fromb(DX), dx_ref, 1e-2, 1.0 / 64);
        if (residual) check("dres", fromb(DRES), dres_ref, 1e-2, 1.0 / 128);
    }
}

// Bit-exact comparison of two bf16 results (NaN payloads included).
static void check_bits(const char* what, const std::vector<bf16>& got, const std::vector<bf16>& want) {
    int bad = 0;
    for (size_t i = 0; i < want.size(); ++i)
        if (got[i].bits != want[i].bits) { if (bad < 3) printf("    %s[%zu]: got %04x want %04x\n", what, i, got[i].bits, want[i].bits); ++bad; }
    printf("  %-28s %s (%zu, bitwise)\n", what, bad ? "FAIL" : "ok", want.size());
    fails += bad > 0;
}

// `all_ties`: every value quantised to 0.5 steps (most windows tie); otherwise a third of them.
// C % 8 == 0 also runs the 16-byte kernels (the backward when win ≤ 2·stride, as the host
// picks) against the references and, to the bit, against the scalar kernels, then again with
// NaNs sprinkled in (no reference: the scalar kernels' NaN behaviour is the rule).
void test_pool(int n, int h, int w, int c, int win, int st, int pad, bool all_ties = false) {
    printf("maxpool n=%d h=%d w=%d c=%d win=%d stride=%d pad=%d ties=%s\n", n, h, w, c, win, st, pad, all_ties ? "all" : "some");
    int p = (h + 2 * pad - win) / st + 1, q = (w + 2 * pad - win) / st + 1;
    auto x = rnd((size_t)n * h * w * c, 1.0f);
    // ties: quantise some values
    for (size_t i = 0; i < x.size(); i += all_ties ? 1 : 3) x[i] = rb(std::round(x[i] * 2) / 2);
    std::vector<double> y_ref((size_t)n * p * q * c), dx_ref(x.size(), 0);
    auto dy = rnd(y_ref.size(), 1.0f);
    auto dx0 = rnd(x.size(), 1.0f);
    for (int b = 0; b < n; ++b) for (int op = 0; op < p; ++op) for (int oq = 0; oq < q; ++oq) for (int ch = 0; ch < c; ++ch) {
        double best = -INFINITY; long at = -1;
        for (int r = 0; r < win; ++r) for (int s = 0; s < win; ++s) {
            int ih = op * st - pad + r, iw = oq * st - pad + s;
            if (ih < 0 || ih >= h || iw < 0 || iw >= w) continue;
            long i = (((long)b * h + ih) * w + iw) * c + ch;
            if (x[i] > best) { best = x[i]; at = i; }
        }
        long o = (((long)b * p + op) * q + oq) * c + ch;
        y_ref[o] = best; dx_ref[at] += dy[o];
    }
    auto X = tobf(x), DY = tobf(dy);
    std::vector<bf16> Y(y_ref.size());
    emu_launch(ew(y_ref.size()), {256, 1, 1}, [&] { k_pool::maxpool_fwd(X.data(), Y.data(), n, h, w, c, p, q, win, st, pad); });
    check("maxpool y", fromb(Y), y_ref, 0, 0);
    for (int acc = 0; acc < 2; ++acc) {
        auto DX = tobf(dx0);
        emu_launch(ew(x.size()), {256, 1, 1}, [&] { k_pool::maxpool_bwd(X.data(), DY.data(), DX.data(), n, h, w, c, p, q, win, st, pad, acc); });
        std::vector<double> want(x.size());
        for (size_t i = 0; i < x.size(); ++i) want[i] = dx_ref[i] + (acc ? dx0[i] : 0);
        check(acc ? "maxpool dx (acc)" : "maxpool dx", fromb(DX), want, 1e-2, 1.0 / 128);
    }
    if (c % 8 == 0) {
        const long groups_out = (long)n * p * q * (c / 8);
        const bool bwd_vec = win <= 2 * st && win <= 15;
        const long tiles = (long)n * ((p + 6) / 7) * ((q + 6) / 7) * ((c / 8 + 7) / 8);  // the host's grid
        auto run = [&](const std::vector<bf16>& XX, bool vec, std::vector<bf16>& y, std::vector<bf16>& dx, int acc) {
            y.assign(y_ref.size(), bf16{0x7fc0});
            dx = tobf(dx0);
            if (vec) emu_launch(ew(groups_out), {256, 1, 1}, [&] { k_pool::maxpool_fwd_vec(XX.data(), y.data(), n, h, w, c, p, q, win, st, pad); });
            else emu_launch(ew(y_ref.size()), {256, 1, 1}, [&] { k_pool::maxpool_fwd(XX.data(), y.data(), n, h, w, c, p, q, win, st, pad); });
            if (vec && bwd_vec) emu_launch({(unsigned)std::min<long>(tiles, 65535), 1, 1}, {256, 1, 1}, [&] { k_pool::maxpool_bwd_vec(XX.data(), DY.data(), dx.data(), n, h, w, c, p, q, win, st, pad, acc); });
            else emu_launch(ew(x.size()), {256, 1, 1}, [&] { k_pool::maxpool_bwd(XX.data(), DY.data(), dx.data(), n, h, w, c, p, q, win, st, pad, acc); });
        };
        for (int acc = 0; acc < 2; ++acc) {
            std::vector<bf16> ys, dxs, yv, dxv;
            run(X, false, ys, dxs, acc);
            run(X, true, yv, dxv, acc);
            if (acc == 0) check("maxpool y (vec)", fromb(yv), y_ref, 0, 0);
            std::vector<double> want(x.size());
            for (size_t i = 0; i < x.size(); ++i) want[i] = dx_ref[i] + (acc ? dx0[i] : 0);
            if (bwd_vec) {
                check(acc ? "maxpool dx (vec, acc)" : "maxpool dx (vec)", fromb(dxv), want, 1e-2, 1.0 / 128);
                check_bits(acc ? "dx vec = scalar (acc)" : "dx vec = scalar", dxv, dxs);
            }
            if (acc == 0) check_bits("y vec = scalar", yv, ys);
            if (bwd_vec && tiles > 3) {  // fewer blocks than tiles: the grid-stride loop
                auto dxg = tobf(dx0);
                emu_launch({3, 1, 1}, {256, 1, 1}, [&] { k_pool::maxpool_bwd_vec(X.data(), DY.data(), dxg.data(), n, h, w, c, p, q, win, st, pad, acc); });
                check_bits("dx vec, 3 blocks = scalar", dxg, dxs);
            }
            // NaNs (a window's first element, later ones, whole pixels): vec = scalar to the bit.
            auto XN = X;
            for (size_t i = 0; i < XN.size(); i += 7) XN[i] = bf16{(uint16_t)(i % 2 ? 0x7fc1 : 0xffc0)};
            run(XN, false, ys, dxs, acc);
            run(XN, true, yv, dxv, acc);
            if (acc == 0) check_bits("y vec = scalar (NaNs)", yv, ys);
            if (bwd_vec) check_bits("dx vec = scalar (NaNs)", dxv, dxs);
        }
    }
    // gap over the same x as n × (h·w) × c
    int hw = h * w;
    std::vector<double> g_ref((size_t)n * c, 0);
    for (int b = 0; b < n; ++b) for (int j = 0; j < hw; ++j) for (int ch = 0; ch < c; ++ch) g_ref[b * c + ch] += x[((size_t)b * hw + j) * c + ch] / hw;
    std::vector<bf16> GY((size_t)n * c);
    emu_launch(ew(n * c), {256, 1, 1}, [&] { k_pool::gap_fwd(X.data(), GY.data(), n, hw, c); });
    check("gap y", fromb(GY), g_ref, 1e-3, 1.0 / 128);
    auto gdy = rnd((size_t)n * c, 1.0f);
    auto GDY = tobf(gdy);
    for (int acc = 0; acc < 2; ++acc) {
        auto DX = tobf(dx0);
        emu_launch(ew(x.size()), {256, 1, 1}, [&] { k_pool::gap_bwd(GDY.data(), DX.data(), n, hw, c, acc); });
        std::vector<double> want(x.size());
        for (size_t i = 0; i < x.size(); ++i) { int ch = i % c; size_t b = i / ((size_t)hw * c); want[i] = gdy[b * c + ch] / hw + (acc ? dx0[i] : 0); }
        check("gap dx", fromb(DX), want, 1e-3, 1.0 / 128);
    }
}

// The max pool that applies the batch norm before it (maxpool_bn_*, pool.cu) against the
// separate passes it replaces, to the bit: bn_apply(_vec) writes y, maxpool_fwd / maxpool_bwd
// run over y, and the ReLU's mask is read from y as bn_bwd_apply reads it. Also against a host
// reference over the host's own batch-norm values (first maximum of each window, f64 sums).
// γ negative, zero and positive by channel; with ReLU and without (then some channels have
// only negative values: a padding that became a transformed zero would win there); ties from
// quantised inputs; every border window; the 16-byte kernels where C % 8 == 0 (the backward
// only where win ≤ 2·stride, as the host picks), and a grid of 3 blocks for the tile loop.
void test_pool_bn(int n, int h, int w, int c, int win, int st, int pad, bool relu) {
    printf("maxpool_bn n=%d h=%d w=%d c=%d win=%d stride=%d pad=%d relu=%d\n", n, h, w, c, win, st, pad, relu);
    const int p = (h + 2 * pad - win) / st + 1, q = (w + 2 * pad - win) / st + 1;
    const long rows = (long)n * h * w, total = rows * c, out = (long)n * p * q * c;
    auto z = rnd(total, 2.0f);
    for (long i = 0; i < total; i += 3) z[i] = rb(std::round(z[i] * 4) / 4);
    std::vector<float> mean(c), invstd(c), gamma(c), beta(c);
    for (int ch = 0; ch < c; ++ch) {
        mean[ch] = rnd32(1, 0.5f)[0];
        invstd[ch] = 0.5f + std::fabs(rnd32(1, 1.0f)[0]);
        const float gm = rb(0.25f + std::fabs(rnd(1, 1.0f)[0]));
        gamma[ch] = ch % 3 == 0 ? -gm : ch % 3 == 1 ? gm : (ch % 2 ? 0.0f : gm);
        beta[ch] = ch % 5 == 4 ? -3.0f : rb(rnd(1, 0.5f)[0]);
    }
    auto dy = rnd(out, 1.0f);
    const auto Z = tobf(z), G = tobf(gamma), B = tobf(beta), DY = tobf(dy);
    // The separate passes.
    std::vector<bf16> Y(total), YP(out, bf16{0x7fc0}), DX(total);
    emu_launch(ew(total), {256, 1, 1}, [&] { k_bn::bn_apply(Z.data(), mean.data(), invstd.data(), G.data(), B.data(), nullptr, Y.data(), total, c, relu); });
    if (c % 8 == 0) {
        std::vector<bf16> Yv(total);
        emu_launch(ew(total / 8), {256, 1, 1}, [&] { k_bn::bn_apply_vec(Z.data(), mean.data(), invstd.data(), G.data(), B.data(), nullptr, Yv.data(), total, c, relu); });
        check_bits("bn_apply_vec = bn_apply", Yv, Y);
    }
    emu_launch(ew(out), {256, 1, 1}, [&] { k_pool::maxpool_fwd(Y.data(), YP.data(), n, h, w, c, p, q, win, st, pad); });
    emu_launch(ew(total), {256, 1, 1}, [&] { k_pool::maxpool_bwd(Y.data(), DY.data(), DX.data(), n, h, w, c, p, q, win, st, pad, 0); });
    std::vector<bf16> g_sep = DX;
    for (long i = 0; i < total; ++i)
        if (relu && !(__bfloat162float(Y[i]) > 0.0f)) g_sep[i] = __float2bfloat16_rn(0.0f);
    // The host's reference: the batch norm's values, each window's first maximum, f64 sums.
    std::vector<double> y_host(total), yp_ref(out), g_ref(total, 0.0);
    for (long i = 0; i < total; ++i) {
        const int ch = (int)(i % c);
        float v = (z[i] - mean[ch]) * invstd[ch] * gamma[ch] + beta[ch];
        if (relu) v = std::max(v, 0.0f);
        y_host[i] = rb(v);
    }
    check("bn output (host)", fromb(Y), y_host, 0, 0);
    for (int b = 0; b < n; ++b) for (int op = 0; op < p; ++op) for (int oq = 0; oq < q; ++oq) for (int ch = 0; ch < c; ++ch) {
        double best = -INFINITY; long at = -1;
        for (int r = 0; r < win; ++r) for (int s2 = 0; s2 < win; ++s2) {
            const int ih = op * st - pad + r, iw = oq * st - pad + s2;
            if (ih < 0 || ih >= h || iw < 0 || iw >= w) continue;
            const long i = (((long)b * h + ih) * w + iw) * c + ch;
            if (at < 0 || y_host[i] > best) { best = y_host[i]; at = i; }
        }
        const long o = (((long)b * p + op) * q + oq) * c + ch;
        yp_ref[o] = best;
        g_ref[at] += dy[o];
    }
    for (long i = 0; i < total; ++i) if (relu && !(y_host[i] > 0)) g_ref[i] = 0;
    check("maxpool_bn y (host)", fromb(YP), yp_ref, 0, 0);
    check("maxpool_bn g (host)", fromb(g_sep), g_ref, 1e-2, 1.0 / 128);
    // The fused kernels: the separate passes' bits.
    std::vector<bf16> yf(out, bf16{0x7fc0}), gf(total, bf16{0x7fc0});
    emu_launch(ew(out), {256, 1, 1}, [&] { k_pool::maxpool_bn_fwd(Z.data(), mean.data(), invstd.data(), G.data(), B.data(), relu, yf.data(), n, h, w, c, p, q, win, st, pad); });
    check_bits("maxpool_bn_fwd = separate", yf, YP);
    emu_launch(ew(total), {256, 1, 1}, [&] { k_pool::maxpool_bn_bwd(Z.data(), mean.data(), invstd.data(), G.data(), B.data(), relu, DY.data(), gf.data(), n, h, w, c, p, q, win, st, pad); });
    check_bits("maxpool_bn_bwd = separate", gf, g_sep);
    if (c % 8 == 0) {
        std::vector<bf16> yv(out, bf16{0x7fc0});
        emu_launch(ew(out / 8), {256, 1, 1}, [&] { k_pool::maxpool_bn_fwd_vec(Z.data(), mean.data(), invstd.data(), G.data(), B.data(), relu, yv.data(), n, h, w, c, p, q, win, st, pad); });
        check_bits("maxpool_bn_fwd_vec = separate", yv, YP);
        if (win <= 2 * st && win <= 15) {
            const long tiles = (long)n * ((p + 6) / 7) * ((q + 6) / 7) * ((c / 8 + 7) / 8);  // the host's grid
            // Its per-tile Σg, Σg·x̂ records (every one written), summed, against f64 sums of g_sep.
            const long records = (long)n * ((p + 6) / 7) * ((q + 6) / 7);
            std::vector<double> sb_ref(c, 0.0), sg_ref(c, 0.0);
            for (long i = 0; i < total; ++i) {
                const int ch = (int)(i % c);
                const double gv = __bfloat162float(g_sep[i]);
                sb_ref[ch] += gv;
                sg_ref[ch] += gv * ((double)z[i] - mean[ch]) * invstd[ch];
            }
            for (unsigned blocks : {(unsigned)std::min<long>(tiles, 65535), 3u}) {
                std::vector<bf16> gv(total, bf16{0x7fc0});
                std::vector<float> pb(records * c, NAN), pg(records * c, NAN);
                emu_launch({blocks, 1, 1}, {256, 1, 1}, [&] { k_pool::maxpool_bn_bwd_vec(Z.data(), mean.data(), invstd.data(), G.data(), B.data(), relu, DY.data(), gv.data(), n, h, w, c, p, q, win, st, pad, pb.data(), pg.data()); });
                check_bits(blocks == 3 ? "maxpool_bn_bwd_vec, 3 blocks" : "maxpool_bn_bwd_vec = separate", gv, g_sep);
                std::vector<double> sb(c, 0.0), sg(c, 0.0);
                for (long r = 0; r < records; ++r) for (int ch = 0; ch < c; ++ch) { sb[ch] += pb[r * c + ch]; sg[ch] += pg[r * c + ch]; }
                double scale_b = 1e-30, scale_g = 1e-30;
                for (int ch = 0; ch < c; ++ch) { scale_b = std::max(scale_b, std::fabs(sb_ref[ch])); scale_g = std::max(scale_g, std::fabs(sg_ref[ch])); }
                check(blocks == 3 ? "maxpool_bn Σg (records, 3 blocks)" : "maxpool_bn Σg (records)", sb, sb_ref, 1e-5 * scale_b, 1e-5);
                check(blocks == 3 ? "maxpool_bn Σg·x̂ (records, 3 blocks)" : "maxpool_bn Σg·x̂ (records)", sg, sg_ref, 1e-5 * scale_g, 1e-5);
            }
        }
    }
}

void test_linear(int n, int in, int out) {
    printf("linear n=%d in=%d out=%d\n", n, in, out);
    auto x = rnd((size_t)n * in, 1), w = rnd((size_t)out * in, 0.1f), b = rnd(out, 0.1f), dy = rnd((size_t)n * out, 1), dx0 = rnd((size_t)n * in, 1);
    std::vector<double> y((size_t)n * out), dx((size_t)n * in), dw((size_t)out * in, 0), db(out, 0);
    for (int i = 0; i < n; ++i) for (int o = 0; o < out; ++o) { double a = b[o]; for (int k = 0; k < in; ++k) a += (double)x[i * in + k] * w[o * in + k]; y[i * out + o] = a; }
    for (int i = 0; i < n; ++i) for (int k = 0; k < in; ++k) { double a = 0; for (int o = 0; o < out; ++o) a += (double)dy[i * out + o] * w[o * in + k]; dx[i * in + k] = a + dx0[i * in + k]; }
    for (int o = 0; o < out; ++o) for (int k = 0; k < in; ++k) { double a = 0; for (int i = 0; i < n; ++i) a += (double)dy[i * out + o] * x[i * in + k]; dw[o * in + k] = a; }
    for (int o = 0; o < out; ++o) for (int i = 0; i < n; ++i) db[o] += dy[i * out + o];
    auto X = tobf(x), W = tobf(w), B = tobf(b), DY = tobf(dy), DX = tobf(dx0);
    std::vector<bf16> Y((size_t)n * out);
    std::vector<float> DW((size_t)out * in, 5), DB(out, 5);
    emu_launch({(unsigned)((out + 15) / 16), (unsigned)((n + 15) / 16), 1}, {16, 16, 1}, [&] { k_linear::linear_fwd(X.data(), W.data(), B.data(), Y.data(), n, in, out); });
    emu_launch({(unsigned)((in + 15) / 16), (unsigned)((n + 15) / 16), 1}, {16, 16, 1}, [&] { k_linear::linear_bwd_data(DY.data(), W.data(), DX.data(), n, in, out, 1); });
    emu_launch({(unsigned)((in + 15) / 16), (unsigned)((out + 15) / 16), 1}, {16, 16, 1}, [&] { k_linear::linear_bwd_weight(DY.data(), X.data(), DW.data(), n, in, out); });
    emu_launch({(unsigned)((out + 255) / 256), 1, 1}, {256, 1, 1}, [&] { k_linear::linear_bias_grad(DY.data(), DB.data(), n, out); });
    check("linear y", fromb(Y), y, 1e-2, 1.0 / 128);
    check("linear dx (acc)", fromb(DX), dx, 1e-2, 1.0 / 128);
    check("linear dw", DW, dw, 1e-4, 1e-4);
    check("linear db", DB, db, 1e-4, 1e-4);
}

// w < 1: a mixed batch, row r's target w·t(label_r) + (1 − w)·t(label_{n−1−r}).
void test_loss(int n, int k, float sm, float w = 1.0f) {
    printf("softmax n=%d k=%d smoothing=%g own_weight=%g\n", n, k, sm, w);
    auto z = rnd((size_t)n * k, 4);
    std::vector<int> lab(n);
    for (auto& l : lab) l = rng() % k;
    std::vector<double> loss(n), dz((size_t)n * k), pr((size_t)n * k), rank(n);
    for (int i = 0; i < n; ++i) {
        int pl = lab[n - 1 - i];
        double m = -INFINITY, tot = 0; for (int j = 0; j < k; ++j) { m = std::max(m, (double)z[i * k + j]); tot += z[i * k + j]; }
        double s = 0; for (int j = 0; j < k; ++j) s += std::exp(z[i * k + j] - m);
        double lse = m + std::log(s);
        loss[i] = lse - (1 - sm) * (w * z[i * k + lab[i]] + (1.0 - w) * z[i * k + pl]) - sm * tot / k;
        int above = 0; for (int j = 0; j < k; ++j) above += z[i * k + j] > z[i * k + lab[i]];
        rank[i] = above;
        for (int j = 0; j < k; ++j) { double p = std::exp(z[i * k + j] - lse), hot = (j == lab[i] ? w : 0.0) + (j == pl ? 1.0 - w : 0.0); pr[i * k + j] = p; dz[i * k + j] = (p - (sm / k + (1 - sm) * hot)) / n; }
    }
    auto Z = tobf(z);
    std::vector<float> L(n), P((size_t)n * k);
    std::vector<int> RK(n);
    std::vector<bf16> DZ((size_t)n * k);
    const float wf = (float)w;  // a device value: one float in memory
    emu_launch({(unsigned)n, 1, 1}, {128, 1, 1}, [&] { k_loss::softmax_xent(Z.data(), lab.data(), k, sm, &wf, 1.0f / n, L.data(), RK.data(), DZ.data(), P.data()); });
    check("loss", L, loss, 1e-5, 1e-5);
    check("rank", RK, rank, 0, 0);
    check("probs", P, pr, 1e-6, 1e-5);
    check("dlogits", fromb(DZ), dz, 1e-6, 1.0 / 128);
}

void test_loss_totals(int n) {
    printf("loss_totals n=%d\n", n);
    auto loss = rnd(n, 3.0f);
    std::vector<int> rank(n);
    for (auto& r : rank) r = rng() % 9;
    double l = 0, t1 = 0, t5 = 0;
    for (int i = 0; i < n; ++i) { l += loss[i]; t1 += rank[i] == 0; t5 += rank[i] < 5; }
    std::vector<double> tot(5, -1.0);
    const int stop_n = n % 2, stop_1 = 1;  // device values: one int in memory
    emu_launch({1, 1, 1}, {256, 1, 1}, [&] { k_loss::loss_totals(loss.data(), rank.data(), n, &stop_n, 0, tot.data()); });
    check("loss_totals", tot, std::vector<double>{l, t1, t5, (double)n, (double)(n % 2)}, 1e-9, 1e-12);
    // A second micro-batch (the first n / 3 rows again) adds its figures; stop is its own.
    const int m = n / 3;
    double l2 = 0, a1 = 0, a5 = 0;
    for (int i = 0; i < m; ++i) { l2 += loss[i]; a1 += rank[i] == 0; a5 += rank[i] < 5; }
    emu_launch({1, 1, 1}, {256, 1, 1}, [&] { k_loss::loss_totals(loss.data(), rank.data(), m, &stop_1, 1, tot.data()); });
    check("loss_totals (added)", tot, std::vector<double>{l + l2, t1 + a1, t5 + a5, (double)(n + m), 1.0}, 1e-9, 1e-12);
    std::vector<double> none(5, -1.0);
    emu_launch({1, 1, 1}, {256, 1, 1}, [&] { k_loss::loss_totals(nullptr, nullptr, 0, &stop_1, 0, none.data()); });
    check("loss_totals (no images)", none, std::vector<double>{0, 0, 0, 0, 1}, 0, 0);
}

void test_scale(long n, float alpha) {
    printf("scale_f32 n=%ld alpha=%g\n", n, alpha);
    auto x = rnd(n, 2.0f);
    std::vector<double> ref(n);
    for (long i = 0; i < n; ++i) ref[i] = (double)(x[i] * alpha);
    emu_launch(ew(n), {256, 1, 1}, [&] { k_optim::scale_f32(x.data(), n, alpha); });
    check("scale_f32", x, ref, 0, 0);
}

// grad_accumulate: `micro` micro-batches of gradients (weights of unequal shares, summing to 1)
// through modes 0, 1…, 2 (or 3 alone), checked bit for bit against the CPU ranks' rule
// (first: w·g; then sum + w·g, each product and sum rounded to f32), the buffer the buckets
// read (g) holding the sum at the end, and against the f64 weighted mean.
void test_grad_accumulate(long n, int micro) {
    printf("grad_accumulate n=%ld micro-batches=%d\n", n, micro);
    std::vector<float> acc(n, NAN), g(n), w(micro), want(n);
    std::vector<double> mean(n, 0.0);
    float left = 1.0f;
    for (int k = 0; k < micro; ++k) w[k] = k + 1 == micro ? left : (left -= 0.75f / micro, 0.75f / micro);
    for (int k = 0; k < micro; ++k) {
        auto part = rnd(n, 2.0f);
        for (long i = 0; i < n; ++i) {
            g[i] = part[i];
            const float wg = w[k] * part[i];
            want[i] = k == 0 ? wg : want[i] + wg;
            mean[i] += (double)w[k] * part[i];
        }
        const int mode = micro == 1 ? 3 : k == 0 ? 0 : k + 1 == micro ? 2 : 1;
        emu_launch(ew(n), {256, 1, 1}, [&] { k_optim::grad_accumulate(acc.data(), g.data(), n, w[k], mode); });
    }
    std::vector<double> exact(want.begin(), want.end());
    check("grad_accumulate (the CPU ranks' rounding)", g, exact, 0, 0);
    check("grad_accumulate (f64 weighted mean)", g, mean, 1e-6, 1e-6);
}

// collective.cu: `ranks` buffers of n values (+ a guard value each, which must stay untouched),
// averaged with a scale per rank / summed in f64, on a grid smaller than n / 256 when n is large
// (the grid-stride loop). Checked bit for bit against the rule the CPU ranks' LocalCollective
// follows (each value times its scale in f32, summed in rank order, divided by the rank count)
// and against the f64 mean; every rank must receive the same bits.
void test_collective(long n, int ranks) {
    printf("rank_average_f32 / rank_sum_f64 n=%ld ranks=%d\n", n, ranks);
    const float scales[4] = {1.5f, 0.5f, 0.75f, 1.25f};
    std::vector<std::vector<float>> g(ranks);
    k_collective::RankBuffersF32 b32{};
    std::vector<float> exact(n);
    std::vector<double> mean(n, 0.0);
    for (int r = 0; r < ranks; ++r) {
        g[r] = rnd32(n + 1, 2.0f);
        g[r][n] = 1234.5f;  // guard
        b32.ptr[r] = g[r].data();
        b32.scale[r] = ranks == 1 ? 1.0f : scales[r];
    }
    for (long i = 0; i < n; ++i) {
        float acc = b32.scale[0] * g[0][i];
        for (int r = 1; r < ranks; ++r) acc = acc + b32.scale[r] * g[r][i];
        exact[i] = acc / (float)ranks;
        for (int r = 0; r < ranks; ++r) mean[i] += (double)b32.scale[r] * g[r][i];
        mean[i] /= ranks;
    }
    emu_launch(ew(n), {256, 1, 1}, [&] { k_collective::rank_average_f32(b32, ranks, n); });
    std::vector<double> exact_d(exact.begin(), exact.end());
    std::vector<float> every, guards;  // every rank's values one after the other
    for (int r = 0; r < ranks; ++r) {
        every.insert(every.end(), g[r].begin(), g[r].begin() + n);
        guards.push_back(g[r][n]);
    }
    std::vector<double> exact_all;
    for (int r = 0; r < ranks; ++r) exact_all.insert(exact_all.end(), exact_d.begin(), exact_d.end());
    check("rank_average_f32 (rule, all)", every, exact_all, 0, 0);
    check("guards untouched", guards, std::vector<double>(ranks, 1234.5), 0, 0);
    check("rank_average_f32 (f64 mean)", g[0], mean, 1e-6, 1e-6);
    std::vector<std::vector<double>> v(ranks);
    k_collective::RankBuffersF64 b64{};
    std::vector<double> sum(n, 0.0);
    for (int r = 0; r < ranks; ++r) {
        auto f = rnd32(n + 1, 100.0f);
        v[r].assign(f.begin(), f.end());
        for (long i = 0; i < n; ++i) v[r][i] += 1e-9 * (double)(i % 7);  // not f32-representable
        v[r][n] = -7.0;
        b64.ptr[r] = v[r].data();
        for (long i = 0; i < n; ++i) sum[i] += v[r][i];  // rank order, as the kernel
    }
    emu_launch(ew(n), {256, 1, 1}, [&] { k_collective::rank_sum_f64(b64, ranks, n); });
    std::vector<double> every_d, sum_all, guards_d;
    for (int r = 0; r < ranks; ++r) {
        every_d.insert(every_d.end(), v[r].begin(), v[r].begin() + n);
        sum_all.insert(sum_all.end(), sum.begin(), sum.end());
        guards_d.push_back(v[r][n]);
    }
    check("rank_sum_f64 (rank order, all)", every_d, sum_all, 0, 0);
    check("guards untouched", guards_d, std::vector<double>(ranks, -7.0), 0, 0);
}

// Rows holding a NaN or infinite logit are never counted correct (rank = INT_MAX).
void test_loss_nonfinite() {
    printf("softmax with non-finite logits\n");
    const int n = 4, k = 7;
    auto z = rnd((size_t)n * k, 1);
    std::vector<int> lab = {2, 3, 0, 5};
    z[0 * k + 2] = NAN;       // the label's own logit
    z[1 * k + 6] = NAN;       // another logit
    z[2 * k + 1] = INFINITY;  // an overflow
    for (int j = 0; j < k; ++j) z[3 * k + j] = j == 5 ? 3.0f : 0.0f;  // finite, label on top
    auto Z = tobf(z);
    std::vector<float> L(n);
    std::vector<int> RK(n);
    const float one = 1.0f;
    emu_launch({(unsigned)n, 1, 1}, {128, 1, 1}, [&] { k_loss::softmax_xent(Z.data(), lab.data(), k, 0.0f, &one, 1.0f / n, L.data(), RK.data(), nullptr, nullptr); });
    std::vector<double> want = {2147483647.0, 2147483647.0, 2147483647.0, 0};
    check("rank (non-finite rows)", RK, want, 0, 0);
}

// A random u8 batch with random per-image augments (7 ints: dy, dx, flip, then the erased
// box; every other image erased, one box touching the bottom-right corner), and its f64
// reference (no mixing).
struct InputCase { std::vector<unsigned char> px; std::vector<int> aug; float scale[3], shift[3]; std::vector<double> ref; };
static InputCase input_case(int n, int s) {
    InputCase t;
    t.px.resize((size_t)n * s * s * 3);
    for (auto& v : t.px) v = rng() & 255;
    t.aug.assign(n * 7, 0);
    int m = std::max(1, s / 8);
    for (int b = 0; b < n; ++b) {
        int* a = &t.aug[b * 7];
        a[0] = (int)(rng() % (2 * m + 1)) - m; a[1] = (int)(rng() % (2 * m + 1)) - m; a[2] = rng() & 1;
        if (b % 2 == 1) {
            int h = 1 + (int)(rng() % (s / 2)), w = 1 + (int)(rng() % (s / 2));
            a[3] = b == 1 ? s - h : (int)(rng() % (s - h + 1)); a[4] = a[3] + h;
            a[5] = b == 1 ? s - w : (int)(rng() % (s - w + 1)); a[6] = a[5] + w;
        }
    }
    const float mean[3] = {0.485f, 0.456f, 0.406f}, stdv[3] = {0.229f, 0.224f, 0.225f};
    for (int c = 0; c < 3; ++c) { t.scale[c] = 1.0f / (255.0f * stdv[c]); t.shift[c] = -mean[c] / stdv[c]; }
    t.ref.resize(t.px.size());
    for (int b = 0; b < n; ++b) for (int y = 0; y < s; ++y) for (int x = 0; x < s; ++x) for (int c = 0; c < 3; ++c) {
        const int* a = &t.aug[b * 7];
        int xs = a[2] ? s - 1 - x : x, sy = y + a[0], sx = xs + a[1];
        bool erased = y >= a[3] && y < a[4] && x >= a[5] && x < a[6];
        double v = 0; if (!erased && sy >= 0 && sx >= 0 && sy < s && sx < s) v = t.px[(((size_t)b * s + sy) * s + sx) * 3 + c] * t.scale[c] + t.shift[c];
        t.ref[(((size_t)b * s + y) * s + x) * 3 + c] = v;
    }
    return t;
}

void test_input(int n, int s) {
    printf("input n=%d s=%d\n", n, s);
    auto t = input_case(n, s);
    auto& px = t.px; auto& aug = t.aug; auto& ref = t.ref;
    std::vector<bf16> out(px.size());
    // Kind none ignores lambda and the box.
    const k_input::InputMix none{BT_MIX_NONE, 0.5f, 0, s, 0, s};
    emu_launch(ew(px.size()), {256, 1, 1}, [&] { k_input::input_transform(px.data(), aug.data(), 1, t.scale, t.shift, &none, out.data(), n, s); });
    check("input", fromb(out), ref, 1e-5, 1.0 / 256);
    // The paired stem's copy (odd s: each row's last pair ends in a zero pixel): the same
    // values as pairs of 4-channel pixels, zeros in channel 3.
    const int pairs_w = (s + 1) / 2;
    std::vector<bf16> out3(px.size(), bf16{0x7fc0}), outp((size_t)n * s * pairs_w * 8, bf16{0x7fc0});
    emu_launch(ew((long)n * s * pairs_w), {256, 1, 1}, [&] { k_input::input_transform_pairs(px.data(), aug.data(), 1, t.scale, t.shift, out3.data(), outp.data(), n, s); });
    check("input_pairs (3 channels)", fromb(out3), ref, 1e-5, 1.0 / 256);
    std::vector<double> refp(outp.size(), 0.0);
    for (size_t row = 0; row < (size_t)n * s; ++row) for (int x = 0; x < s; ++x) for (int c = 0; c < 3; ++c)
        refp[(row * pairs_w + x / 2) * 8 + 4 * (x % 2) + c] = ref[(row * s + x) * 3 + c];
    check("input_pairs (pixel pairs)", fromb(outp), refp, 1e-5, 1.0 / 256);
}

// Mixup / CutMix: image b with its partner n − 1 − b, each after its own augment (odd n: the
// middle image is its own partner).
void test_input_mix(int n, int s, k_input::InputMix mix) {
    printf("input n=%d s=%d mix kind=%d lambda=%g box rows %d..%d cols %d..%d\n", n, s, mix.kind, mix.lambda, mix.y0, mix.y1, mix.x0, mix.x1);
    auto t = input_case(n, s);
    std::vector<double> ref(t.ref.size());
    for (int b = 0; b < n; ++b) for (int y = 0; y < s; ++y) for (int x = 0; x < s; ++x) for (int c = 0; c < 3; ++c) {
        size_t i = (((size_t)b * s + y) * s + x) * 3 + c, j = (((size_t)(n - 1 - b) * s + y) * s + x) * 3 + c;
        bool inside = y >= mix.y0 && y < mix.y1 && x >= mix.x0 && x < mix.x1;
        ref[i] = mix.kind == BT_MIX_BLEND ? mix.lambda * t.ref[i] + (1.0 - mix.lambda) * t.ref[j] : inside ? t.ref[j] : t.ref[i];
    }
    std::vector<bf16> out(t.px.size());
    emu_launch(ew(t.px.size()), {256, 1, 1}, [&] { k_input::input_transform(t.px.data(), t.aug.data(), 1, t.scale, t.shift, &mix, out.data(), n, s); });
    check(mix.kind == BT_MIX_BLEND ? "input (mixup)" : "input (CutMix)", fromb(out), ref, 1e-5, 1.0 / 256);
}

void test_optim(float max_norm) {
    printf("optim (two tensors, chunked, clip to norm %g)\n", max_norm);
    // two "tensors" of 5 and 70000 elements: chunks 5 | 65536 | 4464
    std::vector<int> sizes = {5, 70000};
    int total = 70005;
    auto w0 = rnd(total, 0.5f);
    std::vector<std::vector<float>> grads = {rnd(5, 1), rnd(70000, 1)};
    std::vector<std::vector<bf16>> work = {std::vector<bf16>(5), std::vector<bf16>(70000)};
    std::vector<unsigned long long> gp, wp; std::vector<long> st; std::vector<int> ln; std::vector<float> wd;
    float decay[2] = {0.0f, 0.01f};
    long off = 0;
    for (int t = 0; t < 2; ++t) { for (int d = 0; d < sizes[t]; d += 65536) { int l = std::min(65536, sizes[t] - d); gp.push_back((unsigned long long)(grads[t].data() + d)); wp.push_back((unsigned long long)(work[t].data() + d)); st.push_back(off + d); ln.push_back(l); wd.push_back(decay[t]); } off += sizes[t]; }
    // PyTorch's clip_grad_norm_: every gradient times min(1, max_norm / (‖g‖ + 1e-6)).
    double norm2 = 0;
    for (auto& g : grads) for (float x : g) norm2 += (double)x * x;
    const double coef = max_norm > 0 ? std::min(1.0, max_norm / (std::sqrt(norm2) + 1e-6)) : 1.0;
    double sumsq = -1;
    std::vector<double> partial(st.size(), -1.0);
    emu_launch({(unsigned)st.size(), 1, 1}, {256, 1, 1}, [&] { k_optim::grad_sumsq(gp.data(), ln.data(), partial.data()); });
    emu_launch({1, 1, 1}, {256, 1, 1}, [&] { k_optim::grad_sumsq_total(partial.data(), (int)partial.size(), &sumsq); });
    check("sum of squared gradients", std::vector<float>{(float)sumsq}, std::vector<double>{norm2}, 1e-6, 1e-6);
    for (int kind = 0; kind < 3; ++kind) {
        std::vector<float> master = w0, mbuf(total, 0), vbuf(total, 0);
        std::vector<double> ref(w0.begin(), w0.end()), m(total, 0), v(total, 0);
        for (int step = 1; step <= 2; ++step) {
            for (int i = 0; i < total; ++i) {
                int t = i < 5 ? 0 : 1; double g = grads[t][t ? i - 5 : i] * coef, wdd = decay[t];
                if (kind == 0) { double gi = g + wdd * ref[i]; m[i] = 0.9 * m[i] + gi; ref[i] -= 0.05 * m[i]; }
                else { bool dec = kind == 2; double gi = dec ? g : g + wdd * ref[i]; if (dec) ref[i] *= 1 - 0.05 * wdd; m[i] = 0.9 * m[i] + 0.1 * gi; v[i] = 0.999 * v[i] + 0.001 * gi * gi; ref[i] -= 0.05 * (m[i] / (1 - std::pow(0.9, step))) / (std::sqrt(v[i] / (1 - std::pow(0.999, step))) + 1e-8); }
            }
            // lr and bias corrections are device values (one float each in memory).
            const float lr = 0.05f, bc[2] = {(float)(1 - std::pow(0.9, step)), (float)(1 - std::pow(0.999, step))};
            if (kind == 0) emu_launch({(unsigned)st.size(), 1, 1}, {256, 1, 1}, [&] { k_optim::sgd_update(master.data(), mbuf.data(), gp.data(), wp.data(), st.data(), ln.data(), wd.data(), &lr, 0.9f, 1.0f, 0, max_norm, &sumsq); });
            else emu_launch({(unsigned)st.size(), 1, 1}, {256, 1, 1}, [&] { k_optim::adam_update(master.data(), mbuf.data(), vbuf.data(), gp.data(), wp.data(), st.data(), ln.data(), wd.data(), &lr, 0.9f, 0.999f, 1e-8f, 1.0f, bc, kind == 2, max_norm, &sumsq); });
        }
        check(kind == 0 ? "sgd master" : kind == 1 ? "adam master" : "adamw master", master, ref, 1e-6, 1e-5);
        std::vector<float> wk; for (auto& t : work) for (auto v2 : fromb(t)) wk.push_back(v2);
        check("working bf16", wk, ref, 1e-6, 1.0 / 256);
    }
}

static void check_bits_f(const char* what, const std::vector<float>& got, const std::vector<float>& want) {
    const bool same = got.size() == want.size() && memcmp(got.data(), want.data(), got.size() * 4) == 0;
    printf("  %-28s %s (%zu, bitwise)\n", what, same ? "ok" : "FAIL", want.size());
    fails += !same;
}

// The fused path's merges of partial records (bn_stats_merge, bn_sums_merge: one launch, or
// groups of `group` records and then the groups), bn_moments_finalize and bn_grad_finish, fed
// by the slab kernels (what runs where no fused convolution applies) and checked against f64;
// in one launch they are the finalize kernels' own arithmetic, so their results must equal
// bn_stats_finalize's and bn_bwd_finalize's bit for bit; and another block order gives the
// same bits.
void test_bn_merges(int rows, int C, int per, int group) {
    const int slabs = (rows + per - 1) / per;
    printf("bn merges rows=%d C=%d rows/record=%d records=%d group=%d\n", rows, C, per, slabs, group);
    auto x = rnd((size_t)rows * C, 1.0f);
    for (size_t i = 0; i < x.size(); ++i) x[i] = rb(x[i] + (i % C) * 0.5f);
    std::vector<double> mean(C, 0), m2(C, 0);
    for (int r = 0; r < rows; ++r) for (int c = 0; c < C; ++c) mean[c] += x[(size_t)r * C + c];
    for (int c = 0; c < C; ++c) mean[c] /= rows;
    for (int r = 0; r < rows; ++r) for (int c = 0; c < C; ++c) { double d = x[(size_t)r * C + c] - mean[c]; m2[c] += d * d; }
    std::vector<double> ref(mean);
    ref.insert(ref.end(), m2.begin(), m2.end());
    ref.insert(ref.end(), (size_t)C, (double)rows);
    auto X = tobf(x);
    const unsigned cx = (unsigned)((C + 31) / 32);
    std::vector<float> part(2 * (size_t)slabs * C);
    float* pm = part.data();
    float* pv = part.data() + (size_t)slabs * C;
    emu_launch({cx, (unsigned)slabs, 1}, {32, 8, 1}, [&] { k_bn::bn_stats_partial(X.data(), rows, C, per, pm, pv); });
    auto merge = [&](bool two) {
        std::vector<float> mom(3 * (size_t)C, NAN);
        if (!two) {
            emu_launch({cx, 1, 1}, {32, 32, 1}, [&] { k_bn::bn_stats_merge(pm, pv, slabs, rows, C, (long)per, slabs, mom.data(), mom.data() + C, mom.data() + 2 * C); });
            return mom;
        }
        const int groups = (slabs + group - 1) / group;
        std::vector<float> mid(2 * (size_t)groups * C, NAN);
        emu_launch({cx, (unsigned)groups, 1}, {32, 32, 1}, [&] { k_bn::bn_stats_merge(pm, pv, slabs, rows, C, (long)per, group, mid.data(), mid.data() + (size_t)groups * C, nullptr); });
        emu_launch({cx, 1, 1}, {32, 32, 1}, [&] { k_bn::bn_stats_merge(mid.data(), mid.data() + (size_t)groups * C, groups, rows, C, (long)per * group, groups, mom.data(), mom.data() + C, mom.data() + 2 * C); });
        return mom;
    };
    const auto one = merge(false), two = merge(true);
    check("moments", one, ref, 1e-5, 1e-4);
    check("moments, 2 levels", two, ref, 1e-5, 1e-4);
    g_emu_block_order = 77;
    const auto two_again = merge(true);
    g_emu_block_order = 0;
    check_bits_f("moments, other block order", two_again, two);
    // finalize: the slab finalize's results, bit for bit
    std::vector<float> rm = rnd(C, 0.5f), rv(C);
    for (auto& v : rv) v = 1.0f + std::fabs(rnd(1, 0.5f)[0]);
    std::vector<float> sm(C, NAN), si(C, NAN), rm1 = rm, rv1 = rv, sm2(C, NAN), si2(C, NAN), rm2 = rm, rv2 = rv;
    emu_launch({(unsigned)((C + 127) / 128), 1, 1}, {128, 1, 1}, [&] { k_bn::bn_moments_finalize(one.data(), C, 1e-5f, 0.1f, sm.data(), si.data(), rm1.data(), rv1.data()); });
    emu_launch({cx, 1, 1}, {32, 32, 1}, [&] { k_bn::bn_stats_finalize(pm, pv, slabs, rows, C, per, 1e-5f, 0.1f, sm2.data(), si2.data(), rm2.data(), rv2.data()); });
    check_bits_f("finalize = slab finalize: mean", sm, sm2);
    check_bits_f("finalize = slab finalize: invstd", si, si2);
    check_bits_f("finalize = slab finalize: running", std::vector<float>{rm1.begin(), rm1.end()}, rm2);
    check_bits_f("finalize = slab finalize: running var", rv1, rv2);
    std::vector<double> si_ref(C), rv_ref(C);
    for (int c = 0; c < C; ++c) { si_ref[c] = 1.0 / std::sqrt(m2[c] / rows + 1e-5); rv_ref[c] = 0.9 * rv[c] + 0.1 * m2[c] / (rows > 1 ? rows - 1 : 1); }
    check("finalize invstd", si, si_ref, 1e-5, 1e-3);
    check("finalize running var", rv1, rv_ref, 1e-5, 1e-3);
    // eval: no running statistics written
    std::vector<float> sm3(C, NAN), si3(C, NAN);
    emu_launch({(unsigned)((C + 127) / 128), 1, 1}, {128, 1, 1}, [&] { k_bn::bn_moments_finalize(two.data(), C, 1e-5f, 0.1f, sm3.data(), si3.data(), nullptr, nullptr); });
    check("finalize (no running) invstd", si3, si_ref, 1e-5, 1e-3);
    // backward sums from the slab reduction (ReLU mask from a y), both merges
    auto dy = rnd(x.size(), 1.0f), y = rnd(x.size(), 1.0f);
    auto DY = tobf(dy), Y = tobf(y);
    std::vector<double> sums(2 * (size_t)C, 0);
    for (size_t i = 0; i < x.size(); ++i) {
        const int c = (int)(i % C);
        const double g = y[i] > 0 ? dy[i] : 0.0;
        sums[c] += g;
        sums[C + c] += g * (x[i] - (double)sm[c]) * si[c];
    }
    std::vector<float> pb((size_t)slabs * C), pg((size_t)slabs * C);
    emu_launch({cx, (unsigned)slabs, 1}, {32, 8, 1}, [&] { k_bn::bn_bwd_partial(DY.data(), Y.data(), X.data(), sm.data(), si.data(), rows, C, per, 1, pb.data(), pg.data()); });
    auto sum_merge = [&](bool two) {
        std::vector<float> out(2 * (size_t)C, NAN);
        if (!two) {
            emu_launch({cx, 1, 1}, {32, 32, 1}, [&] { k_bn::bn_sums_merge(pb.data(), pg.data(), slabs, C, slabs, out.data(), out.data() + C); });
            return out;
        }
        const int groups = (slabs + group - 1) / group;
        std::vector<float> mid(2 * (size_t)groups * C, NAN);
        emu_launch({cx, (unsigned)groups, 1}, {32, 32, 1}, [&] { k_bn::bn_sums_merge(pb.data(), pg.data(), slabs, C, group, mid.data(), mid.data() + (size_t)groups * C); });
        emu_launch({cx, 1, 1}, {32, 32, 1}, [&] { k_bn::bn_sums_merge(mid.data(), mid.data() + (size_t)groups * C, groups, C, groups, out.data(), out.data() + C); });
        return out;
    };
    const auto s1 = sum_merge(false), s2 = sum_merge(true);
    check("sums", s1, sums, 1e-3, 1e-4);
    check("sums, 2 levels", s2, sums, 1e-3, 1e-4);
    g_emu_block_order = 91;
    const auto s2_again = sum_merge(true);
    g_emu_block_order = 0;
    check_bits_f("sums, other block order", s2_again, s2);
    std::vector<float> db(C), dg(C);
    emu_launch({cx, 1, 1}, {32, 32, 1}, [&] { k_bn::bn_bwd_finalize(pb.data(), pg.data(), slabs, C, db.data(), dg.data()); });
    check_bits_f("sums = slab finalize: dbeta", std::vector<float>(s1.begin(), s1.begin() + C), db);
    check_bits_f("sums = slab finalize: dgamma", std::vector<float>(s1.begin() + C, s1.end()), dg);
    // bn_grad_finish: g = [y > 0]·(g + residual), with and without either
    auto res = rnd(x.size(), 1.0f);
    auto RES = tobf(res);
    for (int variant = 0; variant < 3; ++variant) {
        const bool with_res = variant != 1, with_relu = variant != 2;
        auto G = DY;
        std::vector<bf16> want(x.size());
        for (size_t i = 0; i < x.size(); ++i) {
            float v = dy[i];
            if (with_res) v = rb(v + res[i]);
            if (with_relu && !(y[i] > 0)) v = 0.0f;
            want[i] = __float2bfloat16_rn(v);
        }
        const long total = (long)x.size();
        emu_launch(ew(total), {256, 1, 1}, [&] { k_bn::bn_grad_finish(G.data(), with_res ? RES.data() : nullptr, with_relu ? Y.data() : nullptr, total); });
        check_bits(with_res && with_relu ? "grad_finish res relu" : with_res ? "grad_finish res" : "grad_finish relu", G, want);
    }
}

// Synchronised BN: the bn_sync_* kernels of two replicas, summed between them as a collective
// would, against the host arithmetic of src/backend/bn_sync.rs transcribed below, bit for bit
// (the kernels use explicitly rounded f64 operations for exactly this).
static void check_same(const char* what, const std::vector<double>& got, const std::vector<double>& want) {
    int bad = 0;
    for (size_t i = 0; i < want.size(); ++i)
        if (memcmp(&got[i], &want[i], sizeof(double)) != 0) { if (bad < 3) printf("    %s[%zu]: got %.17g want %.17g\n", what, i, got[i], want[i]); ++bad; }
    printf("  %-28s %s (%zu, bit for bit)\n", what, bad ? "FAIL" : "ok", want.size());
    fails += bad > 0;
}
static std::vector<double> widen(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

void test_bn_sync(int C, int rows0, int rows1) {
    printf("bn_sync C=%d rows %d + %d\n", C, rows0, rows1);
    const int rows[2] = {rows0, rows1};
    const float momentum = 0.1f;
    const dim3e grid{(unsigned)((C + 127) / 128), 1, 1}, block{128, 1, 1};
    // Forward: each replica packs its moments; the "collective" sums them.
    std::vector<float> mean[2], var[2];
    std::vector<double> sums[2], want_sum(2 * C + 1, 0.0);
    for (int r = 0; r < 2; ++r) {
        mean[r] = rnd(C, 3.0f);
        var[r] = rnd(C, 1.0f);
        for (auto& v : var[r]) v = std::fabs(v) + 0.01f;
        sums[r].assign(2 * C + 1, -1.0);
        double n = rows[r];
        emu_launch(grid, block, [&] { k_bn::bn_sync_moments(mean[r].data(), var[r].data(), n, C, sums[r].data()); });
        std::vector<double> want(2 * C + 1);
        for (int c = 0; c < C; ++c) {
            double m = mean[r][c];
            want[c] = n * m;
            want[C + c] = std::max(n - 1.0, 0.0) * (double)var[r][c] + n * m * m;
        }
        want[2 * C] = n;
        check_same(r ? "moments (replica 1)" : "moments (replica 0)", sums[r], want);
        for (int i = 0; i < 2 * C + 1; ++i) want_sum[i] += want[i];
    }
    std::vector<double> total(2 * C + 1);
    for (int i = 0; i < 2 * C + 1; ++i) total[i] = sums[0][i] + sums[1][i];
    // After the sum: the global statistics and the running ones (the same on both replicas).
    std::vector<float> gm(C, 7.0f), gv(C, 7.0f), rm = rnd(C, 0.5f), rv(C, 1.0f);
    std::vector<float> rm0 = rm, rv0 = rv;
    emu_launch(grid, block, [&] { k_bn::bn_sync_statistics(total.data(), C, momentum, gm.data(), gv.data(), rm.data(), rv.data()); });
    double n = total[2 * C];
    std::vector<double> wm(C), wv(C), wrm(C), wrv(C);
    for (int c = 0; c < C; ++c) {
        double m = total[c] / n, v = std::max(total[C + c] / n - m * m, 0.0);
        double unbias = n > 1.0 ? n / (n - 1.0) : 1.0, mo = (double)momentum;
        wm[c] = (float)m;
        wv[c] = (float)v;
        wrm[c] = (float)((1.0 - mo) * (double)rm0[c] + mo * m);
        wrv[c] = (float)((1.0 - mo) * (double)rv0[c] + mo * v * unbias);
    }
    check_same("global mean", widen(gm), wm);
    check_same("global variance", widen(gv), wv);
    check_same("running mean", widen(rm), wrm);
    check_same("running variance", widen(rv), wrv);
    // Backward: each replica packs its dgamma, dbeta on the global scale; summed; coefficients.
    std::vector<double> gsums[2], gtotal(2 * C, 0.0);
    for (int r = 0; r < 2; ++r) {
        auto dg = rnd(C, 2.0f), db = rnd(C, 2.0f);
        gsums[r].assign(2 * C, -1.0);
        double nr = rows[r];
        emu_launch(grid, block, [&] { k_bn::bn_sync_grad_sums(dg.data(), db.data(), total.data(), nr, C, gsums[r].data()); });
        std::vector<double> want(2 * C);
        double share = nr / n;
        for (int c = 0; c < C; ++c) { want[c] = (double)dg[c] * share; want[C + c] = (double)db[c] * share; }
        check_same(r ? "grad sums (replica 1)" : "grad sums (replica 0)", gsums[r], want);
        for (int i = 0; i < 2 * C; ++i) gtotal[i] += gsums[r][i];
    }
    // After the sum: the global reductions, rounded to f32 for bn_bwd_apply.
    std::vector<float> rdg(C, 7.0f), rdb(C, 7.0f);
    emu_launch(grid, block, [&] { k_bn::bn_sync_reductions(gtotal.data(), C, rdg.data(), rdb.data()); });
    std::vector<double> wdg(C), wdb(C);
    for (int c = 0; c < C; ++c) { wdg[c] = (float)gtotal[c]; wdb[c] = (float)gtotal[C + c]; }
    check_same("global dgamma", widen(rdg), wdg);
    check_same("global dbeta", widen(rdb), wdb);
}

// Synchronised BN over one replica is plain BN's backward, bit for bit: the frozen-statistics
// backward, the sums (share 1), bn_sync_reductions and bn_bwd_apply on the global reductions
// give plain batch statistics' dx. With one row per channel that dx is exactly 0 (the exact
// gradient: the output is beta whatever x is), not the rounding residue of a correction.
void test_bn_sync_one_replica(int rows, int C, bool relu) {
    printf("bn_sync one replica rows=%d C=%d relu=%d\n", rows, C, relu);
    const int per = 37, slabs = (rows + per - 1) / per;
    auto x = rnd((size_t)rows * C, 2.0f), gamma = rnd(C, 1.5f), beta = rnd(C, 0.5f), dy = rnd((size_t)rows * C, 1.0f);
    auto X = tobf(x), G = tobf(gamma), B = tobf(beta), DY = tobf(dy);
    std::vector<float> pm((size_t)slabs * C), pv((size_t)slabs * C), sm(C), si(C), rm(C, 0.0f), rv(C, 1.0f);
    const dim3e fin_grid{(unsigned)((C + 31) / 32), 1, 1}, fin_block{32, 32, 1};
    emu_launch({(unsigned)((C + 31) / 32), (unsigned)slabs, 1}, {32, 8, 1}, [&] { k_bn::bn_stats_partial(X.data(), rows, C, per, pm.data(), pv.data()); });
    emu_launch(fin_grid, fin_block, [&] { k_bn::bn_stats_finalize(pm.data(), pv.data(), slabs, rows, C, per, 1e-5f, 0.1f, sm.data(), si.data(), rm.data(), rv.data()); });
    long total = (long)rows * C;
    std::vector<bf16> Y(x.size());
    emu_launch(ew(total), {256, 1, 1}, [&] { k_bn::bn_apply(X.data(), sm.data(), si.data(), G.data(), B.data(), nullptr, Y.data(), total, C, relu); });
    std::vector<float> pb((size_t)slabs * C), pg((size_t)slabs * C), db(C), dg(C);
    emu_launch({(unsigned)((C + 31) / 32), (unsigned)slabs, 1}, {32, 8, 1}, [&] { k_bn::bn_bwd_partial(DY.data(), Y.data(), X.data(), sm.data(), si.data(), rows, C, per, relu, pb.data(), pg.data()); });
    emu_launch(fin_grid, fin_block, [&] { k_bn::bn_bwd_finalize(pb.data(), pg.data(), slabs, C, db.data(), dg.data()); });
    std::vector<bf16> plain(x.size()), frozen(x.size()), synced(x.size());
    emu_launch(ew(total), {256, 1, 1}, [&] { k_bn::bn_bwd_apply(DY.data(), Y.data(), X.data(), sm.data(), si.data(), G.data(), db.data(), dg.data(), total, C, relu, 1, plain.data(), nullptr, 0); });
    // Synchronised: frozen-statistics dx first (then overwritten), the sums, the reductions.
    emu_launch(ew(total), {256, 1, 1}, [&] { k_bn::bn_bwd_apply(DY.data(), Y.data(), X.data(), sm.data(), si.data(), G.data(), db.data(), dg.data(), total, C, relu, 0, frozen.data(), nullptr, 0); });
    synced = frozen;
    const dim3e grid{(unsigned)((C + 127) / 128), 1, 1}, block{128, 1, 1};
    std::vector<double> moments(2 * C + 1, 0.0), gsums(2 * C, -1.0);
    moments[2 * C] = rows;
    emu_launch(grid, block, [&] { k_bn::bn_sync_grad_sums(dg.data(), db.data(), moments.data(), (double)rows, C, gsums.data()); });
    std::vector<float> rdg(C), rdb(C);
    emu_launch(grid, block, [&] { k_bn::bn_sync_reductions(gsums.data(), C, rdg.data(), rdb.data()); });
    emu_launch(ew(total), {256, 1, 1}, [&] { k_bn::bn_bwd_apply(DY.data(), Y.data(), X.data(), sm.data(), si.data(), G.data(), rdb.data(), rdg.data(), total, C, relu, 1, synced.data(), nullptr, 0); });
    check_bits("dx synced = plain", synced, plain);
    if (C % 8 == 0) {
        std::vector<bf16> vec = frozen;
        emu_launch(ew(total / 8), {256, 1, 1}, [&] { k_bn::bn_bwd_apply_vec(DY.data(), Y.data(), X.data(), sm.data(), si.data(), G.data(), rdb.data(), rdg.data(), total, C, relu, 1, vec.data(), nullptr, 0); });
        check_bits("dx synced (vec) = plain", vec, plain);
    }
    if (rows == 1) {
        std::vector<double> zeros(x.size(), 0.0);
        check("dx of one row is 0", fromb(synced), zeros, 0, 0);
    }
}

int main(int argc, char** argv) {
    test_bn(150, 40, true, true, true);
    test_bn(77, 3, false, false, true);
    test_bn(64, 33, true, true, false);
    test_bn(96, 16, false, true, false);
    test_bn(45, 520, true, true, true);
    test_bn(2101, 24, false, true, true, 5);   // 421 slabs, the last one row
    test_bn(1000, 36, true, false, true, 3);   // 334 slabs, C % 8 != 0 (scalar reductions only)
    test_bn_merges(300, 40, 7, 4);             // 43 records: one launch, or 11 groups
    test_bn_merges(2101, 24, 5, 128);          // 421 records (the last one row): 4 groups
    test_bn_merges(1, 3, 128, 2);              // one row, one record
    test_bn_merges(130, 72, 128, 1);           // two records (of 128 and 2 rows), groups of one
    test_bn_sync(40, 96, 32);
    test_bn_sync(300, 1, 500);   // a replica with one row; C over two blocks
    test_bn_sync_one_replica(96, 40, true);
    test_bn_sync_one_replica(50, 3, false);
    test_bn_sync_one_replica(1, 24, true);  // one value per channel
    test_pool(2, 9, 7, 5, 3, 2, 1);
    test_pool(1, 7, 7, 3, 2, 2, 0);
    test_pool(2, 9, 7, 16, 3, 2, 1);           // the ResNet stem pool, odd sizes
    test_pool(2, 10, 12, 8, 3, 2, 1, true);    // even sizes, nearly every window ties
    test_pool(1, 8, 9, 24, 3, 2, 0);           // no padding: an uncovered tail row / column
    test_pool(2, 7, 8, 8, 2, 2, 1, true);      // one window per pixel, padding on both ends
    test_pool(1, 9, 11, 16, 2, 3, 1);          // win < stride: gaps never written by a window
    test_pool(1, 7, 6, 8, 3, 1, 1, true);      // win > 2·stride: scalar backward, vec forward
    test_pool(1, 5, 6, 8, 4, 2, 1);            // win = 2·stride, even window
    test_pool(2, 33, 31, 72, 3, 2, 1);         // 3×3 output tiles, 9 channel groups (2 chunks)
    test_pool_bn(2, 9, 7, 16, 3, 2, 1, true);  // the ResNet stem: conv → BN → ReLU → max pool
    test_pool_bn(2, 10, 12, 8, 3, 2, 1, false); // no ReLU: negative windows at the borders
    test_pool_bn(1, 7, 7, 5, 3, 2, 1, true);   // C % 8 != 0: the scalar kernels only
    test_pool_bn(1, 8, 9, 24, 3, 2, 0, false); // no padding: an uncovered tail row / column
    test_pool_bn(1, 7, 6, 8, 3, 1, 1, true);   // win > 2·stride: scalar backward, vec forward
    test_pool_bn(2, 33, 31, 72, 3, 2, 1, true); // 3×3 output tiles, 9 channel groups (2 chunks)
    test_linear(5, 37, 19);
    test_loss(5, 10, 0.0f);
    test_loss(3, 285, 0.1f);
    test_loss(7, 10, 0.1f, 0.35f);
    test_loss(6, 285, 0.0f, 0.8f);
    test_loss_totals(1);
    test_loss_totals(700);
    test_scale(3000, 0.75f);
    test_grad_accumulate(3000, 4);
    test_grad_accumulate(300000, 3);
    test_grad_accumulate(77, 1);
    test_collective(1, 1);
    test_collective(5, 4);                     // fewer values than threads
    test_collective(257, 2);                   // one past a block
    test_collective(3001, 3);                  // past 8 blocks of 256: the grid-stride loop
    test_collective(2053, 4);
    test_loss_nonfinite();
    test_input(2, 17);
    test_input_mix(5, 13, {BT_MIX_BLEND, 0.3f, 0, 0, 0, 0});
    test_input_mix(4, 9, {BT_MIX_BLEND, 0.8f, 0, 0, 0, 0});
    test_input_mix(5, 13, {BT_MIX_PASTE, 0.0f, 3, 9, 2, 7});
    test_input_mix(5, 13, {BT_MIX_PASTE, 0.0f, 6, 13, 8, 13});
    test_optim(0.0f);
    test_optim(50.0f);  // the norm is about 150: every gradient ×1/3 (a far smaller factor would make Adam's L2-decayed gradient cancel to rounding noise)
    test_optim(1000.0f);
    printf(fails ? "FAILED (%d)\n" : "ALL OK\n", fails);
    return fails ? 1 : 0;
}
