"""The ``cpu`` kernel on caches whose K is stored transposed per block (vLLM's CPU cache for
its vector ISAs: one region per block and KV head, K as ``[head_dim, block_size]`` then V as
rows; passed as ``"HND"`` views with K strides (slot 1, dim block_size)). That layout has its
own scores stage (``scores_kt``: avx512_kt.cpp, avx512bf16_kt.cpp, stages_portable.inc).
Fuzzed against the float64 oracle over SIMD levels, dtypes, GQA groups, head dims, block sizes (powers of two or
not), ragged lengths with partial last blocks, both placements and selections, VMC and forced
split-KV; the region around each block's used slots is NaN, so a read past a segment shows."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from topth_ops.backends import cpu as cpu_backend
from topth_ops.conformance.cases import Shape, paged_case, random_case, vllm_vec_case
from topth_ops.conformance.compare import TOLERANCES, exact_report, mismatch_report, to_numpy

from .env_run import run_with_env

LEVELS = cpu_backend.cpu_module().simd_levels()


@st.composite
def calls(draw):
    num_kv = draw(st.integers(1, 3))
    group = draw(st.integers(1, 9))
    head_dim = draw(st.sampled_from([16, 40, 64, 80, 128, 256]))
    block = draw(st.sampled_from([7, 16, 24, 32, 48, 100, 128]))
    max_seq = draw(st.integers(1, 500))
    lens = draw(st.lists(st.integers(0, max_seq), min_size=1, max_size=3))
    placement = draw(st.sampled_from(["pre_softmax", "post_softmax"]))
    return dict(shape=Shape(tuple(lens), num_kv * group, num_kv, head_dim, max_seq), block=block,
                dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])), placement=placement,
                selection=draw(st.sampled_from(["head", "group"])), vmc=draw(st.booleans()),
                level=draw(st.sampled_from(LEVELS)), split=draw(st.sampled_from(["0", "1", "7", "40"])),
                keep_lo=draw(st.floats(0.0, 0.9)), seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls())
def test_transposed_key_cache_matches_oracle(c):
    base = random_case("kt", c["shape"], c["dtype"], placement=c["placement"], selection=c["selection"],
                       vmc=c["vmc"], keep_range=(c["keep_lo"], min(1.0, c["keep_lo"] + 0.1)), seed=c["seed"])
    case = vllm_vec_case(paged_case(base, c["block"], "HND", seed=c["seed"] % 1000))
    kw = case.kwargs
    assert kw["key_cache"].stride(2) == 1 and kw["key_cache"].stride(3) == c["block"]
    out, stats, counters = run_with_env(kw, {cpu_backend.ENV_SIMD: c["level"], cpu_backend.ENV_SPLIT: c["split"]})
    assert counters["simd"] == c["level"]
    want = case.oracle()
    rep, _ = mismatch_report("out", to_numpy(out), want.out, **TOLERANCES[c["dtype"]])
    assert rep is None, rep
    ok = ~want.nonfinite.any(-1)
    assert exact_report("kept", to_numpy(stats.kept)[ok], want.kept[ok]) is None
    assert exact_report("v_rows", to_numpy(stats.v_rows), want.v_rows) is None
    assert counters["k_rows"] == sum(c["shape"].seq_lens) * c["shape"].num_kv_heads


def test_transposed_key_cache_keeps_what_the_rows_layout_keeps():
    """The same call on the HND rows layout and on the transposed-K layout: equal kept sets and
    V-row counts, outputs within float32 summation-order differences."""
    base = random_case("kt_rows", Shape((333, 128, 1, 0), 8, 2, 128, 400), torch.bfloat16,
                       placement="post_softmax", selection="group", vmc=True, seed=9)
    rows = paged_case(base, 128, "HND", seed=2)
    kt = vllm_vec_case(rows)
    a = run_with_env(rows.kwargs, {})
    b = run_with_env(kt.kwargs, {})
    np.testing.assert_array_equal(a[1].kept.numpy(), b[1].kept.numpy())
    np.testing.assert_array_equal(a[1].v_rows.numpy(), b[1].v_rows.numpy())
    np.testing.assert_allclose(a[0].float().numpy(), b[0].float().numpy(), atol=2e-2, rtol=2e-2)


BF16_LEVELS = [lv for lv in ("avx512bf16", "amx") if lv in LEVELS]


@pytest.mark.skipif(not BF16_LEVELS, reason="the CPU has neither AVX512-BF16 nor AMX: their bfloat16 "
                                             "transposed-K stage (avx512bf16_kt.cpp) cannot run here")
@pytest.mark.parametrize("head_dim", [2, 33, 64, 80, 127, 128, 256])
@pytest.mark.parametrize("block", [7, 32, 100, 128])
def test_bfloat16_pairs_stage_matches_oracle(head_dim, block):
    """The avx512bf16 / amx levels' transposed-K stage (pairs of head_dim rows per vdpbf16ps) on
    bfloat16 caches: odd head_dims (the last row is paired with zeros; here the row after it is
    NaN, as are the unused slots of each block), segments shorter than a chunk and ragged last
    blocks, head blocks of 1-4 heads alone and after a block of 4 (groups 1-4, 6, 7), against the
    float64 oracle."""
    for i, level in enumerate(BF16_LEVELS):
        for group in (1, 2, 3, 4, 6, 7):
            base = random_case("kt_bf16", Shape((1, 31, 64, 333), 2 * group, 2, head_dim, 333), torch.bfloat16,
                               placement="post_softmax", selection="head", vmc=False, keep_range=(0.3, 0.5),
                               seed=head_dim * 131 + block * 7 + group + i)
            case = paged_case(base, block, "HND", seed=block)
            kw = dict(case.kwargs)
            k = kw["key_cache"]
            nb, hkv, bs, d = k.shape
            buf = torch.full((nb, hkv, d + 1, bs), float("nan"), dtype=k.dtype)  # a NaN row after K's last
            buf[:, :, :d].copy_(k.transpose(2, 3))
            kw["key_cache"] = buf[:, :, :d].transpose(2, 3)
            out, stats, counters = run_with_env(kw, {cpu_backend.ENV_SIMD: level})
            assert counters["simd"] == level
            want = case.oracle()
            rep, _ = mismatch_report("out", to_numpy(out), want.out, **TOLERANCES[torch.bfloat16])
            assert rep is None, f"{level} G {group}: {rep}"
            assert exact_report("v_rows", to_numpy(stats.v_rows), want.v_rows) is None
