// A small persistent thread pool for the CPU kernel (docs/cpu.md, "Threads").
//
// Why not OpenMP: torch's wheels ship their own libgomp; a -fopenmp build would link the
// system one, and two OpenMP runtimes in one process each keep a team of threads (twice
// the cores busy, spinning). The pool's workers sleep on a condition variable between calls
// and never spin, the caller's thread works too, and the thread count is chosen per call
// (torch.get_num_threads()), so the kernel never runs more threads than torch would.
#pragma once

#include <cstdint>
#include <functional>

namespace topth_cpu {

// Run fn(task, worker) for task in [0, n) on `threads` threads (the caller is worker 0;
// workers take tasks in order from a shared counter). Calls are serialised. fn must not
// throw. With threads <= 1 or n <= 1 everything runs on the caller's thread.
void parallel_for(int32_t threads, int64_t n, const std::function<void(int64_t, int32_t)>& fn);

// Worker threads started so far (not counting callers).
int32_t pool_workers();

}  // namespace topth_cpu
