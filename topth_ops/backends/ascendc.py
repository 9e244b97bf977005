"""Backends ``ascendc`` (the Ascend C kernel on an Ascend NPU) and ``ascendc-cpu`` (the same
kernel source compiled with g++ against the CPU model of the Ascend C API).

The kernel (``npu_kernels/kernel/topth_decode_attn.cpp``) is modelled on Ascend's
IncrementalFlashAttention: work split over batch x kv-heads across AI vector cores, and
over the KV sequence (flash-decoding, combined by log-sum-exp) when that is too little
work; K tiles double-buffered GM -> UB; V rows copied only when some head of the GQA group
keeps them. The KV caches are read in place through their strides when every row of
head_dim elements is contiguous (slices of a longer cache, BSND viewed as BNSD, K and V
interleaved); other layouts are copied on every call, with a warning logged once. docs/ascendc.md describes the design, the build and what was verified where:
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
from ..registry import Backend, log_once

DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
PLACEMENT_CODES = {"pre_softmax": 0, "post_softmax": 1}
SDC_CODES = {"none": 0, "exact": 1, "exp_threshold": 2, "offline": 3}

# What limits head_dim (input_reasons checks it per call, from the tiling): the unified
# buffer bounds head_dim x GQA group size; the vector repeat stride bounds head_dim at
# 2040 (float32) / 2032 (float16, bfloat16). Numbers for Atlas A2 (docs/ascendc.md).
HEAD_DIMS_NOTE = "UB-bound: <=1104"
LIMITS = ("head_dim x GQA group size bounded by the unified buffer (Atlas A2: head_dim <= 1104 at group size 1, "
          "group size <= 45 at head_dim 128; table in docs/ascendc.md)")

# Atlas A2 / Ascend 910B1-B2: 24 AI cores with 2 vector cores each, 192 KiB unified buffer
# per vector core (910B3/B4: 40 vector cores).
A2_TARGET = {"name": "Ascend910B (Atlas A2)", "ub_bytes": 196608, "cores": 48, "min_split_len": 512}


def problem_shape(inputs: DecodeInputs, key_cache: Optional[torch.Tensor] = None,
                  value_cache: Optional[torch.Tensor] = None) -> dict:
    """The kernel's view of one call (shapes, dtype, option codes and the caches' strides)
    for the tiling. ``key_cache`` / ``value_cache``: the tensors the kernel will read
    (default: :func:`kernel_cache` of the inputs' caches, without copying)."""
    k = key_cache if key_cache is not None else inputs.key_cache
    v = value_cache if value_cache is not None else inputs.value_cache
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
        "k_strides": cache_strides(k),
        "v_strides": cache_strides(v),
    }


def kernel_reads_layout(cache: torch.Tensor) -> bool:
    """Whether the kernel reads this ``[B, Hkv, S, D]`` cache in place: every row of
    head_dim elements contiguous, rows of one (batch, KV head) not overlapping, and the gap
    between rows under 4 GiB. Batch and head strides are free (slices of a larger cache,
    BSND caches viewed as BNSD, K and V interleaved in one tensor)."""
    B, H, S, D = cache.shape
    row = cache.stride(2) if S > 1 else D
    return (cache.stride(3) == 1 or D == 1) and row >= D and (row - D) * cache.element_size() < 2**32


def cache_strides(cache: torch.Tensor) -> list[int]:
    """(batch, KV head, position) strides in elements of the cache as the kernel will read
    it (contiguous strides when :func:`kernel_reads_layout` is false: it is copied)."""
    if kernel_reads_layout(cache):
        return list(cache.stride()[:3])
    B, H, S, D = cache.shape
    return [H * S * D, S * D, D]


def kernel_cache(cache: torch.Tensor, name: str) -> torch.Tensor:
    """The cache itself when the kernel can read its layout, else a contiguous copy (a
    full read and write of the cache on every call: logged once per process)."""
    if kernel_reads_layout(cache):
        return cache
    log_once(f"topth_ops ascendc: {name} with strides {tuple(cache.stride())} (shape {tuple(cache.shape)}) has "
              f"rows that are not contiguous or overlap; it is copied with .contiguous() on every call, a full "
              f"read and write of the cache that costs more than the V rows the thresholds save "
              f"(docs/ascendc.md, 'Cache layouts')")
    return cache.contiguous()


# Knobs of ``ascendc-cpu``: environment variable, target key, allowed range, meaning.
CPU_KNOBS = (
    ("TOPTH_ASCENDC_CPU_CORES", "cores", 1, 1024, "vector cores (one host thread each)"),
    ("TOPTH_ASCENDC_CPU_UB_BYTES", "ub_bytes", 1024, 1 << 24, "unified-buffer bytes per vector core, a multiple of 32"),
    ("TOPTH_ASCENDC_CPU_MIN_SPLIT_LEN", "min_split_len", 1, (1 << 31) - 1, "fewest KV positions per split"),
)


def _knob_error(name: str, lo: int, hi: int, what: str, got) -> ValueError:
    return ValueError(f"{name} must be an integer in [{lo}, {hi}] ({what}), got {got!r}")


def check_target(target: dict) -> dict:
    """Validate a CPU-model target dict (``cores``, ``ub_bytes``, ``min_split_len``, ``name``).

    Raises
    ------
    ValueError
        A value that is not an integer in its range of :data:`CPU_KNOBS` (``ub_bytes`` also
        a multiple of 32), naming the key and the expected value.
    """
    for _env, key, lo, hi, what in CPU_KNOBS:
        v = target.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi or (key == "ub_bytes" and v % 32):
            raise _knob_error(f"target[{key!r}]", lo, hi, what, v)
    return target


def cpu_target() -> dict:
    """Target of ``ascendc-cpu``: Atlas A2 unless TOPTH_ASCENDC_CPU_CORES / _UB_BYTES /
    _MIN_SPLIT_LEN override the vector-core count, unified-buffer bytes or the shortest
    KV split (ranges in :data:`CPU_KNOBS`).

    Raises
    ------
    ValueError
        A variable that is not an integer in its range, naming the variable and the range.
    """
    t = dict(A2_TARGET)
    for env, key, lo, hi, what in CPU_KNOBS:
        raw = os.environ.get(env, "").strip()
        if not raw:
            continue
        try:
            v = int(raw, 10)
        except ValueError:
            raise _knob_error(env, lo, hi, what, raw) from None
        if not lo <= v <= hi or (key == "ub_bytes" and v % 32):
            raise _knob_error(env, lo, hi, what, raw)
        t[key] = v
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
    """Tensors in the layouts the kernel reads: the caches as they are when the kernel can
    read their strides (:func:`kernel_cache`), everything else contiguous, seq_lens int32."""
    t = {
        "query": inputs.query.contiguous(),
        "key_cache": kernel_cache(inputs.key_cache, "key_cache"),
        "value_cache": kernel_cache(inputs.value_cache, "value_cache"),
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


def _extent(t: torch.Tensor) -> int:
    """Bytes from ``t.data_ptr()`` to the end of the last element (strided views too)."""
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()


def _ptr(t: Optional[torch.Tensor]):
    if t is None or t.numel() == 0:
        return None
    return (t.data_ptr(), _extent(t))


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
        The tiling refuses the shape (the message says why), or an invalid target /
        TOPTH_ASCENDC_CPU_* variable (naming it).
    topth_ops.npu_kernels._ascendc_cpu.ModelError
        The kernel broke a rule of the device (out-of-bounds or misaligned copy, unified
        buffer overflow, queue misuse, missing pipe synchronisation, race).
    """
    mod = _cpu_module()
    target = check_target(dict(target)) if target is not None else cpu_target()
    t = kernel_tensors(inputs)
    # The model tells GM buffers apart by address: give aliased inputs (e.g. one tensor
    # passed as both caches) their own storage.
    # (The device has no such restriction: K and V interleaved in one tensor run in place.)
    seen = []
    for name, x in t.items():
        if x is None or x.numel() == 0:
            continue
        lo = x.data_ptr()
        if any(lo < h and l < lo + _extent(x) for l, h in seen):
            x = t[name] = x.clone(memory_format=torch.contiguous_format)
            lo = x.data_ptr()
        seen.append((lo, lo + _extent(x)))
    o, s = _outputs_for(inputs, out, stats)
    args = {name: _ptr(x) for name, x in t.items()}
    args.update({"out": _ptr(o), "kept": _ptr(s[0]), "v_rows": _ptr(s[1]), "dropped_mass": _ptr(s[2])})
    report = mod.run(args, problem_shape(inputs, t["key_cache"], t["value_cache"]), target)
    _copy_back(out, stats, o, s)
    return report


class AscendCCpuBackend(Backend):
    name = "ascendc-cpu"
    device_type = "cpu"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    head_dims_note = HEAD_DIMS_NOTE
    description = ("the Ascend C kernel built with g++ against the CPU model of the Ascend C API "
                   "(Atlas A2 rules checked); explicit choice only; " + LIMITS)

    def __init__(self):
        self.last_report: Optional[dict] = None

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
        try:
            _cpu_module().compute_tiling(problem_shape(inputs), target)
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

NPU_BUILD_HINT = ("to build it: source CANN's set_env.sh (ASCEND_HOME_PATH), install torch and torch_npu, and "
                  "reinstall with `pip install --no-build-isolation -e .` (under pip's default build isolation the "
                  "NPU build cannot see torch / torch_npu and is skipped with a warning; `pip install -v` shows "
                  "it; docs/ascendc.md)")


def _npu_module():
    from topth_ops.npu_kernels import _ascendc_npu  # compiled with CANN (docs/ascendc.md)

    return _ascendc_npu


class AscendCBackend(Backend):
    name = "ascendc"
    device_type = "npu"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    head_dims_note = HEAD_DIMS_NOTE
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
                t["value_mean"], o, s[0], s[1], s[2], problem_shape(inputs, t["key_cache"], t["value_cache"]))
        _copy_back(out, stats, o, s)


BACKENDS = [AscendCBackend(), AscendCCpuBackend()]
