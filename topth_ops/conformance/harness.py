"""The machinery of the conformance rules: the :class:`Harness` that runs a case on one
backend, device and dtype and compares it with the float64 oracle, the :data:`RULES`
registry with its :func:`rule` decorator, and :func:`expect_errors` for rules about bad
input. The rules themselves live in ``rules*.py`` of this package.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from ..contract import make_inputs
from ..registry import Backend
from .cases import MIN_GUARD, SHAPE_SETS, Case, Shape, seed_of
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


@contextmanager
def spy_forward(backend: Backend):
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


def expect_errors(h: Harness, kw: dict, cases: list) -> None:
    """Each (what, change, exception type, needle): ``decode_attention(**kw | change)`` must
    raise that type with ``needle`` in the message, and the backend must not run."""
    from ..api import decode_attention

    for what, change, exc, needle in cases:
        args = dict(kw)
        args["backend"] = h.backend.name
        args.update(change)
        h.cases += 1
        with spy_forward(h.backend) as calls:
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
