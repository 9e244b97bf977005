// AVX-512 level, stage 3: P.V over the kept-union rows only. Rows come as a list of
// pointers (one per kept position, resolved through the block table by the caller); every
// query head of the group accumulates w_h,t * v_t with register blocking (up to 4 heads x
// 4 chunks of 16 floats per pass). Rows with contiguous head_dim are read straight from the
// cache and converted in registers when one pass covers all heads (G <= 4; float32 rows
// also for larger groups), visited in a strided order when scattered (see visit_stride) with
// rows prefetched at two distances; other cases convert a tile of 32 rows to float32 in L1
// first (the next tile prefetched; scattered lists in the same strided order, their weights
// gathered per tile). The caller passes the whole kept list of an item at once, so
// prefetching runs across it. Also the V-row sum for the VMC mean (value_mean absent).
#include "avx512_common.h"

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

// Order and prefetch of the direct path. Kept rows are scattered: visited in ascending order,
// the hardware stream prefetchers follow the ascent and also fetch the unkept rows between
// them, so P.V over 30 % of the rows cost as much as over all of them. A scattered list (the
// caller's flag: at most 3/4 of the item's range) is therefore visited in a strided order
// (row k * stride mod count, stride a prime not dividing count: every row once, consecutive
// visits far apart), and rows are prefetched by software, kAhead ahead into L1 and about
// kFarBytes ahead into L2. Measured (microbenchmark of this loop, 64 x 8192 rows of 128 bytes,
// one thread, CPU time, loaded machine): 30 % of the rows took 1.2 ms strided against 3.3 ms
// ascending with the L1 prefetch only (3.5 ms for all rows ascending); 10 %: 0.40 against
// 0.64 ms. Dense lists stay ascending (strided was slower for a float32 dense call of the
// kernel). The sum order of P.V changes (deterministic for a given kept list).
// A stride coprime with count (1 for short lists).
inline int64_t visit_stride(int64_t count) {
    if (count < 256) return 1;
    const int64_t primes[4] = {97, 89, 83, 79};
    for (int i = 0; i < 4; ++i)
        if (count % primes[i]) return primes[i];
    return 1;
}

// acc[h][c] += w_h,t * v_t[16 (c0 + c) ..] for rows t < count read in place (DT: dtype),
// chunk c0 + NCB - 1 masked by `last` when last != 0xFFFF.
template <int DT, int HB, int NCB>
inline void pv_direct(const uint8_t* const* rows, int64_t count, int32_t c0, __mmask16 last, int64_t row_bytes,
                      const float* w, int64_t ldw, float* acc, int32_t dpad, int64_t stride) {
    constexpr int64_t es = DT == kF32 ? 4 : 2;
    __m512 a[HB][NCB];
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 4
        for (int c = 0; c < NCB; ++c) a[h][c] = _mm512_loadu_ps(acc + int64_t(h) * dpad + 16 * (c0 + c));
    const int64_t far = far_rows(row_bytes) < count ? far_rows(row_bytes) : count;
    const int64_t near = kAhead < count ? kAhead : count;
    // t: the row visited at step k (k * stride mod count); tn, tf: at steps k + near, k + far
    int64_t t = 0, tn = (near * stride) % count, tf = (far * stride) % count;
    for (int64_t k = 0; k < count; ++k) {
        if (k + far < count) prefetch_row_l2(rows[tf] + 16 * c0 * es, row_bytes);
        if (k + near < count) prefetch_row(rows[tn] + 16 * c0 * es, row_bytes);
        const uint8_t* p = rows[t] + 16 * c0 * es;
        __m512 v[NCB];
#pragma GCC unroll 4
        for (int c = 0; c < NCB; ++c) v[c] = load16(p + 16 * c * es, DT, c + 1 == NCB ? last : __mmask16(0xFFFF));
#pragma GCC unroll 4
        for (int h = 0; h < HB; ++h) {
            const __m512 wv = _mm512_set1_ps(w[h * ldw + t]);
#pragma GCC unroll 4
            for (int c = 0; c < NCB; ++c) a[h][c] = _mm512_fmadd_ps(wv, v[c], a[h][c]);
        }
        t += stride; t -= t >= count ? count : 0;
        tn += stride; tn -= tn >= count ? count : 0;
        tf += stride; tf -= tf >= count ? count : 0;
    }
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 4
        for (int c = 0; c < NCB; ++c) _mm512_storeu_ps(acc + int64_t(h) * dpad + 16 * (c0 + c), a[h][c]);
}

template <int DT, int HB>
inline void pv_direct_heads(const uint8_t* const* rows, int64_t count, int32_t c0, int ncb, __mmask16 last,
                            int64_t row_bytes, const float* w, int64_t ldw, float* acc, int32_t dpad, int64_t stride) {
    switch (ncb) {
        case 1: pv_direct<DT, HB, 1>(rows, count, c0, last, row_bytes, w, ldw, acc, dpad, stride); break;
        case 2: pv_direct<DT, HB, 2>(rows, count, c0, last, row_bytes, w, ldw, acc, dpad, stride); break;
        case 3: pv_direct<DT, HB, 3>(rows, count, c0, last, row_bytes, w, ldw, acc, dpad, stride); break;
        default: pv_direct<DT, HB, 4>(rows, count, c0, last, row_bytes, w, ldw, acc, dpad, stride); break;
    }
}

template <int DT>
void pv_direct_all(const uint8_t* const* rows, int64_t count, int32_t d, int32_t dpad, const float* wk, int64_t ldw,
                   int32_t G, float* acc, int64_t stride) {
    const int32_t nct = (d + 15) / 16;
    for (int32_t h0 = 0; h0 < G; h0 += 4) {
        const int hb = G - h0 < 4 ? G - h0 : 4;
        for (int32_t c0 = 0; c0 < nct; c0 += 4) {
            const int ncb = nct - c0 < 4 ? nct - c0 : 4;
            // the last chunk of this pass is masked when it runs past head_dim
            const __mmask16 last = tail_mask(d - 16 * (c0 + ncb - 1));
            const int64_t row_bytes = int64_t(d - 16 * c0 < 16 * ncb ? d - 16 * c0 : 16 * ncb) * (DT == kF32 ? 4 : 2);
            const float* w = wk + h0 * ldw;
            float* o = acc + int64_t(h0) * dpad;
            switch (hb) {
                case 1: pv_direct_heads<DT, 1>(rows, count, c0, ncb, last, row_bytes, w, ldw, o, dpad, stride); break;
                case 2: pv_direct_heads<DT, 2>(rows, count, c0, ncb, last, row_bytes, w, ldw, o, dpad, stride); break;
                case 3: pv_direct_heads<DT, 3>(rows, count, c0, ncb, last, row_bytes, w, ldw, o, dpad, stride); break;
                default: pv_direct_heads<DT, 4>(rows, count, c0, ncb, last, row_bytes, w, ldw, o, dpad, stride); break;
            }
        }
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

}  // namespace

void pv(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad,
        const float* wk, int64_t ldw, int32_t G, float* acc, float* tile, int32_t scattered) {
    if (count <= 0) return;
    const int64_t stride = scattered ? visit_stride(count) : 1;
    if (sdim == 1 && (G <= 4 || dtype == kF32)) {  // each row converted once (float32: reloaded from L1)
        if (dtype == kF32) pv_direct_all<kF32>(rows, count, d, dpad, wk, ldw, G, acc, stride);
        else if (dtype == kBF16) pv_direct_all<kBF16>(rows, count, d, dpad, wk, ldw, G, acc, stride);
        else pv_direct_all<kF16>(rows, count, d, dpad, wk, ldw, G, acc, stride);
        return;
    }
    // tile path: rows of the steps of one tile converted to float32 first; with a stride, the
    // tile's weights are gathered per block of 4 heads
    const int32_t nct = dpad / 16;
    const int64_t row_bytes = int64_t(d) * (dtype == kF32 ? 4 : 2);
    const int64_t far = far_rows(row_bytes);
    int64_t vis[kTile];
    int64_t tv = 0;                               // row of the next step
    int64_t tn = (kTile * stride) % count;        // row of step t0 + kTile (next tile, into L1)
    int64_t tf = (far * stride) % count;          // row of step t0 + far (into L2, scattered only)
    for (int64_t t0 = 0; t0 < count; t0 += kTile) {
        const int64_t T = count - t0 < kTile ? count - t0 : kTile;
        for (int64_t t = 0; t < T; ++t) {
            vis[t] = tv;
            tv += stride; tv -= tv >= count ? count : 0;
        }
        if (sdim == 1) {
            for (int64_t k = t0 + kTile; k < count && k < t0 + 2 * kTile; ++k) {
                prefetch_row(rows[tn], row_bytes);
                tn += stride; tn -= tn >= count ? count : 0;
            }
            if (stride > 1)
                for (int64_t k = t0 + far; k < count && k < t0 + far + kTile; ++k) {
                    prefetch_row_l2(rows[tf], row_bytes);
                    tf += stride; tf -= tf >= count ? count : 0;
                }
        }
        for (int64_t t = 0; t < T; ++t) load_row(rows[vis[t]], dtype, sdim, d, dpad, tile + t * dpad);
        for (int32_t h0 = 0; h0 < G; h0 += 4) {
            const int hb = G - h0 < 4 ? G - h0 : 4;
            const float* w = wk + h0 * ldw + t0;
            int64_t lw = ldw;
            float wbuf[4 * kTile];
            if (stride > 1) {
                for (int h = 0; h < hb; ++h)
                    for (int64_t t = 0; t < T; ++t) wbuf[h * kTile + t] = wk[(h0 + h) * ldw + vis[t]];
                w = wbuf;
                lw = kTile;
            }
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
