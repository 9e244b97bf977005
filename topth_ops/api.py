"""Public Python API: :func:`decode_attention`."""

from __future__ import annotations

from typing import Optional, Union

import torch

from .contract import DEFAULT_SDC_GAMMA, DecodeStats, make_inputs
from .op import decode_attention_op, run


def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    thresholds: torch.Tensor,
    *,
    scale: Optional[float] = None,
    placement: str = "post_softmax",
    sdc: str = "none",
    sdc_gamma: float = DEFAULT_SDC_GAMMA,
    sdc_table: Optional[torch.Tensor] = None,
    vmc: bool = False,
    value_mean: Optional[torch.Tensor] = None,
    return_stats: bool = False,
    backend: Optional[str] = None,
    block_table: Optional[torch.Tensor] = None,
    kv_layout: Optional[str] = None,
    selection: str = "head",
    threshold_set: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, DecodeStats]]:
    """Top-Theta thresholded decode (incremental) attention, one new query token per sequence.

    Per sequence b and query head h, with n = seq_lens[b], row = min(n, max_row_id) - 1,
    theta = thresholds[h, row] and a_j = scale * <q, k_j> over the n valid positions
    (full formulas, edge cases and errors: docs/semantics.md):

    - ``pre_softmax`` (paper section 3.1, eq. 3): keep a_j > theta, w_j = exp(a_j - m) /
      (R + E~) with R the kept exponent sum and E~ the softmax-denominator compensation
      (section 3.2.1) chosen by ``sdc``;
    - ``post_softmax``: keep s_j > theta with s = softmax(a), w_j = s_j;
    - out = sum_kept w_j v_j (+ beta * mean(v) with ``vmc``, section 3.2.2,
      beta = 1 - sum_kept w_j).

    Parameters
    ----------
    query : torch.Tensor
        ``[batch, num_q_heads, head_dim]``, float16, bfloat16 or float32; RoPE applied.
    key_cache, value_cache : torch.Tensor
        The query's dtype and device; the current token already appended. Without
        ``block_table``: ``[batch, num_kv_heads, max_seq_len, head_dim]`` (BNSD). With it
        (paged): ``[num_blocks, block_size, num_kv_heads, head_dim]`` (``kv_layout="NHD"``,
        vLLM's layout) or ``[num_blocks, num_kv_heads, block_size, head_dim]`` ("HND", and
        "VLLM_AMX": vLLM's CPU cache packed for its AMX kernels, :mod:`topth_ops.packed`).
        Positions ``>= seq_lens[b]`` are never read. GQA: query head h uses KV head
        ``h // (num_q_heads // num_kv_heads)``.
    seq_lens : torch.Tensor
        ``[batch]`` int32/int64 on the query's device: valid positions n_b, 0 <= n_b <=
        max_seq_len (BNSD dim 2, or max_blocks_per_seq * block_size when paged).
    thresholds : torch.Tensor
        float32 ``[H, max_row_id]``, or ``[num_sets, H, max_row_id]`` with
        ``threshold_set``: theta per head and row id (logits for pre_softmax,
        probabilities for post_softmax); -inf keeps every finite score. H is num_q_heads
        (``selection="head"``) or num_kv_heads (``selection="group"``).
    scale : float, optional
        Softmax scale, finite and > 0; default ``1 / sqrt(head_dim)``.
    placement : {"post_softmax", "pre_softmax"}
        Where the threshold is compared.
    sdc : {"none", "exact", "exp_threshold", "offline"}
        Softmax-denominator compensation (pre_softmax only).
    sdc_gamma : float
        gamma of ``exp_threshold``: E~ = gamma * (n - k~) * exp(theta - m). Default 0.05;
        another value with another ``sdc`` is an error.
    sdc_table : torch.Tensor, optional
        float32 ``[num_q_heads, max_row_id]`` (``[num_sets, num_q_heads, max_row_id]``
        with threshold sets), E~ in units of exp(a - m), finite and >= 0; required by and
        only allowed with ``sdc="offline"``.
    vmc : bool
        Add beta * mean(V) (V-mean compensation).
    value_mean : torch.Tensor, optional
        ``[batch, num_kv_heads, head_dim]`` float32 running mean of V over the n valid
        rows (only with ``vmc=True``); computed from the cache when omitted.
    return_stats : bool
        Also return :class:`DecodeStats` (kept, v_rows, dropped_mass).
    backend : str, optional
        Backend name (see ``topth-ops info``); default: the ``TOPTH_BACKEND`` environment
        variable, else the first backend of the device's priority list that supports the
        inputs.
    block_table : torch.Tensor, optional
        ``[batch, max_blocks_per_seq]`` int32: position j of sequence b is slot
        ``j % block_size`` of cache block ``block_table[b, j // block_size]``. Entries of
        blocks past ``ceil(n_b / block_size)`` are never read.
    kv_layout : {None, "BNSD", "NHD", "HND", "VLLM_AMX"}
        Cache layout; None means "BNSD" without a block table and "NHD" with one.
    selection : {"head", "group"}
        "head": one threshold per query head (paper section 3.1). "group": one threshold
        per KV head, compared with the maximum over the group's query heads (of logits
        for pre_softmax, of probabilities for post_softmax), so every head of a GQA group
        keeps the same positions and the group reads exactly the V rows it keeps;
        compensation stays per head.
    threshold_set : torch.Tensor, optional
        ``[batch]`` int32/int64, required with 3-D thresholds: the threshold set (e.g. a
        target k) each sequence uses, so one batch can mix sparsity levels.

    Returns
    -------
    out : torch.Tensor
        ``[batch, num_q_heads, head_dim]`` in the query dtype (float32 math inside).
    stats : DecodeStats
        Only when ``return_stats=True``.

    Notes
    -----
    Inference only: the op has no autograd formula. The same op is
    ``torch.ops.topth.decode_attention(query, key_cache, value_cache, seq_lens, thresholds,
    scale, placement, sdc, sdc_gamma, sdc_table, vmc, value_mean, return_stats, backend,
    block_table, kv_layout, selection, threshold_set)`` with every argument positional
    (``scale=None`` for the default, ``backend=""`` for automatic, ``kv_layout=""`` for
    the default), returning ``(out, kept, v_rows, dropped_mass)`` (stats empty when not
    asked for).

    Raises
    ------
    TypeError, ValueError
        Invalid inputs, before any kernel launch; the message names the argument and the
        expected value (see :func:`topth_ops.contract.make_inputs`).
    NotImplementedError
        The chosen backend cannot run valid inputs, or no backend can (with reasons).
    """
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
    if torch.compiler.is_compiling():  # traced: the public op validates (fake tensors) itself
        out, kept, v_rows, dropped = decode_attention_op(
            query, key_cache, value_cache, seq_lens, thresholds, scale, placement, sdc, sdc_gamma,
            sdc_table, vmc, value_mean, return_stats, backend or "", block_table, kv_layout or "",
            selection, threshold_set)
        return (out, DecodeStats(kept, v_rows, dropped)) if return_stats is True else out
    # Eager: validate once, here (before a dispatcher could coerce types or replace our
    # messages with schema errors), then the direct path, which trusts these inputs.
    inputs = make_inputs(
        query, key_cache, value_cache, seq_lens, thresholds, scale=scale, placement=placement,
        sdc=sdc, sdc_gamma=sdc_gamma, sdc_table=sdc_table, vmc=vmc, value_mean=value_mean,
        return_stats=return_stats, block_table=block_table, kv_layout=kv_layout,
        selection=selection, threshold_set=threshold_set,
    )
    out, stats = run(inputs, backend)
    return (out, stats) if return_stats is True else out
