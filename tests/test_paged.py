"""Paged-cache helpers (topth_ops.paged): token writes, the maintained per-block V sum and
its mean, against means recomputed independently in float64 from the written rows."""

import pytest
import torch

import topth_ops
from topth_ops.conformance.oracle import oracle_decode
from topth_ops.paged import new_value_sum, paged_value_mean, to_paged, update_value_sum, write_kv

BS, H, D = 16, 2, 8


def _slots(table, b, positions):
    return torch.tensor([int(table[b, j // BS]) * BS + j % BS for j in positions], dtype=torch.int64)


def _mean64(rows):
    return torch.stack(rows).double().mean(0)


def test_value_sum_tracks_token_by_token_and_chunked_writes():
    g = torch.Generator().manual_seed(0)
    lens = [37, 16, 1]
    table = torch.tensor([[5, 2, 9], [0, 7, 7], [3, 1, 1]], dtype=torch.int32)
    vs = new_value_sum(10, H, D)
    written = {b: [] for b in range(3)}
    # sequence 0: a prefill chunk of 20 rows, then decode one row at a time
    rows = torch.randn(20, H, D, generator=g)
    update_value_sum(vs, rows, _slots(table, 0, range(20)), BS)
    written[0] += list(rows)
    for j in range(20, 37):
        r = torch.randn(1, H, D, generator=g)
        update_value_sum(vs, r, _slots(table, 0, [j]), BS)
        written[0] += list(r)
    for b in (1, 2):  # one chunk each, with vLLM's padding slot -1 in between
        r = torch.randn(lens[b] + 1, H, D, generator=g)
        slots = torch.cat([_slots(table, b, range(lens[b])), torch.tensor([-1])])
        update_value_sum(vs, r, slots, BS)
        written[b] += list(r[:-1])
    mu = paged_value_mean(vs, table, torch.tensor(lens), BS)
    for b in range(3):
        torch.testing.assert_close(mu[b].double(), _mean64(written[b]), atol=1e-6, rtol=1e-6)


def test_reused_block_forgets_old_rows_and_shared_prefix_blocks_count_for_both():
    g = torch.Generator().manual_seed(1)
    vs = new_value_sum(4, H, D)
    old = torch.randn(BS, H, D, generator=g)
    update_value_sum(vs, old, torch.arange(BS) + 2 * BS, BS)  # block 2 filled by a finished request
    prefix = torch.randn(BS, H, D, generator=g)
    update_value_sum(vs, prefix, torch.arange(BS), BS)  # block 0: a shared prefix
    tails = [torch.randn(3, H, D, generator=g), torch.randn(5, H, D, generator=g)]
    update_value_sum(vs, tails[0], torch.arange(3) + 2 * BS, BS)  # block 2 reused from offset 0
    update_value_sum(vs, tails[1], torch.arange(5) + 3 * BS, BS)
    table = torch.tensor([[0, 2], [0, 3]], dtype=torch.int32)
    mu = paged_value_mean(vs, table, torch.tensor([BS + 3, BS + 5]), BS)
    for b in range(2):
        torch.testing.assert_close(mu[b].double(), _mean64(list(prefix) + list(tails[b])),
                                   atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_write_kv_places_rows_where_the_table_says(layout):
    g = torch.Generator().manual_seed(2)
    shape = (6, BS, H, D) if layout == "NHD" else (6, H, BS, D)
    kc, vc = torch.zeros(shape), torch.zeros(shape)
    table = torch.tensor([[4, 1]], dtype=torch.int32)
    k, v = torch.randn(20, H, D, generator=g), torch.randn(20, H, D, generator=g)
    write_kv(kc, vc, k, v, _slots(table, 0, range(20)), layout)
    for j in range(20):
        blk, off = int(table[0, j // BS]), j % BS
        got_k = kc[blk, off] if layout == "NHD" else kc[blk, :, off]
        got_v = vc[blk, off] if layout == "NHD" else vc[blk, :, off]
        assert torch.equal(got_k, k[j]) and torch.equal(got_v, v[j])


def test_paged_value_mean_as_value_mean_equals_the_cache_mean():
    g = torch.Generator().manual_seed(3)
    B, Hq, S = 3, 4, 70
    k, v = torch.randn(B, H, S, D, generator=g), torch.randn(B, H, S, D, generator=g)
    lens = torch.tensor([70, 17, 0])
    kc, vc, table = to_paged(k, v, lens, BS, generator=g)
    vs = new_value_sum(kc.shape[0], H, D)
    for b in range(B):
        n = int(lens[b])
        update_value_sum(vs, v[b, :, :n].transpose(0, 1), _slots(table, b, range(n)), BS)
    mu = paged_value_mean(vs, table, lens, BS)
    q, th = torch.randn(B, Hq, D, generator=g), torch.full((Hq, S), 0.05)
    out = topth_ops.decode_attention(q, kc, vc, lens, th, vmc=True, value_mean=mu, block_table=table)
    want = oracle_decode(q, kc, vc, lens, th, vmc=True, block_table=table)  # mean from the cache
    torch.testing.assert_close(out.double(), torch.from_numpy(want.out), atol=1e-5, rtol=1e-5)


def test_bad_arguments_are_named():
    vs = new_value_sum(2, H, D)
    with pytest.raises(TypeError, match="slot_mapping"):
        update_value_sum(vs, torch.zeros(2, H, D), torch.zeros(2), BS)
    with pytest.raises(ValueError, match="slot_mapping"):
        update_value_sum(vs, torch.zeros(2, H, D), torch.zeros(3, dtype=torch.int64), BS)
    with pytest.raises(ValueError, match="value_sum"):
        update_value_sum(vs.double(), torch.zeros(2, H, D), torch.zeros(2, dtype=torch.int64), BS)
    with pytest.raises(ValueError, match="kv_layout"):
        write_kv(torch.zeros(2, BS, H, D), torch.zeros(2, BS, H, D), torch.zeros(1, H, D),
                 torch.zeros(1, H, D), torch.zeros(1, dtype=torch.int64), "BNSD")
    with pytest.raises(ValueError, match="num_blocks"):
        to_paged(torch.zeros(1, H, 40, D), torch.zeros(1, H, 40, D), torch.tensor([40]), BS, num_blocks=2)
