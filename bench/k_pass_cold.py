"""The ``cpu`` kernel's K pass alone against a plain read of the same K tensors, cold.

Decode with thresholds at +inf reads every K row (scores, per-head maxima, a selection that
keeps nothing) and no V row: the K pass. This times it, dense decode, and torch's ``K.sum()``
over the same per-layer K tensors, one thread, each round in a new random order, with the
layers rotated past the last-level cache (docs/cpu.md, "The K pass does not overlap with
memory"). Usage: ``taskset -c 1 python -m topth_ops.bench.k_pass_cold [smollm2|llama8b]``.
Record ``lscpu`` with the result.
"""

from __future__ import annotations

import math
import random
import statistics
import sys

import torch

from topth_ops import decode_attention

from .cpu_cold import _layer_count, _time_rotation
from .machine import llc_bytes

SHAPES = {"smollm2": (8, 9, 3, 64, 8192), "llama8b": (8, 32, 8, 128, 8192)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    name = argv[0] if argv else "smollm2"
    if name not in SHAPES:
        raise SystemExit(f"shape must be one of {sorted(SHAPES)}, got {name!r}")
    B, Hq, Hkv, D, S = SHAPES[name]
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    dt = torch.bfloat16
    per_layer = B * Hkv * S * D * dt.itemsize  # K bytes
    layers = _layer_count(per_layer, llc_bytes())
    kv = [(torch.randn(B, Hkv, S, D, generator=gen).to(dt), torch.randn(B, Hkv, S, D, generator=gen).to(dt))
          for _ in range(layers)]
    q = torch.randn(B, Hq, D, generator=gen).to(dt)
    lens = torch.full((B,), S, dtype=torch.int64)

    def op(theta: float):
        th = torch.full((Hkv, 1), theta)
        return [lambda k=k, v=v: decode_attention(q, k, v, lens, th, scale=1 / math.sqrt(D), placement="pre_softmax",
                                                  selection="group", backend="cpu") for k, v in kv]

    variants = {"the op's K pass (theta = +inf)": (op(float("inf")), per_layer),
                "the op, dense": (op(float("-inf")), 2 * per_layer),
                "torch K.sum(), the same tensors": ([lambda k=k: k.sum() for k, _ in kv], per_layer)}
    times: dict = {v: [] for v in variants}
    order = random.Random(0)
    for calls, _ in variants.values():
        calls[0]()
    for _ in range(5):
        for v in order.sample(list(variants), len(variants)):
            times[v].append(_time_rotation(variants[v][0]))
    print(f"{name}: B{B} {Hq}/{Hkv} heads d{D} S{S} bfloat16, {layers} layers rotated, one thread")
    for v, (_, nbytes) in variants.items():
        ms = statistics.median(times[v])
        print(f"{v:34s} {ms:7.2f} ms per layer {nbytes / ms / 1e6:6.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
