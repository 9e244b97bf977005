"""Fidelity sums (k~/k, dropped mass, V rows per layer, set and row-length bucket), the
drift guardrail and the Prometheus metrics, on hand-made op statistics (no engine, no
timing). Expected values are computed here from the inputs, not by the code under test."""

import logging

import pytest
import torch

from topth_ops.vllm import fidelity as F

pytestmark = pytest.mark.vllm


def _step(fid, layer_k, kept_per_row, set_idx, seq_lens, Hq=4, Hkv=2, beta=0.1):
    """One decode step over layers 0..len(layer_k)-1: every row keeps kept_per_row[i] per head."""
    B = len(set_idx)
    si = torch.tensor(set_idx)
    n = torch.tensor(seq_lens)
    for layer, k in enumerate(layer_k):
        kept = torch.tensor(kept_per_row, dtype=torch.int32)[:, None].expand(B, Hq)
        v_rows = torch.tensor(kept_per_row, dtype=torch.int32)[:, None].expand(B, Hkv)
        fid.add(layer, si, F.buckets(n), n, Hkv, v_rows, kept, torch.full((B, Hq), beta),
                torch.tensor([float(k), 0.0]))


def test_buckets_and_labels():
    n = torch.tensor([1, 511, 512, 1023, 5000, 40000])
    assert F.buckets(n).tolist() == [0, 0, 1, 1, 4, 7]
    assert F.bucket_labels()[:2] == ["0-511", "512-1023"] and F.bucket_labels()[-1] == "32768+"


def test_sums_per_layer_set_and_bucket():
    fid = F.Fidelity(2, ["0", "dense"], "cpu")
    for _ in range(3):
        _step(fid, [10, 20], [12, 8, 30], [0, 0, 1], [600, 3000, 700])
    rep = fid.report()
    s0 = rep["sets"]["0"]
    # layer 0, k=10: row 600 (bucket 512-1023) keeps 12 -> 1.2; row 3000 (2048-4095) keeps 8 -> 0.8
    assert s0["layers"][0]["kept_over_k"] == pytest.approx({"512-1023": 1.2, "2048-4095": 0.8})
    assert s0["layers"][1]["kept_over_k"] == pytest.approx({"512-1023": 0.6, "2048-4095": 0.4})
    assert s0["v_rows_read"] == 3 * 2 * 2 * (12 + 8) and s0["v_rows_dense"] == 3 * 2 * 2 * (600 + 3000)
    assert s0["decode_rows"] == 6 and s0["layers"][0]["dropped_mass"] == pytest.approx(0.1)
    d = rep["sets"]["dense"]
    assert d["decode_rows"] == 3 and d["layers"][0]["kept_over_k"] == {}  # no target k: no ratio


def test_sums_over_steps_of_different_batch_sizes_across_flushes():
    """The layers' statistics are kept until a flush and summed in one batch: steps whose
    batch size changes, more than one flush, and a snapshot in the middle of a step."""
    fid = F.Fidelity(2, ["0", "dense"], "cpu")
    read = dense = rows0 = rows_dense = 0
    for s in range(F.FLUSH_STEPS + 9):
        B = 1 + s % 3
        kept = [5 + (s + i) % 7 for i in range(B)]
        sets = [i % 2 for i in range(B)]
        lens = [100 + 37 * s + i for i in range(B)]
        _step(fid, [10, 20], kept, sets, lens)
        read += 2 * 2 * sum(k for k, x in zip(kept, sets) if x == 0)  # 2 layers x 2 KV heads
        dense += 2 * 2 * sum(n for n, x in zip(lens, sets) if x == 0)
        rows0 += sets.count(0)
        rows_dense += sets.count(1)
        if s == 20:
            assert fid.snapshot()[..., F.CHANNELS.index("rows")].sum() == 2 * (rows0 + rows_dense)
    s0 = fid.report()["sets"]["0"]
    assert (s0["v_rows_read"], s0["v_rows_dense"], s0["decode_rows"]) == (read, dense, rows0)
    assert fid.report()["sets"]["dense"]["decode_rows"] == rows_dense


def test_guardrail_warns_once_outside_the_band_and_not_inside(caplog):
    fid = F.Fidelity(1, ["0", "dense"], "cpu", band=(0.8, 1.25), window=64)
    with caplog.at_level(logging.WARNING, logger="vllm.topth_ops"):
        for _ in range(3 * F.FLUSH_STEPS):
            _step(fid, [10], [11, 9], [0, 0], [100, 5000])
    assert not [r for r in caplog.records if "guardrail" in r.message]
    with caplog.at_level(logging.WARNING, logger="vllm.topth_ops"):
        for _ in range(4 * F.FLUSH_STEPS):
            _step(fid, [10], [11, 30], [0, 0], [100, 5000])  # the long rows drift to 3x k
    warned = [r.message for r in caplog.records if "guardrail" in r.message]
    assert len(warned) == 1 and "left [0.8, 1.25] in 1 cell(s): layer 0, set 0, rows 4096-8191: " in warned[0]
    assert 1.25 < float(warned[0].rsplit(": ", 1)[1]) <= 3.0  # the window still holds in-band steps
    assert fid.report()["guardrail"]["out_of_band"] == ["layer 0, set 0, rows 4096-8191"]


def test_prometheus_metrics_are_registered_and_updated():
    from prometheus_client import REGISTRY

    from topth_ops.vllm.metrics import PrometheusExporter

    rank = "91"  # metric objects live for the process: a rank label of this test alone
    exp = PrometheusExporter(int(rank), [{"set": "0", "k": 10, "placement": "post_softmax", "selection": "group",
                                          "file": "x"}])
    fid = F.Fidelity(1, ["0", "dense"], "cpu", on_flush=exp)
    for _ in range(2 * F.FLUSH_STEPS + 1):  # two flushes: enough rows for the windowed k~/k
        _step(fid, [10], [10, 40], [0, 1], [100, 200])
    get = REGISTRY.get_sample_value
    steps = 2 * F.FLUSH_STEPS
    assert steps >= F.MIN_ROWS
    assert get("topth_decode_steps_total", {"rank": rank}) == steps
    assert get("topth_decode_rows_total", {"set": "0", "rank": rank}) == steps
    assert get("topth_v_rows_read_total", {"layer": "0", "set": "0", "rank": rank}) == steps * 2 * 10
    assert get("topth_v_rows_dense_total", {"layer": "0", "set": "dense", "rank": rank}) == steps * 2 * 200
    assert get("topth_kept_over_k", {"layer": "0", "set": "0", "bucket": "0-511", "rank": rank}) == pytest.approx(1.0)
    assert get("topth_guardrail_out_of_band", {"layer": "0", "set": "0", "bucket": "0-511", "rank": rank}) == 0
    assert get("topth_dropped_mass", {"layer": "0", "set": "0", "rank": rank}) == pytest.approx(0.1)
    assert get("topth_threshold_set_info", {"set": "0", "k": "10", "placement": "post_softmax",
                                            "selection": "group", "file": "x", "rank": rank}) == 1


def test_rows_shorter_than_k_are_judged_against_their_length():
    """A layer at k=768 on a 300-position row keeps at most 300: k~/k is 300/300, not 300/768."""
    fid = F.Fidelity(1, ["0", "dense"], "cpu")
    _step(fid, [768], [300, 700], [0, 0], [300, 1000])
    kk = fid.report()["sets"]["0"]["layers"][0]["kept_over_k"]
    assert kk == pytest.approx({"0-511": 1.0, "512-1023": 700 / 768})


def test_flushes_inside_and_outside_inference_mode():
    """The forward flushes under torch.inference_mode(), the statistics thread outside it:
    host state must take updates from both (a server's flusher thread once died here)."""
    import threading

    fid = F.Fidelity(1, ["0", "dense"], "cpu", window=64)
    with torch.inference_mode():  # two flushes in band, then a drift that no flush has seen yet
        for _ in range(2 * F.FLUSH_STEPS + 1):
            _step(fid, [10], [10, 10], [0, 0], [100, 100])
        for _ in range(F.FLUSH_STEPS // 2):
            _step(fid, [10], [30, 30], [0, 0], [100, 100])
    assert not fid.guardrail.out.any()
    errors = []

    def flush():
        try:
            fid.report()
        except Exception as e:  # noqa: BLE001 - recorded for the assertion
            errors.append(e)

    t = threading.Thread(target=flush)
    t.start()
    t.join()
    assert not errors and fid.guardrail.out.any() and int(fid.guardrail.trips.sum()) == 1


def test_idle_flush_hook_reports_new_sums(monkeypatch):
    """When decoding stops, the statistics thread's hook flushes the last steps (fewer than
    FLUSH_STEPS) and says so, so the JSON report is rewritten with them."""
    from topth_ops.vllm import runtime as R

    fid = F.Fidelity(1, ["0", "dense"], "cpu")
    hook = R._idle_flush(fid)
    _step(fid, [10], [10, 10], [0, 0], [100, 100])
    assert not hook()  # rows just came: not idle
    monkeypatch.setattr(F.time, "monotonic", lambda: fid._last_add + 5.0)
    assert hook() and fid.totals[0, 0, :, 5].sum() == 2
    assert not hook()  # nothing new since
