// CPU model of the Ascend C API subset: the cube core (AIC) of Atlas A2 (included by
// api_impl.h): GM -> L1 with ND -> NZ conversion (DataCopy with Nd2NzParams), constant fills
// of L1 / L0 (InitConstValue), L1 -> L0A / L0B (LoadData, 2-D, with fractal transpose), the
// matrix multiply (Mmad, 16-bit inputs, float32 result in L0C) and L0C -> GM with NZ -> ND
// conversion (Fixpipe, FixpipeParamsV220). Names, fields and units as in asc-devkit
// (kernel_struct_mm.h, kernel_struct_fixpipe.h, kernel_struct_data_copy.h); layouts:
//   * a fractal is 512 bytes: 16 x 16 elements of a 16-bit type (16 x 16 float32 in L0C is
//     one 1024-byte fractal); C0 = 32 bytes / sizeof(T) elements is the width of a column block;
//   * Nz (L1, L0C): column blocks of C0 columns one after another, each holding all rows
//     (element (r, c) at ((c / C0) * rows + r) * C0 + c % C0, rows padded to 16);
//   * Zz (L0A, matrix A, m x k): fractals row-major over (m / 16, k / 16), row-major inside;
//   * Zn (L0B, matrix B, k x n): fractals row-major over (k / 16, n / 16), column-major inside
//     (element (k, n) at ((k / 16) * nBlocks + n / 16) * 256 + (n % 16) * 16 + k % 16). A
//     [rows x k] matrix loaded ND -> NZ into L1 is its transpose's Zn layout already;
//   * alignment: L1 operands 32 bytes, L0A / L0B 512 bytes, Mmad's L0C 1024, Fixpipe's L0C 64.
#pragma once

namespace AscendC {

// ----- parameter structs (Atlas A2 / __NPU_ARCH__ 2201 field types) -----
struct Nd2NzParams {
    Nd2NzParams() = default;
    Nd2NzParams(uint16_t ndNumIn, uint16_t nValueIn, uint16_t dValueIn, uint16_t srcNdMatrixStrideIn,
                uint16_t srcDValueIn, uint16_t dstNzC0StrideIn, uint16_t dstNzNStrideIn, uint16_t dstNzMatrixStrideIn)
        : ndNum(ndNumIn), nValue(nValueIn), dValue(dValueIn), srcNdMatrixStride(srcNdMatrixStrideIn),
          srcDValue(srcDValueIn), dstNzC0Stride(dstNzC0StrideIn), dstNzNStride(dstNzNStrideIn),
          dstNzMatrixStride(dstNzMatrixStrideIn) {}
    uint16_t ndNum = 0;              // ND matrices
    uint16_t nValue = 0;             // rows of one ND matrix
    uint16_t dValue = 0;             // columns (elements); padded with 0 to 32 bytes in L1
    uint16_t srcNdMatrixStride = 0;  // elements between ND matrices
    uint16_t srcDValue = 0;          // elements per source row (the row stride)
    uint16_t dstNzC0Stride = 0;      // 32-byte units between column blocks in L1
    uint16_t dstNzNStride = 0;       // 32-byte units between rows of a column block
    uint16_t dstNzMatrixStride = 0;  // elements between NZ matrices
};

struct LoadData2DParams {
    LoadData2DParams() = default;
    LoadData2DParams(uint16_t startIndexIn, uint8_t repeatTimesIn, uint16_t srcStrideIn, uint8_t sidIn,
                     uint16_t dstGapIn, bool ifTransposeIn, uint8_t addrModeIn)
        : startIndex(startIndexIn), dstGap(dstGapIn), srcStride(srcStrideIn), ifTranspose(ifTransposeIn),
          repeatTimes(repeatTimesIn), sid(sidIn), addrMode(addrModeIn) {}
    uint16_t startIndex = 0;  // first source fractal (512-byte units)
    uint16_t dstGap = 0;      // fractals skipped between destination fractals
    uint16_t srcStride = 0;   // fractals between source fractals of consecutive repeats
    bool ifTranspose = false; // transpose each fractal (16-bit types, L1 -> L0 only)
    uint8_t repeatTimes = 0;  // fractals moved
    uint8_t sid = 0;
    uint8_t addrMode = 0;
};
using LoadData2dParams = LoadData2DParams;

struct MmadParams {
    MmadParams() = default;
    MmadParams(uint16_t mIn, uint16_t nIn, uint16_t kIn, bool isBiasIn, int32_t fmOffsetIn, bool enSsparseIn,
               bool enWinogradAIn, bool enWinogradBIn)
        : m(mIn), n(nIn), k(kIn), isBias(isBiasIn), fmOffset(fmOffsetIn), enSsparse(enSsparseIn),
          enWinogradA(enWinogradAIn), enWinogradB(enWinogradBIn) {}
    uint16_t m = 0, n = 0, k = 0;
    bool isBias = false;
    int32_t fmOffset = 0;
    bool enSsparse = false, enWinogradA = false, enWinogradB = false;
    uint8_t unitFlag = 0;
    bool kDirectionAlign = false;
    bool cmatrixSource = false;
    bool cmatrixInitVal = true;  // true: C = A x B; false: C += A x B
};

enum class QuantMode_t { NoQuant, F322F16, F322BF16, DEQF16, VDEQF16, QF322B8_PRE, VQF322B8_PRE, REQ8, VREQ8 };

struct FixpipeParamsV220 {
    FixpipeParamsV220() = default;
    FixpipeParamsV220(uint16_t nSizeIn, uint16_t mSizeIn, uint16_t srcStrideIn, uint32_t dstStrideIn, bool reluEnIn)
        : nSize(nSizeIn), mSize(mSizeIn), srcStride(srcStrideIn), dstStride(dstStrideIn), reluEn(reluEnIn) {}
    uint16_t nSize = 0;      // columns (a multiple of 16)
    uint16_t mSize = 0;      // rows
    uint16_t srcStride = 0;  // rows between column blocks of the NZ source (mSize rounded up to 16)
    uint32_t dstStride = 0;  // NZ2ND: elements per destination row
    QuantMode_t quantPre = QuantMode_t::NoQuant;
    uint64_t deqScalar = 0;
    uint16_t ndNum = 1, srcNdStride = 0, dstNdStride = 0;
    bool reluEn = false;
    uint8_t unitFlag = 0;
    bool isChannelSplit = false;
};

enum class CO2Layout : uint8_t { NZ = 0, ROW_MAJOR, COLUMN_MAJOR };
struct FixpipeConfig {
    CO2Layout format;
    bool isToUB = false;
};
constexpr FixpipeConfig CFG_NZ = {CO2Layout::NZ};
constexpr FixpipeConfig CFG_ROW_MAJOR = {CO2Layout::ROW_MAJOR};

template <typename T>
struct InitConstValueParams {
    InitConstValueParams() = default;
    InitConstValueParams(uint16_t repeatTimesIn, uint16_t blockNumIn, uint16_t dstGapIn, T initValueIn)
        : repeatTimes(repeatTimesIn), blockNum(blockNumIn), dstGap(dstGapIn), initValue(initValueIn) {}
    uint16_t repeatTimes = 0;  // repeats
    uint16_t blockNum = 0;     // blocks per repeat (32 bytes in L1, 512 in L0A / L0B)
    uint16_t dstGap = 0;       // blocks skipped between repeats
    T initValue{};
};

namespace detail {
constexpr uint32_t kFractal = 512;  // bytes of one L0A / L0B fractal

inline void RequireCube(const char* op, const Loc& loc) {
    if (topth_model::Ctx().type != topth_model::CoreType::AIC) {
        Fail(std::string(op) + " at " + Where(loc) + ": a cube-core instruction on a vector core (AIV); only the "
             "AIC of a mix kernel has L1, L0A / L0B / L0C and the cube unit");
    }
}
template <typename T>
constexpr bool kB16 = std::is_same_v<T, half> || std::is_same_v<T, bfloat16_t>;
inline void Check(bool ok, const char* op, const Loc& loc, const std::string& what) {
    if (!ok) Fail(std::string(op) + " at " + Where(loc) + ": " + what);
}
template <typename T>
inline float AsF(T v) {
    if constexpr (std::is_same_v<T, float>) return v;
    else return static_cast<float>(v);
}
}  // namespace detail

// GM -> L1 (A1 / B1) with ND -> NZ conversion (pipe MTE2).
template <typename T>
inline void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const Nd2NzParams& p, Loc loc = Loc::current()) {
    const char* op = "DataCopy GM->L1 (ND2NZ)";
    using detail::Check;
    detail::RequireCube(op, loc);
    detail::CheckSpace(dst, topth_model::Space::L1, "L1 (TPosition A1 / B1)", op, "destination", loc);
    detail::CheckAlign(dst, 32, op, "destination", loc);
    if (p.ndNum == 0 || p.nValue == 0 || p.dValue == 0) return;  // NOP
    Check(p.ndNum == 1, op, loc, "ndNum > 1 is not modelled");
    Check(p.nValue <= 16384, op, loc, "nValue " + std::to_string(p.nValue) + " outside [0, 16384]");
    Check(p.srcDValue >= 1, op, loc, "srcDValue must be >= 1");
    Check(p.dstNzC0Stride >= 1 && p.dstNzC0Stride <= 16384 && p.dstNzNStride >= 1 && p.dstNzNStride <= 16384, op, loc,
          "dstNzC0Stride / dstNzNStride outside [1, 16384]");
    constexpr uint32_t c0 = 32 / sizeof(T);
    const uint32_t blocks = (uint32_t(p.dValue) + c0 - 1) / c0;
    Check(blocks == 1 || p.dstNzC0Stride >= (uint32_t(p.nValue) - 1) * p.dstNzNStride + 1, op, loc,
          "column blocks overlap in L1 (dstNzC0Stride " + std::to_string(p.dstNzC0Stride) + " < rows " +
              std::to_string(p.nValue) + "): the device does not order overlapping writes");
    auto& ctx = topth_model::Ctx();
    topth_model::GmBuffer* buf = nullptr;
    for (uint32_t r = 0; r < p.nValue; ++r) {
        const uint64_t lo = uint64_t(r) * p.srcDValue * sizeof(T);
        buf = &detail::GmTouch(src, lo, lo + uint64_t(p.dValue) * sizeof(T), false, op, loc, false);
    }
    for (uint32_t c = 0; c < blocks; ++c) {
        const uint64_t base = uint64_t(c) * p.dstNzC0Stride * 32;
        if (p.dstNzNStride == 1) {
            detail::UbTouch(dst, base, base + uint64_t(p.nValue) * 32, Pipe::MTE2, true, op, "destination", loc);
        } else {
            for (uint32_t r = 0; r < p.nValue; ++r)
                detail::UbTouch(dst, base + uint64_t(r) * p.dstNzNStride * 32, base + uint64_t(r) * p.dstNzNStride * 32 + 32,
                                Pipe::MTE2, true, op, "destination", loc);
        }
    }
    const uint64_t bytes = uint64_t(p.nValue) * p.dValue * sizeof(T);
    ctx.launch->AddBytes(*buf, true, bytes);
    detail::CountCopy(*buf, true, bytes);
    T* d = dst.Ptr();
    for (uint32_t r = 0; r < p.nValue; ++r) {
        const T* s = src.addr_ + uint64_t(r) * p.srcDValue;
        for (uint32_t c = 0; c < blocks; ++c) {
            T* row = d + (uint64_t(c) * p.dstNzC0Stride + uint64_t(r) * p.dstNzNStride) * c0;
            for (uint32_t e = 0; e < c0; ++e) {
                const uint32_t col = c * c0 + e;
                row[e] = col < p.dValue ? s[col] : T(0.0f);
            }
        }
    }
}

// Fill L1 (pipe MTE2, 32-byte blocks) or L0A / L0B (pipe MTE1, 512-byte blocks) with a value.
template <typename T, typename U>
inline void InitConstValue(const LocalTensor<T>& dst, const InitConstValueParams<U>& p, Loc loc = Loc::current()) {
    static_assert(std::is_same_v<T, U>, "InitConstValue: the value has the tensor's type");
    const char* op = "InitConstValue";
    detail::RequireCube(op, loc);
    const bool l1 = dst.space_ == static_cast<int>(topth_model::Space::L1);
    detail::Check(l1 || dst.space_ == static_cast<int>(topth_model::Space::L0A) ||
                      dst.space_ == static_cast<int>(topth_model::Space::L0B),
                  op, loc, "the destination must be in L1, L0A or L0B");
    const uint32_t blk = l1 ? 32 : detail::kFractal;
    detail::CheckAlign(dst, blk, op, "destination", loc);
    if (p.repeatTimes == 0 || p.blockNum == 0) return;
    const Pipe pipe = l1 ? Pipe::MTE2 : Pipe::MTE1;
    const uint64_t step = (uint64_t(p.blockNum) + p.dstGap) * blk;
    for (uint32_t r = 0; r < p.repeatTimes; ++r)
        detail::UbTouch(dst, r * step, r * step + uint64_t(p.blockNum) * blk, pipe, true, op, "destination", loc);
    topth_model::Ctx().cnt.cubeInstr++;
    auto* d = reinterpret_cast<uint8_t*>(dst.Ptr());
    for (uint32_t r = 0; r < p.repeatTimes; ++r)
        for (uint64_t i = 0; i < uint64_t(p.blockNum) * blk / sizeof(T); ++i)
            std::memcpy(d + r * step + i * sizeof(T), &p.initValue, sizeof(T));
}

// L1 (A1 / B1) -> L0A (A2) / L0B (B2), one 512-byte fractal per repeat (pipe MTE1).
template <typename T>
inline void LoadData(const LocalTensor<T>& dst, const LocalTensor<T>& src, const LoadData2DParams& p, Loc loc = Loc::current()) {
    static_assert(detail::kB16<T>, "the model implements LoadData for 16-bit types (half, bfloat16_t)");
    const char* op = "LoadData (L1->L0)";
    detail::RequireCube(op, loc);
    detail::CheckSpace(src, topth_model::Space::L1, "L1 (TPosition A1 / B1)", op, "source", loc);
    detail::Check(dst.space_ == static_cast<int>(topth_model::Space::L0A) ||
                      dst.space_ == static_cast<int>(topth_model::Space::L0B),
                  op, loc, std::string("the destination must be in L0A (A2) or L0B (B2), not ") + detail::MemName(dst.space_));
    detail::CheckAlign(src, 32, op, "source", loc);
    detail::CheckAlign(dst, detail::kFractal, op, "destination", loc);
    detail::Check(p.addrMode == 0, op, loc, "addrMode 1 (decreasing) is not modelled");
    if (p.repeatTimes == 0) return;
    const uint64_t f = detail::kFractal;
    for (uint32_t i = 0; i < p.repeatTimes; ++i) {
        const uint64_t s = (uint64_t(p.startIndex) + uint64_t(i) * p.srcStride) * f, d = uint64_t(i) * (p.dstGap + 1) * f;
        detail::UbTouch(src, s, s + f, Pipe::MTE1, false, op, "source", loc);
        detail::UbTouch(dst, d, d + f, Pipe::MTE1, true, op, "destination", loc);
    }
    auto& c = topth_model::Ctx().cnt;
    c.cubeInstr++;
    c.mte1Requests++;
    c.mte1Bytes += f * p.repeatTimes;
    T tmp[256];
    for (uint32_t i = 0; i < p.repeatTimes; ++i) {
        const T* s = src.Ptr() + (uint64_t(p.startIndex) + uint64_t(i) * p.srcStride) * 256;
        T* d = dst.Ptr() + uint64_t(i) * (p.dstGap + 1) * 256;
        for (uint32_t e = 0; e < 256; ++e) tmp[e] = p.ifTranspose ? s[(e % 16) * 16 + e / 16] : s[e];
        std::memcpy(d, tmp, sizeof(tmp));
    }
}

// C (L0C, float32, Nz) = A (L0A, m x k, Zz) x B (L0B, k x n, Zn) [+ C] (pipe M). Elements
// of the last fractals beyond m / n / k are ignored (their C entries are left undefined: NaN
// here). m == 1 reads A as one ND row (GEMV mode of Atlas A2). Model choice: float32
// products summed in k order (the device's accumulation order is not documented).
template <typename T, typename U, typename S>
inline void Mmad(const LocalTensor<T>& dst, const LocalTensor<U>& fm, const LocalTensor<S>& filter, const MmadParams& p,
                 Loc loc = Loc::current()) {
    static_assert(std::is_same_v<T, float> && std::is_same_v<U, S> && detail::kB16<U>,
                  "the model implements Mmad for half x half / bfloat16_t x bfloat16_t -> float");
    const char* op = "Mmad";
    using detail::Check;
    detail::RequireCube(op, loc);
    detail::CheckSpace(dst, topth_model::Space::L0C, "L0C (TPosition CO1)", op, "dst", loc);
    detail::CheckSpace(fm, topth_model::Space::L0A, "L0A (TPosition A2)", op, "fm (matrix A)", loc);
    detail::CheckSpace(filter, topth_model::Space::L0B, "L0B (TPosition B2)", op, "filter (matrix B)", loc);
    detail::CheckAlign(dst, 1024, op, "dst", loc);
    detail::CheckAlign(fm, detail::kFractal, op, "fm (matrix A)", loc);
    detail::CheckAlign(filter, detail::kFractal, op, "filter (matrix B)", loc);
    Check(p.m <= 4095 && p.n <= 4095 && p.k <= 4095, op, loc, "m, n, k must be in [0, 4095]");
    Check(!p.isBias && !p.cmatrixSource, op, loc, "bias (isBias / cmatrixSource) is not modelled");
    Check(p.unitFlag == 0, op, loc, "unitFlag is not modelled");
    if (p.m == 0 || p.n == 0 || p.k == 0) return;  // NOP
    const uint32_t mb = (p.m + 15) / 16, nb = (p.n + 15) / 16, kb = (p.k + 15) / 16;
    const bool gemv = p.m == 1;
    detail::UbTouch(fm, 0, gemv ? (uint64_t(p.k) * 2 + 31) / 32 * 32 : uint64_t(mb) * kb * 512, Pipe::M, false, op,
                    "fm (matrix A)", loc);
    detail::UbTouch(filter, 0, uint64_t(kb) * nb * 512, Pipe::M, false, op, "filter (matrix B)", loc);
    if (!p.cmatrixInitVal) detail::UbTouch(dst, 0, uint64_t(mb) * nb * 1024, Pipe::M, false, op, "dst", loc);
    detail::UbTouch(dst, 0, uint64_t(mb) * nb * 1024, Pipe::M, true, op, "dst", loc);
    auto& c = topth_model::Ctx().cnt;
    c.cubeInstr++;
    c.mmadInstr++;
    c.mmadFractals += uint64_t(mb) * nb * kb;
    const U* a = fm.Ptr();
    const S* b = filter.Ptr();
    float* out = dst.Ptr();
    for (uint32_t i = 0; i < mb * 16; ++i) {
        for (uint32_t j = 0; j < nb * 16; ++j) {
            float& o = out[((uint64_t(j / 16) * mb + i / 16) * 16 + i % 16) * 16 + j % 16];
            if (i >= p.m || j >= p.n) {
                o = std::numeric_limits<float>::quiet_NaN();
                continue;
            }
            float acc = p.cmatrixInitVal ? 0.0f : o;
            for (uint32_t l = 0; l < p.k; ++l) {
                const U av = gemv ? a[l] : a[(uint64_t(i / 16) * kb + l / 16) * 256 + (i % 16) * 16 + l % 16];
                const S bv = b[(uint64_t(l / 16) * nb + j / 16) * 256 + (j % 16) * 16 + l % 16];
                acc += detail::AsF(av) * detail::AsF(bv);
            }
            o = acc;
        }
    }
}

// L0C (CO1, Nz, float32) -> GM with NZ -> ND conversion (CFG_ROW_MAJOR; pipe FIX):
// dst[i * dstStride + j] = C[i][j] for i < mSize, j < nSize.
template <typename T, typename U, const FixpipeConfig& config = CFG_ROW_MAJOR>
inline void Fixpipe(const GlobalTensor<T>& dst, const LocalTensor<U>& src, const FixpipeParamsV220& p,
                    Loc loc = Loc::current()) {
    static_assert(std::is_same_v<U, float>, "the model implements Fixpipe from a float32 L0C");
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat16_t>,
                  "Fixpipe: float32, half or bfloat16_t destination");
    const char* op = "Fixpipe (L0C->GM)";
    using detail::Check;
    detail::RequireCube(op, loc);
    Check(config.format == CO2Layout::ROW_MAJOR && !config.isToUB, op, loc, "only CFG_ROW_MAJOR (NZ2ND) to GM is modelled");
    detail::CheckSpace(src, topth_model::Space::L0C, "L0C (TPosition CO1)", op, "src", loc);
    detail::CheckAlign(src, 64, op, "src", loc);
    const QuantMode_t want = std::is_same_v<T, float> ? QuantMode_t::NoQuant
                             : std::is_same_v<T, half> ? QuantMode_t::F322F16 : QuantMode_t::F322BF16;
    Check(p.quantPre == want, op, loc, "quantPre does not match the destination type (NoQuant / F322F16 / F322BF16)");
    Check(p.ndNum == 1 && !p.reluEn && p.unitFlag == 0 && !p.isChannelSplit, op, loc,
          "ndNum > 1, ReLU, unitFlag and channel split are not modelled");
    if (p.nSize == 0 || p.mSize == 0) return;  // NOP
    Check(p.nSize % 16 == 0 && p.nSize <= 4095, op, loc, "nSize " + std::to_string(p.nSize) + " must be a multiple of 16 in [16, 4095]");
    Check(p.mSize <= 8192, op, loc, "mSize over 8192 (NZ2ND)");
    const uint32_t m16 = (p.mSize + 15u) / 16u * 16u;
    Check(p.srcStride >= m16, op, loc, "srcStride " + std::to_string(p.srcStride) + " < mSize rounded up to 16 (" +
                                           std::to_string(m16) + "): the column blocks of the source overlap");
    Check(p.dstStride >= p.nSize, op, loc, "dstStride " + std::to_string(p.dstStride) + " < nSize " + std::to_string(p.nSize) +
                                               ": destination rows overlap (the device does not order overlapping writes)");
    for (uint32_t jb = 0; jb < p.nSize / 16u; ++jb)
        detail::UbTouch(src, uint64_t(jb) * p.srcStride * 64, uint64_t(jb) * p.srcStride * 64 + uint64_t(p.mSize) * 64,
                        Pipe::FIX, false, op, "src", loc);
    topth_model::GmBuffer* buf = nullptr;
    for (uint32_t i = 0; i < p.mSize; ++i) {
        const uint64_t lo = uint64_t(i) * p.dstStride * sizeof(T);
        buf = &detail::GmTouch(dst, lo, lo + uint64_t(p.nSize) * sizeof(T), true, op, loc, false, Pipe::FIX);
    }
    const uint64_t bytes = uint64_t(p.mSize) * p.nSize * sizeof(T);
    topth_model::Ctx().launch->AddBytes(*buf, false, bytes);
    auto& c = topth_model::Ctx().cnt;
    c.cubeInstr++;
    c.fixRequests++;
    c.fixBytes += bytes;
    const float* s = src.Ptr();
    for (uint32_t i = 0; i < p.mSize; ++i)
        for (uint32_t j = 0; j < p.nSize; ++j) {
            const float v = s[(uint64_t(j / 16) * p.srcStride + i) * 16 + j % 16];
            if constexpr (std::is_same_v<T, float>) dst.addr_[uint64_t(i) * p.dstStride + j] = v;
            else dst.addr_[uint64_t(i) * p.dstStride + j] = T(v);
        }
}

}  // namespace AscendC
