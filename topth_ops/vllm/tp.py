"""Tensor-parallel slicing of threshold tables: the rows of one layer that a rank's query
heads (selection "head") or KV heads ("group") read. Nothing here imports vLLM."""

from __future__ import annotations

import torch


def rank_rows(table: torch.Tensor, layer: int, tp_rank: int, num_local_heads: int) -> torch.Tensor:
    """The rows of one layer that a tensor-parallel rank's query heads read.

    vLLM's tensor parallelism gives rank r the query heads
    ``[r * num_local_heads, (r + 1) * num_local_heads)`` (column-parallel QKV projection).

    Parameters
    ----------
    table : torch.Tensor
        ``[num_layers, num_q_heads, max_row_id]`` (thresholds or sdc_table of a file).
    layer : int
    tp_rank : int
    num_local_heads : int

    Returns
    -------
    torch.Tensor
        float32 contiguous ``[num_local_heads, max_row_id]``.

    Raises
    ------
    ValueError
        Layer or rank out of range for the table.
    """
    L, H, _ = table.shape
    lo = tp_rank * num_local_heads
    if not 0 <= layer < L:
        raise ValueError(f"layer {layer} out of range: the threshold file has {L} layers")
    if tp_rank < 0 or num_local_heads < 1 or lo + num_local_heads > H:
        raise ValueError(f"rank {tp_rank} with {num_local_heads} heads per rank needs query heads "
                         f"[{lo}, {lo + num_local_heads}), but the table has {H}")
    return table[layer, lo:lo + num_local_heads].to(torch.float32).contiguous()


def rank_kv_rows(table: torch.Tensor, layer: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The rows of one layer that a tensor-parallel rank's KV heads read (group-selection
    files: one threshold per KV head, compared with the group maximum).

    vLLM gives rank r the KV heads ``[r * Hkv / tp, (r + 1) * Hkv / tp)`` when
    ``Hkv >= tp``, and replicates them otherwise: rank r then holds KV head
    ``r * Hkv // tp`` (``tp`` a multiple of ``Hkv``). Both are ``lo = r * Hkv // tp``.

    Parameters
    ----------
    table : torch.Tensor
        ``[num_layers, num_kv_heads, max_row_id]`` (thresholds of a group-selection file).
    layer, tp_rank, tp_size : int

    Returns
    -------
    torch.Tensor
        float32 contiguous ``[max(1, num_kv_heads // tp_size), max_row_id]``.

    Raises
    ------
    ValueError
        Layer or rank out of range, or ``tp_size`` neither a divisor nor a multiple of the
        KV head count.
    """
    L, H, _ = table.shape
    if not 0 <= layer < L:
        raise ValueError(f"layer {layer} out of range: the threshold file has {L} layers")
    if tp_size < 1 or not 0 <= tp_rank < tp_size or (H % tp_size and tp_size % H):
        raise ValueError(f"tensor-parallel rank {tp_rank} of {tp_size}: tp_size must divide the {H} KV heads "
                         f"or be a multiple of them (group-selection threshold rows are per KV head)")
    n = max(1, H // tp_size)
    lo = tp_rank * H // tp_size
    return table[layer, lo:lo + n].to(torch.float32).contiguous()
