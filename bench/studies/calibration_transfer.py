"""How well calibrated thresholds keep k on text they were not calibrated on (docs/model.md,
"Samples from document starts").

Calibrates one layer-wise threshold set (k, placement, per-head selection; offline SDC and
VMC for pre_softmax, VMC for post_softmax) on ``python-stdlib`` without the evaluation's two
long documents (``evaluate``'s defaults), then counts k~/k (kept / k, per head, thresholded layers, prefill rows)
on: the calibration samples, held-out standard-library text (stream windows and, with
``--align document``, document starts) and HumanEval prompts + canonical solutions.

``--align stream`` calibrates on the first ``--samples`` of 48 consecutive 1024-token
windows and holds out windows 32-47; ``--align document`` calibrates on the starts of the
even-indexed modules and holds out the odd-indexed ones.

Usage (SmolLM2-135M, CPU; a few minutes per run)::

    python -m topth_ops.bench.studies.calibration_transfer --placement pre_softmax --align stream --samples 8
    python -m topth_ops.bench.studies.calibration_transfer --placement pre_softmax --align document --samples 16
"""

from __future__ import annotations

import argparse
import time

LAYER_RANGES = ((2, 5), (6, 9), (10, 14), (15, 19), (20, 24), (25, 29))


def prefill_stats(lm, ts, seqs):
    """Run ``seqs`` (1-D token ids) through the model with thresholds ``ts`` (offline SDC for
    pre_softmax, VMC) and return the kept-count statistics of their prefill rows."""
    import torch

    from topth_ops.hf.attention import TopthSettings, disable, enable
    from topth_ops.hf.evaluate import stats_collector

    col = stats_collector(lm.model)
    sdc = "offline" if ts.placement == "pre_softmax" else "none"
    enable(lm.model, TopthSettings(mode="topth", thresholds=ts, sdc=sdc, vmc=True), prefill_stats=col)
    try:
        with torch.no_grad():
            for ids in seqs:
                lm.model(ids.view(1, -1))
    finally:
        disable(lm.model)
    return col


def _ktk(lm, ts, seqs, num_layers: int) -> str:
    """k~/k of every thresholded layer, and per layer range, over the prefill rows of ``seqs``."""
    col = prefill_stats(lm, ts, seqs)
    parts = []
    for lo, hi in LAYER_RANGES:
        if lo >= num_layers:
            break
        lk = [ts.layer_k[i] if lo <= i <= hi else 0 for i in range(num_layers)]
        parts.append(f"L{lo}-{min(hi, num_layers - 1)}: {col.k_tilde_over_k(lk)[0]:.2f}")
    return f"all {col.k_tilde_over_k(ts.layer_k)[0]:.2f} | " + " | ".join(parts)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--placement", choices=("pre_softmax", "post_softmax"), default="pre_softmax")
    p.add_argument("--align", choices=("stream", "document"), default="stream")
    p.add_argument("--samples", type=int, default=8, help="calibration samples (stream: <= 32)")
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--problems", type=int, default=32, help="HumanEval problems")
    args = p.parse_args(argv)
    if not 1 <= args.samples <= (32 if args.align == "stream" else 64):
        p.error(f"--samples must lie in [1, {32 if args.align == 'stream' else 64}], got {args.samples}")

    import torch

    from topth_ops.hf.calib_sources import calibration_documents
    from topth_ops.hf.calibrate import CalibrationText, calibrate
    from topth_ops.hf.model import load_model
    from topth_ops.hf.texts import humaneval_problems, stdlib_documents, token_samples
    from topth_ops.thresholds import parse_layer_k

    torch.set_num_threads(2)
    lm = load_model(None, progress=False)
    L = int(lm.model.config.num_hidden_layers)
    long_docs = stdlib_documents(lm.tokenizer, 2, 2304, 3072)  # what evaluate holds out (its defaults)
    docs, _ = calibration_documents("python-stdlib", exclude=[name for name, _ in long_docs])
    if args.align == "stream":
        windows = token_samples(lm.tokenizer, docs, 48, 1024)
        calib, held = windows[:args.samples], {"held-out stdlib windows": windows[32:48]}
    else:
        calib = token_samples(lm.tokenizer, docs[::2], args.samples, 1024, align="document")
        held = {"held-out stdlib document starts": token_samples(lm.tokenizer, docs[1::2], 16, 1024, align="document"),
                "held-out stdlib windows": token_samples(lm.tokenizer, docs[1::2], 16, 1024)}
    he = [torch.tensor(lm.tokenizer(q["prompt"] + q["canonical_solution"]).input_ids)
          for q in humaneval_problems(args.problems)]
    t0 = time.time()
    sets = calibrate(lm.model, CalibrationText(calib, args.align), [parse_layer_k("0:256,1:256", args.k, L)],
                     [args.placement], sdc_table=args.placement == "pre_softmax", layerwise=True, progress=False)
    ts = sets[(0, args.placement, "head")]
    print(f"{args.placement} k={args.k}: calibrated on {len(calib)} {args.align} samples in {time.time() - t0:.0f} s",
          flush=True)
    for name, seqs in {"in-sample": calib[:8], **held, "humaneval": he}.items():
        print(f"  {name:32s} {_ktk(lm, ts, seqs, L)}", flush=True)


if __name__ == "__main__":
    main()
