"""Paged-cache helpers (topth_ops.paged): token writes, the maintained per-block V sum
(PagedValueSum: chunked writes, block reuse, rewritten slots, shared prefixes) and its
mean, against means recomputed independently in float64 from the written rows. Every test
runs on both paths of PagedValueSum: the torch one and the compiled CPU pass."""

import pytest
import torch

import topth_ops
from topth_ops.conformance.oracle import oracle_decode
from topth_ops.paged import to_paged, write_kv
from topth_ops import value_sum
from topth_ops.value_sum import PagedValueSum, paged_value_mean

BS, H, D = 16, 2, 8


@pytest.fixture(autouse=True, params=["torch", "fused"])
def value_sum_path(request, monkeypatch):
    """PagedValueSum's torch path, or its compiled one-pass CPU path."""
    monkeypatch.setattr(value_sum, "FUSED_CPU", request.param == "fused")
    if request.param == "fused":  # no skip: test_value_sum_fused.py fails when it is not built
        assert value_sum._fused_module() is not None, "the CPU kernel module lacks value_sum_update"
    return request.param


def _slots(table, b, positions):
    return torch.tensor([int(table[b, j // BS]) * BS + j % BS for j in positions], dtype=torch.int64)


def _mean64(rows):
    return torch.stack(rows).double().mean(0)


class _Written:
    """A paged cache written through write_kv with a PagedValueSum updated before each write."""

    def __init__(self, layout, num_blocks=10, seed=0):
        self.g = torch.Generator().manual_seed(seed)
        shape = (num_blocks, BS, H, D) if layout == "NHD" else (num_blocks, H, BS, D)
        self.layout = layout
        self.k, self.v = torch.full(shape, 50.0), torch.full(shape, 50.0)  # stale rows everywhere
        self.vs = PagedValueSum(num_blocks, BS, H, D, kv_layout=layout)

    def write(self, rows, slots):
        self.vs.update(self.v, rows, slots)
        write_kv(self.k, self.v, torch.randn(rows.shape, generator=self.g), rows, slots, self.layout)

    def rand(self, T):
        return torch.randn(T, H, D, generator=self.g)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_value_sum_tracks_token_by_token_and_chunked_writes(layout):
    w = _Written(layout)
    lens = [37, 16, 1]
    table = torch.tensor([[5, 2, 9], [0, 7, 7], [3, 1, 1]], dtype=torch.int32)
    written = {b: [] for b in range(3)}
    rows = w.rand(20)  # sequence 0: a prefill chunk of 20 rows, then one row at a time
    w.write(rows, _slots(table, 0, range(20)))
    written[0] += list(rows)
    for j in range(20, 37):
        r = w.rand(1)
        w.write(r, _slots(table, 0, [j]))
        written[0] += list(r)
    for b in (1, 2):  # one chunk each, with vLLM's padding slot -1 in between
        r = w.rand(lens[b] + 1)
        w.write(r, torch.cat([_slots(table, b, range(lens[b])), torch.tensor([-1])]))
        written[b] += list(r[:-1])
    mu = w.vs.mean(table, torch.tensor(lens))
    for b in range(3):
        torch.testing.assert_close(mu[b].double(), _mean64(written[b]), atol=1e-6, rtol=1e-6)


def test_reused_block_rewritten_slot_and_shared_prefix_blocks():
    w = _Written("NHD", num_blocks=4, seed=1)
    w.write(w.rand(BS), torch.arange(BS) + 2 * BS)  # block 2 filled by a finished request
    prefix = w.rand(BS)
    w.write(prefix, torch.arange(BS))  # block 0: a shared prefix
    tails = [w.rand(3), w.rand(5)]
    w.write(tails[0], torch.arange(3) + 2 * BS)  # block 2 reused from offset 0: old rows forgotten
    w.write(tails[1], torch.arange(5) + 3 * BS)
    again = w.rand(1)  # a counted slot rewritten (vLLM recomputes a prompt's last token)
    w.write(again, torch.tensor([BS - 1]))
    prefix[BS - 1] = again[0]
    table = torch.tensor([[0, 2], [0, 3]], dtype=torch.int32)
    mu = w.vs.mean(table, torch.tensor([BS + 3, BS + 5]))
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
    vs = PagedValueSum(kc.shape[0], BS, H, D)
    empty = torch.zeros_like(vc)
    for b in range(B):
        n = int(lens[b])
        vs.update(empty, v[b, :, :n].transpose(0, 1), _slots(table, b, range(n)))
    mu = vs.mean(table, lens)
    q, th = torch.randn(B, Hq, D, generator=g), torch.full((Hq, S), 0.05)
    out = topth_ops.decode_attention(q, kc, vc, lens, th, vmc=True, value_mean=mu, block_table=table)
    want = oracle_decode(q, kc, vc, lens, th, vmc=True, block_table=table)  # mean from the cache
    torch.testing.assert_close(out.double(), torch.from_numpy(want.out), atol=1e-5, rtol=1e-5)


def test_bad_arguments_are_named():
    vs, cache = PagedValueSum(2, BS, H, D), torch.zeros(2, BS, H, D)
    with pytest.raises(TypeError, match="slot_mapping"):
        vs.update(cache, torch.zeros(2, H, D), torch.zeros(2))
    with pytest.raises(ValueError, match="slot_mapping"):
        vs.update(cache, torch.zeros(2, H, D), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="value must have shape"):
        vs.update(cache, torch.zeros(2, H + 1, D), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="kv_layout"):
        PagedValueSum(2, BS, H, D, kv_layout="BNSD")
    with pytest.raises(ValueError, match="kv_layout"):
        write_kv(torch.zeros(2, BS, H, D), torch.zeros(2, BS, H, D), torch.zeros(1, H, D),
                 torch.zeros(1, H, D), torch.zeros(1, dtype=torch.int64), "BNSD")
    with pytest.raises(ValueError, match="num_blocks"):
        to_paged(torch.zeros(1, H, 40, D), torch.zeros(1, H, 40, D), torch.tensor([40]), BS, num_blocks=2)


def _nhd(nb=4):
    return torch.zeros(nb, BS, H, D), torch.zeros(nb, BS, H, D)


@pytest.mark.parametrize("rows", [torch.ones(2, 1, D), torch.ones(2, H, 1), torch.ones(2, D)],
                         ids=["one_head", "one_dim", "no_head_dim"])
def test_write_kv_refuses_rows_that_would_broadcast(rows):
    # before: torch broadcast [2, 1, D] over every head (or [2, H, 1] over head_dim) and wrote it
    kc, vc = _nhd()
    with pytest.raises(ValueError, match=r"key must have shape \[num_tokens, 2, 8\]"):
        write_kv(kc, vc, rows, rows, torch.tensor([0, 1]), "NHD")
    assert not kc.any() and not vc.any()


def test_paged_helpers_name_bad_slots_caches_and_sizes():
    kc, vc = _nhd()
    one = torch.ones(1, H, D)
    past = torch.tensor([4 * BS])  # one past the pool (before: a bare IndexError)
    with pytest.raises(ValueError, match=r"slot_mapping values must be < num_blocks x block_size = 64"):
        write_kv(kc, vc, one, one, past, "NHD")
    with pytest.raises(TypeError, match="key must be a torch.Tensor"):
        write_kv(kc, vc, [[0.0]], one, torch.tensor([0]), "NHD")
    with pytest.raises(ValueError, match="value_cache shape must equal the key_cache shape"):
        write_kv(kc, torch.zeros(4, BS, H, D + 1), one, one, torch.tensor([0]), "NHD")
    vs = PagedValueSum(4, BS, H, D)
    with pytest.raises(ValueError, match=r"slot_mapping values must be < num_blocks x block_size"):
        vs.update(vc, one, past)
    # an HND cache (or one of another pool) handed to an NHD sum: before, silently accepted or IndexError
    with pytest.raises(ValueError, match=r"value_cache must have shape \[4, 16, 2, 8\] \(NHD"):
        vs.update(torch.zeros(4, H, BS, D), one, torch.tensor([3]))
    with pytest.raises(ValueError, match=r"value_cache must have shape \[4, 16, 2, 8\]"):
        vs.update(torch.zeros(7, BS, H, D), one, torch.tensor([3]))
    for bad in (0, -1):
        with pytest.raises(ValueError, match="block_size must be an int >= 1"):
            PagedValueSum(4, bad, H, D)
        with pytest.raises(ValueError, match="block_size must be an int >= 1"):
            to_paged(torch.zeros(1, H, 8, D), torch.zeros(1, H, 8, D), torch.tensor([8]), bad)
    with pytest.raises(TypeError, match="block_size must be an int"):
        PagedValueSum(4, 16.0, H, D)


def test_value_sum_refuses_a_slot_twice_in_one_call():
    # before: both rows were added, the block's sum counted slot 0 twice (2.0 instead of 1.0)
    vs = PagedValueSum(4, BS, H, D)
    with pytest.raises(ValueError, match="must not name a slot twice"):
        vs.update(torch.zeros(4, BS, H, D), torch.ones(2, H, D), torch.tensor([0, 0]))
    assert not vs.sum.any()
    vs.update(torch.zeros(4, BS, H, D), torch.ones(3, H, D), torch.tensor([-1, 0, -1]))  # padding may repeat
    assert float(vs.sum[0, 0, 0]) == 1.0


def test_paged_value_mean_checks_lengths_and_used_blocks():
    sums = torch.ones(4, H, D)
    table = torch.tensor([[0]], dtype=torch.int32)
    # before: n = 40 past the one-block table gave 16/40 = 0.4 (a wrong mean), silently
    with pytest.raises(ValueError, match=r"seq_lens values must lie in \[0, 16\]"):
        paged_value_mean(sums, table, torch.tensor([40]), BS)
    with pytest.raises(ValueError, match=r"seq_lens values must lie in \[0, 16\]"):
        paged_value_mean(sums, table, torch.tensor([-3]), BS)
    with pytest.raises(ValueError, match=r"\[0, num_blocks=4\) \(value_sum dim 0\)"):
        paged_value_mean(sums, torch.tensor([[9]], dtype=torch.int32), torch.tensor([3]), BS)
    with pytest.raises(TypeError, match="block_table dtype must be int32"):
        paged_value_mean(sums, table.float(), torch.tensor([3]), BS)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        paged_value_mean(sums, table, torch.tensor([3]), 0)
    # a valid call still averages the n rows: 3 rows of ones in block 0 -> sum 3, mean 1
    got = paged_value_mean(torch.full((4, H, D), 3.0), table, torch.tensor([3]), BS)
    assert torch.equal(got, torch.ones(1, H, D))


def test_to_paged_checks_its_inputs():
    k = torch.zeros(2, H, 40, D)
    with pytest.raises(ValueError, match=r"seq_lens values must lie in \[0, 40\]"):
        to_paged(k, k, torch.tensor([80, 3]), BS)  # before: a table too short for n = 80
    with pytest.raises(ValueError, match=r"seq_lens values must lie in \[0, 40\]"):
        to_paged(k, k, torch.tensor([-5, 3]), BS)  # before: an all -1 row, silently
    with pytest.raises(TypeError, match="seq_lens dtype must be int32 or int64"):
        to_paged(k, k, torch.tensor([4.0, 3.0]), BS)
    with pytest.raises(ValueError, match=r"seq_lens must have shape \[2\]"):
        to_paged(k, k, torch.tensor([40]), BS)
    with pytest.raises(ValueError, match="value shape must equal the key shape"):
        to_paged(k, k[:, :, :20], torch.tensor([10, 3]), BS)
    with pytest.raises(ValueError, match=r"key must have shape \[batch, num_kv_heads, max_seq_len, head_dim\]"):
        to_paged(k[0], k[0], torch.tensor([4]), BS)


# ------------------------------------------- isolation from what earlier users of a block left

def _cache_mean64(cache, table, n):
    """float64 mean of a sequence's first n rows, read from an NHD cache through its table row."""
    bs = cache.shape[1]
    return _mean64([cache[table[j // bs], j % bs] for j in range(n)])


def test_value_sum_over_never_written_nan_memory():
    """The issue's example: a pool never written (NaN), three rows of ones at slots 0-2."""
    cache = torch.full((1, 4, 1, 2), float("nan"))
    vs = PagedValueSum(1, 4, 1, 2)
    ones = torch.ones(3, 1, 2)
    vs.update(cache, ones, torch.tensor([0, 1, 2]))
    write_kv(cache.clone(), cache, ones, ones, torch.tensor([0, 1, 2]))
    assert torch.equal(vs.sum, torch.full((1, 1, 2), 3.0))
    assert torch.equal(vs.mean(torch.tensor([[0]], dtype=torch.int32), torch.tensor([3]), cache),
                       torch.ones(1, 1, 2))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("chunk", [1, 3, BS])
def test_reused_block_forgets_the_earlier_requests_nan_and_inf(layout, chunk):
    """A block that one request filled with NaN / inf rows and a later request rewrote
    with finite rows, in chunks of any size, holds the later request's sum."""
    cache = torch.zeros(2, BS, H, D) if layout == "NHD" else torch.zeros(2, H, BS, D)
    kc = cache.clone()
    vs = PagedValueSum(2, BS, H, D, kv_layout=layout)
    bad = torch.randn(BS, H, D)
    bad[1, 0, 0], bad[5, 1, 2] = float("nan"), float("inf")
    slots = torch.arange(BS)
    vs.update(cache, bad, slots)
    write_kv(kc, cache, bad, bad, slots, layout)
    assert not torch.isfinite(vs.sum[0]).all()
    good = torch.randn(BS, H, D, generator=torch.Generator().manual_seed(3))
    for lo in range(0, BS - 2, chunk):  # the later request's n = BS - 2 rows
        part = slice(lo, min(lo + chunk, BS - 2))
        vs.update(cache, good[part], slots[part])
        write_kv(kc, cache, good[part], good[part], slots[part], layout)
    table = torch.tensor([[0]], dtype=torch.int32)
    want = good[: BS - 2].double().mean(0)
    got = vs.mean(table, torch.tensor([BS - 2]), cache)
    torch.testing.assert_close(got[0].double(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(vs.sum[0].double(), good[: BS - 2].double().sum(0), rtol=1e-6, atol=1e-5)


def test_slot_rewritten_in_place_over_a_counted_nan_row():
    """A counted slot holding NaN, rewritten with a finite row: the block is re-summed."""
    cache = torch.zeros(1, BS, H, D)
    vs = PagedValueSum(1, BS, H, D)
    rows = torch.randn(4, H, D, generator=torch.Generator().manual_seed(4))
    first = rows.clone()
    first[2] = float("nan")
    vs.update(cache, first, torch.arange(4))
    write_kv(cache.clone(), cache, first, first, torch.arange(4))
    vs.update(cache, rows[2:3], torch.tensor([2]))
    write_kv(cache.clone(), cache, rows[2:3], rows[2:3], torch.tensor([2]))
    torch.testing.assert_close(vs.sum[0].double(), rows.double().sum(0), rtol=1e-6, atol=1e-6)


def test_mean_is_of_the_cache_rows_when_rows_were_written_past_n():
    """Rows written past a sequence's end (rejected speculative tokens) are in the block's
    sum; the mean read with the value cache averages rows 0..n-1 only."""
    cache = torch.zeros(2, BS, H, D)
    vs = PagedValueSum(2, BS, H, D)
    rows = torch.randn(BS + 5, H, D, generator=torch.Generator().manual_seed(5))
    rows[BS + 3] = float("nan")
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    slots = torch.cat([torch.arange(BS) + BS, torch.arange(5)])
    vs.update(cache, rows, slots)
    write_kv(cache.clone(), cache, rows, rows, slots)
    n = BS + 2
    got = vs.mean(table, torch.tensor([n]), cache)
    torch.testing.assert_close(got[0].double(), _cache_mean64(cache, table[0].tolist(), n), rtol=1e-6, atol=1e-6)
    assert torch.isnan(vs.mean(table, torch.tensor([n]))).all()  # without the cache: the sums as they are


def test_paged_value_mean_ignores_unused_table_entries_over_a_nan_block():
    """Unused (-1) table entries of one sequence never pull in block 0's NaN sum."""
    value_sum = torch.ones(3, H, D)
    value_sum[0] = float("nan")
    table = torch.tensor([[2, -1], [0, 1]], dtype=torch.int32)
    got = paged_value_mean(value_sum, table, torch.tensor([BS, 2 * BS]), BS)
    assert torch.equal(got[0], torch.full((H, D), 1.0 / BS))
    assert torch.isnan(got[1]).all()  # its own block 0 is NaN: its own answer


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_rows_out_of_order_are_re_summed_from_the_cache(layout):
    """Slot 0 rewritten in place (which restarts the block's count) then an append, and a
    call with a gap (slot 1 never written): the mean is still that of the cache rows."""
    shape = (2, BS, H, D) if layout == "NHD" else (2, H, BS, D)
    cache = torch.full(shape, float("nan"))
    kc = cache.clone()
    vs = PagedValueSum(2, BS, H, D, kv_layout=layout)
    rows = torch.randn(6, H, D, generator=torch.Generator().manual_seed(6))

    def put(r, slots):
        vs.update(cache, r, slots)
        write_kv(kc, cache, r, r, slots, layout)

    put(rows[:3], torch.arange(3))           # block 0: rows 0-2
    put(rows[3:4], torch.tensor([0]))         # slot 0 rewritten in place
    put(rows[4:5], torch.tensor([3]))         # then appended: n = 4
    table = torch.tensor([[0], [1]], dtype=torch.int32)
    own = torch.stack([rows[3], rows[1], rows[2], rows[4]]).double().mean(0)
    got = vs.mean(table, torch.tensor([4, 0]), cache)
    torch.testing.assert_close(got[0].double(), own, rtol=1e-6, atol=1e-6)
    put(rows[:2], torch.tensor([BS, BS + 2]))  # block 1: slots 0 and 2, slot 1 never written (NaN)
    got = vs.mean(table, torch.tensor([4, 3]), cache)
    assert torch.isnan(got[1]).all()  # the cache's rows 0..2 of block 1 hold a NaN: so does their mean


def test_value_sum_refuses_a_cache_of_another_dtype_or_device():
    vs = PagedValueSum(2, BS, H, D)
    with pytest.raises(TypeError, match="value_cache must be a floating-point tensor"):
        vs.mean(torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1]), torch.zeros(2, BS, H, D, dtype=torch.uint8))
    with pytest.raises(TypeError, match="value_cache must be a floating-point tensor"):
        vs.update(torch.zeros(2, BS, H, D, dtype=torch.int32), torch.zeros(1, H, D), torch.tensor([0]))
