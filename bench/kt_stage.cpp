// The avx2 level's transposed-K scores stage (vLLM's vector-ISA cache: per block and KV head
// K as [head_dim][block_size]) against the row scores stage on the same bytes read as rows
// (BNSD) and a plain read of them, in TSC ticks per slot (docs/cpu.md, "The AVX2 transposed-K
// stage").
// Warm: 1024 slots, best of 3000 calls. Cold: copies of 8192 slots (blocks of 128 in order, as
// one work item reads them) rotated over 1 GiB, median of 30 rounds of 8 items (a first round
// is not counted), the three variants interleaved. The first line checks the transposed stage
// against a float64 dot product over the 64 whole blocks of one item (the op's tests cover
// tails and partial blocks); the program exits with 1 when that error exceeds 1e-4.
//
//   g++ -O3 -mavx2 -mfma -mf16c -Icpu_kernels/include -Icpu_kernels/src \
//       cpu_kernels/src/avx2_{scores,select,pv}.cpp bench/kt_stage.cpp -o /tmp/kt_stage
//   taskset -c 1 /tmp/kt_stage [G] [head_dim, a multiple of 16] [dtype: 0 fp16, 1 bf16, 2 fp32]
#include <x86intrin.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "avx2_common.h"

using namespace topth_cpu;

namespace {

__m256 g_sink;

}  // namespace

int main(int argc, char** argv) {
    const int32_t G = argc > 1 ? atoi(argv[1]) : 3, d = argc > 2 ? atoi(argv[2]) : 64;
    const int32_t dtype = argc > 3 ? atoi(argv[3]) : kBF16;
    if (G < 1 || G > 16 || d < 16 || d % 16 || dtype < 0 || dtype > 2) {
        std::fprintf(stderr, "usage: kt_stage [G 1-16] [head_dim, a multiple of 16] [dtype 0-2]\n");
        return 2;
    }
    const int64_t bs = 128, es = dtype == kF32 ? 4 : 2, block_bytes = bs * d * es;
    const int64_t Nw = 1024, Nc = 8192, item_bytes = Nc * d * es, copies = (int64_t(1) << 30) / item_bytes;
    std::vector<uint8_t> buf(size_t(copies * item_bytes) + 64);
    srand(1);
    for (size_t i = 0; i + 1 < buf.size(); i += 2) {  // 16-bit values ~1 as fp16, ~2^-7 as bf16 (fp32: pairs)
        const uint16_t x = uint16_t(0x3c00 ^ (rand() & 0x80ff));
        buf[i] = uint8_t(x);
        buf[i + 1] = uint8_t(x >> 8);
    }
    uint8_t* base = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
    const int64_t ldS = Nc + 64;
    std::vector<float> q(size_t(G) * d), St(size_t(G) * ldS), Sr(size_t(G) * ldS), tile(size_t(40) * d + 1024);
    for (auto& x : q) x = float(rand() % 1000) / 1000.0f - 0.5f;
    std::vector<const uint8_t*> rows(Nc);
    // variant 0: transposed blocks (one stage call per block, told where the next one is);
    // 1: the same bytes as rows of head_dim elements; 2: a plain read
    auto run = [&](int v, const uint8_t* item, int64_t N) {
        if (v == 0) {
            for (int64_t b = 0; b * bs < N; ++b) {
                const uint8_t* k = item + b * block_bytes;
                const int64_t n = std::min(bs, N - b * bs), next_n = std::min(bs, N - (b + 1) * bs);
                avx2_level::scores_kt(k, n, bs * es, dtype, d, d, q.data(), G, St.data() + b * bs, ldS,
                                      next_n > 0 ? k + block_bytes : nullptr, next_n > 0 ? next_n : 0, nullptr,
                                      1.0f);
            }
        } else if (v == 1) {
            for (int64_t t = 0; t < N; ++t) rows[size_t(t)] = item + t * d * es;
            avx2_level::scores(rows.data(), N, dtype, 1, d, d, q.data(), G, Sr.data(), ldS, tile.data(), nullptr,
                               1.0f);
        } else {
            __m256 a = _mm256_setzero_ps();
            const float* f = reinterpret_cast<const float*>(item);
            for (int64_t i = 0; i < N * d * es / 4; i += 8) a = _mm256_add_ps(a, _mm256_load_ps(f + i));
            g_sink = _mm256_add_ps(g_sink, a);
        }
    };
    // the transposed stage against a plain float64 dot product of the same block layout
    run(0, base, Nc);
    double worst = 0;
    for (int32_t h = 0; h < G; ++h)
        for (int64_t t = 0; t < Nc; ++t) {
            const uint8_t* blk = base + (t / bs) * block_bytes;
            double ref = 0;
            for (int32_t i = 0; i < d; ++i)
                ref += double(q[size_t(h) * d + i]) * double(avx2_level::load1(blk + (i * bs + t % bs) * es, dtype));
            worst = std::max(worst, std::fabs(ref - double(St[size_t(h) * ldS + t])) / (1.0 + std::fabs(ref)));
        }
    std::printf("G %d, head_dim %d, dtype %s; transposed stage vs float64: worst relative error %.2e\n", G, d,
                dtype == kF32 ? "fp32" : dtype == kF16 ? "fp16" : "bf16", worst);
    if (!(worst <= 1e-4)) return 1;
    const char* names[3] = {"transposed K", "rows (BNSD)", "plain read"};
    for (int v = 0; v < 3; ++v) {
        double best = 1e300;
        for (int r = 0; r < 3000; ++r) {
            const uint64_t t0 = __rdtsc();
            run(v, base, Nw);
            best = std::min(best, double(__rdtsc() - t0) / double(Nw));
        }
        std::printf("warm %-13s %7.2f ticks/slot\n", names[v], best);
    }
    std::vector<double> per[3];
    int64_t c = 0;
    for (int r = 0; r < 31; ++r)
        for (int v = 0; v < 3; ++v) {
            const uint64_t t0 = __rdtsc();
            for (int i = 0; i < 8; ++i, c = (c + 1) % copies) run(v, base + c * item_bytes, Nc);
            if (r) per[v].push_back(double(__rdtsc() - t0) / (8.0 * double(Nc)));
        }
    for (int v = 0; v < 3; ++v) {
        std::sort(per[v].begin(), per[v].end());
        const double med = per[v][per[v].size() / 2];
        std::printf("cold %-13s %7.2f ticks/slot, %5.2f bytes per tick\n", names[v], med, double(d * es) / med);
    }
    return 0;
}
