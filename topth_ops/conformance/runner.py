"""Run conformance rules against a backend and summarise the verdicts."""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from ..registry import Backend, get_backend
from ..validation import dtype_str
from .harness import RULES, Harness

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class RuleResult:
    """Verdict of one rule on one backend, device and dtype.

    status is "pass" (every supported case matched and at least one ran), "fail", or
    "skip" (the backend declared every case unsupported; ``reason`` says why).
    """

    rule: str
    dtype: str
    device: str
    status: str
    cases: int
    worst: float
    seconds: float
    failures: list = field(default_factory=list)
    unsupported: list = field(default_factory=list)

    @property
    def reason(self) -> str:
        if self.failures:
            return self.failures[0]
        if self.unsupported:
            return self.unsupported[0]
        return ""

    def report(self) -> str:
        """Multi-line detail: every failure and the unsupported cases."""
        lines = [f"{self.rule} [{self.dtype}, {self.device}]: {self.status}, {self.cases} cases"]
        lines += [f"  FAIL {f}" for f in self.failures]
        lines += [f"  unsupported {u}" for u in self.unsupported[:5]]
        if len(self.unsupported) > 5:
            lines.append(f"  ... {len(self.unsupported) - 5} more unsupported cases")
        return "\n".join(lines)


def run_rule(backend: Backend, rule: str, dtype: torch.dtype, *, device: Optional[torch.device] = None,
             shape_set: str = "full") -> RuleResult:
    """Run one rule; an exception inside the backend counts as a failure of the rule.

    Raises
    ------
    ValueError
        No device given and the backend names none on this machine.
    """
    if device is None:
        devices = backend.devices()
        if not devices:
            raise ValueError(f"backend {backend.name!r} names no device of this machine to run on")
        device = devices[0]
    h = Harness(backend=backend, device=torch.device(device), dtype=dtype, shape_set=shape_set)
    t0 = time.perf_counter()
    try:
        RULES[rule].fn(h)
    except Exception as e:  # noqa: BLE001 - report, do not crash the table
        h.failures.append(f"raised {type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}")
    if h.failures:
        status = "fail"
    elif h.cases == 0:
        status = "skip"
    else:
        status = "pass"
    return RuleResult(rule, dtype_str(dtype), str(device), status, h.cases, h.worst,
                      time.perf_counter() - t0, h.failures, h.unsupported)


def plan(backend_name: str, *, dtypes: Iterable[str] = ("float16", "bfloat16", "float32"),
         rules: Optional[Iterable[str]] = None, shape_set: str = "full",
         device: Optional[str] = None) -> tuple[Backend, torch.device, list, list]:
    """Check every argument of :func:`run_conformance` before anything runs.

    Returns
    -------
    backend, device, dtypes (torch dtypes), rule names

    Raises
    ------
    ValueError
        Unknown backend, rule, dtype or shape set; empty dtype or rule list; a backend that
        is unavailable here (with its reasons); a device this machine cannot allocate on.
    """
    from .cases import SHAPE_SETS

    backend = get_backend(backend_name)
    if shape_set not in SHAPE_SETS:
        raise ValueError(f"shape set must be one of {sorted(SHAPE_SETS)}, got {shape_set!r}")
    names = list(rules) if rules is not None else list(RULES)
    unknown = [r for r in names if r not in RULES]
    if unknown or not names:
        raise ValueError(f"rules must be a non-empty list among {list(RULES)}, got {names!r}")
    dtypes = list(dtypes)
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise ValueError(f"dtypes must be a non-empty list among {list(DTYPES)}, got {dtypes!r}")
    reasons = backend.unavailable_reasons()
    if reasons:
        raise ValueError(f"backend {backend_name!r} is not available here: {'; '.join(reasons)}")
    if device is None:
        devices = backend.devices()
        if not devices:
            raise ValueError(f"backend {backend_name!r} names no device of this machine to run on")
        dev = devices[0]
    else:
        try:
            dev = torch.device(device)
            torch.empty(1, device=dev)
        except Exception as e:  # noqa: BLE001 - any failure means the device is not usable here
            raise ValueError(f"device {device!r} is not usable on this machine: {e}") from None
    return backend, dev, [DTYPES[d] for d in dtypes], names


def run_conformance(backend_name: str, *, dtypes: Iterable[str] = ("float16", "bfloat16", "float32"),
                    rules: Optional[Iterable[str]] = None, shape_set: str = "full",
                    device: Optional[str] = None, progress=None) -> list[RuleResult]:
    """Run the suite against one backend.

    Parameters
    ----------
    backend_name : str
        Registered backend.
    dtypes : iterable of str
        Input dtypes to test ("float16", "bfloat16", "float32").
    rules : iterable of str, optional
        Rule names (default: all, in :data:`RULES` order).
    shape_set : {"full", "quick"}
    device : str, optional
        Default: the backend's first device on this machine.
    progress : callable, optional
        Called with each :class:`RuleResult` as it completes.

    Returns
    -------
    list of RuleResult

    Raises
    ------
    ValueError
        As :func:`plan`, before any rule runs.
    """
    backend, dev, dtypes, names = plan(backend_name, dtypes=dtypes, rules=rules,
                                       shape_set=shape_set, device=device)
    results = []
    for dtype in dtypes:
        for r in names:
            res = run_rule(backend, r, dtype, device=dev, shape_set=shape_set)
            results.append(res)
            if progress:
                progress(res)
    return results


def format_table(results: list[RuleResult]) -> str:
    """Pass/fail table: one row per rule, one column per dtype."""
    dtypes = list(dict.fromkeys(r.dtype for r in results))
    rules = list(dict.fromkeys(r.rule for r in results))
    by = {(r.rule, r.dtype): r for r in results}
    width = max(len(r) for r in rules) + 2
    head = f"{'rule':<{width}}" + "".join(f"{d:<22}" for d in dtypes)
    lines = [head, "-" * len(head)]
    for rule in rules:
        cells = []
        for d in dtypes:
            r = by.get((rule, d))
            if r is None:
                cells.append(f"{'-':<22}")
            else:
                cell = f"{r.status.upper()} ({r.cases})"
                if r.status != "skip" and r.worst:
                    cell += f" {r.worst:.2f}"
                cells.append(f"{cell:<22}")
        lines.append(f"{rule:<{width}}" + "".join(cells))
    lines.append("")
    lines.append("cell: verdict (cases run) worst error / tolerance; SKIP: every case unsupported here")
    return "\n".join(lines)
