"""-inf scores (docs/semantics.md, "Edge cases"): a head whose every score is -inf returns 0
(mu with VMC) and leaves the other heads of its group exact, under group selection too, where
its log-probabilities must not turn the group maximum into NaN; -inf rows are never kept. The
torch reference and the ``cpu`` kernel (every SIMD level here, whole rows and split-KV, BNSD
and paged NHD / HND caches) against the float64 oracle."""

import pytest
import torch

from topth_ops import decode_attention
from topth_ops.backends import cpu as cpu_backend
from topth_ops.conformance.oracle import oracle_decode

from ..far_case import check_against_oracle as _check
from ..neg_inf_case import neg_inf_calls, overflow_calls
from .env_run import run_with_env

LEVELS = cpu_backend.cpu_module().simd_levels()
LAYOUTS = (None, "NHD", "HND")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_reference(dtype):
    for what, kw in neg_inf_calls(dtype, LAYOUTS):
        out, stats = decode_attention(**kw, backend="torch", return_stats=True)
        _check(out, stats, oracle_decode(**kw), dtype, what)


@pytest.mark.parametrize("level", LEVELS)
def test_cpu_levels_and_splits(level):
    for dtype in (torch.float32, torch.bfloat16):
        for what, kw in neg_inf_calls(dtype, LAYOUTS):
            want = oracle_decode(**kw)
            for split in ("", "1", "40"):
                out, stats, _ = run_with_env(kw, {"TOPTH_CPU_SIMD": level, "TOPTH_CPU_SPLIT_LEN": split})
                _check(out, stats, want, dtype, (what, level, split))


@pytest.mark.parametrize("level", LEVELS)
def test_overflow_row_in_one_split(level):
    """A split whose only kept row scores -inf in a head (float32 overflow) must not set that
    head's reference: whole rows, splits of 1, 32 (rows 0-31 and 32-63) and 40."""
    for dtype in (torch.float32, torch.bfloat16):
        for what, kw in overflow_calls(dtype):
            want = oracle_decode(**kw)
            out, stats = decode_attention(**kw, backend="torch", return_stats=True)
            _check(out, stats, want, dtype, (what, "torch"))
            for split in ("", "1", "32", "40"):
                out, stats, _ = run_with_env(kw, {"TOPTH_CPU_SIMD": level, "TOPTH_CPU_SPLIT_LEN": split})
                _check(out, stats, want, dtype, (what, level, split))
