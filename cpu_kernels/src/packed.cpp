// vLLM's AMX cache (Params::kv_packed; topth_ops/packed.py): each block and KV head holds a
// K region [block_size / 16][head_dim / 2][16][2] and a V region [head_dim / 16][block_size / 2]
// [16][2] of bfloat16. Here: the K tile pointers of the native scores stage, and rows unpacked
// into contiguous bfloat16 rows for every other stage (K on levels without the native path,
// the kept V rows, the V sum). Unpacking one row reads only that row's elements (and so never
// multiplies a value of another slot, whatever it holds).
#include <algorithm>
#include <cstring>

#include "kernel.h"

namespace topth_cpu {

const uint16_t* packed_region(const Params& P, const void* base, const int64_t* s, int64_t b, int64_t g,
                              int64_t pos) {
    return static_cast<const uint16_t*>(base) + block_of(P, b, pos / P.block_size) * s[0] + g * s[1];
}

void packed_key_tiles(const Params& P, int64_t b, int64_t g, int64_t lo, int64_t count, const uint8_t** out) {
    const int64_t bs = P.block_size, D = P.head_dim;
    const int64_t first = lo / 16 * 16;
    int64_t i = 0;
    for (int64_t j = first; j < lo + count; j += 16, ++i) {
        const uint16_t* reg = packed_region(P, P.key, P.k_s, b, g, j);
        out[i] = reinterpret_cast<const uint8_t*>(reg + (j % bs) / 16 * (D / 2) * 32);
    }
}

void packed_key_rows(const Params& P, int64_t b, int64_t g, int64_t lo, int64_t count, uint16_t* dst,
                     const uint8_t** out) {
    const int64_t bs = P.block_size, D = P.head_dim;
    for (int64_t t = 0; t < count; ++t, dst += D) {
        const int64_t j = lo + t, slot = j % bs;
        const uint16_t* w = packed_region(P, P.key, P.k_s, b, g, j) + (slot / 16) * (D / 2) * 32 + (slot % 16) * 2;
        for (int64_t p = 0; p < D / 2; ++p) std::memcpy(dst + 2 * p, w + 32 * p, 4);  // the pair (2p, 2p + 1)
        out[t] = reinterpret_cast<const uint8_t*>(dst);
    }
}

void packed_value_pointers(const Params& P, int64_t b, int64_t g, int64_t lo, const int32_t* idx, int64_t count,
                           const uint8_t** out) {
    const int64_t bs = P.block_size;
    for (int64_t t = 0; t < count; ++t) {
        const int64_t j = lo + idx[t], slot = j % bs;
        out[t] = reinterpret_cast<const uint8_t*>(packed_region(P, P.value, P.v_s, b, g, j) + (slot / 2) * 32 + slot % 2);
    }
}

void packed_value_rows(const Params& P, int64_t b, int64_t g, int64_t lo, const int32_t* idx, int64_t count,
                       uint16_t* dst, const uint8_t** out) {
    const int64_t bs = P.block_size, D = P.head_dim;
    for (int64_t t = 0; t < count; ++t, dst += D) {
        const int64_t j = lo + (idx ? idx[t] : t), slot = j % bs;
        const uint16_t* p0 = packed_region(P, P.value, P.v_s, b, g, j) + (slot / 2) * 32 + (slot % 2);
        for (int64_t c = 0; c < D; c += 16) {
            const uint16_t* q = p0 + (c / 16) * bs * 16;
            for (int64_t i = 0; i < 16; ++i) dst[c + i] = q[2 * i];
        }
        out[t] = reinterpret_cast<const uint8_t*>(dst);
    }
}

}  // namespace topth_cpu
