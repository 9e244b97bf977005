// pybind11 module topth_ops.npu_kernels._ascendc_cpu: the topth decode-attention Ascend C
// kernel run on the CPU model of the Ascend C API.
//
// No torch headers: tensors travel as (data pointer, byte count) pairs taken from
// torch.Tensor.data_ptr() on the Python side, which keeps every tensor alive during the
// call. The GIL is released while the blocks run.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "topth_model/core.h"
#include "topth_launch.h"
#include "topth_codes_py.h"
#include "topth_tiling_py.h"

namespace py = pybind11;

// The two entries of the kernel: all-vector (topth_decode_attn.cpp) and the cube path's
// mix kernel (topth_decode_attn_cube.cpp); the tiling says which one runs.
#define TOPTH_ENTRY_ARGS                                                                                     \
    uint8_t *query, uint8_t *key, uint8_t *value, uint8_t *seqLens, uint8_t *thresholds, uint8_t *sdcTable,  \
        uint8_t *valueMean, uint8_t *blockTable, uint8_t *thresholdSet, uint8_t *out, uint8_t *kept,         \
        uint8_t *vRows, uint8_t *dropped, uint8_t *workspace, uint8_t *tiling
extern "C" void topth_decode_attn(TOPTH_ENTRY_ARGS);
extern "C" void topth_decode_attn_cube(TOPTH_ENTRY_ARGS);

namespace topth_selftest {
std::vector<std::string> Cases();
void Run(const std::string& name);
std::vector<float> CubeGemm(uint32_t m, uint32_t n, uint32_t k, const std::vector<uint16_t>& aBits,
                            const std::vector<uint16_t>& bBits);
}  // namespace topth_selftest

namespace {

py::dict ComputeTilingPy(const py::dict& shape, const py::dict& target) {
    return topth::TilingDictWithPath(topth::ShapeFromDict(shape), topth::TargetFromDict(target));
}

struct Arg {
    uint8_t* ptr = nullptr;
    uint64_t bytes = 0;
};

Arg ArgFrom(const py::dict& args, const char* name) {
    Arg a;
    if (!args.contains(name) || args[name].is_none()) return a;
    auto t = args[name].cast<py::tuple>();
    a.ptr = reinterpret_cast<uint8_t*>(t[0].cast<uintptr_t>());
    a.bytes = t[1].cast<uint64_t>();
    return a;
}

// The rows each (sequence, KV head) may read, from the lengths, the block table and the
// strides (the expectation the model checks every K / V read against).
topth_model::RowOwnership Ownership(const TopthTilingData& t, const Arg& lens, const Arg& table,
                                    int64_t lengthDelta = 0) {
    topth_model::RowOwnership o;
    o.enabled = true;
    o.kRowBytes = o.vRowBytes = uint64_t(t.headDim) * t.elemBytes;
    o.numKvHeads = t.numKvHeads;
    o.maxBlocksPerSeq = t.maxBlocksPerSeq;
    o.kRows.resize(uint64_t(t.batch) * t.numKvHeads);
    o.vRows.resize(uint64_t(t.batch) * t.numKvHeads);
    o.usedBlocks.assign(t.batch, 0);
    const auto* len = reinterpret_cast<const int32_t*>(lens.ptr);
    const auto* tab = reinterpret_cast<const int32_t*>(table.ptr);
    for (uint32_t b = 0; b < t.batch; ++b) {
        const int64_t raw = int64_t(len[b]) + lengthDelta;  // lengthDelta: tests of the check itself
        const uint32_t n = raw < 0 ? 0u : (raw > int64_t(t.maxSeqLen) ? t.maxSeqLen : uint32_t(raw));
        o.usedBlocks[b] = (n + t.blockSize - 1) / t.blockSize;
        for (uint32_t h = 0; h < t.numKvHeads; ++h) {
            auto& kr = o.kRows[uint64_t(b) * t.numKvHeads + h];
            auto& vr = o.vRows[uint64_t(b) * t.numKvHeads + h];
            kr.reserve(n);
            vr.reserve(n);
            for (uint32_t j = 0; j < n; ++j) {
                const uint32_t i = j / t.blockSize, slot = j % t.blockSize;
                uint64_t blk = b;
                if (t.paged) {
                    const int32_t e = tab[uint64_t(b) * t.maxBlocksPerSeq + i];
                    blk = e < 0 ? 0 : (uint32_t(e) >= t.numBlocks ? t.numBlocks - 1 : uint32_t(e));
                }
                kr.push_back((blk * t.kStrideBlk + h * t.kStrideH + slot * t.kStrideSlot) * t.elemBytes);
                vr.push_back((blk * t.vStrideBlk + h * t.vStrideH + slot * t.vStrideSlot) * t.elemBytes);
            }
            std::sort(kr.begin(), kr.end());
            std::sort(vr.begin(), vr.end());
        }
    }
    return o;
}

py::dict CountersDict(const topth_model::PipeCounters& c) {
    py::dict d;
    d["mte2_bytes"] = c.mte2Bytes;
    d["mte2_requests"] = c.mte2Requests;
    d["k_bytes"] = c.kBytes;
    d["k_requests"] = c.kRequests;
    d["v_bytes"] = c.vBytes;
    d["v_requests"] = c.vRequests;
    d["mte3_bytes"] = c.mte3Bytes;
    d["mte3_requests"] = c.mte3Requests;
    d["vec_instr"] = c.vecInstr;
    d["vec_repeats"] = c.vecRepeats;
    d["scalar_ub_reads"] = c.scalarUbReads;
    d["scalar_ub_writes"] = c.scalarUbWrites;
    d["scalar_gm_reads"] = c.scalarGmReads;
    d["barriers"] = c.barriers;
    d["flags"] = c.flags;
    d["cube_instr"] = c.cubeInstr;
    d["mmad_instr"] = c.mmadInstr;
    d["mmad_fractals"] = c.mmadFractals;
    d["mte1_bytes"] = c.mte1Bytes;
    d["mte1_requests"] = c.mte1Requests;
    d["fix_bytes"] = c.fixBytes;
    d["fix_requests"] = c.fixRequests;
    d["cross_sets"] = c.crossSets;
    d["cross_waits"] = c.crossWaits;
    d["select_scratch_writes"] = c.selectScratchWrites;
    return d;
}

py::dict RunPy(const py::dict& args, const py::dict& shape, const py::dict& target, const py::dict& launchOpts) {
    const topth::TargetInfo tgt = topth::TargetFromDict(target);
    const TopthTilingData t = topth::TilingOrThrow(topth::ShapeFromDict(shape), tgt);
    struct Named {
        const char* name;
        bool writable;
        const char* tag;
    };
    static const Named names[] = {
        {"query", false, ""},       {"key_cache", false, "K"}, {"value_cache", false, "V"},
        {"seq_lens", false, ""},    {"thresholds", false, ""}, {"sdc_table", false, ""},
        {"value_mean", false, ""},  {"block_table", false, ""}, {"threshold_set", false, ""},
        {"out", true, ""},          {"kept", true, ""},        {"v_rows", true, ""},
        {"dropped_mass", true, ""},
    };
    constexpr int kArgs = 13;
    Arg a[kArgs];
    for (int i = 0; i < kArgs; ++i) a[i] = ArgFrom(args, names[i].name);
    if (t.paged && !a[7].ptr) throw py::value_error("paged caches need the block_table buffer");
    std::vector<uint8_t> tilingBytes(sizeof(TopthTilingData));
    std::memcpy(tilingBytes.data(), &t, sizeof(TopthTilingData));
    // Workspace as the NPU binding hands it over: uninitialised (0xFF here, NaN as float32,
    // so a read of a never-written word shows) except the SyncAll area, zeroed when used.
    std::vector<uint8_t> workspace(t.wsBytes, 0xFF);
    if (t.splitCap > 1 && t.syncMode == TOPTH_SYNC_SOFT) {
        std::memset(workspace.data() + t.wsSyncOff, 0, uint64_t(t.blockDim) * 32);
    }

    topth_model::Launch launch(static_cast<uint32_t>(tgt.ubBytes), tgt.aivCores);
    launch.SetAicCount(tgt.aicCores);
    launch.SetFault(topth::DictGet<std::string>(launchOpts, "fault", ""));
    for (int i = 0; i < kArgs; ++i) {
        launch.AddGm(names[i].name, a[i].ptr, a[i].bytes, names[i].writable, names[i].tag);
    }
    if (topth::DictGet<bool>(launchOpts, "check_rows", true)) launch.SetOwnership(Ownership(t, a[3], a[7]));
    launch.SetResidentBlocks(topth::DictGet<uint32_t>(launchOpts, "resident_blocks", 0));
    launch.SetSchedModeNormal(topth::DictGet<bool>(launchOpts, "sched_mode_normal", false));
    if (topth::DictGet<bool>(launchOpts, "check_rows", true)) {
        const int64_t delta = topth::DictGet<int64_t>(launchOpts, "owned_length_delta", 0);
        if (delta != 0) launch.SetOwnership(Ownership(t, a[3], a[7], delta));
    }
    launch.SetTranscendentalError(topth::DictGet<float>(launchOpts, "transcendental_error", 0.0f));
    // The cube path's score ring is the end of the workspace; the model names it apart so
    // that its traffic is reported on its own ('score_ring').
    const uint64_t ringOff = t.cubePath ? t.wsRingOff : workspace.size();
    launch.AddGm("workspace", workspace.data(), ringOff, true, "");
    if (t.cubePath) launch.AddGm("score_ring", workspace.data() + ringOff, workspace.size() - ringOff, true, "");
    launch.AddGm("tiling", tilingBytes.data(), tilingBytes.size(), false, "");
    {
        py::gil_scoped_release release;
        auto entry = t.cubePath ? &topth_decode_attn_cube : &topth_decode_attn;
        launch.Run(
            t.blockDim,
            [&] {
                entry(a[0].ptr, a[1].ptr, a[2].ptr, a[3].ptr, a[4].ptr, a[5].ptr, a[6].ptr, a[7].ptr, a[8].ptr, a[9].ptr,
                      a[10].ptr, a[11].ptr, a[12].ptr, workspace.data(), tilingBytes.data());
            },
            t.cubePath ? 1 : 0, t.cubePath ? 2 : 1);
    }
    py::dict report;
    py::dict perBuffer;
    uint64_t kBytes = 0, vBytes = 0, otherIn = 0, outBytes = 0;
    for (const char* name : {"workspace", "score_ring"}) {  // reported even when empty
        py::dict e;
        e["gm_to_ub_bytes"] = 0;
        e["ub_to_gm_bytes"] = 0;
        e["gm_to_ub_copies"] = 0;
        perBuffer[name] = e;
    }
    for (const auto& b : launch.Buffers()) {
        py::dict e;
        e["gm_to_ub_bytes"] = b.bytesToUb;
        e["ub_to_gm_bytes"] = b.bytesFromUb;
        e["gm_to_ub_copies"] = b.copiesToUb;
        perBuffer[py::str(b.name)] = e;
        if (b.tag == "K") kBytes += b.bytesToUb;
        else if (b.tag == "V") vBytes += b.bytesToUb;
        else otherIn += b.bytesToUb;
        outBytes += b.bytesFromUb;
    }
    report["k_bytes"] = kBytes;
    report["v_bytes"] = vBytes;
    report["other_gm_to_ub_bytes"] = otherIn;
    report["ub_to_gm_bytes"] = outBytes;
    report["buffers"] = perBuffer;
    report["ub_peak"] = launch.Report().ubPeak;
    report["ub_capacity"] = tgt.ubBytes;
    report["block_dim"] = launch.Report().blockDim;
    report["sync_all_calls"] = launch.Report().syncAllCalls;
    report["kernel_type"] = launch.Report().kernelType;
    report["cube_path"] = static_cast<bool>(t.cubePath);
    report["batch_mode"] = launch.BatchMode();
    // per_block: the counters of every core (AIVs and, in a mix launch, AICs), with its
    // type ("aiv" / "aic"), block (AI core) and sub-block index
    py::list perBlock;
    topth_model::PipeCounters total, aic, aiv;
    for (const auto& c : launch.Report().perCore) {
        py::dict d = CountersDict(c.cnt);
        d["core"] = c.type == topth_model::CoreType::AIC ? "aic" : "aiv";
        d["block"] = c.block;
        d["sub"] = c.sub;
        perBlock.append(d);
        total.Add(c.cnt);
        (c.type == topth_model::CoreType::AIC ? aic : aiv).Add(c.cnt);
    }
    report["per_block"] = perBlock;
    report["counters_aic"] = CountersDict(aic);
    report["counters_aiv"] = CountersDict(aiv);
    report["l1_peak"] = launch.Report().l1Peak;
    report["l0a_peak"] = launch.Report().l0aPeak;
    report["l0b_peak"] = launch.Report().l0bPeak;
    report["l0c_peak"] = launch.Report().l0cPeak;
    report["counters"] = CountersDict(total);
    report["tiling"] = topth::TilingDictWithPath(topth::ShapeFromDict(shape), tgt);
    report["target"] = tgt.name;
    return report;
}

// topth::GuardedLaunch (the NPU binding's launch path) driven by a fake runtime: device 0
// current, tensors on `tensorDevice`; `brokenGuard`: SetDevice has no effect; `nullStream`;
// `rc`: what the launch returns. Returns the runtime's event log and the error, if any.
py::dict LaunchSelftest(int tensorDevice, bool brokenGuard, bool nullStream, uint32_t rc) {
    struct FakeRuntime {
        int current = 0;
        bool broken = false, nullStream = false;
        std::vector<std::string> log;
        int CurrentDevice() { return current; }
        void SetDevice(int d) {
            log.push_back("set_device " + std::to_string(d));
            if (!broken) current = d;
        }
        void RestoreDevice(int d) {
            log.push_back("restore_device " + std::to_string(d));
            current = d;
        }
        void* CurrentStream(int d) {
            log.push_back("stream " + std::to_string(d) + " (current " + std::to_string(current) + ")");
            static int token = 0;
            return nullStream ? nullptr : &token;
        }
    } rt;
    rt.broken = brokenGuard;
    rt.nullStream = nullStream;
    std::string error;
    try {
        topth::GuardedLaunch(rt, tensorDevice, "topth_decode_attn", [&](void* stream) -> uint32_t {
            rt.log.push_back(std::string("launch on device ") + std::to_string(rt.current) +
                             (stream ? " with a stream" : " with a null stream"));
            return rc;
        });
    } catch (const topth::LaunchError& e) {
        error = e.what();
    }
    py::dict d;
    d["log"] = rt.log;
    d["error"] = error;
    d["device_after"] = rt.current;
    return d;
}

}  // namespace

PYBIND11_MODULE(_ascendc_cpu, m) {
    m.doc() =
        "The topth decode-attention Ascend C kernel compiled with g++ against the CPU model of the Ascend C API "
        "(unified-buffer capacity, alignment, queue discipline and pipe synchronisation are checked).";
    m.attr("CODES") = topth::CodesDict();
    static py::exception<topth_model::ModelError> modelError(m, "ModelError", PyExc_RuntimeError);
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const topth_model::ModelError& e) {
            py::set_error(modelError, e.what());
        }
    });
    m.attr("TILE_W") = TOPTH_TILE_W;
    m.attr("TILING_BYTES") = sizeof(TopthTilingData);
    m.def("compute_tiling", &ComputeTilingPy, py::arg("shape"), py::arg("target"),
          "Tiling for a problem shape on a target; raises ValueError with the reason when it does not fit.");
    m.def("run", &RunPy, py::arg("args"), py::arg("shape"), py::arg("target"), py::arg("launch") = py::dict(),
          "Run the kernel on the CPU model. args maps buffer names to (data_ptr, nbytes); launch: check_rows "
          "(bool, default true), resident_blocks (int, 0 = all), transcendental_error (float). Returns the report "
          "(GM->UB bytes per buffer, K and V bytes, per-block pipe counters, UB peak, block count, tiling).");
    m.def("selftest_cases", &topth_selftest::Cases, "Names of the model self-test mini-kernels.");
    m.def("launch_selftest", &LaunchSelftest, py::arg("tensor_device"), py::arg("broken_guard") = false,
          py::arg("null_stream") = false, py::arg("rc") = 0,
          "Drive the NPU binding's launch path (topth_launch.h) with a fake runtime; returns log and error.");
    m.def(
        "cube_gemm",
        [](uint32_t mm, uint32_t n, uint32_t k, const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
            if (a.size() != uint64_t(mm) * k || b.size() != uint64_t(n) * k) throw py::value_error("a is m x k, b is n x k");
            py::gil_scoped_release release;
            return topth_selftest::CubeGemm(mm, n, k, a, b);
        },
        py::arg("m"), py::arg("n"), py::arg("k"), py::arg("a_bits"), py::arg("b_bits"),
        "A (m x k) . B (n x k)^T through the model's cube core as the kernel computes scores (float16 bit "
        "patterns in, float32 out, m rows of n rounded up to 16).");
    m.def("selftest", &topth_selftest::Run, py::arg("name"),
          "Run one deliberately faulty (or, for 'ok', correct) mini-kernel on the model; faults raise ModelError.");
}
