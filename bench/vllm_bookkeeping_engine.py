"""Cost of the vLLM backend's live bookkeeping inside one engine: the same decode steps of
the same requests, with metrics and statistics switched on and off in alternating blocks.

Engines started one after another cannot resolve a 2% difference on a machine whose
memory bandwidth drifts by 10-40% between minutes (docs/vllm.md, "Bookkeeping cost"). This
bench runs one in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with the
``topth`` configuration of ``bench/vllm_serving.py`` (metrics on, the JSON report written
by the statistics thread), prefills every request, then times each decode step and
switches the worker's runtime between its "on" state and the state of a ``metrics=False``
engine without a JSON report (no op statistics, no per-layer records, no report) every ``--block-steps``
steps, in the order on, off, off, on, ... so that a drift or the growth of the rows over
the run hits both alike. Decode tokens/s per state = the tokens of its steps over their
time.

Usage::

    python -m topth_ops.bench.vllm_bookkeeping_engine --model out/smol-hf \\
        --thresholds th.safetensors --vmc --json out/bookkeeping_engine.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time


def _toggle(runtime_mod):
    """The worker's runtime and a function setting it to metrics on (True) or off."""
    rts = list(runtime_mod._RUNTIMES.values())
    if len(rts) != 1:
        raise RuntimeError(f"expected one Top-Theta runtime in this process, found {len(rts)}")
    rt = rts[0]
    if not rt.settings.metrics or rt.stats is None:
        raise RuntimeError("the engine must start with metrics and statistics on")
    on = (rt.settings, rt.stats)
    off = (dataclasses.replace(rt.settings, metrics=False), None)

    def set_state(metrics_on: bool) -> None:
        rt.settings, rt.stats = on if metrics_on else off

    return rt, set_state


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="model folder (e.g. from `topth-ops export-hf`)")
    ap.add_argument("--thresholds", required=True)
    ap.add_argument("--vmc", action="store_true")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--block-steps", type=int, default=8, help="decode steps per block of one state")
    ap.add_argument("--metrics-every", type=int, default=None,
                    help="the backend's metrics_every (default: the backend's default)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-gib", type=float, default=4.0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.prompt_tokens + args.new_tokens > args.max_model_len:
        ap.error(f"--prompt-tokens + --new-tokens must be <= --max-model-len ({args.max_model_len})")
    if args.block_steps < 1:
        ap.error(f"--block-steps must be >= 1, got {args.block_steps}")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process: its runtime is reachable

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from topth_ops.vllm import runtime as runtime_mod

    from . import vllm_common as vc
    from .machine import machine
    from .vllm_serving import engine_settings, read_probe_gbps, stdlib_prompts

    mach, probe = machine(), read_probe_gbps()
    ids = stdlib_prompts(args.model, args.prompts, args.prompt_tokens)
    work = tempfile.mkdtemp(prefix="topth_bookkeeping_")
    topth = {"thresholds": os.path.abspath(args.thresholds), "vmc": args.vmc, "log_interval": 0,
             "stats_file": os.path.join(work, "stats.json")}
    if args.metrics_every is not None:
        topth["metrics_every"] = args.metrics_every
    llm = LLM(**vc.engine_kwargs(args.model, **engine_settings(args), additional_config={"topth": topth}))
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    for i, p in enumerate(ids):
        eng.add_request(str(i), TokensPrompt(prompt_token_ids=p), sp)
    count = {str(i): 0 for i in range(len(ids))}

    def step() -> int:
        new = 0
        for o in eng.step():
            n = len(o.outputs[0].token_ids)
            new += n - count[o.request_id]
            count[o.request_id] = n
        return new

    while eng.has_unfinished_requests() and not all(count.values()):
        step()  # prefill: every request gets its first token
    rt, set_state = _toggle(runtime_mod)
    pattern = (True, False, False, True)
    blocks = {True: [], False: []}  # (tokens, seconds) per block
    b = 0
    while eng.has_unfinished_requests():
        state = pattern[b % 4]
        set_state(state)
        tokens, t0 = 0, time.perf_counter()
        for _ in range(args.block_steps):
            if not eng.has_unfinished_requests():
                break
            tokens += step()
        dt = time.perf_counter() - t0
        if tokens == len(ids) * args.block_steps:  # full blocks only: the last may be short
            blocks[state].append((tokens, dt))
        b += 1
    set_state(True)
    st = rt.stats.report()
    eng.engine_core.shutdown()

    def rate(bl):
        return sum(t for t, _ in bl) / sum(s for _, s in bl)

    on, off = rate(blocks[True]), rate(blocks[False])
    pairs = [a[0] / a[1] / (c[0] / c[1]) for a, c in zip(blocks[True], blocks[False])]
    out = {"date": time.strftime("%Y-%m-%d"), "machine": vars(mach), "read_probe_gbps_1thread": probe,
           "workload": {"prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                        "dtype": args.dtype, "thresholds": os.path.basename(args.thresholds), "vmc": args.vmc},
           "metrics_every": rt.settings.metrics_every, "block_steps": args.block_steps, "blocks_on": len(blocks[True]), "blocks_off": len(blocks[False]),
           "decode_tok_s_metrics_on": on, "decode_tok_s_metrics_off": off, "on_over_off": on / off,
           "block_ratio_median": statistics.median(pairs) if pairs else None,
           "block_ratios": pairs, "blocks": {"on": blocks[True], "off": blocks[False]},
           "v_rows_fraction": st.get("v_rows_fraction"), "decode_steps_recorded": st.get("decode_steps")}
    print(f"metrics_every {rt.settings.metrics_every}: decode tokens/s: metrics on {on:.2f}, off {off:.2f}: on = {on / off:.4f}x of off "
          f"({len(blocks[True])} + {len(blocks[False])} blocks of {args.block_steps} steps; median of the "
          f"paired blocks {out['block_ratio_median']:.4f}); V rows read {st.get('v_rows_fraction') or 0:.3f} of dense",
          flush=True)
    if args.json:
        vc.save_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
