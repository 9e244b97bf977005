// SIMD level "amx": the avx512bf16 level with bfloat16 scores on AMX tiles.
//
// Scores of 16 cache rows for the G query heads of a KV group are one tile product
// C[16 x G] = A[16 x 32] . B[32 x G] per 32-element chunk of head_dim: A is 16 K rows as they
// lie in the cache (one tile load with the rows' stride: BNSD, and paged NHD / HND within a
// block, have equally spaced rows), B is the bfloat16 query of the group in the pair-
// interleaved (VNNI) order the instruction reads, built once per call. Four C tiles (64 rows)
// are in flight so that the loads of one overlap the products of the other. Rows that are not
// equally spaced (a run crossing a block boundary) and the last partial tile are copied into
// a contiguous buffer first. The float32 tile is then transposed into the scores (gathers per
// head) and scaled, as the avx512bf16 level scales.
//
// Arithmetic: each product of two bfloat16 values is exact in float32, the accumulation is
// float32 (round to nearest even) in the instruction's order; like vdpbf16ps, subnormal
// inputs and results are treated as zero (docs/cpu.md, "SIMD levels"). Other dtypes, strided
// head_dim, head_dim not a multiple of 32 and groups of more than 16 heads run the
// avx512bf16 level's scores.
//
// Compiled with the AVX-512 flags plus -mavx512bf16 -mamx-tile -mamx-bf16 (setup.py); chosen
// at run time only when the CPU reports AMX-BF16 and Linux granted the tile state to the
// process (dispatch.cpp).
#include "avx512_common.h"

namespace topth_cpu {
namespace amx_level {
namespace {

struct alignas(64) TileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// tiles 0-3: C of four 16-row groups; 4, 5: their A chunks in turn; 6, 7: the query chunks
// (B) of even and odd chunks of head_dim
TileConfig config_for(int32_t G) {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
        c.rows[t] = 16;
        c.colsb[t] = t == 4 || t == 5 ? 64 : uint16_t(4 * G);
    }
    return c;
}

// Rows [t0, t0 + T) of the list as one tile source: in place when 16 equally spaced rows,
// else copied into buf (16 rows of d bfloat16, zeros past T).
inline const uint8_t* tile_source(const uint8_t* const* rows, int64_t t0, int64_t T, int32_t d, uint8_t* buf,
                                  int64_t* stride) {
    if (T == 16 && (*stride = avx512_level::tile_stride(rows + t0)) != 0) return rows[t0];
    const int64_t rb = int64_t(d) * 2;
    for (int64_t t = 0; t < 16; ++t) {
        if (t < T) memcpy(buf + t * rb, rows[t0 + t], size_t(rb));
        else memset(buf + t * rb, 0, size_t(rb));
    }
    *stride = rb;
    return buf;
}

// C tile rows (16 floats apart in cbuf) -> S[h * ldS + t], t < T, times scale.
inline void scatter_scores(const float* cbuf, int32_t G, int64_t T, __m512 scale, float* S, int64_t ldS) {
    const __m512i rowsx16 = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32(16));
    const __mmask16 m = avx512_level::tail_mask(T);
    for (int32_t h = 0; h < G; ++h) {
        const __m512 v = _mm512_i32gather_ps(_mm512_add_epi32(rowsx16, _mm512_set1_epi32(h)), cbuf, 4);
        _mm512_mask_storeu_ps(S + h * ldS, m, _mm512_mul_ps(v, scale));
    }
}

// scores_packed prefetches, chunk by chunk, the same 1 KiB chunk of the K tiles kTilesAhead
// tiles ahead of those it multiplies into L2, so the prefetches are spread over the tile
// products (a burst of whole tiles ahead was slower: docs/cpu.md, "AMX scores").
constexpr int64_t kTilesAhead = 4;

}  // namespace

void scores(const uint8_t* const* rows, int64_t count, int32_t dtype, int64_t sdim, int32_t d, int32_t dpad,
            const float* q, int32_t G, float* S, int64_t ldS, float* tile, const uint16_t* qraw, float scale) {
    if (dtype != kBF16 || sdim != 1 || qraw == nullptr || d % 32 != 0 || G > 16 || count <= 0) {
        avx512bf16_level::scores(rows, count, dtype, sdim, d, dpad, q, G, S, ldS, tile, qraw, scale);
        return;
    }
    // scratch (Scratch::tile holds >= 40 * dpad + 1024 floats): the query in VNNI order
    // [chunk][16 pairs][16 heads], the four C tiles, four copy buffers of 16 rows
    const int32_t nch = d / 32;
    uint32_t* bq = reinterpret_cast<uint32_t*>(tile);
    float* cbuf = tile + 256 * nch;
    uint8_t* abuf = reinterpret_cast<uint8_t*>(cbuf + 1024);
    const int64_t rb = int64_t(d) * 2;
    for (int32_t c = 0; c < nch; ++c)
        for (int32_t p = 0; p < 16; ++p)
            for (int32_t h = 0; h < 16; ++h) {
                uint32_t v = 0;
                if (h < G) {
                    const uint16_t* qh = qraw + int64_t(h) * dpad + 32 * c + 2 * p;
                    v = uint32_t(qh[0]) | (uint32_t(qh[1]) << 16);
                }
                bq[(c * 16 + p) * 16 + h] = v;
            }
    const TileConfig cfg = config_for(G);
    _tile_loadconfig(&cfg);
    const __m512 sc = _mm512_set1_ps(scale);
    const int64_t far = avx512_level::far_rows(rb);
    // no software prefetch for one contiguous run of short rows (the hardware prefetchers
    // follow it; measured on AMX: docs/cpu.md, "AMX scores"); other lists keep the burst of the
    // next 16 rows into L1 and of the rows `far` ahead into L2, four of each before every 64 rows
    const bool prefetch = !avx512_level::one_run(rows, count, rb);
    if (nch <= 2) {  // the query stays in tiles 6 and 7 for the whole call
        _tile_loadd(6, bq, 64);
        if (nch == 2) _tile_loadd(7, bq + 256, 64);
    }
    for (int64_t t0 = 0; t0 < count; t0 += 64) {
        if (prefetch)
            for (int64_t u = 0; u < 64; u += 16) avx512_level::prefetch_ahead(rows, t0 + u, count, rb, far);
        int64_t T[4], st[4];
        const uint8_t* a[4];
        for (int g = 0; g < 4; ++g) {
            const int64_t left = count - t0 - 16 * g;
            T[g] = left <= 0 ? 0 : (left < 16 ? left : 16);
            a[g] = T[g] ? tile_source(rows, t0 + 16 * g, T[g], d, abuf + g * 16 * rb, &st[g]) : nullptr;
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int32_t c = 0; c < nch; ++c) {
            // B: tile 6 for even chunks, 7 for odd ones (reloaded per chunk past two chunks);
            // A: tiles 4 and 5 in turn
            const bool odd = c & 1;
            if (nch > 2) {
                if (odd) _tile_loadd(7, bq + c * 256, 64);
                else _tile_loadd(6, bq + c * 256, 64);
            }
            const int64_t off = 64 * c;
            if (odd) {
                _tile_loadd(4, a[0] + off, st[0]); _tile_dpbf16ps(0, 4, 7);
                if (T[1]) { _tile_loadd(5, a[1] + off, st[1]); _tile_dpbf16ps(1, 5, 7); }
                if (T[2]) { _tile_loadd(4, a[2] + off, st[2]); _tile_dpbf16ps(2, 4, 7); }
                if (T[3]) { _tile_loadd(5, a[3] + off, st[3]); _tile_dpbf16ps(3, 5, 7); }
            } else {
                _tile_loadd(4, a[0] + off, st[0]); _tile_dpbf16ps(0, 4, 6);
                if (T[1]) { _tile_loadd(5, a[1] + off, st[1]); _tile_dpbf16ps(1, 5, 6); }
                if (T[2]) { _tile_loadd(4, a[2] + off, st[2]); _tile_dpbf16ps(2, 4, 6); }
                if (T[3]) { _tile_loadd(5, a[3] + off, st[3]); _tile_dpbf16ps(3, 5, 6); }
            }
        }
        _tile_stored(0, cbuf, 64);
        if (T[1]) _tile_stored(1, cbuf + 256, 64);
        if (T[2]) _tile_stored(2, cbuf + 512, 64);
        if (T[3]) _tile_stored(3, cbuf + 768, 64);
        for (int g = 0; g < 4 && T[g]; ++g) scatter_scores(cbuf + 256 * g, G, T[g], sc, S + t0 + 16 * g, ldS);
    }
    _tile_release();
}

// vLLM's AMX cache (params.h, SimdOps::scores_packed): its K tiles are already the VNNI B
// operand of Q . K^T, so C[G x 16 slots] = Q[G x 32] . K[32 x 16] per 32-element chunk of
// head_dim gives the scores head-major: no copy, no transpose. Four C tiles in flight; the
// query chunk is the A tile (G rows, the bfloat16 query as given).
void scores_packed(const uint8_t* const* tiles, int64_t skip, int64_t count, int32_t d, int32_t dpad,
                   const uint16_t* qraw, int32_t G, float scale, float* S, int64_t ldS, float* tile) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = uint8_t(t < 6 ? G : 16);  // 0-3: C, 4: A (query chunk), 6, 7: B (K tiles)
        cfg.colsb[t] = 64;
    }
    cfg.rows[5] = 0;
    cfg.colsb[5] = 0;
    _tile_loadconfig(&cfg);
    const int32_t nch = d / 32;
    const int64_t ntiles = (skip + count + 15) / 16;
    const __m512 sc = _mm512_set1_ps(scale);
    float* cbuf = tile;  // four C tiles, 16 x 16 floats each
    for (int64_t i0 = 0; i0 < ntiles; i0 += 4) {
        const int64_t nt = ntiles - i0 < 4 ? ntiles - i0 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int32_t c = 0; c < nch; ++c) {
            _tile_loadd(4, qraw + 32 * c, int64_t(dpad) * 2);
            const int64_t off = int64_t(c) * 1024;  // 16 pairs x 64 bytes per chunk
            for (int64_t j = i0 + kTilesAhead; j < ntiles && j < i0 + kTilesAhead + nt; ++j)
                avx512_level::prefetch_row_l2(tiles[j] + off, 1024);
            _tile_loadd(6, tiles[i0] + off, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (nt > 1) { _tile_loadd(7, tiles[i0 + 1] + off, 64); _tile_dpbf16ps(1, 4, 7); }
            if (nt > 2) { _tile_loadd(6, tiles[i0 + 2] + off, 64); _tile_dpbf16ps(2, 4, 6); }
            if (nt > 3) { _tile_loadd(7, tiles[i0 + 3] + off, 64); _tile_dpbf16ps(3, 4, 7); }
        }
        _tile_stored(0, cbuf, 64);
        if (nt > 1) _tile_stored(1, cbuf + 256, 64);
        if (nt > 2) _tile_stored(2, cbuf + 512, 64);
        if (nt > 3) _tile_stored(3, cbuf + 768, 64);
        for (int64_t j = 0; j < nt; ++j) {
            const int64_t col = 16 * (i0 + j) - skip;  // position of lane 0
            const int64_t a = col < 0 ? -col : 0, e = count - col < 16 ? count - col : 16;
            const bool full = a == 0 && e == 16;
            const __mmask16 m = __mmask16(((1u << e) - 1u) & ~((1u << a) - 1u));
            for (int32_t h = 0; h < G; ++h) {
                const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(cbuf + 256 * j + 16 * h), sc);
                if (full) _mm512_storeu_ps(S + h * ldS + col, v);
                else _mm512_mask_compressstoreu_ps(S + h * ldS + col + a, m, v);  // lanes [a, e)
            }
        }
    }
    _tile_release();
}

}  // namespace amx_level

// Constant-initialised (no code of this translation unit runs before the CPU check).
const SimdOps* ops_amx() {
    static const SimdOps ops = {"amx", amx_level::scores, avx512_level::max_bad, avx512_level::sum_exp,
                                avx512_level::select, avx512_level::pv, avx512_level::vsum,
                                amx_level::scores_packed, avx512_level::pv_packed,
                                avx512bf16_level::scores_kt};
    return &ops;
}

}  // namespace topth_cpu
