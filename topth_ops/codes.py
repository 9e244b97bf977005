"""The integer codes the host passes to every compiled kernel, and the position limit.

One definition for the CPU kernel (cpu_kernels/include/topth_cpu/params.h), the Ascend C
kernel (npu_kernels/include/topth_tiling_data.h) and the Triton kernels (cuda_kernels/,
``tl.constexpr`` arguments). Each compiled extension exports the values of its own
headers (``CODES``); tests/backends/test_codes.py compares them with these.
"""

from __future__ import annotations

from enum import IntEnum

import torch


_OF: dict = {}  # (class, option value) -> code: ``of`` runs on every call of the op


def _cached(cls, value, name_of):
    """The member of ``cls`` named ``name_of(value)``, looked up once per value (unhashable
    values are looked up every time, with the lookup's own error)."""
    try:
        code = _OF.get((cls, value))
    except TypeError:
        return cls[name_of(value)]
    if code is None:
        code = _OF[(cls, value)] = cls[name_of(value)]
    return code


class _Code(IntEnum):
    @classmethod
    def of(cls, name: str):
        """The code of an option value of the contract, e.g. ``Sdc.of("exp_threshold")``."""
        return _cached(cls, name, lambda n: n.upper())


class DType(_Code):
    FLOAT16 = 0
    BFLOAT16 = 1
    FLOAT32 = 2

    @classmethod
    def of(cls, dtype: torch.dtype) -> "DType":
        return _cached(cls, dtype, lambda d: str(d).replace("torch.", "").upper())


class Placement(_Code):
    PRE_SOFTMAX = 0
    POST_SOFTMAX = 1


class Sdc(_Code):
    NONE = 0
    EXACT = 1
    EXP_THRESHOLD = 2
    OFFLINE = 3


class Selection(_Code):
    HEAD = 0
    GROUP = 1


class VmcMode(_Code):
    """CPU kernel: no VMC, VMC with the given ``value_mean``, VMC computing the mean."""
    OFF = 0
    GIVEN = 1
    COMPUTED = 2


MAX_POSITIONS = 2**31 - 4096
"""Largest ``max_seq_len`` a kernel takes: positions are int32 inside the kernels, with
room for a tile past the end."""
