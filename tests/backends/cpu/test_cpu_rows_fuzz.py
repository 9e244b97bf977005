"""The ``cpu`` kernel on the row layouts (BNSD, paged NHD and HND, and a strided head_dim),
fuzzed against the float64 oracle on every SIMD level of this machine: dtypes, GQA groups
of 1 to 20 query heads (the levels' head blocks of 1-4, and groups past 16 that bfloat16
direct scores do not take), head dims that are and are not multiples of 16 (direct and tile
paths), block sizes (powers of two or not), ragged lengths with NaN past them, both
placements and selections, exact SDC, VMC and forced split-KV. Each level's stages are
hand-written per instruction set (avx2_*.cpp, avx512_*.cpp) or portable
(stages_portable.inc): this is the check that they all meet the same semantics."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from topth_ops.backends import cpu as cpu_backend
from topth_ops.conformance.cases import Shape, paged_case, random_case
from topth_ops.conformance.compare import TOLERANCES, exact_report, mismatch_report, to_numpy

from .env_run import run_with_env

LEVELS = cpu_backend.cpu_module().simd_levels()


def _strided_head_dim(case):
    """The same BNSD call with K and V as views whose head_dim is not contiguous."""
    kw = dict(case.kwargs)
    for name in ("key_cache", "value_cache"):
        t = kw[name]
        wide = torch.full((*t.shape[:-1], 2 * t.shape[-1]), float("nan"), dtype=t.dtype)
        wide[..., ::2] = t
        kw[name] = wide[..., ::2]
        assert kw[name].stride(-1) == 2
    return kw


@st.composite
def calls(draw):
    num_kv = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 17, 20]))
    head_dim = draw(st.sampled_from([8, 16, 24, 40, 64, 96, 128, 256]))
    max_seq = draw(st.integers(1, 400))
    lens = draw(st.lists(st.integers(0, max_seq), min_size=1, max_size=3))
    placement = draw(st.sampled_from(["pre_softmax", "post_softmax"]))
    return dict(shape=Shape(tuple(lens), num_kv * group, num_kv, head_dim, max_seq),
                layout=draw(st.sampled_from(["BNSD", "BNSD-strided", "NHD", "HND"])),
                block=draw(st.sampled_from([5, 16, 32, 48, 128])),
                dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])), placement=placement,
                selection=draw(st.sampled_from(["head", "group"])), vmc=draw(st.booleans()),
                sdc=draw(st.sampled_from(["none", "exact"])) if placement == "pre_softmax" else "none",
                level=draw(st.sampled_from(LEVELS)), split=draw(st.sampled_from(["0", "1", "7", "40"])),
                keep_lo=draw(st.floats(0.0, 0.95)), seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls())
def test_row_layouts_match_oracle_on_every_level(c):
    case = random_case("rows", c["shape"], c["dtype"], placement=c["placement"], selection=c["selection"],
                       vmc=c["vmc"], sdc=c["sdc"], keep_range=(c["keep_lo"], min(1.0, c["keep_lo"] + 0.05)),
                       seed=c["seed"])
    if c["layout"] in ("NHD", "HND"):
        kw = paged_case(case, c["block"], c["layout"], seed=c["seed"] % 1000).kwargs
    elif c["layout"] == "BNSD-strided":
        kw = _strided_head_dim(case)
    else:
        kw = case.kwargs
    out, stats, counters = run_with_env(kw, {cpu_backend.ENV_SIMD: c["level"], cpu_backend.ENV_SPLIT: c["split"]})
    assert counters["simd"] == c["level"]
    want = case.oracle()
    rep, _ = mismatch_report("out", to_numpy(out), want.out, **TOLERANCES[c["dtype"]])
    assert rep is None, rep
    ok = ~want.nonfinite.any(-1)
    assert exact_report("kept", to_numpy(stats.kept)[ok], want.kept[ok]) is None
    assert exact_report("v_rows", to_numpy(stats.v_rows), want.v_rows) is None
    assert counters["k_rows"] == sum(c["shape"].seq_lens) * c["shape"].num_kv_heads
