// Dispatch of one call: SIMD level, clamping of unchecked values, the split-KV plan, and
// the phases run on the thread pool (docs/cpu.md).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cerrno>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "index_read.h"
#include "kernel.h"
#include "pool.h"

namespace topth_cpu {

// Levels whose translation units were not built (non-x86 machine, or a compiler that refused
// the target flags; see setup.py) are absent.
#if !defined(TOPTH_HAVE_AVX2)
const SimdOps* ops_avx2() { return nullptr; }
#endif
#if !defined(TOPTH_HAVE_AVX512)
const SimdOps* ops_avx512() { return nullptr; }
#endif
#if !defined(TOPTH_HAVE_AVX512BF16)
const SimdOps* ops_avx512bf16() { return nullptr; }
#endif
#if !defined(TOPTH_HAVE_AMX)
const SimdOps* ops_amx() { return nullptr; }
#endif

namespace {

constexpr int64_t kMinSplit = 256;       // fewest positions per KV split
constexpr int64_t kItemsPerThread = 8;   // split until there are about this many items per thread
constexpr int64_t kInlineWork = 1 << 15;  // K elements below which one thread does everything
// Units whose K rows unit_scores walks (unit_walk.cpp) span this many positions (fewer where the
// threads need more units, never below the L2 rule's length; whole sequences for post_softmax
// where build_plan allows it): the walk
// prefetches each chunk of a unit while reading the one before, so a unit's first chunk comes
// unprefetched, and the units of a few hundred positions that the L2 rule below gives on a
// small L2 pay that often (docs/cpu.md, "Paged NHD: units for the walk, and the P.V walk").
constexpr int64_t kWalkUnit = 2048;
// Caches whose KV heads are interleaved inside each slot (paged NHD): the items of one range
// for all KV heads run back to back on one thread (one unit), and ranges are cut so that the
// K and V rows of all heads fit in one core's L2 (unit_bytes, below; longer where the walk
// runs: kWalkUnit): the lines the hardware prefetchers bring in for the other heads are then
// still there when those heads' items read them. Measured on the Xeon (2 MiB L2; docs/cpu.md):
// a quarter of L2 left dense NHD ~10% slower and f = 0.1 up to 10% slower than the whole L2.

// Whether whole sequences of lengths n (0: none) share threads about as evenly as ranges
// would: the longest thread's positions, sequences handed out longest first to the least
// loaded thread (as the pool takes units), at most 10% above an even share.
bool whole_sequences_balance(const std::vector<int64_t>& n, int64_t threads) {
    std::vector<int64_t> lens(n), load(size_t(threads), 0);
    std::sort(lens.begin(), lens.end(), std::greater<int64_t>());
    int64_t total = 0;
    for (const int64_t x : lens) {
        *std::min_element(load.begin(), load.end()) += x;
        total += x;
    }
    return 10 * threads * *std::max_element(load.begin(), load.end()) <= 11 * total;
}

// One element of the query as float32 (exact for half and bfloat16).
float load_scalar(const uint8_t* p, int32_t dtype) {
    float f;
    if (dtype == kF32) {
        std::memcpy(&f, p, 4);
        return f;
    }
    uint16_t u;
    std::memcpy(&u, p, 2);
    if (dtype == kBF16) {
        const uint32_t w = uint32_t(u) << 16;
        std::memcpy(&f, &w, 4);
        return f;
    }
    const float sign = (u & 0x8000u) ? -1.0f : 1.0f;
    const int e = (u >> 10) & 0x1f, m = u & 0x3ff;
    if (e == 0) return sign * std::ldexp(float(m), -24);
    if (e == 31) return m ? std::numeric_limits<float>::quiet_NaN() : sign * std::numeric_limits<float>::infinity();
    return sign * std::ldexp(float(m | 0x400), e - 25);
}

int64_t clamp64(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

// AMX: the CPU reports AMX-TILE and AMX-BF16 (CPUID leaf 7), and Linux grants the process
// the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, once per process; without it the first
// tile instruction faults). The verdict and its reason are computed once.
std::string amx_check() {
#if defined(__x86_64__) && defined(__linux__)
    if (!ops_amx()) return "not built (the compiler refused -mamx-tile -mamx-bf16)";
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22)))
        return "the CPU does not report AMX-TILE and AMX-BF16";
    if (!__builtin_cpu_supports("avx512bf16")) return "the CPU lacks AVX512-BF16 (the level's other stages)";
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0)
        return std::string("Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: errno ") +
               std::to_string(errno) + ")";
    return "";
#else
    return "not an x86-64 Linux build";
#endif
}

bool cpu_has(int32_t level) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (level == kLevelAmx) return amx_unavailable_reason()[0] == 0;
    if (level == kLevelAvx2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (level == kLevelAvx512 || level == kLevelAvx512Bf16)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
               (level == kLevelAvx512 || __builtin_cpu_supports("avx512bf16"));
#endif
    return level == kLevelGeneric;
}

const SimdOps* ops_of(int32_t level) {
    if (level == kLevelAmx) return ops_amx();
    if (level == kLevelAvx512Bf16) return ops_avx512bf16();
    if (level == kLevelAvx512) return ops_avx512();
    if (level == kLevelAvx2) return ops_avx2();
    return ops_generic();
}

// Plan and scratch are reused across calls (one call at a time: guarded by g_call).
std::mutex g_call;
Plan g_plan;
std::vector<Scratch> g_scratch;
std::unique_ptr<std::atomic<int64_t>[]> g_remaining;  // per pair: items not finished yet
int64_t g_remaining_size = 0;

void build_plan(Plan& pl, const Params& P) {
    pl.P = &P;
    const int64_t B = P.batch, Hkv = P.num_kv_heads, Hq = P.num_q_heads;
    const int64_t max_seq_len = P.max_blocks_per_seq * P.block_size;
    pl.G = int32_t(Hq / Hkv);
    pl.D = int32_t(P.head_dim);
    pl.dpad = int32_t((P.head_dim + 15) / 16 * 16);
    pl.n.assign(size_t(B), 0);
    pl.row.assign(size_t(B), 0);
    pl.set.assign(size_t(B), 0);
    int64_t total = 0, units = 0, longest_n = 0;
    for (int64_t b = 0; b < B; ++b) {
        // unchecked values are clamped in their full dtype range (no int32 wrap first)
        const int64_t n = clamp64(index_at(P.seq_lens, b, P.lens_s, P.seq_lens_i64 != 0), 0, max_seq_len);
        pl.n[size_t(b)] = n;
        pl.row[size_t(b)] = std::min(std::max<int64_t>(n, 1), P.max_row_id) - 1;
        if (P.threshold_set)
            pl.set[size_t(b)] = clamp64(index_at(P.threshold_set, b, P.tset_s, P.tset_i64 != 0), 0, P.num_sets - 1);
        total += n * Hkv;
        units += n > 0 ? Hkv : 0;
        longest_n = std::max(longest_n, n);
    }
    int64_t threads = std::max<int32_t>(P.threads, 1);
    if (total * P.head_dim < kInlineWork) threads = 1;
    int64_t split = std::numeric_limits<int64_t>::max();
    const int64_t es = P.dtype == kF32 ? 4 : 2;
    // heads interleaved inside a slot (NHD): a head's rows are further apart than the heads.
    // Their items are grouped per range only when that leaves every thread at least two groups
    // (one sequence of a few hundred positions must not end up on one thread).
    bool interleaved = P.block_table && Hkv > 1 && !P.kv_packed && P.k_s[1] < P.k_s[2];
    const int64_t fit_l2 = std::max(kMinSplit, unit_bytes() / (2 * Hkv * P.head_dim * es));
    if (interleaved && threads > 1) {
        int64_t groups = 0;
        for (int64_t b = 0; b < B; ++b) groups += (pl.n[size_t(b)] + fit_l2 - 1) / fit_l2;
        interleaved = groups >= 2 * threads;
    }
    // units the walk reads: kWalkUnit positions, shorter where that would leave a thread fewer
    // than 4 units' worth of the batch's positions (longest first then evens the rest out)
    int64_t fit = fit_l2;
    bool whole = false;  // post_softmax: whole sequences as units (below)
    if (interleaved && unit_walk(pl)) {
        int64_t want = kWalkUnit;
        if (threads > 1) want = std::min(want, total / Hkv / (4 * threads));  // total: positions x Hkv
        // post_softmax: a sequence cut into ranges takes two phases (the row's max and exponent
        // sum before any selection), and the scores of every item go out to memory in between;
        // whole sequences keep one phase where a sequence's scores fit in L2 and the threads
        // stay about as balanced (docs/cpu.md, "post_softmax on paged NHD")
        const bool fits = longest_n * Hkv * pl.G * int64_t(sizeof(float)) <= unit_bytes();
        whole = P.placement == kPost && fits && (threads == 1 || whole_sequences_balance(pl.n, threads));
        if (whole) want = longest_n;
        fit = std::max(fit_l2, want);
    }
    if (P.split_len > 0) {
        split = P.split_len;
    } else {
        if (threads > 1 && units < 4 * threads && !whole)  // whole: balance checked above
            split = std::max(kMinSplit, (total + kItemsPerThread * threads - 1) / (kItemsPerThread * threads));
        if (interleaved) split = std::min(split, fit);
    }
    pl.items.clear();
    pl.pair_first.assign(size_t(B * Hkv), 0);
    pl.pair_count.assign(size_t(B * Hkv), 0);
    bool split_any = false;
    int64_t ws = 0;
    for (int64_t b = 0; b < B; ++b) {
        const int64_t n = pl.n[size_t(b)];
        const int64_t pieces = n == 0 ? 0 : 1 + (n - 1) / split;  // no overflow for split = max
        const int64_t size = pieces ? (n + pieces - 1) / pieces : 0;
        split_any |= pieces > 1;
        for (int64_t g = 0; g < Hkv; ++g) {
            pl.pair_first[size_t(b * Hkv + g)] = int64_t(pl.items.size());
            for (int64_t lo = 0; lo < n; lo += size) {
                Item it;
                it.b = b; it.g = g; it.lo = lo; it.hi = std::min(n, lo + size);
                it.ws_off = ws;
                ws += pl.G * (it.hi - it.lo);
                pl.items.push_back(it);
            }
            pl.pair_count[size_t(b * Hkv + g)] = int64_t(pl.items.size()) - pl.pair_first[size_t(b * Hkv + g)];
        }
    }
    pl.two_phase = P.placement == kPost && split_any;
    const size_t I = pl.items.size(), G = size_t(pl.G), dpad = size_t(pl.dpad);
    // units, longest first: one item each, or (interleaved heads) the items of one range of a
    // sequence for every KV head (every pair of a sequence has the same ranges)
    std::vector<std::vector<int64_t>> runs;
    for (int64_t b = 0; b < B; ++b) {
        const int64_t pieces = pl.pair_count[size_t(b * Hkv)];
        for (int64_t s = 0; s < pieces; ++s) {
            if (interleaved) runs.emplace_back();
            for (int64_t g = 0; g < Hkv; ++g) {
                const int64_t i = pl.pair_first[size_t(b * Hkv + g)] + s;
                if (interleaved) runs.back().push_back(i);
                else runs.push_back({i});
            }
        }
    }
    auto unit_len = [&](const std::vector<int64_t>& u) { return pl.items[size_t(u[0])].hi - pl.items[size_t(u[0])].lo; };
    std::stable_sort(runs.begin(), runs.end(), [&](const auto& a, const auto& c) { return unit_len(a) > unit_len(c); });
    pl.order.clear();
    pl.unit_first.assign(1, 0);
    for (const auto& u : runs) {
        pl.order.insert(pl.order.end(), u.begin(), u.end());
        pl.unit_first.push_back(int64_t(pl.order.size()));
    }
    for (auto* v : {&pl.m_loc, &pl.m_ref, &pl.Z, &pl.R, &pl.Dd}) v->assign(I * G, 0.0f);
    pl.kc.assign(I * G, 0);
    pl.bad.assign(I * G, 0);
    pl.uni.assign(I, 0);
    pl.acc.resize(I * G * dpad);
    pl.vs.assign(P.vmc == kVmcComputed ? I * dpad : 0, 0.0f);
    for (auto* v : {&pl.k_rows, &pl.v_rows, &pl.vm_rows}) v->assign(I, 0);
    pl.walked.assign(pl.unit_first.size() - 1, 0);
    if (pl.two_phase) {
        if (pl.ws.size() < size_t(ws)) pl.ws.resize(size_t(ws));
        pl.pair_m.assign(size_t(B * Hkv) * G, 0.0f);
        pl.pair_logz.assign(size_t(B * Hkv) * G, 0.0f);
    }
    // scale * query in float32, zero padded (semantics: scores in float32 from the inputs);
    // for bfloat16 also the query as given (the avx512bf16 level's vdpbf16ps scores)
    pl.q.assign(size_t(B * Hq) * dpad, 0.0f);
    pl.qraw.assign(P.dtype == kBF16 ? size_t(B * Hq) * dpad : 0, 0);
    const uint8_t* qp = static_cast<const uint8_t*>(P.query);
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < Hq; ++h)
            for (int64_t d = 0; d < P.head_dim; ++d) {
                const uint8_t* p = qp + (b * P.q_s[0] + h * P.q_s[1] + d * P.q_s[2]) * es;
                const float x = load_scalar(p, P.dtype);
                const size_t at = size_t((b * Hq + h) * int64_t(dpad) + d);
                pl.q[at] = P.scale * x;
                if (P.dtype == kBF16) std::memcpy(&pl.qraw[at], p, 2);
            }
    g_scratch.resize(size_t(threads));
    int64_t longest = 1;
    for (const Item& it : pl.items) longest = std::max(longest, it.hi - it.lo);
    for (auto& sc : g_scratch) sc.reserve(longest, pl.G, pl.dpad);
}

}  // namespace

// One core's L2 in bytes (sysconf, clamped to 256 KiB .. 8 MiB; 2 MiB when unknown): the size
// the scheduler plans units with (build_plan).
int64_t unit_bytes() {
    static const int64_t bytes = [] {
#if defined(_SC_LEVEL2_CACHE_SIZE)
        const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
        if (l2 > 0) return std::min<int64_t>(std::max<int64_t>(l2, 256 << 10), 8 << 20);
#endif
        return int64_t(2) << 20;
    }();
    return bytes;
}

const char* amx_unavailable_reason() {
    static const std::string reason = amx_check();
    return reason.c_str();
}

int32_t best_simd_level() {
    if (cpu_has(kLevelAmx) && ops_amx()) return kLevelAmx;
    if (cpu_has(kLevelAvx512Bf16) && ops_avx512bf16()) return kLevelAvx512Bf16;
    if (cpu_has(kLevelAvx512) && ops_avx512()) return kLevelAvx512;
    if (cpu_has(kLevelAvx2) && ops_avx2()) return kLevelAvx2;
    return kLevelGeneric;
}

bool simd_level_supported(int32_t level) {
    return level == kLevelGeneric || (cpu_has(level) && ops_of(level) != nullptr);
}

const char* simd_level_name(int32_t level) {
    switch (level) {
        case kLevelAmx: return "amx";
        case kLevelAvx512Bf16: return "avx512bf16";
        case kLevelAvx512: return "avx512";
        case kLevelAvx2: return "avx2";
        case kLevelGeneric: return "generic";
        default: return "auto";
    }
}

Counters decode(const Params& P, int32_t level) {
    std::lock_guard<std::mutex> lock(g_call);
    Plan& pl = g_plan;
    if (level == kLevelAuto) level = best_simd_level();
    pl.ops = ops_of(level);
    build_plan(pl, P);
    const int32_t threads = int32_t(g_scratch.size());
    const int64_t I = int64_t(pl.items.size()), pairs = pl.pairs();
    // Items run longest first on the pool; the last item of a (sequence, KV head) to finish
    // runs that pair's combine (acq_rel counter: it sees every split's partial record), so a
    // call needs one pool round trip (two with split post_softmax: scores, then select + P.V).
    if (g_remaining_size < pairs) {
        g_remaining.reset(new std::atomic<int64_t>[size_t(pairs)]);
        g_remaining_size = pairs;
    }
    auto items = [&](Phase phase) {
        for (int64_t p = 0; p < pairs; ++p) g_remaining[p].store(pl.pair_count[size_t(p)], std::memory_order_relaxed);
        const int64_t U = int64_t(pl.unit_first.size()) - 1;
        const bool walk = phase != kSelect && unit_walk(pl), walk_pv = phase != kScores && pv_walk(pl);
        parallel_for(threads, U, [&](int64_t u, int32_t w) {
            const int64_t first = pl.unit_first[size_t(u)], end = pl.unit_first[size_t(u) + 1];
            Scratch& sc = g_scratch[size_t(w)];
            // the KV heads of one NHD range: one K walk, and one P.V walk (unit_pv decides)
            const bool walked = walk && end - first > 1, walked_pv = walk_pv && end - first > 1;
            const auto done = [&](int64_t i) {
                const int64_t pair = pl.items[size_t(i)].b * P.num_kv_heads + pl.items[size_t(i)].g;
                if (g_remaining[pair].fetch_sub(1, std::memory_order_acq_rel) == 1) {
                    if (phase == kScores) combine_lse(pl, pair);
                    else combine_pair(pl, pair);
                }
            };
            if (walked) {
                unit_scores(pl, &pl.order[size_t(first)], end - first, sc);
                pl.walked[size_t(u)] |= 1;
            }
            for (int64_t t = first; t < end; ++t) {
                const int64_t i = pl.order[size_t(t)];
                run_item(pl, i, phase, sc, walked ? sc.scored[size_t(t - first)] : nullptr,
                         walked_pv ? t - first : -1);
                if (!walked_pv) done(i);
            }
            if (walked_pv) {
                if (unit_pv(pl, &pl.order[size_t(first)], end - first, sc)) pl.walked[size_t(u)] |= 2;
                for (int64_t t = first; t < end; ++t) done(pl.order[size_t(t)]);
            }
        }, P.use_openmp != 0);
    };
    if (pl.two_phase) items(kScores);
    items(pl.two_phase ? kSelect : kFull);
    for (int64_t p = 0; p < pairs; ++p)
        if (pl.pair_count[size_t(p)] == 0) combine_pair(pl, p);  // n = 0: zeros

    Counters c;
    for (int64_t i = 0; i < I; ++i) {
        c.k_rows += pl.k_rows[size_t(i)];
        c.v_rows += pl.v_rows[size_t(i)];
        c.v_mean_rows += pl.vm_rows[size_t(i)];
    }
    c.items = I;
    c.units = int64_t(pl.unit_first.size()) - 1;
    for (const uint8_t w : pl.walked) {
        c.k_walks += w & 1;
        c.pv_walks += w >> 1 & 1;
    }
    for (int64_t p = 0; p < pairs; ++p) c.splits_max = std::max(c.splits_max, pl.pair_count[size_t(p)]);
    c.threads_used = threads;
    c.runtime = (threads <= 1 || I <= 1) ? 0 : (P.use_openmp && openmp_runtime()[0] ? 2 : 1);
    return c;
}

}  // namespace topth_cpu
