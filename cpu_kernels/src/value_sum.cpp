// VMC's per-block V sums (topth_ops.value_sum.PagedValueSum) for CPU tensors: the update at each
// cache write and the mean at each decode step, each one pass in C++ instead of some forty
// torch operations. Same semantics as the Python path, which stays the reference and handles
// every case returned here as "fallback" (1): bad slot or table values (it raises the error),
// and a write that rewrites a slot the sum already counts (it re-sums the block from the
// cache). A fallback is decided before anything is modified.
//
// The adds keep the Python path's order (rows added to a block's sum in token order, as
// index_add_ does), so the sums are bit-identical to it; the mean adds a sequence's blocks in
// double and may differ from torch's float32 reduction in rounding. Every index is read once
// from the caller's tensors and used as checked (the GIL is released: no re-read).
#include "value_sum.h"

#include "index_read.h"

#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "topth_cpu/params.h"

namespace topth_cpu {
namespace {

#include "scalar_convert.inc"

inline float load(const uint8_t* base, int64_t elem, int32_t dtype) {
    if (dtype == kF32) return reinterpret_cast<const float*>(base)[elem];
    const uint16_t u = reinterpret_cast<const uint16_t*>(base)[elem];
    return dtype == kBF16 ? bits_to_float(uint32_t(u) << 16) : half_to_float(u);
}

// dst[h * D + d] += row h, d of token / cache slot at `base` (strides in elements)
inline void add_row(float* dst, const uint8_t* base, int64_t at, int64_t s_head, int64_t H, int64_t D,
                    int32_t dtype) {
    for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) dst[h * D + d] += load(base, at + h * s_head + d, dtype);
}

}  // namespace

int32_t value_sum_update(const ValueSumState& S, const RowsView& value, const void* slots, int64_t slot_stride,
                         bool slots64, int64_t tokens) {
    const int64_t nb = S.num_blocks, bs = S.block_size, H = S.num_kv_heads, D = S.head_dim;
    // the slot of every written row, sorted: blocks in order, offsets in order
    std::vector<int64_t> w;
    std::vector<int64_t> slot_of(size_t(tokens), -1);  // the checked slot of each token (-1: padding)
    w.reserve(size_t(tokens));
    for (int64_t t = 0; t < tokens; ++t) {
        const int64_t s = index_at(slots, t, slot_stride, slots64);
        if (s < 0) continue;  // padding
        if (s >= nb * bs) return 1;
        slot_of[size_t(t)] = s;
        w.push_back(s);
    }
    std::sort(w.begin(), w.end());
    for (size_t i = 1; i < w.size(); ++i)
        if (w[i] == w[i - 1]) return 1;  // a slot twice
    // pass 1, read only: a slot the sum already counts (below the block's fill once a write
    // at offset 0 has restarted it) needs the re-sum of the Python path
    for (size_t i = 0; i < w.size();) {
        const int64_t blk = w[i] / bs, off0 = w[i] % bs;
        const int64_t fill = off0 == 0 ? 0 : S.fill[blk];
        if (off0 < fill) return 1;
        while (i < w.size() && w[i] / bs == blk) ++i;
    }
    // pass 2: restart blocks written at offset 0, then advance each touched block's fill when
    // its rows are exactly the slots fill, fill + 1, ... (else -1: unknown until a restart)
    for (size_t i = 0; i < w.size();) {
        const int64_t blk = w[i] / bs, lo = w[i] % bs;
        if (lo == 0) {
            memset(S.sum + blk * H * D, 0, sizeof(float) * size_t(H * D));
            S.fill[blk] = 0;
        }
        size_t j = i;
        while (j < w.size() && w[j] / bs == blk) ++j;
        const int64_t cnt = int64_t(j - i), hi = w[j - 1] % bs, fill = S.fill[blk];
        S.fill[blk] = (lo == fill && hi == fill + cnt - 1) ? hi + 1 : -1;
        i = j;
    }
    // pass 3: the adds, in token order
    const uint8_t* vb = static_cast<const uint8_t*>(value.data);
    for (int64_t t = 0; t < tokens; ++t) {
        const int64_t s = slot_of[size_t(t)];
        if (s < 0) continue;
        add_row(S.sum + (s / bs) * H * D, vb, t * value.s_row, value.s_head, H, D, value.dtype);
    }
    return 0;
}

int32_t value_sum_mean(const ValueSumState& S, const int32_t* table, int64_t bt_s0, int64_t bt_s1, int64_t batch,
                       int64_t max_blocks, const void* lens, int64_t lens_stride, bool lens64,
                       const RowsView* cache, float* out) {
    const int64_t nb = S.num_blocks, bs = S.block_size, H = S.num_kv_heads, D = S.head_dim;
    // values first, as paged_value_mean checks them: lengths within the table, used entries
    // naming blocks of the pool; kept as read (used below, never re-read)
    std::vector<int64_t> len(static_cast<size_t>(batch));
    std::vector<int64_t> first(static_cast<size_t>(batch) + 1, 0), blocks;
    for (int64_t b = 0; b < batch; ++b) {
        const int64_t n = index_at(lens, b, lens_stride, lens64);
        if (n < 0 || n > max_blocks * bs) return 1;
        len[size_t(b)] = n;
        for (int64_t m = 0; m * bs < n; ++m) {
            const int64_t blk = table[b * bt_s0 + m * bt_s1];
            if (blk < 0 || blk >= nb) return 1;
            blocks.push_back(blk);
        }
        first[size_t(b) + 1] = int64_t(blocks.size());
    }
    const uint8_t* cb = cache ? static_cast<const uint8_t*>(cache->data) : nullptr;
    std::vector<float> part(size_t(H * D));
    std::vector<double> acc(size_t(H * D));
    for (int64_t b = 0; b < batch; ++b) {
        const int64_t n = len[size_t(b)];
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t m = 0; first[size_t(b)] + m < first[size_t(b) + 1]; ++m) {
            const int64_t blk = blocks[size_t(first[size_t(b)] + m)], uses = std::min(n - m * bs, bs);
            const float* src = S.sum + blk * H * D;
            if (cb && S.fill[blk] != uses) {  // the sum does not hold exactly these rows: the rows
                std::fill(part.begin(), part.end(), 0.0f);
                for (int64_t j = 0; j < uses; ++j)
                    add_row(part.data(), cb, blk * cache->s_block + j * cache->s_row, cache->s_head, H, D,
                            cache->dtype);
                src = part.data();
            }
            for (int64_t e = 0; e < H * D; ++e) acc[size_t(e)] += src[e];
        }
        const double denom = double(std::max<int64_t>(n, 1));
        for (int64_t e = 0; e < H * D; ++e) out[b * H * D + e] = float(acc[size_t(e)] / denom);
    }
    return 0;
}

}  // namespace topth_cpu
