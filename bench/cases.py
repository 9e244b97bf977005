"""Benchmark cases as data: shape, dtype, placement and the requested kept fraction.

A case set is a plain list of :class:`Case`; add a set by adding an entry to
:data:`CASE_SETS`. Cases say nothing about backends: the harness crosses every case
with every backend variant (see :mod:`topth_ops.bench.harness`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Case:
    """One benchmark case.

    Attributes
    ----------
    name : str
        Short unique label (used in CSV rows and plots).
    batch, seq_len, num_q_heads, num_kv_heads, head_dim : int
        Shapes; every sequence of the batch has ``seq_len`` valid positions unless
        ``ragged`` (then lengths are spread over [seq_len / 2, seq_len]).
    kept_frac : float
        Requested fraction f of the valid V rows kept per KV group (the union over the
        group's query heads); 1.0 means the threshold keeps everything.
    dtype : str
        "fp16", "bf16" or "fp32".
    placement : str
        "pre_softmax" or "post_softmax".
    ragged : bool
        Mixed sequence lengths in the batch.
    """

    name: str
    batch: int
    seq_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    kept_frac: float
    dtype: str = "bf16"
    placement: str = "pre_softmax"
    ragged: bool = False

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def as_dict(self) -> dict:
        return asdict(self)


def _sweep(prefix, fracs, placements=("pre_softmax", "post_softmax"), **shape):
    out = []
    for placement in placements:
        for f in fracs:
            tag = "pre" if placement == "pre_softmax" else "post"
            out.append(Case(name=f"{prefix}-{tag}-f{f:g}", kept_frac=f, placement=placement, **shape))
    return out


# Seconds on a 2-core CPU (torch reference; the Triton interpreter if enabled). Timings on
# the CPU say nothing about GPU/NPU kernels: these cases test the harness itself.
QUICK = _sweep("quick", (0.1, 0.3), batch=2, seq_len=192, num_q_heads=8, num_kv_heads=2,
               head_dim=64, dtype="fp32") + [
    Case(name="quick-ragged-pre-f0.2", batch=3, seq_len=160, num_q_heads=4, num_kv_heads=1,
         head_dim=80, kept_frac=0.2, dtype="fp16", ragged=True),
]

# The H200 targets of issue 4: bf16, GQA 32 q / 8 kv heads, head_dim 128, seq_len 32768, batch 8.
H200_TARGET = dict(batch=8, seq_len=32768, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="bf16")
H200 = _sweep("h200", (0.1, 0.3), **H200_TARGET) + _sweep(
    "h200", (0.05, 0.2, 0.5), placements=("pre_softmax",), **H200_TARGET) + [
    # one long sequence: split-KV must still fill the GPU
    Case(name="h200-b1-s131072-pre-f0.1", batch=1, seq_len=131072, num_q_heads=32, num_kv_heads=8,
         head_dim=128, kept_frac=0.1, dtype="bf16"),
    # small head_dim, ragged batch (SmolLM2-like GQA 9/3, head_dim 64)
    Case(name="h200-d64-ragged-pre-f0.1", batch=16, seq_len=16384, num_q_heads=9, num_kv_heads=3,
         head_dim=64, kept_frac=0.1, dtype="bf16", ragged=True),
]

CASE_SETS: dict[str, list[Case]] = {"quick": QUICK, "h200": H200}
