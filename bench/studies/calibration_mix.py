"""k~/k by row-length bucket on HumanEval and the long documents for calibration text mixes
(docs/model.md, "Calibration text mixes").

Calibrates one layer-wise threshold set per mix and placement (k = 16, per-head selection,
layers 0-1 at 256; offline SDC and VMC for pre_softmax, VMC for post_softmax) on 8 document
starts per text, leaving out what ``evaluate`` evaluates (its two long documents and its
first 32 HumanEval problems), then counts k~/k (kept / k, per head, thresholded layers,
prefill rows) per row-length bucket on 32 HumanEval prompts + canonical solutions and on
the first 1024 tokens of the two long documents. These are the prefill rows behind
``evaluate``'s per-text buckets (``by_text``, which add the decode rows); with
``python-stdlib`` alone they match its records to the digit pre-softmax and within 0.01
post-softmax (SmolLM2).

Usage (SmolLM2-135M, CPU; 1-3 minutes per mix and placement)::

    python -m topth_ops.bench.studies.calibration_mix python-stdlib python-stdlib+pydoc-topics
"""

from __future__ import annotations

import argparse
import time

from .calibration_transfer import prefill_stats

BUCKETS = ((0, 64), (64, 128), (128, 256), (256, 512), (512, 1024))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mixes", nargs="+", metavar="MIX",
                   help="calibration texts joined by '+' (python-stdlib, humaneval, pydoc-topics)")
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--per-text", type=int, default=8, help="samples per text (default 8)")
    args = p.parse_args(argv)

    import torch

    from topth_ops.hf.calib_sources import calibration_texts, mixed_samples
    from topth_ops.hf.calibrate import CalibrationText, calibrate
    from topth_ops.hf.model import load_model
    from topth_ops.hf.texts import humaneval_problems, stdlib_documents
    from topth_ops.thresholds import parse_layer_k

    torch.set_num_threads(2)
    lm = load_model(None, progress=False)
    L = int(lm.model.config.num_hidden_layers)
    long_docs = stdlib_documents(lm.tokenizer, 2, 2304, 3072)  # what evaluate holds out (its defaults)
    problems = humaneval_problems(32)
    held = [name for name, _ in long_docs] + [q["task_id"] for q in problems]
    evals = {"HumanEval": [torch.tensor(lm.tokenizer(q["prompt"] + q["canonical_solution"]).input_ids)
                           for q in problems],
             "long documents": [ids[:1024] for _, ids in long_docs]}

    def ktk(ts, seqs):
        col = prefill_stats(lm, ts, seqs)
        return " ".join(f"{col.k_tilde_over_k(ts.layer_k, lo, hi)[0]:.2f}" for lo, hi in BUCKETS)

    print(f"buckets {' '.join(f'({lo},{hi}]' for lo, hi in BUCKETS)} (nan: no rows)")
    for mix in args.mixes:
        sources = mix.split("+")
        samples, desc = mixed_samples(lm.tokenizer, calibration_texts(sources, exclude=held),
                                      args.per_text * len(sources), 1024, align="document")
        for placement in ("pre_softmax", "post_softmax"):
            t0 = time.time()
            sets = calibrate(lm.model, CalibrationText(samples, desc), [parse_layer_k("0:256,1:256", args.k, L)],
                             [placement], sdc_table=placement == "pre_softmax", layerwise=True, progress=False)
            ts = sets[(0, placement, "head")]
            print(f"{mix} {placement} k={args.k} ({len(samples)} samples, {time.time() - t0:.0f} s)", flush=True)
            for name, seqs in evals.items():
                print(f"  {name:15s} {ktk(ts, seqs)}", flush=True)


if __name__ == "__main__":
    main()
