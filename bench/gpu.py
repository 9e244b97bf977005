"""CUDA-only parts of the benchmark: the compiled kernels' registers and spills as the driver
reports them, and DRAM bytes read under Nsight Compute (CUDA-graph timing is
:func:`topth_ops.bench.timing.time_cuda_graph`).

``python -m topth_ops.bench.gpu resources``  registers / spills / shared memory of every
    Triton kernel variant the h200 target cases compile (run after the benchmark, or it
    runs the target cases once itself);
``python -m topth_ops.bench.gpu ncu``  DRAM bytes read (``dram__bytes_read.sum`` summed
    over the kernels of one call) by the thresholded op at f = 0.1 and by the dense
    kernels on the target shape, next to the bytes that must move; needs ``ncu`` on the
    PATH (Nsight Compute) and the permission to read GPU counters;
``python -m topth_ops.bench.gpu profile --case NAME --variant NAME``  the process that
    ``ncu`` profiles: a few warm-up calls, then one call inside the NVTX range "topth".
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import subprocess
import sys

import torch


def _case(name: str):
    from .cases import CASE_SETS

    for cases in CASE_SETS.values():
        for c in cases:
            if c.name == name:
                return c
    raise SystemExit(f"unknown case {name!r}")


def _variant(name: str):
    from .variants import DENSE_VARIANTS, BackendVariant

    for cls in DENSE_VARIANTS:
        if cls.name == name:
            return cls()
    return BackendVariant(name)


def resources(case_names=("h200-pre-f0.1", "h200-post-f0.1", "h200-pre-f0.1-paged16")) -> list[dict]:
    """Runs the triton backend and its dense mode once on each case, then lists every
    compiled variant of the Triton kernels with the driver's register and spill counts."""
    from topth_ops.cuda_kernels import attn_post, attn_pre, combine

    from .synth import make_case_inputs
    from .variants import TritonDenseVariant

    dev = torch.device("cuda")
    for name in case_names:
        ci = make_case_inputs(_case(name), dev)
        for var in (_variant("triton"), TritonDenseVariant()):
            if not var.reasons(ci):
                fn, _ = var.prepare(ci)
                fn()
        torch.cuda.synchronize()
    rows = []
    for mod, kname in ((attn_pre, "pre_kernel"), (attn_post, "post_scores_kernel"),
                       (attn_post, "post_select_kernel"), (combine, "combine_kernel")):
        kernel = getattr(mod, kname)
        for caches in kernel.device_caches.values():
            for compiled in caches[0].values():
                if hasattr(compiled, "result"):
                    compiled = compiled.result()
                compiled._init_handles()
                flags = {}
                try:  # constexprs of this variant, by name (ASTSource keys them by argument index)
                    names = compiled.src.fn.arg_names
                    for k, v in dict(compiled.src.constants).items():
                        flags[names[k[0]] if isinstance(k, tuple) else str(k)] = v
                except Exception:  # noqa: BLE001 - a kernel loaded from the cache has no source
                    pass
                rows.append(dict(kernel=kname, n_regs=compiled.n_regs, n_spills=compiled.n_spills,
                                 shared=compiled.metadata.shared, num_warps=compiled.metadata.num_warps,
                                 flags=", ".join(f"{k}={v}" for k, v in sorted(flags.items(), key=str)
                                                 if isinstance(v, (bool, int, str)))[:160]))
    return rows


def _ncu_bytes(case: str, variant: str) -> float:
    """dram__bytes_read.sum over the kernels launched inside the NVTX range "topth"."""
    cmd = ["ncu", "--csv", "--metrics", "dram__bytes_read.sum", "--nvtx", "--nvtx-include", "topth/",
           sys.executable, "-m", "topth_ops.bench.gpu", "profile", "--case", case, "--variant", variant]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    text = proc.stdout[proc.stdout.find('"ID"'):] if '"ID"' in proc.stdout else ""
    total, seen = 0.0, 0
    for row in csv.DictReader(io.StringIO(text)):
        if row.get("Metric Name") == "dram__bytes_read.sum":
            unit = (row.get("Metric Unit") or "byte").lower()
            scale = {"byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9}.get(unit, 1)
            total += float(row["Metric Value"].replace(",", "")) * scale
            seen += 1
    if not seen:
        raise RuntimeError(f"ncu returned no dram__bytes_read rows (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout)[-400:]}")
    return total


def ncu_report(cases=("h200-pre-f0.1", "h200-pre-f1"), variants=("triton", "triton-dense", "flashinfer",
                                                                  "flashinfer-tc", "flash-attn", "sdpa")) -> list[dict]:
    from .harness import reference_for
    from .synth import make_case_inputs
    from .traffic import must_move_bytes

    rows = []
    for case in cases:
        ci = make_case_inputs(_case(case), torch.device("cuda"))
        ref = reference_for(ci)
        for var in variants:
            v = _variant(var)
            if v.reasons(ci):
                continue
            v_rows = ref.v_rows_total if v.kind == "topth" else ref.valid_rows_total
            must = must_move_bytes(ci.inputs if v.kind == "topth" else ci.dense, v_rows)
            try:
                got = _ncu_bytes(case, var)
                rows.append(dict(case=case, variant=var, dram_read=got, must_move=must, ratio=got / must))
            except Exception as e:  # noqa: BLE001
                rows.append(dict(case=case, variant=var, error=str(e)[:200]))
    return rows


def _profile(case: str, variant: str) -> None:
    from .synth import make_case_inputs

    ci = make_case_inputs(_case(case), torch.device("cuda"))
    fn, _ = _variant(variant).prepare(ci)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.cuda.nvtx.range("topth"):
        fn()
    torch.cuda.synchronize()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m topth_ops.bench.gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("resources", "ncu", "profile"))
    parser.add_argument("--case", default="h200-pre-f0.1")
    parser.add_argument("--variant", default="triton")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gpu: needs a CUDA device", file=sys.stderr)
        return 2
    if args.what == "profile":
        _profile(args.case, args.variant)
        return 0
    if args.what == "resources":
        rows = resources()
        print(f"{'kernel':<22} {'regs':>4} {'spills':>6} {'smem':>7} {'warps':>5}  constexprs")
        for r in rows:
            print(f"{r['kernel']:<22} {r['n_regs']:>4} {r['n_spills']:>6} {r['shared']:>7} {r['num_warps']:>5}  "
                  f"{r['flags']}")
        return 1 if any(r["n_spills"] for r in rows) else 0
    if shutil.which("ncu") is None:
        print("bench.gpu ncu: Nsight Compute (ncu) is not on the PATH: no DRAM byte counts")
        return 0
    print(f"{'case':<16} {'variant':<14} {'DRAM read MB':>12} {'must move MB':>12} {'ratio':>6}")
    for r in ncu_report():
        if "error" in r:
            print(f"{r['case']:<16} {r['variant']:<14} error: {r['error']}")
        else:
            print(f"{r['case']:<16} {r['variant']:<14} {r['dram_read'] / 1e6:>12.1f} {r['must_move'] / 1e6:>12.1f} "
                  f"{r['ratio']:>6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
