"""Long-context serving through vLLM's offline engine: prefill time, decode tokens/s, V rows
read and greedy agreement, for vLLM's own attention and this project's backend, in one run.

Configurations (``--configs``, run one after another with the same engine settings, each
``--rounds`` times in turn):

- ``vllm``: vLLM's own attention (the plugin inactive);
- ``dense``: this backend in dense mode (on the CPU: vLLM's attention plus bookkeeping);
- ``topth``: this backend with ``--thresholds`` (and ``--vmc``), statistics and metrics on;
- ``topth_nometrics``: the same without any bookkeeping (metrics off, no statistics):
  the cost of the live metrics is ``topth`` over ``topth_nometrics``.

Workload: ``--prompts`` distinct prompts of ``--prompt-tokens`` tokens of standard-library
source (consecutive windows of the concatenated files), ``--new-tokens`` greedy tokens
each (``ignore_eos``), prefix caching off. Per configuration: the prefill time (all prompts,
``max_tokens=1``), then the full run on the same engine; decode tokens/s counts the tokens
that arrive after every request has its first one, over that window. Every run puts all
its prompts in the engine before the first step (:func:`vllm_common.generate_together`),
so each configuration runs the same steps and greedy agreement compares attention, not
request arrival timing. The ``topth`` run writes the backend's
statistics (V rows read over dense). Greedy agreement of each configuration's tokens with
``vllm``'s. Printed with the machine (CPU model, ISA flags, cores, vLLM's thread binding)
and a read-bandwidth probe (sum over a 1 GiB tensor, one thread: the core vLLM's worker
gets on a 2-core machine).

Usage (workload (a) of docs/vllm.md)::

    python -m topth_ops.bench.vllm_serving --model out/smol-hf --thresholds th.safetensors --vmc \\
        --prompts 8 --prompt-tokens 6000 --new-tokens 128 --json out/serving.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from . import vllm_common as vc
from .machine import machine

CONFIGS = ("vllm", "dense", "topth", "topth_nometrics")


def stdlib_prompts(model_dir: str, n: int, length: int) -> list[list[int]]:
    """``n`` distinct prompts of ``length`` tokens: consecutive windows of the standard
    library's sources (files in name order, concatenated)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids: list = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if f.name.startswith("_"):
            continue
        ids += tok(f.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False).input_ids
        if len(ids) >= n * length:
            break
    if len(ids) < n * length:
        raise ValueError(f"the standard library gives {len(ids)} tokens; {n} x {length} asked")
    return [ids[i * length:(i + 1) * length] for i in range(n)]


def engine_settings(args) -> dict:
    """The engine keyword arguments of the long-context workloads (``args``: ``dtype``,
    ``max_model_len``, ``kv_cache_gib``, ``prompts``, ``prompt_tokens``): prefix caching
    off, every prompt in one batch."""
    return dict(dtype=args.dtype, max_model_len=args.max_model_len,
                kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)), max_num_seqs=max(8, args.prompts),
                max_num_batched_tokens=max(8192, args.prompt_tokens), enable_prefix_caching=False)


def read_probe_gbps(reps: int = 5) -> float:
    """One-thread read bandwidth: median over ``reps`` sums of a 1 GiB float32 tensor."""
    t = torch.ones((1 << 30) // 4)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            t.sum()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old)
    return (1 << 30) / statistics.median(times) / 1e9


def run_config(name: str, model: str, ids: list, new_tokens: int, topth, engine: dict) -> dict:
    """One engine: prefill timed (max_tokens=1), then the full run."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = vc.engine_kwargs(model, **engine)
    if topth is not None:
        kw["additional_config"] = {"topth": topth}
    t0 = time.perf_counter()
    llm = LLM(**kw)
    load_s = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]
    vc.generate_together(llm, prompts[:1], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    t0 = time.perf_counter()
    vc.generate_together(llm, prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    prefill_s = time.perf_counter() - t0
    tokens, top, decode_tokens, decode_s = _decode_run(llm, prompts, new_tokens)
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort; the engine also stops when collected
        pass
    del llm
    return {"config": name, "load_s": load_s, "prefill_s": prefill_s, "decode_tokens": decode_tokens,
            "decode_s": decode_s, "decode_tok_s": decode_tokens / max(decode_s, 1e-9), "tokens": tokens, "top": top}


def _decode_run(llm, prompts, new_tokens: int):
    """The full run through the engine's step loop: tokens that arrive after every request
    has its first token are decode tokens, timed over that window."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=2)
    count: dict = {}
    win = {"start": None, "tokens": 0}

    def on_step(outs, now):
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if win["start"] is not None:
                win["tokens"] += n - count.get(o.request_id, 0)
            count[o.request_id] = n
        if win["start"] is None and len(count) == len(prompts) and all(count.values()):
            win["start"] = now

    outs = vc.generate_together(llm, prompts, sp, on_step)
    decode_s = time.perf_counter() - win["start"]
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return tokens, [vc.top_two(o) for o in outs], win["tokens"], decode_s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="model folder (e.g. from `topth-ops export-hf`)")
    ap.add_argument("--thresholds", help="threshold file (configuration topth)")
    ap.add_argument("--vmc", action="store_true", help="V-mean compensation in configuration topth")
    ap.add_argument("--threshold-set", type=int, default=None, help="the set of a file holding several")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=6000)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1, help="run the configurations in turn this many times")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--kv-cache-gib", type=float, default=6.0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs:
        ap.error(f"--configs: unknown {bad}; choose from {CONFIGS}")
    if len(set(configs)) != len(configs):
        ap.error(f"--configs: each configuration at most once (got {configs}); use --rounds to repeat")
    if any(c.startswith("topth") for c in configs) and not args.thresholds:
        ap.error("--thresholds is required by configurations topth*")
    if args.prompt_tokens + args.new_tokens > args.max_model_len:
        ap.error(f"--prompt-tokens + --new-tokens must be <= --max-model-len ({args.max_model_len})")

    mach = machine()
    probe = read_probe_gbps()
    ids = stdlib_prompts(args.model, args.prompts, args.prompt_tokens)
    engine = engine_settings(args)
    work = tempfile.mkdtemp(prefix="topth_serving_")
    runs = []
    for r in range(args.rounds):
        for name in configs:
            topth = None
            if name == "dense":
                topth = {"mode": "dense", "log_interval": 0}
            elif name.startswith("topth"):
                topth = {"thresholds": os.path.abspath(args.thresholds), "vmc": args.vmc, "log_interval": 0,
                         "threshold_set": args.threshold_set}
                if name == "topth":
                    topth["stats_file"] = os.path.join(work, f"stats_{r}.json")
                else:
                    topth["metrics"] = False
            res = run_config(name, args.model, ids, args.new_tokens, topth, engine)
            res["round"] = r
            if name == "topth":
                st = json.loads(Path(topth["stats_file"]).read_text())
                res["v_rows_fraction"] = st.get("v_rows_fraction")
            runs.append(res)
            print(f"round {r} {name:6s} prefill {res['prefill_s']:7.2f} s  decode {res['decode_tok_s']:7.2f} tok/s"
                  + (f"  V rows read {res['v_rows_fraction']:.3f}" if "v_rows_fraction" in res else ""), flush=True)
    summary = {}
    base = [x for x in runs if x["config"] == "vllm"]
    for name in configs:
        mine = [x for x in runs if x["config"] == name]
        row = {"prefill_s": statistics.median(x["prefill_s"] for x in mine),
               "decode_tok_s": statistics.median(x["decode_tok_s"] for x in mine)}
        if base:
            row["prefill_ratio_vs_vllm"] = statistics.median(b["prefill_s"] for b in base) / row["prefill_s"]
            row["decode_ratio_vs_vllm"] = row["decode_tok_s"] / statistics.median(b["decode_tok_s"] for b in base)
            cmp = vc.compare_tokens(base[0]["tokens"], mine[0]["tokens"], base[0]["top"], mine[0]["top"])
            row["greedy_vs_vllm"] = cmp
        if name == "topth":
            row["v_rows_fraction"] = statistics.median(x["v_rows_fraction"] for x in mine)
        summary[name] = row
    print(f"machine: {mach.model}; flags {' '.join(mach.flags)}; {mach.cores} cores; LLC {mach.llc_bytes >> 20} MiB; "
          f"VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND', 'auto')}; "
          f"read probe (1 thread) {probe:.1f} GB/s")
    print(f"workload: {args.prompts} x {args.prompt_tokens} prompt tokens + {args.new_tokens} new, {args.dtype}")
    for name, row in summary.items():
        extra = "".join(f"  {k} {v:.3f}" for k, v in row.items() if isinstance(v, float) and k not in (
            "prefill_s", "decode_tok_s"))
        g = row.get("greedy_vs_vllm")
        if g:
            extra += f"  greedy identical to vllm {g['identical']}/{g['prompts']} (prefix {g['prefix_agreement']:.3f})"
        print(f"{name:6s} prefill {row['prefill_s']:7.2f} s  decode {row['decode_tok_s']:7.2f} tok/s{extra}")
    if args.json:
        vc.save_json(args.json, {
            "date": time.strftime("%Y-%m-%d"), "machine": vars(mach), "read_probe_gbps_1thread": probe,
            "vllm_cpu_omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
            "args": vars(args), "summary": summary,
            "runs": [{k: v for k, v in x.items() if k not in ("tokens", "top")} for x in runs]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
