// CPU model of the Ascend C API subset: data movement GM <-> UB (included by api_impl.h).
#pragma once

namespace AscendC {

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
    auto& buf = detail::GmTouch(src, 0, bytes, false, op, loc);
    detail::UbTouch(dst, 0, bytes, Pipe::MTE2, true, op, "destination", loc);
    detail::CountCopy(buf, true, bytes);
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
    auto& buf = detail::GmTouch(dst, 0, bytes, true, op, loc);
    detail::CountCopy(buf, false, bytes);
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
        auto& buf = detail::GmTouch(g, i * gStep, i * gStep + len, false, op, loc);
        if (i == 0) detail::CountCopy(buf, true, len * p.blockCount);
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
        auto& buf = detail::GmTouch(dst, i * gStep, i * gStep + len, true, op, loc);
        if (i == 0) detail::CountCopy(buf, false, len * p.blockCount);
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
        auto& buf = detail::GmTouch(src, i * gStep, i * gStep + p.blockLen, false, op, loc);
        if (i == 0) detail::CountCopy(buf, true, uint64_t(p.blockLen) * p.blockCount);
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
        auto& buf = detail::GmTouch(dst, i * gStep, i * gStep + p.blockLen, true, op, loc);
        if (i == 0) detail::CountCopy(buf, false, uint64_t(p.blockLen) * p.blockCount);
        std::memcpy(reinterpret_cast<uint8_t*>(dst.addr_) + i * gStep, reinterpret_cast<const uint8_t*>(src.Ptr()) + i * uStep,
                    p.blockLen);
    }
}

}  // namespace AscendC
