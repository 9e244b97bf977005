"""Calibration inside the vLLM engine (mode ``calibrate``): cost against dense serving, and
agreement with ``topth-ops calibrate`` on the same token sequences.

Prompts: standard-library module sources (the ``python-stdlib`` calibration text's order,
leaving out the first ``--held-out`` modules in name order, which ``topth-ops evaluate``
takes as its long documents), each cut to a length drawn from
``[--min-tokens, --max-tokens]``; ``--new-tokens`` greedy tokens each (``ignore_eos``),
prefix caching off, one engine per configuration, one after another:

1. ``vllm``: vLLM's own attention; the prompts with ``max_tokens=1`` (prefill), then whole.
2. ``calibrate_decode``: calibration from decode rows only (one whole call).
3. ``calibrate``: calibration from prompt and decode rows (one whole call); it writes the
   threshold files ``--out`` (``{placement}`` / ``{selection}`` as ``topth-ops calibrate``).
4. With ``--compare N``: the first N prompts with ``max_tokens=1`` through a calibrating
   engine (prompt rows only) and through the offline calibration (transformers, the same
   token ids), and the thresholds compared per set.

With ``--second-round FILE`` (and ``--threshold-set``, ``--vmc``) the calibrating engines run
a second round: every row of the file's thresholded layers goes through the op with that
set while the rows are recorded, and the file records the set's own target; the offline
side of ``--compare`` is ``calibrate(..., second_round=set)``.

Usage::

    python -m topth_ops.bench.vllm_calibrate --model out/smol-hf --prompts 64 --k 32,128 \\
        --out out/engine_{placement}_{selection}.safetensors --compare 4 --json out/calibrate.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

from .vllm_common import engine_kwargs, generate_together, save_json

#: Seconds to wait for a calibrating engine's files after its last request.
WRITE_WAIT_S = 600


def prompts(model: str, n: int, lo: int, hi: int, held_out: int, seed: int = 0) -> list:
    """``n`` prompts (token id lists, BOS first) of standard-library sources."""
    from transformers import AutoTokenizer

    from topth_ops.hf.calib_sources import calibration_documents
    from topth_ops.hf.texts import bos_ids, stdlib_modules

    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    held = [f.name for f in stdlib_modules()[1] if not f.name.startswith("_")][:held_out]
    docs, _ = calibration_documents("python-stdlib", exclude=held)
    rng = random.Random(seed)
    out = []
    for d in docs:
        ids = bos_ids(tok) + tok(d[: 8 * hi], add_special_tokens=False).input_ids
        if len(ids) >= lo:
            out.append(ids[: rng.randint(lo, min(hi, len(ids)))])
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} standard-library modules have >= {lo} tokens")


def run(model: str, ids: list, new_tokens: int, topth, prefill_call: bool, max_len: int, files=()) -> dict:
    """One engine: optional prefill-only call, then the whole generation; seconds of each.

    A calibrating engine writes its ``files`` once every request has finished (the request
    count trigger, from its idle thread); the engine is stopped only after they are written,
    since a write left to shutdown can be cut short when vLLM kills the worker."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = engine_kwargs(model, max_model_len=max_len, max_num_seqs=8, max_num_batched_tokens=8192,
                       enable_prefix_caching=False, kv_cache_memory_bytes=4 << 30)
    if topth is not None:
        if topth.get("mode") == "calibrate":
            topth = {**topth, "calibrate_requests": len(ids)}
        kw["additional_config"] = {"topth": topth}
    llm = LLM(**kw)
    t_start = time.time()
    ps = [TokensPrompt(prompt_token_ids=p) for p in ids]
    res = {}
    if prefill_call:
        t = time.perf_counter()
        generate_together(llm, ps, SamplingParams(temperature=0.0, max_tokens=1))
        res["prefill_s"] = time.perf_counter() - t
    t = time.perf_counter()
    outs = generate_together(llm, ps, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    res["whole_s"] = time.perf_counter() - t
    res["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    if prefill_call:
        res["decode_s"] = res["whole_s"] - res["prefill_s"]
    deadline = time.time() + WRITE_WAIT_S
    while files and not all(os.path.exists(f) and os.path.getmtime(f) >= t_start for f in files):
        if time.time() > deadline:
            print(f"warning: the calibration files {list(files)} were not written within {WRITE_WAIT_S} s", flush=True)
            break
        time.sleep(1.0)
    llm.llm_engine.engine_core.shutdown()
    del llm
    return res


def compare(engine_files: dict, offline: dict) -> dict:
    """Per (placement, selection, set): finite thresholds of both files compared."""
    import torch

    from topth_ops.thresholds import load_threshold_sets

    out = {}
    for key, path in engine_files.items():
        for i, (e, o) in enumerate(zip(load_threshold_sets(path), offline[key])):
            fin = torch.isfinite(e.thresholds) & torch.isfinite(o.thresholds)
            d = (e.thresholds - o.thresholds)[fin].abs()
            both = torch.isfinite(e.thresholds) == torch.isfinite(o.thresholds)
            span = (o.thresholds[fin].max() - o.thresholds[fin].min()).item()
            out[f"{key[0]}/{key[1]}/set{i}(k={e.k})"] = {
                "same_dense_entries": bool(both.all()), "counts_equal": bool(torch.equal(e.counts, o.counts)),
                "max_abs_diff": d.max().item(), "median_abs_diff": d.median().item(),
                "identical_within_1e-5": (d <= 1e-5).float().mean().item(), "value_span": span}
    return out


def offline_sets(model: str, ids: list, ks: list, placements: list, selections: list, second=None,
                 vmc: bool = True) -> dict:
    import torch

    from topth_ops.hf.calibrate import CalibrationText, calibrate
    from topth_ops.hf.cli_common import DEFAULT_LAYER_K
    from topth_ops.hf.model import load_model
    from topth_ops.thresholds import parse_layer_k

    lm = load_model(model, progress=False)
    L = int(lm.config.num_hidden_layers)
    targets = [list(second.layer_k)] if second is not None else [parse_layer_k(DEFAULT_LAYER_K, k, L) for k in ks]
    text = CalibrationText([torch.tensor(p) for p in ids], "the engine's prompts")
    sets = calibrate(lm.model, text, targets, placements, sdc_table=False, model_name=lm.name, progress=False,
                     selections=selections, second_round=second, layerwise_vmc=vmc)
    return {(p, s): [sets[(i, p, s)] for i in range(len(ks))] for p in placements for s in selections}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--min-tokens", type=int, default=4000)
    ap.add_argument("--max-tokens", type=int, default=8000)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--held-out", type=int, default=8)
    ap.add_argument("--k", default="32,128")
    ap.add_argument("--placement", default="both")
    ap.add_argument("--selection", default="both")
    ap.add_argument("--out", required=True, help="threshold files of the calibrating run ({placement}, {selection})")
    ap.add_argument("--compare", type=int, default=0, help="prompts of the engine-vs-offline comparison (0: skip)")
    ap.add_argument("--skip", nargs="*", default=[], choices=("vllm", "calibrate_decode", "calibrate"))
    ap.add_argument("--second-round", metavar="FILE", default=None,
                    help="calibrating engines run a second round serving this file (its --threshold-set)")
    ap.add_argument("--threshold-set", type=int, default=None)
    ap.add_argument("--vmc", action="store_true", help="with --second-round: serve it with VMC")
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    second = None
    if a.second_round:
        from topth_ops.thresholds import load_thresholds

        second = load_thresholds(a.second_round, a.threshold_set)
        a.k, a.placement, a.selection = str(second.k), second.placement, second.selection
    from .machine import machine

    ids = prompts(a.model, a.prompts, a.min_tokens, a.max_tokens, a.held_out)
    max_len = max(len(p) for p in ids) + a.new_tokens + 16
    base = {"calibrate_k": a.k, "calibrate_placement": a.placement, "calibrate_selection": a.selection,
            "metrics": False, "log_interval": 0}
    if second is not None:
        base = {"thresholds": os.path.abspath(a.second_round), "threshold_set": a.threshold_set, "vmc": a.vmc,
                "metrics": False, "log_interval": 0}  # k, layer-k map, placement, selection: the set's
    res = {"machine": vars(machine()), "prompts": len(ids), "prompt_tokens": [len(p) for p in ids],
           "new_tokens": a.new_tokens, "k": a.k, "date": time.strftime("%Y-%m-%d"),
           "second_round": None if second is None else {"file": a.second_round, "set": a.threshold_set,
                                                         "vmc": a.vmc, "summary": second.summary()}}
    tmp = tempfile.mkdtemp(prefix="topth-calibrate-bench-")
    pl = ["pre_softmax", "post_softmax"] if a.placement == "both" else [a.placement]
    se = ["head", "group"] if a.selection == "both" else [a.selection]

    def paths(template: str) -> dict:
        return {(p, s): template.replace("{placement}", p).replace("{selection}", s) for p in pl for s in se}

    for name, topth, pre in (("vllm", None, True),
                             ("calibrate_decode", {**base, "mode": "calibrate", "calibrate_prefill": False,
                                                   "calibrate_out": os.path.join(tmp, "dec_{placement}_{selection}.safetensors"),
                                                   "stats_file": os.path.join(tmp, "dec.json")}, False),
                             ("calibrate", {**base, "mode": "calibrate", "calibrate_out": a.out,
                                            "stats_file": os.path.join(tmp, "calib.json")}, False)):
        if name in a.skip:
            continue
        r = run(a.model, ids, a.new_tokens, topth, pre, max_len,
                list(paths(topth["calibrate_out"]).values()) if topth else [])
        res[name] = {k: v for k, v in r.items() if k != "tokens"}
        res.setdefault("tokens", r["tokens"])
        res[name]["greedy_equal_to_first_run"] = r["tokens"] == res["tokens"]
        report = os.path.join(tmp, {"calibrate": "calib.json", "calibrate_decode": "dec.json"}.get(name, "-"))
        if os.path.exists(report):
            res[name]["worker"] = json.load(open(report)).get("calibration")
        print(name, json.dumps(res[name]), flush=True)
        save_json(a.json, {k: v for k, v in res.items() if k != "tokens"})
    for name in ("calibrate_decode", "calibrate"):
        if "vllm" in res and name in res:
            r, v = res[name], res["vllm"]
            r["serving_time_ratio"] = r["whole_s"] / v["whole_s"]
            rec = (r.get("worker") or {}).get("record_seconds", {})
            # recording time of each kind of row over vLLM's time for that phase (same requests)
            r["record_over_vllm_decode"] = rec.get("decode", 0.0) / v["decode_s"]
            r["record_over_vllm_prefill"] = rec.get("prefill", 0.0) / v["prefill_s"]
    if a.compare:
        sub = ids[: a.compare]
        out = os.path.join(tmp, "cmp_{placement}_{selection}.safetensors")
        files = paths(out)
        run(a.model, sub, 1, {**base, "mode": "calibrate", "calibrate_out": out}, False, max_len, list(files.values()))
        ks = [int(k) for k in a.k.split(",")]  # (a second round: its set's map, not re-parsed)
        off = offline_sets(a.model, sub, ks, pl, se, second, a.vmc)
        res["engine_vs_offline"] = compare(files, off)
        print(json.dumps(res["engine_vs_offline"], indent=1), flush=True)
        if second is not None:  # how far the round moved from the set it served (the scale of the agreement)
            res["engine_vs_served"] = compare(files, {(pl[0], se[0]): [second]})
    res.pop("tokens", None)
    save_json(a.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
