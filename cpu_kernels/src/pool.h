// Threads of the CPU kernel (docs/cpu.md, "Threads").
//
// First choice: the OpenMP runtime torch already loaded (its libgomp, found among the
// process's libraries at run time and driven through GOMP_parallel): the kernel then runs on
// torch's own thread team, so no second team competes with torch's spinning threads for the
// cores (a -fopenmp build would link the system libgomp instead: two runtimes, two teams).
// Fallback (no OpenMP runtime loaded, after fork(), or TOPTH_CPU_PARALLEL=pool): a small
// persistent pool whose workers sleep on a condition variable between calls. Either way the
// thread count is chosen per call (torch.get_num_threads()) and the caller's thread works.
#pragma once

#include <cstdint>
#include <functional>

namespace topth_cpu {

// Run fn(task, worker) for task in [0, n) on `threads` threads (the caller is worker 0;
// workers take tasks in order from a shared counter). Calls are serialised. fn must not
// throw. With threads <= 1 or n <= 1 everything runs on the caller's thread.
// use_openmp: run on the loaded OpenMP runtime when there is one (see above).
void parallel_for(int32_t threads, int64_t n, const std::function<void(int64_t, int32_t)>& fn, bool use_openmp);

// Worker threads of the own pool started so far (not counting callers).
int32_t pool_workers();

// Path of the OpenMP runtime the kernel can use ("" when none is loaded, or after fork()).
const char* openmp_runtime();

}  // namespace topth_cpu
