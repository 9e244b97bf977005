"""Kept-set check of a backend on hardware, with inputs planted at a wide margin.

The conformance suite keeps every score only 2e-4 (MIN_GUARD) away from its threshold: enough
against a float64 oracle for float32 arithmetic on a CPU, not for a device whose vector
Exp / Ln / reductions round differently (a post_softmax log-probability moves by the error
of ln Z). There, ``kept`` and ``v_rows`` mismatches in the conformance table can be rounding,
not bugs. This check plants inputs whose kept set is known exactly with a margin of at least
0.5 (natural-log units: :data:`topth_ops.bench.synth.MIN_GAP` / 2) around every threshold,
so ``kept`` and ``v_rows`` are compared exactly, across the option space: pre/post_softmax,
per-head and group selection, threshold sets (one set keeps the planted rows, the other
nothing), BNSD and paged NHD / HND caches (block sizes 16 and 128). Outputs are compared with
the torch reference on the same device, within the dtype tolerance of the conformance suite.

Run on an Ascend machine by ``bench/npu_check.sh``::

    python -m topth_ops.bench.studies.npu_margin --backend ascendc --device npu

(``--backend ascendc-cpu --device cpu`` runs it on the CPU model; the tests do, with the
model's Exp / Ln perturbed). Exit status 0 when every case matches, 1 otherwise.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from topth_ops.contract import make_inputs

from ..cases import Case
from ..synth import make_case_inputs

SHAPES = (
    # name, batch, seq_len, q heads, kv heads, head_dim, dtype
    ("gqa4-d128-fp16", 2, 1100, 8, 2, 128, "fp16"),
    ("gqa8-d64-bf16", 2, 700, 16, 2, 64, "bf16"),
    ("mha-d96-fp32", 3, 400, 4, 4, 96, "fp32"),
)


def _scores(inputs, b: int, g: int, n: int) -> torch.Tensor:
    """float64 scores (pre_softmax) or log-probabilities (post_softmax) ``[G, n]``."""
    G = inputs.group_size
    q = inputs.query[b, g * G:(g + 1) * G].double().cpu()
    k = inputs.key_cache[b, g, :n].double().cpu()
    a = inputs.scale * (q @ k.T)
    if inputs.placement == "post_softmax":
        a = a - torch.logsumexp(a, dim=1, keepdim=True)
    return a


def _group_thresholds(inputs, plant: list) -> torch.Tensor:
    """``[num_kv_heads, max_row_id]`` thresholds of group selection: midway between the
    highest group maximum of the other rows and the lowest of the planted rows, which are
    >= MIN_GAP apart when every head's planted rows clear its other rows by MIN_GAP."""
    pre = inputs.placement == "pre_softmax"
    Hkv, S = inputs.num_kv_heads, inputs.max_row_id
    th = torch.full((Hkv, S), float("inf") if pre else 2.0, dtype=torch.float32)
    cols: dict[int, list] = {}
    for b, n in enumerate(inputs.seq_lens.tolist()):
        if n:
            cols.setdefault(n - 1, []).append(b)
    for col, bs in cols.items():
        for g in range(Hkv):
            lo, hi = -math.inf, math.inf
            for b in bs:
                n = int(inputs.seq_lens[b])
                x = _scores(inputs, b, g, n).max(dim=0).values
                m = plant[b][g]
                if (~m).any():
                    lo = max(lo, float(x[~m].max()))
                if m.any():
                    hi = min(hi, float(x[m].min()))
            t = lo + 1.0 if math.isinf(hi) else (hi - 1.0 if math.isinf(lo) else 0.5 * (lo + hi))
            th[g, col] = t if pre else math.exp(t)
    return th


def margin_cases(device: torch.device, shapes=SHAPES):
    """(name, inputs, expected kept ``[B, Hq]``, expected v_rows ``[B, Hkv]``) of the check."""
    from topth_ops.paged import to_paged

    for name, B, S, Hq, Hkv, D, dtype in shapes:
        for placement in ("pre_softmax", "post_softmax"):
            case = Case(name=f"margin-{name}", batch=B, seq_len=S, num_q_heads=Hq, num_kv_heads=Hkv,
                        head_dim=D, kept_frac=0.1, dtype=dtype, placement=placement, ragged=True)
            ci = make_case_inputs(case, torch.device("cpu"), seed=len(name))
            base = ci.inputs
            G = Hq // Hkv
            lens = base.seq_lens.tolist()
            # every head keeps exactly the planted rows (synth verified the gap): the plant mask
            plant = [[_scores(base, b, g, n)[0] > (base.thresholds[g * G, n - 1].double().log()
                                                 if placement == "post_softmax" else base.thresholds[g * G, n - 1])
                      if n else torch.zeros(0, dtype=torch.bool) for g in range(Hkv)] for b, n in enumerate(lens)]
            planted = ci.planted_union
            for selection in ("head", "group"):
                th = base.thresholds if selection == "head" else _group_thresholds(base, plant)
                nothing = torch.full_like(th, float("inf") if placement == "pre_softmax" else 2.0)
                sets = torch.tensor([b % 2 for b in range(B)], dtype=torch.int32)
                th3 = torch.stack([th, nothing])
                keep = (sets == 0).to(torch.int64)[:, None]
                want_rows = planted * keep
                want_kept = want_rows.repeat_interleave(G, dim=1)
                layouts = [(None, 0), ("NHD", 16), ("HND", 128)]
                for layout, bs in layouts:
                    k, v, table = base.key_cache, base.value_cache, None
                    if layout is not None:
                        k, v, table = to_paged(k, v, base.seq_lens, bs, kv_layout=layout,
                                               generator=torch.Generator().manual_seed(bs), fill=float("nan"))
                    kw = dict(scale=base.scale, placement=placement, vmc=True, return_stats=True,
                              selection=selection, threshold_set=sets.to(device))
                    if table is not None:
                        kw.update(block_table=table.to(device), kv_layout=layout)
                    inputs = make_inputs(base.query.to(device), k.to(device), v.to(device),
                                         base.seq_lens.to(device), th3.to(device), **kw)
                    tag = f"{name}-{placement}-{selection}-{layout or 'BNSD'}{bs or ''}"
                    yield tag, inputs, want_kept, want_rows


def run(backend_name: str, device: torch.device, launch: dict | None = None, shapes=SHAPES,
        check_out: bool = True) -> tuple[int, list[str]]:
    """Run every margin case on ``backend_name``; returns (cases run, failures).

    ``launch``: CPU-model launch conditions (``ascendc-cpu`` only, e.g. transcendental_error,
    under which only kept / v_rows are meaningful: ``check_out=False``)."""
    from topth_ops.backends.torch_ref import reference_decode
    from topth_ops.conformance.compare import TOLERANCES
    from topth_ops.registry import get_backend

    backend = get_backend(backend_name)
    failures = []
    cases = 0
    for tag, inputs, want_kept, want_rows in margin_cases(device, shapes):
        cases += 1
        reasons = backend.not_supported_reasons(inputs)
        if reasons:
            failures.append(f"{tag}: not supported ({'; '.join(reasons)})")
            continue
        out, stats = inputs.empty_outputs(fill=float("nan"))
        if launch and backend_name == "ascendc-cpu":
            from topth_ops.backends.ascendc import run_cpu_model

            run_cpu_model(inputs, out, stats, launch=launch)
        else:
            backend.forward(inputs, out, stats)
        ref, _ = reference_decode(inputs)
        if not torch.equal(stats.kept.cpu().to(torch.int64), want_kept):
            failures.append(f"{tag}: kept differs from the planted counts")
        if not torch.equal(stats.v_rows.cpu().to(torch.int64), want_rows):
            failures.append(f"{tag}: v_rows differs from the planted counts")
        tol = TOLERANCES[inputs.dtype]
        if check_out and not torch.allclose(out.float().cpu(), ref.float().cpu(), atol=tol["atol"], rtol=tol["rtol"]):
            err = float((out.float() - ref.float()).abs().max())
            failures.append(f"{tag}: output differs from the torch reference (max abs error {err:.3g})")
    return cases, failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m topth_ops.bench.studies.npu_margin",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="ascendc")
    parser.add_argument("--device", default="npu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "npu":
        import torch_npu  # noqa: F401
    cases, failures = run(args.backend, device)
    for f in failures:
        print("FAIL", f)
    print(f"npu_margin: {cases - len(failures)} of {cases} cases match (kept / v_rows exactly, out within "
          f"tolerance) on {args.backend} ({device})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
