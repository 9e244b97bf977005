"""``python -m topth_ops.bench.tune``: sweep Triton launch configs on one H200 target shape.

Times :func:`topth_ops.backends.triton.launch.decode_attn_fwd` (dense mode, pre_softmax at f = 0.1
with the kept rows scattered and clustered in runs of 64, post_softmax at f = 0.1) for a
small grid of tile sizes, warps, stages, split counts and tile skipping, so that the
defaults of :func:`topth_ops.backends.triton.launch.choose_config` (and the occupancy-derived split
count) can be checked on real hardware. Each config's output is checked against the
default config's output before timing. Writes ``tune.csv`` into ``--out``. CUDA only.
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
    from topth_ops.backends.triton.launch import LaunchConfig, choose_config, decode_attn_fwd

    from .cases import H200_TARGET, Case
    from .synth import make_case_inputs

    dev = torch.device("cuda")
    modes = {}
    for label, case in (("f0.1", Case(name="tune-pre-f0.1", kept_frac=0.1, **H200_TARGET)),
                        ("f0.1-clustered", Case(name="tune-pre-f0.1-cl", kept_frac=0.1, cluster=64, **H200_TARGET)),
                        ("post-f0.1", Case(name="tune-post-f0.1", kept_frac=0.1, placement="post_softmax",
                                           **H200_TARGET))):
        modes[label] = make_case_inputs(case, dev).inputs
    inp = modes["f0.1"]
    modes = {"dense": inp, **modes}
    base = choose_config(inp.batch, inp.num_kv_heads, inp.max_seq_len, inp.head_dim, dev,
                         group=inp.group_size, elem_bytes=inp.query.element_size())
    configs = [None]  # None: the launcher's own choice (split count from the compiled occupancy)
    for bn in (16, 32, 64):
        for warps in (4, 8):
            for stages in (3, 4):
                configs.append(LaunchConfig(bn, base.num_splits, warps, stages, False))
    for ns in (2, 4, 6, 8, 12, 16):
        configs.append(LaunchConfig(base.block_n, ns, base.num_warps, base.num_stages, False))
    configs.append(LaunchConfig(base.block_n, base.num_splits, base.num_warps, base.num_stages, True))

    def call(cfg, mode, out):
        x = modes[mode]
        return lambda: decode_attn_fwd(x.query, x.key_cache, x.value_cache, x.seq_lens, x.thresholds, out,
                                       scale=x.scale, placement=x.placement, dense=(mode == "dense"),
                                       config=cfg)

    ref = {}
    for mode in modes:
        o = torch.empty_like(inp.query)
        call(None, mode, o)()
        ref[mode] = o.float()
    rows, t0 = [], time.time()
    print(f"{'mode':<15} {'block_n':>7} {'splits':>6} {'warps':>5} {'stages':>6} {'skip':>5} {'ms':>8}")
    for cfg in configs:
        for mode in modes:
            if cfg is not None and cfg.tile_skip and mode == "dense":
                continue
            if time.time() - t0 > args.seconds:
                break
            o = torch.empty_like(inp.query)
            fn = call(cfg, mode, o)
            try:
                fn()
                torch.cuda.synchronize()
                err = float((o.float() - ref[mode]).abs().max())
                ms = float(triton.testing.do_bench(fn, warmup=10, rep=args.budget_ms, return_mode="median")) \
                    if err < 5e-2 else float("nan")
                status = "ok" if err < 5e-2 else f"mismatch {err:.3g}"
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for a config
                ms, status = float("nan"), f"{type(e).__name__}: {e}"[:120]
            c = cfg or base
            label = "auto" if cfg is None else ""
            print(f"{mode:<15} {c.block_n:>7} {(label or c.num_splits):>6} {c.num_warps:>5} {c.num_stages:>6} "
                  f"{str(c.tile_skip):>5} {ms:8.4f} {status if status != 'ok' else ''}", flush=True)
            rows.append(dict(mode=mode, block_n=c.block_n, num_splits=label or c.num_splits, num_warps=c.num_warps,
                             num_stages=c.num_stages, tile_skip=c.tile_skip, ms=ms, status=status,
                             default=cfg is None))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    for mode in modes:
        ok = [r for r in rows if r["mode"] == mode and r["ms"] == r["ms"]]
        if ok:
            best = min(ok, key=lambda r: r["ms"])
            dflt = next((r for r in ok if r["default"]), None)
            print(f"best {mode}: {best}" + (f"; default {dflt['ms']:.4f} ms" if dflt else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
