"""The integer codes the host passes to every compiled kernel, and the position limit.

One definition for the CPU kernel (cpu_kernels/include/topth_cpu/params.h), the Ascend C
kernel (npu_kernels/include/topth_tiling_data.h) and the Triton kernels (cuda_kernels/,
``tl.constexpr`` arguments). Each compiled extension exports the values of its own
headers (``CODES``); tests/backends/test_codes.py compares them with these.
"""

from __future__ import annotations

from enum import IntEnum

import torch


class DType(IntEnum):
    FLOAT16 = 0
    BFLOAT16 = 1
    FLOAT32 = 2

    @classmethod
    def of(cls, dtype: torch.dtype) -> "DType":
        return {torch.float16: cls.FLOAT16, torch.bfloat16: cls.BFLOAT16, torch.float32: cls.FLOAT32}[dtype]


class Placement(IntEnum):
    PRE_SOFTMAX = 0
    POST_SOFTMAX = 1

    @classmethod
    def of(cls, placement: str) -> "Placement":
        return cls[placement.upper()]


class Sdc(IntEnum):
    NONE = 0
    EXACT = 1
    EXP_THRESHOLD = 2
    OFFLINE = 3

    @classmethod
    def of(cls, sdc: str) -> "Sdc":
        return cls[sdc.upper()]


class Selection(IntEnum):
    HEAD = 0
    GROUP = 1

    @classmethod
    def of(cls, selection: str) -> "Selection":
        return cls[selection.upper()]


class VmcMode(IntEnum):
    """CPU kernel: no VMC, VMC with the given ``value_mean``, VMC computing the mean."""
    OFF = 0
    GIVEN = 1
    COMPUTED = 2


MAX_POSITIONS = 2**31 - 4096
"""Largest ``max_seq_len`` a kernel takes: positions are int32 inside the kernels, with
room for a tile past the end."""
