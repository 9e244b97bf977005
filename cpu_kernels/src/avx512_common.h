// Helpers of the AVX-512 level (row loads with dtype conversion, exp, prefetch, row
// addressing). Only the avx512_*.cpp, avx512bf16_*.cpp and amx_scores.cpp files include
// this, all compiled with at least the AVX-512 flags; every helper has
// internal linkage (anonymous namespace), so no AVX-512 code can leak into the generic path.
#pragma once

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "rows_ahead.h"
#include "topth_cpu/params.h"

namespace topth_cpu {
namespace avx512_level {

void scores(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad,
            const float* q, int32_t G, float* S, int64_t ldS, float* tile, const uint16_t* qraw, float scale);
void max_bad(const float* S, int64_t len, float* m, int32_t* bad);
float sum_exp(const float* S, int64_t len, float m);
int64_t select(const SelectArgs& a);
void pv(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad,
        const float* wk, int64_t ldw, int32_t G, float* acc, float* tile, int32_t scattered);
void vsum(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad,
          float* sum, float* tile);
void scores_pf(const uint8_t* const* rows, int64_t count, const uint8_t* const* pf, int64_t pf_count, int32_t dtype,
               int64_t sdim, int32_t d, int32_t dpad, const float* q, int32_t G, float* S, int64_t ldS, float* tile,
               const uint16_t* qraw, float scale);
void pv_pf(const uint8_t* const* rows, int64_t count, const uint8_t* const* pf, int64_t pf_count, int32_t dtype,
           int64_t sdim, int32_t d, int32_t dpad, const float* wk, int64_t ldw, int32_t G, float* acc, float* tile);
void scores_kt(const uint8_t* k, int64_t count, int64_t dstride, int32_t dtype, int32_t d, int32_t dpad,
               const float* q, int32_t G, float* S, int64_t ldS, const uint8_t* next, int64_t next_count,
               const uint16_t* qraw, float scale);
void pv_packed(const uint8_t* const* rows, int64_t count, int32_t d, int32_t dpad, int64_t gstride, const float* wk,
               int64_t ldw, int32_t G, float* acc, int32_t scattered);

}  // namespace avx512_level

// The avx512bf16 level's own stages, the bfloat16 scores of rows (avx512bf16_scores.cpp) and of
// K stored transposed (avx512bf16_kt.cpp), compiled with -mavx512bf16; the amx level uses the
// second and falls back on the first; every other stage of the avx512bf16 level is the avx512
// level's.
namespace avx512bf16_level {
void scores(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad,
            const float* q, int32_t G, float* S, int64_t ldS, float* tile, const uint16_t* qraw, float scale);
void scores_kt(const uint8_t* k, int64_t count, int64_t dstride, int32_t dtype, int32_t d, int32_t dpad,
               const float* q, int32_t G, float* S, int64_t ldS, const uint8_t* next, int64_t next_count,
               const uint16_t* qraw, float scale);
}  // namespace avx512bf16_level

namespace avx512_level {
namespace {

using rows_ahead::ahead_rows;
using rows_ahead::given_rows;
using rows_ahead::one_run;

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

// Software prefetches the compiler cannot drop. GCC's dead-code elimination deletes
// __builtin_prefetch (what _mm_prefetch expands to) from loops that do nothing else: with GCC
// 12 at -O2 / -O3 every prefetch of prefetch_ahead was missing from the binary, so the scores
// stages ran without them (docs/cpu.md, "Software prefetch"). A volatile asm is always emitted.
inline void prefetch_l1(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p))); }
inline void prefetch_l2(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p))); }

inline void prefetch_row(const uint8_t* p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) prefetch_l1(p + off);
}

inline void prefetch_row_l2(const uint8_t* p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) prefetch_l2(p + off);
}

// Software prefetch distances of the stages that walk a list of row pointers: the next 16 rows
// (one tile or block) into L1 (not everywhere: kNearMinBytes, pv_direct_all), about kFarBytes
// ahead into L2 (the list knows where the next rows are: the hardware prefetchers lose the
// stream at every block of a paged cache, and rows read through their pointers stream slower
// without it; docs/cpu.md, "Row addressing").
constexpr int64_t kFarBytes = 12288;

inline int64_t far_rows(int64_t row_bytes) {
    const int64_t r = kFarBytes / (row_bytes > 0 ? row_bytes : 1);
    return r < 32 ? 32 : (r > 128 ? 128 : r);
}

// Scores rows of kNearMinBytes or more also get the next 16 rows into L1: for 128-byte rows
// that step made the K pass slower end to end on AMD Zen 4, for 256-byte rows it did not
// (those two and 512 were measured, with the prefetches still issued in bursts; the bound
// between them is a choice; docs/cpu.md, "Software prefetch").
constexpr int64_t kNearMinBytes = 256;

// Before the tile of rows [t0, t0 + 16) of a list of count rows, in one burst: the tile `far`
// rows ahead into L2 and the next tile into L1. Only the amx row scores still prefetch this way;
// on AMX hardware a spread version was slower there (docs/cpu.md, "AMX scores").
inline void prefetch_ahead(const uint8_t* const* rows, int64_t t0, int64_t count, int64_t row_bytes, int64_t far) {
    for (int64_t t = t0 + 16; t < count && t < t0 + 32; ++t) prefetch_row(rows[t], row_bytes);
    for (int64_t t = t0 + far; t < count && t < t0 + far + 16; ++t) prefetch_row_l2(rows[t], row_bytes);
}

// How a stage addresses the rows of one 16-row tile: through the list of row pointers, or, when
// the 16 rows are equally spaced (BNSD, and inside a block of a paged cache), as base + t *
// stride. On AMD Zen 4 a stream of loads whose addresses come from loaded pointers read at
// about two thirds of the rate of the same rows addressed from one base (docs/cpu.md, "Row
// addressing"); the loads then do not use the pointers (the software prefetch, where issued,
// still does). Used by the avx512bf16 scores and the AVX-512 P.V; the avx512 scores keep the
// pointers (with RowRun the float32 shape's op ran at 0.87x end to end at f = 0.1, bound by
// the K pass of 512-byte rows).
struct RowPtrs {
    const uint8_t* const* r;
    const uint8_t* at(int64_t t) const { return r[t]; }
    RowPtrs from(int64_t t) const { return {r + t}; }
};
struct RowRun {
    const uint8_t* b;
    int64_t s;
    const uint8_t* at(int64_t t) const { return b + t * s; }
    RowRun from(int64_t t) const { return {b + t * s, s}; }
};

// The byte stride of 16 rows r[0 .. 15] when they are equally spaced with a positive stride,
// else 0.
inline int64_t tile_stride(const uint8_t* const* r) {
    const int64_t s = r[1] - r[0];
    if (s <= 0) return 0;
    const __m512i base = _mm512_set1_epi64(reinterpret_cast<int64_t>(r[0]));
    const __m512i step = _mm512_set1_epi64(s);
    const __m512i i0 = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i e0 = _mm512_add_epi64(base, _mm512_mullo_epi64(i0, step));
    const __m512i e1 = _mm512_add_epi64(e0, _mm512_slli_epi64(step, 3));
    const __mmask8 m0 = _mm512_cmpeq_epi64_mask(_mm512_loadu_si512(r), e0);
    const __mmask8 m1 = _mm512_cmpeq_epi64_mask(_mm512_loadu_si512(r + 8), e1);
    return (m0 & m1) == 0xFF ? s : 0;
}

// Horizontal sums of 16 vectors: result[t] = sum of the lanes of acc[t]. A transpose-and-add
// tree (15 adds) whose every level pairs a mask blend with one shuffle (16 shuffles in all,
// half the shuffles of two-shuffle levels: shuffles, not adds, limit it on AMD Zen 4). The
// tree leaves row r in lane bitreverse4(r), so the inputs are taken in bit-reversed order.
// Always inlined: GCC may otherwise outline it in a larger stage (its 16 inputs then go
// through memory: twice the time).
__attribute__((always_inline)) inline __m512 reduce16(const __m512 (&acc)[16]) {
    constexpr int rev[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    __m512 s[8], u[4], v[2];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {  // 256-bit halves: [a.lo + a.hi, b.hi + b.lo]
        const __m512 a = acc[rev[2 * i]], b = acc[rev[2 * i + 1]];
        s[i] = _mm512_add_ps(_mm512_mask_blend_ps(0xFF00, a, b), _mm512_shuffle_f32x4(a, b, 0x4E));
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {  // 128-bit lanes: [p0 + p1, q0 + q1, p2 + p3, q2 + q3]
        const __m512 p = s[2 * i], q = s[2 * i + 1];
        const __m512 w = _mm512_mask_blend_ps(0x0F0F, p, q);  // [q0 p1 q2 p3]
        u[i] = _mm512_add_ps(_mm512_mask_blend_ps(0xF0F0, p, q), _mm512_shuffle_f32x4(w, w, 0xB1));
    }
#pragma GCC unroll 2
    for (int i = 0; i < 2; ++i) {  // 64-bit halves of each 128-bit lane
        const __m512 a = u[2 * i], b = u[2 * i + 1];
        v[i] = _mm512_add_ps(_mm512_mask_blend_ps(0xCCCC, a, b), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 3, 2)));
    }
    const __m512 w = _mm512_mask_blend_ps(0x5555, v[0], v[1]);  // single floats
    return _mm512_add_ps(_mm512_mask_blend_ps(0xAAAA, v[0], v[1]), _mm512_permute_ps(w, _MM_SHUFFLE(2, 3, 0, 1)));
}

// Scores of a block of HB heads x RB rows (HB * RB <= 16), reduced into one vector v with
// lane h * RB + t = head h, row t: rows t < T of each head go to S[h * ldS + t].
template <int HB, int RB>
inline void store_block(__m512 v, float* S, int64_t ldS, int64_t T) {
    const __mmask16 m = tail_mask(T < RB ? T : RB);
    _mm512_mask_storeu_ps(S, m, v);
#pragma GCC unroll 4
    for (int h = 1; h < HB; ++h) {
        const __m512i idx = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(h * RB));
        _mm512_mask_storeu_ps(S + h * ldS, m, _mm512_permutexvar_ps(idx, v));
    }
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
