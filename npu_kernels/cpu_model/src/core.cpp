// CPU model of the Ascend C API subset used by topth-ops: the launch (see core.h). The
// hazard tracker is in hazard.cpp, SyncAll and the cross-core flags in sync.cpp, the
// checks that need the host's view of the call in checks.cpp.
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
    if (g_ctx) prefix += g_ctx->name + ": ";
    throw ModelError(prefix + msg);
}

std::string AccessInfo::Describe() const {
    return std::string(op) + " at " + Basename(file) + ":" + std::to_string(line);
}

std::vector<uint8_t>& BlockCtx::Mem(int space) {
    switch (static_cast<Space>(space)) {
        case Space::L1: return l1;
        case Space::L0A: return l0a;
        case Space::L0B: return l0b;
        case Space::L0C: return l0c;
        default: return ub;
    }
}

BlockCtx& Ctx() {
    if (!g_ctx) throw ModelError("[ascendc-cpu model] Ascend C API called outside a kernel launch");
    return *g_ctx;
}

bool InLaunch() { return g_ctx != nullptr; }

void SetKernelType(int type) {
    auto& ctx = Ctx();
    const auto t = static_cast<KernelType>(type);
    if (ctx.kernelType != KernelType::Unset && ctx.kernelType != t) Fail("KERNEL_TASK_TYPE_DEFAULT set twice, differently");
    const bool mix12 = t == KernelType::MixAic12;
    if (mix12 != ctx.launch->Mix()) {
        Fail(std::string("KERNEL_TASK_TYPE_DEFAULT declares ") + (mix12 ? "KERNEL_TYPE_MIX_AIC_1_2" : "a kernel without cube cores") +
             " but the launch starts " + (ctx.launch->Mix() ? "one AIC and two AIVs per block" : "vector cores only") +
             ": the runtime starts the cores the compiled kernel type says");
    }
    ctx.kernelType = t;
}

void SetOwner(int64_t seq, int64_t head) {
    auto& ctx = Ctx();
    ctx.ownerSeq = seq;
    ctx.ownerHead = head;
}

void DeclareBatchMode() { Ctx().launch->SetBatchMode(true); }

bool FaultIs(const char* name) { return g_ctx && g_ctx->launch->Fault() == name; }

Launch::Launch(uint32_t ubBytes, uint32_t coreCount) : coreCount_(coreCount), aicCount_(coreCount / 2) {
    if (ubBytes % 32 != 0 || ubBytes == 0) throw ModelError("unified buffer size must be a positive multiple of 32");
    if (coreCount == 0) throw ModelError("core count must be >= 1");
    mem_.ub = ubBytes;
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

void Launch::NoteMem(const BlockCtx& ctx) {
    std::lock_guard<std::mutex> lk(mu_);
    if (ctx.type == CoreType::AIV) {
        report_.ubPeak = std::max(report_.ubPeak, ctx.cursor[static_cast<int>(Space::UB)]);
    } else {
        report_.l1Peak = std::max(report_.l1Peak, ctx.cursor[static_cast<int>(Space::L1)]);
        report_.l0aPeak = std::max(report_.l0aPeak, ctx.cursor[static_cast<int>(Space::L0A)]);
        report_.l0bPeak = std::max(report_.l0bPeak, ctx.cursor[static_cast<int>(Space::L0B)]);
        report_.l0cPeak = std::max(report_.l0cPeak, ctx.cursor[static_cast<int>(Space::L0C)]);
    }
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

// Accesses of different blocks (AI cores) to overlapping writable GM, one of them a write,
// need a SyncAll between them; the cores of one block are ordered by their shared tracker.
void Launch::RecordGm(uint32_t block, bool write, uint64_t lo, uint64_t hi, const AccessInfo& info) {
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& r : epochRecords_) {
        if (r.block == block || !(r.write || write)) continue;
        if (r.lo < hi && lo < r.hi) {
            std::ostringstream os;
            os << "[ascendc-cpu model] block " << block << ": race on GM: " << (write ? "write" : "read") << " of "
               << DescribeGm(lo, hi) << " in " << info.Describe() << " and " << (r.write ? "write" : "read")
               << " by block " << r.block << " in " << r.info.Describe() << " with no SyncAll between them";
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

namespace {
// End-of-kernel discipline of one core: every queue buffer freed, every flag waited.
void CheckCoreEnd(const BlockCtx& ctx) {
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
        Fail("kernel returned with " + std::to_string(ctx.flags.size()) + " SetFlag without a matching WaitFlag");
    }
}
}  // namespace

void Launch::Run(uint32_t blockDim, const std::function<void()>& body, uint32_t aicPerBlock, uint32_t aivPerBlock) {
    if (blockDim == 0) throw ModelError("[ascendc-cpu model] launch with blockDim 0");
    const bool mix = aicPerBlock > 0;
    if (mix && (aicPerBlock != 1 || aivPerBlock != 2)) throw ModelError("[ascendc-cpu model] only 1:2 mix launches are modelled");
    if (!mix && aivPerBlock != 1) throw ModelError("[ascendc-cpu model] a vector-only launch runs one AIV per block");
    const uint32_t limit = mix ? aicCount_ : coreCount_;
    if (blockDim > limit) {
        throw ModelError("[ascendc-cpu model] launch with blockDim " + std::to_string(blockDim) + " > " +
                         std::to_string(limit) + (mix ? " AI cores (cube cores)" : " vector cores") +
                         ": a kernel that uses SyncAll would hang on the device");
    }
    aicPerBlock_ = aicPerBlock;
    aivPerBlock_ = aivPerBlock;
    blocks_ = blockDim;
    const uint32_t perBlock = aicPerBlock + aivPerBlock;
    const uint32_t total = blockDim * perBlock;
    report_.blockDim = blockDim;
    report_.perCore.assign(total, CoreReport());
    alive_ = total;
    arrived_ = 0;
    exitedAiv_ = exitedAll_ = 0;
    aborted_ = false;
    abortReason_.clear();
    epochRecords_.clear();
    waiters_.clear();
    trackers_.clear();
    cross_.assign(blockDim, {});
    for (uint32_t b = 0; b < blockDim; ++b) {
        trackers_.push_back(std::make_unique<HazardTracker>());
        auto& t = *trackers_.back();
        t.describeGm = [this](uint64_t lo, uint64_t hi) { return DescribeGm(lo, hi); };
        if (mix) {
            t.slotName[0] = "AIC";
            t.slotName[1] = "AIV0";
            t.slotName[2] = "AIV1";
        }
    }
    std::vector<std::exception_ptr> errors(total);
    std::vector<std::thread> threads;
    threads.reserve(total);
    for (uint32_t i = 0; i < total; ++i) {
        threads.emplace_back([&, i] {
            BlockCtx ctx;
            ctx.launch = this;
            ctx.block = i / perBlock;
            ctx.dim = blockDim;
            const uint32_t c = i % perBlock;
            ctx.type = (mix && c == 0) ? CoreType::AIC : CoreType::AIV;
            ctx.sub = mix ? (c == 0 ? 0 : c - 1) : 0;
            ctx.ratio = (mix && ctx.type == CoreType::AIV) ? 2 : 1;
            ctx.slot = static_cast<int>(c);
            ctx.haz = trackers_[ctx.block].get();
            ctx.name = "block " + std::to_string(ctx.block);
            if (mix) ctx.name += ctx.type == CoreType::AIC ? " AIC" : " AIV" + std::to_string(ctx.sub);
            if (ctx.type == CoreType::AIV) {
                ctx.ub.assign(mem_.ub, 0xFF);
            } else {
                ctx.l1.assign(mem_.l1, 0xFF);
                ctx.l0a.assign(mem_.l0a, 0xFF);
                ctx.l0b.assign(mem_.l0b, 0xFF);
                ctx.l0c.assign(mem_.l0c, 0xFF);
            }
            ctx.haz->SetActive(ctx.slot, true, ctx.type);
            g_ctx = &ctx;
            try {
                body();
                CheckCoreEnd(ctx);
                NoteMem(ctx);
                std::lock_guard<std::mutex> lk(mu_);
                report_.perCore[i] = CoreReport{ctx.cnt, ctx.block, ctx.sub, ctx.type};
                report_.kernelType = static_cast<int>(ctx.kernelType);
            } catch (...) {
                errors[i] = std::current_exception();
                std::lock_guard<std::mutex> lk(mu_);
                aborted_ = true;
                cv_.notify_all();
            }
            ctx.haz->SetActive(ctx.slot, false, ctx.type);
            {
                std::lock_guard<std::mutex> lk(mu_);
                alive_--;
                exitedAll_++;
                if (ctx.type == CoreType::AIV) exitedAiv_++;
                CheckDeadlock();  // cores still waiting for something only this one could do
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
    CheckCrossFlagsAtEnd();
}

}  // namespace topth_model
