"""The compiled CPU kernel (backend ``cpu``), beyond the conformance suite (tests/conformance
runs every rule on it, in every dtype, with its default SIMD level and split plan).

Checked here: every SIMD level of this machine (``TOPTH_CPU_SIMD``) and forced split-KV
plans (``TOPTH_CPU_SPLIT_LEN``, both placements, paged, group selection) against the
float64 oracle; that V rows kept by no head of a group are never read (NaN there changes
nothing) and that the kernel's row counters equal the kept-union count exactly; thread
counts; a forked child; the output rounding to float16 / bfloat16; the knobs' errors; and
the fallback to ``torch`` when the extension is missing.

The extension is built by the package install; without it these tests fail (they never
skip: the kernel needs no special hardware).
"""

import os
import time

import numpy as np
import pytest
import torch

import topth_ops
from topth_ops.conformance.oracle import oracle_decode
from topth_ops.info import format_info
from topth_ops.backends import cpu as cpu_backend
from topth_ops.conformance import run_rule
from topth_ops.conformance.cases import Shape, paged_case, random_case
from topth_ops.conformance.compare import TOLERANCES
from topth_ops.contract import make_inputs
from topth_ops.registry import get_backend, priority, select_backend

BACKEND = get_backend("cpu")
LEVELS = cpu_backend.cpu_module().simd_levels()


def _run(kw, **extra):
    inputs = make_inputs(**kw, return_stats=True, **extra)
    out, stats = inputs.empty_outputs(fill=float("nan"))
    BACKEND.forward(inputs, out, stats)
    return inputs, out, stats, dict(BACKEND.last_counters)


def _assert_matches_oracle(kw, out, stats, dtype):
    want = oracle_decode(**kw)
    tol = TOLERANCES[dtype]
    ok = ~want.nonfinite
    got = out.float().numpy()
    assert np.allclose(got[ok], want.out[ok], atol=tol["atol"], rtol=tol["rtol"]), \
        float(np.abs(got[ok] - want.out[ok]).max())
    np.testing.assert_array_equal(stats.kept.numpy()[ok.all(-1)], want.kept[ok.all(-1)])
    np.testing.assert_array_equal(stats.v_rows.numpy(), want.v_rows)


def _kept_union(kw) -> torch.Tensor:
    """[B, Hkv, S] bool: positions some head of the group keeps, in float64 (2-D thresholds)."""
    q, k = kw["query"].double(), kw["key_cache"].double()
    B, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = kw["scale"] if kw["scale"] is not None else D ** -0.5
    a = scale * torch.einsum("bkgd,bksd->bkgs", q.view(B, Hkv, G, D), k)  # [B, Hkv, G, S]
    n = kw["seq_lens"].long()
    valid = (torch.arange(S)[None, :] < n[:, None])[:, None, None, :]
    a = a.masked_fill(~valid, float("-inf"))
    th = kw["thresholds"].double()[:, (n.clamp(min=1, max=kw["thresholds"].shape[-1]) - 1)]  # [H, B]
    if kw["placement"] == "post_softmax":
        a = a - torch.logsumexp(a, dim=-1, keepdim=True)
        th = th.log()
    if kw.get("selection", "head") == "group":
        return (a.amax(2) > th.T[:, :, None]) & valid[:, :, 0]
    return ((a > th.T.reshape(B, Hkv, G, 1)) & valid).any(2)


def test_first_on_the_cpu_and_shows_level_and_threads():
    assert priority("cpu")[0] == "cpu"
    case = random_case("sel", Shape((5, 9), 4, 2, 64, 12), torch.float32, placement="pre_softmax", seed=1)
    assert select_backend(make_inputs(**case.kwargs)).name == "cpu"
    text = format_info()
    line = next(ln for ln in text.splitlines() if ln.startswith("cpu "))
    assert f"SIMD {cpu_backend.simd_level()}" in line and f"{torch.get_num_threads()} threads" in line


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("rule", ["pre_softmax", "post_softmax", "sdc_exact", "vmc_computed_mean", "group_selection",
                                  "paged_equivalence", "nan_propagation", "strict_tie", "strided_small_inputs"])
def test_every_simd_level(level, rule, monkeypatch):
    monkeypatch.setenv(cpu_backend.ENV_SIMD, level)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        res = run_rule(BACKEND, rule, dtype, device=torch.device("cpu"), shape_set="quick")
        assert res.status == "pass", res.report()
        assert BACKEND.last_counters["simd"] == level


@pytest.mark.parametrize("split", [1, 7, 64])
@pytest.mark.parametrize("rule", ["pre_softmax", "post_softmax", "sdc_exact", "sdc_exp_threshold", "vmc_computed_mean",
                                  "group_selection", "threshold_sets", "paged_equivalence", "nan_propagation",
                                  "nothing_kept", "dense_equivalence"])
def test_forced_split_kv(split, rule, monkeypatch):
    """Every length cut into splits of `split` positions (post_softmax then runs two phases)."""
    monkeypatch.setenv(cpu_backend.ENV_SPLIT, str(split))
    res = run_rule(BACKEND, rule, torch.float32, device=torch.device("cpu"), shape_set="quick")
    assert res.status == "pass", res.report()
    assert BACKEND.last_counters["splits_max"] > 1


@pytest.mark.parametrize("parallel", ["auto", "pool"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts(threads, parallel, monkeypatch):
    """Both thread runtimes: torch's OpenMP team (auto, when its runtime is loaded, as with
    torch's wheels) and the kernel's own pool."""
    monkeypatch.setenv(cpu_backend.ENV_PARALLEL, parallel)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        case = random_case("threads", Shape((3000, 1, 0, 777), 9, 3, 64, 3000), torch.bfloat16,
                           placement="post_softmax", vmc=True, seed=5)
        _, out, stats, c = _run(case.kwargs)
    finally:
        torch.set_num_threads(old)
    assert c["threads"] == (threads if threads > 1 else 1)
    if threads > 1:
        openmp = bool(cpu_backend.cpu_module().openmp_runtime())
        assert c["runtime"] == ("openmp" if parallel == "auto" and openmp else "pool")
    _assert_matches_oracle(case.kwargs, out, stats, torch.bfloat16)


def test_runs_on_torchs_openmp_runtime():
    """torch's wheels load their own libgomp; the kernel finds it and runs on torch's team."""
    rt = cpu_backend.cpu_module().openmp_runtime()
    assert "omp" in rt and os.path.exists(rt)
    assert "OpenMP team" in cpu_backend.threads_line()


@pytest.mark.parametrize("placement", ["pre_softmax", "post_softmax"])
@pytest.mark.parametrize("selection", ["head", "group"])
@pytest.mark.parametrize("layout", [None, "NHD", "HND"])
def test_unkept_v_rows_never_read(placement, selection, layout, monkeypatch):
    """NaN in every V row that no head of its group keeps: the output stays finite, and the
    kernel's V-row counter equals the kept-union count (stats.v_rows and the oracle's)."""
    monkeypatch.setenv(cpu_backend.ENV_SPLIT, "40")  # several splits per sequence too
    shape = Shape((300, 97, 1, 0), 8, 2, 64, 300)
    case = random_case("unkept", shape, torch.float16, placement=placement, selection=selection,
                       keep_range=(0.05, 0.3), seed=11)
    kw = case.kwargs
    want = case.oracle()
    kept_union = _kept_union(kw)
    assert int(kept_union.sum()) == int(want.v_rows.sum())  # the helper agrees with the oracle
    kw["value_cache"][~kept_union] = float("nan")
    if layout is not None:
        kw = paged_case(case, 16, layout, seed=3).kwargs
    _, out, stats, c = _run(kw)
    assert torch.isfinite(out).all()
    assert c["v_rows"] == int(want.v_rows.sum()) == int(stats.v_rows.sum())
    assert c["k_rows"] == sum(shape.seq_lens) * shape.num_kv_heads
    assert c["v_mean_rows"] == 0
    _assert_matches_oracle(kw, out, stats, torch.float16)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", [None, "NHD"])
@pytest.mark.parametrize("heads,keep", [((8, 2), (0.1, 0.2)), ((16, 2), (0.08, 0.15))])  # G = 8: bf16 tile path
def test_scattered_kept_rows_in_strided_order(level, dtype, layout, heads, keep, monkeypatch):
    """Long scattered kept lists (>= 256 rows, at most 3/4 of the range) take the P.V stage's
    strided visiting order (avx512_pv.cpp, visit_stride): every kept row exactly once, no
    unkept row (NaN there), the same result as the float64 oracle; BNSD and paged with an odd
    block size, one item per sequence (no split) and split-KV, GQA groups of 4 (rows read in
    place) and 8 (bfloat16: the tile path)."""
    monkeypatch.setenv(cpu_backend.ENV_SIMD, level)
    shape = Shape((4000, 2999), heads[0], heads[1], 64, 4000)
    case = random_case("scattered", shape, dtype, placement="pre_softmax", keep_range=keep, seed=5)
    kw = case.kwargs
    kept_union = _kept_union(kw)
    per_group = kept_union.sum(-1)  # [B, Hkv]
    lens = torch.tensor(shape.seq_lens)[:, None]
    assert bool((per_group >= 256).all()) and bool((4 * per_group <= 3 * lens).all())  # the strided path
    kw["value_cache"][~kept_union] = float("nan")
    if layout is not None:
        kw = paged_case(case, 37, layout, seed=4).kwargs
    for split in ("0", "1500"):
        monkeypatch.setenv(cpu_backend.ENV_SPLIT, split)
        _, out, stats, c = _run(kw)
        assert c["simd"] == level
        assert torch.isfinite(out).all()
        assert c["v_rows"] == int(per_group.sum())
        _assert_matches_oracle(kw, out, stats, dtype)


def test_vmc_mean_counter():
    case = random_case("vmc", Shape((50, 0, 9), 4, 2, 64, 60), torch.float32, placement="pre_softmax",
                       vmc=True, seed=2)
    _, _, _, c = _run(case.kwargs)
    assert c["v_mean_rows"] == 59 * 2  # every valid V row once, for the mean
    case = random_case("vmc", Shape((50, 0, 9), 4, 2, 64, 60), torch.float32, placement="pre_softmax",
                       vmc=True, value_mean=True, seed=2)
    _, _, _, c = _run(case.kwargs)
    assert c["v_mean_rows"] == 0


def test_forked_child_runs_the_kernel():
    """The pool's threads do not survive fork(): a child must start its own, not deadlock.
    (The child calls only the kernel: torch's own OpenMP ops are not fork-safe.)"""
    case = random_case("fork", Shape((2000, 3), 8, 2, 64, 2000), torch.float32, placement="post_softmax", seed=4)
    inputs = make_inputs(**case.kwargs)
    out, _ = inputs.empty_outputs(fill=float("nan"))
    args = cpu_backend.kernel_args(inputs, out, None)
    mod = cpu_backend.cpu_module()
    assert mod.decode(args)["threads"] == torch.get_num_threads()  # the parent's pool has run
    if torch.get_num_threads() < 2:
        pytest.skip("torch runs one thread here: no pool to fork")
    expected = out.clone()
    out.fill_(float("nan"))
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            mod.decode(args)
            code = 0 if np.array_equal(out.numpy(), expected.numpy()) else 2
        finally:
            os._exit(code)
    for _ in range(600):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child did not finish the kernel call in 60 s (deadlock)")
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("dtype,code", [(torch.float16, 0), (torch.bfloat16, 1)])
def test_output_rounding_matches_torch(dtype, code):
    rng = np.random.default_rng(0)
    special = [0.0, -0.0, 1.0, 65504.0, 65519.99, 65520.0, 1e9, -1e9, 6.1e-5, 5.96e-8, 2.98e-8, 2.99e-8,
               1e-40, float("inf"), float("-inf"), 1.0009765625, 1.00048828125, 1.001464843750, 3.0e38]
    xs = np.concatenate([rng.standard_normal(4000) * 10.0 ** rng.integers(-9, 6, 4000), special]).astype(np.float32)
    got = torch.tensor(cpu_backend.cpu_module()._convert_out(xs.tolist(), code), dtype=torch.int32)
    want = torch.from_numpy(xs).to(dtype).view(torch.int16).to(torch.int32) & 0xFFFF
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    nan_bits = cpu_backend.cpu_module()._convert_out([float("nan")], code)[0]
    assert torch.tensor([nan_bits], dtype=torch.int32).to(torch.int16).view(dtype).isnan().all()


def test_knob_errors_make_the_backend_unavailable(monkeypatch):
    case = random_case("knob", Shape((5,), 4, 2, 64, 8), torch.float32, placement="pre_softmax", seed=1)
    for name, value in ((cpu_backend.ENV_SIMD, "sse9"), (cpu_backend.ENV_SPLIT, "-3"), (cpu_backend.ENV_SPLIT, "x"),
                        (cpu_backend.ENV_PARALLEL, "tbb")):
        monkeypatch.setenv(name, value)
        reasons = BACKEND.unavailable_reasons()
        assert any(name in r for r in reasons), reasons
        with pytest.raises(NotImplementedError, match=name):
            topth_ops.decode_attention(**case.kwargs, backend="cpu")
        assert select_backend(make_inputs(**case.kwargs)).name == "torch"
        monkeypatch.delenv(name)


def test_missing_extension_falls_back_to_torch(monkeypatch, caplog):
    def missing():
        raise ImportError("No module named 'topth_ops.cpu_kernels._topth_cpu'")

    monkeypatch.setattr(cpu_backend, "cpu_module", missing)
    reasons = BACKEND.unavailable_reasons()
    assert reasons and "not built" in reasons[0] and "C++17" in reasons[0]
    assert "unavailable" in format_info().split("\ncpu ")[1].splitlines()[0]
    case = random_case("fallback", Shape((5,), 4, 2, 64, 8), torch.float32, placement="pre_softmax", seed=1)
    with caplog.at_level("WARNING", logger="topth_ops"):
        assert select_backend(make_inputs(**case.kwargs)).name == "torch"
    out = topth_ops.decode_attention(**case.kwargs)
    assert torch.isfinite(out).all()


def test_unchecked_huge_lengths_clamp_without_wrap():
    """int64 lengths past int32 clamp to max_seq_len (1 << 32 would wrap to 0 through int32)."""
    case = random_case("clamp", Shape((40, 40), 4, 2, 64, 40), torch.float32, placement="pre_softmax", seed=6)
    kw = dict(case.kwargs)
    ref = _run(kw)[1]
    kw["seq_lens"] = torch.tensor([1 << 32, (1 << 40) + 5], dtype=torch.int64)
    inputs = make_inputs(**kw, return_stats=True, check_values=False)
    out, stats = inputs.empty_outputs(fill=float("nan"))
    BACKEND.forward(inputs, out, stats)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert os.environ.get(cpu_backend.ENV_SPLIT) is None
