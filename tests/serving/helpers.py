"""Shared helpers of the vLLM backend tests: synthetic threshold files and a tiny config."""

from __future__ import annotations

import torch

from topth_ops.thresholds import ThresholdSet, attention_config_of


class Cfg:
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


def threshold_set(cfg, *, name="tiny", placement="post_softmax", value=None, rows=64, k=4,
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
