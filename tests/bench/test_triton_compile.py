"""GPU compilation and static performance gates without a GPU.

Every production variant of the kernels (dense, pre/post-softmax, head and group selection,
paged NHD/HND, threshold sets, VMC, stats, head_dim 64/128/256, one query head per KV
head, 64-head groups) is compiled ahead of time for sm_90 (H100/H200) by Triton and
ptxas, in a subprocess without TRITON_INTERPRET (``python -m
topth_ops.bench.compile_report``). The CPU interpreter cannot catch GPU-only compile
errors; this does, and it asserts the gates on the compiled code: no spills,
registers within budget, one wave for every h200 case, V rows read only by predicated
loads (docs/triton.md, "Static performance report")."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _env():
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def test_static_report_gates(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "topth_ops.bench.compile_report", "--json", str(out)],
                          capture_output=True, text=True, env=_env(), timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    rep = json.loads(out.read_text())
    assert all(g["passed"] for g in rep["gates"]), rep["gates"]
    rows = {(r["variant"], r["kernel"]): r for r in rep["kernels"]}
    assert len(rows) >= 30
    main = rows[("pre-d128-g4", "pre_kernel")]
    # tensor cores for q k^T and for one p v product per tile (bf16 in, fp32 accumulation)
    assert main["mma_types"] == ["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"]
    # K software-pipelined (cp.async), V rows by predicated register loads issued a tile early
    assert main["loads"] == {"K": ["cp.async predicated"], "V": ["ld.global predicated"]}
    assert rows[("dense-d128-g4", "pre_kernel")]["loads"]["V"] == ["cp.async predicated"]
    assert rows[("post-d128-g4", "post_select_kernel")]["loads"]["V"] == ["cp.async predicated"]
    # G = 1 stays on tensor cores (15 padded rows): fewer instructions per byte than CUDA cores
    assert rows[("pre-d128-g1-mha", "pre_kernel")]["mma"] > 0
    # the tile loop's instruction issue stays below the memory time of its bytes (static estimate)
    assert main["loop_instrs"] * main["num_warps"] / 4 / main["tile_kib"] < 59
    target = next(w for w in rep["h200_waves"] if w["case"] == "h200-pre-f0.1")
    assert target["waves"] == 1 and target["programs"] <= target["slots"]
    assert target["wave_efficiency"] >= 0.9


def test_every_contract_case_compiles():
    """The historical case list (every SDC mode, VMC with and without value_mean, fp32 /
    fp16 / bf16, head_dim 64...256) compiles; fp32 uses exact fp32 products (no TF32)."""
    proc = subprocess.run([sys.executable, "-m", "topth_ops.bench.triton_compile", "--arch", "90"],
                          capture_output=True, text=True, env=_env(), timeout=600)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert rows and all(r["status"] == "ok" for r in rows)
    assert all(r["spills_in_loops"] == 0 for r in rows)
    fp32 = [r for r in rows if r["case"] == "post-vmc-fp32-d96" and r["kernel"] == "post_select_kernel"]
    assert fp32 and fp32[0]["mma"] == 0
