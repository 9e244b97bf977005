"""Shared pieces of the transformers integration tests (tests/hf/), as fixtures:

* ``prefill_equals_steps(model, settings, ids)``: a thresholded prefill equals feeding the
  tokens one by one through the KV cache and the decode op; ``collector(model)``: a
  StatsCollector shaped for ``model``;
* ``dense_prefix_and_steps(model, settings, ids, N)``: one forward with a dense prefix of N
  rows, and the serving engine's way (dense prefill of N tokens, then decode steps);
* ``sharp_llama(layers, q_heads, kv_heads, head_dim, hidden, vocab)``: a tiny random Llama
  (seed 0) with sharpened attention, so that rows differ clearly;
* ``oracle_logits(model, ids, settings=None)``: float64 attention logits of every layer,
  recomputed from each layer's input hidden states (dense eager run, or with ``settings``
  the Top-Theta run).
"""

import math

import numpy as np
import pytest
import torch

from topth_ops.hf.attention import disable, enable
from topth_ops.hf.runner import forward, new_cache
from topth_ops.rowstats import StatsCollector


def _collector(model) -> StatsCollector:
    c = model.config
    return StatsCollector(c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads)


def _prefill_equals_steps(model, settings, ids):
    """Run ``ids`` once as a prefill and once token by token with ``settings``; assert equal
    logits (1e-4), the same rows / kept counts / V rows in both paths' statistics, and that
    thresholding changed the logits against dense. Returns (prefill logits, decode stats)."""
    pre, dec = _collector(model), _collector(model)
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


def _dense_prefix_and_steps(model, settings, ids, N):
    """Logits and stats of ``ids`` run two ways: one forward with ``dense_prefix = N``
    (``full``, ``pre``), and a plain dense prefill of the first N tokens into a KV cache
    followed by the rest one by one through the decode op (``steps``, ``dec``; the logits
    of rows N..T-1). Returns (full, steps, pre, dec)."""
    pre, dec = _collector(model), _collector(model)
    ctl = enable(model, settings, prefill_stats=pre)
    ctl.dense_prefix = N
    try:
        full = forward(model, ids)
    finally:
        disable(model)
    cache = new_cache(model)
    forward(model, ids[:, :N], cache)  # the engine's own (dense) prefill
    enable(model, settings, decode_stats=dec)
    try:
        steps = torch.cat([forward(model, ids[:, i:i + 1], cache) for i in range(N, ids.shape[1])], 1)
    finally:
        disable(model)
    return full, steps, pre, dec


def _sharp_llama(layers, q_heads, kv_heads, head_dim, hidden, vocab):
    """A tiny random Llama (seed 0, SDPA) whose q and k projections are scaled by 8."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=128, attn_implementation="sdpa")
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper attention than the default init, so rows differ clearly
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return m


def _rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def _oracle_logits(model, ids, settings=None):
    """Float64 logits ``[L, HQ, T, T]`` (-inf above the diagonal) of a dense eager run, or,
    with ``settings``, of a run with Top-Theta attention (each layer's logits from the
    hidden states the thresholded layers below it produced)."""
    c = model.config
    L, HQ, HKV, D = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    captured = {}

    def pre_hook(module, args, kwargs):
        hs = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
        captured[module.layer_idx] = (hs[0].double().numpy(), cos[0].double().numpy(), sin[0].double().numpy())

    attns = [layer.self_attn for layer in model.model.layers]
    handles = [a.register_forward_pre_hook(pre_hook, with_kwargs=True) for a in attns]
    prev = model.config._attn_implementation
    if settings is None:
        model.set_attn_implementation("eager")
    else:
        enable(model, settings)
    try:
        with torch.inference_mode():
            out = model(input_ids=ids.view(1, -1), use_cache=False, output_attentions=settings is None)
    finally:
        if settings is None:
            model.set_attn_implementation(prev)
        else:
            disable(model)
        for h in handles:
            h.remove()
    T = ids.numel()
    causal = np.tril(np.ones((T, T), dtype=bool))
    logits = np.empty((L, HQ, T, T))
    for layer, attn in enumerate(attns):
        hs, cos, sin = captured[layer]
        wq = attn.q_proj.weight.detach().double().numpy()
        wk = attn.k_proj.weight.detach().double().numpy()
        q = (hs @ wq.T).reshape(T, HQ, D).transpose(1, 0, 2)  # [HQ, T, D]
        k = (hs @ wk.T).reshape(T, HKV, D).transpose(1, 0, 2)  # [HKV, T, D]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = np.repeat(k, HQ // HKV, axis=0)  # query head h reads KV head h // (HQ // HKV)
        a = q @ k.transpose(0, 2, 1) / math.sqrt(D)
        logits[layer] = np.where(causal, a, -np.inf)
        if settings is not None:
            continue
        # the reconstruction agrees with transformers' own eager attention probabilities
        p = np.exp(logits[layer] - logits[layer].max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        np.testing.assert_allclose(p, out.attentions[layer][0].double().numpy(), atol=2e-5)
    return logits


@pytest.fixture(scope="session")
def collector():
    return _collector


@pytest.fixture(scope="session")
def prefill_equals_steps():
    return _prefill_equals_steps


@pytest.fixture(scope="session")
def dense_prefix_and_steps():
    return _dense_prefix_and_steps


@pytest.fixture(scope="session")
def sharp_llama():
    return _sharp_llama


@pytest.fixture(scope="session")
def oracle_logits():
    return _oracle_logits
