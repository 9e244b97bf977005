"""Public Python API: :func:`decode_attention`."""

from __future__ import annotations

from typing import Optional, Union

import torch

from .contract import DEFAULT_SDC_GAMMA, DecodeStats, make_inputs
from .op import decode_attention_op


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
        ``[batch, num_kv_heads, max_seq_len, head_dim]`` (BNSD), the query's dtype and
        device; the current token already appended. Positions ``>= seq_lens[b]`` are
        never read. GQA: query head h uses KV head ``h // (num_q_heads // num_kv_heads)``.
    seq_lens : torch.Tensor
        ``[batch]`` int32/int64 on the query's device: valid positions n_b, 0 <= n_b <=
        max_seq_len.
    thresholds : torch.Tensor
        ``[num_q_heads, max_row_id]`` float32: theta per query head and row id (logits
        for pre_softmax, probabilities for post_softmax); -inf keeps everything.
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
        ``[num_q_heads, max_row_id]`` float32, E~ in units of exp(a - m), finite and >= 0;
        required by and only allowed with ``sdc="offline"``.
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
    scale, placement, sdc, sdc_gamma, sdc_table, vmc, value_mean, return_stats, backend)``
    with every argument positional (``scale=None`` for the default, ``backend=""`` for
    automatic), returning ``(out, kept, v_rows, dropped_mass)`` (stats empty when not
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
    # Validate here, before the custom-op dispatcher coerces types (a list query, vmc=1) or
    # replaces our messages with schema errors; the op validates again for direct callers.
    make_inputs(
        query, key_cache, value_cache, seq_lens, thresholds, scale=scale, placement=placement,
        sdc=sdc, sdc_gamma=sdc_gamma, sdc_table=sdc_table, vmc=vmc, value_mean=value_mean,
        return_stats=return_stats,
    )
    out, kept, v_rows, dropped = decode_attention_op(
        query, key_cache, value_cache, seq_lens, thresholds, scale, placement, sdc, sdc_gamma,
        sdc_table, vmc, value_mean, return_stats, backend or "",
    )
    if return_stats is True:
        return out, DecodeStats(kept, v_rows, dropped)
    return out
