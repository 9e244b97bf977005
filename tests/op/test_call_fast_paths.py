"""The cheap paths a call takes in the common case give the answers of the general checks.

Per-call cost (docs/cpu.md, "Per-call cost"): a plain CPU tensor skips torch's ``is_fake``
walk, a finite Python float skips the abstract-number checks, option codes come from a
dictionary, and 2-D threshold tables reach the kernel with the strides a 3-D view would have.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

from topth_ops import make_inputs, validation as V
from topth_ops.backends.cpu import _tensor, _tensor_3d
from topth_ops.codes import DType, Placement, Sdc, Selection, VmcMode


def test_values_checkable_plain_fake_and_wrapped():
    t = torch.arange(4)
    assert V.values_checkable(t)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(t)
    assert is_fake(fake) and not V.values_checkable(fake)
    wrapped = torch._to_functional_tensor(t)  # a C++ wrapper of the plain tensor type
    assert type(wrapped) is torch.Tensor and torch._is_functional_tensor(wrapped)
    assert V.values_checkable(wrapped) == (not is_fake(wrapped))
    assert not V.values_checkable(torch.empty(3, device="meta"))


class _ReportsMeta(torch.Tensor):
    """A subclass whose device property says meta while its data is on the CPU."""

    @property
    def device(self):
        return torch.device("meta")


def test_device_checks_ask_subclasses():
    """The shortcut for plain CPU tensors must not answer for a subclass that reports
    another device: it is not checkable on the host and not on the query's device."""
    t = torch.arange(3).as_subclass(_ReportsMeta)
    assert t.is_cpu and not V.on_cpu(t) and not V.values_checkable(t)
    q, k = torch.randn(1, 2, 8), torch.randn(1, 1, 4, 8)
    th = torch.zeros(1, 3).as_subclass(_ReportsMeta)
    with pytest.raises(ValueError, match="thresholds must be on the query's device cpu, got meta"):
        make_inputs(q, k, k, torch.tensor([4]), th)


def test_option_codes_of_unhashable_values():
    """An unhashable value gets the lookup's own error, not the cache's TypeError."""
    with pytest.raises(AttributeError):
        Sdc.of(["exact"])


@pytest.mark.parametrize("positive", [True, False])
@pytest.mark.parametrize("value", [0.5, 0.0, -1.0, math.inf, -math.inf, math.nan, 1e308, 5e-324,
                                   np.float64(2.0), np.float32(0.25), 3, True, np.bool_(True), "1.0", None])
def test_require_real_same_verdict_as_the_rule(value, positive):
    """Expected from the rule (docs: a finite real number, > 0 when positive, else >= 0; bools
    and non-numbers refused), not from the code under test."""
    is_number = isinstance(value, (int, float, np.floating)) and not isinstance(value, (bool, np.bool_))
    if not is_number:
        with pytest.raises(TypeError, match="must be a real number"):
            V.require_real("x", value, positive=positive)
        return
    f = float(value)
    ok = math.isfinite(f) and (f > 0 if positive else f >= 0)
    if ok:
        got = V.require_real("x", value, positive=positive)
        assert type(got) is float and got == f
    else:
        with pytest.raises(ValueError, match="x must be a finite number"):
            V.require_real("x", value, positive=positive)


@pytest.mark.parametrize("code", [DType, Placement, Sdc, Selection, VmcMode])
def test_option_codes_repeat(code):
    for _ in range(2):  # the second lookup comes from the dictionary
        for member in code:
            if code is DType:
                dtype = {"FLOAT16": torch.float16, "BFLOAT16": torch.bfloat16, "FLOAT32": torch.float32}[member.name]
                assert code.of(dtype) is member
            else:
                assert code.of(member.name.lower()) is member
        with pytest.raises(KeyError):
            code.of("no_such_option")


@pytest.mark.parametrize("table", [
    torch.rand(4, 7),                     # contiguous
    torch.rand(7, 4).t(),                 # transposed
    torch.rand(1, 7).expand(4, 7),        # broadcast heads (stride 0)
    torch.rand(4, 14)[:, ::2],            # strided rows
    torch.rand(2, 4, 7),                  # already 3-D
])
def test_threshold_table_strides_as_a_3d_view(table):
    view = table if table.dim() == 3 else table.unsqueeze(0)
    assert _tensor_3d(table) == _tensor(view)
    assert _tensor_3d(None) is None
