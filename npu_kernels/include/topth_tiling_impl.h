// Definitions of topth_tiling.h (included from there only).
#ifndef TOPTH_TILING_IMPL_H
#define TOPTH_TILING_IMPL_H

namespace topth {

inline bool CacheLayout(const ProblemShape& s, TopthTilingData& t, std::string* why) {
    // Rows are copied in runs with a GM gap of (slot stride - head_dim) elements
    // (DataCopyPad: a 32-bit byte gap), so the rows of one (block, kv head) must not overlap.
    const char* names[2] = {"key_cache", "value_cache"};
    const uint64_t* in[2] = {s.kStrides, s.vStrides};
    uint64_t* outS[2] = {&t.kStrideBlk, &t.vStrideBlk};
    uint64_t* span[2] = {&t.kSpan, &t.vSpan};
    for (int c = 0; c < 2; ++c) {
        uint64_t st[3] = {in[c][0], in[c][1], in[c][2]};
        if (st[0] == 0 && st[1] == 0 && st[2] == 0) {  // contiguous [blocks, heads, slots, D]
            st[2] = s.headDim;
            st[1] = uint64_t(t.blockSize) * s.headDim;
            st[0] = uint64_t(s.numKvHeads) * st[1];
        }
        if (t.blockSize == 1) st[2] = s.headDim;  // one slot per block: its stride is never used
        if (st[2] < s.headDim) {
            std::ostringstream os;
            os << names[c] << ": slot (position) stride " << st[2] << " is smaller than head_dim " << s.headDim
               << " (overlapping rows; the kernel copies runs of whole rows)";
            *why = os.str();
            return false;
        }
        if ((st[2] - s.headDim) * t.elemBytes > 0xffffffffull) {
            *why = std::string(names[c]) + ": the gap between rows exceeds the 32-bit byte stride of DataCopyPad";
            return false;
        }
        outS[c][0] = st[0];
        outS[c][1] = st[1];
        outS[c][2] = st[2];
        *span[c] = (uint64_t(t.numBlocks) - 1) * st[0] + (uint64_t(s.numKvHeads) - 1) * st[1] +
                   (uint64_t(t.blockSize) - 1) * st[2] + s.headDim;
    }
    return true;
}

// Work split and unified-buffer plan for `aivAvail` vector cores (fills t); an empty string
// when the plan fits, else why not.
inline std::string SplitAndFit(const ProblemShape& s, const TargetInfo& target, TopthTilingData& t, uint32_t aivAvail) {
    // Work split (after IncrementalFlashAttention's flash-decode rule): one item per (batch,
    // kv head) pair; when the pairs fill less than 40% of the vector cores, each pair may be
    // split into up to cores / pairs parts of the KV sequence, combined by log-sum-exp. The
    // kernel reads the lengths and uses u <= splitCap splits with >= minSplitLen positions
    // each (u from the longest sequence, fewer for shorter ones): the split follows the
    // actual lengths, not the cache capacity. Splitting costs unified buffer (the combine
    // record, per-split maxima, the soft SyncAll area): when the buffers do not fit, the cap
    // is lowered, down to no split, before refusing.
    const uint64_t limit = UbLimit(target);
    t.ubLimit = static_cast<uint32_t>(limit);
    t.numPairs = s.batch * s.numKvHeads;
    uint32_t cap = 1;
    if (uint64_t(t.numPairs) * 10 < 4ull * aivAvail) {
        cap = aivAvail / t.numPairs;
        cap = std::min<uint32_t>(cap, std::max<uint32_t>(1, s.maxSeqLen / t.minSplitLen));
        cap = std::max<uint32_t>(cap, 1);
    }
    const uint32_t firstCap = cap;
    for (;;) {
        t.splitCap = cap;
        const uint32_t busy = static_cast<uint32_t>(std::min<uint64_t>(aivAvail, uint64_t(t.numPairs) * cap));
        t.blockDim = t.cubePath ? (busy + 1) / 2 : busy;  // AI cores (two vector cores each) or vector cores
        t.aivCount = t.cubePath ? 2 * t.blockDim : t.blockDim;
        if (FitTiles(t, limit)) break;
        if (cap == 1) {
            PlanUb(t, 8, 8);
            std::ostringstream os;
            os << "does not fit the unified buffer of " << target.name << ": with the smallest tiles (8 K rows, "
               << "8 V rows) and no split of the KV sequence";
            if (firstCap > 1) os << " (the work split allowed " << firstCap << ")";
            os << " the kernel needs " << t.ubTotal << " bytes (" << UbBreakdown(t) << ") but a vector core has "
               << limit << " bytes";
            if (limit != target.ubBytes) {
                os << " (" << target.ubBytes << " less the " << TOPTH_UB_API_RESERVE
                   << " bytes the Ascend C API reserves at the top)";
            }
            os << ": the buffers of one GQA group (group size " << t.group
               << " = num_q_heads / num_kv_heads, x head_dim " << s.headDim
               << ": query, accumulators, score tiles) are too large for one vector core";
            return os.str();
        }
        cap -= 1;
    }

    return std::string();
}

inline bool ComputeTiling(const ProblemShape& s, const TargetInfo& target, TopthTilingData* out,
                          std::string* reason, std::string* pathWhy) {
    TopthTilingData t{};
    auto refuse = [&](const std::string& why) {
        if (reason) *reason = why;
        return false;
    };
    if (s.batch == 0 || s.numQHeads == 0 || s.numKvHeads == 0 || s.maxSeqLen == 0 || s.headDim == 0 ||
        s.maxRowId == 0 || s.numSets == 0) {
        return refuse("every dimension must be >= 1");
    }
    if (s.numQHeads % s.numKvHeads != 0) return refuse("num_q_heads must be a multiple of num_kv_heads");
    if (s.dtype > TOPTH_DTYPE_FP32) return refuse("unknown dtype code");
    if (s.selection > TOPTH_SELECT_GROUP) return refuse("unknown selection code");
    if (target.aivCores == 0 || target.aivCores > 65535) return refuse("invalid target: vector cores must be in [1, 65535]");
    if (target.ubBytes < 1024 || target.ubBytes % 32 != 0 || target.ubBytes > 0xffffffffull) {
        return refuse("invalid target: unified-buffer bytes must be a multiple of 32 in [1024, 2^32)");
    }
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
    t.selection = s.selection;
    t.numSets = s.numSets;
    t.hasSets = s.hasSets ? 1u : 0u;
    t.thHeads = s.selection == TOPTH_SELECT_GROUP ? s.numKvHeads : s.numQHeads;
    t.syncMode = target.syncMode;
    t.scale = s.scale;
    t.sdcGamma = s.sdcGamma;
    t.minSplitLen = std::max<uint32_t>(1, target.minSplitLen);
    t.mergeGapBytes = target.mergeGapBytes;
    t.pairWidth = static_cast<uint32_t>(Up(2ull * t.group, 8));
    // Partial record of one split: [M, R, E, K] pair vectors (and MK, the kept reference, with
    // group selection and pre_softmax), an 8-word block (union count), then the G x Dp float32
    // accumulators.
    const uint64_t recPairs = TOPTH_RECORD_PAIRS(s.selection, s.placement);
    t.partFloats = static_cast<uint32_t>(recPairs * t.pairWidth + 8 + uint64_t(t.group) * t.headDimPad);

    if (s.paged) {
        if (s.blockSize == 0 || s.numBlocks == 0 || s.maxBlocksPerSeq == 0) {
            return refuse("paged caches need block_size, num_blocks and max_blocks_per_seq >= 1");
        }
        if (uint64_t(s.blockSize) * s.maxBlocksPerSeq != s.maxSeqLen) {
            return refuse("paged caches: max_seq_len must be max_blocks_per_seq x block_size");
        }
        t.paged = 1;
        t.blockSize = s.blockSize;
        t.numBlocks = s.numBlocks;
        t.maxBlocksPerSeq = s.maxBlocksPerSeq;
    } else {
        t.paged = 0;
        t.blockSize = s.maxSeqLen;
        t.numBlocks = s.batch;
        t.maxBlocksPerSeq = 1;
    }
    std::string why;
    if (!CacheLayout(s, t, &why)) return refuse(why);
    t.l2CacheOff = (double(t.kSpan + t.vSpan) * t.elemBytes >= 1.2 * double(target.l2Bytes)) ? 1u : 0u;

    // Limits of the vector instructions the kernel issues (repeat strides are 8-bit, in
    // 32-byte blocks; repeat counts at most 255). A float32 row of headDimPad elements is a
    // repeat stride of headDimPad / 8 blocks: headDimPad <= 2040, and headDimPad is head_dim
    // rounded up to 32 bytes of the input dtype, so head_dim <= 2040 (float32) or 2032
    // (float16 / bfloat16: 16-element granule).
    if (uint64_t(t.headDimPad) * 4 / 32 > 255) {
        std::ostringstream os;
        os << "head_dim " << s.headDim << " is too large for " << DtypeName(s.dtype) << ": a float32 row of "
           << t.headDimPad * 4 << " bytes (head_dim padded to 32 bytes of " << DtypeName(s.dtype)
           << ") exceeds the 255-block repeat stride of the vector unit (" << DtypeName(s.dtype)
           << ": head_dim <= " << MaxHeadDim(s.dtype) << ")";
        return refuse(os.str());
    }
    if (t.group > 255) return refuse("more than 255 query heads per KV head");
    if (uint64_t(s.maxSeqLen) * 4 > 0xffffffffull) return refuse("max_seq_len too large for 32-bit copy strides");
    if (target.ringSlots < 1 || target.ringSlots > 15) return refuse("invalid target: ring slots must be in [1, 15]");

    // Path: the cube path (Q.K^T on the cube cores of a mix kernel) wherever it can run,
    // else the all-vector kernel (docs/ascendc.md, "Which path runs").
    std::string cubeWhy;
    const uint32_t aicUsable = std::min<uint32_t>(target.aicCores, target.aivCores / 2);
    if (target.path == TOPTH_PATH_VECTOR) {
        cubeWhy = "the all-vector path was asked for";
    } else if (s.dtype == TOPTH_DTYPE_FP32) {
        cubeWhy = "float32 inputs (the cube path is built for float16 and bfloat16)";
    } else if (aicUsable == 0) {
        cubeWhy = "the target has no AI core with a cube core and two vector cores";
    } else if (t.kStrideSlot > 65535) {
        cubeWhy = "the key cache's slot stride exceeds the 16-bit row stride of the GM -> L1 (ND2NZ) copy";
    } else {
        cubeWhy = PlanCube(t, target);
    }
    if (!cubeWhy.empty() && target.path == TOPTH_PATH_CUBE) return refuse("the cube path cannot run: " + cubeWhy);
    t.cubePath = cubeWhy.empty() ? 1u : 0u;
    t.ringSlots = t.cubePath ? target.ringSlots : 0;

    why = SplitAndFit(s, target, t, t.cubePath ? 2 * aicUsable : target.aivCores);
    if (!why.empty() && t.cubePath && target.path == TOPTH_PATH_AUTO) {
        // the cube path's unified-buffer plan (score ring tiles) can be the larger one
        cubeWhy = "its unified-buffer plan does not fit (" + why + ")";
        t.cubePath = 0;
        t.ringSlots = 0;
        why = SplitAndFit(s, target, t, target.aivCores);
    }
    if (!why.empty()) return refuse(why);
    if (pathWhy) *pathWhy = t.cubePath ? std::string() : cubeWhy;

    // Workspace (GM scratch).
    const uint64_t G = t.group, PW = t.pairWidth;
    uint64_t off = 0;
    t.wsSyncOff = off;
    if (t.splitCap > 1 && t.syncMode == TOPTH_SYNC_SOFT) off += Up(uint64_t(t.aivCount) * 32, 32);
    t.wsScoresOff = off;
    if (s.placement == TOPTH_POST_SOFTMAX) off += Up(uint64_t(t.numPairs) * G * s.maxSeqLen * 4, 32);
    t.wsStatsOff = off;
    if (s.placement == TOPTH_POST_SOFTMAX && t.splitCap > 1) {
        off += Up(uint64_t(t.numPairs) * t.splitCap * 2 * PW * 4, 32);
    }
    t.wsPartOff = off;
    if (t.splitCap > 1) off += Up(uint64_t(t.numPairs) * t.splitCap * t.partFloats * 4, 32);
    t.wsRingOff = off;  // last, so that the model can name it apart ('score_ring')
    if (t.cubePath) off += Up(uint64_t(t.aivCount) * t.ringSlots * G * TOPTH_TILE_W * 4, 32);
    t.wsBytes = std::max<uint64_t>(off, 32);
    *out = t;
    return true;
}

}  // namespace topth

#endif  // TOPTH_TILING_IMPL_H
