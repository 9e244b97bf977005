// pybind11 glue shared by the CPU-model and NPU bindings: problem shape / target from
// Python dicts, and the tiling as a dict (header-only; needs pybind11 and topth_tiling.h).
#ifndef TOPTH_TILING_PY_H
#define TOPTH_TILING_PY_H

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "topth_tiling.h"

namespace topth {
namespace py = pybind11;

template <typename V>
inline V DictGet(const py::dict& d, const char* key, V dflt) {
    if (!d.contains(key)) return dflt;
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
    return p;
}

inline TargetInfo TargetFromDict(const py::dict& t, TargetInfo x = TargetInfo()) {
    x.name = DictGet<std::string>(t, "name", x.name);
    x.ubBytes = DictGet<uint64_t>(t, "ub_bytes", x.ubBytes);
    x.aivCores = DictGet<uint32_t>(t, "cores", x.aivCores);
    x.minSplitLen = DictGet<uint32_t>(t, "min_split_len", x.minSplitLen);
    return x;
}

inline py::dict TilingToDict(const TopthTilingData& t) {
    py::dict d;
#define TOPTH_F(name) d[#name] = t.name
    TOPTH_F(wsSyncOff); TOPTH_F(wsScoresOff); TOPTH_F(wsStatsOff); TOPTH_F(wsPartOff); TOPTH_F(wsBytes);
    TOPTH_F(batch); TOPTH_F(numQHeads); TOPTH_F(numKvHeads); TOPTH_F(group); TOPTH_F(maxSeqLen);
    TOPTH_F(headDim); TOPTH_F(headDimPad); TOPTH_F(maxRowId); TOPTH_F(dtype); TOPTH_F(elemBytes);
    TOPTH_F(placement); TOPTH_F(sdc); TOPTH_F(vmc); TOPTH_F(scale); TOPTH_F(sdcGamma);
    TOPTH_F(blockDim); TOPTH_F(splitNum); TOPTH_F(splitLen); TOPTH_F(numItems); TOPTH_F(numPairs);
    TOPTH_F(tileK); TOPTH_F(tileV); TOPTH_F(pairWidth); TOPTH_F(partFloats);
    TOPTH_F(ubKIn); TOPTH_F(ubKF32); TOPTH_F(ubProd); TOPTH_F(ubQ); TOPTH_F(ubAcc); TOPTH_F(ubTile);
    TOPTH_F(ubMask); TOPTH_F(ubVIn); TOPTH_F(ubVF32); TOPTH_F(ubWc); TOPTH_F(ubWb); TOPTH_F(ubPair);
    TOPTH_F(ubPairB); TOPTH_F(ubStage); TOPTH_F(ubMu); TOPTH_F(ubCmb); TOPTH_F(ubMAll); TOPTH_F(ubSync);
    TOPTH_F(ubStat); TOPTH_F(ubSIn); TOPTH_F(ubTotal);
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
