// SIMD level "avx512bf16" (and "amx"), stage 1 for bfloat16 K stored transposed per block
// (vLLM's vector-ISA CPU cache: element i of slot t at byte k + i * dstride + 2 t).
//
// The avx512 level's scores_kt widens every K element to float32 and spends one FMA per
// element and query head. Here two head_dim rows i, i + 1 of the segment are interleaved
// in registers (vpunpck{l,h}wd: each 32-bit lane holds the pair (k_i[t], k_{i+1}[t]) of one
// slot) and one vdpbf16ps per head adds q_i k_i[t] + q_{i+1} k_{i+1}[t] into the slot's
// float32 lane, with the pair (q_i, q_{i+1}) of the query as given broadcast: half the
// multiply instructions and no conversions. The arithmetic is that of the level's row
// scores (avx512bf16_scores.cpp): exact bfloat16 products, float32 accumulation in pairs of
// head_dim elements, the scale applied once to the dot product, subnormal inputs and
// results as zero (docs/cpu.md, "K stored transposed"). The unpack works inside 128-bit
// lanes, so the two accumulators of 32 slots hold slots {0-3, 8-11, 16-19, 24-27} and
// {4-7, 12-15, 20-23, 28-31}; one permute per 16 slots restores slot order before the store.
// Loads are masked to the segment (nothing past its last slot is read; an odd head_dim's last
// row is paired with zeros, not with the row after it), and the next segment is prefetched
// into L2 as in the avx512 level's stage, spread over the pairs of rows. Other dtypes, and
// calls without the bfloat16 query, run the avx512 level's stage.
//
// Compiled with the AVX-512 flags plus -mavx512bf16 (setup.py).
#include "avx512_common.h"

namespace topth_cpu {
namespace avx512bf16_level {
namespace {

using avx512_level::prefetch_l2;

inline __mmask32 lanes32(int64_t n) {
    return n <= 0 ? __mmask32(0) : n >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << n) - 1u);
}

// The 32-bit pair (q[i], q[i + 1]) of a bfloat16 query row, broadcast (q[i + 1] = 0 when `last`).
inline __m512bh query_pair(const uint16_t* q, int32_t i, bool last) {
    int32_t pair;
    if (last) {
        pair = int32_t(q[i]);
    } else {
        memcpy(&pair, q + i, 4);  // one broadcast load
    }
    return (__m512bh)_mm512_set1_epi32(pair);
}

// Slots [0, 32 W) of the segment at k (masks m[w]) for heads h0 .. h0 + HB (q, S rows from
// h0). pf (may be null): pf_lines lines of each row of the next segment, two rows per pair.
template <int HB, int W>
inline void chunk(const uint8_t* k, int64_t dstride, int32_t d, const uint16_t* q, int32_t dpad,
                  const __mmask32 (&m)[2], __m512 scale, float* S, int64_t ldS, const uint8_t* pf, int pf_lines) {
    __m512 acc[HB][2 * W];
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 4
        for (int j = 0; j < 2 * W; ++j) acc[h][j] = _mm512_setzero_ps();
    for (int32_t i = 0; i < d; i += 2) {
        const bool last = i + 1 == d;  // odd head_dim: row i alone
        const uint8_t* p = k + i * dstride;
        if (pf)
            for (int l = 0; l < pf_lines; ++l) {
                prefetch_l2(pf + i * dstride + 64 * l);
                if (!last) prefetch_l2(pf + (i + 1) * dstride + 64 * l);
            }
        __m512i kv[2 * W];
#pragma GCC unroll 2
        for (int w = 0; w < W; ++w) {
            const __m512i a = _mm512_maskz_loadu_epi16(m[w], p + 64 * w);
            const __m512i b = last ? _mm512_setzero_si512() : _mm512_maskz_loadu_epi16(m[w], p + dstride + 64 * w);
            kv[2 * w] = _mm512_unpacklo_epi16(a, b);
            kv[2 * w + 1] = _mm512_unpackhi_epi16(a, b);
        }
#pragma GCC unroll 4
        for (int h = 0; h < HB; ++h) {
            const __m512bh qp = query_pair(q + int64_t(h) * dpad, i, last);
#pragma GCC unroll 4
            for (int j = 0; j < 2 * W; ++j) acc[h][j] = _mm512_dpbf16_ps(acc[h][j], qp, (__m512bh)kv[j]);
        }
    }
    // 128-bit lanes [lo.0 hi.0 lo.1 hi.1] are slots 0-15, [lo.2 hi.2 lo.3 hi.3] slots 16-31
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 2
        for (int w = 0; w < W; ++w) {
            const __m512 lo = acc[h][2 * w], hi = acc[h][2 * w + 1];
            float* out = S + h * ldS + 32 * w;
            _mm512_mask_storeu_ps(out, __mmask16(m[w]),
                                  _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), scale));
            _mm512_mask_storeu_ps(out + 16, __mmask16(m[w] >> 16),
                                  _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), scale));
        }
}

template <int W>
inline void chunk_heads(const uint8_t* k, int64_t dstride, int32_t d, const uint16_t* q, int32_t dpad, int32_t G,
                        const __mmask32 (&m)[2], __m512 scale, float* S, int64_t ldS, const uint8_t* pf,
                        int pf_lines) {
    for (int32_t h0 = 0; h0 < G;) {  // the next segment is prefetched during the first heads only
        const uint16_t* qh = q + int64_t(h0) * dpad;
        float* Sh = S + h0 * ldS;
        const uint8_t* p = h0 == 0 ? pf : nullptr;
        switch (G - h0) {
            case 1: chunk<1, W>(k, dstride, d, qh, dpad, m, scale, Sh, ldS, p, pf_lines); h0 += 1; break;
            case 2: chunk<2, W>(k, dstride, d, qh, dpad, m, scale, Sh, ldS, p, pf_lines); h0 += 2; break;
            case 3: chunk<3, W>(k, dstride, d, qh, dpad, m, scale, Sh, ldS, p, pf_lines); h0 += 3; break;
            default: chunk<4, W>(k, dstride, d, qh, dpad, m, scale, Sh, ldS, p, pf_lines); h0 += 4; break;
        }
    }
}

}  // namespace

void scores_kt(const uint8_t* k, int64_t count, int64_t dstride, int32_t dtype, int32_t d, int32_t dpad,
               const float* q, int32_t G, float* S, int64_t ldS, const uint8_t* next, int64_t next_count,
               const uint16_t* qraw, float scale) {
    if (dtype != kBF16 || qraw == nullptr) {
        avx512_level::scores_kt(k, count, dstride, dtype, d, dpad, q, G, S, ldS, next, next_count, qraw, scale);
        return;
    }
    const __m512 sc = _mm512_set1_ps(scale);
    const int64_t width = 64;  // slots per chunk: 2 x 32, HB x 4 accumulators
    for (int64_t t0 = 0; t0 < count; t0 += width) {
        // the same slots of the next segment (the lines of this chunk's width)
        const uint8_t* pf = next && t0 < next_count ? next + t0 * 2 : nullptr;
        const int pf_lines = pf ? int(((next_count - t0 < width ? next_count - t0 : width) * 2 + 63) / 64) : 0;
        const int64_t rem = count - t0;
        const __mmask32 m[2] = {lanes32(rem), lanes32(rem - 32)};
        const uint8_t* kc = k + t0 * 2;
        if (rem <= 32) chunk_heads<1>(kc, dstride, d, qraw, dpad, G, m, sc, S + t0, ldS, pf, pf_lines);
        else chunk_heads<2>(kc, dstride, d, qraw, dpad, G, m, sc, S + t0, ldS, pf, pf_lines);
    }
}

}  // namespace avx512bf16_level
}  // namespace topth_cpu
