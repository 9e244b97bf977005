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
    // A newer access covering an older one makes the older one redundant (same pair).
    v_.erase(std::remove_if(v_.begin(), v_.end(),
                            [&](const Interval& x) { return x.lo >= lo && x.hi <= hi; }),
             v_.end());
    v_.push_back(Interval{lo, hi, seq, info});
    if (v_.size() > 20000) {
        Fail("internal: more than 20000 unsynchronised accesses are pending between two pipes; "
             "the kernel never synchronises them (last: " + info.Describe() + ")");
    }
}

const Interval* IntervalSet::Overlap(uint64_t lo, uint64_t hi) const {
    for (auto it = v_.rbegin(); it != v_.rend(); ++it) {
        if (it->lo < hi && lo < it->hi) return &*it;
    }
    return nullptr;
}

void IntervalSet::ClearUpTo(uint64_t seq) {
    v_.erase(std::remove_if(v_.begin(), v_.end(), [&](const Interval& x) { return x.seq <= seq; }),
             v_.end());
}

void IntervalSet::ClearRange(uint64_t lo, uint64_t hi) {
    v_.erase(std::remove_if(v_.begin(), v_.end(),
                            [&](const Interval& x) { return x.lo < hi && lo < x.hi; }),
             v_.end());
}

namespace {
const char* SyncHint(Pipe src, Pipe dst) {
    // The synchronisation Ascend C offers for src -> dst.
    if (src == Pipe::V && dst == Pipe::V) return "PipeBarrier<PIPE_V>()";
    static thread_local std::string s;
    s = std::string("SetFlag/WaitFlag<HardEvent::") + PipeName(src) + "_" + PipeName(dst) +
        "> (or a TQue EnQue/DeQue, AllocTensor/FreeTensor pair)";
    return s.c_str();
}
}  // namespace

void HazardTracker::Access(Pipe p, bool write, uint64_t lo, uint64_t hi, const AccessInfo& info) {
    if (hi <= lo) return;
    const int q = static_cast<int>(p);
    for (int s = 0; s < kPipes; ++s) {
        const bool same = (s == q);
        if (same && p != Pipe::V) continue;
        if (const Interval* w = w_[s][q].Overlap(lo, hi)) {
            std::ostringstream os;
            os << "data hazard in " << space_ << ": " << PipeName(p) << (write ? " writes" : " reads")
               << " [" << lo << ", " << hi << ") in " << info.Describe() << ", which "
               << PipeName(static_cast<Pipe>(s)) << " wrote in " << w->info.Describe()
               << " with no " << PipeName(static_cast<Pipe>(s)) << "->" << PipeName(p)
               << " synchronisation in between (" << SyncHint(static_cast<Pipe>(s), p) << ")";
            Fail(os.str());
        }
        if (write && !same) {
            if (const Interval* r = r_[s][q].Overlap(lo, hi)) {
                std::ostringstream os;
                os << "data hazard in " << space_ << ": " << PipeName(p) << " writes [" << lo << ", "
                   << hi << ") in " << info.Describe() << " while " << PipeName(static_cast<Pipe>(s))
                   << " may still read it (" << r->info.Describe() << ") with no "
                   << PipeName(static_cast<Pipe>(s)) << "->" << PipeName(p)
                   << " synchronisation in between (" << SyncHint(static_cast<Pipe>(s), p) << ")";
                Fail(os.str());
            }
        }
    }
    const uint64_t seq = ++seq_[q];
    for (int d = 0; d < kPipes; ++d) {
        if (d == q) {
            if (p == Pipe::V && write) w_[q][q].Add(lo, hi, seq, info);
            continue;
        }
        (write ? w_[q][d] : r_[q][d]).Add(lo, hi, seq, info);
    }
}

void HazardTracker::Sync(Pipe src, Pipe dst, uint64_t seq) {
    const int s = static_cast<int>(src), d = static_cast<int>(dst);
    w_[s][d].ClearUpTo(seq);
    r_[s][d].ClearUpTo(seq);
}

void HazardTracker::SyncRange(Pipe src, Pipe dst, uint64_t lo, uint64_t hi) {
    const int s = static_cast<int>(src), d = static_cast<int>(dst);
    w_[s][d].ClearRange(lo, hi);
    r_[s][d].ClearRange(lo, hi);
}

void HazardTracker::BarrierV() {
    const int v = static_cast<int>(Pipe::V);
    w_[v][v].Clear();
}

void HazardTracker::BarrierAll() {
    for (auto& row : w_)
        for (auto& x : row) x.Clear();
    for (auto& row : r_)
        for (auto& x : row) x.Clear();
}

// ---------------------------------------------------------------------------------------
// Launch

BlockCtx& Ctx() {
    if (!g_ctx) throw ModelError("[ascendc-cpu model] Ascend C API called outside a kernel launch");
    return *g_ctx;
}

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

void Launch::RecordGm(uint32_t block, bool write, uint64_t lo, uint64_t hi, const AccessInfo& info) {
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& r : epochRecords_) {
        if (r.block == block || !(r.write || write)) continue;
        if (r.lo < hi && lo < r.hi) {
            std::ostringstream os;
            os << "[ascendc-cpu model] block " << block << ": race on GM: " << (write ? "write" : "read")
               << " of [" << lo << ", " << hi << ") in " << info.Describe() << " and "
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
                         " aborted: another block failed or returned without reaching SyncAll");
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
