"""Reports of the CPU decode benchmark: the table, the issue-11 targets, CSV and plot, and
the entry point ``topth-ops bench --device cpu`` (``--cases cpu`` / ``cpu-quick``)."""

from __future__ import annotations

import csv
import datetime
import math
import os
import platform
from dataclasses import asdict

import torch

from .cpu import CpuRow, run_shape
from .cpu_cases import CPU_SHAPE_SETS, FRACTIONS


def _ms(x: float) -> str:
    return "-" if x != x else (f"{x:.2f}" if x < 100 else f"{x:.0f}")


def format_cpu_table(rows: list[CpuRow]) -> str:
    """One line per shape: dense times (ms), the kernel's dense mode vs SDPA, and at each f
    the speedup over the best dense variant with the bound 2 / (1 + f_union) in brackets."""
    shapes = list(dict.fromkeys(r.shape for r in rows))
    head = (f"{'shape':<26} {'sdpa':>7} {'sdpa-exp':>8} {'vllm':>6} {'cpu-dense':>9} {'x sdpa':>6} | "
            + " ".join(f"{'f=' + format(f, 'g'):>13}" for f in FRACTIONS) + "  best dense")
    lines = [head, "-" * len(head)]
    for s in shapes:
        by = {r.variant: r for r in rows if r.shape == s}
        bad = by.get("*")
        if bad is not None:
            lines.append(f"{s:<26} {bad.status.upper()}: {bad.reason}")
            continue
        t = lambda name: by[name].time_ms if name in by else float("nan")  # noqa: E731
        dense = by["cpu-dense"]
        cells = []
        for f in FRACTIONS:
            r = by.get(f"cpu f={f:g}")
            cells.append(f"{r.speedup_vs_best_dense:5.2f}x ({r.bound:4.2f})" if r and r.status == "ok" else "-")
        lines.append(f"{s:<26} {_ms(t('sdpa')):>7} {_ms(t('sdpa-expanded')):>8} {_ms(t('vllm-cpu')):>6} "
                     f"{_ms(dense.time_ms):>9} {dense.speedup_vs_sdpa:5.2f}x | "
                     + " ".join(f"{c:>13}" for c in cells) + f"  {dense.best_dense}")
    lines.append("")
    lines.append("times in ms (median of interleaved rounds); f=...: speedup over the best dense variant of the shape "
                 "(bound 2/(1+f_union) in brackets)")
    skipped = {r.variant: r.reason for r in rows if r.status == "skipped"}
    for name, reason in skipped.items():
        lines.append(f"{name} skipped: {reason}")
    return "\n".join(lines)


def cpu_targets(rows: list[CpuRow]) -> list[tuple[str, bool, str]]:
    """Issue 11's targets on the rows present: dense mode >= 1.0x SDPA (every shape);
    f = 0.1 >= 1.5x and f = 0.3 >= 1.25x over the best dense variant at S >= 8k."""
    ok = [r for r in rows if r.status == "ok"]
    out = []
    dense = [r for r in ok if r.variant == "cpu-dense" and r.speedup_vs_sdpa == r.speedup_vs_sdpa]
    if dense:
        worst = min(dense, key=lambda r: r.speedup_vs_sdpa)
        n_ok = sum(r.speedup_vs_sdpa >= 1.0 for r in dense)
        out.append(("dense mode >= 1.0x torch SDPA decode", n_ok == len(dense),
                    f"{n_ok}/{len(dense)} shapes; worst {worst.speedup_vs_sdpa:.2f}x ({worst.shape})"))
    for f, need in ((0.1, 1.5), (0.3, 1.25)):
        sel = [r for r in ok if r.variant == f"cpu f={f:g}" and r.seq_len >= 8192]
        if sel:
            worst = min(sel, key=lambda r: r.speedup_vs_best_dense)
            n_ok = sum(r.speedup_vs_best_dense >= need for r in sel)
            gm = math.exp(sum(math.log(r.speedup_vs_best_dense) for r in sel) / len(sel))
            out.append((f"f={f:g} >= {need}x over the best dense at S >= 8k", n_ok == len(sel),
                        f"{n_ok}/{len(sel)} shapes; geometric mean {gm:.2f}x; worst {worst.speedup_vs_best_dense:.2f}x "
                        f"({worst.shape}, bound {worst.bound:.2f})"))
    return out


def write_cpu_csv(rows: list[CpuRow], path: str) -> None:
    names = list(CpuRow.__dataclass_fields__)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=names)
        w.writeheader()
        for r in rows:
            d = asdict(r)
            d["times_ms"] = " ".join(str(t) for t in r.times_ms)
            w.writerow(d)


def plot_cpu(rows: list[CpuRow], path: str, title: str) -> bool:
    """Speedup over the best dense variant against f_union (with the bound), and the dense
    mode's speedup over SDPA per shape. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in rows if r.status == "ok"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.2))
    for S, marker in ((2048, "o"), (8192, "s"), (32768, "^")):
        for dt, color in (("bf16", "tab:blue"), ("fp32", "tab:orange")):
            pts = [(r.kept_union_frac, r.speedup_vs_best_dense) for r in ok
                   if r.kind == "topth" and r.seq_len == S and r.dtype == dt]
            if pts:
                ax1.scatter(*zip(*pts), marker=marker, color=color, alpha=0.6, s=22, label=f"S={S} {dt}")
    fs = [i / 100 for i in range(2, 101)]
    ax1.plot(fs, [2 / (1 + f) for f in fs], "k--", lw=1, label="bound 2/(1+f)")
    ax1.axhline(1.0, color="gray", lw=0.6)
    ax1.set_xlabel("kept V-row fraction f (union over the KV group)")
    ax1.set_ylabel("speedup over the best dense variant")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    dense = [r for r in ok if r.variant == "cpu-dense" and r.speedup_vs_sdpa == r.speedup_vs_sdpa]
    ax2.bar(range(len(dense)), [r.speedup_vs_sdpa for r in dense], color="tab:green")
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_xticks(range(len(dense)))
    ax2.set_xticklabels([r.shape for r in dense], rotation=70, ha="right", fontsize=6)
    ax2.set_ylabel("cpu dense mode / torch SDPA (GQA)")
    ax2.set_yscale("log")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def machine_line() -> str:
    """CPU model, CPU count, torch version and thread count."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}; {os.cpu_count()} CPUs; torch {torch.__version__}, {torch.get_num_threads()} threads"


def _load() -> str:
    return f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "?"


def run_cpu(set_name: str, out_dir: str, *, min_reps: int, max_reps: int, baselines: bool, progress=print) -> int:
    """Run one CPU shape set, print and write the table, targets, CSV and plot. Returns the exit
    status: 1 when a shape fails its checks, else 0."""
    from topth_ops.backends import cpu as cpu_backend

    shapes = CPU_SHAPE_SETS[set_name]
    os.makedirs(out_dir, exist_ok=True)
    header = [f"date: {datetime.datetime.now().isoformat(timespec='seconds')}", f"machine: {machine_line()}",
              f"load average (1 min) at start: {_load()}", f"kernel: backend cpu, SIMD {cpu_backend.simd_level()}",
              f"shapes: {set_name} ({len(shapes)}); pre_softmax; timing: wall clock, interleaved rounds, median"]
    for line in header:
        progress(line)
    rows: list[CpuRow] = []
    for i, shape in enumerate(shapes):
        new = run_shape(shape, min_reps=min_reps, max_reps=max_reps, baselines=baselines)
        rows += new
        d = next((r for r in new if r.variant == "cpu-dense"), new[0])
        f1 = next((r for r in new if r.variant == "cpu f=0.1"), None)
        progress(f"  [{i + 1}/{len(shapes)}] {shape.name:<26} {d.status:<7} dense {_ms(d.time_ms)} ms "
                 f"x sdpa {d.speedup_vs_sdpa:.2f}  f=0.1 x best {f1.speedup_vs_best_dense if f1 else float('nan'):.2f} "
                 f"({len(d.times_ms)} rounds) {d.reason}")
    table = format_cpu_table(rows)
    targets = cpu_targets(rows)
    summary = "\n".join(header + [f"load average (1 min) at end: {_load()}", "", table, ""] +
                        [f"target {'PASS' if ok else 'FAIL'}: {name}: {detail}" for name, ok, detail in targets])
    progress("\n" + summary)
    with open(os.path.join(out_dir, "summary.txt"), "w") as fh:
        fh.write(summary + "\n")
    write_cpu_csv(rows, os.path.join(out_dir, "bench_cpu.csv"))
    plotted = plot_cpu(rows, os.path.join(out_dir, "bench_cpu.png"),
                       title=f"topth-ops cpu kernel vs dense CPU decode; {machine_line()}")
    progress(f"wrote {out_dir}/summary.txt, bench_cpu.csv" + (", bench_cpu.png" if plotted else ""))
    return 1 if any(r.status in ("wrong", "error") for r in rows) else 0
