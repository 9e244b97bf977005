"""vLLM CPU_ATTN's AMX cache layout, ``kv_layout="VLLM_AMX"``.

vLLM's CPU attention keeps one cache per layer ``[num_blocks, num_kv_heads, block_size,
2 * head_dim]`` and views it as ``[num_blocks, num_kv_heads, 2 * block_size, head_dim]``
split in two along dim 2: per block and KV head, a K region and then a V region of
``block_size * head_dim`` elements each. Where it runs its AMX kernels (bfloat16, block size a
multiple of 32), its writer ``cpu_attn_reshape_and_cache`` packs each region for the tile
instructions instead of storing rows:

- K as ``[block_size / 16, head_dim / 2, 16, 2]``: per group of 16 slots, for each pair of
  dims, the 16 slots' two values (the VNNI B tile of ``Q . K^T``);
- V as ``[head_dim / 16, block_size / 2, 16, 2]``: per group of 16 dims, for each pair of
  slots, the 16 dims' two values (the VNNI B tile of ``P . V``).

The op takes the two views vLLM passes to its own kernel (shape ``[num_blocks,
num_kv_heads, block_size, head_dim]``, each block and head's region contiguous) and reads
element ``(slot, d)`` of a region at the offsets below. (vLLM's other CPU layouts need no
new layout: with its vector ISA, K is stored transposed per block, ``[head_dim,
block_size]``, which is an HND view with strides ``(slot 1, dim block_size)``, and V as rows.)
"""

from __future__ import annotations

import functools

import torch

BLOCK_MULTIPLE = 32
"""Block sizes of the layout are multiples of this (vLLM's AMX kernels)."""
HEAD_DIM_MULTIPLE = 32
"""head_dim of the layout is a multiple of this (one tile's depth)."""


@functools.lru_cache(maxsize=32)
def _offsets(block_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    slot = torch.arange(block_size)[:, None]
    d = torch.arange(head_dim)[None, :]
    koff = ((slot // 16) * (head_dim // 2) + d // 2) * 32 + (slot % 16) * 2 + d % 2
    voff = (d // 16) * (block_size * 16) + (slot // 2) * 32 + (d % 16) * 2 + slot % 2
    return koff.reshape(-1), voff.reshape(-1)


def offsets(block_size: int, head_dim: int, kind: str, device=None) -> torch.Tensor:
    """Element offset of ``(slot, d)`` inside one block and head's region, flattened
    ``[block_size * head_dim]`` int64 in ``(slot, d)`` order.

    Parameters
    ----------
    block_size, head_dim : int
        Multiples of :data:`BLOCK_MULTIPLE` and :data:`HEAD_DIM_MULTIPLE`.
    kind : {"key", "value"}
    device : torch.device, optional

    Raises
    ------
    ValueError
        A block size or head_dim the layout does not have, or another ``kind``.
    """
    check_dims(block_size, head_dim)
    check_kind(kind)
    return _cached(block_size, head_dim, kind, device).clone()


def check_kind(kind: str) -> None:
    """Raises ValueError unless ``kind`` is "key" or "value"."""
    if kind not in ("key", "value"):
        raise ValueError(f"kind must be 'key' or 'value', got {kind!r}")


def _cached(block_size: int, head_dim: int, kind: str, device=None) -> torch.Tensor:
    """:func:`offsets` without the checks and the copy (the cached tensor: not to be modified)."""
    koff, voff = _offsets(int(block_size), int(head_dim))
    off = koff if kind == "key" else voff
    return off if device is None else off.to(device)


def check_dtype(name: str, t: torch.Tensor) -> None:
    """Raises TypeError unless ``t`` (a cache or rows for one) is bfloat16."""
    if t.dtype != torch.bfloat16:
        raise TypeError(f"kv_layout='VLLM_AMX' (vLLM's AMX cache) holds bfloat16, got {name} dtype "
                        f"{str(t.dtype).replace('torch.', '')}")


def check_dims(block_size: int, head_dim: int) -> None:
    """Raises ValueError unless ``block_size`` and ``head_dim`` fit the layout."""
    if block_size % BLOCK_MULTIPLE or head_dim % HEAD_DIM_MULTIPLE:
        raise ValueError(f"kv_layout='VLLM_AMX' needs block_size a multiple of {BLOCK_MULTIPLE} and head_dim a "
                         f"multiple of {HEAD_DIM_MULTIPLE} (vLLM's AMX cache), got block_size {block_size}, "
                         f"head_dim {head_dim}")


def unpack(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """Rows ``[..., block_size, head_dim]`` (a new tensor) of packed regions ``blocks``
    (``[..., block_size, head_dim]``, each region as vLLM's writer left it).

    Raises ValueError for a ``kind`` other than "key" / "value" or sizes the layout lacks."""
    *lead, bs, d = blocks.shape
    check_kind(kind)
    check_dims(bs, d)
    flat = blocks.reshape(*lead, bs * d)
    return flat[..., _cached(bs, d, kind, flat.device)].reshape(*lead, bs, d)


def pack(rows: torch.Tensor, kind: str) -> torch.Tensor:
    """The inverse of :func:`unpack`: regions ``[..., block_size, head_dim]`` holding ``rows``
    in the layout's order.

    Raises ValueError for a ``kind`` other than "key" / "value" or sizes the layout lacks."""
    *lead, bs, d = rows.shape
    check_kind(kind)
    check_dims(bs, d)
    out = torch.empty(*lead, bs * d, dtype=rows.dtype, device=rows.device)
    out[..., _cached(bs, d, kind, rows.device)] = rows.reshape(*lead, bs * d)
    return out.reshape(*lead, bs, d)
