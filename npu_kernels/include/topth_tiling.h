// Host-side tiling of the topth decode-attention kernel (header-only, no CANN dependency):
// from the shapes and the target's unified-buffer size and vector-core count, choose
// the work split over cores (batch x kv-heads, and the KV sequence when that is too
// little work: flash-decoding), the K / V tile sizes, every unified-buffer buffer size
// and the workspace layout. A shape that cannot fit is refused with the reason.
//
// Used by the CPU model binding (cpu_model/src/binding.cpp) and by the NPU binding
// (npu/topth_npu_binding.cpp); the kernel only reads the result.
#ifndef TOPTH_TILING_H
#define TOPTH_TILING_H

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>

#include "topth_tiling_data.h"

namespace topth {

// The device: unified-buffer bytes per AI vector core, and vector-core count.
struct TargetInfo {
    std::string name = "Ascend910B (Atlas A2)";
    uint64_t ubBytes = 196608;  // 192 KiB per AIV core on Atlas A2 / Ascend 910B
    uint32_t aivCores = 48;     // 910B1/B2: 24 AI cores x 2 AIV; 910B3/B4 have 40
    uint32_t minSplitLen = 512; // fewest KV positions one split handles (flash-decoding)
};

struct ProblemShape {
    uint32_t batch = 0, numQHeads = 0, numKvHeads = 0, maxSeqLen = 0, headDim = 0, maxRowId = 0;
    uint32_t dtype = TOPTH_DTYPE_FP16;  // TOPTH_DTYPE_*
    uint32_t placement = TOPTH_PRE_SOFTMAX;
    uint32_t sdc = TOPTH_SDC_NONE;
    uint32_t vmc = 0;
    float scale = 1.0f, sdcGamma = 0.05f;
};

inline uint32_t ElemBytes(uint32_t dtype) { return dtype == TOPTH_DTYPE_FP32 ? 4u : 2u; }
inline uint64_t Up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// Fill the unified-buffer plan for tiles (tileK, tileV); returns the total bytes.
inline uint64_t PlanUb(TopthTilingData& t, uint32_t tileK, uint32_t tileV) {
    const uint64_t G = t.group, Dp = t.headDimPad, E = t.elemBytes, W = TOPTH_TILE_W;
    const bool widen = E != 4;  // fp16 / bf16 are cast to float32 in UB
    const bool split = t.splitNum > 1;
    const bool post = t.placement == TOPTH_POST_SOFTMAX;
    const uint64_t tvPad = Up(tileV, 8);
    t.ubKIn = static_cast<uint32_t>(Up(tileK * Dp * E, 32));             // x2 (double buffer)
    t.ubKF32 = widen ? static_cast<uint32_t>(tileK * Dp * 4) : 0;
    t.ubProd = static_cast<uint32_t>(std::max<uint64_t>(tileK * W * 4, tvPad * Dp * 4));
    t.ubQ = static_cast<uint32_t>(G * Dp * 4);
    t.ubAcc = static_cast<uint32_t>(G * Dp * 4);
    t.ubTile = static_cast<uint32_t>(G * W * 4);                          // x6 tile buffers
    t.ubMask = static_cast<uint32_t>(Up(G * W / 8, 32));
    t.ubVIn = static_cast<uint32_t>(Up(tvPad * Dp * E, 32));             // x2 (double buffer)
    t.ubVF32 = widen ? static_cast<uint32_t>(tvPad * Dp * 4) : 0;
    t.ubWc = static_cast<uint32_t>(G * W * 4);
    t.ubWb = static_cast<uint32_t>(tvPad * 32);
    t.ubPair = static_cast<uint32_t>(TOPTH_NUM_PAIR_VECS * t.pairWidth * 4);
    t.ubPairB = static_cast<uint32_t>(2 * t.pairWidth * 32);
    t.ubStage = widen ? static_cast<uint32_t>(Up(G * Dp * E, 32)) : 0;
    t.ubMu = t.vmc ? static_cast<uint32_t>(Dp * 4) : 0;
    t.ubCmb = split ? static_cast<uint32_t>(uint64_t(t.partFloats) * 4) : 0;   // one partial record
    t.ubMAll = split ? static_cast<uint32_t>(2ull * t.splitNum * t.pairWidth * 4) : 0;
    t.ubSync = split ? static_cast<uint32_t>(t.blockDim * 32) : 0;
    t.ubStat = static_cast<uint32_t>(3 * Up(G * 4, 32));
    t.ubSIn = post ? static_cast<uint32_t>(G * W * 4) : 0;               // x2 (double buffer)
    uint64_t total = 2ull * t.ubKIn + t.ubKF32 + t.ubProd + t.ubQ + t.ubAcc + 6ull * t.ubTile + t.ubMask +
                     2ull * t.ubVIn + t.ubVF32 + t.ubWc + t.ubWb + t.ubPair + t.ubPairB + t.ubStage + t.ubMu +
                     t.ubCmb + t.ubMAll + t.ubSync + t.ubStat + 2ull * t.ubSIn;
    t.tileK = tileK;
    t.tileV = tileV;
    t.ubTotal = static_cast<uint32_t>(total);
    return total;
}

inline std::string UbBreakdown(const TopthTilingData& t) {
    std::ostringstream os;
    os << "K tiles 2x" << t.ubKIn << ", K float32 " << t.ubKF32 << ", products " << t.ubProd << ", query "
       << t.ubQ << ", accumulators " << t.ubAcc << ", score tiles 6x" << t.ubTile << ", V tiles 2x" << t.ubVIn
       << ", V float32 " << t.ubVF32 << ", weights " << (t.ubWc + t.ubWb) << ", combine " << (t.ubCmb + t.ubMAll)
       << ", other " << (t.ubMask + t.ubPair + t.ubPairB + t.ubStage + t.ubMu + t.ubSync + t.ubStat + 2 * t.ubSIn);
    return os.str();
}

// Compute the tiling. Returns false and sets *reason when the shape cannot run.
inline bool ComputeTiling(const ProblemShape& s, const TargetInfo& target, TopthTilingData* out, std::string* reason) {
    TopthTilingData t{};
    auto refuse = [&](const std::string& why) {
        if (reason) *reason = why;
        return false;
    };
    if (s.batch == 0 || s.numQHeads == 0 || s.numKvHeads == 0 || s.maxSeqLen == 0 || s.headDim == 0 || s.maxRowId == 0) {
        return refuse("every dimension must be >= 1");
    }
    if (s.numQHeads % s.numKvHeads != 0) return refuse("num_q_heads must be a multiple of num_kv_heads");
    if (s.dtype > TOPTH_DTYPE_FP32) return refuse("unknown dtype code");
    if (target.aivCores == 0 || target.ubBytes < 1024) return refuse("invalid target description");
    t.batch = s.batch;
    t.numQHeads = s.numQHeads;
    t.numKvHeads = s.numKvHeads;
    t.group = s.numQHeads / s.numKvHeads;
    t.maxSeqLen = s.maxSeqLen;
    t.headDim = s.headDim;
    t.elemBytes = ElemBytes(s.dtype);
    t.headDimPad = static_cast<uint32_t>(Up(uint64_t(s.headDim) * t.elemBytes, 32) / t.elemBytes);
    t.maxRowId = s.maxRowId;
    t.dtype = s.dtype;
    t.placement = s.placement;
    t.sdc = s.sdc;
    t.vmc = s.vmc;
    t.scale = s.scale;
    t.sdcGamma = s.sdcGamma;
    t.pairWidth = static_cast<uint32_t>(Up(2ull * t.group, 8));
    // Partial record of one split: [M, R, E, K] pair vectors, an 8-word block (union
    // count), then the G x Dp float32 accumulators.
    t.partFloats = static_cast<uint32_t>(4ull * t.pairWidth + 8 + uint64_t(t.group) * t.headDimPad);

    // Limits of the vector instructions the kernel issues (repeat strides are 8-bit, in
    // 32-byte blocks; repeat counts at most 255).
    if (uint64_t(t.headDimPad) * 4 / 32 > 255) {
        std::ostringstream os;
        os << "head_dim " << s.headDim << " is too large: a float32 row of " << t.headDimPad * 4
           << " bytes exceeds the 255-block repeat stride of the vector unit (head_dim <= 2040)";
        return refuse(os.str());
    }
    if (t.group > 255) return refuse("more than 255 query heads per KV head");
    if (uint64_t(s.maxSeqLen) * 4 > 0xffffffffull) return refuse("max_seq_len too large for 32-bit copy strides");

    // Work split: batch x kv-heads pairs over vector cores. When that leaves cores idle
    // (few pairs, as IncrementalFlashAttention splits below 40% of the cores, or a last
    // round only partly filled), also split the KV sequence (flash-decoding; the splits are
    // combined by LSE): the smallest split count whose rounds are >= 95% full, else the
    // fullest. Lengths are not known on the host (seq_lens lives on the device), so splits
    // are uniform over max_seq_len.
    t.numPairs = s.batch * s.numKvHeads;
    const uint32_t cores = target.aivCores;
    const uint32_t byLen = std::max<uint32_t>(1, (s.maxSeqLen + std::max<uint32_t>(1, target.minSplitLen) - 1) /
                                                     std::max<uint32_t>(1, target.minSplitLen));
    const uint32_t byCores = std::max<uint32_t>(1, static_cast<uint32_t>((4ull * cores + t.numPairs - 1) / t.numPairs));
    const uint32_t maxSplit = std::min(byLen, byCores);
    uint32_t splitNum = 1;
    double bestFill = 0.0;
    for (uint32_t c = 1; c <= maxSplit; ++c) {
        const uint64_t items = uint64_t(t.numPairs) * c;
        const double fill = double(items) / double((items + cores - 1) / cores * cores);
        if (fill > bestFill + 1e-9) {
            bestFill = fill;
            splitNum = c;
        }
        if (fill >= 0.95) break;
    }
    uint32_t splitLen = static_cast<uint32_t>(Up((s.maxSeqLen + splitNum - 1) / splitNum, TOPTH_TILE_W));
    splitNum = (s.maxSeqLen + splitLen - 1) / splitLen;
    t.splitNum = splitNum;
    t.splitLen = splitLen;
    t.numItems = t.numPairs * splitNum;
    t.blockDim = std::min<uint32_t>(target.aivCores, t.numItems);

    // Tiles: the largest K tile (then V tile) whose buffers fit the unified buffer.
    static const uint32_t kTiles[] = {64, 32, 16, 8};
    static const uint32_t vTiles[] = {32, 16, 8};
    bool fits = false;
    for (uint32_t tk : kTiles) {
        for (uint32_t tv : vTiles) {
            if (PlanUb(t, tk, tv) <= target.ubBytes) {
                fits = true;
                break;
            }
        }
        if (fits) break;
    }
    if (!fits) {
        PlanUb(t, 8, 8);
        std::ostringstream os;
        os << "does not fit the unified buffer of " << target.name << ": with the smallest tiles (8 K rows, 8 V rows) "
           << "the kernel needs " << t.ubTotal << " bytes (" << UbBreakdown(t) << ") but a vector core has "
           << target.ubBytes << " bytes; group size " << t.group << " (num_q_heads / num_kv_heads) x head_dim "
           << s.headDim << " is too large for this kernel";
        return refuse(os.str());
    }

    // Workspace (GM scratch).
    const uint64_t G = t.group, PW = t.pairWidth;
    uint64_t off = 0;
    t.wsSyncOff = off;
    if (splitNum > 1) off += Up(uint64_t(t.blockDim) * 32, 32);
    t.wsScoresOff = off;
    if (s.placement == TOPTH_POST_SOFTMAX) off += Up(uint64_t(t.numPairs) * G * s.maxSeqLen * 4, 32);
    t.wsStatsOff = off;
    if (s.placement == TOPTH_POST_SOFTMAX && splitNum > 1) off += Up(uint64_t(t.numItems) * 2 * PW * 4, 32);
    t.wsPartOff = off;
    if (splitNum > 1) off += Up(uint64_t(t.numItems) * t.partFloats * 4, 32);
    t.wsBytes = std::max<uint64_t>(off, 32);
    *out = t;
    return true;
}

}  // namespace topth

static_assert(sizeof(TopthTilingData) % 8 == 0, "the kernel copies the tiling as 32-bit words");

#endif  // TOPTH_TILING_H
