"""Conformance rules about the public API: bad input raises before the backend runs, and
``decode_attention`` (custom op, ``backend=``, ``TOPTH_BACKEND``) reaches the backend with
results of the documented dtypes and shapes."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Optional

import torch

from ..registry import ENV_BACKEND
from .cases import Shape, random_case
from .compare import mismatch_report, to_numpy
from .harness import Harness, expect_errors, rule, spy_forward


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
    with spy_forward(h.backend) as calls:
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
