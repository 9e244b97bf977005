// The host codes of topth_tiling_data.h as a Python dict (CODES of both Ascend C
// extensions): tests/backends compare them with topth_ops/codes.py.
#ifndef TOPTH_CODES_PY_H
#define TOPTH_CODES_PY_H

#include <pybind11/pybind11.h>

#include "topth_tiling_data.h"

namespace topth {

inline pybind11::dict CodesDict()
{
    namespace py = pybind11;
    py::dict d;
    d["dtype"] = py::dict(py::arg("float16") = TOPTH_DTYPE_FP16, py::arg("bfloat16") = TOPTH_DTYPE_BF16,
                          py::arg("float32") = TOPTH_DTYPE_FP32);
    d["placement"] = py::dict(py::arg("pre_softmax") = TOPTH_PRE_SOFTMAX, py::arg("post_softmax") = TOPTH_POST_SOFTMAX);
    d["sdc"] = py::dict(py::arg("none") = TOPTH_SDC_NONE, py::arg("exact") = TOPTH_SDC_EXACT,
                        py::arg("exp_threshold") = TOPTH_SDC_EXP_THRESHOLD, py::arg("offline") = TOPTH_SDC_OFFLINE);
    d["selection"] = py::dict(py::arg("head") = TOPTH_SELECT_HEAD, py::arg("group") = TOPTH_SELECT_GROUP);
    return d;
}

}  // namespace topth

#endif
