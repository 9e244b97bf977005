"""NPU benchmark: the topth Ascend C kernel vs torch_npu's dense IncrementalFlashAttention.

For an Ascend machine (Atlas A2 / 910B, CANN + torch_npu, topth-ops installed with
ASCEND_HOME_PATH set so that topth_ops.npu_kernels._ascendc_npu is built; docs/ascendc.md).
NOT RUN IN THIS PROJECT'S CI: there is no Ascend hardware there; the kernel is verified on
the CPU model (tests/test_ascendc_cpu.py, backend ascendc-cpu).

Per case (BNSD caches, every sequence seq_len long, kept fraction f of the V rows planted as
in bench/ascendc_bytes.py, so that the kept set is known exactly):

1. correctness: the kernel's output and stats against the PyTorch reference on the same
   NPU tensors (stats exactly; output within the dtype tolerance);
2. timing (device events, warm-up then median of --iters): the kernel launched directly,
   the kernel through ``topth_ops.decode_attention(backend="ascendc")`` (custom-op path),
   and ``torch_npu.npu_incre_flash_attention`` (dense, BNSD, same shapes and scale);
3. speedup over dense IFA and effective bandwidth (K + kept V bytes per second).

The target of issue 5: >= 1.5x over dense IFA at f = 0.1 and 32k context (the traffic bound
is 2 / (1 + f) = 1.82x).

Usage::

    python bench/npu_bench.py [--cases default|quick] [--iters 50] [--out DIR]

Writes npu_bench.csv / .json (with date and device name) to DIR (default bench_results/).
Plugging into the shared harness (bench/harness.py): the ``ascendc`` backend is already a
``BackendVariant`` there; :class:`IfaVariant` below follows the harness's ``Variant``
protocol and is the dense NPU baseline to add to ``DENSE_VARIANTS``; the harness's
``time_fn`` would need an NPU branch timed with ``torch.npu.Event`` as :func:`_time` does.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

try:  # as a module of the merged bench package, or as a script next to ascendc_bytes.py
    from .ascendc_bytes import planted_inputs
except ImportError:  # pragma: no cover
    from ascendc_bytes import planted_inputs

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class NpuCase:
    name: str
    batch: int
    num_q_heads: int
    num_kv_heads: int
    seq_len: int
    head_dim: int
    kept_frac: float
    dtype: str = "fp16"
    placement: str = "pre_softmax"


def _sweep(prefix, fracs, placements=("pre_softmax",), **shape):
    return [NpuCase(f"{prefix}-{'pre' if p == 'pre_softmax' else 'post'}-f{f:g}", kept_frac=f, placement=p, **shape)
            for p in placements for f in fracs]


TARGET_32K = dict(batch=1, num_q_heads=32, num_kv_heads=8, seq_len=32768, head_dim=128)
CASES = {
    "quick": _sweep("s4k", (0.1, 1.0), batch=1, num_q_heads=8, num_kv_heads=2, seq_len=4096, head_dim=128),
    "default": (
        _sweep("s32k", (0.05, 0.1, 0.2, 0.5, 1.0), placements=("pre_softmax", "post_softmax"), **TARGET_32K)
        + _sweep("s32k-bf16", (0.1,), dtype="bf16", **TARGET_32K)
        + _sweep("b8-s32k", (0.1, 1.0), **dict(TARGET_32K, batch=8))
        + _sweep("b16-s8k-mha", (0.1,), batch=16, num_q_heads=8, num_kv_heads=8, seq_len=8192, head_dim=128)
    ),
}


class IfaVariant:
    """torch_npu.npu_incre_flash_attention over the caches (BNSD, GQA, actual lengths):
    the dense NPU baseline, in the shape of bench/harness.py's ``Variant``."""

    name = "npu-ifa"
    kind = "dense"

    def reasons(self, ci) -> list[str]:
        if ci.dense.device.type != "npu":
            return ["needs npu tensors"]
        if ci.dense.dtype not in (torch.float16, torch.bfloat16):
            return ["npu_incre_flash_attention takes float16 / bfloat16"]
        return []

    def prepare(self, ci):
        import torch_npu

        d = ci.dense
        q = d.query.unsqueeze(2).contiguous()  # BNSD query [B, N, 1, D]
        lens = [int(x) for x in d.seq_lens.cpu()]
        holder = {}

        def fn():
            holder["out"] = torch_npu.npu_incre_flash_attention(
                q, d.key_cache, d.value_cache, num_heads=d.num_q_heads, num_key_value_heads=d.num_kv_heads,
                input_layout="BNSD", scale_value=d.scale, actual_seq_lengths=lens)

        return fn, (lambda: holder["out"][:, :, 0])

    def counters(self) -> dict:
        return {}


def _time(fn, iters: int, warmup: int = 5) -> float:
    """Median device time of fn() in microseconds (torch.npu events)."""
    for _ in range(warmup):
        fn()
    torch.npu.synchronize()
    times = []
    for _ in range(iters):
        start = torch.npu.Event(enable_timing=True)
        end = torch.npu.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def time_case(c: NpuCase, iters: int) -> dict:
    import torch_npu  # noqa: F401

    import topth_ops
    from topth_ops.backends.ascendc import kernel_tensors, problem_shape
    from topth_ops.backends.torch_ref import reference_decode
    from topth_ops.conformance.compare import TOLERANCES
    from topth_ops.npu_kernels import _ascendc_npu

    dev = torch.device("npu")
    inputs, planted = planted_inputs(c.batch, c.num_q_heads, c.num_kv_heads, c.seq_len, c.head_dim, c.kept_frac,
                                     dtype=DTYPES[c.dtype], placement=c.placement, device=dev, seed=1)
    t = kernel_tensors(inputs)
    out, stats = inputs.empty_outputs(fill=float("nan"))
    shape = problem_shape(inputs)

    def ours():
        _ascendc_npu.run(t["query"], t["key_cache"], t["value_cache"], t["seq_lens"], t["thresholds"], None, None,
                         out, stats.kept, stats.v_rows, stats.dropped_mass, shape)

    # 1. correctness on the device
    ours()
    torch.npu.synchronize()
    ref_out, ref_stats = reference_decode(inputs)
    tol = TOLERANCES[inputs.dtype]
    ok_out = torch.allclose(out.float(), ref_out.float(), atol=tol["atol"], rtol=tol["rtol"])
    ok_stats = torch.equal(stats.kept.cpu(), ref_stats.kept.cpu()) and torch.equal(stats.v_rows.cpu(), ref_stats.v_rows.cpu())
    ok_planted = torch.equal(stats.v_rows.cpu().long(), planted)

    # 2. timing
    lens = [c.seq_len] * c.batch
    q4 = inputs.query.unsqueeze(2).contiguous()  # BNSD query: [B, N, 1, D]

    def dense_ifa():
        torch_npu.npu_incre_flash_attention(q4, inputs.key_cache, inputs.value_cache, num_heads=c.num_q_heads,
                                            num_key_value_heads=c.num_kv_heads, input_layout="BNSD",
                                            scale_value=inputs.scale, actual_seq_lengths=lens)

    def via_op():
        topth_ops.decode_attention(inputs.query, inputs.key_cache, inputs.value_cache, inputs.seq_lens,
                                   inputs.thresholds, scale=inputs.scale, placement=c.placement, backend="ascendc")

    t_ours = _time(ours, iters)
    t_op = _time(via_op, iters)
    t_ifa = _time(dense_ifa, iters)
    row_bytes = c.head_dim * inputs.query.element_size()
    k_bytes = c.batch * c.num_kv_heads * c.seq_len * row_bytes
    v_bytes = int(planted.sum()) * row_bytes
    return {
        **asdict(c),
        "ok_output": bool(ok_out), "ok_stats": bool(ok_stats), "ok_planted_v_rows": bool(ok_planted),
        "us_topth_kernel": t_ours, "us_topth_op": t_op, "us_dense_ifa": t_ifa,
        "speedup_vs_ifa": t_ifa / t_ours,
        "traffic_bound": 2 * k_bytes / (k_bytes + v_bytes),
        "topth_GBps": (k_bytes + v_bytes) / t_ours / 1e3,
        "ifa_GBps": 2 * k_bytes / t_ifa / 1e3,
        "tiling": json.dumps({k: v for k, v in _ascendc_npu.compute_tiling(shape, 0).items()
                              if k in ("blockDim", "splitNum", "tileK", "tileV", "ubTotal")}),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", choices=sorted(CASES), default="default")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="bench_results")
    args = p.parse_args(argv)
    try:
        import torch_npu  # noqa: F401

        from topth_ops.npu_kernels import _ascendc_npu  # noqa: F401
    except Exception as e:  # noqa: BLE001
        print(f"npu_bench needs an Ascend NPU with torch_npu and the _ascendc_npu extension: {e}", file=sys.stderr)
        return 2
    if not torch.npu.is_available():
        print("npu_bench: torch_npu sees no NPU", file=sys.stderr)
        return 2
    device = torch.npu.get_device_name(0)
    rows = []
    for c in CASES[args.cases]:
        r = time_case(c, args.iters)
        r["device"] = device
        r["date"] = datetime.datetime.now().isoformat(timespec="seconds")
        rows.append(r)
        print(f"{c.name:<22} ok={r['ok_output'] and r['ok_stats'] and r['ok_planted_v_rows']} "
              f"topth {r['us_topth_kernel']:8.1f} us (op {r['us_topth_op']:8.1f})  IFA {r['us_dense_ifa']:8.1f} us  "
              f"speedup {r['speedup_vs_ifa']:5.2f}x (bound {r['traffic_bound']:.2f}x)  "
              f"{r['topth_GBps']:7.1f} GB/s vs {r['ifa_GBps']:7.1f} GB/s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "npu_bench.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (out / "npu_bench.json").write_text(json.dumps(rows, indent=1))
    target = [r for r in rows if r["seq_len"] == 32768 and r["kept_frac"] == 0.1 and r["batch"] == 1
              and r["placement"] == "pre_softmax" and r["dtype"] == "fp16"]
    if target:
        s = target[0]["speedup_vs_ifa"]
        print(f"\ntarget (f = 0.1, 32k, pre_softmax, fp16): {s:.2f}x over dense IFA "
              f"({'meets' if s >= 1.5 else 'misses'} the 1.5x target)")
    failed = [r["name"] for r in rows if not (r["ok_output"] and r["ok_stats"] and r["ok_planted_v_rows"])]
    if failed:
        print(f"correctness failed for: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
