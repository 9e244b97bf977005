// pybind11 module topth_ops.cpu_kernels._topth_cpu: the CPU decode-attention kernel.
//
// No torch headers (torch is not in pip's isolated build environment): tensors travel as
// (data_ptr, strides in elements) taken on the Python side (topth_ops/backends/cpu.py),
// which keeps every tensor alive during the call and has validated shapes, dtypes and
// devices. The GIL is released while the kernel runs.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "calib_hist.h"
#include "kernel.h"
#include "pool.h"
#include "table_check.h"
#include "value_sum.h"

namespace py = pybind11;
using namespace topth_cpu;

namespace {

template <size_t N>
void strides_into(const py::handle& h, int64_t (&dst)[N], const char* name) {
    auto t = h.cast<py::tuple>();
    if (t.size() != N) throw py::value_error(std::string(name) + ": expected " + std::to_string(N) + " strides");
    for (size_t i = 0; i < N; ++i) dst[i] = t[i].cast<int64_t>();
}

// args[name], or None when absent (one dictionary lookup: this runs for every argument of
// every call).
py::handle entry(const py::dict& args, const char* name) {
    PyObject* o = PyDict_GetItemString(args.ptr(), name);  // borrowed; null when absent
    return o ? py::handle(o) : py::handle(Py_None);
}

// args[name] = (data_ptr, (strides...)) or None -> pointer (null for None) and strides.
template <typename T, size_t N>
void tensor_into(const py::dict& args, const char* name, T*& ptr, int64_t (&s)[N]) {
    ptr = nullptr;
    const py::handle h = entry(args, name);
    if (h.is_none()) return;
    auto t = h.cast<py::tuple>();
    ptr = reinterpret_cast<T*>(t[0].cast<uintptr_t>());
    strides_into(t[1], s, name);
}

// scalar-strided 1-D integer tensors: (data_ptr, stride, is_int64) or None
void index_into(const py::dict& args, const char* name, const void*& ptr, int64_t& stride, int32_t& is64) {
    ptr = nullptr;
    const py::handle h = entry(args, name);
    if (h.is_none()) return;
    auto t = h.cast<py::tuple>();
    ptr = reinterpret_cast<const void*>(t[0].cast<uintptr_t>());
    stride = t[1].cast<int64_t>();
    is64 = t[2].cast<bool>() ? 1 : 0;
}

Params params_from(const py::dict& args) {
    Params P;
    auto shape = args["shape"].cast<std::vector<int64_t>>();
    if (shape.size() != 9) throw py::value_error("shape: expected 9 values");
    P.batch = shape[0]; P.num_q_heads = shape[1]; P.num_kv_heads = shape[2]; P.head_dim = shape[3];
    P.block_size = shape[4]; P.num_blocks = shape[5]; P.max_blocks_per_seq = shape[6];
    P.max_row_id = shape[7]; P.num_sets = shape[8];
    for (int64_t v : shape)
        if (v < 1) throw py::value_error("shape values must be >= 1");
    if (P.num_q_heads % P.num_kv_heads) throw py::value_error("num_q_heads must be a multiple of num_kv_heads");
    auto opt = args["options"].cast<std::vector<int64_t>>();
    if (opt.size() != 9) throw py::value_error("options: expected 9 values");
    P.dtype = int32_t(opt[0]); P.placement = int32_t(opt[1]); P.sdc = int32_t(opt[2]); P.vmc = int32_t(opt[3]);
    P.group_selection = int32_t(opt[4]); P.threads = int32_t(opt[5]); P.split_len = opt[6];
    P.use_openmp = int32_t(opt[7]);
    P.kv_packed = int32_t(opt[8]);
    if (P.dtype < kF16 || P.dtype > kF32) throw py::value_error("unknown dtype code");
    P.scale = args["scale"].cast<float>();
    P.sdc_gamma = args["sdc_gamma"].cast<float>();
    tensor_into(args, "query", P.query, P.q_s);
    tensor_into(args, "key_cache", P.key, P.k_s);
    tensor_into(args, "value_cache", P.value, P.v_s);
    tensor_into(args, "block_table", P.block_table, P.bt_s);
    tensor_into(args, "thresholds", P.thresholds, P.th_s);
    tensor_into(args, "sdc_table", P.sdc_table, P.sdc_s);
    tensor_into(args, "value_mean", P.value_mean, P.vm_s);
    tensor_into(args, "out", P.out, P.out_s);
    tensor_into(args, "kept", P.kept, P.kept_s);
    tensor_into(args, "v_rows", P.v_rows, P.vrows_s);
    tensor_into(args, "dropped_mass", P.dropped_mass, P.dm_s);
    index_into(args, "seq_lens", P.seq_lens, P.lens_s, P.seq_lens_i64);
    index_into(args, "threshold_set", P.threshold_set, P.tset_s, P.tset_i64);
    if (!P.query || !P.key || !P.value || !P.seq_lens || !P.thresholds || !P.out)
        throw py::value_error("query, key_cache, value_cache, seq_lens, thresholds and out are required");
    // vLLM's AMX cache: the packed offsets stay inside each block and head's region only for
    // these sizes, with the region contiguous
    if (P.kv_packed && (!P.block_table || P.dtype != kBF16 || P.block_size % 32 || P.head_dim % 32 ||
                        P.k_s[3] != 1 || P.v_s[3] != 1 || P.k_s[2] != P.head_dim || P.v_s[2] != P.head_dim ||
                        (reinterpret_cast<uintptr_t>(P.value) & 3u) || (P.v_s[0] & 1) || (P.v_s[1] & 1)))
        throw py::value_error("kv_packed needs a block table, bfloat16, block_size and head_dim multiples of 32, "
                              "each block and head's region contiguous and the value regions 4-byte aligned");
    if ((P.kept == nullptr) != (P.v_rows == nullptr) || (P.kept == nullptr) != (P.dropped_mass == nullptr))
        throw py::value_error("kept, v_rows and dropped_mass go together");
    if (P.sdc == kSdcOffline && !P.sdc_table) throw py::value_error("sdc='offline' needs sdc_table");
    if (P.vmc == kVmcGiven && !P.value_mean) throw py::value_error("vmc given needs value_mean");
    return P;
}

py::dict decode_py(const py::dict& args, int32_t level) {
    if (level != kLevelAuto && !simd_level_supported(level))
        throw py::value_error(std::string("SIMD level ") + simd_level_name(level) + " is not available here");
    const Params P = params_from(args);
    Counters c;
    {
        py::gil_scoped_release release;
        c = decode(P, level);
    }
    py::dict r;
    r["k_rows"] = c.k_rows;
    r["v_rows"] = c.v_rows;
    r["v_mean_rows"] = c.v_mean_rows;
    r["items"] = c.items;
    r["units"] = c.units;
    r["splits_max"] = c.splits_max;
    r["k_walks"] = c.k_walks;
    r["pv_walks"] = c.pv_walks;
    r["threads"] = c.threads_used;
    r["runtime"] = c.runtime == 2 ? "openmp" : (c.runtime == 1 ? "pool" : "inline");
    r["simd"] = simd_level_name(level == kLevelAuto ? best_simd_level() : level);
    return r;
}

py::list simd_levels() {
    py::list out;
    for (int32_t l : {kLevelAmx, kLevelAvx512Bf16, kLevelAvx512, kLevelAvx2, kLevelGeneric})
        if (simd_level_supported(l)) out.append(simd_level_name(l));
    return out;
}

// float32 values -> raw bits of the output dtype (test hook for the output conversion).
std::vector<uint32_t> convert_out(const std::vector<float>& xs, int32_t dtype) {
    std::vector<uint32_t> r;
    for (float x : xs) r.push_back(dtype == kBF16 ? float_to_bf16(x) : float_to_half(x));
    return r;
}

// PagedValueSum's fast path (value_sum.h): pointers and strides in elements from
// topth_ops/value_sum.py, which keeps the tensors alive and has checked shapes and dtypes.
ValueSumState vsum_state(uintptr_t sum, uintptr_t fill, const std::vector<int64_t>& dims) {
    if (dims.size() != 4) throw py::value_error("dims: expected (num_blocks, block_size, num_kv_heads, head_dim)");
    return {reinterpret_cast<float*>(sum), reinterpret_cast<int64_t*>(fill), dims[0], dims[1], dims[2], dims[3]};
}

RowsView rows_view(uintptr_t data, int32_t dtype, const std::vector<int64_t>& strides) {
    if (strides.size() != 3) throw py::value_error("strides: expected (block, row, head)");
    if (dtype < kF16 || dtype > kF32) throw py::value_error("unknown dtype code");
    return {reinterpret_cast<const void*>(data), dtype, strides[0], strides[1], strides[2]};
}

int32_t vsum_update_py(uintptr_t sum, uintptr_t fill, const std::vector<int64_t>& dims, uintptr_t value,
                       int32_t dtype, const std::vector<int64_t>& value_strides, uintptr_t slots, int64_t slot_stride,
                       bool slots64, int64_t tokens) {
    const ValueSumState S = vsum_state(sum, fill, dims);
    const RowsView V = rows_view(value, dtype, value_strides);
    py::gil_scoped_release release;
    return value_sum_update(S, V, reinterpret_cast<const void*>(slots), slot_stride, slots64, tokens);
}

int32_t vsum_mean_py(uintptr_t sum, uintptr_t fill, const std::vector<int64_t>& dims, uintptr_t table, int64_t bt_s0,
                     int64_t bt_s1, int64_t batch, int64_t max_blocks, uintptr_t lens, int64_t lens_stride, bool lens64,
                     uintptr_t cache, int32_t cache_dtype, const std::vector<int64_t>& cache_strides, uintptr_t out) {
    const ValueSumState S = vsum_state(sum, fill, dims);
    RowsView C{};
    if (cache) C = rows_view(cache, cache_dtype, cache_strides);
    py::gil_scoped_release release;
    return value_sum_mean(S, reinterpret_cast<const int32_t*>(table), bt_s0, bt_s1, batch, max_blocks,
                          reinterpret_cast<const void*>(lens), lens_stride, lens64, cache ? &C : nullptr,
                          reinterpret_cast<float*>(out));
}

// CountAccumulator's histogram update (calib_hist.h): pointers from
// topth_ops/calibration/hist_fast.py, which keeps the tensors alive and has checked them.
// sets: (hist, lo, inv_w) pointers of pre/head, post/head, pre/group, post/group (0 = none).
int32_t calib_hist_py(uintptr_t x, int64_t R, int64_t Hq, int64_t G, int64_t S, int64_t s_row, int64_t s_head,
                      uintptr_t lse, uintptr_t bucket, int64_t num_buckets, int64_t bins,
                      const std::vector<uintptr_t>& sets) {
    if (sets.size() != 12) throw py::value_error("sets: expected 4 x (hist, lo, inv_w)");
    if (G < 1 || Hq % G) throw py::value_error("G must divide Hq");
    CalibHist h[4];
    for (int i = 0; i < 4; ++i)
        h[i] = {reinterpret_cast<int64_t*>(sets[3 * i]), reinterpret_cast<const float*>(sets[3 * i + 1]),
                reinterpret_cast<const float*>(sets[3 * i + 2])};
    py::gil_scoped_release release;
    return calib_hist_add(reinterpret_cast<const float*>(x), R, Hq, G, S, s_row, s_head,
                          reinterpret_cast<const float*>(lse), reinterpret_cast<const int64_t*>(bucket), num_buckets,
                          bins, h[0], h[1], h[2], h[3]);
}

// topth_ops.validation.check_block_table_values on CPU tensors (table_check.h): pointers
// from the caller, which keeps the tensors alive and has checked their dtypes and shapes.
py::tuple check_block_table_py(uintptr_t table, bool table_i64, int64_t s0, int64_t s1, int64_t rows, int64_t cols,
                               uintptr_t lens, bool lens_i64, int64_t lens_s, int64_t block_size, int64_t num_blocks) {
    if (block_size < 1) throw py::value_error("block_size must be >= 1");
    TableCheck r;
    {
        py::gil_scoped_release release;
        r = check_block_table(reinterpret_cast<const void*>(table), table_i64, s0, s1, rows, cols,
                              reinterpret_cast<const void*>(lens), lens_i64, lens_s, block_size, num_blocks);
    }
    return py::make_tuple(r.bad, r.b, r.i);
}

}  // namespace

PYBIND11_MODULE(_topth_cpu, m) {
    m.doc() = "Top-Theta sparse decode attention on the CPU (docs/cpu.md)";
    m.def("decode", &decode_py, py::arg("args"), py::arg("simd_level") = 0,
          "Run one call; args from topth_ops.backends.cpu.kernel_args. Returns the row counters.");
    m.def("simd_levels", &simd_levels, "SIMD levels compiled in and supported by this CPU, best first");
    m.def("amx_unavailable_reason", [] { return std::string(amx_unavailable_reason()); },
          "why the amx level cannot run here ('' when it can)");
    m.def("best_simd_level", [] { return std::string(simd_level_name(best_simd_level())); });
    m.def("l2_bytes", [] { return unit_bytes(); }, "one core's L2 size in bytes as the scheduler plans with it");
    m.def("pool_workers", &pool_workers, "worker threads of the own pool started so far");
    m.def("openmp_runtime", [] { return std::string(openmp_runtime()); },
          "path of the loaded OpenMP runtime the kernel runs on ('' when none, or after fork)");
    m.def("_convert_out", &convert_out, "float32 -> float16 (0) / bfloat16 (1) bits, as the kernel writes them");
    m.def("value_sum_update", &vsum_update_py, "PagedValueSum.update on CPU tensors: 0 done, 1 use the Python path");
    m.def("calib_hist_add", &calib_hist_py, "CountAccumulator's histogram update: 0 done, 1 use the torch path");
    m.def("check_block_table", &check_block_table_py,
          "used block-table entries outside [0, num_blocks): (count, b, i) of the first, (0, -1, -1) if none");
    m.def("value_sum_mean", &vsum_mean_py, "PagedValueSum.mean on CPU tensors: 0 done, 1 use the Python path");
    py::dict codes;
    codes["dtype"] = py::dict(py::arg("float16") = int(kF16), py::arg("bfloat16") = int(kBF16),
                              py::arg("float32") = int(kF32));
    codes["placement"] = py::dict(py::arg("pre_softmax") = int(kPre), py::arg("post_softmax") = int(kPost));
    codes["sdc"] = py::dict(py::arg("none") = int(kSdcNone), py::arg("exact") = int(kSdcExact),
                            py::arg("exp_threshold") = int(kSdcExpThreshold), py::arg("offline") = int(kSdcOffline));
    codes["vmc"] = py::dict(py::arg("off") = int(kVmcOff), py::arg("given") = int(kVmcGiven),
                            py::arg("computed") = int(kVmcComputed));
    m.attr("CODES") = codes;  // params.h, compared with topth_ops/codes.py by the tests
    m.attr("LEVELS") = py::dict(py::arg("auto") = kLevelAuto, py::arg("generic") = kLevelGeneric,
                                py::arg("avx2") = kLevelAvx2, py::arg("avx512") = kLevelAvx512,
                                py::arg("avx512bf16") = kLevelAvx512Bf16, py::arg("amx") = kLevelAmx);
}
