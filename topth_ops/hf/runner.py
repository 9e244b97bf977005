"""Small model-running helpers shared by generate and evaluate: KV-cache steps,
teacher-forced log-likelihood, greedy decoding."""

from __future__ import annotations

import inspect
from typing import Optional

import torch


def new_cache(model):
    """An empty standard KV cache (DynamicCache) for ``model``."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers
        return DynamicCache()


def _cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward(model, ids: torch.Tensor, cache=None) -> torch.Tensor:
    """Run ``ids`` ``[B, T]`` (appending to ``cache`` when given); return float32 logits
    ``[B, T, vocab]``."""
    kw = {"use_cache": cache is not None}
    if cache is not None:
        kw[_cache_kwarg(model)] = cache
    with torch.inference_mode():
        out = model(input_ids=ids.to(next(model.parameters()).device), **kw)
    return out.logits.float()


def token_nll(model, ids: torch.Tensor, first_target: int = 1, chunk: int = 512) -> torch.Tensor:
    """Teacher-forced negative log-likelihood of each token ``ids[first_target:]`` after the
    tokens before it, in one forward pass of the decoder; the LM head runs on ``chunk``
    positions at a time, so a long document never materializes ``[T, vocab]`` logits
    (Gemma 3: 262k vocab).

    Parameters
    ----------
    model : transformers PreTrainedModel
        A causal LM with ``get_decoder()`` and ``get_output_embeddings()``; a
        ``config.final_logit_softcapping`` (Gemma 2 style, c * tanh(logits / c)) is applied
        as the model's own forward does.
    ids : torch.Tensor
        1-D int64 token ids, T >= 2.
    first_target : int
        Index of the first token scored, 1 <= first_target < T.
    chunk : int
        Positions per LM-head call, >= 1.

    Returns
    -------
    torch.Tensor
        float32 ``[T - first_target]`` (nats, CPU); entry i is the NLL of token
        ``first_target + i``, predicted by the row of ``first_target + i`` keys.

    Raises
    ------
    ValueError
        ``ids`` not 1-D, ``first_target`` outside [1, T - 1] or ``chunk`` < 1 (before the
        forward pass).
    """
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D token ids, got shape {tuple(ids.shape)}")
    T = int(ids.numel())
    if not 1 <= first_target < T:
        raise ValueError(f"first_target must lie in [1, {T - 1}] (len(ids) = {T}), got {first_target}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    cap = getattr(model.config, "final_logit_softcapping", None)
    dev = next(model.parameters()).device
    out = []
    with torch.inference_mode():
        hidden = model.get_decoder()(input_ids=ids.view(1, -1).to(dev), use_cache=False).last_hidden_state[0]
        head = model.get_output_embeddings()
        for r0 in range(first_target - 1, T - 1, chunk):
            r1 = min(T - 1, r0 + chunk)
            logits = head(hidden[r0:r1]).float()
            if cap:
                logits = cap * torch.tanh(logits / cap)
            lp = torch.log_softmax(logits, dim=-1)
            out.append(-lp.gather(1, ids[r0 + 1:r1 + 1].to(dev)[:, None])[:, 0].cpu())
    return torch.cat(out)


def greedy(model, prompt: list, max_new_tokens: int, *, eos_token_id: Optional[int] = None,
           forced: Optional[list] = None) -> tuple[list, list]:
    """Greedy decoding with a KV cache: one prefill, then one decode step per token.

    Parameters
    ----------
    prompt : list of int
    max_new_tokens : int
    eos_token_id : int, optional
        Stop after this token (free-running mode only).
    forced : list of int, optional
        Teacher forcing: feed these tokens instead of the model's own choices (the model's
        argmax at each step is still returned).

    Returns
    -------
    (chosen, fed) : (list of int, list of int)
        The model's argmax at each of the steps, and the tokens fed back.
    """
    cache = new_cache(model)
    logits = forward(model, torch.tensor([prompt]), cache)
    chosen, fed = [], []
    steps = len(forced) if forced is not None else max_new_tokens
    for i in range(steps):
        tok = int(logits[0, -1].argmax())
        chosen.append(tok)
        nxt = forced[i] if forced is not None else tok
        fed.append(nxt)
        if i == steps - 1 or (forced is None and eos_token_id is not None and tok == eos_token_id):
            break
        logits = forward(model, torch.tensor([[nxt]]), cache)
    return chosen, fed
