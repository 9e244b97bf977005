"""The conformance rules: each checks one rule of docs/semantics.md on one backend and dtype.

A rule is a function of a :class:`Harness`; it builds cases, runs the backend (through
``Backend.forward`` with NaN-poisoned output buffers, or through the public API where
the rule is about the API) and compares with the float64 oracle. Rules are registered in
:data:`RULES` in the order of the semantics document.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from ..contract import make_inputs
from ..registry import ENV_BACKEND, Backend
from .cases import MIN_GUARD, SHAPE_SETS, Case, Shape, random_case, seed_of
from .compare import TOLERANCES, exact_report, mismatch_report, to_numpy


class CaseGenerationError(RuntimeError):
    """A generated case broke its own guard band: a bug of the suite, not of the backend."""


@dataclass
class Harness:
    """Runs cases of one rule on one backend, device and dtype, and collects the verdict."""

    backend: Backend
    device: torch.device
    dtype: torch.dtype
    shape_set: str = "full"
    cases: int = 0
    unsupported: list = field(default_factory=list)
    failures: list = field(default_factory=list)
    worst: float = 0.0

    @property
    def shapes(self) -> list[Shape]:
        return SHAPE_SETS[self.shape_set]

    @property
    def tol(self) -> dict:
        return TOLERANCES[self.dtype]

    def seed(self, *parts) -> int:
        return seed_of(self.backend.name, str(self.dtype), *parts)

    def fail(self, case: str, msg: str) -> None:
        self.failures.append(f"{case}: {msg}")

    def forward(self, case: Case, *, poison: bool = True, check_values: bool = True):
        """Run the backend directly on ``case`` (moved to the device), outputs pre-filled with
        NaN (and -1 for integer stats). Returns (out, stats) or None when the backend
        declares the inputs unsupported (recorded with its reasons). ``check_values=False``
        skips the value checks, as on an accelerator or under a trace."""
        kw = case.to(self.device).kwargs
        inputs = make_inputs(**kw, return_stats=True, check_values=check_values)
        reasons = self.backend.not_supported_reasons(inputs)
        if reasons:
            self.unsupported.append(f"{case.name}: {'; '.join(reasons)}")
            return None
        out, stats = inputs.empty_outputs(fill=float("nan") if poison else None)
        self.backend.forward(inputs, out, stats)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return out, stats

    def check(self, case: Case, *, ignore_heads: Optional[np.ndarray] = None,
              expected_out: Optional[np.ndarray] = None, result=None,
              guarded: bool = True) -> Optional[tuple]:
        """Run ``case`` and compare output and stats with the oracle.

        ``ignore_heads`` ``[batch, num_q_heads]`` marks heads whose output the contract
        leaves unspecified; ``expected_out`` replaces the oracle's output (e.g. SDPA).
        ``guarded=False`` skips the guard-band check (for cases built from exactly
        representable values, such as ties). Returns the backend's (out, stats), or None
        if unsupported.
        """
        res = result if result is not None else self.forward(case)
        if res is None:
            return None
        out, stats = res
        want = case.oracle()
        compared = ~want.nonfinite
        if ignore_heads is not None:
            compared &= ~ignore_heads
        if guarded and np.any(want.margin[compared] < MIN_GUARD):
            raise CaseGenerationError(f"{case.name}: a score lies within the guard band of its threshold")
        self.cases += 1
        ign = None if ignore_heads is None else ignore_heads[:, :, None]
        ref = want.out if expected_out is None else expected_out
        rep, worst = mismatch_report("out", to_numpy(out), ref, ignore=ign, **self.tol)
        self.worst = max(self.worst, worst)
        problems = [rep]
        unspecified = want.nonfinite if ignore_heads is None else (want.nonfinite | ignore_heads)
        problems.append(exact_report("stats.kept", to_numpy(stats.kept), want.kept, ignore=unspecified))
        B, Hq = want.kept.shape
        Hkv = want.v_rows.shape[1]
        group_bad = unspecified.reshape(B, Hkv, Hq // Hkv).any(axis=2)
        problems.append(exact_report("stats.v_rows", to_numpy(stats.v_rows), want.v_rows,
                                     dims=("b", "kv_head"), ignore=group_bad))
        rep, _ = mismatch_report("stats.dropped_mass", to_numpy(stats.dropped_mass),
                                 want.dropped_mass, dims=("b", "h"), ignore=unspecified,
                                 **TOLERANCES["stats"])
        problems.append(rep)
        for p in problems:
            if p:
                self.fail(case.name, p)
        return res


@dataclass(frozen=True)
class Rule:
    """One rule of the contract: a name, the sentence it checks, and its check."""

    name: str
    description: str
    fn: Callable[[Harness], None]


RULES: dict[str, Rule] = {}


def rule(name: str, description: str):
    def deco(fn):
        RULES[name] = Rule(name, description, fn)
        return fn
    return deco


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


# ------------------------------------------------------------------------------ the API

@contextmanager
def _spy(backend: Backend):
    """Count calls of ``backend.forward`` (instance attribute shadowing the method)."""
    calls = []
    original = backend.forward

    def forward(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    backend.forward = forward
    try:
        yield calls
    finally:
        del backend.forward


@contextmanager
def _env(name: str, value: Optional[str]):
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _valid_kwargs(h: Harness) -> dict:
    shape = Shape((5, 9, 0), 9, 3, 64, 12)
    case = random_case("errors", shape, h.dtype, placement="pre_softmax",
                       seed=h.seed("errors")).to(h.device)
    return case.kwargs


def _error_cases(kw: dict, h: Harness) -> list:
    q, k, v, lens, th = (kw[n] for n in ("query", "key_cache", "value_cache", "seq_lens", "thresholds"))
    other = torch.float16 if h.dtype == torch.float32 else torch.float32
    table = torch.zeros_like(th)
    vm = torch.zeros(q.shape[0], k.shape[1], q.shape[2], device=q.device)
    cases = [
        ("query not a tensor", dict(query=q.tolist()), TypeError, "query"),
        ("query of rank 2", dict(query=q[:, 0]), ValueError, "query"),
        ("key_cache of rank 3", dict(key_cache=k[0]), ValueError, "key_cache"),
        ("value_cache shape differs", dict(value_cache=v[:, :, :-1]), ValueError, "value_cache"),
        ("head_dim mismatch", dict(key_cache=k[..., :-1], value_cache=v[..., :-1]), ValueError, "head_dim"),
        ("num_q_heads not a multiple of num_kv_heads",
         dict(query=q[:, :8], thresholds=th[:8]), ValueError, "num_q_heads"),
        ("batch mismatch", dict(key_cache=k[:2], value_cache=v[:2]), ValueError, "batch"),
        ("mixed dtypes", dict(key_cache=k.to(other)), TypeError, "key_cache"),
        ("float64 inputs", dict(query=q.double(), key_cache=k.double(), value_cache=v.double()),
         TypeError, "query"),
        ("mixed devices", dict(key_cache=k.to("meta")), ValueError, "key_cache"),
        ("seq_lens not integer", dict(seq_lens=lens.float()), TypeError, "seq_lens"),
        ("seq_lens shape", dict(seq_lens=lens[:-1]), ValueError, "seq_lens"),
        ("thresholds shape", dict(thresholds=th[:-1]), ValueError, "thresholds"),
        ("thresholds rank", dict(thresholds=th[0]), ValueError, "thresholds"),
        ("thresholds dtype", dict(thresholds=th.half()), TypeError, "thresholds"),
        ("unknown placement", dict(placement="pre"), ValueError, "placement"),
        ("unknown sdc", dict(sdc="approx"), ValueError, "sdc"),
        ("sdc with post_softmax", dict(placement="post_softmax", sdc="exact"), ValueError, "sdc"),
        ("offline sdc without sdc_table", dict(sdc="offline"), ValueError, "sdc_table"),
        ("sdc_table shape", dict(sdc="offline", sdc_table=table[:, :-1]), ValueError, "sdc_table"),
        ("sdc_table without offline sdc", dict(sdc_table=table), ValueError, "sdc_table"),
        ("value_mean without vmc", dict(value_mean=vm), ValueError, "value_mean"),
        ("value_mean shape", dict(vmc=True, value_mean=vm[:, :, :-1]), ValueError, "value_mean"),
        ("value_mean dtype", dict(vmc=True, value_mean=vm.half()), TypeError, "value_mean"),
        ("scale zero", dict(scale=0.0), ValueError, "scale"),
        ("scale NaN", dict(scale=float("nan")), ValueError, "scale"),
        ("scale not a number", dict(scale="0.1"), TypeError, "scale"),
        ("scale too large for a float", dict(scale=10 ** 400), ValueError, "scale"),
        ("scale a bool", dict(scale=True), TypeError, "scale"),
        ("sdc_gamma negative", dict(sdc="exp_threshold", sdc_gamma=-0.1), ValueError, "sdc_gamma"),
        ("sdc_gamma without exp_threshold", dict(sdc="exact", sdc_gamma=0.5), ValueError, "sdc_gamma"),
        ("return_stats not a bool", dict(return_stats="yes"), TypeError, "return_stats"),
        ("vmc not a bool", dict(vmc=1), TypeError, "vmc"),
        ("unknown backend", dict(backend="no-such-backend"), ValueError, "backend"),
    ]
    if lens.device.type == "cpu":  # value checks need no device sync only on the CPU
        big = lens.clone()
        big[0] = k.shape[2] + 1
        cases += [
            ("seq_lens negative", dict(seq_lens=lens - 6), ValueError, "seq_lens"),
            ("seq_lens above max_seq_len", dict(seq_lens=big), ValueError, "seq_lens"),
            ("sdc_table negative", dict(sdc="offline", sdc_table=table - 1.0), ValueError, "sdc_table"),
            ("sdc_table NaN", dict(sdc="offline", sdc_table=table * float("nan")), ValueError, "sdc_table"),
        ]
    return cases


@rule("errors", "every invalid input raises TypeError/ValueError naming the argument, before the backend runs")
def _errors(h: Harness) -> None:
    kw = _valid_kwargs(h)
    expect_errors(h, kw, _error_cases(kw, h))


def expect_errors(h: Harness, kw: dict, cases: list) -> None:
    """Each (what, change, exception type, needle): ``decode_attention(**kw | change)`` must
    raise that type with ``needle`` in the message, and the backend must not run."""
    from ..api import decode_attention

    for what, change, exc, needle in cases:
        args = dict(kw)
        args["backend"] = h.backend.name
        args.update(change)
        h.cases += 1
        with _spy(h.backend) as calls:
            try:
                decode_attention(**args)
            except exc as e:
                if needle not in str(e):
                    h.fail(f"errors/{what}", f"message does not name {needle!r}: {e}")
            except Exception as e:  # noqa: BLE001 - any other type is a failure
                h.fail(f"errors/{what}", f"raised {type(e).__name__} instead of {exc.__name__}: {e}")
            else:
                h.fail(f"errors/{what}", f"no error raised (expected {exc.__name__})")
        if calls:
            h.fail(f"errors/{what}", "the backend ran before the error was raised")


@rule("public_api", "decode_attention (custom op), backend= and TOPTH_BACKEND reach this backend; dtypes and shapes of results")
def _api(h: Harness) -> None:
    from ..api import decode_attention

    shape = h.shapes[1]
    case = random_case("public_api", shape, h.dtype, placement="pre_softmax", sdc="exact",
                       vmc=True, seed=h.seed("api"))
    direct = h.forward(case)
    if direct is None:
        return
    kw = case.to(h.device).kwargs
    with _spy(h.backend) as calls:
        out, stats = decode_attention(**kw, return_stats=True, backend=h.backend.name)
        h.check(case, result=(out, stats))
        plain = decode_attention(**kw, backend=h.backend.name)
        with _env(ENV_BACKEND, h.backend.name):
            env_out = decode_attention(**kw)
    if len(calls) != 3:
        h.fail(case.name, f"backend ran {len(calls)} times for 3 calls through the public API")
    if not isinstance(plain, torch.Tensor):
        h.fail(case.name, f"return_stats=False must return a tensor, got {type(plain).__name__}")
    for what, t, dtype in (("out", out, h.dtype), ("kept", stats.kept, torch.int32),
                           ("v_rows", stats.v_rows, torch.int32),
                           ("dropped_mass", stats.dropped_mass, torch.float32)):
        if t.dtype != dtype or t.device.type != h.device.type:
            h.fail(case.name, f"{what} is {t.dtype} on {t.device}, expected {dtype} on {h.device}")
    for what, other in (("return_stats=False", plain), (f"{ENV_BACKEND}", env_out)):
        rep, _ = mismatch_report(f"{what} vs direct call", to_numpy(other), to_numpy(direct[0]), **h.tol)
        if rep:
            h.fail(case.name, rep)
