"""Paged KV-cache helpers: building paged caches, writing tokens, and the maintained V sum.

A paged cache stores positions in fixed-size blocks addressed by a block table (vLLM,
FlashInfer, IncrementalFlashAttention's page attention): position j of sequence b lives
at slot ``j % block_size`` of block ``block_table[b, j // block_size]``. Layouts:
``"NHD"`` ``[num_blocks, block_size, num_kv_heads, head_dim]``, ``"HND"``
``[num_blocks, num_kv_heads, block_size, head_dim]`` and ``"VLLM_AMX"`` (HND dims, each block
and head packed as vLLM's AMX cache: :mod:`topth_ops.packed`).

VMC's per-block V sums, maintained as tokens are written, are in :mod:`topth_ops.value_sum`.
"""

from __future__ import annotations

import numbers
from typing import Optional

import numpy as np
import torch

from . import packed
from .validation import (LAYOUT_DIMS, PAGED_LAYOUTS, cache_dims, require_choice,
                         require_rank, require_tensor, shape_str, values_checkable)

_INDEX_DTYPES = (torch.int32, torch.int64)
def _positive_int(name: str, value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 1, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value}")
    return int(value)


def _index_tensor(name: str, t, what: str) -> torch.Tensor:
    require_tensor(name, t)
    if t.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} dtype must be int32 or int64 ({what}), got {str(t.dtype).replace('torch.', '')}")
    return t


def _paged_cache(name: str, cache, kv_layout: str) -> tuple[int, int, int, int]:
    """(num_blocks, num_kv_heads, block_size, head_dim) of a paged cache in ``kv_layout``."""
    require_tensor(name, cache)
    require_rank(name, cache, 4, f"{LAYOUT_DIMS[kv_layout]} (kv_layout={kv_layout!r})")
    return cache_dims(cache, kv_layout)


def _check_rows(name: str, rows, heads: int, head_dim: int, where: str) -> None:
    require_tensor(name, rows)
    if rows.dim() != 3 or tuple(rows.shape[1:]) != (heads, head_dim):
        raise ValueError(f"{name} must have shape [num_tokens, {heads}, {head_dim}] ([num_tokens, num_kv_heads, "
                         f"head_dim] of {where}), got {shape_str(rows)}")


def _check_slot_tensor(slot_mapping, tokens: int) -> None:
    """slot_mapping's type, dtype and shape ``[tokens]`` (not its values)."""
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype not in _INDEX_DTYPES:
        raise TypeError("slot_mapping must be an int32/int64 tensor of shape [num_tokens]")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != tokens:
        raise ValueError(f"slot_mapping must have shape [{tokens}] (one slot per token), "
                         f"got {list(slot_mapping.shape)}")


def _check_slots(slot_mapping: torch.Tensor, tokens: int, num_slots: Optional[int] = None,
                 unique: bool = False) -> torch.Tensor:
    """int64 slots; on CPU (no device sync) also: below ``num_slots`` and, with ``unique``, no
    non-negative slot twice."""
    _check_slot_tensor(slot_mapping, tokens)
    slots = slot_mapping.to(torch.int64)
    if num_slots is not None and tokens and values_checkable(slots):
        hi = int(slots.max())
        if hi >= num_slots:
            raise ValueError(f"slot_mapping values must be < num_blocks x block_size = {num_slots} (or negative: "
                             f"skipped), got {hi}")
        if unique:
            used = slots[slots >= 0]
            if used.unique().numel() != used.numel():
                raise ValueError("slot_mapping must not name a slot twice in one call (a PagedValueSum update "
                                 "counts each written row once)")
    return slots


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
    kv_layout : {"NHD", "HND", "VLLM_AMX"}

    Raises
    ------
    TypeError, ValueError
        Bad slot_mapping (on CPU tensors also: a slot past the pool), unknown layout, caches
        not 4-D in ``kv_layout`` or of different shapes, key / value not
        ``[num_tokens, num_kv_heads, head_dim]`` of the caches (no broadcasting).
    """
    require_choice("kv_layout", kv_layout, PAGED_LAYOUTS)
    num_blocks, heads, bs, head_dim = _paged_cache("key_cache", key_cache, kv_layout)
    _paged_cache("value_cache", value_cache, kv_layout)
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache shape must equal the key_cache shape {shape_str(key_cache)}, "
                         f"got {shape_str(value_cache)}")
    _check_rows("key", key, heads, head_dim, f"key_cache {kv_layout} {shape_str(key_cache)}")
    _check_rows("value", value, heads, head_dim, f"key_cache {kv_layout} {shape_str(key_cache)}")
    if key.shape[0] != value.shape[0]:
        raise ValueError(f"key and value must have the same shape, got {list(key.shape)} and {list(value.shape)}")
    slots = _check_slots(slot_mapping, key.shape[0], num_blocks * bs)
    ok = slots >= 0
    blk, off = slots[ok] // bs, slots[ok] % bs
    if kv_layout == "VLLM_AMX":
        packed.check_dims(bs, head_dim)
        packed.check_dtype("key_cache", key_cache)
    for kind, cache, new in (("key", key_cache, key[ok]), ("value", value_cache, value[ok])):
        if kv_layout == "NHD":
            cache[blk, off] = new.to(cache.dtype)
        elif kv_layout == "HND":
            cache[blk, :, off] = new.to(cache.dtype)
        else:  # the packed offsets of each token's slot, per KV head
            where = packed.offsets(bs, head_dim, kind, cache.device).view(bs, head_dim)[off]  # [tokens, D]
            flat = cache.view(num_blocks, heads, bs * head_dim)
            for h in range(heads):
                flat[blk[:, None], h, where] = new[:, h].to(cache.dtype)


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
    kv_layout : {"NHD", "HND", "VLLM_AMX"}
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

    Raises
    ------
    TypeError, ValueError
        key / value not BNSD tensors of one shape, seq_lens not int32/int64 ``[batch]`` (on
        CPU: values outside ``[0, max_seq_len]``), block_size not an int >= 1, too few
        num_blocks, unknown layout.
    """
    require_choice("kv_layout", kv_layout, PAGED_LAYOUTS)
    _positive_int("block_size", block_size)
    for name, t in (("key", key), ("value", value)):
        require_tensor(name, t)
        require_rank(name, t, 4, "[batch, num_kv_heads, max_seq_len, head_dim] (BNSD)")
    if value.shape != key.shape:
        raise ValueError(f"value shape must equal the key shape {shape_str(key)}, got {shape_str(value)}")
    B, H, S, D = key.shape
    if kv_layout == "VLLM_AMX":
        packed.check_dims(block_size, D)
        packed.check_dtype("key", key)
    _index_tensor("seq_lens", seq_lens, "valid lengths")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != B:
        raise ValueError(f"seq_lens must have shape [{B}] (key dim 0), got {shape_str(seq_lens)}")
    if values_checkable(seq_lens):
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        if lo < 0 or hi > S:
            raise ValueError(f"seq_lens values must lie in [0, {S}] (key dim 2, max_seq_len), got min {lo}, max {hi}")
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
        blocks = blocks[used]  # [need, bs, H, D] (NHD) or [need, H, bs, D] (HND, VLLM_AMX)
        if kv_layout == "VLLM_AMX":
            blocks = packed.pack(blocks, "key" if src is key else "value")
        pool = torch.full((total, *blocks.shape[1:]), fill if fill is not None else 0.0,
                          dtype=src.dtype, device=dev)
        pool[ids] = blocks
        caches.append(pool)
    return caches[0], caches[1], table
