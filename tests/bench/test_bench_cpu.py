"""The CPU decode benchmark (topth_ops.bench.cpu*): tiered inputs whose kept-union is known
exactly for every f on one cache, checks before timing, interleaved timing, reports, and
the cpu backend's counted bytes in the general harness."""

from __future__ import annotations

import csv

import pytest
import torch

from topth_ops.backends import cpu as cpu_backend
from topth_ops.backends.torch_ref import reference_decode
from topth_ops.bench.cases import CASE_SETS
from topth_ops.bench.cpu import _Variant, run_shape, time_interleaved
from topth_ops.bench.cpu_cases import CPU_SHAPE_SETS, FRACTIONS, CpuShape, make_shape_inputs
from topth_ops.bench.harness import run_cases
from topth_ops.bench.variants import BackendVariant
from topth_ops.cli import main


def test_issue_shapes():
    shapes = CPU_SHAPE_SETS["cpu"]
    assert len(shapes) == 48 and len({s.name for s in shapes}) == 48
    assert {(s.batch, s.num_q_heads, s.num_kv_heads, s.head_dim, s.seq_len, s.dtype) for s in shapes} == {
        (b, hq, hkv, d, S, dt) for b in (1, 8) for hq, hkv in ((32, 8), (9, 3)) for d in (64, 128)
        for S in (2048, 8192, 32768) for dt in ("bf16", "fp32")}


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_tiered_inputs_keep_exactly_f(dtype):
    shape = CpuShape(2, 9, 3, 64, 1000, dtype)
    si = make_shape_inputs(shape, seed=3)
    for f in FRACTIONS:
        want = torch.full((2, 3), round(f * 1000), dtype=torch.int64)
        assert torch.equal(si.union[f], want)
        _, st = reference_decode(si.sparse[f])  # independent of the cpu kernel
        assert torch.equal(st.v_rows.to(torch.int64), want)
        # every head of the group keeps the same rows: kept per head == union
        assert torch.equal(st.kept.view(2, 3, 3).to(torch.int64), want[:, :, None].expand(2, 3, 3))


def test_interleaved_rounds_vary_the_order_and_respect_bounds():
    calls = []
    vs = [_Variant(n, "dense", 1.0, (lambda n=n: calls.append(n)), None) for n in "abcd"]
    vs.append(_Variant("skip", "dense", 1.0, reason="not here"))
    times = time_interleaved(vs, min_reps=3, max_reps=8, budget_s=1e9)
    assert set(times) == set("abcd") and all(len(t) == 8 for t in times.values())
    rounds = [tuple(calls[4 + 4 * r: 8 + 4 * r]) for r in range(8)]  # after the warm-up round
    assert all(sorted(r) == list("abcd") for r in rounds)  # each variant once per round
    assert len({r[0] for r in rounds}) > 1 and len(set(rounds)) > 2  # no fixed order


def test_quick_run_writes_table_csv_plot(tmp_path, capsys):
    assert main(["bench", "--cases", "cpu-quick", "--out", str(tmp_path), "--reps", "3"]) == 0
    out = capsys.readouterr().out
    assert "load average" in out and "target" in out and "x sdpa" in out
    with open(tmp_path / "bench_cpu.csv") as fh:
        rows = list(csv.DictReader(fh))
    shapes = {s.name for s in CPU_SHAPE_SETS["cpu-quick"]}
    assert {r["shape"] for r in rows} == shapes
    for s in shapes:
        by = {r["variant"]: r for r in rows if r["shape"] == s}
        for name in [f"cpu f={f:g}" for f in FRACTIONS] + ["cpu-dense", "sdpa", "sdpa-expanded"]:
            assert by[name]["status"] == "ok", by[name]
            assert len(by[name]["times_ms"].split()) >= 3
        assert by["vllm-cpu"]["status"] in ("ok", "skipped") and (by["vllm-cpu"]["status"] == "ok"
                                                                   or by["vllm-cpu"]["reason"])
        assert float(by["cpu f=0.1"]["bound"]) == pytest.approx(2 / 1.1, rel=1e-3)
    assert (tmp_path / "bench_cpu.png").stat().st_size > 1000
    assert "load average" in (tmp_path / "summary.txt").read_text()


def test_a_wrong_kernel_is_not_timed(monkeypatch):
    real = cpu_backend.kernel_args

    def unscaled(inputs, out, stats):
        args = real(inputs, out, stats)
        args["scale"] = 1.0
        return args

    monkeypatch.setattr(cpu_backend, "kernel_args", unscaled)
    rows = run_shape(CPU_SHAPE_SETS["cpu-quick"][0], min_reps=3, max_reps=3)
    assert len(rows) == 1 and rows[0].status == "wrong" and "differs" in rows[0].reason


def test_harness_checks_the_cpu_kernels_counted_bytes():
    """In the general harness, backend cpu reports its K and V rows as bytes; they must equal
    the bytes expected from the planted kept sets exactly (paged twins included)."""
    rows = run_cases(CASE_SETS["quick"], [BackendVariant("cpu")], torch.device("cpu"), reps=1)
    assert rows and all(r.status == "ok" for r in rows), [(r.case, r.status, r.reason) for r in rows]
    assert all(r.bytes_check == "exact" for r in rows)
