"""The KV-cache layouts of the cold-cache benchmark (bench/cpu_cold.py), built from BNSD
tensors, and the K bytes of each as a plain read sees them.

``layer_caches`` builds one layer in a layout (BNSD; paged ``NHD<bs>``/``HND<bs>`` through
:func:`topth_ops.paged.to_paged`, blocks in random order; ``vllm<bs>``: vLLM CPU_ATTN's own
cache filled by its own writer); ``k_regions`` views a K cache's bytes as float32 for the
benchmark's ``K read`` row (docs/cpu.md, "Cold caches, per layout").
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from topth_ops.paged import to_paged

from .cpu import vllm_paged_cache


def layer_caches(layout: str, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, gen: torch.Generator):
    """One layer's caches in a benchmark layout, built from BNSD tensors.

    Parameters
    ----------
    layout : str
        ``"BNSD"``, ``"NHD<bs>"``, ``"HND<bs>"`` (paged, :func:`topth_ops.paged.to_paged`,
        blocks in random order) or ``"vllm<bs>"`` (vLLM CPU_ATTN's own cache, module doc).
    k, v : torch.Tensor
        ``[batch, kv_heads, seq, head_dim]`` (BNSD), float16, bfloat16 or float32.
    lens : torch.Tensor
        ``[batch]`` integer seq_lens.
    gen : torch.Generator
        For the random block order.

    Returns
    -------
    key_cache, value_cache : torch.Tensor
        As ``topth_ops.decode_attention`` takes them (BNSD: ``k`` and ``v`` themselves).
    kwargs : dict
        ``block_table`` and ``kv_layout`` for the paged layouts, empty for BNSD.

    Raises
    ------
    ValueError
        ``layout`` carries no block size (``int`` of its digits), or ``to_paged`` refuses it.
    """
    if layout == "BNSD":
        return k, v, {}
    bs = int(re.sub(r"\D", "", layout))
    if layout.startswith("vllm"):
        return _vllm_cache(k, v, lens, bs, gen)
    kc, vc, table = to_paged(k, v, lens, bs, kv_layout=layout[:3], generator=gen)
    return kc, vc, {"block_table": table, "kv_layout": layout[:3]}


def _vllm_cache(k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, bs: int, gen: torch.Generator):
    """vLLM's own cache of one layer, filled by vLLM's writer, as the op reads it (module doc)."""
    B, S = k.shape[0], k.shape[2]
    nb = B * -(-S // bs)
    table = torch.randperm(nb, generator=gen).to(torch.int32).view(B, nb // B)
    try:
        kc, vc, isa = vllm_paged_cache(k, v, table, bs)
    except ImportError:  # the same layouts, packed here: AMX for bfloat16, else K transposed per block
        if k.dtype == torch.bfloat16:
            kc, vc, table = to_paged(k, v, lens, bs, kv_layout="VLLM_AMX", generator=gen)
            return kc, vc, {"block_table": table, "kv_layout": "VLLM_AMX"}
        kc, vc, table = to_paged(k, v, lens, bs, kv_layout="HND", generator=gen)
        return kc.transpose(2, 3).contiguous().transpose(2, 3), vc, {"block_table": table, "kv_layout": "HND"}
    if isa == "amx":
        return kc, vc, {"block_table": table, "kv_layout": "VLLM_AMX"}
    s = kc.stride()  # vector ISA: K region [head_dim, block_size]
    return kc.as_strided(kc.shape, (s[0], s[1], 1, bs)), vc, {"block_table": table, "kv_layout": "HND"}


def k_regions(kc: torch.Tensor) -> Optional[torch.Tensor]:
    """The bytes of a K cache as float32 (for a plain read), or None for an unknown layout.

    Parameters
    ----------
    kc : torch.Tensor
        A K cache as the op takes it: contiguous (BNSD, paged NHD or HND), or 4-D
        ``[blocks, kv_heads, a, b]`` whose last two dimensions span one contiguous region of
        ``a * b`` elements per block and head (vLLM's K transposed per block, strides
        ``(slot 1, dim block_size)``, or its AMX-packed regions); float16, bfloat16 or float32.

    Returns
    -------
    torch.Tensor or None
        float32 over the same storage: flat for a contiguous cache (a paged pool: every block
        it holds), ``[blocks, kv_heads, region]`` otherwise (the V regions between are not part
        of it); None when the cache is neither, its regions overlap, or they do not split into
        whole float32 words.
    """
    es = kc.element_size()
    f = 4 // es if es in (2, 4) else 0
    if not f or kc.dim() != 4:
        return None
    n, h, a, b = kc.shape
    s = kc.stride()
    if kc.is_contiguous():
        counts, size, stride = (kc.numel(),), (kc.numel() // f,), (1,)
    elif (s[2], s[3]) in ((b, 1), (1, a)):
        span = a * b  # the regions must not overlap: each outer stride past the span below it
        for st, size in sorted((st, size) for st, size in ((s[0], n), (s[1], h)) if size > 1):
            if st < span:
                return None
            span = st * size
        counts, size, stride = (a * b, s[0], s[1]), (n, h, a * b // f), (s[0] // f, s[1] // f, 1)
    else:
        return None
    if any(x % f for x in (*counts, kc.storage_offset())):
        return None
    return torch.empty(0, dtype=torch.float32).set_(kc.untyped_storage(), kc.storage_offset() // f, size, stride)
