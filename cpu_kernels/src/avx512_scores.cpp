// AVX-512 level, stage 1: scores a = <q_h, k_j> for every query head of a KV group, reading
// each K row once from memory, plus the per-head max and exp-sum used by the softmax.
// Rows with a contiguous head_dim are multiplied straight from the cache, float16 and
// bfloat16 ones widened to float32 in registers (the avx512bf16 level has its own bfloat16
// scores); strided rows are converted to float32 in a 16-row tile in L1 first.
// Register blocking: HB heads x RB rows (4 x 4 for GQA groups of 4 or more) accumulate at
// once, so each loaded K chunk serves HB heads and each query chunk RB rows; one
// transpose-and-add tree then reduces the 16 dot products. Compiled with -mavx512f
// -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c (setup.py); selected at run time by
// dispatch.cpp.
#include "avx512_common.h"

namespace topth_cpu {
namespace avx512_level {
namespace {

// 16 float16 / bfloat16 values as float32 (exact). widen16 and k_chunk / k_tail are
// compile-time-dtype forms of load16 (avx512_common.h) for the hot loop: routing them through
// load16 changed its register allocation and slowed it (docs/cpu.md, "The AVX-512 stages").
template <int DT>
inline __m512 widen16(__m256i h) {
    if constexpr (DT == kF16) return _mm512_cvtph_ps(h);
    else return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Chunk c (16 elements) of row r as float32: float32 rows (and the float32 tile) as stored,
// 16-bit rows widened in registers. k_tail: lanes outside m are not read and give 0.
template <int DT>
inline __m512 k_chunk(const void* r, int32_t c) {
    if constexpr (DT == kF32) return _mm512_loadu_ps(static_cast<const float*>(r) + 16 * c);
    else return widen16<DT>(_mm256_loadu_si256(static_cast<const __m256i*>(r) + c));
}

template <int DT>
inline __m512 k_tail(const void* r, int32_t c, __mmask16 m) {
    if constexpr (DT == kF32) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(r) + 16 * c);
    else return widen16<DT>(_mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(r) + 16 * c));
}

// The line of chunk c of rows pf[t] (into L2, NPF >= 1) and pn[t] (into L1, NPF 2), where the
// chunk starts a line (16-bit rows: every other chunk).
template <int DT, int NPF>
inline void prefetch_chunk(const uint8_t* const* pf, const uint8_t* const* pn, int t, int32_t c) {
    if (NPF == 0 || (DT != kF32 && c % 2)) return;
    const int64_t off = int64_t(c) * (DT == kF32 ? 64 : 32);
    if constexpr (NPF >= 1) prefetch_l2(pf[t] + off);
    if constexpr (NPF >= 2) prefetch_l1(pn[t] + off);
}

// acc[h * RB + t] += <q_h, r_t> over 16-element chunks: nfull full ones, then one masked by
// `last` when last != 0 (elements past head_dim are not read; q is zero padded there).
// With each load, the same chunk of row pf[t] (NPF >= 1) into L2 and of row pn[t] (NPF 2) into
// L1: prefetches spread over the arithmetic (ahead_rows, rows_ahead.h).
template <int DT, int HB, int RB, int NPF>
inline void qk_block(const void* const* r, const float* q, int32_t dpad, int32_t nfull, __mmask16 last,
                     __m512 (&acc)[16], const uint8_t* const* pf, const uint8_t* const* pn) {
    for (int32_t c = 0; c < nfull; ++c) {
        __m512 qv[HB];
#pragma GCC unroll 4
        for (int h = 0; h < HB; ++h) qv[h] = _mm512_loadu_ps(q + h * dpad + 16 * c);
#pragma GCC unroll 16
        for (int t = 0; t < RB; ++t) {
            prefetch_chunk<DT, NPF>(pf, pn, t, c);
            const __m512 k = k_chunk<DT>(r[t], c);
#pragma GCC unroll 4
            for (int h = 0; h < HB; ++h) acc[h * RB + t] = _mm512_fmadd_ps(qv[h], k, acc[h * RB + t]);
        }
    }
    if (last) {
        __m512 qv[HB];
#pragma GCC unroll 4
        for (int h = 0; h < HB; ++h) qv[h] = _mm512_loadu_ps(q + h * dpad + 16 * nfull);
#pragma GCC unroll 16
        for (int t = 0; t < RB; ++t) {
            prefetch_chunk<DT, NPF>(pf, pn, t, nfull);
            const __m512 k = k_tail<DT>(r[t], nfull, last);
#pragma GCC unroll 4
            for (int h = 0; h < HB; ++h) acc[h * RB + t] = _mm512_fmadd_ps(qv[h], k, acc[h * RB + t]);
        }
    }
}

// One tile of T <= 16 rows (r[t], t < 16, padded with valid rows) for heads h0 .. h0 + HB.
template <int DT, int HB, int RB, int NPF>
inline void tile_heads(const void* const* r, int64_t T, const float* q, int32_t dpad, int32_t nfull,
                       __mmask16 last, float* S, int64_t ldS, const uint8_t* const* pf, const uint8_t* const* pn) {
    for (int64_t r0 = 0; r0 < T; r0 += RB) {
        __m512 acc[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
        qk_block<DT, HB, RB, NPF>(r + r0, q, dpad, nfull, last, acc, NPF >= 1 ? pf + r0 : pf,
                                  NPF >= 2 ? pn + r0 : pn);
        store_block<HB, RB>(reduce16(acc), S + r0, ldS, T - r0);
    }
}

// One head block (the heads left from q on: up to 4) of one tile; returns its head count.
template <int DT, int NPF>
inline int32_t head_block(const void* const* r, int64_t T, const float* q, int32_t dpad, int32_t nfull,
                          __mmask16 last, int32_t left, float* S, int64_t ldS, const uint8_t* const* pf,
                          const uint8_t* const* pn) {
    switch (left) {
        case 1: tile_heads<DT, 1, 16, NPF>(r, T, q, dpad, nfull, last, S, ldS, pf, pn); return 1;
        case 2: tile_heads<DT, 2, 8, NPF>(r, T, q, dpad, nfull, last, S, ldS, pf, pn); return 2;
        case 3: tile_heads<DT, 3, 4, NPF>(r, T, q, dpad, nfull, last, S, ldS, pf, pn); return 3;
        default: tile_heads<DT, 4, 4, NPF>(r, T, q, dpad, nfull, last, S, ldS, pf, pn); return 4;
    }
}

// Every head block of one tile; the first one issues the prefetches: pf into L2 and pn into L1
// (either may be null; pn only with pf).
template <int DT>
inline void tile_groups(const void* const* r, int64_t T, const float* q, int32_t dpad, int32_t nfull,
                        __mmask16 last, int32_t G, float* S, int64_t ldS, const uint8_t* const* pf,
                        const uint8_t* const* pn) {
    for (int32_t h0 = 0; h0 < G;) {
        const float* qh = q + int64_t(h0) * dpad;
        float* Sh = S + h0 * ldS;
        if (h0 == 0 && pn) h0 += head_block<DT, 2>(r, T, qh, dpad, nfull, last, G - h0, Sh, ldS, pf, pn);
        else if (h0 == 0 && pf) h0 += head_block<DT, 1>(r, T, qh, dpad, nfull, last, G - h0, Sh, ldS, pf, pn);
        else h0 += head_block<DT, 0>(r, T, qh, dpad, nfull, last, G - h0, Sh, ldS, pf, pn);
    }
}

}  // namespace

// pf_list given (unit_scores' walk): pf_list[t] (t < pf_count) into L2 while row t is read,
// instead of the rows `far` further down this list; the next tile into L1 as without it.
void scores_pf(const uint8_t* const* rows, int64_t count, const uint8_t* const* pf_list, int64_t pf_count,
               int32_t dtype, int64_t sdim, int32_t d, int32_t dpad, const float* q, int32_t G, float* S, int64_t ldS,
               float* tile, const uint16_t*, float) {
    const bool direct = sdim == 1;
    // direct rows: d elements (the last chunk masked); tile rows: dpad floats, zero padded
    const int32_t nfull = direct ? d / 16 : dpad / 16;
    const __mmask16 last = direct && d % 16 ? tail_mask(d % 16) : __mmask16(0);
    const int64_t es = dtype == kF32 ? 4 : 2;
    const int64_t row_bytes = sdim == 1 ? int64_t(d) * es : 0, far = far_rows(row_bytes);
    const void* r[16];
    const uint8_t* pfar[16];
    const uint8_t* pnear[16];
    const bool near = row_bytes >= kNearMinBytes;
    for (int64_t t0 = 0; t0 < count; t0 += 16) {
        const int64_t T = count - t0 < 16 ? count - t0 : 16;
        const uint8_t* const* pf = !row_bytes ? nullptr
                                   : pf_list  ? given_rows(pf_list, t0, pf_count, 16, pfar)
                                              : ahead_rows(rows, t0, count, far, 16, pfar);
        const uint8_t* const* pn = row_bytes && near ? ahead_rows(rows, t0, count, 16, 16, pnear) : nullptr;
        if (!pf) pf = pn;  // near rows left only (the end of the list): into L2 as well
        if (direct) {
            for (int64_t t = 0; t < 16; ++t) r[t] = rows[t0 + (t < T ? t : T - 1)];
        } else {
            for (int64_t t = 0; t < T; ++t) load_row(rows[t0 + t], dtype, sdim, d, dpad, tile + t * dpad);
            for (int64_t t = 0; t < 16; ++t) r[t] = tile + (t < T ? t : T - 1) * dpad;
        }
        if (direct && dtype == kF16)
            tile_groups<kF16>(r, T, q, dpad, nfull, last, G, S + t0, ldS, pf, pn);
        else if (direct && dtype == kBF16)
            tile_groups<kBF16>(r, T, q, dpad, nfull, last, G, S + t0, ldS, pf, pn);
        else
            tile_groups<kF32>(r, T, q, dpad, nfull, last, G, S + t0, ldS, pf, pn);
    }
}

void scores(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad,
            const float* q, int32_t G, float* S, int64_t ldS, float* tile, const uint16_t* qraw, float scale) {
    scores_pf(rows, count, nullptr, 0, dtype, sdim, d, dpad, q, G, S, ldS, tile, qraw, scale);
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
                                avx512_level::select, avx512_level::pv, avx512_level::vsum,
                                nullptr, avx512_level::pv_packed, avx512_level::scores_kt,
                                avx512_level::scores_pf, avx512_level::pv_pf};
    return &ops;
}

}  // namespace topth_cpu
