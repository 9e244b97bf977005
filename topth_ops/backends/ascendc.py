"""Backends ``ascendc`` (the Ascend C kernel on an Ascend NPU) and ``ascendc-cpu`` (the same
kernel source compiled with g++ against the CPU model of the Ascend C API).

The kernel (``npu_kernels/kernel/``) is modelled on Ascend's IncrementalFlashAttention: work
split over batch x kv-heads across AI vector cores, and over the actual KV length
(flash-decoding, combined by log-sum-exp) when that is too little work; K read through the
block table (contiguous BNSD, paged NHD / HND) and the scores computed on the cube cores of a
mix kernel (the cube path: float16 / bfloat16 where its buffers fit) or on the vector cores
(the all-vector kernel; ``TOPTH_ASCENDC_PATH`` forces one); V rows copied only when the GQA
group keeps them; per-head or per-group selection, threshold sets.
The caches are read in place through their strides; layouts the kernel cannot read are
refused with the reason (never copied). docs/ascendc.md describes the design, the build and
what was verified where: the ``ascendc`` backend has **not** run on Ascend hardware; CI
verifies the kernel on the CPU model (``ascendc-cpu``).

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
from ..env import env_choice, env_int
from .ascendc_host import (cache_layout_reason, kept_union_masks, kernel_tensors, problem_shape, split_plan,
                           split_workspace_reads, v_fetch_plan)

FEATURES = frozenset({"paged", "group_selection", "threshold_sets"})

# What limits head_dim (input_reasons checks it per call, from the tiling): the unified
# buffer (less the 8 KiB the Ascend C API reserves) bounds head_dim x GQA group size; the
# vector repeat stride bounds head_dim at 2040 (float32) / 2032 (float16, bfloat16).
# Numbers for Atlas A2 (docs/ascendc.md).
HEAD_DIMS_NOTE = "UB-bound: <=1056"
LIMITS = ("head_dim x GQA group size bounded by the unified buffer (Atlas A2: head_dim <= 1056 at group size 1, "
          "group size <= 52 at head_dim 128; table in docs/ascendc.md)")

# Atlas A2 / Ascend 910B1-B2: 24 AI cores with 2 vector cores each, 192 KiB unified buffer
# per vector core (910B3/B4: 40 vector cores).
A2_TARGET = {"name": "Ascend910B (Atlas A2)", "ub_bytes": 196608, "cores": 48, "min_split_len": 512,
             "l2_bytes": 192 << 20}


def layout_reasons(inputs: DecodeInputs) -> list[str]:
    """Reasons the kernel cannot read the caches of ``inputs`` in place (empty: it can)."""
    return [r for r in (cache_layout_reason(inputs, "key"), cache_layout_reason(inputs, "value")) if r]


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


def _extent(t: torch.Tensor) -> int:
    """Bytes from ``t.data_ptr()`` to the end of the last element (strided views too)."""
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()


def _ptr(t: Optional[torch.Tensor]):
    if t is None or t.numel() == 0:
        return None
    return (t.data_ptr(), _extent(t))


# ---------------------------------------------------------------------------- CPU model

def _cpu_module():
    from ..npu_kernels import cpu_model_extension

    return cpu_model_extension()


# Knobs of ``ascendc-cpu``: environment variable, target key, allowed range, meaning.
CPU_KNOBS = (
    ("TOPTH_ASCENDC_CPU_CORES", "cores", 1, 1024, "vector cores (one host thread each)"),
    ("TOPTH_ASCENDC_CPU_UB_BYTES", "ub_bytes", 1024, 1 << 24, "unified-buffer bytes per vector core, a multiple of 32"),
    ("TOPTH_ASCENDC_CPU_MIN_SPLIT_LEN", "min_split_len", 1, (1 << 31) - 1, "fewest KV positions per split"),
)


def _knob_error(name: str, lo: int, hi: int, what: str, got) -> ValueError:
    return ValueError(f"{name} must be an integer in [{lo}, {hi}] ({what}), got {got!r}")


# Which kernel runs (both Ascend backends; the NPU binding reads it too): "auto" (default: the
# cube path wherever it can run, else the all-vector kernel), "vector" or "cube" (refused with
# the reason where it cannot run). docs/ascendc.md, "Which path runs".
PATH_ENV = "TOPTH_ASCENDC_PATH"
PATHS = ("auto", "vector", "cube")


def check_target(target: dict) -> dict:
    """Validate a CPU-model target dict (``cores``, ``ub_bytes``, ``min_split_len``, ``name``,
    ``path``).

    Raises
    ------
    ValueError
        A value that is not an integer in its range of :data:`CPU_KNOBS` (``ub_bytes`` also
        a multiple of 32), or a ``path`` not in :data:`PATHS`, naming the key and the expected value.
    """
    if target.get("path") is not None and target["path"] not in PATHS:
        raise ValueError(f"target['path'] must be one of {PATHS}, got {target['path']!r}")
    for _env, key, lo, hi, what in CPU_KNOBS:
        v = target.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi or (key == "ub_bytes" and v % 32):
            raise _knob_error(f"target[{key!r}]", lo, hi, what, v)
    return target


def cpu_target() -> dict:
    """Target of ``ascendc-cpu``: Atlas A2 unless TOPTH_ASCENDC_CPU_CORES / _UB_BYTES /
    _MIN_SPLIT_LEN override the vector-core count (the cube cores are half of it), unified-buffer
    bytes or the shortest KV split (ranges in :data:`CPU_KNOBS`), and TOPTH_ASCENDC_PATH the
    path (:data:`PATHS`).

    Raises
    ------
    ValueError
        A variable that is not an integer in its range, or an unknown path, naming the
        variable and the expected values.
    """
    t = dict(A2_TARGET)
    if os.environ.get(PATH_ENV, "").strip():
        t["path"] = env_choice(PATH_ENV, PATHS)
    for env, key, lo, hi, what in CPU_KNOBS:
        v = env_int(env, lo, hi, what)
        if v is None:
            continue
        if key == "ub_bytes" and v % 32:
            raise _knob_error(env, lo, hi, what, str(v))
        t[key] = v
    return t


def run_cpu_model(inputs: DecodeInputs, out: torch.Tensor, stats: Optional[DecodeStats] = None, *,
                  target: Optional[dict] = None, launch: Optional[dict] = None) -> dict:
    """Run the Ascend C kernel on the CPU model of the Ascend C API.

    Parameters
    ----------
    inputs : DecodeInputs
        Validated inputs on the CPU (BNSD or paged caches the kernel can read in place).
    out : torch.Tensor
        ``[batch, num_q_heads, head_dim]``, input dtype; every element is written.
    stats : DecodeStats, optional
        Written when given.
    target : dict, optional
        ``name``, ``ub_bytes`` (unified-buffer bytes per vector core), ``cores`` (vector
        cores), ``aic_cores`` (cube cores, default half the vector cores), ``min_split_len``,
        ``path`` ("auto", "vector", "cube"), ``ring_slots``; what the tiling believes of the
        cube memories (``l1_bytes``, ``l0a_bytes``, ``l0b_bytes``, ``l0c_bytes``; the model's
        are Atlas A2's); test switches ``reserve_api_scratch`` (False plans buffers over the
        API's scratch block) and ``sync`` ("hard" / "soft"); default :func:`cpu_target` (Atlas A2).
    launch : dict, optional
        Model conditions: ``check_rows`` (default True: every K / V read must be a row the
        block table names for the work item's sequence), ``resident_blocks`` (blocks that
        start together when another stream holds cores; 0 = all), ``transcendental_error``
        (relative error of the model's Exp / Ln, +/- by element), ``fault`` (a deliberate bug
        of the kernel source, TOPTH_MODEL_FAULT, for the tests that the model catches it).

    Returns
    -------
    dict
        The model's report: ``k_bytes`` and ``v_bytes`` (GM -> UB bytes of the key and value
        caches), ``buffers`` (per-buffer GM <-> UB bytes and copy counts), ``counters`` and
        ``per_block`` (pipe counters: MTE2 / MTE3 bytes and requests, vector instructions
        and repeats, scalar UB / GM accesses, barriers, flags, cube instructions and their
        fractals, L1 -> L0 and Fixpipe bytes, cross-core flags; one entry per core with its
        ``core`` "aiv" / "aic"), ``counters_aic`` / ``counters_aiv`` (summed over the cube /
        vector cores), ``ub_peak`` and ``ub_capacity`` (bytes), ``l1_peak`` / ``l0a_peak`` /
        ``l0b_peak`` / ``l0c_peak`` (cube cores), ``block_dim`` (vector cores, or AI cores on the
        cube path), ``cube_path``, ``kernel_type``, ``sync_all_calls`` and the ``tiling`` (with
        ``path`` and ``pathReason``).

    Raises
    ------
    ValueError
        The tiling refuses the shape or the cache layout (the message says why), or an
        invalid target / TOPTH_ASCENDC_CPU_* variable (naming it).
    topth_ops.npu_kernels._ascendc_cpu.ModelError
        The kernel broke a rule of the device (out-of-bounds or misaligned copy, unified
        buffer overflow, queue misuse, missing pipe synchronisation, race, a cache row the
        block table does not name for the sequence).
    """
    mod = _cpu_module()
    target = check_target(dict(target)) if target is not None else cpu_target()
    bad = layout_reasons(inputs)
    if bad:
        raise ValueError("; ".join(bad))
    t = kernel_tensors(inputs)
    # The model tells GM buffers apart by address: give aliased inputs (e.g. K and V
    # interleaved in one tensor) their own storage, keeping their strides. (The device has
    # no such restriction: they run in place.)
    seen = []
    for name, x in t.items():
        if x is None or x.numel() == 0:
            continue
        lo = x.data_ptr()
        if any(lo < h and l < lo + _extent(x) for l, h in seen):
            y = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
            x = t[name] = y.copy_(x)
            lo = x.data_ptr()
        seen.append((lo, lo + _extent(x)))
    o, s = _outputs_for(inputs, out, stats)
    args = {name: _ptr(x) for name, x in t.items()}
    args.update({"out": _ptr(o), "kept": _ptr(s[0]), "v_rows": _ptr(s[1]), "dropped_mass": _ptr(s[2])})
    report = mod.run(args, problem_shape(inputs), target, dict(launch or {}))
    _copy_back(out, stats, o, s)
    return report


class AscendCCpuBackend(Backend):
    name = "ascendc-cpu"
    device_type = "cpu"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    head_dims_note = HEAD_DIMS_NOTE
    features = FEATURES
    description = ("the Ascend C kernel built with g++ against the CPU model of the Ascend C API "
                   "(Atlas A2 rules checked); explicit choice only; " + LIMITS)

    def __init__(self):
        self.last_report: Optional[dict] = None
        self._last_lens: list[int] = []

    def unavailable_reasons(self) -> list[str]:
        reasons = []
        try:
            _cpu_module()
        except ImportError as e:
            reasons.append(f"the CPU-model extension topth_ops.npu_kernels._ascendc_cpu is not built ({e}); "
                           f"reinstall with `pip install .` (needs a C++20 compiler; pybind11 is a build requirement)")
        try:
            cpu_target()
        except ValueError as e:
            reasons.append(str(e))
        return reasons

    def input_reasons(self, inputs: DecodeInputs) -> list[str]:
        try:
            target = cpu_target()
        except ValueError as e:
            return [str(e)]
        reasons = layout_reasons(inputs)
        if reasons:
            return reasons
        try:
            _cpu_module().compute_tiling(problem_shape(inputs), target)
        except ValueError as e:
            return [f"the kernel's tiling refuses the shape: {e}"]
        return []

    def forward(self, inputs: DecodeInputs, out: torch.Tensor, stats: Optional[DecodeStats]) -> None:
        self.last_report = run_cpu_model(inputs, out, stats)
        self._last_lens = inputs.clamped_lengths(torch.int32).tolist()
        self._last_inputs = inputs

    def bench_counters(self) -> dict:
        """Counters of the last call, for the bench harness (bench/harness.py): GM -> UB
        bytes in all (``gm_to_ub_bytes``), of the K and V caches, of the workspace
        (post_softmax scores, split bookkeeping), UB -> GM bytes, the split bookkeeping the
        kernel's split plan implies (:func:`split_workspace_reads`, declared, not counted),
        and the model's pipe counters summed over blocks (``pipe_*``)."""
        r = self.last_report
        if r is None:
            return {}
        ws = r["buffers"].get("workspace", {}).get("gm_to_ub_bytes", 0)
        counters = {
            "gm_to_ub_bytes": r["k_bytes"] + r["v_bytes"] + r["other_gm_to_ub_bytes"],
            "k_bytes": r["k_bytes"],
            "v_bytes": r["v_bytes"],
            "workspace_gm_to_ub_bytes": ws,
            "workspace_split_gm_to_ub_bytes": split_workspace_reads(r["tiling"], self._last_lens),
            **self._plan_counters(),
            "ub_to_gm_bytes": r["ub_to_gm_bytes"],
            "ub_peak": r["ub_peak"],
        }
        counters.update({f"pipe_{k}": v for k, v in r["counters"].items()})
        # the cube cores' share (cube path; zeros on the all-vector path) and the vector cores'
        # barriers and cross-core flags, for the cycle estimate (bench/ascendc_counters.py)
        counters.update({f"pipe_aic_{k}": v for k, v in r["counters_aic"].items()})
        counters["pipe_barriers_aiv"] = r["counters_aiv"]["barriers"]
        counters["pipe_cross_sets_aiv"] = r["counters_aiv"]["cross_sets"]
        counters["path"] = r["tiling"]["path"]
        return counters

    def _plan_counters(self) -> dict:
        """What the kernel's plan implies for the last call (declared, not counted): V bytes
        fetched between merged runs of kept rows, copy spans and copy instructions, score
        tiles and work items (from :func:`split_plan` and :func:`v_fetch_plan` on kept sets
        selected again in float32); the pipe-counter gates compare the counts with them."""
        inputs, t = self._last_inputs, self.last_report["tiling"]
        e = inputs.query.element_size()
        plan = v_fetch_plan(kept_union_masks(inputs), t, self._last_lens, e, inputs.block_table)
        _u, pieces = split_plan(t, self._last_lens)
        post = inputs.placement == "post_softmax"
        items = sum((p + (p if post else 0) + 1) if p > 1 else 1 for p in pieces) * inputs.num_kv_heads
        return {
            "v_merged_gap_bytes": (plan["fetched_rows"] - plan["kept_rows"]) * inputs.head_dim * e,
            "plan_v_spans": plan["spans"],
            "plan_v_copies": plan["copies"],
            "plan_kept_rows": plan["kept_rows"],
            "plan_score_tiles": plan["score_tiles"],
            "plan_work_items": items,
            "plan_group": inputs.group_size,
            "plan_row_bytes": inputs.head_dim * e,
        }


# ---------------------------------------------------------------------------- NPU

NPU_BUILD_HINT = ("to build it: source CANN's set_env.sh (ASCEND_HOME_PATH), install torch and torch_npu, and "
                  "reinstall with `pip install --no-build-isolation -e .` (under pip's default build isolation the "
                  "NPU build cannot see torch / torch_npu and is skipped with a warning; `pip install -v` shows "
                  "it; docs/ascendc.md)")


def _npu_module():
    from ..npu_kernels import npu_extension

    return npu_extension()


class AscendCBackend(Backend):
    name = "ascendc"
    device_type = "npu"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    head_dims_note = HEAD_DIMS_NOTE
    features = FEATURES
    description = ("Ascend C kernel on an Ascend NPU (Atlas A2 / 910B), built with CANN, launched via torch_npu; "
                   "not yet run on hardware (docs/ascendc.md); " + LIMITS)

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
            built = not (isinstance(e, ImportError) and "_ascendc_npu" in str(e))
            reasons.append(f"the NPU extension topth_ops.npu_kernels._ascendc_npu "
                           f"{'does not load' if built else 'is not built'} ({type(e).__name__}: {e}); {NPU_BUILD_HINT}")
        return reasons

    def input_reasons(self, inputs: DecodeInputs) -> list[str]:
        reasons = layout_reasons(inputs)
        if reasons:
            return reasons
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
                t["value_mean"], t["block_table"], t["threshold_set"], o, s[0], s[1], s[2], problem_shape(inputs))
        _copy_back(out, stats, o, s)


BACKENDS = [AscendCBackend(), AscendCCpuBackend()]
