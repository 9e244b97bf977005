"""Argument checks behind :func:`topth_ops.contract.make_inputs`.

Each check raises TypeError (wrong type or dtype) or ValueError (wrong shape, device or
value) with a message naming the argument and the expected value (docs/semantics.md,
"Errors"). Value checks that would read tensor data run only where that needs neither a
device sync nor a trace break (:func:`values_checkable`); elsewhere the backends clamp.
Scalar checks are skipped for symbolic scalars while ``torch.compile`` traces (the op
checks the concrete values when it runs), so the public API compiles with
``fullgraph=True`` and changing scalar arguments.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Optional

import numpy as np
import torch

from .cpu_kernels import extension_with
from .packed import check_dims, check_dtype

KV_LAYOUTS = ("BNSD", "NHD", "HND", "VLLM_AMX")
PAGED_LAYOUTS = ("NHD", "HND", "VLLM_AMX")
# Cache dims of each layout, as (name of each dim); BNSD is the contiguous-per-sequence cache.
LAYOUT_DIMS = {
    "BNSD": "[batch, num_kv_heads, max_seq_len, head_dim]",
    "NHD": "[num_blocks, block_size, num_kv_heads, head_dim]",
    "HND": "[num_blocks, num_kv_heads, block_size, head_dim]",
    "VLLM_AMX": "[num_blocks, num_kv_heads, block_size, head_dim] (each block and head packed as vLLM's AMX cache)",
}


def shape_str(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def dtype_str(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def require_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.layout != torch.strided:  # kernels read data pointers and strides
        raise TypeError(f"{name} must be a dense (torch.strided) tensor, got layout {value.layout}")
    return value


def require_rank(name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    if t.dim() != rank:
        raise ValueError(f"{name} must have shape {layout} ({rank} dims), got shape {shape_str(t)}")


def require_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def require_choice(name: str, value, choices: tuple) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def is_symbolic(value) -> bool:
    """A scalar that may be symbolic: a SymFloat / SymInt, or anything while dynamo traces
    (it reports a symbolic float's type as float)."""
    return isinstance(value, (torch.SymFloat, torch.SymInt)) or torch.compiler.is_compiling()


def require_real(name: str, value, *, positive: bool):
    """A finite real number (> 0 when ``positive``, else >= 0), returned as float.

    While ``torch.compile`` traces, the value may be symbolic (a float argument that
    changed between calls): only its type is checked there, since comparing it would
    break the graph; the op checks the concrete value when it runs.
    """
    if type(value) is float and not torch.compiler.is_compiling():  # the common case, without the ABC checks
        if math.isfinite(value) and (value > 0 if positive else value >= 0):
            return value
    # numbers.Real covers int, float and numpy's scalars; bools (numpy's too) are rejected.
    symbolic = is_symbolic(value)
    if isinstance(value, (bool, np.bool_)) or not (isinstance(value, numbers.Real) or symbolic):
        raise TypeError(f"{name} must be a real number (Python or numpy scalar), "
                        f"got {type(value).__name__} {value!r}")
    if symbolic:
        return value
    try:
        value = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a finite number, got an int too large for a float") from None
    ok = math.isfinite(value) and (value > 0 if positive else value >= 0)
    if not ok:
        expected = "a finite number > 0" if positive else "a finite number >= 0"
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return value


def values_checkable(t: torch.Tensor) -> bool:
    """True when the values of ``t`` can be read without a device sync or a trace break."""
    if not on_cpu(t):
        return False
    if torch.compiler.is_compiling():
        return False
    if (type(t) is torch.Tensor and not torch._is_functional_tensor(t)
            and not torch._C._functorch.is_functorch_wrapped_tensor(t)):
        return True  # none of the wrappers is_fake looks into (the common case, cheaper)
    return not _is_fake()(t)


def on_cpu(t: torch.Tensor) -> bool:
    """Whether ``t`` is on the CPU, without making a device object for a plain tensor (this runs
    for every tensor argument of every call).

    Parameters
    ----------
    t : torch.Tensor
        Any tensor or tensor subclass; a subclass is asked for its ``device``, which it may
        report differently from where its data lives.

    Returns
    -------
    bool
        ``t.device.type == "cpu"``.
    """
    return t.is_cpu if type(t) is torch.Tensor else t.device.type == "cpu"


@functools.cache
def _is_fake():
    """torch's ``is_fake`` (imported on first use, then kept: this runs on every call)."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake


def min_max(t: torch.Tensor) -> tuple[int, int]:
    """Smallest and largest value of a non-empty integer CPU tensor, as Python ints (small
    tensors through one ``tolist``, cheaper than two reductions)."""
    if t.numel() <= 256:
        vals = t.tolist()
        return min(vals), max(vals)
    return int(t.min()), int(t.max())


def require_dtype(name: str, t: Optional[torch.Tensor], allowed: tuple, words: str) -> None:
    if t is not None and t.dtype not in allowed:
        raise TypeError(f"{name} dtype must be {words}, got {dtype_str(t.dtype)}")


def resolve_layout(kv_layout, paged: bool) -> str:
    """The cache layout: ``kv_layout`` checked against whether a block table was given."""
    if kv_layout is None or kv_layout == "":
        return "NHD" if paged else "BNSD"
    require_choice("kv_layout", kv_layout, KV_LAYOUTS)
    if paged and kv_layout == "BNSD":
        raise ValueError("kv_layout='BNSD' is the contiguous cache: with a block_table the caches are "
                         "paged, kv_layout must be 'NHD', 'HND' or 'VLLM_AMX'")
    if not paged and kv_layout != "BNSD":
        raise ValueError(f"kv_layout={kv_layout!r} is a paged layout and needs block_table "
                         "([batch, max_blocks_per_seq] int32); without one the caches are BNSD")
    return kv_layout


def cache_dims(k: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """(num_blocks, num_kv_heads, block_size, head_dim) of a cache in ``layout``; BNSD
    counts one block of max_seq_len positions per sequence."""
    if layout == "NHD":
        n, bs, h, d = k.shape
        return n, h, bs, d
    n, h, bs, d = k.shape  # BNSD and HND share the dim order
    return n, h, bs, d


def cache_strides(t: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """Element strides ``(block, kv_head, slot, dim)`` of a cache in ``layout``.

    Position j of a sequence lives at slot ``j % block_size`` of its block (BNSD: the
    block is the sequence, one block of ``max_seq_len`` slots), so a kernel addresses
    every layout as ``base + blk * s_block + h * s_head + slot * s_slot + d * s_dim``.
    """
    s = t.stride()
    if layout == "NHD":
        return s[0], s[2], s[1], s[3]
    return s[0], s[1], s[2], s[3]


def check_block_table_values(bt: torch.Tensor, lens: torch.Tensor, block_size: int,
                             num_blocks: int, source: str = "key_cache dim 0") -> None:
    """Used entries (block i < ceil(n_b / block_size)) must lie in [0, num_blocks).

    ``bt`` ``[batch, max_blocks_per_seq]`` and ``lens`` ``[batch]``, int32 or int64, on the
    CPU (:func:`values_checkable`). One pass of the compiled CPU module where it is built
    (a decode step makes this check once per layer), else the torch path; both raise the
    same ValueError, naming the first bad entry in row-major order.
    """
    fast = _table_check_module()
    if (fast is not None and bt.device.type == "cpu" and lens.device.type == "cpu"
            and bt.layout == torch.strided and lens.layout == torch.strided
            and bt.dim() == 2 and lens.dim() == 1 and lens.shape[0] == bt.shape[0]
            and bt.dtype in (torch.int32, torch.int64) and lens.dtype in (torch.int32, torch.int64)
            and block_size >= 1):
        bad, b, i = fast.check_block_table(bt.data_ptr(), bt.dtype == torch.int64, bt.stride(0), bt.stride(1),
                                           bt.shape[0], bt.shape[1], lens.data_ptr(), lens.dtype == torch.int64,
                                           lens.stride(0), block_size, num_blocks)
    else:
        # lengths past the table's capacity use every entry (and cannot overflow the ceil)
        n = lens.to(torch.int64).clamp(0, bt.shape[1] * block_size)
        used = torch.arange(bt.shape[1])[None, :] < ((n + block_size - 1) // block_size)[:, None]
        mask = used & ((bt < 0) | (bt >= num_blocks))
        bad = int(mask.sum())
        b, i = (int(x) for x in mask.nonzero()[0]) if bad else (-1, -1)
    if bad:
        raise ValueError(
            f"block_table entries of used blocks must lie in [0, num_blocks={num_blocks}) ({source}); got block_table[{b}, {i}] = {int(bt[b, i])} for seq_lens[{b}] = {int(lens[b])} "
            f"(block_size {block_size}); {bad} bad entries in all"
        )


# The compiled check (cpu_kernels/src/table_check.cpp); set to False to force the torch path.
FUSED_TABLE_CHECK = True


def _table_check_module():
    return extension_with("check_block_table") if FUSED_TABLE_CHECK else None


def check_index_values(name: str, t: torch.Tensor, upper: int, what: str) -> None:
    lo, hi = min_max(t)
    if lo < 0 or hi >= upper:
        raise ValueError(f"{name} values must lie in [0, {upper}) ({what}), got min {lo}, max {hi}")


def check_caches(k, v, layout: str, batch: int, head_dim: int) -> tuple[int, int]:
    """Cache ranks and shapes against ``layout``; returns (num_kv_heads, block_size)."""
    dims = LAYOUT_DIMS[layout]
    require_rank("key_cache", k, 4, dims)
    require_rank("value_cache", v, 4, dims)
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"value_cache shape must equal the key_cache shape {shape_str(k)}, got {shape_str(v)}")
    num_blocks, num_kv_heads, block_size, d = cache_dims(k, layout)
    if layout == "BNSD":
        if num_blocks != batch:
            raise ValueError(f"key_cache batch must equal the query batch {batch}, got shape {shape_str(k)}")
        if num_kv_heads < 1 or block_size < 1:
            raise ValueError(
                f"key_cache must have num_kv_heads >= 1 and max_seq_len >= 1, got shape {shape_str(k)}")
    elif min(num_blocks, num_kv_heads, block_size) < 1:
        raise ValueError(f"key_cache ({layout} {dims}) must have num_blocks, block_size and "
                         f"num_kv_heads >= 1, got shape {shape_str(k)}")
    if d != head_dim:
        raise ValueError(f"key_cache head_dim (dim 3, {layout} {dims}) must equal the query head_dim "
                         f"{head_dim}, got shape {shape_str(k)}")
    if layout == "VLLM_AMX":
        check_packed(k, v, block_size, head_dim)
    return num_kv_heads, block_size


def check_packed(k, v, block_size: int, head_dim: int) -> None:
    """vLLM's AMX cache (topth_ops.packed): bfloat16, its block and head sizes, and each block
    and head's region of block_size x head_dim elements contiguous."""
    check_dtype("key_cache", k)
    check_dims(block_size, head_dim)
    for name, t in (("key_cache", k), ("value_cache", v)):
        if t.stride(3) != 1 or t.stride(2) != head_dim:
            raise ValueError(f"{name} (kv_layout='VLLM_AMX') must have each block and head's region contiguous "
                             f"(strides [..., {head_dim}, 1] in dims 2 and 3), got strides {list(t.stride())}")
        # a V row's 16-bit elements pair up in 32-bit lanes from the region's start
        if t.stride(0) % 2 or t.stride(1) % 2 or t.storage_offset() % 2:
            raise ValueError(f"{name} (kv_layout='VLLM_AMX') must start each block and head's region on a 4-byte "
                             f"boundary (even storage offset and block / head strides), got storage offset "
                             f"{t.storage_offset()}, strides {list(t.stride())}")


def check_thresholds(th, sdc_table, sdc: str, selection: str, num_q_heads: int, num_kv_heads: int,
                      threshold_set, batch: int) -> None:
    heads, who = (num_q_heads, "num_q_heads") if selection == "head" else (num_kv_heads, "num_kv_heads")
    if th.dim() not in (2, 3):
        raise ValueError(f"thresholds must have shape [{heads}, max_row_id] or [num_sets, {heads}, "
                         f"max_row_id] ({who}, selection={selection!r}), got shape {shape_str(th)}")
    if th.shape[-2] != heads or th.shape[-1] < 1 or (th.dim() == 3 and th.shape[0] < 1):
        lead = "num_sets >= 1, " if th.dim() == 3 else ""
        raise ValueError(f"thresholds must have shape [{lead}{heads}, max_row_id >= 1] ({who}, "
                         f"selection={selection!r}), got {shape_str(th)}")
    if th.dim() == 3:
        if threshold_set is None:
            raise ValueError(f"threshold_set ([batch] int32/int64) is required with 3-D thresholds "
                             f"{shape_str(th)} (one set index per sequence)")
        require_rank("threshold_set", threshold_set, 1, "[batch]")
        if threshold_set.shape[0] != batch:
            raise ValueError(f"threshold_set must have shape [{batch}] (the query batch), "
                             f"got {shape_str(threshold_set)}")
    elif threshold_set is not None:
        raise ValueError(f"threshold_set is only used with 3-D thresholds [num_sets, H, max_row_id], "
                         f"got thresholds {shape_str(th)}")
    if sdc == "offline":
        if sdc_table is None:
            raise ValueError("sdc_table is required with sdc='offline' (float32, shape "
                             "[num_q_heads, max_row_id], with a leading num_sets dim like thresholds)")
        want = (*th.shape[:-2], num_q_heads, th.shape[-1])
        if tuple(sdc_table.shape) != want:
            raise ValueError(
                f"sdc_table must have shape [{', '.join(map(str, want))}] (thresholds' sets and "
                f"row ids, one row per query head), got {shape_str(sdc_table)}")
    elif sdc_table is not None:
        raise ValueError(f"sdc_table is only used with sdc='offline', got sdc={sdc!r}")
