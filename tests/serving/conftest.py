"""Shared pieces of the vLLM backend tests, as fixtures: ``make_cfg`` (a tiny
transformers-like config), ``make_threshold_set`` (a synthetic ThresholdSet for a config)
and ``causal_reference`` (float64 causal attention of new tokens over a context)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from topth_ops.thresholds import ThresholdSet, attention_config_of


class _Cfg:
    """A minimal transformers-like config (attention_config_of reads these attributes)."""

    def __init__(self, layers=4, heads=4, kv_heads=2, head_dim=16, model_type="llama", name=None):
        self.num_hidden_layers = layers
        self.num_attention_heads = heads
        self.num_key_value_heads = kv_heads
        self.head_dim = head_dim
        self.hidden_size = heads * head_dim
        self.model_type = model_type
        if name:
            self.topth_model_name = name


def _threshold_set(cfg, *, name="tiny", placement="post_softmax", value=None, rows=64, k=4,
                  seed=0, sdc_table=False) -> ThresholdSet:
    """A valid ThresholdSet for ``cfg``: every entry distinct (layer*1000 + head*10 + row
    encoded in the value when ``value`` is None), -inf for rows n <= k."""
    ac = attention_config_of(cfg)
    L, H = ac["num_layers"], ac["num_q_heads"]
    if value is None:
        g = torch.Generator().manual_seed(seed)
        th = torch.rand(L, H, rows, generator=g) * 0.05
    else:
        th = torch.full((L, H, rows), float(value))
    th[:, :, :k] = float("-inf")
    sdc = torch.rand(L, H, rows) if sdc_table else None
    return ThresholdSet(thresholds=th, counts=torch.ones(L, H, rows, dtype=torch.int64), layer_k=[k] * L,
                        placement=placement, model_name=name, attention_config=ac, sdc_table=sdc)


def _causal_reference(q, k, v, ctx, scale):
    """float64 softmax attention of new token i (position ctx + i) over positions 0..ctx+i."""
    L, Hq, D = q.shape
    G = Hq // k.shape[1]
    out = np.zeros((L, Hq, D))
    for i in range(L):
        for h in range(Hq):
            a = k[: ctx + i + 1, h // G] @ q[i, h] * scale
            w = np.exp(a - a.max())
            out[i, h] = (w / w.sum()) @ v[: ctx + i + 1, h // G]
    return out


@pytest.fixture(scope="session")
def make_cfg():
    """The config class: ``make_cfg(layers=4, heads=4, kv_heads=2, head_dim=16, model_type="llama", name=None)``."""
    return _Cfg


@pytest.fixture(scope="session")
def make_threshold_set():
    return _threshold_set


@pytest.fixture(scope="session")
def causal_reference():
    return _causal_reference
