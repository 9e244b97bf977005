// Read bandwidth of a 1 GiB buffer read as runs of R contiguous bytes (a paged KV cache's
// blocks), in order, in random order, several random runs at once, and one run at a time
// with the next run software-prefetched. It measures what the machine gives a paged layout
// before any attention kernel runs (docs/cpu.md, "Paged blocks and the memory system").
//
//   g++ -O2 -mavx2 -o /tmp/read_runs bench/read_runs.cpp && /tmp/read_runs
//
// One thread; best of 3 passes per line (the buffer is 1 GiB, so every pass reads from DRAM).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr size_t kBytes = size_t(1) << 30;

// Sums the runs order[i] of `run` bytes, `streams` runs side by side (64 bytes of each in
// turn); with `prefetch`, each run's lines are prefetched into L2 while the previous one is read.
double pass(const uint8_t* buf, const std::vector<size_t>& order, size_t run, int streams, bool prefetch) {
    const auto t0 = std::chrono::steady_clock::now();
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    const size_t n = order.size();
    for (size_t i = 0; i + size_t(streams) <= n; i += size_t(streams)) {
        const float* p[4];
        for (int k = 0; k < streams; ++k) p[k] = reinterpret_cast<const float*>(buf + order[i + size_t(k)] * run);
        const uint8_t* next = prefetch && i + 1 < n ? buf + order[i + 1] * run : nullptr;
        for (size_t o = 0; o < run / 4; o += 16) {
            if (next) _mm_prefetch(reinterpret_cast<const char*>(next + 4 * o), _MM_HINT_T1);
            for (int k = 0; k < streams; ++k) {
                a0 = _mm256_add_ps(a0, _mm256_load_ps(p[k] + o));
                a1 = _mm256_add_ps(a1, _mm256_load_ps(p[k] + o + 8));
            }
        }
    }
    alignas(32) float s[8];
    _mm256_store_ps(s, _mm256_add_ps(a0, a1));
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s[0] == -1.0f) std::puts("");  // keeps the sum live
    return dt;
}

double best_gbs(const uint8_t* buf, const std::vector<size_t>& order, size_t run, int streams, bool prefetch) {
    double best = 1e30;
    for (int rep = 0; rep < 3; ++rep) best = std::min(best, pass(buf, order, run, streams, prefetch));
    return double(kBytes) / best / 1e9;
}

}  // namespace

int main() {
    auto* buf = static_cast<uint8_t*>(std::aligned_alloc(4096, kBytes));
    std::memset(buf, 1, kBytes);
    std::mt19937 rng(1);
    std::vector<size_t> whole(1, 0);
    std::printf("sequential (one run of 1 GiB): %.1f GB/s\n", best_gbs(buf, whole, kBytes, 1, false));
    std::printf("%10s %12s %12s %12s %12s %12s\n", "run bytes", "in order", "random", "random x2", "random x4",
                "random+pf");
    for (size_t run : {size_t(4096), size_t(16384), size_t(65536), size_t(1) << 20}) {
        std::vector<size_t> order(kBytes / run);
        for (size_t i = 0; i < order.size(); ++i) order[i] = i;
        const double seq = best_gbs(buf, order, run, 1, false);
        std::shuffle(order.begin(), order.end(), rng);
        std::printf("%10zu %12.1f %12.1f %12.1f %12.1f %12.1f\n", run, seq, best_gbs(buf, order, run, 1, false),
                    best_gbs(buf, order, run, 2, false), best_gbs(buf, order, run, 4, false),
                    best_gbs(buf, order, run, 1, true));
    }
    std::free(buf);
    return 0;
}
