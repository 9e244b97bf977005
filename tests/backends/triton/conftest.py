"""Shared pieces of the Triton kernel tests (tests/backends/triton/), as fixtures:

* ``dev``: the device the kernels run on (the CPU under Triton's interpreter, else CUDA);
* ``launch``: ``launch(kw, config=None)`` runs decode_attn_fwd on the ``decode_attention``
  keyword arguments ``kw`` (no value checks: the device path), outputs poisoned with NaN;
* ``check``: ``check(res, ref, dtype)`` compares a launch's (out, stats) with the float64
  oracle's result ``ref`` (within the dtype's tolerance; exact kept and V-row counts).
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from topth_ops.env import interpreter_enabled
from topth_ops.conformance.cases import move_strided
from topth_ops.conformance.compare import TOLERANCES
from topth_ops.contract import make_inputs

# tests/conftest.py sets TRITON_INTERPRET=1 without CUDA, before triton is imported
INTERP = interpreter_enabled()
DEV = torch.device("cpu" if INTERP else "cuda")


def _to_dev(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the test device with the same strides (stride-0 expands included)."""
    return t if t.device == DEV else move_strided(t, DEV)


def _launch(kw: dict, config=None):
    """decode_attn_fwd on ``kw`` (no value checks: the device path), outputs poisoned."""
    from topth_ops.backends.triton.launch import decode_attn_fwd

    kw = {k: (_to_dev(v) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    inputs = make_inputs(**kw, return_stats=True, check_values=False)
    out, stats = inputs.empty_outputs(fill=float("nan"))
    decode_attn_fwd(inputs.query, inputs.key_cache, inputs.value_cache, inputs.seq_lens, inputs.thresholds, out,
                    scale=inputs.scale, placement=inputs.placement, sdc=inputs.sdc, sdc_gamma=inputs.sdc_gamma,
                    sdc_table=inputs.sdc_table, vmc=inputs.vmc, value_mean=inputs.value_mean, stats=tuple(stats),
                    block_table=inputs.block_table, kv_layout=inputs.kv_layout, selection=inputs.selection,
                    threshold_set=inputs.threshold_set, config=config)
    return out, stats


def _check(res, ref, dtype):
    assert np.all(ref.margin > 1e-4), "a score lies too close to its threshold: choose another seed"
    out, stats = res
    good = ~ref.nonfinite
    np.testing.assert_allclose(out.cpu().double().numpy()[good], ref.out[good], **TOLERANCES[dtype])
    np.testing.assert_array_equal(stats.kept.cpu().numpy()[good], ref.kept[good])
    B, Hq = ref.kept.shape
    group_bad = ref.nonfinite.reshape(B, ref.v_rows.shape[1], -1).any(axis=2)
    np.testing.assert_array_equal(stats.v_rows.cpu().numpy()[~group_bad], ref.v_rows[~group_bad])
    np.testing.assert_allclose(stats.dropped_mass.cpu().double().numpy()[good], ref.dropped_mass[good], atol=1e-5)


@pytest.fixture(scope="session")
def dev():
    return DEV


@pytest.fixture(scope="session")
def launch():
    return _launch


@pytest.fixture(scope="session")
def check():
    return _check
