"""Fixed cost of one call of the op on the ``cpu`` backend, against torch SDPA, at tiny sizes.

A decode step calls the op once per layer, so its fixed cost (validation, backend selection,
output allocation, the kernel's arguments, the kernel's plan) adds up where the cache is short.
This times the whole call and each part of it on one cache of ``S`` positions (B1, 9/3 heads,
head_dim 64, bfloat16, warm), best of five repeats of many calls (docs/cpu.md, "Per-call
cost"). Usage: ``taskset -c 1 python -m topth_ops.bench.call_overhead [S]``.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from topth_ops import decode_attention
from topth_ops.backends.cpu import cpu_module, kernel_args
from topth_ops.contract import make_inputs
from topth_ops.op import run
from topth_ops.registry import select_backend


def best_us(fn, calls: int = 5000) -> float:
    """Microseconds per call: best of five repeats of ``calls`` calls, after a warm-up."""
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    return best


def main(argv=None) -> int:
    """Print the table: microseconds per call of the whole op and of each part.

    Parameters
    ----------
    argv : list of str, optional
        ``[S]``, the cache length (default 16); else ``sys.argv[1:]``.

    Returns
    -------
    int
        0.
    """
    argv = sys.argv[1:] if argv is None else argv
    S = int(argv[0]) if argv else 16
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    B, Hq, Hkv, D, dt = 1, 9, 3, 64, torch.bfloat16
    q = torch.randn(B, Hq, D, generator=gen).to(dt)
    k = torch.randn(B, Hkv, S, D, generator=gen).to(dt)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(dt)
    lens = torch.full((B,), S, dtype=torch.int64)
    th = torch.full((Hkv, 1), 0.5)
    kw = dict(scale=D ** -0.5, placement="post_softmax", selection="group")
    inputs = make_inputs(q, k, v, lens, th, **kw)
    backend = select_backend(inputs, "cpu")
    out, stats = inputs.empty_outputs()
    args = kernel_args(inputs, out, stats)
    mod = cpu_module()
    q4 = q.view(B, Hq, 1, D)
    rows = [
        ("decode_attention (whole call)", lambda: decode_attention(q, k, v, lens, th, backend="cpu", **kw)),
        ("  make_inputs (validation)", lambda: make_inputs(q, k, v, lens, th, **kw)),
        ("  run (selection + outputs + forward)", lambda: run(inputs, "cpu")),
        ("    select_backend", lambda: select_backend(inputs, "cpu")),
        ("    empty_outputs", inputs.empty_outputs),
        ("    forward", lambda: backend.forward(inputs, out, stats)),
        ("      kernel_args", lambda: kernel_args(inputs, out, stats)),
        ("      the extension's decode", lambda: mod.decode(args, args["simd_level"])),
        ("torch SDPA (GQA), for scale", lambda: F.scaled_dot_product_attention(q4, k, v, scale=kw["scale"],
                                                                               enable_gqa=True)),
    ]
    print(f"B{B} {Hq}/{Hkv} heads d{D} S{S} bfloat16, one thread, warm; microseconds per call")
    for name, fn in rows:
        print(f"{name:40s} {best_us(fn):7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
