"""Building the standalone C++ benchmarks of bench/ against the kernel sources (shared by
their tests): skips name the reason (not x86-64, no g++, flags the compiler rejects)."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "cpu_kernels" / "src"


def cpu_flags() -> set:
    """The flags of /proc/cpuinfo (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def build(tool: str, level: str, flags: list, sources: list, out_dir: Path) -> Path:
    """g++ -O3 FLAGS -I... cpu_kernels/src/SOURCES bench/TOOL -o OUT_DIR/TOOL_LEVEL, as the
    tool's header says; skips where the level cannot be built here."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the {level} sources build only for x86-64 (this machine: {platform.machine()})")
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++ on this machine")
    probe = out_dir / "probe.cpp"
    probe.write_text("int main() { return 0; }\n")
    if subprocess.run([gxx, *flags, str(probe), "-o", str(out_dir / "probe")], capture_output=True).returncode != 0:
        pytest.skip(f"this compiler rejects the {level} flags ({' '.join(flags)}); setup.py drops that level too")
    out = out_dir / f"{Path(tool).stem}_{level}"
    cmd = [gxx, "-O3", *flags, f"-I{ROOT / 'cpu_kernels' / 'include'}", f"-I{SRC}",
           *(str(SRC / f) for f in sources), str(ROOT / "bench" / tool), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out
