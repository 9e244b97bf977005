"""Terminal table and PNG plots of evaluation records."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Sequence

from .evaluate import TARGET_HE, TARGET_KTK, TARGET_LONG


def pct(x: float) -> str:
    """A relative change as "+1.23%", or "n/a" for None / NaN."""
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:+.2f}%"


def num(x, nd=3) -> str:
    """A number with ``nd`` decimals, or "n/a" for None / NaN."""
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _yn(x) -> str:
    return "-" if x is None else ("yes" if x else "no")


def format_table(records: Sequence[dict], dense: dict) -> str:
    """The result table printed by ``topth-ops evaluate`` (Markdown-compatible)."""
    head = ("| variant | k | ppl | Δppl | agree | V rows | V rows (layers at k) | kept | k~/k | "
            "k~/k min..max | long Δppl | long V rows | targets HE/long/k~ |")
    sep = "|" + "---|" * (head.count("|") - 1)
    lines = [head, sep,
             f"| dense | - | {dense['ppl']:.4f} | - | 1.000 | 1.000 | 1.000 | 1.000 | - | - | "
             f"{'-' if math.isnan(dense.get('long_ppl', float('nan'))) else format(dense['long_ppl'], '.4f') + ' (ppl)'} "
             f"| {'-' if math.isnan(dense.get('long_ppl', float('nan'))) else '1.000'} | - |"]
    for r in records:
        vals = [b["k_tilde_over_k"] for b in r["k_tilde_over_k_by_bucket"].values()]
        rng = f"{min(vals):.2f}..{max(vals):.2f}" if vals else "n/a"
        t = r["targets"]
        lines.append(
            f"| {r['variant']} | {r['k']} | {r['ppl']:.4f} | {pct(r['ppl_rel_change'])} | "
            f"{num(r['token_agreement'])} | {num(r['v_rows_frac'])} | {num(r['v_rows_frac_sparse_layers'])} | "
            f"{num(r['attn_kept_frac'])} | {num(r['k_tilde_over_k'], 2)} | {rng} | "
            f"{pct(r['long_ppl_rel_change'])} | {num(r['long_v_rows_frac'])} | "
            f"{_yn(t['humaneval'])}/{_yn(t['long_docs'])}/{_yn(t['k_tilde_over_k'])} |"
        )
    return "\n".join(lines)


def make_plots(records: Sequence[dict], out_dir: str) -> list[str]:
    """Write quality_vs_vrows.png and ktk_by_row_length.png; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    families = sorted({r["variant"] for r in records})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    panels = [
        (axes[0], "v_rows_frac", "ppl_rel_change", TARGET_HE,
         "HumanEval (decode V rows; teacher-forced ppl)"),
        (axes[1], "long_v_rows_frac", "long_ppl_rel_change", TARGET_LONG,
         "Long documents, rows >= 2048 tokens"),
    ]
    for ax, xk, yk, tgt, title in panels:
        for fam in families:
            rs = sorted((r for r in records if r["variant"] == fam and not math.isnan(r[xk])
                         and not math.isnan(r[yk])), key=lambda r: r["k"])
            if not rs:
                continue
            xs = [r[xk] for r in rs]
            ys = [100 * r[yk] for r in rs]
            ax.plot(xs, ys, marker="o", label=fam)
            for r, x, y in zip(rs, xs, ys):
                ax.annotate(f"k={r['k']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.axvline(tgt["v_rows_frac"], color="grey", ls="--", lw=0.8)
        ax.axhline(100 * tgt["ppl_rel_change"], color="grey", ls="--", lw=0.8)
        ax.plot([1.0], [0.0], marker="*", color="black", ms=10, label="dense")
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=0.1)
        ax.margins(x=0.08, y=0.12)  # room for the k= labels under the title
        ax.set_xlabel("V rows read / dense (union over GQA group, all layers)")
        ax.set_ylabel("perplexity change vs dense (%)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    p = str(Path(out_dir) / "quality_vs_vrows.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(8, 4.8))
    calib = None
    for r in records:
        if not r["variant"].startswith("topth"):
            continue
        bs = sorted(r["k_tilde_over_k_by_bucket"].values(), key=lambda b: b["hi"])
        if not bs:
            continue
        ax.plot([b["hi"] for b in bs], [b["k_tilde_over_k"] for b in bs], marker="o",
                label=f"{r['variant']} k={r['k']}")
        calib = r.get("calibration_max_row_id") or calib
    ax.axhspan(TARGET_KTK[0], TARGET_KTK[1], color="green", alpha=0.08, label=f"target [{TARGET_KTK[0]}, {TARGET_KTK[1]}]")
    ax.axhline(1.0, color="grey", lw=0.8)
    if calib:
        ax.axvline(calib, color="red", ls="--", lw=0.8, label=f"longest calibration row ({calib})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("row length n (bucket upper edge)")
    ax.set_ylabel("k~ / k (kept per head / target k)")
    ax.set_title("Top-Theta fidelity by row length (rows with n > k, thresholded layers)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    p = str(Path(out_dir) / "ktk_by_row_length.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


def group_vs_head(records: Sequence[dict], tolerance: float = 0.001) -> list[dict]:
    """Group selection against per-head selection: V rows read at the same k and at equal
    perplexity.

    For every group-selection record (family ``X-group``): the per-head record of family
    ``X`` at the same k (V-row ratio head / group and both perplexity changes), and every
    per-head record whose HumanEval perplexity change is within ``tolerance`` (0.001 = 0.1
    percentage points) of the group's ("equal perplexity"). No interpolation: measured
    perplexity is not monotone in k on small problem sets.

    Returns
    -------
    list of dict
        ``family``, ``k``, ``ppl_rel_change``, ``v_rows_frac``, ``same_k`` (``{ppl_rel_change,
        v_rows_frac, ratio}`` or None), ``pairs`` (``[{k, ppl_rel_change, v_rows_frac, ratio}]``).
    """
    out = []
    for g in records:
        fam = g["variant"]
        if not fam.endswith("-group"):
            continue
        heads = [r for r in records if r["variant"] == fam[: -len("-group")]]
        y = g["ppl_rel_change"]
        same = next((h for h in heads if h["k"] == g["k"]), None)
        pairs = [dict(k=h["k"], ppl_rel_change=h["ppl_rel_change"], v_rows_frac=h["v_rows_frac"],
                      ratio=h["v_rows_frac"] / g["v_rows_frac"])
                 for h in sorted(heads, key=lambda r: r["k"]) if abs(h["ppl_rel_change"] - y) <= tolerance]
        out.append(dict(family=fam, k=g["k"], ppl_rel_change=y, v_rows_frac=g["v_rows_frac"],
                        same_k=None if same is None else dict(ppl_rel_change=same["ppl_rel_change"],
                                                              v_rows_frac=same["v_rows_frac"],
                                                              ratio=same["v_rows_frac"] / g["v_rows_frac"]),
                        pairs=pairs))
    return out
