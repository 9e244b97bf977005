"""Paged NHD caches with several KV heads, where the kernel groups the items of every KV head
of a range into one unit and (on levels with a ``scores_pf`` stage) reads their K rows in one
walk: chunks of 48 positions, head after head, the next chunk prefetched slot by slot; on
levels with a ``pv_pf`` stage, units whose kept lists are all nearly dense read their V rows
the same way (docs/cpu.md, "Paged NHD"). Checked against the float64 oracle on every SIMD
level of this machine, the levels without the walks included: 2, 3, 4 and 8 KV heads,
lengths on both sides of a chunk and longer than one unit, head dims of the direct and the
tile paths and with masked last chunks, both placements, half and most rows kept, with and
without split-KV (two phases for post_softmax; whole sequences in one phase where L2 and the
threads allow), one and two threads, and caches whose slots are padded (views of a wider
tensor)."""

import pytest
import torch

from topth_ops.backends import cpu as cpu_backend
from topth_ops.conformance.cases import Shape, paged_case, random_case
from topth_ops.conformance.compare import TOLERANCES, exact_report, mismatch_report, to_numpy

from .env_run import run_with_env

LEVELS = cpu_backend.cpu_module().simd_levels()
# the levels with scores_pf and pv_pf stages (the generic level and amx's bfloat16 scores walk nothing)
WALKS = {"avx2", "avx512", "avx512bf16"}
L2_BYTES = cpu_backend.cpu_module().l2_bytes()  # the scheduler's L2 size

# (KV heads, query heads per KV head, head_dim, dtype, block size)
SHAPES = [
    (3, 3, 64, torch.bfloat16, 32),    # SmolLM2's decode shape
    (8, 4, 128, torch.float16, 16),    # llama 8B's
    (2, 2, 40, torch.float32, 48),     # head_dim not a multiple of 16: the avx2 level's tile path
    (3, 1, 16, torch.bfloat16, 5),     # MHA, blocks shorter than a chunk
    (2, 17, 32, torch.bfloat16, 16),   # a group past 16: the avx2 level's bfloat16 scores take the tile path
    (2, 3, 40, torch.float16, 16),     # float16, head_dim not a multiple of 16 (AVX-512: a masked last chunk)
    (4, 2, 48, torch.bfloat16, 32),    # bfloat16, head_dim past 32 and not a multiple of it
]
# one sequence per interesting length: under, at and past a chunk of 48, and long enough for
# several units (ranges are cut to what fits one core's L2, and to 2048 positions on one thread
# on levels with the walk, except post_softmax on one thread where the scores fit in L2: whole
# sequences; dispatch.cpp), plus an empty one
LENS = (47, 48, 49, 0, 97, 4500)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("num_kv,group,head_dim,dtype,block", SHAPES)
@pytest.mark.parametrize("placement", ["pre_softmax", "post_softmax"])
@pytest.mark.parametrize("split", ["0", "70"])
@pytest.mark.parametrize("threads,padded", [(1, False), (2, True)])
# about half of the rows kept: scattered lists, P.V item by item; most: the P.V walk
@pytest.mark.parametrize("keep", [(0.5, 0.55), (0.85, 0.95)], ids=["half", "most"])
def test_nhd_units_match_oracle(level, num_kv, group, head_dim, dtype, block, placement, split, threads, padded,
                                keep):
    shape = Shape(LENS, num_kv * group, num_kv, head_dim, max(LENS))
    case = random_case("nhd-walk", shape, dtype, placement=placement, selection="group", vmc=True,
                       keep_range=keep, seed=num_kv * 1000 + head_dim)
    kw = dict(paged_case(case, block, "NHD", seed=7).kwargs)
    if padded:  # each head's row 8 elements short of the next one: no slot is contiguous
        for name in ("key_cache", "value_cache"):
            t = kw[name]
            wide = torch.full((*t.shape[:-1], t.shape[-1] + 8), float("nan"), dtype=t.dtype)
            wide[..., : t.shape[-1]] = t
            kw[name] = wide[..., : t.shape[-1]]
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, stats, counters = run_with_env(kw, {cpu_backend.ENV_SIMD: level, cpu_backend.ENV_SPLIT: split})
    finally:
        torch.set_num_threads(saved)
    assert counters["simd"] == level
    # the KV heads of a range share a unit, so the walk has something to walk
    assert counters["units"] < counters["items"], counters
    if level in WALKS and split == "0" and threads == 1:
        if placement == "post_softmax" and max(LENS) * num_kv * group * 4 <= L2_BYTES:
            # whole sequences (their scores fit in L2): one phase, no split
            assert counters["units"] == sum(1 for n in LENS if n) and counters["splits_max"] == 1, counters
        else:  # the walk's units: 2048 positions
            assert counters["units"] <= sum(1 for n in LENS if n) - 1 + -(-max(LENS) // 2048), counters
    # which walks ran: the K walk on every unit of several items of a level in WALKS; the P.V
    # walk only where every list of a unit holds more than 3/4 of its range (never for "half")
    if level in WALKS:
        assert counters["k_walks"] > 0, counters
        if keep[1] <= 0.6:
            assert counters["pv_walks"] == 0, counters
        elif split == "0":  # "most" rows kept: the long sequence's units walk their V rows
            assert counters["pv_walks"] > 0, counters
    else:
        assert counters["k_walks"] == 0 and counters["pv_walks"] == 0, counters
    want = case.oracle()
    rep, _ = mismatch_report("out", to_numpy(out), want.out, **TOLERANCES[dtype])
    assert rep is None, rep
    assert exact_report("kept", to_numpy(stats.kept), want.kept) is None
    assert exact_report("v_rows", to_numpy(stats.v_rows), want.v_rows) is None
    assert counters["k_rows"] == sum(LENS) * num_kv


# post_softmax on the levels with the walks: whole sequences as units (one phase) where a sequence's scores
# fit in L2 and, handed out longest first, they load no thread more than 10% above an even
# share; else ranges in two phases. The unbalanced cases' long sequences exceed any range the
# scheduler cuts (at most 8 MiB of L2 / 768 bytes per position here), so they must be split.
@pytest.mark.parametrize("level", [lv for lv in LEVELS if lv in WALKS] or
                         [pytest.param("avx2", marks=pytest.mark.skip(reason="no level with the walks on this CPU"))])
@pytest.mark.parametrize("lens,threads,whole", [
    ((3000, 2900, 3100, 2500), 2, True),      # balanced: one phase on two threads
    ((12000, 100, 200, 300), 2, False),       # one sequence past a thread's share: split
    ((12000, 11600, 12400), 2, False),        # three on two threads: 1.3x an even share
    ((12000, 12000, 12000, 1), 2, False),     # four, but the fourth is empty in effect
    ((12000, 11000), 2, True),                # one each: balanced, fewer units than threads x 4
    ((6000, 100), 1, True),                   # one thread: whole where the scores fit
])
def test_post_softmax_whole_sequences(level, lens, threads, whole):
    shape = Shape(lens, 9, 3, 64, max(lens))
    case = random_case("nhd-post", shape, torch.bfloat16, placement="post_softmax", selection="group", vmc=True,
                       keep_range=(0.3, 0.6), seed=11)
    kw = dict(paged_case(case, 32, "NHD", seed=3).kwargs)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, stats, counters = run_with_env(kw, {cpu_backend.ENV_SIMD: level, cpu_backend.ENV_SPLIT: "0"})
    finally:
        torch.set_num_threads(saved)
    assert counters["threads"] == threads, counters
    if whole and max(lens) * 9 * 4 <= L2_BYTES:
        assert counters["units"] == len(lens) and counters["splits_max"] == 1, counters
    else:
        assert counters["splits_max"] > 1, counters
    want = case.oracle()
    rep, _ = mismatch_report("out", to_numpy(out), want.out, **TOLERANCES[torch.bfloat16])
    assert rep is None, rep
    assert exact_report("kept", to_numpy(stats.kept), want.kept) is None
    assert exact_report("v_rows", to_numpy(stats.v_rows), want.v_rows) is None
