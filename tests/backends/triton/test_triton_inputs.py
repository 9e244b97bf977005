"""Issue 9 (items 1-2) on the Triton kernels: every small tensor is read through its strides,
and values that are not checked on a GPU are clamped in their own dtype's full range.

Each test builds the strided (or out-of-range) input so that ignoring its stride (or
wrapping through int32 before the clamp) reads other, deliberately different values; the
expected result is the float64 oracle (topth_ops.conformance.oracle) on contiguous,
in-range copies, never a backend's output. Runs in Triton's CPU interpreter without a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import topth_ops  # noqa: E402
from topth_ops.conformance.cases import Shape, paged_case, random_case  # noqa: E402
from topth_ops.conformance.oracle import oracle_decode  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def strided(t: torch.Tensor, garbage) -> torch.Tensor:
    """A view of ``t``'s values with every stride doubled (the last dim interleaved with
    ``garbage``): reading it as contiguous memory gives the garbage values."""
    pair = torch.stack([t, torch.full_like(t, garbage)], dim=-1)  # [..., 2]
    flat = pair.reshape(*t.shape[:-1], 2 * t.shape[-1])
    view = flat[..., ::2]
    torch.testing.assert_close(view, t, rtol=0, atol=0, equal_nan=True)
    assert not view.is_contiguous()
    return view


def contiguous(kw: dict) -> dict:
    return {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


def test_issue9_strided_seq_lens_public_api(check, dev):
    """The report's input: seq_lens = column 0 of an int32 [4, 2] tensor (stride 2)."""
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, D, S = 4, 8, 2, 64, 300
    q, k, v = torch.randn(B, Hq, D, generator=g), torch.randn(B, Hkv, S, D, generator=g), torch.randn(
        B, Hkv, S, D, generator=g)
    lens = torch.tensor([[300, 7], [13, 250], [1, 99], [177, 0]], dtype=torch.int32)[:, 0]
    assert lens.stride() == (2,)
    th = torch.full((Hq, S), float("-inf"))
    for placement in ("pre_softmax", "post_softmax"):
        out, st = topth_ops.decode_attention(q.to(dev), k.to(dev), v.to(dev), lens.to(dev) if dev.type != "cpu" else lens,
                                             th.to(dev), placement=placement, return_stats=True, backend="triton")
        assert st.kept[:, 0].tolist() == [300, 13, 1, 177]
        ref = oracle_decode(q, k, v, lens.contiguous(), th, placement=placement)
        check((out, st), ref, torch.float32)


@pytest.mark.parametrize("placement,selection,sdc", [("pre_softmax", "head", "offline"),
                                                     ("post_softmax", "group", "none"),
                                                     ("pre_softmax", "group", "exp_threshold")])
def test_every_small_tensor_strided(placement, selection, sdc, check, launch):
    """seq_lens, thresholds (3-D, sets), threshold_set, sdc_table, value_mean and the block
    table all as strided views over garbage; stats written through strides too."""
    shape = Shape((37, 0, 64), 8, 2, 64, 64)
    case = random_case("strided", shape, torch.float32, placement=placement, sdc=sdc, vmc=True,
                       value_mean=True, selection=selection, num_sets=2, seed=3)
    case = paged_case(case, 16, "HND", seed=4)
    kw = dict(case.kwargs)
    ref = oracle_decode(**contiguous(kw))
    kw["seq_lens"] = strided(kw["seq_lens"].to(torch.int64), 10**6)
    kw["threshold_set"] = strided(kw["threshold_set"].to(torch.int32), 7)
    kw["thresholds"] = strided(kw["thresholds"], float("nan"))
    kw["value_mean"] = strided(kw["value_mean"], float("nan"))
    kw["block_table"] = strided(kw["block_table"], -1)
    if sdc == "offline":
        kw["sdc_table"] = strided(kw["sdc_table"], float("nan"))
    check(launch(kw), ref, torch.float32)


def test_expanded_thresholds_stride0(check, launch):
    """thresholds expanded from one row (head stride 0) and a 0-stride value_mean."""
    shape = Shape((50, 21), 4, 1, 64, 50)
    case = random_case("expand", shape, torch.float32, placement="pre_softmax", vmc=True, seed=5)
    kw = dict(case.kwargs)
    kw["thresholds"] = torch.full((1, 50), 0.3).expand(4, 50)
    kw["value_mean"] = torch.randn(1, 1, 64).expand(2, 1, 64)
    ref = oracle_decode(**contiguous(kw))
    assert 0 < ref.kept.sum() < ref.kept.size * 20
    check(launch(kw), ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_lengths_clamped_in_full_dtype_range(dtype, check, launch):
    """Unchecked seq_lens clamp into [0, max_seq_len] in their own dtype: 1 << 40 and
    2**32 + 5 (which an int32 cast would turn into 0 and 5) give max_seq_len."""
    S = 40
    shape = Shape((40, 40, 40, 7), 4, 2, 64, S)
    case = random_case("range", shape, torch.float32, placement="post_softmax", tail=None, seed=6)
    kw = dict(case.kwargs)
    if dtype == torch.int64:
        raw = torch.tensor([1 << 40, -(1 << 40), 2**32 + 5, 7], dtype=torch.int64)
    else:
        raw = torch.tensor([2**31 - 1, -(2**31), 41, 7], dtype=torch.int32)
    want = torch.tensor([S, 0, S, 7])
    kw["thresholds"] = torch.full((4, S), 0.02)
    ref = oracle_decode(**dict(kw, seq_lens=want))
    kw["seq_lens"] = raw
    check(launch(kw), ref, torch.float32)


def _swap_blocks(kw: dict, a: int, b: int) -> None:
    """Exchange pool blocks a and b (NHD caches) and the table entries naming them."""
    for name in ("key_cache", "value_cache"):
        c = kw[name].clone()
        c[[a, b]] = c[[b, a]]
        kw[name] = c
    bt = kw["block_table"].clone()
    ia, ib = bt == a, bt == b
    bt[ia], bt[ib] = b, a
    kw["block_table"] = bt


def test_set_index_and_table_entries_clamped(launch, check):
    """threshold_set outside [0, num_sets) clamps (in int64: 1 << 40 is not 0); used block
    table entries outside [0, num_blocks) clamp into range (no read out of bounds);
    unused entries (2**31 - 1) are never read. The pool is arranged so that the clamped
    entries name the right blocks: the result must equal the in-range call's."""
    shape = Shape((33, 20), 4, 2, 64, 48)
    case = random_case("clamp", shape, torch.float32, placement="pre_softmax", selection="group",
                       num_sets=3, seed=7)
    sets_ok = case.kwargs["threshold_set"]
    case = paged_case(case, 16, "NHD", seed=8, spare_blocks=2)
    kw = dict(case.kwargs)
    nb = kw["key_cache"].shape[0]
    _swap_blocks(kw, int(kw["block_table"][0, 0]), 0)
    _swap_blocks(kw, int(kw["block_table"][0, 1]), nb - 1)
    ref = oracle_decode(**kw)
    bt = kw["block_table"].clone()
    assert bt[0, 0] == 0 and bt[0, 1] == nb - 1
    bt[0, 0], bt[0, 1] = -5, 1 << 30
    bt[:, 3:] = 2**31 - 1  # past every sequence's blocks
    # the clamped set indices (2 and 0) must find the thresholds the sequences used
    th = kw["thresholds"]
    th_new = torch.full_like(th, float("nan"))
    th_new[2, :, 32] = th[int(sets_ok[0]), :, 32]
    th_new[0, :, 19] = th[int(sets_ok[1]), :, 19]
    assert ref.kept.sum() > 0
    sets = torch.tensor([1 << 40, -3], dtype=torch.int64)
    res = launch(dict(kw, block_table=bt, threshold_set=sets, thresholds=th_new))
    check(res, ref, torch.float32)
