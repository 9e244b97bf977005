"""The op contract in code: option names, the frozen inputs object, and input validation.

Every backend, the dispatcher, the conformance suite and the benchmarks share
:class:`DecodeInputs` and :func:`make_inputs`, so a bad input is rejected once, before
any backend is chosen or any kernel is launched. The semantics are written out in
``docs/semantics.md``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
import torch

PLACEMENTS = ("pre_softmax", "post_softmax")
SDC_MODES = ("none", "exact", "exp_threshold", "offline")
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SEQ_LEN_DTYPES = (torch.int32, torch.int64)
DEFAULT_SDC_GAMMA = 0.05  # paper section 3.2.1


class DecodeStats(NamedTuple):
    """Per-head statistics of one decode step (``return_stats=True``).

    Attributes
    ----------
    kept : torch.Tensor
        ``[batch, num_q_heads]`` int32: k~, the number of kept positions of each head.
    v_rows : torch.Tensor
        ``[batch, num_kv_heads]`` int32: size of the union, over the query heads of the
        KV group, of the kept positions; the V rows a kernel must read (paper section 4.6).
    dropped_mass : torch.Tensor
        ``[batch, num_q_heads]`` float32: beta = 1 - sum of the kept weights, in [0, 1]
        (paper section 3.2.2).
    """

    kept: torch.Tensor
    v_rows: torch.Tensor
    dropped_mass: torch.Tensor


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _dtype(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


@dataclass(frozen=True)
class DecodeInputs:
    """One validated decode-attention call, shared by dispatch, backends, tests and benchmarks.

    Build it with :func:`make_inputs`, never directly: the constructor does not validate.

    Attributes
    ----------
    query : torch.Tensor
        ``[batch, num_q_heads, head_dim]``, float16 / bfloat16 / float32, RoPE applied.
    key_cache, value_cache : torch.Tensor
        ``[batch, num_kv_heads, max_seq_len, head_dim]`` (BNSD), same dtype and device as
        ``query``; the current token is already appended.
    seq_lens : torch.Tensor
        ``[batch]`` int32 or int64: n_b, the number of valid positions (row id).
    thresholds : torch.Tensor
        ``[num_q_heads, max_row_id]`` float32; row id n reads column ``min(n, max_row_id) - 1``.
    scale : float
        Resolved softmax scale (``1/sqrt(head_dim)`` when the caller passed None).
    placement, sdc : str
        One of :data:`PLACEMENTS` and :data:`SDC_MODES`.
    sdc_gamma : float
        gamma of the exp_threshold estimate (paper section 3.2.1).
    sdc_table : torch.Tensor or None
        ``[num_q_heads, max_row_id]`` float32, only with ``sdc="offline"``.
    vmc : bool
        V-mean compensation (paper section 3.2.2).
    value_mean : torch.Tensor or None
        ``[batch, num_kv_heads, head_dim]`` float32, only with ``vmc=True``.
    return_stats : bool
        Whether the caller asked for :class:`DecodeStats`.
    """

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    seq_lens: torch.Tensor
    thresholds: torch.Tensor
    scale: float
    placement: str = "post_softmax"
    sdc: str = "none"
    sdc_gamma: float = DEFAULT_SDC_GAMMA
    sdc_table: Optional[torch.Tensor] = None
    vmc: bool = False
    value_mean: Optional[torch.Tensor] = None
    return_stats: bool = False

    @property
    def batch(self) -> int:
        return self.query.shape[0]

    @property
    def num_q_heads(self) -> int:
        return self.query.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.key_cache.shape[1]

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA ratio); query head h reads KV head h // group_size."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.query.shape[2]

    @property
    def max_seq_len(self) -> int:
        return self.key_cache.shape[2]

    @property
    def max_row_id(self) -> int:
        return self.thresholds.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.query.dtype

    @property
    def device(self) -> torch.device:
        return self.query.device

    def describe(self) -> str:
        """One line naming every shape, dtype, device and option; used in error messages."""
        parts = [
            f"query {_shape(self.query)} {_dtype(self.dtype)} on {self.device}",
            f"key/value cache {_shape(self.key_cache)}",
            f"seq_lens {_shape(self.seq_lens)} {_dtype(self.seq_lens.dtype)}",
            f"thresholds {_shape(self.thresholds)}",
            f"placement={self.placement}",
            f"sdc={self.sdc}",
            f"vmc={self.vmc}",
        ]
        if self.value_mean is not None:
            parts.append("value_mean given")
        return "; ".join(parts)

    def empty_outputs(self, fill: Optional[float] = None) -> tuple[torch.Tensor, Optional[DecodeStats]]:
        """Allocate the output ``[batch, num_q_heads, head_dim]`` and, if asked, the stats.

        Parameters
        ----------
        fill : float, optional
            Value to fill every buffer with (the conformance suite poisons with NaN; the
            integer stats get -1). None leaves them uninitialised.
        """
        dev = self.device
        out = torch.empty(self.query.shape, dtype=self.dtype, device=dev)
        stats = None
        if self.return_stats:
            stats = DecodeStats(
                kept=torch.empty((self.batch, self.num_q_heads), dtype=torch.int32, device=dev),
                v_rows=torch.empty((self.batch, self.num_kv_heads), dtype=torch.int32, device=dev),
                dropped_mass=torch.empty((self.batch, self.num_q_heads), dtype=torch.float32, device=dev),
            )
        if fill is not None:
            out.fill_(fill)
            if stats is not None:
                stats.kept.fill_(-1)
                stats.v_rows.fill_(-1)
                stats.dropped_mass.fill_(fill)
        return out, stats


def _require_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _require_rank(name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    if t.dim() != rank:
        raise ValueError(f"{name} must have shape {layout} ({rank} dims), got shape {_shape(t)}")


def _require_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def _require_real(name: str, value, *, positive: bool) -> float:
    # numbers.Real covers int, float and numpy's scalars; bools (numpy's too) are rejected.
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number (Python or numpy scalar), "
                        f"got {type(value).__name__} {value!r}")
    try:
        value = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a finite number, got an int too large for a float") from None
    ok = math.isfinite(value) and (value > 0 if positive else value >= 0)
    if not ok:
        expected = "a finite number > 0" if positive else "a finite number >= 0"
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return value


def _values_checkable(t: torch.Tensor) -> bool:
    """True when the values of ``t`` can be read without a device sync or a trace break."""
    if t.device.type != "cpu":
        return False
    if torch.compiler.is_compiling():
        return False
    from torch._subclasses.fake_tensor import is_fake

    return not is_fake(t)


def make_inputs(
    query,
    key_cache,
    value_cache,
    seq_lens,
    thresholds,
    *,
    scale=None,
    placement="post_softmax",
    sdc="none",
    sdc_gamma=DEFAULT_SDC_GAMMA,
    sdc_table=None,
    vmc=False,
    value_mean=None,
    return_stats=False,
    check_values=True,
) -> DecodeInputs:
    """Validate one decode-attention call and return the frozen :class:`DecodeInputs`.

    Arguments are those of :func:`topth_ops.decode_attention` (see there and
    ``docs/semantics.md``). Nothing here launches a kernel or copies a tensor.

    Parameters
    ----------
    check_values : bool
        Also check the values of ``seq_lens`` (0 <= n <= max_seq_len) and of ``sdc_table``
        (finite, >= 0). Done only where it needs no device sync (CPU tensors outside a
        trace); on accelerators a backend must clamp the lengths into [0, max_seq_len] so
        that it never reads out of bounds.

    Returns
    -------
    DecodeInputs

    Raises
    ------
    TypeError
        A tensor argument is not a tensor, or has the wrong dtype (query not float16 /
        bfloat16 / float32, caches not of the query's dtype, seq_lens not int32/int64,
        thresholds / sdc_table / value_mean not float32); a flag is not a bool; a number
        is not a real number.
    ValueError
        Wrong rank or shape, head_dim mismatch, num_q_heads not a multiple of
        num_kv_heads, tensors on different devices, seq_lens out of [0, max_seq_len],
        unknown placement or sdc, sdc other than "none" with post_softmax, "offline"
        without sdc_table, sdc_table without "offline", sdc_table values negative or not
        finite (CPU), value_mean without vmc, sdc_gamma other than its default without
        "exp_threshold", scale not finite and > 0, sdc_gamma not finite and >= 0.
    """
    q = _require_tensor("query", query)
    k = _require_tensor("key_cache", key_cache)
    v = _require_tensor("value_cache", value_cache)
    lens = _require_tensor("seq_lens", seq_lens)
    th = _require_tensor("thresholds", thresholds)
    if sdc_table is not None:
        _require_tensor("sdc_table", sdc_table)
    if value_mean is not None:
        _require_tensor("value_mean", value_mean)

    _require_rank("query", q, 3, "[batch, num_q_heads, head_dim]")
    _require_rank("key_cache", k, 4, "[batch, num_kv_heads, max_seq_len, head_dim]")
    _require_rank("value_cache", v, 4, "[batch, num_kv_heads, max_seq_len, head_dim]")
    _require_rank("seq_lens", lens, 1, "[batch]")
    _require_rank("thresholds", th, 2, "[num_q_heads, max_row_id]")

    if q.dtype not in INPUT_DTYPES:
        raise TypeError(f"query dtype must be float16, bfloat16 or float32, got {_dtype(q.dtype)}")
    for name, t in (("key_cache", k), ("value_cache", v)):
        if t.dtype != q.dtype:
            raise TypeError(
                f"{name} dtype must equal the query dtype {_dtype(q.dtype)}, got {_dtype(t.dtype)}"
            )
    if lens.dtype not in SEQ_LEN_DTYPES:
        raise TypeError(f"seq_lens dtype must be int32 or int64, got {_dtype(lens.dtype)}")
    for name, t in (("thresholds", th), ("sdc_table", sdc_table), ("value_mean", value_mean)):
        if t is not None and t.dtype != torch.float32:
            raise TypeError(f"{name} dtype must be float32, got {_dtype(t.dtype)}")

    named = [("key_cache", k), ("value_cache", v), ("seq_lens", lens), ("thresholds", th),
             ("sdc_table", sdc_table), ("value_mean", value_mean)]
    for name, t in named:
        if t is not None and t.device != q.device:
            raise ValueError(
                f"{name} must be on the query's device {q.device}, got {t.device}"
            )

    batch, num_q_heads, head_dim = q.shape
    if batch < 1 or num_q_heads < 1 or head_dim < 1:
        raise ValueError(f"query must have batch, num_q_heads and head_dim >= 1, got shape {_shape(q)}")
    if k.shape[0] != batch:
        raise ValueError(f"key_cache batch must equal the query batch {batch}, got shape {_shape(k)}")
    num_kv_heads, max_seq_len = k.shape[1], k.shape[2]
    if num_kv_heads < 1 or max_seq_len < 1:
        raise ValueError(
            f"key_cache must have num_kv_heads >= 1 and max_seq_len >= 1, got shape {_shape(k)}"
        )
    if k.shape[3] != head_dim:
        raise ValueError(
            f"key_cache head_dim must equal the query head_dim {head_dim}, got shape {_shape(k)}"
        )
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(
            f"value_cache shape must equal the key_cache shape {_shape(k)}, got {_shape(v)}"
        )
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_q_heads ({num_q_heads}, query dim 1) must be a multiple of num_kv_heads "
            f"({num_kv_heads}, key_cache dim 1)"
        )
    if lens.shape[0] != batch:
        raise ValueError(f"seq_lens must have shape [{batch}] (the query batch), got {_shape(lens)}")
    if th.shape[0] != num_q_heads or th.shape[1] < 1:
        raise ValueError(
            f"thresholds must have shape [{num_q_heads}, max_row_id >= 1] (num_q_heads from "
            f"query), got {_shape(th)}"
        )

    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if sdc not in SDC_MODES:
        raise ValueError(f"sdc must be one of {SDC_MODES}, got {sdc!r}")
    if placement == "post_softmax" and sdc != "none":
        raise ValueError(
            f"sdc must be 'none' with placement='post_softmax' (compensation of the softmax "
            f"denominator applies to pre_softmax only), got sdc={sdc!r}"
        )
    if sdc == "offline":
        if sdc_table is None:
            raise ValueError("sdc_table is required with sdc='offline' (shape [num_q_heads, max_row_id], float32)")
        if tuple(sdc_table.shape) != tuple(th.shape):
            raise ValueError(
                f"sdc_table must have the thresholds' shape {_shape(th)}, got {_shape(sdc_table)}"
            )
    elif sdc_table is not None:
        raise ValueError(f"sdc_table is only used with sdc='offline', got sdc={sdc!r}")
    sdc_gamma = _require_real("sdc_gamma", sdc_gamma, positive=False)
    if sdc != "exp_threshold" and sdc_gamma != DEFAULT_SDC_GAMMA:
        raise ValueError(
            f"sdc_gamma is only used with sdc='exp_threshold', got sdc={sdc!r} and "
            f"sdc_gamma={sdc_gamma!r} (leave it at its default {DEFAULT_SDC_GAMMA})"
        )

    vmc = _require_bool("vmc", vmc)
    return_stats = _require_bool("return_stats", return_stats)
    if value_mean is not None:
        if not vmc:
            raise ValueError("value_mean is only used with vmc=True, got vmc=False")
        expected = (batch, num_kv_heads, head_dim)
        if tuple(value_mean.shape) != expected:
            raise ValueError(
                f"value_mean must have shape [{batch}, {num_kv_heads}, {head_dim}] "
                f"([batch, num_kv_heads, head_dim]), got {_shape(value_mean)}"
            )

    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    else:
        scale = _require_real("scale", scale, positive=True)

    if check_values and _values_checkable(lens):
        lo, hi = int(lens.min()), int(lens.max())
        if lo < 0 or hi > max_seq_len:
            raise ValueError(
                f"seq_lens values must lie in [0, max_seq_len={max_seq_len}] (key_cache dim 2), "
                f"got min {lo}, max {hi}"
            )
    if check_values and sdc_table is not None and _values_checkable(sdc_table):
        bad = ~(torch.isfinite(sdc_table) & (sdc_table >= 0))
        if bool(bad.any()):
            raise ValueError(
                "sdc_table values must be finite and >= 0 (an estimate of a sum of exponentials), "
                f"got {int(bad.sum())} other values, e.g. {sdc_table[bad][0].item()!r}"
            )

    return DecodeInputs(
        query=q,
        key_cache=k,
        value_cache=v,
        seq_lens=lens,
        thresholds=th,
        scale=scale,
        placement=placement,
        sdc=sdc,
        sdc_gamma=sdc_gamma,
        sdc_table=sdc_table,
        vmc=vmc,
        value_mean=value_mean,
        return_stats=return_stats,
    )
