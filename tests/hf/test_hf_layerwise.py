"""Layer-wise calibration (topth_ops.hf.calib_layerwise) on a tiny random Llama, against a
float64 oracle of the thresholded forward.

Claim under test: each layer's thresholds are calibrated on the activations that layer sees
at inference, where the layers below are thresholded (with VMC, and the offline SDC for
pre_softmax). The oracle runs every sample alone through the model with the calibrated file
and Top-Theta attention, captures each attention layer's input hidden states, and recomputes
that layer's logits in float64 numpy (``oracle_logits``, tests/hf/conftest.py). On those logits, at every
row id that is a bucket of its own, the mean kept count must be k in every layer. The
one-pass calibration (dense activations) misses this in the layers above the first: the
control that shows the check can fail.
"""

import numpy as np
import pytest
import torch

from topth_ops.calibration import bucket_edges
from topth_ops.hf.attention import TopthSettings
from topth_ops.hf.calibrate import CalibrationText, calibrate
from topth_ops.thresholds import DENSE

L, HQ, HKV, D, HIDDEN, VOCAB = 3, 6, 2, 16, 96, 96  # the model and samples of test_hf_calibrate.py
LENGTHS = [40, 40, 33, 40]
TARGET = [3, 3, 3]
EXTEND = 320


@pytest.fixture(scope="module")
def model(sharp_llama):
    return sharp_llama(layers=L, q_heads=HQ, kv_heads=HKV, head_dim=D, hidden=HIDDEN, vocab=VOCAB)


@pytest.fixture(scope="module")
def samples():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


def _calibrate(model, samples, layerwise, placement, selection):
    text = CalibrationText(samples=list(samples), description="random token ids")
    sets = calibrate(model, text, [TARGET], [placement], model_name="tiny", progress=False,
                     selections=(selection,), extend_to=EXTEND, layerwise=layerwise)
    return sets[(0, placement, selection)]


def _settings(ts):
    return TopthSettings(mode="topth", thresholds=ts, placement=ts.placement, vmc=True, selection=ts.selection,
                         sdc="offline" if ts.placement == "pre_softmax" else "none")


def _kept_errors(ts, oracle):
    """Per (layer, head or group, single-row-id bucket n > k): |mean kept - k| / k over the
    oracle's rows of row id n."""
    G = HQ // HKV
    theta = ts.thresholds.numpy().astype(np.float64)
    edges = bucket_edges(max(LENGTHS), sorted(set(TARGET)))
    single = [int(edges[i + 1]) for i in range(len(edges) - 1) if edges[i + 1] - edges[i] == 1]
    errors = {}
    for layer, k in enumerate(TARGET):
        for n in single:
            if n <= k:
                continue
            for g in range(theta.shape[1]):
                kept = []
                for logits in oracle:
                    if logits.shape[-1] < n:
                        continue
                    a = logits[layer, :, n - 1, :n]
                    if ts.placement == "post_softmax":
                        m = a.max(-1, keepdims=True)
                        a = a - m - np.log(np.exp(a - m).sum(-1, keepdims=True))
                    x = a[g] if ts.selection == "head" else a[g * G:(g + 1) * G].max(0)
                    t = theta[layer, g, n - 1]
                    kept.append((x > (t if ts.placement == "pre_softmax" else np.log(t))).sum())
                errors[(layer, g, n)] = abs(np.mean(kept) - k) / k
    return errors


@pytest.mark.parametrize("selection", ["head", "group"])
@pytest.mark.parametrize("placement", ["pre_softmax", "post_softmax"])
def test_layerwise_thresholds_keep_k_on_the_thresholded_forward(model, samples, placement, selection, oracle_logits):
    ts = _calibrate(model, samples, True, placement, selection)
    assert ts.layerwise and ts.length_model is not None and ts.thresholds.shape[-1] == EXTEND
    assert (ts.sdc_table is not None) == (placement == "pre_softmax")
    oracle = [oracle_logits(model, ids, _settings(ts)) for ids in samples]
    errors = _kept_errors(ts, oracle)
    assert len(errors) >= 3 * 10
    worst = max(errors.values())
    # one histogram bin of slack, as for the one-pass estimator on dense activations
    assert worst <= 0.1 + 1e-9, sorted(errors.items(), key=lambda kv: -kv[1])[:5]


def test_one_pass_thresholds_drift_on_the_thresholded_forward(model, samples, oracle_logits):
    """Control: thresholds from dense activations do not keep k in the upper layers of the
    thresholded forward (pre_softmax), so the test above can fail."""
    ts = _calibrate(model, samples, False, "pre_softmax", "head")
    oracle = [oracle_logits(model, ids, _settings(ts)) for ids in samples]
    errors = _kept_errors(ts, oracle)
    assert max(e for (layer, _, _), e in errors.items() if layer == 0) <= 0.1 + 1e-9  # same inputs as dense
    assert max(e for (layer, _, _), e in errors.items() if layer > 0) > 0.1


def test_layerwise_applied_tables_are_the_saved_ones(model, samples, tmp_path):
    """What a layer ran with during the pass is what the file holds (thresholds and the
    offline SDC row), and the flag survives a save and load."""
    from topth_ops.hf.calib_layerwise import LayerwiseCalibrator, run_layerwise
    from topth_ops.thresholds import load_threshold_sets, save_threshold_sets

    layer_k = [DENSE, 6, 2]
    cal = LayerwiseCalibrator(L, HQ, HKV, [int(s.numel()) for s in samples], layer_k, "pre_softmax", "head",
                              EXTEND, sdc=True, vmc=True)
    run_layerwise(model, samples, cal, TopthSettings(mode="dense"))
    res = cal.result()
    assert sorted(cal.applied) == [1, 2]
    for layer, used in cal.applied.items():
        torch.testing.assert_close(used["thresholds"], res.thresholds[layer], rtol=0, atol=0)
        torch.testing.assert_close(used["sdc_table"], res.sdc_table[layer], rtol=0, atol=0)
    assert torch.all(torch.isneginf(res.thresholds[0])) and torch.all(res.sdc_table[0] == 0)
    text = CalibrationText(samples=list(samples), description="random token ids")
    ts = calibrate(model, text, [layer_k], ["pre_softmax"], model_name="tiny", progress=False, extend_to=EXTEND,
                   layerwise=True)[(0, "pre_softmax", "head")]
    torch.testing.assert_close(ts.thresholds, res.thresholds, rtol=0, atol=0)
    path = save_threshold_sets(tmp_path / "lw.safetensors", [ts])
    back = load_threshold_sets(path)[0]
    assert back.layerwise and "layer-wise" in back.summary()
    assert back.layerwise_rule == {"sdc": "offline", "vmc": True} and "sdc=offline, vmc=True" in back.summary()
    one = calibrate(model, text, [layer_k], ["post_softmax"], model_name="tiny", progress=False)
    path = save_threshold_sets(tmp_path / "one.safetensors", [one[(0, "post_softmax", "head")]])
    assert not load_threshold_sets(path)[0].layerwise


def test_layerwise_padding_rows_are_not_recorded(model, samples):
    """The shorter sample is right-padded in the batch: its padding rows must not reach the
    histograms (rows recorded = rows of the samples with n > min k, thinned as usual)."""
    from topth_ops.hf.calib_layerwise import LayerwiseCalibrator, run_layerwise

    lengths = [int(s.numel()) for s in samples]
    assert len(set(lengths)) > 1
    cal = LayerwiseCalibrator(L, HQ, HKV, lengths, TARGET, "post_softmax", "head", EXTEND, sdc=False, vmc=True)
    run_layerwise(model.model, samples, cal, TopthSettings(mode="dense"))
    stride = cal.acc.row_stride
    expect = np.zeros(max(lengths) + 1, dtype=np.int64)
    for T in lengths:
        for n in range(min(TARGET) + 1, T + 1):
            if n % int(stride(torch.tensor([n]))[0]) == 0:
                expect[n] += 1
    for layer in range(L):
        np.testing.assert_array_equal(cal.acc.rows_per_id[layer].numpy(), expect)


@pytest.mark.parametrize("kwargs, match", [
    (dict(estimator="mean"), "kept-count estimator"),
    (dict(topk_at_calibration=True), "top-k at calibration"),
    (dict(pairs={("pre", "head")}), r"pairs must .*\('pre', 'head'\)"),
    (dict(pairs={("pre_softmax", "group")}), r"pairs must .*\('pre_softmax', 'group'\)"),  # not a selection asked for
    (dict(pairs={("post_softmax", "head")}), "pairs must"),  # not a placement asked for
    (dict(pairs=set()), "pairs must"),
    (dict(targets=[[3, -2, 3]]), r"layer-k map values .* got -2"),
    (dict(targets=[[3, 2.5, 3]]), r"layer-k map values .* got 2.5"),
])
def test_layerwise_bad_combinations(model, samples, kwargs, match):
    """Refused with a ValueError naming the argument, before any forward pass (a pairs
    set that matches nothing used to return no thresholds at all; a negative k ran)."""
    text = CalibrationText(samples=list(samples), description="random token ids")
    targets = kwargs.pop("targets", [TARGET])
    calls = []
    handle = model.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=match):
            calibrate(model, text, targets, ["pre_softmax"], progress=False, layerwise=True, **kwargs)
    finally:
        handle.remove()
    assert not calls


def test_layerwise_refuses_a_foreign_batch():
    from topth_ops.hf.calib_layerwise import LayerwiseCalibrator

    cal = LayerwiseCalibrator(L, HQ, HKV, [8, 8], TARGET, "pre_softmax", "head", 64, sdc=False, vmc=False)
    q = torch.zeros(3, HQ, 8, 16)
    kv = torch.zeros(3, HKV, 8, 16)
    with pytest.raises(ValueError, match="2 samples"):
        cal.forward(0, q, kv, kv, torch.ones(3, 8, dtype=torch.int64), None, 0.25)


def test_run_layerwise_refuses_samples_the_calibrator_was_not_built_for(model, samples):
    """Same batch size and longest sample but another order of lengths: the padding rows
    would be recorded as real rows (and real rows dropped) without this check."""
    from topth_ops.hf.calib_layerwise import LayerwiseCalibrator, run_layerwise

    lengths = [int(s.numel()) for s in samples]
    assert lengths != lengths[::-1]
    cal = LayerwiseCalibrator(L, HQ, HKV, lengths[::-1], TARGET, "post_softmax", "head", EXTEND, sdc=False, vmc=True)
    with pytest.raises(ValueError, match="sample lengths"):
        run_layerwise(model, samples, cal, TopthSettings(mode="dense"))
    assert not cal.applied


@pytest.mark.parametrize("placement, selection", [("pre_softmax", "head"), ("post_softmax", "group")])
def test_layerwise_batch_matches_each_sample_at_inference_sliding_window(placement, selection):
    """Gemma 3 (sliding-window layers, 4 query / 1 KV head), samples of different lengths,
    the last one short: each layer's attention output in the padded batch of the pass
    equals, on every real row, what that sample alone produces at inference with the
    calibrated thresholds (VMC; offline SDC for pre_softmax). So padding and the window's
    row ids do not leak into the activations the upper layers are calibrated on."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from topth_ops.hf.attention import disable, enable
    from topth_ops.hf.calib_layerwise import LayerwiseCalibrator, run_layerwise
    from topth_ops.thresholds import ThresholdSet, attention_config_of

    torch.manual_seed(1)
    cfg = Gemma3TextConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=12,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           max_position_embeddings=256, query_pre_attn_scalar=16, attn_implementation="sdpa")
    gemma = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in gemma.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    g = torch.Generator().manual_seed(5)
    lengths = [48, 40, 20]
    samples = [torch.randint(0, 96, (n,), generator=g) for n in lengths]

    def run_captured(fn):
        outs, hs = {}, []
        for i, layer in enumerate(gemma.model.layers):
            hs.append(layer.self_attn.o_proj.register_forward_pre_hook(
                lambda mod, args, i=i: outs.__setitem__(i, args[0].detach().clone())))
        try:
            fn()
        finally:
            for h in hs:
                h.remove()
        return outs

    cal = LayerwiseCalibrator(3, 4, 1, lengths, [3, 3, 3], placement, selection, 256,
                              sdc=placement == "pre_softmax", vmc=True)
    batch = run_captured(lambda: run_layerwise(gemma, samples, cal, TopthSettings(mode="dense")))
    res = cal.result()
    ts = ThresholdSet(thresholds=res.thresholds, counts=res.counts, layer_k=res.layer_k, placement=placement,
                      model_name="tiny-gemma", attention_config=attention_config_of(cfg), alpha=None,
                      sdc_table=res.sdc_table, selection=selection, estimator="count", length_model=res.length_model,
                      sdc_length_model=res.sdc_length_model)
    enable(gemma, _settings(ts))
    try:
        for b, s in enumerate(samples):
            with torch.inference_mode():
                alone = run_captured(lambda: gemma(input_ids=s.view(1, -1), use_cache=False))
            for layer in range(3):
                torch.testing.assert_close(batch[layer][b, :len(s)], alone[layer][0], rtol=1e-5, atol=1e-5)
                assert torch.all(batch[layer][b, len(s):] == 0)  # padding rows: nothing attended
    finally:
        disable(gemma)


def test_layerwise_rule_is_recorded_and_a_mismatch_warns(model, samples, tmp_path):
    """The file records the compensation its layers were calibrated under; running it with
    another one warns (naming the file), running it as calibrated does not."""
    import warnings

    from topth_ops.hf.attention import disable, enable
    from topth_ops.thresholds import ThresholdFileError, load_threshold_sets, save_threshold_sets

    text = CalibrationText(samples=list(samples), description="random token ids")
    sets = calibrate(model, text, [TARGET], ["pre_softmax", "post_softmax"], model_name="tiny", progress=False,
                     layerwise=True, layerwise_vmc=False, sdc_table=False)
    pre, post = sets[(0, "pre_softmax", "head")], sets[(0, "post_softmax", "head")]
    assert pre.layerwise_rule == {"sdc": "none", "vmc": False} == post.layerwise_rule and pre.sdc_table is None
    path = save_threshold_sets(tmp_path / "post.safetensors", [post])
    post = load_threshold_sets(path)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        enable(model, TopthSettings(mode="topth", thresholds=post, vmc=False))
    with pytest.warns(UserWarning, match=r"post\.safetensors.*calibrated layer-wise with sdc=none, vmc=False"):
        enable(model, TopthSettings(mode="topth", thresholds=post, vmc=True))
    disable(model)
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    entries = json.loads(meta["sets"])
    entries[0]["layerwise_rule"] = {"sdc": 1}
    meta["sets"] = json.dumps(entries)
    save_file(tensors, str(tmp_path / "bad.safetensors"), metadata=meta)
    with pytest.raises(ThresholdFileError, match="bad.safetensors.*layerwise_rule"):
        load_threshold_sets(tmp_path / "bad.safetensors")
