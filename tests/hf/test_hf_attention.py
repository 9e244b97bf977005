"""The "topth" transformers attention function on a tiny random Llama (no download):
thresholded prefill == token-by-token decode through the op, dense == SDPA, GQA, KV
cache, VMC, padding, mismatched files."""

import pytest
import torch
import transformers  # noqa: E402,F401 - the hf extra is part of the dev extra

from topth_ops.hf.attention import TopthSettings, disable, enable  # noqa: E402
from topth_ops.hf.calibrate import CalibrationText, calibrate  # noqa: E402
from topth_ops.hf.runner import forward, greedy  # noqa: E402
from topth_ops.thresholds import (  # noqa: E402
    DENSE,
    ThresholdFileError,  # noqa: E402
    parse_layer_k,
)


L = 3


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=96, intermediate_size=128, num_hidden_layers=L,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                      attn_implementation="sdpa")
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper attention than the default init, so thresholds matter
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return m


@pytest.fixture(scope="module")
def files(model):
    g = torch.Generator().manual_seed(1)
    samples = [torch.randint(0, 96, (48,), generator=g) for _ in range(4)]
    targets = [parse_layer_k("0:dense", 4, L)]
    sets = calibrate(model, CalibrationText(samples, "random tokens"), targets, ["pre_softmax", "post_softmax"],
                     alpha=0.2, model_name="tiny-llama", progress=False, estimator="mean")
    return {p: sets[(0, p, "head")] for p in ("pre_softmax", "post_softmax")}


def _ids(seed, n):
    return torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def test_dense_mode_equals_sdpa(model):
    ids = _ids(2, 40)
    ref = forward(model, ids)
    enable(model, TopthSettings(mode="dense"))
    try:
        got = forward(model, ids)
    finally:
        disable(model)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


SETTINGS = [
    dict(mode="topth", placement="post_softmax", sdc="none", vmc=True),
    dict(mode="topth", placement="post_softmax", sdc="none", vmc=False),
    dict(mode="topth", placement="pre_softmax", sdc="offline", vmc=True),
    dict(mode="topth", placement="pre_softmax", sdc="exact", vmc=False),
    dict(mode="topth", placement="pre_softmax", sdc="exp_threshold", vmc=True),
    dict(mode="topk", placement="pre_softmax", sdc="none", vmc=False),
    dict(mode="topk", placement="post_softmax", sdc="none", vmc=True),
]


@pytest.mark.parametrize("spec", SETTINGS, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_thresholded_prefill_equals_decode_steps(model, files, spec, prefill_equals_steps):
    """One forward over T tokens (every row thresholded in the prefill path) gives the same
    logits as feeding the tokens one by one through the KV cache and the decode op."""
    if spec["mode"] == "topth":
        s = TopthSettings(mode="topth", thresholds=files[spec["placement"]], sdc=spec["sdc"], vmc=spec["vmc"])
    else:
        s = TopthSettings(mode="topk", layer_k=parse_layer_k("0:dense", 4, L), placement=spec["placement"],
                          sdc=spec["sdc"], vmc=spec["vmc"])
    ids = _ids(3, 60)
    _, dec = prefill_equals_steps(model, s, ids)
    assert dec.attn_kept_frac(lo=8) < 0.9


def test_hf_generate_uses_the_op_and_matches_manual_greedy(model, files, collector):
    s = TopthSettings(mode="topth", thresholds=files["post_softmax"], vmc=True)
    ids = _ids(4, 20)
    dec = collector(model)
    enable(model, s, decode_stats=dec)
    try:
        with torch.inference_mode():
            gen = model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        chosen, _ = greedy(model, ids[0].tolist(), 12)
    finally:
        disable(model)
    assert gen[0, 20:].tolist() == chosen
    assert dec.num_rows() > 0  # decode steps went through the decode path


def test_left_padded_decode_raises_but_padded_prefill_works(model, files):
    s = TopthSettings(mode="topth", thresholds=files["post_softmax"], vmc=True)
    a, b = _ids(5, 30)[0], _ids(6, 22)[0]
    batch = torch.zeros(2, 30, dtype=torch.int64)
    mask = torch.zeros(2, 30, dtype=torch.int64)
    batch[0], mask[0] = a, 1
    batch[1, 8:], mask[1, 8:] = b, 1
    enable(model, s)
    try:
        with torch.inference_mode():
            logits = model(input_ids=batch, attention_mask=mask, use_cache=False).logits
        one = forward(model, b.view(1, -1))
        torch.testing.assert_close(logits[1:, 8:], one, rtol=1e-4, atol=1e-4)
        with pytest.raises(ValueError, match="left-padded"), torch.inference_mode():
            model.generate(batch, attention_mask=mask, max_new_tokens=2, do_sample=False)
    finally:
        disable(model)


def test_file_for_another_model_or_placement_is_rejected(model, files):
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4))
    with pytest.raises(ThresholdFileError, match="calibrated for model 'tiny-llama'.*3 layers.*2 layers"):
        enable(other, TopthSettings(mode="topth", thresholds=files["pre_softmax"]))
    with pytest.raises(ThresholdFileError, match="holds pre_softmax thresholds"):
        enable(model, TopthSettings(mode="topth", thresholds=files["pre_softmax"], placement="post_softmax"))
    with pytest.raises(ValueError, match="sdc must be 'none' with post_softmax"):
        enable(model, TopthSettings(mode="topth", thresholds=files["post_softmax"], sdc="exact"))


def test_attn_implementation_topth_without_settings_is_a_clear_error():
    from transformers import LlamaConfig, LlamaForCausalLM

    from topth_ops.hf.attention import register

    register()
    m = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, attn_implementation="topth"))
    with pytest.raises(RuntimeError, match="needs Top-Theta settings"), torch.inference_mode():
        m(input_ids=torch.tensor([[1, 2, 3]]))


def test_calibration_files_describe_the_run(files):
    ts = files["pre_softmax"]
    assert ts.layer_k == [DENSE, 4, 4] and ts.sdc_table is not None and ts.calibration_samples == 4
    assert ts.max_calibrated_row_id == 48 and ts.calibration_tokens == 192
    assert files["post_softmax"].sdc_table is None


@pytest.mark.parametrize("spec", [SETTINGS[0], SETTINGS[2], SETTINGS[5]],
                         ids=lambda s: "-".join(str(v) for v in s.values()))
def test_dense_prefix_equals_dense_prefill_then_decode_steps(model, files, spec, dense_prefix_and_steps):
    """``dense_prefix = N`` in one forward == what a serving engine does: the first N tokens
    prefilled densely (plain SDPA) into the KV cache, then the rest fed one by one through
    the decode op. Same logits, and the stats hold exactly the decode rows."""
    if spec["mode"] == "topth":
        s = TopthSettings(mode="topth", thresholds=files[spec["placement"]], sdc=spec["sdc"], vmc=spec["vmc"])
    else:
        s = TopthSettings(mode="topk", layer_k=parse_layer_k("0:dense", 4, L), placement=spec["placement"],
                          sdc=spec["sdc"], vmc=spec["vmc"])
    ids, N = _ids(5, 60), 24
    dense = forward(model, ids)
    full, steps, pre, dec = dense_prefix_and_steps(model, s, ids, N)
    torch.testing.assert_close(full[:, :N], dense[:, :N], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full[:, N:], steps, rtol=1e-4, atol=1e-4)
    assert (full[:, N:] - dense[:, N:]).abs().max() > 1e-3  # the late rows were thresholded
    assert pre.num_rows() == ids.shape[1] - N and pre.num_rows(hi=N) == 0
    assert torch.equal(pre.rows, dec.rows) and torch.equal(pre.kept, dec.kept) and torch.equal(pre.v_rows, dec.v_rows)
