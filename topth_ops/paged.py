"""Paged KV-cache helpers: building paged caches, writing tokens, and the maintained V sum.

A paged cache stores positions in fixed-size blocks addressed by a block table (vLLM,
FlashInfer, IncrementalFlashAttention's page attention): position j of sequence b lives
at slot ``j % block_size`` of block ``block_table[b, j // block_size]``. Layouts:
``"NHD"`` ``[num_blocks, block_size, num_kv_heads, head_dim]``, ``"HND"``
``[num_blocks, num_kv_heads, block_size, head_dim]`` and ``"VLLM_AMX"`` (HND dims, each block
and head packed as vLLM's AMX cache: :mod:`topth_ops.packed`).

V-mean compensation (paper section 3.2.2) needs mean_{j<n} v_j per (sequence, KV head).
Recomputing it from the cache reads every V row, O(n x head_dim) per step, which erases
the saving of reading only the kept rows. Instead a per-block V sum
``[num_blocks, num_kv_heads, head_dim]`` float32 is updated when tokens are written
(:class:`PagedValueSum`) and the mean is assembled from it in O(blocks x head_dim)
(:func:`paged_value_mean`).
"""

from __future__ import annotations

import numbers
from typing import Optional

import numpy as np
import torch

from . import packed
from .validation import (LAYOUT_DIMS, PAGED_LAYOUTS, cache_dims, check_block_table_values, require_choice,
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


def _check_slots(slot_mapping: torch.Tensor, tokens: int, num_slots: Optional[int] = None,
                 unique: bool = False) -> torch.Tensor:
    """int64 slots; on CPU (no device sync) also: below ``num_slots`` and, with ``unique``, no
    non-negative slot twice."""
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype not in _INDEX_DTYPES:
        raise TypeError("slot_mapping must be an int32/int64 tensor of shape [num_tokens]")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != tokens:
        raise ValueError(f"slot_mapping must have shape [{tokens}] (one slot per token), "
                         f"got {list(slot_mapping.shape)}")
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


class PagedValueSum:
    """Per-block V sums ``[num_blocks, num_kv_heads, head_dim]`` float32, kept equal to the
    sum of each block's written V rows while tokens are written, so that VMC's mean costs
    O(blocks x head_dim) instead of reading every V row (paper section 3.2.2).

    Blocks fill from offset 0 in order, and a serving engine may rewrite a slot it has
    already written (vLLM recomputes a prompt's last token into its shared, already counted
    block after a full prefix-cache hit). So each block also records how many of its
    leading slots the sum holds (``fill``): a write at offset 0 starts the block afresh
    (a freed and reallocated block forgets its old rows), writes at ``fill``, ``fill + 1``,
    ... add their rows. A write at an offset below ``fill`` (a counted slot overwritten in
    place) re-sums that block from the cache with the new rows in place, never by
    subtracting the old row; rows out of order (a gap) mark the block unknown.
    Blocks only read (shared prefix blocks) keep their sums.

    Requests are isolated from what earlier users of a block left there: the old contents
    of a slot (never-written memory, another request's NaN or inf row) reach no sum except
    through a slot that the sum counts, and :meth:`mean` with ``value_cache`` re-sums from
    the cache any block whose ``fill`` is not the number of rows the sequence uses there.
    Each update costs O(new tokens x num_kv_heads x head_dim), plus O(block_size x
    num_kv_heads x head_dim) per block with a rewritten slot. Writes that bypass
    :meth:`update` (e.g. blocks loaded from an offload tier) are not seen: call
    :meth:`update` for them too, or build a new PagedValueSum. Whether a block needs the
    slow path is decided on the host (one device sync per call on accelerators).

    Parameters
    ----------
    num_blocks, block_size, num_kv_heads, head_dim : int
        The paged cache's shape.
    kv_layout : {"NHD", "HND", "VLLM_AMX"}
        Layout of the value cache passed to :meth:`update`.
    device : torch.device, optional

    Raises
    ------
    TypeError, ValueError
        A size that is not an int >= 1, or an unknown layout.

    Attributes
    ----------
    sum : torch.Tensor
        ``[num_blocks, num_kv_heads, head_dim]`` float32.
    fill : torch.Tensor
        ``[num_blocks]`` int64: leading slots of each block counted in ``sum``; -1 where
        the rows did not arrive in order (``sum`` not trusted until the next write at
        offset 0).
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *,
                 kv_layout: str = "NHD", device: Optional[torch.device] = None):
        require_choice("kv_layout", kv_layout, PAGED_LAYOUTS)
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim)):
            _positive_int(name, v)
        if kv_layout == "VLLM_AMX":
            packed.check_dims(block_size, head_dim)
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
            A bad slot_mapping (on CPU tensors also: a slot past the pool, or a slot twice),
            rows whose heads / head_dim differ from the sums', or a value cache whose shape in
            ``kv_layout`` is not the sums' (num_blocks, block_size, heads, head_dim).
        """
        nb, heads, head_dim = self.sum.shape
        self._check_cache(value_cache)
        _check_rows("value", value, heads, head_dim, "this PagedValueSum")
        slots = _check_slots(slot_mapping, value.shape[0], nb * self.block_size, unique=True)
        ok = slots >= 0
        blk, off = slots[ok] // self.block_size, slots[ok] % self.block_size
        new = value[ok].to(value_cache.dtype).to(torch.float32)
        starts = blk[off == 0]
        self.sum[starts] = 0.0
        self.fill[starts] = 0
        rewritten = off < self.fill[blk]  # slots already counted: their old row is in the sum
        if bool(rewritten.any()):
            redo = torch.zeros(nb, dtype=torch.bool, device=blk.device)
            redo[blk[rewritten]] = True
            fresh = ~redo[blk]
            self._resum(value_cache, blk[~fresh], off[~fresh], new[~fresh], redo.nonzero().flatten())
            blk, off, new = blk[fresh], off[fresh], new[fresh]
        # never a product with the old row: 0 x NaN of a slot's old contents would be NaN
        self.sum.index_add_(0, blk, new)
        # A block's rows must arrive in order: the new rows of a block are the slots fill,
        # fill + 1, ... exactly. Anything else (a gap, or appending after slot 0 was
        # rewritten and restarted the block) marks it unknown (fill -1) until its next write
        # at offset 0; :meth:`mean` with the value cache re-sums such a block.
        if blk.numel():
            cnt = torch.zeros(nb, dtype=torch.int64, device=blk.device).index_add_(0, blk, torch.ones_like(blk))
            lo = torch.full((nb,), self.block_size, dtype=torch.int64, device=blk.device)
            lo.scatter_reduce_(0, blk, off, reduce="amin")
            hi = torch.full((nb,), -1, dtype=torch.int64, device=blk.device).scatter_reduce_(0, blk, off, reduce="amax")
            touched = cnt > 0
            in_order = touched & (lo == self.fill) & (hi == self.fill + cnt - 1)
            self.fill = torch.where(in_order, hi + 1, torch.where(touched, -1, self.fill))

    def _resum(self, value_cache: torch.Tensor, blk: torch.Tensor, off: torch.Tensor, new: torch.Tensor,
               blocks: torch.Tensor) -> None:
        """Set the sums of ``blocks`` to the sum of their first ``fill`` slots (grown by the
        new rows) as the cache will hold them once ``new`` is written at ``(blk, off)``."""
        rows = self._block_rows(value_cache, blocks)
        where = torch.full((self.num_blocks,), -1, dtype=torch.int64, device=blocks.device)
        where[blocks] = torch.arange(blocks.numel(), device=blocks.device)
        rows[where[blk], off] = new
        self.fill.scatter_reduce_(0, blk, off + 1, reduce="amax")
        self.sum[blocks] = self._leading_sum(rows, self.fill[blocks])

    def mean(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
             value_cache: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``value_mean`` for :func:`topth_ops.decode_attention`: ``[batch, num_kv_heads,
        head_dim]`` float32, mean_{j<n} v_j (paper section 3.2.2).

        Parameters
        ----------
        block_table : torch.Tensor
            ``[batch, max_blocks_per_seq]`` int32.
        seq_lens : torch.Tensor
            ``[batch]`` int32/int64.
        value_cache : torch.Tensor, optional
            The value cache in ``kv_layout``. When given, a used block whose ``fill`` is
            not the number of rows the sequence uses in it (rows written past the
            sequence's end, or slots never written through :meth:`update`) is summed from
            the cache rows the sequence uses, so the mean is always that of the cache's
            rows 0..n-1; without it the sums are trusted (:func:`paged_value_mean`).

        Raises
        ------
        TypeError, ValueError
            As :func:`paged_value_mean`; a value cache whose shape is not this sum's.
        """
        mean = paged_value_mean(self.sum, block_table, seq_lens, self.block_size)
        if value_cache is None:
            return mean
        self._check_cache(value_cache)
        bs, nb = self.block_size, self.num_blocks
        n = seq_lens.to(torch.int64)
        first = torch.arange(block_table.shape[1], device=n.device)[None, :] * bs
        uses = (n[:, None] - first).clamp(0, bs)  # rows of each table entry the sequence uses
        idx = block_table.to(torch.int64).clamp(0, nb - 1)
        off = uses > 0
        stale = off & (self.fill[idx] != uses)
        if not bool(stale.any()):
            return mean
        b, m = stale.nonzero(as_tuple=True)
        exact = self._leading_sum(self._block_rows(value_cache, idx[b, m]), uses[b, m])
        # replaced, never corrected by subtraction: a stale sum may hold another request's NaN
        total = torch.where((off & ~stale)[:, :, None, None], self.sum[idx], 0.0).sum(1).index_add_(0, b, exact)
        return total / n.clamp(min=1).to(torch.float32)[:, None, None]

    def _block_rows(self, value_cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """The V rows of ``blocks`` as ``[len(blocks), block_size, num_kv_heads, head_dim]``
        float32 (a copy, whatever the layout)."""
        rows = value_cache[blocks]
        if self.kv_layout == "VLLM_AMX":
            rows = packed.unpack(rows, "value")
        return (rows if self.kv_layout == "NHD" else rows.transpose(1, 2)).to(torch.float32)

    def _leading_sum(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Sum of the first ``counts[i]`` slots of ``rows[i]`` ``[k, block_size, H, D]``, selected
        with ``where`` (the other slots may hold NaN): ``[k, H, D]``."""
        first = torch.arange(self.block_size, device=rows.device)[None, :] < counts[:, None]
        return torch.where(first[:, :, None, None], rows, 0.0).sum(1)

    def _check_cache(self, value_cache: torch.Tensor) -> None:
        nb, heads, head_dim = self.sum.shape
        want = (nb, self.block_size, heads, head_dim) if self.kv_layout == "NHD" else (nb, heads, self.block_size,
                                                                                       head_dim)
        require_tensor("value_cache", value_cache)
        if not value_cache.is_floating_point():
            raise TypeError(f"value_cache must be a floating-point tensor (the V rows), got "
                            f"{str(value_cache.dtype).replace('torch.', '')}")
        if value_cache.device != self.sum.device:
            raise ValueError(f"value_cache must be on this PagedValueSum's device {self.sum.device}, "
                             f"got {value_cache.device}")
        if tuple(value_cache.shape) != want:
            raise ValueError(f"value_cache must have shape [{', '.join(map(str, want))}] ({self.kv_layout} "
                             f"{LAYOUT_DIMS[self.kv_layout]} of this PagedValueSum), got {shape_str(value_cache)}")


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

    Raises
    ------
    TypeError, ValueError
        Wrong types, dtypes or shapes (as :func:`topth_ops.decode_attention` names them);
        on CPU tensors also ``seq_lens`` outside ``[0, max_blocks_per_seq * block_size]``
        or used ``block_table`` entries outside ``[0, num_blocks)``.
    """
    _positive_int("block_size", block_size)
    require_tensor("value_sum", value_sum)
    require_rank("value_sum", value_sum, 3, "[num_blocks, num_kv_heads, head_dim]")
    require_tensor("block_table", block_table)
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table dtype must be int32, got {str(block_table.dtype).replace('torch.', '')}")
    require_rank("block_table", block_table, 2, "[batch, max_blocks_per_seq]")
    _index_tensor("seq_lens", seq_lens, "valid lengths")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != block_table.shape[0]:
        raise ValueError(f"seq_lens must have shape [{block_table.shape[0]}] (block_table dim 0), "
                         f"got {shape_str(seq_lens)}")
    capacity = block_table.shape[1] * block_size
    if values_checkable(seq_lens) and seq_lens.numel():
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        if lo < 0 or hi > capacity:
            raise ValueError(f"seq_lens values must lie in [0, {capacity}] (max_blocks_per_seq "
                             f"{block_table.shape[1]} x block_size {block_size}), got min {lo}, max {hi}")
        if values_checkable(block_table):
            check_block_table_values(block_table, seq_lens, block_size, value_sum.shape[0], "value_sum dim 0")
    n = seq_lens.to(torch.int64)
    M = block_table.shape[1]
    used = torch.arange(M, device=block_table.device)[None, :] < ((n + block_size - 1) // block_size)[:, None]
    idx = torch.where(used, block_table.to(torch.int64).clamp(0, value_sum.shape[0] - 1), 0)
    # where, not a product: an unused entry reads block 0, whose sum may be another request's NaN
    sums = torch.where(used[:, :, None, None], value_sum[idx], 0.0).sum(1)  # [B, Hkv, D]
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
