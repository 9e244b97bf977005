// Helpers of the AVX-512 level (row loads with dtype conversion, exp, prefetch). Only the
// avx512_*.cpp files include this, all compiled with the same AVX-512 flags; every helper has
// internal linkage (anonymous namespace), so no AVX-512 code can leak into the generic path.
#pragma once

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "topth_cpu/params.h"

namespace topth_cpu {
namespace avx512_level {

void scores(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad,
            const float* q, int32_t G, float* S, int64_t ldS, float* tile);
void max_bad(const float* S, int64_t len, float* m, int32_t* bad);
float sum_exp(const float* S, int64_t len, float m);
int64_t select(const SelectArgs& a);
void pv(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad,
        const float* wk, int64_t ldw, int32_t G, float* acc, float* tile);
void vsum(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad,
          float* sum, float* tile);

namespace {

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u); }

// Up to 16 contiguous elements at p (lanes outside m are not read and give 0) as float32.
inline __m512 load16(const uint8_t* p, int32_t dtype, __mmask16 m) {
    if (dtype == kF32) return _mm512_maskz_loadu_ps(m, p);
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    if (dtype == kBF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

inline float load1(const uint8_t* p, int32_t dtype) {
    if (dtype == kF32) { float f; memcpy(&f, p, 4); return f; }
    uint16_t u;
    memcpy(&u, p, 2);
    if (dtype == kBF16) { const uint32_t b = uint32_t(u) << 16; float f; memcpy(&f, &b, 4); return f; }
    return _cvtsh_ss(u);
}

// One row of `d` elements, `sdim` apart, into dst[0, dpad) as float32, zero padded.
inline void load_row(const uint8_t* p, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad, float* dst) {
    const int64_t es = dtype == kF32 ? 4 : 2;
    if (sdim == 1) {
        for (int32_t i = 0; i < dpad; i += 16) _mm512_storeu_ps(dst + i, load16(p + i * es, dtype, tail_mask(d - i)));
        return;
    }
    for (int32_t i = 0; i < d; ++i) dst[i] = load1(p + i * sdim * es, dtype);
    for (int32_t i = d; i < dpad; ++i) dst[i] = 0.0f;
}

inline void prefetch_row(const uint8_t* p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T0);
}

// exp(x), x <= 88 or NaN: Cody-Waite reduction, Cephes' degree-6 polynomial, 2^n by scalef
// (correct underflow to 0, -inf -> 0, NaN -> NaN), ~1 ulp.
inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-150.0f), x);  // the second operand is returned for NaN
    x = _mm512_min_ps(_mm512_set1_ps(89.0f), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

}  // namespace
}  // namespace avx512_level
}  // namespace topth_cpu
