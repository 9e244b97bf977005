// pybind11 module topth_ops.npu_kernels._ascendc_cpu: the topth decode-attention Ascend C
// kernel run on the CPU model of the Ascend C API.
//
// No torch headers: tensors travel as (data pointer, byte count) pairs taken from
// torch.Tensor.data_ptr() on the Python side, which keeps every tensor alive during the
// call. The GIL is released while the blocks run.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>
#include <vector>

#include "topth_model/core.h"
#include "topth_tiling_py.h"

namespace py = pybind11;

extern "C" void topth_decode_attn(uint8_t* query, uint8_t* key, uint8_t* value, uint8_t* seqLens, uint8_t* thresholds,
                                  uint8_t* sdcTable, uint8_t* valueMean, uint8_t* out, uint8_t* kept, uint8_t* vRows,
                                  uint8_t* dropped, uint8_t* workspace, uint8_t* tiling);

namespace topth_selftest {
std::vector<std::string> Cases();
void Run(const std::string& name);
}  // namespace topth_selftest

namespace {

py::dict ComputeTilingPy(const py::dict& shape, const py::dict& target) {
    return topth::TilingToDict(topth::TilingOrThrow(topth::ShapeFromDict(shape), topth::TargetFromDict(target)));
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

py::dict RunPy(const py::dict& args, const py::dict& shape, const py::dict& target) {
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
        {"value_mean", false, ""},  {"out", true, ""},         {"kept", true, ""},
        {"v_rows", true, ""},       {"dropped_mass", true, ""},
    };
    Arg a[11];
    for (int i = 0; i < 11; ++i) a[i] = ArgFrom(args, names[i].name);
    std::vector<uint8_t> tilingBytes(sizeof(TopthTilingData));
    std::memcpy(tilingBytes.data(), &t, sizeof(TopthTilingData));
    std::vector<uint8_t> workspace(t.wsBytes, 0);  // zeroed: the SyncAll area must start at 0

    topth_model::Launch launch(static_cast<uint32_t>(tgt.ubBytes), tgt.aivCores);
    for (int i = 0; i < 11; ++i) {
        launch.AddGm(names[i].name, a[i].ptr, a[i].bytes, names[i].writable, names[i].tag);
    }
    launch.AddGm("workspace", workspace.data(), workspace.size(), true, "");
    launch.AddGm("tiling", tilingBytes.data(), tilingBytes.size(), false, "");
    {
        py::gil_scoped_release release;
        launch.Run(t.blockDim, [&] {
            topth_decode_attn(a[0].ptr, a[1].ptr, a[2].ptr, a[3].ptr, a[4].ptr, a[5].ptr, a[6].ptr, a[7].ptr, a[8].ptr,
                              a[9].ptr, a[10].ptr, workspace.data(), tilingBytes.data());
        });
    }
    py::dict report;
    py::dict perBuffer;
    uint64_t kBytes = 0, vBytes = 0, otherIn = 0, outBytes = 0;
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
    report["tiling"] = topth::TilingToDict(t);
    report["target"] = tgt.name;
    return report;
}

}  // namespace

PYBIND11_MODULE(_ascendc_cpu, m) {
    m.doc() =
        "The topth decode-attention Ascend C kernel compiled with g++ against the CPU model of the Ascend C API "
        "(unified-buffer capacity, alignment, queue discipline and pipe synchronisation are checked).";
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
    m.def("run", &RunPy, py::arg("args"), py::arg("shape"), py::arg("target"),
          "Run the kernel on the CPU model. args maps buffer names to (data_ptr, nbytes). Returns the report "
          "(GM->UB bytes per buffer, K and V bytes, UB peak, block count, tiling).");
    m.def("selftest_cases", &topth_selftest::Cases, "Names of the model self-test mini-kernels.");
    m.def("selftest", &topth_selftest::Run, py::arg("name"),
          "Run one deliberately faulty (or, for 'ok', correct) mini-kernel on the model; faults raise ModelError.");
}
