"""ServingStats: per-step V-row accounting and the JSON report (no engine)."""

import json

import pytest
import torch

from topth_ops.vllm.stats import ServingStats, rank_path

pytestmark = pytest.mark.vllm


def test_steps_layers_and_report(tmp_path):
    path = tmp_path / "r.json"
    st = ServingStats("topth", str(path), log_interval=0)
    # step 1: prefill only (2 layers); step 2: 2 decodes + a prefill chunk; step 3: 1 decode
    for layer in (0, 1):
        st.add(layer, None, None, prefill_tokens=7)
    for layer in (0, 1):
        st.add(layer, torch.tensor([[3, 4], [5, 6]]), torch.tensor([10, 20]), prefill_tokens=5)
    for layer in (0, 1):
        st.add(layer, torch.tensor([[1, 2]]), torch.tensor([11]))
    rep = st.report()
    assert rep["decode_steps"] == 2 and rep["decode_tokens"] == 3 and rep["prefill_tokens_dense"] == 12
    assert rep["v_rows_read"] == 2 * 18 + 2 * 3
    assert rep["v_rows_dense"] == 2 * (30 * 2) + 2 * (11 * 2)
    assert rep["v_rows_fraction"] == rep["v_rows_read"] / rep["v_rows_dense"]
    assert [s["decode_seqs"] for s in rep["last_steps"]] == [2, 1]
    assert rep["last_steps"][0] == {"step": 2, "decode_seqs": 2, "v_rows_read": 36, "v_rows_dense": 120}
    assert rep["v_rows_read_per_decode_step"] == 21.0
    st.flush()
    assert json.loads(path.read_text())["v_rows_read"] == 42


def test_rank_path():
    assert rank_path("/a/stats.json", 0) == "/a/stats.json"
    assert rank_path("/a/stats.json", 3) == "/a/stats.rank3.json"


def test_batched_reduction_matches_per_step_sums():
    """Steps are reduced REDUCE_STEPS at a time: totals and per-step records over several
    batches, with batch sizes and KV-head counts that change, and a report taken in the
    middle of a step, equal plain per-step sums."""
    from topth_ops.vllm.stats import REDUCE_STEPS

    g = torch.Generator().manual_seed(3)
    st = ServingStats("topth", None, log_interval=0)
    want, mid = [], None
    steps = 2 * REDUCE_STEPS + 7
    for s in range(steps):
        B = 1 + s % 4
        read = dense = 0
        for layer in range(3):
            hkv = 2 if layer < 2 else 1  # e.g. a layer served with fewer KV heads
            v = torch.randint(0, 50, (B, hkv), generator=g, dtype=torch.int32)
            n = torch.randint(50, 99, (B,), generator=g, dtype=torch.int32)
            st.add(layer, v, n)
            read += int(v.sum())
            dense += int(n.sum()) * hkv
            if s == REDUCE_STEPS + 3 and layer == 0:
                mid = st.report()  # the step in progress is merged when its later layers come
        want.append({"step": s + 1, "decode_seqs": B, "v_rows_read": read, "v_rows_dense": dense})
    rep = st.report()
    assert mid["decode_steps"] == REDUCE_STEPS + 4
    assert rep["decode_steps"] == steps and rep["decode_tokens"] == sum(w["decode_seqs"] for w in want)
    assert rep["v_rows_read"] == sum(w["v_rows_read"] for w in want)
    assert rep["v_rows_dense"] == sum(w["v_rows_dense"] for w in want)
    assert rep["last_steps"] == want
