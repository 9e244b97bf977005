"""Benchmark output: CSV, the text tables (times and speedups; counted bytes), the
speed-target verdicts and the plot."""

from __future__ import annotations

import csv
import math
from dataclasses import asdict

from .rows import Row

def write_csv(rows: list[Row], path) -> None:
    names = list(asdict(rows[0]).keys()) if rows else [f.name for f in Row.__dataclass_fields__.values()]
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=names)
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))


def _fmt(x, spec):
    if isinstance(x, float) and math.isnan(x):
        width = "".join(ch for ch in spec.split(".")[0] if ch.isdigit())
        return "-".rjust(int(width or 1))
    return format(x, spec)


def format_table(rows: list[Row]) -> str:
    """The main table: one line per row (status, union fraction, time, GB/s, speedups,
    bound, max abs error, reason); on CUDA also the CUDA-graph time and the speedup over
    the best external dense baseline from graph times."""
    graphs = any(r.time_graph_ms == r.time_graph_ms for r in rows)
    gh = f" {'graph_ms':>9} {'x best g':>8}" if graphs else ""
    head = (f"{'case':<30} {'variant':<13} {'status':<11} {'f_union':>7} {'time_ms':>9} {'GB/s':>8} "
            f"{'x dense':>7} {'x best':>7}{gh} {'bound':>6} {'err':>8}  reason")
    lines = [head, "-" * len(head)]
    for r in rows:
        g = (f" {_fmt(r.time_graph_ms, '9.4f')} {_fmt(r.speedup_graph_vs_best_dense, '8.2f')}" if graphs else "")
        lines.append(
            f"{r.case:<30} {r.variant:<13} {r.status:<11} {_fmt(r.kept_union_frac, '7.3f')} "
            f"{_fmt(r.time_ms, '9.4f')} {_fmt(r.gbps, '8.1f')} {_fmt(r.speedup_vs_dense, '7.2f')} "
            f"{_fmt(r.speedup_vs_best_dense, '7.2f')}{g} {_fmt(r.bound, '6.2f')} "
            f"{_fmt(r.max_abs_err, '8.2g')}  {r.reason}"
        )
    if rows and any(r.best_dense_variant for r in rows):
        lines.append("x best: vs the fastest dense baseline other than our own dense mode "
                     "(FlashInfer with / without tensor cores, flash-attn, SDPA, IFA: whichever ran)")
    return "\n".join(lines)


def format_bytes_table(rows: list[Row]) -> str:
    """Counted vs expected GM -> UB bytes of the rows whose backend counts them (empty
    string when none does): K, V (and V as a fraction of all valid V rows, against the
    requested f), workspace, the traffic bound (K + V_dense) / (K + V) from the counted
    bytes, and the check."""
    counted = [r for r in rows if r.bytes_check]
    if not counted:
        return ""
    n = lambda x: "-" if x is None else str(x)  # noqa: E731
    head = (f"{'case':<30} {'variant':<12} {'f':>5} {'K bytes':>10} {'K exp.':>10} {'V bytes':>10} "
            f"{'V exp.':>10} {'V/Vdense':>8} {'ws bytes':>9} {'ws exp.':>9} {'bound':>6}  check")
    lines = ["GM -> UB bytes counted by the backend vs expected from the inputs and the reference's v_rows",
             head, "-" * len(head)]
    for r in counted:
        vfrac = bound = float("nan")
        if r.v_bytes is not None and r.k_bytes_expected:
            vfrac = r.v_bytes / r.k_bytes_expected  # V_dense = every valid V row = the K rows
            if r.k_bytes is not None:
                bound = 2 * r.k_bytes_expected / (r.k_bytes + r.v_bytes)
        lines.append(f"{r.case:<30} {r.variant:<12} {r.kept_frac:>5.2f} {n(r.k_bytes):>10} {n(r.k_bytes_expected):>10} "
                     f"{n(r.v_bytes):>10} {n(r.v_bytes_expected):>10} {_fmt(vfrac, '8.3f')} {n(r.ws_bytes):>9} "
                     f"{n(r.ws_bytes_expected):>9} {_fmt(bound, '6.2f')}  {r.bytes_check}")
    return "\n".join(lines)


def check_targets(rows: list[Row]) -> list[tuple[str, bool, str]]:
    """The speed targets, evaluated on the rows present. Issue 13 (``h200`` set): Triton
    dense mode >= 85% of copy bandwidth; pre_softmax f=0.1 >= 1.6x and f=0.3 >= 1.4x over
    the **best external dense baseline** (FlashInfer with / without tensor cores,
    flash-attn, SDPA: the fastest that ran), from CUDA-graph times where both sides have
    one (launch overhead excluded, as in a serving engine), else from plain times. Issue 5
    (``npu`` set): ``ascendc`` at f=0.1, 32k, batch 1, fp16 pre_softmax >= 1.5x vs dense
    IFA. Returns (target, passed, detail) for each target with data."""
    out = []
    copy = next((r for r in rows if r.kind == "copy" and r.status == "ok"), None)
    get = lambda case, var: next((r for r in rows if r.case == case and r.variant == var and r.status == "ok"), None)  # noqa: E731
    dense = get("h200-pre-f0.1", "triton-dense")
    if copy is not None and dense is not None:
        t = dense.time_graph_ms if dense.time_graph_ms == dense.time_graph_ms else dense.time_ms
        gbps = dense.bytes / (t * 1e-3) / 1e9
        frac = gbps / copy.gbps
        out.append(("dense mode >= 85% of copy bandwidth", frac >= 0.85,
                    f"{gbps:.0f} GB/s vs copy {copy.gbps:.0f} GB/s = {100 * frac:.1f}%"))
    for case, need in (("h200-pre-f0.1", 1.6), ("h200-pre-f0.3", 1.4)):
        r = get(case, "triton")
        if r is None:
            continue
        graph = r.speedup_graph_vs_best_dense == r.speedup_graph_vs_best_dense
        x = r.speedup_graph_vs_best_dense if graph else r.speedup_vs_best_dense
        out.append((f"{case}: triton >= {need}x vs the best dense baseline ({r.best_dense_variant or '-'})",
                    x >= need, f"{x:.2f}x ({'CUDA graphs' if graph else 'plain launches'}; plain "
                    f"{r.speedup_vs_best_dense:.2f}x; vs own dense mode {r.speedup_vs_dense:.2f}x; bound "
                    f"{r.bound:.2f}x at f_union {r.kept_union_frac:.3f})"))
    r = get("npu-b1-pre-f0.1", "ascendc")
    if r is not None:
        out.append((f"npu-b1-pre-f0.1: ascendc >= 1.5x vs {r.dense_variant or 'dense'}", r.speedup_vs_dense >= 1.5,
                    f"{r.speedup_vs_dense:.2f}x (bound {r.bound:.2f}x, f_union {r.kept_union_frac:.3f}, "
                    f"vs best dense {r.speedup_vs_best_dense:.2f}x)"))
    return out


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def plot(rows: list[Row], path, *, title: str) -> bool:
    """PNG: speedup vs the dense baseline against the kept-union fraction, with the
    2/(1+f) bound; achieved GB/s per variant; and, when a backend counts bytes, counted V
    bytes / dense V bytes against f. Returns False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in rows if r.status == "ok"]
    counted = [r for r in rows if r.v_bytes is not None and r.k_bytes_expected]
    fig, axes = plt.subplots(1, 3 if counted else 2, figsize=(19 if counted else 13, 4.8))
    ax1, ax2 = axes[0], axes[1]
    for variant in sorted({r.variant for r in ok if r.kind == "topth"}):
        for placement, marker in (("pre_softmax", "o"), ("post_softmax", "s")):
            pts = sorted((r.kept_union_frac, r.speedup_vs_dense) for r in ok
                         if r.variant == variant and r.placement == placement and not math.isnan(r.speedup_vs_dense))
            if pts:
                ax1.plot(*zip(*pts), marker=marker, linestyle="", label=f"{variant} {placement}")
    fs = [i / 100 for i in range(1, 101)]
    ax1.plot(fs, [2 / (1 + f) for f in fs], "k--", lw=1, label="bound 2/(1+f)")
    ax1.set_xlabel("kept V-row fraction f (union over the KV group)")
    ax1.set_ylabel("speedup vs dense baseline")
    ax1.grid(alpha=0.3)
    _legend(ax1)
    cases = [c for c in dict.fromkeys(r.case for r in ok if r.kind != "copy")]
    variants = sorted({r.variant for r in ok if r.kind != "copy"})
    width = 0.8 / max(1, len(variants))
    for i, var in enumerate(variants):
        ys = [next((r.gbps for r in ok if r.case == c and r.variant == var), 0.0) for c in cases]
        ax2.bar([j + i * width for j in range(len(cases))], ys, width, label=var)
    copy = next((r for r in ok if r.kind == "copy"), None)
    if copy is not None:
        ax2.axhline(copy.gbps, color="k", ls="--", lw=1, label="device copy")
    ax2.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
    ax2.set_xticklabels(cases, rotation=60, ha="right", fontsize=6)
    ax2.set_ylabel("GB/s (bytes that must move / time)")
    _legend(ax2)
    if counted:
        ax3 = axes[2]
        for variant in sorted({r.variant for r in counted}):
            for placement, marker in (("pre_softmax", "o"), ("post_softmax", "s")):
                pts = sorted((r.kept_union_frac, r.v_bytes / r.k_bytes_expected) for r in counted
                             if r.variant == variant and r.placement == placement)
                if pts:
                    ax3.plot(*zip(*pts), marker=marker, linestyle="", label=f"{variant} {placement}")
        ax3.plot([0, 1], [0, 1], "k--", lw=1, label="V bytes = f x dense V bytes")
        ax3.set_xlabel("kept V-row fraction f (union over the KV group, reference stats)")
        ax3.set_ylabel("counted V bytes / dense V bytes")
        ax3.grid(alpha=0.3)
        _legend(ax3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
