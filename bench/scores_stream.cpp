// The scores stage of a SIMD level alone over one long K stream, against a plain read of the
// same bytes in the same run: how close the stage comes to the read bandwidth when nothing else
// of the op runs between its calls (docs/cpu.md, "The K pass does not overlap with memory").
//
// A buffer of 128-byte rows (head_dim 64, bfloat16, 3 query heads per KV head, the SmolLM2
// shape; 1 GiB, or MB=<MiB>) is cut into items of N rows, scored in order (one call per item,
// like one work item of the op) or in a shuffled order (SHUF=1); with argument 1 a V buffer's
// item is read between two items (as the op's P.V does), its time not counted. PF=1 swaps the
// last two rows of each item, so the stage does not take the item for one contiguous run: the
// avx512bf16 level then issues its software prefetches (none for a run), the avx2 level both
// distances (only the next tile for a run). Each repeat also reads the whole K buffer with
// plain loads (the probe). Median of REPS repeats (default 5).
//
//   avx512bf16 level:
//   g++ -O3 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mfma -mf16c
//       -Icpu_kernels/include -Icpu_kernels/src cpu_kernels/src/avx512_{scores,select,pv,kt}.cpp
//       cpu_kernels/src/avx512bf16_{scores,kt}.cpp bench/scores_stream.cpp -o /tmp/scores_stream
//   avx2 level:
//   g++ -O3 -DSTREAM_AVX2 -mavx2 -mfma -mf16c -Icpu_kernels/include -Icpu_kernels/src
//       cpu_kernels/src/avx2_{scores,select,pv}.cpp bench/scores_stream.cpp -o /tmp/scores_stream2
//   (one command each)
//   taskset -c 1 /tmp/scores_stream [0|1]      (NROWS=8192 rows per item by default)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#if defined(STREAM_AVX2)
#include "avx2_common.h"
#else
#include "avx512_common.h"
#endif

using namespace topth_cpu;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

long read_all(const uint8_t* p, size_t bytes) {  // the probe: every line once, plain loads
#if defined(STREAM_AVX2)
    __m256i acc = _mm256_setzero_si256();
    for (size_t off = 0; off < bytes; off += 64) {
        acc = _mm256_add_epi32(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + off)));
        acc = _mm256_add_epi32(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + off + 32)));
    }
    return _mm256_extract_epi32(acc, 0) + _mm256_extract_epi32(acc, 7);
#else
    __m512i acc = _mm512_setzero_si512();
    for (size_t off = 0; off < bytes; off += 64) acc = _mm512_add_epi32(acc, _mm512_loadu_si512(p + off));
    return _mm512_reduce_add_epi32(acc);
#endif
}

void score_item(const uint8_t* const* rows, int64_t n, int32_t d, int32_t G, const float* q, float* S,
                float* tile, const uint16_t* qraw) {
#if defined(STREAM_AVX2)
    avx2_level::scores(rows, n, kBF16, 1, d, d, q, G, S, n + 16, tile, qraw, 1.0f);
#else
    avx512bf16_level::scores(rows, n, kBF16, 1, d, d, q, G, S, n + 16, tile, qraw, 1.0f);
#endif
}

}  // namespace

int main(int argc, char** argv) {
    const int64_t N = getenv("NROWS") ? atol(getenv("NROWS")) : 8192, rb = 128, G = 3, d = 64;
    const size_t bytes = getenv("MB") ? size_t(atol(getenv("MB"))) << 20 : size_t(1) << 30;
    const int reps = getenv("REPS") ? atoi(getenv("REPS")) : 5;
    const int64_t items = int64_t(bytes) / (N * rb);
    const bool with_v = argc > 1 && atoi(argv[1]) == 1, shuffle = getenv("SHUF") != nullptr;
    const bool prefetch = getenv("PF") != nullptr;
    if (N < 16 || items < 2 || reps < 1) {
        std::fprintf(stderr, "NROWS must be at least 16 and at most %lld (MB=%zu), REPS at least 1\n",
                     (long long)(bytes / rb / 2), bytes >> 20);
        return 2;
    }
    std::vector<uint8_t> k(bytes + 64, 0x3c), v(with_v ? bytes + 64 : 64, 0x3c);
    std::vector<const uint8_t*> ptr(static_cast<size_t>(N));
    std::vector<float> q(size_t(G * d), 0.01f), S(size_t(G * (N + 16))), tile(4096);
    std::vector<uint16_t> qraw(size_t(G * d), 0x3c23);
    std::vector<int64_t> order(static_cast<size_t>(items));
    std::vector<double> ts, ps;
    long sink = 0;
    for (int rep = 0; rep < reps; ++rep) {
        for (int64_t i = 0; i < items; ++i) order[size_t(i)] = i;
        if (shuffle) {
            srand(unsigned(rep));
            for (int64_t i = items - 1; i > 0; --i) std::swap(order[size_t(i)], order[size_t(rand() % (i + 1))]);
        }
        double v_time = 0;
        const auto t0 = Clock::now();
        for (int64_t i : order) {
            const uint8_t* base = k.data() + i * N * rb;
            for (int64_t t = 0; t < N; ++t) ptr[size_t(t)] = base + t * rb;
            if (prefetch) std::swap(ptr[size_t(N - 1)], ptr[size_t(N - 2)]);
            score_item(ptr.data(), N, int32_t(d), int32_t(G), q.data(), S.data(), tile.data(), qraw.data());
            if (with_v) {
                const auto tv = Clock::now();
                sink += read_all(v.data() + i * N * rb, size_t(N * rb));
                v_time += seconds_since(tv);
            }
        }
        ts.push_back(seconds_since(t0) - v_time);
        const auto tp = Clock::now();
        sink += read_all(k.data(), bytes);
        ps.push_back(seconds_since(tp));
    }
    std::sort(ts.begin(), ts.end());
    std::sort(ps.begin(), ps.end());
    const double t_med = ts[ts.size() / 2], p_med = ps[ps.size() / 2];
    std::printf("items of %lld rows%s%s%s: scores %.2f ns/row, %.1f GB/s of K; probe %.1f GB/s; %.0f%% (%ld)\n",
                (long long)N, with_v ? ", V read between items" : "", shuffle ? ", shuffled" : "",
                prefetch ? ", prefetched" : "", t_med / double(items * N) * 1e9, double(bytes) / t_med / 1e9,
                double(bytes) / p_med / 1e9, 100.0 * p_med / t_med, sink & 1);
    return 0;
}
