"""The checks :func:`topth_ops.contract.make_inputs` runs on one decode-attention call, in the
order it runs them (which is the order errors are reported in), and the option names they
accept. Each raises TypeError or ValueError naming the argument and the expected value
(docs/semantics.md, "Errors"); the single-argument checks live in :mod:`topth_ops.validation`.
"""

from __future__ import annotations

import math

import torch

from . import validation as V

PLACEMENTS = ("pre_softmax", "post_softmax")
SDC_MODES = ("none", "exact", "exp_threshold", "offline")
SELECTIONS = ("head", "group")
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SEQ_LEN_DTYPES = (torch.int32, torch.int64)
DEFAULT_SDC_GAMMA = 0.05  # paper section 3.2.1

_shape = V.shape_str


def check_tensors(query, key_cache, value_cache, seq_lens, thresholds, sdc_table, value_mean, block_table,
                  threshold_set, kv_layout, selection):
    """Tensor arguments: types, ranks, dtypes and one device; the layout and selection names.

    Parameters
    ----------
    query, key_cache, value_cache, seq_lens, thresholds, sdc_table, value_mean, block_table,
    threshold_set, kv_layout, selection
        As :func:`topth_ops.decode_attention` takes them (optional ones may be None).

    Returns
    -------
    tuple
        (query, key_cache, value_cache, seq_lens, thresholds, the resolved kv_layout, selection).

    Raises
    ------
    TypeError
        A tensor argument is not a dense tensor or has the wrong dtype.
    ValueError
        A wrong rank, an unknown layout or selection, tensors on different devices.
    """
    q = V.require_tensor("query", query)
    k = V.require_tensor("key_cache", key_cache)
    v = V.require_tensor("value_cache", value_cache)
    lens = V.require_tensor("seq_lens", seq_lens)
    th = V.require_tensor("thresholds", thresholds)
    optional = {"sdc_table": sdc_table, "value_mean": value_mean, "block_table": block_table,
                "threshold_set": threshold_set}
    for name, t in optional.items():
        if t is not None:
            V.require_tensor(name, t)
    layout = V.resolve_layout(kv_layout, block_table is not None)
    selection = V.require_choice("selection", selection, SELECTIONS)

    V.require_rank("query", q, 3, "[batch, num_q_heads, head_dim]")
    V.require_rank("seq_lens", lens, 1, "[batch]")
    if block_table is not None:
        V.require_rank("block_table", block_table, 2, "[batch, max_blocks_per_seq]")

    if q.dtype not in INPUT_DTYPES:
        raise TypeError(f"query dtype must be float16, bfloat16 or float32, got {V.dtype_str(q.dtype)}")
    for name, t in (("key_cache", k), ("value_cache", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} dtype must equal the query dtype {V.dtype_str(q.dtype)}, "
                            f"got {V.dtype_str(t.dtype)}")
    V.require_dtype("seq_lens", lens, SEQ_LEN_DTYPES, "int32 or int64")
    V.require_dtype("threshold_set", threshold_set, SEQ_LEN_DTYPES, "int32 or int64")
    V.require_dtype("block_table", block_table, (torch.int32,), "int32")
    for name, t in (("thresholds", th), ("sdc_table", sdc_table), ("value_mean", value_mean)):
        V.require_dtype(name, t, (torch.float32,), "float32")

    named = [("key_cache", k), ("value_cache", v), ("seq_lens", lens), ("thresholds", th), *optional.items()]
    q_cpu = V.on_cpu(q)  # there is one CPU device: no device objects to compare (this runs on every call)
    for name, t in named:
        if t is not None and not (q_cpu and V.on_cpu(t)) and t.device != q.device:
            raise ValueError(f"{name} must be on the query's device {q.device}, got {t.device}")
    return q, k, v, lens, th, layout, selection


def check_layout(q, k, v, lens, block_table, layout: str) -> tuple[int, int, int]:
    """Shapes of the query ``[batch, num_q_heads, head_dim]``, the caches in ``layout`` and the
    block table ``[batch, max_blocks_per_seq]``.

    Returns
    -------
    tuple of int
        (num_kv_heads, block_size, max_seq_len); BNSD has one block of max_seq_len positions.

    Raises
    ------
    ValueError
        A dimension below 1, caches not of ``layout``'s shape, num_q_heads not a multiple of
        num_kv_heads, seq_lens or block_table not of the query's batch.
    """
    batch, num_q_heads, head_dim = q.shape
    if batch < 1 or num_q_heads < 1 or head_dim < 1:
        raise ValueError(f"query must have batch, num_q_heads and head_dim >= 1, got shape {_shape(q)}")
    num_kv_heads, block_size = V.check_caches(k, v, layout, batch, head_dim)
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_q_heads ({num_q_heads}, query dim 1) must be a multiple of num_kv_heads "
            f"({num_kv_heads}, key_cache {layout} {V.LAYOUT_DIMS[layout]})")
    if lens.shape[0] != batch:
        raise ValueError(f"seq_lens must have shape [{batch}] (the query batch), got {_shape(lens)}")
    max_seq_len = block_size
    if block_table is not None:
        if block_table.shape[0] != batch or block_table.shape[1] < 1:
            raise ValueError(f"block_table must have shape [{batch}, max_blocks_per_seq >= 1] (batch "
                             f"from query), got {_shape(block_table)}")
        max_seq_len = block_table.shape[1] * block_size
    return num_kv_heads, block_size, max_seq_len


def check_thresholds_and_sets(th, sdc_table, threshold_set, placement, sdc, sdc_gamma, selection: str,
                               num_q_heads: int, num_kv_heads: int, batch: int):
    """Placement, SDC mode and gamma (paper section 3.2.1), and the shapes of thresholds,
    sdc_table and threshold_set.

    Returns
    -------
    float
        sdc_gamma as a Python float (or a symbolic value while tracing).

    Raises
    ------
    ValueError
        An unknown placement or sdc, sdc other than "none" with post_softmax, a table shape
        or set index tensor that does not match, sdc_gamma changed without "exp_threshold".
    TypeError
        sdc_gamma not a real number.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if sdc not in SDC_MODES:
        raise ValueError(f"sdc must be one of {SDC_MODES}, got {sdc!r}")
    if placement == "post_softmax" and sdc != "none":
        raise ValueError(
            f"sdc must be 'none' with placement='post_softmax' (compensation of the softmax "
            f"denominator applies to pre_softmax only), got sdc={sdc!r}")
    V.check_thresholds(th, sdc_table, sdc, selection, num_q_heads, num_kv_heads, threshold_set, batch)
    sdc_gamma = V.require_real("sdc_gamma", sdc_gamma, positive=False)
    if sdc != "exp_threshold" and not V.is_symbolic(sdc_gamma) and sdc_gamma != DEFAULT_SDC_GAMMA:
        raise ValueError(
            f"sdc_gamma is only used with sdc='exp_threshold', got sdc={sdc!r} and "
            f"sdc_gamma={sdc_gamma!r} (leave it at its default {DEFAULT_SDC_GAMMA})")
    return sdc_gamma


def check_options(vmc, return_stats, value_mean, scale, batch: int, num_kv_heads: int, head_dim: int):
    """The flags, value_mean (``[batch, num_kv_heads, head_dim]``, only with vmc) and the scale.

    Returns
    -------
    tuple
        (vmc, return_stats, scale); scale defaults to 1 / sqrt(head_dim).

    Raises
    ------
    TypeError
        A flag not a bool, scale not a real number.
    ValueError
        value_mean without vmc or of another shape, scale not finite and > 0.
    """
    vmc = V.require_bool("vmc", vmc)
    return_stats = V.require_bool("return_stats", return_stats)
    if value_mean is not None:
        if not vmc:
            raise ValueError("value_mean is only used with vmc=True, got vmc=False")
        if tuple(value_mean.shape) != (batch, num_kv_heads, head_dim):
            raise ValueError(
                f"value_mean must have shape [{batch}, {num_kv_heads}, {head_dim}] "
                f"([batch, num_kv_heads, head_dim]), got {_shape(value_mean)}")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    else:
        scale = V.require_real("scale", scale, positive=True)
    return vmc, return_stats, scale


def check_values(lens, block_table, threshold_set, sdc_table, th, max_seq_len: int, block_size: int,
                 num_blocks: int) -> None:
    """Values, where they need no device sync (CPU tensors outside a trace): seq_lens in
    [0, max_seq_len], used block ids in [0, num_blocks), threshold_set in [0, num_sets),
    sdc_table finite and >= 0.

    Raises
    ------
    ValueError
        A value out of its range, naming the argument and the range.
    """
    if V.values_checkable(lens):
        lo, hi = V.min_max(lens)
        if lo < 0 or hi > max_seq_len:
            where = (f"max_blocks_per_seq {block_table.shape[1]} x block_size {block_size}"
                     if block_table is not None else "key_cache dim 2")
            raise ValueError(f"seq_lens values must lie in [0, max_seq_len={max_seq_len}] ({where}), "
                             f"got min {lo}, max {hi}")
        if block_table is not None and V.values_checkable(block_table):
            V.check_block_table_values(block_table, lens, block_size, num_blocks)
    if threshold_set is not None and V.values_checkable(threshold_set):
        V.check_index_values("threshold_set", threshold_set, th.shape[0], "thresholds dim 0, num_sets")
    if sdc_table is not None and V.values_checkable(sdc_table):
        bad = ~(torch.isfinite(sdc_table) & (sdc_table >= 0))
        if bool(bad.any()):
            raise ValueError(
                "sdc_table values must be finite and >= 0 (an estimate of a sum of exponentials), "
                f"got {int(bad.sum())} other values, e.g. {sdc_table[bad][0].item()!r}")
