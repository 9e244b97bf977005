// SIMD level "avx512bf16": the AVX-512 level with bfloat16 scores on AVX512-BF16.
//
// For a bfloat16 cache with contiguous head_dim, a = scale * <q_h, k_j> is computed with
// vdpbf16ps straight from the cache rows and the query as given (bfloat16, unscaled): no
// conversion of K to float32 and half the multiply instructions. Every product of two
// bfloat16 values is exact in float32 and vdpbf16ps adds the two products of each lane
// into the float32 accumulator one after the other, each addition rounded to nearest even,
// as a chain of float32 FMAs would; what differs from the avx512 level is the order of the
// additions (lane i sums elements 2i and 2i + 1 of each 32-element chunk), the scale
// applied once to the dot product instead of to the query, and that the instruction treats
// subnormal inputs and results as zero (docs/cpu.md, "SIMD levels"). A tile of 16 equally
// spaced rows is loaded from its first row and the stride (RowRun); the rows ahead are
// prefetched one line per line loaded (ahead_rows), except a contiguous run of short rows,
// which gets no software prefetch (one_run; rows_ahead.h); scores_pf puts the caller's rows
// into L2 instead (the K walk of unit_walk.cpp). Rows of head_dim 32, 64 or 128 that lie back
// to back are not cut into tiles at all: run_scores reads such a run block after block from its
// first row: the whole list without software prefetch when it is one run of rows of at most
// 128 bytes (a BNSD range of head_dim 32 or 64), else each run of at least kMinRun rows (the
// blocks of a paged HND list; a BNSD range of head_dim 128 is one such run) with the list's
// rows far ahead prefetched, and the shorter runs between them through the tile loop
// (tile_range). Every other stage, and other dtypes or strided rows, run the avx512 level's
// code.
//
// Compiled with the AVX-512 flags plus -mavx512bf16 (setup.py); chosen at run time only
// when the CPU reports AVX512-BF16 (dispatch.cpp).
#include "avx512_common.h"

#include <type_traits>

namespace topth_cpu {
namespace avx512bf16_level {
namespace {

using avx512_level::reduce16;
using avx512_level::store_block;
using avx512_level::far_rows;
using avx512_level::kNearMinBytes;
using avx512_level::one_run;
using avx512_level::ahead_rows;
using avx512_level::given_rows;
using avx512_level::prefetch_l1;
using avx512_level::prefetch_l2;
using avx512_level::RowPtrs;
using avx512_level::RowRun;
using avx512_level::tile_stride;

inline __m512bh bf16_chunk(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh bf16_chunk(const uint16_t* p, __mmask32 m) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }

inline const uint16_t* u16(const uint8_t* p) { return reinterpret_cast<const uint16_t*>(p); }

// acc[h * RB + t] += <q_h, r_t> over 32-element chunks (pairs of bfloat16 per lane): nfull
// full ones, then one masked by `last` when last != 0 (nothing past head_dim is read). Rows
// r.at(t): RowPtrs or RowRun (avx512_common.h). With each load, the same line of row pf[t]
// (NPF >= 1) into L2 and of row pn[t] (NPF 2) into L1: prefetches spread over the arithmetic
// (ahead_rows, rows_ahead.h).
template <int HB, int RB, int NPF, class A>
inline void dp_block(A r, const uint16_t* q, int32_t dpad, int32_t nfull, __mmask32 last,
                     __m512 (&acc)[16], const uint8_t* const* pf, const uint8_t* const* pn) {
    for (int32_t c = 0; c < nfull; ++c) {
        __m512bh qv[HB];
#pragma GCC unroll 4
        for (int h = 0; h < HB; ++h) qv[h] = bf16_chunk(q + h * dpad + 32 * c);
#pragma GCC unroll 16
        for (int t = 0; t < RB; ++t) {
            if constexpr (NPF >= 1) prefetch_l2(pf[t] + 64 * c);
            if constexpr (NPF >= 2) prefetch_l1(pn[t] + 64 * c);
            const __m512bh k = bf16_chunk(u16(r.at(t)) + 32 * c);
#pragma GCC unroll 4
            for (int h = 0; h < HB; ++h) acc[h * RB + t] = _mm512_dpbf16_ps(acc[h * RB + t], qv[h], k);
        }
    }
    if (last) {
        __m512bh qv[HB];
#pragma GCC unroll 4
        for (int h = 0; h < HB; ++h) qv[h] = bf16_chunk(q + h * dpad + 32 * nfull, last);
#pragma GCC unroll 16
        for (int t = 0; t < RB; ++t) {
            if constexpr (NPF >= 1) prefetch_l2(pf[t] + 64 * nfull);
            if constexpr (NPF >= 2) prefetch_l1(pn[t] + 64 * nfull);
            const __m512bh k = bf16_chunk(u16(r.at(t)) + 32 * nfull, last);
#pragma GCC unroll 4
            for (int h = 0; h < HB; ++h) acc[h * RB + t] = _mm512_dpbf16_ps(acc[h * RB + t], qv[h], k);
        }
    }
}

template <int HB, int RB, int NPF, class A>
inline void tile_heads(A r, int64_t T, const uint16_t* q, int32_t dpad, int32_t nfull,
                       __mmask32 last, __m512 scale, float* S, int64_t ldS, const uint8_t* const* pf,
                       const uint8_t* const* pn) {
    for (int64_t r0 = 0; r0 < T; r0 += RB) {
        __m512 acc[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
        dp_block<HB, RB, NPF>(r.from(r0), q, dpad, nfull, last, acc, NPF >= 1 ? pf + r0 : pf,
                              NPF >= 2 ? pn + r0 : pn);
        store_block<HB, RB>(_mm512_mul_ps(reduce16(acc), scale), S + r0, ldS, T - r0);
    }
}

// The number of rows from rows[0] on that lie back to back (rows[t] == rows[0] + t * rb).
inline int64_t run_length(const uint8_t* const* rows, int64_t count, int64_t rb) {
    const __m512i step = _mm512_set1_epi64(8 * rb);
    __m512i want = _mm512_add_epi64(_mm512_set1_epi64(reinterpret_cast<int64_t>(rows[0])),
                                    _mm512_mullo_epi64(_mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7), _mm512_set1_epi64(rb)));
    int64_t t = 0;
    for (; t + 8 <= count; t += 8, want = _mm512_add_epi64(want, step)) {
        const __mmask8 bad = _mm512_cmpneq_epi64_mask(_mm512_loadu_si512(rows + t), want);
        if (bad) return t + __builtin_ctz(bad);
    }
    for (; t < count; ++t)
        if (rows[t] != rows[0] + t * rb) return t;
    return count;
}

constexpr int64_t kMinRun = 32;

// HB heads over count rows of one contiguous run (row t at base + t * rb): blocks of RB rows,
// each block's HB x RB dot products reduced at once as in tile_heads, the query's NC chunks
// of 32 elements (head_dim = 32 NC) held in registers where HB x NC <= 8 (else each chunk is
// read from the query where it is used: 16 chunks and 16 accumulators would not fit). The
// last block repeats its last row up to RB rows (only T scores are stored). In the full
// blocks of rows t < nfl, one line of fl[t] per line loaded goes into L2 (the tail block
// prefetches nothing).
template <int HB, int RB, int NC>
inline void run_heads(const uint8_t* base, int64_t count, int64_t rb, const uint16_t* q, int32_t dpad, __m512 sc,
                      float* S, int64_t ldS, const uint8_t* const* fl, int64_t nfl) {
    constexpr bool kInRegs = HB * NC <= 8;  // else each chunk is read from q where it is used
    __m512bh qv[HB][kInRegs ? NC : 1];
    if constexpr (kInRegs) {
#pragma GCC unroll 4
        for (int h = 0; h < HB; ++h)
#pragma GCC unroll 4
            for (int c = 0; c < NC; ++c) qv[h][c] = bf16_chunk(q + h * dpad + 32 * c);
    }
    const auto block = [&](int64_t r0, int64_t T, auto pf) {
        __m512 acc[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c)
#pragma GCC unroll 16
            for (int t = 0; t < RB; ++t) {
                if constexpr (decltype(pf)::value) prefetch_l2(fl[r0 + t] + 64 * c);
                const __m512bh k = bf16_chunk(u16(base + (r0 + (t < T ? t : T - 1)) * rb) + 32 * c);
#pragma GCC unroll 4
                for (int h = 0; h < HB; ++h) {
                    __m512bh qc;
                    if constexpr (kInRegs) qc = qv[h][c];
                    else qc = bf16_chunk(q + h * dpad + 32 * c);
                    acc[h * RB + t] = _mm512_dpbf16_ps(acc[h * RB + t], qc, k);
                }
            }
        store_block<HB, RB>(_mm512_mul_ps(reduce16(acc), sc), S + r0, ldS, T);
    };
    int64_t r0 = 0;
    for (; r0 + RB <= count && r0 + RB <= nfl; r0 += RB) block(r0, RB, std::true_type{});
    for (; r0 + RB <= count; r0 += RB) block(r0, RB, std::false_type{});
    if (r0 < count) block(r0, count - r0, std::false_type{});
}

constexpr int64_t kRunChunk = 128;  // rows per pass of every head block when G > 4

// Scores of one contiguous run of rows of head_dim 32 NC (a BNSD range, or the rows of one
// paged HND block, which the tile loop reads 16 rows at a time from their pointers): one pass
// over the run for up to 4 heads; more heads take it kRunChunk rows at a time, every head
// block per chunk, so that each row comes from memory once. Fewer instructions per row than the
// tile loop (no per-tile addressing, a compile-time chunk count, up to 8 query chunks in
// registers), and more of the memory stream hidden behind them where measured (docs/cpu.md,
// "One contiguous run"). fl[t], t < nfl: a row to prefetch into L2 with row t (the list's rows
// far ahead, which for a paged list lie in the next blocks); the first head block issues them.
template <int NC>
inline void run_scores(int32_t G, const uint8_t* base, int64_t count, int64_t rb, const uint16_t* q, int32_t dpad,
                       __m512 sc, float* S, int64_t ldS, const uint8_t* const* fl = nullptr, int64_t nfl = 0) {
    const int64_t chunk = G <= 4 ? count : kRunChunk;
    for (int64_t c0 = 0; c0 < count; c0 += chunk) {
        const int64_t n = count - c0 < chunk ? count - c0 : chunk;
        for (int32_t h0 = 0; h0 < G;) {
            const uint8_t* b = base + c0 * rb;
            const uint16_t* qh = q + int64_t(h0) * dpad;
            float* Sh = S + h0 * ldS + c0;
            const int64_t pn = fl && h0 == 0 ? nfl - c0 : 0;  // the first head block prefetches
            const uint8_t* const* pfl = pn > 0 ? fl + c0 : nullptr;
            switch (G - h0) {
                case 1: run_heads<1, 16, NC>(b, n, rb, qh, dpad, sc, Sh, ldS, pfl, pn); h0 += 1; break;
                case 2: run_heads<2, 8, NC>(b, n, rb, qh, dpad, sc, Sh, ldS, pfl, pn); h0 += 2; break;
                case 3: run_heads<3, 4, NC>(b, n, rb, qh, dpad, sc, Sh, ldS, pfl, pn); h0 += 3; break;
                default: run_heads<4, 4, NC>(b, n, rb, qh, dpad, sc, Sh, ldS, pfl, pn); h0 += 4; break;
            }
        }
    }
}

// run_scores for head_dim d = 32 NC, NC in {1, 2, 4} (the caller checks d).
inline void run_scores_d(int32_t d, int32_t G, const uint8_t* base, int64_t count, int64_t rb, const uint16_t* q,
                         int32_t dpad, __m512 sc, float* S, int64_t ldS, const uint8_t* const* fl = nullptr,
                         int64_t nfl = 0) {
    if (d == 32) run_scores<1>(G, base, count, rb, q, dpad, sc, S, ldS, fl, nfl);
    else if (d == 64) run_scores<2>(G, base, count, rb, q, dpad, sc, S, ldS, fl, nfl);
    else run_scores<4>(G, base, count, rb, q, dpad, sc, S, ldS, fl, nfl);
}

// One block of hb heads (1-4) of a tile, with NPF streams of prefetches (0: none, 1: pf
// into L2, 2: also pn into L1).
template <int NPF, class A>
inline void tile_block(A r, int hb, int64_t T, const uint16_t* qh, int32_t dpad, int32_t nfull, __mmask32 last,
                       __m512 sc, float* Sh, int64_t ldS, const uint8_t* const* pf, const uint8_t* const* pn) {
    switch (hb) {
        case 1: tile_heads<1, 16, NPF>(r, T, qh, dpad, nfull, last, sc, Sh, ldS, pf, pn); break;
        case 2: tile_heads<2, 8, NPF>(r, T, qh, dpad, nfull, last, sc, Sh, ldS, pf, pn); break;
        case 3: tile_heads<3, 4, NPF>(r, T, qh, dpad, nfull, last, sc, Sh, ldS, pf, pn); break;
        default: tile_heads<4, 4, NPF>(r, T, qh, dpad, nfull, last, sc, Sh, ldS, pf, pn); break;
    }
}

template <class A>
inline void tile_npf(int npf, A r, int hb, int64_t T, const uint16_t* qh, int32_t dpad, int32_t nfull, __mmask32 last,
                     __m512 sc, float* Sh, int64_t ldS, const uint8_t* const* pf, const uint8_t* const* pn) {
    if (npf == 2) tile_block<2>(r, hb, T, qh, dpad, nfull, last, sc, Sh, ldS, pf, pn);
    else if (npf == 1) tile_block<1>(r, hb, T, qh, dpad, nfull, last, sc, Sh, ldS, pf, pn);
    else tile_block<0>(r, hb, T, qh, dpad, nfull, last, sc, Sh, ldS, pf, pn);
}

// The tile loop over list positions [b, e) of rows[0 .. count): 16 rows at a time through
// their pointers (RowRun where a tile is equally spaced), the prefetches looking ahead in the
// whole list (pf_list given: the caller's rows into L2).
void tile_range(const uint8_t* const* rows, int64_t count, int64_t b, int64_t e, const uint8_t* const* pf_list,
                int64_t pf_count, bool prefetch, int32_t d, int32_t dpad, int32_t G, float* S, int64_t ldS,
                const uint16_t* qraw, __m512 sc) {
    const int32_t nfull = d / 32;
    const __mmask32 last = d % 32 ? __mmask32((1u << (d % 32)) - 1u) : __mmask32(0);
    const int64_t row_bytes = int64_t(d) * 2, far = far_rows(row_bytes);
    const uint8_t* r[16];
    const uint8_t* pfar[16];
    const uint8_t* pnear[16];
    const bool near = prefetch && row_bytes >= kNearMinBytes;
    for (int64_t t0 = b; t0 < e; t0 += 16) {
        const int64_t T = e - t0 < 16 ? e - t0 : 16;
        const int64_t st = T == 16 ? tile_stride(rows + t0) : 0;
        const uint8_t* const* pf = !prefetch ? nullptr
                                   : pf_list ? given_rows(pf_list, t0, pf_count, 16, pfar)
                                             : ahead_rows(rows, t0, count, far, 16, pfar);
        const uint8_t* const* pn = near ? ahead_rows(rows, t0, count, 16, 16, pnear) : nullptr;
        if (!pf) pf = pn;  // near rows left only (the end of the list): into L2 as well
        if (!st)
            for (int64_t t = 0; t < 16; ++t) r[t] = rows[t0 + (t < T ? t : T - 1)];
        for (int32_t h0 = 0; h0 < G;) {
            const uint16_t* qh = qraw + int64_t(h0) * dpad;
            float* Sh = S + h0 * ldS + t0;
            const int hb = G - h0 < 4 ? G - h0 : 4;
            const int npf = h0 ? 0 : pn ? 2 : pf ? 1 : 0;  // the first head block prefetches
            if (st) tile_npf(npf, RowRun{rows[t0], st}, hb, T, qh, dpad, nfull, last, sc, Sh, ldS, pf, pn);
            else tile_npf(npf, RowPtrs{r}, hb, T, qh, dpad, nfull, last, sc, Sh, ldS, pf, pn);
            h0 += hb;
        }
    }
}

}  // namespace

// pf_list given (unit_scores' walk): as the avx512 level's scores_pf (pf_list into L2, also for
// a contiguous run).
void scores_pf(const uint8_t* const* rows, int64_t count, const uint8_t* const* pf_list, int64_t pf_count,
               int32_t dtype, int64_t sdim, int32_t d, int32_t dpad, const float* q, int32_t G, float* S, int64_t ldS,
               float* tile, const uint16_t* qraw, float scale) {
    if (dtype != kBF16 || sdim != 1 || qraw == nullptr) {
        avx512_level::scores_pf(rows, count, pf_list, pf_count, dtype, sdim, d, dpad, q, G, S, ldS, tile, qraw, scale);
        return;
    }
    const __m512 sc = _mm512_set1_ps(scale);
    const int64_t row_bytes = int64_t(d) * 2, far = far_rows(row_bytes);
    const bool prefetch = pf_list || !one_run(rows, count, row_bytes);
    if (pf_list || (d != 32 && d != 64 && d != 128)) {
        tile_range(rows, count, 0, count, pf_list, pf_count, prefetch, d, dpad, G, S, ldS, qraw, sc);
        return;
    }
    // one run of short rows (BNSD, head_dim 32 or 64: one_run takes rows of at most 128 bytes):
    // the hardware streams it
    if (!prefetch && d <= 64 && run_length(rows, count, row_bytes) == count) {
        run_scores_d(d, G, rows[0], count, row_bytes, qraw, dpad, sc, S, ldS);
        return;
    }
    // Runs of at least kMinRun rows (the blocks of a paged HND list) each in one loop, with the
    // list's rows far ahead (the next blocks) prefetched into L2; the shorter runs between them
    // (blocks of fewer rows, a range starting late in a block) through the tile loop.
    int64_t t0 = 0, s0 = 0;  // [s0, t0): short runs not scored yet
    while (t0 < count) {
        const int64_t len = run_length(rows + t0, count - t0, row_bytes);
        if (len < kMinRun) {
            t0 += len;
            continue;
        }
        if (s0 < t0) tile_range(rows, count, s0, t0, nullptr, 0, true, d, dpad, G, S, ldS, qraw, sc);
        const int64_t nfl = count - t0 - far;
        const uint8_t* const* fl = nfl > 0 ? rows + t0 + far : nullptr;
        run_scores_d(d, G, rows[t0], len, row_bytes, qraw, dpad, sc, S + t0, ldS, fl, nfl);
        t0 += len;
        s0 = t0;
    }
    if (s0 < count) tile_range(rows, count, s0, count, nullptr, 0, true, d, dpad, G, S, ldS, qraw, sc);
}

void scores(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad,
            const float* q, int32_t G, float* S, int64_t ldS, float* tile, const uint16_t* qraw, float scale) {
    scores_pf(rows, count, nullptr, 0, dtype, sdim, d, dpad, q, G, S, ldS, tile, qraw, scale);
}

}  // namespace avx512bf16_level

// Constant-initialised (no code of this translation unit runs before the CPU check).
const SimdOps* ops_avx512bf16() {
    static const SimdOps ops = {"avx512bf16", avx512bf16_level::scores, avx512_level::max_bad,
                                avx512_level::sum_exp, avx512_level::select, avx512_level::pv,
                                avx512_level::vsum, nullptr, avx512_level::pv_packed,
                                avx512bf16_level::scores_kt, avx512bf16_level::scores_pf,
                                avx512_level::pv_pf};
    return &ops;
}

}  // namespace topth_cpu
