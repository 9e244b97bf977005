// SIMD level "avx2": stages_portable.inc compiled with -mavx2 -mfma -mf16c (setup.py adds the
// flags to this file only; dispatch.cpp selects it after checking the CPU at run time).
#define TOPTH_NS avx2_level
#define TOPTH_LEVEL_NAME "avx2"
#include "stages_portable.inc"

namespace topth_cpu {
const SimdOps* ops_avx2() { return &avx2_level::kOps; }
}  // namespace topth_cpu
