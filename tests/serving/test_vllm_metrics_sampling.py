"""Statistics sampling (settings ``metrics_every``): one decode step in N is measured (op
statistics, fidelity sums, the JSON report's V rows); decode steps, tokens and rows per set
are counted on every step. Runs the backend's per-step path (decode_sets, decode_rows,
record) on hand-made caches, no engine; expected counts are computed here."""

import pytest
import torch

from topth_ops.thresholds import ThresholdSet
from topth_ops.vllm import runtime as R
from topth_ops.vllm.settings import TopthConfigError, VllmTopthSettings, from_sources
from topth_ops.vllm.stats import ServingStats

pytestmark = pytest.mark.vllm

L, HQ, HKV, D, BS = 2, 4, 2, 16, 16


def _runtime(every: int, metrics: bool = True) -> R.Runtime:
    S = 128
    ac = {"model_type": "llama", "num_layers": L, "num_q_heads": HQ, "num_kv_heads": HKV, "head_dim": D}
    ts = ThresholdSet(torch.full((L, HKV, S), 0.02), torch.ones(L, HKV, S, dtype=torch.int64), [8] * L,
                      "post_softmax", "synthetic", ac, selection="group")
    s = VllmTopthSettings(mode="topth", thresholds="unused", metrics=metrics, metrics_every=every, log_interval=0.0)
    return R.Runtime(s, ts, 0, 1, ServingStats("topth", None, 0.0), "synthetic")


def _run(rt: R.Runtime, batch_sizes):
    g = torch.Generator().manual_seed(0)
    nb = 32
    kc, vc = torch.randn(nb, HKV, BS, D, generator=g), torch.randn(nb, HKV, BS, D, generator=g)
    rules = [R.layer_rule(rt, i, HQ, HKV, "cpu") for i in range(L)]
    measured, read = [], 0
    with torch.inference_mode():
        for step, B in enumerate(batch_sizes):
            lens = torch.tensor([40 + 3 * step + i for i in range(B)], dtype=torch.int32)
            bt = torch.arange(B * 4, dtype=torch.int32).view(B, 4)
            q = torch.randn(B, HQ, D, generator=g)
            sets = R.decode_sets(rt, B, lens)
            measured.append(sets.measured)
            for i in range(L):
                _, st = R.decode_rows(rt, rules[i], q, kc, vc, lens, bt, D ** -0.5, "HND", sets)
                assert (st is not None) == sets.measured  # no op statistics on unmeasured steps
                if st is not None:
                    read += int(st.v_rows.sum())
                R.record(rt, i, rules[i], sets, lens, HKV, st, prefill_tokens=5 if step == 1 else 0)
    return measured, read


def test_one_step_in_n_is_measured_and_every_step_is_counted():
    rt = _runtime(every=3)
    sizes = [2, 1, 3, 2, 2, 1, 3]
    measured, read = _run(rt, sizes)
    assert measured == [True, False, False, True, False, False, True]
    rep = rt.stats.report()
    assert rep["decode_steps"] == 7 and rep["decode_steps_measured"] == 3
    assert rep["decode_tokens"] == sum(sizes) and rep["prefill_tokens_dense"] == 5  # step 1: unmeasured
    assert rep["v_rows_read"] == read
    dense = sum(HKV * L * sum(40 + 3 * s + i for i in range(B)) for s, B in enumerate(sizes) if s % 3 == 0)
    assert rep["v_rows_dense"] == dense
    fid = rt.fidelity
    per_set = fid.report()["sets"]["0"]
    # the last (measured) step is still open: more layers of it could come; its rows are summed
    assert fid.all_steps == 6 and per_set["decode_rows"] == sum(sizes)
    assert per_set["v_rows_read"] == read and per_set["v_rows_dense"] == dense


def test_every_step_measured_with_n_1():
    rt = _runtime(every=1)
    measured, read = _run(rt, [2, 2, 2])
    assert measured == [True] * 3
    rep = rt.stats.report()
    assert rep["decode_steps"] == rep["decode_steps_measured"] == 3 and rep["v_rows_read"] == read


def test_metrics_every_setting():
    assert VllmTopthSettings().metrics_every == 4
    assert from_sources({"TOPTH_VLLM_METRICS_EVERY": "1", "TOPTH_VLLM_MODE": "dense"}).metrics_every == 1
    with pytest.raises(TopthConfigError, match="metrics_every must be an integer >= 1, got 0 .TOPTH_VLLM_METRICS_EVERY"):
        from_sources({"TOPTH_VLLM_METRICS_EVERY": "0", "TOPTH_VLLM_MODE": "dense"})
    with pytest.raises(TopthConfigError, match="TOPTH_VLLM_METRICS_EVERY"):
        from_sources({"TOPTH_VLLM_METRICS_EVERY": "x", "TOPTH_VLLM_MODE": "dense"})


def test_kv_cache_groups_of_one_step_follow_its_first_call(monkeypatch):
    """Hybrid models (Gemma 3: sliding-window and full-attention KV-cache groups) build one
    metadata per group, so decode_sets runs once per group and step: the step (the forward
    context) is sampled and counted once, and every group follows that decision."""
    rt = _runtime(every=2)
    lens = torch.tensor([50, 60], dtype=torch.int32)
    seen = []
    with torch.inference_mode():
        for step in range(4):
            key = object()  # one forward pass
            monkeypatch.setattr(R, "_forward_key", lambda: key)
            seen.append([R.decode_sets(rt, 2, lens).measured for _group in range(3)])
    assert seen == [[True] * 3, [False] * 3, [True] * 3, [False] * 3]
    assert rt.decode_steps == 4
    assert rt.stats.unmeasured_steps == 2 and rt.stats.decode_tokens == 2 * 2
    rt.fidelity.snapshot()
    assert rt.fidelity.unmeasured_steps == 2 and int(rt.fidelity.unmeasured_at_flush[1].sum()) == 2 * 2


def test_rows_per_set_count_the_served_set_on_every_step():
    """With dense_beyond, rows past the row id are served dense: measured and unmeasured
    steps both count them under "dense" (the set they are served with)."""
    rt = _runtime(every=2)
    rt.settings = VllmTopthSettings(mode="topth", thresholds="unused", metrics_every=2, log_interval=0.0,
                                    dense_beyond=45)
    _run(rt, [2, 2, 2, 2])  # lens 40+3s+i: steps 0-1 under 45 (set 0), steps 2-3 over (dense)
    per = rt.fidelity.report()["sets"]
    assert per["0"]["decode_rows"] == 4 and per["dense"]["decode_rows"] == 4


def test_unmeasured_steps_alone_make_the_sums_idle_flushable():
    """Decoding that stops after unmeasured steps: the statistics thread's idle check sees
    them, and a flush brings their steps and rows to the report."""
    rt = _runtime(every=4)
    _run(rt, [1, 1, 1, 1])  # one measured step, then three unmeasured
    fid = rt.fidelity
    fid.snapshot()
    _run(rt, [1, 1, 1])  # a new burst: one measured (step 4), then two unmeasured
    fid.snapshot()
    with torch.inference_mode():  # as in the forward
        fid.skip_step(torch.zeros(1, dtype=torch.int32))  # one more unmeasured step, not flushed
    assert fid.idle(seconds=0.0)
    fid.snapshot()
    assert fid.unmeasured_at_flush[0] == 3 + 2 + 1
    assert fid.report()["sets"]["0"]["decode_rows"] == 4 + 3 + 1
