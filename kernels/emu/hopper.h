// hopper.h: the emulator's Hopper (sm_90a) instructions, included after emu.h: the shared-memory
// window, mbarrier with transaction counts, TMA tiled loads (cp.async.bulk.tensor) and the
// warpgroup MMA (wgmma.mma_async) reading its operands through shared-memory descriptors.
//
// Every asynchronous operation is emulated at a legal timing chosen to expose a missing wait:
// - wgmma reads shared memory and writes its accumulators only when the issuing thread's
//   `wgmma.wait_group` retires its group, so a kernel that frees a stage (or reads the
//   accumulators) before waiting reads or computes stale values and fails its check;
// - a TMA load lands either lazily (the default: when a thread waits on its mbarrier and
//   nothing else could complete the phase) or eagerly (at issue, g_emu_tma_eager): the first
//   timing catches a consumer that reads a stage without waiting on its full barrier, the
//   second a producer that refills a stage before its consumers released it.
// A check runs each kernel under both timings and demands the same bits.
#pragma once
#include <map>

// ---- the shared window -------------------------------------------------------------------
// Kernels written for Hopper address shared memory as 32-bit offsets into the block's shared
// window (descriptors hold 14-bit address fields): here, offsets into g_emu_shared, which is
// 1024-byte aligned like the swizzle atoms it holds.
#define BT_EMU_SHARED_WINDOW (227 * 1024)
alignas(1024) inline unsigned char g_emu_shared[BT_EMU_SHARED_WINDOW];

inline unsigned emu_shared_offset(const void* p) {
    const auto* c = static_cast<const unsigned char*>(p);
    if (c < g_emu_shared || c >= g_emu_shared + BT_EMU_SHARED_WINDOW) emu_fail("a shared address outside the shared window");
    return (unsigned)(c - g_emu_shared);
}
inline unsigned char* emu_shared_ptr(unsigned off, unsigned bytes) {
    if ((size_t)off + bytes > BT_EMU_SHARED_WINDOW) emu_fail("a shared access beyond the shared window");
    return g_emu_shared + off;
}

// The 128-byte swizzle: the 16-byte chunk bits [4:6] of an address XORed with its bits [7:9]
// (the pattern TMA writes with CU_TENSOR_MAP_SWIZZLE_128B and wgmma reads with swizzle mode 1).
inline unsigned emu_swizzle128(unsigned a) { return a ^ (((a >> 7) & 7u) << 4); }

// ---- mbarrier ----------------------------------------------------------------------------

struct EmuMbar {
    int expected = 0;  // arrivals per phase
    int pending = 0;   // arrivals still missing in the current phase
    long tx = 0;       // transaction bytes still missing in the current phase
    unsigned phase = 0;
};
inline std::map<unsigned, EmuMbar> g_mbars;

struct EmuTmaLoad {
    unsigned dst, bar;
    const struct BtTmaMap* map;
    int c[4];
};
inline std::vector<EmuTmaLoad> g_tma_inflight;
inline bool g_emu_tma_eager = false;

inline EmuMbar& emu_mbar(unsigned bar) {
    auto it = g_mbars.find(bar);
    if (it == g_mbars.end()) emu_fail("an mbarrier used before mbarrier.init");
    return it->second;
}

inline void emu_mbar_settle(EmuMbar& b) {
    if (b.pending == 0 && b.tx == 0) { b.phase ^= 1; b.pending = b.expected; g_spins = 0; }
}

inline void bt_emu_mbar_init(unsigned bar, int count) {
    if (bar % 8) emu_fail("mbarrier not 8-byte aligned");
    if (count < 1) emu_fail("mbarrier.init with a count below 1");
    g_mbars[bar] = EmuMbar{count, count, 0, 0};
}

inline void bt_emu_mbar_arrive(unsigned bar) {
    EmuMbar& b = emu_mbar(bar);
    if (b.pending <= 0) emu_fail("mbarrier: more arrivals than its count in one phase");
    --b.pending;
    emu_mbar_settle(b);
}

inline void bt_emu_mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
    EmuMbar& b = emu_mbar(bar);
    b.tx += bytes;
    if (b.pending <= 0) emu_fail("mbarrier: more arrivals than its count in one phase");
    --b.pending;
    emu_mbar_settle(b);
}

inline void emu_tma_land(const EmuTmaLoad& l);

// mbarrier.try_wait.parity: whether the phase of parity `parity` has completed (the current
// phase is the other one). Lazy TMA loads on this barrier land here, when nothing else can
// complete its phase.
inline bool bt_emu_mbar_try_wait(unsigned bar, unsigned parity) {
    EmuMbar& b = emu_mbar(bar);
    if (b.phase != (parity & 1)) return true;
    if (b.pending == 0 && b.tx > 0) {
        std::vector<EmuTmaLoad> keep;
        for (const EmuTmaLoad& l : g_tma_inflight) {
            if (l.bar == bar) emu_tma_land(l); else keep.push_back(l);
        }
        g_tma_inflight.swap(keep);
        if (b.phase != (parity & 1)) return true;
    }
    if (++g_spins > 64L * (long)g_fibers.size() + 4096) emu_fail("deadlock: an mbarrier phase that can never complete");
    emu_yield();
    return false;
}

// ---- TMA ---------------------------------------------------------------------------------

// The emulator's tensor map (the GPU's is an opaque 128-byte CUtensorMap): what
// cuTensorMapEncodeTiled is given for a bf16 tensor of rank 2 to 4, element (c0, c1, c2, c3)
// at base + c1·stride[0] + c2·stride[1] + c3·stride[2] (c0 the contiguous dimension).
//
// Traversal strides (cuTensorMapEncodeTiled's elementStrides; CUDA Driver API reference,
// "Tensor Map Object Management", and the same text in cuda.h): "the iteration step along each
// of the tensorRank dimensions, must be non-zero and less than or equal to 8"; with
// CU_TENSOR_MAP_INTERLEAVE_NONE "the first element of this array is ignored since TMA doesn't
// support the stride for dimension zero"; where elementStrides[i] ≠ 1 "TMA loads
// ceil(boxDim[i] / elementStrides[i]) number of elements along i-th dimension. To load N
// elements along i-th dimension, boxDim[i] must be set to N * elementStrides[i]" (boxDim still
// 1..256). So a box issued at coordinate c reads elements c + j·elementStrides[i],
// j < ceil(boxDim[i] / elementStrides[i]), each out-of-bounds one as zero, and lands densely:
// its shared-memory footprint and transaction bytes are those of the traversed elements.
struct alignas(64) BtTmaMap {
    const void* base;
    unsigned rank;
    unsigned box[4];                 // box extents (box[0] · 2 bytes ≤ 128 with the 128-byte swizzle)
    unsigned long long dim[4];       // extents
    unsigned long long stride[3];    // bytes between consecutive c1, c2, c3 (multiples of 16)
    int swizzle128;                  // CU_TENSOR_MAP_SWIZZLE_128B, else none
    unsigned elem_stride[4];         // traversal strides (1..8; [0] ignored: always 1)
};
static_assert(sizeof(BtTmaMap) == 128, "a tensor map is 128 bytes");
// The name the kernels use for the driver's type.
typedef BtTmaMap CUtensorMap;

// cuTensorMapEncodeTiled for a bf16 tensor of `rank` dimensions (innermost first), zeros for
// out-of-bounds elements (CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), traversal strides
// `elem_stride` (null: all 1).
inline BtTmaMap emu_tma_encode(const void* base, unsigned rank, const unsigned long long* dim,
                               const unsigned long long* stride, const unsigned* box, bool swizzle128,
                               const unsigned* elem_stride = nullptr) {
    auto refuse = [](const char* why) { fprintf(stderr, "tensor map: %s\n", why); std::abort(); };
    if (rank < 2 || rank > 4) refuse("rank 2 to 4");
    if (reinterpret_cast<uintptr_t>(base) % 16) refuse("the base must be 16-byte aligned");
    BtTmaMap m{};
    m.base = base; m.rank = rank; m.swizzle128 = swizzle128;
    for (unsigned i = 0; i < 4; ++i) { m.dim[i] = i < rank ? dim[i] : 1; m.box[i] = i < rank ? box[i] : 1; }
    for (unsigned i = 0; i + 1 < rank; ++i) {
        if (stride[i] % 16) refuse("strides must be multiples of 16 bytes");
        m.stride[i] = stride[i];
    }
    for (unsigned i = 0; i < rank; ++i) if (m.box[i] == 0 || m.box[i] > 256) refuse("box extents 1..256");
    for (unsigned i = 0; i < 4; ++i) {
        const unsigned e = elem_stride && i < rank ? elem_stride[i] : 1;
        if (e == 0 || e > 8) refuse("traversal strides 1..8");
        m.elem_stride[i] = i == 0 ? 1 : e;  // the innermost dimension's is ignored (no interleave)
    }
    if (swizzle128 && m.box[0] * 2 > 128) refuse("a 128-byte swizzle needs an inner box of at most 128 bytes");
    return m;
}

// The 2-D case: a row-major [dim1][dim0] matrix with the given row pitch.
inline BtTmaMap emu_tma_encode_2d(const void* base, unsigned long long dim0, unsigned long long dim1,
                                  unsigned long long row_bytes, unsigned box0, unsigned box1, bool swizzle128) {
    const unsigned long long dim[2] = {dim0, dim1}, stride[1] = {row_bytes};
    const unsigned box[2] = {box0, box1};
    return emu_tma_encode(base, 2, dim, stride, box, swizzle128);
}

// The elements a box traverses along dimension d: ceil(box / traversal stride).
inline unsigned emu_tma_extent(const BtTmaMap& m, unsigned d) { return (m.box[d] + m.elem_stride[d] - 1) / m.elem_stride[d]; }

// The box lands densely: traversed element (i0, i1, i2, i3) (global coordinate c + i·stride)
// at row ((i3·n2 + i2)·n1 + i1) of box0 · 2 bytes (n = the traversed extents), then swizzled
// by its address.
inline void emu_tma_land(const EmuTmaLoad& l) {
    const BtTmaMap& m = *l.map;
    const unsigned row_bytes = m.box[0] * 2;
    const unsigned n1 = emu_tma_extent(m, 1), n2 = emu_tma_extent(m, 2), n3 = emu_tma_extent(m, 3);
    const unsigned* es = m.elem_stride;
    unsigned row = 0;
    for (unsigned i3 = 0; i3 < n3; ++i3)
        for (unsigned i2 = 0; i2 < n2; ++i2)
            for (unsigned i1 = 0; i1 < n1; ++i1, ++row)
                for (unsigned i0 = 0; i0 < m.box[0]; ++i0) {
                    const long g[4] = {(long)l.c[0] + i0, (long)l.c[1] + (long)i1 * es[1], (long)l.c[2] + (long)i2 * es[2],
                                       (long)l.c[3] + (long)i3 * es[3]};
                    bool inside = true;
                    for (unsigned d = 0; d < 4; ++d) inside &= g[d] >= 0 && (unsigned long long)g[d] < m.dim[d];
                    uint16_t v = 0;  // out of bounds: zero
                    if (inside) {
                        unsigned long long off = (unsigned long long)g[0] * 2;
                        for (unsigned d = 1; d < m.rank; ++d) off += (unsigned long long)g[d] * m.stride[d - 1];
                        memcpy(&v, static_cast<const char*>(m.base) + off, 2);
                    }
                    unsigned a = l.dst + row * row_bytes + i0 * 2;
                    if (m.swizzle128) a = emu_swizzle128(a);
                    memcpy(emu_shared_ptr(a, 2), &v, 2);
                }
    EmuMbar& b = emu_mbar(l.bar);
    b.tx -= (long)m.box[0] * n1 * n2 * n3 * 2;  // the traversed elements; out-of-bounds ones count too
    if (b.tx < 0) emu_fail("mbarrier: more transaction bytes completed than expected");
    emu_mbar_settle(b);
}

// cp.async.bulk.tensor.{2d,4d}.shared::cluster.global.mbarrier::complete_tx::bytes
inline void bt_emu_tma_load(unsigned dst, const BtTmaMap* map, const int* c, unsigned rank, unsigned bar) {
    if (rank != map->rank) emu_fail("TMA load of another rank than its tensor map's");
    if (dst % (map->swizzle128 ? 1024 : 128)) emu_fail("TMA destination misaligned (1024 bytes with the 128-byte swizzle, else 128)");
    (void)emu_mbar(bar);
    EmuTmaLoad l{dst, bar, map, {0, 0, 0, 0}};
    for (unsigned d = 0; d < rank; ++d) l.c[d] = c[d];
    if (g_emu_tma_eager) emu_tma_land(l); else g_tma_inflight.push_back(l);
}

inline void bt_emu_tma_load_2d(unsigned dst, const BtTmaMap* map, int c0, int c1, unsigned bar) {
    const int c[2] = {c0, c1};
    bt_emu_tma_load(dst, map, c, 2, bar);
}

inline void bt_emu_tma_load_4d(unsigned dst, const BtTmaMap* map, int c0, int c1, int c2, int c3, unsigned bar) {
    const int c[4] = {c0, c1, c2, c3};
    bt_emu_tma_load(dst, map, c, 4, bar);
}

// ---- wgmma -------------------------------------------------------------------------------

// A shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address,
// leading- and stride-dimension byte offsets (each >> 4, 14 bits), swizzle mode in bits 62-63.
struct EmuDesc { unsigned start, lbo, sbo, swizzle; };
inline EmuDesc emu_desc(unsigned long long d) {
    EmuDesc e{(unsigned)(d & 0x3fff) << 4, (unsigned)((d >> 16) & 0x3fff) << 4, (unsigned)((d >> 32) & 0x3fff) << 4,
              (unsigned)(d >> 62)};
    if ((d >> 49) & 7) emu_fail("wgmma descriptor: a base offset the emulator does not model");
    if (e.swizzle != 0 && e.swizzle != 1) emu_fail("wgmma descriptor: only no swizzle and the 128-byte swizzle are emulated");
    return e;
}

// Element (row, k) of an operand (rows = M or N, 16 k of bf16) as the descriptor lays it out,
// PTX ISA's canonical layouts in elements (T = 8 bf16 = 16 bytes):
// - K-major, 128-byte swizzle ((8,m),(T,2k)):((8T,SBO),(1,T)): a row is 128 bytes of k, 8-row
//   atoms `sbo` apart; without swizzle ((8,m),(T,2k)):((1T,SBO),(1,LBO)): core matrices of 8
//   rows × 16 bytes, 8-row groups `sbo` apart, the second 8 k `lbo` further;
// - MN-major (transposed), 128-byte swizzle ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)): 64
//   consecutive rows in 128 bytes, the next 64 rows `lbo` further; a k row of 128 bytes, 8-k
//   atoms `sbo` apart.
inline float emu_desc_elem(const EmuDesc& e, int row, int k, bool mn_major) {
    unsigned a;
    if (mn_major) {
        if (e.swizzle != 1) emu_fail("wgmma descriptor: MN-major operands are emulated with the 128-byte swizzle only");
        a = emu_swizzle128(e.start + (row / 64) * e.lbo + (k / 8) * e.sbo + (k % 8) * 128 + (row % 64) * 2);
    } else if (e.swizzle == 1) a = emu_swizzle128(e.start + (row / 8) * e.sbo + (row % 8) * 128 + k * 2);
    else a = e.start + (row / 8) * e.sbo + (k / 8) * e.lbo + (row % 8) * 16 + (k % 8) * 2;
    uint16_t v;
    memcpy(&v, emu_shared_ptr(a, 2), 2);
    return __bfloat162float(__nv_bfloat16{v});
}

struct EmuWgmma {
    unsigned long long da, db;
    float* d;
    int n;
    bool scale_d, tnsp_a, tnsp_b;
    long group;  // -1 until committed
};
struct EmuWgmmaThread { std::vector<EmuWgmma> ops; long groups = 0; bool fenced = false; };
inline std::vector<EmuWgmmaThread> g_wgmma;  // per thread of the block
// wgmma.wait_group is warpgroup-collective (.sync.aligned): no thread of the warpgroup leaves
// it before every thread's retired operations are done (the hardware runs one MMA for all).
inline std::vector<EmuBarrier> g_warpgroup_barriers;

inline void emu_wgmma_check_warpgroup() {
    if (blockDim.x % 128 || blockDim.y != 1 || blockDim.z != 1) emu_fail("wgmma needs whole warpgroups of 128 threads in x");
}

inline void bt_emu_wgmma_fence() { emu_wgmma_check_warpgroup(); g_wgmma[g_cur].fenced = true; }

// wgmma.mma_async m64nNk16 f32 += bf16 × bf16, both operands from descriptors; tnsp_a /
// tnsp_b: the operand is MN-major (imm-trans-a / imm-trans-b = 1).
inline void bt_emu_wgmma(float* d, int n, unsigned long long da, unsigned long long db, bool scale_d, bool tnsp_a = false,
                         bool tnsp_b = false) {
    EmuWgmmaThread& t = g_wgmma[g_cur];
    if (!t.fenced) emu_fail("wgmma issued without a wgmma.fence before it");
    t.ops.push_back({da, db, d, n, scale_d, tnsp_a, tnsp_b, -1});
}

inline void bt_emu_wgmma_commit() {
    EmuWgmmaThread& t = g_wgmma[g_cur];
    for (auto& o : t.ops) if (o.group < 0) o.group = t.groups;
    ++t.groups;
}

// This thread's part of one wgmma (the accumulator fragment layout of m64nNk16: warp w of the
// warpgroup holds rows 16w..16w+15; lane l, value 4j + 2h + b holds row 16w + l/4 + 8h,
// column 8j + 2·(l % 4) + b).
inline void emu_wgmma_run(const EmuWgmma& o) {
    const EmuDesc a = emu_desc(o.da), b = emu_desc(o.db);
    const int lin = g_fibers[g_cur].lin, warp = (lin / 32) % 4, lane = lin % 32;
    for (int j = 0; j < o.n / 8; ++j)
        for (int h = 0; h < 2; ++h)
            for (int bit = 0; bit < 2; ++bit) {
                const int row = 16 * warp + lane / 4 + 8 * h, col = 8 * j + 2 * (lane % 4) + bit;
                float acc = 0;
                for (int k = 0; k < 16; ++k) acc += emu_desc_elem(a, row, k, o.tnsp_a) * emu_desc_elem(b, col, k, o.tnsp_b);
                float& dst = o.d[4 * j + 2 * h + bit];
                dst = (o.scale_d ? dst : 0.0f) + acc;
            }
}

// wgmma.wait_group n: every committed group but the newest n is done.
inline void bt_emu_wgmma_wait(int n) {
    EmuBarrier& wg = g_warpgroup_barriers[g_fibers[g_cur].lin / 128];
    wg.arrive_and_wait();
    EmuWgmmaThread& t = g_wgmma[g_cur];
    std::vector<EmuWgmma> keep;
    for (const auto& o : t.ops) {
        if (o.group >= 0 && o.group < t.groups - n) emu_wgmma_run(o);
        else keep.push_back(o);
    }
    t.ops.swap(keep);
    t.fenced = false;  // registers written: the next wgmma needs a fence first
    wg.arrive_and_wait();
}

inline void emu_hopper_reset_block(unsigned nthreads) {
    g_mbars.clear();
    g_tma_inflight.clear();
    g_wgmma.assign(nthreads, EmuWgmmaThread{});
    g_warpgroup_barriers.assign((nthreads + 127) / 128, EmuBarrier{});
    for (unsigned w = 0; w < g_warpgroup_barriers.size(); ++w)
        g_warpgroup_barriers[w].expected = (int)std::min(128u, nthreads - 128 * w);
}

inline void emu_hopper_thread_exit() {
    if (!g_wgmma.empty() && !g_wgmma[g_cur].ops.empty()) emu_fail("thread exited with wgmma in flight");
    if (!g_warpgroup_barriers.empty()) g_warpgroup_barriers[g_fibers[g_cur].lin / 128].leave();
}

// Registered with emu.h's launcher before main runs: every block starts with fresh Hopper
// state, and a thread may not exit with wgmma in flight.
inline const bool g_emu_hopper_hooked = [] {
    g_emu_block_start_hook = emu_hopper_reset_block;
    g_emu_thread_exit_hook = emu_hopper_thread_exit;
    return true;
}();
