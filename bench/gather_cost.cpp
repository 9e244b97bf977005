// Gather cost of kept V rows against streaming every row, cold (docs/cpu.md, "Gather cost of
// kept V rows"). Items of 8192 V rows (BNSD: one contiguous run per item) fill a buffer larger
// than the last-level cache; a fraction f of each item's rows, at random positions, is its kept
// list. Per item row (ticks of the TSC divided by the item's 8192 rows), medians over rounds,
// the variants interleaved in each round:
//
//   pv all rows         the level's P.V stage over every row (dense)
//   pv kept             the same stage over the kept list (strided visit order, as the kernel)
//   read all            a plain sum of every row: the memory system's cost of streaming the run
//   read kept asc       a plain sum of the kept rows in ascending order
//   read kept strided   a plain sum of the kept rows in the kernel's strided visit order
//
// The best of "pv kept", "read kept asc" and "read kept strided", as a share r of "read all",
// is the cheapest gather this run found: with k the share of the K pass in dense time (half,
// when both passes run at the memory's speed), a kernel that reads K and V at the memory's
// speed gains at most 1 / (k + (1 - k) * r) over dense from skipping V rows, against the byte
// ratio 1 / (k + (1 - k) * f). The plain reads have no software prefetch; the P.V stage has.
//
// The buffer should be several times the last-level cache (a smaller one is timed partly from
// cache: the tool says so).
//
//   AVX2 level (one command):
//   g++ -O3 -mavx2 -mfma -mf16c -Icpu_kernels/include -Icpu_kernels/src
//       cpu_kernels/src/avx2_pv.cpp bench/gather_cost.cpp -o /tmp/gather_cost
//   AVX-512 level (one command):
//   g++ -O3 -DSTAGE_AVX512 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c
//       -Icpu_kernels/include -Icpu_kernels/src cpu_kernels/src/avx512_pv.cpp bench/gather_cost.cpp
//       -o /tmp/gather_cost512
//
//   taskset -c 1 /tmp/gather_cost [G] [head_dim] [f] [MiB] [rounds]
//
// Defaults: G = 4, head_dim = 128, bfloat16 rows, f = 0.3, 1024 MiB of V rows, 10 rounds.
#include <x86intrin.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <new>
#include <random>
#include <string>
#include <vector>

#if defined(STAGE_AVX512)
#include "avx512_common.h"
namespace level = topth_cpu::avx512_level;
#else
#include "avx2_common.h"
namespace level = topth_cpu::avx2_level;
#endif
#include "pv_visit.h"

using namespace topth_cpu;

namespace {

constexpr int64_t kRows = 8192;  // rows per item

// Sum of rows r[0, n) (row_bytes each, a multiple of 32) visited k * stride mod n.
__attribute__((noinline)) float read_rows(const uint8_t* const* r, int64_t n, int64_t row_bytes, int64_t stride) {
    __m256 a = _mm256_setzero_ps(), b = a;
    int64_t t = 0;
    for (int64_t k = 0; k < n; ++k) {
        const uint8_t* p = r[t];
        for (int64_t o = 0; o < row_bytes; o += 64) {
            a = _mm256_add_ps(a, _mm256_loadu_ps(reinterpret_cast<const float*>(p + o)));
            if (o + 32 < row_bytes) b = _mm256_add_ps(b, _mm256_loadu_ps(reinterpret_cast<const float*>(p + o + 32)));
        }
        t += stride;
        t -= t >= n ? n : 0;
    }
    alignas(32) float s[8];
    _mm256_store_ps(s, _mm256_add_ps(a, b));
    return s[0];
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// argv[i] as a whole number / a float in [lo, hi] (the default when absent); false if it is not
// one entirely or out of range.
bool arg_int(int argc, char** argv, int i, int64_t dflt, int64_t lo, int64_t hi, int64_t* out) {
    if (argc <= i) { *out = dflt; return true; }
    char* end = nullptr;
    errno = 0;
    const long long x = std::strtoll(argv[i], &end, 10);
    *out = x;
    return errno == 0 && end != argv[i] && *end == '\0' && x >= lo && x <= hi;
}

bool arg_float(int argc, char** argv, int i, double dflt, double lo, double hi, double* out) {
    if (argc <= i) { *out = dflt; return true; }
    char* end = nullptr;
    errno = 0;
    const double x = std::strtod(argv[i], &end);
    *out = x;
    return errno == 0 && end != argv[i] && *end == '\0' && x >= lo && x <= hi;
}

// Bytes of the last-level cache (sysfs; 0 when unknown).
int64_t llc_bytes() {
    for (int idx = 4; idx >= 0; --idx) {
        std::ifstream in("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(idx) + "/size");
        std::string size;
        if (!(in >> size) || size.empty()) continue;
        int64_t v = std::atoll(size.c_str());
        if (size.back() == 'K') v <<= 10;
        if (size.back() == 'M') v <<= 20;
        return v;
    }
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    int64_t G = 0, d = 0, mib = 0, rounds = 0;
    double f = 0.0;
    const bool ok = argc <= 6 && arg_int(argc, argv, 1, 4, 1, 16, &G) && arg_int(argc, argv, 2, 128, 32, 1024, &d) &&
                    d % 32 == 0 && arg_float(argc, argv, 3, 0.3, 1.0 / 1024, 0.999, &f) &&
                    arg_int(argc, argv, 4, 1024, 1, 65536, &mib) && arg_int(argc, argv, 5, 10, 2, 1000, &rounds);
    const int64_t row_bytes = d * 2, items = ok ? mib * (int64_t(1) << 20) / (kRows * row_bytes) : 0;
    if (!ok || items < 5) {
        std::fprintf(stderr, "usage: gather_cost [G 1-16] [head_dim 32-1024, a multiple of 32] [f in [1/1024, 0.999]] "
                             "[MiB 1-65536, at least five items of 8192 rows] [rounds 2-1000]\n");
        return 2;
    }
    const int64_t used = items * kRows * row_bytes, llc = llc_bytes();
    if (used < 4 * llc)
        std::fprintf(stderr, "note: %lld MiB of rows against a %lld MiB last-level cache: timed partly from cache, "
                             "not cold\n", static_cast<long long>(used >> 20), static_cast<long long>(llc >> 20));
    std::vector<uint8_t> buf;
    try {
        buf.resize(size_t(used + 64));
    } catch (const std::bad_alloc&) {
        std::fprintf(stderr, "gather_cost: cannot allocate %lld MiB\n", static_cast<long long>(used >> 20));
        return 1;
    }
    std::mt19937 rng(1);
    for (size_t i = 0; i + 1 < buf.size(); i += 2) {  // bfloat16 values of about 2^-7
        buf[i] = uint8_t(rng());
        buf[i + 1] = uint8_t(0x3c ^ (rng() & 0x81));
    }
    const uint8_t* base = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
    std::vector<const uint8_t*> all(size_t(items * kRows)), kept;
    std::vector<int64_t> first(static_cast<size_t>(items)), count(static_cast<size_t>(items));
    std::uniform_real_distribution<double> u(0.0, 1.0);
    for (int64_t it = 0; it < items; ++it) {
        first[size_t(it)] = int64_t(kept.size());
        for (int64_t j = 0; j < kRows; ++j) {
            all[size_t(it * kRows + j)] = base + (it * kRows + j) * row_bytes;
            if (u(rng) < f) kept.push_back(all[size_t(it * kRows + j)]);
        }
        count[size_t(it)] = int64_t(kept.size()) - first[size_t(it)];
    }
    std::vector<float> w(size_t(G) * (kRows + 16), 1.0f / kRows), acc(size_t(G) * d), tile(size_t(40) * d + 1024);
    const char* names[5] = {"pv all rows", "pv kept", "read all", "read kept asc", "read kept strided"};
    std::vector<double> ticks[5];
    std::vector<int64_t> order(static_cast<size_t>(items));
    for (int64_t i = 0; i < items; ++i) order[size_t(i)] = i;
    const int64_t per = std::min<int64_t>(16, items / 5);  // items per variant per round: none read twice in a round
    float sink = 0.0f;
    for (int r = 0; r < rounds + 1; ++r) {
        std::shuffle(order.begin(), order.end(), rng);
        int vorder[5] = {0, 1, 2, 3, 4};
        std::shuffle(vorder, vorder + 5, rng);
        for (int vi = 0; vi < 5; ++vi) {
            const int v = vorder[vi];
            const uint64_t t0 = __rdtsc();
            for (int64_t j = 0; j < per; ++j) {
                const int64_t it = order[size_t((vi * per + j) % items)];
                const bool every = v == 0 || v == 2;  // every row of the item, else its kept list
                const uint8_t* const* rows = every ? all.data() + it * kRows : kept.data() + first[size_t(it)];
                const int64_t n = every ? kRows : count[size_t(it)];
                if (n == 0) continue;
                switch (v) {
                    case 0: level::pv(rows, n, kBF16, 1, d, d, w.data(), kRows + 16, G, acc.data(), tile.data(), 0); break;
                    case 1:  // scattered as the kernel decides it (item.cpp): at most 3/4 of the range kept
                        level::pv(rows, n, kBF16, 1, d, d, w.data(), kRows + 16, G, acc.data(), tile.data(),
                                  4 * n <= 3 * kRows);
                        break;
                    case 2:
                    case 3: sink += read_rows(rows, n, row_bytes, 1); break;
                    default: sink += read_rows(rows, n, row_bytes, pv_visit::visit_stride(n)); break;
                }
            }
            if (r) ticks[v].push_back(double(__rdtsc() - t0) / double(per * kRows));  // round 0 warms up
        }
    }
    double med[5];
    for (int v = 0; v < 5; ++v) med[v] = median(ticks[v]);
    std::printf("G %lld, head_dim %lld, bf16, f %.2f, %lld items of %lld rows (%lld MiB), medians of %lld rounds\n",
                static_cast<long long>(G), static_cast<long long>(d), f, static_cast<long long>(items),
                static_cast<long long>(kRows), static_cast<long long>(used >> 20), static_cast<long long>(rounds));
    for (int v = 0; v < 5; ++v)
        std::printf("%-18s %7.2f ticks per item row  (%.2f of read all)\n", names[v], med[v], med[v] / med[2]);
    const double r_best = std::min(std::min(med[1], med[3]), med[4]) / med[2];
    std::printf("bound  byte ratio %.2fx, cheapest gather here %.2fx (speed-up over dense, K pass half of dense)\n",
                1.0 / (0.5 + 0.5 * f), 1.0 / (0.5 + 0.5 * r_best));
    if (sink == -1.0f) std::puts("");  // keeps the sums live
    return 0;
}
