"""bench/stage_cycles.cpp (the per-stage timing of the AVX2 and AVX-512 levels, docs/cpu.md
"Where the time goes per stage") still builds against the kernel sources with the commands its
header gives, runs where the CPU has the level, prints both lines, and refuses a bad argument.
Timings are not checked."""

from __future__ import annotations

import re
import subprocess

import pytest

from .native import build, cpu_flags

# level: (compiler flags, kernel sources, /proc/cpuinfo flags the binary needs)
LEVELS = {
    "avx2": (["-mavx2", "-mfma", "-mf16c"], ["avx2_scores.cpp", "avx2_select.cpp", "avx2_pv.cpp"], ["avx2"]),
    "avx512": (["-DSTAGE_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma",
                "-mf16c"],
               ["avx512_scores.cpp", "avx512_select.cpp", "avx512_pv.cpp", "avx512_kt.cpp", "avx512bf16_scores.cpp",
                "avx512bf16_kt.cpp"],
               ["avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"]),
}


@pytest.fixture(scope="module", params=sorted(LEVELS))
def level_binary(request, tmp_path_factory):
    level = request.param
    flags, sources, _ = LEVELS[level]
    return level, build("stage_cycles.cpp", level, flags, sources, tmp_path_factory.mktemp("stage"))


def _runnable(level: str) -> None:
    missing = [f for f in LEVELS[level][2] if f not in cpu_flags()]
    if missing:
        pytest.skip(f"the CPU does not report {', '.join(missing)}: the {level} stages cannot run here")


def test_runs_and_prints_both_lines(level_binary):
    level, binary = level_binary
    _runnable(level)
    proc = subprocess.run([str(binary), "3", "64", "1", "64", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for what in ("warm", "cold"):
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(what))
        ticks = [float(x) for x in re.findall(r"(\d+\.\d+)", line)]
        assert len(ticks) == 5 and all(t > 0 for t in ticks), line


@pytest.mark.parametrize("args", [["3", "63"], ["0"], ["3", "64", "7"]])
def test_refuses_bad_arguments(level_binary, args):
    level, binary = level_binary
    _runnable(level)
    proc = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stderr
