"""``topth-ops bench`` / ``python -m topth_ops.bench``: the kernel benchmark.

Writes ``bench.csv``, ``bench.png`` and ``summary.txt`` into ``--out`` and prints the table
(and, when a backend counts bytes, the counted vs expected bytes). Exit status: 0; 1 when a
variant is wrong (output, stats or counted bytes) or fails, or ``--check-targets`` misses a
target; 2 for a bad argument or a device that is not there; 130 when interrupted.

Examples::

    topth-ops bench --device cpu                                       # CPU kernel vs dense CPU decode
    topth-ops bench --cases quick                                      # CPU, seconds
    topth-ops bench --cases h200 --check-targets                       # one H200
    topth-ops bench --device npu --cases npu --backends ascendc        # Ascend, vs IFA
    topth-ops bench --backends ascendc-cpu --cases bytes --no-baselines  # CPU-model bytes
    topth-ops bench --compile-report                                   # static sm_90 report, no GPU
"""

from __future__ import annotations

import argparse
import datetime
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", default=None,
                        help="case sets, comma-separated: quick (CPU, seconds), h200 (the GPU targets), "
                             "npu (the Ascend targets), bytes (GM->UB bytes on the ascendc-cpu model); or one of "
                             "cpu (the CPU kernel against dense CPU decode; about 15 min on 2 cores) and "
                             "cpu-quick (its runner in seconds). Default: cpu with --device cpu, else quick")
    parser.add_argument("--backends", default=None,
                        help="comma-separated registry backends to time (default: every backend that "
                             "runs on the device)")
    parser.add_argument("--device", default=None,
                        help="cuda, npu or cpu (default: cuda if available, else npu if torch_npu sees one, else cpu)")
    parser.add_argument("--no-baselines", action="store_true", help="skip the dense baselines")
    parser.add_argument("--reps", type=int, default=None,
                        help="repetitions on the CPU (median; default 5); with --cases cpu: the most interleaved "
                             "rounds per shape (default 50; rounds fill about 12 s per shape, at least 3)")
    parser.add_argument("--budget-ms", type=float, default=200.0,
                        help="time budget per measurement on cuda (triton do_bench rep) and npu")
    parser.add_argument("--copy-mib", type=int, default=None,
                        help="size of the device-copy bandwidth probe in MiB (default 2048 on cuda/npu, 64 on "
                             "cpu; 0: none)")
    parser.add_argument("--out", default=None,
                        help="output folder (default bench/results/<date>-<device>)")
    parser.add_argument("--compile-report", action="store_true",
                        help="instead of timing: compile every production Triton kernel variant for sm_90 "
                             "(no GPU needed) and print registers, spills, shared memory, CTAs per SM, programs "
                             "vs resident slots for the h200 cases and how V is loaded; exit 1 if a gate fails "
                             "(docs/triton.md)")
    parser.add_argument("--check-targets", action="store_true",
                        help="exit 1 unless the speed targets of the cases run are met (h200, npu sets)")


def _default_backends(device) -> list[str]:
    from topth_ops.registry import list_backends

    names = []
    for b in list_backends():
        if b.unavailable_reasons():
            continue
        if any(d.type == device.type for d in b.devices()):
            names.append(b.name)
    return names


def _run_cpu(args: argparse.Namespace) -> int:
    """The CPU comparison (bench/cpu.py): the cpu backend at each f, its dense mode and the dense
    CPU baselines, interleaved per shape; --reps caps the rounds per shape (at least 3)."""
    from topth_ops.cli import CliError
    from topth_ops.registry import get_backend

    from .cpu_report import run_cpu

    if args.device not in (None, "cpu"):
        raise CliError(f"--cases {args.cases} runs on the CPU, got --device {args.device}")
    if args.backends not in (None, "cpu"):
        raise CliError(f"--cases {args.cases} times the backend cpu only, got --backends {args.backends}")
    reasons = get_backend("cpu").unavailable_reasons()
    if reasons:
        raise CliError(f"--cases {args.cases}: backend 'cpu' is unavailable: {'; '.join(reasons)}")
    out_dir = args.out or os.path.join("bench", "results", f"{datetime.date.today().isoformat()}-cpu-{args.cases}")
    max_reps = args.reps if args.reps is not None else 50
    return run_cpu(args.cases, out_dir, min_reps=min(3, max_reps), max_reps=max_reps,
                   baselines=not args.no_baselines)


def compile_report(json_path=None) -> int:
    """``python -m topth_ops.bench.compile_report`` in a subprocess without TRITON_INTERPRET
    (the interpreter has no compiler; Triton binds the mode when the kernels are imported)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "topth_ops.bench.compile_report"] + (["--json", json_path] if json_path else [])
    return subprocess.run(cmd, env=env).returncode


def run(args: argparse.Namespace) -> int:
    if args.compile_report:
        if args.out:
            os.makedirs(args.out, exist_ok=True)
        return compile_report(os.path.join(args.out, "compile_report.json") if args.out else None)
    import torch

    from topth_ops.cli import CliError

    from .cases import CASE_SETS
    from .cpu_cases import CPU_SHAPE_SETS
    from .harness import fill_speedups, run_cases
    from .report import check_targets, format_bytes_table, format_table, plot, write_csv
    from .rows import FAILED_STATUSES
    from .timing import device_name, resolve_device, timing_method
    from .variants import DENSE_VARIANTS, BackendVariant

    if args.reps is not None and args.reps < 1:
        raise CliError(f"--reps must be >= 1, got {args.reps}")
    if args.cases is None:
        args.cases = "cpu" if args.device == "cpu" else "quick"
    if args.cases in CPU_SHAPE_SETS:
        return _run_cpu(args)
    if args.reps is None:
        args.reps = 5
    if not args.budget_ms > 0:
        raise CliError(f"--budget-ms must be > 0, got {args.budget_ms}")
    cases = []
    for name in args.cases.split(","):
        if name not in CASE_SETS:
            raise CliError(f"--cases must name sets from {sorted(CASE_SETS)}, got {name!r}")
        cases += CASE_SETS[name]
    try:
        device = resolve_device(args.device)
    except RuntimeError as e:
        raise CliError(str(e)) from e
    backends = args.backends.split(",") if args.backends else _default_backends(device)
    try:
        variants = [BackendVariant(b) for b in backends]
    except ValueError as e:  # unknown backend name
        raise CliError(f"--backends: {e}") from e
    if not args.no_baselines:
        variants += [cls() for cls in DENSE_VARIANTS]
    copy_mib = args.copy_mib if args.copy_mib is not None else (64 if device.type == "cpu" else 2048)

    dev_label = device_name(device).replace(" ", "-")
    out_dir = args.out or os.path.join(
        "bench", "results", f"{datetime.date.today().isoformat()}-{dev_label}")
    os.makedirs(out_dir, exist_ok=True)
    print(f"device: {device_name(device)}; timing: {timing_method(device)}")
    if device.type == "cpu":
        print("NOTE: absolute times on the CPU are not meaningful for GPU/NPU kernels (the Triton "
              "interpreter and the Ascend C CPU model are orders of magnitude slower than the "
              "hardware); the CPU run checks the harness, the outputs and counted bytes.")
    print(f"backends: {', '.join(backends) or '(none)'}; cases: {len(cases)}")

    def progress(row):
        t = "-" if row.time_ms != row.time_ms else f"{row.time_ms:.4f} ms"
        print(f"  {row.case:<28} {row.variant:<13} {row.status:<11} {t} {row.reason}", flush=True)

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
    bytes_table = format_bytes_table(rows)
    targets = check_targets(rows)
    lines = [f"device: {device_name(device)}", f"timing: {timing_method(device)}",
             f"torch {torch.__version__}"] + (["INTERRUPTED: partial results"] if interrupted else []) + ["", table, ""]
    if bytes_table:
        lines += [bytes_table, ""]
    from .ascendc_counters import format_pipe_table  # the Ascend C model's pipe counters, if any

    pipe_table = format_pipe_table(rows)
    if pipe_table:
        lines += [pipe_table, ""]
    for name, ok, detail in targets:
        lines.append(f"target {'PASS' if ok else 'FAIL'}: {name}: {detail}")
    summary = "\n".join(lines)
    print()
    print(summary)
    write_csv(rows, os.path.join(out_dir, "bench.csv"))
    with open(os.path.join(out_dir, "summary.txt"), "w") as fh:
        fh.write(summary + "\n")
    title = f"topth-ops decode benchmark on {device_name(device)}"
    if device.type == "cpu":
        title += " (CPU: times not meaningful for accelerators)"
    plotted = plot(rows, os.path.join(out_dir, "bench.png"), title=title)
    print(f"\nwrote {out_dir}/bench.csv, summary.txt" + (", bench.png" if plotted else " (no matplotlib: no PNG)"))
    if interrupted:
        return 130
    if any(r.status in FAILED_STATUSES for r in rows):
        print(f"some variants are {'/'.join(FAILED_STATUSES)} (see the reason column)")
        return 1
    if args.check_targets and not targets:
        print(f"--check-targets: the case sets {args.cases!r} define no targets (the h200 and npu sets do)")
        return 1
    if args.check_targets and not all(ok for _, ok, _ in targets):
        print("--check-targets: some targets were missed (see the target lines above)")
        return 1
    return 0
