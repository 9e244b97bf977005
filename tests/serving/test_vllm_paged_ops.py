"""Paged pieces of the vLLM backend against independent float64 recomputations."""

import math

import numpy as np
import pytest
import torch

from topth_ops.paged import write_kv
from topth_ops.value_sum import PagedValueSum
from topth_ops.vllm.paged_ops import gather_sequence, nhd_views, prefill_dense

pytestmark = pytest.mark.vllm


def test_nhd_views_of_lbnhc_cache():
    nb, bs, H, D = 5, 4, 3, 8
    phys = torch.randn(nb, bs, H, 2 * D)          # LBNHC: tokens outside heads in memory
    logical = phys.permute(0, 2, 1, 3)             # what vLLM hands the backend: [nb, H, bs, 2D]
    k, v = nhd_views(logical, D)
    assert k.shape == v.shape == (nb, bs, H, D)
    assert torch.equal(k, phys[..., :D]) and torch.equal(v, phys[..., D:])
    assert k.data_ptr() == phys.data_ptr()         # views, no copy
    k[1, 2, 0, 3] = 42.0
    assert phys[1, 2, 0, 3] == 42.0
    with pytest.raises(ValueError, match="kv_cache must be"):
        nhd_views(logical, D + 1)


class Sim:
    """A paged cache written the way vLLM writes it, with the V sums updated alongside."""

    def __init__(self, nb=12, bs=4, H=2, D=3, seed=0):
        self.g = torch.Generator().manual_seed(seed)
        self.bs = bs
        self.k = torch.randn(nb, bs, H, D, generator=self.g) * 100  # stale garbage everywhere
        self.v = torch.randn(nb, bs, H, D, generator=self.g) * 100
        self.vs = PagedValueSum(nb, bs, H, D)
        self.tables: dict[str, list] = {}
        self.lens: dict[str, int] = {}
        self.rows: dict[str, list] = {}  # the V rows each sequence wrote, position by position

    def write(self, seq, new_rows, blocks=None, start=None):
        """Write rows at positions start.. (default: the sequence's end)."""
        if blocks is not None:
            self.tables[seq] = blocks
        pos0 = self.lens.get(seq, 0) if start is None else start
        T = len(new_rows)
        slots = torch.tensor([self.tables[seq][(pos0 + i) // self.bs] * self.bs + (pos0 + i) % self.bs
                              for i in range(T)])
        val = torch.stack(new_rows)
        key = torch.randn(val.shape, generator=self.g)
        self.vs.update(self.v, val, slots)       # before the write, as the backend does
        write_kv(self.k, self.v, key, val, slots, "NHD")
        self.lens[seq] = max(self.lens.get(seq, 0), pos0 + T)

    def new_rows(self, T):
        return [torch.randn(self.v.shape[2:], generator=self.g) for _ in range(T)]

    def check(self, seqs):
        bt_w = max(len(self.tables[s]) for s in seqs)
        bt = torch.tensor([self.tables[s] + [-1] * (bt_w - len(self.tables[s])) for s in seqs], dtype=torch.int32)
        n = torch.tensor([self.lens[s] for s in seqs])
        got = self.vs.mean(bt, n)
        for i, s in enumerate(seqs):
            rows = gather_sequence(self.v.double(), bt[i], int(n[i]))  # float64 from the cache itself
            want = rows.mean(0)
            assert torch.allclose(got[i].double(), want, rtol=1e-5, atol=1e-5), (s, got[i], want)


def test_value_sum_follows_vllm_writes():
    sim = Sim()
    sim.write("A", sim.new_rows(4), blocks=[3, 7])     # chunked prefill, chunk 1
    sim.check(["A"])
    sim.write("A", sim.new_rows(2))                    # chunk 2 (block 7 fresh: offset 0 resets it)
    sim.check(["A"])
    # B hits A's full first block in the prefix cache, then prefills the rest into block 5
    sim.tables["B"], sim.lens["B"] = [3, 5], 4
    sim.write("B", sim.new_rows(3))
    sim.check(["A", "B"])
    # C's 4-token prompt is all cached (block 3): vLLM recomputes its last token into the
    # shared block, rewriting slot 3 with the same row
    sim.tables["C"], sim.lens["C"] = [3], 4
    sim.write("C", [sim.v[3, 3].clone()], start=3)
    sim.check(["A", "B", "C"])
    for step in range(6):                              # decode steps; B, A cross into blocks 11 / 10, 9
        if step in (1, 5):
            sim.tables["B"].append(11 if step == 1 else 10)
        if step == 2:
            sim.tables["A"].append(9)
        sim.write("A", sim.new_rows(1))
        sim.write("B", sim.new_rows(1))
        sim.check(["A", "B", "C"])
    # A finishes; its uncached blocks 7 and 9 go to D, which writes from offset 0 again
    sim.write("D", sim.new_rows(5), blocks=[9, 7])
    sim.check(["B", "C", "D"])


def test_value_sum_skips_padding_slots():
    sim = Sim()
    sim.tables["A"] = [2]
    vals = torch.stack(sim.new_rows(3))
    slots = torch.tensor([8, -1, 9])  # -1: vLLM's padding token
    sim.vs.update(sim.v, vals, slots)
    write_kv(sim.k, sim.v, vals, vals, slots, "NHD")
    got = sim.vs.mean(torch.tensor([[2]], dtype=torch.int32), torch.tensor([2]))
    assert torch.allclose(got[0], (vals[0] + vals[2]) / 2)


@pytest.mark.parametrize("n,L,bs", [(7, 7, 4), (23, 5, 4), (16, 1, 16), (40, 9, 16)])
def test_prefill_dense_matches_float64_causal_attention(n, L, bs, causal_reference):
    g = torch.Generator().manual_seed(n * 100 + L)
    Hq, Hkv, D = 6, 2, 8
    nb = -(-n // bs)
    blocks = torch.randperm(nb + 3, generator=g)[:nb]
    k_cache = torch.randn(nb + 3, bs, Hkv, D, generator=g)
    v_cache = torch.randn(nb + 3, bs, Hkv, D, generator=g)
    row = torch.cat([blocks, torch.full((2,), -1)]).to(torch.int32)  # trailing unused entries
    q = torch.randn(L, Hq, D, generator=g)
    scale = 1 / math.sqrt(D)
    got = prefill_dense(q, k_cache, v_cache, row, n, scale)
    k = gather_sequence(k_cache, row, n).double().numpy()
    v = gather_sequence(v_cache, row, n).double().numpy()
    want = causal_reference(q.double().numpy(), k, v, n - L, scale)
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-5)


def test_gather_sequence_follows_the_table():
    bs, H, D = 4, 1, 2
    cache = torch.arange(6 * bs * H * D, dtype=torch.float32).reshape(6, bs, H, D)
    row = torch.tensor([4, 1, 5], dtype=torch.int32)
    got = gather_sequence(cache, row, 6)  # positions 0..3 in block 4, 4..5 in block 1
    assert torch.equal(got[:4], cache[4]) and torch.equal(got[4:], cache[1, :2])


def test_vllm_amx_layout_is_vllms_own_cache():
    """kv_layout='VLLM_AMX' reads the cache vLLM's own writer (cpu_attn_reshape_and_cache, isa
    'amx') packed: the offsets equal the writer's, and the cpu and torch backends on that cache
    equal the float64 oracle within bfloat16 rounding."""
    ops = pytest.importorskip("vllm._custom_ops")
    from topth_ops import decode_attention, packed
    from topth_ops.conformance.oracle import oracle_decode

    gen = torch.Generator().manual_seed(0)
    B, Hq, Hkv, D, S, bs = 2, 8, 2, 64, 100, 32
    nb = 2 * -(-S // bs)
    k = torch.randn(B * S, Hkv, D, generator=gen).bfloat16()
    v = torch.randn(B * S, Hkv, D, generator=gen).bfloat16()
    kv = torch.zeros(nb, Hkv, bs, 2 * D, dtype=torch.bfloat16)
    kc, vc = kv.view(nb, Hkv, 2 * bs, D).chunk(2, dim=2)  # as vLLM's CPU backend views its cache
    table = torch.randperm(nb, generator=gen).to(torch.int32).view(B, nb // B)
    pos = torch.arange(S)
    slots = (table[:, pos // bs].long() * bs + pos % bs).reshape(-1)
    try:
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, "amx")
    except RuntimeError as e:  # vLLM's CPU ops built for this CPU lack the AMX writer (AVX2-only CPUs)
        if "Unsupported CPU attention configuration" not in str(e):
            raise
        pytest.skip(f"vLLM's CPU attention ops on this CPU cannot write its 'amx' layout: {e}")
    rows_k = packed.unpack(kc, "key")  # [nb, Hkv, bs, D] rows
    blk, off = slots // bs, slots % bs
    assert torch.equal(rows_k[blk, :, off], k)
    assert torch.equal(packed.unpack(vc, "value")[blk, :, off], v)
    q = torch.randn(B, Hq, D, generator=gen).bfloat16()
    lens = torch.tensor([S, 61])
    th = torch.full((Hq, 1), 0.004)
    kw = dict(query=q, key_cache=kc, value_cache=vc, seq_lens=lens, thresholds=th, block_table=table,
              kv_layout="VLLM_AMX", placement="post_softmax")
    want = oracle_decode(**kw)
    for backend in ("cpu", "torch"):
        out = decode_attention(**kw, backend=backend)
        np.testing.assert_allclose(out.float().numpy(), want.out, atol=2e-2, rtol=2e-2)
