"""Calibration inside the engine (mode "calibrate"): the rows the CPU backend records on a
hand-built mixed batch (prompts, chunked prefill, decodes) written by vLLM's own cache
writer, against an accumulator fed float64 scores of the same rows computed here from the
written K and Q; the files it writes; tensor-parallel parts merged; bad settings."""

import atexit
import math
import os
import signal
import time

import numpy as np
import pytest
import torch

from topth_ops.calibration import CountAccumulator
from topth_ops.paged import to_paged
from topth_ops.thresholds import load_threshold_sets
from topth_ops.vllm.calibration import EngineCalibration
from topth_ops.vllm.settings import TopthConfigError, from_sources

from .cpu_engine import ISAS, LAYER, Engine, make_impl

pytestmark = pytest.mark.vllm

Hq, Hkv, D, K = 4, 2, 64, 8
DENSE_OTHERS = "0:dense,1:dense,3:dense"  # the hand-built engine runs layer 2 only


def _settings(tmp_path, **kw):
    cfg = {"mode": "calibrate", "calibrate_out": str(tmp_path / "th_{placement}_{selection}.safetensors"),
           "calibrate_k": str(K), "calibrate_layer_k": DENSE_OTHERS, "calibrate_placement": "both",
           "calibrate_selection": "both", "metrics": False, "log_interval": 0}
    cfg.update(kw)
    return from_sources({}, {"topth": cfg})


PLAN = [[("A", 70), ("B", 12)], [("A", 1), ("B", 1), ("C", 40)], [("A", 1), ("B", 1), ("D", 9), ("C", 25)]]


def _reference(eng, steps, prefill):
    """An accumulator fed float64 scores (rounded to float32) of the rows a calibrating
    engine records, in the engine's order (so the histogram ranges match)."""
    ref = CountAccumulator(4, Hq, Hkv, 256, [K], ("pre_softmax", "post_softmax"), ("head", "group"))
    scale = 1 / math.sqrt(D)
    G = Hq // Hkv
    lens = {}
    for plan, (q, qsl) in zip(PLAN, steps):
        for i, (seq, T) in enumerate(plan):
            n0 = lens.get(seq, 0)
            lens[seq] = n0 + T
            decode = T == 1 and n0 > 0
            if not (decode or prefill):
                continue
            ids = [n for n in range(n0 + 1, n0 + T + 1) if n > K]
            if not ids:
                continue
            k = eng.rows[seq][0][: n0 + T].double().numpy()
            qq = q[qsl[i]:qsl[i + 1]].double().numpy()[[n - n0 - 1 for n in ids]]
            a = np.full((Hq, len(ids), n0 + T), -np.inf)
            for r, n in enumerate(ids):
                for h in range(Hq):
                    a[h, r, :n] = k[:n, h // G] @ qq[r, h] * scale
            ref.record(LAYER, torch.from_numpy(a).float()[None], torch.tensor(ids)[None])
    return ref


@pytest.mark.parametrize("isa,dtype", ISAS)
@pytest.mark.parametrize("prefill", [True, False])
def test_engine_records_the_served_rows(monkeypatch, tmp_path, isa, dtype, prefill, make_cfg):
    s = _settings(tmp_path, calibrate_prefill=prefill)
    calib = EngineCalibration(s, make_cfg(layers=4, heads=Hq, kv_heads=Hkv, head_dim=D), "tiny", 0, 1, 256)
    impl, _ = make_impl(monkeypatch, None, s, Hq, Hkv, D, calib=calib)
    eng = Engine(impl, isa, dtype, Hq, nb=12, bs=32, H=Hkv, D=D)
    steps = []
    for plan in PLAN:
        q, _, _, _, qsl = eng.step(plan)
        steps.append((q, qsl))
    ref = _reference(eng, steps, prefill)
    # the same rows, row id by row id
    assert torch.equal(calib.acc.rows_per_id[LAYER], ref.rows_per_id[LAYER])
    # rows > k: prompts A 9-70, B 9-12, C 9-65 (two chunks), D 9; decodes A 71-72, B 13-14
    n_prompt = 62 + 4 + 57 + 1 if prefill else 0
    assert int(calib.acc.rows_per_id[LAYER].sum()) == n_prompt + 4
    assert (calib.decode_rows, calib.prefill_rows, calib.prompts) == (4, n_prompt, 4)
    paths = calib.write("test")
    assert len(paths) == 4 and all(os.path.isfile(p) for p in paths)
    targets = [[0, 0, K, 0]]
    want_th = ref.results(targets, 8 * 72, calibrated_rows=72)
    assert [os.path.basename(p).split("_")[1] for p in paths] == ["post", "post", "pre", "pre"]  # recommended first
    for path in paths:
        ts, = load_threshold_sets(path)
        p, sel = ts.placement, ts.selection
        assert path.endswith(f"th_{p}_{sel}.safetensors") and ts.layer_k == [0, 0, K, 0]
        assert ts.calibration_text.startswith("served traffic: ") and ts.counts.shape[-1] == 72
        got, exp = ts.thresholds[LAYER], want_th[(0, p, sel)].thresholds[LAYER]
        fin = torch.isfinite(exp)
        assert torch.equal(fin, torch.isfinite(got))
        # histogram bins of the same values: equal up to float32 rounding of a score at a bin edge
        width = float(calib.acc.range[(p, sel)][LAYER, :, 1].max())
        assert float((got[fin] - exp[fin]).abs().max()) <= width, (p, sel)


def _hnd_cache(seqs, g):
    """A paged HND cache of ``seqs`` random sequences (``{name: length}``) and their rows."""
    lens = torch.tensor(list(seqs.values()))
    k = torch.randn(len(seqs), Hkv, int(lens.max()), D, generator=g)
    kc, _, table = to_paged(k, k.clone(), lens, 16, kv_layout="HND", num_blocks=64, shuffle=True, generator=g)
    return kc, table, lens


def test_tensor_parallel_parts_merge_into_the_whole_file(tmp_path, make_cfg):
    """Two ranks (each its query heads and KV head) give the file one rank of all heads gives."""
    g = torch.Generator().manual_seed(3)
    kc, table, lens = _hnd_cache({"a": 150, "b": 90}, g)
    q = torch.randn(int(lens.sum()), Hq, D, generator=g)
    qsl = torch.tensor([0, int(lens[0]), int(lens.sum())])
    cfg = make_cfg(layers=4, heads=Hq, kv_heads=Hkv, head_dim=D)
    out = {}
    for tp in (1, 2):
        s = _settings(tmp_path, calibrate_out=str(tmp_path / f"tp{tp}_{{placement}}_{{selection}}.safetensors"))
        ranks = [EngineCalibration(s, cfg, "tiny", r, tp, 256) for r in range(tp)]
        for r, c in enumerate(ranks):
            hq, hk = Hq // tp, Hkv // tp
            c.observe(LAYER, q[:, r * hq:(r + 1) * hq], kc[:, r * hk:(r + 1) * hk], "HND", qsl, lens, table, 0,
                      1 / math.sqrt(D))
        paths = [c.write("test") for c in reversed(ranks)][-1]  # rank 1 first: rank 0 waits for its part
        out[tp] = [load_threshold_sets(p)[0] for p in paths]
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".part")]
    for one, two in zip(out[1], out[2]):
        assert torch.equal(one.counts, two.counts) and one.thresholds.shape == two.thresholds.shape
        torch.testing.assert_close(two.thresholds, one.thresholds, rtol=0, atol=1e-5)


def test_no_rows_writes_no_file(tmp_path, make_cfg, caplog):
    s = _settings(tmp_path)
    c = EngineCalibration(s, make_cfg(layers=4, heads=Hq, kv_heads=Hkv, head_dim=D), "tiny", 0, 1, 256)
    g = torch.Generator().manual_seed(0)
    kc, table, lens = _hnd_cache({"a": 5}, g)  # rows <= k: nothing to record
    c.observe(LAYER, torch.randn(5, Hq, D), kc, "HND", torch.tensor([0, 5]), lens, table, 0, 0.125)
    with caplog.at_level("WARNING", logger="vllm.topth_ops"):
        assert c.write("3 requests finished", final=True) == []
        assert c.write("engine shutdown", final=True) == []  # a trigger before any row: recording goes on
    assert "no threshold file was written" in caplog.text and not list(tmp_path.iterdir())
    assert caplog.text.count("no rows were recorded") == 1  # warned once
    assert not c.done and c.report()["files_written"] == 0


def test_sigusr1_writes_a_snapshot(tmp_path, make_cfg):
    s = _settings(tmp_path, calibrate_placement="post_softmax", calibrate_selection="head")
    c = EngineCalibration(s, make_cfg(layers=4, heads=Hq, kv_heads=Hkv, head_dim=D), "tiny", 0, 1, 256)
    g = torch.Generator().manual_seed(1)
    kc, table, lens = _hnd_cache({"a": 40}, g)
    c.observe(LAYER, torch.randn(40, Hq, D, generator=g), kc, "HND", torch.tensor([0, 40]), lens, table, 0, 0.125)
    old = signal.getsignal(signal.SIGUSR1)
    try:
        c.start_triggers()
        os.kill(os.getpid(), signal.SIGUSR1)
        path = tmp_path / "th_post_softmax_head.safetensors"
        deadline = time.monotonic() + 10
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert path.exists() and not c.done  # a snapshot: recording goes on
    finally:
        c.done = True
        atexit.unregister(c.at_exit)
        signal.signal(signal.SIGUSR1, old)


@pytest.mark.parametrize("kw,msg", [
    ({"calibrate_out": ""}, "needs an output file"),
    ({"calibrate_k": ""}, "needs the k list"),
    ({"calibrate_k": "8,x"}, "calibrate_k must be integers"),
    ({"calibrate_placement": "pre"}, "calibrate_placement must be one of"),
    ({"calibrate_selection": "kv"}, "calibrate_selection must be one of"),
    ({"calibrate_requests": "-1"}, "calibrate_requests must be an integer >= 0"),
    ({"calibrate_layer_k": "0:x"}, "calibrate_layer_k"),
    ({"thresholds": "/x.safetensors", "dense_beyond": "8"}, "dense_beyond does not apply to a second"),
])
def test_bad_calibrate_settings(tmp_path, kw, msg):
    with pytest.raises(TopthConfigError, match=msg):
        _settings(tmp_path, **kw)


def test_bad_calibrate_settings_for_the_model(tmp_path, make_cfg):
    cfg = make_cfg(layers=4, heads=Hq, kv_heads=Hkv, head_dim=D)
    with pytest.raises(TopthConfigError, match="cannot create files|is not a directory"):
        EngineCalibration(_settings(tmp_path, calibrate_out="/proc/topth/th_{placement}_{selection}.safetensors"),
                          cfg, "tiny", 0, 1, 256)
    with pytest.raises(TopthConfigError, match=r"must contain \{selection\}"):
        EngineCalibration(_settings(tmp_path, calibrate_out=str(tmp_path / "th_{placement}.safetensors")),
                          cfg, "tiny", 0, 1, 256)
    with pytest.raises(TopthConfigError, match="whole GQA groups"):
        EngineCalibration(_settings(tmp_path), cfg, "tiny", 0, 4, 256)
    with pytest.raises(TopthConfigError, match="calibrate_layer_k"):
        EngineCalibration(_settings(tmp_path, calibrate_layer_k="7:dense"), cfg, "tiny", 0, 1, 256)


def test_serve_calibrate_options(tmp_path, capsys):
    from transformers import LlamaConfig

    from topth_ops.cli import main

    model = tmp_path / "m"
    LlamaConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                head_dim=16).save_pretrained(model)
    out = tmp_path / "th_{placement}.safetensors"
    assert main(["serve", str(model), "--calibrate", str(out), "--k", "8,16", "--placement", "both",
                 "--calibrate-requests", "64", "--no-calibrate-prefill", "--dry-run"]) == 0
    err = capsys.readouterr().err
    for want in (f"TOPTH_VLLM_CALIBRATE_OUT={out}", "TOPTH_VLLM_CALIBRATE_K=8,16", "TOPTH_VLLM_CALIBRATE_PLACEMENT=both",
                 "TOPTH_VLLM_CALIBRATE_REQUESTS=64", "TOPTH_VLLM_CALIBRATE_PREFILL=0"):
        assert want in err
    for argv, msg in [(["--k", "8"], "--k needs --calibrate OUT"),
                      (["--calibrate", str(tmp_path / "x.safetensors")], "needs the k list"),
                      (["--calibrate", str(tmp_path / "x.safetensors"), "--k", "8", "--selection", "both"],
                       "must contain {selection}"),
                      (["--calibrate", str(tmp_path / "x.safetensors"), "--k", "8", "--layer-k", "9:dense"],
                       "calibrate_layer_k"),
                      (["--calibrate", "/proc/topth/x.safetensors", "--k", "8"], "calibrate_out")]:
        assert main(["serve", str(model), *argv, "--dry-run"]) == 2, argv
        assert msg in capsys.readouterr().err, argv


def test_enable_calibrate(tmp_path, monkeypatch):
    from topth_ops.vllm import enable
    from topth_ops.vllm.settings import ENV

    for var in ENV.values():
        monkeypatch.setenv(var, "")  # recorded, so what enable() sets is removed afterwards
        monkeypatch.delenv(var)
    s = enable(calibrate={"out": str(tmp_path / "th.safetensors"), "k": "16,32", "prefill": False, "requests": 8})
    assert (s.mode, s.calibrate_ks(), s.calibrate_prefill, s.calibrate_requests) == ("calibrate", [16, 32], False, 8)
    assert os.environ["TOPTH_VLLM_CALIBRATE_K"] == "16,32"
    with pytest.raises(TopthConfigError, match="unknown calibrate key 'kk'"):
        enable(calibrate={"out": "x", "kk": 1})


def test_layers_without_long_rows_are_written_dense_and_the_backend_turns_on(tmp_path, make_cfg, caplog):
    from topth_ops.vllm.settings import is_active

    assert is_active({"TOPTH_VLLM_CALIBRATE_OUT": str(tmp_path / "x.safetensors")})  # serve --calibrate, enable()
    s = _settings(tmp_path, calibrate_layer_k="0:dense,1:dense,3:64", calibrate_placement="post_softmax",
                  calibrate_selection="head")
    c = EngineCalibration(s, make_cfg(layers=4, heads=Hq, kv_heads=Hkv, head_dim=D), "tiny", 0, 1, 256)
    g = torch.Generator().manual_seed(2)
    kc, table, lens = _hnd_cache({"a": 40}, g)  # rows up to 40: layer 2 (k=8) is calibrated, layer 3 (k=64) not
    for layer in (2, 3):
        c.observe(layer, torch.randn(40, Hq, D, generator=g), kc, "HND", torch.tensor([0, 40]), lens, table, 0, 0.125)
    with caplog.at_level("WARNING", logger="vllm.topth_ops"):
        path, = c.write("test", final=True)
    assert "layer 3 saw no row longer than its k=64" in caplog.text and c.done
    ts, = load_threshold_sets(path)
    assert ts.layer_k == [0, 0, K, 0]


def test_idle_needs_a_quiet_engine_longer_than_a_step(tmp_path, make_cfg, monkeypatch):
    from topth_ops.vllm import calibration as cal

    c = EngineCalibration(_settings(tmp_path), make_cfg(layers=4, heads=Hq, kv_heads=Hkv, head_dim=D), "tiny", 0, 1,
                          256)
    monkeypatch.setattr(cal.requests_mod, "batch_counts", lambda: (5, 2))
    c._last_forward = time.monotonic() - 2 * cal.IDLE_S
    assert c.idle() and c.finished_requests() == 5  # idle: the last batch has finished
    c._in_forward = True  # a long layer forward in progress
    assert not c.idle() and c.finished_requests() == 3
    c._in_forward, c._step_s = False, 3 * cal.IDLE_S  # slow steps: gaps between layers are long
    assert not c.idle()
