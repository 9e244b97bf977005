"""The kernel benchmark harness (topth_ops.bench) on the CPU: case data, synthetic inputs
that hit the requested kept fraction, bytes accounting, check-before-time, reports."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from topth_ops.bench import cli as bench_cli  # noqa: E402
from topth_ops.bench.cases import CASE_SETS, Case  # noqa: E402
from topth_ops.bench.harness import (BackendVariant, SdpaVariant, TritonDenseVariant, Variant,  # noqa: E402
                                     check_targets, must_move_bytes, reference_for, run_cases)
from topth_ops.bench.synth import make_case_inputs  # noqa: E402
from topth_ops.contract import make_inputs  # noqa: E402

pytestmark = [  # numpy notes from inside the Triton interpreter
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

CPU = torch.device("cpu")
HAS_TRITON = importlib.util.find_spec("triton") is not None


def test_must_move_bytes_by_hand():
    B, Hq, Hkv, S, D = 2, 8, 2, 10, 64
    q = torch.zeros(B, Hq, D, dtype=torch.float16)
    kv = torch.zeros(B, Hkv, S, D, dtype=torch.float16)
    inp = make_inputs(q, kv, kv, torch.tensor([10, 3]), torch.zeros(Hq, S))
    # K: (10 + 3) rows x 2 kv heads; V: 5 rows in all; q and out: 2 x 8 heads; 64 x 2 bytes each
    assert must_move_bytes(inp, 5) == (13 * 2 + 5) * 128 + 2 * 16 * 128


@pytest.mark.parametrize("placement", ["pre_softmax", "post_softmax"])
@pytest.mark.parametrize("frac", [0.05, 0.3, 1.0])
def test_synthetic_inputs_hit_kept_fraction(placement, frac):
    case = Case(name="t", batch=3, seq_len=200, num_q_heads=6, num_kv_heads=2, head_dim=64,
                kept_frac=frac, dtype="fp16", placement=placement, ragged=True)
    ci = make_case_inputs(case, CPU)
    ref = reference_for(ci)
    lens = ci.inputs.seq_lens.tolist()
    assert len(set(lens)) == 3 and max(lens) == 200
    want = sum(round(frac * n) for n in lens) / sum(lens)
    # every head keeps exactly the planted rows: the union over the group is the same set
    assert ref.kept_union_frac == pytest.approx(want, abs=1e-12)
    assert ref.kept_head_frac == pytest.approx(want, abs=1e-12)


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


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
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
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "bench.png").stat().st_size > 1000
