"""GM -> UB traffic of the Ascend C kernel, measured on the CPU model (backend ascendc-cpu).

Decode attention is memory-bound: the bytes a kernel moves bound its speed. The model
counts every byte each copy instruction moves from global memory into a vector core's
unified buffer, per buffer. This report runs the kernel on synthetic inputs whose kept V
rows are planted (a chosen fraction f of the positions of every KV group scores far above
the rest for all heads of the group, and the thresholds sit between), and shows

* K bytes = every valid K row once per KV group (independent of f);
* V bytes = (kept-union rows) x (row bytes), exactly, falling linearly with f;
* the traffic bound on the speedup over a dense kernel that reads K and V once:
  (K + V_dense) / (K + V_kept) = 2 / (1 + f) (design notes of the project);
* the extra workspace traffic of post_softmax (scores written and re-read, 8 bytes per
  query head and position) that pre_softmax does not have.

Usage::

    python bench/ascendc_bytes.py [--cases quick|default] [--out DIR]

Writes ascendc_bytes.csv / .json to DIR (default: bench_results/) and prints a table.
Exit status 1 if any measured byte count differs from the expected one. These are byte
counts of the kernel's copy instructions, not timings: the model says nothing about time.

Relation to the shared bench harness (bench/harness.py): ``topth-ops bench --backends
ascendc-cpu`` already runs this backend as a ``BackendVariant`` and records its
``bench_counters()`` (GM -> UB bytes, K / V / workspace split) in the ``counters`` column,
next to the other backends; its times there are CPU-model wall clock and mean nothing. This
script is the focused view: planted kept sets, so the expected bytes are known exactly and
checked.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class ByteCase:
    name: str
    batch: int
    num_q_heads: int
    num_kv_heads: int
    seq_len: int
    head_dim: int
    dtype: str = "fp16"
    placement: str = "pre_softmax"


CASES = {
    "quick": [ByteCase("gqa4-d128-s512", 1, 8, 2, 512, 128)],
    "default": [
        ByteCase("llama-gqa4-d128-s4096", 1, 8, 2, 4096, 128),
        ByteCase("llama-gqa4-d128-s4096-post", 1, 8, 2, 4096, 128, placement="post_softmax"),
        ByteCase("mha-d64-b2-s2048", 2, 4, 4, 2048, 64, dtype="bf16"),
        ByteCase("gqa8-d256-s2048-fp32", 1, 16, 2, 2048, 256, dtype="fp32"),
    ],
}
FRACTIONS = {"quick": (0.1, 0.5), "default": (0.05, 0.1, 0.2, 0.5, 1.0)}


def planted_inputs(batch, num_q_heads, num_kv_heads, seq_len, head_dim, kept_frac, *, dtype=torch.float16,
                   placement="pre_softmax", device="cpu", seed=0, lens=None):
    """Inputs in which exactly the planted positions are kept by every head.

    For every (sequence, KV group) a random set U of ``round(kept_frac * n)`` valid
    positions gets a key with a large component along the group's mean query direction, so
    its scores sit far above the others for all heads of the group; each head's threshold is
    halfway between (in logits for pre_softmax, in log-probabilities for post_softmax,
    taken over every sequence). Then kept = U for every head and the V rows a kernel must
    read are |U| per group.

    Returns
    -------
    (DecodeInputs, planted) : planted is a [batch, num_kv_heads] int64 tensor of |U|.
    """
    from topth_ops import make_inputs

    gen = torch.Generator().manual_seed(seed)
    G = num_q_heads // num_kv_heads
    q = torch.randn(batch, num_q_heads, head_dim, generator=gen)
    k = 0.25 * torch.randn(batch, num_kv_heads, seq_len, head_dim, generator=gen)
    v = torch.randn(batch, num_kv_heads, seq_len, head_dim, generator=gen)
    lens = list(lens) if lens is not None else [seq_len] * batch
    scale = 1.0 / math.sqrt(head_dim)
    planted_mask = torch.zeros(batch, num_kv_heads, seq_len, dtype=torch.bool)
    for b in range(batch):
        n = lens[b]
        keep = min(n, max(1, round(kept_frac * n))) if n > 0 else 0
        for g in range(num_kv_heads):
            qg = q[b, g * G:(g + 1) * G]
            direction = (qg / qg.norm(dim=-1, keepdim=True)).sum(0)
            direction = direction / direction.norm()
            idx = torch.randperm(n, generator=gen)[:keep]
            k[b, g, idx] += 16.0 * math.sqrt(head_dim) * direction / qg.norm(dim=-1).mean()
            planted_mask[b, g, idx] = True
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    # thresholds from the scores the kernel will see (inputs rounded to dtype), float64
    qd, kd = q.double(), k.double()
    th = torch.empty(num_q_heads, seq_len, dtype=torch.float64)
    for h in range(num_q_heads):
        g = h // G
        lo, hi = -math.inf, math.inf  # max over dropped, min over planted
        for b in range(batch):
            n = lens[b]
            if n == 0:
                continue
            a = scale * (kd[b, g, :n] @ qd[b, h])
            if placement == "post_softmax":
                a = a - torch.logsumexp(a, 0)
            m = planted_mask[b, g, :n]
            if (~m).any():
                lo = max(lo, a[~m].max().item())
            if m.any():
                hi = min(hi, a[m].min().item())
        if not lo < hi:
            raise RuntimeError(f"planted scores of head {h} do not separate ({lo} >= {hi}); lower kept_frac")
        mid = (lo + hi) / 2 if math.isfinite(lo) else hi - 1.0
        th[h, :] = math.exp(mid) if placement == "post_softmax" else mid
    seq = torch.tensor(lens, dtype=torch.int32)
    inputs = make_inputs(q.to(device), k.to(device), v.to(device), seq.to(device), th.float().to(device),
                         scale=scale, placement=placement, return_stats=True)
    return inputs, planted_mask.sum(-1)


def measure(inputs, target=None) -> dict:
    """Run the kernel on the CPU model; return its byte report (see run_cpu_model)."""
    from topth_ops.backends.ascendc import run_cpu_model

    out, stats = inputs.empty_outputs()
    rep = run_cpu_model(inputs, out, stats, target=target)
    rep["v_rows"] = stats.v_rows
    rep["kept"] = stats.kept
    return rep


def run(case_set: str = "default"):
    rows = []
    for c in CASES[case_set]:
        for f in FRACTIONS[case_set]:
            inputs, planted = planted_inputs(c.batch, c.num_q_heads, c.num_kv_heads, c.seq_len, c.head_dim, f,
                                             dtype=DTYPES[c.dtype], placement=c.placement, seed=hash(c.name) % 1000)
            rep = measure(inputs)
            row_bytes = c.head_dim * inputs.query.element_size()
            union_rows = int(planted.sum())
            valid_rows = c.batch * c.num_kv_heads * c.seq_len
            k_expected = valid_rows * row_bytes
            v_expected = union_rows * row_bytes
            dense = 2 * valid_rows * row_bytes
            ws = rep["buffers"].get("workspace", {}).get("gm_to_ub_bytes", 0)
            rows.append({
                **asdict(c), "kept_frac": f, "union_rows": union_rows,
                "v_rows_stat_ok": bool(torch.equal(rep["v_rows"], planted.to(torch.int32))),
                "k_bytes": rep["k_bytes"], "k_expected": k_expected,
                "v_bytes": rep["v_bytes"], "v_expected": v_expected,
                "v_fraction": rep["v_bytes"] / (valid_rows * row_bytes),
                "workspace_gm_to_ub": ws,
                "dense_kv_bytes": dense,
                "traffic_speedup_bound": dense / (rep["k_bytes"] + rep["v_bytes"]),
                "traffic_speedup_with_workspace": dense / (rep["k_bytes"] + rep["v_bytes"] + 2 * ws),
                "ub_peak": rep["ub_peak"], "block_dim": rep["block_dim"], "splits": rep["tiling"]["splitNum"],
            })
    return rows


def format_table(rows) -> str:
    hdr = (f"{'case':<28} {'f':>5} {'K bytes':>11} {'V bytes':>11} {'V exp.':>11} {'V/Vdense':>8} "
           f"{'ws bytes':>9} {'bound':>6} {'UB':>7} {'ok':>3}")
    lines = [hdr, "-" * len(hdr)]
    for r in rows:
        ok = r["k_bytes"] == r["k_expected"] and r["v_bytes"] == r["v_expected"] and r["v_rows_stat_ok"]
        lines.append(f"{r['name']:<28} {r['kept_frac']:>5.2f} {r['k_bytes']:>11} {r['v_bytes']:>11} "
                     f"{r['v_expected']:>11} {r['v_fraction']:>8.3f} {r['workspace_gm_to_ub']:>9} "
                     f"{r['traffic_speedup_bound']:>6.2f} {r['ub_peak']:>7} {'yes' if ok else 'NO':>3}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", choices=sorted(CASES), default="default")
    p.add_argument("--out", default="bench_results", help="directory for ascendc_bytes.csv/.json")
    args = p.parse_args(argv)
    rows = run(args.cases)
    print(format_table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "ascendc_bytes.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (out / "ascendc_bytes.json").write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if r["k_bytes"] != r["k_expected"] or r["v_bytes"] != r["v_expected"]
           or not r["v_rows_stat_ok"]]
    if bad:
        print(f"{len(bad)} case(s) moved other byte counts than expected", file=sys.stderr)
        return 1
    print(f"\nall {len(rows)} cases: K bytes = valid rows once per group, V bytes = kept-union rows x row bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
