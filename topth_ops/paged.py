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
(:class:`PagedValueSum`) and the mean is assembled from it in O(blocks x head_dim)
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


class PagedValueSum:
    """Per-block V sums ``[num_blocks, num_kv_heads, head_dim]`` float32, kept equal to the
    sum of each block's written V rows while tokens are written, so that VMC's mean costs
    O(blocks x head_dim) instead of reading every V row (paper section 3.2.2).

    Blocks fill from offset 0 in order, and a serving engine may rewrite a slot it has
    already written (vLLM recomputes a prompt's last token into its shared, already counted
    block after a full prefix-cache hit). So each block also records how many of its
    leading slots the sum holds (``fill``): a write at offset 0 starts the block afresh
    (a freed and reallocated block forgets its old rows), a write at an offset below
    ``fill`` replaces that slot's old row (subtracted, read from the cache before the
    write), other writes add. Blocks only read (shared prefix blocks) keep their sums.
    Each update costs O(new tokens x num_kv_heads x head_dim).

    Parameters
    ----------
    num_blocks, block_size, num_kv_heads, head_dim : int
        The paged cache's shape.
    kv_layout : {"NHD", "HND"}
        Layout of the value cache passed to :meth:`update`.
    device : torch.device, optional

    Attributes
    ----------
    sum : torch.Tensor
        ``[num_blocks, num_kv_heads, head_dim]`` float32.
    fill : torch.Tensor
        ``[num_blocks]`` int64: leading slots of each block counted in ``sum``.
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *,
                 kv_layout: str = "NHD", device: Optional[torch.device] = None):
        require_choice("kv_layout", kv_layout, PAGED_LAYOUTS)
        self.block_size = int(block_size)
        self.kv_layout = kv_layout
        self.sum = torch.zeros(num_blocks, num_kv_heads, head_dim, dtype=torch.float32, device=device)
        self.fill = torch.zeros(num_blocks, dtype=torch.int64, device=device)

    @property
    def num_blocks(self) -> int:
        return self.sum.shape[0]

    def update(self, value_cache: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Account for new V rows about to be written; call it BEFORE writing the cache.

        Parameters
        ----------
        value_cache : torch.Tensor
            The paged value cache in ``kv_layout``, still holding the old rows of the
            slots about to be written.
        value : torch.Tensor
            ``[num_tokens, num_kv_heads, head_dim]``: the new rows, summed as the cache's
            dtype stores them.
        slot_mapping : torch.Tensor
            ``[num_tokens]`` int32/int64 flat slots ``block * block_size + offset``;
            negative slots (vLLM's padding, -1) are skipped; no slot twice in one call.

        Raises
        ------
        TypeError, ValueError
            A bad slot_mapping, or rows whose heads / head_dim differ from the sums'.
        """
        slots = _check_slots(slot_mapping, value.shape[0])
        if value.dim() != 3 or tuple(value.shape[1:]) != tuple(self.sum.shape[1:]):
            raise ValueError(f"value must have shape [num_tokens, {self.sum.shape[1]}, {self.sum.shape[2]}], "
                             f"got {list(value.shape)}")
        ok = slots >= 0
        blk, off = slots[ok] // self.block_size, slots[ok] % self.block_size
        new = value[ok].to(value_cache.dtype).to(torch.float32)
        starts = blk[off == 0]
        self.sum[starts] = 0.0
        self.fill[starts] = 0
        counted = (off < self.fill[blk]).to(torch.float32)[:, None, None]
        rows = value_cache[blk, off] if self.kv_layout == "NHD" else value_cache[blk, :, off]
        self.sum.index_add_(0, blk, new - rows.to(torch.float32) * counted)
        self.fill.scatter_reduce_(0, blk, off + 1, reduce="amax")

    def mean(self, block_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """``value_mean`` for :func:`topth_ops.decode_attention`: ``[batch, num_kv_heads,
        head_dim]`` float32 (see :func:`paged_value_mean`)."""
        return paged_value_mean(self.sum, block_table, seq_lens, self.block_size)


def paged_value_mean(value_sum: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     block_size: int) -> torch.Tensor:
    """mean_{j<n} v_j per (sequence, KV head) from the per-block V sums, the ``value_mean``
    argument of :func:`topth_ops.decode_attention`; costs O(blocks x head_dim).

    Parameters
    ----------
    value_sum : torch.Tensor
        ``[num_blocks, num_kv_heads, head_dim]`` float32 (:attr:`PagedValueSum.sum`).
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
