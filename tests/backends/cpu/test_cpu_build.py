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
# stage (a regex on the demangled function names of its code: the stage function and the
# helpers the compiler may keep out of line) -> prefetch hints that code must hold. Since the
# prefetches are spread over the loads, they sit in the block helpers (tile_heads, rows_heads,
# pv_rows, ...) as often as in the stage function itself.
_ANON = r"(\(anonymous namespace\)::)?"
EXPECTED = {
    "avx2 scores": (rf"topth_cpu::avx2_level::{_ANON}(scores\(|tile_scores<|head_block<|rows_heads<|block<|half_step<)",
                    {"prefetcht0", "prefetcht1"}),
    "avx2 transposed-K scores": (r"topth_cpu::avx2_level::\(anonymous namespace\)::kt_chunk<", {"prefetcht1"}),
    "avx2 P.V": (rf"topth_cpu::avx2_level::{_ANON}(pv\(|pv_direct<|pv_block<|pv_heads<|pv_rows<)",
                 {"prefetcht0", "prefetcht1"}),
    "avx512 scores": (rf"topth_cpu::avx512_level::{_ANON}(scores\(|tile_groups<|head_block<|tile_heads<|qk_block<)",
                      {"prefetcht0", "prefetcht1"}),
    "avx512 P.V": (rf"topth_cpu::avx512_level::{_ANON}(pv\(|pv_direct_all<|pv_heads_all<|pv_rows_pf<|pv_rows_nv<|pv_rows<)",
                   {"prefetcht0", "prefetcht1"}),
    "avx512bf16 scores": (rf"topth_cpu::avx512bf16_level::{_ANON}(scores\(|tile_npf<|tile_block<|tile_heads<|dp_block<)",
                          {"prefetcht0", "prefetcht1"}),
    "amx scores": (r"topth_cpu::amx_level::scores\(", {"prefetcht0", "prefetcht1"}),
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
    for stage, (pattern, hints) in EXPECTED.items():
        bodies = [h for fn, h in found.items() if re.search(pattern, fn)]
        if not bodies:
            continue  # that level was not compiled (not an x86-64 build, or the compiler refused its flags)
        got = set().union(*bodies)
        assert hints <= got, f"{stage}: prefetch instructions {sorted(got)}, expected {sorted(hints)}"
        checked += 1
    if not checked:
        pytest.skip("no AVX2 or AVX-512 level in this build (their scores stages are the ones that prefetch)")
