// The row walk of the AVX-512 P.V stages (avx512_pv.cpp, and avx512bf16_pv.cpp's bfloat16
// pairs): the visit order of a kept list, its software prefetches, and the weights of a
// block of visits. Included only by files compiled with the AVX-512 flags; everything has
// internal linkage.
#pragma once

#include "avx512_common.h"

namespace topth_cpu {
namespace avx512_level {
namespace {

constexpr int kSplit = 3;   // pseudo dtype: bfloat16, pairwise conversion
constexpr int kPacked = 4;  // pseudo dtype: bfloat16 in vLLM's AMX V packing
constexpr int64_t kRowBlock = 16;

// Order and prefetch of the direct path. Kept rows are scattered: visited in ascending order,
// the hardware stream prefetchers follow the ascent and also fetch the unkept rows between
// them, so P.V over 30 % of the rows cost as much as over all of them. A scattered list (the
// caller's flag: at most 3/4 of the item's range) is therefore visited in a strided order
// (row k * stride mod count, stride a prime not dividing count: every row once, consecutive
// visits far apart), and rows are prefetched by software, kRowBlock ahead into L1 and about
// kFarBytes ahead into L2. Measured (microbenchmark of this loop, 64 x 8192 rows of 128
// bytes, one thread, CPU time, loaded machine): 30 % of the rows took 1.2 ms strided against
// 3.3 ms ascending with the L1 prefetch only (3.5 ms for all rows ascending); 10 %: 0.40
// against 0.64 ms. Dense lists stay ascending (strided was slower for a float32 dense call of
// the kernel). The sum order of P.V changes (deterministic for a given kept list).
// A stride coprime with count (1 for short lists).
inline int64_t visit_stride(int64_t count) {
    if (count < 256) return 1;
    const int64_t primes[4] = {97, 89, 83, 79};
    for (int i = 0; i < 4; ++i)
        if (count % primes[i]) return primes[i];
    return 1;
}

// The weights of heads h0 .. h0 + hb - 1 for the steps t0 .. t0 + T - 1 of a visit (rows
// vis[t]): in place when the visits ascend (stride 1), else gathered into buf (cap per head).
inline const float* block_weights(const float* wk, int64_t ldw, int32_t h0, int hb, int64_t t0, const int64_t* vis,
                                  int64_t T, int64_t stride, float* buf, int64_t cap, int64_t* ld) {
    if (stride == 1) {
        *ld = ldw;
        return wk + h0 * ldw + t0;
    }
    for (int h = 0; h < hb; ++h)
        for (int64_t t = 0; t < T; ++t) buf[h * cap + t] = wk[(h0 + h) * ldw + vis[t]];
    *ld = cap;
    return buf;
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
