"""``python -m topth_ops.bench.gpu_probe``: where the thresholded Triton kernel's time goes on a GPU.

Decomposes one decode call on the H200 target shape (bench/cases.py ``H200_TARGET``) into
what the hardware can do and what the kernel does, all timed in one run (CUDA events,
``triton.testing.do_bench`` medians, caches far larger than L2):

* ``stream K``: a plain Triton kernel that reads every K row once (rows listed in an index
  vector, so it is the same kernel as the gathers), the streaming floor of the K pass;
* ``gather V f``: the same kernel reading a random fraction f of the V rows (sorted row
  ids, 16 KiB per program): the floor of the kept-row gather at f;
* ``ours keep none``: the pre-softmax kernel with every threshold +inf (K pass, scores and
  selection; no V row read), ``ours f=0.1``, ``ours keep all`` (thresholds -inf) and our dense
  mode, with the launcher's own config;
* torch SDPA on the same cache (the dense baseline the benchmark found fastest).

``stream K + gather V f`` against ``ours f`` says how much of the gap to the bound a two-phase
design (scores and compaction, then a free-running gather) could close. CUDA only
(exit 2 without a CUDA device unless ``--small``, which runs a tiny shape under
``TRITON_INTERPRET=1`` on the CPU to check the script). Plain timing (no CUDA graphs): the
launcher's host cost is in the rows of our kernel, which makes them upper bounds.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _rows_sum_kernel(X, IDX, OUT, n_idx, D: tl.constexpr, BLOCK: tl.constexpr):
    """OUT[pid, :] = sum of rows X[IDX[pid * BLOCK : (pid + 1) * BLOCK]] (float32)."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_idx
    rows = tl.load(IDX + offs, mask=m, other=0).to(tl.int64)
    d = tl.arange(0, D)
    x = tl.load(X + rows[:, None] * D + d[None, :], mask=m[:, None], other=0.0)
    tl.store(OUT + pid.to(tl.int64) * D + d, tl.sum(x.to(tl.float32), axis=0))


def rows_sum(x2d: torch.Tensor, idx: torch.Tensor, block: int = 64):
    """A callable summing the rows ``idx`` of ``x2d``, launched once and checked first.

    Parameters
    ----------
    x2d : torch.Tensor
        ``[R, D]``, contiguous (any float dtype; D a power of two for ``tl.arange``).
    idx : torch.Tensor
        ``[n]`` int32 row numbers in ``[0, R)`` (sorted for the gather timings).
    block : int
        Rows per program.

    Returns
    -------
    callable
        One launch of the gather kernel (its float32 sums of each block of rows are kept in
        a buffer it owns).

    Raises
    ------
    RuntimeError
        The first launch's total differs from torch's float64 sum of the same rows by more
        than 1e-4 relative to its largest element.
    """
    n, d = idx.numel(), x2d.shape[1]
    out = torch.empty(triton.cdiv(n, block), d, dtype=torch.float32, device=x2d.device)
    grid = (triton.cdiv(n, block),)
    fn = lambda: _rows_sum_kernel[grid](x2d, idx, out, n, D=d, BLOCK=block, num_warps=4)  # noqa: E731
    fn()
    ref = x2d[idx.long()].double().sum(0)
    err = float((out.double().sum(0) - ref).abs().max() / ref.abs().max().clamp_min(1))
    if not err < 1e-4:
        raise RuntimeError(f"rows_sum: relative error {err:.3g} against torch; the probe's gather is wrong")
    return fn


def _time(fn, budget_ms: float) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return float(triton.testing.do_bench(fn, warmup=10, rep=budget_ms, return_mode="median"))
    import time
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m topth_ops.bench.gpu_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-ms", type=float, default=40.0)
    parser.add_argument("--small", action="store_true", help="a tiny shape (interpreter check of the script)")
    args = parser.parse_args(argv)

    from topth_ops.backends.triton.launch import decode_attn_fwd

    from .cases import H200_TARGET, Case
    from .synth import make_case_inputs

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda" and not args.small:
        print("gpu_probe: needs a CUDA device (or --small with TRITON_INTERPRET=1 to check the script)",
              file=sys.stderr)
        return 2
    shape = dict(H200_TARGET)
    if args.small:
        shape.update(batch=2, seq_len=256, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype="fp16")
    x = make_case_inputs(Case(name="probe-pre-f0.1", kept_frac=0.1, **shape), dev).inputs
    k, v = x.key_cache, x.value_cache
    B, Hkv, S, D = k.shape
    assert k.is_contiguous() and v.is_contiguous(), "the probe expects a contiguous BNSD cache"
    k2, v2 = k.view(-1, D), v.view(-1, D)
    rows = k2.shape[0]
    row_bytes = D * k.element_size()
    gen = torch.Generator(device=dev).manual_seed(0)

    outs = {}

    def ours(name, thresholds, dense=False):
        out = outs[name] = torch.empty_like(x.query)
        return lambda: decode_attn_fwd(x.query, k, v, x.seq_lens, thresholds, out, scale=x.scale,
                                       placement="pre_softmax", dense=dense)

    inf = torch.full_like(x.thresholds, float("inf"))
    variants = [("stream K (all rows)", rows_sum(k2, torch.arange(rows, dtype=torch.int32, device=dev)), rows)]
    for f in (0.1, 0.3):
        idx = torch.sort(torch.randperm(rows, generator=gen, device=dev)[: int(rows * f)])[0].to(torch.int32)
        variants.append((f"gather V f={f}", rows_sum(v2, idx), idx.numel()))
    variants += [(name, ours(name, th, dense), nrows) for name, th, dense, nrows in (
        ("ours keep none", inf, False, rows), ("ours f=0.1", x.thresholds, False, rows * 1.1),
        ("ours keep all", -inf, False, 2 * rows), ("ours dense mode", x.thresholds, True, 2 * rows))]
    q4 = x.query.view(B, Hkv * (x.query.shape[1] // Hkv), 1, D)
    variants.append(("torch SDPA", lambda: torch.nn.functional.scaled_dot_product_attention(
        q4, k, v, scale=x.scale, enable_gqa=True), 2 * rows))

    # our launches against each other: keeping every row is the dense result
    fns = {name: fn for name, fn, _ in variants}
    fns["ours keep all"]()
    fns["ours dense mode"]()
    err = float((outs["ours keep all"].float() - outs["ours dense mode"].float()).abs().max())
    if not err < 2e-2:
        raise RuntimeError(f"gpu_probe: keep-all and dense outputs differ by {err:.3g}")
    print(f"shape B{B} Hq{x.query.shape[1]} Hkv{Hkv} S{S} D{D} {k.dtype}; device "
          f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu (interpreter)'}")
    print(f"{'variant':<22} {'ms':>8} {'rows read':>10} {'GB/s':>8}")
    for name, fn, nrows in variants:
        ms = _time(fn, args.budget_ms)
        print(f"{name:<22} {ms:8.4f} {nrows / rows:10.2f} {nrows * row_bytes / ms / 1e6:8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
