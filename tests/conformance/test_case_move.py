"""Moving a conformance case to another device keeps every tensor's exact view.

The strided-input rules pass slices, transposes and stride-0 expands; the backend under
test must see the same strides on its device. ``move_strided`` is the path taken for a
non-contiguous tensor on a device other than its own; it is exercised here on the CPU
(and on ``meta``, which checks the layout alone), since it must not depend on the target.
"""
import pytest
import torch

from topth_ops.conformance.cases import move_strided


def _views():
    base = torch.arange(2 * 3 * 5, dtype=torch.float32).reshape(2, 3, 5)
    yield "expand", torch.arange(4, dtype=torch.int32).view(4, 1).expand(4, 6)
    yield "expand_row", torch.tensor([1.5, -2.0, 3.25]).expand(5, 3)
    yield "transpose", base.transpose(0, 2)
    yield "offset_slice", base[1:, 1:, ::2]
    yield "expanded_slice", base[1, 2:].expand(3, -1, -1)
    yield "scalar_stride0", torch.tensor(7.0).expand(3, 2)
    yield "empty", base[:, :0]


@pytest.mark.parametrize("name,t", list(_views()), ids=[n for n, _ in _views()])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_move_keeps_view(name, t, device):
    m = move_strided(t, device)
    assert m.device.type == device
    assert m.shape == t.shape and m.stride() == t.stride()
    assert m.storage_offset() == t.storage_offset()
    assert m.dtype == t.dtype
    if device == "cpu":
        assert torch.equal(m, t)
