"""Greedy tokens and logprobs of vLLM's offline engine as a function of request arrival.

vLLM's engine core (a separate process) starts scheduling when the first request reaches it,
so how a batch of prompts is cut into chunked-prefill steps can depend on when each request
arrives, and with it the last bits of every result. This study runs one engine per process
on the same prompts, adding the requests either as ``LLM.generate`` does (``--add plain``)
or with the scheduler paused while adding (``--add paused``, what the benches do:
:func:`bench.vllm_common.generate_together`), optionally with ``--stagger`` seconds between
requests, and writes every step's two best tokens and logprobs. ``--compare A B`` prints
the greedy agreement of two outputs and the first step where any logprob differs.

Usage (docs/vllm.md, "Greedy agreement and request arrival")::

    python -m topth_ops.bench.studies.arrival_order --model out/smol-hf --config vllm --add plain --out a.json
    python -m topth_ops.bench.studies.arrival_order --model out/smol-hf --config vllm --add plain \\
        --stagger 0.3 --out b.json
    python -m topth_ops.bench.studies.arrival_order --compare a.json b.json
"""

from __future__ import annotations

import argparse
import json
import time

from .. import vllm_common as vc
from ..vllm_serving import stdlib_prompts


def run(args) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.llm_engine import LLMEngine

    ids = stdlib_prompts(args.model, args.prompts, args.prompt_tokens)
    kw = vc.engine_kwargs(args.model, dtype="bfloat16", max_model_len=args.prompt_tokens + args.new_tokens + 16,
                          max_num_seqs=max(8, args.prompts), max_num_batched_tokens=args.batched_tokens,
                          enable_prefix_caching=False, kv_cache_memory_bytes=2 << 30)
    if args.config == "dense":
        kw["additional_config"] = {"topth": {"mode": "dense", "log_interval": 0}}
    if args.stagger > 0:  # every request reaches the engine core args.stagger s after the previous one
        add = LLMEngine.add_request

        def slow_add(self, *a, **k):
            r = add(self, *a, **k)
            time.sleep(args.stagger)
            return r

        LLMEngine.add_request = slow_add
    llm = LLM(**kw)
    sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True, logprobs=2)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]
    if args.add == "paused":
        outs = vc.generate_together(llm, prompts, sp)
    else:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    return {"args": vars(args), "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "top": [[[(int(t), float(v.logprob)) for t, v in sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:2]]
                     for lp in o.outputs[0].logprobs] for o in outs]}


def compare(a: dict, b: dict) -> dict:
    """Greedy agreement (:func:`bench.vllm_common.compare_tokens`) and, per prompt, the
    first step whose two best (token, logprob) pairs differ at all (None: none)."""
    first = [next((s for s, (x, y) in enumerate(zip(ta, tb)) if x != y), None) for ta, tb in zip(a["top"], b["top"])]
    cmp = vc.compare_tokens(a["tokens"], b["tokens"], a["top"], b["top"])
    return {"identical": cmp["identical"], "prompts": cmp["prompts"], "first_logprob_difference": first}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two outputs of this study")
    ap.add_argument("--model", help="model folder (e.g. from `topth-ops export-hf`)")
    ap.add_argument("--config", choices=("vllm", "dense"), default="vllm",
                    help="vLLM's attention, or this backend in dense mode")
    ap.add_argument("--add", choices=("plain", "paused"), default="plain")
    ap.add_argument("--stagger", type=float, default=0.0, help="seconds between requests (plain or paused)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--batched-tokens", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--out", help="write the tokens and logprobs here (JSON)")
    args = ap.parse_args(argv)
    if args.compare:
        a, b = (json.load(open(f)) for f in args.compare)
        print(json.dumps(compare(a, b)))
        return 0
    if not args.model or not args.out:
        ap.error("--model and --out are required unless --compare is given")
    if args.stagger < 0 or args.prompts < 1 or args.prompt_tokens < 1 or args.new_tokens < 1:
        ap.error("--stagger must be >= 0; --prompts, --prompt-tokens and --new-tokens >= 1")
    res = run(args)
    vc.save_json(args.out, res)
    print(f"{args.config} add={args.add} stagger={args.stagger}: written {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
