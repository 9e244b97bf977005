"""A second calibration round (``calibrate(..., second_round=set)``, ``topth-ops calibrate
--second-round``) on the tiny random Llama of test_hf_layerwise.py, against the float64
oracle of the thresholded forward.

Claim under test: the second round's thresholds are calibrated on the activations the
model has when every layer runs the earlier set (the forward that serving the earlier set
gives; the vLLM engine's second round records exactly those rows). The oracle runs each
sample alone with the earlier set and Top-Theta attention (VMC, no SDC table) and
recomputes every layer's logits in float64; on them the second round's thresholds keep k
in every layer, while the earlier one-pass set drifts above the first layer (the control
that shows the check can fail).
"""

import pytest
import torch

from topth_ops.hf.attention import TopthSettings
from topth_ops.hf.calibrate import CalibrationText, calibrate
from topth_ops.thresholds import DENSE

from .test_hf_layerwise import HKV, HQ, L, TARGET, _kept_errors
from .test_hf_layerwise import model, samples  # noqa: F401 (the same tiny Llama and samples, as fixtures)

EXTEND = 320


def _text(samples):
    return CalibrationText(samples=list(samples), description="random token ids")


def _one_pass(model, samples, placement, selection, target=TARGET):
    return calibrate(model, _text(samples), [target], [placement], model_name="tiny", progress=False,
                     selections=(selection,), extend_to=EXTEND, sdc_table=False)[(0, placement, selection)]


def _second(model, samples, first, **kw):
    kw = {"sdc_table": False, **kw}
    return calibrate(model, _text(samples), [list(first.layer_k)], [first.placement], model_name="tiny",
                     progress=False, selections=(first.selection,), extend_to=EXTEND, second_round=first,
                     **kw)[(0, first.placement, first.selection)]


def _served(ts):
    return TopthSettings(mode="topth", thresholds=ts, placement=ts.placement, vmc=True, selection=ts.selection)


@pytest.mark.parametrize("placement, selection", [("pre_softmax", "head"), ("pre_softmax", "group"),
                                                  ("post_softmax", "group")])
def test_second_round_keeps_k_on_the_forward_of_the_set_it_refits(model, samples, placement, selection,
                                                                  oracle_logits):
    first = _one_pass(model, samples, placement, selection)
    second = _second(model, samples, first)
    assert not second.layerwise and second.calibration_text == "random token ids; second round of thresholds file"
    assert second.layerwise_rule == {"sdc": "none", "vmc": True}  # the rule the layers below ran with
    assert second.thresholds.shape == first.thresholds.shape and second.length_model is not None
    oracle = [oracle_logits(model, ids, _served(first)) for ids in samples]
    errors = _kept_errors(second, oracle)
    assert len(errors) >= 3 * 10
    # one histogram bin of slack, as for the one-pass estimator on dense activations
    assert max(errors.values()) <= 0.1 + 1e-9, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
    if placement == "pre_softmax":  # control: the set it refits drifts on the same forward
        drift = _kept_errors(first, oracle)
        assert max(e for (layer, _, _), e in drift.items() if layer > 0) > 0.1


def test_second_round_of_a_set_that_keeps_everything_keeps_k_on_the_dense_forward(model, samples, oracle_logits):
    """Thresholds at -inf in every layer: the propagated forward is dense, so the second
    round fits the dense model's logits (float64 oracle of an eager dense run), and its
    first layer, whose inputs no threshold touches, equals the second round of a real set
    there."""
    import dataclasses

    first = _one_pass(model, samples, "pre_softmax", "head")
    keep_all = dataclasses.replace(first, thresholds=torch.full_like(first.thresholds, float("-inf")))
    second = _second(model, samples, keep_all)
    torch.testing.assert_close(second.counts, first.counts, rtol=0, atol=0)  # the same rows
    errors = _kept_errors(second, [oracle_logits(model, ids) for ids in samples])
    assert max(errors.values()) <= 0.1 + 1e-9, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
    real = _second(model, samples, first)
    torch.testing.assert_close(real.thresholds[0], second.thresholds[0], rtol=0, atol=0)
    assert not torch.equal(real.thresholds[1:], second.thresholds[1:])


def test_second_round_propagates_the_given_tables(model, samples):
    """What each thresholded layer ran with during the pass is the earlier set's table, not
    the one the pass solves."""
    from topth_ops.hf.calib_layerwise import LayerwiseCalibrator, run_layerwise

    layer_k = [DENSE, 6, 2]
    first = _one_pass(model, samples, "pre_softmax", "head", target=layer_k)
    cal = LayerwiseCalibrator(L, HQ, HKV, [int(s.numel()) for s in samples], layer_k, "pre_softmax", "head",
                              EXTEND, sdc=False, vmc=True, propagate=first.thresholds)
    run_layerwise(model, samples, cal, TopthSettings(mode="dense"))
    assert sorted(cal.applied) == [1, 2]
    for layer, used in cal.applied.items():
        torch.testing.assert_close(used["thresholds"], first.thresholds[layer], rtol=0, atol=0)
    assert not torch.equal(cal.result().thresholds[2], first.thresholds[2])


@pytest.mark.parametrize("kwargs, match", [
    (dict(targets=[[3, 3, 2]]), "its set's own target"),
    (dict(placements=["post_softmax"]), "its set's own target"),
    (dict(selections=("group",)), "its set's own target"),
    (dict(layerwise=True), "replaces layer-wise"),
    (dict(topk_at_calibration=True), "replaces layer-wise"),
    (dict(estimator="mean"), "kept-count estimator"),
    (dict(sdc_table=True), "no offline SDC table"),
])
def test_second_round_bad_combinations(model, samples, kwargs, match):
    """Refused with a ValueError before any forward pass."""
    first = _one_pass(model, samples, "pre_softmax", "head")
    args = dict(targets=[TARGET], placements=["pre_softmax"], selections=("head",), sdc_table=False)
    args.update(kwargs)
    calls = []
    handle = model.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=match):
            calibrate(model, _text(samples), args.pop("targets"), args.pop("placements"), progress=False,
                      second_round=first, **args)
    finally:
        handle.remove()
    assert not calls


def test_calibrator_refuses_a_propagate_table_of_another_shape():
    from topth_ops.hf.calib_layerwise import LayerwiseCalibrator

    with pytest.raises(ValueError, match=r"propagate must be \[num_layers=3, H=2, R\]"):
        LayerwiseCalibrator(L, HQ, HKV, [8], TARGET, "pre_softmax", "group", 64, sdc=False, vmc=True,
                            propagate=torch.zeros(L, HQ, 64))
    with pytest.raises(ValueError, match="no offline SDC table"):
        LayerwiseCalibrator(L, HQ, HKV, [8], TARGET, "pre_softmax", "head", 64, sdc=True, vmc=True,
                            propagate=torch.zeros(L, HQ, 64))


def test_second_round_refuses_a_set_for_another_model(model, samples):
    import dataclasses

    from topth_ops.thresholds import ThresholdFileError

    first = _one_pass(model, samples, "pre_softmax", "head")
    cfg = dict(first.attention_config, num_layers=L + 1)
    other = dataclasses.replace(first, attention_config=cfg)
    with pytest.raises(ThresholdFileError, match="layers"):
        _second(model, samples, other)
