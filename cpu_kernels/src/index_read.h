// Reading one element of an int32 or int64 index tensor (seq_lens, slots, block tables,
// threshold_set) given as a pointer and an element stride. Used by the files compiled with
// baseline flags only (dispatch, value_sum, table_check), never by a SIMD level's files.
#pragma once

#include <stdint.h>

namespace topth_cpu {

inline int64_t index_at(const void* p, int64_t i, int64_t stride, bool is64) {
    return is64 ? static_cast<const int64_t*>(p)[i * stride] : static_cast<const int32_t*>(p)[i * stride];
}

}  // namespace topth_cpu
