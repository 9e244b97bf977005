"""Conformance rules about how inputs are read rather than what is computed: strided views
of every small tensor, values that skip the checks (device paths, traces), and the
public API under ``torch.compile``."""

from __future__ import annotations

import torch

from .cases import Case, Shape, paged_case, random_case
from .compare import mismatch_report, to_numpy
from .harness import Harness, rule


def _interleaved(t: torch.Tensor, junk) -> torch.Tensor:
    """A view of ``t``'s values whose last dim has stride 2 (junk in between)."""
    big = torch.empty((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype, device=t.device)
    big[..., 1::2] = junk
    big[..., ::2] = t
    return big[..., ::2]


def _column(t: torch.Tensor, junk) -> torch.Tensor:
    """A 1-D view of ``t``'s values with stride 2 (column 0 of a [n, 2] tensor)."""
    big = torch.empty((t.shape[0], 2), dtype=t.dtype, device=t.device)
    big[:, 0], big[:, 1] = t, junk
    return big[:, 0]


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """The same values in column-major storage (strides reversed)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


@rule("strided_small_inputs", "strided views (slices, transposes, stride-0 expands) of seq_lens, thresholds, sdc_table, value_mean, block_table and threshold_set are read through their strides")
def _strided_small(h: Harness) -> None:
    # seq_lens is column 0 of an int32 [4, 2] tensor (stride 2).
    lens_pairs = torch.tensor([[300, 7], [13, 250], [1, 99], [177, 0]], dtype=torch.int32)
    base = random_case("strided_seq_lens", Shape((300, 13, 1, 177), 8, 2, 64, 300), h.dtype,
                       placement="post_softmax", seed=h.seed("stridedlens"))
    base.kwargs["thresholds"] = torch.full_like(base.kwargs["thresholds"], float("-inf"))
    base.kwargs["seq_lens"] = lens_pairs[:, 0]
    assert base.kwargs["seq_lens"].stride() == (2,)
    h.check(base)

    shapes = (Shape((54, 7, 128), 8, 2, 64, 130), Shape((97, 1, 33, 0), 9, 3, 64, 100))
    # (placement, sdc, selection, threshold sets, paged layout): the first variant uses no
    # optional feature, so every backend reads strided small tensors at least there.
    variants = (("pre_softmax", "offline", "head", None, None),
                ("pre_softmax", "offline", "head", 2, "NHD"),
                ("post_softmax", "none", "group", 2, "HND"))
    for i, shape in enumerate(shapes):
        for placement, sdc, selection, sets, layout in variants:
            case = random_case(f"strided_small_{placement}_{selection}", shape, h.dtype,
                               placement=placement, sdc=sdc, vmc=True, value_mean=True,
                               selection=selection, num_sets=sets,
                               seed=h.seed("stridedsmall", i, placement, layout))
            if layout is not None:
                case = paged_case(case, 16, layout, seed=h.seed("stridedsmall", i))
            kw = case.kwargs
            kw["seq_lens"] = _column(kw["seq_lens"], 7)
            kw["thresholds"] = _interleaved(kw["thresholds"], float("-inf"))
            kw["value_mean"] = _interleaved(kw["value_mean"], float("nan"))
            if sets is not None:
                kw["threshold_set"] = _column(kw["threshold_set"], 1 << 20)
            if layout is not None:
                kw["block_table"] = _transposed(kw["block_table"])
            if sdc == "offline":
                kw["sdc_table"] = _transposed(kw["sdc_table"])
            h.check(Case(case.name + " strided", kw))
    # stride-0 expands: one length and one value_mean row shared by the whole batch
    case = random_case("expanded", Shape((41, 41, 41), 8, 2, 64, 50), h.dtype, placement="pre_softmax",
                       sdc="exact", vmc=True, value_mean=True, seed=h.seed("expanded"))
    kw = case.kwargs
    kw["seq_lens"] = kw["seq_lens"][:1].expand(3)
    kw["value_mean"] = kw["value_mean"][:1].expand(3, -1, -1)
    h.check(Case(case.name, kw))


def _clamped(case: Case, **raw) -> tuple[Case, Case]:
    """(the case with out-of-range values ``raw`` in place, the case as it must behave)."""
    kw = dict(case.kwargs)
    kw.update(raw)
    return Case(case.name + " unchecked", kw), case


@rule("unchecked_values", "where values are not checked (device, trace), seq_lens clamp into [0, max_seq_len] over their dtype's full range (no int32 wrap), threshold_set into [0, num_sets); bad block ids never crash")
def _unchecked(h: Harness) -> None:
    S = 64
    # The clamped lengths [0, S, S, S, S]: thresholds are guarded for them.
    shape = Shape((0, S, S, S, S), 8, 2, 64, S)
    for sets in (None, 2):
        case = random_case("unchecked_lengths", shape, h.dtype, placement="pre_softmax", sdc="exact",
                           vmc=True, num_sets=sets, seed=h.seed("unchecked", sets))
        for lens in (torch.tensor([-(1 << 40), 1 << 40, (1 << 32) + 3, S + 1, 2**31 + 5], dtype=torch.int64),
                     torch.tensor([-5, 2**31 - 1, S + 1, 1 << 30, S], dtype=torch.int32)):
            raw = {"seq_lens": lens}
            if sets is not None:  # set indices below 0 and past num_sets clamp to 0 and 1
                ts = case.kwargs["threshold_set"]
                raw["threshold_set"] = torch.where(ts == 0, -(1 << 20), 7).to(ts.dtype)
            unchecked, want = _clamped(case, **raw)
            res = h.forward(unchecked, check_values=False)
            if res is not None:
                h.check(want, result=res)
    # Used block ids out of range: no crash; the other sequences are exact.
    shape = Shape((40, 33, 17), 8, 2, 64, 48)
    base = random_case("unchecked_blocks", shape, h.dtype, placement="post_softmax", vmc=True,
                       seed=h.seed("uncheckedblocks"))
    case = paged_case(base, 16, "NHD", seed=h.seed("uncheckedblocks"))
    kw = dict(case.kwargs)
    table = kw["block_table"].clone()
    table[0, 0], table[0, 1] = kw["key_cache"].shape[0] + 5, -7
    kw["block_table"] = table
    res = h.forward(Case(case.name + " bad ids", kw), check_values=False)
    if res is not None:
        import numpy as np
        ignore = np.zeros((3, 8), dtype=bool)
        ignore[0] = True
        h.check(case, result=res, ignore_heads=ignore)


@rule("compiled_api", "decode_attention under torch.compile(fullgraph=True, dynamic=True) with changing scale / sdc_gamma equals the oracle")
def _compiled(h: Harness) -> None:
    from ..api import decode_attention

    shape = Shape((33, 7, 0), 8, 2, 64, 40)
    base = random_case("compiled", shape, h.dtype, placement="pre_softmax", sdc="exp_threshold",
                       vmc=True, seed=h.seed("compiled"))
    name = h.backend.name

    def call(q, k, v, lens, th, scale, gamma):
        return decode_attention(q, k, v, lens, th, scale=scale, placement="pre_softmax",
                                sdc="exp_threshold", sdc_gamma=gamma, vmc=True,
                                return_stats=True, backend=name)

    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True, dynamic=True)
    for scale, gamma in ((None, 0.05), (0.125, 0.07), (0.13, 0.5)):
        case = random_case("compiled", shape, h.dtype, placement="pre_softmax", sdc="exp_threshold",
                           sdc_gamma=gamma, scale=scale, vmc=True, seed=h.seed("compiled", scale))
        kw = case.to(h.device).kwargs
        if h.forward(case) is None:
            return
        args = [kw[n] for n in ("query", "key_cache", "value_cache", "seq_lens", "thresholds")]
        out, stats = compiled(*args, scale, gamma)
        h.check(case, result=(out, stats))
        eager = call(*args, scale, gamma)[0]
        rep, _ = mismatch_report("compiled vs eager", to_numpy(out), to_numpy(eager), **h.tol)
        if rep:
            h.fail(case.name, rep)
    del base
