"""Backend ``triton``: the split-KV Triton kernels of ``topth_ops.cuda_kernels`` on CUDA.

With ``TRITON_INTERPRET=1`` (set before Triton is first imported) the same kernels run in
Triton's CPU interpreter on CPU tensors; that is how CI runs them (float16 / float32;
the interpreter cannot compute bfloat16 dot products). Nothing here imports Triton at
module level: ``import topth_ops`` works without it.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Optional

import torch

from ...codes import MAX_POSITIONS
from ...contract import DecodeInputs, DecodeStats
from ...env import interpreter_enabled
from ...registry import Backend
from ...validation import dtype_str

HEAD_DIMS = tuple(range(16, 257, 16))  # every multiple of 16 up to 256 (FlashAttention's set)


class TritonBackend(Backend):
    name = "triton"
    device_type = "cuda"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    head_dims = None  # checked in not_supported_reasons: HEAD_DIMS
    head_dims_note = "16..256, step 16"
    features = frozenset({"paged", "group_selection", "threshold_sets"})

    @property
    def description(self) -> str:
        text = ("Triton split-KV kernels (GQA group per program, V-row skipping; BNSD or paged NHD/HND, "
                "head or group selection, threshold sets), CUDA")
        if interpreter_enabled():
            text += "; TRITON_INTERPRET=1: CPU tensors in Triton's interpreter, float16/float32 only"
        return text

    def unavailable_reasons(self) -> list[str]:
        if importlib.util.find_spec("triton") is None:
            return ["triton is not installed (pip install 'topth-ops[triton]')"]
        if interpreter_enabled():
            mod = sys.modules.get("topth_ops.cuda_kernels.attn_pre")
            if mod is not None and type(mod.pre_kernel).__name__ != "InterpretedFunction":
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
            names = ", ".join(dtype_str(d) for d in self.dtypes)
            reasons.append(f"dtype {dtype_str(inputs.dtype)} not supported (supports {names})")
        elif interp and inputs.dtype == torch.bfloat16:
            reasons.append("dtype bfloat16 not supported under TRITON_INTERPRET=1 "
                           "(the interpreter cannot compute bfloat16 tl.dot)")
        if inputs.head_dim not in HEAD_DIMS:
            reasons.append(f"head_dim {inputs.head_dim} not supported (supports multiples of 16 up to 256)")
        if inputs.max_seq_len > MAX_POSITIONS:
            reasons.append(f"max_seq_len {inputs.max_seq_len} beyond the kernels' int32 positions ({MAX_POSITIONS})")
        reasons.extend(self.feature_reasons(inputs))
        if not reasons:
            reasons.extend(self.input_reasons(inputs))
        return reasons

    def forward(self, inputs: DecodeInputs, out: torch.Tensor, stats: Optional[DecodeStats]) -> None:
        """Launch the kernels; every tensor (small ones included) is read and written through
        its strides, unchecked values are clamped on the device (contract v0.2)."""
        from .launch import decode_attn_fwd

        decode_attn_fwd(
            inputs.query, inputs.key_cache, inputs.value_cache, inputs.seq_lens, inputs.thresholds,
            out, scale=inputs.scale, placement=inputs.placement, sdc=inputs.sdc,
            sdc_gamma=inputs.sdc_gamma, sdc_table=inputs.sdc_table, vmc=inputs.vmc,
            value_mean=inputs.value_mean, stats=None if stats is None else tuple(stats),
            block_table=inputs.block_table, kv_layout=inputs.kv_layout, selection=inputs.selection,
            threshold_set=inputs.threshold_set,
        )


BACKENDS = [TritonBackend()]
