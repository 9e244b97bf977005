// The portable SIMD level ("generic"): stages_portable.inc compiled with the baseline flags
// of the build, so it runs on every CPU of the target architecture.
#define TOPTH_NS generic_level
#define TOPTH_LEVEL_NAME "generic"
#include "stages_portable.inc"

namespace topth_cpu {
const SimdOps* ops_generic() { return &generic_level::kOps; }
}  // namespace topth_cpu
