"""Environment variables read by the backends: one parser per kind of value, each naming
the variable and the accepted values in its error."""

from __future__ import annotations

import os
from typing import Sequence

_TRUE = ("1", "true", "on", "yes")


def env_choice(var: str, choices: Sequence[str], default: str = "auto") -> str:
    """``var`` lower-cased and stripped (``default`` when unset or blank).

    Raises
    ------
    ValueError
        A value outside ``choices``, naming ``var``.
    """
    raw = os.environ.get(var, "").strip().lower() or default
    if raw not in choices:
        raise ValueError(f"{var} must be one of {', '.join(choices)}, got {raw!r}")
    return raw


def env_int(var: str, lo: int, hi: int, what: str, default: int | None = None) -> int | None:
    """``var`` as a base-10 integer in ``[lo, hi]`` (``default`` when unset or blank).

    Raises
    ------
    ValueError
        Not an integer in range, naming ``var``, the range and ``what`` it sets.
    """
    raw = os.environ.get(var, "").strip()
    if not raw:
        return default
    try:
        v = int(raw, 10)
    except ValueError:
        v = None
    if v is None or not lo <= v <= hi:
        span = f">= {lo}" if hi >= 2**62 else f"in [{lo}, {hi}]"
        raise ValueError(f"{var} must be an integer {span} ({what}), got {raw!r}")
    return v


def env_flag(var: str) -> bool:
    """A boolean knob parsed as Triton 3.6 parses its own (``1``, ``true``, ``on``, ``yes``,
    any case); anything else, or unset, is False."""
    return os.environ.get(var, "").strip().lower() in _TRUE


def interpreter_enabled() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET``, read now)."""
    return env_flag("TRITON_INTERPRET")
