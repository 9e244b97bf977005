// AVX2 level, stage 1: scores a = <q_h, k_j> for every query head of a KV group, reading each
// K row once from memory, plus the per-head max and exp-sum of the softmax.
//
// Rows with contiguous head_dim a multiple of 16 are multiplied straight from the cache,
// 16 elements per step as a pair of 8-float vectors (bfloat16 widened pairwise, the query
// reordered to match: avx2_common.h); other rows (strided, or a head_dim tail) are converted
// to float32 in a 16-row tile in L1 first. Register blocking: HB heads x RB rows of 8-lane
// accumulators (3 x 3, 4 x 2, 2 x 4 or 1 x 8), each half of a 16-element chunk in turn: the
// HB heads' query half is loaded once into registers and each row's half, loaded once,
// serves the HB heads, so a chunk costs 2 (HB + RB) loads for 2 HB RB FMAs (the load ports,
// not the FMA units, bound the older 3 x 2 blocking, which reloaded the query per row); one
// hadd tree then reduces up to 8 dot products at once.
// K stored transposed per block (vLLM's vector-ISA cache): lane-parallel over the slots, no
// reduction (scores_kt). Compiled with -mavx2 -mfma -mf16c (setup.py); selected at run time
// by dispatch.cpp.
#include "avx2_common.h"

namespace topth_cpu {
namespace avx2_level {
namespace {

// rows per tile of the direct path: a multiple of 8 (the hadd tree) and of every RB used
constexpr int64_t kTile = 24;

// acc[h * RB + t] += q_h . r_t over half H of chunk c: the HB query vectors are loaded once
// and held in registers, each row's half is loaded once and serves the HB heads.
// With NPF >= 1 (first half only), the line at the same offset of row pf[t] into L2, and with
// NPF 2 of row pn[t] into L1, where a 64-byte line starts: prefetches spread over the loads.
template <int DT, int HB, int RB, int H, int NPF>
inline void half_step(const uint8_t* const* r, int32_t c, const float* q, int64_t ldq, __m256* acc,
                      const uint8_t* const* pf, const uint8_t* const* pn) {
    constexpr int64_t es = DT == kF32 ? 4 : 2;
    const bool line = H == 0 && NPF > 0 && (16 * c * es) % 64 == 0;
    __m256 qv[HB];
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h) {
        qv[h] = _mm256_loadu_ps(q + h * ldq + 16 * c + 8 * H);
        // opaque to the optimiser: GCC would otherwise fold the load into every FMA, loading
        // the query RB times instead of once
        asm("" : "+x"(qv[h]));
    }
#pragma GCC unroll 8
    for (int t = 0; t < RB; ++t) {
        if constexpr (NPF >= 1 && H == 0)
            if (line) prefetch_l2(pf[t] + 16 * c * es);
        if constexpr (NPF >= 2 && H == 0)
            if (line) prefetch_l1(pn[t] + 16 * c * es);
        const __m256 k = load_half<DT, H>(r[t] + 16 * c * es);
#pragma GCC unroll 4
        for (int h = 0; h < HB; ++h) acc[h * RB + t] = _mm256_fmadd_ps(qv[h], k, acc[h * RB + t]);
    }
}

// red[h * kTile + t] = the 8-lane partial sums of <q_h, r_t> for t < RB, h < HB; nc chunks
// of 16 elements; q: HB rows of nc * 16 floats (ldq apart) in the order of DT's pairs.
// HB x RB accumulators + HB query vectors + one row vector fit the 16 registers; loads
// per chunk: 2 HB + 2 RB for 2 HB RB FMAs.
template <int DT, int HB, int RB, int NPF>
inline void block(const uint8_t* const* r, int32_t nc, const float* q, int64_t ldq, __m256* red,
                  const uint8_t* const* pf, const uint8_t* const* pn) {
    __m256 acc[HB * RB];
#pragma GCC unroll 12
    for (int i = 0; i < HB * RB; ++i) acc[i] = _mm256_setzero_ps();
    for (int32_t c = 0; c < nc; ++c) {
        half_step<DT, HB, RB, 0, NPF>(r, c, q, ldq, acc, pf, pn);
        half_step<DT, HB, RB, 1, 0>(r, c, q, ldq, acc, pf, pn);
    }
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 8
        for (int t = 0; t < RB; ++t) red[h * kTile + t] = acc[h * RB + t];
}

// Scores of up to kTile rows r[0, T) for heads h < HB: partial sums of RB rows at a time into
// red, then one hadd tree per 8 rows of a head, stored to S[h * ldS + t].
template <int DT, int HB, int RB, int NPF>
inline void rows_heads(const uint8_t* const* r, int64_t T, int32_t nc, const float* q, int64_t ldq, float* S,
                       int64_t ldS, const uint8_t* const* pf, const uint8_t* const* pn) {
    __m256 red[HB * kTile];
    const uint8_t* rb[RB];
    for (int64_t r0 = 0; r0 < T; r0 += RB) {
        const int64_t n = T - r0 < RB ? T - r0 : RB;
        for (int t = 0; t < RB; ++t) rb[t] = r[r0 + (t < n ? t : n - 1)];
        block<DT, HB, RB, NPF>(rb, nc, q, ldq, red + r0, NPF >= 1 ? pf + r0 : pf, NPF >= 2 ? pn + r0 : pn);
    }
    // partial sums past the last block of a short tile are never written: zero them, so the
    // reduction below reads no indeterminate values (their sums are not stored)
    const int64_t done = (T + RB - 1) / RB * RB;
    for (int h = 0; h < HB; ++h)
        for (int64_t t = done; t < (T + 7) / 8 * 8; ++t) red[h * kTile + t] = _mm256_setzero_ps();
    for (int h = 0; h < HB; ++h)
        for (int64_t t0 = 0; t0 < T; t0 += 8) {
            const __m256 v = hsum8(*reinterpret_cast<const __m256(*)[8]>(red + h * kTile + t0));
            if (T - t0 >= 8) {
                _mm256_storeu_ps(S + h * ldS + t0, v);
            } else {
                alignas(32) float tmp[8];
                _mm256_store_ps(tmp, v);
                for (int64_t t = 0; t < T - t0; ++t) S[h * ldS + t0 + t] = tmp[t];
            }
        }
}

// One head block (3, 4, 2 or 1 heads, by the heads left) of rows r[0, T); returns its heads.
template <int DT, int NPF>
inline int32_t head_block(const uint8_t* const* r, int64_t T, int32_t nc, const float* q, int64_t ldq, int32_t left,
                          float* S, int64_t ldS, const uint8_t* const* pf, const uint8_t* const* pn) {
    if (left == 3 || left == 6 || left >= 9) {
        rows_heads<DT, 3, 3, NPF>(r, T, nc, q, ldq, S, ldS, pf, pn);
        return 3;
    }
    if (left >= 4) {
        rows_heads<DT, 4, 2, NPF>(r, T, nc, q, ldq, S, ldS, pf, pn);
        return 4;
    }
    if (left == 2) {
        rows_heads<DT, 2, 4, NPF>(r, T, nc, q, ldq, S, ldS, pf, pn);
        return 2;
    }
    rows_heads<DT, 1, 8, NPF>(r, T, nc, q, ldq, S, ldS, pf, pn);
    return 1;
}

// Rows r[0, T) for every head of the group, in head blocks of 3, 4, 2 or 1 (HB x RB
// accumulators + HB query vectors + one row vector fit the 16 registers). The first head block
// issues the prefetches: pf[t] into L2, pn[t] into L1 (either may be null; pn only with pf).
template <int DT>
void tile_scores(const uint8_t* const* r, int64_t T, int32_t nc, const float* q, int64_t ldq, int32_t G, float* S,
                 int64_t ldS, const uint8_t* const* pf, const uint8_t* const* pn) {
    for (int32_t h0 = 0; h0 < G;) {
        const float* qh = q + h0 * ldq;
        float* Sh = S + h0 * ldS;
        if (h0 == 0 && pn) h0 += head_block<DT, 2>(r, T, nc, qh, ldq, G - h0, Sh, ldS, pf, pn);
        else if (h0 == 0 && pf) h0 += head_block<DT, 1>(r, T, nc, qh, ldq, G - h0, Sh, ldS, pf, pn);
        else h0 += head_block<DT, 0>(r, T, nc, qh, ldq, G - h0, Sh, ldS, pf, pn);
    }
}

// The query in DT's pair order: the given rows (natural order) or a split copy in buf.
template <int DT>
const float* query_for(const float* q, int32_t G, int32_t dpad, float* buf) {
    if constexpr (DT != kSplit) return q;
    memcpy(buf, q, sizeof(float) * size_t(G) * size_t(dpad));
    split16(buf, int64_t(G) * dpad);
    return buf;
}

// Rows [0, count). pf null: the stage prefetches its own list, the rows `far` ahead into L2
// and the next tile's into L1 (for one contiguous run of short rows only the next tile's,
// into L2 and L1). pf given (unit_scores): pf[t] (t < pf_count) into L2 while row t is read,
// and the next tile of this call's rows into L1.
template <int DT>
void direct(const uint8_t* const* rows, int64_t count, const uint8_t* const* pf_list, int64_t pf_count, int32_t d,
            int32_t dpad, const float* q, int32_t G, float* S, int64_t ldS, float* qbuf) {
    constexpr int64_t es = DT == kF32 ? 4 : 2;
    const int64_t row_bytes = int64_t(d) * es, far = far_rows(row_bytes);
    const float* qs = query_for<DT>(q, G, dpad, qbuf);
    constexpr int64_t kStep = kTile;
    // one contiguous run of short rows (BNSD): only the next tile's rows, into L2 and L1
    const bool run = !pf_list && one_run(rows, count, row_bytes);
    const uint8_t* pfar[kTile];
    const uint8_t* pnear[kTile];
    for (int64_t t0 = 0; t0 < count; t0 += kStep) {
        const int64_t T = count - t0 < kStep ? count - t0 : kStep;
        const uint8_t* const* pf = pf_list ? given_rows(pf_list, t0, pf_count, kTile, pfar)  // null past pf_count
                                   : run   ? nullptr
                                           : ahead_rows(rows, t0, count, far, kTile, pfar);
        const uint8_t* const* pn = ahead_rows(rows, t0, count, kStep, kTile, pnear);  // the next tile: always
        if (!pf) pf = pn;  // a run, or near rows left only (the end of the list): into L2 as well
        tile_scores<DT>(rows + t0, T, d / 16, qs, dpad, G, S + t0, ldS, pf, pn);
    }
}

}  // namespace

void scores_pf(const uint8_t* const* rows, int64_t count, const uint8_t* const* pf, int64_t pf_count, int32_t dtype,
               int64_t sdim, int32_t d, int32_t dpad, const float* q, int32_t G, float* S, int64_t ldS, float* tile,
               const uint16_t*, float) {
    if (count <= 0) return;
    // tile: 16 * dpad floats of converted rows, then the split query (G * dpad floats, scratch
    // of 40 * dpad + 1024 floats: Scratch::reserve) for groups of up to 16 heads
    float* qbuf = tile + 16 * int64_t(dpad);
    if (sdim == 1 && d % 16 == 0 && (dtype != kBF16 || G <= 16)) {
        if (dtype == kF32) direct<kF32>(rows, count, pf, pf_count, d, dpad, q, G, S, ldS, qbuf);
        else if (dtype == kF16) direct<kF16>(rows, count, pf, pf_count, d, dpad, q, G, S, ldS, qbuf);
        else direct<kSplit>(rows, count, pf, pf_count, d, dpad, q, G, S, ldS, qbuf);
        return;
    }
    const int64_t es = dtype == kF32 ? 4 : 2;
    const int64_t row_bytes = sdim == 1 ? int64_t(d) * es : 0, far = far_rows(row_bytes);
    const uint8_t* r[16];
    for (int64_t t0 = 0; t0 < count; t0 += 16) {
        const int64_t T = count - t0 < 16 ? count - t0 : 16;
        if (row_bytes && pf) {  // the caller's rows into L2, this call's next tile into L1
            const int64_t n2 = pf_count - t0, n1 = count - (t0 + 16);
            prefetch_rows(pf, t0, n2 < 16 ? n2 : 16, row_bytes, true);
            prefetch_rows(rows, t0 + 16, n1 < 16 ? n1 : 16, row_bytes, false);
        } else if (row_bytes) {
            prefetch_ahead(rows, t0, 16, count, row_bytes, far);
        }
        for (int64_t t = 0; t < T; ++t) {
            load_row(rows[t0 + t], dtype, sdim, d, dpad, tile + t * dpad);
            r[t] = reinterpret_cast<const uint8_t*>(tile + t * dpad);
        }
        tile_scores<kF32>(r, T, dpad / 16, q, dpad, G, S + t0, ldS, nullptr, nullptr);
    }
}

void scores(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad,
            const float* q, int32_t G, float* S, int64_t ldS, float* tile, const uint16_t*, float) {
    scores_pf(rows, count, nullptr, 0, dtype, sdim, d, dpad, q, G, S, ldS, tile, nullptr, 0.0f);
}

namespace {

// The lines of the next segment (the next block of the sequence), row after row and in address
// order within a row, handed out a few per iteration of the current segment's walk, so that the
// whole next segment is requested into L2 while this one is read (docs/cpu.md, "The AVX2
// transposed-K stage"). Every address lies in a row's `bytes` used bytes; a row that does not
// start on a line gets one more request, at its last byte, so its last line is covered too.
struct NextLines {
    const uint8_t* row = nullptr;
    int64_t col = 0, per_row = 0, bytes = 0, dstride = 0;
    inline void issue() {
        const int64_t off = 64 * col < bytes ? 64 * col : bytes - 1;
        prefetch_l2(row + off);
        if (++col == per_row) {
            col = 0;
            row += dstride;
        }
    }
};

// The float at p in all 8 lanes, loaded anew at every use: GCC would merge equal broadcasts of
// one iteration's pairs into one register per head, which does not fit the registers of the
// 3-head x 2-pair block (see kt_chunk).
inline __m256 broadcast_again(const float* p) {
    __m256 v;
    asm volatile("vbroadcastss %1, %0" : "=x"(v) : "m"(*p));
    return v;
}

// Slots [0, 16 W) of a transposed segment at k (element i of slot t at k + i * dstride +
// t * es) for HB heads: per head element i, one broadcast query element times 8 slots per FMA.
// The pairs of slot vectors are visited one at a time, so HB x 2W accumulators (at most 12),
// one pair and the broadcasts share the 16 registers; where one broadcast per head would not
// fit (3 heads x 2 pairs), the query element is broadcast anew for each pair (a load-port op).
// bfloat16 slots are widened pairwise ([8 even | 8 odd]) and interleaved back at the store.
// TAIL: only rem < 16 W slots exist; each row's slots are copied into a zeroed buffer first
// (nothing past the segment is read). share lines of nx are issued over the d iterations.
template <int DT, int HB, int W, bool TAIL>
inline void kt_chunk(const uint8_t* k, int64_t dstride, int32_t d, const float* q, int32_t dpad, int64_t rem,
                     float* S, int64_t ldS, NextLines& nx, int64_t share) {
    constexpr int64_t es = DT == kF32 ? 4 : 2;
    constexpr bool kAgain = HB * 2 * W + 2 + HB > 16;  // one broadcast per head would not fit
    __m256 acc[HB][2 * W];
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h)
#pragma GCC unroll 8
        for (int w = 0; w < 2 * W; ++w) acc[h][w] = _mm256_setzero_ps();
    alignas(32) uint8_t pad[64 * 4];
    if constexpr (TAIL) memset(pad, 0, sizeof pad);
    int64_t due = 0;
    for (int32_t i = 0; i < d; ++i) {
        const uint8_t* p = k + i * dstride;
        for (due += share; due >= d; due -= d) nx.issue();
        if constexpr (TAIL) {
            memcpy(pad, p, size_t(rem * es));
            p = pad;
        }
#pragma GCC unroll 4
        for (int w = 0; w < W; ++w) {
            __m256 a, b;
            load_pair<DT>(p + 16 * w * es, a, b);
#pragma GCC unroll 6
            for (int h = 0; h < HB; ++h) {
                const float* qe = q + h * dpad + i;
                const __m256 qb = kAgain ? broadcast_again(qe) : _mm256_broadcast_ss(qe);
                acc[h][2 * w] = _mm256_fmadd_ps(qb, a, acc[h][2 * w]);
                acc[h][2 * w + 1] = _mm256_fmadd_ps(qb, b, acc[h][2 * w + 1]);
            }
        }
    }
#pragma GCC unroll 6
    for (int h = 0; h < HB; ++h) {
        alignas(32) float out[16 * W];
#pragma GCC unroll 4
        for (int w = 0; w < W; ++w) {
            __m256 a = acc[h][2 * w], b = acc[h][2 * w + 1];
            if constexpr (DT == kSplit) {  // [even slots | odd slots] -> natural order
                const __m256 lo = _mm256_unpacklo_ps(a, b), hi = _mm256_unpackhi_ps(a, b);
                a = _mm256_permute2f128_ps(lo, hi, 0x20);
                b = _mm256_permute2f128_ps(lo, hi, 0x31);
            }
            float* o = TAIL ? out + 16 * w : S + h * ldS + 16 * w;
            _mm256_storeu_ps(o, a);
            _mm256_storeu_ps(o + 8, b);
        }
        if constexpr (TAIL)
            for (int64_t t = 0; t < rem; ++t) S[h * ldS + t] = out[t];
    }
}

// All `count` slots of the segment for heads [0, HB), in chunks of 16 W slots. With next
// (the first head block only), the lines of the next segment (next_count slots per row) are
// spread evenly over the chunks' iterations.
template <int DT, int HB, int W>
inline void kt_heads(const uint8_t* k, int64_t count, int64_t dstride, int32_t d, const float* q, int32_t dpad,
                     float* S, int64_t ldS, const uint8_t* next, int64_t next_count) {
    constexpr int64_t es = DT == kF32 ? 4 : 2, width = 16 * W;
    NextLines nx;
    int64_t lines = 0;
    if (next && next_count > 0) {
        nx.row = next;
        nx.bytes = next_count * es;
        const bool unaligned = reinterpret_cast<uintptr_t>(next) % 64 != 0 || dstride % 64 != 0;
        nx.per_row = (nx.bytes + 63) / 64 + (unaligned ? 1 : 0);
        nx.dstride = dstride;
        lines = nx.per_row * d;
    }
    const int64_t chunks = (count + width - 1) / width;
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t t0 = c * width, rem = count - t0;
        const int64_t share = (c + 1) * lines / chunks - c * lines / chunks;
        if (rem >= width) kt_chunk<DT, HB, W, false>(k + t0 * es, dstride, d, q, dpad, rem, S + t0, ldS, nx, share);
        else kt_chunk<DT, HB, W, true>(k + t0 * es, dstride, d, q, dpad, rem, S + t0, ldS, nx, share);
    }
}

// Every head of the group in head blocks of 3 (32 slots per chunk), 4 (16), 2 (32) or 1 (64).
template <int DT>
void kt_group(const uint8_t* k, int64_t count, int64_t dstride, int32_t d, const float* q, int32_t dpad, int32_t G,
              float* S, int64_t ldS, const uint8_t* next, int64_t next_count) {
    for (int32_t h0 = 0; h0 < G;) {
        const float* qh = q + int64_t(h0) * dpad;
        float* Sh = S + h0 * ldS;
        const uint8_t* ahead = h0 == 0 ? next : nullptr;  // prefetched by the first block only
        switch (G - h0) {
            case 1: kt_heads<DT, 1, 4>(k, count, dstride, d, qh, dpad, Sh, ldS, ahead, next_count); h0 += 1; break;
            case 2: kt_heads<DT, 2, 2>(k, count, dstride, d, qh, dpad, Sh, ldS, ahead, next_count); h0 += 2; break;
            case 3: kt_heads<DT, 3, 2>(k, count, dstride, d, qh, dpad, Sh, ldS, ahead, next_count); h0 += 3; break;
            default: kt_heads<DT, 4, 1>(k, count, dstride, d, qh, dpad, Sh, ldS, ahead, next_count); h0 += 4; break;
        }
    }
}

}  // namespace

void scores_kt(const uint8_t* k, int64_t count, int64_t dstride, int32_t dtype, int32_t d, int32_t dpad,
               const float* q, int32_t G, float* S, int64_t ldS, const uint8_t* next, int64_t next_count,
               const uint16_t*, float) {
    if (count <= 0) return;
    if (dtype == kBF16) kt_group<kSplit>(k, count, dstride, d, q, dpad, G, S, ldS, next, next_count);
    else if (dtype == kF16) kt_group<kF16>(k, count, dstride, d, q, dpad, G, S, ldS, next, next_count);
    else kt_group<kF32>(k, count, dstride, d, q, dpad, G, S, ldS, next, next_count);
}

void max_bad(const float* S, int64_t len, float* m_out, int32_t* bad_out) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    __m256 bad = _mm256_setzero_ps();
    const __m256 inf = _mm256_set1_ps(INFINITY), ninf = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < len; j += 8) {
        const __m256i tm = lane_mask(len - j);
        const __m256 x = _mm256_blendv_ps(ninf, _mm256_maskload_ps(S + j, tm), _mm256_castsi256_ps(tm));
        m = _mm256_max_ps(x, m);                                       // returns m where x is NaN
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(x, inf, _CMP_NLT_UQ));  // NaN or +inf
    }
    *m_out = hmax(m);
    *bad_out = _mm256_movemask_ps(bad) != 0;
}

float sum_exp(const float* S, int64_t len, float mref) {
    __m256 acc = _mm256_setzero_ps();
    const __m256 m = _mm256_set1_ps(mref), ninf = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < len; j += 8) {
        const __m256i tm = lane_mask(len - j);
        const __m256 x = _mm256_blendv_ps(ninf, _mm256_maskload_ps(S + j, tm), _mm256_castsi256_ps(tm));
        acc = _mm256_add_ps(acc, exp256(_mm256_sub_ps(x, m)));
    }
    return hsum(acc);
}

}  // namespace avx2_level

const SimdOps* ops_avx2() {
    static const SimdOps ops = {"avx2", avx2_level::scores, avx2_level::max_bad, avx2_level::sum_exp,
                                avx2_level::select, avx2_level::pv, avx2_level::vsum,
                                nullptr, nullptr, avx2_level::scores_kt, avx2_level::scores_pf,
                                avx2_level::pv_pf};
    return &ops;
}

}  // namespace topth_cpu
