// Block-table values (table_check.h): one pass over the used entries of each sequence, where
// the torch path of the same check runs about seven tensor operations; a decode step of a
// served model makes this check once per layer (docs/cpu.md has the measured cost).
#include "table_check.h"

namespace topth_cpu {

TableCheck check_block_table(const void* table, int32_t table_i64, int64_t s0, int64_t s1, int64_t rows, int64_t cols,
                             const void* lens, int32_t lens_i64, int64_t lens_s, int64_t block_size,
                             int64_t num_blocks) {
    TableCheck r{0, -1, -1};
    const auto* t32 = static_cast<const int32_t*>(table);
    const auto* t64 = static_cast<const int64_t*>(table);
    const auto* l32 = static_cast<const int32_t*>(lens);
    const auto* l64 = static_cast<const int64_t*>(lens);
    for (int64_t b = 0; b < rows; ++b) {
        const int64_t n = lens_i64 ? l64[b * lens_s] : int64_t(l32[b * lens_s]);
        if (n <= 0) continue;
        // ceil(n / block_size) without overflow for n near INT64_MAX
        int64_t used = n / block_size + (n % block_size != 0);
        if (used > cols) used = cols;
        for (int64_t i = 0; i < used; ++i) {
            const int64_t v = table_i64 ? t64[b * s0 + i * s1] : int64_t(t32[b * s0 + i * s1]);
            if (v < 0 || v >= num_blocks) {
                if (r.bad++ == 0) {
                    r.b = b;
                    r.i = i;
                }
            }
        }
    }
    return r;
}

}  // namespace topth_cpu
