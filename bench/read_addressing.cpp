// Read bandwidth of one thread streaming a 1 GiB buffer as 128-byte rows (a BNSD K or V cache of
// head_dim 64 in 16 bits), 8192 rows per call, by how the loads are addressed:
//   base    each 16-row tile from one base pointer: row t at base + t * 128 (RowRun in the kernel)
//   ptrs    every row through its own pointer, loaded from a list (RowPtrs in the kernel)
// each with and without the kernel's software prefetch (every row 96 rows ahead into L2, through
// the list), and with W groups of 7 FMAs per 64-byte line of arithmetic between the loads (W = 0:
// a plain sum). It tells whether the memory stream and the arithmetic overlap, and what the
// addressing and the prefetch cost (docs/cpu.md, "Row addressing").
//
//   g++ -O3 -mavx512f -o /tmp/read_addressing bench/read_addressing.cpp && taskset -c 1 /tmp/read_addressing
//
// Median of 5 passes per line; "warm" reads the same 1 MiB every call (L2), "cold" walks the
// whole buffer (DRAM).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

constexpr size_t kBytes = size_t(1) << 30, kRow = 128, kRows = 8192, kFar = 96;

template <int W, bool BASE, bool PF>
__attribute__((noipa)) float call(const char* const* p) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const __m512 m = _mm512_set1_ps(0.5f);
    for (size_t j = 0; j < kRows; j += 16) {
        if (PF)
            for (size_t t = j + kFar; t < kRows && t < j + kFar + 16; ++t) {
                asm volatile("prefetcht1 %0" : : "m"(*p[t]));
                asm volatile("prefetcht1 %0" : : "m"(*(p[t] + 64)));
            }
        const char* b = p[j];
#pragma GCC unroll 16
        for (size_t t = 0; t < 16; ++t) {
            const char* r = BASE ? b + t * kRow : p[j + t];
#pragma GCC unroll 2
            for (int l = 0; l < 2; ++l) {
                const __m512 v = _mm512_loadu_ps(reinterpret_cast<const float*>(r + 64 * l));
                a0 = _mm512_add_ps(a0, v);
                asm volatile("" : "+v"(a0));
#pragma GCC unroll 8
                for (int w = 0; w < W; ++w) {
                    a1 = _mm512_fmadd_ps(a1, m, v); a2 = _mm512_fmadd_ps(a2, m, v); a3 = _mm512_fmadd_ps(a3, m, v);
                    a4 = _mm512_fmadd_ps(a4, m, v); a5 = _mm512_fmadd_ps(a5, m, v); a6 = _mm512_fmadd_ps(a6, m, v);
                    a7 = _mm512_fmadd_ps(a7, m, v);
                    asm volatile("" : "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7));
                }
            }
        }
    }
    const __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                                   _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
    return _mm512_reduce_add_ps(s);
}

template <int W, bool BASE, bool PF>
void line(const char* buf, bool warm, float* sink) {
    std::vector<const char*> p(kRows);
    std::vector<double> t;
    for (int rep = 0; rep < 5; ++rep) {
        double s = 0;
        for (size_t o = 0; o < kBytes; o += kRows * kRow) {
            for (size_t j = 0; j < kRows; ++j) p[j] = buf + (warm ? 0 : o) + j * kRow;
            const auto a = std::chrono::steady_clock::now();
            *sink += call<W, BASE, PF>(p.data());
            s += std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
        }
        t.push_back(s);
    }
    std::sort(t.begin(), t.end());
    std::printf("%-4s W %d  %-4s %-7s %6.2f GB/s  %5.2f ns/row\n", warm ? "warm" : "cold", W, BASE ? "base" : "ptrs",
                PF ? "prefetch" : "none", kBytes / t[2] / 1e9, t[2] / (kBytes / kRow) * 1e9);
}

}  // namespace

int main() {
    char* buf = static_cast<char*>(std::aligned_alloc(4096, kBytes));
    for (size_t i = 0; i < kBytes / 4; ++i) reinterpret_cast<float*>(buf)[i] = 1e-3f * float(i % 7);
    float sink = 0;
    for (int warm = 1; warm >= 0; --warm) {
        line<0, true, false>(buf, warm, &sink); line<0, false, false>(buf, warm, &sink);
        line<0, true, true>(buf, warm, &sink); line<0, false, true>(buf, warm, &sink);
        line<1, true, false>(buf, warm, &sink); line<1, false, false>(buf, warm, &sink);
        line<1, true, true>(buf, warm, &sink); line<1, false, true>(buf, warm, &sink);
        line<2, true, false>(buf, warm, &sink); line<2, false, false>(buf, warm, &sink);
        line<2, true, true>(buf, warm, &sink); line<2, false, true>(buf, warm, &sink);
    }
    std::printf("(checksum %g)\n", sink);
    std::free(buf);
    return 0;
}
