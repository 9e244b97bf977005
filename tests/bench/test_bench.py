"""The kernel benchmark harness (topth_ops.bench) on the CPU: case data, planted inputs
whose kept-union is known exactly, bytes accounting, check-before-time, reports, the
Ascend C CPU-model bytes report (counted vs expected GM -> UB bytes) and the NPU pieces
that can be checked without an NPU."""

from __future__ import annotations

import argparse
import csv
import json
import importlib.util
import math
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from topth_ops.bench import cli as bench_cli  # noqa: E402
from topth_ops.bench import synth  # noqa: E402
from topth_ops.bench.cases import CASE_SETS, Case  # noqa: E402
from topth_ops.bench.harness import reference_for, run_cases  # noqa: E402
from topth_ops.bench.report import check_targets  # noqa: E402
from topth_ops.bench.traffic import expected_traffic, must_move_bytes  # noqa: E402
from topth_ops.bench.variants import (BackendVariant, IfaVariant, SdpaVariant, TritonDenseVariant,  # noqa: E402
                                      Variant)
from topth_ops.bench.synth import make_case_inputs  # noqa: E402
from topth_ops.contract import make_inputs  # noqa: E402
from topth_ops.registry import get_backend  # noqa: E402

pytestmark = [  # numpy notes from inside the Triton interpreter
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

CPU = torch.device("cpu")


def test_must_move_bytes_by_hand():
    B, Hq, Hkv, S, D = 2, 8, 2, 10, 64
    q = torch.zeros(B, Hq, D, dtype=torch.float16)
    kv = torch.zeros(B, Hkv, S, D, dtype=torch.float16)
    inp = make_inputs(q, kv, kv, torch.tensor([10, 3]), torch.zeros(Hq, S))
    # K: (10 + 3) rows x 2 kv heads; V: 5 rows in all; q and out: 2 x 8 heads; 64 x 2 bytes each
    assert must_move_bytes(inp, 5) == (13 * 2 + 5) * 128 + 2 * 16 * 128


def test_expected_traffic_by_hand():
    B, Hq, Hkv, S, D = 2, 8, 2, 10, 72
    q = torch.zeros(B, Hq, D, dtype=torch.float16)
    kv = torch.zeros(B, Hkv, S, D, dtype=torch.float16)
    lens = torch.tensor([10, 3])
    pre = make_inputs(q, kv, kv, lens, torch.zeros(Hq, S), placement="pre_softmax")
    post = make_inputs(q, kv, kv, lens, torch.zeros(Hq, S), placement="post_softmax")
    # rows of 72 x 2 = 144 bytes; K: 13 valid positions x 2 kv heads; V: 5 kept-union rows
    assert expected_traffic(pre, 5, {}) == {"k_bytes": 26 * 144, "v_bytes": 5 * 144, "workspace_gm_to_ub_bytes": 0}
    # post_softmax: the float32 scores of 8 query heads x 13 positions come back once, plus
    # the split bookkeeping the backend declares
    got = expected_traffic(post, 5, {"workspace_split_gm_to_ub_bytes": 100})
    assert got["workspace_gm_to_ub_bytes"] == 4 * 8 * 13 + 100


@pytest.mark.parametrize("placement", ["pre_softmax", "post_softmax"])
@pytest.mark.parametrize("frac", [0.0, 0.05, 0.3, 1.0])
def test_planted_inputs_give_the_exact_kept_union(placement, frac):
    case = Case(name="t", batch=3, seq_len=200, num_q_heads=6, num_kv_heads=2, head_dim=72,
                kept_frac=frac, dtype="fp16", placement=placement, ragged=True)
    ci = make_case_inputs(case, CPU)
    lens = ci.inputs.seq_lens.tolist()
    assert len(set(lens)) == 3 and max(lens) == 200
    want = torch.tensor([[round(frac * n)] * 2 for n in lens])
    assert torch.equal(ci.planted_union, want)
    # independent float64 selection: every head keeps exactly round(f n) rows, and the rows
    # kept by the heads of one group are the same set (so the union has that size too)
    q, k, th = ci.inputs.query.double(), ci.inputs.key_cache.double(), ci.inputs.thresholds.double()
    for b, n in enumerate(lens):
        for g in range(2):
            sets = []
            for h in range(3 * g, 3 * g + 3):
                a = ci.inputs.scale * (k[b, g, :n] @ q[b, h])
                if placement == "pre_softmax":
                    kept = a > th[h, n - 1]
                else:
                    kept = (a - torch.logsumexp(a, 0)) > (th[h, n - 1].log() if th[h, n - 1] > 0 else -math.inf)
                sets.append(kept)
            assert all(torch.equal(x, sets[0]) for x in sets)
            assert int(sets[0].sum()) == round(frac * n)
    ref = reference_for(ci)  # raises if the reference's v_rows differ from the planted union
    assert ref.kept_union_frac == pytest.approx(sum(round(frac * n) for n in lens) / sum(lens), abs=1e-12)


def test_planted_inputs_refuse_a_kept_set_they_cannot_guarantee(monkeypatch):
    monkeypatch.setattr(synth, "PLANT_GAIN", 0.0)  # nothing separates the planted rows
    case = Case(name="unseparated", batch=1, seq_len=300, num_q_heads=4, num_kv_heads=1, head_dim=64,
                kept_frac=0.2, dtype="fp32")
    with pytest.raises(ValueError, match="'unseparated'.*do not clear"):
        make_case_inputs(case, CPU)


class _Wrong(Variant):
    name = "wrong-on-purpose"
    kind = "topth"

    def prepare(self, ci):
        out = torch.zeros_like(ci.inputs.query)
        return (lambda: None), (lambda: out)


def test_run_cases_checks_before_timing_and_reports(tmp_path):
    cases = [c for c in CASE_SETS["quick"] if c.name in ("quick-pre-f0.1", "quick-ragged-pre-f0.2")]
    rows = run_cases(cases, [BackendVariant("torch"), _Wrong(), SdpaVariant()], CPU, reps=1,
                     copy_bytes=1 << 20)
    assert rows[0].kind == "copy" and rows[0].gbps > 0
    by = {(r.case, r.variant): r for r in rows}
    for c in cases:
        ok = by[(c.name, "torch")]
        assert ok.status == "ok" and ok.time_ms > 0 and ok.max_abs_err < 1e-3
        assert ok.bound == pytest.approx(2 / (1 + ok.kept_union_frac))
        assert ok.dense_variant == "sdpa" and ok.speedup_vs_dense > 0
        assert "NOT meaningful" in ok.timing
        bad = by[(c.name, "wrong-on-purpose")]
        assert bad.status == "wrong" and bad.time_ms != bad.time_ms  # NaN: never timed
    ragged = by[("quick-ragged-pre-f0.2", "sdpa")]
    assert ragged.status == "ok"  # ragged lengths: SDPA with a mask matches the reference
    assert check_targets(rows) == []  # no h200 rows


def test_triton_variants_under_interpreter():
    case = next(c for c in CASE_SETS["quick"] if c.name == "quick-post-f0.1")
    rows = run_cases([case], [BackendVariant("triton"), TritonDenseVariant()],
                     torch.device("cuda" if HAS_CUDA else "cpu"), reps=1)
    assert [r.status for r in rows] == ["ok", "ok"], [r.reason for r in rows]
    assert rows[0].speedup_vs_dense > 0 and rows[0].dense_variant == "triton-dense"


def test_cli_quick_writes_csv_and_png(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    args = parser.parse_args(["--cases", "quick", "--backends", "torch", "--device", "cpu", "--reps", "1",
                              "--copy-mib", "1", "--out", str(tmp_path)])
    assert bench_cli.run(args) == 0
    text = capsys.readouterr().out
    assert "not meaningful" in text
    with open(tmp_path / "bench.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert {r["case"] for r in rows} >= {c.name for c in CASE_SETS["quick"]}
    skipped = [r for r in rows if r["status"] == "skipped"]
    assert all(r["reason"] for r in skipped)
    assert (tmp_path / "summary.txt").exists()
    assert (tmp_path / "bench.png").stat().st_size > 1000  # matplotlib is in the bench extra


# ----------------------------------------------------------------------------- bytes report

def _bench_args(*argv):
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def _read_csv(path):
    with open(path) as fh:
        return list(csv.DictReader(fh))


def test_bytes_report_on_the_cpu_model(tmp_path, capsys):
    """The documented CPU-model report: every counted K/V/workspace byte count equals the
    expectation; checked again here from the case data alone (no reference, no kernel)."""
    args = _bench_args("--backends", "ascendc-cpu", "--cases", "bytes", "--no-baselines", "--reps", "1",
                       "--copy-mib", "0", "--out", str(tmp_path))
    assert bench_cli.run(args) == 0
    text = capsys.readouterr().out
    assert "GM -> UB bytes counted by the backend vs expected" in text
    rows = {r["case"]: r for r in _read_csv(tmp_path / "bench.csv")}
    assert set(rows) == {c.name for c in CASE_SETS["bytes"]}
    es = {"fp16": 2, "bf16": 2, "fp32": 4}
    for c in CASE_SETS["bytes"]:
        r = rows[c.name]
        assert r["status"] == "ok" and r["bytes_check"] == "exact", r
        row_bytes = c.head_dim * es[c.dtype]
        for key in ("k_bytes", "v_bytes", "ws_bytes"):
            assert r[key] == r[key + "_expected"]
        if c.ragged:
            continue
        n = c.seq_len
        assert int(r["k_bytes"]) == c.batch * c.num_kv_heads * n * row_bytes
        # + the rows the Ascend C copy plan fetches between runs sharing a 512-byte granule
        gap = json.loads(r["counters"]).get("v_merged_gap_bytes", 0)
        assert int(r["v_bytes"]) == c.batch * c.num_kv_heads * round(c.kept_frac * n) * row_bytes + gap
    # V bytes grow with f at fixed K; post_softmax adds the score round trip to the workspace
    pre = sorted((c.kept_frac, int(rows[c.name]["v_bytes"])) for c in CASE_SETS["bytes"]
                 if c.name.startswith("bytes-gqa4-d128-pre"))
    assert [v for _, v in pre] == sorted(v for _, v in pre) and len(pre) >= 4
    post, pre01 = rows["bytes-gqa4-d128-post-f0.1"], rows["bytes-gqa4-d128-pre-f0.1"]
    # GM -> UB: the float32 scores of 8 query heads x 4096 positions are read back once
    assert int(post["ws_bytes"]) - int(pre01["ws_bytes"]) >= 4 * 8 * 4096


def test_a_wrong_byte_counter_is_flagged(tmp_path, monkeypatch, capsys):
    """A backend whose V counter is off by one row: the rows become wrong-bytes, are not
    timed, and the CLI exits 1."""
    backend = get_backend("ascendc-cpu")
    honest = type(backend).bench_counters

    def one_row_too_many(self):
        c = honest(self)
        c["v_bytes"] += self.last_report["tiling"]["headDim"] * self.last_report["tiling"]["elemBytes"]
        return c

    monkeypatch.setattr(type(backend), "bench_counters", one_row_too_many)
    args = _bench_args("--backends", "ascendc-cpu", "--cases", "quick", "--no-baselines", "--reps", "1",
                       "--copy-mib", "0", "--out", str(tmp_path))
    assert bench_cli.run(args) == 1
    rows = [r for r in _read_csv(tmp_path / "bench.csv") if r["status"] != "skipped"]
    assert rows and all(r["status"] == "wrong-bytes" and r["time_ms"] == "nan" for r in rows)
    for r in rows:
        row_bytes = int(r["head_dim"]) * (4 if r["dtype"] == "fp32" else 2)
        assert int(r["v_bytes"]) - int(r["v_bytes_expected"]) == row_bytes
        assert r["bytes_check"].startswith("MISMATCH: V ") and "K " not in r["bytes_check"]
    assert "MISMATCH" in capsys.readouterr().out


# ----------------------------------------------------------------------------- NPU pieces

HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None


def test_case_sets_hold_the_issue_targets():
    npu = CASE_SETS["npu"]
    assert {(c.num_q_heads, c.num_kv_heads, c.head_dim, c.seq_len) for c in npu} == {(32, 8, 128, 32768)}
    assert {c.batch for c in npu} == {1, 8}
    assert {c.placement for c in npu} == {"pre_softmax", "post_softmax"}
    assert {c.dtype for c in npu} == {"fp16", "bf16"} and sum(c.dtype == "bf16" for c in npu) == 1
    assert min(c.kept_frac for c in npu) == 0.05 and max(c.kept_frac for c in npu) == 1.0
    assert any(c.name == "npu-b1-pre-f0.1" and c.dtype == "fp16" for c in npu)  # the 1.5x target
    by = CASE_SETS["bytes"]
    assert any(c.head_dim * 2 % 32 and c.dtype == "fp16" for c in by)  # odd row size (144 B)
    assert any(c.placement == "post_softmax" for c in by)
    assert len({c.kept_frac for c in by}) >= 4
    assert len({c.name for s in CASE_SETS.values() for c in s}) == sum(len(s) for s in CASE_SETS.values())


def test_ifa_baseline_says_why_it_cannot_run_here():
    case = next(c for c in CASE_SETS["quick"] if c.dtype == "fp32")
    reasons = IfaVariant().reasons(make_case_inputs(case, CPU))
    assert "needs npu tensors" in reasons
    assert any("float16 / bfloat16" in r for r in reasons)
    assert any("torch_npu" in r for r in reasons) == (not HAS_TORCH_NPU)


@pytest.mark.parametrize("argv,needle", [
    (["--cases", "nope"], "--cases must name sets from"),
    (["--backends", "nope"], "backend must be one of"),
    pytest.param(["--device", "npu", "--cases", "npu", "--backends", "ascendc"], "--device npu needs torch_npu",
                 marks=pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here")),
])
def test_bad_bench_flags_are_one_line_errors(argv, needle, tmp_path, capsys):
    from topth_ops.cli import main

    assert main(["bench", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
