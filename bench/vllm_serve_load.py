"""Concurrent requests through vLLM's OpenAI-compatible server (started with
``topth-ops serve``), in three configurations: vLLM's own CPU attention, the Top-Theta
backend in dense mode, and Top-Theta with a threshold file. Checks every response (no
error, full length, finite logprobs: no NaN) and reports tokens/s. Traffic goes to
127.0.0.1 only; the request count is bounded and each server is stopped afterwards.

Usage::

    python bench/vllm_serve_load.py --model out/smol-hf --thresholds out/th_k16_post.safetensors \
        --requests 32 --json out/vllm_serve_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time

PORT = 8765


def long_text() -> str:
    """Real text for long prompts: Python standard-library sources (installed locally)."""
    import argparse as a
    import inspect
    import json.decoder as jd
    import textwrap as t
    import typing as ty

    return "\n".join(inspect.getsource(m) for m in (a, ty, t, jd))


def make_prompts(model: str, n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids, max_tokens) pairs of mixed lengths: a quarter of them
    with prompts past 1024 tokens (1100-1800), the rest 32-900; 24-64 new tokens each."""
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    ids = tok(long_text())["input_ids"]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        plen = rng.randint(1100, 1800) if i % 4 == 0 else rng.randint(32, 900)
        start = rng.randint(0, len(ids) - plen - 1)
        out.append((ids[start:start + plen], rng.choice([24, 32, 48, 64])))
    return out


def start_server(model: str, mode: str, thresholds, vmc: bool, stats: str, log: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "topth_ops", "serve", model, "--port", str(port)]
    if mode == "topth":
        cmd += ["--thresholds", thresholds, "--stats", stats, "--log-interval", "5"] + (["--vmc"] if vmc else [])
    elif mode == "dense":
        cmd += ["--mode", "dense", "--stats", stats, "--log-interval", "5"]
    else:
        cmd += ["--mode", "vllm"]
    cmd += ["--", "--max-num-seqs", "32"]
    env = dict(os.environ)
    if mode == "vllm-mp":  # vLLM's attention with the Prometheus multi-process directory the other two get
        env["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="topth-bench-prometheus-")
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True, env=env)


async def wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> float:
    import aiohttp

    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as s:
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with status {proc.returncode} before it was ready")
            try:
                async with s.get(f"http://127.0.0.1:{port}/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(2)
    raise TimeoutError(f"server not ready after {timeout} s")


async def send_all(port: int, model: str, prompts, timeout: float) -> dict:
    import aiohttp

    async def one(s, ids, max_tokens):
        body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "logprobs": 1}
        async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                          timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            data = await r.json()
            return r.status, data

    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as s:
        results = await asyncio.gather(*(one(s, ids, mt) for ids, mt in prompts), return_exceptions=True)
    wall = time.perf_counter() - t0
    errors, nan, short, tokens = [], 0, 0, 0
    for i, r in enumerate(results):
        if isinstance(r, BaseException):
            errors.append(f"request {i}: {type(r).__name__}: {r}")
            continue
        status, data = r
        if status != 200 or "choices" not in data:
            errors.append(f"request {i}: HTTP {status}: {str(data)[:200]}")
            continue
        ch = data["choices"][0]
        lps = [x for x in (ch.get("logprobs") or {}).get("token_logprobs") or [] if x is not None]
        nan += sum(1 for x in lps if not math.isfinite(x))
        n = data["usage"]["completion_tokens"]
        tokens += n
        short += n != prompts[i][1]
    return {"requests": len(prompts), "errors": errors, "nonfinite_logprobs": nan, "short_completions": short,
            "completion_tokens": tokens, "prompt_tokens": sum(len(p) for p, _ in prompts), "wall_s": wall,
            "tokens_per_s": tokens / wall if wall else None}


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def run_config(args, mode: str, prompts, wd: str) -> dict:
    stats, log = os.path.join(wd, f"stats_{mode}.json"), os.path.join(wd, f"server_{mode}.log")
    proc = start_server(args.model, mode, args.thresholds, not args.no_vmc, stats, log, args.port)
    try:
        ready = asyncio.run(wait_ready(args.port, proc, args.start_timeout))
        res = asyncio.run(send_all(args.port, args.model, prompts, args.request_timeout))
        res["ready_s"] = ready
        time.sleep(args.settle)  # let the statistics report be rewritten
    finally:
        stop(proc)
    if os.path.exists(stats):
        rep = json.load(open(stats))
        res["stats"] = {k: rep.get(k) for k in ("decode_steps", "decode_tokens", "prefill_tokens_dense",
                                                  "v_rows_read", "v_rows_dense", "v_rows_fraction",
                                                  "v_rows_read_per_decode_step")}
    res["log_tail"] = open(log).read().splitlines()[-5:]
    return res


def summarize(rounds: list, configs: list) -> dict:
    """Per configuration: median tokens/s over the rounds and its ratio to vLLM's."""
    import statistics

    out = {}
    for c in configs:
        tps = [r[c]["tokens_per_s"] for r in rounds if c in r]
        out[c] = {"rounds": len(tps), "tokens_per_s": tps, "tokens_per_s_median": statistics.median(tps)}
    if "vllm" in out:
        for c in configs:
            out[c]["vs_vllm"] = out[c]["tokens_per_s_median"] / out["vllm"]["tokens_per_s_median"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--thresholds", help="threshold file for the topth configuration")
    ap.add_argument("--no-vmc", action="store_true")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--configs", default="vllm,dense,topth",
                    help="comma-separated from vllm, vllm-mp (vLLM's attention with the PROMETHEUS_MULTIPROC_DIR "
                         "that `topth-ops serve` sets for the other two), dense, topth")
    ap.add_argument("--port", type=int, default=PORT)
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--request-timeout", type=float, default=3600)
    ap.add_argument("--settle", type=float, default=7)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the configurations in turn this many times, every other round in reverse "
                         "order; the summary gives medians (default 1)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - {"vllm", "vllm-mp", "dense", "topth"})
    if unknown:
        ap.error(f"--configs: unknown {unknown}; choose from vllm, vllm-mp, dense, topth")
    if "topth" in configs and not args.thresholds:
        ap.error("the topth configuration needs --thresholds")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    from topth_ops.bench.machine import machine
    from topth_ops.bench.vllm_serving import read_probe_gbps

    mach, probe = machine(), read_probe_gbps()
    print(f"machine: {mach.model}; flags {' '.join(mach.flags)}; {mach.cores} cores; LLC {mach.llc_bytes >> 20} MiB; "
          f"read probe (1 thread) {probe:.1f} GB/s", flush=True)
    prompts = make_prompts(args.model, args.requests)
    out = {"date": time.strftime("%Y-%m-%d"), "machine": vars(mach), "read_probe_gbps_1thread": probe,
           "requests": args.requests, "prompt_lengths": [len(p) for p, _ in prompts],
           "max_tokens": [m for _, m in prompts], "load_avg_start": os.getloadavg(), "configs": {}}
    out["rounds"] = []
    with tempfile.TemporaryDirectory() as wd:
        for rnd in range(args.rounds):
            order = configs if rnd % 2 == 0 else configs[::-1]
            this = {}
            for c in order:
                r = run_config(args, c, prompts, wd)
                this[c] = r
                out["configs"][c] = r  # the last round's full result per configuration
                print(f"round {rnd} {c}: {r['requests']} requests, errors {len(r['errors'])}, non-finite logprobs "
                      f"{r['nonfinite_logprobs']}, {r['completion_tokens']} tokens in {r['wall_s']:.1f} s = "
                      f"{r['tokens_per_s']:.2f} tokens/s" + (f"; V rows {r['stats']['v_rows_fraction']:.3f} of dense"
                                                             if r.get("stats") else ""), flush=True)
            out["rounds"].append({c: {"wall_s": this[c]["wall_s"], "tokens_per_s": this[c]["tokens_per_s"],
                                      "completion_tokens": this[c]["completion_tokens"],
                                      "errors": len(this[c]["errors"]),
                                      "nonfinite_logprobs": this[c]["nonfinite_logprobs"]} for c in order})
    out["summary"] = summarize(out["rounds"], configs)
    for c, row in out["summary"].items():
        print(f"{c}: median {row['tokens_per_s_median']:.2f} tokens/s over {row['rounds']} round(s)"
              + (f", {row['vs_vllm']:.3f}x of vllm" if row.get("vs_vllm") else ""), flush=True)
    out["load_avg_end"] = os.getloadavg()
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    bad = any(r["errors"] or r["nonfinite_logprobs"] for rnd in out["rounds"] for r in rnd.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
