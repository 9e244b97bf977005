"""Properties of the built CPU extension that no output can show: the software prefetches of
the stages that stream K and V are in the binary. GCC 12 once deleted every prefetch of the
scores stages as dead code (docs/cpu.md, "Software prefetch"); results stay right without
them, only the speed drops, so this reads the machine code."""

import re
import shutil
import subprocess

import pytest

from topth_ops.backends import cpu as cpu_backend

OBJDUMP = shutil.which("objdump")
# function (demangled, up to its argument list) -> prefetch hints its body must hold
EXPECTED = {
    "topth_cpu::avx2_level::scores(": {"prefetcht0", "prefetcht1"},
    "topth_cpu::avx2_level::(anonymous namespace)::kt_chunk<": {"prefetcht1"},
    "topth_cpu::avx512_level::scores(": {"prefetcht0", "prefetcht1"},
    "topth_cpu::avx512bf16_level::scores(": {"prefetcht0", "prefetcht1"},
    "topth_cpu::amx_level::scores(": {"prefetcht0", "prefetcht1"},
}


def _prefetches_by_function(path: str) -> dict:
    text = subprocess.run([OBJDUMP, "-d", "-C", "--no-show-raw-insn", path], capture_output=True, text=True,
                          check=True).stdout
    found: dict = {}
    fn = None
    for line in text.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if m:
            fn = m.group(1)
            found.setdefault(fn, set())
            continue
        p = re.search(r"\b(prefetch\w+)\b", line)
        if p and fn is not None:
            found.setdefault(fn, set()).add(p.group(1))
    return found


@pytest.mark.skipif(OBJDUMP is None, reason="objdump (binutils) is not installed")
def test_scores_stages_keep_their_prefetches():
    mod = cpu_backend.cpu_module()
    found = _prefetches_by_function(mod.__file__)
    checked = 0
    for prefix, hints in EXPECTED.items():
        bodies = [h for fn, h in found.items() if fn.startswith(prefix)]
        if not bodies:
            continue  # that level was not compiled (not an x86-64 build, or the compiler refused its flags)
        got = set().union(*bodies)
        assert hints <= got, f"{prefix}: prefetch instructions {sorted(got)}, expected {sorted(hints)}"
        checked += 1
    if not checked:
        pytest.skip("no AVX2 or AVX-512 level in this build (their scores stages are the ones that prefetch)")
