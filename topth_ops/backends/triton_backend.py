"""Backend ``triton``: the split-KV Triton kernels of ``topth_ops.cuda_kernels`` on CUDA.

With ``TRITON_INTERPRET=1`` (set before Triton is first imported) the same kernels run in
Triton's CPU interpreter on CPU tensors; that is how CI runs them (float16 / float32;
the interpreter cannot compute bfloat16 dot products). Nothing here imports Triton at
module level: ``import topth_ops`` works without it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Optional

import torch

from ..contract import DecodeInputs, DecodeStats, _dtype
from ..registry import Backend

HEAD_DIMS = (64, 80, 96, 128, 256)


def interpreter_enabled() -> bool:
    """Whether Triton runs kernels in its CPU interpreter: ``TRITON_INTERPRET`` read now and
    parsed as Triton 3.6 parses boolean knobs (``1``, ``true``, ``on``, ``yes``, any case)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")


class TritonBackend(Backend):
    name = "triton"
    device_type = "cuda"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    head_dims = HEAD_DIMS

    @property
    def description(self) -> str:
        text = "Triton split-KV kernels (GQA group per program, V-row skipping), CUDA"
        if interpreter_enabled():
            text += "; TRITON_INTERPRET=1: CPU tensors in Triton's interpreter, float16/float32 only"
        return text

    def unavailable_reasons(self) -> list[str]:
        if importlib.util.find_spec("triton") is None:
            return ["triton is not installed (pip install 'topth-ops[triton]')"]
        if interpreter_enabled():
            mod = sys.modules.get("topth_ops.cuda_kernels.decode_attn")
            if mod is not None and type(mod._decode_attn_kernel).__name__ != "InterpretedFunction":
                return ["TRITON_INTERPRET=1 was set after topth_ops.cuda_kernels was imported "
                        "(set it before the first Triton call)"]
            return []
        if not torch.cuda.is_available():
            return ["no CUDA device (set TRITON_INTERPRET=1 to run the kernels on CPU tensors "
                    "in the Triton interpreter)"]
        return []

    def devices(self) -> list[torch.device]:
        if self.unavailable_reasons():
            return []
        if interpreter_enabled():
            return [torch.device("cpu")]
        return [torch.device("cuda")]

    def not_supported_reasons(self, inputs: DecodeInputs) -> list[str]:
        reasons = list(self.unavailable_reasons())
        interp = interpreter_enabled()
        dev = inputs.device.type
        if interp:
            if dev != "cpu":
                reasons.append(f"needs cpu tensors under TRITON_INTERPRET=1, got {dev}")
        elif dev != "cuda":
            reasons.append(f"needs cuda tensors (or TRITON_INTERPRET=1 with cpu tensors), got {dev}")
        if inputs.dtype not in self.dtypes:
            names = ", ".join(_dtype(d) for d in self.dtypes)
            reasons.append(f"dtype {_dtype(inputs.dtype)} not supported (supports {names})")
        elif interp and inputs.dtype == torch.bfloat16:
            reasons.append("dtype bfloat16 not supported under TRITON_INTERPRET=1 "
                           "(the interpreter cannot compute bfloat16 tl.dot)")
        if inputs.head_dim not in self.head_dims:
            reasons.append(f"head_dim {inputs.head_dim} not supported (supports {list(self.head_dims)})")
        reasons.extend(self.feature_reasons(inputs))
        if not reasons:
            reasons.extend(self.input_reasons(inputs))
        return reasons

    def forward(self, inputs: DecodeInputs, out: torch.Tensor, stats: Optional[DecodeStats]) -> None:
        from ..cuda_kernels import decode_attn_fwd

        st = None
        if stats is not None:
            st = tuple(t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
                       for t in stats)
        decode_attn_fwd(
            inputs.query, inputs.key_cache, inputs.value_cache, inputs.seq_lens, inputs.thresholds,
            out, scale=inputs.scale, placement=inputs.placement, sdc=inputs.sdc,
            sdc_gamma=inputs.sdc_gamma, sdc_table=inputs.sdc_table, vmc=inputs.vmc,
            value_mean=inputs.value_mean, stats=st,
        )
        if stats is not None:
            for dst, src in zip(stats, st):
                if dst is not src:
                    dst.copy_(src)


BACKENDS = [TritonBackend()]
