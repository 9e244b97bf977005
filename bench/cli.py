"""``topth-ops bench`` / ``python -m topth_ops.bench``: the kernel benchmark.

Writes ``bench.csv``, ``bench.png`` and ``summary.txt`` into ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", default="quick",
                        help="case set: quick (CPU, seconds), h200 (the GPU targets); comma-separated")
    parser.add_argument("--backends", default=None,
                        help="comma-separated registry backends to time (default: every backend that "
                             "runs on the device)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--no-baselines", action="store_true", help="skip the dense baselines")
    parser.add_argument("--reps", type=int, default=5, help="repetitions on the CPU (median)")
    parser.add_argument("--budget-ms", type=float, default=200.0,
                        help="time budget per measurement on CUDA (triton do_bench rep)")
    parser.add_argument("--copy-mib", type=int, default=None,
                        help="size of the device-copy bandwidth probe in MiB (default 2048 on CUDA, 64 on CPU)")
    parser.add_argument("--out", default=None,
                        help="output folder (default bench/results/<date>-<device>)")
    parser.add_argument("--check-targets", action="store_true",
                        help="exit 1 unless the H200 targets of the h200 case set are met")


def _default_backends(device) -> list[str]:
    from topth_ops.registry import list_backends

    names = []
    for b in list_backends():
        if b.unavailable_reasons():
            continue
        if any(d.type == device.type for d in b.devices()):
            names.append(b.name)
    return names


def run(args: argparse.Namespace) -> int:
    import torch

    from .cases import CASE_SETS
    from .harness import (DENSE_VARIANTS, BackendVariant, check_targets, fill_speedups, format_table,
                          plot, run_cases, timing_method, write_csv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cases = []
    for name in args.cases.split(","):
        if name not in CASE_SETS:
            print(f"--cases must name sets from {sorted(CASE_SETS)}, got {name!r}")
            return 2
        cases += CASE_SETS[name]
    backends = args.backends.split(",") if args.backends else _default_backends(device)
    variants = [BackendVariant(b) for b in backends]
    if not args.no_baselines:
        variants += [cls() for cls in DENSE_VARIANTS]
    copy_mib = args.copy_mib if args.copy_mib is not None else (2048 if device.type == "cuda" else 64)

    from .harness import device_name

    dev_label = device_name(device).replace(" ", "-")
    out_dir = args.out or os.path.join(
        "bench", "results", f"{datetime.date.today().isoformat()}-{dev_label}")
    os.makedirs(out_dir, exist_ok=True)
    print(f"device: {device_name(device)}; timing: {timing_method(device)}")
    if device.type != "cuda":
        print("NOTE: absolute times on the CPU are not meaningful for GPU/NPU kernels (the Triton "
              "interpreter is orders of magnitude slower than a GPU); the CPU run checks the "
              "harness and the outputs.")
    print(f"backends: {', '.join(backends) or '(none)'}; cases: {len(cases)}")

    def progress(row):
        t = "-" if row.time_ms != row.time_ms else f"{row.time_ms:.4f} ms"
        print(f"  {row.case:<28} {row.variant:<13} {row.status:<7} {t} {row.reason}", flush=True)

    rows: list = []
    interrupted = False
    try:
        run_cases(cases, variants, device, reps=args.reps, budget_ms=args.budget_ms,
                  copy_bytes=copy_mib << 20, progress=progress, rows=rows)
    except KeyboardInterrupt:  # e.g. `timeout -s INT`: keep what was measured
        interrupted = True
        fill_speedups(rows)
        print("\ninterrupted: writing the rows measured so far")
    if not rows:
        return 130
    table = format_table(rows)
    targets = check_targets(rows)
    lines = [f"device: {device_name(device)}", f"timing: {timing_method(device)}",
             f"torch {torch.__version__}"] + (["INTERRUPTED: partial results"] if interrupted else []) + ["", table, ""]
    for name, ok, detail in targets:
        lines.append(f"target {'PASS' if ok else 'FAIL'}: {name}: {detail}")
    summary = "\n".join(lines)
    print()
    print(summary)
    write_csv(rows, os.path.join(out_dir, "bench.csv"))
    with open(os.path.join(out_dir, "summary.txt"), "w") as fh:
        fh.write(summary + "\n")
    title = f"topth-ops decode benchmark on {device_name(device)}"
    if device.type != "cuda":
        title += " (CPU: times not meaningful for accelerators)"
    plotted = plot(rows, os.path.join(out_dir, "bench.png"), title=title)
    print(f"\nwrote {out_dir}/bench.csv, summary.txt" + (", bench.png" if plotted else " (no matplotlib: no PNG)"))
    if interrupted:
        return 130
    if any(r.status in ("wrong", "error") for r in rows):
        print("some variants gave wrong results or errors (see the reason column)")
        return 1
    if args.check_targets and (not targets or not all(ok for _, ok, _ in targets)):
        return 1
    return 0
