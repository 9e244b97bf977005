"""bench/stage_cycles.cpp (the per-stage timing of the AVX2 level, docs/cpu.md "Where the
time goes per stage") still builds against the kernel sources with the command its header
gives, runs, prints both lines, and refuses a bad argument. Timings are not checked."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "cpu_kernels" / "src"


def _has_avx2() -> bool:
    try:
        return " avx2 " in Path("/proc/cpuinfo").read_text().replace("\n", " ")
    except OSError:
        return False


@pytest.fixture(scope="module")
def binary(tmp_path_factory):
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the AVX2 stages build only for x86-64 (this machine: {platform.machine()})")
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++ on this machine")
    out = tmp_path_factory.mktemp("stage") / "stage_cycles"
    cmd = [gxx, "-O3", "-mavx2", "-mfma", "-mf16c", f"-I{ROOT / 'cpu_kernels' / 'include'}", f"-I{SRC}",
           *(str(SRC / f) for f in ("avx2_scores.cpp", "avx2_select.cpp", "avx2_pv.cpp")),
           str(ROOT / "bench" / "stage_cycles.cpp"), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_runs_and_prints_both_lines(binary):
    if not _has_avx2():
        pytest.skip("the CPU does not report AVX2: the stages cannot run here")
    proc = subprocess.run([str(binary), "3", "64", "1", "64", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for what in ("warm", "cold"):
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(what))
        ticks = [float(x) for x in re.findall(r"(\d+\.\d+)", line)]
        assert len(ticks) == 5 and all(t > 0 for t in ticks), line


@pytest.mark.parametrize("args", [["3", "63"], ["0"], ["3", "64", "7"]])
def test_refuses_bad_arguments(binary, args):
    proc = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stderr
