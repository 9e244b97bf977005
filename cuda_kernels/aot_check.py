"""Compile the real launches of :func:`decode_attn_fwd` for a GPU architecture, on a
machine without a GPU: ``python -m topth_ops.cuda_kernels.aot_check [--arch 90]``.

The launcher is run with its kernels replaced by recorders (nothing executes); every
recorded launch is then compiled ahead of time by Triton for ``cuda:<arch>`` (PTX and
cubin through the ptxas bundled with Triton), with the same constexprs and the same
argument specialisations the JIT would use (ints equal to 1 become constants, 16-aligned
pointers and ints get the divisibility hint). This catches GPU-only compile errors that
the CPU interpreter cannot see, and reports shared memory, registers, tensor-core (mma)
instructions and how the V rows are loaded. Must run with ``TRITON_INTERPRET`` unset.
Prints one JSON object per compiled kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
          torch.int32: "i32", torch.int64: "i64"}


class _Recorder:
    def __init__(self, name, fn, calls):
        self.name, self.fn, self.calls = name, fn, calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((self.name, self.fn, args, kwargs))
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
            sig[name] = "i32"
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


def record(label, dtype, placement, sdc, vmc, vmean_given, dense, hq, hkv, d, *, batch=2, seq=64):
    from . import decode_attn as da

    calls = []
    saved = {}
    for name in ("_decode_attn_kernel", "_decode_scores_kernel", "_decode_post_select_kernel",
                 "_decode_combine_kernel"):
        saved[name] = getattr(da, name)
        setattr(da, name, _Recorder(name, saved[name], calls))
    try:
        q = torch.zeros(batch, hq, d, dtype=dtype)
        kv = torch.zeros(batch, hkv, seq, d, dtype=dtype)
        th = torch.zeros(hq, seq)
        table = torch.zeros(hq, seq) if sdc == "offline" else None
        vmean = torch.zeros(batch, hkv, d) if vmean_given else None
        out = torch.empty_like(q)
        stats = (torch.empty(batch, hq, dtype=torch.int32), torch.empty(batch, hkv, dtype=torch.int32),
                 torch.empty(batch, hq))
        cfg = da.LaunchConfig(block_n=da.gpu_block_n(d), num_splits=5)
        da.decode_attn_fwd(q, kv, kv, torch.full((batch,), seq, dtype=torch.int32), th, out,
                           scale=d ** -0.5, placement=placement, sdc=sdc, sdc_table=table, vmc=vmc,
                           value_mean=vmean, stats=None if dense else stats, dense=dense, config=cfg)
    finally:
        for name, fn in saved.items():
            setattr(da, name, fn)
    return calls


def compile_call(name, fn, args, kwargs, arch):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    opts = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    sig, consts, attrs = _signature(fn, args, {k: v for k, v in kwargs.items() if k not in opts})
    t0 = time.time()
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", arch, 32), options=opts)
    ptx = k.asm["ptx"]
    return {
        "kernel": name,
        "compile_s": round(time.time() - t0, 2),
        "shared_bytes": k.metadata.shared,
        "mma": len(re.findall(r"\bmma\.sync|\bwgmma\.", ptx)),
        "mma_types": sorted(set(re.findall(r"mma\.sync\.aligned\.[a-z0-9.]+", ptx))),
        "cp_async": len(re.findall(r"cp\.async\.c[ga]\.shared\.global", ptx)),
        "ld_global_v4": len(re.findall(r"ld\.global(?:\.[a-z0-9]+)*\.v4", ptx)),
        "predicated_ld_global": len(re.findall(r"@%p\d+\s+ld\.global", ptx)),
        "ptx_lines": ptx.count("\n"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m topth_ops.cuda_kernels.aot_check", description=__doc__)
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90 = H100/H200)")
    parser.add_argument("--cases", default="all", help="comma-separated case labels, or all")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("aot_check: unset TRITON_INTERPRET (the interpreter has no compiler)", file=sys.stderr)
        return 2
    wanted = None if args.cases == "all" else set(args.cases.split(","))
    failures = 0
    for case in CASES:
        if wanted is not None and case[0] not in wanted:
            continue
        for name, fn, a, kw in record(*case):
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
