"""Tolerances (one table keyed by dtype) and mismatch reports for the conformance suite."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

# Output tolerance |got - want| <= atol + rtol * |want|, keyed by the input dtype. The
# output is rounded to that dtype, so the bound is a few units in its last place. For
# float32 the bound comes from the float32 math itself: scores of up to |a| ~ 10 carry
# ~1e-6 absolute error, and a sum of a thousand kept terms that cancels to ~0.02 was
# measured 1.4e-5 off in the reference backend. dropped_mass is float32 whatever the
# input dtype and uses the "stats" row.
TOLERANCES: dict = {
    torch.float32: dict(atol=5e-5, rtol=2e-4),
    torch.float16: dict(atol=1e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=8e-3, rtol=1.6e-2),
    "stats": dict(atol=1e-5, rtol=1e-4),
}


def _loc(idx, names) -> str:
    return "(" + ", ".join(f"{n}={i}" for n, i in zip(names, idx)) + ")"


def mismatch_report(name: str, got, want, *, atol: float, rtol: float,
                    dims=("b", "h", "d"), ignore: Optional[np.ndarray] = None) -> tuple[Optional[str], float]:
    """Compare ``got`` with ``want`` elementwise (NaN must match NaN).

    Parameters
    ----------
    name : str
        What is compared, for the report.
    got, want : array-like
        Same shape.
    atol, rtol : float
        Tolerance.
    dims : tuple of str
        Dimension names for locating the worst element.
    ignore : np.ndarray of bool, optional
        Elements (broadcastable) whose value is unspecified by the contract.

    Returns
    -------
    report : str or None
        None when everything matches; else the failing fraction and the worst element.
    worst : float
        Largest |got - want| / (atol + rtol |want|) over finite pairs (1.0 = at tolerance).
    """
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        return f"{name}: shape {got.shape} != expected {want.shape}", float("inf")
    bound = atol + rtol * np.abs(want)
    with np.errstate(invalid="ignore"):
        err = np.abs(got - want)
        ratio = np.where(np.isfinite(err), err / bound, 0.0)
        bad = ~(err <= bound)
    both_nan = np.isnan(got) & np.isnan(want)
    bad &= ~both_nan
    if ignore is not None:
        ignore = np.broadcast_to(ignore, bad.shape)
        bad &= ~ignore
        ratio = np.where(ignore, 0.0, ratio)
    worst = float(ratio.max()) if ratio.size else 0.0
    if not bad.any():
        return None, worst
    n_bad = int(bad.sum())
    # worst failing element: largest ratio, NaN/inf mismatches first
    score = np.where(bad, np.where(np.isfinite(ratio), ratio, np.inf), -1.0)
    score = np.where(bad & ~np.isfinite(err), np.inf, score)
    idx = np.unravel_index(int(np.argmax(score)), bad.shape)
    return (
        f"{name}: {n_bad}/{bad.size} elements ({n_bad / bad.size:.2%}) outside "
        f"atol={atol:g} rtol={rtol:g}; worst at {_loc(idx, dims)}: got {got[idx]!r}, "
        f"expected {want[idx]!r}"
    ), worst


def exact_report(name: str, got, want, *, dims=("b", "h"), ignore: Optional[np.ndarray] = None) -> Optional[str]:
    """Exact comparison of integer statistics; None when equal."""
    got = np.asarray(got)
    want = np.asarray(want)
    if got.shape != want.shape:
        return f"{name}: shape {got.shape} != expected {want.shape}"
    bad = got != want
    if ignore is not None:
        bad &= ~np.broadcast_to(ignore, bad.shape)
    if not bad.any():
        return None
    idx = np.unravel_index(int(np.argmax(bad)), bad.shape)
    return (f"{name}: {int(bad.sum())}/{bad.size} differ; first at {_loc(idx, dims)}: "
            f"got {got[idx]}, expected {want[idx]}")


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float64 if t.is_floating_point() else torch.int64).numpy()
