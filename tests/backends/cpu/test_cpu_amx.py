"""The CPU kernel's AMX paths and vLLM's AMX cache layout, against the float64 oracle.

- the ``amx`` SIMD level's bfloat16 scores (tile loads of 16 rows with their stride, copies
  of irregular or partial groups, groups of up to 16 heads, other head_dims and groups
  falling back to the avx512bf16 scores): a fuzz over GQA groups, head_dims, layouts, block
  sizes and lengths;
- ``kv_layout="VLLM_AMX"`` on every SIMD level (native tile scores and in-place P.V on the
  AVX-512 levels, unpacked rows elsewhere), with NaN in every slot no sequence uses, split-KV
  forced, VMC computed from the packed rows.

The amx level runs only where the CPU has AMX-BF16 and Linux grants the tile state; elsewhere
those cases skip with the kernel's reason. The packed layout runs on every machine.
"""

import math

import numpy as np
import pytest
import torch

from topth_ops.backends import cpu as cpu_backend
from topth_ops.conformance.compare import TOLERANCES
from topth_ops.conformance.oracle import oracle_decode
from topth_ops.contract import make_inputs
from topth_ops.paged import to_paged
from topth_ops.registry import get_backend

BACKEND = get_backend("cpu")
LEVELS = cpu_backend.cpu_module().simd_levels()
AMX_REASON = cpu_backend.cpu_module().amx_unavailable_reason()


def _run(kw):
    inputs = make_inputs(**kw, return_stats=True)
    out, stats = inputs.empty_outputs(fill=float("nan"))
    BACKEND.forward(inputs, out, stats)
    return out, stats, dict(BACKEND.last_counters)


def _check(kw, out, stats):
    want = oracle_decode(**kw)
    tol = TOLERANCES[torch.bfloat16]
    got = out.float().numpy()
    assert np.isfinite(got).all()
    assert np.allclose(got, want.out, atol=tol["atol"], rtol=tol["rtol"]), float(np.abs(got - want.out).max())
    np.testing.assert_array_equal(stats.kept.numpy(), want.kept)
    np.testing.assert_array_equal(stats.v_rows.numpy(), want.v_rows)


def _case(gen, B, hq, hkv, d, S, placement, selection, vmc=False):
    q = torch.randn(B, hq, d, generator=gen).bfloat16()
    k = torch.randn(B, hkv, S, d, generator=gen).bfloat16()
    v = torch.randn(B, hkv, S, d, generator=gen).bfloat16()
    lens = torch.randint(1, S + 1, (B,), generator=gen)
    lens[0] = S
    heads = hkv if selection == "group" else hq
    if placement == "pre_softmax":
        th = torch.rand(heads, S, generator=gen) * 0.6  # scores ~ N(0, 1): keeps about 30-50 %
    else:
        th = torch.rand(heads, S, generator=gen) * 2.0 / torch.arange(1, S + 1)  # around 1 / n
    return dict(query=q, key_cache=k, value_cache=v, seq_lens=lens, thresholds=th, scale=1 / math.sqrt(d),
                placement=placement, selection=selection, vmc=vmc)


# (batch, q heads, kv heads, head_dim, max_seq_len): groups 1 .. 16 (AMX tiles), 17 (fallback),
# head_dims 32 .. 256 and 80 / 96 (not a multiple of 32 / a multiple: fallback / tiles)
AMX_SHAPES = [(2, 3, 1, 64, 300), (3, 32, 8, 128, 257), (1, 16, 1, 64, 70), (2, 4, 4, 96, 130),
              (2, 34, 2, 64, 90), (1, 8, 1, 256, 129), (2, 6, 2, 80, 100), (4, 2, 2, 32, 17)]


@pytest.mark.skipif(bool(AMX_REASON), reason=f"amx level unavailable here: {AMX_REASON}")
@pytest.mark.parametrize("shape", AMX_SHAPES, ids=["x".join(map(str, s)) for s in AMX_SHAPES])
@pytest.mark.parametrize("layout", [None, ("NHD", 16), ("HND", 32), ("NHD", 7), ("HND", 100)])
def test_amx_scores_fuzz(shape, layout, monkeypatch):
    monkeypatch.setenv(cpu_backend.ENV_SIMD, "amx")
    gen = torch.Generator().manual_seed(hash((shape, layout)) % 2**31)
    for i, (placement, selection) in enumerate((("pre_softmax", "head"), ("post_softmax", "group"))):
        kw = _case(gen, *shape, placement, selection)
        if layout is not None:
            k, v, table = to_paged(kw["key_cache"], kw["value_cache"], kw["seq_lens"], layout[1],
                                   kv_layout=layout[0], generator=gen, fill=float("nan"))
            kw.update(key_cache=k, value_cache=v, block_table=table, kv_layout=layout[0])
        for split in ("0", "45"):
            monkeypatch.setenv(cpu_backend.ENV_SPLIT, split)
            out, stats, c = _run(kw)
            assert c["simd"] == "amx"
            _check(kw, out, stats)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("d,bs,heads", [(64, 32, (9, 3)), (128, 128, (32, 8)), (64, 64, (16, 1)), (32, 32, (2, 2))])
def test_vllm_amx_layout_every_level(level, d, bs, heads, monkeypatch):
    monkeypatch.setenv(cpu_backend.ENV_SIMD, level)
    gen = torch.Generator().manual_seed(d * 1000 + bs)
    for placement, selection, vmc in (("pre_softmax", "group", True), ("post_softmax", "head", False),
                                      ("pre_softmax", "head", False)):
        kw = _case(gen, 3, heads[0], heads[1], d, 300, placement, selection, vmc=vmc)
        k, v, table = to_paged(kw["key_cache"], kw["value_cache"], kw["seq_lens"], bs, kv_layout="VLLM_AMX",
                               generator=gen, fill=float("nan"), num_blocks=3 * (300 // bs + 1) + 4)
        kw.update(key_cache=k, value_cache=v, block_table=table, kv_layout="VLLM_AMX")
        for split in ("0", "70"):
            monkeypatch.setenv(cpu_backend.ENV_SPLIT, split)
            out, stats, c = _run(kw)
            assert c["simd"] == level
            _check(kw, out, stats)


def test_amx_level_reason_and_info():
    """The amx level is listed exactly when the kernel says it can run, and info names why not."""
    from topth_ops.info import format_info

    mod = cpu_backend.cpu_module()
    assert ("amx" in mod.simd_levels()) == (AMX_REASON == "")
    if AMX_REASON:
        assert AMX_REASON in format_info()


@pytest.mark.parametrize("batch,lens,grouped", [(1, 500, False), (8, 6000, True)])
def test_nhd_units_keep_every_thread_busy(batch, lens, grouped, monkeypatch):
    """Paged NHD groups the items of all KV heads of a range into one unit only when that leaves
    at least two units per thread: a single short sequence keeps one item per KV head."""
    monkeypatch.setenv(cpu_backend.ENV_PARALLEL, "pool")
    gen = torch.Generator().manual_seed(batch)
    kw = _case(gen, batch, 32, 8, 128, lens, "pre_softmax", "group")
    kw["seq_lens"] = torch.full((batch,), lens)
    k, v, table = to_paged(kw["key_cache"], kw["value_cache"], kw["seq_lens"], 16, kv_layout="NHD", generator=gen)
    kw.update(key_cache=k, value_cache=v, block_table=table, kv_layout="NHD")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out, stats, c = _run(kw)
    finally:
        torch.set_num_threads(threads)
    assert c["threads"] == 2
    assert c["units"] >= 4
    if grouped:
        assert c["units"] * 8 == c["items"]  # every unit holds the 8 KV heads of one range
    else:
        assert c["units"] == c["items"]
    if batch == 1:
        _check(kw, out, stats)
