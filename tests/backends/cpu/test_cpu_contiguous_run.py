"""The ``avx512bf16`` level's scores over contiguous runs of rows (a BNSD range, or the rows of
each paged HND block, of bfloat16 K rows of head_dim 32, 64 or 128: ``run_scores`` in
avx512bf16_scores.cpp), against the float64 oracle. Groups of 1-12 query heads per KV head (one
pass over a run for up to 4 heads, 128 rows per pass of every head block for more), lengths
around the 4-, 8- and 16-row blocks and the 128-row passes, HND blocks of 32, 33, 100 and 128 rows
(ragged last blocks; a range starting inside a block), forced split-KV, both placements and
selections. The cache past each sequence's length is NaN, so a read past a run shows; a cache
whose rows are not back to back (a strided view) takes the tile loop instead and is checked
the same way."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from topth_ops.backends import cpu as cpu_backend
from topth_ops.conformance.cases import Shape, paged_case, random_case
from topth_ops.conformance.compare import TOLERANCES, exact_report, mismatch_report, to_numpy

from .env_run import run_with_env

LEVELS = cpu_backend.cpu_module().simd_levels()
LENS = (1, 2, 3, 5, 16, 17, 129, 300)


@pytest.mark.skipif("avx512bf16" not in LEVELS, reason="the CPU lacks AVX512-BF16: the avx512bf16 level (its "
                                                       "contiguous-run scores) cannot run here")
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 7, 8, 12])
@pytest.mark.parametrize("split", ["0", "7", "100"])
@pytest.mark.parametrize("layout", ["BNSD", "HND32", "HND33", "HND100", "HND128"])
def test_contiguous_run_scores_match_oracle(head_dim, group, split, layout):
    for i, (placement, selection) in enumerate((("post_softmax", "group"), ("pre_softmax", "head"))):
        case = random_case("run", Shape(LENS, 2 * group, 2, head_dim, 320), torch.bfloat16, placement=placement,
                           selection=selection, keep_range=(0.2, 0.6),
                           seed=head_dim * 1009 + group * 31 + int(split) + i)
        if layout != "BNSD":
            case = paged_case(case, int(layout[3:]), "HND", seed=group + i)
        out, stats, counters = run_with_env(case.kwargs, {cpu_backend.ENV_SIMD: "avx512bf16",
                                                          cpu_backend.ENV_SPLIT: split})
        assert counters["simd"] == "avx512bf16"
        want = case.oracle()
        rep, _ = mismatch_report("out", to_numpy(out), want.out, **TOLERANCES[torch.bfloat16])
        assert rep is None, f"G {group} {placement}: {rep}"
        ok = ~want.nonfinite.any(-1)
        assert exact_report("kept", to_numpy(stats.kept)[ok], want.kept[ok]) is None
        assert exact_report("v_rows", to_numpy(stats.v_rows), want.v_rows) is None


@pytest.mark.skipif("avx512bf16" not in LEVELS, reason="the CPU lacks AVX512-BF16: the avx512bf16 level cannot "
                                                       "run here")
@pytest.mark.parametrize("group", [3, 5])
def test_rows_not_back_to_back_take_the_tile_loop(group):
    """K rows with a gap between them (a view of every other row of a longer cache) are not
    one run: the stage must not read them as if they were."""
    case = random_case("gap", Shape(LENS, 2 * group, 2, 64, 320), torch.bfloat16, placement="post_softmax",
                       selection="group", keep_range=(0.2, 0.6), seed=group)
    kw = dict(case.kwargs)
    k = kw["key_cache"]
    wide = torch.full((k.shape[0], k.shape[1], 2 * k.shape[2], k.shape[3]), float("nan"), dtype=k.dtype)
    wide[:, :, ::2].copy_(k)
    kw["key_cache"] = wide[:, :, ::2]
    out, _, counters = run_with_env(kw, {cpu_backend.ENV_SIMD: "avx512bf16"})
    assert counters["simd"] == "avx512bf16"
    rep, _ = mismatch_report("out", to_numpy(out), case.oracle().out, **TOLERANCES[torch.bfloat16])
    assert rep is None, rep


@pytest.mark.skipif("avx512bf16" not in LEVELS, reason="the CPU lacks AVX512-BF16: the avx512bf16 level cannot "
                                                       "run here")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 7, 12])
def test_run_and_tile_loops_give_the_same_bits(group, head_dim):
    """The contiguous-run loop (BNSD) and the tile loop (the same rows paged HND in blocks of
    16, shorter than the runs the loop takes) add the same products in the same order: the
    outputs are bitwise equal."""
    base = random_case("bits", Shape((300, 129, 17, 5), 2 * group, 2, head_dim, 320), torch.bfloat16,
                       placement="post_softmax", selection="group", seed=group)
    paged = paged_case(base, 16, "HND", seed=1)
    env = {cpu_backend.ENV_SIMD: "avx512bf16", cpu_backend.ENV_SPLIT: "8192"}
    a, _, _ = run_with_env(base.kwargs, env)
    b, _, _ = run_with_env(paged.kwargs, env)
    assert torch.equal(a, b)


GUARD_SCRIPT = textwrap.dedent("""
    import ctypes, mmap, os, sys
    import torch
    from topth_ops import decode_attention
    from topth_ops.conformance.cases import Shape, random_case
    from topth_ops.conformance.compare import TOLERANCES, mismatch_report, to_numpy

    def guarded(t):  # a copy of t whose last byte is followed by a PROT_NONE page
        nbytes, page = t.numel() * t.element_size(), mmap.PAGESIZE
        total = ((nbytes + page - 1) // page + 1) * page
        m = mmap.mmap(-1, total)
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.mprotect(ctypes.c_void_p(base + total - page), ctypes.c_size_t(page), 0) == 0
        g = torch.frombuffer(m, dtype=t.dtype, count=t.numel(), offset=total - page - nbytes).view(t.shape)
        g.copy_(t)
        return g, m

    keep = []
    for group in (1, 3, 4, 7):
        for d in (32, 64, 128):
            for lens in ((5, 300, 317), (317,), (33, 317)):  # 317: a partial last block of 4, 8, 16 rows
                case = random_case("guard", Shape(lens, 2 * group, 2, d, 317), torch.bfloat16,
                                   placement="post_softmax", selection="group", keep_range=(0.2, 0.6),
                                   seed=group * 7 + d + len(lens))
                kw = dict(case.kwargs)
                kw["key_cache"], m = guarded(kw["key_cache"].contiguous())
                keep.append(m)
                out = decode_attention(**kw, backend="cpu")
                rep, _ = mismatch_report("out", to_numpy(out), case.oracle().out, **TOLERANCES[torch.bfloat16])
                assert rep is None, (group, d, lens, rep)
    print("ok")
""")


@pytest.mark.skipif("avx512bf16" not in LEVELS, reason="the CPU lacks AVX512-BF16: the avx512bf16 level cannot "
                                                       "run here")
@pytest.mark.parametrize("split", ["0", "7", "100"])
def test_run_loop_reads_nothing_past_the_last_row(split):
    """BNSD K caches whose last row ends at an unreadable page (the last sequence is full
    length): a read past a run's last row faults. Run in a child process so that a fault fails
    this test instead of the session."""
    env = dict(os.environ, **{cpu_backend.ENV_SIMD: "avx512bf16", cpu_backend.ENV_SPLIT: split})
    res = subprocess.run([sys.executable, "-c", GUARD_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), (res.returncode, res.stderr[-2000:])
