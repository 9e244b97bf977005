// CPU model of the Ascend C API subset: the pipe-ordering (hazard) tracker of one block
// (see core.h). One tracker per block (AI core): the pipes of its AIC and AIVs share it, so
// that GM accesses of the cube core and the vector cores are checked against each other
// through the cross-core flags, as intra-core accesses are through SetFlag / WaitFlag.
#include <algorithm>
#include <sstream>

#include "topth_model/core.h"

namespace topth_model {

const char* PipeName(Pipe p) {
    switch (p) {
        case Pipe::MTE2: return "MTE2";
        case Pipe::MTE3: return "MTE3";
        case Pipe::V: return "V";
        case Pipe::S: return "S";
        case Pipe::MTE1: return "MTE1";
        case Pipe::M: return "M";
        case Pipe::FIX: return "FIX";
    }
    return "?";
}

const char* SpaceName(int space) {
    static const char* names[kSpaces] = {"GM", "L1", "L0A", "L0B", "L0C", "UB", "UB", "UB"};
    return space >= 0 && space < kSpaces ? names[space] : "?";
}

void PipeClock::Join(const PipeClock& o) {
    for (int i = 0; i < kGPipes; ++i) c[i] = std::max(c[i], o.c[i]);
}

// ---------------------------------------------------------------------------------------
// IntervalSet

void IntervalSet::Add(uint64_t lo, uint64_t hi, uint64_t seq, const AccessInfo& info) {
    v_.erase(std::remove_if(v_.begin(), v_.end(), [&](const Interval& x) { return x.lo >= lo && x.hi <= hi; }),
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

// ---------------------------------------------------------------------------------------
// HazardTracker

namespace {
constexpr int kS = static_cast<int>(Pipe::S);

bool IsScalar(int gp) { return gp % kPipes == kS; }

std::string SyncHint(int src, int dst) {
    const Pipe s = static_cast<Pipe>(src % kPipes), d = static_cast<Pipe>(dst % kPipes);
    if (src / kPipes != dst / kPipes) {
        return "CrossCoreSetFlag on the writer's pipe and CrossCoreWaitFlag on the other core, after the access";
    }
    if (src == dst) return std::string("PipeBarrier<PIPE_") + PipeName(s) + ">()";
    return std::string("SetFlag/WaitFlag<HardEvent::") + PipeName(s) + "_" + PipeName(d) +
           ">, or a TQue EnQue/DeQue or FreeTensor/AllocTensor pair between them";
}

// Pipes of a core type that can touch a space (for pruning).
bool Touches(CoreType t, int pipe, int space) {
    const Pipe p = static_cast<Pipe>(pipe);
    if (space == static_cast<int>(Space::GM)) {
        return t == CoreType::AIC ? (p == Pipe::MTE2 || p == Pipe::FIX || p == Pipe::S)
                                  : (p == Pipe::MTE2 || p == Pipe::MTE3 || p == Pipe::S);
    }
    if (space >= static_cast<int>(Space::UB)) {
        return t == CoreType::AIV && (p == Pipe::MTE2 || p == Pipe::MTE3 || p == Pipe::V || p == Pipe::S);
    }
    if (t != CoreType::AIC) return false;
    switch (static_cast<Space>(space)) {
        case Space::L1: return p == Pipe::MTE2 || p == Pipe::MTE1;
        case Space::L0A:
        case Space::L0B: return p == Pipe::MTE1 || p == Pipe::M;
        case Space::L0C: return p == Pipe::M || p == Pipe::FIX;
        default: return false;
    }
}
}  // namespace

std::string HazardTracker::PipeLabel(int gp) const {
    const std::string core = slotName[gp / kPipes];
    return std::string(PipeName(static_cast<Pipe>(gp % kPipes))) + (core.empty() ? "" : " (" + core + ")");
}

void HazardTracker::SetActive(int slot, bool active, CoreType type) {
    std::lock_guard<std::mutex> lk(mu_);
    active_[slot] = active;
    type_[slot] = type;
}

void HazardTracker::Access(int space, int gp, bool write, uint64_t lo, uint64_t hi, const AccessInfo& info) {
    if (hi <= lo) return;
    std::lock_guard<std::mutex> lk(mu_);
    auto range = [&](uint64_t a, uint64_t b) {
        if (space == static_cast<int>(Space::GM) && describeGm) return describeGm(a, b);
        return std::string(SpaceName(space)) + " [" + std::to_string(a) + ", " + std::to_string(b) + ")";
    };
    for (int s = 0; s < kGPipes; ++s) {
        const bool same = (s == gp);
        if (same && IsScalar(gp)) continue;  // the scalar unit executes in order
        const uint64_t seen = clk_[gp][s];
        const Interval* w = log_[space][s][1].OverlapAfter(lo, hi, seen);
        const Interval* r = (write && !same) ? log_[space][s][0].OverlapAfter(lo, hi, seen) : nullptr;
        if (w || r) {
            const Interval* x = w ? w : r;
            std::ostringstream os;
            os << "data hazard: " << PipeLabel(gp) << (write ? " writes " : " reads ") << range(lo, hi) << " in "
               << info.Describe() << ", which " << PipeLabel(s) << (w ? " wrote" : " reads") << " in "
               << x->info.Describe() << ", with no " << PipeName(static_cast<Pipe>(s % kPipes)) << "->"
               << PipeName(static_cast<Pipe>(gp % kPipes)) << " synchronisation in between (" << SyncHint(s, gp)
               << ")";
            Fail(os.str());
        }
    }
    const uint64_t seq = ++seq_[gp];
    if (IsScalar(gp)) clk_[gp][gp] = seq;
    log_[space][gp][write ? 1 : 0].Add(lo, hi, seq, info);
    if (++accesses_ % 4096 == 0) Prune();
}

void HazardTracker::Prune() {
    // An access every pipe that can touch the space has observed can never conflict again.
    for (int sp = 0; sp < kSpaces; ++sp) {
        for (int p = 0; p < kGPipes; ++p) {
            uint64_t minSeen = UINT64_MAX;
            for (int q = 0; q < kGPipes; ++q) {
                const int slot = q / kPipes;
                if (!active_[slot] || !Touches(type_[slot], q % kPipes, sp)) continue;
                if (sp >= static_cast<int>(Space::UB) && sp - 5 != slot) continue;
                if (q == p && IsScalar(p)) continue;
                minSeen = std::min(minSeen, clk_[q][p]);
            }
            if (minSeen == UINT64_MAX) minSeen = seq_[p];  // no live pipe can touch it any more
            for (int k = 0; k < 2; ++k) log_[sp][p][k].PruneUpTo(minSeen);
        }
    }
    for (int sp = 0; sp < kSpaces; ++sp)
        for (int p = 0; p < kGPipes; ++p)
            for (int k = 0; k < 2; ++k)
                if (log_[sp][p][k].Size() > 50000) {
                    Fail("internal: more than 50000 accesses by one pipe are never synchronised with the others");
                }
}

PipeClock HazardTracker::Capture(int gp) {
    std::lock_guard<std::mutex> lk(mu_);
    PipeClock c;
    for (int i = 0; i < kGPipes; ++i) c.c[i] = clk_[gp][i];
    c.c[gp] = seq_[gp];  // a flag is set after every earlier operation of its pipe completes
    return c;
}

void HazardTracker::Observe(int gp, const PipeClock& c) {
    std::lock_guard<std::mutex> lk(mu_);
    for (int i = 0; i < kGPipes; ++i) clk_[gp][i] = std::max(clk_[gp][i], c.c[i]);
}

void HazardTracker::ObserveCore(int slot, const PipeClock& c) {
    std::lock_guard<std::mutex> lk(mu_);
    for (int p = 0; p < kPipes; ++p)
        for (int i = 0; i < kGPipes; ++i) clk_[slot * kPipes + p][i] = std::max(clk_[slot * kPipes + p][i], c.c[i]);
}

void HazardTracker::BarrierPipe(int gp) {
    std::lock_guard<std::mutex> lk(mu_);
    clk_[gp][gp] = seq_[gp];
}

void HazardTracker::BarrierCore(int slot) {
    std::lock_guard<std::mutex> lk(mu_);
    for (int q = slot * kPipes; q < (slot + 1) * kPipes; ++q)
        for (int p = slot * kPipes; p < (slot + 1) * kPipes; ++p) clk_[q][p] = std::max(clk_[q][p], seq_[p]);
}

void HazardTracker::BarrierSlots(const std::vector<int>& slots) {
    std::lock_guard<std::mutex> lk(mu_);
    for (int a : slots)
        for (int q = a * kPipes; q < (a + 1) * kPipes; ++q)
            for (int b : slots)
                for (int p = b * kPipes; p < (b + 1) * kPipes; ++p) clk_[q][p] = std::max(clk_[q][p], seq_[p]);
}

}  // namespace topth_model
