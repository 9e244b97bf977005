// Host-side tiling of the topth decode-attention kernel (header-only, no CANN dependency):
// from the shapes and the target's unified-buffer size and vector-core count, choose the
// work split over cores (batch x kv-heads, and at most splitCap splits of the KV sequence
// when that is too little work: flash-decoding; the kernel picks the split count from the
// actual lengths), the K / V tile sizes, every unified-buffer buffer size and the
// workspace layout. A shape that cannot fit is refused with the reason.
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
    uint32_t minSplitLen = 512; // fewest KV positions one split handles (IFA's empirical 512)
    bool reserveApiScratch = true;  // keep the top 8 KiB of UB for the API (false: test of the bug)
    uint32_t syncMode = TOPTH_SYNC_HARD;
    uint32_t mergeGapBytes = 512;  // DRAM access granule of the V-row merge (0: no merging)
    uint64_t l2Bytes = 192ull << 20;  // L2 cache (Atlas A2: 192 MB)
    // Cube cores (AIC, one per AI core with two AIVs) and their buffers (Atlas A2).
    uint32_t aicCores = 24;
    uint64_t l1Bytes = 512ull << 10, l0aBytes = 64ull << 10, l0bBytes = 64ull << 10, l0cBytes = 128ull << 10;
    uint32_t path = 0;       // 0: auto (cube path when it can run), 1: all-vector, 2: cube (refused when it cannot)
    uint32_t ringSlots = 4;  // score tiles in flight per vector core on the cube path
};

#define TOPTH_PATH_AUTO 0u
#define TOPTH_PATH_VECTOR 1u
#define TOPTH_PATH_CUBE 2u

struct ProblemShape {
    uint32_t batch = 0, numQHeads = 0, numKvHeads = 0, maxSeqLen = 0, headDim = 0, maxRowId = 0;
    uint32_t dtype = TOPTH_DTYPE_FP16;  // TOPTH_DTYPE_*
    uint32_t placement = TOPTH_PRE_SOFTMAX;
    uint32_t sdc = TOPTH_SDC_NONE;
    uint32_t vmc = 0;
    uint32_t selection = TOPTH_SELECT_HEAD;
    uint32_t numSets = 1, hasSets = 0;
    float scale = 1.0f, sdcGamma = 0.05f;
    // Paged caches (paged = 1): numBlocks blocks of blockSize slots, block_table
    // [batch, maxBlocksPerSeq]; maxSeqLen = maxBlocksPerSeq * blockSize. Contiguous BNSD:
    // paged = 0, numBlocks = batch, blockSize = maxSeqLen, maxBlocksPerSeq = 1.
    uint32_t paged = 0, blockSize = 0, numBlocks = 0, maxBlocksPerSeq = 1;
    // Cache strides (block, kv head, slot) in elements; each row of head_dim elements is
    // contiguous. All 0: the contiguous layout ([B, Hkv, S, D] BNSD / HND).
    uint64_t kStrides[3] = {0, 0, 0}, vStrides[3] = {0, 0, 0};
};

inline uint32_t ElemBytes(uint32_t dtype) { return dtype == TOPTH_DTYPE_FP32 ? 4u : 2u; }
inline uint64_t Up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }
inline const char* DtypeName(uint32_t dtype) {
    return dtype == TOPTH_DTYPE_FP32 ? "float32" : dtype == TOPTH_DTYPE_BF16 ? "bfloat16" : "float16";
}
// Largest head_dim the vector instructions allow (the unified buffer may allow less):
// 2040 for float32, 2032 for float16 / bfloat16 (see ComputeTiling).
inline uint32_t MaxHeadDim(uint32_t dtype) {
    const uint32_t granule = 32 / ElemBytes(dtype);
    return (255u * 32u / 4u) / granule * granule;
}
// Bytes of the unified buffer a plan may use on a target.
inline uint64_t UbLimit(const TargetInfo& target) {
    if (!target.reserveApiScratch || target.ubBytes <= TOPTH_UB_API_RESERVE) return target.ubBytes;
    return target.ubBytes - TOPTH_UB_API_RESERVE;
}

// Fill the unified-buffer plan for tiles (tileK, tileV); returns the total bytes.
inline uint64_t PlanUb(TopthTilingData& t, uint32_t tileK, uint32_t tileV) {
    const uint64_t G = t.group, Dp = t.headDimPad, E = t.elemBytes, W = TOPTH_TILE_W;
    const bool widen = E != 4;  // fp16 / bf16 are cast to float32 in UB
    const bool split = t.splitCap > 1;
    const bool post = t.placement == TOPTH_POST_SOFTMAX;
    const uint64_t tvPad = Up(tileV, 8);
    const bool cube = t.cubePath != 0;  // no K stream, no query, no score products on the vector core
    t.ubKIn = cube ? 0 : static_cast<uint32_t>(Up(tileK * Dp * E, 32));  // x2 (double buffer)
    t.ubKF32 = (widen && !cube) ? static_cast<uint32_t>(tileK * Dp * 4) : 0;
    t.ubProd = static_cast<uint32_t>(std::max<uint64_t>(cube ? 0 : tileK * W * 4, tvPad * Dp * 4));
    t.ubQ = cube ? 0 : static_cast<uint32_t>(G * Dp * 4);
    t.ubAcc = static_cast<uint32_t>(G * Dp * 4);
    t.ubTile = static_cast<uint32_t>(G * W * 4);                          // x6 tile buffers
    t.ubMask = static_cast<uint32_t>(Up(G * W / 8, 32) + 64);  // + union and fetch bit masks
    t.ubVIn = static_cast<uint32_t>(Up(tvPad * Dp * E, 32));             // x2 (double buffer)
    t.ubVF32 = widen ? static_cast<uint32_t>(tvPad * Dp * 4) : 0;
    t.ubWc = static_cast<uint32_t>((t.vPrefetch ? 2 : 1) * G * W * 4);
    t.ubWb = static_cast<uint32_t>(std::max<uint32_t>(t.wbHeads, 1) * tvPad * 32);  // broadcast weights of wbHeads heads
    const uint64_t pairVecs = TOPTH_NUM_PAIR_VECS + TOPTH_KEPT_REF(t.selection, t.placement);
    t.ubPair = static_cast<uint32_t>(pairVecs * t.pairWidth * 4);
    t.ubPairB = static_cast<uint32_t>(2 * t.pairWidth * 32);
    t.ubStage = widen ? static_cast<uint32_t>(Up(G * Dp * E, 32)) : 0;
    t.ubMu = t.vmc ? static_cast<uint32_t>(Dp * 4) : 0;
    // combine: the statistics of one partial record and one accumulator row at a time
    const uint64_t recPairs = TOPTH_RECORD_PAIRS(t.selection, t.placement);
    t.ubCmb = split ? static_cast<uint32_t>((recPairs * t.pairWidth + 8 + Dp) * 4) : 0;
    // two pair vectors per split: (m, Z) in post_softmax's pass B; the combine's M and, with
    // group selection and pre_softmax, kept references of every split
    t.ubMAll = split ? static_cast<uint32_t>(2ull * t.splitCap * t.pairWidth * 4) : 0;
    t.ubSync = (split && t.syncMode == TOPTH_SYNC_SOFT) ? static_cast<uint32_t>(t.aivCount * 32) : 0;
    t.ubStat = static_cast<uint32_t>(3 * Up(G * 4, 32));
    t.ubSIn = (post || cube) ? static_cast<uint32_t>(G * W * 4) : 0;     // x2 (double buffer)
    uint64_t total = 2ull * t.ubKIn + t.ubKF32 + t.ubProd + t.ubQ + t.ubAcc + 6ull * t.ubTile + t.ubMask +
                     2ull * t.ubVIn + t.ubVF32 + t.ubWc + t.ubWb + t.ubPair + t.ubPairB + t.ubStage + t.ubMu +
                     t.ubCmb + t.ubMAll + t.ubSync + t.ubStat + 2ull * t.ubSIn;
    t.tileK = tileK;
    t.tileV = tileV;
    t.ubTotal = static_cast<uint32_t>(std::min<uint64_t>(total, 0xffffffffull));
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

// The largest K tile (then V tile) whose buffers fit, with the V prefetch if it fits too;
// false when even 8 x 8 does not. On the cube path the K tile is the cube's 64 positions.
// Preference: larger K, then V tiles; then the V prefetch and the weights of up to 8 heads
// at once (P.V by rows), each dropped before a smaller tile.
inline bool FitTiles(TopthTilingData& t, uint64_t limit) {
    static const uint32_t kTiles[] = {64, 32, 16, 8};
    static const uint32_t vTiles[] = {32, 16, 8};
    const uint32_t heads = std::min<uint32_t>(t.group, 8);
    const uint32_t extras[4][2] = {{1, heads}, {0, heads}, {1, 1}, {0, 1}};  // (vPrefetch, wbHeads)
    for (uint32_t tk : kTiles) {
        if (t.cubePath && tk != TOPTH_TILE_W) continue;
        for (uint32_t tv : vTiles) {
            for (const auto& e : extras) {
                t.vPrefetch = e[0];
                t.wbHeads = e[1];
                if (PlanUb(t, tk, tv) <= limit) return true;
            }
        }
    }
    return false;
}

// Cube-core buffers of the cube path (query of both AIVs' items in L1 and L0A, two K tiles
// in L1 and in L0B, two score tiles in L0C); an empty string when they fit the target, else
// why not.
inline std::string PlanCube(TopthTilingData& t, const TargetInfo& target) {
    const uint64_t E = t.elemBytes, W = TOPTH_TILE_W;
    t.mPad = static_cast<uint32_t>(Up(t.group, 16));
    t.kPad = static_cast<uint32_t>(Up(t.headDim, 16));
    t.l1Q = static_cast<uint32_t>(2ull * t.mPad * t.kPad * E);
    t.l1K = static_cast<uint32_t>(W * t.kPad * E);
    t.l0aQ = t.l1Q;
    t.l0bK = t.l1K;
    t.l0c = static_cast<uint32_t>(uint64_t(t.mPad) * W * 4);
    std::ostringstream os;
    if (t.l1Q + 2ull * t.l1K > target.l1Bytes) os << "L1 needs " << (t.l1Q + 2ull * t.l1K) << " of " << target.l1Bytes << " bytes";
    else if (t.l0aQ > target.l0aBytes) os << "L0A needs " << t.l0aQ << " of " << target.l0aBytes << " bytes (two queries of group size " << t.group << ")";
    else if (2ull * t.l0bK > target.l0bBytes) os << "L0B needs " << 2ull * t.l0bK << " of " << target.l0bBytes << " bytes (two 64-row K tiles of head_dim " << t.headDim << ")";
    else if (2ull * t.l0c > target.l0cBytes) os << "L0C needs " << 2ull * t.l0c << " of " << target.l0cBytes << " bytes";
    else if (t.mPad > 4095 || t.headDim > 4095) os << "Mmad takes m, k <= 4095";
    return os.str();
}

// Cache strides and addressable span; false (with *why) for layouts the kernel cannot read.
inline bool CacheLayout(const ProblemShape& s, TopthTilingData& t, std::string* why);

// Compute the tiling. Returns false and sets *reason when the shape cannot run; *pathWhy
// (optional) is why the all-vector kernel runs instead of the cube path (empty on the cube path).
inline bool ComputeTiling(const ProblemShape& s, const TargetInfo& target, TopthTilingData* out,
                          std::string* reason, std::string* pathWhy = nullptr);

}  // namespace topth

#include "topth_tiling_impl.h"

static_assert(sizeof(TopthTilingData) % 8 == 0, "the kernel copies the tiling as 32-bit words");

#endif  // TOPTH_TILING_H
