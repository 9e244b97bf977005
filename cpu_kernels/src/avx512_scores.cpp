// AVX-512 level, stage 1: scores a = <q_h, k_j> for every query head of a KV group, reading
// each K row once (converted to float32 into a 16-row tile in L1), plus the per-head max
// and exp-sum used by the softmax. Compiled with -mavx512f -mavx512bw -mavx512vl
// -mavx512dq -mfma -mf16c (setup.py); selected at run time by dispatch.cpp.
#include "avx512_common.h"

namespace topth_cpu {
namespace avx512_level {
namespace {

// acc[t] += q_h[c0 .. c0 + NC) . tile[t][c0 .. c0 + NC) (16-float chunks), q held in registers.
template <int NC>
inline void qk_pass(const float* qh, const float* tile, int32_t dpad, __m512 (&acc)[16]) {
    __m512 qv[NC];
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_ps(qh + 16 * c);
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) {
        __m512 a = acc[t];
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(tile + t * dpad + 16 * c), a);
        acc[t] = a;
    }
}

inline __m512 pair_sum(__m512 a, __m512 b) {  // [a.lo256 + a.hi256, b.lo256 + b.hi256]
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}

inline __m512 quad_sum(__m512 a, __m512 b) {  // 128-bit lanes: [a0+a1, a2+a3, b0+b1, b2+b3]
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}

// Horizontal sums of 16 vectors: result[t] = sum of the lanes of acc[t].
inline __m512 reduce16(const __m512 (&acc)[16]) {
    __m512 s[8], u[4];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) s[i] = pair_sum(acc[2 * i], acc[2 * i + 1]);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) u[i] = quad_sum(s[2 * i], s[2 * i + 1]);
    // lane i of u[k] holds 4 partial sums of row 4k + i
    const __m512 z0 = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
    const __m512 z1 = _mm512_add_ps(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
    const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(z0, z1, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(z0, z1, _MM_SHUFFLE(3, 2, 3, 2)));
    // f[4 i + k] = row i + 4 k  ->  row r sits at 4 (r % 4) + r / 4
    const __m512i perm = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(perm, f);
}

inline void qk_chunks(const float* qh, const float* tile, int32_t dpad, int32_t nc, __m512 (&acc)[16]) {
    switch (nc) {
        case 1: qk_pass<1>(qh, tile, dpad, acc); break;
        case 2: qk_pass<2>(qh, tile, dpad, acc); break;
        case 3: qk_pass<3>(qh, tile, dpad, acc); break;
        case 4: qk_pass<4>(qh, tile, dpad, acc); break;
        case 5: qk_pass<5>(qh, tile, dpad, acc); break;
        case 6: qk_pass<6>(qh, tile, dpad, acc); break;
        case 7: qk_pass<7>(qh, tile, dpad, acc); break;
        default: qk_pass<8>(qh, tile, dpad, acc); break;
    }
}

}  // namespace

void scores(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad,
            const float* q, int32_t G, float* S, int64_t ldS, float* tile) {
    const int32_t nct = dpad / 16;
    for (int64_t t0 = 0; t0 < count; t0 += 16) {
        const int64_t T = count - t0 < 16 ? count - t0 : 16;
        for (int64_t t = 0; t < T; ++t) load_row(rows[t0 + t], dtype, sdim, d, dpad, tile + t * dpad);
        for (int64_t t = T; t < 16; ++t) memset(tile + t * dpad, 0, sizeof(float) * size_t(dpad));
        for (int32_t h = 0; h < G; ++h) {
            __m512 acc[16];
#pragma GCC unroll 16
            for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
            const float* qh = q + int64_t(h) * dpad;
            for (int32_t c0 = 0; c0 < nct; c0 += 8)
                qk_chunks(qh + 16 * c0, tile + 16 * c0, dpad, nct - c0 < 8 ? nct - c0 : 8, acc);
            _mm512_mask_storeu_ps(S + h * ldS + t0, tail_mask(T), reduce16(acc));
        }
    }
}

void max_bad(const float* S, int64_t len, float* m_out, int32_t* bad_out) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    __mmask16 bad = 0;
    const __m512 inf = _mm512_set1_ps(INFINITY);
    for (int64_t j = 0; j < len; j += 16) {
        const __mmask16 tm = tail_mask(len - j);
        const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tm, S + j);
        m = _mm512_max_ps(x, m);                       // returns m where x is NaN
        bad |= _mm512_cmp_ps_mask(x, inf, _CMP_NLT_UQ);  // NaN or +inf
    }
    *m_out = _mm512_reduce_max_ps(m);
    *bad_out = bad != 0;
}

float sum_exp(const float* S, int64_t len, float mref) {
    __m512 acc = _mm512_setzero_ps();
    const __m512 m = _mm512_set1_ps(mref);
    for (int64_t j = 0; j < len; j += 16) {
        const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(len - j), S + j);
        acc = _mm512_add_ps(acc, exp512(_mm512_sub_ps(x, m)));
    }
    return _mm512_reduce_add_ps(acc);
}

}  // namespace avx512_level

const SimdOps* ops_avx512() {
    static const SimdOps ops = {"avx512", avx512_level::scores, avx512_level::max_bad, avx512_level::sum_exp,
                                avx512_level::select, avx512_level::pv, avx512_level::vsum};
    return &ops;
}

}  // namespace topth_cpu
