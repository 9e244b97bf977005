"""PagedValueSum's compiled CPU pass (cpu_kernels/src/value_sum.cpp) against its torch path
and a float64 oracle, over random serving histories: chunked and token-by-token appends in
shuffled order with padding, blocks freed and reused over another request's NaN / inf rows,
slots rewritten in place (vLLM's prefix-cache recompute) and rows out of order; every cache
layout the sums read (NHD, HND, vLLM's strided K|V view), three dtypes, int32/int64 slots."""

import pytest
import torch

from topth_ops import value_sum
from topth_ops.paged import write_kv
from topth_ops.value_sum import PagedValueSum



def test_the_compiled_pass_is_built():
    """No skip: the CPU kernel module is built by every install with a C++ compiler (the cpu
    backend's tests need it too); a build without value_sum_update is a stale one."""
    assert value_sum._fused_module() is not None, "topth_ops.cpu_kernels._topth_cpu lacks value_sum_update"

BS, H, D, NB = 8, 3, 16, 24


def _caches(layout, dtype):
    """(key, value) caches as the sums read them; 'VLLM' is HND views into one [NB, H, BS, 2D]
    tensor (K then V per block and head), vLLM CPU attention's layout."""
    junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 7.0])
    if layout == "VLLM":
        kv = junk[torch.randint(0, 4, (NB, H, BS, 2 * D))].to(dtype)
        return kv[..., :D], kv[..., D:], "HND"
    shape = (NB, BS, H, D) if layout == "NHD" else (NB, H, BS, D)
    return junk[torch.randint(0, 4, shape)].to(dtype), junk[torch.randint(0, 4, shape)].to(dtype), layout


def _oracle_mean(vc, lay, blocks, n):
    rows = []
    for j in range(n):
        blk, off = blocks[j // BS], j % BS
        rows.append(vc[blk, off] if lay == "NHD" else vc[blk, :, off])
    return torch.stack(rows).double().mean(0) if rows else torch.zeros(H, D, dtype=torch.float64)


class _History:
    """Requests appended, rewritten, written out of order and freed at random; both paths
    see every write."""

    def __init__(self, layout, dtype, slot_dtype, seed):
        self.g = torch.Generator().manual_seed(seed)
        self.kc, self.vc, self.lay = _caches(layout, dtype)
        self.dtype, self.slot_dtype = dtype, slot_dtype
        self.sums = {p: PagedValueSum(NB, BS, H, D, kv_layout=self.lay) for p in ("torch", "fused")}
        self.free = list(range(NB))
        self.seqs = []  # [blocks, n]

    def _rint(self, lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=self.g))

    def _write(self, slots, monkeypatch):
        T = len(slots)
        rows = torch.randn(T, H, D, generator=self.g) * 3
        if self._rint(0, 2):  # the engine's order within a call is free; padding may repeat
            perm = torch.randperm(T, generator=self.g)
            slots, rows = [slots[i] for i in perm], rows[perm]
        if self._rint(0, 3) == 0:
            slots, rows = slots + [-1, -1], torch.cat([rows, torch.full((2, H, D), float("nan"))])
        st = torch.tensor(slots, dtype=self.slot_dtype)
        for path, vs in self.sums.items():
            monkeypatch.setattr(value_sum, "FUSED_CPU", path == "fused")
            vs.update(self.vc, rows, st)
        write_kv(self.kc, self.vc, rows, rows, st, self.lay)

    def step(self, monkeypatch):
        op = self._rint(0, 10)
        if (op < 2 or not self.seqs) and self.free:  # a new request: a prefill chunk
            self.seqs.append([[], 0])
            op = 9
        s = self.seqs[self._rint(0, len(self.seqs))]
        blocks, n = s
        if op < 4 and len(self.seqs) > 1:  # the request ends: its blocks go back to the pool
            self.seqs.remove(s)
            self.free += blocks
            return
        if op == 4 and n:  # the last counted slot rewritten in place
            self._write([blocks[(n - 1) // BS] * BS + (n - 1) % BS], monkeypatch)
            return
        t = self._rint(1, 2 * BS + 1) if op >= 8 else 1
        need = -(-(n + t) // BS) - len(blocks)
        if need > len(self.free):
            return
        for _ in range(need):
            blocks.append(self.free.pop(self._rint(0, len(self.free))))
        positions = list(range(n, n + t))
        if op == 5 and t == 1 and (n + 1) // BS == n // BS:  # one row ahead of its turn, then its turn
            positions = [n + 1, n] if (n + 2) <= len(blocks) * BS else positions
        for chunk in ([positions] if op != 5 else [[p] for p in positions]):
            self._write([blocks[p // BS] * BS + p % BS for p in chunk], monkeypatch)
        s[1] = n + len(positions)

    def check(self, monkeypatch):
        a, b = self.sums["torch"], self.sums["fused"]
        assert torch.equal(a.fill, b.fill)
        torch.testing.assert_close(b.sum, a.sum, rtol=0, atol=0, equal_nan=True)
        if not self.seqs:
            return
        M = max(len(s[0]) for s in self.seqs) + 1
        table = torch.full((len(self.seqs), M), -1, dtype=torch.int32)
        for i, (blocks, _) in enumerate(self.seqs):
            table[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        lens = torch.tensor([s[1] for s in self.seqs], dtype=self.slot_dtype)
        means = {}
        for path, vs in self.sums.items():
            monkeypatch.setattr(value_sum, "FUSED_CPU", path == "fused")
            means[path] = vs.mean(table, lens, self.vc)
        for i, (blocks, n) in enumerate(self.seqs):
            want = _oracle_mean(self.vc, self.lay, blocks, n)
            for path in means:
                torch.testing.assert_close(means[path][i].double(), want, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{path} path, request {i} (n={n}): {m}")


@pytest.mark.parametrize("layout", ["NHD", "HND", "VLLM"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_fused_sums_equal_the_torch_path_and_means_the_oracle(layout, dtype, slot_dtype, monkeypatch):
    h = _History(layout, dtype, slot_dtype, seed=hash((layout, str(dtype), str(slot_dtype))) % 1000)
    for _ in range(120):
        h.step(monkeypatch)
        h.check(monkeypatch)


def test_a_plain_append_on_the_cpu_never_reaches_the_torch_path(monkeypatch):
    """The fast path is taken (else the comparison above would be torch against torch)."""
    monkeypatch.setattr(value_sum, "FUSED_CPU", True)

    def torch_path(*args, **kwargs):
        raise AssertionError("the torch path ran")

    monkeypatch.setattr(value_sum, "_check_slots", torch_path)
    monkeypatch.setattr(value_sum, "paged_value_mean", torch_path)
    kc, vc, lay = _caches("VLLM", torch.bfloat16)
    vs = PagedValueSum(NB, BS, H, D, kv_layout=lay)
    rows, slots = torch.randn(BS + 3, H, D), torch.arange(BS + 3, dtype=torch.int32) + 2 * BS
    vs.update(vc, rows, slots)
    write_kv(kc, vc, rows, rows, slots, lay)
    table = torch.tensor([[2, 3]], dtype=torch.int32)
    got = vs.mean(table, torch.tensor([BS + 3]), vc)
    want = torch.cat([vc[2], vc[3, :, :3]], 1).double().mean(1)
    torch.testing.assert_close(got[0].double(), want, rtol=1e-5, atol=1e-5)


def test_bad_values_get_the_torch_paths_errors(monkeypatch):
    monkeypatch.setattr(value_sum, "FUSED_CPU", True)
    vs = PagedValueSum(NB, BS, H, D, kv_layout="NHD")
    vc = torch.zeros(NB, BS, H, D)
    before = vs.sum.clone(), vs.fill.clone()
    with pytest.raises(ValueError, match="slot_mapping values must be <"):
        vs.update(vc, torch.ones(2, H, D), torch.tensor([0, NB * BS]))
    with pytest.raises(ValueError, match="slot twice"):
        vs.update(vc, torch.ones(2, H, D), torch.tensor([5, 5]))
    assert torch.equal(vs.sum, before[0]) and torch.equal(vs.fill, before[1])  # nothing half-applied
    with pytest.raises(ValueError, match="seq_lens values must lie in"):
        vs.mean(torch.tensor([[0]], dtype=torch.int32), torch.tensor([BS + 1]), vc)
    with pytest.raises(ValueError, match="block_table"):
        vs.mean(torch.tensor([[NB]], dtype=torch.int32), torch.tensor([1]), vc)


@pytest.mark.parametrize("fused", [True, False])
def test_a_sum_held_as_a_view_stays_the_state(fused, monkeypatch):
    """A caller's strided view as ``sum`` is never swapped for a copy: the fused path leaves
    such a state to the torch path, which updates it in place."""
    monkeypatch.setattr(value_sum, "FUSED_CPU", fused)
    kc, vc, lay = _caches("NHD", torch.float32)
    vs = PagedValueSum(NB, BS, H, D, kv_layout=lay)
    buf = torch.zeros(2 * NB, H, D)
    vs.sum = buf[::2]
    assert vs._fused(vc) is None
    rows, slots = torch.ones(3, H, D), torch.tensor([0, 1, 2])
    vs.update(vc, rows, slots)
    write_kv(kc, vc, rows, rows, slots, lay)
    vs.mean(torch.tensor([[0]], dtype=torch.int32), torch.tensor([3]), vc)
    assert vs.sum.data_ptr() == buf.data_ptr() and torch.equal(buf[0], torch.full((H, D), 3.0))


def test_a_state_of_another_dtype_is_not_handed_to_the_compiled_pass():
    vc = torch.zeros(NB, BS, H, D)
    for name, bad in (("sum", lambda vs: vs.sum.double()), ("fill", lambda vs: vs.fill.int())):
        vs = PagedValueSum(NB, BS, H, D, kv_layout="NHD")
        setattr(vs, name, bad(vs))
        assert vs._fused(vc) is None, name
