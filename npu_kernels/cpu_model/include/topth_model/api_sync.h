// CPU model of the Ascend C API subset: block index, flags, barriers, all-core sync (included by api_impl.h).
#pragma once

namespace AscendC {

// ======================================================================================
// Block index and synchronisation

inline int64_t GetBlockIdx() { return topth_model::Ctx().idx; }
inline int64_t GetBlockNum() { return topth_model::Ctx().dim; }

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
    }
}
}  // namespace detail

template <HardEvent evt>
inline void SetFlag(int32_t eventID, Loc loc = Loc::current()) {
    auto& ctx = topth_model::Ctx();
    Pipe src, dst;
    detail::EventPipes(evt, src, dst);
    auto key = std::make_pair(static_cast<int>(evt), static_cast<int>(eventID));
    if (ctx.flags.count(key)) {
        topth_model::Fail("SetFlag at " + topth_model::Where(loc) + ": event " + std::string(topth_model::PipeName(src)) +
                          "_" + topth_model::PipeName(dst) + " id " + std::to_string(eventID) +
                          " set twice without a WaitFlag in between");
    }
    ctx.flags[key] = ctx.haz.Capture(src);
    ctx.cnt.flags++;
}

template <HardEvent evt>
inline void WaitFlag(int32_t eventID, Loc loc = Loc::current()) {
    auto& ctx = topth_model::Ctx();
    Pipe src, dst;
    detail::EventPipes(evt, src, dst);
    auto key = std::make_pair(static_cast<int>(evt), static_cast<int>(eventID));
    auto it = ctx.flags.find(key);
    if (it == ctx.flags.end()) {
        topth_model::Fail("WaitFlag at " + topth_model::Where(loc) + ": event " + std::string(topth_model::PipeName(src)) +
                          "_" + topth_model::PipeName(dst) + " id " + std::to_string(eventID) +
                          " was never set; on the device this waits forever");
    }
    ctx.haz.Observe(dst, it->second);
    ctx.flags.erase(it);
}

template <pipe_t p>
inline void PipeBarrier() {
    auto& ctx = topth_model::Ctx();
    ctx.cnt.barriers++;
    if constexpr (p == PIPE_V) {
        ctx.haz.BarrierV();
    } else if constexpr (p == PIPE_ALL) {
        ctx.haz.BarrierAll();
    }
}

// Hard all-core synchronisation (hardware flags 11-14): Atlas A2, in a kernel of mix type
// (KERNEL_TYPE_MIX_AIV_1_0 for a vector-only kernel, with isAIVOnly = true; an AIV-only
// kernel, or isAIVOnly = false in a vector-only kernel, hangs on the device). Blocks that
// cannot start because another stream holds their cores deadlock it unless the launch is
// in batch schedule mode (Launch::SetResidentBlocks / SetBatchMode).
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
    ctx.haz.BarrierAll();
    ctx.syncAllCalls++;
    ctx.launch->Barrier(ctx.idx, loc);
}

// Soft all-core synchronisation (flags in a GM area). Requirements checked: gm workspace
// >= blockDim * 32 bytes, zeroed by the host; ub workspace >= blockDim * 32 bytes;
// usedCores 0 or the launch's blockDim. Deadlocks like the hard one without batch mode.
template <bool isAIVOnly = true>
inline void SyncAll(const GlobalTensor<int32_t>& gmWorkspace, const LocalTensor<int32_t>& ubWorkspace,
                    const int32_t usedCores = 0, Loc loc = Loc::current()) {
    auto& ctx = topth_model::Ctx();
    const uint64_t need = uint64_t(ctx.dim) * 32;
    if (usedCores != 0 && static_cast<uint32_t>(usedCores) != ctx.dim) {
        topth_model::Fail("SyncAll at " + topth_model::Where(loc) + ": usedCores " + std::to_string(usedCores) +
                          " differs from the launch's blockDim " + std::to_string(ctx.dim) + " (not modelled)");
    }
    detail::CheckLive(ubWorkspace, "SyncAll", "ubWorkspace", loc);
    if (uint64_t(ubWorkspace.GetSize()) * 4 < need) {
        topth_model::Fail("SyncAll at " + topth_model::Where(loc) + ": ubWorkspace has " +
                          std::to_string(ubWorkspace.GetSize() * 4) + " bytes, needs blockDim * 32 = " + std::to_string(need));
    }
    auto& buf = detail::GmTouch(gmWorkspace, 0, need, false, "SyncAll", loc, false);
    const uint64_t start = reinterpret_cast<const uint8_t*>(gmWorkspace.addr_) - buf.base;
    if (gmWorkspace.sized_ && gmWorkspace.size_ * 4 < need) {
        topth_model::Fail("SyncAll at " + topth_model::Where(loc) + ": gmWorkspace declares fewer than blockDim * 32 bytes");
    }
    ctx.launch->CheckSyncWorkspace(buf.base + start, need, loc);
    ctx.haz.BarrierAll();
    ctx.syncAllCalls++;
    ctx.launch->Barrier(ctx.idx, loc);
}

}  // namespace AscendC
