// CPU model of the Ascend C API subset: block index, flags, barriers, all-core sync and the
// cross-core flags of mix kernels (included by api_impl.h).
#pragma once

namespace AscendC {

// ======================================================================================
// Block index. In a 1:2 mix kernel the runtime starts blockDim AI cores, each one AIC and
// two AIVs: on the AIC GetBlockIdx is the block, on an AIV block * 2 + GetSubBlockIdx();
// GetBlockNum is blockDim on both; GetTaskRation is 1 on the AIC and 2 on an AIV.

inline int64_t GetBlockIdx() {
    const auto& c = topth_model::Ctx();
    return c.type == topth_model::CoreType::AIV ? int64_t(c.block) * c.ratio + c.sub : int64_t(c.block);
}
inline int64_t GetBlockNum() { return topth_model::Ctx().dim; }
inline int64_t GetSubBlockIdx() { return topth_model::Ctx().sub; }
inline int64_t GetSubBlockNum() {
    const auto& c = topth_model::Ctx();
    return c.type == topth_model::CoreType::AIV ? c.ratio : 1;
}
inline int64_t GetTaskRation() { return GetSubBlockNum(); }
inline int64_t GetTaskRatio() { return GetSubBlockNum(); }

namespace detail {
inline void EventPipes(HardEvent e, Pipe& src, Pipe& dst) {
    switch (e) {
        case HardEvent::MTE2_V: src = Pipe::MTE2; dst = Pipe::V; return;
        case HardEvent::V_MTE2: src = Pipe::V; dst = Pipe::MTE2; return;
        case HardEvent::MTE3_V: src = Pipe::MTE3; dst = Pipe::V; return;
        case HardEvent::V_MTE3: src = Pipe::V; dst = Pipe::MTE3; return;
        case HardEvent::MTE2_MTE3: src = Pipe::MTE2; dst = Pipe::MTE3; return;
        case HardEvent::MTE3_MTE2: src = Pipe::MTE3; dst = Pipe::MTE2; return;
        case HardEvent::S_V: src = Pipe::S; dst = Pipe::V; return;
        case HardEvent::V_S: src = Pipe::V; dst = Pipe::S; return;
        case HardEvent::S_MTE2: src = Pipe::S; dst = Pipe::MTE2; return;
        case HardEvent::MTE2_S: src = Pipe::MTE2; dst = Pipe::S; return;
        case HardEvent::S_MTE3: src = Pipe::S; dst = Pipe::MTE3; return;
        case HardEvent::MTE3_S: src = Pipe::MTE3; dst = Pipe::S; return;
        case HardEvent::MTE2_MTE1: src = Pipe::MTE2; dst = Pipe::MTE1; return;
        case HardEvent::MTE1_MTE2: src = Pipe::MTE1; dst = Pipe::MTE2; return;
        case HardEvent::MTE1_M: src = Pipe::MTE1; dst = Pipe::M; return;
        case HardEvent::M_MTE1: src = Pipe::M; dst = Pipe::MTE1; return;
        case HardEvent::M_FIX: src = Pipe::M; dst = Pipe::FIX; return;
        case HardEvent::FIX_M: src = Pipe::FIX; dst = Pipe::M; return;
        case HardEvent::MTE2_M: src = Pipe::MTE2; dst = Pipe::M; return;
        case HardEvent::M_MTE2: src = Pipe::M; dst = Pipe::MTE2; return;
        case HardEvent::FIX_MTE2: src = Pipe::FIX; dst = Pipe::MTE2; return;
        case HardEvent::MTE2_FIX: src = Pipe::MTE2; dst = Pipe::FIX; return;
        case HardEvent::FIX_S: src = Pipe::FIX; dst = Pipe::S; return;
        case HardEvent::S_FIX: src = Pipe::S; dst = Pipe::FIX; return;
        case HardEvent::M_S: src = Pipe::M; dst = Pipe::S; return;
        case HardEvent::S_M: src = Pipe::S; dst = Pipe::M; return;
        case HardEvent::MTE1_FIX: src = Pipe::MTE1; dst = Pipe::FIX; return;
        case HardEvent::FIX_MTE1: src = Pipe::FIX; dst = Pipe::MTE1; return;
    }
}

// Pipes of each core type (an event between pipes the core does not have is a bug).
inline bool CoreHasPipe(topth_model::CoreType t, Pipe p) {
    if (p == Pipe::S || p == Pipe::MTE2) return true;
    if (t == topth_model::CoreType::AIV) return p == Pipe::V || p == Pipe::MTE3;
    return p == Pipe::MTE1 || p == Pipe::M || p == Pipe::FIX;
}

inline Pipe ToPipe(pipe_t p) {
    switch (p) {
        case PIPE_S: return Pipe::S;
        case PIPE_V: return Pipe::V;
        case PIPE_M: return Pipe::M;
        case PIPE_MTE1: return Pipe::MTE1;
        case PIPE_MTE2: return Pipe::MTE2;
        case PIPE_MTE3: return Pipe::MTE3;
        case PIPE_FIX: return Pipe::FIX;
        default: return Pipe::S;
    }
}

inline void CheckEvent(const char* op, Pipe src, Pipe dst, const Loc& loc) {
    const auto t = Ctx().type;
    if (!CoreHasPipe(t, src) || !CoreHasPipe(t, dst)) {
        Fail(std::string(op) + " at " + Where(loc) + ": event " + topth_model::PipeName(src) + "_" +
             topth_model::PipeName(dst) + " names a pipe the " + (t == topth_model::CoreType::AIV ? "vector" : "cube") +
             " core does not have");
    }
}
}  // namespace detail

// ======================================================================================
// Same-core synchronisation

template <HardEvent evt>
inline void SetFlag(int32_t eventID, Loc loc = Loc::current()) {
    auto& ctx = topth_model::Ctx();
    Pipe src, dst;
    detail::EventPipes(evt, src, dst);
    detail::CheckEvent("SetFlag", src, dst, loc);
    auto key = std::make_pair(static_cast<int>(evt), static_cast<int>(eventID));
    if (ctx.flags.count(key)) {
        topth_model::Fail("SetFlag at " + topth_model::Where(loc) + ": event " + std::string(topth_model::PipeName(src)) +
                          "_" + topth_model::PipeName(dst) + " id " + std::to_string(eventID) +
                          " set twice without a WaitFlag in between");
    }
    ctx.flags[key] = ctx.haz->Capture(ctx.GPipe(static_cast<int>(src)));
    ctx.cnt.flags++;
}

template <HardEvent evt>
inline void WaitFlag(int32_t eventID, Loc loc = Loc::current()) {
    auto& ctx = topth_model::Ctx();
    Pipe src, dst;
    detail::EventPipes(evt, src, dst);
    detail::CheckEvent("WaitFlag", src, dst, loc);
    auto key = std::make_pair(static_cast<int>(evt), static_cast<int>(eventID));
    auto it = ctx.flags.find(key);
    if (it == ctx.flags.end()) {
        topth_model::Fail("WaitFlag at " + topth_model::Where(loc) + ": event " + std::string(topth_model::PipeName(src)) +
                          "_" + topth_model::PipeName(dst) + " id " + std::to_string(eventID) +
                          " was never set; on the device this waits forever");
    }
    ctx.haz->Observe(ctx.GPipe(static_cast<int>(dst)), it->second);
    ctx.flags.erase(it);
}

// Later instructions of the pipe wait for the earlier ones (PIPE_ALL: every pipe of the core
// for every other). Needed between dependent vector or cube instructions, and between
// copies of one MTE pipe whose destinations overlap (the device does not order them).
template <pipe_t p>
inline void PipeBarrier() {
    static_assert(p != PIPE_S, "PipeBarrier does not take PIPE_S (the scalar unit is in order)");
    auto& ctx = topth_model::Ctx();
    ctx.cnt.barriers++;
    if constexpr (p == PIPE_ALL) {
        ctx.haz->BarrierCore(ctx.slot);
    } else {
        ctx.haz->BarrierPipe(ctx.GPipe(static_cast<int>(detail::ToPipe(p))));
    }
}

// ======================================================================================
// All-core synchronisation

// Hard all-core synchronisation (hardware flags 11-14): Atlas A2, in a kernel of mix type.
// In a vector-only kernel (KERNEL_TYPE_MIX_AIV_1_0) isAIVOnly must be true; in a 1:2 mix
// kernel SyncAll<true>() synchronises the AIVs only (the AIC does not call it) and
// SyncAll<false>() every core. Blocks that cannot start because another stream holds their
// cores deadlock it unless the launch is in batch schedule mode.
template <bool isAIVOnly = true>
inline void SyncAll(Loc loc = Loc::current()) {
    auto& ctx = topth_model::Ctx();
    using topth_model::KernelType;
    if (ctx.kernelType == KernelType::Unset || ctx.kernelType == KernelType::AivOnly ||
        ctx.kernelType == KernelType::AicOnly) {
        topth_model::Fail("SyncAll<>() at " + topth_model::Where(loc) +
                          ": the hard all-core sync needs a mix kernel type (KERNEL_TASK_TYPE_DEFAULT("
                          "KERNEL_TYPE_MIX_AIV_1_0) / __mix__(0, 1) for a vector-only kernel); in this kernel it hangs");
    }
    if (ctx.kernelType == KernelType::MixAiv10 && !isAIVOnly) {
        topth_model::Fail("SyncAll<false>() at " + topth_model::Where(loc) +
                          ": isAIVOnly must be true in a vector-only (MIX_AIV_1_0) kernel, else it waits for cube "
                          "cores that never run");
    }
    if (isAIVOnly && ctx.type == topth_model::CoreType::AIC) {
        topth_model::Fail("SyncAll<true>() at " + topth_model::Where(loc) +
                          ": called on the AIC, but isAIVOnly synchronises the vector cores only");
    }
    ctx.haz->BarrierCore(ctx.slot);
    ctx.syncAllCalls++;
    ctx.launch->Barrier(ctx, isAIVOnly, loc);
}

// Soft all-core synchronisation (flags in a GM area). Requirements checked: gm workspace
// >= cores * 32 bytes, zeroed by the host; ub workspace >= cores * 32 bytes; usedCores 0 or
// the number of cores taking part. In a 1:2 mix kernel the AIVs call it with isAIVOnly =
// false: with true, the API indexes its area by the AI core (both AIVs of a core would
// share one slot). Deadlocks like the hard one without batch mode.
template <bool isAIVOnly = true>
inline void SyncAll(const GlobalTensor<int32_t>& gmWorkspace, const LocalTensor<int32_t>& ubWorkspace,
                    const int32_t usedCores = 0, Loc loc = Loc::current()) {
    auto& ctx = topth_model::Ctx();
    const bool mix = ctx.launch->Mix();
    if (mix && isAIVOnly) {
        topth_model::Fail("SyncAll<true>(gm, ub, n) at " + topth_model::Where(loc) +
                          ": in a mix kernel isAIVOnly = true indexes the GM area by the AI core, so the two AIVs of a "
                          "core share one slot; call it with isAIVOnly = false and usedCores = the number of AIVs");
    }
    if (ctx.type != topth_model::CoreType::AIV) {
        topth_model::Fail("SyncAll(gm, ub, n) at " + topth_model::Where(loc) + ": the model runs it on vector cores only");
    }
    const uint32_t cores = ctx.dim * ctx.ratio;
    const uint64_t need = uint64_t(cores) * 32;
    if (usedCores != 0 && static_cast<uint32_t>(usedCores) != cores) {
        topth_model::Fail("SyncAll at " + topth_model::Where(loc) + ": usedCores " + std::to_string(usedCores) +
                          " differs from the launch's " + std::to_string(cores) + " vector cores (not modelled)");
    }
    detail::CheckLive(ubWorkspace, "SyncAll", "ubWorkspace", loc);
    if (uint64_t(ubWorkspace.GetSize()) * 4 < need) {
        topth_model::Fail("SyncAll at " + topth_model::Where(loc) + ": ubWorkspace has " +
                          std::to_string(ubWorkspace.GetSize() * 4) + " bytes, needs cores * 32 = " + std::to_string(need));
    }
    auto& buf = detail::GmTouch(gmWorkspace, 0, need, false, "SyncAll", loc, false);
    const uint64_t start = reinterpret_cast<const uint8_t*>(gmWorkspace.addr_) - buf.base;
    if (gmWorkspace.sized_ && gmWorkspace.size_ * 4 < need) {
        topth_model::Fail("SyncAll at " + topth_model::Where(loc) + ": gmWorkspace declares fewer than cores * 32 bytes");
    }
    ctx.launch->CheckSyncWorkspace(buf.base + start, need, loc);
    ctx.haz->BarrierCore(ctx.slot);
    ctx.syncAllCalls++;
    ctx.launch->Barrier(ctx, true, loc);
}

// ======================================================================================
// Cross-core flags of a mix kernel (Atlas A2: modes 1 and 2 modelled; flag ids 0-10, since
// the hard SyncAll uses 11-14). CrossCoreSetFlag<mode, pipe>(id) is issued on `pipe`: it
// takes effect after that pipe's earlier instructions; CrossCoreWaitFlag(id) stops the
// core's later instructions of every pipe until its counter of `id` is non-zero.

namespace detail {
inline void CheckCrossFlag(const char* op, int flagId, const Loc& loc) {
    auto& ctx = Ctx();
    using topth_model::KernelType;
    if (ctx.kernelType != KernelType::MixAic11 && ctx.kernelType != KernelType::MixAic12) {
        Fail(std::string(op) + " at " + Where(loc) + ": cross-core flags between the AIC and the AIVs need a mix "
             "kernel type with cube cores (KERNEL_TYPE_MIX_AIC_1_1 / _1_2); in this kernel the hardware scheduler "
             "that counts them is not started");
    }
    if (flagId < 0 || flagId > 10) {
        Fail(std::string(op) + " at " + Where(loc) + ": flag id " + std::to_string(flagId) +
             " outside [0, 10] (Atlas A2; ids 11-14 belong to the hard SyncAll)");
    }
}
}  // namespace detail

template <uint8_t modeId, pipe_t pipe>
inline void CrossCoreSetFlag(uint16_t flagId, Loc loc = Loc::current()) {
    static_assert(pipe != PIPE_S && pipe != PIPE_ALL, "CrossCoreSetFlag does not take PIPE_S or PIPE_ALL");
    auto& ctx = topth_model::Ctx();
    const std::string what = "CrossCoreSetFlag<" + std::to_string(modeId) + ">(" + std::to_string(flagId) + ") at " +
                             topth_model::Where(loc);
    detail::CheckCrossFlag("CrossCoreSetFlag", flagId, loc);
    if (modeId != 1 && modeId != 2) topth_model::Fail(what + ": only modes 1 and 2 are modelled");
    const Pipe p = detail::ToPipe(pipe);
    if (!detail::CoreHasPipe(ctx.type, p)) {
        topth_model::Fail(what + ": the " + std::string(ctx.type == topth_model::CoreType::AIV ? "vector" : "cube") +
                          " core has no pipe " + topth_model::PipeName(p));
    }
    ctx.cnt.crossSets++;
    ctx.launch->CrossSet(ctx, modeId, flagId, ctx.haz->Capture(ctx.GPipe(static_cast<int>(p))), what);
}

template <uint8_t modeId = 0, pipe_t pipe = PIPE_S>
inline void CrossCoreWaitFlag(uint16_t flagId, Loc loc = Loc::current()) {
    auto& ctx = topth_model::Ctx();
    detail::CheckCrossFlag("CrossCoreWaitFlag", flagId, loc);
    ctx.cnt.crossWaits++;
    const std::string what = "CrossCoreWaitFlag(" + std::to_string(flagId) + ") at " + topth_model::Where(loc);
    ctx.haz->ObserveCore(ctx.slot, ctx.launch->CrossWait(ctx, flagId, what));
}

}  // namespace AscendC
