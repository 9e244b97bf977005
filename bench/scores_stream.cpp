// The avx512bf16 scores stage alone over one long K stream, against a plain read of the same
// bytes in the same run: how close the stage comes to the read bandwidth when nothing else of
// the op runs between its calls (docs/cpu.md, "The K pass does not overlap with memory").
//
// A 1 GiB buffer of 128-byte rows (head_dim 64, bfloat16, 3 query heads per KV head, the
// SmolLM2 shape) is cut into items of N rows, scored in order (one call per item, like one
// work item of the op) or in a shuffled order (SHUF=1); with argument 1 a V buffer's item is
// read between two items (as the op's P.V does), its time not counted. Each repeat also reads
// the whole K buffer with plain loads (the probe). Median of five repeats.
//
//   g++ -O3 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mfma -mf16c
//       -Icpu_kernels/include -Icpu_kernels/src cpu_kernels/src/avx512_{scores,select,pv,kt}.cpp
//       cpu_kernels/src/avx512bf16_scores.cpp bench/scores_stream.cpp -o /tmp/scores_stream
//   (one command)
//   taskset -c 1 /tmp/scores_stream [0|1]      (NROWS=8192 rows per item by default)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "avx512_common.h"

using namespace topth_cpu;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

long read_all(const uint8_t* p, size_t bytes) {  // the probe: every line once, plain loads
    __m512i acc = _mm512_setzero_si512();
    for (size_t off = 0; off < bytes; off += 64) acc = _mm512_add_epi32(acc, _mm512_loadu_si512(p + off));
    return _mm512_reduce_add_epi32(acc);
}

}  // namespace

int main(int argc, char** argv) {
    const int64_t N = getenv("NROWS") ? atol(getenv("NROWS")) : 8192, rb = 128, G = 3, d = 64;
    const size_t bytes = size_t(1) << 30;
    const int64_t items = int64_t(bytes) / (N * rb);
    const bool with_v = argc > 1 && atoi(argv[1]) == 1, shuffle = getenv("SHUF") != nullptr;
    if (N < 16 || items < 2) {
        std::fprintf(stderr, "NROWS must be at least 16 and at most %lld\n", (long long)(bytes / rb / 2));
        return 2;
    }
    std::vector<uint8_t> k(bytes + 64, 0x3c), v(with_v ? bytes + 64 : 64, 0x3c);
    std::vector<const uint8_t*> ptr(static_cast<size_t>(N));
    std::vector<float> q(size_t(G * d), 0.01f), S(size_t(G * (N + 16))), tile(4096);
    std::vector<uint16_t> qraw(size_t(G * d), 0x3c23);
    std::vector<int64_t> order(static_cast<size_t>(items));
    std::vector<double> ts, ps;
    long sink = 0;
    for (int rep = 0; rep < 5; ++rep) {
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
            avx512bf16_level::scores(ptr.data(), N, kBF16, 1, int32_t(d), int32_t(d), q.data(), int32_t(G), S.data(),
                                     N + 16, tile.data(), qraw.data(), 1.0f);
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
    std::printf("items of %lld rows%s%s: scores %.2f ns/row, %.1f GB/s of K; probe %.1f GB/s; %.0f%% (%ld)\n",
                (long long)N, with_v ? ", V read between items" : "", shuffle ? ", shuffled" : "",
                ts[2] / double(items * N) * 1e9, double(bytes) / ts[2] / 1e9, double(bytes) / ps[2] / 1e9,
                100.0 * ps[2] / ts[2], sink & 1);
    return 0;
}
