"""The machine a CPU benchmark ran on: CPU model (with family and model numbers), the ISA
flags that choose the kernel's SIMD level, usable cores, last-level cache size, and the
memory left, for the benchmarks to record with every result and to size their caches."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from dataclasses import dataclass
from typing import Optional


@dataclass
class Machine:
    model: str
    flags: list
    cores: int
    llc_bytes: int


def machine() -> Machine:
    """CPU model, ISA flags that matter here, usable cores, last-level cache size."""
    model, flags = platform.processor() or "unknown", []
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        m = re.search(r"Model name:\s*(.+)", text)
        model = m.group(1).strip() if m else model
        fam, mod = re.search(r"CPU family:\s*(\S+)", text), re.search(r"\nModel:\s*(\S+)", text)
        if fam and mod:  # a generic model name ("AMD EPYC") says little: family and model say which
            model += f" (family {fam.group(1)}, model {mod.group(1)})"
        f = re.search(r"Flags:\s*(.+)", text)
        have = set(f.group(1).split()) if f else set()
        flags = [x for x in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
                 if x in have]
    except (OSError, subprocess.SubprocessError):
        pass
    return Machine(model, flags, len(os.sched_getaffinity(0)), llc_bytes())


def llc_bytes() -> int:
    """Size of the largest cache level the kernel reports for cpu0 (default 512 MiB)."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    for d in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        try:
            size = open(os.path.join(base, d, "size")).read().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        best = max(best, int(size.rstrip("KMG")) * mult)
    return best or (512 << 20)


def mem_available() -> Optional[int]:
    """MemAvailable of /proc/meminfo in bytes, None where the file is absent."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
