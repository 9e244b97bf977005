"""vLLM's AMX cache layout (``kv_layout="VLLM_AMX"``, topth_ops/packed.py): the offsets against
an independent reading of vLLM's writer, pack / unpack, the paged helpers on the layout, and
the op's errors. The comparison with vLLM's own writer (and its own attention on the same
cache) is in tests/serving/test_vllm_paged_ops.py."""

import pytest
import torch

from topth_ops import decode_attention, packed
from topth_ops.paged import to_paged, write_kv
from topth_ops.value_sum import PagedValueSum, paged_value_mean


def test_offsets_follow_the_documented_packing():
    """K (slot, d): [slot // 16][d // 2][slot % 16][d % 2]; V: [d // 16][slot // 2][d % 16][slot % 2]."""
    bs, d = 64, 96
    koff = packed.offsets(bs, d, "key").view(bs, d)
    voff = packed.offsets(bs, d, "value").view(bs, d)
    for slot, dim in ((0, 0), (0, 1), (1, 0), (15, 95), (16, 0), (63, 94), (33, 17)):
        assert int(koff[slot, dim]) == (((slot // 16) * (d // 2) + dim // 2) * 16 + slot % 16) * 2 + dim % 2
        assert int(voff[slot, dim]) == (((dim // 16) * (bs // 2) + slot // 2) * 16 + dim % 16) * 2 + slot % 2
    for off in (koff, voff):  # a permutation of the region
        assert torch.equal(off.flatten().sort().values, torch.arange(bs * d))


def test_pack_unpack_round_trip():
    rows = torch.randn(3, 2, 32, 64).bfloat16()
    for kind in ("key", "value"):
        p = packed.pack(rows, kind)
        assert not torch.equal(p, rows)
        assert torch.equal(packed.unpack(p, kind), rows)


@pytest.mark.parametrize("bs,d", [(16, 64), (32, 48), (24, 64)])
def test_sizes_the_layout_lacks_are_refused(bs, d):
    with pytest.raises(ValueError, match="VLLM_AMX"):
        packed.offsets(bs, d, "key")
    k = torch.zeros(1, 1, 64, d).bfloat16()
    with pytest.raises(ValueError, match="VLLM_AMX"):
        to_paged(k, k, torch.tensor([64]), bs, kv_layout="VLLM_AMX")


def test_write_kv_and_value_sum_on_the_layout():
    """write_kv into a VLLM_AMX pool equals to_paged of the same rows; the per-block V sum reads
    the packed rows (its cache re-sum included)."""
    gen = torch.Generator().manual_seed(0)
    B, H, S, D, bs = 2, 2, 70, 64, 32
    k = torch.randn(B, H, S, D, generator=gen).bfloat16()
    v = torch.randn(B, H, S, D, generator=gen).bfloat16()
    lens = torch.tensor([70, 41])
    kc, vc, table = to_paged(k, v, lens, bs, kv_layout="VLLM_AMX", generator=gen, fill=0.0)
    k2, v2 = torch.zeros_like(kc), torch.zeros_like(vc)
    sums = PagedValueSum(kc.shape[0], bs, H, D, kv_layout="VLLM_AMX")
    for b in range(B):
        n = int(lens[b])
        pos = torch.arange(n)
        slots = table[b, pos // bs].long() * bs + pos % bs
        sums.update(v2, v[b, :, :n].transpose(0, 1), slots)  # before the write
        write_kv(k2, v2, k[b, :, :n].transpose(0, 1), v[b, :, :n].transpose(0, 1), slots, kv_layout="VLLM_AMX")
    for cache, want in ((k2, kc), (v2, vc)):
        used = table[table >= 0].long()
        assert torch.equal(cache[used], want[used])
    mean = sums.mean(table, lens, vc)
    want = torch.stack([v[b, :, : int(lens[b])].float().mean(1) for b in range(B)])
    torch.testing.assert_close(mean, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(paged_value_mean(sums.sum, table, lens, bs), want, atol=1e-5, rtol=1e-5)


def test_op_refuses_other_dtypes_and_strided_regions():
    q = torch.randn(1, 4, 64)
    k = torch.zeros(2, 2, 32, 64)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    th = torch.zeros(4, 1)
    with pytest.raises(TypeError, match="VLLM_AMX"):
        decode_attention(q, k, k, torch.tensor([40]), th, block_table=table, kv_layout="VLLM_AMX")
    kb = torch.zeros(2, 2, 32, 128).bfloat16()[..., :64]
    with pytest.raises(ValueError, match="key_cache"):
        decode_attention(q.bfloat16(), kb, kb, torch.tensor([40]), th, block_table=table, kv_layout="VLLM_AMX")


def test_misaligned_regions_and_helper_inputs_are_refused():
    """A region starting off a 4-byte boundary (the kernel pairs 16-bit elements in 32-bit lanes)
    is refused by the contract naming the cache, for every backend; the paged helpers refuse
    other dtypes and sizes when built, not later."""
    q = torch.randn(1, 4, 64).bfloat16()
    flat = torch.zeros(2 * 2 * 32 * 64 + 1).bfloat16()
    odd = flat[1:].view(2, 2, 32, 64)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    th = torch.zeros(4, 1)
    for backend in ("torch", "cpu"):
        with pytest.raises(ValueError, match="value_cache.*4-byte"):
            decode_attention(q, torch.zeros(2, 2, 32, 64).bfloat16(), odd, torch.tensor([40]), th, block_table=table,
                             kv_layout="VLLM_AMX", backend=backend)
    with pytest.raises(TypeError, match="VLLM_AMX"):
        to_paged(torch.zeros(1, 1, 64, 64), torch.zeros(1, 1, 64, 64), torch.tensor([64]), 32, kv_layout="VLLM_AMX")
    with pytest.raises(TypeError, match="VLLM_AMX"):
        write_kv(torch.zeros(2, 1, 32, 64), torch.zeros(2, 1, 32, 64), torch.zeros(1, 1, 64), torch.zeros(1, 1, 64),
                 torch.tensor([3]), kv_layout="VLLM_AMX")
    with pytest.raises(ValueError, match="VLLM_AMX"):
        PagedValueSum(4, 16, 1, 64, kv_layout="VLLM_AMX")


def test_offsets_are_a_copy():
    off = packed.offsets(32, 64, "key")
    off.zero_()
    assert not torch.equal(packed.offsets(32, 64, "key"), off)


@pytest.mark.parametrize("fn", [packed.pack, packed.unpack])
def test_unknown_kind_is_refused(fn):
    x = torch.zeros(2, 32, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kind must be 'key' or 'value', got 'values'"):
        fn(x, "values")
