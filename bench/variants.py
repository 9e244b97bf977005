"""What the benchmark runs on a case: the thresholded op of a registered backend
(:class:`BackendVariant`) and the dense baselines (our Triton dense mode, torch SDPA,
FlashInfer with and without tensor cores, flash-attn, torch_npu's
IncrementalFlashAttention). A variant's ``prepare`` returns a function that runs it once
and one that returns its last output; ``reasons`` says why it cannot run a case.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from topth_ops.contract import DecodeStats

from .synth import CaseInputs

class Variant:
    """Something to run on a case. ``prepare`` returns a zero-argument function that runs
    it once and a function returning its last output ``[B, Hq, D]``."""

    name = ""
    kind = "dense"

    def reasons(self, ci: CaseInputs) -> list[str]:
        return []

    def prepare(self, ci: CaseInputs) -> tuple[Callable[[], None], Callable[[], torch.Tensor]]:
        raise NotImplementedError

    def counters(self) -> dict:
        """Counters of the last run (e.g. bytes moved); empty when the variant has none."""
        return {}

    def last_stats(self) -> Optional[DecodeStats]:
        """Statistics of the last run, for thresholded variants that return them."""
        return None


class BackendVariant(Variant):
    """The thresholded op of a registered backend, called through ``Backend.forward``
    (the direct path, no custom-op dispatch)."""

    kind = "topth"

    def __init__(self, backend_name: str):
        from topth_ops.registry import get_backend

        self.backend = get_backend(backend_name)
        self.name = backend_name

    def reasons(self, ci):
        return self.backend.not_supported_reasons(ci.inputs)

    def prepare(self, ci):
        inputs = ci.inputs
        out, stats = inputs.empty_outputs(fill=float("nan"))
        self._stats = stats
        return (lambda: self.backend.forward(inputs, out, stats)), (lambda: out)

    def counters(self):
        fn = getattr(self.backend, "bench_counters", None)
        return dict(fn()) if fn is not None else {}

    def last_stats(self):
        return getattr(self, "_stats", None)


class TritonDenseVariant(Variant):
    """Dense mode of our Triton kernel (no threshold): the in-house baseline."""

    name = "triton-dense"

    def reasons(self, ci):
        from topth_ops.registry import get_backend

        return get_backend("triton").not_supported_reasons(ci.dense)

    def prepare(self, ci):
        from topth_ops.backends.triton.launch import decode_attn_fwd

        d = ci.dense
        out = torch.empty_like(d.query)
        fn = lambda: decode_attn_fwd(d.query, d.key_cache, d.value_cache, d.seq_lens, None, out,  # noqa: E731
                                     scale=d.scale, dense=True)
        return fn, (lambda: out)


class SdpaVariant(Variant):
    """torch.nn.functional.scaled_dot_product_attention over the caches (GQA via
    enable_gqa); ragged batches use a boolean mask over max_seq_len."""

    name = "sdpa"

    def prepare(self, ci):
        d = ci.dense
        q = d.query.unsqueeze(2)  # [B, Hq, 1, D]
        ragged = ci.case.ragged or int(d.seq_lens.min()) != d.max_seq_len
        mask = None
        if ragged:
            pos = torch.arange(d.max_seq_len, device=d.device)
            mask = (pos[None, :] < d.seq_lens[:, None].long())[:, None, None, :]
        holder = {}

        def fn():
            holder["out"] = torch.nn.functional.scaled_dot_product_attention(
                q, d.key_cache, d.value_cache, attn_mask=mask, scale=d.scale, enable_gqa=True)

        return fn, (lambda: holder["out"][:, :, 0])


class FlashInferVariant(Variant):
    """FlashInfer batch decode (paged wrapper; the BNSD cache is an HND paged cache with one
    page of max_seq_len rows per sequence, no copy), CUDA-core decode kernel."""

    name = "flashinfer"
    use_tensor_cores = False

    def reasons(self, ci):
        try:
            import flashinfer  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure means "not here"
            return [f"flashinfer not importable ({type(e).__name__})"]
        return [] if ci.dense.device.type == "cuda" else ["needs cuda"]

    def prepare(self, ci):
        import flashinfer

        d = ci.dense
        B, Hq, D = d.query.shape
        dev = d.device
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="HND",
                                                          use_tensor_cores=self.use_tensor_cores)
        indptr = torch.arange(B + 1, dtype=torch.int32, device=dev)
        indices = torch.arange(B, dtype=torch.int32, device=dev)
        w.plan(indptr, indices, d.seq_lens.to(torch.int32), Hq, d.num_kv_heads, D, d.max_seq_len,
               q_data_type=d.dtype, kv_data_type=d.dtype, sm_scale=d.scale)
        holder = {}

        def fn():
            holder["out"] = w.run(d.query, (d.key_cache, d.value_cache))

        return fn, (lambda: holder["out"])


class FlashInferTCVariant(FlashInferVariant):
    """FlashInfer batch decode with ``use_tensor_cores=True`` (its prefill-style kernel,
    faster for large GQA groups)."""

    name = "flashinfer-tc"
    use_tensor_cores = True


class FlashAttnVariant(Variant):
    """flash-attn ``flash_attn_with_kvcache`` (BSHD copy of the caches made once, untimed)."""

    name = "flash-attn"

    def reasons(self, ci):
        try:
            import flash_attn  # noqa: F401
        except Exception as e:  # noqa: BLE001
            return [f"flash_attn not importable ({type(e).__name__})"]
        if ci.dense.device.type != "cuda":
            return ["needs cuda"]
        if ci.dense.dtype == torch.float32:
            return ["flash-attn has no float32 kernels"]
        return []

    def prepare(self, ci):
        from flash_attn import flash_attn_with_kvcache

        d = ci.dense
        k = d.key_cache.transpose(1, 2).contiguous()
        v = d.value_cache.transpose(1, 2).contiguous()
        q = d.query.unsqueeze(1)
        lens = d.seq_lens.to(torch.int32)
        holder = {}

        def fn():
            holder["out"] = flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, softmax_scale=d.scale)

        return fn, (lambda: holder["out"][:, 0])


class IfaVariant(Variant):
    """torch_npu ``npu_incre_flash_attention`` (Ascend's IncrementalFlashAttention) over the
    caches: BNSD, GQA, the case's scale and ``actual_seq_lengths``; the dense NPU baseline
    (the Ascend target is measured against it)."""

    name = "npu-ifa"

    def reasons(self, ci):
        d = ci.dense
        out = []
        try:
            import torch_npu  # noqa: F401
        except Exception as e:  # noqa: BLE001 - ImportError or a broken CANN install
            out.append(f"torch_npu not importable ({type(e).__name__})")
        if d.device.type != "npu":
            out.append("needs npu tensors")
        if d.dtype not in (torch.float16, torch.bfloat16):
            out.append("npu_incre_flash_attention takes float16 / bfloat16 only")
        return out

    def prepare(self, ci):
        import torch_npu

        d = ci.dense
        q = d.query.unsqueeze(2).contiguous()  # BNSD query [B, N, 1, D]
        lens = [int(x) for x in d.seq_lens.clamp(0, d.max_seq_len).cpu()]  # host list, read once
        holder = {}

        def fn():
            holder["out"] = torch_npu.npu_incre_flash_attention(
                q, d.key_cache, d.value_cache, num_heads=d.num_q_heads, num_key_value_heads=d.num_kv_heads,
                input_layout="BNSD", scale_value=d.scale, actual_seq_lengths=lens)

        return fn, (lambda: holder["out"][:, :, 0])


DENSE_VARIANTS = (TritonDenseVariant, IfaVariant, SdpaVariant, FlashInferVariant, FlashInferTCVariant,
                  FlashAttnVariant)
"""Dense baselines; the first one measured on a case is the reference for ``speedup_vs_dense``
(our Triton dense mode on CUDA, IFA on Ascend, else SDPA). ``speedup_vs_best_dense`` is
against the fastest of the others (:data:`OWN_DENSE` excluded): the dense kernel a user
would otherwise run."""

OWN_DENSE = ("triton-dense",)
"""Our own dense modes: reported, never the 'best dense' a target is measured against."""


def default_variants(backends: list[str]) -> list[Variant]:
    """Thresholded variants of ``backends`` plus every dense baseline."""
    return [BackendVariant(b) for b in backends] + [cls() for cls in DENSE_VARIANTS]
