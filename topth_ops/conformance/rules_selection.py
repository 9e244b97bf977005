"""Conformance rules for group selection and threshold sets (docs/semantics.md)."""

from __future__ import annotations

import torch

from .cases import Case, random_case
from .harness import Harness, rule

_PRE_SDC = ("none", "exact", "exp_threshold", "offline")


@rule("group_selection", "selection='group': one threshold per KV head against the group maximum of logits / probabilities; every head keeps the same rows; compensation per head")
def _group(h: Harness) -> None:
    for i, shape in enumerate(h.shapes):
        placement = "pre_softmax" if i % 2 else "post_softmax"
        sdc = _PRE_SDC[(i // 2) % len(_PRE_SDC)] if placement == "pre_softmax" else "none"
        h.check(random_case("group_selection", shape, h.dtype, placement=placement, sdc=sdc,
                            vmc=i % 3 != 0, selection="group", seed=h.seed("group", shape.id)))


# A head's kept rows far below its own maximum (docs/semantics.md): group selection with
# pre_softmax, B sequences, HKV KV heads of G query heads, head_dim D, S positions.
FAR_SHAPE = (2, 2, 3, 32, 300)
FAR_THETA = 150.0


def far_case(gap: float, dtype: torch.dtype, seed: int = 0, hot: float = 200.0):
    """A group-selection case whose heads 1 and 2 keep only rows far below their own maxima.

    Head 0 of each group scores ``hot`` on about 20 rows (the kept rows: the group maximum
    is above the threshold hot - 50); heads 1 and 2 score about ``gap`` on a few rows that
    the group drops (their own maxima; needs gap + 1 < hot - 50) and within a few units of
    0 on the kept rows (docs/semantics.md, "A head's kept rows far below its own maximum").

    Parameters
    ----------
    gap : float
        Heads 1 and 2's maxima, about this far above their kept scores.
    dtype : torch.dtype
        Of query, key and value (float16, bfloat16 or float32).
    seed : int
        Of the random keys and values.
    hot : float
        Head 0's score on the kept rows.

    Returns
    -------
    tuple
        (query ``[B, HKV * G, D]``, key and value ``[B, HKV, S, D]`` (BNSD), seq_lens ``[B]``
        int64, thresholds ``[HKV, 1]`` float32), with ``B, HKV, G, D, S = FAR_SHAPE``.
    """
    B, HKV, G, D, S = FAR_SHAPE
    gen = torch.Generator().manual_seed(seed)
    q = torch.zeros(B, HKV * G, D)
    for g in range(HKV):
        for h in range(G):
            q[:, g * G + h, h] = 1.0
    k = 0.5 * torch.randn(B, HKV, S, D, generator=gen)
    k[..., :G] = 0.0
    rows = torch.randperm(S, generator=gen)[:20]
    far = torch.randperm(S, generator=gen)[:4]
    far = far[~torch.isin(far, rows)]
    k[:, :, rows, 0] = hot
    k[:, :, rows, 1:G] = torch.randn(B, HKV, len(rows), G - 1, generator=gen)
    k[:, :, far, 1] = gap
    k[:, :, far, 2] = gap + 1.0
    v = torch.randn(B, HKV, S, D, generator=gen)
    lens = torch.tensor([S, S - 17])
    th = torch.full((HKV, 1), hot - (200.0 - FAR_THETA))
    return q.to(dtype), k.to(dtype), v.to(dtype), lens, th


def far_reproducer(dtype: torch.dtype, x: float) -> dict:
    """The reproducer of docs/semantics.md ("A head's kept rows far below its own maximum").

    One sequence, one KV head, two query heads: q0 = e0, q1 = e1 (head_dim 16), K rows
    [200 e0, x e1], V all ones, theta 150, scale 1, pre_softmax, group selection, no SDC.
    The group keeps only row 0, which head 1 scores x below its own maximum; every output
    element is 1.

    Parameters
    ----------
    dtype : torch.dtype
        Of query, key and value (float16, bfloat16 or float32).
    x : float
        Head 1's score on row 1, its maximum (below theta, so that row is dropped).

    Returns
    -------
    dict
        Keyword arguments of :func:`topth_ops.decode_attention`: query ``[1, 2, 16]``, key and
        value caches ``[1, 1, 2, 16]`` (BNSD), seq_lens ``[1]`` int64, thresholds ``[1, 1]``
        float32, and the options above.
    """
    q = torch.zeros(1, 2, 16)
    q[0, 0, 0] = q[0, 1, 1] = 1.0
    k = torch.zeros(1, 1, 2, 16)
    k[0, 0, 0, 0], k[0, 0, 1, 1] = 200.0, x
    v = torch.ones(1, 1, 2, 16)
    return dict(query=q.to(dtype), key_cache=k.to(dtype), value_cache=v.to(dtype),
                seq_lens=torch.tensor([2]), thresholds=torch.full((1, 1), FAR_THETA), scale=1.0,
                placement="pre_softmax", selection="group", sdc="none", vmc=False)


@rule("group_far_below_max", "selection='group', pre_softmax: a head whose kept rows all lie 95-140 below its own maximum (exp(a - m) subnormal or 0 in float32) gets its exact answer, every SDC variant, VMC")
def _far_below_max(h: Harness) -> None:
    _B, HKV, G, _D, _S = FAR_SHAPE
    h.check(Case("group_far_below_max_reproducer", far_reproducer(h.dtype, 120.0)))
    sdcs = [("none", {}), ("exact", {}), ("exp_threshold", {"sdc_gamma": 0.5}),
            ("offline", {"sdc_table": torch.full((HKV * G, 1), 0.3)}), ("exp_threshold", {"sdc_gamma": 0.0}),
            ("offline", {"sdc_table": torch.full((HKV * G, 1), 1.2e-38)})]
    for gap in (95.0, 140.0):
        q, k, v, lens, th = far_case(gap, h.dtype, seed=h.seed("far", gap) % 1000)
        for i, (sdc, extra) in enumerate(sdcs):
            kw = dict(query=q, key_cache=k, value_cache=v, seq_lens=lens, thresholds=th, scale=1.0,
                      placement="pre_softmax", selection="group", sdc=sdc, vmc=i % 2 == 1, **extra)
            h.check(Case(f"group_far_below_max_gap{gap:g}_{sdc}{i}", kw))


@rule("threshold_sets", "3-D thresholds: sequence b reads set threshold_set[b] of thresholds and sdc_table (per head and per group)")
def _sets(h: Harness) -> None:
    for i, shape in enumerate(h.shapes):
        placement = "pre_softmax" if i % 2 == 0 else "post_softmax"
        sdc = "offline" if placement == "pre_softmax" else "none"
        selection = "group" if i % 3 == 1 else "head"
        h.check(random_case("threshold_sets", shape, h.dtype, placement=placement, sdc=sdc,
                            vmc=True, selection=selection, num_sets=2 + i % 3,
                            seed=h.seed("sets", shape.id)))


def _bits(*words: int) -> list:
    return torch.tensor(words, dtype=torch.int32).view(torch.float32).tolist()


# float32 thresholds at the edges of the format, compared exactly as docs/semantics.md
# defines: positive subnormals (smallest, 2^-140, 2^16 x smallest, largest), the smallest
# normal, +-0, a negative subnormal, a small normal, +-largest finite, +-inf, NaN.
EDGE_THRESHOLDS = (*_bits(0x00000001, 0x00000200, 0x00010000, 0x007FFFFF, 0x00800000, 0x00000000, -0x80000000,
                          -0x7FFFFFFF), 1e-30, 3.4028234663852886e38, -3.4028234663852886e38,
                   float("inf"), float("-inf"), float("nan"))
# Scores of the first positions: 1 and 0 (pre_softmax ties at +-0 and +-subnormals), then
# log-probabilities (LSE ~ 1.31) at -85.3, -90.3, ..., -105.3, -121.3: every ln(theta) above
# lies 1.5 or more from each of them, and a threshold clamped up to 1e-38 (ln -87.5) or
# flushed to 0 keeps other positions than theta itself.
_EDGE_SCORES = (1.0, 0.0, -84.0, -89.0, -94.0, -99.0, -104.0, -120.0)


def edge_threshold_case(dtype: torch.dtype, placement: str, selection: str, seed: int):
    """A call whose sequence b reads ``EDGE_THRESHOLDS[b]`` (its row id picks that column);
    scores exactly representable in every dtype (integers, scale 1). Two query heads per
    KV head read their scores in opposite order, so the group maximum differs from each
    head's own."""
    B, Hkv, G, D = len(EDGE_THRESHOLDS), 2, 2, 64
    lens = torch.arange(len(_EDGE_SCORES), len(_EDGE_SCORES) + B)
    S = int(lens.max())
    gen = torch.Generator().manual_seed(seed)
    q = torch.zeros(B, Hkv * G, D)
    q[:, 0::2, 0] = 1.0
    q[:, 1::2, 1] = 1.0
    scores = torch.tensor(_EDGE_SCORES + tuple(-130.0 - j for j in range(S - len(_EDGE_SCORES))))
    k = torch.randn(B, Hkv, S, D, generator=gen).round()
    k[:, :, :, 0] = scores
    k[:, :, :, 1] = scores
    k[:, :, : len(_EDGE_SCORES), 1] = scores[: len(_EDGE_SCORES)].flip(0)
    q[:, :, 2:] = 0.0
    v = torch.randn(B, Hkv, S, D, generator=gen)
    rows = Hkv if selection == "group" else Hkv * G
    th = torch.full((rows, S), float("nan"))  # other columns: NaN, a wrong column keeps nothing
    for b, theta in enumerate(EDGE_THRESHOLDS):
        th[:, int(lens[b]) - 1] = theta
    kw = dict(query=q.to(dtype), key_cache=k.to(dtype), value_cache=v.to(dtype), seq_lens=lens,
              thresholds=th, scale=1.0, placement=placement, sdc="none", sdc_gamma=0.05, vmc=True,
              selection=selection)
    return Case(f"threshold_edges_{placement}_{selection}", kw)


@rule("threshold_edges", "float32 edge thresholds (subnormals, +-0, +-largest finite, +-inf, NaN) compared exactly as defined, both placements and selections")
def _edges(h: Harness) -> None:
    for placement in ("pre_softmax", "post_softmax"):
        for selection in ("head", "group"):
            h.check(edge_threshold_case(h.dtype, placement, selection, h.seed("edges", placement, selection)),
                    guarded=False)
