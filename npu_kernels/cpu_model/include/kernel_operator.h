// CPU model of the Ascend C API subset used by topth-ops (npu_kernels/kernel/).
//
// The kernel source includes "kernel_operator.h"; built with CANN it gets the real
// header, built with g++ for the CPU model it gets this one. Every function below keeps
// the Ascend C name, parameter order and units of the public API reference (CANN 8.x,
// "Ascend C API reference" on hiascend.com). Where that reference leaves something open
// the choice made here is written next to the function ("Model choice:") and the kernel
// does not depend on it.
//
// Each function takes a trailing std::source_location (defaulted), so a violation names
// the offending call: "DataCopyPad GM->UB at topth_decode_attn.cpp:412: ...".
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <source_location>
#include <string>
#include <type_traits>

#include "topth_model/core.h"
#include "topth_model/types.h"

// ----- toolchain version: CANN force-includes asc_devkit_version.h (asc-devkit >= 8.5);
// the model emulates the toolchain given by -DTOPTH_MODEL_CANN_VERSION_NUM (default: an
// older CANN without it, as 8.0 - 8.3) -----
#ifdef TOPTH_MODEL_CANN_VERSION_NUM
#define ASC_DEVKIT_VERSION_NUM TOPTH_MODEL_CANN_VERSION_NUM
#endif
#if defined(ASC_DEVKIT_VERSION_NUM) && (ASC_DEVKIT_VERSION_NUM >= 90099802)
#define TOPTH_MODEL_HAS_WHOLE_REDUCE 0  // renamed ReduceRepeat in asc-devkit 9.1.0-beta.2
#else
#define TOPTH_MODEL_HAS_WHOLE_REDUCE 1
#endif

// ----- device qualifiers: nothing on the host -----
#define __aicore__
#define __global__
#define __gm__
#define GM_ADDR uint8_t*

// Kernel types (KERNEL_TASK_TYPE_DEFAULT records the kernel's type for the checks of SyncAll).
enum KernelMetaType {
    KERNEL_TYPE_AIV_ONLY, KERNEL_TYPE_AIC_ONLY, KERNEL_TYPE_MIX_AIV_1_0, KERNEL_TYPE_MIX_AIC_1_0,
    KERNEL_TYPE_MIX_AIC_1_1, KERNEL_TYPE_MIX_AIC_1_2
};
#define KERNEL_TASK_TYPE_DEFAULT(x) topth_model::SetKernelType(static_cast<int>(x))

// ----- CPU-model hooks of the kernel source (empty on the device) -----
// The work item reads the caches of sequence b, KV head h (the model checks each K / V row).
#define TOPTH_MODEL_OWNER(b, h) topth_model::SetOwner(static_cast<int64_t>(b), static_cast<int64_t>(h))
// The kernel is launched in batch schedule mode (__schedmode__(1)): its blocks start together.
// The model emulates a toolchain with the qualifier (its effect is recorded by the hook;
// Launch::SetSchedModeNormal simulates a toolchain without it).
#define TOPTH_HAS_SCHEDMODE 1
#define __schedmode__(mode)
#define TOPTH_MODEL_SCHED_BATCH() topth_model::DeclareBatchMode()

enum pipe_t : int { PIPE_S = 0, PIPE_V, PIPE_M, PIPE_MTE1, PIPE_MTE2, PIPE_MTE3, PIPE_ALL };
enum event_t : int {
    EVENT_ID0 = 0, EVENT_ID1, EVENT_ID2, EVENT_ID3, EVENT_ID4, EVENT_ID5, EVENT_ID6, EVENT_ID7
};

namespace AscendC {

using topth_model::Pipe;
using Loc = std::source_location;
using TEventID = int8_t;

constexpr uint32_t ONE_BLK_SIZE = 32;    // bytes in one UB data block
constexpr uint32_t ONE_REPEAT_BYTE_SIZE = 256;  // bytes one vector repeat processes
constexpr uint32_t MAX_REPEAT_TIMES = 255;

enum class TPosition : uint8_t { GM, A1, A2, B1, B2, C1, C2, CO1, CO2, VECIN, VECOUT, VECCALC, LCM = VECCALC, MAX };
using QuePosition = TPosition;

enum class HardEvent : uint8_t {
    MTE2_V, V_MTE2, MTE3_V, V_MTE3, MTE2_MTE3, MTE3_MTE2, S_V, V_S, S_MTE2, MTE2_S, S_MTE3, MTE3_S
};

enum class CMPMODE : uint8_t { LT = 0, GT, EQ, LE, GE, NE };
enum class SELMODE : uint8_t { VSEL_CMPMASK_SPR = 0, VSEL_TENSOR_SCALAR_MODE, VSEL_TENSOR_TENSOR_MODE };
enum class RoundMode : uint8_t { CAST_NONE = 0, CAST_RINT, CAST_FLOOR, CAST_CEIL, CAST_ROUND, CAST_TRUNC, CAST_ODD };
enum class ReduceOrder : uint8_t { ORDER_VALUE_INDEX = 0, ORDER_INDEX_VALUE, ORDER_ONLY_VALUE, ORDER_ONLY_INDEX };
enum class ReduceType { NONE = -1, SUM = 0, MAX, MIN };
enum class CacheMode { CACHE_MODE_DISABLE = 0, CACHE_MODE_NORMAL = 1, CACHE_MODE_LAST = 2, CACHE_MODE_PERSISTENT = 4 };

// ----- copy and repeat parameter structs (field names, types and units as in Ascend C) -----
struct DataCopyParams {
    DataCopyParams() = default;
    DataCopyParams(uint16_t count, uint16_t len, uint16_t srcStrideIn, uint16_t dstStrideIn)
        : blockCount(count), blockLen(len), srcStride(srcStrideIn), dstStride(dstStrideIn) {}
    uint16_t blockCount = 1;  // number of blocks
    uint16_t blockLen = 0;    // in 32-byte units
    uint16_t srcStride = 0;   // gap between blocks of the source, 32-byte units
    uint16_t dstStride = 0;   // gap between blocks of the destination, 32-byte units
};

struct DataCopyExtParams {
    DataCopyExtParams() = default;
    DataCopyExtParams(uint16_t count, uint32_t len, uint32_t srcStrideIn, uint32_t dstStrideIn, uint32_t rsvIn)
        : blockCount(count), blockLen(len), srcStride(srcStrideIn), dstStride(dstStrideIn), rsv(rsvIn) {}
    uint16_t blockCount = 1;
    uint32_t blockLen = 0;   // bytes
    uint32_t srcStride = 0;  // GM side: bytes; UB side: 32-byte units
    uint32_t dstStride = 0;  // GM side: bytes; UB side: 32-byte units
    uint32_t rsv = 0;
};

template <typename T>
struct DataCopyPadExtParams {
    DataCopyPadExtParams() = default;
    DataCopyPadExtParams(bool isPadIn, uint8_t left, uint8_t right, T value)
        : isPad(isPadIn), leftPadding(left), rightPadding(right), paddingValue(value) {}
    bool isPad = false;
    uint8_t leftPadding = 0;   // elements
    uint8_t rightPadding = 0;  // elements
    T paddingValue{};
};

struct BinaryRepeatParams {
    BinaryRepeatParams() = default;
    BinaryRepeatParams(uint8_t dB, uint8_t s0B, uint8_t s1B, uint8_t dR, uint8_t s0R, uint8_t s1R)
        : dstBlkStride(dB), src0BlkStride(s0B), src1BlkStride(s1B), dstRepStride(dR), src0RepStride(s0R),
          src1RepStride(s1R) {}
    uint8_t dstBlkStride = 1, src0BlkStride = 1, src1BlkStride = 1;  // 32-byte units
    uint8_t dstRepStride = 8, src0RepStride = 8, src1RepStride = 8;  // 32-byte units
};

struct GatherMaskParams {
    GatherMaskParams() = default;
    GatherMaskParams(uint8_t s0B, uint16_t rep, uint16_t s0R, uint8_t s1R)
        : src0BlockStride(s0B), repeatTimes(rep), src0RepeatStride(s0R), src1RepeatStride(s1R) {}
    uint8_t src0BlockStride = 1;    // 32-byte units
    uint16_t repeatTimes = 0;
    uint16_t src0RepeatStride = 0;  // 32-byte units
    uint8_t src1RepeatStride = 0;   // 32-byte units
};

struct BrcbRepeatParams {
    BrcbRepeatParams() = default;
    BrcbRepeatParams(uint16_t dB, uint16_t dR) : dstBlkStride(dB), dstRepStride(dR) {}
    uint16_t dstBlkStride = 1;
    uint16_t dstRepStride = 8;
};

// ----- tensors -----
template <typename T>
class LocalTensor {
public:
    LocalTensor() = default;

    // Scalar-unit read / write of one element (pipe S).
    T GetValue(uint32_t index, Loc loc = Loc::current()) const;
    void SetValue(uint32_t index, T value, Loc loc = Loc::current()) const;

    LocalTensor operator[](uint32_t offset) const {
        LocalTensor t = *this;
        t.off_ += offset * static_cast<uint32_t>(sizeof(T));
        t.size_ = offset <= size_ ? size_ - offset : 0;
        return t;
    }
    uint32_t GetSize() const { return size_; }
    void SetSize(uint32_t size) { size_ = size; }
    template <typename U>
    LocalTensor<U> ReinterpretCast() const {
        LocalTensor<U> t;
        t.valid_ = valid_;
        t.off_ = off_;
        t.size_ = static_cast<uint32_t>(size_ * sizeof(T) / sizeof(U));
        t.bufLo_ = bufLo_;
        t.bufHi_ = bufHi_;
        t.bufIndex_ = bufIndex_;
        t.slot_ = slot_;
        t.gen_ = gen_;
        return t;
    }

    // ---- model internals ----
    T* Ptr() const { return reinterpret_cast<T*>(topth_model::Ctx().ub.data() + off_); }
    bool valid_ = false;
    uint32_t off_ = 0;    // byte offset in the unified buffer
    uint32_t size_ = 0;   // elements
    uint32_t bufLo_ = 0, bufHi_ = 0;  // byte range of the owning buffer
    int bufIndex_ = -1;
    topth_model::SlotState* slot_ = nullptr;
    uint32_t gen_ = 0;
};

template <typename T>
class GlobalTensor {
public:
    GlobalTensor() = default;
    // bufferSize in elements (Ascend C: "bufferSize ... number of elements").
    void SetGlobalBuffer(__gm__ T* buffer, uint64_t bufferSize, Loc loc = Loc::current());
    void SetGlobalBuffer(__gm__ T* buffer, Loc loc = Loc::current()) {
        addr_ = buffer;
        size_ = 0;
        sized_ = false;
        (void)loc;
    }
    GlobalTensor operator[](uint64_t offset) const {
        GlobalTensor t = *this;
        t.addr_ = addr_ + offset;
        if (sized_) {
            t.size_ = offset <= size_ ? size_ - offset : 0;
            t.overrun_ = overrun_ || offset > size_;
        }
        return t;
    }
    uint64_t GetSize() const { return size_; }
    // L2 cache policy of this tensor's accesses: no effect on the model's memory (it has no
    // cache), recorded for the tests.
    void SetL2CacheHint(CacheMode mode) { l2Mode_ = mode; }
    CacheMode l2Mode_ = CacheMode::CACHE_MODE_NORMAL;
    // Scalar-unit read of one element of GM (pipe S, through the scalar data cache).
    T GetValue(uint64_t index, Loc loc = Loc::current()) const;

    // ---- model internals ----
    T* addr_ = nullptr;
    uint64_t size_ = 0;
    bool sized_ = false;
    bool overrun_ = false;
};

// ----- pipe, queues, buffers -----
class TPipe;
TPipe* GetTPipePtr();

template <TPosition pos = TPosition::VECCALC>
class TBuf {
public:
    template <typename T>
    LocalTensor<T> Get(Loc loc = Loc::current()) const {
        return Get<T>((hi_ - lo_) / static_cast<uint32_t>(sizeof(T)), loc);
    }
    template <typename T>
    LocalTensor<T> Get(uint32_t len, Loc loc = Loc::current()) const {
        if (index_ < 0) topth_model::Fail("TBuf::Get at " + topth_model::Where(loc) + ": buffer was never passed to TPipe::InitBuffer");
        if (static_cast<uint64_t>(len) * sizeof(T) > hi_ - lo_) {
            topth_model::Fail("TBuf::Get at " + topth_model::Where(loc) + ": asks for " + std::to_string(len * sizeof(T)) +
                              " bytes of a " + std::to_string(hi_ - lo_) + "-byte buffer");
        }
        LocalTensor<T> t;
        t.valid_ = true;
        t.off_ = lo_;
        t.size_ = len;
        t.bufLo_ = lo_;
        t.bufHi_ = hi_;
        t.bufIndex_ = index_;
        return t;
    }
    // model internals
    int index_ = -1;
    uint32_t lo_ = 0, hi_ = 0;
};

template <TPosition pos, int32_t depth = 1, auto mask = 0>
class TQue {
public:
    template <typename T>
    LocalTensor<T> AllocTensor(Loc loc = Loc::current());
    template <typename T>
    bool EnQue(const LocalTensor<T>& tensor, Loc loc = Loc::current());
    template <typename T>
    LocalTensor<T> DeQue(Loc loc = Loc::current());
    template <typename T>
    void FreeTensor(LocalTensor<T>& tensor, Loc loc = Loc::current());
    // model internals
    int qindex_ = -1;
};

class TPipe {
public:
    TPipe(Loc loc = Loc::current());
    ~TPipe();
    template <TPosition pos, int32_t depth, auto mask>
    bool InitBuffer(TQue<pos, depth, mask>& que, uint8_t num, uint32_t len, Loc loc = Loc::current());
    template <TPosition pos>
    bool InitBuffer(TBuf<pos>& buf, uint32_t len, Loc loc = Loc::current());
    template <HardEvent evt>
    TEventID FetchEventID() { return 0; }
    TEventID FetchEventID(HardEvent) { return 0; }
    void Destroy() {}
};

}  // namespace AscendC

#include "topth_model/api_impl.h"
