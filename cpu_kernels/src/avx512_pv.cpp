// AVX-512 level, stage 3: P.V over the kept-union rows only. Rows come as a list of
// pointers (one per kept position, resolved through the block table by the caller); every
// query head of the group accumulates w_h,t * v_t with register blocking (up to 4 heads x
// 4 chunks of 16 floats per pass). Rows with contiguous head_dim are read straight from the
// cache and converted in registers, visited in a strided order when scattered (see
// visit_stride) and prefetched ahead (pv_direct_all, spread over the arithmetic), a block of 16 equally spaced rows
// addressed from its first row (RowRun, avx512_common.h); rows with a strided head_dim are
// converted a tile of 32 rows at a time to float32 in L1 first (no software prefetch;
// scattered lists in the same strided order, their weights gathered per tile). The caller
// passes the whole kept list of an item at once, so prefetching runs across it; pv_pf takes the
// rows to put into L2 from its caller instead (the P.V walk of unit_walk.cpp). Also the V-row
// sum for the VMC mean (value_mean absent).
#include "avx512_common.h"
#include "pv_visit.h"

namespace topth_cpu {
namespace avx512_level {
namespace {

constexpr int64_t kTile = 32;

template <int HB, int NCB>
inline void pv_block(const float* tile, int32_t dpad, int64_t T, const float* w, int64_t ldw, float* acc) {
    __m512 a[HB][NCB];
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 4
        for (int c = 0; c < NCB; ++c) a[h][c] = _mm512_loadu_ps(acc + int64_t(h) * dpad + 16 * c);
    for (int64_t t = 0; t < T; ++t) {
        __m512 v[NCB];
#pragma GCC unroll 4
        for (int c = 0; c < NCB; ++c) v[c] = _mm512_loadu_ps(tile + t * dpad + 16 * c);
#pragma GCC unroll 4
        for (int h = 0; h < HB; ++h) {
            const __m512 wv = _mm512_set1_ps(w[h * ldw + t]);
#pragma GCC unroll 4
            for (int c = 0; c < NCB; ++c) a[h][c] = _mm512_fmadd_ps(wv, v[c], a[h][c]);
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 4
        for (int c = 0; c < NCB; ++c) _mm512_storeu_ps(acc + int64_t(h) * dpad + 16 * c, a[h][c]);
}

template <int HB>
inline void pv_heads(const float* tile, int32_t dpad, int64_t T, const float* w, int64_t ldw, float* acc, int ncb) {
    switch (ncb) {
        case 1: pv_block<HB, 1>(tile, dpad, T, w, ldw, acc); break;
        case 2: pv_block<HB, 2>(tile, dpad, T, w, ldw, acc); break;
        case 3: pv_block<HB, 3>(tile, dpad, T, w, ldw, acc); break;
        default: pv_block<HB, 4>(tile, dpad, T, w, ldw, acc); break;
    }
}

// Visit order of a kept list (strided when scattered) and the weights of a block of visits:
// pv_visit.h, which says why. Rows are prefetched about kFarBytes ahead into L2 (not a
// contiguous run of short rows: one_run) and, for a scattered list, kRowBlock visits ahead into
// L1 too, one row per visited row (pv_direct_all, pv_rows).
using pv_visit::block_weights;
using pv_visit::visit_stride;

// The direct path (head_dim contiguous) in one pass over the rows: blocks of kRowBlock rows
// (in visit order); each block serves every head block (up to 4 heads) and column block (up
// to 4 vectors of 16 floats) with the accumulators in registers, the block's rows re-read
// from L1, so no row is fetched from memory twice however large head_dim or the group is.
// bfloat16 rows with head_dim a multiple of 32 are converted pairwise (kSplit): one load of
// 32 elements gives the even elements (shifted up) and the odd ones (masked), one
// instruction each, and the accumulators hold each 32-element chunk as [16 even | 16 odd]
// (pv() permutes them back at the end).
// vLLM's AMX cache (kPacked): a row's 16-element vector c is the even (low) or odd (high)
// half of the 32-bit lanes of one 64-byte line, lines `cstride` bytes apart; the row pointer
// points at its own first element, so its parity is bit 1 of the address (regions are 4-byte
// aligned) and the conversion is one shift or one mask.
constexpr int kSplit = 3;   // pseudo dtype: bfloat16, pairwise conversion
constexpr int kPacked = 4;  // pseudo dtype: bfloat16 in vLLM's AMX V packing
constexpr int64_t kRowBlock = 16;

// The lines of the bytes one pv_rows call reads from a row at p (column block at byte offset
// off, NV vectors), prefetched into L2 (l2) or L1.
template <int DT, int NV>
inline void prefetch_part(const uint8_t* p, int64_t off, int64_t cstride, bool l2) {
    constexpr int64_t vb = DT == kF32 ? 64 : 32;  // bytes of one vector in the row (kPacked: one line each)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) {
        if (DT != kPacked && DT != kF32 && c % 2) continue;
        const uint8_t* a = DT == kPacked ? p + off + c * cstride : p + off + c * vb;
        if (l2)
            prefetch_l2(a);
        else
            prefetch_l1(a);
    }
}

// acc[h][c] += w[h][t] * v_t[16 c ..] for the R rows of one block (rb.at(t): RowPtrs or RowRun,
// avx512_common.h), rows at byte offset `off`; vector NV - 1 masked by `last` (plain dtypes).
// With PF, the rows pf[t] into L2 and (pn not null) pn[t] into L1, the part of each this call
// reads, one row per visited row: prefetches spread over the block's arithmetic (VisitAhead,
// rows_ahead.h).
template <int DT, int HB, int NV, bool PF, class A>
inline void pv_rows(A rb, int64_t R, int64_t off, __mmask16 last, const float* w, int64_t ldw,
                    float* acc, int32_t dpad, int64_t cstride, const uint8_t* const* pf, const uint8_t* const* pn) {
    constexpr int64_t es = DT == kF32 ? 4 : 2;
    __m512 a[HB][NV];
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 4
        for (int c = 0; c < NV; ++c) a[h][c] = _mm512_loadu_ps(acc + int64_t(h) * dpad + 16 * c);
    const __m512i hi16 = _mm512_set1_epi32(int32_t(0xFFFF0000u));
    for (int64_t t = 0; t < R; ++t) {
        if constexpr (PF) {
            prefetch_part<DT, NV>(pf[t], off, cstride, true);
            if (pn) prefetch_part<DT, NV>(pn[t], off, cstride, false);
        }
        const uint8_t* p = rb.at(t) + off;
        __m512 v[NV];
        if constexpr (DT == kPacked) {
            const uintptr_t odd = (reinterpret_cast<uintptr_t>(rb.at(t)) >> 1) & 1u;
            const uint8_t* line = rb.at(t) - 2 * odd + off;
            if (odd) {
#pragma GCC unroll 4
                for (int c = 0; c < NV; ++c)
                    v[c] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(line + c * cstride), hi16));
            } else {
#pragma GCC unroll 4
                for (int c = 0; c < NV; ++c)
                    v[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(line + c * cstride), 16));
            }
        } else if constexpr (DT == kSplit) {
#pragma GCC unroll 2
            for (int j = 0; j < NV / 2; ++j) {
                const __m512i x = _mm512_loadu_si512(p + 64 * j);
                v[2 * j] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
                v[2 * j + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, hi16));
            }
        } else {
#pragma GCC unroll 4
            for (int c = 0; c < NV; ++c) v[c] = load16(p + 16 * c * es, DT, c + 1 == NV ? last : __mmask16(0xFFFF));
        }
#pragma GCC unroll 4
        for (int h = 0; h < HB; ++h) {
            const __m512 wv = _mm512_set1_ps(w[h * ldw + t]);
#pragma GCC unroll 4
            for (int c = 0; c < NV; ++c) a[h][c] = _mm512_fmadd_ps(wv, v[c], a[h][c]);
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 4
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + int64_t(h) * dpad + 16 * c, a[h][c]);
}

template <int DT, int HB, bool PF, class A>
inline void pv_rows_nv(A rb, int64_t R, int64_t off, int nv, __mmask16 last, const float* w,
                       int64_t ldw, float* acc, int32_t dpad, int64_t cstride, const uint8_t* const* pf,
                       const uint8_t* const* pn) {
    switch (nv) {
        case 1: pv_rows<DT, HB, 1, PF>(rb, R, off, last, w, ldw, acc, dpad, cstride, pf, pn); break;
        case 2: pv_rows<DT, HB, 2, PF>(rb, R, off, last, w, ldw, acc, dpad, cstride, pf, pn); break;
        case 3: pv_rows<DT, HB, 3, PF>(rb, R, off, last, w, ldw, acc, dpad, cstride, pf, pn); break;
        default: pv_rows<DT, HB, 4, PF>(rb, R, off, last, w, ldw, acc, dpad, cstride, pf, pn); break;
    }
}

template <int DT, int HB, class A>
inline void pv_rows_pf(A rb, int64_t R, int64_t off, int nv, __mmask16 last, const float* w,
                       int64_t ldw, float* acc, int32_t dpad, int64_t cstride, const uint8_t* const* pf,
                       const uint8_t* const* pn) {
    if (pf) pv_rows_nv<DT, HB, true>(rb, R, off, nv, last, w, ldw, acc, dpad, cstride, pf, pn);
    else pv_rows_nv<DT, HB, false>(rb, R, off, nv, last, w, ldw, acc, dpad, cstride, pf, pn);
}

// Permutes each 32-float chunk of the G accumulator rows between natural order and
// [16 even | 16 odd] (to_split: natural -> split).
inline void split_order(float* acc, int32_t G, int32_t d, int32_t dpad, bool to_split) {
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int32_t h = 0; h < G; ++h)
        for (int32_t c = 0; c < d; c += 32) {
            float* p = acc + int64_t(h) * dpad + c;
            const __m512 x = _mm512_loadu_ps(p), y = _mm512_loadu_ps(p + 16);
            _mm512_storeu_ps(p, _mm512_permutex2var_ps(x, to_split ? ev : lo, y));
            _mm512_storeu_ps(p + 16, _mm512_permutex2var_ps(x, to_split ? od : hi, y));
        }
}

// Every head block (up to 4 heads) and column block (up to 4 vectors) of one block of R visits;
// the first head block also issues the prefetches of pf (may be null) and pn (may be null;
// only with pf), each column block those of its own bytes.
template <int DT, class A>
inline void pv_heads_all(A rb, int64_t R, int64_t k0, const int64_t* vis, int64_t stride, int32_t d, int32_t dpad,
                         int32_t nct, const float* wk, int64_t ldw, int32_t G, float* acc, float* wbuf,
                         int64_t cstride, const uint8_t* const* pf, const uint8_t* const* pn) {
    for (int32_t h0 = 0; h0 < G; h0 += 4, pf = pn = nullptr) {
        const int hb = G - h0 < 4 ? G - h0 : 4;
        int64_t lw = 0;
        const float* w = block_weights(wk, ldw, h0, hb, k0, vis, R, stride, wbuf, kRowBlock, &lw);
        for (int32_t c0 = 0; c0 < nct; c0 += 4) {
            const int nv = nct - c0 < 4 ? nct - c0 : 4;
            const __mmask16 last = tail_mask(d - 16 * (c0 + nv - 1));
            const int64_t off = int64_t(c0) * cstride;
            float* o = acc + int64_t(h0) * dpad + 16 * c0;
            switch (hb) {
                case 1: pv_rows_pf<DT, 1>(rb, R, off, nv, last, w, lw, o, dpad, cstride, pf, pn); break;
                case 2: pv_rows_pf<DT, 2>(rb, R, off, nv, last, w, lw, o, dpad, cstride, pf, pn); break;
                case 3: pv_rows_pf<DT, 3>(rb, R, off, nv, last, w, lw, o, dpad, cstride, pf, pn); break;
                default: pv_rows_pf<DT, 4>(rb, R, off, nv, last, w, lw, o, dpad, cstride, pf, pn); break;
            }
        }
    }
}

// cstride: bytes between a row's consecutive 16-element vectors (kPacked; the others: 0, set
// to 16 elements here).
// scattered: the caller's flag (a sparse list): visited with visit_stride(count), and the only
// lists also prefetched into L1.
// An ascending list (dense or nearly dense) relies on the L2 prefetch and the hardware
// prefetchers: the L1 step on top did not help it end to end on AMD Zen 4 (docs/cpu.md,
// "Software prefetch"). An ascending list that is one contiguous run of short rows (one_run: a
// dense BNSD range of rows up to 128 bytes) gets no software prefetch and relies on the
// hardware prefetchers alone. The first `far` rows of a list get no software prefetch into L2.
// The prefetches of a block are spread over its rows (pv_rows), not issued before it.
// pf_list given (unit_pv; an ascending list): pf_list[t] (t < pf_count) goes into L2 while
// row t is read, instead of the rows further down this list.
template <int DT>
void pv_direct_all(const uint8_t* const* rows, int64_t count, int32_t d, int32_t dpad, const float* wk, int64_t ldw,
                   int32_t G, float* acc, bool scattered, int64_t cstride, const uint8_t* const* pf_list = nullptr,
                   int64_t pf_count = 0) {
    constexpr int64_t es = DT == kF32 ? 4 : 2;
    const int64_t stride = scattered ? visit_stride(count) : 1;
    const int64_t row_bytes = int64_t(d) * es;
    if (DT != kPacked) cstride = 16 * es;
    const int32_t nct = (d + 15) / 16;
    const int64_t far = far_rows(row_bytes);
    const uint8_t* rb[kRowBlock];
    int64_t vis[kRowBlock];
    float wbuf[4 * kRowBlock];
    int64_t tv = 0;                                    // row of the next step (scattered)
    rows_ahead::VisitAhead<kRowBlock> ahead(rows, count, stride, far);
    // one run: the hardware prefetchers
    const bool prefetch = !pf_list && (scattered || !one_run(rows, count, row_bytes));
    const uint8_t* given[kRowBlock];
    for (int64_t k0 = 0; k0 < count; k0 += kRowBlock) {
        const int64_t R = count - k0 < kRowBlock ? count - k0 : kRowBlock;
        const uint8_t* const* blk = rows + k0;  // an ascending list's block: its rows in place
        if (scattered) {
            for (int64_t t = 0; t < R; ++t) {
                vis[t] = tv;
                rb[t] = rows[tv];
                tv += stride; tv -= tv >= count ? count : 0;
            }
            blk = rb;
        }
        const uint8_t* const* pn;  // the rows to prefetch, one per row of this block
        const uint8_t* const* pf;
        ahead.block(k0, R, scattered, prefetch, &pn, &pf);
        if (pf_list) pf = given_rows(pf_list, k0, pf_count, kRowBlock, given);
        const int64_t st = !scattered && R == kRowBlock ? tile_stride(rows + k0) : 0;
        if (st)
            pv_heads_all<DT>(RowRun{rows[k0], st}, R, k0, vis, stride, d, dpad, nct, wk, ldw, G, acc, wbuf, cstride,
                             pf, pn);
        else
            pv_heads_all<DT>(RowPtrs{blk}, R, k0, vis, stride, d, dpad, nct, wk, ldw, G, acc, wbuf, cstride, pf, pn);
    }
}

inline void load_tile(const uint8_t* const* rows, int64_t t0, int64_t T, int64_t count, int32_t dtype, int64_t sdim,
                      int32_t d, int32_t dpad, float* tile) {
    if (sdim == 1) {
        const int64_t row_bytes = int64_t(d) * (dtype == kF32 ? 4 : 2);
        for (int64_t t = t0 + kTile; t < count && t < t0 + 2 * kTile; ++t) prefetch_row(rows[t], row_bytes);
    }
    for (int64_t t = 0; t < T; ++t) load_row(rows[t0 + t], dtype, sdim, d, dpad, tile + t * dpad);
}

// Every row path of pv and pv_pf (pf_list only for ascending lists).
void pv_any(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad,
            const float* wk, int64_t ldw, int32_t G, float* acc, float* tile, int32_t scattered,
            const uint8_t* const* pf, int64_t pf_count) {
    if (count <= 0) return;
    const bool sc = scattered != 0;
    if (sdim == 1) {
        if (dtype == kF32) {
            pv_direct_all<kF32>(rows, count, d, dpad, wk, ldw, G, acc, sc, 0, pf, pf_count);
        } else if (dtype == kBF16 && d % 32 == 0) {
            split_order(acc, G, d, dpad, true);
            pv_direct_all<kSplit>(rows, count, d, dpad, wk, ldw, G, acc, sc, 0, pf, pf_count);
            split_order(acc, G, d, dpad, false);
        } else if (dtype == kBF16) {
            pv_direct_all<kBF16>(rows, count, d, dpad, wk, ldw, G, acc, sc, 0, pf, pf_count);
        } else {
            pv_direct_all<kF16>(rows, count, d, dpad, wk, ldw, G, acc, sc, 0, pf, pf_count);
        }
        return;
    }
    const int64_t stride = sc ? visit_stride(count) : 1;
    // tile path (head_dim strided, no software prefetch): rows of the steps of one tile converted
    // to float32 first; with a stride, the tile's weights are gathered per block of 4 heads
    const int32_t nct = dpad / 16;
    int64_t vis[kTile];
    int64_t tv = 0;  // row of the next step
    for (int64_t t0 = 0; t0 < count; t0 += kTile) {
        const int64_t T = count - t0 < kTile ? count - t0 : kTile;
        for (int64_t t = 0; t < T; ++t) {
            vis[t] = tv;
            tv += stride; tv -= tv >= count ? count : 0;
        }
        for (int64_t t = 0; t < T; ++t) load_row(rows[vis[t]], dtype, sdim, d, dpad, tile + t * dpad);
        for (int32_t h0 = 0; h0 < G; h0 += 4) {
            const int hb = G - h0 < 4 ? G - h0 : 4;
            float wbuf[4 * kTile];
            int64_t lw = 0;
            const float* w = block_weights(wk, ldw, h0, hb, t0, vis, T, stride, wbuf, kTile, &lw);
            for (int32_t c0 = 0; c0 < nct; c0 += 4) {
                const int ncb = nct - c0 < 4 ? nct - c0 : 4;
                const float* tl = tile + 16 * c0;
                float* o = acc + int64_t(h0) * dpad + 16 * c0;
                switch (hb) {
                    case 1: pv_heads<1>(tl, dpad, T, w, lw, o, ncb); break;
                    case 2: pv_heads<2>(tl, dpad, T, w, lw, o, ncb); break;
                    case 3: pv_heads<3>(tl, dpad, T, w, lw, o, ncb); break;
                    default: pv_heads<4>(tl, dpad, T, w, lw, o, ncb); break;
                }
            }
        }
    }
}

}  // namespace

void pv(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad,
        const float* wk, int64_t ldw, int32_t G, float* acc, float* tile, int32_t scattered) {
    pv_any(rows, count, dtype, sdim, d, dpad, wk, ldw, G, acc, tile, scattered, nullptr, 0);
}

void pv_pf(const uint8_t* const* rows, int64_t count, const uint8_t* const* pf, int64_t pf_count, int32_t dtype,
           int64_t sdim, int32_t d, int32_t dpad, const float* wk, int64_t ldw, int32_t G, float* acc, float* tile) {
    pv_any(rows, count, dtype, sdim, d, dpad, wk, ldw, G, acc, tile, 0, pf_count > 0 ? pf : nullptr, pf_count);
}

void pv_packed(const uint8_t* const* rows, int64_t count, int32_t d, int32_t dpad, int64_t gstride, const float* wk,
               int64_t ldw, int32_t G, float* acc, int32_t scattered) {
    if (count <= 0) return;
    pv_direct_all<kPacked>(rows, count, d, dpad, wk, ldw, G, acc, scattered != 0, gstride);
}

void vsum(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad,
          float* sum, float* tile) {
    for (int64_t t0 = 0; t0 < count; t0 += kTile) {
        const int64_t T = count - t0 < kTile ? count - t0 : kTile;
        load_tile(rows, t0, T, count, dtype, sdim, d, dpad, tile);
        for (int32_t c = 0; c < dpad; c += 16) {
            __m512 s = _mm512_loadu_ps(sum + c);
            for (int64_t t = 0; t < T; ++t) s = _mm512_add_ps(s, _mm512_loadu_ps(tile + t * dpad + c));
            _mm512_storeu_ps(sum + c, s);
        }
    }
}

}  // namespace avx512_level
}  // namespace topth_cpu
