// Time per row of each stage of a SIMD level (scores, select, P.V) on one item of N
// contiguous rows, dense (every row kept), in TSC ticks: warm (the item in L1/L2, best of
// many calls) and cold (C copies of the item rotated, so K and V come from DRAM; median of
// rounds). It tells how far each stage is from its FMA and load-port bounds and how much the
// memory stream adds (docs/cpu.md, "Where the time goes per stage"). Its cold mode does not
// predict the end-to-end effect of prefetch changes (twice it ranked variants the other way
// round from bench/cpu_cold.py: docs/cpu.md, "Software prefetch"). One source, two builds:
//
//   AVX2 level:
//   g++ -O3 -mavx2 -mfma -mf16c -Icpu_kernels/include -Icpu_kernels/src \
//       cpu_kernels/src/avx2_{scores,select,pv}.cpp bench/stage_cycles.cpp -o /tmp/stage_cycles
//   AVX-512 levels (bfloat16 scores by the avx512bf16 level's vdpbf16ps, the rest avx512):
//   g++ -O3 -DSTAGE_AVX512 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mfma -mf16c \
//       -Icpu_kernels/include -Icpu_kernels/src cpu_kernels/src/avx512_{scores,select,pv,kt}.cpp \
//       cpu_kernels/src/avx512bf16_{scores,kt}.cpp bench/stage_cycles.cpp -o /tmp/stage_cycles512
//
//   taskset -c 1 /tmp/stage_cycles [G] [head_dim] [dtype: 0 fp16, 1 bf16, 2 fp32] [N] [C]
//
// Defaults: G = 3, head_dim = 64, bf16, N = 2048 (warm), C = 64 copies of 8192 rows (cold).
#include <x86intrin.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#if defined(STAGE_AVX512)
#include "avx512_common.h"
namespace level = topth_cpu::avx512_level;
namespace score_level = topth_cpu::avx512bf16_level;
#else
#include "avx2_common.h"
namespace level = topth_cpu::avx2_level;
namespace score_level = topth_cpu::avx2_level;
#endif

using namespace topth_cpu;

namespace {

struct Item {
    int32_t G, d, dtype;
    int64_t N;
    std::vector<const uint8_t*> k, v;
    std::vector<uint16_t> qraw;  // the query as bfloat16 (used by the avx512bf16 scores only)
    std::vector<float> q, S, tile, w, acc, sub, cut, mref, R, D;
    std::vector<int32_t> idx;
    std::vector<uint8_t> flags;
    std::vector<int64_t> kc;
};

void setup(Item& it, int32_t G, int32_t d, int32_t dtype, int64_t N) {
    it.G = G; it.d = d; it.dtype = dtype; it.N = N;
    it.q.assign(size_t(G) * d, 0.01f);
    it.qraw.assign(size_t(G) * d, 0x3c23);  // 0.01 in bfloat16 (truncated)
    it.S.assign(size_t(G) * (N + 16), 0.0f);
    it.tile.assign(size_t(40) * d + 1024, 0.0f);
    it.w.assign(size_t(G) * (N + 16), 0.001f);
    it.acc.assign(size_t(G) * d, 0.0f);
    it.sub.assign(G, 0.0f);
    it.cut.assign(G, -INFINITY);
    it.mref.assign(G, 1.0f);
    it.R.assign(G, 0.0f);
    it.D.assign(G, 0.0f);
    it.idx.assign(N + 16, 0);
    it.flags.assign(N + 16, 0);
    it.kc.assign(G, 0);
}

// Ticks of the three stages over rows k[0, N), v[0, N).
void run(Item& it, const uint8_t* const* k, const uint8_t* const* v, uint64_t t[3]) {
    const int64_t N = it.N, ld = N + 16;
    const uint64_t t0 = __rdtsc();
    score_level::scores(k, N, it.dtype, 1, it.d, it.d, it.q.data(), it.G, it.S.data(), ld, it.tile.data(),
                        it.qraw.data(), 1.0f);
    const uint64_t t1 = __rdtsc();
    SelectArgs a;
    a.S = it.S.data(); a.ldS = ld; a.G = it.G; a.len = N;
    a.sub1 = it.sub.data(); a.sub2 = it.sub.data(); a.cut = it.cut.data(); a.group = 1; a.mref = it.mref.data();
    a.idx = it.idx.data(); a.wk = it.w.data(); a.ldw = ld; a.flags = it.flags.data();
    a.R = it.R.data(); a.dropped = it.D.data(); a.kcount = it.kc.data();
    level::select(a);
    const uint64_t t2 = __rdtsc();
    level::pv(v, N, it.dtype, 1, it.d, it.d, it.w.data(), ld, it.G, it.acc.data(), it.tile.data(), 0);
    const uint64_t t3 = __rdtsc();
    t[0] = t1 - t0; t[1] = t2 - t1; t[2] = t3 - t2;
}

// C copies of N rows of K and of V, random finite values.
std::vector<uint8_t> rows(int64_t N, int C, int64_t row_bytes, unsigned seed, std::vector<const uint8_t*>& ptr) {
    std::vector<uint8_t> buf(size_t(N) * C * row_bytes + 64);
    srand(seed);
    for (size_t i = 0; i + 1 < buf.size(); i += 2) {  // 16-bit values: ~1 as fp16, ~2^-7 as bf16 (fp32: pairs)
        const uint16_t x = uint16_t(0x3c00 ^ (rand() & 0x80ff));
        buf[i] = uint8_t(x); buf[i + 1] = uint8_t(x >> 8);
    }
    const size_t a = (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
    ptr.resize(size_t(N) * C);
    for (int64_t i = 0; i < N * C; ++i) ptr[size_t(i)] = buf.data() + a + i * row_bytes;
    return buf;
}

void print(const char* what, const double t[3], int64_t row_bytes) {
    const double tot = t[0] + t[1] + t[2];
    std::printf("%-5s scores %6.1f  select %5.1f  pv %6.1f  total %6.1f ticks/row  (%.2f bytes of K+V per tick)\n",
                what, t[0], t[1], t[2], tot, 2.0 * row_bytes / tot);
}

}  // namespace

int main(int argc, char** argv) {
    const int32_t G = argc > 1 ? atoi(argv[1]) : 3, d = argc > 2 ? atoi(argv[2]) : 64;
    const int32_t dtype = argc > 3 ? atoi(argv[3]) : kBF16;
    const int64_t Nw = argc > 4 ? atol(argv[4]) : 2048;
    const int C = argc > 5 ? atoi(argv[5]) : 64;
    if (G < 1 || G > 16 || d < 16 || d % 16 || dtype < 0 || dtype > 2 || Nw < 1 || C < 1) {
        std::fprintf(stderr, "usage: stage_cycles [G 1-16] [head_dim, a multiple of 16] [dtype 0-2] [N] [C]\n");
        return 2;
    }
    const int64_t es = dtype == kF32 ? 4 : 2, rb = d * es;
    std::printf("G %d, head_dim %d, dtype %s\n", G, d, dtype == kF32 ? "fp32" : dtype == kF16 ? "fp16" : "bf16");
    {   // warm: best of 2000 calls per stage
        Item it;
        setup(it, G, d, dtype, Nw);
        std::vector<const uint8_t*> k, v;
        auto kb = rows(Nw, 1, rb, 1, k), vb = rows(Nw, 1, rb, 2, v);
        double best[3] = {1e300, 1e300, 1e300};
        for (int r = 0; r < 2000; ++r) {
            uint64_t t[3];
            run(it, k.data(), v.data(), t);
            for (int s = 0; s < 3; ++s) best[s] = std::min(best[s], double(t[s]) / Nw);
        }
        print("warm", best, rb);
    }
    {   // cold: C copies of 8192 rows rotated; median over rounds of 8 items
        const int64_t N = 8192;
        Item it;
        setup(it, G, d, dtype, N);
        std::vector<const uint8_t*> k, v;
        auto kb = rows(N, C, rb, 3, k), vb = rows(N, C, rb, 4, v);
        std::vector<double> per[3];
        int c = 0;
        for (int r = 0; r < 25; ++r) {
            double sum[3] = {0, 0, 0};
            for (int i = 0; i < 8; ++i, c = (c + 1) % C) {
                uint64_t t[3];
                run(it, k.data() + size_t(c) * N, v.data() + size_t(c) * N, t);
                for (int s = 0; s < 3; ++s) sum[s] += double(t[s]) / (8.0 * N);
            }
            if (r)
                for (int s = 0; s < 3; ++s) per[s].push_back(sum[s]);
        }
        double med[3];
        for (int s = 0; s < 3; ++s) {
            std::sort(per[s].begin(), per[s].end());
            med[s] = per[s][per[s].size() / 2];
        }
        print("cold", med, rb);
    }
    return 0;
}
