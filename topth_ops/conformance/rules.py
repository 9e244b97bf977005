"""The conformance rules: each checks one rule of docs/semantics.md on one backend and dtype.

A rule is a function of a :class:`Harness`; it builds cases, runs the backend (through
``Backend.forward`` with NaN-poisoned output buffers, or through the public API where
the rule is about the API) and compares with the float64 oracle. Rules are registered in
:data:`RULES` in the order of the semantics document.

This module holds the rules of selection, compensation and special values; the harness and
the registry live in :mod:`.harness` (re-exported here), the API rules in
:mod:`.rules_api`, and the v0.2 rules in ``rules_paged``, ``rules_selection`` and
``rules_inputs``; the package imports them in that order.
"""

from __future__ import annotations

import numpy as np
import torch

from .cases import Case, Shape, random_case
from .compare import exact_report, mismatch_report, to_numpy
from .harness import RULES, CaseGenerationError, Harness, Rule, expect_errors, rule

__all__ = ["RULES", "CaseGenerationError", "Harness", "Rule", "expect_errors", "rule"]


def _random_rule(h: Harness, name: str, **opts) -> None:
    for shape in h.shapes:
        case = random_case(name, shape, h.dtype, seed=h.seed(name, shape.id), **opts)
        h.check(case)


# ----------------------------------------------------------------------------- selection

def _placement_rule(h: Harness, placement: str) -> None:
    for i, shape in enumerate(h.shapes):
        scale = 0.37 if i % 2 else None  # a non-default scale on every other shape
        h.check(random_case(placement, shape, h.dtype, placement=placement, scale=scale,
                            seed=h.seed(placement, shape.id)))


@rule("pre_softmax", "keep a_j > theta, w = exp(a - m) / R; output and stats vs oracle")
def _pre_softmax(h: Harness) -> None:
    _placement_rule(h, "pre_softmax")


@rule("post_softmax", "keep s_j > theta with s = softmax(a), w = s; output and stats vs oracle")
def _post_softmax(h: Harness) -> None:
    _placement_rule(h, "post_softmax")


@rule("sdc_exact", "pre_softmax with E~ = sum of the dropped exp(a_j - m)")
def _sdc_exact(h: Harness) -> None:
    _random_rule(h, "sdc_exact", placement="pre_softmax", sdc="exact")


@rule("sdc_exp_threshold", "pre_softmax with E~ = gamma (n - k~) exp(theta - m), default and custom gamma")
def _sdc_exp(h: Harness) -> None:
    for i, shape in enumerate(h.shapes):
        gamma = 0.05 if i % 2 == 0 else 0.5
        h.check(random_case("sdc_exp_threshold", shape, h.dtype, placement="pre_softmax",
                            sdc="exp_threshold", sdc_gamma=gamma, seed=h.seed("sdcexp", shape.id)))


@rule("sdc_offline", "pre_softmax with E~ = sdc_table[h, row]")
def _sdc_offline(h: Harness) -> None:
    _random_rule(h, "sdc_offline", placement="pre_softmax", sdc="offline")


@rule("vmc_computed_mean", "out += beta * mean of the n valid V rows (value_mean absent)")
def _vmc(h: Harness) -> None:
    for i, shape in enumerate(h.shapes):
        placement = "pre_softmax" if i % 2 else "post_softmax"
        h.check(random_case("vmc_computed_mean", shape, h.dtype, placement=placement, vmc=True,
                            seed=h.seed("vmc", shape.id)))


@rule("vmc_value_mean", "out += beta * value_mean when value_mean is given (the cache mean is not used)")
def _vmc_given(h: Harness) -> None:
    for i, shape in enumerate(h.shapes):
        placement = "pre_softmax" if i % 2 else "post_softmax"
        sdc = "exact" if placement == "pre_softmax" else "none"
        h.check(random_case("vmc_value_mean", shape, h.dtype, placement=placement, sdc=sdc,
                            vmc=True, value_mean=True, seed=h.seed("vmcgiven", shape.id)))


# ------------------------------------------------------------------------- special values

def _sdpa_reference(case: Case) -> np.ndarray:
    """Dense attention over the valid positions with torch's scaled_dot_product_attention
    in float64 (n = 0 gives 0 by the contract)."""
    kw = case.kwargs
    q, k, v = (kw[n].double() for n in ("query", "key_cache", "value_cache"))
    B, Hq, D = q.shape
    group = Hq // k.shape[1]
    scale = kw["scale"] if kw["scale"] is not None else 1.0 / np.sqrt(D)
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b, n in enumerate(kw["seq_lens"].tolist()):
        if n == 0:
            continue
        kk = k[b, :, :n].repeat_interleave(group, dim=0)
        vv = v[b, :, :n].repeat_interleave(group, dim=0)
        out[b] = torch.nn.functional.scaled_dot_product_attention(
            q[b][:, None, :], kk, vv, scale=scale)[:, 0]
    return out.numpy()


@rule("dense_equivalence", "theta = -inf (and post_softmax theta <= 0) equals scaled_dot_product_attention")
def _dense(h: Harness) -> None:
    for i, shape in enumerate(h.shapes):
        for placement, fill in (("pre_softmax", float("-inf")), ("post_softmax", float("-inf")),
                                ("post_softmax", 0.0)):
            case = random_case(f"dense_{placement}_theta{fill}", shape, h.dtype,
                               placement=placement, seed=h.seed("dense", shape.id))
            case.kwargs["thresholds"] = torch.full_like(case.kwargs["thresholds"], fill)
            h.check(case, expected_out=_sdpa_reference(case))


@rule("strict_tie", "a score exactly equal to theta is dropped (strict '>'), exact fp values")
def _tie(h: Harness) -> None:
    D, S = 64, 8
    # pre_softmax: scale 0.5 and q = 2 e_0 make a_j = k_j0 exactly, in every dtype.
    q = torch.zeros(2, 2, D)
    q[:, :, 0] = 2.0
    k = torch.zeros(2, 1, S, D)
    k[:, 0, :, 0] = torch.tensor([-2.0, 1.0, 0.0, 1.0, 3.0, 2.0, 1.0, -1.0])
    v = torch.randn(2, 1, S, D, generator=torch.Generator().manual_seed(7))
    th = torch.empty(2, S)
    th[0] = 1.0   # ties at the three 1.0 scores
    th[1] = 2.0   # tie at 2.0; with n = 6 the 3.0 is kept
    th[1, 4] = 3.0  # n = 5 reads column 4: the maximum itself ties, nothing kept
    lens = torch.tensor([6, 5])
    for sdc in ("none", "exact"):
        kw = dict(query=q.to(h.dtype), key_cache=k.to(h.dtype), value_cache=v.to(h.dtype),
                  seq_lens=lens, thresholds=th, scale=0.5, placement="pre_softmax", sdc=sdc,
                  sdc_gamma=0.05, vmc=False)
        h.check(Case(f"strict_tie_pre_{sdc}", kw), guarded=False)
    # post_softmax: q = 0 gives a uniform row, s_j = 1/n exactly for n a power of two.
    lens = torch.tensor([4, 8])
    th = torch.full((2, S), float("nan"))
    th[0, 3], th[0, 7] = 0.25, 0.125     # theta == s_j: nothing kept
    th[1, 3], th[1, 7] = 0.125, 0.0625   # theta == s_j / 2: everything kept
    kw = dict(query=torch.zeros(2, 2, D, dtype=h.dtype), key_cache=k.to(h.dtype),
              value_cache=v.to(h.dtype), seq_lens=lens, thresholds=th, scale=None,
              placement="post_softmax", sdc="none", sdc_gamma=0.05, vmc=True)
    h.check(Case("strict_tie_post", kw), guarded=False)


@rule("row_id_lookup", "row id n reads column min(n, max_row_id) - 1 of thresholds and sdc_table")
def _row_lookup(h: Harness) -> None:
    shape = Shape((97, 54, 7, 1, 130, 60), 9, 3, 64, 130)
    for placement, sdc in (("pre_softmax", "offline"), ("post_softmax", "none")):
        h.check(random_case(f"row_id_lookup_{placement}", shape, h.dtype, placement=placement,
                            sdc=sdc, max_row_id=60, seed=h.seed("rowid", placement)))


@rule("empty_sequence", "n = 0: output 0 and every stat 0, whatever the options")
def _empty(h: Harness) -> None:
    for shape in (Shape((0, 5, 0), 9, 3, 64, 8), Shape((0, 0), 4, 2, 80, 3)):
        for placement, sdc, vmc, vm in (("pre_softmax", "exp_threshold", True, False),
                                        ("post_softmax", "none", True, True),
                                        ("pre_softmax", "offline", False, False)):
            h.check(random_case(f"empty_{placement}_{sdc}_vmc{vmc}", shape, h.dtype,
                                placement=placement, sdc=sdc, vmc=vmc, value_mean=vm,
                                seed=h.seed("empty", shape.id, placement, sdc)))


@rule("nothing_kept", "no score above theta: output 0 (beta * mu with VMC), never NaN; beta = 1")
def _nothing(h: Harness) -> None:
    shape = h.shapes[1]
    variants = [("pre_softmax", s, vmc, vm) for s in ("none", "exact", "exp_threshold", "offline")
                for vmc, vm in ((False, False), (True, False))]
    variants += [("post_softmax", "none", False, False), ("post_softmax", "none", True, True)]
    for placement, sdc, vmc, vm in variants:
        case = random_case(f"nothing_kept_{placement}_{sdc}_vmc{vmc}", shape, h.dtype,
                           placement=placement, sdc=sdc, vmc=vmc, value_mean=vm,
                           seed=h.seed("nothing", placement, sdc, vmc))
        fill = float("inf") if placement == "pre_softmax" else 1.5
        case.kwargs["thresholds"] = torch.full_like(case.kwargs["thresholds"], fill)
        h.check(case)


@rule("poisoned_outputs", "every output and stat element is written (buffers pre-filled with NaN / -1)")
def _poison(h: Harness) -> None:
    shape = Shape((0, 33, 1, 0, 17), 8, 2, 96, 40)
    case = random_case("poisoned_outputs", shape, h.dtype, placement="post_softmax",
                       seed=h.seed("poison"))
    case.kwargs["thresholds"][:, 16] = 2.0  # n = 17 keeps nothing; n = 0 rows are empty
    res = h.check(case)
    if res is not None:
        out, stats = res
        if torch.isnan(out.float()).any() or (stats.kept < 0).any() or (stats.v_rows < 0).any():
            h.fail(case.name, "an output or stat element was left unwritten (NaN / -1 remains)")


@rule("nan_cache_tail", "positions >= n are never read: NaN, inf or huge tails change nothing")
def _tail(h: Harness) -> None:
    for tail in (float("nan"), float("inf"), 6.0e4):
        for shape in h.shapes[:3]:
            for placement in ("pre_softmax", "post_softmax"):
                h.check(random_case(f"tail{tail}_{placement}", shape, h.dtype, placement=placement,
                                    vmc=True, tail=tail, seed=h.seed("tail", shape.id, placement)))


@rule("nan_propagation", "NaN/+inf scores make that head NaN; NaN in a kept V row reaches the heads keeping it; nothing else changes")
def _nan(h: Harness) -> None:
    shape = Shape((54, 97, 7), 9, 3, 64, 100)

    def inject(q, k, v):
        q[0, 1, 3] = float("nan")             # head (0, 1)
        k[1, 2, 10, 5] = float("nan")          # every head of group 2 in sequence 1
        k[2, 0, 3, 0] = float("inf")          # +inf or -inf score by sign of q[2, h, 0]

    for placement in ("pre_softmax", "post_softmax"):
        h.check(random_case(f"nan_qk_{placement}", shape, h.dtype, placement=placement,
                            mutate=inject, seed=h.seed("nanqk", placement)))
        # NaN in a V row kept by head 0 of group 0 in sequence 1 (its top score).
        case = random_case(f"nan_v_{placement}", shape, h.dtype, placement=placement,
                           keep_range=(0.3, 0.9), seed=h.seed("nanv", placement))
        kw = case.kwargs
        a = (kw["key_cache"][1, 0, :97].double() @ kw["query"][1, 0].double())
        j = int(torch.argmax(a))
        kw["value_cache"][1, 0, j, 2] = float("nan")
        want = case.oracle()
        ignore = np.zeros_like(want.nonfinite)
        ignore[1, 0:3] = ~np.isnan(want.out[1, 0:3, 2])  # same group, row not kept: unspecified
        h.check(case, ignore_heads=ignore)
        # With VMC from the cache, a NaN in any valid V row reaches every head of the group.
        case = random_case(f"nan_v_vmc_{placement}", shape, h.dtype, placement=placement,
                           vmc=True, seed=h.seed("nanvmc", placement))
        case.kwargs["value_cache"][2, 1, 5, 7] = float("nan")
        h.check(case)


NEG_INF_SHAPE = Shape((54, 97, 7, 130), 9, 3, 64, 130)
# (placement, sdc) of the neg_inf_scores cases; VMC on every other one
NEG_INF_VARIANTS = (("pre_softmax", "none"), ("pre_softmax", "exact"), ("pre_softmax", "exp_threshold"),
                    ("pre_softmax", "offline"), ("post_softmax", "none"))


def inject_neg_inf(q, k, v) -> None:
    """-inf scores in NEG_INF_SHAPE's tensors (in place): sequence 0 head 1 and sequence 3 head 8
    score -inf everywhere (a -inf query element meets key elements > 0; the other heads of
    their groups stay finite); sequence 1 rows 4 and 60 score -inf in every head of group 2;
    sequence 2 group 1 scores -inf everywhere in every head (nothing kept)."""
    k[0, 0, :, 1] = k[0, 0, :, 1].abs() + 0.5
    q[0, 1, 1] = float("-inf")
    q[1, 6:9, 2] = q[1, 6:9, 2].abs() + 0.5
    k[1, 2, 4, 2] = k[1, 2, 60, 2] = float("-inf")
    k[2, 1, :, 3] = k[2, 1, :, 3].abs() + 0.5
    q[2, 3:6, 3] = float("-inf")
    k[3, 2, :, 4] = k[3, 2, :, 4].abs() + 0.5
    q[3, 8, 4] = float("-inf")


def neg_inf_case(dtype: torch.dtype, placement: str, sdc: str, selection: str, vmc: bool, seed: int) -> Case:
    """A random call on NEG_INF_SHAPE with inject_neg_inf's -inf scores (guard-banded thresholds)."""
    return random_case(f"neg_inf_{placement}_{sdc}_{selection}", NEG_INF_SHAPE, dtype, placement=placement,
                       sdc=sdc, vmc=vmc, selection=selection, mutate=inject_neg_inf, seed=seed)


def overflow_case(dtype: torch.dtype, sdc: str = "none", vmc: bool = False) -> Case:
    """Group selection, pre_softmax, one KV head of two query heads, 64 positions: head 1 makes
    the group keep rows 0 and 40; head 0's float32 score overflows to -inf at row 0 (weight 0
    there), its maximum (row 1, 100) is dropped and its score at row 40 is -200. So head 0
    returns row 40's V alone, however a backend splits the positions (a split holding only
    row 0 of head 0's kept rows must not set its reference). float32 and bfloat16 inputs only:
    float16 products cannot overflow float32."""
    d, S = 16, 64
    q, k = torch.zeros(1, 2, d), torch.zeros(1, 1, S, d)
    q[0, 0, 0], q[0, 0, 1], q[0, 0, 2] = 1e20, 1.0, 1.0
    q[0, 1, 0], q[0, 1, 3] = -2e-18, 1.0
    k[0, 0, 0, 0] = -1e20                       # row 0: head 0 -1e40 (-inf in float32), head 1 200
    k[0, 0, 1, 1] = 100.0                       # row 1: head 0 100, head 1 0 (dropped)
    k[0, 0, 40, 2], k[0, 0, 40, 3] = -200.0, 200.0  # row 40: head 0 -200, head 1 200
    v = torch.randn(1, 1, S, d, generator=torch.Generator().manual_seed(0))
    kw = dict(query=q.to(dtype), key_cache=k.to(dtype), value_cache=v.to(dtype), seq_lens=torch.tensor([S]),
              thresholds=torch.full((1, 1), 150.0), scale=1.0, placement="pre_softmax", selection="group",
              sdc=sdc, vmc=vmc)
    return Case(f"neg_inf_overflow_{sdc}{'_vmc' if vmc else ''}", kw)


@rule("neg_inf_scores", "a score of -inf has weight 0 and is never kept; a head whose every score is -inf returns 0 (mu with VMC) and changes nothing for the other heads of its group; both placements and selections")
def _neg_inf(h: Harness) -> None:
    for i, (placement, sdc) in enumerate(NEG_INF_VARIANTS):
        for selection in ("head", "group"):
            h.check(neg_inf_case(h.dtype, placement, sdc, selection, vmc=i % 2 == 0,
                                 seed=h.seed("neginf", placement, sdc, selection)))
    if h.dtype != torch.float16:
        for sdc, vmc in (("none", False), ("none", True), ("exact", False)):
            h.check(overflow_case(h.dtype, sdc, vmc))


@rule("batch_independence", "a sequence's result does not depend on the other sequences, max_seq_len or batch order")
def _batch(h: Harness) -> None:
    for shape in h.shapes:
        if len(shape.seq_lens) < 2:
            continue
        case = random_case("batch_independence", shape, h.dtype, placement="pre_softmax",
                           sdc="exp_threshold", vmc=True, seed=h.seed("batch", shape.id))
        full = h.check(case)
        if full is None:
            continue
        out_full, st_full = full
        kw = case.kwargs
        for b, n in enumerate(shape.seq_lens):
            s_b = max(n, 1) + (b % 3)  # a different max_seq_len, sometimes with no tail
            sub = dict(kw)
            sub["query"] = kw["query"][b:b + 1].clone()
            sub["key_cache"] = kw["key_cache"][b:b + 1, :, :s_b].clone()
            sub["value_cache"] = kw["value_cache"][b:b + 1, :, :s_b].clone()
            sub["seq_lens"] = kw["seq_lens"][b:b + 1].clone()
            single = h.check(Case(f"batch_independence[{shape.id}] sequence {b} alone", sub))
            if single is None:
                continue
            rep, _ = mismatch_report(f"sequence {b} alone vs in batch", to_numpy(single[0][0]),
                                     to_numpy(out_full[b]), dims=("h", "d"), **h.tol)
            if rep:
                h.fail(case.name, rep)
            for field_name in ("kept", "v_rows"):
                rep = exact_report(f"stats.{field_name} alone vs in batch",
                                   to_numpy(getattr(single[1], field_name)[0]),
                                   to_numpy(getattr(st_full, field_name)[b]), dims=("h",))
                if rep:
                    h.fail(case.name, rep)
        # reversed batch order
        rev = dict(kw)
        for name in ("query", "key_cache", "value_cache", "seq_lens"):
            rev[name] = kw[name].flip(0).clone()
        res = h.check(Case(f"batch_independence[{shape.id}] reversed", rev))
        if res is not None:
            rep, _ = mismatch_report("reversed batch", to_numpy(res[0].flip(0)),
                                     to_numpy(out_full), **h.tol)
            if rep:
                h.fail(case.name, rep)


@rule("strided_inputs", "non-contiguous query and caches (slices of larger buffers) give the same result")
def _strided(h: Harness) -> None:
    for shape in h.shapes[:3]:
        for placement in ("pre_softmax", "post_softmax"):
            case = random_case(f"strided_{placement}", shape, h.dtype, placement=placement,
                               vmc=True, seed=h.seed("strided", shape.id, placement))
            kw = case.kwargs
            B, Hkv, S, D = kw["key_cache"].shape
            # caches inside a longer, head-interleaved buffer; query inside a wider one
            for name in ("key_cache", "value_cache"):
                big = torch.full((B, S + 5, Hkv, D + 3), float("nan"), dtype=h.dtype)
                big[:, :S, :, :D] = kw[name].transpose(1, 2)
                kw[name] = big[:, :S, :, :D].transpose(1, 2)
            q = kw["query"]
            wide = torch.full((q.shape[0], q.shape[1], D * 2), float("nan"), dtype=h.dtype)
            wide[..., ::2] = q
            kw["query"] = wide[..., ::2]
            assert not kw["key_cache"].is_contiguous() and not kw["query"].is_contiguous()
            h.check(case)
