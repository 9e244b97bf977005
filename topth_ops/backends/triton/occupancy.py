"""Occupancy and wave arithmetic of a CUDA kernel (pure Python, no GPU needed).

Used twice: at run time by the launcher, to choose the split count from the compiled
kernel's registers and shared memory and the device's SM count (so that the grid fills
the resident slots in one wave); and by the static performance report
(:mod:`topth_ops.bench.compile_report`), which applies the same formulas to kernels compiled
ahead of time for sm_90.

Formulas: the CUDA occupancy calculator (CUDA C Programming Guide, "Occupancy" and the
compute-capability tables): registers are allocated per warp in units of 256, shared
memory per CTA plus 1 KiB reserved by the system per CTA, threads and CTAs per SM capped.
The split heuristic follows FlashAttention's ``num_splits_heuristic`` (wave efficiency),
restricted to one full wave, since a partly filled second wave leaves SMs idle for a
whole program's duration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SmLimits:
    """Per-SM limits of one GPU generation (defaults: sm_90, H100/H200)."""

    regs_per_sm: int = 65536
    max_regs_per_thread: int = 255
    reg_alloc_unit: int = 256  # registers, allocated per warp
    smem_per_sm: int = 228 * 1024
    smem_reserved_per_cta: int = 1024
    max_threads_per_sm: int = 2048
    max_ctas_per_sm: int = 32


SM90 = SmLimits()
H200_SMS = 132


def ctas_per_sm(n_regs: int, shared_bytes: int, num_warps: int, limits: SmLimits = SM90) -> int:
    """Resident CTAs per SM of a kernel (0 when it cannot run at all).

    Parameters
    ----------
    n_regs : int
        Registers per thread of the compiled kernel.
    shared_bytes : int
        Dynamic + static shared memory per CTA, bytes.
    num_warps : int
        Warps per CTA.
    """
    if n_regs > limits.max_regs_per_thread or num_warps < 1:
        return 0
    regs_per_warp = math.ceil(max(n_regs, 1) * 32 / limits.reg_alloc_unit) * limits.reg_alloc_unit
    by_regs = limits.regs_per_sm // (regs_per_warp * num_warps)
    by_smem = limits.smem_per_sm // (shared_bytes + limits.smem_reserved_per_cta)
    by_threads = limits.max_threads_per_sm // (32 * num_warps)
    return int(max(0, min(by_regs, by_smem, by_threads, limits.max_ctas_per_sm)))


def choose_splits(groups: int, max_seq_len: int, block_n: int, num_sms: int, ctas: int, *,
                  min_tokens_per_split: int = 256, max_splits: int = 64) -> int:
    """Split count of the KV sequence (flash-decoding) from the occupancy.

    ``groups`` programs (batch x KV heads) exist before splitting; ``slots = num_sms x ctas``
    of them run at once. The count is the largest ``ns`` with ``groups x ns <= slots``
    (one wave, never a partial second one), bounded by ``max_seq_len /
    min_tokens_per_split`` (a split shorter than that costs more in combine traffic than
    it gains) and ``max_splits``. When ``groups`` alone fill the slots, no split: 1.

    Returns
    -------
    int
        In ``[1, max_splits]``.
    """
    slots = max(1, num_sms * max(ctas, 1))
    by_len = max(1, max_seq_len // max(min_tokens_per_split, block_n))
    ns = max(1, slots // max(groups, 1))
    return int(max(1, min(ns, by_len, max_splits)))


def waves(programs: int, num_sms: int, ctas: int) -> tuple[int, float]:
    """(number of waves, efficiency = programs / (waves x slots)) of a grid."""
    slots = max(1, num_sms * max(ctas, 1))
    w = max(1, math.ceil(programs / slots))
    return w, programs / (w * slots)
