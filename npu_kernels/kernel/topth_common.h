// Shared definitions of the topth decode-attention kernel: constants, pipe-sync helper,
// tiling load, the API compatibility wrappers and the CPU-model hooks.
#ifndef TOPTH_COMMON_H
#define TOPTH_COMMON_H

#include "kernel_operator.h"
#include "topth_tiling_data.h"

// ---- Ascend C API compatibility -------------------------------------------------------
// asc-devkit 9.1 (CANN 9.1, from 9.1.0-beta.2) replaced WholeReduceSum / WholeReduceMax by
// ReduceRepeat<ReduceType::SUM / MAX> (same operands, same units). The toolchain
// force-includes asc_devkit_version.h (ASC_DEVKIT_VERSION_NUM = major*1e7 + minor*1e5 +
// patch*1e3, beta.N = -200 + N); older CANN defines nothing and has only the old names.
// TOPTH_USE_REDUCE_REPEAT=0/1 on the compiler command line overrides the choice.
#ifndef TOPTH_USE_REDUCE_REPEAT
#if defined(ASC_DEVKIT_VERSION_NUM) && (ASC_DEVKIT_VERSION_NUM >= 90099802)
#define TOPTH_USE_REDUCE_REPEAT 1
#else
#define TOPTH_USE_REDUCE_REPEAT 0
#endif
#endif

// ---- CPU-model hooks (nothing on the device) --------------------------------------------
// TOPTH_MODEL_OWNER(b, h): the work item now reads the caches of sequence b, KV head h;
// the model checks every K / V read against the rows the block table names for it.
#ifndef TOPTH_MODEL_OWNER
#define TOPTH_MODEL_OWNER(b, h)
#endif
// TOPTH_MODEL_SCHED_BATCH(): the model's view of the batch schedule mode below.
#ifndef TOPTH_MODEL_SCHED_BATCH
#define TOPTH_MODEL_SCHED_BATCH()
#endif
// TOPTH_MODEL_FAULT(name): true when a CPU-model test switched on that deliberate bug (the
// tests check that the model catches each kind); always false on the device.
#ifndef TOPTH_MODEL_FAULT
#define TOPTH_MODEL_FAULT(name) false
#endif

// ---- batch schedule mode ---------------------------------------------------------------
// The split-KV combine waits at an all-core SyncAll: if another stream holds some cores,
// blocks that already started wait for blocks that cannot start (a deadlock, for the hard
// and the soft SyncAll alike). __schedmode__(1) makes the runtime start all blocks of the
// kernel together. Toolchains that have it (asc-devkit, CANN >= 8.5: the CMake build
// defines TOPTH_HAS_SCHEDMODE) get it; older ones run in normal mode with that risk
// (docs/ascendc.md, "All-core synchronisation").
#if defined(TOPTH_HAS_SCHEDMODE)
#define TOPTH_SCHED_BATCH __schedmode__(1)
#else
#define TOPTH_SCHED_BATCH
#endif

using namespace AscendC;

namespace topth {

constexpr uint32_t W = TOPTH_TILE_W;  // score-tile width (positions)
// Floor of running maxima: -FLT_MAX, the lowest finite float, so that every finite score
// can be the maximum (a higher floor would turn scores below it into zero weights), and
// exp(a - m) never sees inf - inf (m is finite even when every score so far is -inf).
constexpr float NEG_FLOOR = -3.40282346638528859812e+38f;

// Pair-vector slots (pairWidth floats each; head g's value at element 2g).
// Cross-core flags of the cube path (mode 2: AIC <-> both AIVs of its AI core). Ids 0-10 on
// Atlas A2 (the hard SyncAll uses 11-14).
constexpr uint16_t FLAG_SCORES_READY = 1;  // AIC -> AIVs: the score tiles of one ring step are in GM
constexpr uint16_t FLAG_SLOT_FREE = 2;     // AIVs -> AIC: both AIVs have copied them out of the ring

enum PairSlot : uint32_t {
    P_M = 0,   // reference maximum (running max in pass A / pre; global max in pass B)
    P_R = 1,   // sum of kept exp(a - m), or exp(a - P_MK) (pass A of post_softmax: Z, sum of all)
    P_E = 2,   // sum of dropped exp(a - m)
    P_K = 3,   // kept count
    P_MNEW = 4,
    P_RT = 5,
    P_ET = 6,
    P_KT = 7,
    P_TMAX = 8,
    P_F = 9,   // rescale factor / reciprocal denominator
    P_LNZ = 10,
    P_TMP = 11,
    // Only with group selection and pre_softmax (TOPTH_KEPT_REF): the maximum over the kept
    // scores (NEG_FLOOR while none), the reference of P_R and the accumulators.
    P_MK = 12,
};

__aicore__ inline float NegInf() { return -__builtin_huge_valf(); }

// The bits of a float32 (a union read: no float operation, so no flush of subnormals).
__aicore__ inline uint32_t FloatBits(float x)
{
    union {
        float f;
        uint32_t u;
    } c;
    c.f = x;
    return c.u;
}

// 149 ln 2: a positive subnormal float32 is m x 2^-149 with the integer m < 2^23.
constexpr float LN_SUBNORMAL_UNIT = 103.27892990343184f;

// ln |x| of a nonzero x is Ln(LnArgument(x)) - LnShift(x), decided on the bits so that a flush
// of subnormals to zero cannot turn it into -inf: |x| when x is normal (or inf / NaN), the
// integer m of a subnormal m x 2^-149 with LnShift = 149 ln 2.
__aicore__ inline bool IsSubnormal(float x)
{
    const uint32_t b = FloatBits(x) & 0x7FFFFFFFu;
    return b != 0u && b < 0x00800000u;
}
__aicore__ inline float LnArgument(float x)
{
    return IsSubnormal(x) ? static_cast<float>(FloatBits(x) & 0x7FFFFFFFu) : (x < 0.0f ? -x : x);
}
__aicore__ inline float LnShift(float x) { return IsSubnormal(x) ? LN_SUBNORMAL_UNIT : 0.0f; }
__aicore__ inline float QNaN() { return __builtin_nanf(""); }
__aicore__ inline uint32_t Min32(uint32_t a, uint32_t b) { return a < b ? a : b; }
__aicore__ inline uint32_t CeilDiv(uint32_t a, uint32_t b) { return (a + b - 1) / b; }

// Same-core ordering between two pipes (e.g. V writes, then S reads).
template <HardEvent E>
__aicore__ inline void Sync()
{
    TEventID id = GetTPipePtr()->FetchEventID(E);
    SetFlag<E>(id);
    WaitFlag<E>(id);
}

// Sum (RowSum) / maximum with its index (RowMax, ORDER_VALUE_INDEX pairs) of the first
// `mask` elements of each repeat; dstRepStride in results (pairs for RowMax).
__aicore__ inline void RowSum(const LocalTensor<float>& dst, const LocalTensor<float>& src, int32_t mask,
                              int32_t repeat, int32_t dstRepStride, int32_t srcBlkStride, int32_t srcRepStride)
{
#if TOPTH_USE_REDUCE_REPEAT
    ReduceRepeat<ReduceType::SUM, float, float>(dst, src, mask, repeat, dstRepStride, srcBlkStride, srcRepStride);
#else
    WholeReduceSum<float>(dst, src, mask, repeat, dstRepStride, srcBlkStride, srcRepStride);
#endif
}

__aicore__ inline void RowMax(const LocalTensor<float>& dst, const LocalTensor<float>& src, int32_t mask,
                              int32_t repeat, int32_t dstRepStride, int32_t srcBlkStride, int32_t srcRepStride)
{
#if TOPTH_USE_REDUCE_REPEAT
    ReduceRepeat<ReduceType::MAX, float, float>(dst, src, mask, repeat, dstRepStride, srcBlkStride, srcRepStride,
                                                ReduceOrder::ORDER_VALUE_INDEX);
#else
    WholeReduceMax<float>(dst, src, mask, repeat, dstRepStride, srcBlkStride, srcRepStride,
                          ReduceOrder::ORDER_VALUE_INDEX);
#endif
}

__aicore__ inline void LoadTiling(TopthTilingData& td, GM_ADDR tiling)
{
    GlobalTensor<uint32_t> src;
    constexpr uint32_t words = sizeof(TopthTilingData) / sizeof(uint32_t);
    src.SetGlobalBuffer((__gm__ uint32_t*)tiling, words);
    uint32_t* dst = reinterpret_cast<uint32_t*>(&td);
    for (uint32_t i = 0; i < words; ++i) {
        dst[i] = src.GetValue(i);
    }
}

// Kernel arguments, in launch order (GM_ADDR is a macro for a pointer type: one per line).
struct KernelArgs {
    GM_ADDR query;
    GM_ADDR key;
    GM_ADDR value;
    GM_ADDR seqLens;
    GM_ADDR thresholds;
    GM_ADDR sdcTable;
    GM_ADDR valueMean;
    GM_ADDR blockTable;
    GM_ADDR thresholdSet;
    GM_ADDR out;
    GM_ADDR kept;
    GM_ADDR vRows;
    GM_ADDR dropped;
    GM_ADDR workspace;
};

}  // namespace topth

#endif  // TOPTH_COMMON_H
