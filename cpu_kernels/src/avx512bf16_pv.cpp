// SIMD level "avx512bf16", stage 3: P.V of bfloat16 rows with vdpbf16ps, two rows per
// instruction.
//
// acc_h += w_h,t v_t + w_h,t+1 v_t+1 for two consecutive visits t, t + 1 of the kept list:
// the two rows' bfloat16 elements are interleaved (vpunpcklwd / vpunpckhwd: lane i of a
// 32-element chunk holds v_t[d], v_t+1[d] for one d), and each head's two weights, rounded
// to bfloat16, are broadcast as one 32-bit pair. One vdpbf16ps then does the work of two
// float32 FMAs and no row is converted to float32: per row and head, one instruction per 32
// elements instead of two FMAs plus the conversions. The products of two bfloat16 values
// are exact in float32 and added into the accumulator one after the other, each addition
// rounded to nearest even; what differs from the avx512 level is that the weights are
// rounded to bfloat16 first (as FlashAttention and the Triton kernels round p to the input
// dtype: a relative error of at most 2^-9 per weight, within the bfloat16 tolerance of the
// contract), the order of the additions, and that subnormal inputs and results are treated
// as zero (as the avx512bf16 scores are). docs/cpu.md, "P.V on AVX512-BF16".
//
// The accumulators hold each 32-element chunk of a head in the unpack order: [lo | hi] with
// lo = elements 0-3, 8-11, 16-19, 24-27 and hi = 4-7, 12-15, 20-23, 28-31; pv() permutes them
// there and back. An odd last row pairs with zeros (a zero row and weight 0), so no row
// outside the kept list is read. Rows are walked as the avx512 level walks them
// (avx512_pv_rows.h: strided visits of scattered lists, software prefetch). Other dtypes,
// strided rows and head_dim not a multiple of 32 run the avx512 level's code.
//
// Compiled with the AVX-512 flags plus -mavx512bf16 (setup.py); used by the avx512bf16 and
// amx levels only, which run only where the CPU reports AVX512-BF16 (dispatch.cpp).
#include <type_traits>

#include "avx512_pv_rows.h"

namespace topth_cpu {
namespace avx512bf16_level {
namespace {

using avx512_level::kRowBlock;
using avx512_level::tail_mask;

// Each 32-float chunk of the G accumulator rows between natural order and unpack order
// (to_pairs: natural -> unpack).
inline void pair_order(float* acc, int32_t G, int32_t d, int32_t dpad, bool to_pairs) {
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i hi = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const __m512i n0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i n1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    avx512_level::permute_chunks(acc, G, d, dpad, to_pairs ? lo : n0, to_pairs ? hi : n1);
}

// The weights of one block for HB heads as bfloat16 pairs: wp[h][i] = (w_h,2i, w_h,2i+1),
// zero past R.
template <int HB>
inline void weight_pairs(const float* w, int64_t ldw, int64_t R, uint32_t (&wp)[4][kRowBlock / 2]) {
    const __mmask16 m = tail_mask(R);
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(wp[h]),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, w + h * ldw)));
}

// acc[h][2j], acc[h][2j + 1] += the pairs of rows (t, t + 1) of the block, for the NJ chunks
// of 32 elements at byte offset `off` of each row.
template <int HB, int NJ>
inline void pv_pairs(const uint8_t* const* rb, int64_t R, int64_t off, const uint32_t (&wp)[4][kRowBlock / 2],
                     float* acc, int32_t dpad) {
    __m512 a[HB][2 * NJ];
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 4
        for (int c = 0; c < 2 * NJ; ++c) a[h][c] = _mm512_loadu_ps(acc + int64_t(h) * dpad + 16 * c);
    // one pair of rows; `odd` (a compile-time flag): the last row alone, paired with zeros
    auto step = [&](const uint8_t* p0, const uint8_t* p1, int64_t i, auto odd) {
        __m512bh lo[NJ], hi[NJ];
#pragma GCC unroll 2
        for (int j = 0; j < NJ; ++j) {
            const __m512i x0 = _mm512_loadu_si512(p0 + 64 * j);
            __m512i x1 = _mm512_setzero_si512();
            if constexpr (!decltype(odd)::value) x1 = _mm512_loadu_si512(p1 + 64 * j);
            lo[j] = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
            hi[j] = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
        }
#pragma GCC unroll 4
        for (int h = 0; h < HB; ++h) {
            const __m512bh wv = (__m512bh)_mm512_set1_epi32(int32_t(wp[h][i]));
#pragma GCC unroll 2
            for (int j = 0; j < NJ; ++j) {
                a[h][2 * j] = _mm512_dpbf16_ps(a[h][2 * j], lo[j], wv);
                a[h][2 * j + 1] = _mm512_dpbf16_ps(a[h][2 * j + 1], hi[j], wv);
            }
        }
    };
    int64_t t = 0;
    for (; t + 1 < R; t += 2) step(rb[t] + off, rb[t + 1] + off, t / 2, std::false_type{});
    if (t < R) step(rb[t] + off, nullptr, t / 2, std::true_type{});
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 4
        for (int c = 0; c < 2 * NJ; ++c) _mm512_storeu_ps(acc + int64_t(h) * dpad + 16 * c, a[h][c]);
}

template <int HB>
inline void pv_pairs_nj(const uint8_t* const* rb, int64_t R, int64_t off, int nj,
                        const uint32_t (&wp)[4][kRowBlock / 2], float* acc, int32_t dpad) {
    if (nj == 1)
        pv_pairs<HB, 1>(rb, R, off, wp, acc, dpad);
    else
        pv_pairs<HB, 2>(rb, R, off, wp, acc, dpad);
}

}  // namespace

void pv(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad,
        const float* wk, int64_t ldw, int32_t G, float* acc, float* tile, int32_t scattered) {
    if (dtype != kBF16 || sdim != 1 || d % 32 != 0 || count <= 0) {
        avx512_level::pv(rows, count, dtype, sdim, d, dpad, wk, ldw, G, acc, tile, scattered);
        return;
    }
    const int64_t stride = scattered ? avx512_level::visit_stride(count) : 1;
    const int32_t nch = d / 32;  // chunks of 32 elements (64 bytes)
    pair_order(acc, G, d, dpad, true);
    avx512_level::visit_row_blocks<kBF16>(rows, count, int64_t(d) * 2, 32, d, stride,
                                         [&](const uint8_t* const* rb, const int64_t* vis, int64_t k0, int64_t R) {
        float wbuf[4 * kRowBlock];
        uint32_t wp[4][kRowBlock / 2];
        for (int32_t h0 = 0; h0 < G; h0 += 4) {
            const int hb = G - h0 < 4 ? G - h0 : 4;
            int64_t lw = 0;
            const float* w = avx512_level::block_weights(wk, ldw, h0, hb, k0, vis, R, stride, wbuf, kRowBlock, &lw);
            switch (hb) {
                case 1: weight_pairs<1>(w, lw, R, wp); break;
                case 2: weight_pairs<2>(w, lw, R, wp); break;
                case 3: weight_pairs<3>(w, lw, R, wp); break;
                default: weight_pairs<4>(w, lw, R, wp); break;
            }
            for (int32_t c0 = 0; c0 < nch; c0 += 2) {
                const int nj = nch - c0 < 2 ? nch - c0 : 2;
                const int64_t off = int64_t(c0) * 64;
                float* o = acc + int64_t(h0) * dpad + 32 * c0;
                switch (hb) {
                    case 1: pv_pairs_nj<1>(rb, R, off, nj, wp, o, dpad); break;
                    case 2: pv_pairs_nj<2>(rb, R, off, nj, wp, o, dpad); break;
                    case 3: pv_pairs_nj<3>(rb, R, off, nj, wp, o, dpad); break;
                    default: pv_pairs_nj<4>(rb, R, off, nj, wp, o, dpad); break;
                }
            }
        }
    });
    pair_order(acc, G, d, dpad, false);
}

}  // namespace avx512bf16_level
}  // namespace topth_cpu
