// pybind11 glue shared by the CPU-model and NPU bindings: problem shape / target from
// Python dicts, and the tiling as a dict (header-only; needs pybind11 and topth_tiling.h).
#ifndef TOPTH_TILING_PY_H
#define TOPTH_TILING_PY_H

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "topth_tiling.h"

namespace topth {
namespace py = pybind11;

template <typename V>
inline V DictGet(const py::dict& d, const char* key, V dflt) {
    if (!d.contains(key) || d[key].is_none()) return dflt;
    return d[key].cast<V>();
}

inline ProblemShape ShapeFromDict(const py::dict& s) {
    ProblemShape p;
    p.batch = s["batch"].cast<uint32_t>();
    p.numQHeads = s["num_q_heads"].cast<uint32_t>();
    p.numKvHeads = s["num_kv_heads"].cast<uint32_t>();
    p.maxSeqLen = s["max_seq_len"].cast<uint32_t>();
    p.headDim = s["head_dim"].cast<uint32_t>();
    p.maxRowId = s["max_row_id"].cast<uint32_t>();
    p.dtype = s["dtype"].cast<uint32_t>();
    p.placement = s["placement"].cast<uint32_t>();
    p.sdc = s["sdc"].cast<uint32_t>();
    p.vmc = s["vmc"].cast<uint32_t>();
    p.scale = s["scale"].cast<float>();
    p.sdcGamma = s["sdc_gamma"].cast<float>();
    p.selection = DictGet<uint32_t>(s, "selection", TOPTH_SELECT_HEAD);
    p.numSets = DictGet<uint32_t>(s, "num_sets", 1);
    p.hasSets = DictGet<uint32_t>(s, "has_sets", 0);
    p.paged = DictGet<uint32_t>(s, "paged", 0);
    p.blockSize = DictGet<uint32_t>(s, "block_size", 0);
    p.numBlocks = DictGet<uint32_t>(s, "num_blocks", 0);
    p.maxBlocksPerSeq = DictGet<uint32_t>(s, "max_blocks_per_seq", 1);
    for (int c = 0; c < 2; ++c) {  // optional (block, kv head, slot) strides of the caches
        const char* key = c == 0 ? "k_strides" : "v_strides";
        if (!s.contains(key) || s[key].is_none()) continue;
        auto st = s[key].cast<std::vector<int64_t>>();
        if (st.size() != 3 || st[0] < 0 || st[1] < 0 || st[2] < 0) {
            throw py::value_error(std::string(key) + " must be 3 non-negative strides (block, kv head, slot)");
        }
        uint64_t* dst = c == 0 ? p.kStrides : p.vStrides;
        for (int i = 0; i < 3; ++i) dst[i] = static_cast<uint64_t>(st[i]);
    }
    return p;
}

inline TargetInfo TargetFromDict(const py::dict& t, TargetInfo x = TargetInfo()) {
    x.name = DictGet<std::string>(t, "name", x.name);
    x.ubBytes = DictGet<uint64_t>(t, "ub_bytes", x.ubBytes);
    x.aivCores = DictGet<uint32_t>(t, "cores", x.aivCores);
    x.minSplitLen = DictGet<uint32_t>(t, "min_split_len", x.minSplitLen);
    x.reserveApiScratch = DictGet<bool>(t, "reserve_api_scratch", x.reserveApiScratch);
    x.mergeGapBytes = DictGet<uint32_t>(t, "merge_gap_bytes", x.mergeGapBytes);
    x.l2Bytes = DictGet<uint64_t>(t, "l2_bytes", x.l2Bytes);
    const std::string sync = DictGet<std::string>(t, "sync", x.syncMode == TOPTH_SYNC_HARD ? "hard" : "soft");
    if (sync != "hard" && sync != "soft") throw py::value_error("target['sync'] must be 'hard' or 'soft'");
    x.syncMode = sync == "hard" ? TOPTH_SYNC_HARD : TOPTH_SYNC_SOFT;
    return x;
}

inline py::dict TilingToDict(const TopthTilingData& t) {
    py::dict d;
#define TOPTH_F(name) d[#name] = t.name
    TOPTH_F(wsSyncOff); TOPTH_F(wsScoresOff); TOPTH_F(wsStatsOff); TOPTH_F(wsPartOff); TOPTH_F(wsBytes);
    TOPTH_F(kStrideBlk); TOPTH_F(kStrideH); TOPTH_F(kStrideSlot); TOPTH_F(vStrideBlk); TOPTH_F(vStrideH);
    TOPTH_F(vStrideSlot); TOPTH_F(kSpan); TOPTH_F(vSpan);
    TOPTH_F(batch); TOPTH_F(numQHeads); TOPTH_F(numKvHeads); TOPTH_F(group); TOPTH_F(maxSeqLen);
    TOPTH_F(headDim); TOPTH_F(headDimPad); TOPTH_F(maxRowId); TOPTH_F(dtype); TOPTH_F(elemBytes);
    TOPTH_F(placement); TOPTH_F(sdc); TOPTH_F(vmc); TOPTH_F(selection);
    TOPTH_F(paged); TOPTH_F(blockSize); TOPTH_F(numBlocks); TOPTH_F(maxBlocksPerSeq);
    TOPTH_F(numSets); TOPTH_F(thHeads); TOPTH_F(hasSets); TOPTH_F(syncMode);
    TOPTH_F(scale); TOPTH_F(sdcGamma);
    TOPTH_F(blockDim); TOPTH_F(splitCap); TOPTH_F(minSplitLen); TOPTH_F(numPairs);
    TOPTH_F(tileK); TOPTH_F(tileV); TOPTH_F(pairWidth); TOPTH_F(partFloats);
    TOPTH_F(ubKIn); TOPTH_F(ubKF32); TOPTH_F(ubProd); TOPTH_F(ubQ); TOPTH_F(ubAcc); TOPTH_F(ubTile);
    TOPTH_F(ubMask); TOPTH_F(ubVIn); TOPTH_F(ubVF32); TOPTH_F(ubWc); TOPTH_F(ubWb); TOPTH_F(ubPair);
    TOPTH_F(ubPairB); TOPTH_F(ubStage); TOPTH_F(ubMu); TOPTH_F(ubCmb); TOPTH_F(ubMAll); TOPTH_F(ubSync);
    TOPTH_F(ubStat); TOPTH_F(ubSIn); TOPTH_F(ubTotal); TOPTH_F(ubLimit); TOPTH_F(mergeGapBytes); TOPTH_F(l2CacheOff);
#undef TOPTH_F
    return d;
}

// The tiling, or ValueError with the reason the shape cannot run.
inline TopthTilingData TilingOrThrow(const ProblemShape& shape, const TargetInfo& target) {
    TopthTilingData t{};
    std::string reason;
    if (!ComputeTiling(shape, target, &t, &reason)) throw py::value_error(reason);
    return t;
}

}  // namespace topth

#endif  // TOPTH_TILING_PY_H
