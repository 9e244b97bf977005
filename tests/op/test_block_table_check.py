"""The op's check of block-table values (topth_ops.validation.check_block_table_values): its
compiled CPU pass and its torch path against an independent loop over the used entries
(which entries are bad, how many, which one the error names), and through the public op."""

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
        used = min(bt.shape[1], max(0, -(-n // block_size)))
        for i in range(used):
            v = int(bt[b, i])
            if v < 0 or v >= num_blocks:
                bad += 1
                first = first or (b, i)
    return bad, first


class _Counted:
    """The compiled module with its check counted (proof that the fast path ran)."""

    def __init__(self, mod):
        self.mod, self.calls = mod, 0

    def check_block_table(self, *args):
        self.calls += 1
        return self.mod.check_block_table(*args)


def _run(bt, lens, block_size, num_blocks, fused):
    """The check's error message on one path (None when it passes), and whether the compiled
    pass ran."""
    saved = validation.FUSED_TABLE_CHECK, validation._table_check_module
    counted = _Counted(saved[1]())
    validation.FUSED_TABLE_CHECK = fused
    validation._table_check_module = lambda: counted if validation.FUSED_TABLE_CHECK else None
    try:
        validation.check_block_table_values(bt, lens, block_size, num_blocks)
        msg = None
    except ValueError as e:
        msg = str(e)
    finally:
        validation.FUSED_TABLE_CHECK, validation._table_check_module = saved
    assert counted.calls == int(fused), "the compiled check ran on the torch path or not on the fused one"
    return msg


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
    view = data.draw(st.sampled_from(["contiguous", "strided", "transposed"]))
    if view == "strided":  # a strided view of a wider table
        wide = torch.full((rows, 2 * cols), -5, dtype=tdt)
        wide[:, ::2] = bt
        bt = wide[:, ::2]
    elif view == "transposed":  # column-major storage
        bt = bt.t().contiguous().t()
    top = 2**31 - 1 if ldt == torch.int32 else 2**63 - 1
    lengths = st.one_of(st.integers(0, cols * block_size + 3), st.sampled_from([-1, top - 15, top]))
    lens = torch.tensor(data.draw(st.lists(lengths, min_size=rows, max_size=rows)), dtype=ldt)
    if data.draw(st.booleans()):  # every other element of a longer vector
        lens = torch.stack([lens, lens]).t().reshape(-1)[::2]
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
def test_empty_tables_pass_on_both_paths(fused):
    for rows, cols in [(0, 4), (3, 0), (0, 0)]:
        assert _run(torch.zeros(rows, cols, dtype=torch.int32), torch.zeros(rows, dtype=torch.int64), 16, 4,
                    fused) is None


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
    kw = dict(block_table=table, kv_layout="NHD", selection="group", backend="cpu")
    topth_ops.decode_attention(q, kc, vc, lens, th, **kw)
    table[1, 0] = nb
    with pytest.raises(ValueError, match=re.escape(f"got block_table[1, 0] = {nb} for seq_lens[1] = 16")):
        topth_ops.decode_attention(q, kc, vc, lens, th, **kw)
