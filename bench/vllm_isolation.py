"""Request isolation in vLLM's CPU engine: a request whose V rows hold a non-finite value
must not change the tokens of requests that later run on the blocks it used.

One engine (in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the attention layer can
be wrapped here) with a KV pool small enough that blocks are reused, the Top-Theta backend
with VMC (its per-block V sums in the loop): request A runs with NaN written into every V
row it stores (a stand-in for an fp16 overflow), then request B. A fresh engine then runs B
alone. B's tokens must be equal, and B must have been given blocks that A left NaN in.

Usage: ``python -m topth_ops.bench.vllm_isolation --model DIR --thresholds FILE --json OUT``
"""

from __future__ import annotations

import argparse
import os

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from . import vllm_common as vc  # noqa: E402


def _wrap_cache_writes(record: dict):
    """Wrap the backend's KV write: record the blocks each phase writes and, while
    ``record["poison"]``, write NaN into every V row."""
    from topth_ops.vllm.cpu_backend import TopthCpuImpl

    original = TopthCpuImpl.do_kv_cache_update

    def update(self, layer, key, value, kv_cache, slot_mapping):
        bs = int(kv_cache.shape[2])  # [num_blocks, num_kv_heads, block_size, 2 * head_size]
        record["block_size"] = bs
        slots = slot_mapping[slot_mapping >= 0]
        record.setdefault(record["phase"], set()).update((slots // bs).tolist())
        if record["poison"]:
            value = value.clone()
            value[:, :, :] = float("nan")
        return original(self, layer, key, value, kv_cache, slot_mapping)

    TopthCpuImpl.do_kv_cache_update = update


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--thresholds", required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--blocks", type=int, default=12, help="KV blocks in the pool (small: blocks are reused)")
    args = ap.parse_args(argv)

    ids = vc.tokenize(args.model, vc.humaneval_prompts(2))
    a, b = ids[0][:120], ids[1][:100]
    topth = {"thresholds": args.thresholds, "vmc": True}
    engine = dict(max_model_len=256, num_gpu_blocks_override=args.blocks, enable_prefix_caching=False)
    record = {"phase": "a", "poison": True}
    _wrap_cache_writes(record)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm = LLM(**vc.engine_kwargs(args.model, additional_config={"topth": topth}, **engine))
    out_a = llm.generate([TokensPrompt(prompt_token_ids=a)], sp, use_tqdm=False)[0].outputs[0].token_ids
    record.update(phase="b", poison=False)
    out_b = llm.generate([TokensPrompt(prompt_token_ids=b)], sp, use_tqdm=False)[0].outputs[0].token_ids
    llm.llm_engine.engine_core.shutdown()
    del llm
    record.update(phase="fresh")
    fresh = vc.run_llm(args.model, [b], args.max_tokens, topth=topth, logprobs=None, **engine)
    res = {
        "tokens_a": list(out_a), "tokens_b_after_a": list(out_b), "tokens_b_fresh": fresh["tokens"][0],
        "blocks_a": sorted(record.get("a", ())), "blocks_b": sorted(record.get("b", ())),
        "block_size": record.get("block_size"),
    }
    res["reused_blocks"] = sorted(set(res["blocks_a"]) & set(res["blocks_b"]))
    res["equal"] = res["tokens_b_after_a"] == res["tokens_b_fresh"]
    vc.save_json(args.json, res)
    print(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
