"""Threshold file format 2: several threshold sets per file, group selection, the length
model beyond the calibrated row ids, and format 1 files (written here byte by byte with
safetensors, independently of the code under test) still loading."""

import json

import numpy as np
import pytest
import torch

from topth_ops.thresholds import (
    DENSE,
    LengthModel,
    ThresholdFileError,
    ThresholdSet,
    extend_sdc,
    extend_table,
    fingerprint,
    load_threshold_sets,
    load_thresholds,
    pick_set,
    save_threshold_sets,
    stack_sets,
)

CFG = dict(model_type="llama", num_layers=3, num_q_heads=4, num_kv_heads=2, head_dim=8)
LAYER_K = [DENSE, 2, 3]


def _table(H, R, placement, seed=0, layer_k=LAYER_K):
    g = torch.Generator().manual_seed(seed)
    th = torch.rand(3, H, R, generator=g) * (0.1 if placement == "post_softmax" else 3.0)
    for layer, k in enumerate(layer_k):
        th[layer, :, : (R if k == DENSE else k)] = -torch.inf
    return th


def _set(placement="post_softmax", selection="head", R=6, seed=0, layer_k=LAYER_K, **kw):
    H = CFG["num_q_heads"] if selection == "head" else CFG["num_kv_heads"]
    return ThresholdSet(thresholds=_table(H, R, placement, seed, layer_k), counts=torch.full((3, H, R), 2),
                        layer_k=list(layer_k), placement=placement, model_name="tiny", attention_config=dict(CFG),
                        alpha=0.0, selection=selection, estimator="count", calibration_text="unit", **kw)


def _write_v1(path, th, counts, layer_k, placement, sdc=None, alpha=0.5):
    """A format-1 file exactly as topth-ops 0.1 wrote it (one set, top-level metadata)."""
    from safetensors.torch import save_file

    meta = {"format": "topth-thresholds", "format_version": "1", "model_name": "tiny",
            "attention_config": json.dumps(CFG, sort_keys=True), "attention_fingerprint": fingerprint(CFG),
            "placement": placement, "layer_k": json.dumps(layer_k), "alpha": json.dumps(alpha),
            "topk_at_calibration": "false", "calibration_text": "old", "calibration_samples": "3",
            "calibration_tokens": "300", "source": "calibrate", "created_by": "topth-ops 0.1.0"}
    tensors = {"thresholds": th, "sample_counts": counts}
    if sdc is not None:
        tensors["sdc_table"] = sdc
    save_file(tensors, str(path), metadata=meta)


def test_format_1_files_still_load(tmp_path):
    th = _table(4, 7, "pre_softmax")
    counts = torch.arange(3 * 4 * 7, dtype=torch.int64).view(3, 4, 7)
    sdc = torch.rand(3, 4, 7)
    _write_v1(tmp_path / "v1.safetensors", th, counts, LAYER_K, "pre_softmax", sdc)
    ts = load_thresholds(tmp_path / "v1.safetensors")
    assert torch.equal(ts.thresholds, th) and torch.equal(ts.counts, counts) and torch.equal(ts.sdc_table, sdc)
    assert (ts.selection, ts.estimator, ts.length_model, ts.alpha) == ("head", "mean", None, 0.5)
    assert ts.layer_k == LAYER_K and ts.calibration_samples == 3 and ts.max_row_id == 7
    # a re-save writes format 2 and reads back the same
    back = load_thresholds(ts.save(tmp_path / "v2.safetensors"))
    assert torch.equal(back.thresholds, th) and torch.equal(back.sdc_table, sdc)
    bad = tmp_path / "v1bad.safetensors"
    _write_v1(bad, th, counts[:, :, :3].contiguous(), LAYER_K, "pre_softmax")
    with pytest.raises(ThresholdFileError, match="v1bad.safetensors.*sample_counts"):
        load_thresholds(bad)


def test_several_sets_round_trip_and_stack(tmp_path):
    sets = [_set(R=6, seed=1), _set(R=9, seed=2, layer_k=[DENSE, 4, 4]), _set(R=5, seed=3)]
    path = save_threshold_sets(tmp_path / "multi.safetensors", sets)
    back = load_threshold_sets(path)
    assert [b.set_index for b in back] == [0, 1, 2] and all(b.path == str(path) for b in back)
    for a, b in zip(sets, back):
        assert torch.equal(a.thresholds, b.thresholds) and a.layer_k == b.layer_k
    assert load_thresholds(path, 1).layer_k == [DENSE, 4, 4]
    st = stack_sets(back, 1)
    assert st.shape == (3, 4, 9)
    assert torch.equal(st[1], back[1].thresholds[1])
    assert torch.equal(st[0, :, :6], back[0].thresholds[1])
    assert torch.equal(st[0, :, 6:], back[0].thresholds[1, :, 5:6].expand(4, 3))  # last column repeated
    assert stack_sets(back, 1, "sdc_table") is None


def test_set_index_errors_name_the_file(tmp_path):
    path = save_threshold_sets(tmp_path / "m.safetensors", [_set(seed=1), _set(seed=2, layer_k=[DENSE, 4, 4])])
    with pytest.raises(ThresholdFileError, match=r"m.safetensors' holds 2 threshold sets \(0: k=2, 1: k=4\)"):
        load_thresholds(path)
    with pytest.raises(ThresholdFileError, match=r"index 2 is out of range for thresholds file .*m.safetensors"):
        load_thresholds(path, 2)
    with pytest.raises(ThresholdFileError, match="out of range"):
        pick_set(load_threshold_sets(path), -1, str(path))


def test_sets_of_one_file_must_agree():
    with pytest.raises(ThresholdFileError, match="share the placement"):
        save_threshold_sets("/nonexistent/x.safetensors", [_set(), _set("pre_softmax")])
    with pytest.raises(ThresholdFileError, match="share the selection"):
        save_threshold_sets("/nonexistent/x.safetensors", [_set(), _set(selection="group")])


def test_group_sets_are_per_kv_head_and_selection_is_checked(tmp_path):
    g = _set(selection="group")
    assert g.num_heads == 2 and g.num_q_heads == 4
    back = load_thresholds(g.save(tmp_path / "g.safetensors"))
    assert back.selection == "group" and back.thresholds.shape == (3, 2, 6)
    with pytest.raises(ThresholdFileError, match=r"g.safetensors\).*selection='group'.*selection='head'"):
        back.check_model(dict(CFG), "tiny", "post_softmax", selection="head")
    back.check_model(dict(CFG), "tiny", "post_softmax", selection="group")
    wrong = _set(selection="group")
    wrong.thresholds = _table(4, 6, "post_softmax")  # per query head, but selection group
    with pytest.raises(ThresholdFileError, match="num_kv_heads"):
        wrong.save(tmp_path / "w.safetensors")


def test_other_model_file_is_a_clear_error(tmp_path):
    path = _set().save(tmp_path / "smol.safetensors")
    gemma = dict(model_type="gemma3_text", num_layers=18, num_q_heads=4, num_kv_heads=1, head_dim=256)
    with pytest.raises(ThresholdFileError, match=r"smol.safetensors.*'tiny'.*gemma3_text.*num_layers: file 3 vs model 18"):
        load_thresholds(path).check_model(gemma, "gemma-3-270m")


def _model(L, H, domain, anchor=4.0, value=-3.0, slope=-0.5):
    an = np.full((L, H), anchor)
    av = np.full((L, H), value)
    an[0], av[0] = np.nan, np.nan  # dense layer
    return LengthModel(domain, an, av, np.full((L, H), slope))


def test_length_model_extends_the_table_and_is_stored_compactly(tmp_path):
    Rc, R = 5, 40
    stored = _table(4, Rc, "post_softmax")
    m = _model(3, 4, "log_prob")
    th = extend_table(stored, m, R)
    # independent: beyond Rc, theta = exp(value + slope * (log n - log anchor)), dense layer -inf
    n = np.arange(Rc + 1, R + 1)
    expect = np.exp(-3.0 - 0.5 * (np.log(n) - np.log(4.0)))
    np.testing.assert_allclose(th[1, 2, Rc:].numpy(), expect, rtol=1e-6)
    assert torch.all(torch.isneginf(th[0]))
    ts = ThresholdSet(thresholds=th, counts=torch.ones(3, 4, Rc, dtype=torch.int64), layer_k=list(LAYER_K),
                      placement="post_softmax", model_name="tiny", attention_config=dict(CFG), alpha=None,
                      estimator="count", length_model=m)
    path = ts.save(tmp_path / "lm.safetensors")
    back = load_thresholds(path)
    assert torch.equal(back.thresholds, th) and back.calibrated_row_ids == Rc and back.max_row_id == R
    np.testing.assert_array_equal(back.length_model.slope, m.slope)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert f.get_slice("set0.thresholds").get_shape() == [3, 4, Rc]  # only calibrated columns stored
    ts.thresholds = th.clone()
    ts.thresholds[1, 0, 30] = 0.5  # beyond the calibrated row ids, not the model's value
    with pytest.raises(ThresholdFileError, match="must follow the length model"):
        ts.save(tmp_path / "bad.safetensors")


@pytest.mark.parametrize("feature", ["log_one_minus_k_over_n", "inverse_n_over_k", "log_log_n_over_k"])
def test_threshold_length_features_round_trip(tmp_path, feature):
    # log_one_minus_k_over_n is what calibration writes now; inverse_n_over_k and log_log_n_over_k
    # are what earlier files hold: all must load and extend their tables by their own law
    Rc, R = 5, 64
    stored = _table(4, Rc, "pre_softmax")
    an, av = np.full((3, 4), 5.0), np.full((3, 4), 1.25)
    an[0], av[0] = np.nan, np.nan
    m = LengthModel("logit", an, av, np.full((3, 4), 0.8), feature, np.array(LAYER_K))
    th = extend_table(stored, m, R)
    n = np.arange(Rc + 1, R + 1, dtype=np.float64)
    k = LAYER_K[2]
    x = {"inverse_n_over_k": lambda v: -k / v, "log_log_n_over_k": lambda v: np.log(np.log(v / k)),
         "log_one_minus_k_over_n": lambda v: np.log(1 - k / v)}[feature]
    np.testing.assert_allclose(th[2, 1, Rc:].numpy(), 1.25 + 0.8 * (x(n) - x(5.0)), rtol=1e-5)
    ts = ThresholdSet(thresholds=th, counts=torch.ones(3, 4, Rc, dtype=torch.int64), layer_k=list(LAYER_K),
                      placement="pre_softmax", model_name="tiny", attention_config=dict(CFG), alpha=None,
                      estimator="count", length_model=m)
    back = load_thresholds(ts.save(tmp_path / f"{feature}.safetensors"))
    assert back.length_model.feature == feature and torch.equal(back.thresholds, th)
    if feature != "log_log_n_over_k":  # saturates: never above the limit value - slope * x(anchor)
        assert float(th[2, 1, -1]) < 1.25 - 0.8 * x(5.0)


def test_unknown_length_feature_is_a_clear_error():
    from topth_ops.thresholds import feature_of

    with pytest.raises(ValueError, match="feature must be one of"):
        feature_of(np.array([10.0]), "sqrt_n", 4)


def _rewrite_set0(path, out, **entries):
    """Copy of a format-2 file with set 0's metadata entries replaced."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    sets = json.loads(meta["sets"])
    sets[0].update(entries)
    meta["sets"] = json.dumps(sets)
    save_file(tensors, str(out), metadata=meta)
    return out


_BAD_LENGTH_METADATA = [{"length_feature": "sqrt_n"}, {"length_feature": ""}, {"length_feature": ["inverse_n_over_k"]},
                        {"layer_k": ["a", 2, 3]}, {"layer_k": [None, 2, 3]}, {"layer_k": [0, 2]}, {"layer_k": 3}]


@pytest.mark.parametrize("feature, entries",
                         [(f, e) for f in ("log_one_minus_k_over_n", "inverse_n_over_k", "log_n")
                          for e in _BAD_LENGTH_METADATA]
                         + [("inverse_n_over_k", {"layer_k": [10 ** 30, 2, 3]})])
def test_bad_length_metadata_is_a_file_error_naming_the_file(tmp_path, feature, entries):
    Rc, R = 5, 16
    an, av = np.full((3, 4), 5.0), np.full((3, 4), 1.25)
    an[0], av[0] = np.nan, np.nan
    m = LengthModel("logit", an, av, np.full((3, 4), 0.8), feature, np.array(LAYER_K))
    ts = ThresholdSet(thresholds=extend_table(_table(4, Rc, "pre_softmax"), m, R),
                      counts=torch.ones(3, 4, Rc, dtype=torch.int64), layer_k=list(LAYER_K), placement="pre_softmax",
                      model_name="tiny", attention_config=dict(CFG), alpha=None, estimator="count", length_model=m)
    bad = _rewrite_set0(ts.save(tmp_path / "good.safetensors"), tmp_path / "bad.safetensors", **entries)
    with pytest.raises(ThresholdFileError, match="bad.safetensors"):
        load_thresholds(bad)


def test_k_features_need_k():
    from topth_ops.thresholds import feature_of

    for feature in ("log_one_minus_k_over_n", "inverse_n_over_k", "log_log_n_over_k"):
        with pytest.raises(ValueError, match="needs k"):
            feature_of(np.array([10.0]), feature)
        m = LengthModel("logit", np.array([[5.0]]), np.array([[1.0]]), np.array([[1.0]]), feature)
        with pytest.raises(ValueError, match="needs k"):
            m.theta(np.array([10.0]))
    assert feature_of(np.array([np.e]), "log_n") == pytest.approx(1.0)


@pytest.mark.parametrize("feature", ["log_n", "inverse_n_over_k", "log_one_minus_k_over_n"])
def test_sdc_length_feature_round_trips(tmp_path, feature):
    # the SDC table's length model keeps its own feature (before 2026-12-01 it was not stored and
    # every file's SDC model loaded as log n); a file without the entry still loads as log n
    Rc, R = 5, 48
    stored = _table(4, Rc, "pre_softmax")
    an, av = np.full((3, 4), 5.0), np.full((3, 4), -2.0)
    an[0], av[0] = np.nan, np.nan
    sm = LengthModel("log", an.copy(), av.copy(), np.full((3, 4), 0.6), feature, np.array(LAYER_K))
    sdc_c = torch.full((3, 4, Rc), 0.25)
    sdc_c[0] = 0.0
    sdc = extend_sdc(sdc_c, sm, R)
    n = np.arange(Rc + 1, R + 1, dtype=np.float64)
    x = {"log_n": np.log, "inverse_n_over_k": lambda v: -LAYER_K[2] / v,
         "log_one_minus_k_over_n": lambda v: np.log(1 - LAYER_K[2] / v)}[feature]
    np.testing.assert_allclose(sdc[2, 3, Rc:].numpy(), np.exp(-2.0 + 0.6 * (x(n) - x(5.0))), rtol=1e-5)
    lm = LengthModel("logit", an.copy(), np.full((3, 4), 1.0), np.full((3, 4), 0.1))
    ts = ThresholdSet(thresholds=extend_table(stored, lm, R), counts=torch.ones(3, 4, Rc, dtype=torch.int64),
                      layer_k=list(LAYER_K), placement="pre_softmax", model_name="tiny", attention_config=dict(CFG),
                      alpha=None, estimator="count", length_model=lm, sdc_table=sdc, sdc_length_model=sm)
    path = ts.save(tmp_path / "sdc.safetensors")
    back = load_thresholds(path)
    assert back.sdc_length_model.feature == feature and torch.equal(back.sdc_table, sdc)
    old = load_thresholds(_rewrite_set0(path, tmp_path / "old.safetensors", sdc_length_feature=None))
    assert old.sdc_length_model.feature == "log_n"
    assert torch.equal(old.sdc_table, sdc) == (feature == "log_n")


def _pre_set(m, R=48, Rc=5, sdc=None, sm=None):
    return ThresholdSet(thresholds=extend_table(_table(4, Rc, "pre_softmax"), m, R),
                        counts=torch.ones(3, 4, Rc, dtype=torch.int64), layer_k=list(LAYER_K),
                        placement="pre_softmax", model_name="tiny", attention_config=dict(CFG), alpha=None,
                        estimator="count", length_model=m, sdc_table=sdc, sdc_length_model=sm)


def _k_model(anchor=5.0, slope=0.8, feature="log_one_minus_k_over_n", k=LAYER_K, domain="logit", value=1.25):
    an, av = np.full((3, 4), anchor), np.full((3, 4), value)
    an[0], av[0] = np.nan, np.nan
    return LengthModel(domain, an, av, np.full((3, 4), slope), feature, None if k is None else np.array(k))


@pytest.mark.parametrize("anchor, slope", [(2.5, 0.8), (3.0, -0.8), (3.0, 0.8)])
def test_length_model_anchor_at_or_below_k_is_refused(tmp_path, anchor, slope):
    # x(anchor) = log(1 - k / anchor) is -inf or NaN there: the extension would be silently dense
    # (every row) or +inf; saving refuses it, naming the model, the layer and k
    with pytest.raises(ThresholdFileError, match=r"'length_model' layer 2: anchor row ids must exceed k=3"):
        _pre_set(_k_model(anchor=anchor, slope=slope)).save(tmp_path / "a.safetensors")


def test_length_model_k_must_match_layer_k_and_feature_must_be_known(tmp_path):
    with pytest.raises(ThresholdFileError,
                       match=r"needs k per layer equal to the set's layer_k \[0, 2, 3\], got \[0, 2, 5\]"):
        ts = _pre_set(_k_model(k=[DENSE, 2, 5]), R=5)  # R == Rc: nothing extended, the file would load wrong
        ts.save(tmp_path / "k.safetensors")
    with pytest.raises(ThresholdFileError, match="got None"):
        _pre_set(_k_model(k=None), R=5).save(tmp_path / "n.safetensors")
    with pytest.raises(ThresholdFileError, match="feature must be one of"):
        _pre_set(_k_model(feature="sqrt_n", k=None), R=5).save(tmp_path / "f.safetensors")


@pytest.mark.parametrize("entry", ["sdc_length_feature", "length_feature"])
def test_malformed_feature_without_its_model_is_a_file_error(tmp_path, entry):
    ts = _set()  # post_softmax, no length model, no SDC table
    bad = _rewrite_set0(ts.save(tmp_path / "good.safetensors"), tmp_path / "bad.safetensors", **{entry: "bogus"})
    with pytest.raises(ThresholdFileError,
                       match=r"bad.safetensors.*unknown .* feature 'bogus'; expected one of log_n, "):
        load_thresholds(bad)


def test_overflowing_sdc_model_is_refused_not_zeroed(tmp_path):
    # an SDC model whose extension overflows to +inf used to become 0 (no compensation) silently
    sm = _k_model(feature="log_n", k=None, domain="log", value=100.0, slope=0.0)
    sdc_c = torch.full((3, 4, 5), 0.25)
    sdc_c[0] = 0.0
    sdc = torch.cat([sdc_c, torch.full((3, 4, 43), float("inf"))], dim=-1)
    with pytest.raises(ThresholdFileError, match="'sdc_length_model' layer 1 head 0: the model must give a log "
                                                 "dropped mass below 88.72"):
        _pre_set(_k_model(), sdc=sdc, sm=sm).save(tmp_path / "s.safetensors")
