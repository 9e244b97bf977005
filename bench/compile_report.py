"""Static performance report of the Triton kernels, without a GPU:
``python -m topth_ops.bench.compile_report`` (also ``topth-ops bench --compile-report``).

Every production variant of the kernels is compiled for sm_90 exactly as the JIT would
(:mod:`topth_ops.bench.triton_compile`); the report gives per kernel the registers and spills (ptxas), shared
memory, CTAs per SM (:mod:`topth_ops.backends.triton.occupancy`), and how K and V rows are loaded inside the loop.
For each case of the benchmark's ``h200`` set it gives the split count the launcher picks
from that occupancy, the programs launched against the resident slots of an H200 (132
SMs), and the waves. Gates (exit status 1, asserted in CI): no spill instruction inside
a loop (a spill outside the loops, once per program, is listed); registers within
:data:`REG_BUDGET`; one wave (never a partial second one) for every h200 case; V rows
read only through predicated loads in every thresholded kernel.

Everything here is static: it says what the compiled code is, not how fast it runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

import torch

from topth_ops.backends.triton import occupancy
from topth_ops.env import interpreter_enabled

from .triton_compile import fresh_cache

# Registers per thread allowed per warps-per-CTA. 4 warps: 168 keeps 3 CTAs (12 warps,
# three independent K pipelines) resident per SM; with 4 stages of 8 KiB K tiles that is
# ~72 KiB of K reads in flight per SM, about twice what an H200 needs to cover its memory
# latency (4.8 TB/s x ~1 us / 132 SMs = 36 KiB). 8 warps (64-row head tiles): 128 keeps 2.
REG_BUDGET = {4: 168, 8: 128}


@dataclass(frozen=True)
class Variant:
    """One production configuration of the op (arguments of :func:`topth_ops.bench.triton_compile.record`)."""

    label: str
    placement: str = "pre_softmax"
    dense: bool = False
    hq: int = 32
    hkv: int = 8
    d: int = 128
    dtype: torch.dtype = torch.bfloat16
    selection: str = "head"
    paged: tuple = None
    sets: int = 0
    stats: bool = False
    vmc: bool = False
    vmean: bool = False
    sdc: str = "none"
    extra: dict = field(default_factory=dict)

    def record(self):
        from .triton_compile import record

        return record(self.label, self.dtype, self.placement, self.sdc, self.vmc, self.vmean, self.dense,
                      self.hq, self.hkv, self.d, selection=self.selection, paged=self.paged, sets=self.sets,
                      stats=self.stats)


VARIANTS = [
    Variant("dense-d128-g4", dense=True),
    Variant("pre-d128-g4"),
    Variant("pre-d128-g4-stats", stats=True),
    Variant("pre-d128-g4-group-nhd16", selection="group", paged=("NHD", 16)),
    Variant("pre-d128-g4-hnd128-sets-vmc", paged=("HND", 128), sets=3, vmc=True, vmean=True),
    Variant("pre-d128-g4-vmc-mean", vmc=True),
    Variant("post-d128-g4", placement="post_softmax"),
    Variant("post-d128-g4-group-nhd16-vmc", placement="post_softmax", selection="group", paged=("NHD", 16),
            vmc=True, vmean=True),
    Variant("pre-d64-g3", hq=9, hkv=3, d=64),
    Variant("pre-d256-g4-fp16", hq=8, hkv=2, d=256, dtype=torch.float16),
    Variant("pre-d128-g1-mha", hq=8, hkv=8),  # tensor cores with 15 padded rows (see tiles.dot_qk)
    Variant("post-d128-g1-mha", placement="post_softmax", hq=8, hkv=8),
    Variant("pre-d128-g64", hq=64, hkv=1),
    Variant("post-d128-g64", placement="post_softmax", hq=64, hkv=1),
]


def compile_variants(variants=VARIANTS, arch: int = 90) -> list[dict]:
    """Compile every kernel of every variant; one row per (variant, kernel)."""
    from .triton_compile import compile_call

    rows, cache = [], {}
    for var in variants:
        for name, fn, args, kwargs, _grid in var.record():
            key = (name, tuple(sorted((k, str(v)) for k, v in kwargs.items())),
                   tuple(str(a.dtype) if isinstance(a, torch.Tensor) else type(a).__name__ for a in args))
            if key not in cache:
                cache[key] = compile_call(name, fn, args, kwargs, arch)
            row = dict(cache[key], variant=var.label)
            row["ctas_per_sm"] = occupancy.ctas_per_sm(row["regs"], row["shared_bytes"], row["num_warps"])
            rows.append(row)
    return rows


def h200_waves(arch: int = 90, num_sms: int = occupancy.H200_SMS) -> list[dict]:
    """For each case of the bench ``h200`` set: the split count the launcher derives from
    the compiled kernels' occupancy, programs vs resident slots, waves."""
    from .cases import CASE_SETS

    from topth_ops.backends.triton.launch import MAX_SPLITS

    out, seen = [], {}
    for case in CASE_SETS["h200"]:
        paged = (case.kv_layout, case.block_size) if getattr(case, "block_size", 0) else None
        var = Variant(f"case-{case.name}", placement=case.placement, hq=case.num_q_heads, hkv=case.num_kv_heads,
                      d=case.head_dim, dtype=case.torch_dtype, stats=True, paged=paged)
        key = (var.placement, var.hq, var.hkv, var.d, var.dtype, paged)
        if key not in seen:
            rows = compile_variants([var], arch)
            main = [r for r in rows if r["kernel"] != "combine_kernel"]
            seen[key] = (min(r["ctas_per_sm"] for r in main), main[0]["num_warps"])
        ctas, _warps = seen[key]
        groups = case.batch * case.num_kv_heads
        from topth_ops.backends.triton.launch import gpu_tiles

        block_n, _ = gpu_tiles(case.head_dim, case.num_q_heads // case.num_kv_heads,
                               torch.tensor([], dtype=case.torch_dtype).element_size(), case.placement)
        ns = occupancy.choose_splits(groups, case.seq_len, block_n, num_sms, ctas, max_splits=MAX_SPLITS)
        programs = groups * ns
        waves, eff = occupancy.waves(programs, num_sms, ctas)
        out.append(dict(case=case.name, groups=groups, ctas_per_sm=ctas, slots=num_sms * ctas, num_splits=ns,
                        programs=programs, waves=waves, wave_efficiency=round(eff, 3)))
    return out


MEM_CYCLES_PER_KIB = 1024 / (4.0e12 / 132 / 1.755e9)
"""SM cycles to read one KiB at an assumed 4.0 TB/s sustained (H200: 4.8 TB/s peak) over 132
SMs at 1.755 GHz: about 59. An estimate to compare instruction issue with, not a measurement."""


def issue_cycles_per_kib(row: dict):
    """Issue cycles per KiB of K tile of a main kernel's tile loop (None elsewhere)."""
    if row["kernel"] not in ("pre_kernel", "post_scores_kernel") or not row.get("tile_kib") or not row["loop_instrs"]:
        return None
    return round(row["loop_instrs"] * row["num_warps"] / 4 / row["tile_kib"])


def gates(rows: list[dict], waves: list[dict]) -> list[tuple[str, bool, str]]:
    """(gate, passed, detail) for every gate of the module docstring."""
    out = []
    in_loops = [f"{r['variant']}/{r['kernel']}: {r['spills_in_loops']} STL/LDL in loops"
                for r in rows if r["spills_in_loops"]]
    outside = sorted({f"{r['variant']}/{r['kernel']}: {r['spill_stores']}+{r['spill_loads']} B outside loops"
                      for r in rows if (r["spill_stores"] or r["spill_loads"]) and not r["spills_in_loops"]})
    out.append(("no register spill inside a loop", not in_loops,
                "; ".join(in_loops) or f"{len(rows)} kernels" + (f" (listed: {'; '.join(outside)})" if outside
                                                                 else ", no spill at all")))
    over = [f"{r['variant']}/{r['kernel']}: {r['regs']} > {REG_BUDGET.get(r['num_warps'], 255)} "
            f"({r['num_warps']} warps)" for r in rows
            if r["kernel"] != "combine_kernel" and r["regs"] > REG_BUDGET.get(r["num_warps"], 255)]
    out.append(("registers within budget " + str(REG_BUDGET), not over, "; ".join(over) or "all"))
    second = [f"{w['case']}: {w['programs']} programs, {w['slots']} slots" for w in waves if w["waves"] != 1]
    out.append(("one wave for every h200 case", not second, "; ".join(second) or f"{len(waves)} cases"))
    unpred = []
    for r in rows:
        if r["kernel"] in ("pre_kernel", "post_select_kernel") and "dense" not in r["variant"]:
            kinds = r["loads"]["V"]
            if not kinds or any("predicated" not in k for k in kinds):
                unpred.append(f"{r['variant']}/{r['kernel']}: {kinds}")
    out.append(("V rows read by predicated loads only", not unpred, "; ".join(unpred) or "all thresholded kernels"))
    return out


def format_report(rows, waves, checks) -> str:
    lines = ["Static performance report: Triton kernels compiled for sm_90 (Triton + ptxas, no GPU). "
             "Nothing here is a measured speed.", ""]
    head = (f"{'variant':<30} {'kernel':<20} {'regs':>4} {'spill':>5} {'smem KiB':>8} {'warps':>5} "
            f"{'stg':>3} {'CTA/SM':>6} {'loop':>5} {'cyc/KiB':>7}  K loads / V loads")
    lines += [head, "-" * len(head)]
    for r in rows:
        kl = ",".join(r["loads"]["K"]) or "-"
        vl = ",".join(r["loads"]["V"]) or "-"
        cyc = issue_cycles_per_kib(r)
        lines.append(f"{r['variant']:<30} {r['kernel']:<20} {r['regs']:>4} {r['spill_stores'] + r['spill_loads']:>5} "
                     f"{r['shared_bytes'] / 1024:>8.1f} {r['num_warps']:>5} {r['num_stages']:>3} "
                     f"{r['ctas_per_sm']:>6} {r['loop_instrs'] or '-':>5} {cyc if cyc else '-':>7}  {kl} / {vl}")
    lines += ["", "loop: SASS instructions one warp issues per tile; cyc/KiB: issue cycles of an SM per KiB of "
              "K tile (loop x warps / 4 schedulers / tile KiB), to compare with the memory time of a KiB per SM "
              f"({MEM_CYCLES_PER_KIB:.0f} cycles at 4.0 TB/s, 132 SMs, 1.755 GHz; x (1 + f) with V)"]
    lines += ["", "h200 case set on 132 SMs: split count from the occupancy above", ""]
    head = (f"{'case':<30} {'groups':>6} {'CTA/SM':>6} {'slots':>5} {'splits':>6} {'programs':>8} "
            f"{'waves':>5} {'wave eff':>8}")
    lines += [head, "-" * len(head)]
    for w in waves:
        lines.append(f"{w['case']:<30} {w['groups']:>6} {w['ctas_per_sm']:>6} {w['slots']:>5} {w['num_splits']:>6} "
                     f"{w['programs']:>8} {w['waves']:>5} {w['wave_efficiency']:>8.3f}")
    lines.append("")
    for name, ok, detail in checks:
        lines.append(f"gate {'PASS' if ok else 'FAIL'}: {name}: {detail}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m topth_ops.bench.compile_report", description=__doc__)
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--json", default=None, help="also write the rows, waves and gates as JSON here")
    args = parser.parse_args(argv)
    if interpreter_enabled():
        print("report: unset TRITON_INTERPRET (the interpreter has no compiler)", file=sys.stderr)
        return 2
    fresh_cache()
    rows = compile_variants(VARIANTS, args.arch)
    waves = h200_waves(args.arch)
    checks = gates(rows, waves)
    print(format_report(rows, waves, checks), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"kernels": rows, "h200_waves": waves,
                       "gates": [dict(gate=g, passed=ok, detail=d) for g, ok, d in checks]}, fh, indent=1)
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
