"""One definition of the codes the host passes to the kernels (topth_ops/codes.py), checked
against the values each compiled extension exports from its own headers (``CODES``) and
against the Triton kernels' constants."""

import importlib

import pytest

from topth_ops.codes import DType, Placement, Sdc, Selection, VmcMode


def _names(enum) -> dict:
    return {m.name.lower(): int(m) for m in enum}


PYTHON = {"dtype": _names(DType), "placement": _names(Placement), "sdc": _names(Sdc),
          "selection": _names(Selection), "vmc": _names(VmcMode)}


def _extension(module: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.skip(f"{module} is not built here ({e})")


@pytest.mark.parametrize("module,kinds", [
    ("topth_ops.cpu_kernels._topth_cpu", ("dtype", "placement", "sdc", "vmc")),
    ("topth_ops.npu_kernels._ascendc_cpu", ("dtype", "placement", "sdc", "selection")),
    ("topth_ops.npu_kernels._ascendc_npu", ("dtype", "placement", "sdc", "selection")),
])
def test_extension_codes_equal_the_python_enums(module, kinds):
    ext = _extension(module)
    assert set(ext.CODES) == set(kinds)
    for kind in kinds:
        assert ext.CODES[kind] == PYTHON[kind], kind


def test_triton_sdc_constants_equal_the_python_enum():
    pytest.importorskip("triton", reason="triton is not installed")
    from topth_ops.cuda_kernels import codes as tc

    assert {"none": tc.SDC_NONE.value, "exact": tc.SDC_EXACT.value, "exp_threshold": tc.SDC_EXP_THRESHOLD.value,
            "offline": tc.SDC_OFFLINE.value} == PYTHON["sdc"]


def test_enum_lookups_name_the_contract_values():
    import torch

    assert Placement.of("post_softmax") is Placement.POST_SOFTMAX and Sdc.of("exp_threshold") is Sdc.EXP_THRESHOLD
    assert Selection.of("group") is Selection.GROUP and DType.of(torch.bfloat16) is DType.BFLOAT16
