"""Paged KV-cache helpers: building paged caches, writing tokens, and the maintained V sum.

A paged cache stores positions in fixed-size blocks addressed by a block table (vLLM,
FlashInfer, IncrementalFlashAttention's page attention): position j of sequence b lives
at slot ``j % block_size`` of block ``block_table[b, j // block_size]``. Layouts:
``"NHD"`` ``[num_blocks, block_size, num_kv_heads, head_dim]`` and ``"HND"``
``[num_blocks, num_kv_heads, block_size, head_dim]``.

V-mean compensation (paper section 3.2.2) needs mean_{j<n} v_j per (sequence, KV head).
Recomputing it from the cache reads every V row, O(n x head_dim) per step, which erases
the saving of reading only the kept rows. Instead a per-block V sum
``[num_blocks, num_kv_heads, head_dim]`` float32 is updated when tokens are written
(:func:`update_value_sum`) and the mean is assembled from it in O(blocks x head_dim)
(:func:`paged_value_mean`).
"""

from __future__ import annotations

from typing import Optional

import torch

from .validation import PAGED_LAYOUTS, require_choice


def _check_slots(slot_mapping: torch.Tensor, tokens: int) -> torch.Tensor:
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError("slot_mapping must be an int32/int64 tensor of shape [num_tokens]")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != tokens:
        raise ValueError(f"slot_mapping must have shape [{tokens}] (one slot per token), "
                         f"got {list(slot_mapping.shape)}")
    return slot_mapping.to(torch.int64)


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, slot_mapping: torch.Tensor, kv_layout: str = "NHD") -> None:
    """Write new tokens' keys and values into paged caches, in place.

    Parameters
    ----------
    key_cache, value_cache : torch.Tensor
        Paged caches in ``kv_layout``.
    key, value : torch.Tensor
        ``[num_tokens, num_kv_heads, head_dim]``, cast to the caches' dtype.
    slot_mapping : torch.Tensor
        ``[num_tokens]`` int32/int64: flat slot ``block * block_size + offset`` of each
        token; negative slots (vLLM's padding, -1) are skipped.
    kv_layout : {"NHD", "HND"}

    Raises
    ------
    TypeError, ValueError
        Bad slot_mapping, unknown layout, or shapes that do not match the caches.
    """
    require_choice("kv_layout", kv_layout, PAGED_LAYOUTS)
    slots = _check_slots(slot_mapping, key.shape[0])
    if key.shape != value.shape:
        raise ValueError(f"key and value must have the same shape, got {list(key.shape)} and {list(value.shape)}")
    bs = key_cache.shape[1] if kv_layout == "NHD" else key_cache.shape[2]
    ok = slots >= 0
    blk, off = slots[ok] // bs, slots[ok] % bs
    for cache, new in ((key_cache, key[ok]), (value_cache, value[ok])):
        if kv_layout == "NHD":
            cache[blk, off] = new.to(cache.dtype)
        else:
            cache[blk, :, off] = new.to(cache.dtype)


def new_value_sum(num_blocks: int, num_kv_heads: int, head_dim: int,
                  device: Optional[torch.device] = None) -> torch.Tensor:
    """A zeroed per-block V sum, ``[num_blocks, num_kv_heads, head_dim]`` float32."""
    return torch.zeros(num_blocks, num_kv_heads, head_dim, dtype=torch.float32, device=device)


def update_value_sum(value_sum: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                     block_size: int) -> None:
    """Add new tokens' V rows to the per-block V sum, in place.

    A block written at offset 0 is reset before the rows of this call are added: blocks
    fill from offset 0 in order, so a write there starts a block's (re)use, and a freed,
    reallocated block forgets its old rows. Blocks that are only read (shared prefix
    blocks) keep their sums. Rows must not be rewritten at other offsets.

    Parameters
    ----------
    value_sum : torch.Tensor
        ``[num_blocks, num_kv_heads, head_dim]`` float32.
    value : torch.Tensor
        ``[num_tokens, num_kv_heads, head_dim]``, any float dtype (summed in float32 as
        it was written: pass the cache-dtype value so the sum matches the cache).
    slot_mapping : torch.Tensor
        ``[num_tokens]`` int32/int64 flat slots; negative slots are skipped.
    block_size : int

    Raises
    ------
    TypeError, ValueError
        value_sum not float32 or of the wrong shape; bad slot_mapping.
    """
    if value_sum.dtype != torch.float32 or value_sum.dim() != 3 or value_sum.shape[1:] != value.shape[1:]:
        raise ValueError(f"value_sum must be float32 [num_blocks, {value.shape[1]}, {value.shape[2]}], "
                         f"got {value_sum.dtype} {list(value_sum.shape)}")
    slots = _check_slots(slot_mapping, value.shape[0])
    ok = slots >= 0
    blk, off = slots[ok] // block_size, slots[ok] % block_size
    value_sum[blk[off == 0]] = 0.0
    value_sum.index_add_(0, blk, value[ok].to(torch.float32))


def paged_value_mean(value_sum: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     block_size: int) -> torch.Tensor:
    """mean_{j<n} v_j per (sequence, KV head) from the per-block V sums, the ``value_mean``
    argument of :func:`topth_ops.decode_attention`; costs O(blocks x head_dim).

    Parameters
    ----------
    value_sum : torch.Tensor
        ``[num_blocks, num_kv_heads, head_dim]`` float32 (see :func:`update_value_sum`).
    block_table : torch.Tensor
        ``[batch, max_blocks_per_seq]`` int32.
    seq_lens : torch.Tensor
        ``[batch]`` int32/int64; the rows 0..n-1 of each sequence must have been written
        (and nothing past n in its last block).
    block_size : int

    Returns
    -------
    torch.Tensor
        ``[batch, num_kv_heads, head_dim]`` float32; zeros for n = 0.
    """
    n = seq_lens.to(torch.int64)
    M = block_table.shape[1]
    used = torch.arange(M, device=block_table.device)[None, :] < ((n + block_size - 1) // block_size)[:, None]
    idx = torch.where(used, block_table.to(torch.int64).clamp(0, value_sum.shape[0] - 1), 0)
    sums = (value_sum[idx] * used[:, :, None, None]).sum(1)  # [B, Hkv, D]
    return sums / n.clamp(min=1).to(torch.float32)[:, None, None]


def to_paged(key: torch.Tensor, value: torch.Tensor, seq_lens: torch.Tensor, block_size: int, *,
             kv_layout: str = "NHD", num_blocks: Optional[int] = None, shuffle: bool = True,
             generator: Optional[torch.Generator] = None, fill: Optional[float] = None):
    """Copy BNSD caches ``[batch, num_kv_heads, max_seq_len, head_dim]`` into paged caches.

    Every sequence gets ``ceil(max_seq_len / block_size)`` table slots; only the blocks
    its length needs are allocated, in random order when ``shuffle``; the rest of its
    table row is -1.

    Parameters
    ----------
    key, value : torch.Tensor
        BNSD caches.
    seq_lens : torch.Tensor
        ``[batch]`` valid lengths.
    block_size : int
    kv_layout : {"NHD", "HND"}
    num_blocks : int, optional
        Blocks in the pool (>= the blocks needed); default: exactly those needed, plus one.
    shuffle : bool
        Permute the block ids.
    fill : float, optional
        Value of every unallocated block and of slots past n (default: zeros).

    Returns
    -------
    key_cache, value_cache : torch.Tensor
        Paged caches in ``kv_layout``.
    block_table : torch.Tensor
        ``[batch, max_blocks_per_seq]`` int32.
    """
    require_choice("kv_layout", kv_layout, PAGED_LAYOUTS)
    B, H, S, D = key.shape
    dev = key.device
    M = -(-S // block_size)
    n = seq_lens.to(device=dev, dtype=torch.int64)
    used = torch.arange(M, device=dev)[None, :] < ((n + block_size - 1) // block_size)[:, None]
    need = int(used.sum())
    total = num_blocks if num_blocks is not None else need + 1
    if total < need:
        raise ValueError(f"num_blocks must be >= {need} (blocks needed), got {total}")
    ids = torch.randperm(total, generator=generator) if shuffle else torch.arange(total)
    ids = ids[:need].to(dev)
    table = torch.full((B, M), -1, dtype=torch.int32, device=dev)
    table[used] = ids.to(torch.int32)
    valid = (torch.arange(M * block_size, device=dev)[None, :] < n[:, None])[:, None, :, None]
    caches = []
    for src in (key, value):
        padded = torch.zeros(B, H, M * block_size, D, dtype=src.dtype, device=dev)
        padded[:, :, :S] = src
        if fill is not None:
            padded = torch.where(valid, padded, torch.tensor(fill, dtype=src.dtype, device=dev))
        blocks = padded.view(B, H, M, block_size, D)
        blocks = blocks.permute(0, 2, 3, 1, 4) if kv_layout == "NHD" else blocks.permute(0, 2, 1, 3, 4)
        blocks = blocks[used]  # [need, bs, H, D] (NHD) or [need, H, bs, D] (HND)
        pool = torch.full((total, *blocks.shape[1:]), fill if fill is not None else 0.0,
                          dtype=src.dtype, device=dev)
        pool[ids] = blocks
        caches.append(pool)
    return caches[0], caches[1], table
