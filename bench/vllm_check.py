"""Correctness measurements of the vLLM backend on SmolLM2-135M-Instruct (docs/vllm.md).

Parts (``--parts``, default all):

- ``equiv``: thresholds at -inf through the Top-Theta backend vs vLLM's own CPU attention,
  greedy, token for token on HumanEval prompts; each difference is reported with the
  logprob gap of the two best tokens where the runs split (a near-tie when tiny). Both
  engines run in ``--dtype`` (float32 by default; in bfloat16 the two best logits are often
  exactly equal, and such a tie follows the last bit of the attention).
- ``file``: a threshold file (``--thresholds``, e.g. k=16 post-softmax) with VMC through
  vLLM vs the transformers ``topth`` path (same file, same prompts, prefill dense as in
  the backend, and also thresholded prefill, the transformers default), greedy
  agreement; V rows read per decode step from the backend's statistics report. The
  transformers side loads the GGUF default model, so this also checks ``export-hf``.

Usage::

    topth-ops export-hf out/smol-hf
    topth-ops calibrate --k 16 --placement post_softmax --out out/th_k16_post.safetensors
    python bench/vllm_check.py --model out/smol-hf --thresholds out/th_k16_post.safetensors \
        --prompts 16 --max-tokens 64 --json out/vllm_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import vllm_common as vc  # noqa: E402
else:
    from . import vllm_common as vc


def part_equiv(model, ids, max_tokens, workdir, dtype: str) -> dict:
    dense_file = vc.write_threshold_file(model, os.path.join(workdir, "dense.safetensors"), kind="dense")
    base = vc.run_llm(model, ids, max_tokens, dtype=dtype)
    mine = vc.run_llm(model, ids, max_tokens, topth={"thresholds": dense_file,
                                                      "stats_file": os.path.join(workdir, "equiv_stats.json")},
                      dtype=dtype)
    cmp = vc.compare_tokens(base["tokens"], mine["tokens"], base["top"], mine["top"])
    rep = json.load(open(os.path.join(workdir, "equiv_stats.json")))
    return {"dtype": dtype, "compare_cpu_attn_vs_topth_neg_inf": cmp, "v_rows_fraction": rep["v_rows_fraction"],
            "gen_s": {"cpu_attn": base["gen_s"], "topth_neg_inf": mine["gen_s"]},
            "load_s": {"cpu_attn": base["load_s"], "topth_neg_inf": mine["load_s"]},
            "tokens": {"cpu_attn": base["tokens"], "topth_neg_inf": mine["tokens"]}}


def part_file(model, ids, max_tokens, thresholds, vmc, workdir, hf_model=None,
              hf_prefills=("dense", "thresholded"), progress=None) -> dict:
    stats_path = os.path.join(workdir, "file_stats.json")
    mine = vc.run_llm(model, ids, max_tokens, topth={"thresholds": thresholds, "vmc": vmc, "stats_file": stats_path})
    rep = json.load(open(stats_path))
    from topth_ops.hf.attention import enable
    from topth_ops.hf.model import load_model
    from topth_ops.hf.settings import TopthSettings

    lm = load_model(hf_model, progress=False)  # default: the GGUF model the export was made from
    out = {"vllm": {"gen_s": mine["gen_s"], "load_s": mine["load_s"], "tokens": mine["tokens"]},
           "vllm_stats": {k: rep[k] for k in ("decode_steps", "decode_tokens", "v_rows_read", "v_rows_dense",
                                              "v_rows_fraction", "v_rows_read_per_decode_step",
                                              "v_rows_dense_per_decode_step")}}
    for prefill in hf_prefills:
        if progress is not None:
            progress(out)
        enable(lm.model, TopthSettings(mode="topth", thresholds=thresholds, vmc=vmc, prefill=prefill))
        t0 = time.perf_counter()
        hf = vc.hf_greedy(lm.model, ids, max_tokens)
        out[f"hf_prefill_{prefill}"] = {"gen_s": time.perf_counter() - t0, "tokens": hf,
                                        "compare_vllm_vs_hf": vc.compare_tokens(mine["tokens"], hf, mine["top"])}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face folder (topth-ops export-hf)")
    ap.add_argument("--thresholds", help="threshold file for the 'file' part")
    ap.add_argument("--no-vmc", action="store_true", help="file part without V-mean compensation")
    ap.add_argument("--hf-model", default=None,
                    help="model for the transformers path (default: the GGUF default model, which also "
                         "checks the export); 'same' = --model")
    ap.add_argument("--hf-prefill", default="dense,thresholded",
                    help="prefill modes of the transformers path to compare with (comma-separated)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--parts", default="equiv,file")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                    help="model and KV-cache dtype of both engines in the 'equiv' part (default float32; "
                         "the 'file' part always runs float32)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if "file" in parts and not args.thresholds:
        ap.error("the 'file' part needs --thresholds")
    if args.dtype != "float32" and "equiv" not in parts:
        ap.error(f"--dtype {args.dtype} applies to the 'equiv' part only, which --parts leaves out")
    ids = vc.tokenize(args.model, vc.humaneval_prompts(args.prompts))
    res = {"model": args.model, "prompts": args.prompts, "max_tokens": args.max_tokens,
           "prompt_tokens": [len(x) for x in ids], "load_avg_start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as wd:
        if "equiv" in parts:
            res["equiv"] = part_equiv(args.model, ids, args.max_tokens, wd, args.dtype)
            c = res["equiv"]["compare_cpu_attn_vs_topth_neg_inf"]
            print(f"equiv: {c['identical']}/{c['prompts']} prompts identical to vLLM's CPU attention; "
                  f"diffs {c['diffs']}", flush=True)
            if args.json:
                vc.save_json(args.json, res)
        if "file" in parts:
            hf_model = args.model if args.hf_model == "same" else args.hf_model
            prefills = tuple(p.strip() for p in args.hf_prefill.split(",") if p.strip())
            def progress(partial):  # keep what is measured if a later step is interrupted
                res["file"] = partial
                if args.json:
                    vc.save_json(args.json, res)

            res["file"] = part_file(args.model, ids, args.max_tokens, args.thresholds, not args.no_vmc, wd, hf_model,
                                    prefills, progress)
            f = res["file"]
            s = f["vllm_stats"]
            print(f"file: V rows read {s['v_rows_fraction']:.3f} of dense, "
                  f"{s['v_rows_read_per_decode_step']:.0f} of {s['v_rows_dense_per_decode_step']:.0f} per decode step",
                  flush=True)
            for prefill in prefills:
                c = f[f"hf_prefill_{prefill}"]["compare_vllm_vs_hf"]
                print(f"file: vs transformers topth (prefill {prefill}): {c['identical']}/{c['prompts']} identical, "
                      f"prefix agreement {c['prefix_agreement']:.3f}; diffs {c['diffs']}", flush=True)
    res["load_avg_end"] = os.getloadavg()
    if args.json:
        vc.save_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
