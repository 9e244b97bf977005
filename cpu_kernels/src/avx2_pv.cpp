// AVX2 level, stage 3: P.V over the kept-union rows only (the AVX-512 stage's design with
// 8-float vectors). Rows come as a list of pointers; every query head of the group
// accumulates w_h,t * v_t. Rows with contiguous head_dim a multiple of 16 are read straight
// from the cache and converted in registers (bfloat16 pairwise: the accumulators hold each
// 16-float chunk as [8 even | 8 odd] during the call), in blocks of 16 rows: each block
// serves every head block (up to 2 heads x 32 columns, or 3-4 heads x 16 columns: at most 8
// accumulators, which GCC keeps in registers; 12 spill; float32 keeps 3 x 32, see pv_block)
// with the block's rows re-read from L1, so no row is fetched from memory twice. A
// scattered list is visited in a strided order (pv_visit.h, visit_stride, explains why).
// Every list is prefetched at two distances, spread over the rows of each block, but one run
// of short rows, only the next block (pv_direct); pv_pf takes the rows to put into L2 from its
// caller instead.
// Other rows are converted to a float32 tile first. Also the V-row sum for the VMC mean
// (value_mean absent).
#include "avx2_common.h"
#include "pv_visit.h"

namespace topth_cpu {
namespace avx2_level {
namespace {

constexpr int64_t kRowBlock = 16;

using pv_visit::block_weights;
using pv_visit::visit_stride;

// acc[h][16 c ..] += w[h][t] * v_t[16 c ..] for the R rows rb (at byte offset off), NP
// 16-element chunks (pairs of vectors) per pass. With PF, per row t the lines this pass reads
// (those starting a 64-byte line) of row pf[t] into L2 and, pn not null, of row pn[t] into L1:
// prefetches spread over the block's arithmetic.
template <int DT, int HB, int NP, bool PF>
inline void pv_rows(const uint8_t* const* rb, int64_t R, int64_t off, const float* w, int64_t ldw, float* acc,
                    int32_t dpad, const uint8_t* const* pf, const uint8_t* const* pn) {
    __m256 a[HB][2 * NP];
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 4
        for (int c = 0; c < 2 * NP; ++c) a[h][c] = _mm256_loadu_ps(acc + int64_t(h) * dpad + 8 * c);
    constexpr int64_t es = DT == kF32 ? 4 : 2;
    for (int64_t t = 0; t < R; ++t) {
        const uint8_t* p = rb[t] + off;
#pragma GCC unroll 2
        for (int j = 0; j < NP; ++j) {
            if constexpr (PF) {
                const int64_t o = off + 16 * j * es;
                if (o % 64 == 0) {
                    prefetch_l2(pf[t] + o);
                    if (pn) prefetch_l1(pn[t] + o);
                }
            }
            __m256 x, y;
            load_pair<DT>(p + 16 * j * es, x, y);
#pragma GCC unroll 4
            for (int h = 0; h < HB; ++h) {
                const __m256 wv = _mm256_broadcast_ss(w + h * ldw + t);
                a[h][2 * j] = _mm256_fmadd_ps(wv, x, a[h][2 * j]);
                a[h][2 * j + 1] = _mm256_fmadd_ps(wv, y, a[h][2 * j + 1]);
            }
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 4
        for (int c = 0; c < 2 * NP; ++c) _mm256_storeu_ps(acc + int64_t(h) * dpad + 8 * c, a[h][c]);
}

template <int DT, bool PF>
inline void pv_heads(const uint8_t* const* rb, int64_t R, int32_t nch, const float* w, int64_t lw, int hb, float* o,
                     int32_t dpad, const uint8_t* const* pf, const uint8_t* const* pn);

// One block of rows for every head block and column chunk. nch: 16-element chunks per row.
// The first head block issues the prefetches of pf (may be null) and pn (may be null; only
// with pf).
template <int DT>
inline void pv_block(const uint8_t* const* rb, int64_t R, int32_t nch, const float* wk, int64_t ldw, int64_t t0,
                     const int64_t* vis, int64_t stride, int32_t G, float* acc, int32_t dpad,
                     const uint8_t* const* pf, const uint8_t* const* pn) {
    float wbuf[4 * kRowBlock];
    for (int32_t h0 = 0; h0 < G;) {
        const int hb = G - h0 >= 4 && G - h0 != 6 ? 4 : (G - h0 >= 3 ? 3 : G - h0);
        int64_t lw = 0;
        const float* w = block_weights(wk, ldw, h0, hb, t0, vis, R, stride, wbuf, kRowBlock, &lw);
        float* o = acc + int64_t(h0) * dpad;
        if (h0 == 0 && pf) pv_heads<DT, true>(rb, R, nch, w, lw, hb, o, dpad, pf, pn);
        else pv_heads<DT, false>(rb, R, nch, w, lw, hb, o, dpad, pf, pn);
        h0 += hb;
    }
}

// Every column chunk of one head block (hb heads, weights w) of a block of rows.
template <int DT, bool PF>
inline void pv_heads(const uint8_t* const* rb, int64_t R, int32_t nch, const float* w, int64_t lw, int hb, float* o,
                     int32_t dpad, const uint8_t* const* pf, const uint8_t* const* pn) {
    constexpr int64_t es = DT == kF32 ? 4 : 2;
    for (int32_t c = 0; c < nch;) {
        const int64_t off = 16 * int64_t(c) * es;
        // one pair per pass for 3-4 heads (3 heads x 2 pairs spill two accumulators), except
        // 3 heads of float32: there a pass over one 64-byte line per row, 4 lines apart,
        // read cold 1.5x slower than the spilling 2-pair pass (docs/cpu.md)
        if (hb == 4 || (hb == 3 && es == 2)) {
            if (hb == 4) pv_rows<DT, 4, 1, PF>(rb, R, off, w, lw, o + 16 * c, dpad, pf, pn);
            else pv_rows<DT, 3, 1, PF>(rb, R, off, w, lw, o + 16 * c, dpad, pf, pn);
            c += 1;
        } else if (nch - c >= 2) {
            switch (hb) {
                case 1: pv_rows<DT, 1, 2, PF>(rb, R, off, w, lw, o + 16 * c, dpad, pf, pn); break;
                case 2: pv_rows<DT, 2, 2, PF>(rb, R, off, w, lw, o + 16 * c, dpad, pf, pn); break;
                default: pv_rows<DT, 3, 2, PF>(rb, R, off, w, lw, o + 16 * c, dpad, pf, pn); break;
            }
            c += 2;
        } else {
            switch (hb) {
                case 1: pv_rows<DT, 1, 1, PF>(rb, R, off, w, lw, o + 16 * c, dpad, pf, pn); break;
                case 2: pv_rows<DT, 2, 1, PF>(rb, R, off, w, lw, o + 16 * c, dpad, pf, pn); break;
                default: pv_rows<DT, 3, 1, PF>(rb, R, off, w, lw, o + 16 * c, dpad, pf, pn); break;
            }
            c += 1;
        }
    }
}

// Rows `rows` (head_dim d a multiple of 16, contiguous) in visit order, kRowBlock at a time,
// the next block prefetched into L1 and the rows about 12 KiB ahead into L2, one row ahead per
// row of a block (pv_rows); for a list that is one run of short rows (one_run) only the next
// block, into L2 and L1. pf_list given (unit_pv; stride 1): pf_list[t] (t < pf_count) goes
// into L2 while row t is read, instead of the rows further down this list.
template <int DT>
void pv_direct(const uint8_t* const* rows, int64_t count, int32_t d, int32_t dpad, const float* wk, int64_t ldw,
               int32_t G, float* acc, int64_t stride, const uint8_t* const* pf_list, int64_t pf_count) {
    constexpr int64_t es = DT == kF32 ? 4 : 2;
    const int64_t row_bytes = int64_t(d) * es, far = far_rows(row_bytes);
    const uint8_t* rb[kRowBlock];
    const uint8_t* given[kRowBlock];
    int64_t vis[kRowBlock];
    int64_t tv = 0;                              // row of the next step
    rows_ahead::VisitAhead<kRowBlock> ahead(rows, count, stride, far);
    // every list but one run of short rows: also the rows about 12 KiB ahead (or pf_list) into L2
    const bool prefetch = pf_list || stride != 1 || !one_run(rows, count, row_bytes);
    for (int64_t k0 = 0; k0 < count; k0 += kRowBlock) {
        const int64_t R = count - k0 < kRowBlock ? count - k0 : kRowBlock;
        for (int64_t t = 0; t < R; ++t) {
            vis[t] = tv;
            rb[t] = rows[tv];
            tv += stride; tv -= tv >= count ? count : 0;
        }
        const uint8_t* const* pn;  // the rows to prefetch, one per row of this block
        const uint8_t* const* pf;
        ahead.block(k0, R, true, prefetch && !pf_list, &pn, &pf);  // the next block: always
        // the caller's rows; past pf_count the next block's, as without pf_list
        if (const uint8_t* const* g = given_rows(pf_list, k0, pf_count, kRowBlock, given)) pf = g;
        pv_block<DT>(rb, R, d / 16, wk, ldw, k0, vis, stride, G, acc, dpad, pf, pn);
    }
}

// Every row path of pv and pv_pf (pf_list only with stride 1).
void pv_any(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad,
            const float* wk, int64_t ldw, int32_t G, float* acc, float* tile, int64_t stride,
            const uint8_t* const* pf_list, int64_t pf_count) {
    if (count <= 0) return;
    if (sdim == 1 && d % 16 == 0) {
        if (dtype == kF32) {
            pv_direct<kF32>(rows, count, d, dpad, wk, ldw, G, acc, stride, pf_list, pf_count);
        } else if (dtype == kF16) {
            pv_direct<kF16>(rows, count, d, dpad, wk, ldw, G, acc, stride, pf_list, pf_count);
        } else {
            split16(acc, int64_t(G) * dpad);
            pv_direct<kSplit>(rows, count, d, dpad, wk, ldw, G, acc, stride, pf_list, pf_count);
            merge16(acc, int64_t(G) * dpad);
        }
        return;
    }
    // tile path: kRowBlock rows of the visit converted to float32 (natural order) first
    const uint8_t* rb[kRowBlock];
    int64_t vis[kRowBlock];
    int64_t tv = 0;
    for (int64_t k0 = 0; k0 < count; k0 += kRowBlock) {
        const int64_t R = count - k0 < kRowBlock ? count - k0 : kRowBlock;
        for (int64_t t = 0; t < R; ++t) {
            vis[t] = tv;
            if (sdim == 1) prefetch_row(rows[(tv + kRowBlock * stride) % count], int64_t(d) * (dtype == kF32 ? 4 : 2),
                                        false);
            load_row(rows[tv], dtype, sdim, d, dpad, tile + t * dpad);
            rb[t] = reinterpret_cast<const uint8_t*>(tile + t * dpad);
            tv += stride; tv -= tv >= count ? count : 0;
        }
        pv_block<kF32>(rb, R, dpad / 16, wk, ldw, k0, vis, stride, G, acc, dpad, nullptr, nullptr);
    }
}

}  // namespace

void pv(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad,
        const float* wk, int64_t ldw, int32_t G, float* acc, float* tile, int32_t scattered) {
    pv_any(rows, count, dtype, sdim, d, dpad, wk, ldw, G, acc, tile, scattered ? visit_stride(count) : 1, nullptr, 0);
}

void pv_pf(const uint8_t* const* rows, int64_t count, const uint8_t* const* pf, int64_t pf_count, int32_t dtype,
           int64_t sdim, int32_t d, int32_t dpad, const float* wk, int64_t ldw, int32_t G, float* acc, float* tile) {
    pv_any(rows, count, dtype, sdim, d, dpad, wk, ldw, G, acc, tile, 1, pf_count > 0 ? pf : nullptr, pf_count);
}

void vsum(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad,
          float* sum, float* tile) {
    constexpr int64_t kTile = 32;
    for (int64_t t0 = 0; t0 < count; t0 += kTile) {
        const int64_t T = count - t0 < kTile ? count - t0 : kTile;
        for (int64_t t = 0; t < T; ++t) load_row(rows[t0 + t], dtype, sdim, d, dpad, tile + t * dpad);
        for (int32_t c = 0; c < dpad; c += 8) {
            __m256 s = _mm256_loadu_ps(sum + c);
            for (int64_t t = 0; t < T; ++t) s = _mm256_add_ps(s, _mm256_loadu_ps(tile + t * dpad + c));
            _mm256_storeu_ps(sum + c, s);
        }
    }
}

}  // namespace avx2_level
}  // namespace topth_cpu
