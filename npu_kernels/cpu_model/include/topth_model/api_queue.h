// CPU model of the Ascend C API subset: TPipe, buffers and queues of every position (VECIN /
// VECOUT / VECCALC in the unified buffer; A1 / B1 in L1, A2 in L0A, B2 in L0B, CO1 in L0C on
// the cube core), and the flags their EnQue / DeQue and FreeTensor / AllocTensor carry
// (included by api_impl.h).
#pragma once

#include <algorithm>
#include <sstream>

namespace AscendC {

inline TPipe::TPipe(Loc loc) {
    auto& ctx = topth_model::Ctx();
    if (ctx.pipeAlive) topth_model::Fail("TPipe at " + topth_model::Where(loc) + ": a second TPipe while one is alive");
    ctx.pipeAlive = true;
    ctx.pipePtr = this;
    for (auto& c : ctx.cursor) c = 0;
}

inline TPipe::~TPipe() {
    auto& ctx = topth_model::Ctx();
    ctx.launch->NoteMem(ctx);
    ctx.pipeAlive = false;
    ctx.pipePtr = nullptr;
}

inline TPipe* GetTPipePtr() {
    auto* p = static_cast<TPipe*>(topth_model::Ctx().pipePtr);
    if (!p) topth_model::Fail("GetTPipePtr: no live TPipe");
    return p;
}

namespace detail {
// Buffers of one position are placed one after another in its memory, each rounded up to 32
// bytes (the model does not align them further: L0A / L0B operands must start at 512 bytes,
// L0C at 1024, which the kernel's buffer sizes must keep).
inline uint32_t MemAlloc(TPosition pos, uint32_t bytes, const std::string& what, const Loc& loc) {
    auto& ctx = Ctx();
    if (!ctx.pipeAlive) Fail("TPipe::InitBuffer at " + Where(loc) + ": no TPipe");
    const int space = SpaceOfPosition(pos);
    if (space < 0) Fail("TPipe::InitBuffer at " + Where(loc) + ": position " + PositionName(pos) + " is not modelled");
    auto& mem = ctx.Mem(space);
    if (mem.empty()) {
        Fail("TPipe::InitBuffer at " + Where(loc) + ": " + what + " is in " + MemName(space) + ", which " +
             (ctx.type == topth_model::CoreType::AIV ? "an AI vector core (AIV) does not have"
                                                     : "the AI cube core (AIC) does not have"));
    }
    static const char* longNames[] = {"", "L1 buffer", "L0A buffer", "L0B buffer", "L0C buffer", "unified buffer"};
    const uint32_t len = RoundUp32(bytes);
    uint32_t& cursor = ctx.cursor[space];
    const uint64_t end = uint64_t(cursor) + len;
    if (end > mem.size()) {
        std::ostringstream os;
        os << "TPipe::InitBuffer at " << Where(loc) << ": " << what << " needs " << len << " bytes but only "
           << (mem.size() - cursor) << " of the " << mem.size() << "-byte " << longNames[space] << " are left ("
           << cursor << " already in use)";
        Fail(os.str());
    }
    const uint32_t lo = cursor;
    cursor = static_cast<uint32_t>(end);
    return lo;
}
}  // namespace detail

inline const char* PositionName(TPosition p) {
    switch (p) {
        case TPosition::A1: return "A1";
        case TPosition::A2: return "A2";
        case TPosition::B1: return "B1";
        case TPosition::B2: return "B2";
        case TPosition::C1: return "C1";
        case TPosition::C2: return "C2";
        case TPosition::CO1: return "CO1";
        case TPosition::CO2: return "CO2";
        case TPosition::VECIN: return "VECIN";
        case TPosition::VECOUT: return "VECOUT";
        case TPosition::VECCALC: return "VECCALC";
        default: return "GM";
    }
}

template <TPosition pos, int32_t depth, auto mask>
bool TPipe::InitBuffer(TQue<pos, depth, mask>& que, uint8_t num, uint32_t len, Loc loc) {
    auto& ctx = topth_model::Ctx();
    if (num == 0 || len == 0) topth_model::Fail("TPipe::InitBuffer at " + topth_model::Where(loc) + ": zero buffers or zero length");
    if (que.qindex_ >= 0) topth_model::Fail("TPipe::InitBuffer at " + topth_model::Where(loc) + ": queue initialised twice");
    auto q = std::make_unique<topth_model::QueueState>();
    q->desc = std::string("TQue<") + PositionName(pos) + ", depth " + std::to_string(depth) + "> initialised at " +
              topth_model::Where(loc);
    q->position = static_cast<int>(pos);
    q->depth = depth;
    const uint32_t slotLen = detail::RoundUp32(len);
    for (int i = 0; i < num; ++i) {
        const uint32_t lo = detail::MemAlloc(pos, len, q->desc, loc);
        auto s = std::make_unique<topth_model::SlotState>();
        s->lo = lo;
        s->hi = lo + slotLen;
        ctx.buffers.push_back(topth_model::BufferDesc{SpaceOfPosition(pos), s->lo, s->hi, q->desc});
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
    std::string desc = std::string("TBuf<") + PositionName(pos) + "> initialised at " + topth_model::Where(loc);
    buf.lo_ = detail::MemAlloc(pos, len, desc, loc);
    buf.hi_ = buf.lo_ + detail::RoundUp32(len);
    buf.index_ = static_cast<int>(ctx.buffers.size());
    ctx.buffers.push_back(topth_model::BufferDesc{SpaceOfPosition(pos), buf.lo_, buf.hi_, desc});
    return true;
}

namespace detail {
// Producer and consumer pipes of a queue position (VECIN: MTE2 -> V, VECOUT: V -> MTE3;
// A1 / B1: MTE2 -> MTE1, A2 / B2: MTE1 -> M, CO1: M -> FIX).
inline bool QueuePipes(int position, Pipe& prod, Pipe& cons) {
    switch (static_cast<TPosition>(position)) {
        case TPosition::VECIN: prod = Pipe::MTE2; cons = Pipe::V; return true;
        case TPosition::VECOUT: prod = Pipe::V; cons = Pipe::MTE3; return true;
        case TPosition::A1:
        case TPosition::B1: prod = Pipe::MTE2; cons = Pipe::MTE1; return true;
        case TPosition::A2:
        case TPosition::B2: prod = Pipe::MTE1; cons = Pipe::M; return true;
        case TPosition::CO1: prod = Pipe::M; cons = Pipe::FIX; return true;
        default: return false;
    }
}
inline int QGPipe(Pipe p) { return Ctx().GPipe(static_cast<int>(p)); }

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
// The tensor a queue hands out for slot s (AllocTensor, DeQue): the slot's whole buffer in
// memory `space`, tagged with the slot and its generation.
template <typename T, typename Slot>
LocalTensor<T> SlotTensor(int space, Slot* s) {
    LocalTensor<T> t;
    t.valid_ = true;
    t.space_ = space;
    t.off_ = s->lo;
    t.size_ = (s->hi - s->lo) / static_cast<uint32_t>(sizeof(T));
    t.bufLo_ = s->lo;
    t.bufHi_ = s->hi;
    for (size_t b = 0; b < topth_model::Ctx().buffers.size(); ++b) {
        const auto& d = topth_model::Ctx().buffers[b];
        if (d.lo == s->lo && d.space == t.space_) t.bufIndex_ = static_cast<int>(b);
    }
    t.slot_ = s;
    t.gen_ = s->gen;
    return t;
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
        topth_model::Ctx().haz->Observe(detail::QGPipe(prod), s->freed);
    }
    return detail::SlotTensor<T>(SpaceOfPosition(pos), s);
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
    if (detail::QueuePipes(q.position, prod, cons)) s->enqueued = topth_model::Ctx().haz->Capture(detail::QGPipe(prod));
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
        topth_model::Ctx().haz->Observe(detail::QGPipe(cons), s->enqueued);
    }
    return detail::SlotTensor<T>(SpaceOfPosition(pos), s);
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
    if (detail::QueuePipes(q.position, prod, cons)) s->freed = topth_model::Ctx().haz->Capture(detail::QGPipe(cons));
    q.freeOrder.push_back(i);
}

}  // namespace AscendC
