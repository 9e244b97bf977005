"""Benchmark cases as data: shape, dtype, placement and the requested kept fraction.

A case set is a plain list of :class:`Case`; add a set by adding an entry to
:data:`CASE_SETS`. Cases say nothing about backends: the harness crosses every case
with every backend variant (see :mod:`topth_ops.bench.harness`). The sets:

``quick``
    seconds on a 2-core CPU; checks the harness (CI runs it), times mean nothing;
``h200``
    the CUDA targets (bench/gpu_check.sh);
``npu``
    the Ascend targets (bench/npu_check.sh): GQA 32 q / 8 kv heads, head_dim
    128, seq_len 32768, batch 1 and 8, f from 0.05 to 1, fp16 and one bf16 case;
Each set has paged twins (block sizes 16 and 128) of some of its cases, named
``...-paged16`` / ``...-paged128``.

``bytes``
    small shapes for the Ascend C CPU model (backend ``ascendc-cpu``): exact GM -> UB
    bytes against f, in seconds on a CPU.
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
    block_size : int
        0: contiguous BNSD caches; else paged caches of this block size (blocks shuffled
        in the pool, see :func:`topth_ops.paged.to_paged`).
    kv_layout : str
        Paged layout, "NHD" or "HND" (with ``block_size`` only).
    cluster : int
        0: the kept rows are spread uniformly at random; else they come in runs of
        ``cluster`` consecutive positions (aligned to multiples of ``cluster``), as when
        attention concentrates on a few passages.
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
    block_size: int = 0
    kv_layout: str = "NHD"
    cluster: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def as_dict(self) -> dict:
        return asdict(self)


def _paged(cases, block_sizes=(16, 128), kv_layout="NHD"):
    """Paged twins of ``cases`` (one per block size), named ``<name>-paged<bs>``."""
    return [Case(**dict(c.as_dict(), name=f"{c.name}-paged{bs}", block_size=bs, kv_layout=kv_layout))
            for c in cases for bs in block_sizes]


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
QUICK += _paged(QUICK[:1] + QUICK[-1:])

# The H200 targets: bf16, GQA 32 q / 8 kv heads, head_dim 128, seq_len 32768,
# batch 8. pre_softmax swept over the kept fraction f = 0.05 ... 1 (1: every row kept, the
# thresholded kernel's own overhead), post_softmax at the two target fractions, and the
# kept rows clustered in runs of 64 (tile-aligned: whole tiles without a kept row) besides
# uniformly scattered.
H200_TARGET = dict(batch=8, seq_len=32768, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="bf16")
H200 = _sweep("h200", (0.1, 0.3), **H200_TARGET) + _sweep(
    "h200", (0.05, 0.2, 0.5, 1.0), placements=("pre_softmax",), **H200_TARGET) + [
    Case(name="h200-pre-f0.1-clustered", kept_frac=0.1, cluster=64, **H200_TARGET),
    Case(name="h200-post-f0.1-clustered", kept_frac=0.1, cluster=64, placement="post_softmax", **H200_TARGET),
    # one long sequence: split-KV must still fill the GPU
    Case(name="h200-b1-s131072-pre-f0.1", batch=1, seq_len=131072, num_q_heads=32, num_kv_heads=8,
         head_dim=128, kept_frac=0.1, dtype="bf16"),
    # small head_dim, ragged batch (SmolLM2-like GQA 9/3, head_dim 64)
    Case(name="h200-d64-ragged-pre-f0.1", batch=16, seq_len=16384, num_q_heads=9, num_kv_heads=3,
         head_dim=64, kept_frac=0.1, dtype="bf16", ragged=True),
]
# paged twins of the target (block sizes 16 and 128, vLLM's NHD layout)
H200 += _paged([c for c in H200 if c.name in ("h200-pre-f0.1", "h200-post-f0.1")])

# The Ascend targets: >= 1.5x over dense IncrementalFlashAttention at f = 0.1,
# 32k context (GQA 32 q / 8 kv heads, head_dim 128, fp16). Traffic bound 2 / (1 + f).
NPU_TARGET = dict(seq_len=32768, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="fp16")
NPU = _sweep("npu-b1", (0.05, 0.1, 0.2, 0.5, 1.0), batch=1, **NPU_TARGET) + _sweep(
    "npu-b8", (0.1, 0.5, 1.0), placements=("pre_softmax",), batch=8, **NPU_TARGET) + _sweep(
    "npu-b8", (0.1,), placements=("post_softmax",), batch=8, **NPU_TARGET) + _sweep(
    "npu-b1-bf16", (0.1,), placements=("pre_softmax",), batch=1, **dict(NPU_TARGET, dtype="bf16"))
# paged twins in page attention's HND layout, block sizes 16 and 128
NPU += _paged([c for c in NPU if c.name in ("npu-b1-pre-f0.1", "npu-b1-pre-f1")], kv_layout="HND")

# GM -> UB bytes on the Ascend C CPU model (seconds on a CPU): V bytes against f on a
# Llama-like GQA shape, its post_softmax twin (score round trip through the workspace), an
# odd row size (head_dim 72 fp16 = 144-byte rows, not a whole number of 32-byte blocks)
# with ragged lengths, MHA in bf16 and a wide fp32 group.
BYTES_SHAPE = dict(batch=1, seq_len=4096, num_q_heads=8, num_kv_heads=2, head_dim=128, dtype="fp16")
BYTES = _sweep("bytes-gqa4-d128", (0.05, 0.1, 0.2, 0.5, 1.0), placements=("pre_softmax",), **BYTES_SHAPE) + _sweep(
    "bytes-gqa4-d128", (0.1,), placements=("post_softmax",), **BYTES_SHAPE) + [
    Case(name="bytes-d72-ragged-post-f0.2", batch=2, seq_len=600, num_q_heads=6, num_kv_heads=3, head_dim=72,
         kept_frac=0.2, dtype="fp16", placement="post_softmax", ragged=True),
    Case(name="bytes-mha-d64-bf16-pre-f0.1", batch=2, seq_len=2048, num_q_heads=4, num_kv_heads=4, head_dim=64,
         kept_frac=0.1, dtype="bf16"),
    Case(name="bytes-gqa8-d256-fp32-pre-f0.1", batch=1, seq_len=2048, num_q_heads=16, num_kv_heads=2,
         head_dim=256, kept_frac=0.1, dtype="fp32"),
]

CASE_SETS: dict[str, list[Case]] = {"quick": QUICK, "h200": H200, "npu": NPU, "bytes": BYTES}
