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
import math
import time
from pathlib import Path

from .. import vllm_common as vc
from ..vllm_serving import stdlib_prompts


def run(args) -> dict:
    """One engine on the study's prompts (``args`` as parsed by :func:`main`).

    Returns
    -------
    dict
        ``args``, ``tokens`` (per prompt) and ``top`` (per prompt and step: the two best
        ``(token, logprob)`` pairs).
    """
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
            "top": [vc.top_two(o) for o in outs]}


WORKLOAD_KEYS = ("model", "prompts", "prompt_tokens", "new_tokens", "batched_tokens")


def compare(a: dict, b: dict) -> dict:
    """Two outputs of this study compared.

    Parameters
    ----------
    a, b : dict
        Outputs of :func:`run` (``tokens``, ``top``) of the same workload.

    Returns
    -------
    dict
        ``identical`` and ``prompts`` (greedy agreement, :func:`bench.vllm_common.compare_tokens`)
        and ``first_logprob_difference``: per prompt, the first step whose two best
        ``(token, logprob)`` pairs differ at all (None: none).

    Raises
    ------
    ValueError
        The outputs are of different workloads or lack ``tokens`` / ``top``.
    """
    for name, x in (("A", a), ("B", b)):
        if not isinstance(x, dict) or "tokens" not in x or "top" not in x:
            raise ValueError(f"{name} is not an output of this study (no 'tokens' / 'top')")
    wa, wb = ({k: x.get("args", {}).get(k) for k in WORKLOAD_KEYS} for x in (a, b))
    if wa != wb or len(a["tokens"]) != len(b["tokens"]):
        raise ValueError(f"A and B ran different workloads: {wa} vs {wb}")
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
        try:
            a, b = (json.loads(Path(f).read_text()) for f in args.compare)
            print(json.dumps(compare(a, b)))
        except (OSError, ValueError) as e:
            ap.error(f"--compare: {e}")
        return 0
    if not args.model or not args.out:
        ap.error("--model and --out are required unless --compare is given")
    if not Path(args.model).is_dir():
        ap.error(f"--model: {args.model!r} is not a model folder")
    if not (math.isfinite(args.stagger) and args.stagger >= 0):
        ap.error(f"--stagger must be a finite number >= 0, got {args.stagger}")
    for name in ("prompts", "prompt_tokens", "new_tokens", "batched_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    res = run(args)
    vc.save_json(args.out, res)
    print(f"{args.config} add={args.add} stagger={args.stagger}: written {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
