"""Group selection, pre_softmax: a head whose kept rows all lie far below its own maximum
(docs/semantics.md, "A head's kept rows far below its own maximum"). The head's maximum
sits on a row the group dropped, so exp(a - m) of its kept rows is subnormal or 0 in float32;
the weights must be taken relative to the maximum over the kept rows. The torch reference and
the ``cpu`` kernel (every SIMD level here, with and without split-KV, BNSD and paged) against
the float64 oracle, for every SDC variant, with and without VMC, and gaps from 30 (no
rescaling) to 140; and a split whose kept rows lie 200 below its own maximum merged with
another split (far_case.split_case).
"""

import pytest
import torch

from topth_ops import decode_attention
from topth_ops.backends import cpu as cpu_backend
from topth_ops.conformance.oracle import oracle_decode

from ..far_case import SDC, SPLIT_SDC, check_against_oracle as _check, far_case, far_kwargs, split_case
from .env_run import run_with_env

LEVELS = cpu_backend.cpu_module().simd_levels()


@pytest.mark.parametrize("gap", [30.0, 95.0, 140.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_reference(gap, dtype):
    for sdc, extra in SDC:
        for vmc in (False, True):
            kw = far_kwargs(*far_case(gap, dtype), sdc, extra, vmc, paged=False)
            out, stats = decode_attention(**kw, backend="torch", return_stats=True)
            _check(out, stats, oracle_decode(**kw), dtype)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("gap", [30.0, 95.0, 140.0])
def test_cpu_levels_and_splits(level, gap):
    for dtype in (torch.float32, torch.bfloat16):
        case = far_case(gap, dtype)
        for paged in (False, True):
            for sdc, extra in SDC:
                for vmc in (False, True):
                    kw = far_kwargs(*case, sdc, extra, vmc, paged)
                    want = oracle_decode(**kw)
                    for split in ("", "1", "40"):
                        out, stats, _ = run_with_env(kw, {"TOPTH_CPU_SIMD": level, "TOPTH_CPU_SPLIT_LEN": split})
                        _check(out, stats, want, dtype)


@pytest.mark.parametrize("level", LEVELS)
def test_split_dropped_sum(level):
    """A split whose kept rows lie 200 below its own maximum, merged with one whose kept row
    lies 1 below it (far_case.split_case): the torch reference and the cpu kernel, whole
    range, two splits of 32, and one position per split."""
    for dtype in (torch.float32, torch.bfloat16):
        case = split_case(dtype)
        for sdc, extra in SPLIT_SDC:
            for vmc in (False, True):
                kw = far_kwargs(*case, sdc, extra, vmc, paged=False)
                want = oracle_decode(**kw)
                out, stats = decode_attention(**kw, backend="torch", return_stats=True)
                _check(out, stats, want, dtype)
                for split in ("", "32", "1"):
                    out, stats, _ = run_with_env(kw, {"TOPTH_CPU_SIMD": level, "TOPTH_CPU_SPLIT_LEN": split})
                    _check(out, stats, want, dtype)
