// The row walk of the AVX-512 P.V stages (avx512_pv.cpp, and avx512bf16_pv.cpp's bfloat16
// pairs): software prefetch along the visit order of pv_visit.h, and the accumulator
// permutations of the pairwise bfloat16 paths. Included only by files compiled with the
// AVX-512 flags; everything has internal linkage.
#pragma once

#include "avx512_common.h"
#include "pv_visit.h"

namespace topth_cpu {
namespace avx512_level {
namespace {

constexpr int kSplit = 3;   // pseudo dtype: bfloat16, pairwise conversion
constexpr int kPacked = 4;  // pseudo dtype: bfloat16 in vLLM's AMX V packing
constexpr int64_t kRowBlock = 16;

using pv_visit::block_weights;
using pv_visit::visit_stride;

// Permutes each 32-float chunk of the G accumulator rows: the first 16 floats become
// permutex2var(chunk, i0), the next 16 permutex2var(chunk, i1) (indices into the chunk's 32).
inline void permute_chunks(float* acc, int32_t G, int32_t d, int32_t dpad, __m512i i0, __m512i i1) {
    for (int32_t h = 0; h < G; ++h)
        for (int32_t c = 0; c < d; c += 32) {
            float* p = acc + int64_t(h) * dpad + c;
            const __m512 x = _mm512_loadu_ps(p), y = _mm512_loadu_ps(p + 16);
            _mm512_storeu_ps(p, _mm512_permutex2var_ps(x, i0, y));
            _mm512_storeu_ps(p + 16, _mm512_permutex2var_ps(x, i1, y));
        }
}

// One row for the prefetches: its d elements, or (kPacked) its d / 16 lines.
template <int DT>
inline void prefetch_one(const uint8_t* p, int64_t row_bytes, int64_t cstride, int32_t d, bool l2) {
    if constexpr (DT == kPacked) {
        for (int32_t c = 0; c < d; c += 16, p += cstride)
            if (l2)
                prefetch_l2(p);
            else
                prefetch_l1(p);
    } else if (l2) {
        prefetch_row_l2(p, row_bytes);
    } else {
        prefetch_row(p, row_bytes);
    }
}

// The kept list `rows` in blocks of kRowBlock visits (visit k is row k * stride mod count):
// before each block, the next block's rows are prefetched into L1 and the rows `far` visits
// ahead into L2; then block(rb, vis, k0, R) runs with the block's R row pointers and row
// numbers.
template <int DT, class Block>
inline void visit_row_blocks(const uint8_t* const* rows, int64_t count, int64_t row_bytes, int64_t cstride,
                             int32_t d, int64_t stride, Block&& block) {
    const int64_t far = far_rows(row_bytes);
    const uint8_t* rb[kRowBlock];
    int64_t vis[kRowBlock];
    int64_t tv = 0;                                    // row of the next step
    int64_t tn = (kRowBlock * stride) % count;         // row of step k0 + kRowBlock (into L1)
    int64_t tf = (far * stride) % count;               // row of step k0 + far (into L2)
    for (int64_t k0 = 0; k0 < count; k0 += kRowBlock) {
        const int64_t R = count - k0 < kRowBlock ? count - k0 : kRowBlock;
        for (int64_t t = 0; t < R; ++t) {
            vis[t] = tv;
            rb[t] = rows[tv];
            tv += stride; tv -= tv >= count ? count : 0;
        }
        for (int64_t k = k0 + kRowBlock; k < count && k < k0 + 2 * kRowBlock; ++k) {
            prefetch_one<DT>(rows[tn], row_bytes, cstride, d, false);
            tn += stride; tn -= tn >= count ? count : 0;
        }
        for (int64_t k = k0 + far; k < count && k < k0 + far + kRowBlock; ++k) {
            prefetch_one<DT>(rows[tf], row_bytes, cstride, d, true);
            tf += stride; tf -= tf >= count ? count : 0;
        }
        block(rb, vis, k0, R);
    }
}

}  // namespace
}  // namespace avx512_level
}  // namespace topth_cpu
