"""bench/gather_cost.cpp (the gather cost of kept V rows against streaming every row, docs/cpu.md
"Gather cost of kept V rows") builds against the kernel's P.V sources with the commands its
header gives, runs where the CPU has the level, prints its five variants and the bound line,
and refuses bad arguments. Timings are not checked."""

from __future__ import annotations

import re
import subprocess

import pytest

from .native import build, cpu_flags

# level: (compiler flags, kernel sources, /proc/cpuinfo flags the binary needs)
LEVELS = {
    "avx2": (["-mavx2", "-mfma", "-mf16c"], ["avx2_pv.cpp"], ["avx2", "fma", "f16c"]),
    "avx512": (["-DSTAGE_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
               ["avx512_pv.cpp"], ["avx512f", "avx512bw", "avx512vl", "avx512dq"]),
}
VARIANTS = ("pv all rows", "pv kept", "read all", "read kept asc", "read kept strided")


@pytest.fixture(scope="module", params=sorted(LEVELS))
def binary(request, tmp_path_factory):
    level = request.param
    flags, sources, needs = LEVELS[level]
    missing = [f for f in needs if f not in cpu_flags()]
    if missing:
        pytest.skip(f"the CPU does not report {', '.join(missing)}: the {level} P.V cannot run here")
    return build("gather_cost.cpp", level, flags, sources, tmp_path_factory.mktemp("gather"))


@pytest.mark.parametrize("g, d", [(3, 64), (4, 128)])
def test_runs_and_prints_every_variant(binary, g, d):
    # 16 MiB, 2 rounds: a smoke run timed partly from cache (the tool notes it), not a measurement
    proc = subprocess.run([str(binary), str(g), str(d), "0.3", "16", "2"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"G {g}, head_dim {d}, bf16, f 0.30")
    for name in VARIANTS:
        line = next(ln for ln in lines if ln.startswith(name + " "))
        ticks, rel = (float(x) for x in re.findall(r"(\d+\.\d+)", line)[:2])
        assert ticks > 0 and rel > 0, line
    bound = next(ln for ln in lines if ln.startswith("bound"))
    assert "byte ratio 1.54x" in bound  # 1 / (0.5 + 0.5 * 0.3)


@pytest.mark.parametrize("args", [["3", "48"], ["0"], ["17"], ["3x"], ["3", "64", "1.5"], ["3", "64", "1e-9"],
                                  ["3", "64", "0.3", "4"], ["3", "64", "0.3", "100000000"],
                                  ["3", "64", "0.3", "16", "1"], ["3", "64", "0.3", "16", "2", "extra"]])
def test_refuses_bad_arguments(binary, args):
    proc = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stderr
