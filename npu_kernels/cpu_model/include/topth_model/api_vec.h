// CPU model of the Ascend C API subset: vector unit, elementwise (included by api_impl.h).
#pragma once

namespace AscendC {

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
    CountVec(RepeatsOf<T>(count));
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
    CountVec(repeat);
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
    CountVec(RepeatsOf<T>(count));
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
    detail::CountVec(detail::RepeatsOf<T>(count));
    T* d = dst.Ptr();
    const U* s = src.Ptr();
    for (int32_t i = 0; i < count; ++i) d[i] = d[i] + s[i] * scalar;
}

// ---- unary ----
namespace detail {
// Model choice: std::exp / std::log, correctly rounded or nearly so. The device's vector
// Exp / Ln round differently; Launch::SetTranscendentalError(eps) makes the model return
// x * (1 +/- eps) instead (the sign alternating by element and call), to check that a
// test's planted inputs keep their kept sets under such rounding differences.
inline float Jitter(float x, uint64_t i) {
    const float eps = Ctx().launch->TranscendentalError();
    if (eps == 0.0f || !(x == x) || x == 0.0f || std::isinf(x)) return x;
    static thread_local uint64_t calls = 0;
    const uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull + (++calls) * 0xBF58476D1CE4E5B9ull;
    return x * (1.0f + ((h >> 33) & 1 ? eps : -eps));
}
}  // namespace detail

template <typename T>
inline void Exp(const LocalTensor<T>& dst, const LocalTensor<T>& src, const int32_t count, Loc loc = Loc::current()) {
    detail::RequireFloat<T>("Exp");
    detail::UnaryCount("Exp", dst, src, count, loc, [](T a) { return std::exp(a); });
    for (int32_t i = 0; i < count; ++i) dst.Ptr()[i] = detail::Jitter(dst.Ptr()[i], i);
}
template <typename T>
inline void Ln(const LocalTensor<T>& dst, const LocalTensor<T>& src, const int32_t count, Loc loc = Loc::current()) {
    detail::RequireFloat<T>("Ln");
    detail::UnaryCount("Ln", dst, src, count, loc, [](T a) { return std::log(a); });
    for (int32_t i = 0; i < count; ++i) dst.Ptr()[i] = detail::Jitter(dst.Ptr()[i], i);
}

template <typename T>
inline void Duplicate(const LocalTensor<T>& dst, const T& scalar, const int32_t count, Loc loc = Loc::current()) {
    detail::CheckCount(count, "Duplicate", loc);
    detail::VecWrite(dst, count, "Duplicate", "dst", loc);
    detail::CountVec(detail::RepeatsOf<T>(count));
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
    detail::CountVec(repeatTimes);
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
    detail::CountVec(detail::RepeatsOf<float>(count));
    TD* d = dst.Ptr();
    const TS* s = src.Ptr();
    for (uint32_t i = 0; i < count; ++i) {
        if constexpr (widen) d[i] = static_cast<float>(s[i]);
        else d[i] = TD(s[i]);
    }
}

}  // namespace AscendC
