"""Bad threshold files and bad set choices are clear errors, never silent wrong thresholds:
length models with non-finite or out-of-range numbers, a model domain that does not fit
the placement, ``extend_to`` out of bounds, unexpected tensors, malformed configs, and
threshold-set choices of the wrong type (found by a reviewer editing files by hand)."""

import json

import numpy as np
import pytest
import torch

from topth_ops.hf.settings import TopthSettings, set_choice
from topth_ops.thresholds import (
    DENSE,
    MAX_ROW_IDS,
    LengthModel,
    ThresholdFileError,
    ThresholdSet,
    attention_config_of,
    extend_sdc,
    extend_table,
    load_thresholds,
    pick_set,
)

CFG = dict(model_type="llama", num_layers=3, num_q_heads=4, num_kv_heads=2, head_dim=8)
LAYER_K = [DENSE, 2, 3]
RC, R = 6, 48


def _model(placement, anchor=5.0, value=None, slope=None):
    """A length model in log(1 - k / n) per (layer, head); layer 0 dense (NaN)."""
    domain = "logit" if placement == "pre_softmax" else "log_prob"
    value = (1.25 if domain == "logit" else -3.0) if value is None else value
    slope = (0.8 if domain == "logit" else 2.0) if slope is None else slope
    an, av = np.full((3, 4), anchor), np.full((3, 4), value)
    an[0], av[0] = np.nan, np.nan
    return LengthModel(domain, an, av, np.full((3, 4), slope), "log_one_minus_k_over_n", np.array(LAYER_K))


def _set(placement="post_softmax", model=None, extend=True):
    g = torch.Generator().manual_seed(0)
    th = torch.rand(3, 4, RC, generator=g) * (0.1 if placement == "post_softmax" else 3.0)
    for layer, k in enumerate(LAYER_K):
        th[layer, :, : (RC if k == DENSE else k)] = -torch.inf
    model = _model(placement) if model is None else model
    return ThresholdSet(thresholds=extend_table(th, model, R) if extend else th,
                        counts=torch.ones(3, 4, RC, dtype=torch.int64), layer_k=list(LAYER_K), placement=placement,
                        model_name="tiny", attention_config=dict(CFG), alpha=None, estimator="count",
                        length_model=model)


def _edit(path, out, tensors=None, meta=None, set0=None):
    """Copy of a format-2 file with tensors / metadata / set 0's entries replaced (None removes)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        m = dict(f.metadata())
        t = {n: f.get_tensor(n) for n in f.keys()}
    for n, v in (tensors or {}).items():
        t.pop(n) if v is None else t.__setitem__(n, v)
    m.update(meta or {})
    sets = json.loads(m["sets"])
    sets[0].update(set0 or {})
    m["sets"] = json.dumps(sets)
    save_file(t, str(out), metadata=m)
    return out


def _model_tensor_with(path, field, value, layer=1, head=0):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        t = f.get_tensor("set0.length_model").clone()
    t[field, layer, head] = value
    return t


@pytest.mark.parametrize("placement", ["pre_softmax", "post_softmax"])
@pytest.mark.parametrize("field, value", [(0, float("nan")), (0, float("inf")), (0, 1e12), (1, float("nan")),
                                          (1, float("inf")), (1, float("-inf")), (2, float("nan")),
                                          (2, float("inf"))])
def test_non_finite_or_misplaced_length_model_numbers_are_refused(tmp_path, placement, field, value):
    # each used to load: NaN made the head dense beyond the calibrated rows, +inf kept nothing
    good = _set(placement).save(tmp_path / "good.safetensors")
    bad = _edit(good, tmp_path / "bad.safetensors",
                tensors={"set0.length_model": _model_tensor_with(good, field, value)})
    with pytest.raises(ThresholdFileError, match=r"bad.safetensors' set 0: 'length_model' layer 1 head 0: "
                                                 r"anchor_n, anchor_value and slope must be finite"):
        load_thresholds(bad)


def test_head_without_calibrated_rows_keeps_its_marker(tmp_path):
    # anchor_n and anchor_value NaN with slope 0 is what calibration writes for a head without rows
    m = _model("post_softmax")
    m.anchor_n[1, 2], m.anchor_value[1, 2], m.slope[1, 2] = np.nan, np.nan, 0.0
    back = load_thresholds(_set(model=m).save(tmp_path / "m.safetensors"))
    assert torch.all(torch.isneginf(back.thresholds[1, 2, RC:]))
    assert torch.all(torch.isfinite(back.thresholds[1, 1, RC:]))


@pytest.mark.parametrize("placement, slope, needle", [
    ("post_softmax", -1e6, r"log probabilities above -87"),  # theta 0: every key kept
    ("pre_softmax", 1e6, r"thresholds within \+-1e4"),
    ("pre_softmax", 1e300, r"thresholds within \+-1e4")])  # overflows: named, no numpy warning
def test_length_model_out_of_range_on_the_extended_rows_is_refused(tmp_path, placement, slope, needle):
    with pytest.raises(ThresholdFileError, match=r"'length_model' layer 1 head 0: the model must give " + needle):
        with np.errstate(over="raise", invalid="raise"):
            _set(placement, model=_model(placement, slope=slope)).save(tmp_path / "x.safetensors")


def test_post_softmax_model_above_probability_1_is_capped_as_documented(tmp_path):
    # calibration on peaked heads fits lines that reach log p slightly above 0 beyond the
    # samples (a reviewer saw 8 of 192 tiny-model sets); theta is capped at 1 there, not refused
    m = _model("post_softmax", value=-0.2, slope=0.5)
    back = load_thresholds(_set(model=m).save(tmp_path / "c.safetensors"))
    assert float(back.thresholds[1, :, RC:].max()) == 1.0 and float(back.thresholds[1, 0, RC]) < 1.0


def _pre_with_sdc(sdc_value):
    ts = _set("pre_softmax")
    an, av = np.full((3, 4), float(RC)), np.full((3, 4), sdc_value)
    an[0], av[0] = np.nan, np.nan
    ts.sdc_length_model = LengthModel("log", an, av, np.zeros((3, 4)))
    sdc_c = torch.full((3, 4, RC), 0.5)
    sdc_c[0] = 0.0
    ts.sdc_table = extend_sdc(sdc_c, ts.sdc_length_model, R)
    return ts


def test_sdc_model_overflowing_float32_is_refused_by_name(tmp_path):
    # exp(100) overflows float32: +inf used to be reported without the layer and head
    with pytest.raises(ThresholdFileError, match=r"'sdc_length_model' layer 1 head 0: the model must give a log "
                                                 r"dropped mass below 88.72"):
        with np.errstate(over="raise", invalid="raise"):
            _pre_with_sdc(100.0).save(tmp_path / "s.safetensors")
    back = load_thresholds(_pre_with_sdc(1.0).save(tmp_path / "ok.safetensors"))
    assert torch.allclose(back.sdc_table[1, :, RC:], torch.tensor(float(np.e)))


def test_pre_softmax_thresholds_beyond_1e4_are_refused(tmp_path):
    ts = _set("pre_softmax")
    ts.thresholds[2, 1, 4] = 1e30  # a calibrated column
    with pytest.raises(ThresholdFileError, match=r"pre_softmax thresholds \(scaled logits\) must lie within"):
        ts.save(tmp_path / "p.safetensors")


def test_length_model_domain_must_fit_the_placement(tmp_path):
    good = _set("post_softmax").save(tmp_path / "good.safetensors")
    with pytest.raises(ThresholdFileError, match="domain must be 'log_prob' with post_softmax thresholds, got 'logit'"):
        load_thresholds(_edit(good, tmp_path / "a.safetensors", set0={"length_domain": "logit"}))
    with pytest.raises(ThresholdFileError, match="domain must be 'logit' with pre_softmax thresholds, got 'log_prob'"):
        load_thresholds(_edit(good, tmp_path / "b.safetensors", meta={"placement": "pre_softmax"}))


@pytest.mark.parametrize("extend_to", [MAX_ROW_IDS + 1, 2 ** 40, RC - 1, True, 48.0, "48"])
def test_extend_to_out_of_bounds_is_refused_before_allocating(tmp_path, extend_to):
    good = _set().save(tmp_path / "good.safetensors")
    with pytest.raises(ThresholdFileError, match=rf"'extend_to' must be an integer from the stored row ids \({RC}\) "
                                                 rf"to {MAX_ROW_IDS}"):
        load_thresholds(_edit(good, tmp_path / "bad.safetensors", set0={"extend_to": extend_to}))


def test_malformed_file_parts_are_named(tmp_path):
    good = _set().save(tmp_path / "good.safetensors")
    cases = [
        (dict(tensors={"set7.thresholds": torch.zeros(1)}), r"unexpected tensors \['set7.thresholds'\]"),
        (dict(tensors={"set0.thresholds": torch.zeros(4, RC)}),
         r"'set0.thresholds' must be float32 \[num_layers, heads, row ids\], got torch.float32 \[4, 6\]"),
        (dict(meta={"selection": "both"}), r"selection must be one of \('head', 'group'\), got 'both'"),
        (dict(set0={"layerwise_rule": "yes"}), r"set 0: malformed metadata: layerwise_rule must be"),
        (dict(tensors={"set0.sdc_table": torch.zeros(3, 4, RC)}),
         "an sdc_table is only valid with pre_softmax thresholds"),
    ]
    for i, (edit, needle) in enumerate(cases):
        with pytest.raises(ThresholdFileError, match=needle):
            load_thresholds(_edit(good, tmp_path / f"bad{i}.safetensors", **edit))


@pytest.mark.parametrize("change, needle", [
    ({"num_layers": "3"}, r"\['num_layers'\] must be integers >= 1"),
    ({"num_kv_heads": 0}, r"\['num_kv_heads'\] must be integers >= 1"),
    ({"num_q_heads": 6, "num_kv_heads": 4}, r"num_q_heads \(6\) must be a multiple of num_kv_heads \(4\)")])
def test_attention_config_of_a_dict_is_checked(change, needle):
    with pytest.raises(ValueError, match=needle):
        attention_config_of({**CFG, **change})
    assert attention_config_of(dict(CFG)) == CFG


def test_set_index_types(tmp_path):
    sets = [_set(), _set()]
    assert pick_set(sets, np.int64(1), "f") is sets[1]
    assert pick_set(sets, torch.tensor(1), "f") is sets[1]
    for bad in ("1", True, 1.0, [1], torch.tensor(1.0), np.array([1, 0])):
        with pytest.raises(TypeError, match="threshold set index must be an int"):
            pick_set(sets, bad, "f")


@pytest.mark.parametrize("choice, expect", [(2, [2]), (np.int64(1), [1]), ([2, 0], [2, 0]), ((1,), [1]),
                                            (torch.tensor([2, 0]), [2, 0]), (torch.tensor(1), [1]),
                                            (np.array([0, 1], dtype=np.int32), [0, 1]), (range(2), [0, 1]),
                                            (None, None)])
def test_set_choice_accepts_integers(choice, expect):
    assert set_choice(choice) == expect


@pytest.mark.parametrize("choice", [True, 1.0, "1", "12", {0: 1}, [[0], [1]], [0, 1.5], torch.tensor([1.0]),
                                    torch.tensor([[1, 0]]), torch.tensor([True]), np.array(["1"]),
                                    np.array([1], dtype=object)])
def test_set_choice_refuses_other_types(choice):
    with pytest.raises(TypeError, match="threshold_set must be an int, a sequence of int, or a 1-D integer tensor"):
        set_choice(choice)
    with pytest.raises(TypeError):
        TopthSettings(threshold_set=choice)


def test_settings_selection_is_checked():
    with pytest.raises(ValueError, match=r"selection must be one of \('head', 'group'\) or None, got 'foo'"):
        TopthSettings(mode="dense", selection="foo")
    for mode in ("dense", "topk"):
        with pytest.raises(ValueError, match=f"selection='group' needs mode 'topth'.*got mode '{mode}'"):
            TopthSettings(mode=mode, selection="group", layer_k=[0, 2, 2], placement="post_softmax").resolved(3)


def test_threshold_sets_compare_by_identity():
    a = _set()
    assert a == a and a != _set()
