// Read bandwidth of one thread over a 1 GiB buffer laid out as a paged NHD cache: slots of H
// KV heads x R bytes (one row per head), read as the kernel reads it, one KV head at a time
// over a unit of 256 slots (the interleaved-heads units of dispatch.cpp), against other orders
// of the same bytes:
//   contiguous     every row in address order (what a BNSD cache of the same bytes gives)
//   per head       head 0's rows of the unit (R bytes every H * R), then head 1's, ...; without
//                  software prefetch, with the kernel's (the same head's row 48 rows ahead,
//                  prefetcht1, one line per line loaded; or prefetcht0), or with a walker that
//                  prefetches the next unit slot by slot (all heads of a slot together)
//   tiles          per tile of 16 slots, each head's 16 rows in turn (what a stage that served
//                  every KV head of a slot range in one call would read), without prefetch or
//                  with the same head's row 32 or 16 slots ahead
// with W groups of 3 FMAs per 64-byte line of arithmetic between the loads (W = 0: a plain
// sum). docs/cpu.md, "Paged NHD: the order of the reads".
//
//   g++ -O3 -mavx512f -o /tmp/read_strided bench/read_strided.cpp && taskset -c 1 /tmp/read_strided [R H [random]]
//
// "random": blocks of 32 slots in a shuffled order, as in a paged cache (the contiguous column
// stays in address order).
// GB/s, median of 5 passes over the whole buffer (cold: 1 GiB exceeds the LLC).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

constexpr size_t kBytes = size_t(1) << 30, kUnit = 256;
size_t g_row = 256, g_heads = 8;
std::vector<size_t> g_block;  // "random": slot s lies in block g_block[s / 32] (a paged cache's table)

inline size_t at(size_t s) { return g_block.empty() ? s : g_block[s / 32] * 32 + s % 32; }

enum Mode { kContig, kHeadNoPf, kHeadPf, kHeadPf0, kHeadWalk, kTileNoPf, kTilePf };

inline void pf1(const char* p) { asm volatile("prefetcht1 %0" : : "m"(*p)); }
inline void pf0(const char* p) { asm volatile("prefetcht0 %0" : : "m"(*p)); }

template <int MODE, int W>
__attribute__((noipa)) float pass(const char* buf, size_t far) {
    const size_t R = g_row, H = g_heads, slot = R * H, slots = kBytes / slot, lines = R / 64;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const __m512 m = _mm512_set1_ps(0.5f);
    auto eat = [&](const char* r, const char* p) {
        for (size_t l = 0; l < lines; ++l) {
            if (p) {
                if (MODE == kHeadPf0) pf0(p + 64 * l);
                else pf1(p + 64 * l);
            }
            const __m512 v = _mm512_loadu_ps(reinterpret_cast<const float*>(r + 64 * l));
            a0 = _mm512_add_ps(a0, v);
            for (int w = 0; w < W; ++w) {
                a1 = _mm512_fmadd_ps(a1, m, v); a2 = _mm512_fmadd_ps(a2, m, v); a3 = _mm512_fmadd_ps(a3, m, v);
                asm volatile("" : "+v"(a1), "+v"(a2), "+v"(a3));
            }
            asm volatile("" : "+v"(a0));
        }
    };
    for (size_t u0 = 0; u0 + kUnit <= slots; u0 += kUnit) {
        if (MODE == kContig) {
            const char* base = buf + u0 * slot;
            for (size_t r = 0; r < kUnit * H; ++r) eat(base + r * R, nullptr);
        } else if (MODE == kTileNoPf || MODE == kTilePf) {
            for (size_t s0 = u0; s0 < u0 + kUnit; s0 += 16)
                for (size_t h = 0; h < H; ++h)
                    for (size_t s = s0; s < s0 + 16; ++s)
                        eat(buf + at(s) * slot + h * R,
                            MODE == kTilePf && s + far < slots ? buf + at(s + far) * slot + h * R : nullptr);
        } else {
            for (size_t h = 0; h < H; ++h)
                for (size_t s = u0; s < u0 + kUnit; ++s) {
                    const char* p = nullptr;
                    if (MODE == kHeadPf || MODE == kHeadPf0) {
                        // the same head's row `far` ahead; past the unit, the next head's first rows
                        const size_t t = s + far;
                        if (t < u0 + kUnit) p = buf + at(t) * slot + h * R;
                        else if (h + 1 < H) p = buf + at(t - kUnit) * slot + (h + 1) * R;
                        else if (t < slots) p = buf + at(t) * slot;
                    } else if (MODE == kHeadWalk) {
                        // the next unit, slot-major: every head of a slot, then the next slot
                        const size_t w = h * kUnit + (s - u0), ts = u0 + kUnit + w / H;
                        if (ts < slots) p = buf + at(ts) * slot + (w % H) * R;
                    }
                    eat(buf + at(s) * slot + h * R, p);
                }
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

template <int MODE, int W>
double gbs(const char* buf, size_t far) {
    std::vector<double> ts;
    volatile float sink = 0;
    for (int i = 0; i < 5; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        sink = sink + pass<MODE, W>(buf, far);
        ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ts.begin(), ts.end());
    const size_t used = kBytes / (g_row * g_heads) / kUnit * kUnit * g_row * g_heads;
    return double(used) / ts[2] / 1e9;
}

template <int W>
void line() {
    static char* buf = nullptr;
    if (!buf) {
        buf = static_cast<char*>(aligned_alloc(4096, kBytes));
        for (size_t i = 0; i < kBytes; i += 4) *reinterpret_cast<float*>(buf + i) = 1.0f;
    }
    printf("| %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |\n", W, gbs<kContig, W>(buf, 0),
           gbs<kHeadNoPf, W>(buf, 0), gbs<kHeadPf, W>(buf, 48), gbs<kHeadPf0, W>(buf, 48), gbs<kHeadWalk, W>(buf, 0),
           gbs<kTileNoPf, W>(buf, 0), gbs<kTilePf, W>(buf, 32), gbs<kTilePf, W>(buf, 16));
}

}  // namespace

int main(int argc, char** argv) {
    if (argc >= 3) {
        g_row = size_t(std::atol(argv[1]));
        g_heads = size_t(std::atol(argv[2]));
    }
    if (g_row < 64 || g_row % 64 || g_heads < 1) {
        fprintf(stderr, "R must be a multiple of 64 bytes, H >= 1\n");
        return 1;
    }
    if (argc >= 4) {
        const size_t blocks = kBytes / (g_row * g_heads) / 32;
        g_block.resize(blocks);
        for (size_t i = 0; i < blocks; ++i) g_block[i] = i;
        srand(1);
        for (size_t i = blocks - 1; i > 0; --i) std::swap(g_block[i], g_block[size_t(rand()) % (i + 1)]);
        printf("blocks of 32 slots in random order\n");
    }
    printf("rows of %zu bytes, %zu KV heads per slot (slot %zu bytes), units of %zu slots; GB/s\n", g_row, g_heads,
           g_row * g_heads, kUnit);
    printf("| W | contiguous | per head, no prefetch | per head, prefetcht1 48 ahead | per head, prefetcht0 48 ahead | "
           "per head, slot-major walker | tiles, no prefetch | tiles, prefetch 32 ahead | tiles, prefetch 16 ahead |\n");
    printf("|---|---|---|---|---|---|---|---|---|\n");
    for (int rep = 0; rep < 2; ++rep) {
        line<0>();
        line<3>();
    }
    return 0;
}
