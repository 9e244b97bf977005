// CPU model of the Ascend C API subset: implementations (included by kernel_operator.h).
#pragma once

#include <algorithm>
#include <sstream>

namespace AscendC {
namespace detail {

using topth_model::AccessInfo;
using topth_model::Ctx;
using topth_model::Fail;
using topth_model::SlotState;
using topth_model::Where;

inline AccessInfo Info(const char* op, const Loc& loc) { return AccessInfo{op, loc.file_name(), loc.line()}; }

inline std::string BufName(int index) {
    auto& ctx = Ctx();
    if (index < 0 || index >= static_cast<int>(ctx.buffers.size())) return "?";
    return ctx.buffers[index].desc;
}

template <typename T>
inline void CheckLive(const LocalTensor<T>& t, const char* op, const char* role, const Loc& loc) {
    if (!t.valid_) {
        Fail(std::string(op) + " at " + Where(loc) + ": " + role +
             " is a LocalTensor that never came from TBuf::Get or TQue::AllocTensor/DeQue");
    }
    if (t.slot_ && (t.slot_->gen != t.gen_ || t.slot_->st == SlotState::Free)) {
        Fail(std::string(op) + " at " + Where(loc) + ": " + role + " is a buffer of " + BufName(t.bufIndex_) +
             " used after FreeTensor");
    }
}

// Record an access of bytes [relLo, relHi) of tensor t (relative to its start) by pipe p.
template <typename T>
inline void UbTouch(const LocalTensor<T>& t, uint64_t relLo, uint64_t relHi, Pipe p, bool write, const char* op,
                    const char* role, const Loc& loc) {
    CheckLive(t, op, role, loc);
    const uint64_t lo = t.off_ + relLo, hi = t.off_ + relHi;
    if (lo < t.bufLo_ || hi > t.bufHi_) {
        std::ostringstream os;
        os << op << " at " << Where(loc) << ": " << role << " UB range [" << lo << ", " << hi
           << ") is outside its buffer [" << t.bufLo_ << ", " << t.bufHi_ << ") (" << BufName(t.bufIndex_) << ")";
        Fail(os.str());
    }
    Ctx().haz.Access(topth_model::Space::UB, p, write, lo, hi, Info(op, loc));
}

template <typename T>
inline void CheckAlign(const LocalTensor<T>& t, uint32_t align, const char* op, const char* role, const Loc& loc) {
    if (t.off_ % align != 0) {
        Fail(std::string(op) + " at " + Where(loc) + ": " + role + " UB address " + std::to_string(t.off_) +
             " is not " + std::to_string(align) + "-byte aligned (" + BufName(t.bufIndex_) + ")");
    }
}

// Resolve a GM range, check bounds, record hazards / races / bytes.
template <typename T>
inline topth_model::GmBuffer& GmTouch(const GlobalTensor<T>& g, uint64_t relLo, uint64_t relHi, bool write,
                                      const char* op, const Loc& loc, bool countBytes = true,
                                      Pipe pipe = Pipe::MTE2) {
    auto& ctx = Ctx();
    if (!g.addr_) Fail(std::string(op) + " at " + Where(loc) + ": GlobalTensor was never given a GM address");
    auto& buf = ctx.launch->FindGm(reinterpret_cast<const uint8_t*>(g.addr_), op, loc);
    const uint64_t start = reinterpret_cast<const uint8_t*>(g.addr_) - buf.base;
    const uint64_t lo = start + relLo, hi = start + relHi;
    if (hi > buf.bytes) {
        std::ostringstream os;
        os << op << " at " << Where(loc) << ": GM range [" << lo << ", " << hi << ") bytes of '" << buf.name
           << "' is out of bounds (the buffer has " << buf.bytes << " bytes)";
        Fail(os.str());
    }
    if (g.sized_ && (g.overrun_ || relHi > g.size_ * sizeof(T))) {
        std::ostringstream os;
        os << op << " at " << Where(loc) << ": GM range [" << lo << ", " << hi << ") bytes of '" << buf.name
           << "' goes past the GlobalTensor's declared size";
        Fail(os.str());
    }
    if (write && !buf.writable) {
        Fail(std::string(op) + " at " + Where(loc) + ": writes GM buffer '" + buf.name + "', a read-only input");
    }
    if (buf.writable) {
        const uint64_t alo = reinterpret_cast<uint64_t>(buf.base) + lo, ahi = reinterpret_cast<uint64_t>(buf.base) + hi;
        ctx.haz.Access(topth_model::Space::GM, write ? Pipe::MTE3 : pipe, write, alo, ahi, Info(op, loc));
        ctx.launch->RecordGm(ctx.idx, write, alo, ahi, Info(op, loc));
    }
    if (countBytes) ctx.launch->AddBytes(buf, !write, relHi - relLo);
    return buf;
}

inline uint32_t RoundUp32(uint64_t x) { return static_cast<uint32_t>((x + 31) / 32 * 32); }

}  // namespace detail

// ======================================================================================
// Tensors

template <typename T>
T LocalTensor<T>::GetValue(uint32_t index, Loc loc) const {
    detail::UbTouch(*this, uint64_t(index) * sizeof(T), uint64_t(index + 1) * sizeof(T), Pipe::S, false,
                    "LocalTensor::GetValue", "the tensor", loc);
    T v;
    std::memcpy(&v, reinterpret_cast<const uint8_t*>(Ptr()) + uint64_t(index) * sizeof(T), sizeof(T));
    return v;
}

template <typename T>
void LocalTensor<T>::SetValue(uint32_t index, T value, Loc loc) const {
    detail::UbTouch(*this, uint64_t(index) * sizeof(T), uint64_t(index + 1) * sizeof(T), Pipe::S, true,
                    "LocalTensor::SetValue", "the tensor", loc);
    std::memcpy(reinterpret_cast<uint8_t*>(Ptr()) + uint64_t(index) * sizeof(T), &value, sizeof(T));
}

template <typename T>
void GlobalTensor<T>::SetGlobalBuffer(__gm__ T* buffer, uint64_t bufferSize, Loc loc) {
    addr_ = buffer;
    size_ = bufferSize;
    sized_ = true;
    overrun_ = false;
    if (buffer && bufferSize > 0) {
        auto& buf = topth_model::Ctx().launch->FindGm(buffer, "GlobalTensor::SetGlobalBuffer", loc);
        const uint64_t start = reinterpret_cast<const uint8_t*>(buffer) - buf.base;
        if (start + bufferSize * sizeof(T) > buf.bytes) {
            topth_model::Fail("GlobalTensor::SetGlobalBuffer at " + topth_model::Where(loc) + ": declares " +
                              std::to_string(bufferSize * sizeof(T)) + " bytes from offset " + std::to_string(start) +
                              " of '" + buf.name + "', which has " + std::to_string(buf.bytes) + " bytes");
        }
    }
}

template <typename T>
T GlobalTensor<T>::GetValue(uint64_t index, Loc loc) const {
    auto& ctx = topth_model::Ctx();
    GlobalTensor<T> g = (*this)[index];
    if (!g.addr_ || !addr_) topth_model::Fail("GlobalTensor::GetValue at " + topth_model::Where(loc) + ": no GM address");
    auto& buf = ctx.launch->FindGm(g.addr_, "GlobalTensor::GetValue", loc);
    if (buf.writtenByKernel) {
        topth_model::Fail("GlobalTensor::GetValue at " + topth_model::Where(loc) + ": scalar read of GM buffer '" +
                          buf.name + "', which this kernel writes: the scalar data cache may hold stale data "
                          "(copy it to UB with DataCopy instead)");
    }
    detail::GmTouch(g, 0, sizeof(T), false, "GlobalTensor::GetValue", loc, false, Pipe::S);
    T v;
    std::memcpy(&v, g.addr_, sizeof(T));
    return v;
}

inline TPipe::TPipe(Loc loc) {
    auto& ctx = topth_model::Ctx();
    if (ctx.pipeAlive) topth_model::Fail("TPipe at " + topth_model::Where(loc) + ": a second TPipe while one is alive");
    ctx.pipeAlive = true;
    ctx.pipePtr = this;
    ctx.pipeCursor = 0;
}

inline TPipe::~TPipe() {
    auto* launch = topth_model::Ctx().launch;
    auto& ctx = topth_model::Ctx();
    launch->NoteUb(ctx.pipeCursor);
    ctx.pipeAlive = false;
    ctx.pipePtr = nullptr;
}

inline TPipe* GetTPipePtr() {
    auto* p = static_cast<TPipe*>(topth_model::Ctx().pipePtr);
    if (!p) topth_model::Fail("GetTPipePtr: no live TPipe");
    return p;
}

namespace detail {
inline uint32_t UbAlloc(uint32_t bytes, const std::string& what, const Loc& loc) {
    auto& ctx = Ctx();
    if (!ctx.pipeAlive) Fail("TPipe::InitBuffer at " + Where(loc) + ": no TPipe");
    const uint32_t len = RoundUp32(bytes);
    const uint64_t end = uint64_t(ctx.pipeCursor) + len;
    if (end > ctx.ub.size()) {
        std::ostringstream os;
        os << "TPipe::InitBuffer at " << Where(loc) << ": " << what << " needs " << len << " bytes but only "
           << (ctx.ub.size() - ctx.pipeCursor) << " of the " << ctx.ub.size()
           << "-byte unified buffer are left (" << ctx.pipeCursor << " already in use)";
        Fail(os.str());
    }
    const uint32_t lo = ctx.pipeCursor;
    ctx.pipeCursor = static_cast<uint32_t>(end);
    return lo;
}
}  // namespace detail

template <TPosition pos, int32_t depth, auto mask>
bool TPipe::InitBuffer(TQue<pos, depth, mask>& que, uint8_t num, uint32_t len, Loc loc) {
    auto& ctx = topth_model::Ctx();
    if (num == 0 || len == 0) topth_model::Fail("TPipe::InitBuffer at " + topth_model::Where(loc) + ": zero buffers or zero length");
    if (que.qindex_ >= 0) topth_model::Fail("TPipe::InitBuffer at " + topth_model::Where(loc) + ": queue initialised twice");
    auto q = std::make_unique<topth_model::QueueState>();
    const char* posName = pos == TPosition::VECIN ? "VECIN" : pos == TPosition::VECOUT ? "VECOUT" : "VECCALC";
    q->desc = std::string("TQue<") + posName + ", depth " + std::to_string(depth) + "> initialised at " +
              topth_model::Where(loc);
    q->position = static_cast<int>(pos);
    q->depth = depth;
    const uint32_t slotLen = detail::RoundUp32(len);
    for (int i = 0; i < num; ++i) {
        const uint32_t lo = detail::UbAlloc(len, q->desc, loc);
        auto s = std::make_unique<topth_model::SlotState>();
        s->lo = lo;
        s->hi = lo + slotLen;
        ctx.buffers.push_back(topth_model::BufferDesc{s->lo, s->hi, q->desc});
        q->slots.push_back(std::move(s));
        q->freeOrder.push_back(i);
    }
    que.qindex_ = static_cast<int>(ctx.queues.size());
    ctx.queues.push_back(std::move(q));
    return true;
}

template <TPosition pos>
bool TPipe::InitBuffer(TBuf<pos>& buf, uint32_t len, Loc loc) {
    auto& ctx = topth_model::Ctx();
    if (len == 0) topth_model::Fail("TPipe::InitBuffer at " + topth_model::Where(loc) + ": zero-length TBuf");
    if (buf.index_ >= 0) topth_model::Fail("TPipe::InitBuffer at " + topth_model::Where(loc) + ": TBuf initialised twice");
    std::string desc = "TBuf initialised at " + topth_model::Where(loc);
    buf.lo_ = detail::UbAlloc(len, desc, loc);
    buf.hi_ = buf.lo_ + detail::RoundUp32(len);
    buf.index_ = static_cast<int>(ctx.buffers.size());
    ctx.buffers.push_back(topth_model::BufferDesc{buf.lo_, buf.hi_, desc});
    return true;
}

namespace detail {
// Producer and consumer pipes of a queue position (VECIN: MTE2 -> V, VECOUT: V -> MTE3).
inline bool QueuePipes(int position, Pipe& prod, Pipe& cons) {
    if (position == static_cast<int>(TPosition::VECIN)) {
        prod = Pipe::MTE2;
        cons = Pipe::V;
        return true;
    }
    if (position == static_cast<int>(TPosition::VECOUT)) {
        prod = Pipe::V;
        cons = Pipe::MTE3;
        return true;
    }
    return false;
}

inline topth_model::QueueState& Queue(int qindex, const char* op, const Loc& loc) {
    auto& ctx = Ctx();
    if (qindex < 0 || qindex >= static_cast<int>(ctx.queues.size())) {
        Fail(std::string(op) + " at " + Where(loc) + ": queue was never passed to TPipe::InitBuffer");
    }
    return *ctx.queues[qindex];
}

inline int SlotIndexOf(const topth_model::QueueState& q, const topth_model::SlotState* s) {
    for (size_t i = 0; i < q.slots.size(); ++i)
        if (q.slots[i].get() == s) return static_cast<int>(i);
    return -1;
}
}  // namespace detail

template <TPosition pos, int32_t depth, auto mask>
template <typename T>
LocalTensor<T> TQue<pos, depth, mask>::AllocTensor(Loc loc) {
    auto& q = detail::Queue(qindex_, "TQue::AllocTensor", loc);
    if (q.freeOrder.empty()) {
        topth_model::Fail("TQue::AllocTensor at " + topth_model::Where(loc) + ": all " + std::to_string(q.slots.size()) +
                          " buffers of " + q.desc + " are in use (missing FreeTensor?); on the device this waits forever");
    }
    const int i = q.freeOrder.front();
    q.freeOrder.erase(q.freeOrder.begin());
    auto* s = q.slots[i].get();
    s->st = topth_model::SlotState::Allocated;
    s->gen++;
    Pipe prod, cons;
    if (detail::QueuePipes(q.position, prod, cons)) {
        // AllocTensor waits for the flag the consumer set at FreeTensor of this buffer.
        topth_model::Ctx().haz.Observe(prod, s->freed);
    }
    LocalTensor<T> t;
    t.valid_ = true;
    t.off_ = s->lo;
    t.size_ = (s->hi - s->lo) / static_cast<uint32_t>(sizeof(T));
    t.bufLo_ = s->lo;
    t.bufHi_ = s->hi;
    for (size_t b = 0; b < topth_model::Ctx().buffers.size(); ++b) {
        if (topth_model::Ctx().buffers[b].lo == s->lo) t.bufIndex_ = static_cast<int>(b);
    }
    t.slot_ = s;
    t.gen_ = s->gen;
    return t;
}

template <TPosition pos, int32_t depth, auto mask>
template <typename T>
bool TQue<pos, depth, mask>::EnQue(const LocalTensor<T>& tensor, Loc loc) {
    auto& q = detail::Queue(qindex_, "TQue::EnQue", loc);
    const int i = detail::SlotIndexOf(q, tensor.slot_);
    if (i < 0) topth_model::Fail("TQue::EnQue at " + topth_model::Where(loc) + ": tensor was not allocated from " + q.desc);
    auto* s = q.slots[i].get();
    if (s->gen != tensor.gen_ || s->st != topth_model::SlotState::Allocated) {
        topth_model::Fail("TQue::EnQue at " + topth_model::Where(loc) + ": tensor of " + q.desc +
                          " is not in the allocated state (enqueued twice, or after FreeTensor)");
    }
    if (static_cast<int32_t>(q.fifo.size()) >= q.depth) {
        topth_model::Fail("TQue::EnQue at " + topth_model::Where(loc) + ": " + q.desc + " already holds " +
                          std::to_string(q.fifo.size()) + " tensor(s), its depth");
    }
    s->st = topth_model::SlotState::Enqueued;
    Pipe prod, cons;
    if (detail::QueuePipes(q.position, prod, cons)) s->enqueued = topth_model::Ctx().haz.Capture(prod);
    q.fifo.push_back(i);
    return true;
}

template <TPosition pos, int32_t depth, auto mask>
template <typename T>
LocalTensor<T> TQue<pos, depth, mask>::DeQue(Loc loc) {
    auto& q = detail::Queue(qindex_, "TQue::DeQue", loc);
    if (q.fifo.empty()) {
        topth_model::Fail("TQue::DeQue at " + topth_model::Where(loc) + ": " + q.desc +
                          " is empty (no EnQue before it); on the device this waits forever");
    }
    const int i = q.fifo.front();
    q.fifo.erase(q.fifo.begin());
    auto* s = q.slots[i].get();
    s->st = topth_model::SlotState::Dequeued;
    Pipe prod, cons;
    if (detail::QueuePipes(q.position, prod, cons)) {
        // DeQue waits for the flag the producer set at EnQue.
        topth_model::Ctx().haz.Observe(cons, s->enqueued);
    }
    LocalTensor<T> t;
    t.valid_ = true;
    t.off_ = s->lo;
    t.size_ = (s->hi - s->lo) / static_cast<uint32_t>(sizeof(T));
    t.bufLo_ = s->lo;
    t.bufHi_ = s->hi;
    for (size_t b = 0; b < topth_model::Ctx().buffers.size(); ++b) {
        if (topth_model::Ctx().buffers[b].lo == s->lo) t.bufIndex_ = static_cast<int>(b);
    }
    t.slot_ = s;
    t.gen_ = s->gen;
    return t;
}

template <TPosition pos, int32_t depth, auto mask>
template <typename T>
void TQue<pos, depth, mask>::FreeTensor(LocalTensor<T>& tensor, Loc loc) {
    auto& q = detail::Queue(qindex_, "TQue::FreeTensor", loc);
    const int i = detail::SlotIndexOf(q, tensor.slot_);
    if (i < 0) topth_model::Fail("TQue::FreeTensor at " + topth_model::Where(loc) + ": tensor was not allocated from " + q.desc);
    auto* s = q.slots[i].get();
    if (s->gen != tensor.gen_ || s->st == topth_model::SlotState::Free) {
        topth_model::Fail("TQue::FreeTensor at " + topth_model::Where(loc) + ": buffer of " + q.desc + " freed twice");
    }
    if (s->st != topth_model::SlotState::Dequeued) {
        topth_model::Fail("TQue::FreeTensor at " + topth_model::Where(loc) + ": buffer of " + q.desc +
                          (s->st == topth_model::SlotState::Enqueued ? " is still enqueued (DeQue it first)"
                                                                    : " was never enqueued and dequeued"));
    }
    s->st = topth_model::SlotState::Free;
    Pipe prod, cons;
    if (detail::QueuePipes(q.position, prod, cons)) s->freed = topth_model::Ctx().haz.Capture(cons);
    q.freeOrder.push_back(i);
}

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
    if constexpr (p == PIPE_V) {
        ctx.haz.BarrierV();
    } else if constexpr (p == PIPE_ALL) {
        ctx.haz.BarrierAll();
    }
}

// Soft all-core synchronisation (the hard SyncAll<>() is not available to kernel-launch
// projects). Requirements checked: gm workspace >= blockDim * 32 bytes, zeroed by the
// host; ub workspace >= blockDim * 32 bytes; usedCores 0 or the launch's blockDim.
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

// ======================================================================================
// Data movement

namespace detail {
template <typename T>
inline void CheckGmToUbBlocks(const char* op, uint32_t blockCount, const Loc& loc) {
    if (blockCount == 0 || blockCount > 4095) {
        Fail(std::string(op) + " at " + Where(loc) + ": blockCount " + std::to_string(blockCount) + " outside [1, 4095]");
    }
}
}  // namespace detail

// GM -> UB, `count` elements; count * sizeof(T) must be a multiple of 32 bytes.
template <typename T>
inline void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const uint32_t count, Loc loc = Loc::current()) {
    const char* op = "DataCopy GM->UB";
    const uint64_t bytes = uint64_t(count) * sizeof(T);
    if (count == 0 || bytes % 32 != 0) {
        detail::Fail(std::string(op) + " at " + detail::Where(loc) + ": length " + std::to_string(bytes) +
                     " bytes is not a positive multiple of 32 bytes (use DataCopyPad)");
    }
    detail::CheckAlign(dst, 32, op, "destination", loc);
    detail::GmTouch(src, 0, bytes, false, op, loc);
    detail::UbTouch(dst, 0, bytes, Pipe::MTE2, true, op, "destination", loc);
    std::memcpy(dst.Ptr(), src.addr_, bytes);
}

// UB -> GM, `count` elements; count * sizeof(T) must be a multiple of 32 bytes.
template <typename T>
inline void DataCopy(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const uint32_t count, Loc loc = Loc::current()) {
    const char* op = "DataCopy UB->GM";
    const uint64_t bytes = uint64_t(count) * sizeof(T);
    if (count == 0 || bytes % 32 != 0) {
        detail::Fail(std::string(op) + " at " + detail::Where(loc) + ": length " + std::to_string(bytes) +
                     " bytes is not a positive multiple of 32 bytes (use DataCopyPad)");
    }
    detail::CheckAlign(src, 32, op, "source", loc);
    detail::UbTouch(src, 0, bytes, Pipe::MTE3, false, op, "source", loc);
    detail::GmTouch(dst, 0, bytes, true, op, loc);
    std::memcpy(dst.addr_, src.Ptr(), bytes);
}

// GM -> UB in blocks; blockLen, srcStride and dstStride in 32-byte units.
template <typename T>
inline void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const DataCopyParams& p, Loc loc = Loc::current()) {
    const char* op = "DataCopy GM->UB";
    detail::CheckGmToUbBlocks<T>(op, p.blockCount, loc);
    if (p.blockLen == 0) detail::Fail(std::string(op) + " at " + detail::Where(loc) + ": blockLen 0");
    detail::CheckAlign(dst, 32, op, "destination", loc);
    const uint64_t len = uint64_t(p.blockLen) * 32;
    const uint64_t gStep = len + uint64_t(p.srcStride) * 32, uStep = len + uint64_t(p.dstStride) * 32;
    for (uint32_t i = 0; i < p.blockCount; ++i) {
        GlobalTensor<T> g = src;
        detail::GmTouch(g, i * gStep, i * gStep + len, false, op, loc);
        detail::UbTouch(dst, i * uStep, i * uStep + len, Pipe::MTE2, true, op, "destination", loc);
        std::memcpy(reinterpret_cast<uint8_t*>(dst.Ptr()) + i * uStep, reinterpret_cast<const uint8_t*>(src.addr_) + i * gStep, len);
    }
}

// UB -> GM in blocks; blockLen, srcStride and dstStride in 32-byte units.
template <typename T>
inline void DataCopy(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const DataCopyParams& p, Loc loc = Loc::current()) {
    const char* op = "DataCopy UB->GM";
    detail::CheckGmToUbBlocks<T>(op, p.blockCount, loc);
    if (p.blockLen == 0) detail::Fail(std::string(op) + " at " + detail::Where(loc) + ": blockLen 0");
    detail::CheckAlign(src, 32, op, "source", loc);
    const uint64_t len = uint64_t(p.blockLen) * 32;
    const uint64_t uStep = len + uint64_t(p.srcStride) * 32, gStep = len + uint64_t(p.dstStride) * 32;
    for (uint32_t i = 0; i < p.blockCount; ++i) {
        detail::UbTouch(src, i * uStep, i * uStep + len, Pipe::MTE3, false, op, "source", loc);
        detail::GmTouch(dst, i * gStep, i * gStep + len, true, op, loc);
        std::memcpy(reinterpret_cast<uint8_t*>(dst.addr_) + i * gStep, reinterpret_cast<const uint8_t*>(src.Ptr()) + i * uStep, len);
    }
}

// GM -> UB without alignment constraint on the length: blockLen bytes per block, GM gap
// srcStride bytes, UB gap dstStride 32-byte blocks. Each block lands at a 32-byte
// boundary in UB, padded on the left / right with paddingValue when isPad (at most 32
// bytes each). Model choice: bytes of the last 32-byte block not covered by data or
// padding are left undefined (0xFF here), as the reference leaves them unspecified.
template <typename T>
inline void DataCopyPad(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const DataCopyExtParams& p,
                        const DataCopyPadExtParams<T>& pad, Loc loc = Loc::current()) {
    const char* op = "DataCopyPad GM->UB";
    detail::CheckGmToUbBlocks<T>(op, p.blockCount, loc);
    if (p.blockLen == 0) detail::Fail(std::string(op) + " at " + detail::Where(loc) + ": blockLen 0");
    detail::CheckAlign(dst, 32, op, "destination", loc);
    const uint32_t lp = pad.isPad ? pad.leftPadding : 0, rp = pad.isPad ? pad.rightPadding : 0;
    if (lp * sizeof(T) > 32 || rp * sizeof(T) > 32) {
        detail::Fail(std::string(op) + " at " + detail::Where(loc) + ": left/right padding over 32 bytes");
    }
    if (p.blockLen % sizeof(T) != 0) {
        detail::Fail(std::string(op) + " at " + detail::Where(loc) + ": blockLen " + std::to_string(p.blockLen) +
                     " is not a whole number of elements");
    }
    const uint64_t row = detail::RoundUp32(uint64_t(lp + rp) * sizeof(T) + p.blockLen);
    const uint64_t gStep = uint64_t(p.blockLen) + p.srcStride, uStep = row + uint64_t(p.dstStride) * 32;
    for (uint32_t i = 0; i < p.blockCount; ++i) {
        detail::GmTouch(src, i * gStep, i * gStep + p.blockLen, false, op, loc);
        detail::UbTouch(dst, i * uStep, i * uStep + row, Pipe::MTE2, true, op, "destination", loc);
        uint8_t* d = reinterpret_cast<uint8_t*>(dst.Ptr()) + i * uStep;
        std::memset(d, 0xFF, row);
        T* dt = reinterpret_cast<T*>(d);
        for (uint32_t k = 0; k < lp; ++k) dt[k] = pad.paddingValue;
        std::memcpy(d + lp * sizeof(T), reinterpret_cast<const uint8_t*>(src.addr_) + i * gStep, p.blockLen);
        T* after = reinterpret_cast<T*>(d + lp * sizeof(T) + p.blockLen);
        for (uint32_t k = 0; k < rp; ++k) after[k] = pad.paddingValue;
    }
}

// UB -> GM without alignment constraint: blockLen bytes per block; the UB source of each
// block starts at a 32-byte boundary (gap srcStride 32-byte blocks); GM gap dstStride bytes.
template <typename T>
inline void DataCopyPad(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const DataCopyExtParams& p,
                        Loc loc = Loc::current()) {
    const char* op = "DataCopyPad UB->GM";
    detail::CheckGmToUbBlocks<T>(op, p.blockCount, loc);
    if (p.blockLen == 0) detail::Fail(std::string(op) + " at " + detail::Where(loc) + ": blockLen 0");
    detail::CheckAlign(src, 32, op, "source", loc);
    const uint64_t row = detail::RoundUp32(p.blockLen);
    const uint64_t uStep = row + uint64_t(p.srcStride) * 32, gStep = uint64_t(p.blockLen) + p.dstStride;
    for (uint32_t i = 0; i < p.blockCount; ++i) {
        detail::UbTouch(src, i * uStep, i * uStep + p.blockLen, Pipe::MTE3, false, op, "source", loc);
        detail::GmTouch(dst, i * gStep, i * gStep + p.blockLen, true, op, loc);
        std::memcpy(reinterpret_cast<uint8_t*>(dst.addr_) + i * gStep, reinterpret_cast<const uint8_t*>(src.Ptr()) + i * uStep,
                    p.blockLen);
    }
}

// ======================================================================================
// Vector unit (pipe V). "count" forms operate on the first count elements; operands
// start 32-byte aligned. Repeat forms follow the mask / repeatTimes / block-stride /
// repeat-stride model of the Ascend C "high-dimensional tensor" interfaces (continuous
// mask mode: the first `mask` elements of each 256-byte repeat take part).

namespace detail {

template <typename T>
inline void VecRead(const LocalTensor<T>& t, uint64_t count, const char* op, const char* role, const Loc& loc) {
    CheckAlign(t, 32, op, role, loc);
    UbTouch(t, 0, count * sizeof(T), Pipe::V, false, op, role, loc);
}
template <typename T>
inline void VecWrite(const LocalTensor<T>& t, uint64_t count, const char* op, const char* role, const Loc& loc) {
    CheckAlign(t, 32, op, role, loc);
    UbTouch(t, 0, count * sizeof(T), Pipe::V, true, op, role, loc);
}
inline void CheckCount(int64_t count, const char* op, const Loc& loc) {
    if (count < 0) Fail(std::string(op) + " at " + Where(loc) + ": negative count");
}

template <typename T>
inline float ToF(T v) {
    if constexpr (std::is_same_v<T, float>) return v;
    else return static_cast<float>(v);
}

// Byte extent [0, hi) of the elements a repeat-form operand touches (relative to its start).
template <typename T>
inline uint64_t RepExtent(uint32_t mask, uint32_t repeat, uint32_t blkStride, uint32_t repStride) {
    constexpr uint32_t epb = 32 / sizeof(T);
    const uint32_t nblk = (mask + epb - 1) / epb;
    uint64_t hi = 0;
    for (uint32_t r = 0; r < repeat; ++r) {
        for (uint32_t b = 0; b < nblk; ++b) {
            const uint32_t active = std::min<uint32_t>(epb, mask - b * epb);
            hi = std::max<uint64_t>(hi, (uint64_t(r) * repStride + uint64_t(b) * blkStride) * 32 + active * sizeof(T));
        }
    }
    return hi;
}

template <typename T>
inline uint64_t RepOffset(uint32_t r, uint32_t e, uint32_t blkStride, uint32_t repStride) {
    constexpr uint32_t epb = 32 / sizeof(T);
    return (uint64_t(r) * repStride + uint64_t(e / epb) * blkStride) * 32 + uint64_t(e % epb) * sizeof(T);
}

template <typename T>
inline void CheckMaskRepeat(uint64_t mask, uint32_t repeat, const char* op, const Loc& loc) {
    constexpr uint64_t epr = 256 / sizeof(T);
    if (mask == 0 || mask > epr) {
        Fail(std::string(op) + " at " + Where(loc) + ": mask " + std::to_string(mask) + " outside [1, " + std::to_string(epr) + "]");
    }
    if (repeat > 255) Fail(std::string(op) + " at " + Where(loc) + ": repeatTimes over 255");
}

template <typename T, typename F>
inline void BinaryCount(const char* op, const LocalTensor<T>& dst, const LocalTensor<T>& s0, const LocalTensor<T>& s1,
                        int32_t count, const Loc& loc, F f) {
    CheckCount(count, op, loc);
    VecRead(s0, count, op, "src0", loc);
    VecRead(s1, count, op, "src1", loc);
    VecWrite(dst, count, op, "dst", loc);
    T* d = dst.Ptr();
    const T* a = s0.Ptr();
    const T* b = s1.Ptr();
    for (int32_t i = 0; i < count; ++i) d[i] = f(a[i], b[i], d[i]);
}

template <typename T, typename F>
inline void BinaryRep(const char* op, const LocalTensor<T>& dst, const LocalTensor<T>& s0, const LocalTensor<T>& s1,
                      uint64_t mask, uint8_t repeat, const BinaryRepeatParams& p, const Loc& loc, F f) {
    CheckMaskRepeat<T>(mask, repeat, op, loc);
    if (repeat == 0) return;
    const uint32_t m = static_cast<uint32_t>(mask);
    CheckAlign(s0, 32, op, "src0", loc);
    CheckAlign(s1, 32, op, "src1", loc);
    CheckAlign(dst, 32, op, "dst", loc);
    UbTouch(s0, 0, RepExtent<T>(m, repeat, p.src0BlkStride, p.src0RepStride), Pipe::V, false, op, "src0", loc);
    UbTouch(s1, 0, RepExtent<T>(m, repeat, p.src1BlkStride, p.src1RepStride), Pipe::V, false, op, "src1", loc);
    UbTouch(dst, 0, RepExtent<T>(m, repeat, p.dstBlkStride, p.dstRepStride), Pipe::V, true, op, "dst", loc);
    auto* d = reinterpret_cast<uint8_t*>(dst.Ptr());
    auto* a = reinterpret_cast<const uint8_t*>(s0.Ptr());
    auto* b = reinterpret_cast<const uint8_t*>(s1.Ptr());
    for (uint32_t r = 0; r < repeat; ++r) {
        for (uint32_t e = 0; e < m; ++e) {
            T x, y, z;
            std::memcpy(&x, a + RepOffset<T>(r, e, p.src0BlkStride, p.src0RepStride), sizeof(T));
            std::memcpy(&y, b + RepOffset<T>(r, e, p.src1BlkStride, p.src1RepStride), sizeof(T));
            uint8_t* dp = d + RepOffset<T>(r, e, p.dstBlkStride, p.dstRepStride);
            std::memcpy(&z, dp, sizeof(T));
            z = f(x, y, z);
            std::memcpy(dp, &z, sizeof(T));
        }
    }
}

template <typename T, typename F>
inline void UnaryCount(const char* op, const LocalTensor<T>& dst, const LocalTensor<T>& src, int32_t count,
                       const Loc& loc, F f) {
    CheckCount(count, op, loc);
    VecRead(src, count, op, "src", loc);
    VecWrite(dst, count, op, "dst", loc);
    T* d = dst.Ptr();
    const T* s = src.Ptr();
    for (int32_t i = 0; i < count; ++i) d[i] = f(s[i]);
}

inline float VMax(float a, float b) {
    // Model choice: NaN in either operand gives NaN (the kernel does not rely on it).
    if (a != a || b != b) return std::numeric_limits<float>::quiet_NaN();
    return a > b ? a : b;
}
inline float VMin(float a, float b) {
    if (a != a || b != b) return std::numeric_limits<float>::quiet_NaN();
    return a < b ? a : b;
}

template <typename T>
inline void RequireFloat(const char* op) {
    static_assert(std::is_same_v<T, float>, "the model implements this vector operation for float only");
    (void)op;
}

}  // namespace detail

// ---- binary, count form ----
template <typename T>
inline void Add(const LocalTensor<T>& dst, const LocalTensor<T>& s0, const LocalTensor<T>& s1, const int32_t count,
                Loc loc = Loc::current()) {
    detail::RequireFloat<T>("Add");
    detail::BinaryCount("Add", dst, s0, s1, count, loc, [](T a, T b, T) { return a + b; });
}
template <typename T>
inline void Sub(const LocalTensor<T>& dst, const LocalTensor<T>& s0, const LocalTensor<T>& s1, const int32_t count,
                Loc loc = Loc::current()) {
    detail::RequireFloat<T>("Sub");
    detail::BinaryCount("Sub", dst, s0, s1, count, loc, [](T a, T b, T) { return a - b; });
}
template <typename T>
inline void Mul(const LocalTensor<T>& dst, const LocalTensor<T>& s0, const LocalTensor<T>& s1, const int32_t count,
                Loc loc = Loc::current()) {
    detail::RequireFloat<T>("Mul");
    detail::BinaryCount("Mul", dst, s0, s1, count, loc, [](T a, T b, T) { return a * b; });
}
template <typename T>
inline void Div(const LocalTensor<T>& dst, const LocalTensor<T>& s0, const LocalTensor<T>& s1, const int32_t count,
                Loc loc = Loc::current()) {
    detail::RequireFloat<T>("Div");
    detail::BinaryCount("Div", dst, s0, s1, count, loc, [](T a, T b, T) { return a / b; });
}
template <typename T>
inline void Max(const LocalTensor<T>& dst, const LocalTensor<T>& s0, const LocalTensor<T>& s1, const int32_t count,
                Loc loc = Loc::current()) {
    detail::RequireFloat<T>("Max");
    detail::BinaryCount("Max", dst, s0, s1, count, loc, [](T a, T b, T) { return detail::VMax(a, b); });
}

// ---- binary, repeat form ----
template <typename T, bool isSetMask = true>
inline void Add(const LocalTensor<T>& dst, const LocalTensor<T>& s0, const LocalTensor<T>& s1, uint64_t mask,
                const uint8_t repeatTimes, const BinaryRepeatParams& p, Loc loc = Loc::current()) {
    detail::RequireFloat<T>("Add");
    detail::BinaryRep("Add", dst, s0, s1, mask, repeatTimes, p, loc, [](T a, T b, T) { return a + b; });
}
template <typename T, bool isSetMask = true>
inline void Sub(const LocalTensor<T>& dst, const LocalTensor<T>& s0, const LocalTensor<T>& s1, uint64_t mask,
                const uint8_t repeatTimes, const BinaryRepeatParams& p, Loc loc = Loc::current()) {
    detail::RequireFloat<T>("Sub");
    detail::BinaryRep("Sub", dst, s0, s1, mask, repeatTimes, p, loc, [](T a, T b, T) { return a - b; });
}
template <typename T, bool isSetMask = true>
inline void Mul(const LocalTensor<T>& dst, const LocalTensor<T>& s0, const LocalTensor<T>& s1, uint64_t mask,
                const uint8_t repeatTimes, const BinaryRepeatParams& p, Loc loc = Loc::current()) {
    detail::RequireFloat<T>("Mul");
    detail::BinaryRep("Mul", dst, s0, s1, mask, repeatTimes, p, loc, [](T a, T b, T) { return a * b; });
}
// dst = src0 * src1 + dst (same type; the mixed half->float form is not modelled).
template <typename T, typename U, bool isSetMask = true>
inline void MulAddDst(const LocalTensor<T>& dst, const LocalTensor<U>& s0, const LocalTensor<U>& s1, uint64_t mask,
                      const uint8_t repeatTimes, const BinaryRepeatParams& p, Loc loc = Loc::current()) {
    static_assert(std::is_same_v<T, float> && std::is_same_v<U, float>, "MulAddDst modelled for float only");
    detail::BinaryRep("MulAddDst", dst, s0, s1, mask, repeatTimes, p, loc, [](T a, T b, T d) { return a * b + d; });
}

// ---- scalar operand, count form ----
template <typename T>
inline void Adds(const LocalTensor<T>& dst, const LocalTensor<T>& src, const T& scalar, const int32_t count,
                 Loc loc = Loc::current()) {
    detail::RequireFloat<T>("Adds");
    const T s = scalar;
    detail::UnaryCount("Adds", dst, src, count, loc, [s](T a) { return a + s; });
}
template <typename T>
inline void Muls(const LocalTensor<T>& dst, const LocalTensor<T>& src, const T& scalar, const int32_t count,
                 Loc loc = Loc::current()) {
    detail::RequireFloat<T>("Muls");
    const T s = scalar;
    detail::UnaryCount("Muls", dst, src, count, loc, [s](T a) { return a * s; });
}
template <typename T>
inline void Maxs(const LocalTensor<T>& dst, const LocalTensor<T>& src, const T& scalar, const int32_t count,
                 Loc loc = Loc::current()) {
    detail::RequireFloat<T>("Maxs");
    const T s = scalar;
    detail::UnaryCount("Maxs", dst, src, count, loc, [s](T a) { return detail::VMax(a, s); });
}
template <typename T>
inline void Mins(const LocalTensor<T>& dst, const LocalTensor<T>& src, const T& scalar, const int32_t count,
                 Loc loc = Loc::current()) {
    detail::RequireFloat<T>("Mins");
    const T s = scalar;
    detail::UnaryCount("Mins", dst, src, count, loc, [s](T a) { return detail::VMin(a, s); });
}
// dst = dst + src * scalar
template <typename T, typename U>
inline void Axpy(const LocalTensor<T>& dst, const LocalTensor<U>& src, const U scalar, const int32_t count,
                 Loc loc = Loc::current()) {
    static_assert(std::is_same_v<T, float> && std::is_same_v<U, float>, "Axpy modelled for float only");
    detail::CheckCount(count, "Axpy", loc);
    detail::VecRead(src, count, "Axpy", "src", loc);
    detail::VecRead(dst, count, "Axpy", "dst", loc);
    detail::VecWrite(dst, count, "Axpy", "dst", loc);
    T* d = dst.Ptr();
    const U* s = src.Ptr();
    for (int32_t i = 0; i < count; ++i) d[i] = d[i] + s[i] * scalar;
}

// ---- unary ----
template <typename T>
inline void Exp(const LocalTensor<T>& dst, const LocalTensor<T>& src, const int32_t count, Loc loc = Loc::current()) {
    detail::RequireFloat<T>("Exp");
    detail::UnaryCount("Exp", dst, src, count, loc, [](T a) { return std::exp(a); });
}
template <typename T>
inline void Ln(const LocalTensor<T>& dst, const LocalTensor<T>& src, const int32_t count, Loc loc = Loc::current()) {
    detail::RequireFloat<T>("Ln");
    detail::UnaryCount("Ln", dst, src, count, loc, [](T a) { return std::log(a); });
}

template <typename T>
inline void Duplicate(const LocalTensor<T>& dst, const T& scalar, const int32_t count, Loc loc = Loc::current()) {
    detail::CheckCount(count, "Duplicate", loc);
    detail::VecWrite(dst, count, "Duplicate", "dst", loc);
    T* d = dst.Ptr();
    for (int32_t i = 0; i < count; ++i) d[i] = scalar;
}
// Repeat form: in each repeat the first `mask` elements (block stride dstBlockStride,
// repeat stride dstRepeatStride, both in 32-byte units) are set to scalar.
template <typename T, bool isSetMask = true>
inline void Duplicate(const LocalTensor<T>& dst, const T& scalar, uint64_t mask, const uint8_t repeatTimes,
                      const uint16_t dstBlockStride, const uint8_t dstRepeatStride, Loc loc = Loc::current()) {
    const char* op = "Duplicate";
    detail::CheckMaskRepeat<T>(mask, repeatTimes, op, loc);
    if (repeatTimes == 0) return;
    detail::CheckAlign(dst, 32, op, "dst", loc);
    const uint32_t m = static_cast<uint32_t>(mask);
    detail::UbTouch(dst, 0, detail::RepExtent<T>(m, repeatTimes, dstBlockStride, dstRepeatStride), Pipe::V, true, op, "dst", loc);
    auto* d = reinterpret_cast<uint8_t*>(dst.Ptr());
    for (uint32_t r = 0; r < repeatTimes; ++r)
        for (uint32_t e = 0; e < m; ++e)
            std::memcpy(d + detail::RepOffset<T>(r, e, dstBlockStride, dstRepeatStride), &scalar, sizeof(T));
}

// ---- conversion ----
// Supported as on Atlas A2: half->float and bfloat16_t->float (CAST_NONE, exact);
// float->half and float->bfloat16_t (CAST_RINT: round to nearest even).
template <typename TD, typename TS>
inline void Cast(const LocalTensor<TD>& dst, const LocalTensor<TS>& src, const RoundMode mode, const uint32_t count,
                 Loc loc = Loc::current()) {
    const char* op = "Cast";
    constexpr bool widen = std::is_same_v<TD, float> && (std::is_same_v<TS, half> || std::is_same_v<TS, bfloat16_t>);
    constexpr bool narrow = std::is_same_v<TS, float> && (std::is_same_v<TD, half> || std::is_same_v<TD, bfloat16_t>);
    static_assert(widen || narrow, "Cast combination not modelled");
    if constexpr (widen) {
        if (mode != RoundMode::CAST_NONE) detail::Fail(std::string(op) + " at " + detail::Where(loc) + ": widening cast takes CAST_NONE");
    } else {
        if (mode != RoundMode::CAST_RINT) detail::Fail(std::string(op) + " at " + detail::Where(loc) + ": the model implements CAST_RINT only for narrowing");
    }
    detail::VecRead(src, count, op, "src", loc);
    detail::VecWrite(dst, count, op, "dst", loc);
    TD* d = dst.Ptr();
    const TS* s = src.Ptr();
    for (uint32_t i = 0; i < count; ++i) {
        if constexpr (widen) d[i] = static_cast<float>(s[i]);
        else d[i] = TD(s[i]);
    }
}

// ---- reductions, repeat form ----
// Sum of the first `mask` elements of each repeat -> dst[r * dstRepStride] (unit: one
// element). Model choice: summed in order (the device adds as a tree; float rounding differs).
template <typename T, bool isSetMask = true>
inline void WholeReduceSum(const LocalTensor<T>& dst, const LocalTensor<T>& src, const int32_t mask, const int32_t repeatTimes,
                           const int32_t dstRepStride, const int32_t srcBlkStride, const int32_t srcRepStride,
                           Loc loc = Loc::current()) {
    detail::RequireFloat<T>("WholeReduceSum");
    const char* op = "WholeReduceSum";
    detail::CheckMaskRepeat<T>(mask, repeatTimes, op, loc);
    if (repeatTimes == 0) return;
    detail::CheckAlign(src, 32, op, "src", loc);
    detail::CheckAlign(dst, sizeof(T), op, "dst", loc);
    detail::UbTouch(src, 0, detail::RepExtent<T>(mask, repeatTimes, srcBlkStride, srcRepStride), Pipe::V, false, op, "src", loc);
    detail::UbTouch(dst, 0, (uint64_t(repeatTimes - 1) * dstRepStride + 1) * sizeof(T), Pipe::V, true, op, "dst", loc);
    auto* s = reinterpret_cast<const uint8_t*>(src.Ptr());
    T* d = dst.Ptr();
    for (int32_t r = 0; r < repeatTimes; ++r) {
        T acc = 0;
        for (int32_t e = 0; e < mask; ++e) {
            T x;
            std::memcpy(&x, s + detail::RepOffset<T>(r, e, srcBlkStride, srcRepStride), sizeof(T));
            acc += x;
        }
        d[uint64_t(r) * dstRepStride] = acc;
    }
}

// Maximum (and its index within the repeat) of the first `mask` elements of each repeat.
// ORDER_VALUE_INDEX writes [value, index] pairs, dstRepStride in units of one pair; the
// index is stored as the bits of a uint32 in the second slot. Model choice: NaN in a
// repeat gives NaN.
template <typename T, bool isSetMask = true>
inline void WholeReduceMax(const LocalTensor<T>& dst, const LocalTensor<T>& src, const int32_t mask, const int32_t repeatTimes,
                           const int32_t dstRepStride, const int32_t srcBlkStride, const int32_t srcRepStride,
                           ReduceOrder order = ReduceOrder::ORDER_VALUE_INDEX, Loc loc = Loc::current()) {
    detail::RequireFloat<T>("WholeReduceMax");
    const char* op = "WholeReduceMax";
    if (order != ReduceOrder::ORDER_VALUE_INDEX) detail::Fail(std::string(op) + " at " + detail::Where(loc) + ": only ORDER_VALUE_INDEX is modelled");
    detail::CheckMaskRepeat<T>(mask, repeatTimes, op, loc);
    if (repeatTimes == 0) return;
    detail::CheckAlign(src, 32, op, "src", loc);
    detail::CheckAlign(dst, 2 * sizeof(T), op, "dst", loc);
    detail::UbTouch(src, 0, detail::RepExtent<T>(mask, repeatTimes, srcBlkStride, srcRepStride), Pipe::V, false, op, "src", loc);
    detail::UbTouch(dst, 0, (uint64_t(repeatTimes - 1) * dstRepStride + 1) * 2 * sizeof(T), Pipe::V, true, op, "dst", loc);
    auto* s = reinterpret_cast<const uint8_t*>(src.Ptr());
    T* d = dst.Ptr();
    for (int32_t r = 0; r < repeatTimes; ++r) {
        T best = -std::numeric_limits<T>::infinity();
        uint32_t bi = 0;
        bool nan = false;
        for (int32_t e = 0; e < mask; ++e) {
            T x;
            std::memcpy(&x, s + detail::RepOffset<T>(r, e, srcBlkStride, srcRepStride), sizeof(T));
            if (x != x) nan = true;
            if (e == 0 || x > best) {
                best = x;
                bi = static_cast<uint32_t>(e);
            }
        }
        if (nan) best = std::numeric_limits<T>::quiet_NaN();
        d[uint64_t(r) * dstRepStride * 2] = best;
        std::memcpy(&d[uint64_t(r) * dstRepStride * 2 + 1], &bi, sizeof(uint32_t));
    }
}

// Broadcast: each repeat reads 8 consecutive elements of src and writes each to a whole
// 32-byte block of dst (block i of repeat r at (r * dstRepStride + i * dstBlkStride) * 32 B).
template <typename T>
inline void Brcb(const LocalTensor<T>& dst, const LocalTensor<T>& src, const uint8_t repeatTimes, const BrcbRepeatParams& p,
                 Loc loc = Loc::current()) {
    static_assert(sizeof(T) == 2 || sizeof(T) == 4, "Brcb takes 16- or 32-bit elements");
    const char* op = "Brcb";
    if (repeatTimes == 0) return;
    constexpr uint32_t epb = 32 / sizeof(T);
    detail::CheckAlign(src, 32, op, "src", loc);
    detail::CheckAlign(dst, 32, op, "dst", loc);
    detail::UbTouch(src, 0, uint64_t(repeatTimes) * 8 * sizeof(T), Pipe::V, false, op, "src", loc);
    const uint64_t hi = (uint64_t(repeatTimes - 1) * p.dstRepStride + 7ull * p.dstBlkStride) * 32 + 32;
    detail::UbTouch(dst, 0, hi, Pipe::V, true, op, "dst", loc);
    const T* s = src.Ptr();
    auto* d = reinterpret_cast<uint8_t*>(dst.Ptr());
    for (uint32_t r = 0; r < repeatTimes; ++r) {
        for (uint32_t i = 0; i < 8; ++i) {
            T v = s[r * 8 + i];
            uint8_t* blk = d + (uint64_t(r) * p.dstRepStride + uint64_t(i) * p.dstBlkStride) * 32;
            for (uint32_t e = 0; e < epb; ++e) std::memcpy(blk + e * sizeof(T), &v, sizeof(T));
        }
    }
}

// ---- compare and select ----
// Element i of the result is bit (i % 8) of byte (i / 8) of dst (model choice: least
// significant bit first; the kernel only hands the mask to Select, never reads its bits).
// count * sizeof(T) must be a multiple of 256 bytes.
template <typename T, typename U>
inline void Compare(const LocalTensor<U>& dst, const LocalTensor<T>& s0, const LocalTensor<T>& s1, CMPMODE mode,
                    const uint32_t count, Loc loc = Loc::current()) {
    static_assert(std::is_same_v<U, uint8_t>, "Compare writes a uint8_t bit mask");
    detail::RequireFloat<T>("Compare");
    const char* op = "Compare";
    if (count == 0 || (uint64_t(count) * sizeof(T)) % 256 != 0) {
        detail::Fail(std::string(op) + " at " + detail::Where(loc) + ": count * sizeof(T) = " +
                     std::to_string(uint64_t(count) * sizeof(T)) + " is not a positive multiple of 256 bytes");
    }
    detail::VecRead(s0, count, op, "src0", loc);
    detail::VecRead(s1, count, op, "src1", loc);
    detail::VecWrite(dst, count / 8, op, "dst", loc);
    const T* a = s0.Ptr();
    const T* b = s1.Ptr();
    uint8_t* d = dst.Ptr();
    for (uint32_t i = 0; i < count / 8; ++i) d[i] = 0;
    for (uint32_t i = 0; i < count; ++i) {
        bool r = false;
        switch (mode) {
            case CMPMODE::LT: r = a[i] < b[i]; break;
            case CMPMODE::GT: r = a[i] > b[i]; break;
            case CMPMODE::EQ: r = a[i] == b[i]; break;
            case CMPMODE::LE: r = a[i] <= b[i]; break;
            case CMPMODE::GE: r = a[i] >= b[i]; break;
            case CMPMODE::NE: r = a[i] != b[i]; break;
        }
        if (r) d[i / 8] |= static_cast<uint8_t>(1u << (i % 8));
    }
}

// dst[i] = mask bit i ? src0[i] : scalar (VSEL_TENSOR_SCALAR_MODE).
template <typename T, typename U>
inline void Select(const LocalTensor<T>& dst, const LocalTensor<U>& selMask, const LocalTensor<T>& src0, T src1,
                   SELMODE mode, uint32_t count, Loc loc = Loc::current()) {
    static_assert(std::is_same_v<U, uint8_t>, "Select takes a uint8_t bit mask");
    detail::RequireFloat<T>("Select");
    const char* op = "Select";
    if (mode != SELMODE::VSEL_TENSOR_SCALAR_MODE) detail::Fail(std::string(op) + " at " + detail::Where(loc) + ": only VSEL_TENSOR_SCALAR_MODE is modelled");
    detail::VecRead(selMask, (count + 7) / 8, op, "selMask", loc);
    detail::VecRead(src0, count, op, "src0", loc);
    detail::VecWrite(dst, count, op, "dst", loc);
    const uint8_t* m = selMask.Ptr();
    const T* a = src0.Ptr();
    T* d = dst.Ptr();
    for (uint32_t i = 0; i < count; ++i) d[i] = ((m[i / 8] >> (i % 8)) & 1u) ? a[i] : src1;
}

}  // namespace AscendC
