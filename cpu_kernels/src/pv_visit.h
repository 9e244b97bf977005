// The visit order of a kept list and the weights of a block of visits, shared by the P.V
// stages of the SIMD levels (avx2_pv.cpp, avx512_pv.cpp). Scalar code with internal
// linkage: each level's file gets its own copy, compiled with its own flags.
#pragma once

#include <stdint.h>

namespace topth_cpu {
namespace pv_visit {
namespace {

// Kept rows are scattered: visited in ascending order, the hardware stream prefetchers follow
// the ascent and also fetch the unkept rows between them, so P.V over 30 % of the rows cost as
// much as over all of them. A scattered list (the caller's flag: at most 3/4 of the item's
// range) is therefore visited in a strided order (row k * stride mod count, stride a prime
// not dividing count: every row once, consecutive visits far apart), and the levels prefetch
// rows by software at two distances. Measured (microbenchmark of the AVX-512 loop, 64 x 8192
// rows of 128 bytes, one thread, CPU time, loaded machine): 30 % of the rows took 1.2 ms
// strided against 3.3 ms ascending with the L1 prefetch only (3.5 ms for all rows
// ascending); 10 %: 0.40 against 0.64 ms. Dense lists stay ascending (strided was slower for
// a float32 dense call of the kernel). The sum order of P.V changes (deterministic for a
// given kept list). Returns a stride coprime with count (1 for short lists).
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

}  // namespace
}  // namespace pv_visit
}  // namespace topth_cpu
