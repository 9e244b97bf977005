// CPU model of the Ascend C API subset: what makes one core wait for others (see core.h):
// the all-core barrier of SyncAll, the cross-core flags of a mix kernel
// (CrossCoreSetFlag / CrossCoreWaitFlag, modes 1 and 2, per block and flag id) and the
// detection of a launch in which every live core waits for something no core will do.
#include <algorithm>
#include <sstream>

#include "topth_model/core.h"

namespace topth_model {

void Launch::BlockOn(std::unique_lock<std::mutex>& lk, BlockCtx& ctx, const std::function<bool()>& ready,
                     const std::string& what) {
    if (ready()) return;
    waiters_.push_back(Waiter{&ctx, ready, what});
    CheckDeadlock();
    cv_.wait(lk, [&] { return ready() || aborted_; });
    waiters_.erase(std::remove_if(waiters_.begin(), waiters_.end(), [&](const Waiter& w) { return w.ctx == &ctx; }),
                   waiters_.end());
    if (!ready()) {
        if (!abortReason_.empty()) Fail(what + ": " + abortReason_);
        throw ModelError("[ascendc-cpu model] " + ctx.name + ": " + what + " aborted (another core failed)");
    }
}

// Under mu_: if every core still running waits and none of their conditions holds, nothing
// can ever wake them (on the device: a hang).
void Launch::CheckDeadlock() {
    if (aborted_ || waiters_.empty() || waiters_.size() < alive_) return;
    for (const auto& w : waiters_)
        if (w.ready()) return;
    std::ostringstream os;
    os << "deadlock, the kernel would hang on the device: every core still running waits (";
    for (size_t i = 0; i < waiters_.size(); ++i) os << (i ? "; " : "") << waiters_[i].ctx->name << " in " << waiters_[i].what;
    os << ")";
    if (exitedAll_ > 0) os << " and " << exitedAll_ << " core(s) returned";
    abortReason_ = os.str();
    aborted_ = true;
    cv_.notify_all();
}

void Launch::Barrier(BlockCtx& ctx, bool aivOnly, const std::source_location& loc) {
    std::unique_lock<std::mutex> lk(mu_);
    const std::string what = "SyncAll at " + Where(loc);
    if (aborted_) throw ModelError("[ascendc-cpu model] " + ctx.name + ": aborted (another core failed)");
    if (resident_ > 0 && resident_ < blocks_ && !batchMode_.load()) {
        aborted_ = true;
        cv_.notify_all();
        throw ModelError("[ascendc-cpu model] " + ctx.name + ": " + what + " would deadlock: another stream holds cores, so only " +
                         std::to_string(resident_) + " of the " + std::to_string(blocks_) +
                         " blocks start, and they wait here for blocks that cannot start (launch the kernel in "
                         "batch schedule mode, __schedmode__(1), so that all its blocks start together)");
    }
    const uint32_t participants = aivOnly ? blocks_ * aivPerBlock_ : blocks_ * (aicPerBlock_ + aivPerBlock_);
    const uint32_t exited = aivOnly ? exitedAiv_ : exitedAll_;
    if (exited > 0) {
        aborted_ = true;
        cv_.notify_all();
        throw ModelError("[ascendc-cpu model] " + ctx.name + ": " + what + " would hang on the device: " +
                         std::to_string(exited) + " core(s) returned without reaching it");
    }
    const uint32_t gen = generation_;
    barrierCtx_.push_back(&ctx);
    if (++arrived_ == participants) {
        arrived_ = 0;
        ++generation_;
        ++epoch_;
        epochRecords_.clear();
        report_.syncAllCalls++;
        // Every participant's later operations follow every participant's earlier ones.
        std::map<uint32_t, std::vector<int>> slots;
        for (auto* c : barrierCtx_) slots[c->block].push_back(c->slot);
        for (auto& [b, s] : slots) trackers_[b]->BarrierSlots(s);
        barrierCtx_.clear();
        cv_.notify_all();
        return;
    }
    BlockOn(lk, ctx, [this, gen] { return generation_ != gen; }, what);
}

// ---------------------------------------------------------------------------------------
// Cross-core flags. Each core has a counter per flag id (at most 15 pending). Mode 2: a set
// on the AIC adds 1 to the flag of both AIVs of its AI core; the AIC's flag gets 1 when both
// AIVs have set. Mode 1: when both AIVs have set, each AIV's flag gets 1. A wait blocks the
// core's later instructions until its counter is non-zero, then takes 1. The knowledge the
// setting pipe had travels with each count (vector clocks), so that the waiter's later
// accesses are ordered after the setter's earlier ones, and no others.

namespace {
constexpr size_t kCounterMax = 15;

void Push(std::deque<PipeClock>& q, const PipeClock& c, const std::string& core, int flagId, const std::string& what) {
    if (q.size() >= kCounterMax) {
        Fail(what + ": the counter of flag " + std::to_string(flagId) + " on " + core + " would exceed " +
             std::to_string(kCounterMax) + " (sets that no CrossCoreWaitFlag has taken); on the device this is an "
             "error that stops the kernel");
    }
    q.push_back(c);
}
}  // namespace

void Launch::CrossSet(BlockCtx& ctx, int mode, int flagId, const PipeClock& clock, const std::string& what) {
    std::unique_lock<std::mutex> lk(mu_);
    CrossFlag& f = cross_[ctx.block][flagId];
    auto pending = [&] {
        for (const auto& q : f.toCore)
            if (!q.empty()) return true;
        return !f.fromAiv[0].empty() || !f.fromAiv[1].empty();
    };
    if (f.mode >= 0 && f.mode != mode && pending()) {
        Fail(what + ": flag " + std::to_string(flagId) + " is used in mode " + std::to_string(mode) + " while sets of mode " +
             std::to_string(f.mode) + " are still pending (finish every set / wait of one mode before reusing the id)");
    }
    f.mode = mode;
    f.lastSet = ctx.name + " in " + what;
    const std::string aiv0 = "block " + std::to_string(ctx.block) + " AIV0", aiv1 = "block " + std::to_string(ctx.block) + " AIV1";
    if (mode == 2 && ctx.type == CoreType::AIC) {
        Push(f.toCore[1], clock, aiv0, flagId, what);
        Push(f.toCore[2], clock, aiv1, flagId, what);
    } else if (ctx.type == CoreType::AIV) {
        f.fromAiv[ctx.sub].push_back(clock);
        if (!f.fromAiv[0].empty() && !f.fromAiv[1].empty()) {
            PipeClock j = f.fromAiv[0].front();
            j.Join(f.fromAiv[1].front());
            f.fromAiv[0].pop_front();
            f.fromAiv[1].pop_front();
            if (mode == 2) {
                Push(f.toCore[0], j, "block " + std::to_string(ctx.block) + " AIC", flagId, what);
            } else {
                Push(f.toCore[1], j, aiv0, flagId, what);
                Push(f.toCore[2], j, aiv1, flagId, what);
            }
        }
    } else {
        Fail(what + ": mode 1 synchronises the two AIVs of an AI core; the AIC cannot set it");
    }
    cv_.notify_all();
}

PipeClock Launch::CrossWait(BlockCtx& ctx, int flagId, const std::string& what) {
    std::unique_lock<std::mutex> lk(mu_);
    auto& q = cross_[ctx.block][flagId].toCore[ctx.slot];
    BlockOn(lk, ctx, [&q] { return !q.empty(); }, what);
    PipeClock c = q.front();
    q.pop_front();
    return c;
}

void Launch::CheckCrossFlagsAtEnd() {
    for (uint32_t b = 0; b < cross_.size(); ++b) {
        for (const auto& [id, f] : cross_[b]) {
            static const char* cores[kSlots] = {"AIC", "AIV0", "AIV1"};
            for (int s = 0; s < kSlots; ++s) {
                if (!f.toCore[s].empty()) {
                    throw ModelError("[ascendc-cpu model] block " + std::to_string(b) + ": kernel returned with " +
                                     std::to_string(f.toCore[s].size()) + " CrossCoreSetFlag(" + std::to_string(id) +
                                     ") that no CrossCoreWaitFlag on " + cores[s] + " took (last set by " + f.lastSet +
                                     "): unmatched cross-core flags are undefined behaviour");
                }
            }
            for (int a = 0; a < 2; ++a) {
                if (!f.fromAiv[a].empty()) {
                    throw ModelError("[ascendc-cpu model] block " + std::to_string(b) + ": kernel returned with " +
                                     std::to_string(f.fromAiv[a].size()) + " CrossCoreSetFlag(" + std::to_string(id) +
                                     ") of AIV" + std::to_string(a) + " without the partner AIV's (mode " +
                                     std::to_string(f.mode) + " counts only when both AIVs have set)");
                }
            }
        }
    }
}

}  // namespace topth_model
