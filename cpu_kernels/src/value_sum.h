// VMC's per-block V sums on the CPU (value_sum.cpp; the Python reference is
// topth_ops.value_sum.PagedValueSum). Plain data in, 0 = done, 1 = fall back to the Python path.
#pragma once

#include <stdint.h>

namespace topth_cpu {

// PagedValueSum's state: sum [num_blocks, num_kv_heads, head_dim] float32 and fill
// [num_blocks] int64, both contiguous.
struct ValueSumState {
    float* sum;
    int64_t* fill;
    int64_t num_blocks, block_size, num_kv_heads, head_dim;
};

// Rows of V: element (row, head, d) at data[block * s_block + row * s_row + head * s_head + d]
// (d contiguous), dtype a Dtype code. New rows use block 0; a paged cache names its block.
struct RowsView {
    const void* data;
    int32_t dtype;
    int64_t s_block, s_row, s_head;
};

// Account for the rows `value` [tokens, H, D] about to be written at `slots` (negative:
// skipped). 1 (nothing modified): a slot past the pool, a slot twice, or a slot already counted.
int32_t value_sum_update(const ValueSumState& S, const RowsView& value, const void* slots, int64_t slot_stride,
                         bool slots64, int64_t tokens);

// out [batch, H, D] float32 = mean of rows 0..n-1 per sequence from the block sums; with a
// cache, blocks whose fill is not the rows used are summed from it. 1 (out untouched): a
// length outside [0, max_blocks * block_size] or a used table entry outside the pool.
int32_t value_sum_mean(const ValueSumState& S, const int32_t* table, int64_t bt_s0, int64_t bt_s1, int64_t batch,
                       int64_t max_blocks, const void* lens, int64_t lens_stride, bool lens64,
                       const RowsView* cache, float* out);

}  // namespace topth_cpu
