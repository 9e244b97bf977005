// CPU model of the Ascend C API subset: reductions, broadcast, compare, select (included by api_impl.h).
#pragma once

#include <vector>

namespace AscendC {

// ---- reductions, repeat form ----
// CANN <= 9.0 (and asc-devkit before 9.1.0-beta.2) name them WholeReduceSum / WholeReduceMax;
// newer ones ReduceRepeat<ReduceType::SUM / MAX>. The model offers exactly one spelling,
// chosen by ASC_DEVKIT_VERSION_NUM as the toolchain would (kernel_operator.h), so that a
// kernel that does not handle both fails to build against one of them.
namespace detail {
template <typename T>
inline void ReduceSumRep(const char* op, const LocalTensor<T>& dst, const LocalTensor<T>& src, int32_t mask,
                         int32_t repeatTimes, int32_t dstRepStride, int32_t srcBlkStride, int32_t srcRepStride,
                         const Loc& loc);
template <typename T>
inline void ReduceMaxRep(const char* op, const LocalTensor<T>& dst, const LocalTensor<T>& src, int32_t mask,
                         int32_t repeatTimes, int32_t dstRepStride, int32_t srcBlkStride, int32_t srcRepStride,
                         ReduceOrder order, const Loc& loc);
}  // namespace detail

#if TOPTH_MODEL_HAS_WHOLE_REDUCE
template <typename T, bool isSetMask = true>
inline void WholeReduceSum(const LocalTensor<T>& dst, const LocalTensor<T>& src, const int32_t mask, const int32_t repeatTimes,
                           const int32_t dstRepStride, const int32_t srcBlkStride, const int32_t srcRepStride,
                           Loc loc = Loc::current()) {
    detail::ReduceSumRep("WholeReduceSum", dst, src, mask, repeatTimes, dstRepStride, srcBlkStride, srcRepStride, loc);
}
template <typename T, bool isSetMask = true>
inline void WholeReduceMax(const LocalTensor<T>& dst, const LocalTensor<T>& src, const int32_t mask, const int32_t repeatTimes,
                           const int32_t dstRepStride, const int32_t srcBlkStride, const int32_t srcRepStride,
                           ReduceOrder order = ReduceOrder::ORDER_VALUE_INDEX, Loc loc = Loc::current()) {
    detail::ReduceMaxRep("WholeReduceMax", dst, src, mask, repeatTimes, dstRepStride, srcBlkStride, srcRepStride,
                         order, loc);
}
#else
template <ReduceType reduceType, typename T, typename U, bool isSetMask = true>
inline void ReduceRepeat(const LocalTensor<T>& dst, const LocalTensor<U>& src, const int32_t mask, const int32_t repeatTime,
                         const int32_t dstRepStride, const int32_t srcBlkStride, const int32_t srcRepStride,
                         ReduceOrder order = ReduceOrder::ORDER_VALUE_INDEX, Loc loc = Loc::current()) {
    static_assert(std::is_same_v<T, U>, "ReduceRepeat modelled with equal source and destination types");
    static_assert(reduceType == ReduceType::SUM || reduceType == ReduceType::MAX, "ReduceRepeat: SUM and MAX modelled");
    if constexpr (reduceType == ReduceType::SUM) {
        detail::ReduceSumRep("ReduceRepeat<SUM>", dst, src, mask, repeatTime, dstRepStride, srcBlkStride, srcRepStride, loc);
    } else {
        detail::ReduceMaxRep("ReduceRepeat<MAX>", dst, src, mask, repeatTime, dstRepStride, srcBlkStride, srcRepStride,
                             order, loc);
    }
}
#endif

namespace detail {
// Sum of the first `mask` elements of each repeat -> dst[r * dstRepStride] (unit: one
// element). Model choice: summed in order (the device adds as a tree; float rounding differs).
template <typename T>
inline void ReduceSumRep(const char* op, const LocalTensor<T>& dst, const LocalTensor<T>& src, int32_t mask,
                         int32_t repeatTimes, int32_t dstRepStride, int32_t srcBlkStride, int32_t srcRepStride,
                         const Loc& loc) {
    detail::RequireFloat<T>(op);
    detail::CheckMaskRepeat<T>(mask, repeatTimes, op, loc);
    if (repeatTimes == 0) return;
    detail::CheckAlign(src, 32, op, "src", loc);
    detail::CheckAlign(dst, sizeof(T), op, "dst", loc);
    detail::UbTouch(src, 0, detail::RepExtent<T>(mask, repeatTimes, srcBlkStride, srcRepStride), Pipe::V, false, op, "src", loc);
    detail::UbTouch(dst, 0, (uint64_t(repeatTimes - 1) * dstRepStride + 1) * sizeof(T), Pipe::V, true, op, "dst", loc);
    detail::CountVec(repeatTimes);
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
template <typename T>
inline void ReduceMaxRep(const char* op, const LocalTensor<T>& dst, const LocalTensor<T>& src, int32_t mask,
                         int32_t repeatTimes, int32_t dstRepStride, int32_t srcBlkStride, int32_t srcRepStride,
                         ReduceOrder order, const Loc& loc) {
    detail::RequireFloat<T>(op);
    if (order != ReduceOrder::ORDER_VALUE_INDEX) detail::Fail(std::string(op) + " at " + detail::Where(loc) + ": only ORDER_VALUE_INDEX is modelled");
    detail::CheckMaskRepeat<T>(mask, repeatTimes, op, loc);
    if (repeatTimes == 0) return;
    detail::CheckAlign(src, 32, op, "src", loc);
    detail::CheckAlign(dst, 2 * sizeof(T), op, "dst", loc);
    detail::UbTouch(src, 0, detail::RepExtent<T>(mask, repeatTimes, srcBlkStride, srcRepStride), Pipe::V, false, op, "src", loc);
    detail::UbTouch(dst, 0, (uint64_t(repeatTimes - 1) * dstRepStride + 1) * 2 * sizeof(T), Pipe::V, true, op, "dst", loc);
    detail::CountVec(repeatTimes);
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

}  // namespace detail

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
    detail::CountVec(repeatTimes);
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
    detail::CountVec(detail::RepeatsOf<T>(count));
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

namespace detail {
// The Ascend C API's own scratch: Select in tensor-scalar mode (and tensor-tensor mode)
// first duplicates its scalar (the mask address) into one 32-byte block at TMP_UB_OFFSET
// = 184 KiB on Atlas A2, the start of the top 8 KiB of the 192 KiB unified buffer that
// the API reserves, then loads it into the CMPMASK register (PipeBarrier<PIPE_V> around
// both, inside the API). The model places it 8 KiB below the top of its unified buffer
// (184 KiB at the default size), writes the scalar there as the device does, and rejects
// a kernel whose TPipe buffers cover that block: on the device their data would be
// silently overwritten.
template <typename T>
inline void SelectScratch(T scalar, const char* op, const Loc& loc) {
    auto& ctx = Ctx();
    ctx.haz.BarrierV();
    const uint64_t ub = ctx.ub.size();
    if (ub < topth_model::kApiScratchReserve + 32) return;
    const uint32_t lo = static_cast<uint32_t>(ub - topth_model::kApiScratchReserve), hi = lo + 32;
    for (const auto& b : ctx.buffers) {
        if (b.lo < hi && lo < b.hi) {
            std::ostringstream os;
            os << op << " at " << Where(loc) << ": writes the Ascend C API's 32-byte scratch block at UB [" << lo
               << ", " << hi << ") (the top " << topth_model::kApiScratchReserve / 1024
               << " KiB of the unified buffer are reserved for the API), which lies inside " << b.desc
               << " [" << b.lo << ", " << b.hi << "): that buffer's data is overwritten on the device";
            Fail(os.str());
        }
    }
    for (uint32_t i = 0; i < 32 / sizeof(T); ++i) std::memcpy(ctx.ub.data() + lo + i * sizeof(T), &scalar, sizeof(T));
    ctx.cnt.selectScratchWrites++;
    ctx.haz.BarrierV();
}
}  // namespace detail

// dst[i] = mask bit i ? src0[i] : scalar (VSEL_TENSOR_SCALAR_MODE).
template <typename T, typename U>
inline void Select(const LocalTensor<T>& dst, const LocalTensor<U>& selMask, const LocalTensor<T>& src0, T src1,
                   SELMODE mode, uint32_t count, Loc loc = Loc::current()) {
    static_assert(std::is_same_v<U, uint8_t>, "Select takes a uint8_t bit mask");
    detail::RequireFloat<T>("Select");
    const char* op = "Select";
    if (mode != SELMODE::VSEL_TENSOR_SCALAR_MODE) detail::Fail(std::string(op) + " at " + detail::Where(loc) + ": only VSEL_TENSOR_SCALAR_MODE is modelled");
    detail::SelectScratch(src1, op, loc);
    detail::CountVec(detail::RepeatsOf<T>(count));
    detail::VecRead(selMask, (count + 7) / 8, op, "selMask", loc);
    detail::VecRead(src0, count, op, "src0", loc);
    detail::VecWrite(dst, count, op, "dst", loc);
    const uint8_t* m = selMask.Ptr();
    const T* a = src0.Ptr();
    T* d = dst.Ptr();
    for (uint32_t i = 0; i < count; ++i) d[i] = ((m[i / 8] >> (i % 8)) & 1u) ? a[i] : src1;
}

// GatherMask, user pattern, normal mode (reduceMode false; Atlas A2, float with a uint32_t
// pattern): each of repeatTimes repeats reads the 64 floats of one 256-byte repeat of src0
// (repeat r at r * src0RepeatStride blocks) and the 64 pattern bits at r * src1RepeatStride
// blocks of src1Pattern; the elements whose bit is 1 are written to dst one after another,
// continuing across repeats; rsvdCnt is their number. Model choice: pattern bit i is bit
// (i % 32) of uint32 word i / 32 (the layout Compare writes its mask in).
template <typename T, typename U>
inline void GatherMask(const LocalTensor<T>& dst, const LocalTensor<T>& src0, const LocalTensor<U>& src1Pattern,
                       const bool reduceMode, const uint32_t mask, const GatherMaskParams& p, uint64_t& rsvdCnt,
                       Loc loc = Loc::current()) {
    static_assert(std::is_same_v<T, float> && std::is_same_v<U, uint32_t>,
                  "GatherMask modelled for float data with a uint32_t pattern");
    const char* op = "GatherMask";
    if (reduceMode) detail::Fail(std::string(op) + " at " + detail::Where(loc) + ": only normal mode (reduceMode false) is modelled");
    (void)mask;
    if (p.repeatTimes == 0 || p.repeatTimes > 255 || p.src0BlockStride != 1) {
        detail::Fail(std::string(op) + " at " + detail::Where(loc) + ": repeatTimes must be in [1, 255] and src0BlockStride 1 (modelled)");
    }
    detail::CheckAlign(dst, 32, op, "dst", loc);
    detail::CheckAlign(src0, 32, op, "src0", loc);
    detail::CheckAlign(src1Pattern, 32, op, "src1Pattern", loc);
    const uint32_t reps = p.repeatTimes;
    detail::UbTouch(src0, 0, (uint64_t(reps - 1) * p.src0RepeatStride) * 32 + 256, Pipe::V, false, op, "src0", loc);
    detail::UbTouch(src1Pattern, 0, (uint64_t(reps - 1) * p.src1RepeatStride) * 32 + 8, Pipe::V, false, op,
                    "src1Pattern", loc);
    std::vector<T> picked;
    auto* s0 = reinterpret_cast<const uint8_t*>(src0.Ptr());
    auto* s1 = reinterpret_cast<const uint8_t*>(src1Pattern.Ptr());
    for (uint32_t r = 0; r < reps; ++r) {
        uint32_t words[2];
        std::memcpy(words, s1 + uint64_t(r) * p.src1RepeatStride * 32, 8);
        for (uint32_t e = 0; e < 64; ++e) {
            if ((words[e / 32] >> (e % 32)) & 1u) {
                T x;
                std::memcpy(&x, s0 + uint64_t(r) * p.src0RepeatStride * 32 + e * sizeof(T), sizeof(T));
                picked.push_back(x);
            }
        }
    }
    if (!picked.empty()) {
        detail::UbTouch(dst, 0, picked.size() * sizeof(T), Pipe::V, true, op, "dst", loc);
        std::memcpy(dst.Ptr(), picked.data(), picked.size() * sizeof(T));
    }
    detail::CountVec(reps);
    rsvdCnt = picked.size();
}

// Scalar unit: index of the first bit equal to countValue (0 or 1) from the least
// significant end, -1 when there is none.
template <int countValue>
inline int64_t ScalarGetSFFValue(uint64_t valueIn) {
    static_assert(countValue == 0 || countValue == 1, "countValue is 0 or 1");
    const uint64_t v = countValue == 1 ? valueIn : ~valueIn;
    if (v == 0) return -1;
    return static_cast<int64_t>(__builtin_ctzll(v));
}

// Scalar unit: the number of bits of valueIn equal to countValue (0 or 1).
template <int countValue>
inline int64_t ScalarGetCountOfValue(uint64_t valueIn) {
    static_assert(countValue == 0 || countValue == 1, "countValue is 0 or 1");
    const int64_t ones = __builtin_popcountll(valueIn);
    return countValue == 1 ? ones : 64 - ones;
}

}  // namespace AscendC
