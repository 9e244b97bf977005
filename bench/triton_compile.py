"""Compile the real launches of :func:`decode_attn_fwd` for a GPU architecture, on a
machine without a GPU: ``python -m topth_ops.bench.triton_compile [--arch 90]``.

The launcher is run with its kernels replaced by recorders (nothing executes); every
recorded launch is then compiled ahead of time by Triton for ``cuda:<arch>`` (PTX and
cubin through the ptxas bundled with Triton), with the same constexprs and the same
argument specialisations the JIT would use (ints equal to 1 become constants, 16-aligned
pointers and ints get the divisibility hint). This catches GPU-only compile errors that
the CPU interpreter cannot see, and measures what the compiled code costs: registers and
spills (``ptxas -v``, the same ptxas and target Triton uses), shared memory,
tensor-core instructions, and how K and V rows are loaded (cp.async or predicated
``ld.global``, found from the TTGIR's source locations). Must run with
``TRITON_INTERPRET`` unset. Prints one JSON object per compiled kernel.
"""

from __future__ import annotations

import argparse
import json
import linecache
import os
import re
import subprocess
import sys
import tempfile
import time
from functools import lru_cache

import torch

from topth_ops.env import interpreter_enabled

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
          torch.int32: "i32", torch.int64: "i64"}
KERNELS = ("pre_kernel", "post_scores_kernel", "post_select_kernel", "combine_kernel")


class _Recorder:
    def __init__(self, name, fn, calls):
        self.name, self.fn, self.calls = name, fn, calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((self.name, self.fn, args, kwargs, grid))
        return launch


def _signature(fn, args, kwargs):
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        value = kwargs[name] if name in kwargs else args[i]
        if fn.params[i].is_constexpr:
            sig[name], consts[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[name] = "*" + _TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int) and fn.params[i].do_not_specialize:
            sig[name] = "i64" if abs(value) >= 2 ** 31 else "i32"
        elif isinstance(value, int):
            if value == 1:
                sig[name], consts[name] = "constexpr", 1
            else:
                sig[name] = "i64" if abs(value) >= 2 ** 31 else "i32"
                if value % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{name}: cannot specialise {type(value).__name__}")
    return sig, consts, attrs


# (label, dtype, placement, sdc, vmc, value_mean given, dense, Hq, Hkv, D)
CASES = [
    ("target-pre-bf16", torch.bfloat16, "pre_softmax", "none", False, False, False, 32, 8, 128),
    ("target-dense-bf16", torch.bfloat16, "pre_softmax", "none", False, False, True, 32, 8, 128),
    ("target-post-bf16", torch.bfloat16, "post_softmax", "none", False, False, False, 32, 8, 128),
    ("pre-exact-vmc-mean-bf16-d64", torch.bfloat16, "pre_softmax", "exact", True, False, False, 9, 3, 64),
    ("pre-expth-fp16-d80-mha", torch.float16, "pre_softmax", "exp_threshold", False, False, False, 8, 8, 80),
    ("post-vmc-fp32-d96", torch.float32, "post_softmax", "none", True, True, False, 16, 2, 96),
    ("pre-offline-bf16-d256", torch.bfloat16, "pre_softmax", "offline", True, True, False, 10, 2, 256),
]


def record(label, dtype, placement, sdc, vmc, vmean_given, dense, hq, hkv, d, *, batch=2, seq=64,
           selection="head", paged=None, sets=0, stats=None, config=None):
    """Run :func:`decode_attn_fwd` with recorders in place of the kernels; returns the
    launches as ``(name, kernel, args, kwargs, grid)``. ``paged`` = (layout, block_size)."""
    from topth_ops.backends.triton import launch as la

    calls = []
    saved = {name: getattr(la, name) for name in KERNELS}
    for name, fn in saved.items():
        setattr(la, name, _Recorder(name, fn, calls))
    try:
        q = torch.zeros(batch, hq, d, dtype=dtype)
        bt, layout = None, "BNSD"
        if paged is not None:
            layout, bs = paged
            nblk = batch * (-(-seq // bs))
            shape = (nblk, bs, hkv, d) if layout == "NHD" else (nblk, hkv, bs, d)
            kv = torch.zeros(shape, dtype=dtype)
            bt = torch.zeros(batch, -(-seq // bs), dtype=torch.int32)
        else:
            kv = torch.zeros(batch, hkv, seq, d, dtype=dtype)
        heads = hkv if selection == "group" else hq
        th = torch.zeros((sets, heads, seq) if sets else (heads, seq))
        tset = torch.zeros(batch, dtype=torch.int32) if sets else None
        table = torch.zeros((sets, hq, seq) if sets else (hq, seq)) if sdc == "offline" else None
        vmean = torch.zeros(batch, hkv, d) if vmean_given else None
        out = torch.empty_like(q)
        if stats is None:
            stats = not dense
        st = (torch.empty(batch, hq, dtype=torch.int32), torch.empty(batch, hkv, dtype=torch.int32),
              torch.empty(batch, hq)) if stats else None
        if config is None:
            bn, warps = la.gpu_tiles(d, hq // hkv, torch.tensor([], dtype=dtype).element_size(),
                                     "pre_softmax" if dense else placement)
            config = la.LaunchConfig(block_n=bn, num_splits=5, num_warps=warps)
        la.decode_attn_fwd(q, kv, kv, torch.full((batch,), seq, dtype=torch.int32), th, out,
                           scale=d ** -0.5, placement=placement, sdc=sdc, sdc_table=table, vmc=vmc,
                           value_mean=vmean, stats=st, dense=dense, config=config, block_table=bt,
                           kv_layout=layout, selection=selection, threshold_set=tset)
    finally:
        for name, fn in saved.items():
            setattr(la, name, fn)
    return calls


@lru_cache(maxsize=None)
def _bin(tool: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)


def ptxas_usage(ptx: str, arch: int) -> dict:
    """Registers, spill bytes and stack of ``ptx`` from ``ptxas -v`` (Triton's ptxas and
    target name, so the numbers are those of the cubin Triton builds)."""
    name = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as fh:
            fh.write(ptx)
        proc = subprocess.run([_bin("ptxas"), "-v", f"--gpu-name={name}", src, "-o", os.path.join(tmp, "k.o")],
                              capture_output=True, text=True, check=True)
    log = proc.stderr + proc.stdout
    grab = lambda pat: int(m.group(1)) if (m := re.search(pat, log)) else 0  # noqa: E731
    return {"regs": grab(r"Used (\d+) registers"), "spill_stores": grab(r"(\d+) bytes spill stores"),
            "spill_loads": grab(r"(\d+) bytes spill loads"), "stack": grab(r"(\d+) bytes stack frame")}


_SASS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def sass_of(cubin: bytes) -> str:
    """SASS text of a cubin (``cuobjdump -sass``, bundled with Triton)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as fh:
            fh.write(cubin)
        return subprocess.run([_bin("cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout


def _instrs_and_loops(sass: str):
    instrs = [(int(m.group(1), 16), m.group(3), m.group(4)) for m in _SASS.finditer(sass)]
    loops = []
    for addr, op, rest in instrs:
        if op.startswith("BRA") and (t := re.search(r"0x([0-9a-f]+)", rest)) and int(t.group(1), 16) <= addr:
            loops.append((int(t.group(1), 16), addr))
    return instrs, loops


def spills_in_loops_of(sass: str) -> int:
    """Local-memory (spill) instructions, STL / LDL, that lie inside a loop of the SASS: a
    loop is the range [target, branch] of a backward branch. A spill outside every loop
    costs one L1 access per program; inside a loop it costs one per iteration."""
    instrs, loops = _instrs_and_loops(sass)
    return sum(1 for addr, op, _ in instrs if op.split(".")[0] in ("STL", "LDL")
               and any(lo <= addr <= hi for lo, hi in loops))


def tile_loop_instrs(sass: str) -> int:
    """SASS instructions of the innermost loop with tensor-core or cp.async work (the tile
    loop), or of the largest loop: what one warp issues per tile."""
    instrs, loops = _instrs_and_loops(sass)
    best = 0
    for lo, hi in loops:
        body = [op for addr, op, _ in instrs if lo <= addr <= hi]
        inner = not any(lo < a <= b < hi for a, b in loops if (a, b) != (lo, hi))
        if inner and any(op.startswith(("HMMA", "LDGSTS", "FFMA")) for op in body):
            best = max(best, len(body))
    return best


_LOC_DEF = re.compile(r"^#(loc\d*) = loc\((.*)\)\s*$")
_LOC_FILE = re.compile(r'^"([^"]+)":(\d+):\d+$')
_LOC_CALL = re.compile(r"^callsite\(#(loc\d*) at #(loc\d*)\)$")
_LOC_NAMED = re.compile(r'^"[^"]*"\(#(loc\d*)\)$')


def _frames(defs: dict, loc: str, depth: int = 0) -> list:
    """Source (file, line) frames of a TTGIR location id, innermost first."""
    body = defs.get(loc, "")
    if depth > 50:
        return []
    if m := _LOC_FILE.match(body):
        return [(m.group(1), int(m.group(2)))]
    if m := _LOC_CALL.match(body):
        return _frames(defs, m.group(1), depth + 1) + _frames(defs, m.group(2), depth + 1)
    if m := _LOC_NAMED.match(body):
        return _frames(defs, m.group(1), depth + 1)
    return []


def cache_loads(ttgir: str) -> dict:
    """How the kernel loads K and V rows inside its loops: for each cache, the set of
    ``cp.async`` (pipelined to shared memory) / ``ld.global`` (to registers) loads, and
    whether they are predicated (masked). A load is attributed to V or K when one of its
    source frames is a line of this package that names ``V_head`` or ``K_head``."""
    defs = {}
    for line in ttgir.splitlines():
        if m := _LOC_DEF.match(line.strip()):
            defs[m.group(1)] = m.group(2)
    found = {"K": set(), "V": set()}
    for line in ttgir.splitlines():
        is_copy = "ttg.async_copy_global_to_local" in line
        if not (is_copy or " tt.load " in line):
            continue
        indent = len(line) - len(line.lstrip())
        m = re.search(r"loc\(#(loc\d*)\)\s*$", line)
        if indent <= 4 or m is None:
            continue  # outside the loops
        cache = None
        for path, lineno in _frames(defs, m.group(1)):
            text = linecache.getline(path, lineno)
            if "V_head" in text:
                cache = "V"
            elif "K_head" in text and cache is None:
                cache = "K"
        if cache is None:
            continue
        masked = " mask " in line if is_copy else bool(re.search(r"tt\.load %\S+, %", line))
        found[cache].add(("cp.async" if is_copy else "ld.global") + (" predicated" if masked else ""))
    return {k: sorted(v) for k, v in found.items()}


def compile_call(name, fn, args, kwargs, arch, *, usage=True):
    """Compile one recorded launch; returns its report row (dict)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    opts = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    sig, consts, attrs = _signature(fn, args, {k: v for k, v in kwargs.items() if k not in opts})
    t0 = time.time()
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", arch, 32), options=opts)
    ptx = k.asm["ptx"]
    row = {
        "kernel": name,
        "compile_s": round(time.time() - t0, 2),
        "num_warps": k.metadata.num_warps,
        "num_stages": opts.get("num_stages", 3),
        "shared_bytes": k.metadata.shared,
        "mma": len(re.findall(r"\bmma\.sync|\bwgmma\.", ptx)),
        "mma_types": sorted(set(re.findall(r"mma\.sync\.aligned\.[a-z0-9.]+", ptx))),
        "cp_async": len(re.findall(r"cp\.async\.c[ga]\.shared\.global", ptx)),
        "predicated_ld_global": len(re.findall(r"@%p\d+\s+ld\.global", ptx)),
        "loads": cache_loads(k.asm["ttgir"]),
    }
    if usage:
        row.update(ptxas_usage(ptx, arch))
        sass = sass_of(k.asm["cubin"])
        row["spills_in_loops"] = spills_in_loops_of(sass)
        row["loop_instrs"] = tile_loop_instrs(sass)
        bn, dpad = kwargs.get("BLOCK_N"), kwargs.get("D_PAD")
        es = next((a.element_size() for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()
                   and a.dtype != torch.float32), 4)
        row["tile_kib"] = round(bn * dpad * es / 1024, 2) if bn and dpad else None
    return row


def fresh_cache() -> str:
    """Point Triton's compile cache at a new empty folder (``TRITON_CACHE_DIR``) and return it.

    The report reads the source line of every load from the locations of the compiled code;
    Triton's cache key is the kernels' source, not their line numbers, so a cached
    compilation made before an edit that only moved lines (a docstring) would point at the
    wrong lines. Every report therefore compiles afresh."""
    path = tempfile.mkdtemp(prefix="topth-triton-cache-")
    os.environ["TRITON_CACHE_DIR"] = path
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m topth_ops.bench.triton_compile", description=__doc__)
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90 = H100/H200)")
    parser.add_argument("--cases", default="all", help="comma-separated case labels, or all")
    args = parser.parse_args(argv)
    if interpreter_enabled():
        print("triton_compile: unset TRITON_INTERPRET (the interpreter has no compiler)", file=sys.stderr)
        return 2
    fresh_cache()
    wanted = None if args.cases == "all" else set(args.cases.split(","))
    failures = 0
    for case in CASES:
        if wanted is not None and case[0] not in wanted:
            continue
        for name, fn, a, kw, _grid in record(*case):
            try:
                info = compile_call(name, fn, a, kw, args.arch)
                info["status"] = "ok"
            except Exception as e:  # noqa: BLE001 - report every failing kernel
                failures += 1
                info = {"kernel": name, "status": "error", "error": f"{type(e).__name__}: {e}"[:2000]}
            info["case"] = case[0]
            print(json.dumps(info), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
