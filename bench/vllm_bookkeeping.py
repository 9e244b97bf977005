"""Cost of the vLLM backend's live bookkeeping (statistics and metrics) per decode step,
without an engine: one decode step of a 30-layer model's thresholded decode rows through
:func:`topth_ops.vllm.runtime.decode_rows` and :func:`~topth_ops.vllm.runtime.record`,
with metrics on (the op's statistics, the device sums, a flush every 32 steps, the JSON
report's counters) and off (none of it), the two alternating step by step so that the
machine's drift hits both alike. Each layer has its own paged cache (rotated, as in a model).

The end-to-end comparison (``bench/vllm_serving.py --configs topth,topth_nometrics``) is
the user-facing number; on a machine whose speed drifts by tens of percent between engine
runs it cannot resolve a 2% difference, which this can.

Usage::

    python -m topth_ops.bench.vllm_bookkeeping --json out/bookkeeping.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=3000)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", default="9,3", help="query heads, KV heads (SmolLM2-135M)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--steps", type=int, default=96, help="decode steps per configuration")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from topth_ops.thresholds import ThresholdSet
    from topth_ops.vllm import runtime as R
    from topth_ops.vllm.settings import VllmTopthSettings
    from topth_ops.vllm.stats import ServingStats

    from .machine import machine
    from .vllm_common import save_json

    torch.set_num_threads(args.threads)
    Hq, Hkv = (int(x) for x in args.heads.split(","))
    B, S, L, D, bs = args.batch, args.seq_len, args.layers, args.head_dim, 32
    nb = B * (-(-S // bs))
    g = torch.Generator().manual_seed(0)
    caches = [(torch.randn(nb, Hkv, bs, D, generator=g).to(torch.bfloat16),
               torch.randn(nb, Hkv, bs, D, generator=g).to(torch.bfloat16)) for _ in range(L)]
    bt = torch.randperm(nb, generator=g).view(B, -1).to(torch.int32)
    lens = torch.full((B,), S, dtype=torch.int32)
    q = torch.randn(B, Hq, D, generator=g).to(torch.bfloat16)
    # thresholds keeping about k of S positions (post-softmax, per KV group): log-prob cut
    th = torch.full((L, Hkv, S), 1.0 / (2 * args.k))
    ac = {"model_type": "llama", "num_layers": L, "num_q_heads": Hq, "num_kv_heads": Hkv, "head_dim": D}
    ts = ThresholdSet(th, torch.ones(L, Hkv, S, dtype=torch.int64), [args.k] * L, "post_softmax", "synthetic", ac,
                      selection="group")

    def runtime(on: bool):
        s = VllmTopthSettings(mode="topth", thresholds="unused", metrics=on, log_interval=0.0)
        return R.Runtime(s, ts, 0, 1, ServingStats("topth", None, 0.0) if on else None, "synthetic")

    rts = {"on": runtime(True), "off": runtime(False)}
    rules = {k: [R.layer_rule(rt, i, Hq, Hkv, "cpu") for i in range(L)] for k, rt in rts.items()}
    times: dict = {"on": [], "off": []}
    v_rows = []
    with torch.inference_mode():
        for step in range(args.steps * 2 + 4):
            name = "on" if step % 2 == 0 else "off"
            rt = rts[name]
            t0 = time.perf_counter()
            sets = R.decode_sets(rt, B, lens)
            for i in range(L):
                kc, vc = caches[i]
                _, st = R.decode_rows(rt, rules[name][i], q, kc, vc, lens, bt, D ** -0.5, "HND", sets)
                if rt.stats is not None or rt.settings.metrics:
                    R.record(rt, i, rules[name][i], sets, lens, Hkv, st)
                if st is not None and i == 0 and step == 0:
                    v_rows.append(float(st.v_rows.float().mean()))
            dt = time.perf_counter() - t0
            if step >= 4:
                times[name].append(dt)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    out = {"date": time.strftime("%Y-%m-%d"), "machine": vars(machine()), "threads": args.threads,
           "shape": {"batch": B, "seq_len": S, "layers": L, "heads": [Hq, Hkv], "head_dim": D, "k": args.k,
                     "layout": "HND bfloat16, block 32"},
           "step_ms_metrics_on": on * 1e3, "step_ms_metrics_off": off * 1e3, "off_over_on": off / on,
           "v_rows_per_group_layer0": v_rows[0] if v_rows else None, "steps_each": len(times["on"]),
           "flushes": rts["on"].fidelity.flushes if rts["on"].fidelity else 0}
    print(f"{B} x {S} rows, {L} layers, {Hq}/{Hkv} heads, d{D}, k {args.k}, {args.threads} thread(s): decode step "
          f"{on * 1e3:.2f} ms with metrics, {off * 1e3:.2f} ms without; throughput with metrics = "
          f"{off / on:.3f}x of without ({out['flushes']} flushes)", flush=True)
    if args.json:
        save_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
