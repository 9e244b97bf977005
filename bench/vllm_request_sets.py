"""Per-request sparsity and live metrics through vLLM's OpenAI-compatible server (started
with ``topth-ops serve``): the "done when" run of docs/vllm.md, "Per-request sparsity".

1. One server with a threshold file of several sets. ``--requests`` concurrent completions
   (greedy, ``ignore_eos``) of standard-library text, spread round-robin over the file's
   sets and dense (``vllm_xargs: {"topth": ...}``); ``/metrics`` is scraped while they run.
   Then every request again alone, with the same choice: its tokens must equal the
   concurrent run's. Per set, the V rows read over dense from the scraped metrics.
   A malformed choice and an unknown k are sent too: each must get HTTP 400.
2. With ``--guard-thresholds``: a server with that file on prompts of
   ``--guard-prompt-tokens`` (a file used far past its calibrated row ids): the server log
   must show the guardrail warning; and one on ``--guard-in-range-tokens`` (within them),
   where it must not. The first server's log (rows within its file's range) is searched
   for it too.

Usage::

    python -m topth_ops.bench.vllm_request_sets --model out/smol-hf --thresholds sets.safetensors \\
        --default-set 1 --guard-thresholds pre512.safetensors --json out/request_sets.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time

from .vllm_common import save_json
from .vllm_serve_load import long_text, stop, wait_ready

PORT = 8779
#: The guardrail's WARNING line (its "back inside" INFO line starts "topth guardrail: k~/k back").
WARNING_MARK = "topth guardrail: k~/k over"


def guardrail_warnings(log: str) -> list:
    """The guardrail WARNING lines of a server log."""
    with open(log) as f:
        return [ln.rstrip() for ln in f if WARNING_MARK in ln]


def prompts(model: str, n: int, lo: int, hi: int, max_tokens: int, seed: int = 1) -> list:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model, local_files_only=True)(long_text())["input_ids"]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        plen = rng.randint(lo, hi)
        s = rng.randint(0, len(ids) - plen - 1)
        out.append((ids[s:s + plen], max_tokens))
    return out


def serve(model: str, thresholds: str, default_set, log: str, port: int, band: str,
          vmc: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "topth_ops", "serve", model, "--thresholds", thresholds, "--port", str(port),
           "--log-interval", "5", "--guard-band", band] + (["--vmc"] if vmc else [])
    if default_set is not None:
        cmd += ["--threshold-set", str(default_set)]
    cmd += ["--", "--max-num-seqs", "32", "--max-model-len", "4096"]
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True, env=env)


async def complete(s, port: int, model: str, ids, max_tokens: int, choice):
    import aiohttp

    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if choice is not None:
        body["vllm_xargs"] = {"topth": choice}
    async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                      timeout=aiohttp.ClientTimeout(total=3600)) as r:
        data = await r.json()
        return r.status, data


def tokens_of(data: dict) -> list:
    return data["choices"][0].get("token_ids") or data["choices"][0]["text"]


async def scrape(s, port: int) -> str:
    async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
        return await r.text()


def topth_samples(text: str) -> dict:
    """{(name, frozenset(labels)): value} of the topth_* samples of one scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name.startswith("topth_"):
                out[(smp.name, frozenset(smp.labels.items()))] = smp.value
    return out


async def mixed_run(args, port: int, work: list, choices: list) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        stop_scraping = asyncio.Event()
        scrapes = []

        async def scraper():
            while not stop_scraping.is_set():
                try:
                    scrapes.append((time.time(), await scrape(s, port)))
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(args.scrape_every)

        t = asyncio.create_task(scraper())
        t0 = time.perf_counter()
        together = await asyncio.gather(*(complete(s, port, args.model, ids, mt, c)
                                          for (ids, mt), c in zip(work, choices)))
        wall = time.perf_counter() - t0
        stop_scraping.set()
        await t
        during = [x for x in scrapes if topth_samples(x[1])]
        await asyncio.sleep(args.settle)  # the worker flushes its last interval
        final = await scrape(s, port)
        alone = [await complete(s, port, args.model, ids, mt, c) for (ids, mt), c in zip(work, choices)]
        bad = [await complete(s, port, args.model, work[0][0][:64], 4, c) for c in ("set=x", "k=48")]
    return {"together": together, "alone": alone, "wall_s": wall, "scrape_during": during[-1] if during else None,
            "scrapes_during": len(during), "final": final, "bad": bad}


def per_set_fraction(samples: dict) -> dict:
    read, dense = {}, {}
    for (name, labels), v in samples.items():
        lab = dict(labels)
        if name == "topth_v_rows_read_total":
            read[lab["set"]] = read.get(lab["set"], 0) + v
        elif name == "topth_v_rows_dense_total":
            dense[lab["set"]] = dense.get(lab["set"], 0) + v
    return {k: read.get(k, 0) / d for k, d in dense.items() if d}


def guard_run(args, wd: str, name: str, spec: str, band: str) -> dict:
    """A server with ``--guard-thresholds`` on prompts of ``spec`` ("LOW,HIGH") tokens."""
    lo, hi = (int(x) for x in spec.split(","))
    work = prompts(args.model, args.guard_requests, lo, hi, args.max_tokens, seed=2)
    log = os.path.join(wd, f"server_guard_{name}_{band}.log")
    proc = serve(args.model, args.guard_thresholds, args.guard_set, log, args.port, band, args.vmc)
    try:
        asyncio.run(wait_ready(args.port, proc, 900))

        async def go():
            import aiohttp

            async with aiohttp.ClientSession() as s:
                res = await asyncio.gather(*(complete(s, args.port, args.model, ids, mt, None) for ids, mt in work))
                await asyncio.sleep(args.settle)
                return res, await scrape(s, args.port)

        res, text = asyncio.run(go())
    finally:
        stop(proc)
    samples = topth_samples(text)
    warnings = guardrail_warnings(log)
    return {"prompt_lengths": [len(p) for p, _ in work], "status": [r[0] for r in res],
            "warning_count": len(warnings), "warnings": warnings[:5],
            "out_of_band_series": sum(1 for (n, _), v in samples.items() if n == "topth_guardrail_out_of_band" and v == 1),
            "kept_over_k_series": sum(1 for (n, _), v in samples.items() if n == "topth_kept_over_k"),
            "kept_over_k_range": [round(f(v for (n, _), v in samples.items() if n == "topth_kept_over_k"), 3)
                                  for f in (min, max)] if any(n == "topth_kept_over_k" for n, _ in samples) else None}


def kept_range(samples: dict) -> dict:
    """Per set: [min, max] of the windowed k~/k gauges of one scrape."""
    vals: dict = {}
    for (name, labels), v in samples.items():
        if name == "topth_kept_over_k":
            vals.setdefault(dict(labels)["set"], []).append(v)
    return {k: [round(min(v), 3), round(max(v), 3)] for k, v in vals.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--thresholds", required=True, help="a file of several threshold sets")
    ap.add_argument("--default-set", type=int, default=None)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", default="300,1000", help="LOW,HIGH prompt lengths (within the file's rows)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--guard-thresholds", help="a file to use far past its calibrated row ids")
    ap.add_argument("--guard-set", type=int, default=None, help="set of --guard-thresholds to serve (several sets)")
    ap.add_argument("--guard-prompt-tokens", default="2000,2600", help="past the guard file's calibrated rows")
    ap.add_argument("--guard-in-range-tokens", default="300,500", help="within them ('' to skip)")
    ap.add_argument("--guard-bands", default="0.8,1.25",
                    help="guardrail bands to run the two guard servers with, ';'-separated (the first also serves step 1)")
    ap.add_argument("--guard-requests", type=int, default=8)
    ap.add_argument("--scrape-every", type=float, default=2.0)
    ap.add_argument("--settle", type=float, default=12.0)
    ap.add_argument("--port", type=int, default=PORT)
    ap.add_argument("--guard-only", action="store_true", help="skip step 1")
    ap.add_argument("--vmc", action="store_true", help="serve with V-mean compensation (serve --vmc)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from topth_ops.thresholds import load_threshold_sets

    sets = load_threshold_sets(args.thresholds)
    # vllm_xargs holds strings and numbers: an index, "k=K" (by k) and "dense"
    menu = [i if i % 2 == 0 else f"k={ts.k}" for i, ts in enumerate(sets)] + ["dense"]
    lo, hi = (int(x) for x in args.prompt_tokens.split(","))
    work = prompts(args.model, args.requests, lo, hi, args.max_tokens)
    choices = [menu[i % len(menu)] for i in range(args.requests)]
    from .machine import machine

    out: dict = {"requests": args.requests, "choices": choices, "prompt_lengths": [len(p) for p, _ in work],
                 "machine": vars(machine()), "thresholds": args.thresholds, "guard_thresholds": args.guard_thresholds,
                 "vmc": args.vmc}
    wd = tempfile.mkdtemp(prefix="topth_sets_")
    log = os.path.join(wd, "server.log")
    bands = [b.strip() for b in args.guard_bands.split(";") if b.strip()]
    out["guard_band_step1"] = bands[0]
    if not args.guard_only:
        proc = serve(args.model, args.thresholds, args.default_set, log, args.port, bands[0], args.vmc)
        try:
            out["ready_s"] = asyncio.run(wait_ready(args.port, proc, 900))
            r = asyncio.run(mixed_run(args, args.port, work, choices))
        finally:
            stop(proc)
        same = [a[0] == b[0] == 200 and tokens_of(a[1]) == tokens_of(b[1]) for a, b in zip(r["together"], r["alone"])]
        final = topth_samples(r["final"])
        out.update({
            "http_status": [a[0] for a in r["together"]], "same_as_alone": same, "wall_s": r["wall_s"],
            "completion_tokens": sum(a[1]["usage"]["completion_tokens"] for a in r["together"] if a[0] == 200),
            "bad_requests": [{"status": b[0], "message": str(b[1].get("error", b[1]))[:300]} for b in r["bad"]],
            "scrapes_with_topth_series_during_run": r["scrapes_during"],
            "scrape_during_run": sorted(ln for ln in (r["scrape_during"] or (0, ""))[1].splitlines()
                                        if ln.startswith("topth_") and not ln.endswith(" 0.0"))[:60],
            "v_rows_fraction_per_set": per_set_fraction(final),
            "kept_over_k_range_per_set": kept_range(final),
            "series_nonzero": sorted({n for (n, _), v in final.items() if v}),
            "guardrail_lines_in_range": guardrail_warnings(log),
            "server_log_topth": [ln.rstrip() for ln in open(log) if "topth" in ln][:20],
        })
        print(f"{args.requests} requests over {menu}: same tokens as alone {sum(same)}/{len(same)}; "
              f"bad requests -> {[b['status'] for b in out['bad_requests']]}; V rows per set "
              f"{ {k: round(v, 3) for k, v in out['v_rows_fraction_per_set'].items()} }; "
              f"guardrail warnings in range: {len(out['guardrail_lines_in_range'])}", flush=True)
    if args.guard_thresholds:
        out["guard"] = {}
        for band in bands:
            for name, spec in (("past_range", args.guard_prompt_tokens), ("in_range", args.guard_in_range_tokens)):
                if not spec:
                    continue
                g = guard_run(args, wd, name, spec, band)
                out["guard"][f"{name} band {band}"] = g
                print(f"guardrail band [{band}], {name} ({spec} prompt tokens): {g['warning_count']} warning "
                      f"line(s); {g['out_of_band_series']} cells out of band on /metrics; k~/k of the cells on "
                      f"/metrics {g['kept_over_k_range']}", flush=True)
    if args.json:
        save_json(args.json, out)
    if args.guard_only:
        return 0
    return 0 if all(out["same_as_alone"]) and all(b["status"] == 400 for b in out["bad_requests"]) else 1


if __name__ == "__main__":
    sys.exit(main())
