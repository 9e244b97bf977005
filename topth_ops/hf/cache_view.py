"""How the "topth" attention function reads the KV cache transformers hands it: which keys
each query row may attend (row ids and valid keys, from the attention mask), the mask
function registered for "topth", and the checks of which models and caches the
integration supports.

Row ids come from the mask, never from the shape of the cache. transformers builds the
mask from the cache's own positions (``Cache.get_query_offset`` / ``get_mask_sizes``), so
this is right for every cache class whose keys arrive in position order: a dynamic cache
(keys = the tokens seen so far), a static cache (keys = its whole capacity, the slots past
the current position empty), offloaded and quantized caches (the dequantized keys). For
SDPA, transformers drops the mask when SDPA's ``is_causal`` flag gives the same result,
among others for the prefill of an empty static cache, where the key length is the cache
capacity and SDPA aligns the causal mask to the upper left; :func:`topth_mask` therefore
always materializes the mask, and a call without one (a caller outside transformers'
model code) follows SDPA's convention for a missing mask (:func:`rows_from_mask`).

The V mean of each sequence's valid rows (VMC) is :func:`topth_ops.vmean.valid_value_mean`;
the decode path uses it only to (re)build the running sums of :mod:`topth_ops.hf.vmean`.
"""

from __future__ import annotations

from typing import Optional

import torch


def topth_mask(*args, **kwargs):
    """transformers' boolean SDPA mask (``masking_utils.sdpa_mask``), always materialized
    (``allow_is_causal_skip=False``): the "topth" attention function reads the row id and
    the valid keys of every query row from it.

    Returns
    -------
    torch.Tensor
        ``[B, 1, T, S]`` bool (True = the key may be attended).
    """
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def rows_from_mask(mask: Optional[torch.Tensor], B: int, T: int, S: int,
                   dev) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Row id and valid keys of each of T query rows against S keys.

    Parameters
    ----------
    mask : torch.Tensor or None
        ``[B or 1, 1, T, S' >= S]`` bool (True = valid) or additive float (valid where
        above half the dtype's minimum); the last S key columns are used. None: SDPA's
        convention for a missing mask, ``is_causal`` for T > 1 (row i attends keys 0..i,
        aligned to the upper left as in ``torch.nn.functional.scaled_dot_product_attention``
        and transformers' prefill of an empty static cache) and every key for T = 1.
    B, T, S : int
        Batch, query rows, keys.
    dev : torch.device

    Returns
    -------
    row_ids : torch.Tensor
        ``[B, T]`` int64: n, the number of valid keys of each row.
    key_valid : torch.Tensor or None
        ``[B, T, S]`` bool, or None when every row's valid keys are the prefix 0..n-1.

    Raises
    ------
    ValueError
        A mask that is not 4-D.
    """
    if mask is None:
        n = torch.arange(1, T + 1, device=dev, dtype=torch.int64) if T > 1 else torch.full(
            (1,), S, device=dev, dtype=torch.int64)
        return n.unsqueeze(0).expand(B, T), None
    if mask.dim() != 4:
        raise ValueError(f"topth attention expects a 4D attention mask [B, 1, T, S], got shape {list(mask.shape)}")
    m = mask[:, 0, :, -S:]
    valid = m if m.dtype == torch.bool else (m > torch.finfo(m.dtype).min / 2)
    if m.shape[-1] == S and bool(valid.all()):  # every key valid for every row: a decode step of a dynamic cache
        return torch.full((B, T), S, device=dev, dtype=torch.int64), None
    valid = valid.expand(B, T, S)
    n = valid.sum(-1).to(torch.int64)
    prefix = torch.arange(S, device=dev).view(1, 1, S) < n.unsqueeze(-1)
    if bool((prefix == valid).all()):
        return n, None
    return n, valid


def sdpa_can_skip_mask(row_ids: torch.Tensor, key_valid: Optional[torch.Tensor], S: int) -> bool:
    """Whether SDPA without a mask (its convention, see :func:`rows_from_mask`) attends
    exactly the keys given by ``row_ids`` / ``key_valid``: then the dense path drops the
    mask, as transformers does for SDPA, so that the causal kernel (about 2x faster on long
    prefills) runs.

    Parameters
    ----------
    row_ids : torch.Tensor
        ``[B, T]`` int64 from :func:`rows_from_mask`.
    key_valid : torch.Tensor or None
    S : int
        Number of keys.
    """
    if key_valid is not None:
        return False
    T = row_ids.shape[1]
    if T == 1:
        return bool((row_ids == S).all())
    return bool((row_ids == torch.arange(1, T + 1, device=row_ids.device)).all())


def check_supported(model) -> None:
    """Refuse, before anything runs, a model whose attention the integration would get wrong.

    Supported: causal decoders whose attention layers are full attention or sliding-window
    attention (transformers' layer types "full_attention" / "sliding_attention"; a sliding
    layer's row id is the number of keys its row attends, min(n, window), read from the
    mask like every row id), without attention-logit soft-capping, with any cache class
    that hands the attention function the keys and values of the attended positions
    (dynamic, static, offloaded, quantized; sliding layers: their window).

    Raises
    ------
    ValueError
        Chunked or other attention layers besides full and sliding-window ones, logit
        soft-capping (``attn_logit_softcapping``: the op thresholds the plain logits), a
        bidirectional (``is_causal=False``) config, or a generation config that asks for
        the paged cache of continuous batching (which runs its own attention functions).
    """
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    if getattr(cfg, "is_causal", True) is False:
        raise ValueError("topth attention is causal decode attention; this model's config has is_causal=False")
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        layer_types, _ = get_layer_types_and_kwargs(cfg)
    except (ImportError, AttributeError, TypeError):  # other transformers versions
        layer_types = list(getattr(cfg, "layer_types", None) or [])
        if getattr(cfg, "sliding_window", None) is not None and not layer_types:
            layer_types = ["sliding_attention"]
    ok = ("full_attention", "sliding_attention")
    other = sorted({t for t in layer_types if t not in ok})
    if other:
        idx = [i for i, t in enumerate(layer_types) if t not in ok]
        raise ValueError(
            f"topth attention supports full-attention and sliding-window layers only; {type(model).__name__} has "
            f"layer types {other} at layers {idx[:8]}{' ...' if len(idx) > 8 else ''} (chunked attention changes "
            "which keys a row sees in a way the row id does not describe)")
    if getattr(cfg, "attn_logit_softcapping", None):
        raise ValueError(f"topth attention does not support attention-logit soft-capping "
                         f"(attn_logit_softcapping={cfg.attn_logit_softcapping}): the op thresholds plain logits")
    gen = getattr(model, "generation_config", None)
    if getattr(gen, "cache_implementation", None) == "paged":
        raise ValueError(
            "topth attention does not support cache_implementation='paged' (continuous batching swaps in its own "
            "attention functions); use the dynamic or static cache")
