"""bench/kt_stage.cpp (the avx2 transposed-K scores stage against the row stage and a plain
read, docs/cpu.md "The AVX2 transposed-K stage") still builds against the kernel sources with
the command its header gives, passes its own float64 check, prints every line, and refuses a
bad argument. Timings are not checked."""

from __future__ import annotations

import re
import subprocess

import pytest

from .native import build, cpu_flags

FLAGS = ["-mavx2", "-mfma", "-mf16c"]
SOURCES = ["avx2_scores.cpp", "avx2_select.cpp", "avx2_pv.cpp"]


@pytest.fixture(scope="module")
def binary(tmp_path_factory):
    if "avx2" not in cpu_flags() or "fma" not in cpu_flags():
        pytest.skip("the CPU does not report AVX2 and FMA: the avx2 stages cannot run here")
    return build("kt_stage.cpp", "avx2", FLAGS, SOURCES, tmp_path_factory.mktemp("kt_stage"))


@pytest.mark.parametrize("args", [["3", "64", "1"], ["4", "32", "2"]])
def test_runs_checks_and_prints_every_line(binary, args):
    proc = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    err = float(re.search(r"worst relative error (\S+)", proc.stdout).group(1))
    assert 0 <= err <= 1e-4
    for what in ("warm", "cold"):
        for variant in ("transposed K", "rows (BNSD)", "plain read"):
            line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(f"{what} {variant}"))
            assert float(re.findall(r"(\d+\.\d+) ticks/slot", line)[0]) > 0, line


@pytest.mark.parametrize("args", [["3", "63"], ["0"], ["3", "64", "7"], ["17"]])
def test_refuses_bad_arguments(binary, args):
    proc = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stderr
