"""Backend ``cpu``: the compiled CPU kernel that reads only the kept V rows.

C++ through pybind11 (``topth_ops.cpu_kernels._topth_cpu``, sources in cpu_kernels/, design
in docs/cpu.md). Per (sequence, KV head, KV split) it reads every valid K row once for the
whole GQA group, thresholds the scores, and reads only the V rows some head of the group
keeps (paper section 4.6: the traffic bound 2 / (1 + f)). Whole contract: both placements,
every SDC variant, VMC, BNSD and paged (NHD / HND) caches through the block table,
``selection="group"``, threshold sets, statistics, any strides, float16 / bfloat16 /
float32 inputs with float32 math.

The extension is optional: a machine without a C++ compiler installs the package without
it, and this backend then reports why it is unavailable (the registry falls back to
``torch``). Knobs (environment variables, read on every call; the parsed values and the
availability verdict are cached per distinct set of values, so a decode loop does not
re-parse them and a changed variable takes effect at the next call):

- ``TOPTH_CPU_SIMD``: ``auto`` (default: the best level this CPU runs), ``amx`` (the
  ``avx512bf16`` level with bfloat16 scores on AMX tiles), ``avx512bf16`` (AVX-512 with
  vdpbf16ps scores for bfloat16 caches), ``avx512``, ``avx2`` or ``generic``
  (the portable C++ path);
- ``TOPTH_CPU_SPLIT_LEN``: positions per KV split (default 0: automatic);
- ``TOPTH_CPU_PARALLEL``: ``auto`` (default: torch's own OpenMP thread team when its runtime
  is loaded, else the kernel's pool) or ``pool`` (always the kernel's pool).

Threads: ``torch.get_num_threads()`` per call (docs/cpu.md, "Threads").
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .. import validation as V
from ..codes import DType, Placement, Sdc, Selection, VmcMode
from ..contract import DecodeInputs, DecodeStats
from ..env import env_choice, env_int
from ..registry import Backend

ENV_SIMD = "TOPTH_CPU_SIMD"
ENV_SPLIT = "TOPTH_CPU_SPLIT_LEN"
ENV_PARALLEL = "TOPTH_CPU_PARALLEL"
SIMD_CHOICES = ("auto", "amx", "avx512bf16", "avx512", "avx2", "generic")
PARALLEL_CHOICES = ("auto", "pool")


def cpu_module():
    """The compiled kernel module (ImportError when it was not built)."""
    from ..cpu_kernels import extension

    return extension()


def simd_request() -> str:
    """The SIMD level asked for by ``TOPTH_CPU_SIMD`` (``auto`` when unset).

    Raises
    ------
    ValueError
        A value outside :data:`SIMD_CHOICES`, naming the variable.
    """
    return env_choice(ENV_SIMD, SIMD_CHOICES)


def split_len() -> int:
    """Positions per KV split from ``TOPTH_CPU_SPLIT_LEN`` (0: automatic).

    Raises
    ------
    ValueError
        Not an integer >= 0, naming the variable.
    """
    return env_int(ENV_SPLIT, 0, 2**63 - 1, "positions per KV split, 0: automatic", default=0)


def parallel_request() -> str:
    """``TOPTH_CPU_PARALLEL`` (``auto`` when unset).

    Raises
    ------
    ValueError
        A value outside :data:`PARALLEL_CHOICES`, naming the variable.
    """
    return env_choice(ENV_PARALLEL, PARALLEL_CHOICES)


def threads_line() -> str:
    """Thread count and where the threads come from, for ``topth-ops info``."""
    rt = cpu_module().openmp_runtime() if parallel_request() == "auto" else ""
    where = f"torch's OpenMP team ({os.path.basename(rt)})" if rt else "the kernel's own pool"
    return f"{torch.get_num_threads()} threads (torch.get_num_threads()) on {where}"


def simd_level() -> str:
    """The SIMD level the kernel runs with here: the request, or the best one this CPU runs.

    Raises
    ------
    ImportError
        The extension is not built.
    ValueError
        A bad ``TOPTH_CPU_SIMD``, or a level this build / CPU cannot run.
    """
    mod = cpu_module()
    req = simd_request()
    if req == "auto":
        return mod.best_simd_level()
    if req not in mod.simd_levels():
        why = f" ({mod.amx_unavailable_reason()})" if req == "amx" else ""
        raise ValueError(f"{ENV_SIMD}={req}: not available on this machine{why} (available: "
                         f"{', '.join(mod.simd_levels())})")
    return req


# (cpu_module accessor, raw knob values) -> (reasons, (level code, split, use_openmp) or None,
# the ImportError of a missing extension or None). Keyed on the accessor too, so a test that
# replaces it (missing extension) is seen.
_verdicts: dict = {}


def _verdict() -> tuple[list[str], Optional[tuple[int, int, int]], Optional[ImportError]]:
    """Why the backend cannot run with the current knobs (empty: it can), the parsed kernel
    knobs when it can (SIMD level code, split length, whether to use torch's OpenMP team),
    and the ImportError when the extension is missing. Cached per (extension accessor, raw
    values of the three variables)."""
    env = os.environ
    key = (cpu_module, env.get(ENV_SIMD), env.get(ENV_SPLIT), env.get(ENV_PARALLEL))
    hit = _verdicts.get(key)
    if hit is not None:
        return hit
    try:
        mod = cpu_module()
    except ImportError as e:
        verdict = ([f"the CPU kernel extension topth_ops.cpu_kernels._topth_cpu is not built ({e}); reinstall "
                    f"the package from its repository, e.g. `pip install -e .` as in README (needs a C++17 compiler; "
                    f"pybind11 is a build requirement)"], None, e)
    else:
        reasons, values = [], []
        for check in (simd_level, split_len, parallel_request):
            try:
                values.append(check())
            except ValueError as e:
                reasons.append(str(e))
        knobs = None
        if not reasons:
            knobs = (mod.LEVELS[simd_request()], values[1], int(values[2] == "auto"))
        verdict = (reasons, knobs, None)
    if len(_verdicts) > 64:  # env values changed many times (tests): start over
        _verdicts.clear()
    _verdicts[key] = verdict
    return verdict


def _knobs() -> tuple[int, int, int]:
    """(SIMD level code, split length, use torch's OpenMP team) for the kernel call.

    Raises
    ------
    ImportError, ValueError
        As :meth:`CpuBackend.unavailable_reasons` reports (the extension is missing, a bad knob).
    """
    reasons, knobs, missing = _verdict()
    if missing is not None:
        cpu_module()  # raises the missing extension's ImportError afresh (no shared traceback)
    if knobs is None:
        raise ValueError("; ".join(reasons))
    return knobs


def _tensor(t: Optional[torch.Tensor], strides=None):
    if t is None:
        return None
    return (t.data_ptr(), tuple(strides if strides is not None else t.stride()))


def _tensor_3d(t: Optional[torch.Tensor]):
    """A ``[num_sets, heads, max_row_id]`` table as the kernel reads it: 2-D tables are one set
    (the strides :meth:`torch.Tensor.unsqueeze` would give, without making the view)."""
    if t is None:
        return None
    s = t.stride()
    return (t.data_ptr(), s if t.dim() == 3 else (t.shape[0] * s[0], *s))


def _index(t: Optional[torch.Tensor]):
    if t is None:
        return None
    return (t.data_ptr(), t.stride(0), t.dtype == torch.int64)


def kernel_args(inputs: DecodeInputs, out: torch.Tensor, stats: Optional[DecodeStats]) -> dict:
    """The kernel's arguments: data pointers and element strides of every tensor (read in
    place, no copy), shapes and option codes. BNSD caches travel as one HND block per
    sequence without a block table (docs/cpu.md, "One code path"); vLLM's AMX cache as HND
    strides with the packing flag (the last option).

    Parameters
    ----------
    inputs : DecodeInputs
        Validated inputs on the CPU.
    out : torch.Tensor
        ``[batch, num_q_heads, head_dim]``, the input dtype, any strides.
    stats : DecodeStats, optional
        Written when given (any strides).
    """
    knobs = _knobs()
    vmc = VmcMode.OFF
    if inputs.vmc:
        vmc = VmcMode.GIVEN if inputs.value_mean is not None else VmcMode.COMPUTED
    # every value read once (this runs on every call; a decode step makes one call per layer)
    q, k, th, bt, layout = inputs.query, inputs.key_cache, inputs.thresholds, inputs.block_table, inputs.kv_layout
    batch, num_q_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, _ = V.cache_dims(k, layout)
    three_d = th.dim() == 3
    return {
        "simd_level": knobs[0],  # read by CpuBackend.forward; the kernel ignores it in the dict
        "shape": [batch, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks,
                  bt.shape[1] if bt is not None else 1, th.shape[-1], th.shape[0] if three_d else 1],
        "options": [int(DType.of(q.dtype)), int(Placement.of(inputs.placement)), int(Sdc.of(inputs.sdc)),
                    int(vmc), int(Selection.of(inputs.selection)), torch.get_num_threads(), knobs[1], knobs[2],
                    int(layout == "VLLM_AMX")],
        "scale": float(inputs.scale),
        "sdc_gamma": float(inputs.sdc_gamma),
        "query": _tensor(q),
        "key_cache": _tensor(k, V.cache_strides(k, layout)),
        "value_cache": _tensor(inputs.value_cache, V.cache_strides(inputs.value_cache, layout)),
        "block_table": _tensor(bt),
        "seq_lens": _index(inputs.seq_lens),
        "thresholds": _tensor_3d(th),
        "threshold_set": _index(inputs.threshold_set),
        "sdc_table": _tensor_3d(inputs.sdc_table),
        "value_mean": _tensor(inputs.value_mean) if vmc == VmcMode.GIVEN else None,
        "out": _tensor(out),
        "kept": _tensor(stats.kept) if stats is not None else None,
        "v_rows": _tensor(stats.v_rows) if stats is not None else None,
        "dropped_mass": _tensor(stats.dropped_mass) if stats is not None else None,
    }


class CpuBackend(Backend):
    name = "cpu"
    device_type = "cpu"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    features = frozenset({"paged", "group_selection", "threshold_sets", "vllm_amx"})

    def __init__(self):
        self.last_counters: Optional[dict] = None
        self._row_bytes = 0

    @property
    def description(self) -> str:
        try:
            level, threads = simd_level(), threads_line()
            amx = cpu_module().amx_unavailable_reason()
        except (ImportError, ValueError) as e:
            level, threads, amx = f"? ({e})", f"{torch.get_num_threads()} threads", ""
        no_amx = f" (amx level unavailable: {amx})" if amx else ""
        return (f"compiled C++ kernel (pybind11), SIMD {level}{no_amx}, {threads}; K read once per GQA group, "
                f"only kept-union V rows read (docs/cpu.md)")

    def unavailable_reasons(self) -> list[str]:
        return list(_verdict()[0])

    def forward(self, inputs: DecodeInputs, out: torch.Tensor, stats: Optional[DecodeStats]) -> None:
        args = kernel_args(inputs, out, stats)
        self.last_counters = cpu_module().decode(args, args["simd_level"])
        self._row_bytes = inputs.head_dim * inputs.query.element_size()

    def bench_counters(self) -> dict:
        """Rows the last call read, as bytes (bench/harness.py compares them with the bytes
        expected from the inputs): ``k_bytes`` (every valid K row once per KV group),
        ``v_bytes`` (the kept-union V rows of P.V); plus the raw counters."""
        c = self.last_counters
        if c is None:
            return {}
        r = self._row_bytes
        return {"k_bytes": c["k_rows"] * r, "v_bytes": c["v_rows"] * r, "v_mean_bytes": c["v_mean_rows"] * r,
                "items": c["items"], "splits_max": c["splits_max"], "threads": c["threads"], "simd": c["simd"],
                "runtime": c["runtime"]}


BACKENDS = [CpuBackend()]
