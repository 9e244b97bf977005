// AVX-512 level, stage 1 for K stored transposed per block (vLLM's vector-ISA CPU cache,
// docs/semantics.md): element i of slot t at byte k + i * dstride + t * elem_size. The slots
// of a block segment are contiguous, so the scores of 16 slots accumulate lane-parallel, one
// broadcast query element per FMA, with no horizontal reduction; each K element is loaded
// once for HB heads. Loads are masked to the segment (nothing past its last slot is read).
// The next segment (the next block of the sequence) is prefetched into L2 while this one is
// read, one row of a chunk's lines per iteration: the hardware prefetchers do not follow the
// row-strided walk, and a burst of prefetches at the start of a chunk would leave most of the
// walk unhidden (docs/cpu.md, "K stored transposed").
// bfloat16 on the avx512bf16 and amx levels: avx512bf16_kt.cpp (vdpbf16ps on pairs of rows).
// Compiled with the AVX-512 flags (setup.py), one of the avx512_*.cpp files.
#include "avx512_common.h"

namespace topth_cpu {
namespace avx512_level {
namespace {

inline __mmask16 lanes(int64_t n) { return n <= 0 ? __mmask16(0) : tail_mask(n); }

// Slots [0, 16 W) of the segment at k (masks m[w]) for heads h0 .. h0 + HB: S rows h0 ...
// pf (may be null): pf_lines lines of the next segment per row, prefetched one row per
// iteration so that the requests are spread over the reads they hide behind.
template <int HB, int W>
inline void chunk(const uint8_t* k, int64_t dstride, int32_t dtype, int64_t es, int32_t d, const float* q,
                  int32_t dpad, const __mmask16 (&m)[4], float* S, int64_t ldS, const uint8_t* pf, int pf_lines) {
    __m512 acc[HB][W];
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 4
        for (int w = 0; w < W; ++w) acc[h][w] = _mm512_setzero_ps();
    for (int32_t i = 0; i < d; ++i) {
        const uint8_t* p = k + i * dstride;
        if (pf)
            for (int l = 0; l < pf_lines; ++l)
                prefetch_l2(pf + i * dstride + 64 * l);
        __m512 kv[W];
#pragma GCC unroll 4
        for (int w = 0; w < W; ++w) kv[w] = load16(p + 16 * w * es, dtype, m[w]);
#pragma GCC unroll 4
        for (int h = 0; h < HB; ++h) {
            const __m512 qb = _mm512_set1_ps(q[h * dpad + i]);
#pragma GCC unroll 4
            for (int w = 0; w < W; ++w) acc[h][w] = _mm512_fmadd_ps(qb, kv[w], acc[h][w]);
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 4
        for (int w = 0; w < W; ++w) _mm512_mask_storeu_ps(S + h * ldS + 16 * w, m[w], acc[h][w]);
}

template <int W>
inline void chunk_heads(const uint8_t* k, int64_t dstride, int32_t dtype, int64_t es, int32_t d, const float* q,
                        int32_t dpad, int32_t G, const __mmask16 (&m)[4], float* S, int64_t ldS, const uint8_t* pf,
                        int pf_lines) {
    for (int32_t h0 = 0; h0 < G;) {  // the next segment is prefetched during the first heads only
        const float* qh = q + int64_t(h0) * dpad;
        float* Sh = S + h0 * ldS;
        const uint8_t* p = h0 == 0 ? pf : nullptr;
        switch (G - h0) {
            case 1: chunk<1, W>(k, dstride, dtype, es, d, qh, dpad, m, Sh, ldS, p, pf_lines); h0 += 1; break;
            case 2: chunk<2, W>(k, dstride, dtype, es, d, qh, dpad, m, Sh, ldS, p, pf_lines); h0 += 2; break;
            case 3: chunk<3, W>(k, dstride, dtype, es, d, qh, dpad, m, Sh, ldS, p, pf_lines); h0 += 3; break;
            default: chunk<4, W>(k, dstride, dtype, es, d, qh, dpad, m, Sh, ldS, p, pf_lines); h0 += 4; break;
        }
    }
}

}  // namespace

void scores_kt(const uint8_t* k, int64_t count, int64_t dstride, int32_t dtype, int32_t d, int32_t dpad,
               const float* q, int32_t G, float* S, int64_t ldS, const uint8_t* next, int64_t next_count,
               const uint16_t*, float) {
    const int64_t es = dtype == kF32 ? 4 : 2;
    // up to 64 slots per chunk: 4 16-slot vectors per head, HB x 4 independent accumulators
    // (16 for groups of 4 heads and more), so FMA latency is covered
    const int64_t width = 64;
    for (int64_t t0 = 0; t0 < count; t0 += width) {
        // the same slots of the next segment (the lines of this chunk's width)
        const uint8_t* pf = next && t0 < next_count ? next + t0 * es : nullptr;
        const int pf_lines = pf ? int(((next_count - t0 < width ? next_count - t0 : width) * es + 63) / 64) : 0;
        const int64_t rem = count - t0;
        const __mmask16 m[4] = {lanes(rem), lanes(rem - 16), lanes(rem - 32), lanes(rem - 48)};
        const uint8_t* kc = k + t0 * es;
        if (rem <= 16)
            chunk_heads<1>(kc, dstride, dtype, es, d, q, dpad, G, m, S + t0, ldS, pf, pf_lines);
        else if (rem <= 32)
            chunk_heads<2>(kc, dstride, dtype, es, d, q, dpad, G, m, S + t0, ldS, pf, pf_lines);
        else
            chunk_heads<4>(kc, dstride, dtype, es, d, q, dpad, G, m, S + t0, ldS, pf, pf_lines);
    }
}

}  // namespace avx512_level
}  // namespace topth_cpu
