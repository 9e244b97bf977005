"""Backends ``ascendc`` (the Ascend C kernel on an Ascend NPU) and ``ascendc-cpu`` (the same
kernel source compiled with g++ against the CPU model of the Ascend C API).

The kernel (``npu_kernels/kernel/topth_decode_attn.cpp``) is modelled on Ascend's
IncrementalFlashAttention: work split over batch x kv-heads across AI vector cores, and
over the KV sequence (flash-decoding, combined by log-sum-exp) when that is too little
work; K tiles double-buffered GM -> UB; V rows copied only when some head of the GQA group
keeps them. docs/ascendc.md describes the design, the build and what was verified where:
the ``ascendc`` backend has **not** run on Ascend hardware; CI verifies the kernel on the
CPU model (``ascendc-cpu``).

Neither module is imported by ``import topth_ops``: the compiled extensions
(``topth_ops.npu_kernels._ascendc_cpu`` / ``_ascendc_npu``) and torch_npu load inside
``unavailable_reasons`` / ``forward``.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from ..contract import DecodeInputs, DecodeStats
from ..registry import Backend

DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
PLACEMENT_CODES = {"pre_softmax": 0, "post_softmax": 1}
SDC_CODES = {"none": 0, "exact": 1, "exp_threshold": 2, "offline": 3}

# Atlas A2 / Ascend 910B1-B2: 24 AI cores with 2 vector cores each, 192 KiB unified buffer
# per vector core (910B3/B4: 40 vector cores).
A2_TARGET = {"name": "Ascend910B (Atlas A2)", "ub_bytes": 196608, "cores": 48, "min_split_len": 512}


def problem_shape(inputs: DecodeInputs) -> dict:
    """The kernel's view of one call (shapes, dtype and option codes) for the tiling."""
    return {
        "batch": inputs.batch,
        "num_q_heads": inputs.num_q_heads,
        "num_kv_heads": inputs.num_kv_heads,
        "max_seq_len": inputs.max_seq_len,
        "head_dim": inputs.head_dim,
        "max_row_id": inputs.max_row_id,
        "dtype": DTYPE_CODES[inputs.dtype],
        "placement": PLACEMENT_CODES[inputs.placement],
        "sdc": SDC_CODES[inputs.sdc],
        "vmc": int(inputs.vmc),
        "scale": float(inputs.scale),
        "sdc_gamma": float(inputs.sdc_gamma),
    }


def cpu_target() -> dict:
    """Target of ``ascendc-cpu``: Atlas A2 unless TOPTH_ASCENDC_CPU_CORES / _UB_BYTES /
    _MIN_SPLIT_LEN override the vector-core count, unified-buffer bytes or the shortest
    KV split."""
    t = dict(A2_TARGET)
    for key, env in (("cores", "TOPTH_ASCENDC_CPU_CORES"), ("ub_bytes", "TOPTH_ASCENDC_CPU_UB_BYTES"),
                     ("min_split_len", "TOPTH_ASCENDC_CPU_MIN_SPLIT_LEN")):
        if os.environ.get(env):
            t[key] = int(os.environ[env])
    return t


def value_mean_of(inputs: DecodeInputs) -> torch.Tensor:
    """mean_{j<n} v_j in float32, [batch, num_kv_heads, head_dim]; 0 where n = 0.

    Used when ``vmc=True`` and no ``value_mean`` is given: it reads every valid V row (the
    kernel's own V traffic stays the kept rows only); pass ``value_mean`` (a running mean
    kept with the cache) to avoid it.
    """
    n = inputs.seq_lens.to(torch.int64).clamp(0, inputs.max_seq_len)
    pos = torch.arange(inputs.max_seq_len, device=inputs.device)
    valid = (pos[None, :] < n[:, None]).view(inputs.batch, 1, -1, 1)
    v = torch.where(valid, inputs.value_cache.to(torch.float32), 0.0)
    return (v.sum(2) / n.clamp(min=1).to(torch.float32).view(-1, 1, 1)).contiguous()


def kernel_tensors(inputs: DecodeInputs) -> dict:
    """Contiguous tensors in the layouts the kernel reads (seq_lens as int32)."""
    t = {
        "query": inputs.query.contiguous(),
        "key_cache": inputs.key_cache.contiguous(),
        "value_cache": inputs.value_cache.contiguous(),
        # the kernel clamps each length into [0, max_seq_len]; int64 lengths that do not fit
        # int32 are clamped here first so that the conversion cannot wrap
        "seq_lens": inputs.seq_lens.clamp(0, inputs.max_seq_len).to(torch.int32).contiguous(),
        "thresholds": inputs.thresholds.contiguous(),
        "sdc_table": inputs.sdc_table.contiguous() if inputs.sdc_table is not None else None,
        "value_mean": None,
    }
    if inputs.vmc:
        vm = inputs.value_mean if inputs.value_mean is not None else value_mean_of(inputs)
        t["value_mean"] = vm.to(torch.float32).contiguous()
    return t


def _outputs_for(inputs: DecodeInputs, out: torch.Tensor, stats: Optional[DecodeStats]):
    """Contiguous buffers for the kernel to write (the caller's own when contiguous)."""
    dev = inputs.device
    o = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype, device=dev)
    if stats is not None:
        s = [x if x.is_contiguous() else torch.empty(x.shape, dtype=x.dtype, device=dev) for x in stats]
    else:
        s = [torch.empty((inputs.batch, inputs.num_q_heads), dtype=torch.int32, device=dev),
             torch.empty((inputs.batch, inputs.num_kv_heads), dtype=torch.int32, device=dev),
             torch.empty((inputs.batch, inputs.num_q_heads), dtype=torch.float32, device=dev)]
    return o, s


def _copy_back(out, stats, o, s):
    if o is not out:
        out.copy_(o)
    if stats is not None:
        for dst, src in zip(stats, s):
            if dst is not src:
                dst.copy_(src)


def _ptr(t: Optional[torch.Tensor]):
    if t is None or t.numel() == 0:
        return None
    return (t.data_ptr(), t.numel() * t.element_size())


# ---------------------------------------------------------------------------- CPU model

def _cpu_module():
    from topth_ops.npu_kernels import _ascendc_cpu  # compiled extension

    return _ascendc_cpu


def run_cpu_model(inputs: DecodeInputs, out: torch.Tensor, stats: Optional[DecodeStats] = None, *,
                  target: Optional[dict] = None) -> dict:
    """Run the Ascend C kernel on the CPU model of the Ascend C API.

    Parameters
    ----------
    inputs : DecodeInputs
        Validated inputs on the CPU.
    out : torch.Tensor
        ``[batch, num_q_heads, head_dim]``, input dtype; every element is written.
    stats : DecodeStats, optional
        Written when given.
    target : dict, optional
        ``name``, ``ub_bytes`` (unified-buffer bytes per vector core), ``cores`` (vector
        cores), ``min_split_len``; default :func:`cpu_target` (Atlas A2).

    Returns
    -------
    dict
        The model's report: ``k_bytes`` and ``v_bytes`` (GM -> UB bytes of the key and value
        caches), ``buffers`` (per-buffer GM <-> UB bytes and copy counts), ``ub_peak`` and
        ``ub_capacity`` (bytes), ``block_dim``, ``sync_all_calls`` and the ``tiling``.

    Raises
    ------
    ValueError
        The tiling refuses the shape (the message says why).
    topth_ops.npu_kernels._ascendc_cpu.ModelError
        The kernel broke a rule of the device (out-of-bounds or misaligned copy, unified
        buffer overflow, queue misuse, missing pipe synchronisation, race).
    """
    mod = _cpu_module()
    t = kernel_tensors(inputs)
    # The model tells GM buffers apart by address: give aliased inputs (e.g. one tensor
    # passed as both caches) their own storage.
    seen = []
    for name, x in t.items():
        if x is None:
            continue
        lo, hi = x.data_ptr(), x.data_ptr() + x.numel() * x.element_size()
        if any(lo < h and l < hi for l, h in seen):
            x = t[name] = x.clone()
            lo, hi = x.data_ptr(), x.data_ptr() + x.numel() * x.element_size()
        seen.append((lo, hi))
    o, s = _outputs_for(inputs, out, stats)
    args = {name: _ptr(x) for name, x in t.items()}
    args.update({"out": _ptr(o), "kept": _ptr(s[0]), "v_rows": _ptr(s[1]), "dropped_mass": _ptr(s[2])})
    report = mod.run(args, problem_shape(inputs), target or cpu_target())
    _copy_back(out, stats, o, s)
    return report


class AscendCCpuBackend(Backend):
    name = "ascendc-cpu"
    device_type = "cpu"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    description = ("the Ascend C kernel built with g++ against the CPU model of the Ascend C API "
                   "(Atlas A2 rules checked); explicit choice only")

    def __init__(self):
        self.last_report: Optional[dict] = None

    def unavailable_reasons(self) -> list[str]:
        try:
            _cpu_module()
        except ImportError as e:
            return [f"the CPU-model extension topth_ops.npu_kernels._ascendc_cpu is not built ({e}); "
                    f"reinstall with `pip install .` (needs a C++20 compiler; pybind11 is a build requirement)"]
        return []

    def input_reasons(self, inputs: DecodeInputs) -> list[str]:
        try:
            _cpu_module().compute_tiling(problem_shape(inputs), cpu_target())
        except ValueError as e:
            return [f"the kernel's tiling refuses the shape: {e}"]
        return []

    def forward(self, inputs: DecodeInputs, out: torch.Tensor, stats: Optional[DecodeStats]) -> None:
        self.last_report = run_cpu_model(inputs, out, stats)
        self._last_lens = inputs.seq_lens.clamp(0, inputs.max_seq_len).tolist()

    def bench_counters(self) -> dict:
        """Byte counts of the last call, for the bench harness (bench/harness.py): GM -> UB
        bytes in all (``gm_to_ub_bytes``), of the K and V caches, of the workspace
        (post_softmax scores, split bookkeeping), UB -> GM bytes, and the split bookkeeping
        the tiling's split plan implies (:func:`split_workspace_reads`, declared, not counted)."""
        r = self.last_report
        if r is None:
            return {}
        ws = r["buffers"].get("workspace", {}).get("gm_to_ub_bytes", 0)
        return {
            "gm_to_ub_bytes": r["k_bytes"] + r["v_bytes"] + r["other_gm_to_ub_bytes"],
            "k_bytes": r["k_bytes"],
            "v_bytes": r["v_bytes"],
            "workspace_gm_to_ub_bytes": ws,
            "workspace_split_gm_to_ub_bytes": split_workspace_reads(r["tiling"], self._last_lens),
            "ub_to_gm_bytes": r["ub_to_gm_bytes"],
            "ub_peak": r["ub_peak"],
        }


def split_workspace_reads(tiling: dict, seq_lens: list[int]) -> int:
    """GM -> UB bytes of the kernel's split bookkeeping under a split plan (0 unsplit).

    A (sequence, KV head) pair of length n uses ``u = ceil(n / splitLen)`` splits. Its
    combine step reads the u running maxima (``pairWidth`` floats each) and the u partial
    records (``partFloats`` floats each); for post_softmax each of its u pass-B items also
    reads the u (m, Z) pairs (2 x ``pairWidth`` floats). The post_softmax score round trip
    is not included (4 bytes per query head and position, computed by the bench harness).

    Parameters
    ----------
    tiling : dict
        The host tiling of the call (``run_cpu_model(...)["tiling"]``).
    seq_lens : list of int
        Lengths clamped into [0, max_seq_len].
    """
    if tiling["splitNum"] <= 1:
        return 0
    pw, rec, split_len = 4 * tiling["pairWidth"], 4 * tiling["partFloats"], tiling["splitLen"]
    post = tiling["placement"] == PLACEMENT_CODES["post_softmax"]
    total = 0
    for n in seq_lens:
        u = -(-int(n) // split_len)
        total += tiling["numKvHeads"] * (u * (pw + rec) + (u * u * 2 * pw if post else 0))
    return total


# ---------------------------------------------------------------------------- NPU

def _npu_module():
    from topth_ops.npu_kernels import _ascendc_npu  # compiled with CANN (docs/ascendc.md)

    return _ascendc_npu


class AscendCBackend(Backend):
    name = "ascendc"
    device_type = "npu"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    description = ("Ascend C kernel on an Ascend NPU (Atlas A2 / 910B), built with CANN, launched via torch_npu; "
                   "not yet run on hardware (docs/ascendc.md)")

    def unavailable_reasons(self) -> list[str]:
        reasons = []
        if not os.environ.get("ASCEND_HOME_PATH"):
            reasons.append("CANN toolkit not found: ASCEND_HOME_PATH is not set "
                           "(source <CANN install>/set_env.sh)")
        try:
            import torch_npu  # noqa: F401
        except Exception as e:  # ImportError, or a broken CANN / driver install
            reasons.append(f"torch_npu is not importable ({type(e).__name__}: {e})")
        else:
            try:
                if not torch.npu.is_available():
                    reasons.append("torch_npu sees no Ascend NPU")
            except Exception as e:  # noqa: BLE001
                reasons.append(f"torch.npu.is_available() failed ({e})")
        try:
            _npu_module()
        except Exception as e:  # ImportError, or missing CANN runtime libraries
            reasons.append(f"the NPU extension topth_ops.npu_kernels._ascendc_npu is not built or does not load "
                           f"({type(e).__name__}: {e}); rebuild with ASCEND_HOME_PATH set (docs/ascendc.md)")
        return reasons

    def input_reasons(self, inputs: DecodeInputs) -> list[str]:
        try:
            _npu_module().compute_tiling(problem_shape(inputs), inputs.device.index or 0)
        except ValueError as e:
            return [f"the kernel's tiling refuses the shape: {e}"]
        return []

    def forward(self, inputs: DecodeInputs, out: torch.Tensor, stats: Optional[DecodeStats]) -> None:
        mod = _npu_module()
        t = kernel_tensors(inputs)
        o, s = _outputs_for(inputs, out, stats)
        mod.run(t["query"], t["key_cache"], t["value_cache"], t["seq_lens"], t["thresholds"], t["sdc_table"],
                t["value_mean"], o, s[0], s[1], s[2], problem_shape(inputs))
        _copy_back(out, stats, o, s)


BACKENDS = [AscendCBackend(), AscendCCpuBackend()]
