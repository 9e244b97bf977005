// Thread pool behind parallel_for (see pool.h).
#include "pool.h"

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>

#include <cstring>
#include <string>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace topth_cpu {
namespace {

class Pool {
  public:
    void run(int32_t threads, int64_t n, const std::function<void(int64_t, int32_t)>& fn) {
        std::lock_guard<std::mutex> call(call_mutex_);
        const int32_t helpers = int32_t(threads - 1 < n - 1 ? threads - 1 : n - 1);
        grow(helpers);
        {
            std::lock_guard<std::mutex> lk(m_);
            fn_ = &fn;
            n_ = n;
            next_.store(0);
            active_ = helpers;
            pending_ = helpers;
            ++generation_;
        }
        cv_.notify_all();
        work(0);
        std::unique_lock<std::mutex> lk(m_);
        done_.wait(lk, [this] { return pending_ == 0; });
        fn_ = nullptr;
    }

    int32_t workers() {
        std::lock_guard<std::mutex> lk(m_);
        return started_;
    }

  private:
    void grow(int32_t helpers) {
        std::lock_guard<std::mutex> lk(m_);
        while (started_ < helpers) {
            const int32_t id = ++started_;
            std::thread([this, id, gen = generation_] { loop(id, gen); }).detach();
        }
    }

    void work(int32_t worker) {
        for (int64_t t = next_.fetch_add(1); t < n_; t = next_.fetch_add(1)) (*fn_)(t, worker);
    }

    void loop(int32_t id, uint64_t seen) {
        for (;;) {
            {
                std::unique_lock<std::mutex> lk(m_);
                cv_.wait(lk, [&] { return generation_ != seen; });
                seen = generation_;
                if (id > active_) continue;  // not needed in this call
            }
            work(id);
            std::lock_guard<std::mutex> lk(m_);
            if (--pending_ == 0) done_.notify_one();
        }
    }

    std::mutex call_mutex_, m_;
    std::condition_variable cv_, done_;
    const std::function<void(int64_t, int32_t)>* fn_ = nullptr;
    std::atomic<int64_t> next_{0};
    int64_t n_ = 0;
    int32_t active_ = 0, pending_ = 0, started_ = 0;
    uint64_t generation_ = 0;
};

Pool* g_pool = nullptr;
std::once_flag g_once;
std::atomic<bool> g_forked{false};

// A forked child has none of the parent's threads: it starts a fresh pool (the old one is
// leaked on purpose, its mutexes may be held by threads that no longer exist) and leaves
// OpenMP alone (libgomp's team does not survive fork() either).
void after_fork_in_child() {
    g_pool = new Pool();
    g_forked.store(true);
}

// ---------------------------------------------------------------- the loaded OpenMP runtime

using GompParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);
using OmpThreadNum = int (*)();

struct OpenMp {
    GompParallel parallel = nullptr;
    OmpThreadNum thread_num = nullptr;
    std::string path;
};

int find_openmp(struct dl_phdr_info* info, size_t, void* data) {
    const char* name = info->dlpi_name;
    if (!name || !*name) return 0;
    const char* base = std::strrchr(name, '/');
    base = base ? base + 1 : name;
    if (std::strncmp(base, "libgomp", 7) && std::strncmp(base, "libiomp5", 8) && std::strncmp(base, "libomp", 6))
        return 0;
    void* h = dlopen(name, RTLD_NOW | RTLD_NOLOAD);  // already loaded: only a handle, no new load
    if (!h) return 0;
    auto* rt = static_cast<OpenMp*>(data);
    rt->parallel = reinterpret_cast<GompParallel>(dlsym(h, "GOMP_parallel"));
    rt->thread_num = reinterpret_cast<OmpThreadNum>(dlsym(h, "omp_get_thread_num"));
    if (rt->parallel && rt->thread_num) {
        rt->path = name;
        return 1;
    }
    rt->parallel = nullptr;
    rt->thread_num = nullptr;
    return 0;
}

const OpenMp& openmp() {
    static const OpenMp rt = [] {
        OpenMp r;
        dl_iterate_phdr(find_openmp, &r);
        return r;
    }();
    return rt;
}

struct OmpTask {
    const std::function<void(int64_t, int32_t)>* fn;
    std::atomic<int64_t> next;
    int64_t n;
    OmpThreadNum thread_num;
};

void omp_body(void* data) {
    auto* task = static_cast<OmpTask*>(data);
    const int32_t worker = task->thread_num();
    for (int64_t t = task->next.fetch_add(1); t < task->n; t = task->next.fetch_add(1)) (*task->fn)(t, worker);
}

Pool& pool() {
    std::call_once(g_once, [] {
        g_pool = new Pool();
        pthread_atfork(nullptr, nullptr, after_fork_in_child);
    });
    return *g_pool;
}

}  // namespace

void parallel_for(int32_t threads, int64_t n, const std::function<void(int64_t, int32_t)>& fn, bool use_openmp) {
    if (n <= 0) return;
    if (threads <= 1 || n == 1) {
        for (int64_t t = 0; t < n; ++t) fn(t, 0);
        return;
    }
    if (use_openmp && !g_forked.load() && openmp().parallel) {
        // worker ids are OpenMP thread numbers, < threads (the caller's scratch is sized so)
        OmpTask task{&fn, {0}, n, openmp().thread_num};
        openmp().parallel(omp_body, &task, unsigned(threads < n ? threads : n), 0);
        return;
    }
    pool().run(threads, n, fn);
}

int32_t pool_workers() { return pool().workers(); }

const char* openmp_runtime() { return g_forked.load() ? "" : openmp().path.c_str(); }

}  // namespace topth_cpu
