"""Shared check of the transformers integration tests: a thresholded prefill equals
feeding the tokens one by one through the KV cache and the decode op."""

import torch

from topth_ops.hf.attention import disable, enable
from topth_ops.hf.runner import forward, new_cache
from topth_ops.rowstats import StatsCollector


def collector(model) -> StatsCollector:
    c = model.config
    return StatsCollector(c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads)


def prefill_equals_steps(model, settings, ids):
    """Run ``ids`` once as a prefill and once token by token with ``settings``; assert equal
    logits (1e-4), the same rows / kept counts / V rows in both paths' statistics, and that
    thresholding changed the logits against dense. Returns (prefill logits, decode stats)."""
    pre, dec = collector(model), collector(model)
    enable(model, settings, prefill_stats=pre, decode_stats=dec)
    try:
        full = forward(model, ids)
        cache = new_cache(model)
        steps = [forward(model, ids[:, i:i + 1], cache) for i in range(ids.shape[1])]
    finally:
        disable(model)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)
    assert torch.equal(pre.rows, dec.rows) and torch.equal(pre.kept, dec.kept) and torch.equal(pre.v_rows, dec.v_rows)
    dense = forward(model, ids)
    assert (full - dense).abs().max() > 1e-3  # thresholding changed something
    return full, dec
