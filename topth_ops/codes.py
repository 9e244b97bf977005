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


class _Code(IntEnum):
    @classmethod
    def of(cls, name: str):
        """The code of an option value of the contract, e.g. ``Sdc.of("exp_threshold")``."""
        code = _OF.get((cls, name))
        if code is None:
            code = _OF[(cls, name)] = cls[name.upper()]
        return code


class DType(_Code):
    FLOAT16 = 0
    BFLOAT16 = 1
    FLOAT32 = 2

    @classmethod
    def of(cls, dtype: torch.dtype) -> "DType":
        code = _OF.get((cls, dtype))
        if code is None:
            code = _OF[(cls, dtype)] = cls[str(dtype).replace("torch.", "").upper()]
        return code


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
