"""k~/k on rows 2-8 x longer than the calibration samples (docs/model.md, "Rows 2-8 x beyond
the calibration samples").

Two measurements on SmolLM2-135M (8k context; ``--model gemma3-270m`` for Gemma 3 270M, whose
sliding-window layers' row ids are their 512-key windows, so only its global layers 5, 11 and
17 have rows beyond the samples), both on held-out code: the first ``--docs`` standard-library
modules of at least 8192 tokens (aifc.py, argparse.py, ...; left out of calibration),
truncated to 8192 tokens.

``op``: calibrates layer-wise threshold sets (the library's own length model beyond the
calibrated row ids; layers 0-1 at 256; offline SDC and VMC for pre_softmax, VMC for
post_softmax) on ``--samples`` document starts of ``--calib-tokens`` tokens from
python-stdlib + pydoc-topics, then counts k~/k (kept / k, per head, thresholded layers,
prefill rows, every layer thresholded) and the perplexity change against dense attention
by row-length range on the held-out documents; then, per range, the spread (min..max) of
each thresholded layer's own k~/k (layers 2 and up).

``dense``: one pass of dense attention records kept-count histograms (as calibration does)
of 8 document starts of 8192 tokens of the same mix and of the held-out documents; then, per
truncation T, thresholds calibrated on row ids <= T are continued beyond T by each length
model (theta constant, log log(n / k), -k / n, log(1 - k / n)) and their kept counts read off the recorded
rows (layers 2 and up, every layer dense, so this isolates the length model), over all
layers and, for the held-out rows, per layer (min..max). Histograms are cached in
``--cache`` (file names start with the ``--model`` name when one is given).

Usage (CPU, 2 cores: ``op`` ~40 minutes at --calib-tokens 1024, ``dense`` ~12 minutes; Gemma
3 270M ``op`` ~22 minutes)::

    python -m topth_ops.bench.studies.length_extrapolation op --calib-tokens 1024
    python -m topth_ops.bench.studies.length_extrapolation dense --cache /tmp/lx
    python -m topth_ops.bench.studies.length_extrapolation op --model gemma3-270m
"""

from __future__ import annotations

import argparse
import math
import time

LONG = 8192
FIRST_K = 256  # op: the k of layers 0 and 1
DENSE_KS = (16, 32, 64, 96)  # dense: the k recorded (each is a bucket edge of the histograms)
TARGETS = {"pre-head": ("pre_softmax", "head"), "post-head": ("post_softmax", "head"),
           "post-group": ("post_softmax", "group")}


def _ranges(t: int) -> list:
    return [(lo, hi) for lo, hi in ((t // 2, t), (t, 2 * t), (2 * t, 4 * t), (4 * t, 8 * t)) if hi <= LONG]


def _setup(docs: int, model=None):
    import torch

    from topth_ops.hf.model import load_model
    from topth_ops.hf.texts import stdlib_documents

    torch.set_num_threads(2)
    lm = load_model(model, progress=False)
    held = stdlib_documents(lm.tokenizer, docs, LONG, LONG)
    return lm, held


def _mix(lm, held, samples: int, tokens: int):
    from topth_ops.hf.calib_sources import calibration_texts, mixed_samples
    from topth_ops.hf.texts import stdlib_documents

    excl = {n for n, _ in held} | {n for n, _ in stdlib_documents(lm.tokenizer, 2, 2304, 3072)}  # + evaluate's
    return mixed_samples(lm.tokenizer, calibration_texts(["python-stdlib", "pydoc-topics"], exclude=sorted(excl)),
                         samples, tokens, align="document")


def _nll(model, ids):
    """Per-position negative log-likelihood of ``ids`` (position i predicts token i + 1)."""
    from topth_ops.hf.runner import token_nll

    return token_nll(model, ids)


def _mean(nll, lo: int, hi: int) -> float:
    """Mean NLL of the tokens predicted by rows n in (lo, hi] (row n sits at position n - 1)."""
    import torch

    return float(torch.cat([x[lo:hi] for x in nll]).mean())  # positions lo .. hi - 1 (the last row predicts none)


def _layer_spread(col, layer_k, ranges) -> str:
    """Per row range, the range of k~/k over the thresholded layers taken one at a time."""
    from .length_extrapolation_dense import spread

    from topth_ops.thresholds import DENSE

    def one(layer):
        return [DENSE] * layer + [layer_k[layer]] + [DENSE] * (len(layer_k) - layer - 1)

    layers = [i for i, k in enumerate(layer_k) if k != DENSE and i >= 2]  # layers 0-1: FIRST_K
    return " ".join(spread(col.k_tilde_over_k(one(i), lo, hi)[0] for i in layers) for lo, hi in ranges)


def run_op(args) -> None:
    from topth_ops.hf.attention import TopthSettings, disable, enable
    from topth_ops.hf.calibrate import CalibrationText, calibrate
    from topth_ops.hf.evaluate import stats_collector
    from topth_ops.thresholds import parse_layer_k

    lm, held = _setup(args.docs, args.model)
    L = int(lm.model.config.num_hidden_layers)
    samples, desc = _mix(lm, held, args.samples, args.calib_tokens)
    ranges = _ranges(args.calib_tokens)
    print(f"# calibration: {desc}\n# held out: {', '.join(n for n, _ in held)} (first {LONG} tokens)")
    print(f"# by row range {' '.join(f'({lo},{hi}]' for lo, hi in ranges)} (x the sample length: "
          f"{' '.join(f'{lo / args.calib_tokens:g}-{hi / args.calib_tokens:g}' for lo, hi in ranges)}): k~/k, "
          f"then the perplexity change against dense attention of the tokens those rows predict", flush=True)
    dense = [_nll(lm.model, ids) for _, ids in held]
    targets = [parse_layer_k(f"0:{FIRST_K},1:{FIRST_K}", k, L) for k in args.k]
    for p, s in (TARGETS[t] for t in args.targets):
        t0 = time.time()
        sets = calibrate(lm.model, CalibrationText(samples, desc), targets, [p], selections=[s],
                         sdc_table=p == "pre_softmax", layerwise=True, progress=False, pairs={(p, s)})
        for i, k in enumerate(args.k):
            ts = sets[(i, p, s)]
            col = stats_collector(lm.model)
            sdc = "offline" if p == "pre_softmax" else "none"
            enable(lm.model, TopthSettings(mode="topth", thresholds=ts, sdc=sdc, vmc=True), prefill_stats=col)
            try:
                sparse = [_nll(lm.model, ids) for _, ids in held]
            finally:
                disable(lm.model)
            ktk = " ".join(f"{col.k_tilde_over_k(ts.layer_k, lo, hi)[0]:.2f}" for lo, hi in ranges)
            ppl = " ".join(f"{100 * (math.exp(_mean(sparse, lo, hi) - _mean(dense, lo, hi)) - 1):+.1f}%"
                           for lo, hi in ranges)
            print(f"{p} {s} k={k}: k~/k {ktk} | ppl {ppl}   ({time.time() - t0:.0f} s)", flush=True)
            print(f"    per layer, min..max (layers with rows there): {_layer_spread(col, ts.layer_k, ranges)}",
                  flush=True)


def _cache_paths(cache: str, model) -> dict:
    """Histogram files of ``dense``: ``calib_8192.pt`` / ``heldout_8192.pt`` for SmolLM2 (the
    default; the recorded names), prefixed with the model's name (a path's last component)
    for any other model."""
    import os

    from topth_ops.hf.model import MODEL_ALIASES

    tag = "" if model in (None, MODEL_ALIASES[0]) else os.path.basename(os.path.normpath(str(model))) + "_"
    return {name: os.path.join(cache, f"{tag}{name}_{LONG}.pt") for name in ("calib", "heldout")}


def run_dense(args) -> None:
    import os

    from .length_extrapolation_dense import collect, compare

    paths = _cache_paths(args.cache, args.model)
    if not all(os.path.exists(p) for p in paths.values()):
        lm, held = _setup(args.docs, args.model)
        samples, desc = _mix(lm, held, 8, LONG)
        os.makedirs(args.cache, exist_ok=True)
        print(f"# calibration text: {desc}\n# held out: {', '.join(n for n, _ in held)}", flush=True)
        collect(lm.model, samples, list(DENSE_KS), paths["calib"])
        collect(lm.model, [ids for _, ids in held], list(DENSE_KS), paths["heldout"])
    for t in (1024, 2048):
        compare(paths["calib"], paths["heldout"], t, _ranges(t), args.k)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("op", "dense"))
    p.add_argument("--calib-tokens", type=int, default=1024, help="op: calibration sample length (257-4096)")
    p.add_argument("--samples", type=int, default=16, help="op: calibration samples (8 per text)")
    p.add_argument("--k", type=int, nargs="+", default=[16, 32, 96])
    p.add_argument("--docs", type=int, default=2,
                   help="held-out documents of >= 8192 tokens (the recorded dense run: 4)")
    p.add_argument("--cache", default="out/length_extrapolation", help="dense: histogram files")
    p.add_argument("--model", default=None,
                   help="smollm2-135m (default), gemma3-270m (its sliding-window layers' rows are their "
                        "windows, so only the global layers have rows beyond the samples) or a path; dense: "
                        "the cache files are named after it")
    p.add_argument("--targets", nargs="+", choices=list(TARGETS), default=list(TARGETS),
                   help="op: placement-selection pairs to calibrate and count")
    args = p.parse_args(argv)
    if not FIRST_K < args.calib_tokens <= LONG // 2:  # layers 0-1 need calibration rows longer than their k
        p.error(f"--calib-tokens must lie in [{FIRST_K + 1}, {LONG // 2}], got {args.calib_tokens}")
    if args.mode == "op" and not all(1 <= k < args.calib_tokens for k in args.k):
        p.error(f"op: --k must lie in [1, {args.calib_tokens - 1}] (calibration rows longer than k), got {args.k}")
    if args.mode == "dense" and not set(args.k) <= set(DENSE_KS):
        p.error(f"dense: --k must be among the recorded {' '.join(map(str, DENSE_KS))}, got {args.k}")
    if args.docs < 1 or args.samples < 2:
        p.error(f"--docs must be >= 1 and --samples >= 2 (one per text), got {args.docs} and {args.samples}")
    (run_op if args.mode == "op" else run_dense)(args)


if __name__ == "__main__":
    main()
