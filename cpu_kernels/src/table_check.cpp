// Block-table values (table_check.h): one pass over the used entries of each sequence, where
// the torch path of the same check runs about seven tensor operations; a decode step of a
// served model makes this check once per layer (docs/cpu.md has the measured cost).
#include "table_check.h"

#include "index_read.h"

namespace topth_cpu {

TableCheck check_block_table(const void* table, int32_t table_i64, int64_t s0, int64_t s1, int64_t rows, int64_t cols,
                             const void* lens, int32_t lens_i64, int64_t lens_s, int64_t block_size,
                             int64_t num_blocks) {
    TableCheck r{0, -1, -1};
    for (int64_t b = 0; b < rows; ++b) {
        const int64_t n = index_at(lens, b, lens_s, lens_i64 != 0);
        if (n <= 0) continue;
        // ceil(n / block_size) without overflow for n near INT64_MAX
        int64_t used = n / block_size + (n % block_size != 0);
        if (used > cols) used = cols;
        for (int64_t i = 0; i < used; ++i) {
            const int64_t v = index_at(table, b * s0 + i * s1, 1, table_i64 != 0);
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
