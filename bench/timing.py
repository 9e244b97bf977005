"""Timing and devices of the benchmark: ``triton.testing.do_bench`` on cuda (also replayed
from a CUDA graph), ``torch.npu.Event`` with an L2 flush on npu, the wall clock on the CPU;
device names and resolution of ``--device``."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import torch

L2_FLUSH_BYTES = 256 << 20
"""Buffer zeroed before each timed NPU run (Ascend 910B L2: 192 MB), as do_bench does on CUDA."""


def timing_method(device: torch.device) -> str:
    """How :func:`time_fn` times on ``device`` (recorded in every row)."""
    if device.type == "cuda":
        return "cuda (triton.testing.do_bench median, L2 flushed)"
    if device.type == "npu":
        return "npu (torch.npu.Event median after warm-up, L2 flushed)"
    return f"{device.type} wall clock median (NOT meaningful for GPU/NPU kernels)"


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize()


def time_fn(fn: Callable[[], None], device: torch.device, *, reps: int, budget_ms: float) -> float:
    """Median time of one call of ``fn``, in ms.

    Parameters
    ----------
    fn : callable
        Runs the variant once (asynchronously on an accelerator).
    device : torch.device
        cuda: ``triton.testing.do_bench`` (warm-up ``budget_ms / 4``, repetitions for
        ``budget_ms``, L2 flushed, median). npu: :func:`_time_npu` (device events, same
        scheme). cpu: wall clock of ``reps`` calls, median.
    reps : int
        Repetitions on the CPU; the least number of timed runs on npu.
    budget_ms : float
        Time budget of the timed runs on cuda and npu.
    """
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=max(5.0, budget_ms / 4), rep=budget_ms,
                                             return_mode="median"))
    if device.type == "npu":
        return _time_npu(fn, device, reps=reps, budget_ms=budget_ms)
    times = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_cuda_graph(fn: Callable[[], None], *, budget_ms: float) -> tuple[float, str]:
    """Median time of ``fn`` replayed from a CUDA graph (``triton.testing.do_bench``, L2
    flushed), in ms, and "" ; or (nan, reason) when ``fn`` cannot be captured."""
    import triton.testing

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm: compile, allocate, cache occupancy outside the capture
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(graph.replay, warmup=max(5.0, budget_ms / 4), rep=budget_ms,
                                     return_mode="median")
        return float(ms), ""
    except Exception as e:  # noqa: BLE001 - report it in the row, keep the plain timing
        torch.cuda.synchronize()
        return float("nan"), f"{type(e).__name__}: {e}"[:160]


def _time_npu(fn: Callable[[], None], device: torch.device, *, reps: int, budget_ms: float,
              max_reps: int = 1000) -> float:
    """Median device time of ``fn`` on the current NPU stream, in ms (torch.npu.Event).

    Five calls estimate the time per call; warm-up continues to ``budget_ms / 4``; then
    ``n = clamp(budget_ms / estimate, reps, max_reps)`` runs are timed, each between its own
    pair of events, with :data:`L2_FLUSH_BYTES` zeroed before it (outside the events) so
    that no run finds the caches in L2. Events are read after one final synchronisation.
    """
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)
    synchronize(device)
    start, end = torch.npu.Event(enable_timing=True), torch.npu.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    end.synchronize()
    est = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(int(budget_ms / 4 / est)):
        fn()
    n = int(min(max_reps, max(reps, budget_ms / est)))
    starts = [torch.npu.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.npu.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def resolve_device(spec: Optional[str] = None) -> torch.device:
    """The benchmark device: ``spec`` ("cpu", "cuda[:i]", "npu[:i]") or, when None, cuda if
    available, else npu if torch_npu sees one, else cpu.

    Raises
    ------
    RuntimeError
        ``spec`` names npu and torch_npu is not importable or sees no NPU, or cuda without one.
    """
    if spec is None:
        if torch.cuda.is_available():
            return torch.device("cuda")
        try:
            import torch_npu  # noqa: F401

            if torch.npu.is_available():
                return torch.device("npu")
        except Exception:  # noqa: BLE001 - no usable torch_npu: not an NPU machine
            pass
        return torch.device("cpu")
    if spec.split(":")[0] == "npu":
        try:
            import torch_npu  # noqa: F401 - registers the "npu" device type
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"--device npu needs torch_npu ({type(e).__name__}: {e})") from e
        if not torch.npu.is_available():
            raise RuntimeError("--device npu: torch_npu sees no Ascend NPU")
    elif spec.split(":")[0] == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device")
    return torch.device(spec)


def device_name(device: torch.device) -> str:
    """Human-readable device name (GPU / NPU model, or the device type)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "npu":
        return torch.npu.get_device_name(device.index or 0)
    return device.type


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "npu":
        torch.npu.empty_cache()
