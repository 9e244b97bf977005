// CPU model of the Ascend C API subset used by topth-ops: runtime (see core.h).
#include "topth_model/core.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <sstream>
#include <thread>

namespace topth_model {

namespace {
thread_local BlockCtx* g_ctx = nullptr;

const char* Basename(const char* path) {
    const char* s = std::strrchr(path, '/');
    return s ? s + 1 : path;
}
}  // namespace

std::string Where(const std::source_location& loc) {
    return std::string(Basename(loc.file_name())) + ":" + std::to_string(loc.line());
}

void Fail(const std::string& msg) {
    std::string prefix = "[ascendc-cpu model] ";
    if (g_ctx) prefix += "block " + std::to_string(g_ctx->idx) + ": ";
    throw ModelError(prefix + msg);
}

const char* PipeName(Pipe p) {
    switch (p) {
        case Pipe::MTE2: return "MTE2";
        case Pipe::MTE3: return "MTE3";
        case Pipe::V: return "V";
        case Pipe::S: return "S";
    }
    return "?";
}

std::string AccessInfo::Describe() const {
    return std::string(op) + " at " + Basename(file) + ":" + std::to_string(line);
}

// ---------------------------------------------------------------------------------------
// IntervalSet / HazardTracker

void IntervalSet::Add(uint64_t lo, uint64_t hi, uint64_t seq, const AccessInfo& info) {
    v_.erase(std::remove_if(v_.begin(), v_.end(),
                            [&](const Interval& x) { return x.lo >= lo && x.hi <= hi; }),
             v_.end());
    v_.push_back(Interval{lo, hi, seq, info});
}

const Interval* IntervalSet::OverlapAfter(uint64_t lo, uint64_t hi, uint64_t after) const {
    for (auto it = v_.rbegin(); it != v_.rend(); ++it) {
        if (it->seq > after && it->lo < hi && lo < it->hi) return &*it;
    }
    return nullptr;
}

void IntervalSet::PruneUpTo(uint64_t seq) {
    v_.erase(std::remove_if(v_.begin(), v_.end(), [&](const Interval& x) { return x.seq <= seq; }), v_.end());
}

namespace {
std::string SyncHint(Pipe src, Pipe dst) {
    if (src == Pipe::V && dst == Pipe::V) return "PipeBarrier<PIPE_V>()";
    return std::string("SetFlag/WaitFlag<HardEvent::") + PipeName(src) + "_" + PipeName(dst) +
           ">, or a TQue EnQue/DeQue or FreeTensor/AllocTensor pair between them";
}
}  // namespace

void HazardTracker::Access(Space space, Pipe p, bool write, uint64_t lo, uint64_t hi, const AccessInfo& info) {
    if (hi <= lo) return;
    const int q = static_cast<int>(p), sp = static_cast<int>(space);
    auto range = [&](uint64_t a, uint64_t b) {
        if (space == Space::GM && describeGm) return describeGm(a, b);
        return std::string(space == Space::UB ? "UB [" : "GM [") + std::to_string(a) + ", " + std::to_string(b) + ")";
    };
    for (int s = 0; s < kPipes; ++s) {
        const bool same = (s == q);
        if (same && p != Pipe::V) continue;  // MTE2, MTE3 and S execute in order
        const uint64_t seen = clk_[q][s];
        const Interval* w = log_[sp][s][1].OverlapAfter(lo, hi, seen);
        const Interval* r = (write && !same) ? log_[sp][s][0].OverlapAfter(lo, hi, seen) : nullptr;
        if (w || r) {
            const Interval* x = w ? w : r;
            std::ostringstream os;
            os << "data hazard: " << PipeName(p) << (write ? " writes " : " reads ") << range(lo, hi) << " in "
               << info.Describe() << ", which " << PipeName(static_cast<Pipe>(s)) << (w ? " wrote" : " reads")
               << " in " << x->info.Describe() << ", with no " << PipeName(static_cast<Pipe>(s)) << "->"
               << PipeName(p) << " synchronisation in between (" << SyncHint(static_cast<Pipe>(s), p) << ")";
            Fail(os.str());
        }
    }
    const uint64_t seq = ++seq_[q];
    if (p != Pipe::V) clk_[q][q] = seq;
    log_[sp][q][write ? 1 : 0].Add(lo, hi, seq, info);
    if (++accesses_ % 4096 == 0) Prune();
}

void HazardTracker::Prune() {
    // An access every other pipe is ordered after can never conflict again.
    for (int p = 0; p < kPipes; ++p) {
        uint64_t minSeen = UINT64_MAX;
        for (int q = 0; q < kPipes; ++q) {
            if (q == p && p != static_cast<int>(Pipe::V)) continue;
            minSeen = std::min(minSeen, clk_[q][p]);
        }
        for (int sp = 0; sp < 2; ++sp)
            for (int k = 0; k < 2; ++k) log_[sp][p][k].PruneUpTo(minSeen);
    }
    for (int sp = 0; sp < 2; ++sp)
        for (int p = 0; p < kPipes; ++p)
            for (int k = 0; k < 2; ++k)
                if (log_[sp][p][k].Size() > 50000) {
                    Fail("internal: more than 50000 accesses by one pipe are never synchronised with the others");
                }
}

PipeClock HazardTracker::Capture(Pipe p) const {
    PipeClock c;
    const int q = static_cast<int>(p);
    for (int i = 0; i < kPipes; ++i) c.c[i] = clk_[q][i];
    c.c[q] = seq_[q];  // a flag is set after every earlier operation of its pipe completes
    return c;
}

void HazardTracker::Observe(Pipe q, const PipeClock& c) {
    const int x = static_cast<int>(q);
    for (int i = 0; i < kPipes; ++i) clk_[x][i] = std::max(clk_[x][i], c.c[i]);
}

void HazardTracker::BarrierV() {
    const int v = static_cast<int>(Pipe::V);
    clk_[v][v] = seq_[v];
}

void HazardTracker::BarrierAll() {
    for (int q = 0; q < kPipes; ++q)
        for (int p = 0; p < kPipes; ++p) clk_[q][p] = seq_[p];
}

// ---------------------------------------------------------------------------------------
// Launch

BlockCtx& Ctx() {
    if (!g_ctx) throw ModelError("[ascendc-cpu model] Ascend C API called outside a kernel launch");
    return *g_ctx;
}

void SetKernelType(int type) {
    auto& ctx = Ctx();
    const auto t = static_cast<KernelType>(type);
    if (ctx.kernelType != KernelType::Unset && ctx.kernelType != t) Fail("KERNEL_TASK_TYPE_DEFAULT set twice, differently");
    ctx.kernelType = t;
}

void SetOwner(int64_t seq, int64_t head) {
    auto& ctx = Ctx();
    ctx.ownerSeq = seq;
    ctx.ownerHead = head;
}

void DeclareBatchMode() { Ctx().launch->SetBatchMode(true); }

Launch::Launch(uint32_t ubBytes, uint32_t coreCount) : ubBytes_(ubBytes), coreCount_(coreCount) {
    if (ubBytes % 32 != 0 || ubBytes == 0) throw ModelError("unified buffer size must be a positive multiple of 32");
    if (coreCount == 0) throw ModelError("core count must be >= 1");
}

Launch::~Launch() = default;

void Launch::AddGm(const std::string& name, void* ptr, uint64_t bytes, bool writable, const std::string& tag) {
    if (bytes == 0) return;  // nothing can be read or written; no address to register
    if (!ptr) throw ModelError("GM buffer '" + name + "' has a null pointer");
    auto* p = static_cast<uint8_t*>(ptr);
    for (const auto& b : gm_) {
        if (p < b.base + b.bytes && b.base < p + bytes) {
            throw ModelError("GM buffers '" + name + "' and '" + b.name + "' overlap");
        }
    }
    GmBuffer b;
    b.name = name;
    b.tag = tag;
    b.base = p;
    b.bytes = bytes;
    b.writable = writable;
    gm_.push_back(b);
}

GmBuffer& Launch::FindGm(const void* p, const char* op, const std::source_location& loc) {
    auto* a = static_cast<const uint8_t*>(p);
    for (auto& b : gm_) {
        if (a >= b.base && a < b.base + b.bytes) return b;
    }
    Fail(std::string(op) + " at " + Where(loc) + ": GM address is not inside any buffer passed to the kernel");
}

void Launch::AddBytes(GmBuffer& b, bool toUb, uint64_t bytes) {
    std::lock_guard<std::mutex> lk(mu_);
    if (toUb) {
        b.bytesToUb += bytes;
        b.copiesToUb += 1;
    } else {
        b.bytesFromUb += bytes;
        b.writtenByKernel = true;
    }
}

void Launch::NoteUb(uint32_t used) {
    std::lock_guard<std::mutex> lk(mu_);
    report_.ubPeak = std::max(report_.ubPeak, used);
}

std::string Launch::DescribeGm(uint64_t lo, uint64_t hi) const {
    for (const auto& b : gm_) {
        const uint64_t base = reinterpret_cast<uint64_t>(b.base);
        if (lo >= base && lo < base + b.bytes) {
            return "'" + b.name + "' bytes [" + std::to_string(lo - base) + ", " + std::to_string(hi - base) + ")";
        }
    }
    return "GM [" + std::to_string(lo) + ", " + std::to_string(hi) + ")";
}

void Launch::RecordGm(uint32_t block, bool write, uint64_t lo, uint64_t hi, const AccessInfo& info) {
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& r : epochRecords_) {
        if (r.block == block || !(r.write || write)) continue;
        if (r.lo < hi && lo < r.hi) {
            std::ostringstream os;
            os << "[ascendc-cpu model] block " << block << ": race on GM: " << (write ? "write" : "read")
               << " of " << DescribeGm(lo, hi) << " in " << info.Describe() << " and "
               << (r.write ? "write" : "read") << " by block " << r.block << " in " << r.info.Describe()
               << " with no SyncAll between them";
            throw ModelError(os.str());
        }
    }
    for (auto& r : epochRecords_) {  // identical record from the same block: keep one
        if (r.block == block && r.write == write && r.lo <= lo && hi <= r.hi) return;
    }
    epochRecords_.push_back(GmRecord{lo, hi, block, write, info});
}

void Launch::CheckSyncWorkspace(const uint8_t* p, uint64_t bytes, const std::source_location& loc) {
    std::lock_guard<std::mutex> lk(mu_);
    if (syncWsChecked_) return;
    syncWsChecked_ = true;
    for (uint64_t i = 0; i < bytes; ++i) {
        if (p[i] != 0) {
            throw ModelError("[ascendc-cpu model] SyncAll at " + Where(loc) +
                             ": the GM sync workspace must be zero-initialised by the host before the launch");
        }
    }
}

void Launch::Barrier(uint32_t block, const std::source_location& loc) {
    std::unique_lock<std::mutex> lk(mu_);
    if (aborted_) throw ModelError("[ascendc-cpu model] block " + std::to_string(block) + ": aborted (another block failed)");
    if (resident_ > 0 && resident_ < running_ && !batchMode_.load()) {
        aborted_ = true;
        cv_.notify_all();
        throw ModelError("[ascendc-cpu model] block " + std::to_string(block) + ": SyncAll at " + Where(loc) +
                         " would deadlock: another stream holds cores, so only " + std::to_string(resident_) +
                         " of the " + std::to_string(running_) +
                         " blocks start, and they wait here for blocks that cannot start (launch the kernel in "
                         "batch schedule mode, __schedmode__(1), so that all its blocks start together)");
    }
    const uint32_t gen = generation_;
    if (exited_ > 0) {
        aborted_ = true;
        cv_.notify_all();
        throw ModelError("[ascendc-cpu model] block " + std::to_string(block) + ": SyncAll at " + Where(loc) +
                         " would hang on the device: " + std::to_string(exited_) +
                         " block(s) returned without reaching it");
    }
    if (++arrived_ == running_) {
        arrived_ = 0;
        ++generation_;
        ++epoch_;
        epochRecords_.clear();
        report_.syncAllCalls++;
        cv_.notify_all();
        return;
    }
    cv_.wait(lk, [&] { return generation_ != gen || aborted_; });
    if (generation_ == gen) {
        throw ModelError("[ascendc-cpu model] block " + std::to_string(block) + ": SyncAll at " + Where(loc) +
                         " aborted: another block failed, or returned without reaching SyncAll (on the device "
                         "this SyncAll would hang)");
    }
}

void Launch::Run(uint32_t blockDim, const std::function<void()>& body) {
    if (blockDim == 0) throw ModelError("[ascendc-cpu model] launch with blockDim 0");
    if (blockDim > coreCount_) {
        throw ModelError("[ascendc-cpu model] launch with blockDim " + std::to_string(blockDim) +
                         " > " + std::to_string(coreCount_) +
                         " vector cores: a kernel that uses SyncAll would hang on the device");
    }
    report_.blockDim = blockDim;
    report_.perBlock.assign(blockDim, PipeCounters());
    running_ = blockDim;
    arrived_ = 0;
    exited_ = 0;
    aborted_ = false;
    epochRecords_.clear();
    std::vector<std::exception_ptr> errors(blockDim);
    std::vector<std::thread> threads;
    threads.reserve(blockDim);
    for (uint32_t b = 0; b < blockDim; ++b) {
        threads.emplace_back([&, b] {
            BlockCtx ctx;
            ctx.launch = this;
            ctx.idx = b;
            ctx.dim = blockDim;
            ctx.ub.assign(ubBytes_, 0xFF);
            ctx.haz.describeGm = [this](uint64_t lo, uint64_t hi) { return DescribeGm(lo, hi); };
            g_ctx = &ctx;
            try {
                body();
                // End-of-kernel discipline: every queue buffer freed, every flag waited.
                for (const auto& q : ctx.queues) {
                    for (size_t i = 0; i < q->slots.size(); ++i) {
                        if (q->slots[i]->st != SlotState::Free) {
                            static const char* names[] = {"free", "allocated", "enqueued", "dequeued"};
                            Fail("kernel returned with buffer " + std::to_string(i) + " of " + q->desc + " still " +
                                 names[q->slots[i]->st] + " (missing FreeTensor)");
                        }
                    }
                }
                if (!ctx.flags.empty()) {
                    Fail("kernel returned with " + std::to_string(ctx.flags.size()) +
                         " SetFlag without a matching WaitFlag");
                }
                NoteUb(ctx.pipeCursor);
                std::lock_guard<std::mutex> lk(mu_);
                report_.perBlock[b] = ctx.cnt;
                report_.kernelType = static_cast<int>(ctx.kernelType);
            } catch (...) {
                errors[b] = std::current_exception();
                std::lock_guard<std::mutex> lk(mu_);
                aborted_ = true;
                cv_.notify_all();
            }
            {
                // A block that returns while others wait in SyncAll would hang the device.
                std::lock_guard<std::mutex> lk(mu_);
                exited_++;
                if (arrived_ > 0) {
                    aborted_ = true;
                    cv_.notify_all();
                }
            }
            g_ctx = nullptr;
        });
    }
    for (auto& t : threads) t.join();
    // Report the first real error (not an "aborted" follower) if there is one.
    std::exception_ptr first = nullptr;
    for (auto& e : errors) {
        if (!e) continue;
        try {
            std::rethrow_exception(e);
        } catch (const std::exception& ex) {
            if (std::string(ex.what()).find("aborted") == std::string::npos) {
                first = e;
                break;
            }
            if (!first) first = e;
        }
    }
    if (first) std::rethrow_exception(first);
}

}  // namespace topth_model
