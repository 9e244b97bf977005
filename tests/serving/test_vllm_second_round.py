"""A second calibration round in the engine (mode "calibrate" with a served file): on the
hand-built mixed batch of test_vllm_calibration.py (prompts, chunked prefill, decodes,
written by vLLM's own cache writer), every row of the thresholded layer, prompt rows
included, is Top-Theta attention with the served set (float64 oracle per row), and the
rows recorded are those a first round records; settings that name another target than the
served set's are refused."""

import math
import re

import numpy as np
import pytest
import torch

from topth_ops.conformance.oracle import oracle_decode
from topth_ops.thresholds import load_thresholds
from topth_ops.vllm.calib_plan import check_calibration, token_rows
from topth_ops.vllm.calibration import EngineCalibration
from topth_ops.vllm.settings import TopthConfigError, from_sources

from .cpu_engine import ISAS, LAYER, Engine, make_impl
from .test_vllm_calibration import PLAN, D, Hkv, Hq, K, _reference

pytestmark = pytest.mark.vllm


def _settings(tmp_path, **kw):
    cfg = {"mode": "calibrate", "thresholds": "unused", "calibrate_out": str(tmp_path / "r2.safetensors"),
           "metrics": False, "log_interval": 0}
    cfg.update(kw)
    return from_sources({}, {"topth": cfg})


def _served(make_cfg, make_threshold_set, placement):
    cfg = make_cfg(layers=4, heads=Hq, kv_heads=Hkv, head_dim=D)
    ts = make_threshold_set(cfg, rows=128, k=K, seed=3, placement=placement)
    if placement == "pre_softmax":
        ts.thresholds.mul_(20)  # logits of the random rows are O(1): keep some, drop some
    for layer in (0, 1, 3):
        ts.layer_k[layer] = 0  # the hand-built engine runs layer 2 only
    return cfg, ts


@pytest.mark.parametrize("isa,dtype", ISAS)
@pytest.mark.parametrize("placement,vmc", [("post_softmax", True), ("pre_softmax", False)])
def test_second_round_thresholds_every_row_and_records_the_first_rounds_rows(
        monkeypatch, tmp_path, isa, dtype, placement, vmc, make_cfg, make_threshold_set):
    cfg, ts = _served(make_cfg, make_threshold_set, placement)
    s = _settings(tmp_path, vmc=vmc)
    calib = EngineCalibration(s, cfg, "tiny", 0, 1, 256, served=ts)
    assert (calib.placements, calib.selections, calib.targets) == ([placement], ["head"], [list(ts.layer_k)])
    impl, stats = make_impl(monkeypatch, ts, s, Hq, Hkv, D, sets=[ts], calib=calib)
    eng = Engine(impl, isa, dtype, Hq, nb=12, bs=32, H=Hkv, D=D)
    steps, scale, kept, dense = [], 1 / math.sqrt(D), 0, 0
    lens = {}
    for plan in PLAN:
        q, out, _, _, qsl = eng.step(plan)
        steps.append((q, qsl))
        assert not torch.isnan(out.float()).any()
        for i, (seq, T) in enumerate(plan):
            lens[seq] = n = lens.get(seq, 0) + T
            kk, vv = eng.rows[seq]
            kb = kk[:n].transpose(0, 1)[None].expand(T, -1, -1, -1)
            vb = vv[:n].transpose(0, 1)[None].expand(T, -1, -1, -1)
            rows = torch.arange(n - T + 1, n + 1)
            want = oracle_decode(q[qsl[i]:qsl[i + 1]], kb, vb, rows, ts.thresholds[LAYER], scale=scale,
                                 placement=placement, vmc=vmc)
            tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
            np.testing.assert_allclose(out[qsl[i]:qsl[i + 1]].double().numpy(), want.out, rtol=tol, atol=tol)
            kept += int(want.v_rows.sum())
            dense += int((rows[:, None] * torch.ones(1, Hkv, dtype=torch.int64)).sum())
    assert 0 < kept < dense  # rows were dropped: the check above is not dense attention
    ref = _reference(eng, steps, True)
    assert torch.equal(calib.acc.rows_per_id[LAYER], ref.rows_per_id[LAYER])
    assert (calib.decode_rows, calib.prefill_rows) == (4, 62 + 4 + 57 + 1)
    rep = stats.report()
    assert not rep["last_steps"] and rep["prefill_tokens_dense"] == 0, rep  # no statistics in a second round
    path, = calib.write("test")
    assert "second round, every row served with thresholds file" in calib.source()
    assert load_thresholds(path).layerwise_rule == {"sdc": "none", "vmc": vmc}  # the rule the rows ran with
    calib.done = True


def test_token_rows_match_a_loop():
    qsl = torch.tensor([0, 1, 2, 42, 51])
    seq_lens = torch.tensor([71, 13, 65, 9])
    table = torch.arange(4 * 3).view(4, 3)
    rows, bt = token_rows(qsl, seq_lens, table)
    want_rows, want_bt = [], []
    for i in range(4):
        T = int(qsl[i + 1] - qsl[i])
        for t in range(T):
            want_rows.append(int(seq_lens[i]) - T + t + 1)
            want_bt.append(table[i].tolist())
    assert rows.tolist() == want_rows and bt.tolist() == want_bt and rows.dtype == bt.dtype == torch.int32
    with pytest.raises(ValueError, match="more query tokens than its seq_lens"):
        token_rows(torch.tensor([0, 5]), torch.tensor([4]), table[:1])


def test_second_round_settings(tmp_path, make_cfg, make_threshold_set):
    cfg, ts = _served(make_cfg, make_threshold_set, "pre_softmax")
    s = _settings(tmp_path, vmc=True, threshold_set=0)  # decode settings apply in a second round
    assert check_calibration(s, cfg, 1, ts)[1:] == ([list(ts.layer_k)], ["pre_softmax"], ["head"])
    with pytest.raises(TopthConfigError, match="dense_beyond does not apply to a second calibration round"):
        _settings(tmp_path, dense_beyond=64)
    for kw, named in (({"calibrate_placement": "post_softmax"}, ["placement"]),
                      ({"calibrate_selection": "group"}, ["selection"]),
                      ({"calibrate_k": "16", "calibrate_layer_k": ""}, ["k per layer"]),
                      ({"calibrate_layer_k": "1:dense"}, ["k per layer"]),
                      ({"calibrate_placement": "both", "calibrate_selection": "both"}, ["placement", "selection"])):
        with pytest.raises(TopthConfigError, match="records the target of the set it serves") as e:
            check_calibration(_settings(tmp_path, **kw), cfg, 1, ts)
        # the message names exactly the settings that differ
        assert re.findall(r"(k per layer|placement|selection) \(calibrate_\w+[^)]*\): asked", str(e.value)) == named
    # a k given that is the set's own map is accepted
    ok = _settings(tmp_path, calibrate_k=str(K), calibrate_layer_k="0:dense,1:dense,3:dense",
                   calibrate_placement="pre_softmax")
    assert check_calibration(ok, cfg, 1, ts)[1] == [list(ts.layer_k)]
    # without a file, decode settings are still refused in mode calibrate
    with pytest.raises(TopthConfigError, match="without a threshold file serves every row dense"):
        _settings(tmp_path, thresholds=None, vmc=True, calibrate_k="8")
