"""Paged-cache pieces of the vLLM backend that need no vLLM: the NHD views of vLLM's
per-layer cache and the dense causal prefill over a paged cache (the per-block V sum,
kept correct under vLLM's slot rewrites, is :class:`topth_ops.value_sum.PagedValueSum`).

vLLM 0.32 gives each attention layer one cache tensor, logically ``[num_blocks,
num_kv_heads, block_size, 2 * head_dim]`` (K then V in the last dim). The backend asks
for the ``LBNHC`` physical layout, in which the block's tokens are outermost, so
``kv_cache.transpose(1, 2)`` is a ``[num_blocks, block_size, num_kv_heads, 2 * head_dim]``
view and its two halves are the K and V caches in the op's ``"NHD"`` layout (strided
views, read in place by :func:`topth_ops.decode_attention`).
"""

from __future__ import annotations


import torch



def nhd_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches ``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD) as views of
    vLLM's per-layer cache.

    Parameters
    ----------
    kv_cache : torch.Tensor
        ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (vLLM's logical shape).
    head_size : int

    Returns
    -------
    key_cache, value_cache : torch.Tensor
        Views sharing ``kv_cache``'s storage.

    Raises
    ------
    ValueError
        ``kv_cache`` is not 4-D with last dim ``2 * head_size``.
    """
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(f"kv_cache must be [num_blocks, num_kv_heads, block_size, {2 * head_size}], "
                         f"got {list(kv_cache.shape)}")
    kv = kv_cache.transpose(1, 2)
    return kv[..., :head_size], kv[..., head_size:]


def gather_sequence(cache: torch.Tensor, block_row: torch.Tensor, n: int) -> torch.Tensor:
    """Positions 0..n-1 of one sequence from an NHD cache: ``[n, num_kv_heads, head_dim]``.

    Parameters
    ----------
    cache : torch.Tensor
        NHD ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    block_row : torch.Tensor
        The sequence's block-table row; only its first ``ceil(n / block_size)`` entries are read.
    n : int
    """
    bs = cache.shape[1]
    nb = -(-n // bs)
    blocks = cache[block_row[:nb].to(torch.int64)]  # [nb, bs, H, D]
    return blocks.reshape(nb * bs, cache.shape[2], cache.shape[3])[:n]


def prefill_dense(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  block_row: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
    """Dense causal attention of one request's new tokens over its paged cache.

    The request has ``seq_len`` positions after this step, of which the last
    ``L = query.shape[0]`` are new (chunked prefill and prefix caching give
    ``seq_len > L``): new token i sits at position ``seq_len - L + i`` and attends to
    positions ``0 .. seq_len - L + i``.

    Parameters
    ----------
    query : torch.Tensor
        ``[L, num_q_heads, head_dim]``.
    key_cache, value_cache : torch.Tensor
        NHD caches holding positions 0..seq_len-1 (this step's tokens written).
    block_row : torch.Tensor
        The request's block-table row.
    seq_len : int
    scale : float

    Returns
    -------
    torch.Tensor
        ``[L, num_q_heads, head_dim]`` in the query dtype.
    """
    L, Hq, _ = query.shape
    k = gather_sequence(key_cache, block_row, seq_len).transpose(0, 1)  # [Hkv, n, D]
    v = gather_sequence(value_cache, block_row, seq_len).transpose(0, 1)
    group = Hq // k.shape[0]
    if group > 1:
        k = k.repeat_interleave(group, 0)
        v = v.repeat_interleave(group, 0)
    q = query.transpose(0, 1)  # [Hq, L, D]
    ctx = seq_len - L
    pos_q = torch.arange(L, device=query.device)[:, None] + ctx
    pos_k = torch.arange(seq_len, device=query.device)[None, :]
    mask = pos_k <= pos_q  # [L, n]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(0), k.to(q.dtype).unsqueeze(0), v.to(q.dtype).unsqueeze(0),
        attn_mask=mask, scale=scale)[0]
    return out.transpose(0, 1)
