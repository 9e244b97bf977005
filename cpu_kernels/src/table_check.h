// The op's check of block-table values on CPU tensors (table_check.cpp; the reference is the
// torch path of topth_ops.validation.check_block_table_values). Plain data in.
#pragma once

#include <stdint.h>

namespace topth_cpu {

// Used entries of a block table that lie outside [0, num_blocks): their count and the first
// one in row-major order (b, i), or b = i = -1 when there is none. Entry i of sequence b is
// used when i < ceil(seq_lens[b] / block_size) (at most cols entries). The table is int32 or
// int64 ([rows, cols], element (b, i) at s0 * b + s1 * i), seq_lens int32 or int64 (rows
// elements, lens_s apart).
struct TableCheck {
    int64_t bad;
    int64_t b;
    int64_t i;
};

TableCheck check_block_table(const void* table, int32_t table_i64, int64_t s0, int64_t s1, int64_t rows, int64_t cols,
                             const void* lens, int32_t lens_i64, int64_t lens_s, int64_t block_size,
                             int64_t num_blocks);

}  // namespace topth_cpu
