// Helpers of the AVX2 level (16-element loads with dtype conversion, exp, horizontal sums,
// prefetch). Only the avx2_*.cpp files include this, all compiled with -mavx2 -mfma -mf16c
// (setup.py); every helper has internal linkage, so no AVX2 code can reach the generic path.
//
// Sixteen head_dim elements are handled as a pair of 8-float vectors. float32 and float16
// give them in natural order (elements 0-7, 8-15). bfloat16 is widened pairwise (kSplit):
// one 32-byte load gives the even elements (each 32-bit lane shifted up) and the odd ones
// (the low half masked off), one instruction each, so a pair holds [8 even | 8 odd]. The
// other operand (the query in the scores, the accumulators in P.V) is kept in the same
// order (split16 / merge16).
#pragma once

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "rows_ahead.h"
#include "topth_cpu/params.h"

namespace topth_cpu {
namespace avx2_level {

void scores(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad,
            const float* q, int32_t G, float* S, int64_t ldS, float* tile, const uint16_t* qraw, float scale);
void scores_pf(const uint8_t* const* rows, int64_t count, const uint8_t* const* pf, int64_t pf_count, int32_t dtype,
               int64_t sdim, int32_t d, int32_t dpad, const float* q, int32_t G, float* S, int64_t ldS, float* tile,
               const uint16_t* qraw, float scale);
void scores_kt(const uint8_t* k, int64_t count, int64_t dstride, int32_t dtype, int32_t d, int32_t dpad,
               const float* q, int32_t G, float* S, int64_t ldS, const uint8_t* next, int64_t next_count,
               const uint16_t* qraw, float scale);
void max_bad(const float* S, int64_t len, float* m, int32_t* bad);
float sum_exp(const float* S, int64_t len, float m);
int64_t select(const SelectArgs& a);
void pv(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad,
        const float* wk, int64_t ldw, int32_t G, float* acc, float* tile, int32_t scattered);
void pv_pf(const uint8_t* const* rows, int64_t count, const uint8_t* const* pf, int64_t pf_count, int32_t dtype,
           int64_t sdim, int32_t d, int32_t dpad, const float* wk, int64_t ldw, int32_t G, float* acc, float* tile);
void vsum(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad,
          float* sum, float* tile);

namespace {

using rows_ahead::ahead_rows;
using rows_ahead::given_rows;
using rows_ahead::one_run;

constexpr int kSplit = 3;  // pseudo dtype: bfloat16 widened pairwise ([8 even | 8 odd])

// Half `H` (0: the first 8-float vector, 1: the second) of the 16 elements at p, in DT's pair
// order (see the file comment).
template <int DT, int H>
inline __m256 load_half(const uint8_t* p) {
    if constexpr (DT == kF32) {
        return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8 * H);
    } else if constexpr (DT == kF16) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * H)));
    } else {  // kSplit: one 32-byte load, even elements shifted up (H = 0), odd ones masked (H = 1)
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        if constexpr (H == 0) return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
        else return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
    }
}

// 16 elements at p as two 8-float vectors (kSplit: the compiler merges the two loads).
template <int DT>
inline void load_pair(const uint8_t* p, __m256& a, __m256& b) {
    a = load_half<DT, 0>(p);
    b = load_half<DT, 1>(p);
}

// 8 consecutive 16-bit or 32-bit elements at p as floats in natural order.
inline __m256 load8(const uint8_t* p, int32_t dtype) {
    if (dtype == kF32) return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if (dtype == kF16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float load1(const uint8_t* p, int32_t dtype) {
    if (dtype == kF32) { float f; memcpy(&f, p, 4); return f; }
    uint16_t u;
    memcpy(&u, p, 2);
    if (dtype == kBF16) { const uint32_t b = uint32_t(u) << 16; float f; memcpy(&f, &b, 4); return f; }
    return _cvtsh_ss(u);
}

// One row of `d` elements, `sdim` apart, into dst[0, dpad) as float32 (natural order), zero padded.
inline void load_row(const uint8_t* p, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad, float* dst) {
    const int64_t es = dtype == kF32 ? 4 : 2;
    int32_t i = 0;
    if (sdim == 1)
        for (; i + 8 <= d; i += 8) _mm256_storeu_ps(dst + i, load8(p + i * es, dtype));
    for (; i < d; ++i) dst[i] = load1(p + i * sdim * es, dtype);
    for (; i < dpad; ++i) dst[i] = 0.0f;
}

// [8 even | 8 odd] order of each 16-float chunk of n floats (n a multiple of 16), in place;
// merge16 undoes it.
inline void split16(float* x, int64_t n) {
    const __m256i perm = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (int64_t c = 0; c < n; c += 16) {
        const __m256 u = _mm256_permutevar8x32_ps(_mm256_loadu_ps(x + c), perm);      // e0-3 o0-3
        const __m256 v = _mm256_permutevar8x32_ps(_mm256_loadu_ps(x + c + 8), perm);  // e4-7 o4-7
        _mm256_storeu_ps(x + c, _mm256_permute2f128_ps(u, v, 0x20));
        _mm256_storeu_ps(x + c + 8, _mm256_permute2f128_ps(u, v, 0x31));
    }
}

inline void merge16(float* x, int64_t n) {
    for (int64_t c = 0; c < n; c += 16) {
        const __m256 e = _mm256_loadu_ps(x + c), o = _mm256_loadu_ps(x + c + 8);
        const __m256 lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);  // e0 o0 e1 o1 | e4 o4 e5 o5 ...
        _mm256_storeu_ps(x + c, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(x + c + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
}

// Lane sums of 8 vectors: result lane i = sum of the lanes of v[i].
inline __m256 hsum8(const __m256 (&v)[8]) {
    const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
    const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);  // [0..3 low | 0..3 high], [4..7 ...]
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// Lane sums of n <= 8 vectors into out[0, n).
inline void hsum_store(const __m256* v, int n, float* out) {
    __m256 w[8];
    for (int i = 0; i < 8; ++i) w[i] = i < n ? v[i] : _mm256_setzero_ps();
    alignas(32) float r[8];
    _mm256_store_ps(r, hsum8(w));
    for (int i = 0; i < n; ++i) out[i] = r[i];
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {  // v holds no NaN
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Lanes [0, n) set (n clamped to [0, 8]): a mask for maskload / maskstore / blendv.
inline __m256i lane_mask(int64_t n) {
    const int32_t k = n <= 0 ? 0 : (n >= 8 ? 8 : int32_t(n));
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// exp(x) for x <= 88 or NaN: Cody-Waite reduction and Cephes' degree-6 polynomial (~1 ulp),
// as the portable stage: x < -87.33654 (and -inf) gives 0, NaN stays NaN.
inline __m256 exp256(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33654f);
    __m256 xc = _mm256_max_ps(lo, x);                      // the second operand is returned for NaN
    xc = _mm256_min_ps(_mm256_set1_ps(88.0f), xc);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    // 2^n, n in [-126, 127] (NaN lanes give garbage here and are restored below)
    const __m256i ni = _mm256_cvtps_epi32(_mm256_max_ps(n, _mm256_set1_ps(-126.0f)));
    const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(ni, _mm256_set1_epi32(127)), 23));
    __m256 e = _mm256_mul_ps(p, s);
    e = _mm256_blendv_ps(e, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));                  // NaN -> NaN
    return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), e);                      // x < -87.34 -> 0
}

// Software prefetches the compiler cannot drop (see avx512_common.h: GCC deletes
// __builtin_prefetch from loops that do nothing else).
inline void prefetch_l1(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p))); }
inline void prefetch_l2(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p))); }

inline void prefetch_row(const uint8_t* p, int64_t bytes, bool l2) {
    for (int64_t off = 0; off < bytes; off += 64) {
        if (l2) prefetch_l2(p + off);
        else prefetch_l1(p + off);
    }
}

// Prefetch distances of the stages that walk a list of row pointers (as the AVX-512 level):
// the next block of rows into L1, about 12 KiB ahead into L2.
inline int64_t far_rows(int64_t row_bytes) {
    const int64_t r = 12288 / (row_bytes > 0 ? row_bytes : 1);
    return r < 32 ? 32 : (r > 128 ? 128 : r);
}

// Rows [a, a + n) of a list when they are not one contiguous run (a run is left to the
// hardware prefetchers: BNSD, or a block of an HND cache).
inline void prefetch_rows(const uint8_t* const* rows, int64_t a, int64_t n, int64_t row_bytes, bool l2) {
    if (n <= 0 || rows[a + n - 1] - rows[a] == (n - 1) * row_bytes) return;
    for (int64_t t = a; t < a + n; ++t) prefetch_row(rows[t], row_bytes, l2);
}

// Before rows [t0, t0 + step) of a list of count: the next step into L1, the rows `far`
// ahead into L2, in one burst (the converting tile paths).
inline void prefetch_ahead(const uint8_t* const* rows, int64_t t0, int64_t step, int64_t count, int64_t row_bytes,
                           int64_t far) {
    const int64_t n1 = count - (t0 + step), n2 = count - (t0 + far);
    prefetch_rows(rows, t0 + step, n1 < step ? n1 : step, row_bytes, false);
    prefetch_rows(rows, t0 + far, n2 < step ? n2 : step, row_bytes, true);
}

}  // namespace
}  // namespace avx2_level
}  // namespace topth_cpu
