// CPU model of the Ascend C API subset: checking helpers and tensors
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

inline const char* MemName(int space) {
    switch (static_cast<topth_model::Space>(space)) {
        case topth_model::Space::L1: return "L1";
        case topth_model::Space::L0A: return "L0A";
        case topth_model::Space::L0B: return "L0B";
        case topth_model::Space::L0C: return "L0C";
        default: return "UB";
    }
}

// Which memories a pipe can touch: the vector, scalar and MTE3 pipes the unified buffer, MTE2
// the unified buffer or L1 (it writes them), MTE1 L1 -> L0A / L0B, the cube L0A / L0B -> L0C,
// FIX L0C.
inline bool PipeReaches(Pipe p, int space, bool write) {
    using topth_model::Space;
    const auto sp = static_cast<Space>(space);
    switch (p) {
        case Pipe::V:
        case Pipe::S:
        case Pipe::MTE3: return sp == Space::UB;
        case Pipe::MTE2: return write && (sp == Space::UB || sp == Space::L1);
        case Pipe::MTE1: return write ? (sp == Space::L0A || sp == Space::L0B) : sp == Space::L1;
        case Pipe::M: return write ? sp == Space::L0C : (sp == Space::L0A || sp == Space::L0B || sp == Space::L0C);
        case Pipe::FIX: return !write && sp == Space::L0C;
    }
    return false;
}

// Record an access of bytes [relLo, relHi) of tensor t (relative to its start) by pipe p.
template <typename T>
inline void UbTouch(const LocalTensor<T>& t, uint64_t relLo, uint64_t relHi, Pipe p, bool write, const char* op,
                    const char* role, const Loc& loc) {
    CheckLive(t, op, role, loc);
    if (!PipeReaches(p, t.space_, write)) {
        Fail(std::string(op) + " at " + Where(loc) + ": " + role + " is in " + MemName(t.space_) + " (" +
             BufName(t.bufIndex_) + "), which this instruction's pipe " + topth_model::PipeName(p) + " cannot " +
             (write ? "write" : "read"));
    }
    const uint64_t lo = t.off_ + relLo, hi = t.off_ + relHi;
    if (lo < t.bufLo_ || hi > t.bufHi_) {
        std::ostringstream os;
        os << op << " at " << Where(loc) << ": " << role << " " << MemName(t.space_) << " range [" << lo << ", " << hi
           << ") is outside its buffer [" << t.bufLo_ << ", " << t.bufHi_ << ") (" << BufName(t.bufIndex_) << ")";
        Fail(os.str());
    }
    auto& ctx = Ctx();
    ctx.haz->Access(ctx.SpaceOf(t.space_), ctx.GPipe(static_cast<int>(p)), write, lo, hi, Info(op, loc));
}

template <typename T>
inline void CheckAlign(const LocalTensor<T>& t, uint32_t align, const char* op, const char* role, const Loc& loc) {
    if (t.off_ % align != 0) {
        Fail(std::string(op) + " at " + Where(loc) + ": " + role + " " + MemName(t.space_) + " address " +
             std::to_string(t.off_) + " is not " + std::to_string(align) + "-byte aligned (" + BufName(t.bufIndex_) + ")");
    }
}

// The tensor must live in one of the memories of the positions named (e.g. "A2 (L0A)").
template <typename T>
inline void CheckSpace(const LocalTensor<T>& t, topth_model::Space want, const char* where, const char* op,
                       const char* role, const Loc& loc) {
    CheckLive(t, op, role, loc);
    if (t.space_ != static_cast<int>(want)) {
        Fail(std::string(op) + " at " + Where(loc) + ": " + role + " must be in " + where + ", but it is in " +
             MemName(t.space_) + " (" + BufName(t.bufIndex_) + ")");
    }
}

// Resolve a GM range, check bounds, record hazards / races / bytes.
// pipe: the pipe doing the access (default: MTE2 for reads, MTE3 for writes).
template <typename T>
inline topth_model::GmBuffer& GmTouch(const GlobalTensor<T>& g, uint64_t relLo, uint64_t relHi, bool write,
                                      const char* op, const Loc& loc, bool countBytes = true,
                                      Pipe pipe = Pipe::V) {
    if (pipe == Pipe::V) pipe = write ? Pipe::MTE3 : Pipe::MTE2;
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
        ctx.haz->Access(static_cast<int>(topth_model::Space::GM), ctx.GPipe(static_cast<int>(pipe)), write, alo, ahi,
                        Info(op, loc));
        ctx.launch->RecordGm(ctx.block, write, alo, ahi, Info(op, loc));
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

}  // namespace AscendC
