"""V-mean compensation's per-block V sums for paged caches (paper section 3.2.2).

VMC needs mean_{j<n} v_j per (sequence, KV head). Recomputing it from the cache reads every
V row, O(n x head_dim) per step, which erases the saving of reading only the kept rows.
Instead a per-block V sum ``[num_blocks, num_kv_heads, head_dim]`` float32 is updated when
tokens are written (:class:`PagedValueSum`) and the mean is assembled from it in
O(blocks x head_dim) (:func:`paged_value_mean`). On CPU tensors both run as one pass of the
compiled CPU kernel module (cpu_kernels/src/value_sum.cpp) when it is built.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import packed
from .codes import DType
from .cpu_kernels import extension_with
from .paged import _check_rows, _check_slot_tensor, _check_slots, _index_tensor, _positive_int
from .validation import (LAYOUT_DIMS, PAGED_LAYOUTS, check_block_table_values, require_choice, require_rank,
                         require_tensor, shape_str, values_checkable)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: :class:`PagedValueSum` runs :meth:`~PagedValueSum.update` and :meth:`~PagedValueSum.mean`
#: on CPU tensors as one pass of the compiled CPU kernel module when it is built (same sums;
#: every unusual case, bad values included, goes to the torch path). False: the torch path
#: always (the reference; the tests run both).
FUSED_CPU = True


def _fused_module():
    """The compiled module when the fused path applies, else None."""
    return extension_with("value_sum_update") if FUSED_CPU else None



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
        offset 0). An update may change it in place or replace it: read the attribute.
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
        _check_slot_tensor(slot_mapping, value.shape[0])
        if self._fused_update(value_cache, value, slot_mapping):
            return
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

    def _fused_update(self, value_cache: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
        """:meth:`update` in one compiled pass when everything is on the CPU; False: not
        done (nothing changed), the torch path runs (and raises for bad values)."""
        mod = self._fused(value_cache)
        if mod is None or value.device.type != "cpu" or slot_mapping.device.type != "cpu":
            return False
        rows = value.to(value_cache.dtype)  # summed as the cache stores them
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        sums, fill = self.sum, self.fill  # held for the call (it runs without the GIL)
        return mod.value_sum_update(sums.data_ptr(), fill.data_ptr(), self._dims(), rows.data_ptr(),
                                    int(DType.of(rows.dtype)), (0, rows.stride(0), rows.stride(1)),
                                    slot_mapping.data_ptr(), slot_mapping.stride(0),
                                    slot_mapping.dtype == torch.int64, rows.shape[0]) == 0

    def _fused(self, value_cache: Optional[torch.Tensor]):
        """The compiled module when the fused path can read ``value_cache`` (None: no cache
        read) and this sum's state (float32 ``sum``, int64 ``fill``, both contiguous on the
        CPU), else None."""
        mod = _fused_module()
        cache_ok = value_cache is None or (value_cache.dtype in _FLOAT_DTYPES and value_cache.stride(-1) == 1)
        if (mod is None or not cache_ok or self.sum.device.type != "cpu" or self.kv_layout == "VLLM_AMX"
                or self.sum.dtype != torch.float32 or self.fill.dtype != torch.int64
                or self.fill.device.type != "cpu" or not (self.sum.is_contiguous() and self.fill.is_contiguous())):
            return None
        return mod

    def _dims(self) -> tuple[int, int, int, int]:
        nb, heads, head_dim = self.sum.shape
        return nb, self.block_size, heads, head_dim

    def _cache_strides(self, value_cache: torch.Tensor) -> tuple[int, int, int]:
        """(block, slot, head) strides of ``value_cache`` in elements."""
        s = value_cache.stride()
        return (s[0], s[1], s[2]) if self.kv_layout == "NHD" else (s[0], s[2], s[1])

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
        _check_table_and_lens(block_table, seq_lens)
        if value_cache is not None:
            self._check_cache(value_cache)
        fused = self._fused_mean(block_table, seq_lens, value_cache)
        if fused is not None:
            return fused
        mean = paged_value_mean(self.sum, block_table, seq_lens, self.block_size)
        if value_cache is None:
            return mean
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

    def _fused_mean(self, block_table, seq_lens, value_cache: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """:meth:`mean` in one compiled pass when everything is on the CPU; None: the
        torch path runs (and raises for bad arguments)."""
        mod = self._fused(value_cache)
        if mod is None or block_table.device.type != "cpu" or seq_lens.device.type != "cpu":
            return None
        B, M = block_table.shape
        out = torch.empty(B, self.sum.shape[1], self.sum.shape[2], dtype=torch.float32)
        cache = (0, 0, (0, 0, 0)) if value_cache is None else (
            value_cache.data_ptr(), int(DType.of(value_cache.dtype)), self._cache_strides(value_cache))
        sums, fill = self.sum, self.fill  # held for the call (it runs without the GIL)
        rc = mod.value_sum_mean(sums.data_ptr(), fill.data_ptr(), self._dims(), block_table.data_ptr(),
                                block_table.stride(0), block_table.stride(1), B, M, seq_lens.data_ptr(),
                                seq_lens.stride(0), seq_lens.dtype == torch.int64, *cache, out.data_ptr())
        return out if rc == 0 else None

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


def _check_table_and_lens(block_table, seq_lens) -> None:
    """block_table int32 ``[batch, max_blocks_per_seq]`` and seq_lens int32/int64 ``[batch]``
    (types and shapes, not values)."""
    require_tensor("block_table", block_table)
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table dtype must be int32, got {str(block_table.dtype).replace('torch.', '')}")
    require_rank("block_table", block_table, 2, "[batch, max_blocks_per_seq]")
    _index_tensor("seq_lens", seq_lens, "valid lengths")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != block_table.shape[0]:
        raise ValueError(f"seq_lens must have shape [{block_table.shape[0]}] (block_table dim 0), "
                         f"got {shape_str(seq_lens)}")


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
    _check_table_and_lens(block_table, seq_lens)
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
