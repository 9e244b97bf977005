"""Validation details not covered by the conformance rule ``errors``."""

import numpy as np
import pytest
import torch

import topth_ops
from topth_ops.contract import DEFAULT_SDC_GAMMA, make_inputs


def _args():
    q = torch.randn(2, 4, 8)
    k = torch.randn(2, 2, 5, 8)
    return q, k, k.clone(), torch.tensor([5, 2]), torch.zeros(4, 5)


@pytest.mark.parametrize("scale", [0.25, 1, np.float32(0.25), np.float64(0.25), np.int64(2)])
def test_real_scalars_are_accepted_as_scale(scale):
    assert make_inputs(*_args(), scale=scale).scale == float(scale)


@pytest.mark.parametrize("scale,exc", [(np.bool_(True), TypeError), (torch.tensor(0.1), TypeError),
                                       (float("inf"), ValueError), (-1.0, ValueError), (10 ** 400, ValueError)])
def test_bad_scales(scale, exc):
    with pytest.raises(exc, match="scale"):
        make_inputs(*_args(), scale=scale)


def test_default_scale_is_inverse_sqrt_head_dim():
    assert make_inputs(*_args()).scale == pytest.approx(8 ** -0.5)


def test_sdc_gamma_default_is_accepted_with_every_sdc():
    for sdc in ("none", "exact", "exp_threshold"):
        make_inputs(*_args(), placement="pre_softmax", sdc=sdc, sdc_gamma=DEFAULT_SDC_GAMMA)


def test_value_checks_are_skipped_when_asked():
    q, k, v, _, th = _args()
    make_inputs(q, k, v, torch.tensor([99, -1]), th, check_values=False)  # no error


def test_describe_names_shapes_and_options():
    text = make_inputs(*_args(), placement="pre_softmax", sdc="exact").describe()
    assert "query [2, 4, 8] float32" in text and "sdc=exact" in text


@pytest.mark.parametrize("arg", ["query", "key_cache", "seq_lens", "thresholds"])
def test_sparse_tensors_are_refused_by_name(arg):
    # before: the cpu backend raised RuntimeError "Cannot access data pointer of Tensor that
    # doesn't have storage" (the torch backend a reshape error), naming no argument
    B, Hq, Hkv, S, D = 2, 4, 2, 8, 16
    kw = dict(query=torch.randn(B, Hq, D), key_cache=torch.randn(B, Hkv, S, D),
              value_cache=torch.randn(B, Hkv, S, D), seq_lens=torch.tensor([8, 3]),
              thresholds=torch.full((Hq, S), 0.01))
    kw[arg] = kw[arg].to_sparse()
    with pytest.raises(TypeError, match=rf"{arg} must be a dense \(torch.strided\) tensor"):
        topth_ops.decode_attention(*kw.values())
