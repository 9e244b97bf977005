"""transformers' generate() and cache classes with the "topth" attention function, on a tiny
random Llama built from a config (no download).

- Every generate mode (greedy, sampling, beam search, beam sampling, prompt lookup),
  with VMC and thresholds that drop keys, on dynamic and static caches: the logits that
  chose each token equal those of one teacher-forced forward over the returned sequence
  without a cache (the prefill reference: every row's mu from its own valid V rows, no
  state, no reorder). Before the fix, beam search handed the op a V mean that was not
  reordered with the cache.
- Direct cache edits (reorder, batch selection, repeat, crop, reset) between decode steps.
- Every cache class matches SDPA (same weights) at thresholds -inf, or is refused by
  enable(). Before the fix, a static cache's prefill attended future tokens and empty slots.
"""

import warnings

import pytest
import torch
import transformers  # the hf extra is part of the dev extra
import transformers.cache_utils

from topth_ops.hf.attention import TopthSettings, disable, enable
from topth_ops.hf.cache_view import rows_from_mask
from topth_ops.hf.runner import forward
from topth_ops.rowstats import StatsCollector
from topth_ops.thresholds import ThresholdSet, attention_config_of
from topth_ops.vmean import valid_value_mean

L, HQ, HKV, D, VOCAB, P, NEW = 2, 4, 2, 64, 64, 12, 6


def _config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=L,
                       num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, max_position_embeddings=64,
                       attn_implementation="sdpa", **kw)


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_config()).eval()


def _constant(model, theta: float) -> ThresholdSet:
    """Post-softmax thresholds equal to ``theta`` for every layer, head and row id."""
    R = 64
    return ThresholdSet(torch.full((L, HQ, R), float(theta)), torch.ones(L, HQ, R, dtype=torch.int64), [1] * L,
                        "post_softmax", "tiny", attention_config_of(model.config))


def _prompts(b, seed=1):
    return torch.randint(0, VOCAB, (b, P), generator=torch.Generator().manual_seed(seed))


def _collector():
    return StatsCollector(L, HQ, HKV)


def _generate(model, ids, **kw):
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "attention mask not set" for unpadded batches, deprecations
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kw)


MODES = {
    "greedy": (2, dict(do_sample=False)),
    "sample": (2, dict(do_sample=True, top_k=0, num_return_sequences=2)),
    "beam": (1, dict(do_sample=False, num_beams=3, num_return_sequences=3)),
    "beam_sample": (2, dict(do_sample=True, top_k=0, num_beams=3, num_return_sequences=2)),
    "prompt_lookup": (1, dict(do_sample=False, prompt_lookup_num_tokens=3)),
    "assisted": (1, dict(do_sample=False)),  # + assistant_model: a second tiny Llama (SDPA)
}


# Prompt lookup on a static cache fails inside transformers 5.24 with SDPA too (candidates are
# written past the capacity generate sized the cache for), and transformers < 5.20 (the
# version CI runs, pinned by the vLLM extra) refuses assisted generation with a static cache
# for SDPA too: neither is a case of this integration.
ASSISTED_STATIC = hasattr(transformers.cache_utils, "Fp8QuantizedLayer")  # a 5.20+ feature, as a version probe
UNSUPPORTED = {("prompt_lookup", "static")} | (set() if ASSISTED_STATIC else {("assisted", "static")})


@pytest.mark.parametrize("mode,cache", [(m, c) for m in MODES for c in ("dynamic", "static")
                                        if (m, c) not in UNSUPPORTED])
def test_generate_modes_with_vmc_give_the_teacher_forced_logits(model, mode, cache):
    batch, kw = MODES[mode]
    ids = _prompts(batch)
    if mode == "prompt_lookup":  # a repetitive prompt, so that candidates are proposed (and some rejected: crop)
        ids = torch.tensor([[5, 6, 7, 8, 9] * 2 + [5, 6]])
    if mode == "assisted":
        from transformers import LlamaForCausalLM

        torch.manual_seed(5)
        kw = dict(kw, assistant_model=LlamaForCausalLM(_config()).eval())
    dec = _collector()
    enable(model, TopthSettings(thresholds=_constant(model, 0.1), vmc=True), decode_stats=dec)
    try:
        torch.manual_seed(3)
        # assisted generation makes its own (dynamic) cache; transformers < 5.20 refuses an
        # explicit cache_implementation next to it
        cache_kw = {} if (mode, cache) == ("assisted", "dynamic") else dict(cache_implementation=cache)
        out = _generate(model, ids, **cache_kw, **kw)
        ref = forward(model, out.sequences)  # teacher-forced, no cache
    finally:
        disable(model)
    seqs = out.sequences
    assert seqs.shape[1] == P + NEW
    steps = torch.stack(out.logits, 1)  # [running batch, NEW, vocab]
    if out.get("beam_indices") is not None:
        bi = out.beam_indices[:, :NEW]  # the running beam whose logits chose token t of each sequence
        got = torch.stack([steps[bi[i], torch.arange(NEW)] for i in range(seqs.shape[0])])
    else:
        got = steps
    torch.testing.assert_close(got, ref[:, P - 1:-1], rtol=1e-4, atol=1e-4)
    if mode not in ("prompt_lookup", "assisted"):  # these verify candidates in multi-token (prefill-path) forwards
        assert dec.num_rows() > 0 and dec.dropped_mass(lo=P) > 0.01  # VMC had mass to compensate
    # the same sequences without VMC give other logits: a test that can fail on a wrong V mean
    enable(model, TopthSettings(thresholds=_constant(model, 0.1), vmc=False))
    try:
        no_vmc = forward(model, seqs)
    finally:
        disable(model)
    assert (no_vmc[:, P - 1:-1] - ref[:, P - 1:-1]).abs().max() > 1e-2


def _op_reorder(c):
    c.reorder_cache(torch.tensor([2, 0, 0]))
    return [2, 0, 0]


def _op_select(c):
    c.batch_select_indices(torch.tensor([2, 0, 1]))
    return [2, 0, 1]


def _op_repeat(c):
    c.batch_repeat_interleave(2)
    return [0, 0, 1, 1, 2, 2]


CACHE_OPS = {"reorder_cache": _op_reorder, "batch_select_indices": _op_select,
             "batch_repeat_interleave": _op_repeat, "crop": None, "reset": None}


@pytest.mark.parametrize("op", list(CACHE_OPS))
def test_vmc_follows_cache_edits_between_decode_steps(model, op):
    """Prefill 3 prompts, decode 2 tokens, edit the cache, decode 3 more: every decode step's
    logits equal a teacher-forced forward over the history the edited cache holds."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(7)
    hist = _prompts(3)
    cache = DynamicCache(config=model.config)
    enable(model, TopthSettings(thresholds=_constant(model, 0.1), vmc=True))
    try:
        forward(model, hist, cache)
        for _ in range(2):
            tok = torch.randint(0, VOCAB, (hist.shape[0], 1), generator=g)
            forward(model, tok, cache)
            hist = torch.cat([hist, tok], 1)
        if op == "crop":
            cache.crop(-3)
            hist = hist[:, :-3]
        elif op == "reset":
            cache.reset()
            hist = _prompts(3, seed=9)
            forward(model, hist, cache)
        else:
            hist = hist[CACHE_OPS[op](cache)]
        assert cache.get_seq_length() == hist.shape[1]
        for _ in range(3):
            tok = torch.randint(0, VOCAB, (hist.shape[0], 1), generator=g)
            got = forward(model, tok, cache)[:, -1]
            hist = torch.cat([hist, tok], 1)
            torch.testing.assert_close(got, forward(model, hist)[:, -1], rtol=1e-4, atol=1e-4)
    finally:
        disable(model)


def _cuda_only(name):
    return pytest.param(name, marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                       reason="transformers' offloaded caches need CUDA"))


# transformers' fp8 quantized cache (Fp8QuantizedLayer) exists from 5.20 on; the vLLM extra
# pins transformers < 5.20 in CI, where the other quantized backends (quanto, hqq) are not
# installed, so the quantized case runs where fp8 exists.
HAS_FP8_CACHE = hasattr(transformers.cache_utils, "Fp8QuantizedLayer")

CACHES = {
    "dynamic": dict(cache_implementation="dynamic"),
    "static": dict(cache_implementation="static"),
    "sliding_window": dict(cache_implementation="sliding_window"),  # deprecated alias: static, layers from config
    **({"quantized_fp8": dict(cache_implementation="quantized", cache_config={"backend": "fp8"})}
       if HAS_FP8_CACHE else {}),
    "prefill_chunks": dict(cache_implementation="static", prefill_chunk_size=5),
    "offloaded": dict(cache_implementation="offloaded"),
    "offloaded_static": dict(cache_implementation="offloaded_static"),
}


@pytest.mark.parametrize("prefill", ["thresholded", "dense"])
@pytest.mark.parametrize("cache", [c if "offloaded" not in c else _cuda_only(c) for c in CACHES])
def test_every_cache_class_matches_sdpa_at_thresholds_minus_inf(model, cache, prefill):
    """Thresholds -inf keep every key, so the logits of every step (the first one is the
    prefill: the thresholded reference, or SDPA through the integration's dense path) must
    equal the SDPA model's with the same cache class."""
    dev = "cuda" if "offloaded" in cache else "cpu"
    m = model.to(dev)
    ids = _prompts(2).to(dev)
    try:
        ref = _generate(m, ids, do_sample=False, **CACHES[cache])
        enable(m, TopthSettings(thresholds=_constant(m, float("-inf")), vmc=True, prefill=prefill))
        try:
            got = _generate(m, ids, do_sample=False, **CACHES[cache])
        finally:
            disable(m)
    finally:
        model.to("cpu")
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=2e-5)


def test_unsupported_models_and_caches_are_refused_by_enable(model):
    from transformers import MistralConfig, MistralForCausalLM

    s = TopthSettings(mode="dense")
    from transformers import Gemma2Config, Gemma2ForCausalLM

    gemma2 = Gemma2ForCausalLM(Gemma2Config(vocab_size=32, hidden_size=32, intermediate_size=32, head_dim=16,
                                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                            sliding_window=8, attn_logit_softcapping=50.0))
    with pytest.raises(ValueError, match=r"soft-capping \(attn_logit_softcapping=50.0\)"):
        enable(gemma2, s)
    assert gemma2.config._attn_implementation != "topth"
    mistral = MistralForCausalLM(MistralConfig(vocab_size=32, hidden_size=32, intermediate_size=32,
                                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                               sliding_window=8))
    enable(mistral, s)  # sliding-window layers are supported (row id = keys the row attends)
    disable(mistral)
    from transformers import LlamaForCausalLM

    with pytest.raises(ValueError, match="is_causal=False"):
        enable(LlamaForCausalLM(_config(is_causal=False)), s)
    model.generation_config.cache_implementation = "paged"
    try:
        with pytest.raises(ValueError, match="cache_implementation='paged'"):
            enable(model, s)
    finally:
        model.generation_config.cache_implementation = None
    assert model.config._attn_implementation == "sdpa"


def test_rows_without_a_mask_follow_sdpa_convention():
    """No mask: SDPA's is_causal for T > 1 (row i attends keys 0..i, upper-left, as in the
    prefill of an empty static cache) and every key for T = 1; never aligned to the end."""
    n, valid = rows_from_mask(None, 2, 4, 10, "cpu")
    assert valid is None and n.tolist() == [[1, 2, 3, 4]] * 2
    n, valid = rows_from_mask(None, 2, 1, 10, "cpu")
    assert valid is None and n.tolist() == [[10], [10]]
    # a static cache's decode mask: keys 0..6 valid of a capacity of 10
    mask = torch.zeros(1, 1, 1, 10, dtype=torch.bool)
    mask[..., :7] = True
    n, valid = rows_from_mask(mask, 3, 1, 10, "cpu")
    assert valid is None and n.tolist() == [[7]] * 3


@pytest.mark.parametrize("n", [[5, 5, 5], [5, 0, 9], [10, 10, 10]])
def test_valid_value_mean_averages_the_valid_prefix(n):
    v = torch.randn(3, 2, 10, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    got = valid_value_mean(v, torch.tensor(n))
    want = torch.stack([v[b, :, :k].double().mean(1) if k else torch.zeros(2, 8, dtype=torch.float64)
                        for b, k in enumerate(n)])
    assert got.dtype == torch.float32 and got.shape == (3, 2, 8)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["greedy", "beam"])
def test_vmc_sums_live_on_the_cache_and_add_one_row_per_step(model, mode):
    """The V mean is not re-read from the whole cache at every step: the sums are built once
    per layer (first decode step) and then follow the cache, beam reorders included."""
    batch, kw = MODES[mode]
    enable(model, TopthSettings(thresholds=_constant(model, 0.1), vmc=True))
    try:
        out = _generate(model, _prompts(batch), cache_implementation="dynamic", **kw)
    finally:
        disable(model)
    sums = out.past_key_values._topth_value_sums
    assert sums.rebuilds == L
    assert set(sums.layers) == set(range(L))


def test_value_sums_follow_cache_edits_against_the_cache_mean():
    """ValueSums after reorder / batch selection / repeat / crop equals the mean of the
    valid V rows of the edited cache (float64 reference)."""
    from transformers import DynamicCache

    from topth_ops.hf.vmean import value_sums_for

    g = torch.Generator().manual_seed(4)
    cache = DynamicCache(config=_config())
    B, S0 = 3, 5
    for layer in range(L):
        cache.update(torch.randn(B, HKV, S0, D, generator=g), torch.randn(B, HKV, S0, D, generator=g), layer)
    sums = value_sums_for(cache)

    def step():  # append one row per layer, ask for the mean, compare with the cache
        for layer in range(L):
            _, v = cache.update(torch.randn(cache.layers[layer].values.shape[0], HKV, 1, D, generator=g),
                                torch.randn(cache.layers[layer].values.shape[0], HKV, 1, D, generator=g), layer)
            n = torch.full((v.shape[0],), v.shape[2], dtype=torch.int64)
            mu = sums.mean(layer, v, n)
            torch.testing.assert_close(mu.double(), v.double().mean(2), atol=1e-5, rtol=1e-5)

    step()
    step()
    assert sums.rebuilds == L
    cache.reorder_cache(torch.tensor([2, 0, 0]))
    step()
    cache.batch_select_indices(torch.tensor([0, 2]))
    step()
    cache.batch_repeat_interleave(2)
    step()
    assert sums.rebuilds == L  # followed, not rebuilt
    cache.crop(-3)
    step()
    assert sums.rebuilds == 2 * L  # a crop drops the sums: rebuilt once per layer
