"""The op's check of block-table values (topth_ops.validation.check_block_table_values): its
compiled CPU pass and its torch path against an independent loop over the used entries
(which entries are bad, how many, which one the error names), and through the public op."""

import math
import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

import topth_ops
from topth_ops import validation


def _expected(bt, lens, block_size, num_blocks):
    """(count, first (b, i) in row-major order) of used entries outside [0, num_blocks)."""
    bad, first = 0, None
    for b in range(bt.shape[0]):
        n = int(lens[b])
        used = min(bt.shape[1], max(0, math.ceil(n / block_size)))
        for i in range(used):
            v = int(bt[b, i])
            if v < 0 or v >= num_blocks:
                bad += 1
                first = first or (b, i)
    return bad, first


def _run(bt, lens, block_size, num_blocks, fused):
    """The check's error message on one path (None when it passes)."""
    saved = validation.FUSED_TABLE_CHECK
    validation.FUSED_TABLE_CHECK = fused
    try:
        validation.check_block_table_values(bt, lens, block_size, num_blocks)
    except ValueError as e:
        return str(e)
    finally:
        validation.FUSED_TABLE_CHECK = saved
    return None


def test_the_compiled_check_is_built():
    # no skip: the compiled module is part of the build (.ci/run builds it), and without it
    # the tests below would compare the torch path with itself
    assert validation._table_check_module() is not None, "the CPU kernel module lacks check_block_table"


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_both_paths_name_the_bad_entries_the_loop_finds(data):
    rows = data.draw(st.integers(1, 6))
    cols = data.draw(st.integers(1, 9))
    block_size = data.draw(st.sampled_from([1, 3, 16, 32]))
    num_blocks = data.draw(st.integers(1, 40))
    tdt = data.draw(st.sampled_from([torch.int32, torch.int64]))
    ldt = data.draw(st.sampled_from([torch.int32, torch.int64]))
    values = data.draw(st.lists(st.sampled_from([-(2**31), -1, 0, 1, num_blocks - 1, num_blocks, num_blocks + 7,
                                                 2**31 - 1]), min_size=rows * cols, max_size=rows * cols))
    bt = torch.tensor(values, dtype=tdt).view(rows, cols)
    if data.draw(st.booleans()):  # a strided view of a wider table
        wide = torch.full((rows, 2 * cols), -5, dtype=tdt)
        wide[:, ::2] = bt
        bt = wide[:, ::2]
    lens = torch.tensor(data.draw(st.lists(st.integers(0, cols * block_size), min_size=rows, max_size=rows)),
                        dtype=ldt)
    count, first = _expected(bt, lens, block_size, num_blocks)
    msgs = [_run(bt, lens, block_size, num_blocks, fused) for fused in (True, False)]
    if count == 0:
        assert msgs == [None, None]
        return
    b, i = first
    for m in msgs:
        assert m is not None
        assert f"got block_table[{b}, {i}] = {int(bt[b, i])} for seq_lens[{b}] = {int(lens[b])}" in m, m
        assert re.search(rf"; {count} bad entries in all$", m), m
    assert msgs[0] == msgs[1]


@pytest.mark.parametrize("fused", [True, False])
def test_the_op_refuses_a_bad_used_entry_and_ignores_unused_ones(fused, monkeypatch):
    monkeypatch.setattr(validation, "FUSED_TABLE_CHECK", fused)
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, D, bs, nb = 2, 4, 2, 16, 16, 6
    q = torch.randn(B, Hq, D, generator=g)
    kc = torch.randn(nb, bs, Hkv, D, generator=g)
    vc = torch.randn(nb, bs, Hkv, D, generator=g)
    lens = torch.tensor([20, 16], dtype=torch.int32)
    th = torch.full((Hkv, 1), float("-inf"))
    table = torch.tensor([[0, 1, 99], [2, -3, 4]], dtype=torch.int32)  # unused entries: [0, 2], [1, 1], [1, 2]
    topth_ops.decode_attention(q, kc, vc, lens, th, block_table=table, kv_layout="NHD", selection="group", backend="cpu")
    table[1, 0] = nb
    with pytest.raises(ValueError, match=re.escape(f"got block_table[1, 0] = {nb} for seq_lens[1] = 16")):
        topth_ops.decode_attention(q, kc, vc, lens, th, block_table=table, kv_layout="NHD", selection="group", backend="cpu")
