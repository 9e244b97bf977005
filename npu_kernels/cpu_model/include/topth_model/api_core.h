// CPU model of the Ascend C API subset: checking helpers, tensors, TPipe and TQue
// (included by api_impl.h).
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
    if (!write && (buf.tag == "K" || buf.tag == "V")) ctx.launch->CheckCacheRead(buf, lo, hi, ctx, op, loc);
    if (buf.writable) {
        const uint64_t alo = reinterpret_cast<uint64_t>(buf.base) + lo, ahi = reinterpret_cast<uint64_t>(buf.base) + hi;
        ctx.haz.Access(topth_model::Space::GM, write ? Pipe::MTE3 : pipe, write, alo, ahi, Info(op, loc));
        ctx.launch->RecordGm(ctx.idx, write, alo, ahi, Info(op, loc));
    }
    if (countBytes) ctx.launch->AddBytes(buf, !write, relHi - relLo);
    return buf;
}

inline uint32_t RoundUp32(uint64_t x) { return static_cast<uint32_t>((x + 31) / 32 * 32); }

inline topth_model::PipeCounters& Cnt() { return Ctx().cnt; }

// One copy instruction of `bytes` between GM buffer `buf` and UB (counters).
inline void CountCopy(const topth_model::GmBuffer& buf, bool toUb, uint64_t bytes) {
    auto& c = Cnt();
    if (toUb) {
        c.mte2Requests++;
        c.mte2Bytes += bytes;
        if (buf.tag == "K") {
            c.kRequests++;
            c.kBytes += bytes;
        } else if (buf.tag == "V") {
            c.vRequests++;
            c.vBytes += bytes;
        }
    } else {
        c.mte3Requests++;
        c.mte3Bytes += bytes;
    }
}

// One vector instruction of `repeats` 256-byte repeats (counters).
inline void CountVec(uint64_t repeats) {
    auto& c = Cnt();
    c.vecInstr++;
    c.vecRepeats += repeats;
}
template <typename T>
inline uint64_t RepeatsOf(uint64_t count) {
    return (count * sizeof(T) + 255) / 256;
}

}  // namespace detail

// ======================================================================================
// Tensors

template <typename T>
T LocalTensor<T>::GetValue(uint32_t index, Loc loc) const {
    detail::UbTouch(*this, uint64_t(index) * sizeof(T), uint64_t(index + 1) * sizeof(T), Pipe::S, false,
                    "LocalTensor::GetValue", "the tensor", loc);
    detail::Cnt().scalarUbReads++;
    T v;
    std::memcpy(&v, reinterpret_cast<const uint8_t*>(Ptr()) + uint64_t(index) * sizeof(T), sizeof(T));
    return v;
}

template <typename T>
void LocalTensor<T>::SetValue(uint32_t index, T value, Loc loc) const {
    detail::UbTouch(*this, uint64_t(index) * sizeof(T), uint64_t(index + 1) * sizeof(T), Pipe::S, true,
                    "LocalTensor::SetValue", "the tensor", loc);
    detail::Cnt().scalarUbWrites++;
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
    if (buf.name == "block_table") {
        ctx.launch->CheckTableRead((reinterpret_cast<const uint8_t*>(g.addr_) - buf.base) / sizeof(T), ctx, loc);
    }
    detail::GmTouch(g, 0, sizeof(T), false, "GlobalTensor::GetValue", loc, false, Pipe::S);
    ctx.cnt.scalarGmReads++;
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

}  // namespace AscendC
