"""``python -m topth_ops.bench.tune``: sweep Triton launch configs on one H200 target shape.

Times :func:`topth_ops.cuda_kernels.decode_attn_fwd` (dense mode and pre_softmax at
f = 0.1) for a small grid of tile sizes, warps, stages and split counts, so that the
defaults of :func:`topth_ops.cuda_kernels.choose_config` can be checked on real hardware.
Each config's output is checked against the default config's output before timing.
Writes ``tune.csv`` into ``--out``. CUDA only.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m topth_ops.bench.tune", description=__doc__)
    parser.add_argument("--out", default=".")
    parser.add_argument("--seconds", type=float, default=90.0, help="stop sweeping after this long")
    parser.add_argument("--budget-ms", type=float, default=60.0)
    args = parser.parse_args(argv)

    import torch
    import triton.testing

    if not torch.cuda.is_available():
        print("tune: needs a CUDA device")
        return 2
    from topth_ops.cuda_kernels import LaunchConfig, choose_config, decode_attn_fwd

    from .cases import H200_TARGET, Case
    from .synth import make_case_inputs

    dev = torch.device("cuda")
    case = Case(name="tune-h200-pre-f0.1", kept_frac=0.1, **H200_TARGET)
    ci = make_case_inputs(case, dev)
    inp = ci.inputs
    default = choose_config(inp.batch, inp.num_kv_heads, inp.max_seq_len, inp.head_dim, dev)
    configs = [default]
    for bn in (32, 64, 128):
        for warps in (4, 8):
            for stages in (2, 3):
                configs.append(LaunchConfig(bn, default.num_splits, warps, stages, True))
    for ns in sorted({2, 4, 8, 16, 2 * default.num_splits} - {default.num_splits}):
        configs.append(LaunchConfig(default.block_n, ns, default.num_warps, default.num_stages, True))
    configs.append(LaunchConfig(default.block_n, default.num_splits, default.num_warps,
                                default.num_stages, False))

    def call(cfg, dense, out):
        return lambda: decode_attn_fwd(inp.query, inp.key_cache, inp.value_cache, inp.seq_lens,
                                       inp.thresholds, out, scale=inp.scale, placement="pre_softmax",
                                       dense=dense, config=cfg)

    ref = {}
    for dense in (True, False):
        o = torch.empty_like(inp.query)
        call(default, dense, o)()
        ref[dense] = o.float()
    rows, t0 = [], time.time()
    print(f"{'mode':<6} {'block_n':>7} {'splits':>6} {'warps':>5} {'stages':>6} {'skip':>5} {'ms':>8}")
    for cfg in configs:
        for dense in (True, False):
            if time.time() - t0 > args.seconds:
                break
            o = torch.empty_like(inp.query)
            fn = call(cfg, dense, o)
            try:
                fn()
                torch.cuda.synchronize()
                err = float((o.float() - ref[dense]).abs().max())
                ms = float(triton.testing.do_bench(fn, warmup=10, rep=args.budget_ms, return_mode="median")) \
                    if err < 5e-2 else float("nan")
                status = "ok" if err < 5e-2 else f"mismatch {err:.3g}"
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for a config
                ms, status = float("nan"), f"{type(e).__name__}: {e}"[:120]
            mode = "dense" if dense else "f0.1"
            print(f"{mode:<6} {cfg.block_n:>7} {cfg.num_splits:>6} {cfg.num_warps:>5} {cfg.num_stages:>6} "
                  f"{str(cfg.tile_skip):>5} {ms:8.4f} {status if status != 'ok' else ''}", flush=True)
            rows.append(dict(mode=mode, block_n=cfg.block_n, num_splits=cfg.num_splits,
                             num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                             tile_skip=cfg.tile_skip, ms=ms, status=status,
                             default=(cfg == default)))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    for mode in ("dense", "f0.1"):
        ok = [r for r in rows if r["mode"] == mode and r["ms"] == r["ms"]]
        if ok:
            best = min(ok, key=lambda r: r["ms"])
            dflt = next((r for r in ok if r["default"]), None)
            print(f"best {mode}: {best}" + (f"; default {dflt['ms']:.4f} ms" if dflt else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
