"""Would a per-row reference frame make pre-softmax thresholds transfer between texts?
(docs/model.md, "Samples from document starts").

On dense activations (no layer thresholded, so only the transfer is measured), kept-count
thresholds (:mod:`topth_ops.calibration.count`, target k per row-length bucket) are calibrated in
four frames of the same logits a of a row:

- ``raw``: a (the op's pre_softmax),
- ``first``: a - a_0 (relative to the first key, an attention sink),
- ``max``: a - max_j a_j (relative to the row maximum),
- ``lse``: a - log sum_j exp(a_j) (the log-probability: the op's post_softmax),

on ``python-stdlib`` document starts (even-indexed modules, evaluate's long documents left
out), then k~/k (kept / k, per head, layers at k) is counted in each frame on the
calibration samples, on held-out document starts (odd-indexed modules) and on HumanEval
prompts + canonical solutions.

Usage (SmolLM2-135M, CPU; ~5 minutes)::

    python -m topth_ops.bench.studies.threshold_frames --k 16
"""

from __future__ import annotations

import argparse
import time

FRAMES = ("raw", "first", "max", "lse")
EDGES = (0, 64, 128, 256, 512, 1024)
LAYER_RANGES = ((2, 9), (10, 19), (20, 29))


def frame(a, name: str):
    """The logits ``a`` ``[..., S]`` (-inf at invalid keys) in frame ``name``."""
    from topth_ops.calibration import row_log_z

    if name == "raw":
        return a
    if name == "first":
        return a - a[..., :1]
    m, log_z = row_log_z(a)
    return a - m if name == "max" else a - m - log_z


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--samples", type=int, default=8, help="calibration and held-out samples (1024 tokens)")
    p.add_argument("--problems", type=int, default=32, help="HumanEval problems")
    args = p.parse_args(argv)

    import numpy as np
    import torch

    from topth_ops.calibration import CountAccumulator
    from topth_ops.hf.attention import TopthSettings
    from topth_ops.hf.calib_sources import calibration_documents
    from topth_ops.hf.calibrate import run_calibration_pass
    from topth_ops.hf.model import load_model
    from topth_ops.hf.texts import humaneval_problems, stdlib_documents, token_samples
    from topth_ops.thresholds import parse_layer_k

    torch.set_num_threads(2)
    lm = load_model(None, progress=False)
    cfg = lm.model.config
    L, Hq, Hkv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    long_docs = stdlib_documents(lm.tokenizer, 2, 2304, 3072)  # what evaluate holds out (its defaults)
    docs, _ = calibration_documents("python-stdlib", exclude=[name for name, _ in long_docs])
    calib = token_samples(lm.tokenizer, docs[::2], args.samples, 1024, align="document")
    held = token_samples(lm.tokenizer, docs[1::2], args.samples, 1024, align="document")
    he = [torch.tensor(lm.tokenizer(q["prompt"] + q["canonical_solution"]).input_ids)
          for q in humaneval_problems(args.problems)]
    lk = parse_layer_k("0:256,1:256", args.k, L)
    ks = sorted({x for x in lk if x})
    accs = {f: CountAccumulator(L, Hq, Hkv, 1024, ks, ["pre_softmax"], ["head"]) for f in FRAMES}

    def record(layer, a, n, m, log_z):
        for f in FRAMES:
            accs[f].record(layer, frame(a.float(), f), n)

    t0 = time.time()
    run_calibration_pass(lm.model, calib, TopthSettings(mode="dense"), record, "calibrate", False)
    th = {f: torch.from_numpy(accs[f].result("pre_softmax", "head", lk, extend_to=1024)[0]).float() for f in FRAMES}
    print(f"k={args.k}: calibrated {len(calib)} document starts in {time.time() - t0:.0f} s", flush=True)

    for name, seqs in (("in-sample", calib), ("held-out doc starts", held), ("humaneval", he)):
        kept = {f: np.zeros((len(EDGES) - 1, L)) for f in FRAMES}
        target = np.zeros((len(EDGES) - 1, L))

        def count(layer, a, n, m, log_z):
            k = lk[layer]
            nn = n.reshape(-1)
            sel = nn > k
            if k == 0 or not bool(sel.any()):
                return
            b = np.searchsorted(EDGES, nn[sel].numpy(), side="left") - 1
            for f in FRAMES:
                t = th[f][layer][:, nn[sel] - 1]  # [H, rows]
                x = frame(a.float(), f).reshape(Hq, -1, a.shape[-1])[:, sel, :]  # B = 1
                np.add.at(kept[f][:, layer], b, (x > t.unsqueeze(-1)).sum((0, 2)).numpy())
            np.add.at(target[:, layer], b, Hq * k)

        run_calibration_pass(lm.model, seqs, TopthSettings(mode="dense"), count, name, False)
        for f in FRAMES:
            per_b = kept[f].sum(1) / np.maximum(target.sum(1), 1)
            per_l = [kept[f][:, lo:hi + 1].sum() / max(target[:, lo:hi + 1].sum(), 1) for lo, hi in LAYER_RANGES]
            print(f"k={args.k} {name:20s} {f:5s} all {kept[f].sum() / target.sum():.2f} | buckets "
                  + " ".join(f"{v:.2f}" if target.sum(1)[i] else "-" for i, v in enumerate(per_b))
                  + " | layers 2-9/10-19/20-29 " + " ".join(f"{v:.2f}" for v in per_l), flush=True)


if __name__ == "__main__":
    main()
